#!/usr/bin/env python3
"""Compile the engine's Triton kernels for a Hopper GPU (sm_90: H100, H200) on a machine without one, at the launch
arguments the engine gives them for a shape, and report what the compiler made of each: registers and spilled
bytes per thread, shared memory per block, software-pipelined copies (cp.async, TMA) and wgmma.

    python scripts/kernel-report.py [--shape llama-3.1-8b,llama-3.2-1b,deepseek-v3-mini] [--kernels K=V,...]
        [--json]

Why: Triton's interpreter (the CPU tests) checks what a kernel computes, not what it becomes on the GPU: a kernel
can pass it and fail to compile there (a module global read as other than a tl.constexpr, docs/findings.md section
25), spill its registers, ask for more shared memory than a block may have, or run its loop over K unpipelined. Each
of those costs a lease's minutes to find. (Registers at the limit, 255, are a hint too: ptxas then issues a fully
unrolled kernel's loads fewer at a time rather than spill, which no count here shows.) Here each launch goes through
the engine's own wrapper (engine.gemv's products, engine.decode_attention's split-KV attention,
engine.moe_decode.routed_experts), as a model built with --kernels (engine/kernels.py; default the engine's) runs
them, with CPU tensors of the shape's sizes; a launch compiles instead of running (JITFunction.warmup, under a
stand-in driver that names sm_90), so the arguments, their specialization (alignment, divisibility by 16) and the
compile options are the JIT's own on the GPU. The
resources are read from the compiled binary (cuobjdump, shipped with Triton). Nothing is timed: what runs fast is a
benchmark's question (scripts/bench-gemv.py, scripts/ab-decode.py).

Exit: 0 every launch compiled within the limits; 1 some launch failed to compile, spilled, or asked for more
shared memory than a block of sm_90 may have; 2 bad arguments; 3 no Triton here.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.errors import EngineError  # noqa: E402
from engine.kernels import Kernels  # noqa: E402
from engine.shapes import SHAPES  # noqa: E402
from gpu_bench import add_shape_option, products, shapes_of  # noqa: E402

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction
except ImportError:
    triton = None

NO_TRITON = 3
SM90_SHARED = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
DECODE_CACHE, LONG_CACHE = 384, 33024  # the caches baseline-decode decodes in: 128 + 256 tokens, and 32768 + 256
VERIFY_TOKENS = 8  # a chain of 7 drafts' verify
TREE_TOKENS = 32  # a tree's verify (tree-sweep's k8x4n32)


@dataclass
class Launch:
    kernel: str
    case: str  # what the engine runs it for
    constexprs: dict
    num_warps: int
    num_stages: int
    regs: int = 0
    spill_bytes: int = 0  # stack and local memory per thread: spilled registers
    shared: int = 0
    pipelined_copies: int = 0  # cp.async / TMA copies in the PTX: the compiler pipelined a loop's loads
    wgmma: bool = False
    error: str = ""

    @property
    def problems(self) -> list[str]:
        if self.error:
            return [f"does not compile: {self.error}"]
        out = [f"spills {self.spill_bytes} bytes a thread"] if self.spill_bytes else []
        if self.shared > SM90_SHARED:
            out.append(f"asks for {self.shared} bytes of shared memory, over {SM90_SHARED}")
        return out


class Sm90Driver:
    """Stands in for the CUDA driver where the JIT asks which GPU it compiles for."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers, spilled bytes) per thread of a cubin's one function, by cuobjdump -res-usage: the spilled bytes
    are its stack frame and local memory, which a Triton kernel (no recursion, no local arrays) uses for spills."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    field = {k: int(v) for k, v in (w.split(":") for w in out.split() if w.startswith(("REG:", "STACK:", "LOCAL:")))}
    return field["REG"], field["STACK"] + field["LOCAL"]


def describe(kernel, case: str, grid, args: tuple, kwargs: dict) -> Launch:
    """Compile one launch the way the JIT would on an sm_90 GPU and read what it became."""
    consts = {p.name: v for p, v in zip(kernel.params, args) if p.is_constexpr}
    consts.update({k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")})
    launch = Launch(kernel.fn.__name__, case, consts, kwargs.get("num_warps", 4), kwargs.get("num_stages", 3))
    try:
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
    except Exception as e:  # noqa: BLE001 - a compile error is this report's finding, not its failure
        launch.error = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        return launch
    ptx = compiled.asm["ptx"]
    launch.regs, launch.spill_bytes = resources(compiled.asm["cubin"])
    launch.shared = compiled.metadata.shared
    launch.num_stages = compiled.metadata.num_stages
    launch.pipelined_copies = ptx.count("cp.async.ca") + ptx.count("cp.async.cg") + ptx.count("cp.async.bulk")
    launch.wgmma = "wgmma" in ptx
    return launch


@contextlib.contextmanager
def compiling(case: str, found: list[Launch]) -> Iterator[None]:
    """Within it, every Triton launch compiles for sm_90 and is appended to `found` instead of running."""
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        if warmup:  # describe's own compile
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        found.append(describe(self, case, grid, args, kwargs))

    JITFunction.run = compile_instead
    try:
        yield
    finally:
        JITFunction.run = run


def empty(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)  # never read: the kernels are compiled, not run


def gemv_launches(shape: str, kernels: Kernels, found: list[Launch]) -> None:
    """Each product at one row and at a verify's rows, as the chosen products run them; a Llama layer's fused
    prologues where chosen."""
    from engine import gemv
    c = ModelConfig(**SHAPES[shape])
    for name, n, k in products(shape):
        if n * k > gemv.MAX_WEIGHT:
            continue  # cuBLAS takes it
        what = f"{shape} {name} [{n} x {k}]"
        if kernels.linear != "cublas":
            blocks = gemv.Linear(k, n, bias=False, device="meta", kernels=kernels).blocks
            with compiling(f"{what}, 1 row", found):
                kernels.pick("linear")(empty(1, k), empty(n, k), None, *blocks)
        if kernels.verify_linear != "cublas":
            for m in (VERIFY_TOKENS, TREE_TOKENS):
                with compiling(f"{what}, {m} rows", found):
                    kernels.pick("verify_linear")(empty(m, k), empty(n, k))
        if c.is_mla:
            continue
        if name == "down_proj" and kernels.swiglu_prologue != "swiglu_then_product":
            with compiling(f"{what}, 1 row, SwiGLU prologue", found):
                gemv.swiglu_gemv(empty(1, 2 * k), empty(n, k), None, kernels.wide_prologue)
        if name in ("wqkv", "w13") and kernels.norm_prologue != "add_then_norm":
            with compiling(f"{what}, 1 row, add + norm prologue", found):
                gemv.add_norm_gemv(empty(1, k), empty(1, k), empty(k), 1e-5, empty(n, k), None,
                                   kernels.wide_prologue)


def attention_launches(shape: str, kernels: Kernels, found: list[Launch]) -> None:
    from engine import decode_attention
    c = ModelConfig(**SHAPES[shape])
    if c.is_mla or kernels.attention == "sdpa":
        return  # MLA's attention is SDPA's (engine/deepseek.py)
    rep = c.num_attention_heads // c.num_key_value_heads
    for tokens in (1, VERIFY_TOKENS):
        for cache in (DECODE_CACHE, LONG_CACHE):
            case = f"{shape} attention, {tokens} token(s) over a cache of {cache}"
            with compiling(case, found):
                kv = empty(1, c.num_key_value_heads, cache, c.head_dim)
                counts = torch.zeros(c.num_key_value_heads, dtype=torch.int32) if kernels.fuse_merge else None
                decode_attention.split_kv_attention(
                    empty(1, c.num_key_value_heads, rep * tokens, c.head_dim), kv, kv,
                    torch.ones(tokens, cache, dtype=torch.bool), tokens, counts, kernels.pick("merge"),
                    kernels.attention_block_n or decode_attention.BLOCK_N)


def expert_launches(shape: str, kernels: Kernels, found: list[Launch]) -> None:
    from engine import moe_decode
    from engine.deepseek import Experts
    c = ModelConfig(**SHAPES[shape])
    if not c.n_routed_experts:
        return
    E, H, inter, top_k = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    inter_s = c.n_shared_experts * inter
    gate_up, down = empty(E, 2 * inter, H), empty(E, H, inter)
    blocks = Experts(1, 1, 1, kernels).blocks  # the block sizes the model's experts take
    for tokens in (1, VERIFY_TOKENS):
        fused = kernels.fuse_shared and tokens <= moe_decode.SHARED_MAX_TOKENS
        shared = (empty(2 * inter_s, H), empty(H, inter_s)) if fused else None
        idx = torch.arange(tokens * top_k).reshape(tokens, top_k) % E
        case = f"{shape} routed experts, {tokens} token(s)" + (", shared experts in" if shared else "")
        with compiling(case, found):
            moe_decode.routed_experts(empty(tokens, H), torch.ones(tokens, top_k), idx, gate_up, down,
                                      shared=shared, **blocks)


def report(shapes: list[str], kernels: Kernels | None = None) -> list[Launch]:
    found: list[Launch] = []
    driver.set_active(Sm90Driver())  # for this process: it compiles and never launches
    for shape in shapes:
        for launches in (gemv_launches, attention_launches, expert_launches):
            launches(shape, kernels or Kernels(), found)
    return found


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_option(p)
    p.add_argument("--kernels", default="", help="kernel choices, CHOICE=VALUE,... (engine/kernels.py) [default: "
                   "the engine's]")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    a.shapes = shapes_of(p, a.shape)
    try:
        a.kernels = Kernels.parse(a.kernels)
    except EngineError as e:
        p.error(f"--kernels: {e}")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if triton is None:
        print("no Triton here: it compiles the kernels (the test extra installs it on Linux x86-64)", file=sys.stderr)
        return NO_TRITON
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(tempfile.gettempdir()) / "specbook-sm90-triton"))
    found = report(a.shapes, a.kernels)
    bad = [x for x in found if x.problems]
    if a.json:
        print(json.dumps({"target": "sm_90", "triton": triton.__version__, "shared_limit": SM90_SHARED,
                          "kernels": a.kernels.as_dict(),
                          "launches": [{**asdict(x), "problems": x.problems} for x in found]}, indent=1))
        return 1 if bad else 0
    print(f"the engine's Triton kernels compiled for sm_90 (Triton {triton.__version__}), kernels {a.kernels}; "
          f"registers and spilled bytes a thread, shared bytes a block")
    print(f"{'kernel':<18} {'warps':>5} {'stages':>6} {'regs':>5} {'spill':>6} {'shared':>7} {'pipelined':>9} "
          f"{'wgmma':>5}  launch")
    for x in found:
        if x.error:
            print(f"{x.kernel:<18} {x.num_warps:>5} {'':>6} {'-':>5} {'-':>6} {'-':>7} {'-':>9} {'-':>5}  {x.case}: "
                  f"does not compile: {x.error}")
            continue
        print(f"{x.kernel:<18} {x.num_warps:>5} {x.num_stages:>6} {x.regs:>5} {x.spill_bytes:>6} {x.shared:>7} "
              f"{x.pipelined_copies:>9} {'yes' if x.wgmma else 'no':>5}  {x.case}")
    for x in bad:
        print(f"PROBLEM {x.kernel} ({x.case}): {'; '.join(x.problems)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
