"""bfrt_python script: bring a Tofino running p4src/tna up for a job description.

Run the way Tofino operators run bfrt_python scripts, with the `bfrt` object in scope:

    $SDE/run_bfshell.sh -b /path/to/repo/bfrt_scripts/setup_switch.py
    bfshell -b /path/to/repo/bfrt_scripts/setup_switch.py

bfshell passes no arguments, so the script reads the job file that
`python -m bfrt_scripts.deploy` writes ($THC_INA_BFRT_JOB, default
/tmp/thc_ina_bfrt_job.json): the repository root (to import the project's validation and
plan), the SwitchConfig JSON, the deployment options and the mode:

    install     make the switch serve the description (idempotent: a second run writes
                nothing; what the switch holds beyond the description is deleted)
    remove      tear the deployment down (every entry of the program, its multicast
                groups, the jobs' registers and counters; drop reporting off)
    dry-run     print every write the install would make on this switch, write nothing
    counters    print the counters under the protocol's names (JSON), and save them to
                the job file's counters_out
"""
import json
import os
import sys

DEFAULT_JOB_FILE = "/tmp/thc_ina_bfrt_job.json"


def main(bfrt, job_file=None, out=print) -> int:
    path = job_file or os.environ.get("THC_INA_BFRT_JOB", DEFAULT_JOB_FILE)
    try:
        with open(path) as f:
            spec = json.load(f)
    except (OSError, ValueError) as exc:
        out(f"error: cannot read the job file {path} ({exc}); write it with "
            "python -m bfrt_scripts.deploy --config job.json --write-only")
        return 2
    root = spec["repo_root"]
    if root not in sys.path:
        sys.path.insert(0, root)
    from dataplane.config import ConfigError, SwitchConfig
    from bfrt_scripts.bfrt_controls import BfrtError, ThcInaSwitch
    from bfrt_scripts.tofino_plan import DeployOptions

    mode = spec.get("mode", "install")
    status = {"status": "error", "message": "did not finish"}
    try:
        config = SwitchConfig.from_dict(spec["config"])
        options = DeployOptions.from_dict(spec.get("options"))
        switch = ThcInaSwitch(bfrt, options, dry_run=(mode == "dry-run"), out=out,
                              verbose=bool(spec.get("verbose")))
        if mode == "counters":
            counters = switch.counters(switch.plan(config))
            text = json.dumps(counters, indent=1, sort_keys=True)
            if spec.get("counters_out"):
                with open(spec["counters_out"], "w") as f:
                    f.write(text)
            out(text)
        elif mode == "remove":
            switch.remove()
            out(switch.summary())
        else:
            switch.install(config)
            out(switch.summary())
        status = {"status": "ok", "message": switch.summary()}
    except (ConfigError, BfrtError) as exc:
        status = {"status": "error", "message": str(exc)}
        out(f"error: {exc}")
    except Exception as exc:    # anything else: still one line, and the wrapper's exit code
        status = {"status": "error", "message": f"{type(exc).__name__}: {exc} (mode {mode})"}
        out(f"error: {status['message']}")
    finally:
        # bfshell exits 0 whatever the script did: the wrapper reads this instead
        if spec.get("status_out"):
            with open(spec["status_out"], "w") as f:
                json.dump(status, f)
    return 0 if status["status"] == "ok" else 2


if "bfrt" in globals():         # run by bfshell -b: the bfrt object is in scope
    main(bfrt)  # noqa: F821
