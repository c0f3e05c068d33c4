"""Re-measure (verify) or re-record (record) on several GPUs at once.

`runbook verify` on a machine with GPUs runs each runbook in a child `runbook verify NAME --profile P --json` pinned
to one GPU (CUDA_VISIBLE_DEVICES). A runbook that records a timing has its GPU to itself: no other measurement shares
the device it times. A runbook whose numbers are all exact (losses, accept lengths: deterministic, whatever else runs)
shares a GPU with up to SHARE - 1 others of its kind, which overlaps their host-side work (kernel start, data
preparation, launches) with each other's GPU work. A runbook starts once the runbooks it depends on (on the same
profile) have finished, which leaves their outputs built for it; among the ready ones the runbook with the longest
chain of dependents goes first, since the chain bounds the wall time. The children's verdicts are merged as if one
process had judged them all. `runbook record` schedules `runbook run NAME --record` children the same way.

With the timing lock (`[tool.specbook] timing_lock = true`: the project's engine keeps its protocol) the exact
runbooks also run beside timing ones on their GPU (up to TIMERS of those at once), and a timing runbook has the
device to itself only while it times. Each child on a GPU gets TIMING_LOCK_ENV, the path of that GPU's lock file, and TIMING_ROLE_ENV, its role:
- "timer" (a runbook that records a timing): outside its timed sections it holds PATH.timers and PATH shared; around
  each timed section it lets both go, queues at PATH.queue (exclusively: timers time in the order they asked), takes
  PATH.timers exclusively (once every other timer is timing or waiting to: meanwhile the background goes on), then
  PATH.turn, then PATH, and after it releases all four and passes PATH.queue to hold PATH.timers and PATH shared
  again;
- "background" (a runbook whose numbers are all exact): from its start it holds PATH shared, taking it only through
  PATH.turn (shared, and let go at once), and at every yield point between units of its GPU work (a training step,
  one generation) it finds out whether a timer holds PATH.turn; if one does, it waits for its device's queued work to
  finish, lets PATH go and waits at PATH.turn until the timer is done.
So a timed section starts once every other timer waits to time and every background process has reached a yield
point and emptied its queue, nothing but the timer runs on the device (or the host's cores) while it times, and the untimed
rest of every runbook - the compiles, captures and training that are most of a timing runbook's wall time -
overlaps. The locks are flock(2)
locks: the kernel lets go of a process's locks when it ends, so a crashed child blocks no one. A child `runbook`
process takes the variables out of its own environment and gives them to its runbooks' kernels (kernel_env); around
runs of an engine that may not keep the protocol (the recorded commit's tree, in an interleaved A/B) a timer child
holds its GPU itself (exclusive).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


SHARE = 3  # runbooks with only exact numbers at once on one GPU
TIMERS = 2  # runbooks that time something at once on one GPU, with the timing lock: their timed sections take turns
TIMING_LOCK_ENV = "SPECBOOK_TIMING_LOCK"  # a GPU's lock file (PATH and three beside it), set for each child on it
TIMING_ROLE_ENV = "SPECBOOK_TIMING_ROLE"  # "timer" or "background"
_timing: tuple[str, str] | None = None  # this child's (lock path, role), taken out of its environment
_held = 0  # depth of exclusive() blocks: the timer holds its GPU itself


def adopt_timing_lock() -> None:
    """A child `runbook` process: take the timing lock's variables out of its environment and keep them for the
    kernels of its runbooks (kernel_env). They are not this process's: it imports project code (an input's hash)
    but does no device work, and the engine would otherwise hold the device for it."""
    global _timing
    path, role = os.environ.pop(TIMING_LOCK_ENV, None), os.environ.pop(TIMING_ROLE_ENV, None)
    _timing = (path, role or "timer") if path else None


def kernel_env() -> dict[str, str]:
    """The variables a runbook kernel of this tree gets: the lock's, unless this process holds the lock itself."""
    if _timing is None or _held:
        return {}
    return {TIMING_LOCK_ENV: _timing[0], TIMING_ROLE_ENV: _timing[1]}


@contextmanager
def exclusive() -> Iterator[None]:
    """A timer child holds its GPU itself for the block, as one timed section: for runs whose engine may not keep
    the protocol (the recorded commit's tree, in an interleaved A/B). Kernels started inside get no lock variables.
    Anywhere else, nothing."""
    global _held
    if _timing is None or _timing[1] != "timer" or _held:
        yield
        return
    import fcntl  # POSIX, as the lock is: only a machine whose GPUs a runner shares gets here

    path = _timing[0]
    with (open(path + ".queue", "a") as queue, open(path + ".timers", "a") as timers, open(path + ".turn", "a") as turn,
          open(path, "a") as device):
        fcntl.flock(queue, fcntl.LOCK_EX)  # behind the timers that asked first
        fcntl.flock(timers, fcntl.LOCK_EX)  # the other timers wait to time
        fcntl.flock(turn, fcntl.LOCK_EX)  # the background processes stop at their next yield point
        fcntl.flock(device, fcntl.LOCK_EX)  # ... and have let the device go
        _held += 1
        try:
            yield
        finally:
            _held -= 1  # closing the files lets both locks go


@dataclass(frozen=True)
class Job:
    name: str
    profile: str
    after: frozenset[str]  # keys of the jobs that must finish first
    exclusive: bool = True  # it times something: no other job on its GPU meanwhile
    memory_gib: float = 0.0  # the GPU memory it declares (runbook header gpu_memory_gib); 0: not declared

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


def sharing(lock: bool, memory: dict[str, float] | None = None) -> str:
    """How runbooks share a GPU, in words, for the log lines of verify and record."""
    if lock:
        words = (f"one that times something has its GPU to itself while it times (the timing lock): up to {TIMERS} "
                 f"that time something and {SHARE} whose numbers are all exact share one")
    else:
        words = f"one that times something has its GPU to itself, up to {SHARE} whose numbers are all exact share one"
    if memory:
        cards = ", ".join(f"{s}: {g:.0f} GiB" for s, g in memory.items())
        words += f", while the GPU memory their headers declare fits the card ({cards})"
    return words


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
             log: Callable[[str], None], poll_s: float = 0.2, share: int = 1, lock: bool = False,
             memory: dict[str, float] | None = None) -> list[Finished]:
    """Run every job on one of `slots` (GPUs), dependencies first: an exclusive job alone on its slot, the others up
    to `share` at a time on a slot without an exclusive one; with `lock` (the timing lock), up to TIMERS exclusive
    jobs and `share` others at once on a slot. With `memory` (GiB of each slot's card), a job joins others on a slot
    only while their declared memory and its own fit the card. A job whose dependency failed still runs: its own
    verify then builds what it needs, or fails with the reason."""
    jobs = _within(jobs)
    rank = chain_lengths(jobs)
    waiting = sorted(jobs, key=lambda j: -rank[j.key])
    on: dict[str, list[Job]] = {s: [] for s in slots}  # what runs on each slot
    running, done = {}, []
    finished_keys: set[str] = set()
    while waiting or running:
        for job in [j for j in waiting if j.after <= finished_keys]:
            slot = _place(job, on, share, lock, memory)
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


def estimate(jobs: list[Job], slots: list[str], seconds: dict[str, float], share: int = 1,
             lock: bool = False, memory: dict[str, float] | None = None) -> float:
    """Wall seconds `schedule` would take if each job ran as long as `seconds` says (0 where unknown) and jobs that
    share a slot did not slow each other: the same order and placement, simulated. A lower bound for shared jobs
    (they compete for the GPU, and timing ones take turns at their timed sections), exact for the others."""
    if not slots:
        raise ValueError("no slot to run on")
    jobs = _within(jobs)
    rank = chain_lengths(jobs)
    waiting = sorted(jobs, key=lambda j: -rank[j.key])
    on: dict[str, list[Job]] = {s: [] for s in slots}
    running: list[tuple[float, Job, str]] = []
    finished: set[str] = set()
    now = 0.0
    while waiting or running:
        for job in [j for j in waiting if j.after <= finished]:
            slot = _place(job, on, share, lock, memory)
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


def _within(jobs: list[Job]) -> list[Job]:
    """The jobs with their dependencies cut to those among them."""
    keys = {j.key for j in jobs}
    return [dataclasses.replace(j, after=frozenset(a for a in j.after if a in keys)) for j in jobs]


def _place(job: Job, on: dict[str, list[Job]], share: int, lock: bool = False,
           memory: dict[str, float] | None = None) -> str | None:
    """A slot the job may start on now, the least busy first; None: wait. An exclusive job needs, with the lock, a
    slot with fewer than TIMERS exclusive ones, and without it a slot to itself; the others a slot with fewer than
    `share` of their kind, and without the lock one where no exclusive job runs. With `memory`, a slot where others
    run also needs room on its card for the job's declared memory (a job alone always fits: it has the whole card)."""
    def fits(s: str) -> bool:
        timing = [j for j in on[s] if j.exclusive]
        if on[s] and memory and s in memory and sum(j.memory_gib for j in on[s]) + job.memory_gib > memory[s]:
            return False
        if job.exclusive:
            return len(timing) < TIMERS if lock else not on[s]
        return len(on[s]) - len(timing) < share and (lock or not timing)

    return min((s for s in on if fits(s)), key=lambda s: len(on[s]), default=None)


def card_memory(slots: list[str]) -> dict[str, float]:
    """GiB of each GPU among `slots` (CUDA ids), from nvidia-smi; {} where it cannot say (no NVIDIA GPU or tool):
    then nothing is held back for memory."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    out = {}
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        index, _, mib = line.partition(",")
        try:
            out[index.strip()] = float(mib) / 1024
        except ValueError:
            continue
    return {s: out[s] for s in slots if s in out}


def child(root: Path, scratch: Path, log: Callable[[str], None], argv: Callable[[Job], list[str]],
          lock: bool = False) -> Callable[[Job, str], subprocess.Popen]:
    """A starter for `schedule`: `runbook ARGV(job)` on GPU `slot`, its stdout written to a file under `scratch` (a
    pipe could fill and stall the child), its log lines relayed with the GPU as prefix; with `lock`, the timing
    lock's variables for its GPU and role (the module doc)."""
    scratch.mkdir(parents=True, exist_ok=True)

    def start(job: Job, slot: str) -> subprocess.Popen:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": slot, "PYTHONUNBUFFERED": "1"}
        if lock:
            env[TIMING_LOCK_ENV] = str(lock_file(scratch, slot))
            env[TIMING_ROLE_ENV] = "timer" if job.exclusive else "background"
        output = scratch / f"{job.name}-{job.profile}.json"
        with output.open("w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "specbook.cli", "--root", str(root), *argv(job)], env=env,
                                    stdout=f, stderr=subprocess.PIPE, text=True)
        proc.output = output  # type: ignore[attr-defined]
        threading.Thread(target=_relay, args=(proc, f"[gpu {slot}] ", log), daemon=True).start()
        return proc

    return start


def lock_file(scratch: Path, slot: str) -> Path:
    """GPU `slot`'s timing lock (and PATH.turn, PATH.timers, PATH.queue beside it), made if missing: the children
    only open them."""
    path = scratch / f"gpu-{slot}.timing.lock"
    for p in [path] + [path.with_name(path.name + x) for x in (".turn", ".timers", ".queue")]:
        p.touch()
    return path


def verify_child(root: Path, scratch: Path, log: Callable[[str], None],
                 lock: bool = False) -> Callable[[Job, str], subprocess.Popen]:
    """`runbook verify NAME --profile P --json`, its verdicts as JSON in the output file."""
    return child(root, scratch, log, lambda j: ["verify", j.name, "--profile", j.profile, "--json"], lock)


def record_child(root: Path, scratch: Path, log: Callable[[str], None],
                 lock: bool = False) -> Callable[[Job, str], subprocess.Popen]:
    """`runbook run NAME --record --profile P --json --docs-later`: the run recorded, its metrics as JSON in the
    output file; docs/ is left to the parent, which brings it up to date once, after every child."""
    return child(root, scratch, log, lambda j: ["run", j.name, "--record", "--profile", j.profile, "--json",
                                                "--docs-later"], lock)


def _relay(proc: subprocess.Popen, prefix: str, log: Callable[[str], None]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        log(prefix + line.rstrip())
