"""EAGLE-3 drafter: published key layout and shapes, layer-id conventions, round trip, bad checkpoints."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.drafter import (Eagle3Config, Eagle3Drafter, aux_layers_from_ids, default_config, draft_vocab,
                            load_drafter, new_drafter, save_drafter)
from engine.errors import EngineError
from engine.loading import random_model
from engine.model import internal_to_hf
from engine.shapes import shape_config

# The published 8B drafter layout (field facts, section 1): key -> shape
LLAMA8B_LAYOUT = {
    "fc.weight": (4096, 12288),
    "midlayer.hidden_norm.weight": (4096,),
    "midlayer.input_layernorm.weight": (4096,),
    "midlayer.self_attn.q_proj.weight": (4096, 8192),
    "midlayer.self_attn.k_proj.weight": (1024, 8192),
    "midlayer.self_attn.v_proj.weight": (1024, 8192),
    "midlayer.self_attn.o_proj.weight": (4096, 4096),
    "midlayer.post_attention_layernorm.weight": (4096,),
    "midlayer.mlp.gate_proj.weight": (14336, 4096),
    "midlayer.mlp.up_proj.weight": (14336, 4096),
    "midlayer.mlp.down_proj.weight": (4096, 14336),
    "norm.weight": (4096,),
    "lm_head.weight": (32000, 4096),
    "d2t": (32000,),
    "t2d": (128256,),
}


def hf_shapes(drafter) -> dict[str, tuple[int, ...]]:
    sd = internal_to_hf(drafter, dict(drafter.state_dict()))
    return {k: tuple(v.shape) for k, v in sd.items()}


def test_llama8b_layout_matches_published_keys_and_shapes():
    cfg = default_config(shape_config("llama-3.1-8b"), 32000)
    with torch.device("meta"):
        d = Eagle3Drafter(cfg, (2, 16, 29), embedding=torch.nn.Embedding(128256, 4096))
    assert hf_shapes(d) == LLAMA8B_LAYOUT
    hf = cfg.to_hf(d.aux_layers)
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (hf["hidden_size"], hf["intermediate_size"], hf["draft_vocab_size"], hf["vocab_size"]) == \
        (4096, 14336, 32000, 128256)
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]  # SGLang: output of layer id


def test_kimi_k2_drafter_shapes_on_meta():
    # AQ-MedAI Kimi-K2 drafter: hidden 7168, intermediate 18432, draft vocab 32000, target vocab 163840
    raw = {"architectures": ["LlamaForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
           "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 163840, "draft_vocab_size": 32000,
           "rms_norm_eps": 1e-6, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    cfg = Eagle3Config.from_hf(raw)
    assert aux_layers_from_ids(cfg.aux_layer_ids) == (2, 30, 58)
    with torch.device("meta"):
        d = Eagle3Drafter(cfg, aux_layers_from_ids(cfg.aux_layer_ids), embedding=torch.nn.Embedding(163840, 7168))
    s = hf_shapes(d)
    assert s["fc.weight"] == (7168, 3 * 7168)
    assert s["midlayer.self_attn.q_proj.weight"] == (7168, 2 * 7168)
    assert s["midlayer.mlp.gate_proj.weight"] == (18432, 7168)
    assert s["midlayer.mlp.down_proj.weight"] == (7168, 18432)
    assert s["lm_head.weight"] == (32000, 7168)
    assert s["t2d"] == (163840,) and "embed_tokens.weight" not in s


def test_default_layers_follow_sglang_numbering():
    tgt = shape_config("tiny")  # 4 layers
    assert tgt.default_aux_layers() == (1, 2, 4)
    assert aux_layers_from_ids([1, 15, 28]) == (2, 16, 29)


@pytest.fixture(scope="module")
def target():
    return random_model("tiny", seed=1)


def small_drafter(target, **kw):
    ids = torch.arange(0, target.cfg.vocab_size, 2)  # every other id in the draft vocab
    return new_drafter(target.cfg, ids, embedding=target.embed_tokens, seed=3, **kw)


def test_round_trip_same_outputs(tmp_path, target):
    d = small_drafter(target)
    save_drafter(d, tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "embed_tokens.weight" not in keys and "midlayer.self_attn.q_proj.weight" in keys
    d2 = load_drafter(tmp_path, target)
    assert d2.aux_layers == d.aux_layers and d2.embedding is target.embed_tokens
    torch.testing.assert_close(d2.d2t, d.d2t)
    assert torch.equal(d2.draft_to_target(torch.tensor([0, 5])), torch.tensor([0, 10]))
    h = torch.randn(1, 5, 3 * target.cfg.hidden_size)
    ids = torch.randint(0, target.cfg.vocab_size, (1, 5))
    pos = torch.arange(5)
    l1, o1 = d(h, ids, pos)
    l2, o2 = d2(h, ids, pos)
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(o1, o2)
    # own hidden state (H wide) skips fc
    l3, _ = d2(o2, ids, pos)
    assert l3.shape == (1, 5, target.cfg.vocab_size // 2)



def test_a_draft_distribution_moves_to_the_target_ids(target):
    """A sampled chain's q_T over the draft vocabulary, as the verify reads it: each draft id's mass at its target
    id, nothing at the ids outside the draft vocabulary."""
    d = small_drafter(target)
    q = torch.rand(3, d.cfg.draft_vocab_size).softmax(-1)
    full = d.probs_to_target(q)
    assert full.shape == (3, target.cfg.vocab_size)
    assert torch.equal(full[:, 0::2], q) and not full[:, 1::2].any()
    draft_ids = torch.tensor([0, 7, d.cfg.draft_vocab_size - 1])
    assert torch.equal(full.gather(1, d.draft_to_target(draft_ids)[:, None])[:, 0], q[torch.arange(3), draft_ids])

def test_shared_embedding_is_not_a_parameter_of_the_drafter(target):
    d = small_drafter(target)
    assert not any(n.startswith("embed_tokens") for n, _ in d.named_parameters())
    assert "embed_tokens.weight" not in d.state_dict()
    assert d.embedding is target.embed_tokens


def test_own_embedding_is_saved_and_loaded(tmp_path, target):
    cfg = default_config(target.cfg, 16)
    d = Eagle3Drafter(cfg, target.cfg.default_aux_layers())
    save_drafter(d, tmp_path)
    assert "embed_tokens.weight" in load_file(str(tmp_path / "model.safetensors"))
    d2 = load_drafter(tmp_path, target)
    assert d2.embed_tokens is not None
    torch.testing.assert_close(d2.embed_tokens.weight, d.embed_tokens.weight)


def test_vllm_key_names_load(tmp_path, target):
    save_drafter(small_drafter(target), tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    renamed = {k.replace("midlayer.", "layers.0.").replace("d2t", "draft_id_to_target_id"): v for k, v in sd.items()}
    save_file(renamed, str(f))
    assert load_drafter(tmp_path, target).d2t.shape == (target.cfg.vocab_size // 2,)


def test_draft_vocab_picks_most_frequent_sorted():
    counts = torch.tensor([5, 0, 9, 1, 7])
    assert draft_vocab(counts, 3).tolist() == [0, 2, 4]


def _corrupt(tmp_path, target, edit_sd=None, edit_cfg=None):
    save_drafter(small_drafter(target), tmp_path)
    f, c = tmp_path / "model.safetensors", tmp_path / "config.json"
    if edit_sd:
        sd = load_file(str(f))
        edit_sd(sd)
        save_file(sd, str(f))
    if edit_cfg:
        cfg = json.loads(c.read_text())
        edit_cfg(cfg)
        c.write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("edit_sd,edit_cfg,message", [
    (lambda sd: sd.pop("midlayer.mlp.up_proj.weight"), None, "missing tensor midlayer.mlp.up_proj.weight"),
    (lambda sd: sd.__setitem__("t2d", torch.zeros(7, dtype=torch.bool)), None, "t2d has shape [7], expected [512]"),
    (lambda sd: sd["d2t"].__setitem__(3, 10_000), None, "d2t maps draft id 3 to target id 10003"),
    (lambda sd: sd.pop("d2t"), None, "missing tensor d2t (expected shape [256])"),
    (lambda sd: sd.__setitem__("fc.weight", torch.zeros(64, 10)), None,
     "fc.weight has shape [64, 10], expected [64, 192]"),
    (None, lambda c: c.__setitem__("vocab_size", 1000), "vocab_size 1000 does not match the target's 512"),
    (None, lambda c: c.__setitem__("target_hidden_size", 128), "target_hidden_size 128"),
    (None, lambda c: c.__setitem__("architectures", ["LlamaForCausalLM2"]), "not an EAGLE-3 drafter"),
    (None, lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [1, 2, 40]),
     "feature layers [2, 3, 41]"),
])
def test_bad_checkpoints_name_key_and_shape(tmp_path, target, edit_sd, edit_cfg, message):
    path = _corrupt(tmp_path, target, edit_sd, edit_cfg)
    with pytest.raises(EngineError, match=re.escape(message)):
        load_drafter(path, target)


def test_hidden_size_mismatch_without_embedding(tmp_path, target):
    d = new_drafter(target.cfg, torch.arange(8), hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16)
    # 32 wide with its own embedding: saved and loadable; drop the embedding -> cannot share the target's
    save_drafter(d, tmp_path)
    assert load_drafter(tmp_path, target).cfg.target_hidden_size == 64
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd.pop("embed_tokens.weight")
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(EngineError, match="no embed_tokens.weight and its hidden_size 32"):
        load_drafter(tmp_path, target)


def test_new_drafter_validates_vocab(target):
    with pytest.raises(EngineError, match="sorted, unique"):
        new_drafter(target.cfg, torch.tensor([3, 1, 2]), embedding=target.embed_tokens)
    cfg = ModelConfig(**{**shape_config("tiny").__dict__, "extra": {}})
    with pytest.raises(EngineError, match="feature layers"):
        new_drafter(cfg, torch.arange(4), aux_layers=(1, 2, 9))
