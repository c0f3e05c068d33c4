"""`runbook record`: re-record every runbook of one or more profiles after a change, dependencies first.

On a machine with GPUs each runbook runs in a child `runbook run NAME --record` scheduled as verify schedules its
re-measurements (specbook.parallel): one whose record holds a timing, or that has no record yet, has its GPU to
itself; those whose numbers are all exact share one. Without GPUs they run one after another in this process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specbook import RunFailed, project
from specbook.execute import run, target
from specbook.parallel import SHARE, Job, card_memory, record_child, schedule, sharing
from specbook.runbooks import check_name, discover, load
from specbook.verify import times_something


@dataclass
class Recorded:
    runbook: str
    profile: str
    run_id: str | None  # None: it failed
    error: str = ""


def jobs(root: Path, profile: str, names: list[str] | None = None) -> list[Job]:
    """The runbooks to record on `profile` (`names`, else every runbook that declares it) in dependency order, with
    what each waits for among them and whether it needs its GPU to itself."""
    for n in names or []:
        check_name(n)
    chosen = names or [n for n in discover(root) if profile in load(root, n).profiles]
    for n in chosen:
        load(root, n).params_for(profile)  # a runbook without this profile is refused here, before anything runs
    order: list[str] = []

    def visit(name: str) -> None:
        if name not in order:
            for dep in target(root, name, profile).upstream:
                if dep in chosen:
                    visit(dep)
            order.append(name)

    for n in chosen:
        visit(n)
    return [Job(n, profile, frozenset(f"{d}/{profile}" for d in target(root, n, profile).upstream if d in chosen),
                exclusive=times_something(root, n, profile), memory_gib=load(root, n).gpu_memory_gib)
            for n in order]


def record_all(root: Path, todo: list[Job], gpus: list[str], log: Callable[[str], None] = print,
               progress: bool = True) -> list[Recorded]:
    """Record each job's runbook; on `gpus` through children, else one after another here."""
    if gpus:
        lock, memory = project.settings(root).timing_lock, card_memory(gpus)
        log(f"recording {len(todo)} runbooks on {len(gpus)} GPU(s) ({', '.join(gpus)}): {sharing(lock, memory)} (one "
            "without a record yet counts as timing)")
        done = schedule(todo, gpus, record_child(root, root / ".specbook" / "parallel", log, lock), log, share=SHARE,
                        lock=lock, memory=memory)
        return [_from_child(f.job, f.returncode, f.stdout) for f in done]
    out: list[Recorded] = []
    recorded: set[str] = set()
    for job in todo:
        if job.key in recorded:  # recorded already as another's missing dependency
            continue
        try:
            outcomes = run(root, target(root, job.name, job.profile), record=True, fresh=True, progress=progress,
                           log=log)
        except RunFailed as e:
            out.append(Recorded(job.name, job.profile, None, str(e)))
            continue
        for o in outcomes:
            if o.run_id:
                recorded.add(f"{o.target.rb.name}/{o.target.profile}")
                out.append(Recorded(o.target.rb.name, o.target.profile, o.run_id))
    return out


def _from_child(job: Job, returncode: int, stdout: str) -> Recorded:
    """What a child `runbook run NAME --record --json` recorded: its rows name the run."""
    if returncode:
        return Recorded(job.name, job.profile, None, f"exit {returncode} (its log is above)")
    try:
        run_id = next(r["run"] for r in json.loads(stdout) if r["runbook"] == job.name)
    except (ValueError, KeyError, TypeError, StopIteration):
        return Recorded(job.name, job.profile, None, "exit 0 without a recorded run")
    return Recorded(job.name, job.profile, run_id)
