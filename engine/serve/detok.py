"""Incremental detokenizing: the text of a growing id list, piece by piece, with stop strings held back.

With a `tokenizers.Tokenizer` the pieces come from its own `DecodeStream` (the incremental decoder vLLM and TGI use:
it decodes a window of ids with the ids before it as context, so tokenizers that merge across tokens - leading
spaces, byte fallback - stream as they decode in one piece). Without one (random-weight shapes: ids are UTF-8 bytes)
the same windowing runs over the engine's decode callable.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class PieceDecoder(Protocol):
    def step(self, ids: list[int]) -> str:
        """The new text the ids complete (may be empty: an incomplete character waits for its other bytes)."""

    def flush(self) -> str:
        """What is left at the end of the answer (an incomplete character decodes as U+FFFD)."""


class StreamDecoder:
    """Pieces from tokenizers' DecodeStream, special tokens skipped (as Engine.decode does)."""

    def __init__(self, tokenizer: Any):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.pending: list[int] = []  # ids DecodeStream holds back (an incomplete character so far)

    def step(self, ids: list[int]) -> str:
        out = []
        for i in ids:
            piece = self.stream.step(self.tokenizer, i)
            if piece is None:
                self.pending.append(i)
            else:
                self.pending.clear()
                out.append(piece)
        return "".join(out)

    def flush(self) -> str:
        tail = self.tokenizer.decode(self.pending, skip_special_tokens=True) if self.pending else ""
        self.pending = []
        return tail


class WindowDecoder:
    """Pieces from a plain decode callable: each step decodes only the ids since the last clean boundary, with the
    ids before them as a prefix (DecodeStream's method, for engines without a tokenizer)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix_at = self.read_at = 0  # ids[prefix_at:read_at] is the context of the next window

    def step(self, ids: list[int]) -> str:
        self.ids += ids
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.decode(self.ids[self.prefix_at:self.read_at])
        full = self.decode(self.ids[self.prefix_at:])
        # An incomplete multi-byte character decodes to U+FFFD: wait for the rest unless the answer is over.
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_at, self.read_at = self.read_at, len(self.ids)
            return full[len(prefix):]
        return ""


def piece_decoder(decode: Callable[[list[int]], str], tokenizer: Any = None) -> PieceDecoder:
    if tokenizer is not None:
        try:
            return StreamDecoder(tokenizer)
        except ImportError:  # tokenizers < 0.21 has no DecodeStream
            pass
    return WindowDecoder(decode)


class Detokenizer:
    """Incremental text of a growing id list; holds back text that may still become a stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str], tokenizer: Any = None):
        self.pieces = piece_decoder(decode, tokenizer)
        self.stops = stops
        self.text = ""  # decoded so far
        self.sent = 0  # characters already emitted
        self.hold = max((len(s) for s in stops), default=1) - 1

    @classmethod
    def for_engine(cls, eng: Any, stops: list[str]) -> "Detokenizer":
        return cls(eng.decode, stops, getattr(eng, "tokenizer", None))

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """New text safe to emit, and whether a stop string was reached (text is cut before it)."""
        self.text += self.pieces.step(ids)
        start = max(self.sent - self.hold, 0)
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            return self._emit(cut), True
        return self._emit(len(self.text) - self.hold), False

    def flush(self) -> str:
        self.text += self.pieces.flush()
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        new = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return new
