"""scripts/bench-gemv.py without a GPU: its exit codes say what went wrong (the timing itself runs on a lent GPU;
tests/test_gpu_engine.py::test_gemv_linear_on_cuda covers the kernel there)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench-gemv.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [["--shape", "no-such-shape"], ["--shape", ","], ["--samples", "2"]])
def test_bad_arguments_exit_2_with_the_reason(args):
    r = run(*args)
    assert r.returncode == 2 and args[0] in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the benchmark runs")
def test_no_gpu_exits_3():
    r = run("--shape", "llama-3.2-1b")
    assert r.returncode == 3 and "no CUDA device" in r.stderr, r.stderr
