"""Deterministic (batch-invariant) decoding: every target forward of the decode loop runs at one width.

Why: the baseline's decode step is a forward of 1 token, EAGLE-3's verify one of W tokens. GEMMs of 1 and of W rows
(and attention over 1 and W query rows) take different kernels that reduce in different orders, so in bfloat16 the
same position's logits round differently in the two and greedy outputs part at near-ties. In deterministic mode both
run the same forward at width W (the chain's verify width, steps + 1): the decode step feeds its token plus W - 1
padding rows at the following positions and slots (the real row's causal mask hides them and later steps overwrite
them), so the same kernels at the same shapes compute every row, and a row's result depends neither on its index nor
on the other rows. A chain's verify writes row i at slot = position, as decode steps do, so attention reduces over the
same keys at the same slots in the same order (the split-KV kernel's splits depend only on the cache size, never on
the query's position): the logits at a position are bit-identical, and greedy speculation gives the baseline's tokens.

Limits: a tree's nodes sit at cache slots other than their positions, so their attention sums keys in another order:
chains only. Both decoders must also prefill alike: the baseline computes the logits of every prompt row, as the
speculative prefill does (a 1-row lm_head is another GEMM). With torch.compile the layers are compiled once per
(model, width) and shared by every decoder, so both run the same generated kernels with the same tuned
configurations.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import EngineError

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class Deterministic:
    """How every target forward of a deterministic decode loop runs."""
    width: int  # rows per forward: the verify's token count (steps + 1 for a chain)
    hidden_layers: tuple[int, ...] = ()  # the drafter's feature layers; the baseline computes and drops them too,
    #                                      so that both decoders run the same forward

    @classmethod
    def chain(cls, steps: int, drafter) -> "Deterministic":
        """The mode of an EAGLE-3 chain of `steps` draft steps with this drafter (and of its baseline)."""
        return cls(steps + 1, tuple(drafter.aux_layers))

    def __post_init__(self) -> None:
        if self.width < 1:
            raise EngineError(f"deterministic width must be at least 1, got {self.width}")


class WidthForward:
    """The target forward at `mode.width` rows: shorter inputs are padded, the outputs cut back to their rows."""

    def __init__(self, model: torch.nn.Module, mode: Deterministic, compile: bool):
        self.model, self.mode = model, mode
        self.compile = compile

    def _forward(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model(tokens, pos, slots, mask, hidden_layers=self.mode.hidden_layers, compiled=self.compile)

    def pad(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows up to the width at the positions (and slots) after the last row, clamped to the cache's last slot:
        callers keep the last real position below it, so padding never writes a slot a real row attends to."""
        n, S = self.mode.width - tokens.shape[1], self.model.max_seq_len
        extra = (pos[-1:] + torch.arange(1, n + 1, device=pos.device)).clamp(max=S - 1)
        causal = self.model.slot_ids[None, :S] <= extra[:, None]
        return (torch.cat([tokens, tokens.new_zeros(1, n)], dim=1), torch.cat([pos, extra]),
                torch.cat([slots, extra]), torch.cat([mask, causal]))

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [1, T], pos and slots [T], mask [T, S] with T <= width -> logits [1, T, V], features or None."""
        T = tokens.shape[1]
        if T > self.mode.width:
            raise EngineError(f"a forward of {T} tokens does not fit the deterministic width {self.mode.width}")
        if T < self.mode.width:
            tokens, pos, slots, mask = self.pad(tokens, pos, slots, mask)
        logits, aux = self._forward(tokens, pos, slots, mask)
        return logits[:, :T], None if aux is None else aux[:, :T]


def width_forward(model: torch.nn.Module, mode: Deterministic, compile: bool = False) -> WidthForward:
    """One WidthForward per (model, mode, compile), shared by every decoder of that model: with compile, a second
    compilation of the same graph could tune its kernels differently."""
    per_model = vars(model).setdefault("_width_forwards", {})  # dies with the model (a global map would keep it)
    key = (mode, compile)
    if key not in per_model:
        per_model[key] = WidthForward(model, mode, compile)
    return per_model[key]


def decode_forward(model: torch.nn.Module, mode: Deterministic, compile: bool = False) -> Forward:
    """The baseline decode step's forward, `(token [1, 1], input_pos [1]) -> (logits [1, 1, V], _)`, at the width:
    slot = position and a causal mask, as the verify of a chain writes and masks that position."""
    forward = width_forward(model, mode, compile)

    def step(token: torch.Tensor, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        mask = model.slot_ids[None, :model.max_seq_len] <= input_pos[:, None]
        return forward(token, input_pos, input_pos, mask)

    return step
