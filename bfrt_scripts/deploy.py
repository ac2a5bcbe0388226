"""Deploy a job description onto a Tofino running p4src/tna.

Checks the description against the program's limits first (a refusal names the limit and
what to lower, and nothing is written), writes the job file that
bfrt_scripts/setup_switch.py reads, and runs that script in bfshell:

    python -m bfrt_scripts.deploy --config job.json                  # install
    python -m bfrt_scripts.deploy --config job.json --dry-run        # print every write
    python -m bfrt_scripts.deploy --config job.json --counters       # protocol counters
    python -m bfrt_scripts.deploy --config job.json --remove         # tear the job down
    python -m bfrt_scripts.deploy --config job.json --plan           # entry counts, no SDE
    python -m bfrt_scripts.deploy --config job.json --write-only     # then run bfshell yourself

bfshell comes from --bfshell or $SDE/run_bfshell.sh. Without an SDE, --dry-run prints the
writes for a clean switch.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from dataplane.config import ConfigError, SwitchConfig
from bfrt_scripts.bfrt_controls import ThcInaSwitch
from bfrt_scripts.setup_switch import DEFAULT_JOB_FILE
from bfrt_scripts.tofino_plan import DEFAULT_PROGRAM, DeployOptions, plan_switch

REPO_ROOT = Path(__file__).resolve().parents[1]
SETUP_SCRIPT = Path(__file__).resolve().parent / "setup_switch.py"


def parse_port_map(text: str | None) -> tuple[tuple[int, int], ...]:
    """"0=128,1=136" -> ((0, 128), (1, 136)): protocol port -> Tofino dev_port."""
    if not text:
        return ()
    pairs = []
    for item in text.split(","):
        port, sep, dev = item.partition("=")
        if not sep:
            raise ConfigError(f"--port-map item {item!r}: write PORT=DEV_PORT")
        pairs.append((int(port), int(dev)))
    return tuple(pairs)


def options_from(args) -> DeployOptions:
    return DeployOptions(program=args.program, tofino=args.tofino,
                         port_map=parse_port_map(args.port_map), speed=args.speed, fec=args.fec,
                         add_ports=args.add_ports,
                         drop_report_ports=tuple(args.drop_report_port or ()),
                         dlcp_packet_bytes=args.dlcp_packet_bytes)


def write_job_file(path: Path, config: SwitchConfig, options: DeployOptions, mode: str,
                   verbose: bool = False) -> Path:
    """The file setup_switch.py reads (bfshell passes scripts no arguments); it reports
    back in <job file>.status.json (and .counters.json in counters mode)."""
    spec = {"repo_root": str(REPO_ROOT), "config": config.to_dict(),
            "options": options.to_dict(), "mode": mode, "verbose": verbose,
            "status_out": str(status_file(path)),
            "counters_out": str(path.with_suffix(".counters.json")) if mode == "counters"
            else None}
    path.write_text(json.dumps(spec, indent=1))
    return path


def status_file(job_file: Path) -> Path:
    return job_file.with_suffix(".status.json")


def bfshell_runner(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    sde = os.environ.get("SDE")
    if sde and Path(sde, "run_bfshell.sh").is_file():
        return str(Path(sde, "run_bfshell.sh"))
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bfrt_scripts.deploy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="SwitchConfig JSON (dataplane/config.py)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print every write, write nothing")
    mode.add_argument("--counters", action="store_true", help="print the protocol counters")
    mode.add_argument("--remove", action="store_true",
                      help="tear the deployment down: the program's entries, multicast "
                           "groups, the jobs' registers and counters, drop reporting")
    mode.add_argument("--plan", action="store_true",
                      help="print the entry counts per table and exit (no switch)")
    ap.add_argument("--write-only", action="store_true",
                    help="write the job file and print the bfshell command, run nothing")
    ap.add_argument("--job-file", default=os.environ.get("THC_INA_BFRT_JOB", DEFAULT_JOB_FILE),
                    help="where setup_switch.py reads the job (default %(default)s)")
    ap.add_argument("--bfshell", help="bfshell runner (default $SDE/run_bfshell.sh)")
    ap.add_argument("--program", default=DEFAULT_PROGRAM, help="P4 program name in bfrt")
    ap.add_argument("--tofino", type=int, choices=(1, 2), default=1)
    ap.add_argument("--port-map", help="protocol port -> dev_port, e.g. 0=128,1=136")
    ap.add_argument("--add-ports", action="store_true", help="bring the ports up (port.port)")
    ap.add_argument("--speed", default="BF_SPEED_100G")
    ap.add_argument("--fec", default="BF_FEC_TYP_NONE")
    ap.add_argument("--drop-report-port", type=int, action="append",
                    help="dev_port whose queue receives its pipe's deflected TM drops (DLCP "
                         "drop counters); once per pipe the description uses")
    ap.add_argument("--dlcp-packet-bytes", type=int,
                    help="frame size the DLCP packet limits are converted to cells with "
                         "(default: the largest RESULT of the description)")
    ap.add_argument("--verbose", action="store_true", help="print every write made")
    args = ap.parse_args(argv)
    try:
        return run(args)
    except Exception as exc:    # any step's failure: one line and the exit code
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    """Plan (refusing before anything is written), then the dry run, the job file or the
    bfshell run the arguments ask for; 0 when it worked, 2 with a one-line error if not."""
    try:
        config = SwitchConfig.load(args.config)
        options = options_from(args)
        plan = plan_switch(config, options)          # refuses before anything else
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.plan:
        for count, what in plan.summary():
            print(f"{count:6d}  {what}")
        return 0
    runner = bfshell_runner(args.bfshell)
    if args.dry_run and runner is None and not args.write_only:
        print("no SDE ($SDE/run_bfshell.sh): the writes for a clean switch", file=sys.stderr)
        switch = ThcInaSwitch(None, options, dry_run=True)
        switch.install(config)
        print(switch.summary())
        return 0
    job_mode = ("dry-run" if args.dry_run else "counters" if args.counters
                else "remove" if args.remove else "install")
    job_file = Path(args.job_file)
    write_job_file(job_file, config, options, job_mode, args.verbose)
    status_file(job_file).unlink(missing_ok=True)
    command = [runner or "$SDE/run_bfshell.sh", "-b", str(SETUP_SCRIPT)]
    if args.write_only or runner is None:
        print(f"job file: {job_file}")
        print("run:", f"THC_INA_BFRT_JOB={job_file}", " ".join(command))
        if runner is None and not args.write_only:
            print("error: no SDE: set $SDE or pass --bfshell", file=sys.stderr)
            return 2
        return 0
    env = dict(os.environ, THC_INA_BFRT_JOB=str(job_file))
    done = subprocess.run(command, env=env)
    try:
        status = json.loads(status_file(job_file).read_text())
    except (OSError, ValueError):
        status = {"status": "error",
                  "message": f"{' '.join(command)} exited with {done.returncode} and left no "
                             f"status in {status_file(job_file)} (did bfshell start?)"}
    if status["status"] != "ok":
        print(f"error: {status['message']}", file=sys.stderr)
        return 2
    if args.counters:
        print(job_file.with_suffix(".counters.json").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
