"""EAGLE-3 speculative decoding: draft, verify, accept, compact, draft-extend - chain (topk 1) or tree.

State between cycles: the sequence has L tokens; the target has K/V for positions 0..L-2 and the drafter has
entries for 0..L-2 (entry p = target features at p + token p+1). The last token x_{L-1}, the ROOT, is unverified.

One cycle:
  draft    the previous draft-extend's logits give K depth-1 candidates; draft steps 1..k-1 (one drafter forward
           of K tokens each, at position L-2+i, written to scratch slots past the sequence) grow the pool
           (engine.tree), and the best `draft_tokens - 1` nodes form the tree.
  verify   ONE target forward over root + tree at positions L-1 + depth, slots L-1 + node index, tree mask,
           returning the drafter's features. The target's choice after every node (argmax, or a sample) decides
           the accepted path: exactly the target's greedy output, and with sampling exactly its distribution -
           drafts are picked deterministically (top-k), so the draft distribution is a point mass and rejection
           sampling with residual resampling (accept child c with probability p'(c), else zero c in p' and
           renormalise; after the last child sample p') is the same as drawing t ~ p and taking the child equal to
           t, as EAGLE's evaluate_posterior and SGLang's target-only tree sampling do.
           It also writes the accepted path's features and tokens into the draft-extend's static inputs.
  sync     the accepted count and tokens come to the host: the cycle's only synchronisation. On CUDA the next
           cycle's draft phase is queued before the host waits (its inputs are all on the device), so the GPU
           drafts while the host reads the result and does its bookkeeping - unless this cycle may be the last.
  compact  the path's K/V move to slots L-1 .. L-2+count (trees only: a chain's path is already in place).
  extend   (first in the next cycle's draft phase) the drafter writes entries for the accepted positions from the
           target's features; its logits at the last accepted entry are the depth-1 candidates. It runs over
           steps + 1 rows whatever the count: rows past the count write entries at slots >= the new start, which
           every later read masks out and the next extend overwrites. One shape, so one graph and one compile.

Two captured CUDA graphs per cycle, each owning its static buffers: the draft phase (extend, the k-1 draft steps and
the tree build; one graph per draft-token count, and one without the extend for the first cycle, whose extend was the
prefill's) and verify (one per draft-token count and sampling setting). `eager_verify=True` runs the verify forward
eagerly - the game plan's "extend mode without CUDA graphs" - to measure what that costs.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.deterministic import Deterministic, width_forward
from engine.drafter import Eagle3Drafter
from engine.errors import EngineError
from engine.generate import GenerationResult, check_lengths, cut_at_stop, prompt_tensor
from engine.graphs import CapturedCall, GraphSet
from engine.sampling import SamplingParams, logits_to_probs, sample_from_probs
from engine.timing import Clock, clock, sync
from engine.tree import TreeShape, accept, ancestors, build_tree, select_nodes, top_children, topk, tree_mask


@dataclass
class DraftState:
    """Static buffers the drafter graphs read and advance; nothing here leaves the device during a cycle."""
    start: torch.Tensor  # [1] position (and target slot) of the root
    root: torch.Tensor  # [1] the root token
    beam_scores: torch.Tensor  # [K] cumulative log-probs of the beams
    beam_tokens: torch.Tensor  # [K] target ids
    beam_pool: torch.Tensor  # [K] pool index of each beam
    beam_hidden: torch.Tensor  # [1, K, H] drafter output the beams' next entries are built from
    beam_anc: torch.Tensor  # [K, scratch] bool: scratch slots of each beam's drafted ancestors
    pool_scores: torch.Tensor  # [P]
    pool_tokens: torch.Tensor  # [P] target ids
    pool_parents: torch.Tensor  # [P] pool index of the parent, -1 for depth 1
    pool_depth: torch.Tensor  # [P] constant

    @classmethod
    def empty(cls, shape: TreeShape, hidden: int, dtype: torch.dtype, device: torch.device) -> "DraftState":
        K, P = shape.topk, shape.pool_size
        long = dict(dtype=torch.long, device=device)
        parents = torch.full((P,), -1, **long)
        return cls(torch.zeros(1, **long), torch.zeros(1, **long), torch.zeros(K, device=device),
                   torch.zeros(K, **long), torch.zeros(K, **long), torch.zeros(1, K, hidden, dtype=dtype,
                                                                                 device=device),
                   torch.zeros(K, shape.scratch, dtype=torch.bool, device=device), torch.zeros(P, device=device),
                   torch.zeros(P, **long), parents, shape.pool_depths(device))


@dataclass
class TreeInputs:
    """Static inputs of one verify size N, written by the tree-build graph and read by the verify graph."""
    tokens: torch.Tensor  # [1, N]
    pos: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]
    mask: torch.Tensor  # [N, S]
    parents: torch.Tensor  # [N]
    depth: torch.Tensor  # [N]
    anc: torch.Tensor  # [N, N]
    noise: torch.Tensor  # [N, V] Exp(1) draws for sampling (filled per cycle; unused when greedy)

    @classmethod
    def empty(cls, n: int, seq_len: int, vocab: int, device: torch.device) -> "TreeInputs":
        long = dict(dtype=torch.long, device=device)
        return cls(torch.zeros(1, n, **long), torch.zeros(n, **long), torch.arange(n, **long),
                   torch.ones(n, seq_len, dtype=torch.bool, device=device), torch.zeros(n, **long),
                   torch.zeros(n, **long), torch.eye(n, dtype=torch.bool, device=device),
                   torch.ones(n, vocab, device=device))


@dataclass
class ExtendInputs:
    """The accepted path as the draft-extend reads it: written by the verify graph, read by the next draft graph.
    Padded to steps + 1 rows (the longest path), so one graph serves every accepted count."""
    feats: torch.Tensor  # [1, E, 3 * target hidden] target features at the path's nodes
    tokens: torch.Tensor  # [1, E] the target's tokens after them (accepted drafts + bonus)
    count: torch.Tensor  # [1] valid rows

    @classmethod
    def empty(cls, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> "ExtendInputs":
        return cls(torch.zeros(1, rows, width, dtype=dtype, device=device),
                   torch.zeros(1, rows, dtype=torch.long, device=device), torch.ones(1, dtype=torch.long, device=device))


@dataclass
class Cycle:
    tokens: list[int]
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0


class SpecDecoder:
    """Target + EAGLE-3 drafter with `generate` / `stream` like engine.generate.Generator."""

    def __init__(self, target: torch.nn.Module, drafter: Eagle3Drafter, max_seq_len: int, steps: int = 7,
                 topk: int = 1, draft_tokens: int | None = None, cuda_graphs: bool = True, eager_verify: bool = False,
                 prefill_chunk: int = 512, compile: bool = False, overlap: bool | None = None,
                 deterministic: bool = False):
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
        self.state = DraftState.empty(self.shape, drafter.cfg.hidden_size, drafter.dtype, self.device)
        self.inputs = {n: TreeInputs.empty(n, max_seq_len, target.cfg.vocab_size, self.device)
                       for n in (1, self.shape.draft_tokens)}
        self.extend = ExtendInputs.empty(self.shape.steps + 1, 3 * drafter.cfg.feature_size, drafter.dtype,
                                         self.device)
        self._caches = None  # the cache objects the graphs were captured over
        self._draft: dict[tuple[int, bool], CapturedCall] = {}  # (draft-token count, with the extend)
        self._verify: dict[tuple[int, SamplingParams], CapturedCall] = {}
        self._compact: GraphSet | None = None

    # ---- the functions the graphs capture ---------------------------------------------------------------
    def _extend_fn(self, feats: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor) -> None:
        """Drafter entries for positions start .. start+T-1 from target features and the tokens after them; the
        top-K at entry count-1 become the depth-1 candidates. Advances start by count (rows past it are padding)."""
        st, K = self.state, self.shape.topk
        T = tokens.shape[1]
        pos = st.start + torch.arange(T, device=self.device)
        logits, out = self.drafter(feats, tokens, pos)
        last = count - 1
        scores, ids = topk(F.log_softmax(logits[0].index_select(0, last)[0], -1), K)
        st.pool_scores[:K] = scores
        st.pool_tokens[:K] = self.drafter.draft_to_target(ids)
        st.beam_scores.copy_(scores)
        st.beam_tokens.copy_(st.pool_tokens[:K])
        st.beam_pool.copy_(torch.arange(K, device=self.device))
        st.beam_hidden.copy_(out.index_select(1, last).expand(1, K, -1))
        st.beam_anc.zero_()
        st.root.copy_(tokens[0].index_select(0, last))
        st.start.add_(count)

    def _draft_inputs(self, i: int) -> dict[str, torch.Tensor]:
        """Static inputs of draft step i (1..k-1): all that differs between steps is data, so one compiled function
        serves every step (one compile, not k-1)."""
        st, K, S = self.state, self.shape.topk, self.max_seq_len
        long = dict(dtype=torch.long, device=self.device)
        own_slots = torch.arange((i - 1) * K, i * K, **long)  # scratch index of this step's entries
        itself = torch.zeros_like(st.beam_anc)  # each beam sees its own new entry
        itself[torch.arange(K, device=self.device), own_slots] = True
        off = K + (i - 1) * K * K
        return {"start": st.start, "depth": torch.full((1,), i - 1, **long), "slots": S + own_slots,
                "itself": itself, "dst": torch.arange(off, off + K * K, **long)}

    def _draft_step(self, start: torch.Tensor, depth: torch.Tensor, slots: torch.Tensor, itself: torch.Tensor,
                    dst: torch.Tensor) -> None:
        """One draft step: the beams (at position root + depth) each propose K children; all K*K join the pool at
        `dst`, the best K become the next beams."""
        st, K, S = self.state, self.shape.topk, self.max_seq_len
        pos = (start + depth).expand(K)
        own = st.beam_anc | itself
        mask = torch.cat([(self.target.slot_ids[:S] < start)[None, :].expand(K, S), own], dim=1)
        logits, out = self.drafter(st.beam_hidden, st.beam_tokens[None], pos, slots, mask)
        scores, ids, rows = top_children(st.beam_scores, F.log_softmax(logits[0], -1), K)
        tokens = self.drafter.draft_to_target(ids)
        st.pool_scores.index_copy_(0, dst, scores)
        st.pool_tokens.index_copy_(0, dst, tokens)
        st.pool_parents.index_copy_(0, dst, st.beam_pool[rows])
        keep = topk(scores, K)[1]
        st.beam_scores.copy_(scores[keep])
        st.beam_tokens.copy_(tokens[keep])
        st.beam_pool.copy_(dst[keep])
        st.beam_hidden.copy_(out[:, rows[keep]])
        st.beam_anc.copy_(own[rows[keep]])

    def _build_fn(self, n: int):
        st, ti = self.state, self.inputs[n]

        def build(start: torch.Tensor) -> None:
            sel = select_nodes(st.pool_scores, n - 1)
            tokens, parents, depth = build_tree(sel, st.pool_parents, st.pool_tokens, st.pool_depth, st.root)
            anc = ancestors(parents, self.shape.steps)
            ti.tokens.copy_(tokens[None])
            ti.pos.copy_(start + depth)
            ti.slots.copy_(start + torch.arange(n, device=self.device))
            ti.mask.copy_(tree_mask(anc, start, self.max_seq_len))
            ti.parents.copy_(parents)
            ti.depth.copy_(depth)
            ti.anc.copy_(anc)

        return build

    def _draft_fn(self, n: int, extend: bool, compiled: dict):
        """The draft phase for a verify of n tokens: the draft-extend over the last accepted path (not in the first
        cycle: the prefill extended), the k-1 draft steps (none when n is 1), the tree build."""
        steps = [self._draft_inputs(i) for i in range(1, self.shape.steps)] if n > 1 else []
        build = self._compiled(self._build_fn(n), n)

        def draft(feats: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor, start: torch.Tensor) -> None:
            if extend:
                compiled["extend"](feats, tokens, count)
            for inputs in steps:
                compiled["step"](**inputs)
            build(start)

        return draft

    def _verify_fn(self, n: int, sampling: SamplingParams):
        max_depth, ext = self.shape.steps, self.extend
        m = min(n, max_depth + 1)  # path rows the extend can need

        forward = self._target_forward()

        def verify(tokens, pos, slots, mask, parents, depth, anc, noise):
            logits, aux = forward(tokens, pos, slots, mask)
            if sampling.greedy:
                choice = logits[0].argmax(-1)
            else:
                choice = (logits_to_probs(logits[0], sampling) / noise).argmax(-1)  # exponential race
            count, path, emitted = accept(tokens[0], choice, parents, depth, anc, max_depth)
            ext.feats[:, :m].copy_(aux.index_select(1, path[:m]))
            ext.tokens[0, :m].copy_(emitted[:m])
            ext.count.copy_(count)
            return path, torch.cat([count, emitted])  # result: what the host reads

        return verify

    def _target_forward(self):
        """The verify's target forward; in deterministic mode the shared width forward of the baseline's decode step
        (compiled there, on its own: the verify around it stays eager inside the graph)."""
        if self.deterministic is not None:
            return width_forward(self.target, self.deterministic, self.compile)
        aux_layers = self.drafter.aux_layers
        return lambda tokens, pos, slots, mask: self.target(tokens, pos, slots, mask, hidden_layers=aux_layers)

    def _compiled(self, fn, n: int | None = None):
        """With `compile`, fn (serving verifies of n tokens; None: of every size) through torch.compile (inductor),
        captured inside our own graph like the eager fn. A draft step is ~100 small kernels (norms, RoPE,
        log-softmax, top-k, state updates) around ~750 MB of matrix reads at the 8b shape, and verify several hundred
        around the target's weights: inductor fuses the small ones. One compile for the extend, one for all draft steps, one each for the tree build and verify of the
        full tree. A verify of one token (the fallback at the cache's end) is rare: captured, not compiled, which
        saves two compiles; the prefill stays eager."""
        return torch.compile(fn, fullgraph=True, dynamic=False) if self.compile and n != 1 else fn

    # ---- setup --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _prepare(self, sampling: SamplingParams) -> None:
        """Caches and graphs (captured once per cache allocation; verify once per sampling setting)."""
        if self.target.max_seq_len < self.max_seq_len:
            self.target.setup_caches(self.max_seq_len)
        if self.drafter.max_seq_len != self.max_seq_len + self.shape.scratch:
            self.drafter.setup_caches(self.max_seq_len + self.shape.scratch)
        caches = (self.target.layers[0].self_attn.cache, self.drafter.midlayer.self_attn.cache)
        if caches != self._caches:
            self._caches = caches
            self._draft.clear(), self._verify.clear()
        if self.target.max_seq_len != self.max_seq_len:
            raise EngineError(f"the target's cache holds {self.target.max_seq_len} tokens, this decoder "
                              f"{self.max_seq_len}: use one max_seq_len for both")
        on, st, dev = self.cuda_graphs, self.state, self.device
        if not self._draft:
            compiled = {"extend": self._compiled(self._extend_fn), "step": self._compiled(self._draft_step)}
            pool = torch.cuda.graph_pool_handle() if on and dev.type == "cuda" else None  # never replayed at once
            for n in sorted(self.inputs, reverse=True):
                for extend in (True, False):
                    st.start.zero_()  # warm-up runs advance start: keep their writes inside the cache
                    self._draft[n, extend] = CapturedCall(self._draft_fn(n, extend, compiled),
                                                          {**vars(self.extend), "start": st.start}, enabled=on,
                                                          pool=pool)
            st.start.zero_()  # the verify warm-ups then write slots 0..N-1

            def slots(c: int) -> dict[str, torch.Tensor]:
                return {"src_slots": torch.zeros(c, dtype=torch.long, device=dev),
                        "dst_slots": torch.zeros(c, dtype=torch.long, device=dev)}

            # one launch instead of four copies per layer; sizes 2..k+1 (an accepted root alone is in place)
            self._compact = GraphSet(self.target.move_cache, slots, range(2, self.shape.steps + 2), enabled=on)
        for n in self.inputs:
            if (n, sampling) not in self._verify:
                eager = self.eager_verify  # the game plan's slow path: neither captured nor compiled
                verify = self._verify_fn(n, sampling)
                plain = eager or self.deterministic is not None  # deterministic: the forward inside is compiled
                self._verify[n, sampling] = CapturedCall(verify if plain else self._compiled(verify, n),
                                                         vars(self.inputs[n]), enabled=on and not eager)

    @torch.no_grad()
    def _prefill(self, ids: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> None:
        """Target prefill in chunks with features, the first token, and the drafter's extend over the prompt."""
        L, aux_layers = ids.shape[1], self.drafter.aux_layers
        self.state.start.zero_()
        for s in range(0, L, self.prefill_chunk):
            e = min(s + self.prefill_chunk, L)
            logits, feats = self.target(ids[:, s:e], torch.arange(s, e, device=self.device), hidden_layers=aux_layers)
            nxt = ids[:, s + 1:e + 1]
            if e == L:
                first = sample_from_probs(logits_to_probs(logits[0, -1:], sampling), gen) if not sampling.greedy \
                    else logits[0, -1:].argmax(-1)
                nxt = torch.cat([nxt, first[None]], dim=1)
            self._extend_fn(feats, nxt, torch.full((1,), e - s, device=self.device))

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
        first = int(self.state.root.item())
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
                self._draft[n, extend]()
            draft_s = clock.lap()
            if not sampling.greedy:
                self.inputs[n].noise.exponential_(generator=gen)
            path, result = self._verify[n, sampling]()
            verify_s = clock.lap()
            self.result.start(result)
            # The next draft needs only device data: queue it while the host waits, unless this cycle may be the
            # last (length), the next size depends on the count (cache end), or the phases are being timed.
            ahead = self.overlap and not timed and done + longest < max_new_tokens and L + longest - 1 + N <= S
            if ahead:
                self._draft[N, True]()
            host = self.result.wait()  # the cycle's one host synchronisation
            c = host[0]
            tokens, reason = cut_at_stop(host[1:1 + c][:max_new_tokens - done], stop_ids)
            done, L = done + len(tokens), L + c
            if reason == "stop" or done >= max_new_tokens:
                yield Cycle(tokens, draft_s, verify_s, clock.lap())
                return
            if self.shape.topk > 1 and c > 1:  # move the accepted path's K/V into place (a chain's already is)
                root_slot = L - 1 - c
                self._compact(c, src_slots=path[:c] + root_slot,
                              dst_slots=self.target.slot_ids[root_slot:root_slot + c])
            extend = True
            yield Cycle(tokens, draft_s, verify_s, clock.lap())

    def generate(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_ids: Sequence[int] = (), seed: int = 0, timed_phases: bool = False) -> GenerationResult:
        """With timed_phases the device is synchronised between phases, so the split is exact but the total
        a little slower."""
        self._prepare(sampling)  # graph capture is not prefill time
        sync(self.device)
        now = clock(self.device)
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


class HostCopy:
    """A device result read by the host without waiting for work queued after it: a copy into pinned memory and
    an event to wait on (on CPU, a plain copy)."""

    def __init__(self, size: int, device: torch.device):
        cuda = device.type == "cuda"
        self.buf = torch.empty(size, dtype=torch.long, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.n = 0

    def start(self, t: torch.Tensor) -> None:
        self.n = t.numel()
        self.buf[:self.n].copy_(t, non_blocking=True)
        if self.event is not None:
            self.event.record()

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.buf[:self.n].tolist()
