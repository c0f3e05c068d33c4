"""Faults and bad input around the data specbook keeps: dependency outputs built by concurrent runs, malformed or
hostile record files, file modes of atomic writes, leftover run directories, Ctrl-C, concurrent kernel starts, names
that are paths, unknown profiles."""

import asyncio
import gc
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from jupyter_core.utils import ensure_event_loop

from specbook import fsutil, provenance, records
from specbook.claims import Edit, apply_edits
from specbook.record import make_metric, read_metrics
from specbook_testing import baseline, cli, make_repo, runbook_text


def _here() -> str:
    """The profile the subprocesses below detect (h200 on the GPU box, cpu elsewhere)."""
    return provenance.profile_of(provenance.gpus())


def _runbook_cmd(root: Path, *args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    env = {**(os.environ if env is None else env), "SPECBOOK_ROOT": str(root)}
    return subprocess.Popen([sys.executable, "-m", "specbook.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _run(i: int) -> dict:
    date = f"2026-11-29T14:00:{i:02d}Z"
    return {"id": f"run-{i}", "date": date, "source": "measured", "inputs_hash": "h", "parameters": {},
            "provenance": {"git_commit": "c0ffee0"}}


def _write_record(root: Path, name: str, value: float = 1.0) -> None:
    records.add_run(root, name, "cpu", _run(0), [make_metric("x", value, unit="u", rel_tol=0.1)])


def _one_line(result, code: int, *fragments: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def cpu_machine(monkeypatch):
    monkeypatch.setattr(provenance, "detect_profile", lambda: "cpu")


# ------------------------------------------------------------------------ 1. dependencies built by concurrent runs

UP = runbook_text(profiles=f"{{{_here()}: {{}}}}", params='outputs_dir = ""', body="""
    import time
    from pathlib import Path
    with open(Path(outputs_dir, "model.txt"), "a") as f:  # a second build into the same directory adds a line
        f.write("built\\n")
    time.sleep(3)  # long enough for a concurrent run to find the outputs unfinished
""")


def _consumer(extra: str = "") -> str:
    return runbook_text(profiles=f"{{{_here()}: {{}}}}", extra_header="depends: [up]", params="upstream = {}",
                        body=f"""
        from pathlib import Path
        record("builds", len(Path(upstream["up"], "model.txt").read_text().split()), unit="n", direction="none")
        {extra}
    """)


@pytest.mark.slow
def test_concurrent_consumers_build_a_dependency_once(tmp_path):
    root = make_repo(tmp_path, up=UP, down_a=_consumer(), down_b=_consumer())
    procs = [_runbook_cmd(root, "run", "--record", name, "--json") for name in ("down-a", "down-b")]
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        errs.append(err)
    assert sum("running up" in e for e in errs) == 1, errs
    for name in ("down-a", "down-b"):
        assert baseline(root, name)["profiles"][_here()]["metrics"]["builds"]["value"] == 1


def test_a_failed_dependency_build_is_not_taken_for_done(tmp_path, cpu_machine):
    root = make_repo(tmp_path, up=runbook_text(params='outputs_dir = ""\nfail = True', body="""
        from pathlib import Path
        Path(outputs_dir, "model.txt").write_text("half")
        if fail:
            raise RuntimeError("killed mid-build")
    """), down=_consumer().replace(f"{_here()}: {{}}", "cpu: {}"))
    r = cli(root, "run", "--record", "down")
    assert r.exit_code == 3 and "runbook up" in r.stderr
    [outputs] = [d for d in (root / ".specbook" / "outputs" / "up" / "cpu").iterdir() if d.is_dir()]
    assert (outputs / "model.txt").exists() and not (outputs / "DONE").exists()


REBUILT = runbook_text(profiles=f"{{{_here()}: {{}}}}", params='outputs_dir = ""', body="""
    import os, time
    from pathlib import Path
    Path(outputs_dir, "value").write_text("5")  # half way through its build
    time.sleep(float(os.environ.get("UP_SLEEP", "0")))
    Path(outputs_dir, "value").write_text("10")
    record("value", 10.0, unit="n", direction="none")
""")

READS_LATE = runbook_text(profiles=f"{{{_here()}: {{}}}}", extra_header="depends: [up]", params="upstream = {}",
                          body="""
    import os, time
    from pathlib import Path
    Path(os.environ["DOWN_STARTED"]).write_text("reading")
    time.sleep(10)  # work before it reads its dependency's outputs
    record("value", float(Path(upstream["up"], "value").read_text()), unit="n", direction="none")
""")


def test_a_dependency_is_not_rebuilt_under_a_run_that_reads_it(tmp_path):
    """`runbook run up` while `run down`, started earlier, reads up's outputs: up once rebuilt them in place, and
    down recorded 5 where the answer is 10. The rebuild now waits for its reader."""
    root = make_repo(tmp_path / "repo", up=REBUILT, down=READS_LATE)
    started = tmp_path / "down-started"
    env = {**os.environ, "DOWN_STARTED": str(started)}
    down = _runbook_cmd(root, "run", "down", "--json", env=env)
    deadline = time.monotonic() + 120
    while not started.exists() and down.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert started.exists(), down.communicate()
    up = _runbook_cmd(root, "run", "up", "--json", env={**env, "UP_SLEEP": "12"})
    out, err = down.communicate(timeout=180)
    assert down.returncode == 0, err
    assert [r["measured"] for r in json.loads(out) if r["runbook"] == "down"] == [10.0], err
    up_out, up_err = up.communicate(timeout=180)
    assert up.returncode == 0 and "waiting for the runs that read up" in up_err, up_err
    assert json.loads(up_out)[0]["measured"] == 10.0


# ------------------------------------------------------------------------------- 2. one malformed record file

def test_one_malformed_record_does_not_hide_the_others(tmp_path, cpu_machine):
    root = make_repo(tmp_path, good=runbook_text(), bad=runbook_text())
    _write_record(root, "good", 7.0)
    (root / "baselines" / "bad.yaml").write_text("runbook: bad\nprofiles: {cpu: [\n")

    r = cli(root, "list", "--json")
    line = _one_line(r, 2, "bad.yaml")
    listed = {i["name"]: i for i in json.loads(r.stdout)}
    # the record of good was made up (its inputs hash is not the runbook's): stale, and shown
    assert listed["good"]["records"] == {"cpu": "stale"} and listed["bad"]["records"] == {"-": "invalid record"}
    assert "malformed" in line

    r = cli(root, "status", "--json")
    _one_line(r, 2, "bad.yaml")
    assert [v["state"] for v in json.loads(r.stdout) if v["runbook"] == "good"] == ["stale"]

    r = cli(root, "context")
    _one_line(r, 2, "bad.yaml")
    assert "good @ cpu" in r.stdout

    assert cli(root, "status", "good").exit_code == 1  # stale; the broken file is not asked about


def _big_value(d: dict) -> None:
    d["profiles"]["cpu"]["metrics"]["x"]["value"] = 10 ** 400


def _int_profile(d: dict) -> None:
    d["profiles"][1] = d["profiles"].pop("cpu")


def _gpu_count(d: dict) -> None:
    d["profiles"]["cpu"]["runs"][0]["provenance"]["gpu"] = {"count": "x"}


def _versions_list(d: dict) -> None:
    d["profiles"]["cpu"]["runs"][0]["provenance"]["versions"] = ["x"]


@pytest.mark.parametrize("edit, field", [
    (_big_value, "profiles.cpu.metrics.x: needs a numeric value"),
    (_int_profile, "profiles.1: a profile name must be a string"),
    (_gpu_count, "profiles.cpu.runs[0].provenance.gpu.count: must be a count (a whole number >= 0), not 'x'"),
    (_versions_list, "profiles.cpu.runs[0].provenance.versions: must be a mapping with string keys, not ['x']"),
])
def test_a_hand_edited_field_of_the_wrong_type_is_named_and_hides_nothing(tmp_path, cpu_machine, edit, field):
    """Each of these once crashed every command (exit 3; `list` printed nothing)."""
    root = make_repo(tmp_path, good=runbook_text(), bad=runbook_text())
    _write_record(root, "good", 7.0)
    _write_record(root, "bad")
    data = baseline(root, "bad")
    edit(data)
    (root / "baselines" / "bad.yaml").write_text(yaml.safe_dump(data))
    for args in (("list",), ("status",), ("context",), ("show", "good")):
        r = cli(root, *args)
        if args[0] == "show":
            assert r.exit_code == 0 and "good" in r.stdout, r.output
            continue
        _one_line(r, 2, "bad.yaml", field)
        assert "good" in r.stdout, (args, r.stdout)
    _one_line(cli(root, "show", "bad"), 2, "bad.yaml", field)
    _one_line(cli(root, "verify", "bad"), 2, "bad.yaml", field)


def test_exit_code_epilog_names_malformed_records():
    r = cli(Path("."), "--help")
    assert "malformed record" in r.stdout and "the others are still shown" in r.stdout


# ---------------------------------------------------------------------------------- 3. modes of atomic writes

@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_write_keeps_the_mode_and_leaves_no_temp_file(tmp_path, umask_022):
    new = tmp_path / "new.txt"
    fsutil.atomic_write(new, b"one")
    assert new.read_bytes() == b"one" and _mode(new) == 0o644
    old = tmp_path / "old.txt"
    old.write_bytes(b"x")
    old.chmod(0o664)
    fsutil.atomic_write(old, b"two")
    assert old.read_bytes() == b"two" and _mode(old) == 0o664
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.txt", "old.txt"]


def test_a_failed_atomic_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "f.txt"
    path.write_bytes(b"old")

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        fsutil.atomic_write(path, b"new")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_record_files_and_docs_keep_their_mode(tmp_path, umask_022):
    root = make_repo(tmp_path)
    _write_record(root, "bench")
    path = root / "baselines" / "bench.yaml"
    assert _mode(path) == 0o644  # a new file: 0o666 less the umask
    path.chmod(0o664)  # group-writable, as a shared checkout has it
    records.add_run(root, "bench", "cpu", _run(1), [make_metric("x", 2.0, unit="u")])
    assert _mode(path) == 0o664 and baseline(root, "bench")["profiles"]["cpu"]["metrics"]["x"]["value"] == 2.0

    page = root / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("old")
    page.chmod(0o644)
    apply_edits([Edit(page, hashlib.sha256(b"old").hexdigest(), "new")])
    assert page.read_text() == "new" and _mode(page) == 0o644


def test_executed_notebook_is_readable_by_others(tmp_path, umask_022, cpu_machine):
    root = make_repo(tmp_path, bench=runbook_text())
    assert cli(root, "run", "--record", "bench").exit_code == 0
    assert _mode(root / "docs" / "runbooks" / "executed" / "bench-cpu.ipynb") == 0o644
    assert _mode(root / "baselines" / "bench.yaml") == 0o644


# -------------------------------------------------------------------------------- 4. hostile record files

GOOD = """\
runbook: bench
profiles:
  cpu:
    runs:
    - {id: r1, date: '2026-11-29T14:40:00Z', source: measured, inputs_hash: h, parameters: {}, provenance: {}}
    metrics:
      x: {value: 1.0, unit: u, direction: higher, tolerance: {rel: 0.1, abs: 0.0}, run: r1, samples: [1.0, 1.5],
          history: [{value: 1.0, run: r1, date: '2026-11-29T14:40:00Z'}]}
"""

BOMB = """\
runbook: bench
profiles:
  cpu:
    runs:
    - id: r1
      date: '2026-11-29T14:40:00Z'
      source: measured
      inputs_hash: h
      parameters: {}
      provenance:
        a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]
        b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
        c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    metrics: {}
"""


def test_yaml_aliases_are_refused(tmp_path):
    root = make_repo(tmp_path, bench=runbook_text())
    (root / "baselines" / "bench.yaml").write_text(BOMB)
    for args in (("show", "bench"), ("show", "bench", "--json")):
        r = cli(root, *args)
        line = _one_line(r, 2, "bench.yaml:11", "anchors and aliases")
        assert len(r.stdout) < 1000, line


def test_a_plain_record_file_still_loads(tmp_path):
    root = make_repo(tmp_path)
    (root / "baselines" / "bench.yaml").write_text(GOOD)
    assert records.load(root / "baselines" / "bench.yaml").data["profiles"]["cpu"]["metrics"]["x"]["value"] == 1.0


@pytest.mark.parametrize("old, new, where", [
    ("value: 1.0, unit", "value: .nan, unit", "needs a numeric value (finite"),
    ("value: 1.0, unit", "value: -.inf, unit", "needs a numeric value (finite"),
    ("samples: [1.0, 1.5]", "samples: [1.0, .inf]", "samples must be a list of finite numbers"),
    ("rel: 0.1", "rel: .inf", "tolerance must be"),
    ("abs: 0.0", "abs: .nan", "tolerance must be"),
    ("history: [{value: 1.0", "history: [{value: .nan", "history[0]: needs a numeric value (finite"),
    ("history: [{value: 1.0, run: r1, date: '2026-11-29T14:40:00Z'}]", "history: [3]",
     "history[0]: needs a numeric value (finite"),
])
def test_nan_and_inf_are_refused_in_records(tmp_path, old, new, where):
    root = make_repo(tmp_path, bench=runbook_text())
    assert old in GOOD
    (root / "baselines" / "bench.yaml").write_text(GOOD.replace(old, new))
    _one_line(cli(root, "show", "bench"), 2, "bench.yaml", "profiles.cpu.metrics.x", where)


def test_nan_written_by_a_runbook_is_refused(tmp_path):
    path = tmp_path / "r.records.jsonl"
    path.write_text(json.dumps({"name": "x", "value": float("nan"), "unit": "u"}) + "\n")
    with pytest.raises(ValueError, match="value of x must be finite"):
        read_metrics(path)


def test_docs_say_that_comments_in_record_files_are_not_kept():
    root = Path(__file__).resolve().parent.parent
    arch = (root / "docs" / "architecture.md").read_text()
    section = arch.split("## Records", 1)[1].split("\n## ", 1)[0]
    assert "comments" in section.lower() and "comments" in records.__doc__.lower()


# -------------------------------------------------------------------- 5. leftover runs, Ctrl-C, kernel starts

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _run_dir(root: Path, name: str, pid: int, age_s: float, failed: bool = False) -> Path:
    d = root / ".specbook" / "runs" / name
    d.mkdir(parents=True)
    (d / "owner.json").write_text(json.dumps({"pid": pid, **({"failed": "2026-12-01T00:00:00Z"} if failed else {})}))
    (d / "x.ipynb").write_text("{}")
    t = time.time() - age_s
    for p in (d / "owner.json", d / "x.ipynb", d):
        os.utime(p, (t, t))
    return d


def test_stale_run_directories_are_removed_at_the_start_of_a_run(tmp_path, cpu_machine):
    root = make_repo(tmp_path, bench=runbook_text(), bad=runbook_text(body="raise KeyError('boom')"))
    killed = _run_dir(root, "killed-cpu-old", _dead_pid(), 2 * 86400)
    legacy = root / ".specbook" / "runs" / "legacy-cpu-old"  # from before runs named their owner
    legacy.mkdir()
    os.utime(legacy, (time.time() - 2 * 86400,) * 2)
    failed = _run_dir(root, "failed-cpu-recent", _dead_pid(), 60, failed=True)  # its error message named it
    running = _run_dir(root, "running-cpu-old", os.getpid(), 2 * 86400)  # a long run still going

    assert cli(root, "run", "--record", "bench").exit_code == 0
    assert not killed.exists() and not legacy.exists() and failed.exists() and running.exists()
    assert sorted(p.name for p in (root / ".specbook" / "runs").iterdir()) == [failed.name, running.name]

    r = cli(root, "run", "bad")  # a failed run keeps the notebook its message names
    assert r.exit_code == 3
    assert Path(r.stderr.split("partly executed notebook: ")[1].rstrip(")\n")).exists()


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    root = make_repo(tmp_path, slow=runbook_text(profiles=f"{{{_here()}: {{}}}}", body="""
        import time
        print("started", flush=True)
        open("started", "w").close()
        time.sleep(120)
    """))
    proc = _runbook_cmd(root, "run", "slow", "--json", start_new_session=True)
    deadline = time.monotonic() + 120
    while not (root / "started").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground process group
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err
    assert "Traceback" not in err and "Error" not in err, err
    assert not (root / "baselines" / "slow.yaml").exists()
    assert not list((root / ".specbook" / "runs").iterdir())  # no message names the interrupted run's notebook


LINGERS = runbook_text(profiles=f"{{{_here()}: {{}}}}", body="""
    import os, subprocess, time
    child = subprocess.Popen(["sleep", "300"])  # what the runbook's code starts: a server, a worker
    with open("pids.tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace("pids.tmp", "pids")
    time.sleep(300)
""")


def _gone(pid: int) -> bool:
    """Whether a process has ended (a zombie waiting for a parent that is gone has ended too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_run_leaves_no_kernel_and_no_run_directory(tmp_path, sig):
    """`kill` (SIGTERM) or `kill -9` of `runbook run` once left the kernel running the runbook's code, its children,
    and .specbook/runs/... behind. SIGTERM: the kernel's process group is killed, the run directory removed, exit
    143. SIGKILL cannot be caught: the kernel sees its parent gone and kills its group, and the next run removes the
    directory of a run whose process is gone."""
    root = make_repo(tmp_path, slow=LINGERS, quick=runbook_text(profiles=f"{{{_here()}: {{}}}}"))
    log = tmp_path / "stderr"
    with open(log, "w") as f:  # not a pipe: what outlives the command would hold it open
        proc = subprocess.Popen([sys.executable, "-m", "specbook.cli", "--root", str(root), "run", "slow"],
                                stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (root / "pids").exists():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.1)
    pids = [int(p) for p in (root / "pids").read_text().split()]
    os.kill(proc.pid, sig)  # the command alone, as `kill PID` or a supervisor's timeout sends it
    proc.wait(timeout=60)
    err = log.read_text()
    if sig == signal.SIGTERM:
        assert proc.returncode == 143 and err.strip().splitlines()[-1] == "terminated", err
        assert not list((root / ".specbook" / "runs").iterdir())
    deadline = time.monotonic() + 20
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in pids if not _gone(p)] == [], "the kernel or its child outlived the run"
    if sig == signal.SIGKILL:
        assert len(list((root / ".specbook" / "runs").iterdir())) == 1
        assert cli(root, "run", "quick").exit_code == 0  # the next run: the dead run's directory goes
        assert not list((root / ".specbook" / "runs").iterdir())


def test_ctrl_c_leaves_no_traceback_of_the_abandoned_cell(tmp_path, cpu_machine, caplog):
    """The cell interrupts this process while it waits for the cell's reply (the moment a Ctrl-C usually comes):
    nbclient's task of that cell then fails as the kernel shuts down, and asyncio used to print its DeadKernelError
    when the task was collected."""
    root = make_repo(tmp_path, slow=runbook_text(body="""
        import os, signal, time
        os.kill(int(os.environ["JPY_PARENT_PID"]), signal.SIGINT)
        time.sleep(60)
    """))
    r = cli(root, "run", "slow", "--json")
    code, err = r.exit_code, r.stderr
    del r  # its exception chain keeps nbclient's tasks alive
    ensure_event_loop().run_until_complete(asyncio.sleep(2))  # the abandoned tasks run on, as at a later run or exit
    gc.collect()
    assert code == 130 and err.strip().splitlines()[-1] == "interrupted", err
    assert not [rec.getMessage() for rec in caplog.records if rec.name == "asyncio"]


KERNEL_PORTS = """
    import json
    import ipykernel.connect
    info = json.loads(open(ipykernel.connect.get_connection_file()).read())
    record("tcp_ports", 5 if info["transport"] == "tcp" else 0, unit="n", direction="none")
"""


@pytest.mark.slow
def test_concurrent_kernel_starts_take_no_tcp_ports(tmp_path):
    """jupyter_client picks free TCP ports, closes them and hands them to the kernel: a concurrent start can take
    one in between (Address already in use, or a kernel that died before replying). Kernels here listen on sockets
    in a directory of their own instead; four runs start at once and all land."""
    profile = f"{{{_here()}: {{}}}}"
    root = make_repo(tmp_path, **{f"k{i}": runbook_text(profiles=profile, body=KERNEL_PORTS) for i in range(4)})
    procs = [_runbook_cmd(root, "run", "--record", f"k{i}", "--json") for i in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
    for i in range(4):
        assert baseline(root, f"k{i}")["profiles"][_here()]["metrics"]["tcp_ports"]["value"] == 0


# --------------------------------------------------------------------------------------- 6. names that are paths

@pytest.mark.parametrize("args", [("show", "../evil"), ("show", "../evil", "--json"), ("status", "../evil"),
                                  ("verify", "../evil"), ("verify", "bench", "../evil")])
def test_names_that_are_paths_are_refused_everywhere(tmp_path, args, cpu_machine):
    root = make_repo(tmp_path, bench=runbook_text())
    (root / "evil.yaml").write_text(GOOD.replace("runbook: bench", "runbook: evil"))  # valid, but outside baselines/
    _one_line(cli(root, *args), 2, "invalid runbook name '../evil'")


# ------------------------------------------------------------------------------------------- unknown profiles

@pytest.mark.parametrize("args", [("verify", "--profile", "cpu.typo"), ("verify", "bench", "--profile", "cpu.typo"),
                                  ("run", "bench", "--profile", "nosuch"), ("run", "bench", "--profile", "cpu.typo")])
def test_unknown_profiles_name_the_known_ones(tmp_path, args, cpu_machine):
    root = make_repo(tmp_path, bench=runbook_text(profiles="{cpu: {}, cpu.dsv3: {}}"))
    records.add_run(root, "bench", "h200", _run(0), [make_metric("x", 1.0, unit="u")])
    _one_line(cli(root, *args), 2, f"unknown profile '{args[-1]}'; known profiles: cpu, cpu.dsv3, h200")


# ------------------------------------------------------------------------------- an input that cannot be hashed here

def _corpus_repo(tmp_path: Path, monkeypatch, archives: str) -> Path:
    """A repository whose runbook declares the real corpus input, its record claimed in docs, and a corpus
    directory of this machine holding `archives`: "corrupt" (every pinned archive, damaged) or "none"."""
    from engine.train import corpus

    root = make_repo(tmp_path / "repo", a=runbook_text(extra_header="inputs: [corpus]"))
    with open(root / "pyproject.toml", "a") as f:
        f.write('\n[tool.specbook.inputs]\ncorpus = "engine.train.corpus:manifest_hash"\n')
    _write_record(root, "a")
    (root / "docs").mkdir()
    (root / "docs" / "p.md").write_text("---\ntitle: P\nstatus: current\nupdated: 2026-12-01\nrunbooks: []\n"
                                        "records: []\n---\n\nx is <!-- claim: a/cpu/x fmt=.1f -->1.0<!-- /claim --> u\n")
    (root / "docs" / "status.md").write_text("committed\n")
    here = tmp_path / "corpus"
    here.mkdir()
    if archives == "corrupt":
        for pin in corpus.pins():
            (here / pin.filename).write_bytes(b"not the archive")
    monkeypatch.setenv(corpus.DIR_ENV, str(here))
    corpus.scan.cache_clear()  # this process may have scanned the real corpus (a failed scan is not cached)
    return root


def test_a_damaged_local_corpus_is_never_written_into_the_committed_status_page(tmp_path, monkeypatch, cpu_machine):
    """It once made `runbook site` write "failed" for every number into docs/status.md: a problem of this machine,
    not of the records."""
    root = _corpus_repo(tmp_path, monkeypatch, "corrupt")
    r = cli(root, "site")
    _one_line(r, 3, "input corpus unavailable", "does not match its pinned sha256", "unknown here")
    assert (root / "docs" / "status.md").read_text() == "committed\n"
    assert not (root / "docs" / "llms.txt").exists()


def test_site_check_fetches_nothing(tmp_path, monkeypatch, cpu_machine):
    """`site --check` is documented to write nothing; it once downloaded the corpus (21 MB) to hash it."""
    from engine.train import corpus

    root = _corpus_repo(tmp_path, monkeypatch, "none")
    fetched = []
    monkeypatch.setattr(corpus, "_pip_download", lambda batch, dest: fetched.append(batch))
    r = cli(root, "site", "--check")
    _one_line(r, 3, "not in", "SPECBOOK_OFFLINE forbids fetching them", "unknown here")
    assert fetched == [] and list((tmp_path / "corpus").iterdir()) == []
