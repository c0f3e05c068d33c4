"""The engine's Transformer against transformers' own implementations, fp32 on CPU: logits over a chunked
prefill, single-token decodes and a tree-shaped chunk with an explicit mask; greedy generation; sharded loading."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.loading import load_model, random_model, save_model, transformers_twin
from engine.target_decoder import TargetDecoder

TOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=256)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)  # short, so that the scaling changes positions we use
FAMILIES = {
    "llama3-untied": dict(model_type="llama", rope_scaling=LLAMA3_ROPE),
    "llama3-tied": dict(model_type="llama", rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
    "qwen2-bias": dict(model_type="qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen3-qknorm": dict(model_type="qwen3", head_dim=32),
    "mistral": dict(model_type="mistral", num_key_value_heads=1),
}


def perturbed_model(cfg: ModelConfig, seed: int = 0):
    """Random weights with non-trivial norms and biases (the default init makes them 1 and 0, hiding bugs)."""
    model = random_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(ours loaded back from an HF directory, transformers' model from the same directory)."""
    cfg = ModelConfig(**{**SMALL, **FAMILIES[request.param]})
    d = tmp_path_factory.mktemp(request.param)
    save_model(perturbed_model(cfg), d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return load_model(d), hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_transformers_twin_is_the_checkpoint_transformers_loads(pair):
    """bench's peer is built in memory; it must be the very model from_pretrained gives: same class, same logits."""
    ours, hf = pair
    twin = transformers_twin(ours)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    assert type(twin) is type(hf)
    assert torch.equal(hf_logits(twin, ids), hf_logits(hf, ids))


def test_logits_match_transformers_over_prefill_decode_and_masked_chunk(pair):
    ours, hf = pair
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids[:36])
    ours.setup_caches(64)
    with torch.no_grad():
        got = [ours(torch.tensor([ids[0:12]]), torch.arange(0, 12))[0][0],  # prefill in two chunks
               ours(torch.tensor([ids[12:30]]), torch.arange(12, 30))[0][0]]
        for t in range(30, 36):  # single-token decodes
            got.append(ours(torch.tensor([[ids[t]]]), torch.tensor([t]))[0][0])
        assert (torch.cat(got) - ref).abs().max().item() < TOL
        # A tree chunk at slots 36..39: a; b and c children of a; d child of c. Positions are 36 + depth.
        a, b, c, d = ids[36:40]
        mask = ours.slot_ids[None, :] < 36
        mask = mask.repeat(4, 1)
        for row, visible in enumerate(([36], [36, 37], [36, 38], [36, 38, 39])):
            mask[row, visible] = True
        logits, _ = ours(torch.tensor([[a, b, c, d]]), torch.tensor([36, 37, 37, 38]),
                         cache_slots=torch.arange(36, 40), attn_mask=mask)
    prefix = ids[:36]
    for row, path in enumerate(([a], [a, b], [a, c], [a, c, d])):
        expect = hf_logits(hf, prefix + path)[-1]
        assert (logits[0, row] - expect).abs().max().item() < TOL, f"tree node {row}"
    ours.drop_caches()


def test_greedy_generation_matches_transformers_generate(pair):
    ours, hf = pair
    prompt = [3, 17, 99, 4, 250, 8]
    n = 64
    expect = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(prompt):]
    got = TargetDecoder(ours, 128, prefill_chunk=4).generate(prompt, n)
    assert got.token_ids == expect.tolist()
    assert len(got.token_ids) == n
    ours.drop_caches()


def test_sharded_safetensors_with_index_load_like_one_file(tmp_path):
    cfg = ModelConfig(**{**SMALL, **FAMILIES["qwen2-bias"]})
    save_model(perturbed_model(cfg, seed=5), tmp_path / "one")
    sd = load_file(str(tmp_path / "one" / "model.safetensors"))
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    keys = sorted(sd)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, str(shard / name))
        weight_map.update({k: name for k in part})
    (shard / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids, pos = torch.tensor([[5, 6, 7, 8]]), torch.arange(4)
    with torch.no_grad():
        one, _ = load_model(tmp_path / "one")(ids, pos)
        two, _ = load_model(shard)(ids, pos)
    assert torch.equal(one, two)
