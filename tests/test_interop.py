"""Interop with the ecosystem's own loaders: a drafter exported to vLLM's `speculators` format loads in speculators
and drafts the same logits there, from the target layers speculators names; a drafter in SpecForge's output layout
loads here and drafts what its weights mean.

The speculators tests need the optional extra (`pip install -e '.[interop]' && pip install --no-deps
speculators==0.9.0`, see pyproject.toml); CI installs it. SpecForge itself cannot be installed beside this project
(it pins torch 2.11 and sglang), so its layout is written here as its exporters write it (specforge 0.2.0,
export/to_sglang.py and export/to_hf.py: `model.save_pretrained` of `LlamaForCausalLMEagle3`, a transformers
LlamaConfig with `draft_vocab_size` and `eagle_config`, weights named as the module's attributes).
"""
import dataclasses
import importlib.util
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.drafter import load_drafter, new_drafter, save_drafter
from engine.errors import EngineError
from engine.interop import SPECBOOK_KEY, export_speculators
from engine.loading import load_model, random_model, save_model

pytestmark = pytest.mark.usefixtures("one_thread")
needs_speculators = pytest.mark.skipif(
    importlib.util.find_spec("speculators") is None,
    reason="speculators not installed: pip install -e '.[interop]' && pip install --no-deps speculators==0.9.0")

# 8 layers: the default feature layers (2, 4, 5) are distinct, as speculators requires; the drafter takes others,
# (1, 3, 6), so that a converter falling back to its default, or reading SGLang's ids as its own, is caught.
TARGET = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=256)
AUX = (1, 3, 6)
DRAFT_VOCAB = 96
T = 12


def perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Norm weights away from 1: with the default init, swapping two norms or dropping one changes nothing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return module


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    save_model(perturbed(random_model(TARGET, seed=1), seed=2), d)
    return d


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)


def make_drafter(target, **overrides):
    ids = torch.randperm(TARGET.vocab_size, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB].sort().values
    d = new_drafter(target.cfg, ids, embedding=target.embed_tokens, aux_layers=AUX, seed=4, **overrides)
    return perturbed(d, seed=5).eval()


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target):
    d = tmp_path_factory.mktemp("drafter")
    save_drafter(make_drafter(target), d)
    return d


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, TARGET.vocab_size, (1, T), generator=torch.Generator().manual_seed(6))


def in_target_vocab(logits: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """[..., Vd] draft logits -> [..., V] (-inf off the draft vocabulary): comparable across two d2t tables."""
    full = logits.new_full((*logits.shape[:-1], TARGET.vocab_size), float("-inf"))
    full[..., torch.arange(d2t.numel()) + d2t.long()] = logits
    return full


@torch.no_grad()
def our_logits(target, drafter, tokens) -> torch.Tensor:
    """One draft forward over the sequence: (features at p, token p+1) -> logits at p, in the target vocabulary."""
    _, feats = target(tokens, torch.arange(T), hidden_layers=drafter.aux_layers)
    logits, _ = drafter(feats[:, :-1], tokens[:, 1:], torch.arange(T - 1))
    return in_target_vocab(logits[0], drafter.d2t)


# ---- speculators (vLLM's checkpoint library) -------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory, drafter_dir, target_dir):
    """Self-contained (the target's embedding copied in): what speculators' from_pretrained loads as is."""
    return export_speculators(drafter_dir, target_dir, tmp_path_factory.mktemp("export") / "speculators",
                              include_embedding=True)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def load_speculators(path):
    from speculators.models.eagle3 import Eagle3DraftModel

    return Eagle3DraftModel.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def speculators_logits(model, hf_target, tokens) -> torch.Tensor:
    """Speculators' own draft forward (one TTT step) on features that transformers' implementation of the target
    gives for the layer ids speculators names (vLLM's convention: hidden_states[i] enters layer i)."""
    hs = hf_target(tokens, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i] for i in model.target_layer_ids], dim=-1)[:, :-1]
    captured = []
    hook = model.lm_head.register_forward_hook(lambda m, i, out: captured.append(out))
    try:
        model(feats, tokens[:, 1:], document_ids=torch.zeros(1, T - 1, dtype=torch.long),
              position_ids=torch.arange(T - 1)[None], ttt_steps=1)
    finally:
        hook.remove()
    return in_target_vocab(captured[0][0], model.d2t)


@pytest.fixture(scope="module")
def theirs(exported):
    return load_speculators(exported)


@needs_speculators
def test_exported_drafter_drafts_the_same_logits_in_speculators(exported, theirs, hf_target, target, drafter_dir,
                                                                tokens):
    ours = load_drafter(drafter_dir, target)
    assert theirs.target_layer_ids == list(AUX)
    torch.testing.assert_close(speculators_logits(theirs, hf_target, tokens), our_logits(target, ours, tokens))
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg[SPECBOOK_KEY]["sglang_eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]
    keys = set(load_file(str(exported / "model.safetensors")))
    assert {"layers.0.self_attn.q_proj.weight", "d2t", "t2d", "embed_tokens.weight"} <= keys


@needs_speculators
def test_lean_export_takes_the_embedding_from_the_verifier(drafter_dir, target_dir, hf_target, target, tokens,
                                                           tmp_path):
    # vLLM's layout for a drafter that shares the target's table: no embed_tokens. speculators 0.9.0 loses its NaN
    # placeholder for the missing table (see export_speculators), so mark it missing again and let speculators read
    # the verifier's table, as vLLM does.
    out = export_speculators(drafter_dir, target_dir, tmp_path / "lean")
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    model = load_speculators(out)
    with torch.no_grad():
        model.embed_tokens.weight.fill_(float("nan"))
    model.load_verifier_weights()
    ours = our_logits(target, load_drafter(drafter_dir, target), tokens)
    torch.testing.assert_close(speculators_logits(model, hf_target, tokens), ours)


@needs_speculators
@pytest.mark.parametrize("break_", ["d2t off by one", "sglang layer ids", "speculators default layer ids"])
def test_comparison_catches_a_wrong_vocabulary_map_or_layer_ids(exported, theirs, hf_target, target, drafter_dir,
                                                                tokens, break_):
    # the check above must fail on what a careless export gets wrong: d2t, and the layer-id convention
    model = load_speculators(exported)
    if break_ == "d2t off by one":
        model.d2t.copy_(torch.roll(model.d2t + torch.arange(DRAFT_VOCAB), 1) - torch.arange(DRAFT_VOCAB))
    elif break_ == "sglang layer ids":
        model.config.eagle_aux_hidden_state_layer_ids = [i - 1 for i in AUX]
    else:
        model.config.eagle_aux_hidden_state_layer_ids = list(TARGET.default_aux_layers())  # (2, 4, 5)
    ours = our_logits(target, load_drafter(drafter_dir, target), tokens)
    assert not torch.allclose(speculators_logits(model, hf_target, tokens), ours, atol=1e-3)


@needs_speculators
def test_export_records_the_verifier_name_and_refuses_a_full_directory(drafter_dir, target_dir, tmp_path):
    out = export_speculators(drafter_dir, target_dir, tmp_path / "a", verifier_name="org/target-model")
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
        "org/target-model"
    with pytest.raises(EngineError, match="not empty"):
        export_speculators(drafter_dir, target_dir, out)


def test_export_without_speculators_says_how_to_install(drafter_dir, target_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "speculators.convert", None)  # import fails as if absent
    with pytest.raises(EngineError, match=r"pip install .*interop"):
        export_speculators(drafter_dir, target_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_drafter_for_another_target(drafter_dir, tmp_path):
    other = tmp_path / "other"
    save_model(random_model(dataclasses.replace(TARGET, hidden_size=32, head_dim=None), seed=0), other)
    with pytest.raises(EngineError, match="hidden_size"):
        export_speculators(drafter_dir, other, tmp_path / "out")


# ---- SpecForge's output layout ---------------------------------------------------------------------------------

def write_specforge_layout(path, drafter, with_embedding: bool, **config_extra) -> None:
    """What specforge 0.2.0's exporters write: save_pretrained of LlamaForCausalLMEagle3 (config: a transformers
    LlamaConfig, which in transformers 5 keeps rope_theta only inside rope_parameters; SpecForge numbering of
    the feature layers in eagle_config) and its state dict (to_hf adds the target's embedding, to_sglang drops it)."""
    mc = drafter.cfg.model
    cfg = transformers.LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=1, num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_key_value_heads,
        rms_norm_eps=mc.rms_norm_eps, max_position_embeddings=mc.max_position_embeddings, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": mc.rope_theta})
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    cfg.draft_vocab_size = drafter.cfg.draft_vocab_size
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in drafter.aux_layers]}
    for k, v in config_extra.items():
        setattr(cfg, k, v)
    cfg.save_pretrained(path)
    src = path / "ours"
    save_drafter(drafter, src)  # our layout has SpecForge's names: take the tensors from there
    sd = load_file(str(src / "model.safetensors"))
    if with_embedding:
        sd["embed_tokens.weight"] = drafter.embedding.weight.detach().clone()
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        f.unlink()
    src.rmdir()


@pytest.mark.parametrize("with_embedding", [False, True], ids=["to_sglang", "to_hf"])
def test_specforge_layout_loads_and_drafts_what_its_weights_mean(tmp_path, target, tokens, with_embedding):
    # a RoPE base that is neither the target's nor the engine's default: a config read wrongly changes the logits
    source = make_drafter(target, rope_theta=2500.0)
    write_specforge_layout(tmp_path, source, with_embedding)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 2500.0  # transformers 5 spelling
    loaded = load_drafter(tmp_path, target)
    assert loaded.aux_layers == AUX  # SpecForge's ids [0, 2, 5] name the layers entering 1, 3, 6
    assert (loaded.embed_tokens is not None) == with_embedding
    torch.testing.assert_close(our_logits(target, loaded, tokens), our_logits(target, source, tokens))


@pytest.mark.parametrize("key,value", [("fc_norm", True), ("norm_output", False), ("norm_before_fc", True)])
def test_specforge_options_the_engine_cannot_run_are_refused(tmp_path, target, key, value):
    # each changes the draft math (SpecForge 0.2.0 LlamaForCausalLMEagle3: fc_norm adds fc_norm.{0,1,2}.weight,
    # norm_output False drops the final norm from the logits; norm_before_fc is speculators' gpt-oss variant)
    write_specforge_layout(tmp_path, make_drafter(target), False, **{key: value})
    if key == "fc_norm":
        f = tmp_path / "model.safetensors"
        sd = load_file(str(f))
        sd.update({f"fc_norm.{i}.weight": torch.ones(TARGET.hidden_size) for i in range(3)})
        save_file(sd, str(f))
    with pytest.raises(EngineError, match=f"{key}=.*not supported"):
        load_drafter(tmp_path, target)
