"""The model-loading options of `python -m engine generate | bench | serve` and the helper that turns them into an
engine.runtime.Engine: one definition for every command that loads a model.

Only click and the torch-free engine.spec_settings here at import time (torch and the engine load inside the
helpers), so engine/__main__.py and engine/serve can both import it without importing each other.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import click

from engine.spec_settings import DEFAULT_STEPS, DEFAULT_TOPK


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf: nan passes every comparison with a bound, and an infinite
    temperature samples uniform noise."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


# torch.manual_seed's range (64 bits), as engine.loading.SEEDS for the Python API (torch is not imported here)
SEED = click.IntRange(-2**63, 2**64 - 1)

# Exit codes: the same meanings as `runbook`'s (specbook/cli.py); tests/test_cli_conventions.py holds them together
EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES = """\b
Exit codes (the same meanings as runbook's):
  0    ok
  1    a check failed (no engine command checks anything; runbook: drifted or flaky numbers)
  2    bad input or usage: one line on stderr
  3    internal failure, could not run: one line on stderr (--debug shows the traceback)
  130  interrupted (Ctrl-C)"""

DEBUG = "engine.debug"  # key in click's context meta, shared by a group and its subcommands


def _note_debug(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.meta[DEBUG] = True
    return value


DEBUG_ATTRS: dict[str, Any] = {"is_flag": True, "expose_value": False, "callback": _note_debug,
                                "help": "Show tracebacks (before or after the command name)."}


def debug_option() -> click.Option:
    """--debug, accepted before and after the command name: it only marks the shared context."""
    return click.Option(["--debug"], **DEBUG_ATTRS)


def with_debug(cmd: click.Command) -> click.Command:
    """Add --debug to a command and, for a group, to each of its subcommands."""
    if not any(p.name == "debug" for p in cmd.params):
        cmd.params.append(debug_option())
    for sub in getattr(cmd, "commands", {}).values():
        with_debug(sub)
    return cmd


def debug_requested(ctx: click.Context | None = None) -> bool:
    ctx = ctx or click.get_current_context(silent=True)
    return bool(ctx and ctx.meta.get(DEBUG))


def int_list(minimum: int) -> Callable[[click.Context, click.Parameter, str | None], list[int] | None]:
    """A click callback: '1,2,4' or '1 2 4' -> [1, 2, 4], every number >= minimum."""
    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
        if value is None:
            return None
        try:
            out = [int(x) for x in value.replace(",", " ").split()]
        except ValueError:
            raise click.BadParameter(f"expected integers separated by commas or spaces, got {value!r}") from None
        if not out or min(out) < minimum:
            raise click.BadParameter(f"expected integers >= {minimum}, got {value!r}")
        return out

    return parse


def engine_options(max_seq_len: int | None, max_seq_len_help: str,
                   extra: Sequence[Callable[[Callable], Callable]] = (),
                   compile_help: str = "") -> Callable[[Callable], Callable]:
    """A decorator adding what to load and how to run it. `max_seq_len` is the command's --max-seq-len default (None:
    the command decides); `extra` are the command's own options, listed before --debug; `compile_help` ends
    --compile's help for this command."""
    options = [
        click.option("--target", type=click.Path(), default=None,
                     help="HF-format model directory (config.json, *.safetensors, tokenizer.json)."),
        click.option("--shape", default=None, help="Named random-weight shape instead of --target: tiny, small, "
                                                   "llama-3.2-1b, llama-3.1-8b, qwen3-8b, ..."),
        click.option("--device", default=None, help="cpu or cuda [default: cuda when available, else cpu]."),
        click.option("--dtype", default=None, help="float32 | bfloat16 | float16 (fp32/bf16/fp16) "
                                                   "[default: bf16 on cuda, fp32 on cpu]."),
        click.option("--max-seq-len", default=max_seq_len, show_default=max_seq_len is not None,
                     type=click.IntRange(min=2), help=max_seq_len_help),
        click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
                     help="Replay the decode step as a CUDA graph (no effect on cpu)."),
        click.option("--drafter", type=click.Path(), default=None,
                     help="EAGLE-3 drafter directory: speculative decoding instead of the target alone."),
        click.option("--steps", default=DEFAULT_STEPS, show_default=True, type=click.IntRange(min=1),
                     help="Draft steps per cycle."),
        click.option("--topk", default=DEFAULT_TOPK, show_default=True, type=click.IntRange(min=1),
                     help="Draft top-k: 1 chain, > 1 tree."),
        click.option("--draft-tokens", default=None, type=click.IntRange(min=2),
                     help="Tokens per verify, the root included [default: steps*topk+1; a chain: steps+1]."),
        click.option("--eager-verify", is_flag=True, help="Run the verify forward without CUDA graphs (the slow "
                                                          "path of the game plan, for comparison)."),
        click.option("--compile", "compile_", is_flag=True,
                     help="torch.compile inside the CUDA graphs (fuses small ops): the decode step's forward, or with "
                          "--drafter the draft steps and verify" + compile_help + "."),
        *extra,
        click.option("--debug", **DEBUG_ATTRS),
    ]

    def decorate(f: Callable) -> Callable:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


def default_device(device: str | None) -> str:
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def load_engine(device: str | None = None, dtype: str | None = None, compile_: bool = False, **options: Any):
    """engine.runtime.Engine.load from the options above (`compile_` is generate/bench's --compile); the device
    defaults to cuda when available, the dtype to bf16 on cuda and fp32 on cpu."""
    from engine.runtime import Engine

    device = default_device(device)
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return Engine.load(device=device, dtype=dtype, compile=compile_, **options)
