"""Issue 15, checkpoints and the command line: a malformed checkpoint directory or an out-of-range option is bad
input. The Python API raises EngineError with one line; `python -m engine` prints that line (naming the file and
the problem) and exits 2: no traceback, no "internal failure" exit 1, nothing allocated first.

Each case copies a tiny random-weight checkpoint written by the engine's own save path and breaks one thing."""
from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_cli_testing import assert_bad_input, run
from engine.errors import EngineError
from engine.loading import random_model, save_model
from engine.runtime import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

Edit = Callable[[Path], None]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    save_model(random_model("tiny"), d)
    return d


def broken(src: Path, dst: Path, edit: Edit) -> Path:
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def assert_refused(d: Path, *words: str) -> None:
    """The same one-line refusal from the Python API and from `python -m engine generate`."""
    with pytest.raises(EngineError) as e:
        Engine.load(target=str(d), max_seq_len=64)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert_bad_input(run("generate", "--target", str(d), "--prompt-ids", "1,2", "--max-new-tokens", "2"), *words)


# ---- config.json ----------------------------------------------------------------------------------------------

def edit_config(**fields) -> Edit:
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **fields}))
    return edit


def write(name: str, data: str | bytes) -> Edit:
    def edit(d: Path) -> None:
        (d / name).write_bytes(data.encode() if isinstance(data, str) else data)
    return edit


def replace_in_config(old: str, new: str) -> Edit:
    def edit(d: Path) -> None:
        text = (d / "config.json").read_text()
        assert old in text
        (d / "config.json").write_text(text.replace(old, new))
    return edit


LLAMA3 = dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=512, low_freq_factor=1.0,
              high_freq_factor=4.0)
CONFIG_CASES = {
    "not UTF-8": (write("config.json", b'{"model_type": "llama\xff"}'), ["UTF-8"]),
    "not JSON": (write("config.json", "{model_type: llama"), ["invalid JSON"]),
    "a list": (write("config.json", "[1, 2]"), ["JSON object"]),
    "a string": (write("config.json", '"llama"'), ["JSON object"]),
    "zero kv heads": (edit_config(num_key_value_heads=0), ["num_key_value_heads", "0"]),
    "negative hidden size": (edit_config(hidden_size=-64), ["hidden_size", "-64"]),
    "fractional layers": (edit_config(num_hidden_layers=2.5), ["num_hidden_layers", "integer", "2.5"]),
    "layers as a float": (edit_config(num_hidden_layers=4.0), ["num_hidden_layers", "integer"]),
    "layers as a bool": (edit_config(num_hidden_layers=True), ["num_hidden_layers", "integer"]),
    "layers as a string": (edit_config(num_hidden_layers="4"), ["num_hidden_layers", "integer"]),
    "int64 overflow": (edit_config(intermediate_size=2 ** 80), ["intermediate_size"]),
    "heads wider than hidden": (edit_config(num_attention_heads=128, num_key_value_heads=128, head_dim=None),
                                ["head_dim", "hidden_size 64 // num_attention_heads 128"]),
    "odd head_dim": (edit_config(head_dim=15), ["head_dim", "even"]),
    "rope_theta a string": (edit_config(rope_theta="10000"), ["rope_theta", "number"]),
    "rope_theta zero": (edit_config(rope_theta=0), ["rope_theta"]),
    "rms_norm_eps NaN": (replace_in_config('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'), ["rms_norm_eps"]),
    "rms_norm_eps Infinity": (replace_in_config('"rms_norm_eps": 1e-05', '"rms_norm_eps": Infinity'),
                              ["rms_norm_eps"]),
    "rope_scaling a list": (edit_config(rope_scaling=[1, 2]), ["rope_scaling", "object"]),
    "rope_scaling unknown type": (edit_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                                  ["rope_scaling", "dynamic"]),
    "llama3 scaling without its factors": (edit_config(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                                           ["rope_scaling", "low_freq_factor"]),
    "llama3 scaling with equal factors": (edit_config(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}),
                                          ["rope_scaling", "high_freq_factor"]),
    "rope factor a string": (edit_config(rope_scaling={**LLAMA3, "factor": "8"}), ["rope_scaling", "factor"]),
    "rope_parameters a string": (edit_config(rope_parameters="yarn"), ["rope_parameters", "object"]),
    "text_config a string": (edit_config(text_config="llama"), ["text_config", "object"]),
    "text_config with a bad field": (edit_config(text_config={"num_key_value_heads": 0}), ["num_key_value_heads"]),
    "tie_word_embeddings a string": (edit_config(tie_word_embeddings="no"), ["tie_word_embeddings", "true or false"]),
    "eos_token_id a string": (edit_config(eos_token_id="</s>"), ["eos_token_id"]),
    "eos_token_id list of strings": (edit_config(eos_token_id=["</s>"]), ["eos_token_id"]),
    "max_position_embeddings zero": (edit_config(max_position_embeddings=0), ["max_position_embeddings"]),
    # what the engine does not compute is refused, not run as SiLU and unquantized weights
    "gelu activation": (edit_config(hidden_act="gelu"), ["hidden_act", "gelu", "silu"]),
    "gelu in text_config": (edit_config(text_config={"hidden_act": "gelu_pytorch_tanh"}), ["hidden_act", "gelu"]),
    "AWQ weights": (edit_config(quantization_config={"quant_method": "awq", "bits": 4}),
                    ["quantization_config", "awq"]),
    "quantization_config a list": (edit_config(quantization_config=[8]), ["quantization_config", "object"]),
    "an integer torch_dtype": (edit_config(torch_dtype="int8"), ["torch_dtype", "int8", "floating-point"]),
    "dtype a number": (edit_config(dtype=16), ["dtype", "floating-point"]),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_malformed_config_json_is_refused(tiny_dir, tmp_path, case):
    edit, words = CONFIG_CASES[case]
    assert_refused(broken(tiny_dir, tmp_path / "m", edit), "config.json", *words)


@pytest.mark.parametrize("fields", [dict(hidden_act="silu", torch_dtype="bfloat16"), dict(hidden_act="swish"),
                                    dict(dtype="float16"), dict(torch_dtype="float64", quantization_config=None)])
def test_what_the_engine_computes_is_accepted(tiny_dir, tmp_path, fields):
    """torch_dtype is a storage hint: the engine computes in --dtype whatever it says."""
    eng = Engine.load(target=str(broken(tiny_dir, tmp_path / "m", edit_config(**fields))), max_seq_len=64)
    assert eng.generate([1, 2], 2).token_ids


def test_a_config_for_a_huge_model_is_checked_against_the_weights_before_allocating(tiny_dir, tmp_path, monkeypatch):
    # 2**20 x 2**18 float32 embeddings alone: 1 TiB. Allocating them is what the old code tried first.
    d = broken(tiny_dir, tmp_path / "m", edit_config(vocab_size=2 ** 20, hidden_size=2 ** 18))
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda *a, **k: pytest.fail("allocated the model first"))
    assert_refused(d, "has shape (512, 64), config implies (1048576, 262144)")


def test_a_config_with_more_layers_than_the_weights_is_refused_before_building(tiny_dir, tmp_path):
    d = broken(tiny_dir, tmp_path / "m", edit_config(num_hidden_layers=1_000_000))
    assert_refused(d, "num_hidden_layers", "1000000", "4 layers")


# ---- model.safetensors.index.json -----------------------------------------------------------------------------

def sharded(d: Path) -> dict[str, str]:
    """Split model.safetensors into two shards with an index, as large checkpoints come."""
    sd = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: sd[k] for k in keys}, str(d / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def edit_index(change: Callable[[dict], object]) -> Edit:
    def edit(d: Path) -> None:
        weight_map = sharded(d)
        index = {"metadata": {}, "weight_map": weight_map}
        (d / "model.safetensors.index.json").write_text(json.dumps(change(index)))
    return edit


def test_a_sharded_checkpoint_still_loads(tiny_dir, tmp_path):
    d = broken(tiny_dir, tmp_path / "m", sharded)
    want = Engine.load(target=str(tiny_dir), max_seq_len=64).generate([1, 2], 4).token_ids
    assert Engine.load(target=str(d), max_seq_len=64).generate([1, 2], 4).token_ids == want


def first_key_to(shard: str) -> Callable[[dict], dict]:
    def change(index: dict) -> dict:
        key = next(iter(index["weight_map"]))
        return {**index, "weight_map": {**index["weight_map"], key: shard}}
    return change


INDEX_CASES = {
    "not JSON": (write("model.safetensors.index.json", "{weight_map"), ["invalid JSON"]),
    "not UTF-8": (write("model.safetensors.index.json", b'{"weight_map": {"a": "\xff"}}'), ["UTF-8"]),
    "a list": (edit_index(lambda index: [index]), ["JSON object"]),
    "no weight_map": (edit_index(lambda index: {"metadata": {}}), ["weight_map"]),
    "weight_map a list": (edit_index(lambda index: {"weight_map": ["model.safetensors"]}), ["weight_map"]),
    "a shard name not a string": (edit_index(first_key_to(7)), ["weight_map"]),
    "a shard above the directory": (edit_index(first_key_to("../../model.safetensors")),
                                    ["../../model.safetensors", "outside"]),
    "an absolute shard path": (edit_index(first_key_to("/etc/passwd")), ["/etc/passwd", "outside"]),
}


@pytest.mark.parametrize("case", INDEX_CASES)
def test_malformed_index_is_refused(tiny_dir, tmp_path, case):
    edit, words = INDEX_CASES[case]
    assert_refused(broken(tiny_dir, tmp_path / "m", edit), "model.safetensors.index.json", *words)


def test_a_shard_outside_the_directory_is_never_read(tiny_dir, tmp_path):
    """The index's shard name would reach a real checkpoint one level up; it must be refused, not loaded."""
    outside = broken(tiny_dir, tmp_path / "outside", lambda d: None)
    d = broken(tiny_dir, outside / "inner", edit_index(lambda index: {
        "weight_map": {k: "../model.safetensors" for k in index["weight_map"]}}))
    for f in d.glob("model-*.safetensors"):
        f.unlink()
    assert_refused(d, "../model.safetensors", "outside")


# ---- weights ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(tiny_dir, tmp_path, value):
    def poison(d: Path) -> None:
        sd = load_file(str(d / "model.safetensors"))
        sd["model.layers.2.mlp.down_proj.weight"][3, 5] = value
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})

    assert_refused(broken(tiny_dir, tmp_path / "m", poison), "model.safetensors",
                   "model.layers.2.mlp.down_proj.weight", "NaN or infinite")




# ---- what the engine writes: atomic, with the modes of ordinary files ---------------------------------------------

@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_saved_checkpoints_get_the_modes_open_gives_and_keep_existing_ones(tmp_path, umask_027):
    """safetensors writes 0600 whatever the umask: a checkpoint saved for others to read was unreadable by them."""
    from engine.drafter import new_drafter, save_drafter

    model = random_model("tiny")
    d = save_model(model, tmp_path / "m")
    assert {f.name: mode(f) for f in d.iterdir()} == {"model.safetensors": 0o640, "config.json": 0o640}
    (d / "config.json").chmod(0o664)  # a shared checkout's group-writable file stays so
    (d / "model.safetensors").chmod(0o644)
    save_model(model, d)
    assert {f.name: mode(f) for f in d.iterdir()} == {"model.safetensors": 0o644, "config.json": 0o664}
    dd = save_drafter(new_drafter(model.cfg, torch.arange(model.cfg.vocab_size), seed=1), tmp_path / "d")
    assert {f.name: mode(f) for f in dd.iterdir()} == {"model.safetensors": 0o640, "config.json": 0o640}


def test_a_failed_save_leaves_the_old_checkpoint_and_no_temporary_file(tmp_path, monkeypatch):
    from engine import fsutil

    d = save_model(random_model("tiny", seed=1), tmp_path / "m")
    before = {f.name: f.read_bytes() for f in d.iterdir()}

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(fsutil.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        save_model(random_model("tiny", seed=2), d)
    assert {f.name: f.read_bytes() for f in d.iterdir()} == before

# ---- FP8 checkpoints (DeepSeek-V3, Kimi-K2): block-scaled float8 weights, dequantised when loaded -----------------

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def to_fp8(src: Path, dst: Path, block: tuple[int, int], seed: int = 0) -> dict[str, torch.Tensor]:
    """`src` rewritten as DeepSeek-V3 ships it: every layer's projection an FP8 matrix with a float32
    weight_scale_inv per block (a partial block at the edges where the block does not divide the shape); the
    other tensors as they were. -> the weights the FP8 checkpoint stands for, each element code * its block's scale."""
    g = torch.Generator().manual_seed(seed)
    shutil.copytree(src, dst)
    sd, want = load_file(str(dst / "model.safetensors")), {}
    for k, w in list(sd.items()):
        if ".layers." in k and k.endswith("proj.weight"):
            codes = (torch.randn(w.shape, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            rows, cols = (w.shape[0] + block[0] - 1) // block[0], (w.shape[1] + block[1] - 1) // block[1]
            scale = torch.rand(rows, cols, generator=g) * 1e-3 + 1e-4
            i, j = torch.arange(w.shape[0])[:, None] // block[0], torch.arange(w.shape[1])[None, :] // block[1]
            want[k] = codes.float() * scale[i, j]
            sd[k], sd[k.removesuffix("weight") + "weight_scale_inv"] = codes, scale
        else:
            want[k] = w
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    edit_config(quantization_config={**FP8_CONFIG, "weight_block_size": list(block)})(dst)
    return want


@pytest.mark.parametrize("shape,block", [("tiny", (128, 128)), ("tiny", (48, 40)), ("deepseek-v3-tiny", (128, 96))])
def test_an_fp8_checkpoint_loads_its_dequantised_weights(tmp_path, shape, block):
    from engine.loading import hf_state_dict, load_model

    src = tmp_path / "src"
    save_model(random_model(shape, seed=2), src)
    want = to_fp8(src, tmp_path / "fp8", block)
    got = hf_state_dict(load_model(tmp_path / "fp8"))
    assert got.keys() == want.keys()
    for k, w in want.items():
        assert torch.equal(got[k], w), k
    # and it runs: the same tokens as the unquantized checkpoint of those weights
    plain = tmp_path / "plain"
    shutil.copytree(src, plain)
    save_file(want, str(plain / "model.safetensors"), metadata={"format": "pt"})
    run_ids = ["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--max-seq-len", "32", "--json"]
    a, b = run(*run_ids, "--target", str(tmp_path / "fp8")), run(*run_ids, "--target", str(plain))
    assert a.exit_code == 0 and b.exit_code == 0, a.stderr
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


def fp8_edit(edit: Callable[[dict[str, torch.Tensor], Path], None]) -> Edit:
    def apply(d: Path) -> None:
        shutil.rmtree(d)
        to_fp8(d.parent / "src", d, (32, 32))
        sd = load_file(str(d / "model.safetensors"))
        edit(sd, d)
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return apply


SCALE = "model.layers.1.mlp.down_proj.weight_scale_inv"
FP8_CASES = {
    "no quantization_config": (fp8_edit(lambda sd, d: edit_config(quantization_config=None)(d)),
                               ["float8_e4m3fn", "quantization_config"]),
    "a missing scale": (fp8_edit(lambda sd, d: sd.pop(SCALE)), ["model.layers.1.mlp.down_proj.weight", SCALE]),
    "a scale of the wrong shape": (fp8_edit(lambda sd, d: sd.update({SCALE: torch.ones(1, 1)})),
                                   [SCALE, "(1, 1)", "32x32", "(2, 4)"]),
    "a scale without its FP8 weight": (
        fp8_edit(lambda sd, d: sd.update({"model.layers.0.input_layernorm.weight_scale_inv": torch.ones(1, 2)})),
        ["model.layers.0.input_layernorm.weight_scale_inv", "scales no FP8 weight"]),
    "an infinite scale": (fp8_edit(lambda sd, d: sd[SCALE].fill_(float("inf"))), [SCALE, "NaN or infinite"]),
    "a NaN code": (fp8_edit(lambda sd, d: sd["model.layers.1.mlp.down_proj.weight"].view(torch.uint8).__setitem__(
        (0, 0), 0x7F)), ["model.layers.1.mlp.down_proj.weight", "NaN or infinite"]),
    "fp8 without blocks": (edit_config(quantization_config={**FP8_CONFIG, "weight_block_size": None}),
                           ["quantization_config", "weight_block_size"]),
    "fp8 static activations": (
        edit_config(quantization_config={**FP8_CONFIG, "activation_scheme": "static", "weight_block_size": [8, 8]}),
        ["quantization_config", "static"]),
}


@pytest.mark.parametrize("case", FP8_CASES)
def test_a_malformed_fp8_checkpoint_is_refused(tiny_dir, tmp_path, case):
    edit, words = FP8_CASES[case]
    shutil.copytree(tiny_dir, tmp_path / "src")
    assert_refused(broken(tiny_dir, tmp_path / "m", edit), *words)

# ---- EAGLE-3 drafter directories (the same validator and loaders) --------------------------------------------

@pytest.fixture(scope="module")
def drafter_dir(tiny_dir, tmp_path_factory) -> Path:
    from engine.drafter import new_drafter, save_drafter
    from engine.loading import load_model

    target = load_model(tiny_dir)
    return save_drafter(new_drafter(target.cfg, torch.arange(target.cfg.vocab_size), seed=1),
                        tmp_path_factory.mktemp("drafter") / "d")


def poison_first_float(d: Path) -> None:
    sd = load_file(str(d / "model.safetensors"))
    name = next(k for k, t in sorted(sd.items()) if t.is_floating_point())
    sd[name].view(-1)[0] = float("nan")
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


DRAFTER_CASES = {
    "aux layer ids not integers": (edit_config(eagle_config={"eagle_aux_hidden_state_layer_ids": ["a", "b", "c"]}),
                                   ["config.json", "eagle_aux_hidden_state_layer_ids"]),
    "eagle_config a list": (edit_config(eagle_config=[1]), ["config.json", "eagle_config", "object"]),
    "draft_vocab_size a string": (edit_config(draft_vocab_size="512"), ["config.json", "draft_vocab_size"]),
    "architectures a string": (edit_config(architectures="LlamaForCausalLMEagle3"), ["config.json", "architectures"]),
    "rms_norm_eps NaN": (replace_in_config('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'),
                         ["config.json", "rms_norm_eps"]),
    "NaN weights": (poison_first_float, ["model.safetensors", "NaN or infinite"]),
}


@pytest.mark.parametrize("case", DRAFTER_CASES)
def test_malformed_drafter_is_refused(tiny_dir, drafter_dir, tmp_path, case):
    edit, words = DRAFTER_CASES[case]
    d = broken(drafter_dir, tmp_path / "d", edit)
    with pytest.raises(EngineError) as e:
        Engine.load(target=str(tiny_dir), drafter=str(d), max_seq_len=64)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    assert_bad_input(run("generate", "--target", str(tiny_dir), "--drafter", str(d), "--prompt-ids", "1,2",
                         "--max-new-tokens", "2"), *words)


# ---- tokenizer_config.json and chat templates -------------------------------------------------------------------

TOKENIZER_CASES = {
    "not JSON": (write("tokenizer_config.json", "{chat_template"), ["tokenizer_config.json", "invalid JSON"]),
    "not UTF-8": (write("tokenizer_config.json", b'{"bos_token": "\xff"}'), ["tokenizer_config.json", "UTF-8"]),
    "a list": (write("tokenizer_config.json", "[]"), ["tokenizer_config.json", "JSON object"]),
    "template not a string": (write("tokenizer_config.json", '{"chat_template": 5}'),
                              ["tokenizer_config.json", "chat_template"]),
    "template syntax error": (write("tokenizer_config.json", json.dumps(
        {"chat_template": "{% for m in messages %}{{ m.content }}"})), ["tokenizer_config.json", "chat template",
                                                                        "line 1"]),
    "named template syntax error": (write("tokenizer_config.json", json.dumps(
        {"chat_template": [{"name": "default", "template": "{{ messages[0].content }"}]})),
        ["tokenizer_config.json", "chat template 'default'"]),
    "jinja file syntax error": (write("chat_template.jinja", "{% if messages %}hi"), ["chat_template.jinja",
                                                                                     "chat template"]),
    "jinja file not UTF-8": (write("chat_template.jinja", b"{{ messages \xff }}"), ["chat_template.jinja", "UTF-8"]),
}


@pytest.mark.parametrize("case", TOKENIZER_CASES)
def test_malformed_tokenizer_config_or_chat_template_is_refused(tiny_dir, tmp_path, case):
    edit, words = TOKENIZER_CASES[case]
    assert_refused(broken(tiny_dir, tmp_path / "m", edit), *words)


def test_a_valid_chat_template_loads(tiny_dir, tmp_path):
    from engine.loading import read_chat_template

    tpl = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    d = broken(tiny_dir, tmp_path / "m", write("tokenizer_config.json", json.dumps({"chat_template": tpl})))
    assert read_chat_template(d) == tpl
    assert Engine.load(target=str(d), max_seq_len=64).generate([1, 2], 2).token_ids


# ---- options of python -m engine ---------------------------------------------------------------------------------

GENERATE = ("generate", "--shape", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "2")


@pytest.mark.parametrize("args,option", [
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--temperature", "-inf"], "--temperature"),
    (["--top-p", "nan"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-1"], "--top-k"),
    (["--seed", str(2 ** 80)], "--seed"),
    (["--seed", str(-2 ** 63 - 1)], "--seed"),
    (["--max-seq-len", "1e9"], "--max-seq-len"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--steps", "0"], "--steps"),
    (["--prompt-ids", "99999999999999999999999"], "--prompt-ids"),
    (["--prompt-ids", "1,-2"], "--prompt-ids"),
])
def test_generate_options_out_of_range(args, option):
    assert_bad_input(run(*GENERATE, *args), option)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_temperature_from_the_python_api(value):
    eng = Engine.load(shape="tiny", max_seq_len=32)
    with pytest.raises(EngineError, match="temperature"):
        eng.generate([1, 2], 2, temperature=value)


def test_a_seed_beyond_64_bits_from_the_python_api():
    with pytest.raises(EngineError, match="seed"):
        Engine.load(shape="tiny", max_seq_len=32, seed=2 ** 80)
    eng = Engine.load(shape="tiny", max_seq_len=32)
    for call in (eng.generate, lambda *a, **k: list(eng.stream(*a, **k))):
        with pytest.raises(EngineError, match="seed"):
            call([1, 2], 2, seed=2 ** 64)
    assert eng.generate([1, 2], 2, seed=2 ** 64 - 1).token_ids  # the largest seed torch takes


def test_a_cache_larger_than_the_device_is_refused_before_allocating(monkeypatch):
    from engine import loading

    monkeypatch.setattr(loading, "device_memory_bytes", lambda device: 64 << 30)
    assert_bad_input(run(*GENERATE, "--max-seq-len", str(10 ** 9)), "--max-seq-len", "1000000000", "GB")
    with pytest.raises(EngineError, match="max_seq_len 1000000000"):
        Engine.load(shape="tiny", max_seq_len=10 ** 9)
    assert Engine.load(shape="tiny", max_seq_len=4096).max_seq_len == 4096  # a cache that fits still loads


@pytest.mark.parametrize("args,option", [
    (["--repeats", "0"], "--repeats"),
    (["--prompt-len", "0"], "--prompt-len"),
    (["--new-tokens", "-1"], "--new-tokens"),
    (["--sizes", "0,4"], "--sizes"),
    (["--seed", str(2 ** 64)], "--seed"),
])
def test_bench_options_out_of_range(args, option, monkeypatch):
    from engine import bench

    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("benchmarked bad options"))
    assert_bad_input(run("bench", "--shape", "tiny", "--no-peer", *args), option)


@pytest.mark.parametrize("args,option", [
    (["targets", "OUT", "--steps-a", "-1"], "--steps-a"),
    (["targets", "OUT", "--steps-b", "0"], "--steps-b"),
    (["targets", "OUT", "--family", "gpt2"], "--family"),
    (["targets", "OUT", "--preset", "tpu"], "--preset"),
    (["drafter", "OUT", "--target", "T", "--steps", "0"], "--steps"),
    (["drafter", "OUT", "--target", "T", "--samples", "-5"], "--samples"),
    (["drafter", "OUT", "--target", "T", "--eval-prompts", "-1"], "--eval-prompts"),
    (["drafter", "OUT", "--target", "T", "--mix", "C"], "--mix"),
])
def test_train_options_out_of_range(args, option, monkeypatch, tmp_path):
    from engine.train import drafter, target

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(target, "train_targets", lambda *a, **k: pytest.fail("trained with bad options"))
    monkeypatch.setattr(drafter, "train_drafter", lambda *a, **k: pytest.fail("trained with bad options"))
    assert_bad_input(run("train", *args), option)
