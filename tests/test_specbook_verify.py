"""Verdicts: drift in both directions and with direction none, stale detection, other profiles, exit codes."""

import datetime as dt
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from specbook import provenance, records
from specbook import verify as verify_module
from specbook.execute import target
from specbook.provenance import canonical, sha
from specbook.record import Metric
from specbook.verify import (CURRENT, DRIFTED, FAILED, FLAKY, FRESH, MOVED, REPORTED, STALE, UNRECORDED, Verdict,
                             age, drift, environment_changes, exit_code, status, verify)
from specbook_testing import baseline, cli, make_repo, runbook_text, write_runbook


def entry(value: float, direction: str, rel: float = 0.0, abs_: float = 0.0) -> dict:
    return {"value": value, "direction": direction, "tolerance": {"rel": rel, "abs": abs_}}


@pytest.mark.parametrize("e, new, expected", [
    (entry(100, "higher", rel=0.1), 109.9, None),
    (entry(100, "higher", rel=0.1), 89, "regression"),
    (entry(100, "higher", rel=0.1), 111, "improvement"),
    (entry(100, "lower", rel=0.1), 111, "regression"),
    (entry(100, "lower", rel=0.1), 89, "improvement"),
    (entry(100, "lower", abs_=20), 119, None),  # the larger of relative and absolute tolerance
    (entry(100, "lower", rel=0.1, abs_=20), 121, "regression"),
    (entry(1.5, "none"), 1.5, None),
    (entry(1.5, "none"), 1.5000001, "changed"),
    (entry(1.5, "none"), 1.4999999, "changed"),
    (entry(0.1 + 0.2, "none"), 0.3, None),  # float noise is not drift
])
def test_drift(e, new, expected):
    assert drift(e, new) == expected


def test_exit_codes():
    v = lambda verdict: Verdict("r", "cpu", "m", verdict)  # noqa: E731
    assert exit_code([v(FRESH), v(STALE), v(CURRENT), v(REPORTED), v(UNRECORDED)]) == 0
    assert exit_code([v(FRESH), v(DRIFTED)]) == 1
    assert exit_code([v(FRESH), v(FLAKY)]) == 1
    assert exit_code([v(DRIFTED), v(FAILED)]) == 3


def test_age():
    now = dt.datetime(2026, 11, 29, 12, tzinfo=dt.timezone.utc)
    assert age("2026-11-26T11:00:00Z", now) == "3d"
    assert age(dt.datetime(2026, 11, 29, 7, 30), now) == "4h"


def _record_current(root: Path, name: str, profile: str = "cpu", value: float = 1.0) -> None:
    """Record a run whose inputs hash is the current one, without executing anything."""
    t = target(root, name, profile)
    kept = {"runbook_hash": sha(t.rb.hashed_source), "params_hash": sha(canonical(t.params)), "engine_hash": t.engine}
    run = {"id": records.new_run_id("2026-11-29T10:00:00Z"), "date": "2026-11-29T10:00:00Z",
           "source": "measured", "inputs_hash": t.inputs_hash, "parameters": t.params, "provenance": kept}
    records.add_run(root, name, profile, run, [Metric("x", value, "u", "higher")])


def _verdicts(vs: list[Verdict]) -> dict:
    return {(v.runbook, v.profile, v.metric): v.state for v in vs}


USES_MODEL = 'from engine.model import *  # noqa: F403 - all of it: every definition is used\nrecord("x", value, unit="u", direction="higher", rel_tol=0.1)'


def test_stale_when_runbook_parameters_or_engine_change(tmp_path):
    root = make_repo(tmp_path, a=runbook_text(body=USES_MODEL),
                     b=runbook_text(profiles="{cpu: {}, h200: {value: 2.0}}", body=USES_MODEL))
    (root / "engine").mkdir()
    (root / "engine" / "model.py").write_text("LAYERS = 2\n")
    _record_current(root, "a")
    _record_current(root, "b", "h200")
    assert _verdicts(status(root)) == {("a", "cpu", "x"): CURRENT, ("b", "h200", "x"): CURRENT}

    write_runbook(root, "b", runbook_text(profiles="{cpu: {}, h200: {value: 3.0}}", body=USES_MODEL))  # h200 only
    assert _verdicts(status(root)) == {("a", "cpu", "x"): CURRENT, ("b", "h200", "x"): STALE}
    assert status(root, ["b"])[0].inputs == "parameters changed"  # the profile's, not code

    write_runbook(root, "a", runbook_text(params="value = 1.0  # a comment is a change too", body=USES_MODEL))
    assert (status(root, ["a"])[0].state, status(root, ["a"])[0].inputs) == (STALE, "runbook changed")

    _record_current(root, "a")
    _record_current(root, "b", "h200")
    (root / "engine" / "model.py").write_text("LAYERS = 3\n")
    assert {(v.state, v.inputs) for v in status(root)} == {(STALE, "engine changed")}


def test_only_the_engine_code_a_runbook_imports_makes_it_stale(tmp_path):
    """engine.model imports engine.rope; engine.serve is used by nobody here; runbook c imports no engine at all."""
    root = make_repo(tmp_path, a=runbook_text(body=USES_MODEL), c=runbook_text())
    (root / "engine").mkdir()
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "model.py").write_text("from engine.rope import THETA\n")
    (root / "engine" / "rope.py").write_text("THETA = 1e4\n")
    (root / "engine" / "serve.py").write_text("PORT = 8000\n")
    _record_current(root, "a")
    _record_current(root, "c")
    (root / "engine" / "serve.py").write_text("PORT = 8001\n")
    assert _verdicts(status(root)) == {("a", "cpu", "x"): CURRENT, ("c", "cpu", "x"): CURRENT}
    (root / "engine" / "rope.py").write_text("THETA = 5e5\n")  # reached through engine.model's own import
    assert _verdicts(status(root)) == {("a", "cpu", "x"): STALE, ("c", "cpu", "x"): CURRENT}


def test_stale_when_upstream_changes(tmp_path):
    root = make_repo(tmp_path, up=runbook_text(), down=runbook_text(extra_header="depends: [up]"))
    _record_current(root, "down")
    assert status(root, ["down"])[0].state == CURRENT
    write_runbook(root, "up", runbook_text(params="value = 2.0"))
    assert (status(root, ["down"])[0].state, status(root, ["down"])[0].inputs) == (STALE, "upstream changed")


def test_status_without_runbook_or_profile(tmp_path):
    root = make_repo(tmp_path, a=runbook_text(profiles="{cpu: {}, h200: {}}"))
    _record_current(root, "a", "h200")
    write_runbook(root, "a", runbook_text(profiles="{cpu: {}}"))  # h200 dropped from the runbook
    v = status(root)[0]
    assert v.state == FAILED and "cannot run on profile h200" in v.detail
    (root / "runbooks" / "a.py").unlink()
    assert "unknown runbook 'a'" in status(root)[0].detail


def test_reported_and_other_profiles_are_not_re_measured_here(tmp_path):
    root = make_repo(tmp_path, a=runbook_text(profiles="{cpu: {}, h200: {}}"))
    _record_current(root, "a", "h200", value=227.0)
    run = {"id": "r1", "date": "2026-11-01T00:00:00Z", "source": "reported", "provenance": {"reported_by": "x"}}
    records.add_run(root, "k25", "8x-rtx-pro-6000", run, [Metric("tok_s", 82.5, "tok/s", "higher")])
    vs = verify(root, "cpu", progress=False, log=lambda m: None)  # nothing here to run: no execution
    assert _verdicts(vs) == {("a", "h200", "x"): CURRENT, ("k25", "8x-rtx-pro-6000", "tok_s"): REPORTED}
    assert {v.label for v in vs} == {"current (h200 only)", "reported"} and not any(v.here for v in vs)
    assert verify(root, "cpu", profile="h200", progress=False, log=lambda m: None)[0].recorded == 227.0
    assert exit_code(vs) == 0


def test_an_unknown_profile_is_bad_input(tmp_path):
    root = make_repo(tmp_path, a=runbook_text())
    r = cli(root, "verify", "--profile", "cpu.typo")
    assert r.exit_code == 2 and "unknown profile 'cpu.typo'" in r.stderr and "cpu" in r.stderr


def sequence_runbook(direction: str) -> str:
    """Each run records the next number of seq.txt: a machine whose timings have good and bad moments."""
    body = f"""
        import pathlib
        seq = pathlib.Path("seq.txt").read_text().split()
        pathlib.Path("seq.txt").write_text(" ".join(seq[1:]))
        record("x", float(seq[0]), unit="ms", direction="{direction}", rel_tol={0.1 if direction != "none" else 0})
    """
    return runbook_text(body=body)


@pytest.mark.parametrize("direction,runs,changed,state,left", [
    ("lower", "1.05", False, FRESH, ""),  # within tolerance: one run
    ("lower", "3.0 2.9 2.8", False, MOVED, "2.9 2.8"),  # code as recorded: the machine moved, exit 0, and more
    # runs could only say moved or fresh: none is made
    ("lower", "3.0 2.9 2.8", True, DRIFTED, "2.8"),  # changed code (no git here): two runs drift, the third is moot
    ("lower", "3.0 1.05 0.5", True, FLAKY, ""),  # changed code, no two runs agree: neither verdict can be trusted
    ("none", "3.0 1.0", False, DRIFTED, "1.0"),  # an exact number: no second run
])
def test_a_drifted_noisy_number_with_changed_code_gets_three_measurements(tmp_path, direction, runs, changed, state, left):
    root = make_repo(tmp_path, seq=sequence_runbook(direction))
    (root / "seq.txt").write_text("1.0")
    assert cli(root, "run", "seq", "--record").exit_code == 0
    if changed:
        write_runbook(root, "seq", sequence_runbook(direction) + "# changed since recorded\n")
    (root / "seq.txt").write_text(runs)
    logged = []
    [v] = verify(root, "cpu", progress=False, log=logged.append)
    assert (v.state, (root / "seq.txt").read_text()) == (state, left)
    used = runs.split()[:len(runs.split()) - len(left.split())]
    if len(used) > 1:
        assert f"measured {', '.join(f'{float(x):g}' for x in used)};" in v.detail
        assert any(("code and parameters as recorded" in m) != changed for m in logged if "measuring" in m)
    assert exit_code([v]) == (1 if state in (FLAKY, DRIFTED) else 0)


@pytest.mark.parametrize("machine,state,left", [
    ("Another CPU 9000", MOVED, "2.9 2.8"),  # recorded elsewhere: its timing is that machine's, no confirming run
    (None, MOVED, "2.9 2.8"),  # the same kind of machine: moved too, said to be this kind
])
def test_a_timing_recorded_on_another_machine_moves_without_confirming_runs(tmp_path, monkeypatch, machine, state,
                                                                            left):
    root = make_repo(tmp_path, seq=sequence_runbook("lower"))
    (root / "seq.txt").write_text("1.0")
    assert cli(root, "run", "seq", "--record").exit_code == 0
    if machine:
        monkeypatch.setattr(provenance, "cpu_model", lambda: machine)
    (root / "seq.txt").write_text("3.0 2.9 2.8")
    logged = []
    [v] = verify(root, "cpu", progress=False, log=logged.append)
    assert (v.state, (root / "seq.txt").read_text()) == (state, left)
    assert ("recorded on another machine: CPU model" in v.detail) == bool(machine)
    assert ("recorded on this kind of machine" in v.detail) != bool(machine)
    assert (f"-> {machine}" in v.detail) == bool(machine)
    assert exit_code([v]) == 0


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=root, check=True,
                   capture_output=True)


def recorded_in_git(tmp_path: Path, name: str, runbook: str, engine: str) -> Path:
    """A repository whose runbook NAME imports engine/NAME.py (holding `engine`), committed, then recorded."""
    root = make_repo(tmp_path, **{name: runbook})
    (root / "engine").mkdir()
    (root / "engine" / f"{name}.py").write_text(engine)
    (root / ".gitignore").write_text(".specbook/\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "engine")
    assert cli(root, "run", name, "--record").exit_code == 0
    return root


SPEED_RUNBOOK = runbook_text(body="""
    import os
    from engine.speed import MS
    record("x", MS * float(os.environ.get("MACHINE_FACTOR", "1")), unit="ms", direction="lower", rel_tol=0.1)
""")


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("engine_ms,machine,state", [
    ("2.0", "1", DRIFTED),  # the engine got slower: this tree against the recorded commit's, three times
    ("2.0 / 2", "2", FRESH),  # the engine changed (same value), the machine got slower: the recorded engine is too
])
def test_a_drifted_noisy_number_is_judged_against_the_recorded_commit(tmp_path, monkeypatch, engine_ms, machine,
                                                                       state, gpu):
    root = recorded_in_git(tmp_path, "speed", SPEED_RUNBOOK, "MS = 1.0\n")
    (root / "engine" / "speed.py").write_text(f"MS = {engine_ms}\n")
    monkeypatch.setenv("MACHINE_FACTOR", machine)
    monkeypatch.setattr(verify_module, "side_by_side_here", lambda: not gpu)
    logged = []
    [v] = verify(root, "cpu", progress=False, log=logged.append)
    how = "interleaved" if gpu else "side by side"
    assert any(f"{how} with the recorded commit" in m for m in logged), logged
    assert v.state == state, v.detail
    assert f"recorded engine measures {float(machine):.3g}x its record" in v.detail
    if state == DRIFTED:  # in turn, two pairs that agree make a third moot; side by side all three run at once
        assert v.change == "regression" and f"{how}: {'2, 2' if gpu else '2, 2, 2'};" in v.detail


FAILS_AS_A = runbook_text(body="""
    import os
    from engine.speed import MS
    assert "/.specbook/ab/" not in os.getcwd(), "the recorded commit's tree cannot run here"
    record("x", MS, unit="ms", direction="lower", rel_tol=0.1)
""")


@pytest.mark.parametrize("gpu", [False, True])
def test_a_failed_run_of_the_recorded_commit_makes_a_changed_timing_flaky(tmp_path, monkeypatch, gpu):
    """Not a verdict against the record in its place: the pairs are what the number is judged by."""
    root = recorded_in_git(tmp_path, "speed", FAILS_AS_A, "MS = 1.0\n")
    (root / "engine" / "speed.py").write_text("MS = 2.0\n")
    monkeypatch.setattr(verify_module, "side_by_side_here", lambda: not gpu)
    logged = []
    [v] = verify(root, "cpu", progress=False, log=logged.append)
    assert (v.state, v.detail) == (FLAKY, "a confirming run failed or did not record it"), logged
    assert any("cannot run here" in m for m in logged), logged
    assert exit_code([v]) == 1


TIMED_RUNBOOK = runbook_text(body="""
    import os, time
    from engine.speed import MS
    start = time.time()
    time.sleep(2.5 * MS)  # longer than a notebook's start varies on a busy 2-core machine; this tree's twice A's
    with open(os.environ["RUN_LOG"], "a") as f:
        f.write(f"{os.getcwd()} {start} {time.time()}\\n")
    record("x", MS, unit="ms", direction="lower", rel_tol=0.1)
""")


def test_side_by_side_the_recorded_commit_and_this_tree_run_at_once(tmp_path, monkeypatch):
    """What makes the pairs robust to a shared CPU's pace: A's k-th run and B's k-th run overlap in time. Each pair
    starts together, so the streams do not drift apart run by run, also when this tree's runs take twice as long."""
    runs = tmp_path / "runs.log"
    monkeypatch.setenv("RUN_LOG", str(runs))
    root = recorded_in_git(tmp_path / "repo", "speed", TIMED_RUNBOOK, "MS = 1.0\n")
    (root / "engine" / "speed.py").write_text("MS = 2.0\n")
    monkeypatch.setattr(verify_module, "side_by_side_here", lambda: True)
    [v] = verify(root, "cpu", progress=False, log=lambda m: None)
    assert (v.state, v.change) == (DRIFTED, "regression"), v.detail
    spans: dict[str, list[tuple[float, float]]] = {}
    for line in runs.read_text().splitlines()[2:]:  # after the recording run and verify's first run of this tree
        where, start, end = line.rsplit(" ", 2)
        spans.setdefault("B" if Path(where) == root else "A", []).append((float(start), float(end)))
    assert len(spans["A"]) == len(spans["B"]) == 3, spans
    for (a0, a1), (b0, b1) in zip(spans["A"], spans["B"]):
        assert a0 < b1 and b0 < a1, spans  # the k-th runs overlap


@pytest.mark.parametrize("engine_ms,state", [
    ("1.9", DRIFTED),  # a slowdown inside the tolerance of a record made on a busier day
    ("2.0 / 2", FRESH),  # changed code that is as fast: the recorded engine measures the same
])
def test_with_changed_code_a_timing_within_tolerance_is_judged_against_the_recorded_commit(tmp_path, monkeypatch,
                                                                                          engine_ms, state):
    monkeypatch.setenv("MACHINE_FACTOR", "2")  # recorded while the machine ran at half its pace
    root = recorded_in_git(tmp_path, "speed", SPEED_RUNBOOK, "MS = 1.0\n")
    monkeypatch.setenv("MACHINE_FACTOR", "1")
    monkeypatch.setattr(verify_module, "side_by_side_here", lambda: True)
    (root / "engine" / "speed.py").write_text(f"MS = {engine_ms}\n")
    logged = []
    [v] = verify(root, "cpu", progress=False, log=logged.append)
    assert any("side by side with the recorded commit" in m for m in logged), logged
    assert v.state == state, v.detail
    assert exit_code([v]) == (1 if state == DRIFTED else 0)


def test_with_the_code_as_recorded_a_timing_within_tolerance_takes_one_run(tmp_path, monkeypatch):
    root = recorded_in_git(tmp_path, "speed", SPEED_RUNBOOK, "MS = 1.0\n")
    logged = []
    [v] = verify(root, "cpu", progress=False, log=logged.append)
    assert v.state == FRESH and not any("interleaved" in m for m in logged)


EXACT_RUNBOOK = runbook_text(body="""
    import os
    from engine.loss import LOSS
    record("loss", LOSS + float(os.environ.get("ROUNDING", "0")), unit="nats", direction="lower", kind="exact")
""")


@pytest.mark.parametrize("engine,elsewhere,state", [
    ("LOSS = 2.0\n", False, DRIFTED),  # the same kind of machine: an exact number must reproduce
    ("LOSS = 2.0\n", True, MOVED),  # another processor, the code as recorded: its rounding, not the code
    ("LOSS = 4.0 / 2\n", True, MOVED),  # changed code, another processor: the recorded commit agrees here
    ("LOSS = 2.5\n", True, DRIFTED),  # changed code that changes the number: the recorded commit disagrees here
])
def test_an_exact_number_on_another_processor_is_judged_against_the_recorded_commit(tmp_path, monkeypatch, engine,
                                                                                     elsewhere, state):
    root = recorded_in_git(tmp_path, "loss", EXACT_RUNBOOK, "LOSS = 2.0\n")
    (root / "engine" / "loss.py").write_text(engine)
    monkeypatch.setenv("ROUNDING", "0.001")  # this machine's math rounds otherwise
    if elsewhere:
        monkeypatch.setattr(provenance, "cpu_model", lambda: "Another CPU 9000")
    logged = []
    [v] = verify(root, "cpu", progress=False, log=logged.append)
    assert v.state == state, v.detail
    assert ("recorded on another machine: CPU model" in v.detail) == elsewhere
    assert any("running the recorded commit" in m for m in logged) == (elsewhere and "2.0\n" not in engine)
    if elsewhere and state == DRIFTED:
        assert "differs from the recorded commit's here (2.001)" in v.detail
    assert exit_code([v]) == (1 if state == DRIFTED else 0)


GOAL_RUNBOOK = runbook_text(body="""
    import os
    from engine.loss import LOSS, GOAL
    loss = LOSS + float(os.environ.get("ROUNDING", "0"))
    record("loss", loss, unit="nats", direction="lower", kind="exact")
    if loss <= GOAL:  # recorded only when reached, as drift-dial's samples_to_recover
        record("reached", loss, unit="nats", direction="lower", kind="exact")
""")


@pytest.mark.parametrize("engine,rounding,elsewhere,state", [
    ("LOSS, GOAL = 2.0, 2.0\n", "0.001", False, FAILED),  # the same kind of machine: the number must come back
    ("LOSS, GOAL = 2.0, 2.0\n", "0.001", True, MOVED),  # another processor, the code as recorded: its rounding
    ("LOSS, GOAL = 4.0 / 2, 2.0\n", "0.001", True, MOVED),  # changed code; the recorded commit misses it here too
    ("LOSS, GOAL = 2.0, 1.99\n", "-0.001", True, FAILED),  # changed code; the recorded commit records it here
])
def test_an_exact_number_a_run_on_another_processor_does_not_record(tmp_path, monkeypatch, engine, rounding,
                                                                     elsewhere, state):
    root = recorded_in_git(tmp_path, "loss", GOAL_RUNBOOK, "LOSS, GOAL = 2.0, 2.0\n")
    (root / "engine" / "loss.py").write_text(engine)
    monkeypatch.setenv("ROUNDING", rounding)  # this machine's math rounds otherwise
    if elsewhere:
        monkeypatch.setattr(provenance, "cpu_model", lambda: "Another CPU 9000")
    verdicts = {v.metric: v for v in verify(root, "cpu", progress=False, log=lambda m: None)}
    v = verdicts["reached"]
    assert v.state == state, v.detail
    assert "did not record it" in v.detail
    if state == FAILED and elsewhere:
        assert "the recorded commit records it here (1.999)" in v.detail
    assert ("recorded on another machine: CPU model" in v.detail) == elsewhere
    assert exit_code(list(verdicts.values())) == (3 if state == FAILED else 0)
    if elsewhere:  # the table shows it, though it has no measured value
        monkeypatch.setattr("specbook.cli.verify", lambda *a, **k: list(verdicts.values()))
        shown = cli(root, "verify", "loss").output
        assert re.search(rf"reached\s+{state}\b", shown), shown


@pytest.mark.parametrize("rounding,state", [("0.001", FRESH), ("0.002", DRIFTED)])
def test_each_kind_of_processor_verifies_against_the_value_it_recorded(tmp_path, monkeypatch, rounding, state):
    """Recorded on an AMD machine, then on an Intel one (the newest value, what docs claim): back on AMD the number
    is judged exactly against AMD's own value, not moved for being another machine's."""
    root = make_repo(tmp_path, loss=EXACT_RUNBOOK)
    (root / "engine").mkdir()
    (root / "engine" / "loss.py").write_text("LOSS = 2.0\n")
    monkeypatch.setattr(provenance, "cpu_model", lambda: "AMD EPYC")
    monkeypatch.setenv("ROUNDING", "0.001")
    assert cli(root, "run", "loss", "--record").exit_code == 0
    monkeypatch.setattr(provenance, "cpu_model", lambda: "Intel Xeon")
    monkeypatch.setenv("ROUNDING", "0.003")
    assert cli(root, "run", "loss", "--record").exit_code == 0
    assert baseline(root, "loss")["profiles"]["cpu"]["metrics"]["loss"]["value"] == 2.003
    monkeypatch.setattr(provenance, "cpu_model", lambda: "AMD EPYC")
    monkeypatch.setenv("ROUNDING", rounding)
    [v] = verify(root, "cpu", progress=False, log=lambda m: None)
    assert (v.state, v.recorded) == (state, 2.001), v.detail
    assert "recorded on this kind of machine" in v.detail
    assert exit_code([v]) == (1 if state == DRIFTED else 0)
    shown = cli(root, "run", "loss").output  # the main job's conclusion: this machine's own committed value
    assert "the committed record was made on this kind of machine (AMD EPYC" in shown, shown
    assert ("within tolerance" in shown) == (state == FRESH)


def test_environment_changes_name_what_moved():
    then = {"provenance": {"versions": {"torch": "2.13.0"}, "env": {"NCCL_P2P_LEVEL": "SYS"},
                           "sitecustomize": {"sitecustomize": {"active": False, "hash": None, "path": None}}}}
    now = {"versions": {"torch": "2.14.0"}, "env": {},
           "sitecustomize": {"sitecustomize": {"active": True, "hash": "ab", "path": "/x/sitecustomize.py"}}}
    got = environment_changes(then, now)
    assert got == ["torch 2.13.0 -> 2.14.0", "NCCL_P2P_LEVEL=SYS -> (unset)",
                   "sitecustomize active at /x/sitecustomize.py (recorded: inactive)"]
    assert environment_changes(then, {**then["provenance"]}) == []
    pinned = {**then["provenance"], "env": {**then["provenance"]["env"], "CUDA_VISIBLE_DEVICES": "1"}}
    assert environment_changes(then, pinned) == []  # verify pins each child to a GPU: not a change of environment


def test_verify_re_measures_instead_of_reading_back_cached_outputs(tmp_path):
    """A runbook may reuse its outputs directory (a finished training run is read back, not redone): verify must
    measure from nothing, or a cached result would be called fresh."""
    body = '''
        from pathlib import Path
        cached = Path(outputs_dir) / "result"
        if not cached.exists():
            cached.write_text(str(value))  # "training"
        record("y", float(cached.read_text()), unit="n", direction="none", kind="exact")
    '''
    root = make_repo(tmp_path, a=runbook_text(params='value = 1.0\noutputs_dir = ""', body=body))
    assert cli(root, "run", "a", "--record").exit_code == 0
    (cache,) = (root / ".specbook" / "outputs" / "a" / "cpu").glob("*/result")
    cache.write_text("7")  # what a stale or tampered cache would hand back
    r = cli(root, "verify", "a")
    assert r.exit_code == 0 and "fresh" in r.output, r.output


def test_verify_re_measures_a_dependency_once_before_its_dependents(tmp_path):
    """`a` sorts before `z`, its dependency: in name order z would be built for a, then again for its own verdict."""
    counted = 'import pathlib\np = pathlib.Path("{0}.count")\np.write_text(p.read_text() + "x" if p.exists() else "x")'
    root = make_repo(tmp_path, z=runbook_text(body=counted.format("z") + '\nrecord("x", 1.0, unit="u", kind="exact")'),
                     a=runbook_text(extra_header="depends: [z]", params="upstream = {}",
                                    body=counted.format("a") + '\nrecord("y", 2.0, unit="u", kind="exact")'))
    assert cli(root, "run", "a", "--record").exit_code == 0 and cli(root, "run", "z", "--record").exit_code == 0
    for name in "az":
        (root / f"{name}.count").unlink()
    shutil.rmtree(root / ".specbook" / "outputs")  # a clean checkout: nothing built yet
    logged = []
    vs = verify(root, "cpu", progress=False, log=logged.append)
    assert [(v.runbook, v.state) for v in vs] == [("a", FRESH), ("z", FRESH)]  # reported in name order
    assert (root / "z.count").read_text() == "x" and (root / "a.count").read_text() == "x"
    ran = [m for m in logged if m.startswith("running ")]
    assert [m.split()[1] for m in ran] == ["z", "a"]


def committed_repo(root: Path) -> str:
    """`root` (a make_repo) as a git repository with one commit; returns the commit."""
    (root / ".gitignore").write_text(".specbook/\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "x")
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize("recorded", ["--output=NOTES.md", "../../../vic", "HEAD", "HEAD~0", "0" * 40, "-h",
                                      None, 40])
def test_the_recorded_commits_tree_is_taken_only_for_a_commit_git_verifies(tmp_path, recorded):
    """A record's git_commit is an input: `--output=NOTES.md` once reached `git archive` as an option (truncating a
    file) and `../../../vic` became a path whose `.tmp` sibling outside the repository was deleted."""
    root = make_repo(tmp_path / "repo", a=runbook_text())
    (root / "NOTES.md").write_text("notes\n")
    head = committed_repo(root)
    outside = tmp_path / "vic.tmp"
    outside.mkdir()
    (outside / "keep").write_text("keep\n")
    assert verify_module.baseline_tree(root, recorded) is None
    assert (root / "NOTES.md").read_text() == "notes\n" and (outside / "keep").read_text() == "keep\n"
    assert not (root / ".specbook" / "ab").exists() and not (tmp_path / "vic").exists()
    assert verify_module.baseline_tree(root, head) == root / ".specbook" / "ab" / head[:12]


def test_a_record_naming_no_commit_is_refused_by_name(tmp_path):
    """The same record through the command: one line naming the file and the field, exit 2, nothing touched."""
    root = make_repo(tmp_path / "repo", a=runbook_text(), b=runbook_text())
    (root / "NOTES.md").write_text("notes\n")
    committed_repo(root)
    _record_current(root, "a")
    _record_current(root, "b")
    data = baseline(root, "a")
    data["profiles"]["cpu"]["runs"][0]["provenance"]["git_commit"] = "--output=NOTES.md"
    (root / "baselines" / "a.yaml").write_text(yaml.safe_dump(data))
    r = cli(root, "verify", "a")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert "baselines/a.yaml: profiles.cpu.runs[0].provenance.git_commit: must be a commit id" in r.stderr
    assert (root / "NOTES.md").read_text() == "notes\n"
    listed = cli(root, "list")
    assert listed.exit_code == 2 and "cpu: current" in listed.stdout  # b is still shown


EXTRACT = """
import sys, time
from pathlib import Path
from specbook.verify import baseline_tree
root, commit, start = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
time.sleep(max(0.0, start - time.time()))  # every process extracts at the same moment
print(baseline_tree(root, commit))
"""


def test_verifies_at_once_extract_the_recorded_commit_once_and_leave_nothing_behind(tmp_path):
    """Two verifies that need the recorded commit's tree at once once failed (`Directory not empty`,
    `FileExistsError`) and left a `.tmp` directory."""
    root = make_repo(tmp_path, a=runbook_text())
    for i in range(300):  # enough files that the extractions overlap
        (root / "runbooks" / f"data{i}.txt").write_text("x" * 1000)
    head = committed_repo(root)
    start = time.time() + 8  # after every process has imported specbook
    procs = [subprocess.Popen([sys.executable, "-c", EXTRACT, str(root), head, str(start)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    dest = root / ".specbook" / "ab" / head[:12]
    assert [(p.returncode, out.strip()) for p, (out, _) in zip(procs, outs)] == [(0, str(dest))] * 4, outs
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]  # no temporary directory left
    assert len(list((dest / "runbooks").glob("data*.txt"))) == 300


def test_in_a_shallow_clone_the_verdict_says_the_recorded_commit_is_missing(tmp_path, monkeypatch):
    """`git clone --depth 1` has no recorded commit to compare with: the verdict is then against the record alone,
    which the detail says, with what would bring the commit."""
    root = recorded_in_git(tmp_path / "repo", "speed", SPEED_RUNBOOK, "MS = 1.0\n")
    (root / "engine" / "speed.py").write_text("MS = 2.0 / 2\n")  # refactored: the same number
    git(root, "add", "-A")
    git(root, "commit", "-qm", "refactor")
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{root}", "clone")
    monkeypatch.setattr(verify_module, "side_by_side_here", lambda: False)
    logged = []
    [v] = verify(tmp_path / "clone", "cpu", progress=False, log=logged.append)
    assert v.state == FRESH
    assert "is missing from this shallow clone (`git fetch --unshallow` fetches the history)" in v.detail, v.detail
    assert "judged against the record alone" in v.detail and not any("interleaved" in m for m in logged)


def test_a_record_made_with_uncommitted_changes_is_not_judged_against_its_clean_commit(tmp_path, monkeypatch):
    """Recorded with the engine slowed down but not committed (git_dirty): the commit's tree runs the faster engine,
    and against it an unchanged measurement read "drifted (regression)"."""
    root = make_repo(tmp_path, speed=SPEED_RUNBOOK)
    (root / "engine").mkdir()
    (root / "engine" / "speed.py").write_text("MS = 1.0\n")
    committed_repo(root)
    (root / "engine" / "speed.py").write_text("MS = 2.0\n")  # measured, never committed
    assert cli(root, "run", "speed", "--record").exit_code == 0
    assert baseline(root, "speed")["profiles"]["cpu"]["runs"][0]["provenance"]["git_dirty"] is True
    (root / "engine" / "speed.py").write_text("MS = 4.0 / 2\n")  # refactored: the same number
    monkeypatch.setattr(verify_module, "side_by_side_here", lambda: False)
    logged = []
    [v] = verify(root, "cpu", progress=False, log=logged.append)
    assert (v.state, v.change) == (FRESH, None), v.detail
    assert "tree does not reproduce the record's engine hash; it was recorded with uncommitted changes" in v.detail
    assert not any("interleaved" in m for m in logged), logged
