"""Speculative decoding on CUDA: captured verify == eager verify, one host sync per cycle, bf16 greedy output equal
to the target alone."""
import warnings

import pytest
import torch

from engine.sampling import SamplingParams
from engine.speculate import SpecDecoder
from engine.target_decoder import TargetDecoder
from test_speculate import SOFT, bigram_target, drafter_for, prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = [(4, 1, None), (3, 3, 8), (7, 1, None)]


def on_cuda(context: float, dtype=torch.float32, miss: int = 3, sure: float = 40.0):
    t = bigram_target(context).to("cuda", dtype)
    d = drafter_for(t, oracle=True, miss=miss, sure=sure).to("cuda", dtype)
    return t, d


@pytest.mark.parametrize("steps,topk,n", CASES)
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)])
def test_graph_verify_equals_eager_verify(steps, topk, n, sampling):
    t, d = on_cuda(100.0)
    runs = {}
    for name, kw in {"graphs": {}, "eager_verify": {"eager_verify": True},
                     "eager": {"cuda_graphs": False}}.items():
        spec = SpecDecoder(t, d, 256, steps, topk, n, **kw)
        runs[name] = [spec.generate(p, 48, sampling, seed=i) for i, p in enumerate(prompts(4))]
    captured = SpecDecoder(t, d, 256, steps, topk, n)
    captured.generate(prompts(1)[0], 4)
    assert all(c.captured for c in captured.verify.calls.values())
    for name in ("eager_verify", "eager"):
        for a, b in zip(runs["graphs"], runs[name]):
            assert a.token_ids == b.token_ids, name
            assert a.accept_hist == b.accept_hist, name


@pytest.mark.parametrize("steps,topk,n", CASES)
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.7)])
def test_one_host_sync_per_cycle(steps, topk, n, sampling):
    t, d = on_cuda(100.0)
    spec = SpecDecoder(t, d, 256, steps, topk, n)
    p = prompts(1)[0]
    spec.generate(p, 8, sampling)  # capture first
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            r = spec.generate(p, 64, sampling, seed=1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    # the prefill copies the prompt in and reads the first token; each cycle waits once for its accepted tokens
    # (an event: the next draft phase is already queued behind them)
    assert r.verify_cycles > 5
    assert len(syncs) <= r.verify_cycles + 2, [str(w.message)[:80] for w in syncs[:5]]


@pytest.mark.parametrize("steps,topk,n", CASES)
def test_bf16_greedy_equals_baseline(steps, topk, n):
    t, d = on_cuda(1.0, torch.bfloat16)
    base = TargetDecoder(t, 256)
    spec = SpecDecoder(t, d, 256, steps, topk, n)
    for p in prompts(6):
        want, got = base.generate(p, 64), spec.generate(p, 64)
        assert got.token_ids == want.token_ids
        assert got.accept_length > 1.5


def test_timed_phases_on_cuda():
    t, d = on_cuda(1.0)
    spec = SpecDecoder(t, d, 256, 5, 1)
    spec.generate(prompts(1)[0], 8)
    r = spec.generate(prompts(1)[0], 64, timed_phases=True)
    assert r.draft_s > 0 and r.verify_s > 0 and r.other_s > 0
    assert r.draft_s + r.verify_s + r.other_s <= r.decode_s * 1.05


@pytest.mark.parametrize("steps,topk,n", [(7, 1, None), (3, 3, 8)])
def test_compiled_draft_steps_and_verify_in_graphs_match(steps, topk, n):
    t, d = on_cuda(100.0)
    runs = [[SpecDecoder(t, d, 256, steps, topk, n, compile=c).generate(p, 48) for p in prompts(3)]
            for c in (False, True)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert [r.accept_hist for r in runs[0]] == [r.accept_hist for r in runs[1]]


@pytest.mark.parametrize("steps", [4, 7])
@pytest.mark.parametrize("compile", [False, True])
def test_sampled_chain_cycle_is_captured(steps, compile):
    """A chain at temperature > 0 drafts from the drafter's q_T inside the captured draft graph (its noise drawn
    ahead into a static buffer) and settles by speculative sampling inside the captured verify: both phases are
    graphs, and they give the tokens and accept lengths of the same cycle run eagerly (same seeds)."""
    t, d = on_cuda(100.0, sure=SOFT)
    sampling = SamplingParams(temperature=0.7, top_p=0.9)
    runs = {}
    for graphs in (True, False):
        spec = SpecDecoder(t, d, 256, steps, 1, cuda_graphs=graphs, compile=compile)
        runs[graphs] = [spec.generate(p, 48, sampling, seed=i) for i, p in enumerate(prompts(4))]
        if graphs:
            drafts = [c for (_, _, mode), c in spec.draft.calls.items() if mode == sampling]
            assert drafts and all(c.captured for c in drafts)
            assert all(c.captured for (_, mode), c in spec.verify.calls.items() if mode == sampling)
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids and a.accept_hist == b.accept_hist
    assert sum(sum(r.accept_hist[2:]) for r in runs[True]) > 0  # sampled drafts were accepted
