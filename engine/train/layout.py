"""Where the training runbooks put their models: the one place that names train-target's and train-drafter's
outputs layout, so that the runbooks downstream find them through these names, not through copied strings."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class _Outputs:
    """A training runbook's outputs directory, whose layout the subclasses name."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))  # a str from `upstream` too


@dataclass(frozen=True)
class TargetOutputs(_Outputs):
    """train-target's outputs (engine.train.target.train_targets writes them): the shared tokenizer, target A (the
    miniature Kimi-K2, mix A) and target B (the miniature K2.5: A trained further on mix B)."""

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
class DrafterOutputs(_Outputs):
    """train-drafter's outputs: drafter A, the EAGLE-3 drafter trained on target A."""

    @property
    def drafter_a(self) -> Path:
        return self.root / "drafter-a"


def trained_pair_dirs(target: str, drafter: str, upstream: dict[str, str]) -> tuple[Path, Path]:
    """The target and drafter directories a runbook measures: the ones given (`-p target=DIR -p drafter=DIR`),
    else target A and drafter A from train-target's and train-drafter's outputs in `upstream`."""
    if not (target or "train-target" in upstream) or not (drafter or "train-drafter" in upstream):
        raise ValueError("give -p target=DIR -p drafter=DIR, or run through `runbook run` so the upstream models "
                         "arrive")
    return (Path(target or TargetOutputs(upstream["train-target"]).target_a),
            Path(drafter or DrafterOutputs(upstream["train-drafter"]).drafter_a))
