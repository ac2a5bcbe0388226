"""The job layout plan both P4 control planes install: where each job of a description
lives inside a program's shared resources, and how counter cells read back become the
protocol's counter names (docs/protocol.md §3, §4.5).

Both P4 programs (p4src/v1model and p4src/tna) hold every job in the same shared
resources, so their planners (dataplane/bmv2/control.py, bfrt_scripts/tofino_plan.py)
share this plan and keep only their target's limits and table names:

* jobs get dense indices in job-id order; index i owns counter cells
  i * JOB_COUNTER_STRIDE .. + JOB_COUNTER_STRIDE - 1 and multicast group i + 1;
* job i's slots follow job i - 1's in the shared slot registers (slot_base);
* route r's next hops follow route r - 1's in the next-hop table (next_hop_bases);
* the global and DLCP counter cells are numbered alike in both programs' counters.p4.

Standard library plus dataplane.config (itself standard library only), so the Tofino
SDE's bfshell Python imports it as it imports bfrt_scripts/tofino_plan.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from dataplane.config import ConfigError, Job, Member, SwitchConfig

JOB_COUNTER_STRIDE = 16        # counter cells per job (JOB_COUNTER_STRIDE in counters.p4)

# Counter cells of both programs' counters.p4 -> protocol.md §4.5 names.
GLOBAL_COUNTER_CELLS = {
    "drop_truncated": 0, "drop_bad_version": 1, "drop_bad_type": 2, "drop_bad_length": 3,
    "drop_unknown_job": 4, "drop_not_routable": 5, "forwarded": 6, "drop_fragment": 7,
    "drop_oversize": 8,       # the Tofino program leaves it to the MAC (bfrt_controls.py)
}
DLCP_COUNTER_CELLS = {"dlcp_selective_drop": 0, "dlcp_buffer_drop": 1, "dlcp_ce_marked": 2}


@dataclass(frozen=True)
class JobLayout:
    """Where a job lives inside a program's shared resources."""
    job: int
    index: int                 # dense job index: counter block, multicast group index + 1
    slot_base: int             # first slot in the shared slot registers
    pool_size: int

    @property
    def group_id(self) -> int:
        return self.index + 1  # multicast group 0 means "no multicast"

    @property
    def counter_base(self) -> int:
        return self.index * JOB_COUNTER_STRIDE


def jobs_in_order(config: SwitchConfig) -> list[Job]:
    """The description's jobs in job-id order: the order of their dense indices."""
    return sorted(config.jobs, key=lambda j: j.job)


def members_in_order(job: Job) -> list[Member]:
    """A job's members in worker-id order: the order of its multicast replicas (§5.1)."""
    return sorted(job.members, key=lambda m: m.worker)


def job_layouts(config: SwitchConfig) -> dict[int, JobLayout]:
    """Dense job indices and consecutive slot ranges, in job-id order."""
    layouts, base = {}, 0
    for index, job in enumerate(jobs_in_order(config)):
        layouts[job.job] = JobLayout(job.job, index, base, job.pool_size)
        base += job.pool_size
    return layouts


def check_job_capacity(config: SwitchConfig, plane: str, max_jobs: int, slot_budget: int,
                       jobs_limit_source: str) -> None:
    """Refuses more jobs than `max_jobs`, or more slots in all than `slot_budget`, naming
    the plane's limit (`jobs_limit_source`: where the job limit is defined) and what to
    lower."""
    if len(config.jobs) > max_jobs:
        raise ConfigError(f"{len(config.jobs)} jobs; {plane} holds at most {max_jobs} "
                          f"({jobs_limit_source}): run fewer jobs per switch")
    total = sum(j.pool_size for j in config.jobs)
    if total > slot_budget:
        sizes = ", ".join(f"job {j.job}: {j.pool_size}" for j in config.jobs)
        raise ConfigError(f"the jobs ask for {total} slots ({sizes}); {plane} has "
                          f"{slot_budget} in all: lower pool_size")


def next_hop_bases(config: SwitchConfig) -> list[int]:
    """Route i's first entry in the next-hop table: its next hops follow route i - 1's."""
    bases, base = [], 0
    for route in config.routes:
        bases.append(base)
        base += len(route.next_hops)
    return bases


def switch_ports(config: SwitchConfig) -> list[int]:
    """The switch ports the description uses: members' and next hops'."""
    return sorted({m.port for j in config.jobs for m in j.members}
                  | {p for r in config.routes for p, _ in r.next_hops})


def lane_pairs(job: Job) -> list[tuple[int, int]]:
    """The byte lookup of a job's table: packed byte b -> (T[b >> 4], T[b & 15]) (§2.2)."""
    table = [int(v) for v in job.table]
    return [(table[byte >> 4], table[byte & 0x0F]) for byte in range(256)]


def counters_from_cells(layouts: dict[int, JobLayout], job_parts: dict[str, tuple[int, ...]],
                        job_cells: dict[int, int], global_cells: dict[int, int],
                        dlcp_cells: dict[int, int]) -> dict:
    """Counter cells read from a switch -> the {"global", "jobs"} dict of §4.5.

    `job_parts` names, per protocol job counter, the cells (offsets in the job's block)
    whose sum it is: one cell where a program counts the name itself, several where it
    counts outcomes."""
    glob = {name: int(global_cells.get(cell, 0)) for name, cell in GLOBAL_COUNTER_CELLS.items()}
    glob.update({name: int(dlcp_cells.get(cell, 0)) for name, cell in DLCP_COUNTER_CELLS.items()})
    jobs = {}
    for job, layout in layouts.items():
        jobs[job] = {name: sum(int(job_cells.get(layout.counter_base + cell, 0))
                               for cell in cells)
                     for name, cells in job_parts.items()}
    return {"global": glob, "jobs": jobs}
