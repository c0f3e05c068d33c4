"""One facade over the engine: target (+ EAGLE-3 drafter) + tokenizer + decoder. The server (engine/serve) and
the CLI use only this. Runbooks use it where one loaded engine is what they measure (baseline-decode,
deepseek-mla-moe); the others build decoders, drafters and training runs from the modules below it, or drive other
servers through engine.backends."""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.decoding import GenerationResult
from engine.errors import EngineError
from engine.kernels import Kernels
from engine.loading import check_cache_fits, check_seed, load_model, random_model, read_chat_template, \
    resolve_device, resolve_dtype
from engine.sampling import SamplingParams
from engine.spec_settings import DEFAULT_STEPS, DEFAULT_TOPK
from engine.target_decoder import TargetDecoder


@dataclass
class Chunk:
    """What one decode cycle produced (the first chunk is the prefill's token: zero verify cycles)."""
    token_ids: list[int]
    verify_cycles: int
    accepted_tokens: int  # draft tokens accepted in this chunk (bonus token excluded)
    finish_reason: str | None  # None until the last chunk: "stop" | "length"


def find_tokenizer(path: Path):
    read_chat_template(path)  # tokenizer_config.json and the chat template are checked with the tokenizer
    f = path / "tokenizer.json"
    if not f.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises its own exception type for malformed JSON
        raise EngineError(f"{f}: unreadable tokenizer ({e})") from None


def sampling_params(temperature: float, top_k: int, top_p: float) -> SamplingParams:
    if not (math.isfinite(temperature) and temperature >= 0):  # nan passes every comparison; inf samples noise
        raise EngineError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise EngineError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise EngineError(f"top_p must be in (0, 1], got {top_p}")
    return SamplingParams(float(temperature), int(top_k), float(top_p))


class Engine:
    def __init__(self, model, decoder, tokenizer=None, name: str = ""):
        self.model, self.decoder, self.tokenizer, self.name = model, decoder, tokenizer, name

    @classmethod
    def load(cls, target: str | None = None, shape: str | None = None, drafter: str | None = None,
             device: str = "cpu", dtype: str = "float32", max_seq_len: int = 2048, cuda_graphs: bool = True,
             steps: int = DEFAULT_STEPS, topk: int = DEFAULT_TOPK, draft_tokens: int | None = None,
             eager_verify: bool = False, seed: int = 0, compile: bool = False, prefill_chunk: int = 512,
             kernels: Kernels | None = None) -> "Engine":
        """A target directory (HF format) or a named random-weight shape; with `drafter`, EAGLE-3 speculation.
        `compile`: torch.compile inside the CUDA graphs (the decode step, or the draft steps and verify);
        `kernels`: what the target's and the drafter's modules run (engine.kernels; default the engine's)."""
        if (target is None) == (shape is None):
            raise EngineError("give exactly one of a target directory (--target) or a random-weight shape (--shape)")
        if max_seq_len <= 1:
            raise EngineError(f"max_seq_len must be at least 2, got {max_seq_len}")
        dev, dt = resolve_device(device), resolve_dtype(dtype)
        if target is not None:
            model, tokenizer, name = load_model(target, dev, dt, kernels), find_tokenizer(Path(target)), str(target)
        else:
            model, tokenizer, name = random_model(shape, dev, dt, seed=seed, kernels=kernels), None, shape
        check_cache_fits(model, max_seq_len)
        if drafter is None:
            decoder = TargetDecoder(model, max_seq_len, cuda_graphs=cuda_graphs, prefill_chunk=prefill_chunk,
                                    compile=compile)
        else:
            from engine.drafter import load_drafter  # speculation modules load only when asked for
            from engine.speculate import SpecDecoder

            draft = load_drafter(drafter, model, device=dev, dtype=dt, kernels=kernels)
            decoder = SpecDecoder(model, draft, max_seq_len, steps, topk, draft_tokens, cuda_graphs=cuda_graphs,
                                  eager_verify=eager_verify, prefill_chunk=prefill_chunk,
                                  compile=compile)
        return cls(model, decoder, tokenizer, name)

    @property
    def max_seq_len(self) -> int:
        return self.decoder.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.model.cfg.eos_ids

    @property
    def speculative(self) -> bool:
        return not isinstance(self.decoder, TargetDecoder)

    def encode(self, text: str) -> list[int]:
        """Tokenizer ids, or UTF-8 bytes (ids 0-255) for random-weight shapes without a tokenizer."""
        return self.tokenizer.encode(text).ids if self.tokenizer is not None else list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return bytes(i % 256 for i in ids).decode(errors="replace")

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, stop_ids: Sequence[int] = (), seed: int = 0,
                 timed_phases: bool = False) -> GenerationResult:
        check_seed(seed)
        return self.decoder.generate(prompt_ids, max_new_tokens, sampling_params(temperature, top_k, top_p),
                                     stop_ids=tuple(stop_ids), seed=seed, timed_phases=timed_phases)

    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, stop_ids: Sequence[int] = (), seed: int = 0) -> Iterator[Chunk]:
        check_seed(seed)
        stops = set(stop_ids)
        parts = self.decoder.stream(prompt_ids, max_new_tokens, sampling_params(temperature, top_k, top_p),
                                    stop_ids=tuple(stop_ids), seed=seed)
        total = 0
        try:
            for i, ids in enumerate(parts):
                total += len(ids)
                reason = "stop" if stops.intersection(ids) else "length" if total >= max_new_tokens else None
                # the first part is the prefill's token; every later part is one verify cycle plus its bonus token
                yield Chunk(list(ids), 1 if i else 0, len(ids) - 1 if i else 0, reason)
        finally:
            parts.close()

    def info(self) -> dict[str, Any]:
        cfg = self.model.cfg
        return {"model": self.name, "model_type": cfg.model_type, "layers": cfg.num_hidden_layers,
                "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "device": str(self.model.device),
                "dtype": str(self.model.dtype).removeprefix("torch."), "max_seq_len": self.max_seq_len,
                "speculative": self.speculative, "kernels": str(self.model.kernels)}
