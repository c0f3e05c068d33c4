"""scripts/kernel-ab.sh off a GPU: the stages it runs, the verdict table it ends on (read from each A/B's JSON), a
stage cut at its limit named as such, and exit codes for an unknown stage or a machine without a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kernel-ab.sh"

# python3 scripts/ab-decode.py --b CHOICE ... --json: a stand-in whose verdict depends on the choice; the merge hangs
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = -c ]; then exec /usr/bin/env -u PATH "$REAL_PYTHON" "$@"; fi
case "$*" in
  *pytest*) echo "3 passed"; exit 0 ;;
  *few_rows*--spec\\ 7,1,8*) echo '{"verdict": "faster"}'; exit 0 ;;
  *few_rows*) echo '{"verdict": "same"}'; exit 1 ;;
  *grouped_merge*) sleep 30 ;;
  *) echo '{"verdict": "slower"}'; exit 1 ;;
esac
"""


def tree(tmp_path: Path, gpu: bool = True) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts")
    shutil.copy(SCRIPT.parent / "carried-wheels.sh", root / "scripts")
    text = (SCRIPT.read_text().replace("timeout 200 ", "timeout 5 ").replace("ab merge 200", "ab merge 2"))
    (root / "scripts" / "kernel-ab.sh").write_text(text)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    smi = "#!/bin/sh\necho 'fake GPU, 1 MiB, 1'\n" if gpu else "#!/bin/sh\nexit 9\n"
    for name, body in (("python3", FAKE_PYTHON), ("nvidia-smi", smi)):
        (bin_ / name).write_text(body)
        (bin_ / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "REAL_PYTHON": shutil.which("python3") or "python3"}
    return root, env


def run(root: Path, env: dict[str, str], *stages: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/kernel-ab.sh", *stages], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_every_stage_runs_and_the_table_names_each_verdict(tmp_path):
    root, env = tree(tmp_path)
    r = run(root, env)
    assert r.returncode == 0, r.stdout + r.stderr
    table = {line.split()[0]: line for line in (tmp_path / "out" / "summary.txt").read_text().splitlines()}
    assert list(table) == ["tests", "rows", "rows-tree", "merge", "norm", "swiglu"]
    assert "passed" in table["tests"]
    assert "faster" in table["rows"] and "same" in table["rows-tree"]
    assert "cut at its limit" in table["merge"] and " 124 " in table["merge"]
    assert "slower" in table["norm"] and "slower" in table["swiglu"]
    # a lent machine gives back 8 files: the A/Bs' files travel in one archive
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["kernel-ab.tgz", "summary.txt"]
    with tarfile.open(tmp_path / "out" / "kernel-ab.tgz") as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
        assert tar.extractfile("./ab/rows.json").read().strip() == b'{"verdict": "faster"}'
    assert {f"ab/{s}.{ext}" for s in table if s != "tests" for ext in ("json", "err")} <= names
    assert {"gpu.txt", "gpu-tests.log", "summary.txt"} <= names


def test_named_stages_only(tmp_path):
    root, env = tree(tmp_path)
    r = run(root, env, "rows")
    assert r.returncode == 0
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rows ") and "faster" in lines[0]


def test_unknown_stage_and_no_gpu(tmp_path):
    root, env = tree(tmp_path)
    r = run(root, env, "rows", "bogus")
    assert r.returncode == 2 and "unknown stage 'bogus'" in r.stderr
    assert not (tmp_path / "out" / "summary.txt").exists()
    root2, env2 = tree(tmp_path / "nogpu", gpu=False)
    r = run(root2, env2, "rows")
    assert r.returncode == 3 and "no CUDA device" in r.stderr
