"""Token choice from logits: greedy, temperature, top-k, top-p. Tensor ops only - no host synchronisation, so
the same code runs inside a captured CUDA graph. Settings are Python numbers fixed per generation."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Temperatures below this decode greedily, as vLLM's sampler does (its _SAMPLING_EPS): logits / 1e-300 overflow to
# inf, the softmax of a row holding inf is NaN, and the exponential race over NaN picks token 0 every time. Above the
# floor a real model's logits stay finite after the division; below it the distribution differs from the greedy
# choice only between logits closer than about 1e-4.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below SAMPLING_EPS (0 among them): greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x.max(-1): the largest value along the last dim and the first index holding it (NaN counts as largest, as in
    torch.max). A long row (a vocabulary) is reduced in two passes, within chunks and then across them: a single row
    reduced in one pass runs on one GPU block, which reads the whole vocabulary alone; chunked, many blocks share
    the read. The values and indices are the same as x.max(-1)'s."""
    V = x.shape[-1]
    chunks = math.gcd(V, 256) if V >= 1 << 14 else 1
    if chunks < 32:
        return tuple(x.max(-1))
    best, col = x.unflatten(-1, (chunks, V // chunks)).max(-1)  # [..., chunks]: each chunk's max, first index
    value, chunk = best.max(-1, keepdim=True)  # the first chunk holding the row's max
    index = chunk * (V // chunks) + col.gather(-1, chunk)
    return value.squeeze(-1), index.squeeze(-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] the first index of the largest logit: logits.argmax(-1), by row_max."""
    return row_max(logits)[1]


def logits_to_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k and top-p.
    Greedy gives a one-hot distribution, so rejection sampling reduces to exact matching."""
    logits = logits.float()
    if p.greedy:
        return torch.nn.functional.one_hot(greedy(logits), logits.shape[-1]).float()
    logits = logits / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) > p.top_p  # keep the token that crosses top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] a sample of each row of `weights` (a distribution, or unnormalised non-negative weights) by
    the exponential race argmax(w / E) over Exp(1) draws `noise` - multinomial sampling without a host sync. Drawn
    ahead into a static buffer, the noise keeps a captured graph free of random-number state."""
    return greedy(weights / noise)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A sample of each row of probs (the exponential race over fresh draws)."""
    return race(probs, torch.empty_like(probs).exponential_(1, generator=generator))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), the unnormalised distribution a rejected draft is replaced from (the race needs no norm)."""
    return (p - q).clamp(min=0)


def speculative_choices(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The target's choice after each node of a chain whose drafts were sampled from the drafter: speculative
    sampling (Leviathan et al. 2023, Chen et al. 2023), every row at once, without a host sync.

    drafts [n-1]: node i+1's token, drawn from q[i] [n-1, V]; p [n, V]: the target's distribution after each node;
    noise [n, V]: Exp(1) draws. Draft x after node i is kept when u < p_i(x) / q_i(x), u = exp(-noise[i, x])
    (uniform); else the choice is a sample of norm(max(0, p_i - q_i)), raced over the row's other draws (x itself
    is left out: a rejected x has p_i(x) < q_i(x), so weight 0, and the race stays independent of u); after the last
    node it is a sample of p. engine.tree.accept then keeps each node whose token is its parent's choice: a draft is
    accepted with probability 1 - TV(p_i, q_i), and the emitted tokens are distributed as the target's p.
    -> [n] the choice after each node."""
    x = drafts[:, None]
    u = torch.exp(-noise[:-1].gather(1, x))
    keep = (u * q.gather(1, x) < p[:-1].gather(1, x))[:, 0]
    weights = torch.cat([residual(p[:-1], q).scatter(1, x, -1.0), p[-1:]])
    choice = race(weights, noise)
    return torch.cat([torch.where(keep, drafts, choice[:-1]), choice[-1:]])


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """[..., V] -> [...] int64 token ids."""
    if p.greedy:
        return greedy(logits)
    return sample_from_probs(logits_to_probs(logits, p), generator)
