"""scripts/ab-decode.py without a GPU: its exit codes say what went wrong (the A/B itself runs on a lent GPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ab-decode.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [["--switch", "engine.decode_attention.no_such_switch"],
                                  ["--switch", "engine.decode_attention.BLOCK_N"],  # an int, not a switch
                                  ["--switch", "torch.backends.cudnn.enabled"],  # outside the engine
                                  ["--switch", "engine.no_such_module.x"],
                                  ["--switch", "engine.moe_decode.fuse_shared", "--shape", "no-such-shape"],
                                  ["--switch", "engine.moe_decode.fuse_shared", "--rounds", "2"]])
def test_bad_arguments_exit_2_with_the_reason(args):
    r = run(*args)
    assert r.returncode == 2 and args[-2] in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the A/B runs")
def test_no_gpu_exits_3():
    r = run("--switch", "engine.decode_attention.fuse_merge")
    assert r.returncode == 3 and "no CUDA device" in r.stderr, r.stderr
