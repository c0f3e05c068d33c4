"""Interop with the ecosystem's own loaders: a drafter exported to vLLM's `speculators` format loads in speculators
and drafts the same logits there, from the target layers speculators names; a drafter written by SpecForge's own
exporters loads here and drafts the logits SpecForge's module computes.

Both need the optional extra and two packages installed without their dependencies (speculators pulls CUDA builds
of torchvision/torchaudio that break transformers' import on a CPU torch; SpecForge pins torch 2.11 and sglang, yet
its draft model and exporters import with this project's packages):

    pip install -e '.[interop]' && pip install --no-deps speculators==0.9.0 specforge==0.2.0

CI installs them; elsewhere these tests are skipped with that line as the reason.
"""
import dataclasses
import importlib.util
import json
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.drafter import load_drafter, new_drafter, save_drafter
from engine.errors import EngineError
from engine.interop import SPECBOOK_KEY, export_speculators
from engine.loading import load_model, random_model, save_model

pytestmark = pytest.mark.usefixtures("one_thread")
INSTALL = "pip install -e '.[interop]' && pip install --no-deps speculators==0.9.0 specforge==0.2.0"
needs_speculators = pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                                       reason=f"speculators not installed: {INSTALL}")
needs_specforge = pytest.mark.skipif(importlib.util.find_spec("specforge") is None,
                                     reason=f"specforge not installed: {INSTALL}")

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
def test_comparison_catches_a_wrong_vocabulary_map_or_layer_ids(exported, hf_target, target, drafter_dir, tokens,
                                                                break_):
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
    monkeypatch.setitem(sys.modules, "speculators.convert", None)  # import fails as if absent
    with pytest.raises(EngineError, match=r"pip install .*interop"):
        export_speculators(drafter_dir, target_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_drafter_for_another_target(drafter_dir, tmp_path):
    other = tmp_path / "other"
    save_model(random_model(dataclasses.replace(TARGET, hidden_size=32, head_dim=None), seed=0), other)
    with pytest.raises(EngineError, match="hidden_size"):
        export_speculators(drafter_dir, other, tmp_path / "out")


# ---- SpecForge's exporters ------------------------------------------------------------------------------------

# A SpecForge draft config (its configs/*.json) for TARGET: feature layers in SpecForge's numbering, [0, 2, 5] for
# the streams entering layers 1, 3, 6; a RoPE base that is neither the target's nor the engine's default, so that a
# config read wrongly changes the logits.
SPECFORGE_DRAFT = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "vocab_size": 256,
                   "draft_vocab_size": DRAFT_VOCAB, "hidden_size": 64, "intermediate_size": 80,
                   "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 256, "rope_theta": 2500.0, "tie_word_embeddings": False,
                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in AUX]}}


def specforge_model(config_path, dtype):
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    return AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(config_path)), torch_dtype=dtype).eval()


def specforge_checkpoint(tmp_path, **config_extra):
    """A SpecForge training checkpoint (training_state.pt, as its CheckpointManager writes it) of a random bf16
    drafter, and its draft config file."""
    config_path = tmp_path / "draft.json"
    config_path.write_text(json.dumps({**SPECFORGE_DRAFT, **config_extra}))
    model = specforge_model(config_path, torch.bfloat16)  # SpecForge trains and exports in bf16
    g = torch.Generator().manual_seed(7)
    ids = torch.randperm(TARGET.vocab_size, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB].sort().values
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.05 * torch.randn(p.shape, generator=g))
        model.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
        model.t2d.zero_()
        model.t2d[ids] = True
    state = {"strategy": "eagle3", "draft_state_dict": {k: v for k, v in model.state_dict().items()
                                                        if "embed" not in k}}  # as its checkpoints: no embedding
    torch.save(state, tmp_path / "training_state.pt")
    return config_path, tmp_path / "training_state.pt", state["draft_state_dict"]


@torch.no_grad()
def specforge_logits(config_path, state_dict, embedding, target, tokens) -> torch.Tensor:
    """SpecForge's own module (fp32, sdpa) on the same weights: fc, the draft layer with its causal mask, logits."""
    model = specforge_model(config_path, torch.float32)
    model.load_state_dict({**{k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()},
                           "embed_tokens.weight": embedding.float()})
    _, feats = target(tokens, torch.arange(T), hidden_layers=AUX)
    h = model.project_hidden_states(feats[:, :-1])
    mask = model.prepare_decoder_attention_mask(attention_mask=torch.ones(1, T - 1, dtype=torch.bool),
                                                hidden_states=h, batch_size=1, seq_length=T - 1,
                                                past_key_values_length=0)
    out = model.backbone(input_embeds=model.embed_input_ids(tokens[:, 1:]), hidden_states=h, cache_hidden=[[], []],
                         attention_mask=mask, position_ids=torch.arange(T - 1)[None], use_cache=False)
    return in_target_vocab(model.compute_logits(out)[0], model.d2t)


@needs_specforge
@pytest.mark.parametrize("exporter", ["to_sglang", "to_hf", "to_sglang, transformers 5 rope fields only"])
def test_specforge_export_loads_and_drafts_specforge_logits(tmp_path, target_dir, target, tokens, exporter,
                                                            monkeypatch):
    from specforge.export.to_hf import export_to_hf
    from specforge.export.to_sglang import export_to_sglang

    config_path, state_path, state_dict = specforge_checkpoint(tmp_path)
    out = tmp_path / "export"
    if exporter == "to_hf":  # ships the target's embedding (in bf16)
        export_to_hf(str(state_path), str(config_path), str(out), embedding_source=str(target_dir))
    else:
        if "rope fields only" in exporter:
            monkeypatch.setenv("SPECFORGE_DISABLE_LEGACY_ROPE_SCALING", "1")
        export_to_sglang(str(state_path), str(config_path), str(out))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert ("rope_theta" in cfg) != ("rope fields only" in exporter)  # then only rope_parameters has it

    loaded = load_drafter(out, target)
    assert loaded.aux_layers == AUX  # SpecForge's ids [0, 2, 5]
    weights = load_file(str(out / "model.safetensors"))
    assert (loaded.embed_tokens is not None) == ("embed_tokens.weight" in weights) == (exporter == "to_hf")
    embedding = weights.get("embed_tokens.weight", target.embed_tokens.weight)  # SGLang shares the target's
    torch.testing.assert_close(our_logits(target, loaded, tokens),
                               specforge_logits(config_path, state_dict, embedding, target, tokens))


@needs_specforge
@pytest.mark.parametrize("option", [{"fc_norm": True}, {"norm_output": False}])
def test_specforge_options_the_engine_cannot_run_are_refused(tmp_path, target, option):
    # each changes SpecForge's draft math: per-feature norms before fc, logits without the final norm
    from specforge.export.to_sglang import export_to_sglang

    config_path, state_path, _ = specforge_checkpoint(tmp_path, **option)
    export_to_sglang(str(state_path), str(config_path), str(tmp_path / "export"))
    key = next(iter(option))
    with pytest.raises(EngineError, match=f"{key}=.*not supported"):
        load_drafter(tmp_path / "export", target)


def test_speculators_gpt_oss_option_is_refused(tmp_path, target):
    # speculators' converter reads norm_before_fc from a research-layout config (a norm over the concatenated
    # features before fc); the engine does not implement it
    save_drafter(make_drafter(target), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "norm_before_fc": True}))
    with pytest.raises(EngineError, match="norm_before_fc=true.*not supported"):
        load_drafter(tmp_path, target)
