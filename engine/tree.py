"""Draft trees as EAGLE-2/3 and SGLang build them, in fixed-shape tensor ops (no host syncs: CUDA-graph safe).

Drafting keeps `topk` beams. The draft-extend's logits give the first K candidates (depth 1); each of the k-1 draft
steps expands every beam by its K best children (K*K candidates, scored by cumulative log-probability) and keeps the
K best as the next beams. All candidates go into a pool of K + (k-1)K^2 nodes; the verified tree is the root (the
last accepted token) plus the `draft_tokens - 1` best pool nodes. A chain is the same with topk 1.

Scores only fall along a path (log-probs are <= 0) and the pool is in depth order, so a stable descending sort ranks
every parent before its children: the selected set always contains its nodes' ancestors.

Verify order: the root is node 0, then the selected nodes in pool order (parents before children). Node i sits at
position start + depth[i] and is written to cache slot start + i; it attends to the prefix and its ancestors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling import row_max
from engine.spec_settings import DEFAULT_STEPS, DEFAULT_TOPK, SpecSettings, pool_size


@dataclass(frozen=True)
class TreeShape:
    steps: int  # k: drafter forwards per cycle = depth of the deepest draft token
    topk: int  # K: beams kept and children per beam
    draft_tokens: int  # N: tokens per verify forward, the root included

    @classmethod
    def make(cls, steps: int = DEFAULT_STEPS, topk: int = DEFAULT_TOPK,
             draft_tokens: int | None = None) -> "TreeShape":
        """Checked (and draft_tokens defaulted) by engine.spec_settings, the same rule the backends apply."""
        s = SpecSettings(steps, topk, draft_tokens)
        return cls(s.steps, s.topk, s.draft_tokens)

    @property
    def pool_size(self) -> int:
        return pool_size(self.steps, self.topk)

    @property
    def scratch(self) -> int:
        """Drafter cache slots the draft steps write (K per step), kept apart from the sequence's slots."""
        return max(self.steps - 1, 1) * self.topk

    def pool_depths(self, device: torch.device) -> torch.Tensor:
        K = self.topk
        depth = [1] * K + [d for d in range(2, self.steps + 1) for _ in range(K * K)]
        return torch.tensor(depth, dtype=torch.long, device=device)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k) along the last dim; k = 1 as a max (engine.sampling.row_max). A chain drafts with k = 1, and on
    CUDA topk over a vocabulary runs a multi-block radix select (several kernels) where a max is a reduction or two
    (docs/findings.md, section 7)."""
    if k != 1:
        return x.topk(k)
    value, index = row_max(x)
    return value[..., None], index[..., None]


def top_children(beam_scores: torch.Tensor, logprobs: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """beam_scores [B], logprobs [B, Vd] -> the k best children of every beam, flattened [B*k]:
    cumulative scores, draft-vocabulary ids, and the beam (row) each came from."""
    scores, ids = topk(beam_scores[:, None] + logprobs, k)
    rows = torch.arange(ids.numel(), device=ids.device) // k  # repeat_interleave would run a scan
    return scores.flatten(), ids.flatten(), rows


def select_nodes(pool_scores: torch.Tensor, n: int) -> torch.Tensor:
    """Pool indices of the n best candidates, in pool order (closed under ancestors, see the module doc). A chain
    takes the whole pool: no sort."""
    if n == pool_scores.shape[0]:
        return torch.arange(n, device=pool_scores.device)
    order = pool_scores.sort(descending=True, stable=True).indices[:n]
    return order.sort().values


def build_tree(sel: torch.Tensor, pool_parents: torch.Tensor, pool_tokens: torch.Tensor,
               pool_depth: torch.Tensor, root_token: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sel [N-1] selected pool indices; pool_parents [P] (-1: child of the root); root_token [1]
    -> tokens [N], parents [N] (verify indices; the root is its own parent), depth [N]."""
    n, dev = sel.shape[0] + 1, sel.device
    to_verify = torch.zeros(pool_parents.shape[0], dtype=torch.long, device=dev)
    to_verify[sel] = torch.arange(1, n, device=dev)
    par = pool_parents[sel]
    parents = torch.where(par < 0, 0, to_verify[par.clamp(min=0)])
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    return (torch.cat([root_token, pool_tokens[sel]]), torch.cat([zero, parents]),
            torch.cat([zero, pool_depth[sel]]))


def ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[N, N] bool: anc[i, j] = node j is node i or one of its ancestors."""
    n = parents.shape[0]
    idx = torch.arange(n, device=parents.device)
    anc = idx[:, None] == idx[None, :]
    cur = idx
    for _ in range(max_depth):  # a scalar True would be a host->device copy, illegal inside graph capture
        cur = parents[cur]
        anc = anc | (cur[:, None] == idx[None, :])
    return anc


def tree_mask(anc: torch.Tensor, start: torch.Tensor, seq_len: int) -> torch.Tensor:
    """anc [N, N]; start [1] (slot of the root) -> [N, seq_len] bool: the prefix (slots < start) plus each node's
    ancestors at slots start + j. The caller guarantees start + N <= seq_len."""
    n = anc.shape[0]
    slots = torch.arange(seq_len, device=anc.device)
    mask = (slots < start)[None, :].expand(n, seq_len).clone()
    cols = (start + torch.arange(n, device=anc.device))[None, :].expand(n, n)
    return mask.scatter(1, cols, anc)


def accept(tokens: torch.Tensor, target_tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
           anc: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accepted path. target_tokens [N] is the target's choice after each node (argmax, or a sample from its
    distribution); a node is accepted when its token equals its parent's target choice and its parent is accepted.

    -> count [1] (accepted drafts + 1), path [N] (verify indices of the root and the accepted nodes by depth; the
    first `count` are valid, the rest 0), emitted [N] (the target's tokens after each path node: accepted drafts +
    bonus)."""
    n = tokens.shape[0]
    ok = (tokens == target_tokens[parents]) | (torch.arange(n, device=tokens.device) == 0)  # the root always
    acc = ok
    for _ in range(max_depth):
        acc = acc & acc[parents]
    # the deepest accepted node (siblings carry distinct tokens); index_select keeps it on the device
    best = torch.where(acc, depth, -1).argmax().view(1)
    idx = torch.arange(n, device=tokens.device)
    on_path = anc.index_select(0, best)[0]
    # the path's nodes have depths 0..count-1: scatter each to its depth (the rest go to a spare row n and stay 0)
    path = torch.zeros(n + 1, dtype=torch.long, device=tokens.device)
    path = path.scatter(0, torch.where(on_path, depth, n), idx)[:n]
    return depth.index_select(0, best) + 1, path, target_tokens[path]
