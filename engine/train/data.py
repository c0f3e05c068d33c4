"""Token streams and batches. A batch is a pure function of (stream, seed, step): resuming needs no RNG state."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer

from engine.errors import EngineError
from engine.train.tokenizer import eos_id


def token_stream(tok: Tokenizer, texts: list[str], chunk: int = 1024) -> torch.Tensor:
    """All documents as one int32 stream, each followed by the eos separator. Encoded a chunk of documents at a
    time: a whole corpus of Encoding objects (tokens, offsets, masks) would take several times the text's memory."""
    eos = eos_id(tok)
    parts = [torch.tensor(enc.ids + [eos], dtype=torch.int32)
             for i in range(0, len(texts), chunk) for enc in tok.encode_batch(texts[i:i + chunk])]
    if not parts:
        raise EngineError("empty corpus: no tokens to train on")
    return torch.cat(parts)


def _windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return stream[starts[:, None] + torch.arange(length)[None, :]].long()


def random_windows(stream: torch.Tensor, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[n, length] windows of the stream at random starts."""
    last = stream.numel() - length
    if last <= 0:
        raise EngineError(f"corpus too small: {stream.numel()} tokens for windows of {length}")
    return _windows(stream, torch.randint(0, last, (n,), generator=generator), length)


def step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def batch_at(stream: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """[batch_size, seq_len + 1] random windows (inputs and shifted labels) for this step."""
    return random_windows(stream, batch_size, seq_len + 1, step_generator(seed, step))


def eval_batches(stream: torch.Tensor, n: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
    """n fixed batches spread evenly over a (validation) stream."""
    last = stream.numel() - seq_len - 1
    if last <= 0:
        raise EngineError(f"validation split too small: {stream.numel()} tokens for windows of {seq_len + 1}")
    starts = torch.linspace(0, last, n * batch_size).long()
    return [_windows(stream, s, seq_len + 1) for s in starts.split(batch_size)]
