"""Kernel choices: which implementation each of the model's products, attentions and expert launches runs, as one
frozen value (`Kernels`) passed where a model is built (engine.loading, engine.drafter, runtime.Engine, the CLI's
`--kernels k=v,...`) and recorded as a runbook parameter (`as_dict` / `from_dict`). The defaults are the engine's
behaviour; a new kernel lands off, and turning it on is a parameter change.

Dispatch is by name. A record's engine fingerprint covers the top-level definitions its runbook reaches by name
(identifiers, attribute names, import aliases, string constants, parameter values), so every choice's value is the
exact name of the top-level function that implements it, found with getattr in the module that holds it (`HOMES`)
and accepted only when it carries the `implements` mark for that choice. No table lists the implementations: a
kernel no run chooses is named nowhere in the code a run reaches, so landing it stales no record, and choosing it
stales exactly the runs that choose it. Its Triton kernel, wrapper and block-size helpers are top-level definitions
that only its implementation references.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from engine.errors import EngineError

# the module holding each named choice's implementations
HOMES = {"linear": "engine.gemv", "verify_linear": "engine.gemv", "attention": "engine.model",
         "merge": "engine.decode_attention", "norm_prologue": "engine.gemv", "swiglu_prologue": "engine.gemv"}
MAX_BLOCK = 4096  # a block size beyond this is a typo, not a tuning


def implements(*choices: str) -> Callable[[Callable], Callable]:
    """Mark a top-level function as an implementation of these choices (fields of Kernels), under its own name."""
    def mark(fn: Callable) -> Callable:
        fn.kernel_choices = choices
        return fn
    return mark


@functools.cache
def implementation(choice: str, name: str) -> Callable:
    """The function named `name` in the choice's home module, if it is marked as implementing `choice`."""
    module = importlib.import_module(HOMES[choice])
    fn = getattr(module, name, None) if name.isidentifier() else None
    if choice not in getattr(fn, "kernel_choices", ()):
        known = sorted(k for k, v in vars(module).items() if choice in getattr(v, "kernel_choices", ()))
        raise EngineError(f"kernels: unknown {choice} {name!r}; one of {', '.join(known)}")
    return fn


@dataclass(frozen=True)
class Kernels:
    """What the model's modules run. Named choices hold the name of their implementation (see the module doc);
    block sizes 0 take the kernel's own rule for the shape."""
    linear: str = "gemv"  # one-row products (a decode step): engine.gemv
    verify_linear: str = "cublas"  # products of 2 or more rows (verify, draft, prefill)
    attention: str = "split_kv"  # attention over the static cache (engine.model)
    fuse_merge: bool = True  # split-KV: the last block of a KV head merges its splits (few splits)
    merge: str = "unrolled_merge"  # split-KV: the merge's loop over the splits (engine.decode_attention)
    fuse_shared: bool = True  # MoE: a decode step's shared experts in the routed experts' launches
    norm_prologue: str = "add_then_norm"  # a Llama layer's residual add + RMSNorm before its q/k/v and gate/up
    swiglu_prologue: str = "swiglu_then_product"  # its SwiGLU before the down projection
    wide_prologue: bool = True  # fused prologues: more rows a program than the plain one-row kernel
    gemv_block_n: int = 0  # one-row kernel: output rows a program (0: engine.gemv.blocks by width)
    gemv_block_k: int = 0  # its load width
    gemv_warps: int = 0
    attention_block_n: int = 0  # split-KV: cached positions a tile (0: engine.decode_attention.BLOCK_N)
    moe_block_i: int = 0  # MoE decode kernels (0: engine.moe_decode's BLOCK_I, BLOCK_H, BLOCK_K, NUM_WARPS)
    moe_block_h: int = 0
    moe_block_k: int = 0
    moe_warps: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise EngineError(f"kernels: {f.name} is true or false, not {value!r}")
            elif f.type == "int":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > MAX_BLOCK \
                        or value & (value - 1):
                    raise EngineError(f"kernels: {f.name} is 0 (the kernel's own) or a power of two up to "
                                      f"{MAX_BLOCK}, not {value!r}")
            elif not isinstance(value, str):
                raise EngineError(f"kernels: {f.name} is a name, not {value!r}")
            else:
                implementation(f.name, value)
        if self.fuses_prologue and self.linear != Kernels.linear:
            raise EngineError(f"kernels: a fused prologue runs in the one-row kernel: linear={Kernels.linear}")

    @property
    def fuses_prologue(self) -> bool:
        """Whether a Llama layer hands its add + norm or its SwiGLU to the product after it (model.ProductBlock)."""
        return (self.norm_prologue != Kernels.norm_prologue) or (self.swiglu_prologue != Kernels.swiglu_prologue)

    def pick(self, choice: str) -> Callable:
        """The implementation this value chooses for `choice` (a named field)."""
        return implementation(choice, getattr(self, choice))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def changes(self) -> dict[str, Any]:
        """The fields that differ from the defaults."""
        default = Kernels()
        return {k: v for k, v in self.as_dict().items() if getattr(default, k) != v}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Kernels:
        """From a plain dict (a runbook parameter, `as_dict`'s output); unknown keys are bad input."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise EngineError(f"kernels: a mapping of choices, not {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise EngineError(f"kernels: unknown choice {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**d)

    @classmethod
    def parse(cls, text: str | None) -> Kernels:
        """'k=v,k=v' (the CLI's and the scripts' syntax): names as they are, true/false, integers."""
        types = {f.name: f.type for f in fields(cls)}
        out: dict[str, Any] = {}
        for item in (text or "").split(","):
            if not item.strip():
                continue
            key, sep, value = (s.strip() for s in item.partition("="))
            if not sep or not key or not value:
                raise EngineError(f"kernels: CHOICE=VALUE items separated by commas, not {item.strip()!r}")
            out[key] = _value(key, value, types.get(key))
        return cls.from_dict(out)

    def __str__(self) -> str:
        return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                        for k, v in self.changes().items()) or "defaults"


def _value(key: str, text: str, kind: str | None) -> Any:
    if kind == "bool":
        if text.lower() not in ("true", "false", "1", "0", "on", "off"):
            raise EngineError(f"kernels: {key} is true or false, not {text!r}")
        return text.lower() in ("true", "1", "on")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise EngineError(f"kernels: {key} is an integer, not {text!r}") from None
    return text
