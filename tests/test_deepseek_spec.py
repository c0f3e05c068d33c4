"""EAGLE-3 on a DeepSeek-V3 target through the generic model interface: greedy output equals the target's own."""
from __future__ import annotations

import pytest
import torch

from engine.drafter import new_drafter
from engine.speculate import SpecDecoder
from engine.target_decoder import TargetDecoder
from test_deepseek import YARN, engine_model, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return engine_model(tiny(num_hidden_layers=5, rope_scaling=YARN), seed=4)


@pytest.mark.parametrize("steps,topk,draft_tokens", [(3, 1, None), (3, 2, 6)])
def test_eagle3_greedy_equals_target(target, steps, topk, draft_tokens):
    prompt = torch.randint(0, target.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    want = TargetDecoder(target, 96, cuda_graphs=False).generate(prompt, 40).token_ids
    drafter = new_drafter(target.cfg, torch.arange(0, target.cfg.vocab_size, 2), embedding=target.embed_tokens,
                          seed=2, intermediate_size=64)
    assert drafter.aux_layers == target.cfg.default_aux_layers()
    spec = SpecDecoder(target, drafter, 96, steps=steps, topk=topk, draft_tokens=draft_tokens, cuda_graphs=False)
    got = spec.generate(prompt, 40)
    assert got.token_ids == want
    assert got.verify_cycles >= 1 and sum(got.accept_hist) == got.verify_cycles
