"""Mininet testbed: N worker hosts + one aggregating switch (BMv2, DPDK or the reference
UDP service behind a Linux bridge). `python -m host.experiments.testbed --help`."""
from .network import (SWITCH_KINDS, Testbed, TestbedError, TestbedOptions, TestbedResult,
                      choose_switch, cleanup_interfaces, make_config, run_testbed,
                      switch_available)

__all__ = ["SWITCH_KINDS", "Testbed", "TestbedError", "TestbedOptions", "TestbedResult",
           "choose_switch", "cleanup_interfaces", "make_config", "run_testbed",
           "switch_available"]
