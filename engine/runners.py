"""The captured phases of a speculation cycle, one runner per phase as SGLang has one graph runner per phase.

Each runner owns the static input buffers of its graphs and the graphs (CapturedCall / GraphSet) captured over them;
the phase before it writes into those buffers, so a replay needs no host data:

  DraftRunner    extend + draft steps + tree build; reads ExtendInputs (its own), writes the verify's TreeInputs
  VerifyRunner   the target forward over the tree and the acceptance; reads TreeInputs (its own), writes the
                 accepted path into the draft runner's ExtendInputs and returns what the host reads
  CompactRunner  trees only: the accepted path's K/V moved into place, one graph per accepted count

engine.speculate captures them (SpecDecoder._prepare) and replays them in its loop.

Sampling (temperature above the floor): a chain draws each draft from the drafter's q_T (the target's transform -
temperature, top-k, top-p - of the drafter's logits) with Exp(1) noise drawn per cycle into DraftState.noise, keeps
q_T of each drafted token, and its verify accepts by the standard speculative-sampling rule
(engine.sampling.speculative_choices): a draft is accepted with probability 1 - TV(p_T, q_T). Trees keep their
deterministic top-k drafts, whose q is a point mass: EAGLE's multi-draft rule (accept a child with probability
p'(child), else zero it in p' and renormalise), which the verify's race of p over the children is. Sampled trees
would take SpecInfer's multi-draft rule: siblings drawn from q_T (with or without replacement), each kept with
probability min(1, p'(x) / q(x)) against the residual p' = norm(max(0, p' - q)) left by the siblings before it,
so the verify would need q_T per node and a sequential pass over each node's children.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.deterministic import Deterministic, width_forward
from engine.drafter import Eagle3Drafter
from engine.graphs import CapturedCall, GraphSet
from engine.sampling import SamplingParams, greedy, logits_to_probs, race, speculative_choices
from engine.tree import TreeShape, accept, ancestors, build_tree, select_nodes, top_children, topk, tree_mask


def maybe_compile(fn: Callable, on: bool) -> Callable:
    """fn through torch.compile (inductor) when `on`, then captured inside our own graph like the eager fn. A draft
    step and a verify are many small kernels (norms, RoPE, log-softmax, top-k, state updates) around the weights'
    matrix reads: inductor fuses the small ones."""
    return torch.compile(fn, fullgraph=True, dynamic=False) if on else fn


@dataclass
class DraftState:
    """Static buffers the draft graphs read and advance; nothing here leaves the device during a cycle."""
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
    pool_probs: torch.Tensor  # [P, Vd] a sampled chain's q_T of each drafted token (no rows for a tree)
    noise: torch.Tensor  # [steps, Vd] a sampled chain's Exp(1) draws, one row per depth (filled per cycle)

    @classmethod
    def empty(cls, shape: TreeShape, hidden: int, draft_vocab: int, dtype: torch.dtype,
              device: torch.device) -> "DraftState":
        K, P = shape.topk, shape.pool_size
        long = dict(dtype=torch.long, device=device)
        parents = torch.full((P,), -1, **long)
        chain = K == 1
        return cls(torch.zeros(1, **long), torch.zeros(1, **long), torch.zeros(K, device=device),
                   torch.zeros(K, **long), torch.zeros(K, **long), torch.zeros(1, K, hidden, dtype=dtype,
                                                                                 device=device),
                   torch.zeros(K, shape.scratch, dtype=torch.bool, device=device), torch.zeros(P, device=device),
                   torch.zeros(P, **long), parents, shape.pool_depths(device),
                   torch.zeros(P if chain else 0, draft_vocab, device=device),
                   torch.ones(shape.steps if chain else 0, draft_vocab, device=device))


@dataclass
class TreeInputs:
    """Static inputs of one verify size N, written by the draft phase's tree build and read by the verify graph."""
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
        long = dict(dtype=torch.long, device=device)
        return cls(torch.zeros(1, rows, width, dtype=dtype, device=device), torch.zeros(1, rows, **long),
                   torch.ones(1, **long))


GREEDY = SamplingParams()


def sampled_child(logits: torch.Tensor, noise: torch.Tensor, sampling: SamplingParams
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sampled chain's next draft: logits [1, Vd], noise [1, Vd] Exp(1) -> log q_T(draft) [1], the draft [1]
    (draft-vocabulary id) and q_T [1, Vd], the target's sampling transform of the drafter's logits."""
    q = logits_to_probs(logits, sampling)
    ids = race(q, noise)
    return q.gather(1, ids[:, None])[:, 0].log(), ids, q


class DraftRunner:
    """The draft phase as one graph per (draft-token count, with the extend, draft sampling): the draft-extend over
    the last accepted path (left out in the first cycle, whose extend was the prefill's), the k-1 draft steps (none
    for a verify of one token), the tree build into the verify's inputs. One compile each for the extend, all draft
    steps and the build. Drafts are the drafter's top-k, except a chain's at temperature > 0 (`sampled`): drawn from
    q_T, one graph set per sampling setting."""

    def __init__(self, target: torch.nn.Module, drafter: Eagle3Drafter, shape: TreeShape, max_seq_len: int,
                 compile: bool = False):
        self.target, self.drafter, self.shape, self.max_seq_len = target, drafter, shape, max_seq_len
        self.device, self.compile = target.device, compile
        self.state = DraftState.empty(shape, drafter.cfg.hidden_size, drafter.cfg.draft_vocab_size, drafter.dtype,
                                      self.device)
        self.inputs = ExtendInputs.empty(shape.steps + 1, 3 * drafter.cfg.feature_size, drafter.dtype, self.device)
        self.calls: dict[tuple[int, bool, SamplingParams], CapturedCall] = {}
        self.pool = None  # the graphs' shared memory pool

    @property
    def captured(self) -> bool:
        return bool(self.calls)

    def clear(self) -> None:
        self.calls.clear()
        self.pool = None

    def sampled(self, sampling: SamplingParams) -> bool:
        """Whether drafts are drawn from q_T: a chain's at temperature > 0 (a tree's stay its top-k)."""
        return self.shape.topk == 1 and not sampling.greedy

    def drafting(self, sampling: SamplingParams) -> SamplingParams:
        """The setting the draft phase runs under: the request's when sampled, else greedy (one graph set for all)."""
        return sampling if self.sampled(sampling) else GREEDY

    def __call__(self, n: int, extend: bool, sampling: SamplingParams = GREEDY) -> None:
        self.calls[n, extend, self.drafting(sampling)]()

    def draw(self, sampling: SamplingParams, generator: torch.Generator) -> None:
        """Fresh noise for the next draft phase of a sampled chain, on the device before its graph replays (as the
        verify's noise is drawn)."""
        if self.sampled(sampling):
            self.state.noise.exponential_(generator=generator)

    def target_probs(self) -> torch.Tensor:
        """[steps, V] a sampled chain's q_T of each drafted token over the target vocabulary, in depth order."""
        return self.drafter.probs_to_target(self.state.pool_probs)

    def capture(self, trees: dict[int, TreeInputs], enabled: bool, sampling: SamplingParams = GREEDY) -> None:
        """Once per draft setting: one graph per verify size in `trees` (largest first: the smaller reuse its pool),
        with and without the extend; they never replay at once, so they share one memory pool."""
        mode = self.drafting(sampling)
        if any(key[2] == mode for key in self.calls):
            return
        st = self.state
        def extend(feats: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor) -> None:
            self.extend(feats, tokens, count, mode)

        def draft_step(**inputs: torch.Tensor) -> torch.Tensor:
            return self._draft_step(mode, **inputs)

        compiled = {"extend": maybe_compile(extend, self.compile), "step": maybe_compile(draft_step, self.compile)}
        if self.pool is None and enabled and self.device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        for n in sorted(trees, reverse=True):
            for extend in (True, False):
                st.start.zero_()  # warm-up runs advance start: keep their writes inside the cache
                self.calls[n, extend, mode] = CapturedCall(self._phase_fn(trees[n], extend, compiled),
                                                           {**vars(self.inputs), "start": st.start},
                                                           enabled=enabled, pool=self.pool)
        st.start.zero_()  # the verify warm-ups then write slots 0..N-1

    def extend(self, feats: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor,
               sampling: SamplingParams = GREEDY) -> None:
        """Drafter entries for positions start .. start+T-1 from target features and the tokens after them; the
        top-K at entry count-1 (a sampled chain: a draw from q_T with noise row 0) become the depth-1 candidates.
        Advances start by count (rows past it are padding). Also the prefill's extend over the prompt, eagerly."""
        st, K = self.state, self.shape.topk
        T = tokens.shape[1]
        pos = st.start + torch.arange(T, device=self.device)
        logits, out = self.drafter(feats, tokens, pos)
        last = count - 1
        row = logits[0].index_select(0, last)
        if self.sampled(sampling):
            scores, ids, q = sampled_child(row, st.noise[:1], sampling)
            st.pool_probs[:1].copy_(q)
        else:
            scores, ids = topk(F.log_softmax(row[0], -1), K)
        st.pool_scores[:K] = scores
        st.pool_tokens[:K] = self.drafter.draft_to_target(ids)
        st.beam_scores.copy_(scores)
        st.beam_tokens.copy_(st.pool_tokens[:K])
        st.beam_pool.copy_(torch.arange(K, device=self.device))
        st.beam_hidden.copy_(out.index_select(1, last).expand(1, K, -1))
        st.beam_anc.zero_()
        st.root.copy_(tokens[0].index_select(0, last))
        st.start.add_(count)

    def _draft_step_inputs(self, i: int) -> dict[str, torch.Tensor]:
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

    def _draft_step(self, sampling: SamplingParams, start: torch.Tensor, depth: torch.Tensor, slots: torch.Tensor,
                    itself: torch.Tensor, dst: torch.Tensor) -> None:
        """One draft step: the beams (at position root + depth) each propose K children; all K*K join the pool at
        `dst`, the best K become the next beams. A sampled chain's one child is a draw from q_T with noise row
        depth + 1."""
        st, K, S = self.state, self.shape.topk, self.max_seq_len
        pos = (start + depth).expand(K)
        own = st.beam_anc | itself
        mask = torch.cat([(self.target.slot_ids[:S] < start)[None, :].expand(K, S), own], dim=1)
        logits, out = self.drafter(st.beam_hidden, st.beam_tokens[None], pos, slots, mask)
        if self.sampled(sampling):
            logq, ids, q = sampled_child(logits[0], st.noise.index_select(0, depth + 1), sampling)
            scores, rows = st.beam_scores + logq, torch.zeros_like(ids)
            st.pool_probs.index_copy_(0, dst, q)
        else:
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

    def _build_fn(self, ti: TreeInputs) -> Callable[[torch.Tensor], None]:
        st, n = self.state, ti.tokens.shape[1]

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

    def _phase_fn(self, ti: TreeInputs, extend: bool, compiled: dict[str, Callable]) -> Callable[..., None]:
        """What one draft graph runs for a verify of n tokens. A verify of one token (the fallback at the cache's
        end) is rare: its build is captured, not compiled, which saves a compile."""
        n = ti.tokens.shape[1]
        steps = [self._draft_step_inputs(i) for i in range(1, self.shape.steps)] if n > 1 else []
        build = maybe_compile(self._build_fn(ti), self.compile and n != 1)

        def draft(feats: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor, start: torch.Tensor) -> None:
            if extend:
                compiled["extend"](feats, tokens, count)
            for inputs in steps:
                compiled["step"](**inputs)
            build(start)

        return draft


class VerifyRunner:
    """The target's verify as one graph per (tree size, sampling setting): the forward over root + tree with the
    drafter's features, the target's choice after every node, the accepted path. It writes the path's features and
    tokens into the draft runner's ExtendInputs and returns (path, [count, emitted tokens]) for the host.
    `eager`: neither captured nor compiled (the game plan's "extend mode without CUDA graphs", to measure its cost)."""

    def __init__(self, target: torch.nn.Module, aux_layers: tuple[int, ...], shape: TreeShape, max_seq_len: int,
                 extend_inputs: ExtendInputs, compile: bool = False, eager: bool = False,
                 deterministic: Deterministic | None = None,
                 draft_probs: Callable[[], torch.Tensor] | None = None):
        self.target, self.aux_layers, self.shape = target, aux_layers, shape
        self.extend_inputs = extend_inputs
        # a sampled chain's q_T of each draft over the target vocabulary, [steps, V] (DraftRunner.target_probs)
        self.draft_probs = draft_probs
        self.compile, self.eager, self.deterministic = compile, eager, deterministic
        vocab, dev = target.cfg.vocab_size, target.device
        # the full tree, and one token for the cache's end where the tree no longer fits
        self.inputs = {n: TreeInputs.empty(n, max_seq_len, vocab, dev) for n in (1, shape.draft_tokens)}
        self.calls: dict[tuple[int, SamplingParams], CapturedCall] = {}

    def clear(self) -> None:
        self.calls.clear()

    def __call__(self, n: int, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        return self.calls[n, sampling]()

    def capture(self, sampling: SamplingParams, enabled: bool) -> None:
        """The graphs of one sampling setting, once."""
        for n in self.inputs:
            if (n, sampling) not in self.calls:
                self.calls[n, sampling] = CapturedCall(self._fn(n, sampling), vars(self.inputs[n]),
                                                       enabled=enabled and not self.eager)

    def _fn(self, n: int, sampling: SamplingParams) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """The target forward (with compile, its layers compiled: Transformer.compiled_layers), then the settle: the
        target's choices, the accepted path and the extend's inputs - small kernels that inductor fuses, except
        in a verify of one token (rare: the cache's end), in deterministic mode and in eager mode."""
        forward = self._forward()
        fuse = self.compile and n != 1 and not self.eager and self.deterministic is None
        settle = maybe_compile(self._settle_fn(n, sampling), fuse)

        def verify(tokens, pos, slots, mask, parents, depth, anc, noise):
            logits, aux = forward(tokens, pos, slots, mask)
            return settle(tokens, logits, aux, parents, depth, anc, noise)

        return verify

    def _settle_fn(self, n: int, sampling: SamplingParams) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """The target's choice after every node, then the accepted path (engine.tree.accept: a node is accepted when
        its token is its parent's choice). Greedy: the argmax. Sampled: a chain's drafts were drawn from q_T, so
        speculative sampling with that q; a tree's are the drafter's top-k (q a point mass), for which the race
        of p after each node is the rule."""
        max_depth, ext = self.shape.steps, self.extend_inputs
        m = min(n, max_depth + 1)  # path rows the extend can need
        sampled_chain = not sampling.greedy and self.shape.topk == 1 and n > 1
        if sampled_chain and self.draft_probs is None:
            raise ValueError("the verify of a sampled chain needs the drafts' distributions (draft_probs)")

        def settle(tokens, logits, aux, parents, depth, anc, noise):
            if sampling.greedy:
                choice = greedy(logits[0])
            elif sampled_chain:
                choice = speculative_choices(tokens[0, 1:], logits_to_probs(logits[0], sampling), self.draft_probs(),
                                             noise)
            else:
                choice = race(logits_to_probs(logits[0], sampling), noise)
            count, path, emitted = accept(tokens[0], choice, parents, depth, anc, max_depth)
            ext.feats[:, :m].copy_(aux.index_select(1, path[:m]))
            ext.tokens[0, :m].copy_(emitted[:m])
            ext.count.copy_(count)
            return path, torch.cat([count, emitted])  # result: what the host reads

        return settle

    def _forward(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
        """The target forward with the drafter's feature layers; in deterministic mode the width forward shared with
        the baseline's decode step (engine.deterministic)."""
        compiled = self.compile and not self.eager
        if self.deterministic is not None:
            return width_forward(self.target, self.deterministic, compiled)
        aux_layers = self.aux_layers
        return lambda tokens, pos, slots, mask: self.target(tokens, pos, slots, mask, hidden_layers=aux_layers,
                                                            compiled=compiled)


class CompactRunner:
    """A tree's accepted path, written at the slots of its verify indices, moved to consecutive slots after the
    root: one launch instead of copies per layer, one graph per accepted count 2..k+1 (an accepted root alone is
    in place). A chain's path is in place already."""

    def __init__(self, target: torch.nn.Module, shape: TreeShape, enabled: bool):
        self.target = target
        dev = target.device

        def slots(c: int) -> dict[str, torch.Tensor]:
            return {"src_slots": torch.zeros(c, dtype=torch.long, device=dev),
                    "dst_slots": torch.zeros(c, dtype=torch.long, device=dev)}

        self.graphs = GraphSet(target.move_cache, slots, range(2, shape.steps + 2), enabled=enabled)

    def __call__(self, count: int, path: torch.Tensor, root_slot: int) -> None:
        """Path nodes 0..count-1 (verify indices from root_slot) to slots root_slot .. root_slot + count - 1."""
        self.graphs(count, src_slots=path[:count] + root_slot,
                    dst_slots=self.target.slot_ids[root_slot:root_slot + count])
