"""Verdicts on recorded numbers: fresh, stale, drifted (regression / improvement / changed), not verifiable here,
failed. `status` compares input hashes only; `verify` re-runs what can run here and compares with tolerance."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specbook import RunFailed, SpecbookError, provenance, records
from specbook.execute import Target, run, target
from specbook.provenance import canonical, sha
from specbook.runbooks import check_name, discover, load

FRESH, STALE, DRIFTED, ELSEWHERE, FAILED, UNRECORDED = (
    "fresh", "stale", "drifted", "not verifiable here", "failed", "unrecorded")
INVALID = "invalid record"  # status: the record file is malformed (detail: the one-line error)


@dataclass
class Verdict:
    runbook: str
    profile: str
    metric: str
    verdict: str
    recorded: float | None = None
    measured: float | None = None
    unit: str = ""
    change: str | None = None  # drifted: regression | improvement | changed (direction none)
    age: str = ""  # how old the recorded number is
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def exit_code(verdicts: list[Verdict]) -> int:
    """3 when something failed, else 1 when something drifted, else 0."""
    kinds = {v.verdict for v in verdicts}
    return 3 if FAILED in kinds else 1 if DRIFTED in kinds else 0


def drift(entry: dict[str, Any], value: float) -> str | None:
    """None within tolerance (max of relative and absolute), else regression / improvement / changed."""
    recorded = entry["value"]
    tol = entry.get("tolerance", {})
    allowed = max(tol.get("rel", 0.0) * abs(recorded), tol.get("abs", 0.0))
    delta = value - recorded
    if abs(delta) <= allowed + 1e-12 * max(1.0, abs(recorded)):  # float noise is not drift
        return None
    if entry["direction"] == "none":
        return "changed"
    return "improvement" if (delta > 0) == (entry["direction"] == "higher") else "regression"


def age(date: Any, now: dt.datetime | None = None) -> str:
    seconds = ((now or dt.datetime.now(dt.timezone.utc)) - records.parse_date(date)).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(int(seconds), 0)}s"


def _names(root: Path, names: list[str] | None) -> list[str]:
    if names:
        for n in names:
            check_name(n)  # before any path is built from it
            if not records.path_for(root, n).exists():
                load(root, n)  # unknown names fail here with suggestions
        return list(names)
    return sorted(set(discover(root)) | {p.stem for p in (root / records.BASELINES).glob("*.yaml")})


def _current(root: Path, name: str, profile: str, cache: dict) -> Target | Exception:
    key = (name, profile)
    if key not in cache:
        try:
            cache[key] = target(root, name, profile)
        except SpecbookError as e:  # runbook gone, profile dropped, input unavailable: reported, not raised
            cache[key] = e
    return cache[key]


def why_stale(t: Target, run: dict[str, Any]) -> str:
    """Which inputs changed since `run`, from the hashes its provenance kept."""
    p = run.get("provenance", {})
    now = {"runbook": sha(t.rb.hashed_source), "parameters": sha(canonical(t.params)), "engine": t.engine}
    then = {"runbook": p.get("runbook_hash"), "parameters": p.get("params_hash"), "engine": p.get("engine_hash")}
    changed = [k for k in now if now[k] != then[k]]
    changed += [f"input {i}" for i, h in t.inputs.items() if p.get(f"{i}_manifest") != h]
    return ", ".join(changed or ["upstream"]) + " changed since it was recorded"


def _static(root: Path, name: str, profile: str, prof: dict, here: str | None, cache: dict) -> list[Verdict]:
    """Verdicts without running: reported or other-hardware numbers, and fresh/stale by inputs hash."""
    out = []
    for mname, entry in prof["metrics"].items():
        r = records.run_of(prof, entry["run"])
        v = Verdict(name, profile, mname, FRESH, entry["value"], None, entry["unit"], age=age(r["date"]))
        if r["source"] == "reported":
            v.verdict, v.detail = ELSEWHERE, "reported, never re-run"
        elif here is not None and not provenance.runs_here(profile, here):
            v.verdict, v.detail = ELSEWHERE, f"profile {profile}, this machine is {here}"
        else:
            t = _current(root, name, profile, cache)
            if isinstance(t, Exception):
                v.verdict, v.detail = FAILED, str(t)
            elif t.inputs_hash != r["inputs_hash"]:
                v.verdict, v.detail = STALE, why_stale(t, r)
        out.append(v)
    return out


def status(root: Path, names: list[str] | None = None) -> list[Verdict]:
    """Fresh or stale for every recorded number of every profile; hashes only, nothing runs."""
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
            out += _static(root, name, profile, prof, None, cache)
    return out


def verify(root: Path, here: str, names: list[str] | None = None, profile: str | None = None,
           progress: bool = True, log=print) -> list[Verdict]:
    """Re-run every runbook with measured numbers on this machine's profile and compare; report the others."""
    out, cache = [], {}
    for name in _names(root, names):
        rf = records.load(records.path_for(root, name))
        for pname, prof in rf.data["profiles"].items():
            if profile is not None and pname != profile:
                continue
            static = _static(root, name, pname, prof, here, cache)
            if not provenance.runs_here(pname, here) or all(v.verdict in (ELSEWHERE, FAILED) for v in static):
                out += static
                continue
            out += _rerun(root, name, pname, prof, static, progress, log)
        if not rf.data["profiles"] and (profile in (None, here)):
            out.append(Verdict(name, here, "-", UNRECORDED))
    return out


def _measure(root: Path, t: Target, progress: bool, log) -> dict[str, float]:
    return {m.name: m.value for m in run(root, t, record=False, progress=progress, log=log)[-1].execution.metrics}


def _rerun(root: Path, name: str, profile: str, prof: dict, static: list[Verdict], progress: bool,
           log) -> list[Verdict]:
    try:
        t = target(root, name, profile)
        measured = _measure(root, t, progress, log)
    except RunFailed as e:
        return [_with(v, FAILED, str(e)) if v.verdict != ELSEWHERE else v for v in static]
    now = t.all_inputs()
    out = []
    for v in static:
        if v.verdict == ELSEWHERE:
            out.append(v)
        elif v.metric not in measured:
            out.append(_with(v, FAILED, "the re-run did not record it"))
        else:
            v.measured = measured[v.metric]
            moved = changed_inputs(records.run_of(prof, prof["metrics"][v.metric]["run"]), now)
            if moved:  # another corpus measures something else: no verdict on the number, only that it is old
                v.verdict = STALE
                v.detail = (f"{', '.join(moved)} differs from the recorded run's (another Python or package set): "
                            "re-record on this machine to verify")
                out.append(v)
                continue
            v.change = drift(prof["metrics"][v.metric], v.measured)
            out.append(_with(v, DRIFTED, v.change) if v.change else v)
    _confirm(root, t, prof, [v for v in out if v.verdict == DRIFTED], progress, log)
    return out


def _confirm(root: Path, t: Target, prof: dict, drifted: list[Verdict], progress: bool, log) -> None:
    """Timings on shared machines have bad moments: a rate or time (a number with a direction) that drifted is
    measured once more, and stays drifted only if the second run drifts too. Numbers without a direction (accept
    length, exact match) are exact, and a second run would only repeat them."""
    if not any(prof["metrics"][v.metric]["direction"] != "none" for v in drifted):
        return
    log(f"{t.rb.name} ({t.profile}): {len(drifted)} number(s) drifted; running it once more to tell a change "
        "from a noisy moment")
    try:
        again = _measure(root, t, progress, log)
    except RunFailed as e:
        log(f"{t.rb.name} ({t.profile}): the second run failed ({e}); the first run's verdicts stand")
        return
    for v in drifted:
        second = again.get(v.metric)
        if second is None:
            continue
        if drift(prof["metrics"][v.metric], second):
            v.detail += f"; a second run drifted too ({second:.6g})"
        else:
            first, v.measured, v.change = v.measured, second, None
            v.verdict, v.detail = FRESH, f"within tolerance on a second run (the first measured {first:.6g})"


def changed_inputs(run_entry: dict, now: dict[str, str]) -> list[str]:
    """Declared inputs (e.g. the corpus, gathered from this machine) whose fingerprint differs from the run's."""
    prov = run_entry.get("provenance") or {}
    return [n for n, h in sorted(now.items()) if prov.get(f"{n}_manifest") not in (None, h)]


def _with(v: Verdict, verdict: str, detail: str) -> Verdict:
    # a stale record that also drifted says both
    stale = f"; {v.detail}" if v.verdict == STALE else ""
    v.verdict, v.detail = verdict, detail + stale
    return v
