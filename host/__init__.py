"""host: the worker side of THC in-network aggregation, and the public API for training code.

    import host
    state = host.thc_hook_state(aggregator="127.0.0.1:50000", job=1)
    model.register_comm_hook(state, host.thc_hook)

Public API (`__all__`):
  PyTorch hook (host.ddp_hook)   thc_hook, thc_hook_state, THCHookState, allreduce_gradients,
                                 worker_job (the job handshake), JobMismatchError,
                                 ResumeWarning (hook state not restored on resume)
  FSDP2 (host.fsdp)              THCReduceScatter, thc_fully_shard_comm
  allreduce (host.allreduce)     THCAllreduce, AggregatorExchange, SumAllreduceExchange,
                                 AllreduceError, SizeMismatchError, RescueWaitWarning
                                 (a worker lacking sums waits long for the others)
  transport (host.transport)     AggregatorTransport, parse_address, TransportError,
                                 AggregatorUnreachable, AggregatorTimeout, StragglerNotice

Library modules and subpackages:
  host.ddp_hook, host.allreduce  DDP hook and THC allreduce over an aggregator or over
                                 dist.all_reduce
  host.fsdp                      THC as FSDP2's reduce-scatter
  host.transport                 one worker's side of the wire protocol (docs/protocol.md)
  host.datagram, host.native     batched UDP datagram I/O and the native (C) data path
  host.packets                   AGG packets: scapy layer and vectorized numpy codec
  host.dlcp                      DLCP host side: marking, bounded-loss transport, rate control
  host.adapcc                    AdapCC-style scheduling (docs/adapcc.md)
  host.selective_reduce          selective reduce and its simulator (docs/selective_reduce.md)
  host.netlab                    network namespaces, veth links, shaping, the Mininet testbed
Drivers (main job, benchmarks, studies, plots) live in host.experiments; no library module
imports it.

The public names load on first use (module __getattr__, from the modules named above):
they need torch, which takes seconds to import, and `import host.packets` or a helper
process such as host.dlcp.switchbox must not pay for it.
"""
from __future__ import annotations

import importlib

_SOURCE_MODULE = {
    "thc_hook": "host.ddp_hook",
    "thc_hook_state": "host.ddp_hook",
    "THCHookState": "host.ddp_hook",
    "allreduce_gradients": "host.ddp_hook",
    "worker_job": "host.ddp_hook",
    "JobMismatchError": "host.ddp_hook",
    "ResumeWarning": "host.ddp_hook",
    "THCReduceScatter": "host.fsdp",
    "thc_fully_shard_comm": "host.fsdp",
    "THCAllreduce": "host.allreduce",
    "AggregatorExchange": "host.allreduce",
    "SumAllreduceExchange": "host.allreduce",
    "AllreduceError": "host.allreduce",
    "SizeMismatchError": "host.allreduce",
    "RescueWaitWarning": "host.allreduce",
    "AggregatorTransport": "host.transport",
    "parse_address": "host.transport",
    "TransportError": "host.transport",
    "AggregatorUnreachable": "host.transport",
    "AggregatorTimeout": "host.transport",
    "StragglerNotice": "host.transport",
}

__all__ = list(_SOURCE_MODULE)


def __getattr__(name: str):
    """A public name, imported from its module on first use and kept here afterwards."""
    source = _SOURCE_MODULE.get(name)
    if source is None:
        raise AttributeError(f"module 'host' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
