"""Re-measure (verify) or re-record (record) on several GPUs at once.

`runbook verify` on a machine with GPUs runs each runbook in a child `runbook verify NAME --profile P --json` pinned
to one GPU (CUDA_VISIBLE_DEVICES). A runbook that records a timing has its GPU to itself: no other measurement shares
the device it times. A runbook whose numbers are all exact (losses, accept lengths: deterministic, whatever else runs)
shares a GPU with up to SHARE - 1 others of its kind, which overlaps their host-side work (kernel start, data
preparation, launches) with each other's GPU work. A runbook starts once the runbooks it depends on (on the same
profile) have finished, which leaves their outputs built for it; among the ready ones the runbook with the longest
chain of dependents goes first, since the chain bounds the wall time. The children's verdicts are merged as if one
process had judged them all. `runbook record` schedules `runbook run NAME --record` children the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


SHARE = 3  # runbooks with only exact numbers at once on one GPU


@dataclass(frozen=True)
class Job:
    name: str
    profile: str
    after: frozenset[str]  # keys of the jobs that must finish first
    exclusive: bool = True  # it times something: no other job on its GPU meanwhile

    @property
    def key(self) -> str:
        return f"{self.name}/{self.profile}"


@dataclass
class Finished:
    job: Job
    returncode: int
    stdout: str
    seconds: float
    slot: str


def chain_lengths(jobs: list[Job]) -> dict[str, int]:
    """For each job, the number of jobs on its longest chain of dependents, itself included."""
    dependents: dict[str, list[str]] = {j.key: [] for j in jobs}
    for j in jobs:
        for a in j.after:
            dependents[a].append(j.key)
    memo: dict[str, int] = {}

    def length(key: str) -> int:
        if key not in memo:
            memo[key] = 1 + max((length(d) for d in dependents[key]), default=0)
        return memo[key]

    return {j.key: length(j.key) for j in jobs}


def schedule(jobs: list[Job], slots: list[str], start: Callable[[Job, str], subprocess.Popen],
             log: Callable[[str], None], poll_s: float = 0.2, share: int = 1) -> list[Finished]:
    """Run every job on one of `slots` (GPUs), dependencies first: an exclusive job alone on its slot, the others up
    to `share` at a time on a slot without an exclusive one. A job whose dependency failed still runs: its own
    verify then builds what it needs, or fails with the reason."""
    keys = {j.key for j in jobs}
    jobs = [Job(j.name, j.profile, frozenset(a for a in j.after if a in keys), j.exclusive) for j in jobs]
    rank = chain_lengths(jobs)
    waiting = sorted(jobs, key=lambda j: -rank[j.key])
    on: dict[str, list[Job]] = {s: [] for s in slots}  # what runs on each slot
    running, done = {}, []
    finished_keys: set[str] = set()
    while waiting or running:
        for job in [j for j in waiting if j.after <= finished_keys]:
            slot = _place(job, on, share)
            if slot is None:
                continue
            on[slot].append(job)
            log(f"[{slot}] {job.key}: started")
            running[job.key] = (job, slot, start(job, slot), time.monotonic())
            waiting.remove(job)
        for key, (job, slot, proc, t0) in list(running.items()):
            if proc.poll() is None:
                continue
            out = proc.output.read_text() if hasattr(proc, "output") else ""
            seconds = time.monotonic() - t0
            log(f"[{slot}] {key}: finished in {seconds:.0f} s (exit {proc.returncode})")
            done.append(Finished(job, proc.returncode, out, seconds, slot))
            finished_keys.add(key)
            on[slot].remove(job)
            del running[key]
        time.sleep(poll_s)
    return done


def estimate(jobs: list[Job], slots: list[str], seconds: dict[str, float], share: int = 1) -> float:
    """Wall seconds `schedule` would take if each job ran as long as `seconds` says (0 where unknown) and jobs that
    share a slot did not slow each other: the same order and placement, simulated. A lower bound for shared jobs
    (they compete for the GPU), exact for the others."""
    if not slots:
        raise ValueError("no slot to run on")
    keys = {j.key for j in jobs}
    jobs = [Job(j.name, j.profile, frozenset(a for a in j.after if a in keys), j.exclusive) for j in jobs]
    rank = chain_lengths(jobs)
    waiting = sorted(jobs, key=lambda j: -rank[j.key])
    on: dict[str, list[Job]] = {s: [] for s in slots}
    running: list[tuple[float, Job, str]] = []
    finished: set[str] = set()
    now = 0.0
    while waiting or running:
        for job in [j for j in waiting if j.after <= finished]:
            slot = _place(job, on, share)
            if slot is not None:
                on[slot].append(job)
                running.append((now + seconds.get(job.key, 0.0), job, slot))
                waiting.remove(job)
        now = min(end for end, _, _ in running)
        for item in [r for r in running if r[0] <= now]:
            running.remove(item)
            on[item[2]].remove(item[1])
            finished.add(item[1].key)
    return now


def _place(job: Job, on: dict[str, list[Job]], share: int) -> str | None:
    """A slot the job may start on now, the least busy first; None: wait."""
    if job.exclusive:
        return next((s for s, jobs in on.items() if not jobs), None)
    fits = [s for s, jobs in on.items() if len(jobs) < share and not any(j.exclusive for j in jobs)]
    return min(fits, key=lambda s: len(on[s]), default=None)


def child(root: Path, scratch: Path, log: Callable[[str], None],
          argv: Callable[[Job], list[str]]) -> Callable[[Job, str], subprocess.Popen]:
    """A starter for `schedule`: `runbook ARGV(job)` on GPU `slot`, its stdout written to a file under `scratch` (a
    pipe could fill and stall the child), its log lines relayed with the GPU as prefix."""
    scratch.mkdir(parents=True, exist_ok=True)

    def start(job: Job, slot: str) -> subprocess.Popen:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": slot, "PYTHONUNBUFFERED": "1"}
        output = scratch / f"{job.name}-{job.profile}.json"
        with output.open("w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "specbook.cli", "--root", str(root), *argv(job)], env=env,
                                    stdout=f, stderr=subprocess.PIPE, text=True)
        proc.output = output  # type: ignore[attr-defined]
        threading.Thread(target=_relay, args=(proc, f"[gpu {slot}] ", log), daemon=True).start()
        return proc

    return start


def verify_child(root: Path, scratch: Path, log: Callable[[str], None]) -> Callable[[Job, str], subprocess.Popen]:
    """`runbook verify NAME --profile P --json`, its verdicts as JSON in the output file."""
    return child(root, scratch, log, lambda j: ["verify", j.name, "--profile", j.profile, "--json"])


def record_child(root: Path, scratch: Path, log: Callable[[str], None]) -> Callable[[Job, str], subprocess.Popen]:
    """`runbook run NAME --record --profile P --json`: the run recorded, its metrics as JSON in the output file."""
    return child(root, scratch, log, lambda j: ["run", j.name, "--record", "--profile", j.profile, "--json"])


def _relay(proc: subprocess.Popen, prefix: str, log: Callable[[str], None]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        log(prefix + line.rstrip())
