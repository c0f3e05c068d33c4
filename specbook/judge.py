"""The paired 2-of-3 rule: whether B differs from A, from pairs of measurements, numbers in and a verdict out.

`runbook verify` judges a noisy number that moved with changed code by it (specbook/verify.py: three runs of the
recorded commit's engine, A, paired with this tree's, B), and the A/B scripts of scripts/ judge a kernel choice by
it (their samples from engine/abtest.py). One copy, here, with no dependency but the standard library: specbook and
the engine never import each other, and scripts/ (entry points) may import both.

Each pair's ratio B/A is a vote against a relative tolerance around 1: inside it (None), or outside it in the
metric's direction - "regression" (worse), "improvement" (better), "changed" (direction "none"). Two of three votes
agreeing decide: inside -> the same; outside -> that change. No two agree -> flaky (which fails as a change does).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SAME, CHANGED, FLAKY = "same", "changed", "flaky"
DIRECTIONS = ("higher", "lower", "none")


def drift(entry: dict[str, Any], value: float) -> str | None:
    """None within tolerance (max of relative and absolute), else regression / improvement / changed. `entry`
    holds the reference "value", its "direction" (higher, lower or none is better) and "tolerance" {rel, abs}."""
    recorded = entry["value"]
    tol = entry.get("tolerance", {})
    allowed = max(tol.get("rel", 0.0) * abs(recorded), tol.get("abs", 0.0))
    delta = value - recorded
    if abs(delta) <= allowed + 1e-12 * max(1.0, abs(recorded)):  # float noise is not drift
        return None
    if entry["direction"] == "none":
        return "changed"
    return "improvement" if (delta > 0) == (entry["direction"] == "higher") else "regression"


def ratio_votes(ratios: Sequence[float], direction: str, rel: float) -> list[str | None]:
    """Each pair's ratio B/A against 1 within `rel`: the votes of the rule."""
    reference = {"value": 1.0, "direction": direction, "tolerance": {"rel": rel}}
    return [drift(reference, r) for r in ratios]


def majority(votes: Sequence[str | None]) -> tuple[bool, str | None]:
    """(whether two of three votes agree, what they agree on: None = within tolerance)."""
    for vote in dict.fromkeys(votes):
        if votes.count(vote) >= 2:
            return True, vote
    return False, None


def settled(votes: Sequence[str | None]) -> bool:
    """Whether the pairs so far decide the verdict whatever a third would give: three votes, or two that agree."""
    return len(votes) >= 3 or len(votes) == 2 and votes[0] == votes[1]


def verdict(votes: Sequence[str | None]) -> tuple[str, str | None]:
    """(SAME, None) | (CHANGED, the vote two agree on) | (FLAKY, the first vote outside tolerance)."""
    agreed, vote = majority(votes)
    if not agreed:
        return FLAKY, next(c for c in votes if c)
    return (SAME, None) if vote is None else (CHANGED, vote)


def ab_verdict(ratios: Sequence[float], direction: str, rel: float) -> str:
    """An A/B's verdict in words from its pairs' ratios B/A: "same", "slower" / "faster" (a regression /
    improvement of a direction that is higher or lower), "changed" (direction none) or "flaky"."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction is one of {', '.join(DIRECTIONS)}, not {direction!r}")
    if len(ratios) != 3:
        raise ValueError(f"the paired 2-of-3 rule takes three pairs' ratios, not {len(ratios)}")
    state, change = verdict(ratio_votes(ratios, direction, rel))
    if state != CHANGED:
        return state
    return {"regression": "slower", "improvement": "faster"}.get(change, "changed")
