"""The baseline: the target model alone. Chunked prefill, then a decode loop whose step (T=1 forward, sampling,
bookkeeping) is one CUDA graph replayed over static buffers - no host data goes in and nothing comes out until the
loop ends, so the GPU never waits for Python. On CPU the same step runs eagerly.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine import quiet
from engine.decoding import GenerationResult, check_lengths, cut_at_stop, prompt_tensor
from engine.deterministic import Deterministic, decode_forward
from engine.errors import EngineError
from engine.graphs import CapturedCall
from engine.sampling import SamplingParams, sample
from engine.timing import clock, sync


@torch.no_grad()
def prefill(model, ids: torch.Tensor, chunk: int, last_logits_only: bool = True) -> torch.Tensor:
    """Write the prompt's K/V in chunks of `chunk` tokens; the last position's logits [1, V]. `last_logits_only=False`
    computes the lm_head over every row, as speculative prefill does (deterministic mode: the same GEMM shape)."""
    L = ids.shape[1]
    for s in range(0, L, chunk):
        e = min(s + chunk, L)
        logits, _ = model(ids[:, s:e], torch.arange(s, e, device=ids.device), last_logits_only=last_logits_only)
    return logits[:, -1]


@dataclass
class DecodeState:
    """Static buffers of the decode step. The step advances them itself, so a replay needs no inputs."""
    token: torch.Tensor  # [1, 1] the last token
    input_pos: torch.Tensor  # [1] its position
    idx: torch.Tensor  # [1] where the next sampled token goes in `out`
    out: torch.Tensor  # [max_seq_len] sampled tokens of this generation

    @classmethod
    def empty(cls, n: int, device: torch.device) -> "DecodeState":
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        return cls(z(1, 1), z(1), z(1), z(n))

    def as_inputs(self) -> dict[str, torch.Tensor]:
        return {"token": self.token, "input_pos": self.input_pos, "idx": self.idx, "out": self.out}


class TargetDecoder:
    """The target alone. `compile=True` runs the model's layers of the decode step through torch.compile (inductor
    fuses the small ops; Transformer.compiled_layers) before it is captured in our own CUDA graph; sampling stays eager so that its random
    numbers come from the graph-safe default generator. `deterministic` runs every decode step at the verify's width,
    so its logits are bit-identical to a deterministic SpecDecoder's (engine.deterministic)."""

    def __init__(self, model: torch.nn.Module, max_seq_len: int, cuda_graphs: bool = True, prefill_chunk: int = 512,
                 compile: bool = False, deterministic: Deterministic | None = None):
        if max_seq_len <= 1:
            raise EngineError(f"max_seq_len must be at least 2, got {max_seq_len}")
        if prefill_chunk <= 0:
            raise EngineError(f"prefill_chunk must be positive, got {prefill_chunk}")
        self.model, self.max_seq_len, self.prefill_chunk = model, max_seq_len, prefill_chunk
        self.cuda_graphs, self.compile, self.deterministic = cuda_graphs, compile, deterministic
        self.device = model.device
        self.state = DecodeState.empty(max_seq_len, self.device)
        self._forward = functools.partial(model, compiled=True) if compile else model
        self._calls: dict[SamplingParams, CapturedCall] = {}
        self._cache = None  # the cache object the graphs were captured over

    def _step_fn(self, sampling: SamplingParams):
        forward = self._forward
        if self.deterministic is not None:
            forward = decode_forward(self.model, self.deterministic, self.compile)

        def step(token, input_pos, idx, out):
            logits, _ = forward(token, input_pos)
            nxt = sample(logits[:, -1], sampling)  # [1]
            out.index_copy_(0, idx, nxt)
            token.copy_(nxt.view(1, 1))
            input_pos.add_(1)
            idx.add_(1)

        return step

    def _decode_call(self, sampling: SamplingParams) -> CapturedCall:
        if self.model.max_seq_len < self.max_seq_len:
            self.model.setup_caches(self.max_seq_len)
        cache = self.model.layers[0].self_attn.cache
        if cache is not self._cache:  # caches were reallocated: graphs captured over the old ones are stale
            self._calls.clear()
            self._cache = cache
        if sampling not in self._calls:
            with torch.no_grad():
                self._calls[sampling] = CapturedCall(self._step_fn(sampling), self.state.as_inputs(),
                                                     enabled=self.cuda_graphs)
        return self._calls[sampling]

    @torch.no_grad()
    def begin(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams,
              seed: int) -> tuple[CapturedCall, int, float]:
        """Capture (once), seed, prefill and load the decode buffers. Returns the decode step (a call without
        arguments that samples the next token into `state.out`), the prompt length and the prefill seconds."""
        ids = prompt_tensor(prompt_ids, self.model.cfg.vocab_size, self.device)
        L = ids.shape[1]
        check_lengths(L, max_new_tokens, self.max_seq_len)
        step = self._decode_call(sampling)
        torch.manual_seed(seed)  # also seeds the CUDA generator the graph's sampling draws from
        sync(self.device)
        now = clock(self.device)
        t0 = now()
        first = sample(prefill(self.model, ids, self.prefill_chunk, self.deterministic is None), sampling)  # [1]
        st = self.state
        st.token.copy_(first.view(1, 1))
        st.input_pos.fill_(L)
        st.out[0] = first[0]
        st.idx.fill_(1)
        sync(self.device)
        return step, L, now() - t0

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_ids: Sequence[int] = (), seed: int = 0, timed_phases: bool = False) -> GenerationResult:
        """The whole decode loop on the device and one host sync at the end; stop ids are applied afterwards,
        so the loop always runs max_new_tokens steps (decode_s includes any steps after a stop)."""
        step, L, prefill_s = self.begin(prompt_ids, max_new_tokens, sampling, seed)
        now = clock(self.device)
        with quiet.timed():  # the device to itself while it decodes (a runner's timing lock; else nothing)
            t0 = now()
            for _ in range(max_new_tokens - 1):
                step()
            ids = self.state.out[:max_new_tokens].tolist()  # the one host sync
            decode_s = now() - t0
        ids, reason = cut_at_stop(ids, stop_ids)
        cycles = len(ids) - 1
        return GenerationResult(ids, L, prefill_s, decode_s, cycles, [0, cycles],
                                verify_s=decode_s if timed_phases else 0.0, finish_reason=reason)

    @torch.no_grad()
    def stream(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               stop_ids: Sequence[int] = (), seed: int = 0, timed_phases: bool = False) -> Iterator[list[int]]:
        """Yields the prefill's token, then each decode step's token (one host sync per step); ends after a stop
        id or max_new_tokens."""
        step, _, _ = self.begin(prompt_ids, max_new_tokens, sampling, seed)
        stops = set(stop_ids)
        token = self.state.token
        for i in range(max_new_tokens):
            if i:
                step()
            t = int(token.item())
            yield [t]
            if t in stops:
                return
