"""What every decoder shares: the result of a generation, prompt and length checks, cutting at a stop id.
The decoders themselves: engine.target_decoder (the target alone) and engine.speculate (with an EAGLE-3 drafter).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine import metrics
from engine.errors import EngineError


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (the prefill's token first), cut after a stop id
    prompt_len: int
    prefill_s: float  # seconds of the prefill on engine.timing's clock (after a device sync)
    decode_s: float  # seconds from after the prefill to the last token, on the same clock
    verify_cycles: int  # target forwards after the prefill (baseline: one per decode step)
    accept_hist: list[int]  # accept_hist[n] = cycles that emitted n tokens, bonus token included
    draft_s: float = 0.0  # phase totals, filled when timed_phases (each phase synced)
    verify_s: float = 0.0
    other_s: float = 0.0
    finish_reason: str = "length"  # "length" | "stop"

    @property
    def decode_tokens(self) -> int:
        return max(len(self.token_ids) - 1, 0)  # the prefill's token is not a decode token

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.decode_s / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def accept_length(self) -> float:
        """engine.metrics.accept_length: decode tokens per verify cycle, bonus token included."""
        return metrics.accept_length(self.decode_tokens, self.verify_cycles)

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens the target accepted (each cycle's bonus token excluded)."""
        return self.decode_tokens - self.verify_cycles

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__},
                "tok_s": self.tok_s, "ms_per_token": self.ms_per_token, "accept_length": self.accept_length}


def prompt_tensor(prompt_ids: Sequence[int] | torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Validated [1, L] int64 prompt on the device (an out-of-range id would be a device-side assert on CUDA)."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise EngineError("the prompt is empty: give at least one token")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise EngineError(f"prompt token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size})")
    return ids.to(device)[None]


def check_lengths(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> None:
    if max_new_tokens <= 0:
        raise EngineError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if prompt_len >= max_seq_len:
        raise EngineError(f"prompt has {prompt_len} tokens; the cache holds {max_seq_len} (raise --max-seq-len)")
    if prompt_len + max_new_tokens > max_seq_len:
        raise EngineError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the cache of "
                          f"{max_seq_len} tokens (raise --max-seq-len)")


def cut_at_stop(ids: list[int], stop_ids: Sequence[int]) -> tuple[list[int], str]:
    """ids cut after the first stop id (kept), and the finish reason."""
    stops = set(stop_ids)
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1], "stop"
    return ids, "length"
