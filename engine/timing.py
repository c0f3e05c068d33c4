"""Timing: the one clock every engine measurement reads, and the helpers that time calls and decoders.

On CUDA the clock is wall time after a device synchronisation: a dedicated GPU's wall time is what a user waits.
On CPU it is the CPU time of this process (`time.process_time`). Other processes sharing the cores take turns with
the benchmark; wall time then counts their turns too, CPU time does not. So a CPU number measures the work the
engine did, whatever else the machine is doing, and a real slowdown (the same work done twice) still doubles it.
With one torch thread (what the cpu profiles use) CPU time equals wall time on an idle machine; with several,
threads waiting for each other spin and add CPU time under load, so timing runbooks pin one thread on CPU.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine import quiet
from engine.metrics import accept_length
from engine.sampling import SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_clock_override: Callable[[], float] | None = None


def clock(device: torch.device) -> Callable[[], float]:
    """Seconds, for differences only: wall time on CUDA, this process's CPU time elsewhere (see the module doc);
    inside `use_clock`, the clock given there."""
    if _clock_override is not None:
        return _clock_override
    return time.perf_counter if device.type == "cuda" else time.process_time


def wall_clock() -> Callable[[], float]:
    """Wall seconds, for how long a phase of work took on any device (compiles and captures included); inside
    `use_clock`, the clock given there."""
    return _clock_override or time.perf_counter


@contextmanager
def use_clock(now: Callable[[], float]) -> Iterator[None]:
    """Every measurement inside the block reads `now` (seconds) instead of the device's clock, CUDA events
    included: a test scripts the time each piece of work takes and checks the numbers derived from it."""
    global _clock_override
    before, _clock_override = _clock_override, now
    try:
        yield
    finally:
        _clock_override = before


def time_fn(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Seconds per call of fn after warm-up: on CUDA the mean of `iters` back-to-back calls between two events; on
    CPU (or inside `use_clock`) the median of `iters` timed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    with quiet.timed():
        if device.type == "cuda" and _clock_override is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000 / iters
        now, times = clock(device), []
        for _ in range(iters):
            t0 = now()
            fn()
            times.append(now() - t0)
        return statistics.median(times)


class Clock:
    """Phase laps of a decode loop; synchronises the device first when timing is asked for, and costs nothing
    otherwise."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled, self.now = device, enabled, clock(device)
        self.t = self.now()

    def lap(self) -> float:
        if not self.enabled:
            return 0.0
        sync(self.device)
        now = self.now()
        dt, self.t = now - self.t, now
        return dt


@dataclass
class CycleStats:
    """Decode speed of one decoder over a set of prompts (the median of `repeats` passes), and the per-cycle split
    from one extra pass with synchronised phases."""
    tok_s: float
    samples: list[float]  # tok/s of each pass
    ms_per_cycle: float  # target forwards after the prefill: decode steps for the baseline, verify cycles here
    accept_length: float  # engine.metrics.accept_length over the median pass's prompts (token-weighted)
    draft_ms: float
    verify_ms: float
    other_ms: float
    token_ids: list[list[int]]  # the outputs of the last pass, per prompt


def cycle_stats(decoder, prompts: list[list[int]], new_tokens: int, repeats: int = 3, seed: int = 0,
                sampling: SamplingParams = SamplingParams()) -> CycleStats:
    """One decoder's CycleStats (interleaved_cycle_stats of it alone)."""
    return interleaved_cycle_stats({"": decoder}, prompts, new_tokens, repeats, seed, sampling)[""]


def interleaved_cycle_stats(decoders: dict[str, object], prompts: list[list[int]], new_tokens: int | dict[str, int],
                            repeats: int = 3, seed: int = 0,
                            sampling: SamplingParams = SamplingParams()) -> dict[str, CycleStats]:
    """Several decoders (TargetDecoder and SpecDecoder alike) measured in rounds: in each of `repeats` rounds every
    decoder makes one pass over the prompts, in an order rotated round by round, so that a change of the machine's
    pace hits them alike and pass r of each is round r's (a speedup is taken round by round: paired_ratios). Each
    decoder's first call captures its graphs and is not timed; `new_tokens` may differ per decoder."""
    names = list(decoders)
    n_new = {n: new_tokens[n] if isinstance(new_tokens, dict) else new_tokens for n in names}
    for n in names:
        decoders[n].generate(prompts[0], min(n_new[n], 8), sampling, seed=seed)
    passes: dict[str, list] = {n: [] for n in names}
    with quiet.timed():  # every pass in one quiet window, so the passes are alike
        for r in range(repeats):
            for n in names[r % len(names):] + names[:r % len(names)]:
                runs = [decoders[n].generate(p, n_new[n], sampling, seed=seed) for p in prompts]
                tokens, secs = sum(x.decode_tokens for x in runs), sum(x.decode_s for x in runs)
                passes[n].append((tokens / secs, secs, sum(x.verify_cycles for x in runs), runs))
        timed = {n: [decoders[n].generate(p, n_new[n], sampling, seed=seed, timed_phases=True) for p in prompts]
                 for n in names}
    return {n: _stats(passes[n], timed[n]) for n in names}


def _stats(passes: list, timed: list) -> CycleStats:
    """The median pass's speed and accept length, and the phase split of the synchronised pass."""
    tok_s, secs, cycles, runs = sorted(passes, key=lambda x: x[0])[len(passes) // 2]
    n = sum(r.verify_cycles for r in timed)

    def per_cycle(attr: str) -> float:
        return 1e3 * sum(getattr(r, attr) for r in timed) / n

    return CycleStats(tok_s, [p[0] for p in passes], 1e3 * secs / cycles,
                      accept_length(sum(r.decode_tokens for r in runs), cycles), per_cycle("draft_s"),
                      per_cycle("verify_s"), per_cycle("other_s"), [r.token_ids for r in runs])


def paired_ratios(num: CycleStats, den: CycleStats) -> list[float]:
    """num's speed over den's, round by round, from interleaved_cycle_stats: each ratio is of two passes made
    back to back, so the machine's pace between rounds cancels."""
    return [a / b for a, b in zip(num.samples, den.samples, strict=True)]
