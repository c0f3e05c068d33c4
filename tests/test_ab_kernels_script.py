"""scripts/ab-kernels.py without a GPU: its exit codes say what went wrong (the A/B itself runs on a lent GPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ab-kernels.py"
ENGINE = Path(__file__).resolve().parents[1] / "engine"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_bad_arguments_exit_2_with_the_reason(tmp_path):
    r = run("--old", str(tmp_path / "missing"))
    assert r.returncode == 2 and "no directory" in r.stderr, r.stderr
    r = run("--old", str(tmp_path))  # a directory with neither module
    assert r.returncode == 2 and "holds none of" in r.stderr, r.stderr
    (tmp_path / "moe_decode.py").write_text((ENGINE / "moe_decode.py").read_text())
    r = run("--old", str(tmp_path), "--samples", "2")
    assert r.returncode == 2 and "--samples" in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the A/B runs")
def test_no_gpu_exits_3(tmp_path):
    (tmp_path / "decode_attention.py").write_text((ENGINE / "decode_attention.py").read_text())
    r = run("--old", str(tmp_path))
    assert r.returncode == 3 and "no CUDA device" in r.stderr, r.stderr
