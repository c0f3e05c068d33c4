"""Verdicts on recorded numbers, in one vocabulary for every command, page and agent context.

A recorded number is in exactly one state:

- re-measured by this command: **fresh** (within tolerance; a noisy number with changed inputs only when the
  paired measurements against the recorded commit's engine say so too), **drifted** (outside it; a noisy number
  only when two of three measurements against the recorded commit's engine say so), **moved** (a noisy number outside tolerance with
  the code and parameters as recorded, or an exact one that differs, or is not recorded at all, on another kind of
  processor or GPU than it was recorded on: the machine or environment moved, not the code; exit 0, but shown),
  **flaky** (no two of three measurements agree: fails like drift), **failed** (the runbook could not run);
- not re-measured: **current** (its inputs - runbook, parameters, engine code, declared inputs, upstream records -
  hash as when it was recorded), **stale** (they changed since), **reported** (measured by hand on hardware this
  project cannot reach; there are no inputs to hash).

`where` says whether this machine can re-measure it at all; a number of another hardware profile is never fresh
here, only current or stale. `status` hashes; `verify` re-runs what this machine can run and judges.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import shutil
import statistics
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from specbook import RunFailed, SpecbookError, judge, parallel, project, provenance, records, sidebyside
from specbook.execute import EXECUTED, Target, notebook_seconds, run, target
from specbook.judge import drift
from specbook.parallel import SHARE, Job, card_memory, estimate, schedule, sharing, verify_child
from specbook.provenance import canonical, sha
from specbook.runbooks import check_name, check_profile, discover, load

FRESH, MOVED, DRIFTED, FLAKY, FAILED = "fresh", "moved", "drifted", "flaky", "failed"
CURRENT, STALE, REPORTED, UNRECORDED = "current", "stale", "reported", "unrecorded"
INVALID = "invalid record"  # status: the record file is malformed (detail: the one-line error)
STATES = (FRESH, MOVED, DRIFTED, FLAKY, FAILED, INVALID, CURRENT, STALE, REPORTED, UNRECORDED)
# states that make a documented number untrustworthy here
FAILING = frozenset({DRIFTED, FLAKY, FAILED, INVALID, STALE})
MEANING = {
    FRESH: "re-measured here within tolerance",
    MOVED: "re-measured here outside tolerance with the code and parameters as recorded (a timing, or an exact "
           "number on another kind of processor or GPU, where it may also be missing): the machine or its "
           "environment moved it, not the code",
    DRIFTED: "re-measured here outside tolerance (noisy numbers: on two runs)",
    FLAKY: "re-measured here twice and the runs disagree",
    FAILED: "could not be re-measured: the runbook failed or cannot be resolved",
    INVALID: "the record file is malformed",
    CURRENT: "not re-measured by this command; its inputs are unchanged since it was recorded",
    STALE: "its inputs (code, parameters, upstream) changed since it was recorded: re-record it",
    REPORTED: "measured by hand on hardware this project cannot reach; never re-run",
    UNRECORDED: "the runbook has no records yet",
}


@dataclass
class Verdict:
    runbook: str
    profile: str
    metric: str
    state: str
    recorded: float | None = None
    measured: float | None = None
    unit: str = ""
    kind: str = ""  # noisy | exact
    change: str | None = None  # drifted / flaky: regression | improvement | changed (direction none)
    here: bool = False  # whether this machine's hardware profile can re-measure it
    inputs: str = ""  # "unchanged", or which inputs changed since it was recorded
    date: str = ""  # when it was recorded (ISO)
    commit: str = ""  # the commit it was recorded at
    hardware: str = ""  # what it was recorded on
    detail: str = ""

    @property
    def key(self) -> str:
        return f"{self.runbook}/{self.profile}/{self.metric}"

    @property
    def label(self) -> str:
        """The state as one phrase: `current (h200 only)`, `drifted (regression)`."""
        extra = self.change or ("" if self.here or self.state in (UNRECORDED, REPORTED) else
                                f"{provenance.hardware_of(self.profile)} only")
        return f"{self.state} ({extra})" if extra else self.state

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "key": self.key}


def exit_code(verdicts: list[Verdict]) -> int:
    """3 when something failed, else 1 when something drifted or is flaky, else 0."""
    states = {v.state for v in verdicts}
    return 3 if FAILED in states else 1 if states & {DRIFTED, FLAKY} else 0


def age(date: Any, now: dt.datetime | None = None) -> str:
    seconds = ((now or dt.datetime.now(dt.timezone.utc)) - records.parse_date(date)).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(int(seconds), 0)}s"


def hardware(profile: str, run: dict) -> str:
    """What a run was measured on, in words: the GPUs it saw, or its profile."""
    gpu = (run.get("provenance") or {}).get("gpu") or {}
    names, count = ", ".join(gpu.get("names") or []), gpu.get("count", 0)
    return (f"{count}x {names}" if count > 1 else names) if names else profile


# ------------------------------------------------------------------------------------------------ names, profiles


def _names(root: Path, names: list[str] | None) -> list[str]:
    if names:
        for n in names:
            check_name(n)
            if not records.path_for(root, n).exists():
                load(root, n)  # unknown names fail here with suggestions
        return list(names)
    return sorted(set(discover(root)) | {p.stem for p in (root / records.BASELINES).glob("*.yaml")})


# ------------------------------------------------------------------------------------------------ hashes only


def _current(root: Path, name: str, profile: str, cache: dict) -> Target | Exception:
    key = (name, profile)
    if key not in cache:
        try:
            cache[key] = target(root, name, profile)
        except SpecbookError as e:  # runbook gone, profile dropped, input unavailable: reported, not raised
            cache[key] = e
    return cache[key]


def changed_inputs(t: Target, run: dict[str, Any]) -> list[str]:
    """Which of `t`'s own inputs (runbook, parameters, engine code, declared inputs) hash otherwise than when `run`
    was recorded, from the hashes its provenance kept."""
    p = run.get("provenance", {})
    now = {"runbook": sha(t.rb.hashed_source), "parameters": sha(canonical(t.params)), "engine": t.engine}
    then = {"runbook": p.get("runbook_hash"), "parameters": p.get("params_hash"), "engine": p.get("engine_hash")}
    changed = [k for k in now if now[k] != then[k]]
    return changed + [f"input {i}" for i, h in t.inputs.items() if p.get(f"{i}_manifest") != h]


def why_stale(root: Path, t: Target, run: dict[str, Any]) -> str:
    """Which inputs changed since `run`; for the engine, which files and definitions (from the recorded commit's
    files, where this clone has them)."""
    changed = changed_inputs(t, run)
    if "engine" in changed:
        changed[changed.index("engine")] = engine_change(root, t, run.get("provenance", {}))
    return ", ".join(changed or ["upstream"]) + " changed"


def engine_change(root: Path, t: Target, p: dict[str, Any]) -> str:
    """`engine (engine/gemv.py: blocks, gemv)`: where the engine code the runbook reaches differs from the recorded
    commit's; plain `engine` when that commit is not in this clone."""
    where = provenance.engine_changes(root, str(p.get("git_commit") or ""), t.rb.source, t.params)
    if not where:
        return "engine"

    def some(items: list[str], n: int) -> list[str]:  # a status line stays readable
        return items if len(items) <= n else [*items[:n], f"+{len(items) - n} more"]

    files = [f"{path}: {', '.join(some(labels, 4))}" for path, labels in where.items()]
    return "engine (" + "; ".join(some(files, 3)) + ")"


def _static(root: Path, name: str, profile: str, prof: dict, here: str, cache: dict) -> list[Verdict]:
    """Verdicts without running: reported, current or stale by inputs hash, failed when it cannot be resolved."""
    out = []
    runs_here = provenance.runs_here(profile, here)
    for mname, entry in prof["metrics"].items():
        r = records.run_of(prof, entry["run"])
        v = Verdict(name, profile, mname, CURRENT, entry["value"], None, entry["unit"], records.kind_of(entry),
                    here=runs_here and r["source"] == "measured", inputs="unchanged", date=str(r["date"]),
                    commit=str((r.get("provenance") or {}).get("git_commit") or "")[:10],
                    hardware=hardware(profile, r))
        if r["source"] == "reported":
            v.state, v.inputs, v.detail = REPORTED, "-", str((r.get("provenance") or {}).get("reported_by", ""))
        else:
            t = _current(root, name, profile, cache)
            if isinstance(t, Exception):
                v.state, v.inputs, v.detail = FAILED, "-", str(t)
            elif t.inputs_hash != r["inputs_hash"]:
                v.state, v.inputs = STALE, why_stale(root, t, r)
        out.append(v)
    return out


def status(root: Path, names: list[str] | None = None, here: str | None = None) -> list[Verdict]:
    """current / stale / reported / failed for every recorded number of every profile; nothing runs."""
    here = here or provenance.detect_profile()
    out, cache = [], {}
    for name in _names(root, names):
        try:
            rf = records.load(records.path_for(root, name))
        except SpecbookError as e:  # one malformed file must not hide the others
            out.append(Verdict(name, "-", "-", INVALID, detail=str(e)))
            continue
        if not rf.data["profiles"]:
            out.append(Verdict(name, "-", "-", UNRECORDED))
        for profile, prof in rf.data["profiles"].items():
            out += _static(root, name, profile, prof, here, cache)
    return out


def index(root: Path, here: str | None = None) -> dict[str, Verdict]:
    """Every recorded number's verdict by key (runbook/profile/metric), from hashes: what claims, the site, the
    status page and the context pack read. A record file that does not load is skipped here; `status` names it."""
    here = here or provenance.detect_profile()
    out, cache = {}, {}
    for name in _names(root, None):
        try:
            rf = records.load(records.path_for(root, name))
        except SpecbookError:
            continue
        for profile, prof in rf.data["profiles"].items():
            out.update((v.key, v) for v in _static(root, name, profile, prof, here, cache))
    return out


# ------------------------------------------------------------------------------------------------ re-measuring


def verify(root: Path, here: str, names: list[str] | None = None, profile: str | Sequence[str] | None = None,
           progress: bool = True, log: Callable[[str], None] = print, gpus: list[str] | None = None) -> list[Verdict]:
    """Re-run every runbook with measured numbers on this machine's profiles (or on `profile`: one or several) and
    judge; report the others. With more than one of `gpus`, or one that runbooks can share, the runbooks of every
    chosen profile are spread over them in one schedule (see specbook.parallel)."""
    groups = _groups(root, here, names, profile)
    todo = [g for g in groups if isinstance(g, tuple)]
    if gpus and len(todo) > 1 and (len(gpus) > 1 or _share_one_gpu(root, [_times(prof) for _, _, prof, _ in todo])):
        judged = _rerun_parallel(root, by_profile(todo, profile), gpus, log)
    else:
        judged = {(n, p): _rerun(root, n, p, prof, static, progress, log)
                  for n, p, prof, static in dependencies_first(root, todo)}
    return [v for g in groups for v in (judged[g[:2]] if isinstance(g, tuple) else g)]


Group = list[Verdict] | tuple[str, str, dict, list[Verdict]]  # judged without running, or (name, profile, ...) to run


def dependencies_first(root: Path, todo: list[tuple[str, str, dict, list[Verdict]]]) \
        -> list[tuple[str, str, dict, list[Verdict]]]:
    """`todo` reordered so that a runbook comes after those it depends on (same profile), else as given: a
    dependency re-measured first, from nothing, is then what its dependents use, not built once for them and again
    for its own verdict (a training run measured twice)."""
    keys = {(n, p): g for g in todo for n, p in [g[:2]]}
    out: list = []
    placed: set[tuple[str, str]] = set()

    def place(key: tuple[str, str]) -> None:
        if key in placed:
            return
        placed.add(key)
        try:
            upstream = target(root, *key).upstream
        except SpecbookError:  # its own re-run reports why
            upstream = {}
        for dep in upstream:
            if (dep, key[1]) in keys:
                place((dep, key[1]))
        out.append(keys[key])

    for n, p, _, _ in todo:
        place((n, p))
    return out


def _groups(root: Path, here: str, names: list[str] | None, profile: str | Sequence[str] | None) -> list[Group]:
    """Per runbook and profile: its verdicts when nothing there can be re-measured here, else what to re-run."""
    chosen = chosen_profiles(profile)
    for p in chosen or ():
        check_profile(root, p)
    groups: list[Group] = []
    cache: dict = {}
    for name in _names(root, names):
        rf = records.load(records.path_for(root, name))
        for pname, prof in rf.data["profiles"].items():
            if chosen is not None and pname not in chosen:
                continue
            static = _static(root, name, pname, prof, here, cache)
            if not any(v.here for v in static) or all(v.state == FAILED for v in static):
                groups.append(static)
            else:
                groups.append((name, pname, prof, static))
        if not rf.data["profiles"] and (chosen is None or here in chosen):
            groups.append([Verdict(name, here, "-", UNRECORDED)])
    return groups


def by_profile(todo: list[tuple[str, str, dict, list[Verdict]]], profile: str | Sequence[str] | None) \
        -> list[tuple[str, str, dict, list[Verdict]]]:
    """The runbooks to re-measure profile by profile (in the order named, else by name), as `runbook record
    --profile A --profile B` lists them: the scheduler starts runbooks it ranks alike in this order, so a verify
    runs them as the record did whose wall times `plan` adds up."""
    order = chosen_profiles(profile) or sorted({g[1] for g in todo})
    return sorted(todo, key=lambda g: order.index(g[1]))


def chosen_profiles(profile: str | Sequence[str] | None) -> list[str] | None:
    """The profiles a command names (`--profile`, repeatable), in order without repeats; None: it names none."""
    if profile is None:
        return None
    return list(dict.fromkeys([profile] if isinstance(profile, str) else profile)) or None


@dataclass
class Planned:
    """A runbook `verify` would re-measure here, and how long its recorded run took."""
    runbook: str
    profile: str
    shares_gpu: bool  # every number exact: it may share a GPU with others of its kind
    seconds: float | None  # the recorded run's wall time, else its executed notebook's cell time; None: neither
    after: list[str]  # runbooks (same profile) it waits for
    timed: str = "run"  # what `seconds` is: "run" (the whole run), "cells" (cells only: an older record), "none"
    stale: bool = False  # its record was made with other code, parameters or inputs: `seconds` is that run's time


def recorded_seconds(root: Path, name: str, profile: str, prof: dict) -> tuple[float | None, str]:
    """How long the run behind a profile's record took: its wall time where the record keeps it (runs recorded
    since it does), else the cell time of its executed notebook (the process and kernel starts left out)."""
    run = records.run_of(prof, next(iter(prof["metrics"].values()))["run"]) if prof.get("metrics") else {}
    if isinstance(run.get("seconds"), (int, float)):
        return float(run["seconds"]), "run"
    cells = notebook_seconds(root / EXECUTED / f"{name}-{profile}.ipynb")
    return cells, "none" if cells is None else "cells"


def plan(root: Path, here: str, names: list[str] | None = None, profile: str | Sequence[str] | None = None,
         gpus: list[str] | None = None) -> tuple[list[Planned], float, float]:
    """What `verify` would re-measure here, without running anything: the runbooks (of every profile in `profile`
    at once, as one verify schedules them), each with the time its recorded run took (recorded_seconds), then the
    estimated wall seconds on `gpus` (the scheduler simulated, runbooks sharing a GPU taken as not slowing each
    other) and the plain sum (one after another)."""
    todo = by_profile([g for g in _groups(root, here, names, profile) if isinstance(g, tuple)], profile)
    keys = {(n, p) for n, p, _, _ in todo}
    out = []
    for n, p, prof, static in todo:
        seconds, timed = recorded_seconds(root, n, p, prof)
        out.append(Planned(n, p, not _times(prof), seconds,
                           [d for d in target(root, n, p).upstream if (d, p) in keys], timed,
                           any(v.state == STALE for v in static)))
    seconds = {f"{x.runbook}/{x.profile}": x.seconds or 0.0 for x in out}
    total = sum(seconds.values())
    if not gpus:
        return out, total, total
    jobs = [Job(x.runbook, x.profile, frozenset(f"{d}/{x.profile}" for d in x.after), not x.shares_gpu,
                target(root, x.runbook, x.profile).rb.gpu_memory_gib) for x in out]
    on_it = here == provenance.detect_profile()  # planning on the machine itself: its cards; else the records'
    memory = card_memory(gpus) if on_it else recorded_card_memory([g[2] for g in todo], gpus)
    return out, estimate(jobs, gpus, seconds, share=SHARE, lock=project.settings(root).timing_lock,
                         memory=memory), total


def recorded_card_memory(profiles: list[dict], gpus: list[str]) -> dict[str, float]:
    """The card memory a profile's records keep (the smallest any run names), for each of `gpus`: planning a verify
    from another machine packs runbooks as its scheduler will. {} where no run kept it."""
    sizes = [m for prof in profiles for run in prof.get("runs", [])
             for m in ((run.get("provenance") or {}).get("gpu") or {}).get("memory_gib") or []]
    return {g: min(sizes) for g in gpus} if sizes else {}


def _share_one_gpu(root: Path, timed: list[bool]) -> bool:
    """Whether runbooks (whether each times something) could run side by side on one GPU: two whose numbers are all
    exact, or with the timing lock one of them beside a timing one."""
    exact = timed.count(False)
    return exact > 1 or exact > 0 and any(timed) and project.settings(root).timing_lock


def _rerun_parallel(root: Path, todo: list[tuple[str, str, dict, list[Verdict]]], gpus: list[str],
                    log) -> dict[tuple[str, str], list[Verdict]]:
    """Each runbook re-measured by a child `runbook verify` on one GPU, dependencies first."""
    jobs = [_job(target(root, n, p), _times(prof)) for n, p, prof, _ in todo]
    lock, memory = project.settings(root).timing_lock, card_memory(gpus)
    log(f"re-measuring {len(jobs)} runbooks on {len(gpus)} GPU(s) ({', '.join(gpus)}): {sharing(lock, memory)}")
    done = {f.job.key: f for f in schedule(jobs, gpus, verify_child(root, root / ".specbook" / "parallel", log, lock),
                                           log, share=SHARE, lock=lock, memory=memory)}
    out = {}
    for n, p, _, static in todo:
        f = done[f"{n}/{p}"]
        try:
            out[(n, p)] = [Verdict(**{k: v for k, v in d.items() if k != "key"})
                           for d in json.loads(f.stdout)["verdicts"]]
        except (ValueError, KeyError, TypeError):
            out[(n, p)] = [_failed(v, f"its verify on GPU {f.slot} exited {f.returncode} without a verdict; "
                                      "see the log above") if v.here else v for v in static]
    return out


def _job(t: Target, timed: bool) -> Job:
    """A runbook's place in a schedule: what it waits for, whether it times, the GPU memory it declares."""
    return Job(t.rb.name, t.profile, frozenset(f"{d}/{t.profile}" for d in t.upstream), timed, t.rb.gpu_memory_gib)


def _times(prof: dict) -> bool:
    """Whether a runbook's record holds a noisy number (a timing), which other work on its device would disturb."""
    return any(m.get("kind") != "exact" for m in prof["metrics"].values())


def times_something(root: Path, name: str, profile: str) -> bool:
    """Whether a runbook needs its device to itself on a profile: its record there holds a timing, or it has no
    record there yet (what it measures is unknown)."""
    path = records.path_for(root, name)
    prof = records.load(path).data["profiles"].get(profile) if path.exists() else None
    return not (prof and prof.get("metrics")) or _times(prof)


def _measure(root: Path, t: Target, progress: bool, log) -> dict[str, float]:
    outcome = run(root, t, record=False, fresh=True, progress=progress, log=log)[-1]
    return {m.name: m.value for m in outcome.execution.metrics}


def _rerun(root: Path, name: str, profile: str, prof: dict, static: list[Verdict], progress: bool,
           log) -> list[Verdict]:
    try:
        t = target(root, name, profile)
        first = _measure(root, t, progress, log)
    except RunFailed as e:
        return [_failed(v, str(e)) if v.here else v for v in static]
    now = provenance.fingerprint(root, t.rb.hashed_source)
    prof = recorded_here(prof, t.inputs_hash, now)
    judged = [_judge(v, prof, first) if v.here else v for v in static]
    again = [v for v in judged
             if v.kind == "noisy" and (v.state == DRIFTED or v.state == FRESH and changed_code(prof, v, t))]
    if again:
        _confirm(root, t, prof, again, now, progress, log)
    # an exact number the re-run did not record: one that exists only for some outcomes (a fine-tune that reached
    # its goal) may be absent where the processor rounds the run before it otherwise; judged as a changed exact one
    exact = [v for v in judged if v.kind != "noisy" and (v.state == DRIFTED or v.state == FAILED and
                                                         v.detail == NOT_RECORDED)]
    if exact:
        _exact_elsewhere(root, t, prof, exact, now, progress, log)
    env = environment_changes(records.run_of(prof, next(iter(prof["metrics"].values()))["run"]), now)
    if env:
        note = "environment differs from the recorded run: " + "; ".join(env)
        for v in judged:  # the timings, and an exact number that moved: what may explain it
            if v.here and (v.kind == "noisy" or v.state in (DRIFTED, MOVED)):
                v.detail = f"{v.detail}; {note}" if v.detail else note
    return judged


def changed_code(prof: dict, v: Verdict, t: Target) -> bool:
    """Whether v's number was recorded with other inputs than this tree's (code, parameters, upstream records). A
    timing within tolerance of such a record is no evidence that the code did not slow down: the machine's pace moves
    by more than a tolerance between hours and loads (a record made in a slow hour hid a planted 2x slowdown), so it is
    judged by the paired runs against the recorded commit (_confirm), as one outside tolerance is."""
    return records.run_of(prof, prof["metrics"][v.metric]["run"]).get("inputs_hash") != t.inputs_hash


def recorded_here(prof: dict, inputs_hash: str, now: dict[str, Any]) -> dict:
    """The profile's record as this kind of machine recorded it: each metric whose latest run was made on another
    kind of machine is judged against the newest value in its history that a run on this kind made with the inputs
    as they are now, where there is one (`history_run` names it). A record can so hold one value per processor kind
    (record on each: the newest one is what docs claim), and each kind verifies exactly against its own."""
    runs = {r["id"]: r for r in prof["runs"]}
    metrics = {}
    for name, entry in prof["metrics"].items():
        metrics[name] = entry
        cpu = ("model", "count", "isa") if records.kind_of(entry) == "noisy" else ("model", "isa")
        if other_machine(runs[entry["run"]], now, cpu) is None:
            continue
        for h in reversed(entry.get("history", [])):
            run = runs.get(h["run"])
            if run and run.get("inputs_hash") == inputs_hash and other_machine(run, now, cpu) is None:
                metrics[name] = {**entry, "value": h["value"], "run": h["run"], "history_run": h["run"]}
                break
    return {**prof, "metrics": metrics}


NOT_RECORDED = "the re-run did not record it"


def _judge(v: Verdict, prof: dict, measured: dict[str, float]) -> Verdict:
    if v.metric not in measured:
        return _failed(v, NOT_RECORDED)
    entry = prof["metrics"][v.metric]
    v.measured = measured[v.metric]
    v.change = drift(entry, v.measured)
    v.state = DRIFTED if v.change else FRESH
    if "history_run" in entry:
        v.recorded = entry["value"]
        v.detail = f"against run {entry['history_run']}, recorded on this kind of machine"
    if v.change:
        v.detail = f"measured {v.measured:.6g}, recorded {v.recorded:.6g}" + (f"; {v.detail}" if v.detail else "")
    return v


def other_machine(run_entry: dict, now: dict[str, Any], cpu: tuple[str, ...] = ("model", "count", "isa")) \
        -> str | None:
    """How the machine a run was recorded on differs from this one (processor model, core count, instruction set,
    GPUs), or None: the same kind of machine. A timing is a fact about its machine; an exact number about its
    processor and GPUs (cpu=("model", "isa"): the runbooks fix their thread counts)."""
    then = run_entry.get("provenance") or {}
    out = []
    for key in cpu:
        a, b = (then.get("cpu") or {}).get(key), (now.get("cpu") or {}).get(key)
        if a is not None and b is not None and a != b:
            out.append(f"CPU {key} {a} -> {b}")
    a, b = (then.get("gpu") or {}).get("names"), (now.get("gpu") or {}).get("names")
    if a is not None and b is not None and list(a) != list(b):
        out.append(f"GPUs {', '.join(a) or 'none'} -> {', '.join(b) or 'none'}")
    return "; ".join(out) or None


def _confirm(root: Path, t: Target, prof: dict, drifted: list[Verdict], now: dict[str, Any], progress: bool,
             log) -> None:
    """Judge noisy numbers outside their tolerance, and with changed inputs every noisy number (changed_code). With
    the code and parameters as recorded (the inputs hash
    unchanged) the code cannot explain a drift: MOVED at once (the machine or its environment; exit 0, shown with
    the value and whether the record was made on another kind of machine, other_machine). More runs could only
    choose between moved and fresh, and on 2 cores or a lent GPU each costs minutes. With changed inputs there are
    three measurements against the engine the number was recorded with, as asv's continuous mode compares two
    commits: the recorded commit's tree (A) and this one (B), three pairs on this machine now, and each pair's ratio
    B/A is a vote against the tolerance: a majority outside it in one direction -> drifted, a majority inside ->
    fresh (the machine's factor is noted). No majority -> flaky, which fails as drift does. Without GPUs the pairs
    run side by side (specbook.sidebyside: a shared CPU's pace moves within a minute, by more than a tolerance, and
    runs one after another would compare two moments); with GPUs, A B in turn (two runs on one GPU would time each
    other's kernels), and the last pair is skipped when the two before it already agree (_settled). Without the
    recorded commit's tree (no git history, a shallow clone, a record made with uncommitted changes: recorded_tree),
    B runs twice more against the record, and the detail says why and what that leaves out."""
    name, profile = t.rb.name, t.profile
    run = records.run_of(prof, prof["metrics"][drifted[0].metric]["run"])
    unchanged = run.get("inputs_hash") == t.inputs_hash
    if unchanged:
        elsewhere = other_machine(run, now)
        where = f"recorded on another machine: {elsewhere}" if elsewhere else "recorded on this kind of machine"
        log(f"{name} ({profile}): {len(drifted)} noisy number(s) outside tolerance with the code and parameters as "
            f"recorded ({where}): moved; more runs could only say moved or fresh")
        for v in drifted:
            v.state = MOVED
            v.detail = f"{v.detail}; code and parameters as recorded, {where}"
        return
    a_root, ta, without = recorded_tree(root, t, run)
    if without:
        log(f"{name} ({profile}): not against the recorded commit: {without}")
    side = ta is not None and side_by_side_here()
    commit = str(run["provenance"]["git_commit"]) if ta else ""
    how = (f"side by side with the recorded commit {commit[:10]} (two streams of three runs)" if side else
           f"interleaved with the recorded commit {commit[:10]} (A B, three times)" if ta else
           "twice more against the record")
    outside = sum(v.state == DRIFTED for v in drifted)
    log(f"{name} ({profile}): the code or parameters changed since the record ({outside} of {len(drifted)} noisy "
        f"number(s) outside tolerance); measuring {how}")
    pairs: list[tuple[dict | None, dict | None]] = []
    if side:
        pairs = sidebyside.pairs((a_root, root), name, profile, 3, log)
    else:
        with parallel.exclusive() if ta else contextlib.nullcontext():  # the recorded engine may not keep the lock
            for _ in range(3 if ta else 2):
                a = _measure_or_none(a_root, ta, progress, log) if ta else None
                pairs.append((a, _measure_or_none(root, t, progress, log)))
                if len(pairs) == (2 if ta else 1) and \
                        all(_settled(v, prof["metrics"][v.metric], pairs, ta is not None) for v in drifted):
                    log(f"{name} ({profile}): the runs so far agree; one more could not change the verdict")
                    break
    for v in drifted:
        _rejudge(v, prof["metrics"][v.metric], pairs, ta is not None, "side by side" if side else "interleaved")
        if without:
            v.detail = (f"{v.detail}; not against the recorded commit ({without}): judged against the record "
                        "alone, so a change of this machine's pace since the record counts as the code's")


def _exact_elsewhere(root: Path, t: Target, prof: dict, drifted: list[Verdict], now: dict[str, Any],
                     progress: bool, log) -> None:
    """Judge exact numbers outside their tolerance, or that the re-run did not record (one recorded only for some
    outcomes, e.g. a goal reached), on another kind of processor or GPU than they were recorded on.
    Fixed seeds and thread counts make a number exact on one kind of machine; another rounds differently (oneMKL
    picks its kernels by processor vendor whatever MKL_CBWR says, outside its slow COMPATIBLE mode), and a training
    run carries the rounding to its last step. On the same kind of machine they stay DRIFTED. Elsewhere, with the
    inputs as recorded only the machine can explain it: MOVED (exit 0, shown). With changed inputs the recorded
    commit runs here once and this tree must give its numbers exactly: the same -> MOVED, else DRIFTED."""
    name, profile = t.rb.name, t.profile
    run = records.run_of(prof, prof["metrics"][drifted[0].metric]["run"])
    elsewhere = other_machine(run, now, cpu=("model", "isa"))
    if elsewhere is None:
        return
    where = f"recorded on another machine: {elsewhere}"
    if run.get("inputs_hash") == t.inputs_hash:
        log(f"{name} ({profile}): {len(drifted)} exact number(s) differ or are not recorded with the code and "
            f"parameters as recorded ({where}): moved")
        for v in drifted:
            v.state, v.change = MOVED, None
            v.detail = f"{v.detail}; code and parameters as recorded, {where}"
        return
    a_root, ta, without = recorded_tree(root, t, run)
    a = None
    if ta is not None:
        log(f"{name} ({profile}): {len(drifted)} exact number(s) differ ({where}); running the recorded commit "
            f"{run['provenance']['git_commit'][:10]} here to compare with")
        a = _measure_or_none(a_root, ta, progress, log)
    else:
        log(f"{name} ({profile}): not against the recorded commit: {without}")
    for v in drifted:
        if a is not None and v.measured is None and v.metric not in a:  # neither records it on this processor
            v.state, v.change = MOVED, None
            v.detail = f"{v.detail}; {where}; the recorded commit does not record it here either"
            continue
        if a is None or v.metric not in a:
            why = without or ("its run failed" if a is None else "it records no such number here")
            v.detail = (f"{v.detail}; {where}, and the recorded commit could not be run here to compare with "
                        f"({why}): this processor's rounding cannot be told from a change of the code")
            continue
        if v.measured is None:  # the recorded commit records it here, this tree does not: the code lost it
            v.detail = f"{v.detail}; {where}; the recorded commit records it here ({a[v.metric]:.6g})"
            continue
        entry = {**prof["metrics"][v.metric], "value": a[v.metric]}
        v.change = drift(entry, v.measured)
        v.state = DRIFTED if v.change else MOVED
        same = "differs from" if v.change else "is"
        v.detail = f"{v.detail}; {where}; this tree's value {same} the recorded commit's here ({a[v.metric]:.6g})"


def side_by_side_here() -> bool:
    """Whether A and B run side by side here (see _confirm): on a machine without GPUs."""
    return not provenance.gpus()


def _missing(v: Verdict, pairs: list[tuple[dict | None, dict | None]], against_a: bool) -> bool:
    """Whether a confirming run failed or did not record v's number."""
    return any(b is None or v.metric not in b or against_a and (a is None or v.metric not in a) for a, b in pairs)


def _settled(v: Verdict, entry: dict, pairs: list[tuple[dict | None, dict | None]], against_a: bool) -> bool:
    """Whether the measurements so far decide v's verdict whatever the last run would give: two of three on the
    same side of the tolerance (against the record: the first run and one more; interleaved: two pairs' ratios).
    A failed run decides too (flaky)."""
    if _missing(v, pairs, against_a):
        return True
    if not against_a:
        votes = [drift(entry, x) for x in (v.measured, *(b[v.metric] for _, b in pairs))]
        return len(votes) >= 3 or votes[0] is not None and votes.count(votes[0]) >= 2
    return judge.settled(judge.ratio_votes(_ratios(v, pairs), entry["direction"], entry["tolerance"]["rel"]))


def _ratios(v: Verdict, pairs: list[tuple[dict | None, dict | None]]) -> list[float]:
    """Each pair's ratio B/A of v's metric."""
    return [b[v.metric] / a[v.metric] if a[v.metric] else float("inf") for a, b in pairs]


def _measure_or_none(root: Path, t: Target, progress: bool, log) -> dict[str, float] | None:
    try:
        return _measure(root, t, progress, log)
    except RunFailed as e:
        log(f"{t.rb.name} ({t.profile}): a confirming run failed: {e}")
        return None


def _rejudge(v: Verdict, entry: dict, pairs: list[tuple[dict | None, dict | None]], against_a: bool,
             how: str = "interleaved") -> None:
    """The verdict of one drifted noisy number from its confirming runs (see _confirm); `against_a`: the pairs hold
    the recorded commit's runs (A), measured `how`."""
    if _missing(v, pairs, against_a):
        v.state, v.detail = FLAKY, "a confirming run failed or did not record it"
        return
    first = v.measured
    if not against_a:
        values = [first, *(b[v.metric] for _, b in pairs)]
        v.measured = statistics.median(values)  # of two runs that agree, or of three
        v.detail = f"measured {', '.join(f'{x:.6g}' for x in values)}; recorded {v.recorded:.6g}"
        votes = [drift(entry, x) for x in values]
    else:  # this tree against the recorded commit's, pair by pair
        ratios = _ratios(v, pairs)
        votes = judge.ratio_votes(ratios, entry["direction"], entry["tolerance"]["rel"])
        machine = statistics.median(a[v.metric] for a, _ in pairs) / v.recorded if v.recorded else float("nan")
        v.measured = statistics.median(b[v.metric] for _, b in pairs)
        v.detail = (f"this engine / recorded engine, {how}: {', '.join(f'{r:.3g}' for r in ratios)}; the "
                    f"recorded engine measures {machine:.3g}x its record on this machine now (first run {first:.6g})")
    state, v.change = judge.verdict(votes)
    v.state = {judge.SAME: FRESH, judge.CHANGED: DRIFTED, judge.FLAKY: FLAKY}[state]


def recorded_tree(root: Path, t: Target, run: dict[str, Any]) -> tuple[Path | None, Target | None, str]:
    """The tree of the commit `run` was recorded at and `t`'s runbook resolved in it, or (None, None, why not, in
    words for the verdict's detail). The tree stands for the record only where it reproduces the record's input
    hashes (runbook, parameters, engine code): a run recorded with uncommitted changes (git_dirty) measured code
    that its commit does not hold, and comparing with the commit would call the difference a change."""
    p = run.get("provenance") or {}
    commit = p.get("git_commit")
    if not commit:
        return None, None, "the record names no commit"
    a_root = baseline_tree(root, commit)
    if a_root is None:
        return None, None, provenance.why_no_commit(root, commit) if provenance.verified_commit(root, commit) \
            is None else f"the recorded commit {commit[:10]} could not be extracted"
    try:
        ta = target(a_root, t.rb.name, t.profile)
    except SpecbookError as e:
        return None, None, f"the recorded commit {commit[:10]} cannot run it ({e})"
    if differs := changed_inputs(ta, run):
        dirty = "; it was recorded with uncommitted changes (git_dirty)" if p.get("git_dirty") else ""
        return None, None, (f"the recorded commit {commit[:10]}'s tree does not reproduce the record's "
                            f"{', '.join(differs)} hash{dirty}")
    return a_root, ta, ""


def baseline_tree(root: Path, recorded: Any) -> Path | None:
    """The repository at the commit a record names, extracted once under .specbook/ab/ (its outputs shared with this
    tree's, so dependencies whose inputs are unchanged are not rebuilt); None without git or that commit. The
    record's value is used only once git has verified it as a full commit id (provenance.verified_commit): a record
    field never reaches git as an option nor a path as anything but hex digits."""
    commit = provenance.verified_commit(root, recorded)
    if commit is None:
        return None
    dest = root / ".specbook" / "ab" / commit[:12]
    if (dest / "runbooks").is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    (root / ".specbook" / "outputs").mkdir(parents=True, exist_ok=True)
    # extracted into a directory of this process's own, then moved into place in one step: two verifies at once
    # each extract their copy, one rename wins and the other's copy goes
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        archive = subprocess.run(["git", "archive", "--format=tar", "--end-of-options", commit], cwd=root,
                                 capture_output=True)
        if archive.returncode != 0:
            return None
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        (tmp / ".specbook").mkdir()
        (tmp / ".specbook" / "outputs").symlink_to((root / ".specbook" / "outputs").resolve())
        try:
            tmp.rename(dest)
        except OSError:  # another process's copy is in place (ENOTEMPTY, EEXIST)
            if not (dest / "runbooks").is_dir():
                raise
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _failed(v: Verdict, detail: str) -> Verdict:
    v.state, v.detail, v.change = FAILED, detail, None
    return v


PINNED_DEVICE = "CUDA_VISIBLE_DEVICES"  # which GPU a run had, not how fast: verify pins each child to one, and the
# profile already checks what hardware it is


def environment_changes(run_entry: dict, now: dict[str, Any]) -> list[str]:
    """What differs in the performance-relevant environment between a recorded run and now: package versions,
    NCCL_*/CUDA_*/... variables, sitecustomize/usercustomize (the game plan's team hid NCCL tuning there)."""
    then = run_entry.get("provenance") or {}
    out = []
    for k in sorted(set(then.get("versions", {})) | set(now.get("versions", {}))):
        a, b = then.get("versions", {}).get(k), now.get("versions", {}).get(k)
        if a != b and k != "engine":
            out.append(f"{k} {a} -> {b}")
    isa_then, isa_now = (then.get("cpu") or {}).get("isa"), (now.get("cpu") or {}).get("isa")
    if isa_then and isa_now and isa_then != isa_now:
        out.append(f"CPU instructions {isa_then} -> {isa_now}")
    env_then, env_now = then.get("env", {}) or {}, now.get("env", {}) or {}
    for k in sorted((set(env_then) | set(env_now)) - {PINNED_DEVICE}):
        if env_then.get(k) != env_now.get(k):
            out.append(f"{k}={env_then.get(k, '(unset)')} -> {env_now.get(k, '(unset)')}")
    for mod, s in (now.get("sitecustomize") or {}).items():
        before = (then.get("sitecustomize") or {}).get(mod) or {}
        if (s.get("hash"), s.get("active")) != (before.get("hash"), before.get("active")):
            out.append(f"{mod} {'active' if s.get('active') else 'inactive'} at {s.get('path')} "
                       f"(recorded: {'active' if before.get('active') else 'inactive'})")
    return out
