"""Write the DPDK switch's configuration file from a SwitchConfig.

One description, two consumers: the reference aggregator reads the SwitchConfig
itself, the DPDK switch (dataplane/dpdk/) reads the line-oriented file written
here (format documented at the top of dataplane/dpdk/agg_config.c). The config is
validated first, with the DPDK switch's own limits, so a bad description fails
here with the same message the reference gives; the C parser checks again.

    python -m dataplane.dpdk_config job.json switch.conf
"""
from __future__ import annotations

import argparse
import ipaddress
from pathlib import Path

from dataplane.config import ConfigError, SwitchConfig

DPDK_MAX_SLOTS = 65536     # docs/protocol.md §8
DPDK_MAX_PORTS = 32        # AGG_MAX_PORTS in agg_core.h
DPDK_MAX_VALUES = 8192     # AGG_MAX_VALUES in agg_core.h


def render(config: SwitchConfig) -> str:
    """The config file's text for a validated SwitchConfig."""
    config.validate(max_slots=DPDK_MAX_SLOTS, max_values=DPDK_MAX_VALUES,
                    plane="the DPDK switch")
    for job in config.jobs:
        for m in job.members:
            if m.port >= DPDK_MAX_PORTS:
                raise ConfigError(f"job {job.job} worker {m.worker}: switch port {m.port} "
                                  f"exceeds the DPDK switch's {DPDK_MAX_PORTS} ports")
    for r in config.routes:
        for port, _ in r.next_hops:
            if not 0 <= port < DPDK_MAX_PORTS:
                raise ConfigError(f"route {r.prefix}: port {port} must be in "
                                  f"0..{DPDK_MAX_PORTS - 1}")

    lines = ["# THC-INA DPDK switch configuration (written by dataplane/dpdk_config.py)",
             f"switch {config.mac} {config.ip}",
             f"capacity {config.dlcp.capacity}"]
    lines += [f"threshold {q} {int(k)}" for q, k in enumerate(config.dlcp.thresholds)]
    # The whole map is written: the first 'dscp' line replaces the switch's default.
    dscp_map = dict(config.dlcp.dscp_map) or {0: (0, False)}
    lines += [f"dscp {d} {q} {int(bool(is_data))}" for d, (q, is_data) in sorted(dscp_map.items())]
    for job in config.jobs:
        lines.append(f"job {job.job} {job.pool_size} {job.values_per_packet} "
                     + " ".join(str(int(v)) for v in job.table))
        for m in sorted(job.members, key=lambda m: m.worker):
            lines.append(f"member {job.job} {m.worker} {m.port} {m.mac} {m.ip} {m.udp_port}")
    for r in config.routes:
        net = ipaddress.IPv4Network(r.prefix, strict=False)
        hops = " ".join(f"{port} {mac}" for port, mac in r.next_hops)
        lines.append(f"route {net.network_address}/{net.prefixlen} {hops}")
    return "\n".join(lines) + "\n"


def write_config(config: SwitchConfig, path: str | Path) -> Path:
    """Validate config and write the DPDK switch's file to path."""
    path = Path(path)
    path.write_text(render(config))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job_json", help="a SwitchConfig saved with SwitchConfig.save")
    ap.add_argument("out", help="the DPDK switch config file to write")
    args = ap.parse_args(argv)
    try:
        write_config(SwitchConfig.load(args.job_json), args.out)
    except ConfigError as exc:
        ap.exit(2, f"refusing the configuration: {exc}\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
