"""Interleaved A/B sampling: the one timing loop of the scripts that decide whether an engine change pays.

Given callables (on CUDA each may replay a captured graph), `interleave` warms each up, then takes rounds of one
sample each, the order reversed every other round (A B, B A, A B, ...), so a drift of the machine's pace (a GPU's
clock, a shared CPU's load) hits every variant alike. Each sample is timed with the engine's one clock
(engine.timing: wall time after a device sync on CUDA, process CPU time on CPU; `use_clock` injects another), inside
one timed section of engine.quiet (the timing lock, where a runner set one up). A callable may return the seconds it
measured itself with that clock (a generation's decode_s, leaving its prefill out); otherwise the call is timed.

`ab` samples two of them in `pairs` blocks of `rounds` rounds and gives each block's ratio B/A of median seconds:
the three pairs the paired 2-of-3 rule takes (specbook/judge.py; the engine never imports specbook, the scripts
combine the two).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine import quiet
from engine.errors import EngineError
from engine.timing import clock, sync

Sample = Callable[[], object]


def interleave(calls: Mapping[str, Sample], device: torch.device, rounds: int, warmup: int = 1
               ) -> tuple[dict[str, list[float]], list[list[str]]]:
    """({name: seconds of each round}, the order of each round): `warmup` untimed calls of each, then `rounds`
    rounds of one timed call each, in the given order and reversed by turns."""
    if not calls or rounds < 1 or warmup < 0:
        raise EngineError("interleave: at least one callable, one round and no negative warm-up")
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    sync(device)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    orders = []
    with quiet.timed():
        now = clock(device)
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                sync(device)
                t0 = now()
                own = calls[name]()
                sync(device)
                took = now() - t0
                seconds[name].append(float(own) if isinstance(own, (int, float)) and not isinstance(own, bool)
                                     else took)
            orders.append(list(order))
    return seconds, orders


@dataclass
class ABSamples:
    """Two callables' seconds, sampled in pairs of interleaved rounds."""
    a: list[float]
    b: list[float]
    orders: list[list[str]]  # each round's order: ["A", "B"] or ["B", "A"]
    pairs: int
    rounds: int  # per pair

    def pair_ratios(self) -> list[float]:
        """Each pair's median seconds of B over A: above 1, B took longer."""
        out = []
        for p in range(self.pairs):
            block = slice(p * self.rounds, (p + 1) * self.rounds)
            out.append(statistics.median(self.b[block]) / statistics.median(self.a[block]))
        return out

    def round_ratios(self) -> list[float]:
        return [b / a for a, b in zip(self.a, self.b)]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pair_ratios": self.pair_ratios(), "round_ratios": self.round_ratios(),
                "a_median": statistics.median(self.a), "b_median": statistics.median(self.b)}


def ab(a: Sample, b: Sample, device: torch.device, pairs: int = 3, rounds: int = 3, warmup: int = 1) -> ABSamples:
    """A against B: `pairs` blocks of `rounds` interleaved rounds each (see the module doc)."""
    if pairs < 1 or rounds < 1:
        raise EngineError(f"ab: at least one pair of one round, not {pairs} pairs of {rounds}")
    seconds, orders = interleave({"A": a, "B": b}, device, pairs * rounds, warmup)
    if min(seconds["A"]) <= 0:
        raise EngineError("ab: A took no time on this clock; time more work per sample")
    return ABSamples(seconds["A"], seconds["B"], orders, pairs, rounds)
