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
    """Works for TargetDecoder and SpecDecoder alike; the first call captures graphs and is not timed."""
    decoder.generate(prompts[0], min(new_tokens, 8), sampling, seed=seed)
    passes = []
    with quiet.timed():  # every pass in one quiet window, so the passes are alike
        for _ in range(repeats):
            runs = [decoder.generate(p, new_tokens, sampling, seed=seed) for p in prompts]
            tokens, secs = sum(r.decode_tokens for r in runs), sum(r.decode_s for r in runs)
            passes.append((tokens / secs, secs, sum(r.verify_cycles for r in runs), runs))
        timed = [decoder.generate(p, new_tokens, sampling, seed=seed, timed_phases=True) for p in prompts]
    tok_s, secs, cycles, runs = sorted(passes, key=lambda x: x[0])[len(passes) // 2]
    n = sum(r.verify_cycles for r in timed)

    def per_cycle(attr: str) -> float:
        return 1e3 * sum(getattr(r, attr) for r in timed) / n

    return CycleStats(tok_s, [p[0] for p in passes], 1e3 * secs / cycles,
                      accept_length(sum(r.decode_tokens for r in runs), cycles), per_cycle("draft_s"),
                      per_cycle("verify_s"), per_cycle("other_s"), [r.token_ids for r in runs])
