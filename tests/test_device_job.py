"""scripts/device-job.sh: a job that outlives one lent-machine call, in a copy of the tree of its own."""

from __future__ import annotations

import shutil
import time
import subprocess
import uuid
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device-job.sh"


def job(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def name():
    n = f"test-{uuid.uuid4().hex[:8]}"
    yield n
    shutil.rmtree(f"/tmp/job-{n}", ignore_errors=True)


def test_a_job_writes_into_its_own_copy_and_its_exit_code_comes_back(tmp_path, name):
    tree = tmp_path / "tree"
    (tree / "baselines").mkdir(parents=True)
    (tree / "baselines" / "r.yaml").write_text("old\n")
    r = job(tree, "start", name, "sleep 2; echo new > baselines/r.yaml; echo done; exit 7")
    assert r.returncode == 0, r.stderr
    # what the next call does to the machine's tree: the working tree copied over it again
    (tree / "baselines" / "r.yaml").write_text("old\n")
    assert job(tree, "wait", name, "0").returncode == 124  # still running
    r = job(tree, "wait", name, "30")
    assert r.returncode == 7 and "done" in r.stdout and "ended: exit 7" in r.stdout
    assert (Path(f"/tmp/job-{name}/tree/baselines/r.yaml")).read_text() == "new\n"  # the job's record survived
    assert (tree / "baselines" / "r.yaml").read_text() == "old\n"


def test_bad_input_exits_2_with_one_line(tmp_path, name):
    for args in (["start", "a b", "true"], ["wait", name, "1"], ["wait", name, "x"], ["stop", name, "1"], ["start"]):
        r = job(tmp_path, *args)
        assert r.returncode == 2, args
        assert len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    assert job(tmp_path, "start", name, "true").returncode == 0
    r = job(tmp_path, "start", name, "true")  # one job per name
    assert r.returncode == 2 and "already started" in r.stderr


def test_stop_cuts_the_job_which_still_packs_and_its_exit_code_comes_back(tmp_path, name):
    """A lease about to end: `stop` sends TERM to the job's processes; a job that traps it (gpu-runbooks.sh packs
    what finished) still writes its exit code, and `stop` returns it."""
    script = "trap 'echo packed; exit 124' TERM; echo working; sleep 30 & wait"
    assert job(tmp_path, "start", name, script).returncode == 0
    time.sleep(1)
    r = job(tmp_path, "stop", name, "20")
    assert r.returncode == 124, r.stdout + r.stderr
    assert "sent TERM" in r.stdout and "packed" in r.stdout and "ended: exit 124" in r.stdout
    r = job(tmp_path, "stop", name, "1")  # already over: nothing to signal, the same answer
    assert r.returncode == 124 and "sent TERM" not in r.stdout
