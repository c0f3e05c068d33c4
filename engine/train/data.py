"""Token streams and batches. A batch is a pure function of (stream, seed, step): resuming needs no RNG state."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer

from engine.errors import EngineError
from engine.train.tokenizer import eos_id


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one int64 stream, each followed by the eos separator."""
    eos = eos_id(tok)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    if not ids:
        raise EngineError("empty corpus: no tokens to train on")
    return torch.tensor(ids, dtype=torch.int64)


def _windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return stream[starts[:, None] + torch.arange(length)[None, :]]


def batch_at(stream: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int, pool: int | None = None
             ) -> torch.Tensor:
    """[batch_size, seq_len + 1] random windows (inputs and shifted labels) for this step. With `pool`, windows
    are drawn from that many fixed windows (a data set of `pool` samples) instead of anywhere in the stream."""
    n = stream.numel() - seq_len - 1
    if n <= 0:
        raise EngineError(f"corpus too small: {stream.numel()} tokens for windows of {seq_len + 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if pool is None:
        starts = torch.randint(0, n, (batch_size,), generator=g)
    else:
        if pool <= 0:
            raise EngineError(f"the number of training samples must be positive, got {pool}")
        fixed = torch.randint(0, n, (pool,), generator=torch.Generator().manual_seed(seed))
        starts = fixed[torch.randint(0, pool, (batch_size,), generator=g)]
    return _windows(stream, starts, seq_len + 1)


def eval_batches(stream: torch.Tensor, n: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
    """n fixed batches spread evenly over a (validation) stream."""
    last = stream.numel() - seq_len - 1
    if last <= 0:
        raise EngineError(f"validation split too small: {stream.numel()} tokens for windows of {seq_len + 1}")
    starts = torch.linspace(0, last, n * batch_size).long()
    return [_windows(stream, s, seq_len + 1) for s in starts.split(batch_size)]
