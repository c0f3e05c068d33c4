"""`python -m engine`: every bad input of issue 2 is one line on stderr, exit code 2, no traceback."""
import json

import pytest
import torch

from engine.__main__ import cli
from engine_cli_testing import assert_bad_input, run
from engine.loading import random_model, save_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_model(random_model("tiny"), d)
    return d


def copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_generate_from_a_directory_prints_text_and_speed(model_dir):
    r = run("generate", "--target", str(model_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "5")
    assert r.exit_code == 0, r.stderr
    assert "5 tokens (length)" in r.stderr and "tok/s" in r.stderr and "ms/token" in r.stderr


def test_generate_json_matches_the_python_api(model_dir):
    from engine.runtime import Engine

    r = run("generate", "--target", str(model_dir), "--prompt", "hi", "--max-new-tokens", "6", "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    expect = Engine.load(target=str(model_dir)).generate(list(b"hi"), 6).token_ids
    assert out["token_ids"] == expect and out["prompt_len"] == 2 and out["tok_s"] > 0


def test_bench_json_on_the_tiny_shape():
    r = run("bench", "--shape", "tiny", "--prompt-len", "4", "--new-tokens", "4", "--repeats", "1",
            "--sizes", "1,2", "--no-peer", "--no-eager", "--max-seq-len", "32", "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["forward_ms"]["eager"]) == {"1", "2"} and out["decode"]["graph"]["tok_s"] > 0
    assert out["peer_tok_s"] is None


def test_directory_without_config(tmp_path):
    assert_bad_input(run("generate", "--target", str(tmp_path), "--prompt", "x"), "no config.json")


def test_directory_without_weights(tmp_path, model_dir):
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    assert_bad_input(run("generate", "--target", str(tmp_path), "--prompt", "x"), "no *.safetensors")


def test_unsupported_architecture(tmp_path, model_dir):
    d = copy_dir(model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    assert_bad_input(run("generate", "--target", str(d), "--prompt", "x"), "unsupported model_type", "gpt2")


def test_weights_that_do_not_fit_the_config(tmp_path, model_dir):
    d = copy_dir(model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    assert_bad_input(run("generate", "--target", str(d), "--prompt", "x"), "shape", "config implies")


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_truncated_or_corrupt_safetensors(tmp_path, model_dir, damage):
    d = copy_dir(model_dir, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 16 + data[16:])
    assert_bad_input(run("generate", "--target", str(d), "--prompt", "x"), "model.safetensors", "unreadable")


def test_prompt_longer_than_the_cache():
    ids = ",".join(str(i) for i in range(40))
    assert_bad_input(run("generate", "--shape", "tiny", "--prompt-ids", ids, "--max-seq-len", "32"),
                     "40 tokens", "32")


@pytest.mark.parametrize("n", ["0", "-4"])
def test_non_positive_token_count(n):
    assert_bad_input(run("generate", "--shape", "tiny", "--prompt", "x", "--max-new-tokens", n), "--max-new-tokens",
                     "x>=1")


def test_unknown_shape_suggests_the_closest():
    assert_bad_input(run("generate", "--shape", "llama-3.1-8", "--prompt", "x"), "unknown shape",
                     "did you mean llama-3.1-8b")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_device_cuda_without_gpu():
    assert_bad_input(run("generate", "--shape", "tiny", "--prompt", "x", "--device", "cuda"), "no CUDA GPU")


@pytest.mark.parametrize("args,words", [
    (["--prompt", "x"], ["--target", "--shape"]),
    (["--shape", "tiny"], ["--prompt"]),
    (["--shape", "tiny", "--prompt-ids", "1,x"], ["--prompt-ids"]),
    (["--shape", "tiny", "--prompt", "x", "--max-new-tokens", "many"], ["--max-new-tokens"]),
    (["--shape", "tiny", "--prompt", "x", "--dtype", "int3"], ["unknown dtype"]),
    (["--shape", "tiny", "--prompt", "x", "--temperature", "-1"], ["temperature"]),
    (["--shape", "tiny", "--prompt", "x", "--bogus"], ["--bogus"]),
])
def test_bad_options_are_one_line(args, words):
    assert_bad_input(run("generate", *args), *words)


@pytest.mark.parametrize("temperature", ["1e-300", "5e-324"])
def test_a_tiny_temperature_generates_the_greedy_tokens(temperature):
    common = ["generate", "--shape", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--json"]
    greedy, tiny = run(*common), run(*common, "--temperature", temperature)
    assert greedy.exit_code == 0 and tiny.exit_code == 0, tiny.stderr
    assert json.loads(tiny.stdout)["token_ids"] == json.loads(greedy.stdout)["token_ids"]


def test_debug_shows_the_exception_instead():
    r = run("generate", "--shape", "tiny", "--prompt", "x", "--dtype", "int3", "--debug")
    assert r.exit_code != 0 and type(r.exception).__name__ == "EngineError"


def test_help_explains_the_commands():
    r = run("--help")
    assert r.exit_code == 0 and "generate" in r.stdout and "bench" in r.stdout and "Exit codes" in r.stdout
    r = run("generate", "--help")
    assert r.exit_code == 0 and "--max-new-tokens" in r.stdout and "--drafter" in r.stdout


def test_generate_and_bench_with_a_drafter(tmp_path, model_dir):
    from engine.drafter import new_drafter, save_drafter
    from engine.loading import load_model

    target = load_model(model_dir)
    save_drafter(new_drafter(target.cfg, torch.arange(target.cfg.vocab_size), seed=1), tmp_path / "drafter")
    common = ["--target", str(model_dir), "--max-seq-len", "128", "--json"]
    base = run("generate", *common, "--prompt-ids", "1,2,3", "--max-new-tokens", "20")
    spec = run("generate", *common, "--prompt-ids", "1,2,3", "--max-new-tokens", "20",
               "--drafter", str(tmp_path / "drafter"), "--steps", "3")
    assert base.exit_code == 0 and spec.exit_code == 0, spec.stderr
    b, s = json.loads(base.stdout), json.loads(spec.stdout)
    assert s["speculative"] and not b["speculative"]
    assert s["token_ids"] == b["token_ids"]  # greedy speculation reproduces the target's greedy output
    r = run("bench", *common, "--drafter", str(tmp_path / "drafter"), "--steps", "2", "--prompt-len", "4",
            "--new-tokens", "8", "--repeats", "1", "--sizes", "1,8", "--no-peer")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["spec"]["steps"] == 2 and out["decode"]["speculative"]["accept_length"] >= 1.0
    bad = run("generate", *common, "--prompt", "x", "--drafter", str(tmp_path / "missing"))
    assert_bad_input(bad, "missing")


def test_tokenizer_json_is_used_for_text(tmp_path, model_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from engine.runtime import Engine

    d = copy_dir(model_dir, tmp_path / "m")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["hello world, hello there"] * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    eng = Engine.load(target=str(d), max_seq_len=64)
    ids = eng.encode("hello world")
    assert ids == tok.encode("hello world").ids and len(ids) < len("hello world")  # merges, not bytes
    assert eng.decode(ids) == "hello world"
    r = run("generate", "--target", str(d), "--prompt", "hello world", "--max-new-tokens", "4", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["prompt_len"] == len(ids), r.stderr
    (d / "tokenizer.json").write_text("{not json")
    assert_bad_input(run("generate", "--target", str(d), "--prompt", "x"), "tokenizer.json", "unreadable")


def test_an_internal_failure_is_one_line_and_exit_3(monkeypatch):
    from engine import runtime

    def boom(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access\nCUDA kernel errors might be reported later")

    monkeypatch.setattr(runtime.Engine, "generate", boom)
    r = run("generate", "--shape", "tiny", "--prompt", "x")
    assert r.exit_code == 3 and r.stderr.count("\n") == 1 and "RuntimeError: CUDA error" in r.stderr
    assert "--debug" in r.stderr and "Traceback" not in r.output


def test_generate_bench_and_serve_share_the_model_options():
    names = {c: {p.name for p in cli.commands[c].params} for c in ("generate", "bench", "serve")}
    shared = {"target", "shape", "drafter", "device", "dtype", "max_seq_len", "cuda_graphs", "steps", "topk",
              "draft_tokens", "eager_verify", "compile_", "debug"}
    assert all(shared <= n for n in names.values()), names
    max_len = {c: next(p for p in cli.commands[c].params if p.name == "max_seq_len").default for c in names}
    assert max_len == {"generate": None, "bench": None, "serve": 2048}


@pytest.mark.parametrize("args,words", [
    (["--steps", "0"], ["--steps"]),
    (["--max-seq-len", "1"], ["--max-seq-len"]),
])
def test_bad_model_options_are_one_line(args, words):
    assert_bad_input(run("generate", "--shape", "tiny", "--prompt", "x", *args), *words)


def test_compile_reaches_the_draft_steps_and_verify(tmp_path, model_dir, monkeypatch):
    from engine.drafter import new_drafter, save_drafter
    from engine.loading import load_model

    target = load_model(model_dir)
    save_drafter(new_drafter(target.cfg, torch.arange(target.cfg.vocab_size), seed=1), tmp_path / "drafter")
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda f, **kw: compiled.append(f.__name__) or f)
    r = run("generate", "--target", str(model_dir), "--drafter", str(tmp_path / "drafter"), "--compile",
            "--max-seq-len", "64", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json")
    assert r.exit_code == 0, r.stderr
    # the drafter's phases, the verify's settle, and the target's layers one by one (`_call_impl`: regional)
    assert sorted(set(compiled)) == ["_call_impl", "build", "draft_step", "extend", "settle"]
    assert json.loads(r.stdout)["speculative"]
