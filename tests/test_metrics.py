"""engine.metrics against numbers worked out by hand (the arithmetic is in the comments)."""
from __future__ import annotations

import pytest

from engine.backends import sglang, vllm
from engine.errors import EngineError
from engine.metrics import (accept_length, accept_length_from_hist, breakeven, exact_match, in_decode_steps,
                            projected_speedup, projected_tok_s)


# ------------------------------------------------------------------------------------------------- accept length


@pytest.mark.parametrize("hist, want", [
    ([0, 4], 1.0),  # four cycles, one token each: nothing accepted
    ([0, 1, 0, 3], 2.5),  # 1*1 + 3*3 = 10 tokens over 4 cycles
    ([0, 2, 1, 0, 1], 2.0),  # 2*1 + 1*2 + 1*4 = 8 tokens over 4 cycles
    ([0, 0, 0, 0, 0, 0, 0, 0, 5], 8.0),  # a 7-step chain accepted in full: 7 drafts + the bonus, every cycle
    ([0, 3, 0, 0, 1], 1.75),  # 3 + 4 = 7 tokens over 4 cycles
    ([], 0.0),  # no cycle: nothing measured
    ([0, 0, 0], 0.0),
])
def test_accept_length_of_hand_counted_histograms(hist, want):
    assert accept_length_from_hist(hist) == pytest.approx(want)


def test_accept_length_counts_the_bonus_and_not_the_prefill_token():
    # 3 cycles: 2 drafts accepted + bonus, 0 + bonus, 1 + bonus -> 3 + 1 + 2 = 6 decode tokens; with the prefill's
    # token the answer has 7 tokens. Accept length 6 / 3 = 2.
    assert accept_length(6, 3) == 2.0
    assert accept_length(7, 2) == 3.5
    assert accept_length(0, 0) == 0.0
    with pytest.raises(EngineError, match="negative"):
        accept_length(-1, 2)


def test_sglang_meta_info_maps_to_the_same_accept_length():
    # request 1: 9 completion tokens (1 from the prefill) over 4 verifies; request 2: 5 tokens over 2 verifies.
    # (9 - 1 + 5 - 1) / (4 + 2) = 12 / 6 = 2.0 (token-weighted); SGLang's own per-request value, 9 / 4 = 2.25,
    # counts the prefill's token.
    metas = [{"completion_tokens": 9, "spec_verify_ct": 4}, {"completion_tokens": 5, "spec_verify_ct": 2},
             {"completion_tokens": 3, "spec_verify_ct": 0}, None]  # no speculation stats: left out
    assert sglang.accept_length(metas) == pytest.approx(2.0)
    assert sglang.accept_length([None, {"completion_tokens": 1}]) is None


def test_vllm_counters_map_to_the_same_accept_length():
    # 10 drafts (verify cycles), 12 draft tokens accepted: 12 + 10 bonus tokens = 22 tokens over 10 cycles = 2.2
    assert vllm.SpecCounters(drafts=10, draft_tokens=30, accepted=12).accept_length == pytest.approx(2.2)
    assert vllm.SpecCounters().accept_length is None


# --------------------------------------------------------------------------------------------------- exact match


def test_exact_match_is_the_share_of_prompts_where_all_decoders_agree():
    base = [[1, 2, 3], [4, 5], [6], [7, 8]]
    spec = [[1, 2, 3], [4, 9], [6], [7, 8, 0]]  # prompt 2 differs in a token, prompt 4 in length
    assert exact_match(base, spec) == 0.5  # 2 of 4
    assert exact_match(base, base) == 1.0
    other = [[1, 2, 3], [4, 5], [0], [7, 8]]  # agrees with base on 3 of 4, with spec on 1 of 4
    assert exact_match(base, spec, other) == 0.25  # all three agree on prompt 1 only
    assert exact_match([[]], [[]]) == 1.0  # two empty outputs are the same
    assert exact_match([[1]], [[]]) == 0.0


@pytest.mark.parametrize("outputs, msg", [
    (([[1]],), "at least two"),
    (([[1], [2]], [[1]]), "different numbers of prompts"),  # zip would silently drop the second prompt
    (([], []), "no prompts"),
])
def test_exact_match_refuses_what_it_cannot_compare(outputs, msg):
    with pytest.raises(EngineError, match=msg):
        exact_match(*outputs)


# ------------------------------------------------------------------------------------- break-even and projection


def test_breakeven_is_the_accept_length_that_matches_the_baseline():
    # a 12 ms cycle against an 8 ms decode step: the baseline decodes 1.5 tokens in one cycle's time
    assert breakeven(12.0, 8.0) == pytest.approx(1.5)
    assert breakeven(5.0, 5.0) == pytest.approx(1.0)
    assert in_decode_steps(2.0, 8.0) == pytest.approx(0.25)  # a 2 ms verify is a quarter of a step
    with pytest.raises(EngineError, match="positive"):
        breakeven(12.0, 0.0)


def test_projection_from_accept_length_and_cycle_cost():
    # 3 tokens per 10 ms cycle: 300 tok/s; the baseline at 5 ms per step makes 200 tok/s: 1.5x
    assert projected_tok_s(3.0, 10.0) == pytest.approx(300.0)
    assert projected_speedup(3.0, 10.0, 5.0) == pytest.approx(1.5)
    # at the break-even accept length the projection is the baseline itself
    assert projected_speedup(breakeven(10.0, 5.0), 10.0, 5.0) == pytest.approx(1.0)
    # SGLang's H200 numbers: accept length 3.86 at an 8.6 ms cycle -> 448.8 tok/s
    assert projected_tok_s(3.86, 8.6) == pytest.approx(448.837, abs=1e-3)
    with pytest.raises(EngineError, match="positive"):
        projected_tok_s(3.0, 0.0)
    with pytest.raises(EngineError, match="positive"):
        projected_speedup(3.0, 10.0, -1.0)
