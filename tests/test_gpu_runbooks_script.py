"""scripts/gpu-runbooks.sh off a GPU: chains' exit codes, logs in $OUT while they run, and results packed when the
script is cut (a lent machine's call ends at its limit; what finished must still come back)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-runbooks.sh"

# python3 -m specbook.cli CMD...: a stand-in that records a file, says what it ran and exits as told
FAKE_PYTHON = """#!/usr/bin/env bash
shift 2  # -m specbook.cli
echo "ran $*"
case "$1" in
  sleep) sleep "$2" ;;
  fail) exit "$2" ;;
  git-dir) echo "GIT_DIR=${GIT_DIR:-unset}" ;;
  record) echo "$2" > "baselines/$2.yaml" ;;
  verify)  # the lines a verify on one GPU logs as its runbooks start and end, then one still running
    echo "[0] a/h200: started" >&2
    echo "[gpu 0] done a/h200 in 12 s (kernel start 1 s, cells 9 s)" >&2
    echo "[0] a/h200: finished in 13 s (exit 0)" >&2
    echo "[0] b/h200: started" >&2
    sleep "$2" ;;
esac
"""


def tree(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "baselines").mkdir()
    (root / "docs" / "runbooks" / "executed").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts")
    shutil.copy(SCRIPT.parent / "carried-wheels.sh", root / "scripts")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("python3", FAKE_PYTHON), ("nvidia-smi", "#!/bin/sh\necho '0, fake GPU, 0 MiB'\n")):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SPECBOOK_GIT_COMMIT": "abc",
           "OUT": str(tmp_path / "out")}
    return root, env


def members(tmp_path: Path) -> set[str]:
    with tarfile.open(tmp_path / "out" / "results.tgz") as tar:
        return set(tar.getnames())


def test_the_first_failing_chain_sets_the_exit_code_and_every_chain_runs_to_its_end(tmp_path):
    root, env = tree(tmp_path)
    r = subprocess.run(["bash", "scripts/gpu-runbooks.sh", "record a;fail 5;record b", "fail 7"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 5, r.stdout + r.stderr
    assert "baselines/b.yaml" in members(tmp_path)  # the chain went on after its failure
    log = (tmp_path / "out" / "gpu0.log").read_text()
    assert "[gpu 0] ran record b" in log and "exit 5" in log
    assert all(re.match(r"\d\d:\d\d:\d\d \[gpu 0\] ", line) for line in log.splitlines())  # each line timed
    assert "exit 7" in (tmp_path / "out" / "gpu1.log").read_text()


def test_a_cut_run_still_packs_what_finished_and_its_log(tmp_path):
    root, env = tree(tmp_path)
    p = subprocess.Popen(["bash", "scripts/gpu-runbooks.sh", "record a;sleep 30;record b"], cwd=root, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = tmp_path / "out" / "gpu0.log"
    deadline = time.monotonic() + 30
    while not (log.exists() and "ran sleep" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "[gpu 0] ran record a" in log.read_text()  # in $OUT before the chain ended
    os.killpg(p.pid, signal.SIGTERM)  # what timeout(1) does to its command's process group
    _, err = p.communicate(timeout=30)
    assert p.returncode == 124 and "packing what finished" in err
    got = members(tmp_path)
    assert "baselines/a.yaml" in got and "baselines/b.yaml" not in got and "logs/gpu0.log" in got


def test_fresh_removes_what_earlier_runs_left_and_only_then(tmp_path):
    root, env = tree(tmp_path)
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    left = [tmp / "site" / "pkg.py", tmp / "torchinductor_root" / "fx" / "k.py", home / ".triton" / "cache" / "k",
            home / ".cache" / "torch" / "kernels" / "k", home / ".cache" / "triton" / "k"]
    kept = home / ".cache" / "pip" / "k"  # not a compile cache
    for f in [*left, kept]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x")
    env = {**env, "HOME": str(home), "TMPDIR": str(tmp)}
    r = subprocess.run(["bash", "scripts/gpu-runbooks.sh", "record a"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and all(f.exists() for f in left), r.stdout + r.stderr  # only asked for
    r = subprocess.run(["bash", "scripts/gpu-runbooks.sh", "record a"], cwd=root, env={**env, "FRESH": "1"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [f for f in left if f.exists()] == [] and kept.exists()
    assert "FRESH=1: removed" in r.stdout


ROW = r"{key}\s+\d\d:\d\d:\d\d\s+{end}\s+{wall}\s+{runs}\s+{kernel}\s+{cells}\s+{code}"


def test_the_log_ends_with_where_each_runbooks_time_went(tmp_path):
    root, env = tree(tmp_path)
    r = subprocess.run(["bash", "scripts/gpu-runbooks.sh", "verify 0"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    table = r.stdout.split("== where the time went")[1]
    assert re.search(ROW.format(key="a/h200", end=r"\d\d:\d\d:\d\d", wall=13, runs=1, kernel=1, cells=9, code=0),
                     table), table
    assert re.search(ROW.format(key="b/h200", end="running", wall="-", runs=0, kernel="-", cells="-", code="-"),
                     table), table
    assert table.strip() in (root / "logs" / "summary.txt").read_text()  # packed with the logs


def test_a_cut_run_says_which_runbooks_were_still_running(tmp_path):
    root, env = tree(tmp_path)
    p = subprocess.Popen(["bash", "scripts/gpu-runbooks.sh", "verify 30"], cwd=root, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = tmp_path / "out" / "gpu0.log"
    deadline = time.monotonic() + 30
    while not (log.exists() and "b/h200: started" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 124
    assert re.search(ROW.format(key="b/h200", end="running", wall="-", runs=0, kernel="-", cells="-", code="-"), out)
    assert "logs/summary.txt" in members(tmp_path)


def test_a_git_copy_that_does_not_know_the_sent_commit_is_not_asked(tmp_path):
    """A lent machine gets the sending checkout's .git as it was when the session began; a commit made since is
    unknown there, and specbook would refuse it: the script then hides that .git (and keeps one that knows it)."""
    root, env = tree(tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], cwd=root, check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "old"], cwd=root, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    for sent, hidden in (("f" * 40, True), (head, False)):
        r = subprocess.run(["bash", "scripts/gpu-runbooks.sh", "git-dir"], cwd=root,
                           env={**env, "SPECBOOK_GIT_COMMIT": sent}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        log = (tmp_path / "out" / "gpu0.log").read_text()
        assert ("GIT_DIR=/nonexistent/.git" in log) is hidden and ("GIT_DIR=unset" in log) is not hidden, log
