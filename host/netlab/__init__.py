"""The network lab: namespaces, veth links, shaping, loss relays and the Mininet testbed.

What lives where:

* `links`: the building blocks (`sh`, namespaces, entering one with setns, quiet veth
  pairs and bridges with IPv6 off, MTU, tbf/netem shaping, offloads, teardown helpers);
* `topology`: `Topology`, the one namespace topology, in a "bridge", "ports" (bare switch
  ports for a data plane process) or "routed" (switch ports in the root namespace)
  layout; cleans up on exit, on error and on SIGTERM;
* `relay`: `LossyRelay`, a UDP relay with drop rules (seeded random loss, rules on AGG or
  DLCP headers), keeping the ToS byte;
* `aggregators`: starting and stopping the reference UDP service and the DPDK switch as
  processes (in a topology's switch namespace or on a Mininet host);
* `shaped_links`: workers and an aggregator on a shaped topology (bench_allreduce, main_job);
* `dlcp_probes`: probe traffic, capture and the docs/protocol.md §6 oracle for a live
  DLCP bottleneck on a routed topology;
* `testbed/`: the Mininet testbed (CLI: `python -m host.experiments.testbed`); its worker
  uses host.transport.AggregatorTransport.
"""
