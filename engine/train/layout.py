"""Where the training runbooks put their models: the one place that names train-target's and train-drafter's
outputs layout, so that the runbooks downstream find them through these names, not through copied strings."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TargetOutputs:
    """train-target's outputs (engine.train.target.train_targets writes them): the shared tokenizer, target A (the
    miniature Kimi-K2, mix A) and target B (the miniature K2.5: A trained further on mix B)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))  # a str from `upstream` too

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def target_a(self) -> Path:
        return self.root / "target-a"

    @property
    def target_b(self) -> Path:
        return self.root / "target-b"


@dataclass(frozen=True)
class DrafterOutputs:
    """train-drafter's outputs: drafter A, the EAGLE-3 drafter trained on target A."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))  # a str from `upstream` too

    @property
    def drafter_a(self) -> Path:
        return self.root / "drafter-a"
