"""EAGLE-3 draft settings: steps, top-k and the verify budget, with their one default and their one check. The
bundled engine (engine.tree.TreeShape) and every external backend (engine.backends) take them from here; no torch,
so the command line and the server launchers import it cheaply."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EngineError

DEFAULT_STEPS = 7  # draft steps per cycle
DEFAULT_TOPK = 1  # a chain


def pool_size(steps: int, topk: int) -> int:
    """Draft candidates: topk at depth 1, then topk children of each of the topk beams per further step."""
    return topk + (steps - 1) * topk * topk


@dataclass
class SpecSettings:
    """steps k (drafter forwards per cycle), topk K (beams kept and children per beam), draft_tokens N (tokens per
    verify forward, the root included; None: steps * topk + 1, a chain's steps + 1). Checked on construction."""
    steps: int = DEFAULT_STEPS
    topk: int = DEFAULT_TOPK
    draft_tokens: int | None = None

    def __post_init__(self) -> None:
        steps, topk = self.steps, self.topk
        if steps < 1:
            raise EngineError(f"steps must be at least 1, got {steps}")
        if topk < 1:
            raise EngineError(f"topk must be at least 1, got {topk}")
        pool = pool_size(steps, topk)
        if self.draft_tokens is None:
            self.draft_tokens = steps * topk + 1  # never more than the pool + 1
        if topk == 1 and self.draft_tokens != steps + 1:
            raise EngineError(f"a chain (topk 1) of {steps} steps verifies {steps + 1} tokens; "
                              f"draft_tokens {self.draft_tokens} does not fit")
        if not 2 <= self.draft_tokens <= pool + 1:
            raise EngineError(f"draft_tokens must be in 2..{pool + 1} for {steps} steps of topk {topk} "
                              f"(a pool of {pool} candidates plus the root), got {self.draft_tokens}")
