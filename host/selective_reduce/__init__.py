"""Selective reduce: BAG, BPAWR, the controller, baselines and the simulator (docs/selective_reduce.md)."""
