"""The derived numbers of speculative decoding, each defined once: accept length, kept share, exact match, break-even
accept length, and the speed a cycle cost projects at a given accept length. Runbooks, benchmarks, the server and the
backends' statistics all call these; docs/glossary.md says how the accept length maps to SGLang's and vLLM's.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.errors import EngineError


def accept_length(decode_tokens: float, verify_cycles: float) -> float:
    """Tokens emitted per verify cycle, the bonus token included: decode_tokens / verify_cycles.

    decode_tokens are the tokens after the first one: the first token of an answer comes from the prefill, not from
    a verify cycle, so it is not counted. Every cycle emits its accepted draft tokens plus the target's own token
    after them (the bonus), so 1.0 means no draft token was ever accepted and a chain of k steps reaches at most
    k + 1. Over several requests pass the sums (token-weighted, like SGLang's scheduler and vLLM's counters).

    The same number as SGLang's scheduler `avg_spec_accept_length` (accepted drafts + one per request per verify,
    over verifies) and vLLM's mean acceptance length (1 + accepted / drafts). SGLang's per-request meta_info
    `spec_accept_length` is completion_tokens / spec_verify_ct: it counts the prefill's token too and reads
    1 / spec_verify_ct higher. 0.0 when there was no cycle (nothing was measured).
    """
    if decode_tokens < 0 or verify_cycles < 0:
        raise EngineError(f"accept length of {decode_tokens} tokens over {verify_cycles} cycles: counts are negative")
    if not verify_cycles:
        return 0.0
    return decode_tokens / verify_cycles


def kept_share(accept: float, accept_before: float) -> float:
    """The share of a drafter's accepted draft tokens per cycle that survive a change (of target, of data): both
    accept lengths less their bonus token, (accept - 1) / (accept_before - 1)."""
    if accept_before <= 1:
        raise EngineError(f"a kept share of an accept length of {accept_before}: nothing was accepted before")
    return (accept - 1) / (accept_before - 1)


def accept_length_from_hist(hist: Sequence[int]) -> float:
    """accept_length from a histogram: hist[n] = cycles that emitted n tokens, bonus included."""
    return accept_length(sum(n * c for n, c in enumerate(hist)), sum(hist))


def exact_match(*outputs: Sequence[Sequence[int]]) -> float:
    """Share of prompts on which every decoder gave the same tokens. Each argument is one decoder's outputs, one
    token list per prompt, the prompts in the same order; a token list of another length is a mismatch."""
    if len(outputs) < 2:
        raise EngineError(f"exact match compares at least two decoders' outputs, got {len(outputs)}")
    counts = {len(o) for o in outputs}
    if len(counts) > 1:
        raise EngineError(f"decoders' outputs cover different numbers of prompts: {sorted(counts)}")
    if not counts.pop():
        raise EngineError("exact match over no prompts")
    same = sum(len({tuple(t) for t in per_prompt}) == 1 for per_prompt in zip(*outputs))
    return same / len(outputs[0])


def in_decode_steps(ms: float, step_ms: float) -> float:
    """What `ms` costs in baseline decode steps of `step_ms` each (e.g. a verify forward over a decode step)."""
    if step_ms <= 0:
        raise EngineError(f"a decode step must take a positive time, got {step_ms} ms")
    return ms / step_ms


def breakeven(cycle_ms: float, step_ms: float) -> float:
    """The accept length at which speculation matches the baseline: in the time of one cycle the baseline decodes
    cycle_ms / step_ms tokens, so a cycle must emit that many to break even."""
    return in_decode_steps(cycle_ms, step_ms)


def projected_tok_s(accept_len: float, cycle_ms: float) -> float:
    """Decode tok/s of speculation that emits `accept_len` tokens per cycle of `cycle_ms`."""
    if cycle_ms <= 0:
        raise EngineError(f"a cycle must take a positive time, got {cycle_ms} ms")
    return accept_len / (cycle_ms / 1e3)


def projected_speedup(accept_len: float, cycle_ms: float, step_ms: float) -> float:
    """projected_tok_s over the baseline's 1000 / step_ms tok/s: the accept length over the break-even one."""
    if cycle_ms <= 0 or step_ms <= 0:
        raise EngineError(f"cycle and decode step must take positive times, got {cycle_ms} and {step_ms} ms")
    return accept_len * step_ms / cycle_ms
