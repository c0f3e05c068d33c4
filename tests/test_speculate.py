"""Speculative decoding on CPU: greedy output identical to the target alone (chain and tree; all accepted, all
rejected, partly accepted, EOS inside a draft, the cache filling up), sampling that keeps the target's distribution,
and the tree helpers."""
import math

import pytest
import torch

from engine.config import ModelConfig
from engine.drafter import Eagle3Drafter, new_drafter
from engine.errors import EngineError
from engine.loading import random_model
from engine.sampling import SamplingParams, logits_to_probs
from engine.speculate import SpecDecoder
from engine.target_decoder import TargetDecoder
from engine.tree import TreeShape, accept, ancestors, build_tree, select_nodes, top_children, topk, tree_mask

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread beats two that contend
V = 97  # prime, so x -> 7x + 3 is a permutation


def bigram(x: torch.Tensor, vocab: int = V) -> torch.Tensor:
    return (7 * x + 3) % vocab


def bigram_target(context: float, vocab: int = V, scale: float = 0.5, seed: int = 0):
    """A target whose greedy choice is bigram(x) unless the context (attention and MLP outputs scaled by
    `context`) overrides it: context 1 -> always the bigram, 100 -> about 3 times in 4. `scale` sets how sure."""
    cfg = ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=512)
    m = random_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    inv = torch.empty(vocab, dtype=torch.long)
    inv[(7 * torch.arange(vocab) + 3) % vocab] = torch.arange(vocab)
    with torch.no_grad():
        E = torch.randn(vocab, 64, generator=g)
        m.embed_tokens.weight.copy_(E)
        m.lm_head.weight.copy_(scale * E[inv])
        for layer in m.layers:
            layer.self_attn.o_proj.weight.mul_(context)
            layer.mlp.down_proj.weight.mul_(context)
    return m


class OracleDrafter(Eagle3Drafter):
    """A real drafter forward whose logits are then pushed toward bigram(next token) by `sure`; on tokens divisible
    by `miss` its first choice is wrong and the bigram only second (so trees accept a second branch). A small `sure`
    leaves the drafter's q far from a point mass."""
    miss = 0
    sure = 40.0

    def forward(self, hidden, input_ids, input_pos, cache_slots=None, attn_mask=None):
        logits, out = super().forward(hidden, input_ids, input_pos, cache_slots, attn_mask)
        v = logits.shape[-1]  # the draft vocabulary is the whole vocabulary here
        right = torch.nn.functional.one_hot(bigram(input_ids, v), v).float()
        wrong = torch.nn.functional.one_hot((bigram(input_ids, v) + 1) % v, v).float()
        missed = (input_ids % self.miss == 0)[..., None] if self.miss else torch.zeros_like(right, dtype=torch.bool)
        sure = self.sure
        return logits + torch.where(missed, sure * wrong + sure / 2 * right, sure * right), out


def drafter_for(target, oracle: bool = False, miss: int = 0, seed: int = 3, sure: float = 40.0) -> Eagle3Drafter:
    d = new_drafter(target.cfg, torch.arange(target.cfg.vocab_size), embedding=target.embed_tokens, seed=seed)
    if oracle:
        d.__class__ = OracleDrafter
        d.miss, d.sure = miss, sure
    return d


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def same_as_target(target, drafter, steps, topk, draft_tokens=None, n_prompts=8, new=32, seq=96, **kw):
    base = TargetDecoder(target, seq, cuda_graphs=False)
    spec = SpecDecoder(target, drafter, seq, steps, topk, draft_tokens, **kw)
    results = []
    for p in prompts(n_prompts):
        want = base.generate(p, new)
        got = spec.generate(p, new)
        assert got.token_ids == want.token_ids, f"prompt {p}"
        assert sum(n * c for n, c in enumerate(got.accept_hist)) == len(got.token_ids) - 1
        assert got.verify_cycles == sum(got.accept_hist)
        results.append(got)
    return results


CASES = [(4, 1, None), (3, 3, 8), (5, 2, 10)]  # chain, tree, deeper tree


@pytest.mark.parametrize("steps,topk,n", CASES)
def test_all_accepted(steps, topk, n):
    t = bigram_target(1.0)
    for r in same_as_target(t, drafter_for(t, oracle=True), steps, topk, n):
        full = steps + 1
        assert r.accept_hist[full] >= r.verify_cycles - 1  # every cycle but a truncated last one
        assert r.accept_length > steps


@pytest.mark.parametrize("steps,topk,n", CASES)
def test_all_rejected_random_drafter(steps, topk, n):
    t = bigram_target(1.0)
    for r in same_as_target(t, drafter_for(t), steps, topk, n):
        assert r.accept_hist[1] >= 0.9 * r.verify_cycles


@pytest.mark.parametrize("steps,topk,n", CASES)
def test_partly_accepted_with_context(steps, topk, n):
    t = bigram_target(100.0)
    results = same_as_target(t, drafter_for(t, oracle=True, miss=3), steps, topk, n)
    hist = [sum(col) for col in zip(*(r.accept_hist for r in results))]
    assert hist[1] > 0 and sum(hist[2:]) > 0  # both rejections and acceptances happened


def test_tree_beats_chain_when_first_choice_misses():
    t = bigram_target(1.0)
    d = drafter_for(t, oracle=True, miss=3)
    chain = same_as_target(t, d, 4, 1, n_prompts=2)
    tree = same_as_target(t, d, 4, 2, 8, n_prompts=2)
    assert sum(r.accept_length for r in tree) > sum(r.accept_length for r in chain)


@pytest.mark.parametrize("topk,n", [(1, None), (3, 9)])
def test_eos_inside_a_draft_stops_there(topk, n):
    t = bigram_target(1.0)
    spec = SpecDecoder(t, drafter_for(t, oracle=True), 128, 4, topk, n)
    p = prompts(1)[0]
    full = spec.generate(p, 30).token_ids
    stop = full[6]  # cycles emit 5 tokens after the prefill's: position 6 is inside the second cycle's draft
    assert stop not in full[:6]
    assert spec.generate(p, 30, stop_ids=(full[0],)).token_ids == full[:1]  # the prefill's token stops too
    r = spec.generate(p, 30, stop_ids=(stop,))
    assert r.token_ids == full[:7] and r.finish_reason == "stop"
    assert list(spec.stream(p, 30, stop_ids=(stop,)))[-1][-1] == stop
    assert TargetDecoder(t, 128, cuda_graphs=False).generate(p, 30, stop_ids=(stop,)).token_ids == r.token_ids


@pytest.mark.parametrize("topk,n", [(1, None), (3, 12)])
def test_cache_filling_up_falls_back_and_ends_cleanly(topk, n):
    t = bigram_target(100.0)
    seq = 48
    p = prompts(1)[0]
    d = drafter_for(t, oracle=True, miss=3)
    want = TargetDecoder(t, seq, cuda_graphs=False).generate(p, seq - len(p))
    got = SpecDecoder(t, d, seq, 4, topk, n).generate(p, seq - len(p))
    assert got.token_ids == want.token_ids and got.finish_reason == "length"
    assert len(got.token_ids) == seq - len(p)


@pytest.mark.parametrize("steps,topk,n", CASES)
def test_draft_queued_ahead_of_the_host_read_gives_the_same_tokens(steps, topk, n):
    """With `overlap` (CUDA's default) each cycle queues the next draft phase before the host reads its count:
    the outputs must not change, through partial acceptance, a stop id and the cache's end."""
    t = bigram_target(100.0)
    d = drafter_for(t, oracle=True, miss=3)
    results = same_as_target(t, d, steps, topk, n, n_prompts=4, new=40, seq=60, overlap=True)
    assert sum(r.accept_hist[1] for r in results) and sum(sum(r.accept_hist[2:]) for r in results)
    p = prompts(1)[0]
    full = TargetDecoder(t, 60, cuda_graphs=False).generate(p, 60 - len(p)).token_ids
    spec = SpecDecoder(t, d, 60, steps, topk, n, overlap=True)
    assert spec.generate(p, 60 - len(p)).token_ids == full  # the last cycles fall back to verifying one token
    assert spec.generate(p, 40, stop_ids=(full[9],)).token_ids == full[:full.index(full[9]) + 1]


def test_stream_matches_generate():
    t = bigram_target(100.0)
    spec = SpecDecoder(t, drafter_for(t, oracle=True, miss=3), 128, 3, 2, 6)
    p = prompts(1)[0]
    parts = list(spec.stream(p, 25))
    assert [x for part in parts for x in part] == spec.generate(p, 25).token_ids
    assert len(parts[0]) == 1 and max(len(x) for x in parts) <= 4


def test_timed_phases_split_the_decode_time():
    t = bigram_target(1.0)
    r = SpecDecoder(t, drafter_for(t, oracle=True), 128, 3, 1).generate(prompts(1)[0], 30, timed_phases=True)
    assert r.draft_s > 0 and r.verify_s > 0 and r.other_s > 0
    assert r.draft_s + r.verify_s + r.other_s <= r.decode_s * 1.05


def test_bad_settings_are_engine_errors():
    t = bigram_target(1.0)
    d = drafter_for(t)
    with pytest.raises(EngineError, match="draft_tokens must be in 2..11"):
        SpecDecoder(t, d, 128, steps=3, topk=2, draft_tokens=12)
    with pytest.raises(EngineError, match="does not fit a cache of 16"):
        SpecDecoder(t, d, 16, steps=5, topk=4, draft_tokens=30)
    with pytest.raises(EngineError, match="chain"):
        SpecDecoder(t, d, 128, steps=3, topk=1, draft_tokens=6)
    spec = SpecDecoder(t, d, 32, steps=3, topk=1)
    with pytest.raises(EngineError, match="exceeds the cache"):
        spec.generate(list(range(20)), 20)
    with pytest.raises(EngineError, match="max_new_tokens must be positive"):
        spec.generate([1, 2], 0)


# ---- sampling keeps the target's distribution ---------------------------------------------------------------

@torch.no_grad()
def exact_marginals(target, prompt: list[int], n: int, sampling: SamplingParams
                    ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Marginal distributions of the first n generated tokens and their joint one ([V**n], the first token most
    significant), by enumeration over the target."""
    seqs, probs, out = [prompt], torch.ones(1), []
    for _ in range(n):
        x = torch.tensor(seqs)
        target.drop_caches()
        logits, _ = target(x, torch.arange(x.shape[1]))
        p = logits_to_probs(logits[:, -1], sampling) * probs[:, None]  # [S, V] joint
        out.append(p.sum(0))
        seqs = [s + [v] for s in seqs for v in range(p.shape[1])]
        probs = p.flatten()
    return out, probs


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom; a count in a cell of probability 0 is infinitely unlikely."""
    if bool((counts[p == 0] > 0).any()):
        return math.inf, 1
    keep = p * counts.sum() >= 5  # pool the rare cells
    exp = torch.cat([p[keep], p[~keep].sum(0, keepdim=True)]) * counts.sum()
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    ok = exp > 0
    return float(((obs - exp)[ok] ** 2 / exp[ok]).sum()), int(ok.sum()) - 1


def chi2_critical(df: int) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty), so a correct sampler fails once in a thousand seeds."""
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


SAMPLING_SCALE = 0.05  # the bigram token about 3 times in 4
SAMPLES = 800


SOFT = 1.5  # an oracle drafter this sure puts about a third of q_T on the bigram: far from a point mass and from p


def sampled_generations(topk: int, n: int | None, sure: float, sampling: SamplingParams
                        ) -> tuple[list[list[int]], int, tuple[list[torch.Tensor], torch.Tensor], int]:
    """SAMPLES seeded generations of 3 tokens, the drafts accepted, the target's exact marginals and joint."""
    t = bigram_target(1.0, vocab=SAMPLING_V, scale=SAMPLING_SCALE)
    d = drafter_for(t, oracle=True, miss=4, sure=sure)
    prompt = [1, 5, 2]
    spec = SpecDecoder(t, d, 32, steps=2, topk=topk, draft_tokens=n)
    samples, accepted = [], 0
    for seed in range(SAMPLES):
        r = spec.generate(prompt, 3, sampling, seed=seed)
        samples.append(r.token_ids)
        accepted += r.accepted_tokens
    return samples, accepted, exact_marginals(t, prompt, 3, sampling)


def joint_chi_square(samples: list[list[int]], joint: torch.Tensor) -> tuple[float, int]:
    """The three tokens together: the prefill's token, then a cycle's, each conditioned on those before it."""
    v = SAMPLING_V
    cells = torch.tensor([(s[0] * v + s[1]) * v + s[2] for s in samples])
    return chi_square(torch.bincount(cells, minlength=v ** 3).float(), joint)


SAMPLING_V = 11
SOFT_SAMPLING = SamplingParams(temperature=1.3, top_k=6)  # spread p: the faults have room to show


@pytest.mark.parametrize("topk,n,sure,sampling", [(1, None, 40.0, SamplingParams(temperature=1.0)),
                                                  (1, None, SOFT, SOFT_SAMPLING),
                                                  (2, 5, 40.0, SamplingParams(temperature=1.0))],
                         ids=["chain", "chain-soft-drafter", "tree"])
def test_sampling_keeps_target_distribution(topk, n, sure, sampling):
    """End to end, the drafts of a chain sampled from the drafter's q_T (a soft drafter: q far from a point mass
    and from p) and a tree's top-k drafts: the tokens are distributed as the target samples them."""
    samples, accepted, (marginals, joint) = sampled_generations(topk, n, sure, sampling)
    assert accepted > SAMPLES // 4  # drafts were accepted often, so the acceptance path is what is tested
    for i, p in enumerate(marginals):
        counts = torch.bincount(torch.tensor([s[i] for s in samples]), minlength=SAMPLING_V).float()
        stat, df = chi_square(counts, p)
        assert stat < chi2_critical(df), f"token {i}: chi-square {stat:.1f} on {df} df"
    stat, df = joint_chi_square(samples, joint)
    assert stat < chi2_critical(df), f"joint: chi-square {stat:.1f} on {df} df"


def test_drafts_not_drawn_from_the_q_they_report_are_caught(monkeypatch):
    """A planted fault in the draft phase: the chain drafts the drafter's argmax but reports q_T to the verify (the
    deterministic draft with the sampled rule). The end-to-end test sees it."""
    import engine.runners

    real = engine.runners.sampled_child

    def argmax_child(logits, noise, sampling):
        _, _, q = real(logits, noise, sampling)
        ids = q.argmax(-1)
        return q.gather(1, ids[:, None])[:, 0].log(), ids, q

    monkeypatch.setattr(engine.runners, "sampled_child", argmax_child)
    samples, _, (_, joint) = sampled_generations(1, None, SOFT, SOFT_SAMPLING)
    stat, df = joint_chi_square(samples, joint)
    assert stat > chi2_critical(df), f"chi-square {stat:.1f} on {df} df: the planted fault went unseen"


@pytest.mark.parametrize("topk,n", [(1, None), (2, 5)])
def test_a_tiny_temperature_speculates_greedily(topk, n):
    """Below the sampling floor the verify takes the greedy choice (not NaN probabilities: token 0 forever), so the
    output is the target's greedy one."""
    t = bigram_target(100.0)
    spec = SpecDecoder(t, drafter_for(t, oracle=True, miss=3), 96, 3, topk, n)
    base = TargetDecoder(t, 96, cuda_graphs=False)
    for p in prompts(2):
        got = spec.generate(p, 16, SamplingParams(temperature=1e-300), seed=1)
        assert got.token_ids == base.generate(p, 16).token_ids, f"prompt {p}"



# ---- the acceptance rule alone: one verify's emitted tokens against the published rule ----------------------------
# A tree's drafts are chosen deterministically (top-k of the drafter), so the draft distribution q is a point mass at
# the draft token and speculative sampling (Leviathan et al., Chen et al.; SpecInfer / EAGLE for trees) accepts draft
# x with probability min(1, p(x) / q(x)) = p(x), and on rejection samples norm(max(0, p - q)) = p without x. Emitted
# that way, a cycle's tokens are distributed as the target sampling token after token until it leaves the tree: this
# checks the verify's own settle (VerifyRunner) against that distribution, for a tree and for a chain given point
# masses as q. A chain's drafts are sampled from the drafter's q_T (tests further down): there the rule must use q.

SETTLE_V = 6
SETTLE_TRIALS = 6000


def tiny_verify_runner(shape: TreeShape, draft_probs=None):
    from engine.runners import ExtendInputs, VerifyRunner

    cfg = ModelConfig(vocab_size=SETTLE_V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    t = random_model(cfg)
    ext = ExtendInputs.empty(shape.steps + 1, 8, torch.float32, t.device)
    return VerifyRunner(t, (0, 0, 0), shape, 32, ext, draft_probs=draft_probs)


def emitted_distribution(tokens: list[int], parents: list[int], probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Each possible emitted sequence and its probability when the target samples from probs[node] after each node,
    moving to the child carrying the sampled token while there is one."""
    children = {i: {tokens[j]: j for j in range(1, len(tokens)) if parents[j] == i} for i in range(len(tokens))}
    out: dict[tuple[int, ...], float] = {}

    def walk(node: int, prefix: tuple[int, ...], prob: float) -> None:
        for y in range(probs.shape[1]):
            p = prob * float(probs[node, y])
            if p == 0:
                continue
            if y in children[node]:
                walk(children[node][y], prefix + (y,), p)
            else:
                out[prefix + (y,)] = p

    walk(0, (), 1.0)
    return out


def settle_trials(shape: TreeShape, tokens: list[int], parents: list[int], logits: torch.Tensor,
                  sampling: SamplingParams, trials: int = SETTLE_TRIALS, same_noise: bool = False
                  ) -> dict[tuple[int, ...], int]:
    """Emitted sequences of `trials` verifies of one tree with fixed target logits [N, V], fresh noise each time.
    A chain's q: point masses at its drafts."""
    point_masses = torch.nn.functional.one_hot(torch.tensor(tokens[1:]), SETTLE_V).float()
    runner = tiny_verify_runner(shape, lambda: point_masses)
    n = len(tokens)
    settle = runner._settle_fn(n, sampling)
    par = torch.tensor(parents)
    depth = torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    anc = ancestors(par, shape.steps)
    tok, aux = torch.tensor([tokens]), torch.zeros(1, n, 8)
    g = torch.Generator().manual_seed(0)
    seen: dict[tuple[int, ...], int] = {}
    for _ in range(trials):
        noise = torch.empty(n, SETTLE_V).exponential_(generator=g)
        if same_noise:  # a planted fault: one draw shared by every node
            noise = noise[:1].expand(n, -1).contiguous()
        _, result = settle(tok, logits[None], aux, par, depth, anc, noise)
        c = int(result[0])
        key = tuple(result[1:1 + c].tolist())
        seen[key] = seen.get(key, 0) + 1
    return seen


def settle_chi_square(seen: dict[tuple[int, ...], int], want: dict[tuple[int, ...], float]) -> tuple[float, int]:
    keys = sorted(set(seen) | set(want))
    return chi_square(torch.tensor([float(seen.get(k, 0)) for k in keys]),
                      torch.tensor([want.get(k, 0.0) for k in keys]))


def settle_case(kind: str):
    """(shape, node tokens, parents, target logits per node): drafts the target takes sometimes, not always."""
    g = torch.Generator().manual_seed(7)
    if kind == "chain":  # root, then drafts 2, 4, 1: a chain of 3 steps
        shape, tokens, parents, boost = TreeShape.make(3, 1), [0, 2, 4, 1], [0, 0, 1, 2], [0, 0.8, 0.8, 0.8]
    else:  # root with children 2 and 3 (the second branch taken too); 2 with child 5: 2 steps, topk 2
        shape, tokens, parents, boost = TreeShape.make(2, 2, 4), [0, 2, 3, 5], [0, 0, 0, 1], [0, 1.0, 2.0, 0.3]
    logits = torch.randn(len(tokens), SETTLE_V, generator=g) * 0.8
    for i in range(1, len(tokens)):  # make each draft likely, not certain, after its parent
        logits[parents[i], tokens[i]] += boost[i]
    return shape, tokens, parents, logits


SETTLE_SAMPLING = SamplingParams(temperature=0.7, top_p=0.9)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_the_verify_emits_the_targets_distribution(kind):
    shape, tokens, parents, logits = settle_case(kind)
    want = emitted_distribution(tokens, parents, logits_to_probs(logits, SETTLE_SAMPLING))
    seen = settle_trials(shape, tokens, parents, logits, SETTLE_SAMPLING)
    assert sum(c for k, c in seen.items() if len(k) > 1) > SETTLE_TRIALS // 4  # drafts were accepted often
    stat, df = settle_chi_square(seen, want)
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} on {df} df"


def accept_always(tokens, target_tokens, parents, depth, anc, max_depth):
    """A wrong rule: every draft accepted (the target's choice after a node replaced by its draft child)."""
    from engine.tree import accept as real

    forced = target_tokens.clone()
    forced[parents[1:]] = tokens[1:]
    return real(tokens, forced, parents, depth, anc, max_depth)


def untempered(logits, sampling):
    """A wrong rule: the target's choice drawn at temperature 1 whatever the request's temperature."""
    return logits_to_probs(logits, SamplingParams(1.0, sampling.top_k, sampling.top_p))


@pytest.mark.parametrize("fault", ["accept always", "temperature not applied", "one noise draw for all nodes"])
def test_the_distribution_test_catches_a_wrong_rule(fault, monkeypatch):
    """The chi-square test has the power to fail: each planted fault is rejected far beyond the critical value."""
    import engine.runners

    shape, tokens, parents, logits = settle_case("chain")
    if fault == "accept always":
        monkeypatch.setattr(engine.runners, "accept", accept_always)
    if fault == "temperature not applied":
        monkeypatch.setattr(engine.runners, "logits_to_probs", untempered)
    want = emitted_distribution(tokens, parents, logits_to_probs(logits, SETTLE_SAMPLING))
    seen = settle_trials(shape, tokens, parents, logits, SETTLE_SAMPLING,
                         same_noise=fault == "one noise draw for all nodes")
    stat, df = settle_chi_square(seen, want)
    assert stat > chi2_critical(df), f"chi-square {stat:.1f} on {df} df: the planted fault went unseen"


# ---- a chain's sampled drafts: the rule with the drafter's q -------------------------------------------------------
# A Markov target and drafter on SETTLE_V tokens: after token a the target samples p_T(lp[a]) and the drafter
# q_T(lq[a]), q near p but neither p nor a point mass (and top-p leaves them different supports). Each trial drafts
# a chain from q, settles it with the verify's own settle given that q, and goes on from the last emitted token until
# MARKOV_LEN tokens are out: their joint law must be the target's own, p(y1 | 0) p(y2 | y1) p(y3 | y2).

MARKOV_LEN = 3


def markov_case(seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(SETTLE_V, SETTLE_V, generator=g)
    return lp, lp + 0.5 * torch.randn(SETTLE_V, SETTLE_V, generator=g)


def sampled_chain_trials(lp: torch.Tensor, lq: torch.Tensor, sampling: SamplingParams, steps: int = 3,
                         trials: int = SETTLE_TRIALS) -> tuple[dict[tuple[int, ...], int], int]:
    """The first MARKOV_LEN tokens of `trials` generations from token 0 (see above), and how many generations had
    their first draft accepted."""
    n, q_rows = steps + 1, logits_to_probs(lq, sampling)
    drafted_q = torch.zeros(steps, SETTLE_V)
    settle = tiny_verify_runner(TreeShape.make(steps, 1), lambda: drafted_q)._settle_fn(n, sampling)
    parents, depth = (torch.arange(n) - 1).clamp(min=0), torch.arange(n)
    anc, aux = ancestors(parents, steps), torch.zeros(1, n, 8)
    g = torch.Generator().manual_seed(1)
    seen: dict[tuple[int, ...], int] = {}
    first_accepted = 0
    for trial in range(trials):
        out: list[int] = []
        while len(out) < MARKOV_LEN:
            tokens = [out[-1] if out else 0]
            for _ in range(steps):
                tokens.append(int(torch.multinomial(q_rows[tokens[-1]], 1, generator=g)))
            drafted_q.copy_(q_rows[tokens[:-1]])
            noise = torch.empty(n, SETTLE_V).exponential_(generator=g)
            _, result = settle(torch.tensor([tokens]), lp[tokens][None], aux, parents, depth, anc, noise)
            c = int(result[0])
            first_accepted += not out and c > 1
            out += result[1:1 + c].tolist()
        key = tuple(out[:MARKOV_LEN])
        seen[key] = seen.get(key, 0) + 1
    return seen, first_accepted


def markov_law(lp: torch.Tensor, sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    p = logits_to_probs(lp, sampling)
    law = {(): 1.0}
    for _ in range(MARKOV_LEN):
        law = {k + (y,): w * float(p[k[-1] if k else 0, y]) for k, w in law.items() for y in range(SETTLE_V)}
    return law


def sampled_rule_failures() -> list[str]:
    """The checks of the settle with sampled drafts that fail: the joint law of the emitted tokens (chi-square) and
    the first draft's acceptance rate, which must be 1 - TV(p, q) (Leviathan et al., theorem 3.5)."""
    lp, lq = markov_case()
    seen, first_accepted = sampled_chain_trials(lp, lq, SETTLE_SAMPLING)
    failures = []
    stat, df = settle_chi_square(seen, markov_law(lp, SETTLE_SAMPLING))
    if stat >= chi2_critical(df):
        failures.append(f"distribution: chi-square {stat:.1f} on {df} df")
    p, q = logits_to_probs(lp[0], SETTLE_SAMPLING), logits_to_probs(lq[0], SETTLE_SAMPLING)
    want = 1 - 0.5 * float((p - q).abs().sum())
    rate = first_accepted / SETTLE_TRIALS
    if abs(rate - want) >= 4 * math.sqrt(want * (1 - want) / SETTLE_TRIALS):
        failures.append(f"acceptance: {rate:.3f}, 1 - TV is {want:.3f}")
    return failures


def test_sampled_drafts_keep_the_targets_distribution_and_accept_one_minus_tv():
    assert sampled_rule_failures() == []
    # q this close to p: drafting q's argmax instead would accept p(argmax q), far less
    lp, lq = markov_case()
    p, q = logits_to_probs(lp[0], SETTLE_SAMPLING), logits_to_probs(lq[0], SETTLE_SAMPLING)
    assert 1 - 0.5 * float((p - q).abs().sum()) > float(p[q.argmax()]) + 0.1


def point_mass_rule(drafts, p, q, noise):
    """A wrong rule for sampled drafts: q ignored, each draft taken for a point mass (the rule of top-k drafts).
    It keeps the target's distribution (a sample of p compared with the draft) but accepts only sum(p q)."""
    from engine.sampling import speculative_choices

    return speculative_choices(drafts, p, torch.nn.functional.one_hot(drafts, p.shape[1]).float(), noise)


@pytest.mark.parametrize("fault,caught_by", [("residual is p", "distribution"), ("q ignored", "acceptance")])
def test_the_sampled_draft_test_catches_a_wrong_rule(fault, caught_by, monkeypatch):
    import engine.runners
    import engine.sampling

    if fault == "residual is p":  # a rejected draft replaced by a sample of p, not of norm(max(0, p - q))
        monkeypatch.setattr(engine.sampling, "residual", lambda p, q: p)
    else:
        monkeypatch.setattr(engine.runners, "speculative_choices", point_mass_rule)
    failures = sampled_rule_failures()
    assert any(f.startswith(caught_by) for f in failures), f"the planted fault went unseen: {failures}"


# ---- tree helpers -------------------------------------------------------------------------------------------

def test_tree_selection_is_closed_under_ancestors_even_with_ties():
    # pool of topk 2, 3 steps: 2 depth-1 nodes, then 4 + 4 candidates; scores with ties at -inf-like values
    shape = TreeShape.make(3, 2, 7)
    parents = torch.tensor([-1, -1, 0, 0, 1, 1, 2, 2, 3, 3])
    scores = torch.tensor([0.0, -5.0, 0.0, -1.0, -5.0, -5.0, 0.0, -2.0, -1.0, -9.0])
    sel = select_nodes(scores, shape.draft_tokens - 1)
    assert set(sel.tolist()) >= {int(parents[i]) for i in sel.tolist() if parents[i] >= 0}
    tokens, par, depth = build_tree(sel, parents, torch.arange(10) + 100, shape.pool_depths(torch.device("cpu")),
                                    torch.tensor([7]))
    assert tokens[0] == 7 and par[0] == 0 and depth[0] == 0
    assert (par[1:] < torch.arange(1, 7)).all()  # parents come first
    assert (depth[1:] == depth[par[1:]] + 1).all()


@pytest.mark.parametrize("k", [1, 3])
def test_topk_and_whole_pool_selection_match_the_general_ops(k):
    """A chain's shortcuts (max for top-1, the whole pool without a sort) give what topk and the sort give."""
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(k))
    values, ids = topk(x, k)
    assert torch.equal(values, x.topk(k).values) and torch.equal(ids, x.topk(k).indices)
    scores, ids, rows = top_children(torch.tensor([0.0, -1.0, -2.0, -3.0]), x, k)
    assert rows.tolist() == [r for r in range(4) for _ in range(k)]
    assert torch.equal(scores, (x + torch.tensor([0.0, -1.0, -2.0, -3.0])[:, None]).gather(1, ids.view(4, k)).flatten())
    pool = torch.tensor([0.0, -1.0, -0.5, -3.0, -2.0, -2.5])
    assert select_nodes(pool, 6).tolist() == pool.sort(descending=True, stable=True).indices.sort().values.tolist()


def test_mask_and_accepted_path():
    # root 0 -> 1 -> 3, root 0 -> 2 -> 4
    parents = torch.tensor([0, 0, 0, 1, 2])
    depth = torch.tensor([0, 1, 1, 2, 2])
    anc = ancestors(parents, 2)
    mask = tree_mask(anc, torch.tensor([5]), 12)
    assert mask[:, :5].all() and not mask[:, 10:].any()
    assert mask[4, 5:10].tolist() == [True, False, True, False, True]
    tokens = torch.tensor([9, 11, 12, 13, 14])
    target = torch.tensor([12, 0, 14, 0, 8])  # root -> 12 (node 2), node 2 -> 14 (node 4), bonus 8
    count, path, emitted = accept(tokens, target, parents, depth, anc, 2)
    assert count.item() == 3 and path[:3].tolist() == [0, 2, 4] and emitted[:3].tolist() == [12, 14, 8]
    count, path, emitted = accept(tokens, torch.tensor([5, 0, 0, 0, 0]), parents, depth, anc, 2)
    assert count.item() == 1 and emitted[0].item() == 5


@pytest.mark.parametrize("topk,n", [(1, None), (3, 8)])
def test_mla_moe_target_through_the_model_interface(topk, n):
    t = random_model("deepseek-v3-tiny", seed=0)
    with torch.no_grad():
        t.lm_head.weight.mul_(10)  # clear argmax margins, so chunked and single-token forwards agree
    d = new_drafter(t.cfg, torch.arange(0, t.cfg.vocab_size, 4), embedding=t.embed_tokens)
    same_as_target(t, d, 3, topk, n, n_prompts=2, new=16)


def test_cycle_stats_for_baseline_and_speculation():
    from engine.timing import cycle_stats

    t = bigram_target(1.0)
    ps = prompts(2)
    base = cycle_stats(TargetDecoder(t, 96, cuda_graphs=False), ps, 24, repeats=2)
    spec = cycle_stats(SpecDecoder(t, drafter_for(t, oracle=True), 96, 3, 1), ps, 24, repeats=2)
    assert base.token_ids == spec.token_ids and len(base.samples) == 2
    assert base.accept_length == 1.0 and base.draft_ms == 0.0 and base.verify_ms > 0
    assert spec.accept_length > 3 and spec.ms_per_cycle > 0 and spec.draft_ms > 0


@pytest.mark.parametrize("topk,n,sure,sampling", [(2, 6, 40.0, SamplingParams()), (1, None, SOFT, SOFT_SAMPLING)],
                         ids=["tree-greedy", "chain-sampled"])
def test_compiled_draft_steps_and_verify_give_the_same_tokens(topk, n, sure, sampling):
    t = bigram_target(100.0)
    d = drafter_for(t, oracle=True, miss=3, sure=sure)
    p = prompts(2)
    want = [SpecDecoder(t, d, 96, 3, topk, n).generate(x, 24, sampling, seed=i) for i, x in enumerate(p)]
    got = [SpecDecoder(t, d, 96, 3, topk, n, compile=True).generate(x, 24, sampling, seed=i)
           for i, x in enumerate(p)]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.accept_hist for r in got] == [r.accept_hist for r in want]
    assert sum(sum(r.accept_hist[2:]) for r in want) > 0  # drafts were accepted: the compiled step drafted them


def test_one_compile_serves_every_draft_step():
    """The draft steps differ only in data (their static inputs), so a 7-step chain compiles the step once: per-step
    closures compiled 6 times each and hit dynamo's recompile limit with a second decoder in the same process."""
    from torch._dynamo.utils import counters

    t = bigram_target(100.0)
    d = drafter_for(t, oracle=True, miss=3)
    torch._dynamo.reset()
    counters.clear()
    r = SpecDecoder(t, d, 96, 7, 1, compile=True).generate(prompts(1)[0], 16)
    # the extend, the draft step, the tree build and the verify's settle: one each, not one per step; and the
    # target's layer at the verify's 8 tokens: one graph shared by its 4 layers (Transformer.compiled_layers)
    assert counters["stats"]["unique_graphs"] == 5
    assert r.token_ids == TargetDecoder(t, 96).generate(prompts(1)[0], 16).token_ids


@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("count", [1, 3, 5])
def test_padded_extend_equals_the_exact_one(topk, count):
    """The draft graph runs the extend over steps + 1 rows whatever the accepted count: the rows past the count must
    leave the candidates, the beams, the root, start and the drafter's valid cache entries as an exact extend does."""
    t = bigram_target(100.0)
    d = drafter_for(t, oracle=True, miss=3)
    steps, H3 = 4, 3 * d.cfg.feature_size
    g = torch.Generator().manual_seed(count)
    feats, tokens = torch.randn(1, steps + 1, H3, generator=g), torch.randint(0, V, (1, steps + 1), generator=g)
    states = []
    for rows in (count, steps + 1):  # exact, then padded with rows the extend must ignore
        spec = SpecDecoder(t, d, 96, steps, topk)
        spec._prepare(SamplingParams())
        cache = d.midlayer.self_attn.cache
        cache.k.zero_(), cache.v.zero_()  # the decoders share the drafter's cache: nothing carries over
        spec.draft.state.start.fill_(10)
        spec.draft.extend(feats[:, :rows], tokens[:, :rows], torch.tensor([count]))
        states.append({**{k: v.clone() for k, v in vars(spec.draft.state).items()},
                       "k": cache.k[:, :, :10 + count].clone(), "v": cache.v[:, :, :10 + count].clone()})
    exact, padded = states
    assert int(padded["start"]) == 10 + count and int(padded["root"]) == int(tokens[0, count - 1])
    for key, want in exact.items():
        assert torch.equal(padded[key], want) if key not in ("k", "v", "beam_hidden", "beam_scores", "pool_scores") \
            else torch.allclose(padded[key], want, atol=1e-5), key
