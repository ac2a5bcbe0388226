"""Workers on shaped links: an aggregator on a `host.netlab.topology.Topology` ("bridge" or
"ports" layout), and workers in its host namespaces. Shared by
host.experiments.bench_allreduce and host.experiments.main_job --link-mbit.

* `job_config`: the job description of a topology's hosts (worker w at host_ip(w),
  WORKER_UDP_PORT), with the packet size the hosts send;
* `start_reference`: the reference UDP service bound to the bridge in the switch
  namespace (in-network aggregation: its traffic crosses only the workers' links);
* `start_dpdk`: the DPDK switch on the bare switch ports of a layout="ports" topology
  (net_af_packet, qdisc_bypass=0 so the ports' shaping applies to its output too).

Stopping them: host.netlab.aggregators.stop; a worker process joins its namespace with
host.netlab.links.enter_netns before it opens anything.
"""
from __future__ import annotations

from pathlib import Path

from dataplane.wire import AGG_PORT_BASE
from dataplane.config import Job, Member, SwitchConfig
from dataplane.dpdk_runner import af_packet_vdevs
from host.netlab import aggregators

WORKER_UDP_PORT = 40000
AGG_PORT = AGG_PORT_BASE
GLOO_PORT = 29600


def job_config(tb, pool_size: int, job: int = 1, values_per_packet: int = 1024):
    members = [Member(worker=w, port=w, mac=tb.host_mac(w), ip=tb.host_ip(w),
                      udp_port=WORKER_UDP_PORT) for w in range(tb.num_hosts)]
    return SwitchConfig(ip=tb.switch_ip, mac=tb.switch_mac,
                        jobs=(Job.from_thc(job, pool_size, members,
                                           values_per_packet=values_per_packet),)).validate()


def start_reference(tb, config, workdir: Path):
    """The reference aggregator in the switch namespace at (tb.switch_ip, AGG_PORT)."""
    path = Path(workdir) / "switch.json"
    config.save(path)
    return aggregators.start_reference(tb.popen_switch, path, tb.switch_ip, AGG_PORT)


def start_dpdk(tb, config, workdir: Path, ring_frames: int = 1024):
    """thc_switch in the switch namespace, port w = worker w's link (af_packet).

    Its counters go to workdir/dpdk_stats.json when it stops."""
    # qdisc_bypass=0: the switch's transmissions go through the port's tbf (the link rate).
    # Jumbo-sized ring frames (16 KiB of locked memory each, per direction): 1024 hold four
    # windows of a 256-slot pool, room while the switch's lcore is descheduled on this
    # shared machine (512 lost packets at 1024 values per packet).
    vdevs = af_packet_vdevs([tb.switch_port(p) for p in range(tb.num_hosts)],
                            framecnt=ring_frames, qdisc_bypass=False)
    return aggregators.start_dpdk(tb.popen_switch, config, vdevs, workdir)
