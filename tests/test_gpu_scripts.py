"""The GPU benchmarks and A/Bs of scripts/ without a GPU: their exit codes say what went wrong, 2 for bad arguments
(with the reason), 3 where there is no GPU. The timings themselves run on a lent GPU; tests/test_gpu_engine.py
covers the kernels there."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
OLD = "{old}"  # stands for a directory holding a copy of engine/decode_attention.py (ab-kernels.py's --old)


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                          timeout=120)


# (script, arguments, what the one-line error names)
BAD_ARGUMENTS = [
    ("ab-decode.py", ["--b", "no_such_choice=1"], "unknown choice 'no_such_choice'"),
    ("ab-decode.py", ["--b", "verify_linear=fastest"], "unknown verify_linear 'fastest'"),
    ("ab-decode.py", ["--b", "gemv_block_n=3"], "gemv_block_n"),  # not a power of two
    ("ab-decode.py", ["--a", "merge", "--b", "fuse_merge=false"], "--a"),
    ("ab-decode.py", ["--b", "linear=gemv"], "the same kernels"),  # the defaults on both sides
    ("ab-decode.py", [], "--b"),
    ("ab-decode.py", ["--b", "fuse_shared=false", "--shape", "no-such-shape"], "--shape"),
    ("ab-decode.py", ["--b", "fuse_shared=false", "--rounds", "0"], "--rounds"),
    ("ab-decode.py", ["--b", "fuse_shared=false", "--tolerance", "2"], "--tolerance"),
    ("ab-decode.py", ["--b", "fuse_shared=false", "--expect", "slower"], "--expect"),
    ("ab-decode.py", ["--b", "fuse_shared=false", "--spec", "7,x"], "--spec"),
    ("ab-decode.py", ["--b", "fuse_shared=false", "--spec", "0,1,1"], "--spec"),
    ("kernel-report.py", ["--kernels", "merge=fastest"], "unknown merge 'fastest'"),
    ("bench-gemv.py", ["--shape", "no-such-shape"], "--shape"),
    ("bench-gemv.py", ["--shape", ","], "--shape"),
    ("bench-gemv.py", ["--samples", "2"], "--samples"),
    ("bench-gemv.py", ["--rows", "0"], "--rows"),
    ("bench-gemv.py", ["--rows", "8,x"], "--rows"),
    ("bench-gemv.py", ["--rows", "65"], "--rows"),
    ("kernel-report.py", ["--shape", "no-such-shape"], "--shape"),
    ("bench-moe-decode.py", ["--tokens", "1,x"], "--tokens"),
    ("bench-moe-decode.py", ["--tokens", "0"], "--tokens"),
    ("bench-moe-decode.py", ["--shape", "llama-3.1-8b"], "--shape"),  # not an MoE shape
    ("bench-moe-decode.py", ["--samples", "2"], "--samples"),
    ("ab-regen.py", ["--family", "llama,gpt2"], "--family"),
    ("ab-regen.py", ["--preset", "huge"], "unknown training preset 'huge'"),
    ("ab-regen.py", ["--samples", "0"], "--samples"),
    ("ab-regen.py", ["--rounds", "0"], "--rounds"),
]


@pytest.mark.parametrize("script,args,named", BAD_ARGUMENTS, ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD_ARGUMENTS])
def test_bad_arguments_exit_2_with_the_reason(script, args, named):
    r = run(script, *args)
    assert r.returncode == 2 and named in r.stderr, r.stderr


def test_ab_kernels_bad_old_directory_exits_2(tmp_path):
    r = run("ab-kernels.py", "--old", str(tmp_path / "missing"))
    assert r.returncode == 2 and "no directory" in r.stderr, r.stderr
    r = run("ab-kernels.py", "--old", str(tmp_path))  # a directory with neither module
    assert r.returncode == 2 and "holds none of" in r.stderr, r.stderr
    (tmp_path / "moe_decode.py").write_text((ROOT / "engine" / "moe_decode.py").read_text())
    r = run("ab-kernels.py", "--old", str(tmp_path), "--samples", "2")
    assert r.returncode == 2 and "--samples" in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the scripts run")
@pytest.mark.parametrize("script,args", [("ab-decode.py", ["--b", "fuse_merge=false"]),
                                         ("ab-kernels.py", ["--old", OLD]),
                                         ("bench-gemv.py", ["--shape", "llama-3.2-1b"]),
                                         ("bench-moe-decode.py", ["--tokens", "1"]),
                                         ("ab-regen.py", [])])
def test_no_gpu_exits_3(script, args, tmp_path):
    (tmp_path / "decode_attention.py").write_text((ROOT / "engine" / "decode_attention.py").read_text())
    r = run(script, *[str(tmp_path) if a == OLD else a for a in args])
    assert r.returncode == 3 and "no CUDA device" in r.stderr, r.stderr
