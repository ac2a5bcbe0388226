"""Selective reduce studies: the parameter sweeps and the convergence comparison."""
