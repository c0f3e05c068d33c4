"""`runbook` end to end on throwaway repositories: papermill runs, records, verdicts, bad input and exit codes."""

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specbook import provenance
from specbook_testing import baseline, cli, make_repo, runbook_text, write_runbook

FROM_FILE = runbook_text(params='direction = "higher"', body="""
    value = float(open("value.txt").read())  # runbooks run with the repository root as working directory
    record("x", value, unit="tok/s", direction=direction, rel_tol=0.1)
""")


@pytest.fixture(autouse=True)
def cpu_machine(monkeypatch):
    monkeypatch.setattr(provenance, "detect_profile", lambda: "cpu")


def _one_line_error(result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    for f in fragments:
        assert f in lines[-1], lines[-1]


def test_help_documents_exit_codes():
    r = cli(Path("."), "--help")
    assert r.exit_code == 0 and "Exit codes" in r.stdout and "could not run" in r.stdout


def test_run_records_publishes_and_verifies(tmp_path, monkeypatch):
    from specbook import claims

    refreshed = []
    monkeypatch.setattr(claims, "refresh_docs", lambda root, names: refreshed.append(list(names)) or [])
    root = make_repo(tmp_path, bench=FROM_FILE)
    (root / "value.txt").write_text("100")
    r = cli(root, "run", "--record", "bench")
    assert r.exit_code == 0, r.stderr
    assert refreshed == [["bench"]]  # docs claims follow the new record
    assert "bench" in r.stdout and "100" in r.stdout and "new" in r.stdout
    rec = baseline(root, "bench")["profiles"]["cpu"]
    assert rec["metrics"]["x"]["value"] == 100.0 and rec["runs"][0]["source"] == "measured"
    assert {"git_commit", "engine_hash", "versions", "gpu", "env", "sitecustomize"} <= set(rec["runs"][0]["provenance"])
    assert json.loads((root / "docs/runbooks/executed/bench-cpu.ipynb").read_text())["cells"]

    r = cli(root, "verify", "--json")
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and [v["state"] for v in out["verdicts"]] == ["fresh"]
    assert out["verdicts"][0]["measured"] == 100.0

    r = cli(root, "run", "--record", "bench", "--json")
    rows = json.loads(r.stdout)
    assert r.exit_code == 0 and rows[0]["recorded"] == 100.0 and rows[0]["vs_recorded"] == "within tolerance"
    assert len(baseline(root, "bench")["profiles"]["cpu"]["metrics"]["x"]["history"]) == 2


def test_run_says_where_its_wall_time_went(tmp_path):
    """The cells, the kernel's start and the rest add up to the run's wall time; a slow cell shows in the cells."""
    from specbook.execute import kernel_start_seconds

    nb = tmp_path / "nb.ipynb"
    meta = lambda t: {"papermill": {"start_time": f"2026-01-01T00:00:{t}+00:00"}}  # noqa: E731
    nb.write_text(json.dumps({"metadata": meta("01.000000"), "cells": [{"metadata": meta("04.500000")},
                                                                        {"metadata": meta("03.250000")}]}))
    assert kernel_start_seconds(nb) == 2.25 and kernel_start_seconds(tmp_path / "none.ipynb") is None
    import re

    root = make_repo(tmp_path, bench=runbook_text(body="""
    import time
    time.sleep(1.5)
    record("x", 1.0, unit="tok/s", direction="higher", rel_tol=0.1)
"""))
    r = cli(root, "run", "bench")
    assert r.exit_code == 0, r.stderr
    took = re.search(r"took (\d+) s in all \(bench (\d+) s\); bench: (\d+) s in its cells, (\d+) s starting the "
                     r"kernel, (\d+) s outside", r.stdout)
    assert took, r.stdout
    total, own, cells, kernel, rest = map(int, took.groups())
    assert cells >= 1 and own >= cells and total >= own - 1  # the 1.5 s sleep is in the cells
    assert abs(own - (cells + kernel + rest)) <= 2  # each part rounded on its own


def test_run_without_record_changes_no_tracked_file(tmp_path):
    """A local re-run measures and compares; only --record writes baselines/ and docs/."""
    root = make_repo(tmp_path, bench=FROM_FILE)
    (root / "value.txt").write_text("100")
    assert cli(root, "run", "--record", "bench").exit_code == 0
    before = (root / "baselines" / "bench.yaml").read_bytes()
    (root / "value.txt").write_text("50")
    r = cli(root, "run", "bench")
    assert r.exit_code == 0, r.stderr
    assert (root / "baselines" / "bench.yaml").read_bytes() == before
    assert "will run: bench (cpu)" in r.stderr and "nothing recorded" in r.stdout
    assert "50" in r.stdout and "worse, in one run" in r.stdout  # measured beside the committed record, and
    assert "runbook verify bench" in r.stdout  # one run of a timing is not a verdict: the table says who judges
    assert (root / ".specbook" / "executed" / "bench-cpu.ipynb").is_file()


@pytest.mark.parametrize("direction, new, change", [
    ("higher", "80", "regression"), ("higher", "120", "improvement"),
    ("lower", "80", "improvement"), ("lower", "120", "regression"),
])
def test_verify_drift_exits_1(tmp_path, direction, new, change):
    root = make_repo(tmp_path, bench=FROM_FILE)
    (root / "value.txt").write_text("100")
    assert cli(root, "run", "--record", "bench", "-p", f"direction={direction}").exit_code == 0
    write_runbook(root, "bench", FROM_FILE + "# changed since recorded\n")
    (root / "value.txt").write_text(new)  # and the code changed: measured three times, two of three decide
    r = cli(root, "verify", "bench", "--json")
    v = json.loads(r.stdout)["verdicts"][0]
    assert r.exit_code == 1 and v["state"] == "drifted" and v["change"] == change
    assert baseline(root, "bench")["profiles"]["cpu"]["metrics"]["x"]["value"] == 100.0  # verify never records


def test_failing_cell_is_one_line_and_records_nothing(tmp_path):
    root = make_repo(tmp_path, bad=runbook_text(body="record('x', 1.0, unit='u')\nraise KeyError('no such model')"))
    r = cli(root, "run", "--record", "bad")
    _one_line_error(r, 3, "runbook bad: cell 3 (line", "raised KeyError: 'no such model'", "partly executed notebook")
    partial = Path(r.stderr.split("partly executed notebook: ")[1].rstrip(")\n"))
    assert partial.exists() and not (root / "baselines" / "bad.yaml").exists()


def test_whole_run_timeout(tmp_path):
    root = make_repo(tmp_path, slow=runbook_text(extra_header="timeout: 2", body="import time\ntime.sleep(30)"))
    t0 = time.monotonic()
    _one_line_error(cli(root, "run", "--record", "slow"), 3, "whole-run timeout 2s exceeded")
    assert time.monotonic() - t0 < 20


def test_reproduces_must_be_recorded(tmp_path):
    root = make_repo(tmp_path, r=runbook_text(extra_header="reproduces: [x, tok_s]"))
    _one_line_error(cli(root, "run", "--record", "r"), 3, "declares reproduces ['tok_s'] but did not record them")


@pytest.mark.parametrize("args, code, fragment", [
    (("run", "bnech"), 2, "did you mean bench"),
    (("run", "../bench"), 2, "invalid runbook name"),
    (("show", "a/b"), 2, "invalid runbook name"),
    (("run", "bench", "-p", "valeu=3"), 2, "did you mean value"),
    (("run", "bench", "-p", "value=fast"), 2, "must be float"),
    (("run", "bench", "--profile", "h200"), 3, "cannot measure profile h200 on this machine (it is cpu)"),
    (("record", "bench", "--profile", "h200"), 3, "cannot measure profile h200 on this machine (it is cpu)"),
    (("run", "bench", "--profile", "h2OO"), 2, "unknown profile 'h2OO'"),
    (("run", "gpuonly"), 3, "cannot run on profile cpu"),
    (("verify", "nope"), 2, "unknown runbook 'nope'"),
])
def test_bad_input(tmp_path, args, code, fragment):
    root = make_repo(tmp_path, bench=runbook_text(), gpuonly=runbook_text(profiles="{h200: {}}"))
    _one_line_error(cli(root, *args), code, fragment)


def test_malformed_record_names_file_and_line(tmp_path):
    root = make_repo(tmp_path, bench=runbook_text())
    (root / "baselines" / "bench.yaml").write_text("runbook: bench\nprofiles:\n  cpu: [\n")
    for args in (("status",), ("verify",), ("show", "bench"), ("run", "bench")):
        _one_line_error(cli(root, *args), 2, "bench.yaml:", "malformed YAML")


def test_a_record_is_measured_from_nothing_not_read_back_from_cached_outputs(tmp_path):
    counting = runbook_text(params='outputs_dir = ""', body="""
        from pathlib import Path
        p = Path(outputs_dir, "runs.txt")
        n = int(p.read_text()) + 1 if p.exists() else 1
        p.write_text(str(n))
        record("runs_in_outputs", float(n), unit="runs")
    """)
    root = make_repo(tmp_path, counting=counting)
    for _ in range(2):
        assert cli(root, "run", "--record", "counting").exit_code == 0
        assert baseline(root, "counting")["profiles"]["cpu"]["metrics"]["runs_in_outputs"]["value"] == 1.0
    assert cli(root, "record", "counting").exit_code == 0
    assert baseline(root, "counting")["profiles"]["cpu"]["metrics"]["runs_in_outputs"]["value"] == 1.0


def test_dependencies_run_once_and_again_when_stale(tmp_path):
    up = runbook_text(params='outputs_dir = ""', body="""
        from pathlib import Path
        Path(outputs_dir, "model.txt").write_text("41")
    """)
    down = runbook_text(extra_header="depends: [up]", params="upstream = {}", body="""
        from pathlib import Path
        record("x", float(Path(upstream["up"], "model.txt").read_text()) + 1, unit="u")
    """)
    root = make_repo(tmp_path, up=up, down=down)
    r = cli(root, "run", "--record", "down")
    assert r.exit_code == 0, r.stderr
    assert "running up" in r.stderr and baseline(root, "down")["profiles"]["cpu"]["metrics"]["x"]["value"] == 42.0
    assert not (root / "baselines" / "up.yaml").exists()  # it recorded no numbers

    r = cli(root, "run", "--record", "down")
    assert r.exit_code == 0 and "running up" not in r.stderr  # cached outputs of the same inputs
    assert "running up" in cli(root, "run", "--record", "down", "--force").stderr

    write_runbook(root, "up", up.replace('"41"', '"9"'))
    assert cli(root, "status", "down").exit_code == 1  # stale: its upstream changed
    r = cli(root, "run", "--record", "down")
    assert "running up" in r.stderr and baseline(root, "down")["profiles"]["cpu"]["metrics"]["x"]["value"] == 10.0


def test_dependency_cycle(tmp_path):
    root = make_repo(tmp_path, a=runbook_text(extra_header="depends: [b]"), b=runbook_text(extra_header="depends: [a]"))
    _one_line_error(cli(root, "run", "--record", "a"), 2, "dependency cycle: a -> b -> a")


def test_list_show_env_status(tmp_path):
    root = make_repo(tmp_path, bench=runbook_text(profiles="{cpu: {}, h200: {}}"))
    assert json.loads(cli(root, "list", "--json").stdout)[0]["records"] == {"-": "unrecorded"}
    assert cli(root, "run", "--record", "bench").exit_code == 0
    listed = json.loads(cli(root, "list", "--json").stdout)
    assert listed == [{"name": "bench", "title": "T", "profiles": ["cpu", "h200"], "depends": [],
                       "records": {"cpu": "current"}}]
    shown = cli(root, "show", "bench")
    assert shown.exit_code == 0 and "rel 0.1" in shown.stdout and "commit" in shown.stdout
    assert json.loads(cli(root, "show", "bench", "--json").stdout)["runbook"] == "bench"
    env = json.loads(cli(root, "env", "--json").stdout)
    assert {"git_commit", "versions", "gpu", "env", "sitecustomize", "profile"} <= set(env)
    r = cli(root, "status", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)[0]["state"] == "current"


def _here() -> str:
    """A profile the subprocesses below can run on (they detect the real machine, e.g. h200 on the GPU box)."""
    p = provenance.profile_of(provenance.gpus())
    return f"{{{p}: {{}}}}"


def _runbook_cmd(root: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "SPECBOOK_ROOT": str(root)}
    return subprocess.Popen([sys.executable, "-m", "specbook.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_concurrent_runs_both_land(tmp_path):
    root = make_repo(tmp_path, bench=runbook_text(profiles=_here()))
    procs = [_runbook_cmd(root, "run", "--record", "bench") for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert [len(p["runs"]) for p in baseline(root, "bench")["profiles"].values()] == [2]


def test_sigkill_mid_run_leaves_the_record_untouched(tmp_path):
    slow = runbook_text(profiles=_here(), params="value = 1.0\nwait = 0.0", body="""
        record("x", value, unit="u")
        print("recorded", flush=True)
        import time
        time.sleep(wait)
    """)
    root = make_repo(tmp_path, bench=slow)
    assert _runbook_cmd(root, "run", "--record", "bench").wait(timeout=60) == 0
    before = (root / "baselines" / "bench.yaml").read_bytes()
    proc = _runbook_cmd(root, "run", "--record", "bench", "-p", "value=2.0", "-p", "wait=60")
    deadline = time.monotonic() + 60
    while not list((root / ".specbook" / "runs").glob("bench-*/*.records.jsonl")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (root / "baselines" / "bench.yaml").read_bytes() == before
    assert _runbook_cmd(root, "run", "--record", "bench", "-p", "value=3.0").wait(timeout=60) == 0  # no stale lock blocks it
    assert [p["metrics"]["x"]["value"] for p in baseline(root, "bench")["profiles"].values()] == [3.0]


def test_list_survives_a_broken_runbook(tmp_path):
    root = make_repo(tmp_path, good=runbook_text(), broken="# %%\nx = 1\n")
    r = cli(root, "list", "--json")
    assert r.exit_code == 0
    assert {i["name"]: i["title"].startswith("invalid:") for i in json.loads(r.stdout)} == {
        "broken": True, "good": False}


def test_verify_docs_problems_exit_1(tmp_path, monkeypatch):
    from specbook import claims, site

    root = make_repo(tmp_path)
    monkeypatch.setattr(claims, "check_docs", lambda root: ["docs/x.md:3: claim a/cpu/x: literal '1' != record '2'"])
    r = cli(root, "verify", "--docs")
    assert r.exit_code == 1 and "docs/x.md:3: claim a/cpu/x" in r.stdout
    monkeypatch.setattr(claims, "check_docs", lambda root: [])
    monkeypatch.setattr(site, "out_of_date", lambda root: [])
    assert cli(root, "verify", "--docs").exit_code == 0


def test_kernel_runs_this_interpreter():
    from jupyter_client.kernelspec import KernelSpecManager

    from specbook.execute import _runs_here, ensure_kernel

    name = ensure_kernel()
    assert ensure_kernel() == name  # idempotent
    assert _runs_here(KernelSpecManager().get_kernel_spec(name).argv)
    assert not _runs_here(["/usr/bin/python2.7", "-m", "ipykernel_launcher"])


def test_profile_variants_run_here_record_apart_and_carry_through_dependencies(tmp_path):
    """`cpu.alt` is the cpu machine with other parameters: it runs here, records under its own name, its
    dependencies run on the same variant, and `h200.alt` is another machine's."""
    up = runbook_text(profiles="{cpu: {}, cpu.alt: {n: 40}, h200.alt: {}}", params='n = 1\noutputs_dir = ""', body="""
        from pathlib import Path
        Path(outputs_dir, "model.txt").write_text(str(n))
    """)
    down = runbook_text(profiles="{cpu: {}, cpu.alt: {}, h200.alt: {}}", extra_header="depends: [up]",
                        params="upstream = {}", body="""
        from pathlib import Path
        record("x", float(Path(upstream["up"], "model.txt").read_text()) + 1, unit="u")
    """)
    root = make_repo(tmp_path, up=up, down=down)
    assert cli(root, "run", "--record", "down").exit_code == 0
    r = cli(root, "run", "--record", "down", "--profile", "cpu.alt", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)[0]["profile"] == "cpu.alt"
    metrics = {p: v["metrics"]["x"]["value"] for p, v in baseline(root, "down")["profiles"].items()}
    assert metrics == {"cpu": 2.0, "cpu.alt": 41.0}
    assert (root / "docs" / "runbooks" / "executed" / "down-cpu.alt.ipynb").exists()
    _one_line_error(cli(root, "run", "--record", "down", "--profile", "h200.alt"), 3, "h200.alt", "it is cpu")
    r = cli(root, "verify", "--json")
    assert r.exit_code == 0, r.stderr
    verdicts = {(v["profile"], v["state"]) for v in json.loads(r.stdout)["verdicts"] if v["runbook"] == "down"}
    assert verdicts == {("cpu", "fresh"), ("cpu.alt", "fresh")}


def test_another_profile_in_the_header_leaves_records_fresh(tmp_path):
    root = make_repo(tmp_path, x=runbook_text(profiles="{cpu: {value: 2.0}}"))
    assert cli(root, "run", "--record", "x").exit_code == 0
    write_runbook(root, "x", runbook_text(profiles="\n  cpu: {value: 2.0}\n  h200.alt: {value: 3.0}"))
    assert cli(root, "status", "x").exit_code == 0  # still fresh: only another profile was added
    write_runbook(root, "x", runbook_text(profiles="{cpu: {value: 5.0}}"))
    assert cli(root, "status", "x").exit_code == 1  # this profile's parameters changed: stale
    write_runbook(root, "x", runbook_text(profiles="{cpu: {value: 2.0}}", body='record("x", value + 0, unit="u")'))
    assert cli(root, "status", "x").exit_code == 1  # the code changed: stale


def test_run_marks_an_exact_number_that_moved_as_a_difference_not_one_run(tmp_path):
    """An exact number (direction none: a count, an accept length) outside its tolerance differs, whatever the
    machine's noise; a timing outside its tolerance is only seen so in one run."""
    root = make_repo(tmp_path, bench=runbook_text(body="""
    record("x", float(open("value.txt").read()), unit="n", direction="none", kind="exact")
"""))
    (root / "value.txt").write_text("100")
    assert cli(root, "run", "--record", "bench").exit_code == 0
    (root / "value.txt").write_text("101")
    r = cli(root, "run", "bench")
    assert r.exit_code == 0 and "changed (exact number)" in r.stdout and "in one run" not in r.stdout


def test_verify_announces_the_profiles_and_builds_it_will_run_with_an_estimate(tmp_path):
    """`verify NAME` re-measures every variant of this machine's profile too; it says so before running, with what
    it must build first and --plan's estimate, as `run` says what it will run."""
    exact = 'record("y", value, unit="n", direction="none", kind="exact")'
    root = make_repo(tmp_path, up=runbook_text(profiles="{cpu: {}, cpu.v: {}}", body=exact),
                     one=runbook_text(profiles="{cpu: {}, cpu.v: {value: 2.0}}", body=exact,
                                      extra_header="depends: [up]"))
    for profile in ("cpu", "cpu.v"):
        assert cli(root, "run", "one", "--record", "--profile", profile).exit_code == 0
    shutil.rmtree(root / ".specbook" / "outputs" / "up" / "cpu.v")  # not cached: the verify builds it first
    r = cli(root, "verify", "one")
    assert r.exit_code == 0, r.output
    first = r.stderr.splitlines()[0]
    assert first.startswith("will verify: one (cpu), one (cpu.v); first builds (not cached): up (cpu.v); "
                            "estimated "), first
    assert "`--profile cpu` verifies one profile of cpu, cpu.v" in first


OUTPUTS_UP = runbook_text(params='outputs_dir = ""', extra_header="""outputs:
  paths: {model: "the model it trains"}
  command: "{python} -m tool --model {outputs_dir}/model"
""", body="""
    from pathlib import Path
    Path(outputs_dir, "model").write_text("weights")
    record("y", 1, unit="n", direction="none", kind="exact")
""")


def test_outputs_names_the_built_paths_and_a_ready_command(tmp_path, monkeypatch):
    """`runbook outputs NAME` says where the outputs of NAME and its dependencies are (hashed folders under
    .specbook/outputs/) and fills in the command that uses them; the conclusion of a run shows that command."""
    down = runbook_text(params="value = 1.0\nupstream = {}", extra_header="""depends: [up]
outputs:
  command: "{python} -m tool --model {up}/model --fast"
""")
    root = make_repo(tmp_path, up=OUTPUTS_UP, down=down)
    monkeypatch.chdir(root)
    r = cli(root, "outputs", "down")
    assert r.exit_code == 0 and "not built yet" in r.stdout and "`runbook run down` builds them" in r.stdout
    run = cli(root, "run", "down")
    assert run.exit_code == 0, run.output
    info = json.loads(cli(root, "outputs", "down", "--json").stdout)
    assert info["built"] and [g["runbook"] for g in info["outputs"]] == ["up"]
    (model, what), = info["outputs"][0]["paths"].items()
    assert (root / model).read_text() == "weights" and what == "the model it trains"
    assert model.startswith(".specbook/outputs/up/cpu/")  # relative to the current directory, as typed here
    assert info["command"] == f"{sys.executable} -m tool --model {model} --fast"
    text = cli(root, "outputs", "down").stdout
    assert f"  {model}  the model it trains" in text and f"  {info['command']}" in text and "not built" not in text
    assert f"  {info['command']}" in run.stdout.splitlines()  # the run's conclusion
    assert cli(root, "outputs", "nope").exit_code == 2


def test_naming_the_outputs_leaves_the_records_current(tmp_path):
    """The header's `outputs` describe a run; adding them must not make the runbook's records stale."""
    from specbook.execute import target

    plain = "".join(line for line in OUTPUTS_UP.splitlines(keepends=True)
                    if not line.startswith(("# outputs:", "#   paths:", "#   command:")))
    assert plain != OUTPUTS_UP and "outputs" not in plain.split("```")[1]
    root = make_repo(tmp_path, up=plain)
    before = target(root, "up", "cpu").inputs_hash
    write_runbook(root, "up", OUTPUTS_UP)
    assert target(root, "up", "cpu").inputs_hash == before


@pytest.mark.content
def test_the_trained_pairs_outputs_are_the_layout_the_engine_names():
    """The training runbooks' headers name their outputs for people; engine.train.layout names them for code."""
    from engine.train.layout import DrafterOutputs, TargetOutputs
    from specbook.runbooks import load

    root = Path(__file__).resolve().parents[1]
    t, d = TargetOutputs(Path("o")), DrafterOutputs(Path("o"))
    assert set(load(root, "train-target").outputs["paths"]) == {t.target_a.name, t.target_b.name, t.tokenizer.name}
    assert set(load(root, "train-drafter").outputs["paths"]) == {d.drafter_a.name}
    command = load(root, "baseline-eagle3").outputs["command"]
    assert f"{{train-target}}/{t.target_a.name}" in command and f"{{train-drafter}}/{d.drafter_a.name}" in command


PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


def test_the_conclusion_tells_the_whole_run(tmp_path, monkeypatch):
    """The main job's conclusion: what its dependencies measured on the way (or that they were cached), its plots
    as PNG files that open without Jupyter, the whole run's time, and in words a speedup that is within its noise."""
    up = runbook_text(params="value = 1.0", body='''
        record("loss", 2.5, unit="nats", direction="lower", kind="exact")
    ''')
    down = runbook_text(params="speedup = 1.03\nupstream = {}", extra_header="depends: [up]", body=f'''
        import base64
        from IPython.display import Image, display
        display(Image(data=base64.b64decode("{PNG}")))
        display(Image(data=base64.b64decode("{PNG}")))
        record("speedup", speedup, unit="x", direction="higher", rel_tol=0.15)
        record("tok_s", 100.0, unit="tok/s", direction="higher", rel_tol=0.15)
    ''')
    root = make_repo(tmp_path, up=up, down=down)
    monkeypatch.chdir(root)
    r = cli(root, "run", "down")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "no real speedup on a CPU: speedup 1.03x (tolerance \u00b115%) is within the noise of 1.0" in out, out
    assert re.search(r"what it depended on:\n  up \(cpu, ran \d+ s\): loss 2.5 nats\n", out), out
    assert "plots of down: .specbook/executed/down-cpu.png, .specbook/executed/down-cpu-2.png" in out
    for png in ("down-cpu.png", "down-cpu-2.png"):
        assert (root / ".specbook" / "executed" / png).read_bytes().startswith(b"\x89PNG")
    took = re.search(r"took (\d+) s in all \(up (\d+) s, down (\d+) s\)", out)
    assert took and int(took[1]) >= int(took[2]) + int(took[3]) - 1, out
    again = cli(root, "run", "down", "-p", "speedup=1.5").stdout
    assert "up (cpu): built by an earlier run, cached" in again and "no real speedup" not in again


def test_verify_save_keeps_each_numbers_last_verdict_for_the_status_page(tmp_path):
    """`verify --save` writes the verdict of every number it re-measured (state, date, machine, commit) into a
    committed file apart from the records, keeps those it did not re-measure, and the status page shows it."""
    from specbook import site, verified

    exact = 'record("y", value, unit="n", direction="none", kind="exact")'
    root = make_repo(tmp_path, one=runbook_text(body=exact), two=runbook_text(body=exact))
    for name in ("one", "two"):
        assert cli(root, "run", name, "--record").exit_code == 0
    (root / "docs").mkdir(exist_ok=True)
    (root / "docs" / "p.md").write_text("---\ntitle: T\nstatus: current\nupdated: 2026-11-29\nrunbooks: []\n"
                                        "records: []\n---\nIt gives <!-- claim: one/cpu/y fmt=.1f -->1.0<!-- /claim "
                                        "--> and <!-- claim: two/cpu/y fmt=.1f -->1.0<!-- /claim -->.\n")
    records_before = {p.name: p.read_text() for p in (root / "baselines").glob("*.yaml")}
    assert "| - |" in site.status_page(root).splitlines()[-1]  # never verified
    assert cli(root, "verify", "one").exit_code == 0 and not (root / verified.PATH).exists()  # only when asked
    r = cli(root, "verify", "one", "--save")
    assert r.exit_code == 0, r.output
    first = verified.load(root)
    assert list(first) == ["one/cpu/y"]
    entry = first["one/cpu/y"]
    assert entry["state"] == "fresh" and entry["profile"] == "cpu" and entry["measured"] == 1.0
    assert entry["machine"] == provenance.cpu_model() and entry["date"][:4] >= "2026"
    assert cli(root, "verify", "two", "--save").exit_code == 0
    both = verified.load(root)
    assert set(both) == {"one/cpu/y", "two/cpu/y"} and both["one/cpu/y"] == entry  # the other kept as it was
    assert {p.name: p.read_text() for p in (root / "baselines").glob("*.yaml")} == records_before
    page = site.status_page(root)
    assert "| last verified |" in page
    row = next(line for line in page.split("\n## one\n", 1)[1].splitlines() if line.startswith("| `cpu/y` |"))
    assert row.endswith(f"| fresh {entry['date'][:10]}, cpu on {entry['machine']}, commit `-` |"), row


def test_status_says_the_summary_first_and_every_number_only_with_all(tmp_path):
    root = make_repo(tmp_path, one=runbook_text(), two=runbook_text())
    for name in ("one", "two"):
        assert cli(root, "run", name, "--record").exit_code == 0
    write_runbook(root, "two", runbook_text(params="value = 2.0"))  # its parameters changed: stale
    r = cli(root, "status")
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert lines[0] == "this machine's profiles: 1 current, 1 stale; other hardware or reported: none", lines
    assert lines[1:] == ["not current:", "  two (cpu): 1 stale - runbook, parameters changed",
                         "`runbook status --all` lists all 2 numbers"], lines
    full = cli(root, "status", "--all").stdout.splitlines()
    assert full[0] == lines[0] and full[1].split()[:3] == ["runbook", "profile", "metric"] and len(full) == 5


def test_show_formats_a_runs_parameters_for_reading(tmp_path):
    root = make_repo(tmp_path, one=runbook_text(params='value = 1.0\nname = "a b"\nopt: int | None = None\n'
                                                       'sizes = [1, 2]'))
    assert cli(root, "run", "one", "--record").exit_code == 0
    shown = cli(root, "show", "one").stdout
    assert '    params: value=1.0 name="a b" sizes=[1,2]; unset: opt' in shown.splitlines(), shown
    assert "{'" not in shown  # no Python dict dumped
