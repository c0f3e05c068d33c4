"""How far a target drifted from another, and what that costs its drafter: the drift dial's measures and fits.

Distances between two targets of one shape (A and a B trained further from it): approach C's probe (the cosine
similarity of their residual streams per layer on the same prompts; the drafter reads three of them), the KL of
their next-token distributions on the same text, and the relative distance of their weights. Then the numbers read
off a dial of such targets: how many samples a fine-tune needs to reach a goal (interpolated in log samples) and
straight-line fits with their standard errors (kept share against probe similarity, and the like).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.errors import EngineError
from engine.model import Transformer


@torch.no_grad()
def _forward(model: Transformer, ids: list[int], layers: tuple[int, ...] = ()
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [T, V] and the residual streams entering `layers`, [T, len(layers), H] (None without layers),
    float32."""
    x = torch.tensor([ids], device=model.device)
    logits, aux = model(x, torch.arange(len(ids), device=model.device), hidden_layers=layers)
    return logits[0].float(), aux.float().view(len(ids), len(layers), -1) if layers else None


def layer_cosines(model_a: Transformer, model_b: Transformer, prompts: Sequence[list[int]]) -> list[float]:
    """Approach C's probe: the cosine similarity of A's and B's residual streams entering each layer 0..L (0 = the
    embeddings, L = the last layer's output) on the same prompts, averaged over every token of every prompt."""
    L = model_a.cfg.num_hidden_layers
    if model_b.cfg.num_hidden_layers != L:
        raise EngineError(f"targets of {L} and {model_b.cfg.num_hidden_layers} layers: the probe compares one shape")
    if not prompts:
        raise EngineError("the probe needs at least one prompt")
    layers = tuple(range(L + 1))
    sums = torch.zeros(L + 1)
    tokens = 0
    for ids in prompts:
        cos_t = F.cosine_similarity(_forward(model_a, ids, layers)[1], _forward(model_b, ids, layers)[1], dim=-1)
        sums += cos_t.sum(0).cpu()
        tokens += len(ids)
    return (sums / tokens).tolist()


def probe_similarity(cosines: Sequence[float], aux_layers: Sequence[int]) -> float:
    """The probe's one number: the mean of layer_cosines at the drafter's feature layers."""
    return sum(cosines[i] for i in aux_layers) / len(aux_layers)


def log_distance(similarity: float) -> float:
    """The probe's reading as a distance for the drift dial's fits: log10(1 - similarity)."""
    if not similarity < 1:
        raise EngineError(f"a similarity of {similarity} is no distance: the targets are the same")
    return math.log10(1 - similarity)


def similarity_at(log_dist: float) -> float:
    """The similarity of a log_distance."""
    return 1 - 10 ** log_dist


def next_token_kl(model_a: Transformer, model_b: Transformer, prompts: Sequence[list[int]]) -> float:
    """KL(A || B) of the next-token distributions, nats per token, averaged over every position of every prompt:
    how much of what A predicts B no longer does."""
    if not prompts:
        raise EngineError("the KL needs at least one prompt")
    total, tokens = 0.0, 0
    for ids in prompts:
        la, lb = _forward(model_a, ids)[0], _forward(model_b, ids)[0]
        total += F.kl_div(lb.log_softmax(-1), la.log_softmax(-1), log_target=True, reduction="sum").item()
        tokens += len(ids)
    return total / tokens


@torch.no_grad()
def weight_distance(model_a: torch.nn.Module, model_b: torch.nn.Module) -> float:
    """||theta_B - theta_A|| / ||theta_A|| over every weight (the 2-norm of all of them as one vector)."""
    sa, sb = model_a.state_dict(), model_b.state_dict()
    if sa.keys() != sb.keys() or any(sa[k].shape != sb[k].shape for k in sa):
        raise EngineError("weight distance between models of different shapes")
    diff = sum(((sb[k].double() - sa[k].double()) ** 2).sum().item() for k in sa)
    norm = sum((sa[k].double() ** 2).sum().item() for k in sa)
    if not norm:
        raise EngineError("weight distance from a model whose weights are all zero")
    return math.sqrt(diff / norm)


def samples_to_recover(counts: Sequence[float], accepts: Sequence[float], goal: float,
                       before: float | None = None) -> float | None:
    """The number of fine-tuning samples at which accept length first reaches `goal`, read off the measured points
    (counts[i] samples gave accepts[i]) by straight lines in log samples. 0 when `before` (no fine-tune) reaches it
    already; the smallest count when that one does (an upper bound: nothing was measured below it); None when no
    count does (more than the largest is needed)."""
    if len(counts) != len(accepts) or not counts:
        raise EngineError(f"{len(counts)} sample counts against {len(accepts)} accept lengths")
    if any(not math.isfinite(v) for v in (*counts, *accepts, goal, *(() if before is None else (before,)))):
        raise EngineError("samples to recover from a number that is not finite")
    if any(n <= 0 for n in counts) or len(set(counts)) != len(counts):
        raise EngineError(f"sample counts must be positive and distinct, got {list(counts)}")
    if before is not None and before >= goal:
        return 0.0
    pts = sorted(zip(counts, accepts))
    if pts[0][1] >= goal:
        return float(pts[0][0])
    for (n0, a0), (n1, a1) in zip(pts, pts[1:]):
        if a1 >= goal:  # a0 < goal <= a1: the first crossing
            t = (goal - a0) / (a1 - a0)
            return math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0)))
    return None


@dataclass(frozen=True)
class LinearFit:
    """y = intercept + slope * x by least squares, with what its standard errors need: the residual standard
    deviation (n - 2 degrees of freedom), the mean of x and the sum of squares of x about it; and the range of x it
    was fitted on (beyond it, the line is extrapolated). Its fields are plain numbers, so that a recorded fit is
    rebuilt from its record: LinearFit(**values)."""

    slope: float
    intercept: float
    resid_std: float
    n: int
    x_mean: float
    sxx: float
    x_min: float
    x_max: float

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x

    def se(self, x: float) -> float:
        """Standard error of the fitted line at x (the mean response; it widens away from the data)."""
        return self.resid_std * math.sqrt(1 / self.n + (x - self.x_mean) ** 2 / self.sxx)

    def solve(self, y: float) -> float:
        """The x at which the line reaches y."""
        if self.slope == 0:
            raise EngineError("a flat line reaches no other value")
        return (y - self.intercept) / self.slope

    def solve_band(self, y: float, k: float = 1.0) -> tuple[float, float] | None:
        """The x range over which y lies within k standard errors of the line (Fieller's interval of solve(y)):
        the two x where |line(x) - y| = k * se(x). None when the band never leaves y on one side (the slope is
        within k standard errors of flat): then every x is possible."""
        # (c + b d)^2 = k^2 s^2 (1/n + d^2 / sxx) with d = x - x_mean, c = line(x_mean) - y, b = slope
        b, c, ks2 = self.slope, self(self.x_mean) - y, (k * self.resid_std) ** 2
        qa, qb, qc = b * b - ks2 / self.sxx, 2 * b * c, c * c - ks2 / self.n
        if qa <= 0:
            return None
        disc = max(qb * qb - 4 * qa * qc, 0.0)  # >= 0 whenever qa > 0; a perfect fit rounds it to either side
        roots = sorted(((-qb - math.sqrt(disc)) / (2 * qa), (-qb + math.sqrt(disc)) / (2 * qa)))
        return roots[0] + self.x_mean, roots[1] + self.x_mean


def linear_fit(x: Sequence[float], y: Sequence[float]) -> LinearFit:
    """Least-squares straight line through (x, y); at least three points (two leave no residual to estimate the
    error from), at least two distinct x."""
    if len(x) != len(y):
        raise EngineError(f"a fit of {len(x)} x against {len(y)} y")
    if len(x) < 3:
        raise EngineError(f"a straight-line fit with errors needs at least 3 points, got {len(x)}")
    if any(not math.isfinite(v) for v in (*x, *y)):
        raise EngineError("a fit through a point that is not finite")
    n = len(x)
    xm, ym = sum(x) / n, sum(y) / n
    sxx = sum((a - xm) ** 2 for a in x)
    if sxx == 0:
        raise EngineError("a fit needs at least two distinct x")
    slope = sum((a - xm) * (b - ym) for a, b in zip(x, y)) / sxx
    intercept = ym - slope * xm
    rss = sum((b - intercept - slope * a) ** 2 for a, b in zip(x, y))
    return LinearFit(slope, intercept, math.sqrt(rss / (n - 2)), n, xm, sxx, min(x), max(x))


SCALE_CAVEAT = ("the dial is a miniature: targets of millions of parameters drifting over tens of steps of Python "
                "code; the same similarity need not mean the same drift in a larger target trained further on other "
                "data, so read the prediction as an order of magnitude, against the kept share measured")


def on_the_dial(similarity: float, values: Mapping[str, float], share: float, kept: float | None = None
                ) -> list[str]:
    """Where a probe reading falls on a drift dial's recorded curves, in words: `values` are the drift-dial
    record's metrics by name (kept_fit.* rebuilds fit (a), kept share against log_distance; w_keep and w_recover_nN
    are its thresholds, similarities) and `share` its goal (recover_share); `kept`, the kept share measured beside
    the reading, is set against the prediction."""
    fit = LinearFit(**{f.name: values[f"kept_fit.{f.name}"] for f in dataclasses.fields(LinearFit)})
    x = log_distance(similarity)
    y, se = fit(x), fit.se(x)
    where = "inside" if fit.x_min <= x <= fit.x_max else "outside (extrapolated)"
    lines = [f"a probe similarity of {similarity:.4f} predicts a kept share of {y:.2f} +- {se:.2f} (one standard "
             f"error), {where} the dial's range of similarities {similarity_at(fit.x_max):.4f}.."
             f"{similarity_at(fit.x_min):.4f}" + ("" if kept is None else f"; measured here: {kept:.2f}")]
    slope_se = fit.resid_std / math.sqrt(fit.sxx) if fit.sxx > 0 else math.inf
    if abs(fit.slope) <= slope_se:
        lines.append(f"no forecast: the curve's slope, {fit.slope:.2f} +- {slope_se:.2f}, is within one standard error "
                     f"of flat - on this profile the similarity does not tell what the drafter keeps; measure it")
    counts = sorted(int(m[1]) for k in values if (m := re.fullmatch(r"w_recover_n(\d+)", k)))
    rules = [("w_keep", "the old drafter unchanged")] + [(f"w_recover_n{n}", f"a fine-tune on {n} samples")
                                                         for n in counts]
    for key, what in rules:
        if key in values:
            side = "above" if similarity >= values[key] else "below"
            lines.append(f"{side} W = {values[key]:.4f}, the similarity above which {what} keeps {share:.0%}")
    return lines + [f"caveat of scale: {SCALE_CAVEAT}"]
