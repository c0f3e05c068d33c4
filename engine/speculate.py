"""EAGLE-3 speculative decoding: draft, verify, accept, compact, draft-extend - chain (topk 1) or tree.

State between cycles: the sequence has L tokens; the target has K/V for positions 0..L-2 and the drafter has
entries for 0..L-2 (entry p = target features at p + token p+1). The last token x_{L-1}, the ROOT, is unverified.

One cycle:
  draft    the previous draft-extend's logits give K depth-1 candidates; draft steps 1..k-1 (one drafter forward
           of K tokens each, at position L-2+i, written to scratch slots past the sequence) grow the pool
           (engine.tree), and the best `draft_tokens - 1` nodes form the tree. Candidates are the drafter's top-k,
           except a chain's when sampling: each draft is drawn from the drafter's q_T (the target's temperature,
           top-k and top-p applied to the drafter's logits), with noise drawn per cycle from the generation's seed.
  verify   ONE target forward over root + tree at positions L-1 + depth, slots L-1 + node index, tree mask,
           returning the drafter's features. The target's choice after every node (argmax, or a sample) decides
           the accepted path: exactly the target's greedy output, and with sampling exactly its distribution.
           A sampled chain takes speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft x kept with
           probability min(1, p(x) / q(x)), else replaced by a sample of norm(max(0, p - q)), the bonus from p - a
           draft is accepted with probability 1 - TV(p_T, q_T). A tree's drafts are picked deterministically
           (top-k), so the draft distribution is a point mass and rejection sampling with residual resampling
           (accept child c with probability p'(c), else zero c in p' and renormalise; after the last child sample
           p') is the same as drawing t ~ p and taking the child equal to t, as EAGLE's evaluate_posterior and
           SGLang's target-only tree sampling do (engine.runners says what sampled trees would need).
           It also writes the accepted path's features and tokens into the draft-extend's static inputs.
  sync     the accepted count and tokens come to the host: the cycle's only synchronisation. On CUDA the next
           cycle's draft phase is queued before the host waits (its inputs are all on the device), so the GPU
           drafts while the host reads the result and does its bookkeeping - unless this cycle may be the last.
  compact  the path's K/V move to slots L-1 .. L-2+count (trees only: a chain's path is already in place).
  extend   (first in the next cycle's draft phase) the drafter writes entries for the accepted positions from the
           target's features; its logits at the last accepted entry are the depth-1 candidates. It runs over
           steps + 1 rows whatever the count: rows past the count write entries at slots >= the new start, which
           every later read masks out and the next extend overwrites. One shape, so one graph and one compile.

The phases run as captured CUDA graphs (eagerly on CPU), one runner each (engine.runners): the draft phase (extend,
the k-1 draft steps and the tree build; one graph per draft-token count, and one without the extend for the first
cycle, whose extend was the prefill's), verify (one per draft-token count and sampling setting) and, for a tree that
accepted drafts, the compaction: two graph launches per cycle, three when a tree compacts. `eager_verify=True` runs
the verify forward eagerly - the game plan's "extend mode without CUDA graphs" - to measure what that costs.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine import quiet
from engine.decoding import GenerationResult, check_lengths, cut_at_stop, prompt_tensor
from engine.deterministic import Deterministic
from engine.drafter import Eagle3Drafter
from engine.errors import EngineError
from engine.graphs import HostCopy
from engine.runners import CompactRunner, DraftRunner, VerifyRunner
from engine.sampling import SamplingParams, greedy, logits_to_probs, sample_from_probs
from engine.spec_settings import DEFAULT_STEPS, DEFAULT_TOPK
from engine.timing import Clock, clock, sync
from engine.tree import TreeShape


@dataclass
class Cycle:
    tokens: list[int]
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0


class SpecDecoder:
    """Target + EAGLE-3 drafter with `generate` / `stream` like engine.target_decoder.TargetDecoder."""

    def __init__(self, target: torch.nn.Module, drafter: Eagle3Drafter, max_seq_len: int,
                 steps: int = DEFAULT_STEPS, topk: int = DEFAULT_TOPK, draft_tokens: int | None = None,
                 cuda_graphs: bool = True, eager_verify: bool = False, prefill_chunk: int = 512, compile: bool = False,
                 overlap: bool | None = None, deterministic: bool = False):
        if max_seq_len <= 1:
            raise EngineError(f"max_seq_len must be at least 2, got {max_seq_len}")
        self.shape = TreeShape.make(steps, topk, draft_tokens)
        if self.shape.draft_tokens >= max_seq_len:
            raise EngineError(f"a tree of {self.shape.draft_tokens} draft tokens does not fit a cache of "
                              f"{max_seq_len} tokens (raise --max-seq-len or lower --draft-tokens)")
        if drafter.device != target.device:
            raise EngineError(f"drafter is on {drafter.device}, the target on {target.device}")
        self.target, self.drafter, self.max_seq_len = target, drafter, max_seq_len
        self.cuda_graphs, self.eager_verify, self.prefill_chunk = cuda_graphs, eager_verify, prefill_chunk
        self.device = target.device
        self.compile = compile
        self.deterministic = deterministic_mode(self.shape, drafter, eager_verify) if deterministic else None
        # Queue the next draft phase before the host reads a cycle's result. On CUDA that hides the host's share
        # of the cycle; on CPU nothing runs asynchronously, so by default it would only cost a wasted draft phase
        # when a stop id ends the generation (tests turn it on there to check the outputs are the same).
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.result = HostCopy(self.shape.draft_tokens + 1, self.device)
        self.draft = DraftRunner(target, drafter, self.shape, max_seq_len, compile)
        self.verify = VerifyRunner(target, drafter.aux_layers, self.shape, max_seq_len, self.draft.inputs, compile,
                                   eager_verify, self.deterministic, self.draft.target_probs)
        self.compact: CompactRunner | None = None
        self._caches = None  # the cache objects the graphs were captured over

    # ---- setup --------------------------------------------------------------------------------------------
    def _fit_caches(self) -> None:
        """Caches of max_seq_len tokens (the drafter's with scratch slots for the draft steps); graphs captured over
        caches since reallocated are dropped."""
        if self.target.max_seq_len < self.max_seq_len:
            self.target.setup_caches(self.max_seq_len)
        if self.drafter.max_seq_len != self.max_seq_len + self.shape.scratch:
            self.drafter.setup_caches(self.max_seq_len + self.shape.scratch)
        caches = (self.target.layers[0].self_attn.cache, self.drafter.midlayer.self_attn.cache)
        if caches != self._caches:
            self._caches = caches
            self.draft.clear(), self.verify.clear()
        if self.target.max_seq_len != self.max_seq_len:
            raise EngineError(f"the target's cache holds {self.target.max_seq_len} tokens, this decoder "
                              f"{self.max_seq_len}: use one max_seq_len for both")

    @torch.no_grad()
    def _prepare(self, sampling: SamplingParams) -> None:
        """Caches and graphs (captured once per cache allocation; verify, and a sampled chain's draft phase, once per
        sampling setting). The draft phase is captured first: its warm-ups leave start at 0, where the verify
        warm-ups then write."""
        self._fit_caches()
        if not self.draft.captured:
            self.compact = CompactRunner(self.target, self.shape, self.cuda_graphs)
        self.draft.capture(self.verify.inputs, self.cuda_graphs, sampling)
        self.verify.capture(sampling, self.cuda_graphs)

    @torch.no_grad()
    def _prefill(self, ids: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> None:
        """Target prefill in chunks with features, the first token, and the drafter's extend over the prompt."""
        L, aux_layers = ids.shape[1], self.drafter.aux_layers
        self.draft.state.start.zero_()
        for s in range(0, L, self.prefill_chunk):
            e = min(s + self.prefill_chunk, L)
            logits, feats = self.target(ids[:, s:e], torch.arange(s, e, device=self.device), hidden_layers=aux_layers)
            nxt = ids[:, s + 1:e + 1]
            if e == L:
                first = sample_from_probs(logits_to_probs(logits[0, -1:], sampling), gen) if not sampling.greedy \
                    else greedy(logits[0, -1:])
                nxt = torch.cat([nxt, first[None]], dim=1)
                self.draft.draw(sampling, gen)  # the noise of the first draft phase, which this extend begins
            self.draft.extend(feats, nxt, torch.full((1,), e - s, device=self.device), sampling)

    # ---- the loop -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _cycles(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams, stop_ids: Sequence[int],
                seed: int, timed: bool) -> Iterator[Cycle]:
        """Yields the prefill's token, then each cycle's emitted tokens (cut at a stop id or max_new_tokens)."""
        ids = prompt_tensor(prompt_ids, self.target.cfg.vocab_size, self.device)
        L = ids.shape[1]
        check_lengths(L, max_new_tokens, self.max_seq_len)
        self._prepare(sampling)
        gen = torch.Generator(self.device).manual_seed(seed)
        self._prefill(ids, sampling, gen)
        first = int(self.draft.state.root.item())
        yield Cycle([first])
        if first in stop_ids or max_new_tokens == 1:
            return
        L, done = L + 1, 1
        N, S, longest = self.shape.draft_tokens, self.max_seq_len, self.shape.steps + 1
        clock = Clock(self.device, timed)
        extend = False  # the prefill extended over the prompt; later cycles extend over the last accepted path
        ahead = False  # this cycle's draft phase was queued by the previous cycle
        while True:
            n = N if L - 1 + N <= S else 1
            if not ahead:
                self.draft.draw(sampling, gen)
                self.draft(n, extend, sampling)
            draft_s = clock.lap()
            if not sampling.greedy:
                self.verify.inputs[n].noise.exponential_(generator=gen)
            path, result = self.verify(n, sampling)
            verify_s = clock.lap()
            self.result.start(result)
            # The next draft needs only device data: queue it while the host waits, unless this cycle may be the
            # last (length), the next size depends on the count (cache end), or the phases are being timed.
            ahead = self.overlap and not timed and done + longest < max_new_tokens and L + longest - 1 + N <= S
            if ahead:  # its noise is drawn after this cycle's, as without overlap: the same tokens either way
                self.draft.draw(sampling, gen)
                self.draft(N, True, sampling)
            host = self.result.wait()  # the cycle's one host synchronisation
            c = host[0]
            tokens, reason = cut_at_stop(host[1:1 + c][:max_new_tokens - done], stop_ids)
            done, L = done + len(tokens), L + c
            if reason == "stop" or done >= max_new_tokens:
                yield Cycle(tokens, draft_s, verify_s, clock.lap())
                return
            if self.shape.topk > 1 and c > 1:  # move the accepted path's K/V into place (a chain's already is)
                self.compact(c, path, L - 1 - c)
            extend = True
            yield Cycle(tokens, draft_s, verify_s, clock.lap())

    def generate(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_ids: Sequence[int] = (), seed: int = 0, timed_phases: bool = False) -> GenerationResult:
        """With timed_phases the device is synchronised between phases, so the split is exact but the total
        a little slower."""
        self._prepare(sampling)  # graph capture is not prefill time
        sync(self.device)
        now = clock(self.device)
        with quiet.timed():  # the device to itself while it decodes (a runner's timing lock; else nothing)
            t0 = now()
            cycles = self._cycles(prompt_ids, max_new_tokens, sampling, tuple(stop_ids), seed, timed_phases)
            token_ids = next(cycles).tokens
            prefill_s = now() - t0
            t1 = now()
            hist = [0] * (self.shape.steps + 2)
            draft_s = verify_s = other_s = 0.0
            n_cycles = 0
            for cyc in cycles:
                token_ids += cyc.tokens
                n_cycles += 1
                hist[len(cyc.tokens)] += 1
                draft_s, verify_s, other_s = draft_s + cyc.draft_s, verify_s + cyc.verify_s, other_s + cyc.other_s
            sync(self.device)
            decode_s = now() - t1
        reason = "stop" if token_ids[-1] in set(stop_ids) else "length"
        return GenerationResult(token_ids, torch.as_tensor(prompt_ids).numel(), prefill_s, decode_s, n_cycles, hist,
                                draft_s, verify_s, other_s, reason)

    def stream(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               stop_ids: Sequence[int] = (), seed: int = 0, timed_phases: bool = False) -> Iterator[list[int]]:
        """Yields the prefill's token, then each cycle's tokens (accepted drafts + bonus)."""
        for cyc in self._cycles(prompt_ids, max_new_tokens, sampling, tuple(stop_ids), seed, timed_phases):
            yield cyc.tokens


def deterministic_mode(shape: TreeShape, drafter: Eagle3Drafter, eager_verify: bool) -> Deterministic:
    """The deterministic mode of a chain (engine.deterministic): trees and eager verify are refused."""
    if shape.topk > 1:
        raise EngineError("deterministic mode needs a chain (topk 1): tree nodes sit at cache slots other than their "
                          "positions, so their attention sums in another order than a decode step's")
    if eager_verify:
        raise EngineError("deterministic mode runs the verify through the decode step's forward; eager_verify "
                          "measures another path")
    return Deterministic.chain(shape.steps, drafter)
