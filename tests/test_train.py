"""engine.train: corpus, tokenizer, resumable training loop, target and drafter training, training-time test.

Everything runs on a synthetic corpus of a few hundred small Python files and models of a few thousand
parameters, so the whole file takes seconds on 2 CPU cores."""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.drafter import new_drafter, save_drafter
from engine.errors import EngineError
from engine.loading import load_model, random_model
from engine.train import corpus, loop
from engine.train.data import random_windows
from engine.train import drafter as D
from engine.train.presets import DrafterRun, TargetRun, target_config, with_overrides, get_preset
from engine.train.layout import DrafterOutputs, TargetOutputs, trained_pair_dirs
from engine.train.target import train_target, train_targets
from engine.train.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

from corpus_testing import make_archives


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A synthetic corpus patched in as the machine's corpus, a tokenizer, and a briefly trained tiny target."""
    root = tmp_path_factory.mktemp("world")
    roots = make_archives(root / "src")
    mp = pytest.MonkeyPatch()
    files = corpus.scan(roots)
    mp.setattr(corpus, "scan", lambda sources=None: files)
    tok = train_tokenizer(corpus.texts("A", "train", 10**9), 300)
    tok_dir = save_tokenizer(tok, root / "tok")
    cfg = tiny_config(tok.get_vocab_size())
    run = TargetRun(mix="A", steps=40, lr=1e-2, warmup=4, batch_size=8, seq_len=32, data_bytes=10**9,
                    ckpt_every=10)
    torch.manual_seed(0)
    target = train_target(root / "target", run, tok_dir, cfg)
    yield dict(root=root, roots=roots, tok=tok, tok_dir=tok_dir, cfg=cfg, run=run, target=target)
    mp.undo()


def tiny_config(vocab: int, family: str = "llama") -> ModelConfig:
    preset = dataclasses.replace(get_preset("cpu"), model=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=256, rope_theta=10000.0))
    return target_config(preset, family, vocab_size=vocab)


# ---- tokenizer --------------------------------------------------------------------------------------------------

def test_tokenizer_round_trip_and_transformers_load(world, tmp_path):
    from transformers import AutoTokenizer

    text = corpus.prompts(1, chars=300)[0] + "    émoji ✓ and tabs\t\n"
    tok = load_tokenizer(world["tok_dir"])
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 1.5  # BPE merges actually compress
    assert AutoTokenizer.from_pretrained(str(world["tok_dir"]))(text)["input_ids"] == ids
    with pytest.raises(EngineError, match="empty corpus"):
        train_tokenizer([], 300)


# ---- training ---------------------------------------------------------------------------------------------------

def test_target_training_lowers_loss_and_saves_an_engine_and_hf_checkpoint(world):
    r = world["target"]
    loss = r.log.history["loss"]
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 1.0
    assert r.val_loss < loss[0]
    assert not (r.path / loop.STATE).exists() and (r.path / loop.LOG).is_file()
    model = load_model(r.path)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(r.path)).eval()
    x = torch.tensor([world["tok"].encode("def alpha_beta_0(alpha):\n").ids])
    ours, _ = model(x, torch.arange(x.shape[1]))
    torch.testing.assert_close(ours, hf(x).logits.float(), atol=1e-4, rtol=1e-4)


def test_train_targets_writes_the_layout_that_downstream_runbooks_read(world, tmp_path):
    """The runbooks after train-target find its models through TargetOutputs only."""
    preset = dataclasses.replace(get_preset("cpu"), vocab_size=300, tokenizer_bytes=10**6, model=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rope_theta=10000.0))
    run = TargetRun(mix="A", steps=2, lr=1e-2, warmup=1, batch_size=2, seq_len=16, data_bytes=10**9)
    a, b = train_targets(str(tmp_path), preset, a=run, b=dataclasses.replace(run, mix="B"))
    out = TargetOutputs(str(tmp_path))  # `upstream` hands runbooks a str
    assert (a.path, b.path) == (out.target_a, out.target_b) == (tmp_path / "target-a", tmp_path / "target-b")
    assert out.tokenizer == tmp_path / "tokenizer"
    vocab = load_tokenizer(out.tokenizer).get_vocab()
    assert load_tokenizer(out.target_a).get_vocab() == load_tokenizer(out.target_b).get_vocab() == vocab
    assert load_model(out.target_b).cfg.vocab_size == len(vocab)
    assert DrafterOutputs(str(tmp_path)).drafter_a == tmp_path / "drafter-a"


def test_trained_pair_dirs_picks_the_given_dirs_else_the_upstream_layout(tmp_path):
    """tree-sweep and baseline-eagle3 measure target A + drafter A from two different upstream roots, unless given
    directories; with neither for a side they refuse, naming both ways."""
    up = {"train-target": str(tmp_path / "t"), "train-drafter": str(tmp_path / "d")}  # `upstream` hands over strs
    assert trained_pair_dirs("", "", up) == (tmp_path / "t" / "target-a", tmp_path / "d" / "drafter-a")
    assert trained_pair_dirs("x/tgt", "", up) == (Path("x/tgt"), tmp_path / "d" / "drafter-a")
    assert trained_pair_dirs("", "x/dft", up) == (tmp_path / "t" / "target-a", Path("x/dft"))
    assert trained_pair_dirs("x/tgt", "x/dft", {}) == (Path("x/tgt"), Path("x/dft"))
    for target, drafter, upstream in (("", "", {}), ("x/tgt", "", {"train-target": "t"}),
                                      ("", "x/dft", {"train-drafter": "d"})):
        with pytest.raises(ValueError, match=r"^give -p target=DIR -p drafter=DIR, or run through `runbook run` so "
                                             r"the upstream models arrive$"):
            trained_pair_dirs(target, drafter, upstream)


def test_finished_run_is_reused_and_other_parameters_refused(world):
    w = world
    again = train_target(w["target"].path, w["run"], w["tok_dir"], w["cfg"])
    assert again.log.history == w["target"].log.history
    with pytest.raises(EngineError, match=r"other parameters \(run.lr: 0.01 -> 0.005\)"):
        train_target(w["target"].path, with_overrides(w["run"], lr=5e-3), w["tok_dir"], w["cfg"])


def test_deepseek_family_trains_through_the_same_path(world, tmp_path):
    cfg = tiny_config(world["tok"].get_vocab_size(), "deepseek_v3")
    run = dataclasses.replace(world["run"], steps=12)
    r = train_target(tmp_path / "ds", run, world["tok_dir"], cfg)
    loss = r.log.history["loss"]
    assert sum(loss[-3:]) < sum(loss[:3])
    assert load_model(r.path).cfg.model_type == "deepseek_v3"
    d = D.train_drafter(tmp_path / "d", drafter_run(steps=3), r.path)  # EAGLE-3 features from an MLA target
    assert len(d.log.history["loss"]) == 3 and all(map(math.isfinite, d.log.history["loss"]))


def test_resume_with_other_parameters_is_refused(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters())
    sched = loop.Schedule(steps=4, lr=0.1, warmup=1, ckpt_every=2)
    step = lambda s: ((model(torch.ones(2, 4)) ** 2).mean(), {})  # noqa: E731
    loop.train(tmp_path, {"lr": 0.1}, model, opt, sched, step, "t")
    assert torch.load(tmp_path / loop.STATE, weights_only=True)["step"] == 2
    with pytest.raises(EngineError, match=r"other parameters \(lr: 0.1 -> 0.2\)"):
        loop.train(tmp_path, {"lr": 0.2}, model, opt, sched, step, "t")


def test_every_step_runs_with_deterministic_kernels_and_the_setting_is_restored(tmp_path):
    """GPU runs reproduce only with deterministic kernels in forward, backward and optimizer step; outside training
    (evaluation, the caller's code) the caller's setting holds."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters())
    seen = []

    def step(s):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return (model(torch.ones(2, 4)) ** 2).mean(), {}

    def grad_hook(grad):
        seen.append(torch.are_deterministic_algorithms_enabled())  # the backward too
        return grad

    model.weight.register_hook(grad_hook)
    assert not torch.are_deterministic_algorithms_enabled()
    first = loop.train(tmp_path, {}, model, opt, loop.Schedule(steps=3, lr=0.1, warmup=1), step, "t",
                       eval_fn=lambda: {"outside": float(torch.are_deterministic_algorithms_enabled())}, eval_every=3)
    log = loop.train(tmp_path / "again", {}, model, opt, loop.Schedule(steps=1, lr=0.1, warmup=1), step, "t")
    assert seen == [True] * 8 and len(log.history["loss"]) == 1 and first.evals == [{"step": 3, "outside": 0.0}]
    assert not torch.are_deterministic_algorithms_enabled()


def test_disk_full_during_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters())
    log = loop.TrainLog({"p": 1}, {"loss": [1.0]})
    loop.save_state(tmp_path, 3, model, opt, log)
    before = (tmp_path / loop.STATE).read_bytes()

    def full_disk(obj, f):
        Path(f).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(EngineError, match=r"disk full while writing .*train-state.pt; the previous one is intact"):
        loop.save_state(tmp_path, 4, model, opt, log)
    assert (tmp_path / loop.STATE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [loop.STATE]


RESUME_SCRIPT = """
import sys, torch
from pathlib import Path
from engine.train import corpus
from engine.train.presets import TargetRun
from engine.train.target import train_target
sys.path.insert(0, {tests!r})
from test_train import tiny_config
torch.set_num_threads(1)
files = corpus.scan(tuple((g, tuple(Path(p) for p in ps)) for g, ps in {roots!r}))
corpus.scan = lambda sources=None: files
run = TargetRun(mix="A", steps=200, lr=1e-2, warmup=4, batch_size=4, seq_len=32, data_bytes=10**9, ckpt_every=5)
train_target(sys.argv[1], run, {tok!r}, tiny_config({vocab}))
"""


def test_resume_after_sigkill_ends_in_the_same_state(world, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RESUME_SCRIPT.format(tests=str(Path(__file__).parent), roots=tuple((g, tuple(map(str, ps))) for g, ps in world["roots"]),
                                           tok=str(world["tok_dir"]), vocab=world["tok"].get_vocab_size()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = lambda out: [sys.executable, str(script), str(out)]  # noqa: E731
    killed = tmp_path / "killed"
    proc = subprocess.Popen(cmd(killed), env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / loop.STATE).exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step = torch.load(killed / loop.STATE, weights_only=True)["step"]
    assert 0 < step < 200, "the run was not killed mid-way"
    for out in (killed, tmp_path / "straight"):
        subprocess.run(cmd(out), env=env, check=True, stderr=subprocess.DEVNULL)
    a, b = load_file(killed / "model.safetensors"), load_file(tmp_path / "straight" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logs = [json.loads((d / loop.LOG).read_text())["history"] for d in (killed, tmp_path / "straight")]
    assert logs[0] == logs[1] and len(logs[0]["loss"]) == 200


# ---- drafter: training-time test --------------------------------------------------------------------------------

def test_ttt_mask_on_a_tiny_example():
    m = D.ttt_mask(3, 2).int().tolist()
    assert m == [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                 [1, 1, 0, 0, 1, 0, 0, 1, 0],
                 [1, 1, 1, 0, 0, 1, 0, 0, 1]]


def masked_ttt_attention(q, k, v, mask=None):
    """The masked form of step j's attention: split_kv over the steps' keys and values concatenated, with
    ttt_mask (what training computed before ttt_attention)."""
    from engine.model import split_kv

    return split_kv(q, torch.cat(k, dim=2), torch.cat(v, dim=2), D.ttt_mask(q.shape[2], len(k) - 1))


@pytest.mark.parametrize("heads,kv", [(4, 2), (3, 3)])
@pytest.mark.parametrize("j", [0, 1, 3])
def test_ttt_attention_equals_the_masked_form_forward_and_backward(heads, kv, j):
    g = torch.Generator().manual_seed(j)
    B, T, Dh = 2, 7, 8
    leaves = [torch.randn(B, h, T, Dh, generator=g).requires_grad_() for h in [heads] + [kv] * (2 * j + 2)]
    w = torch.randn(B, heads, T, Dh, generator=g)  # weights every output element differently in the loss
    grads = []
    for attend in (D.ttt_attention, masked_ttt_attention):
        out = attend(leaves[0], leaves[1:j + 2], leaves[j + 2:])
        grads.append((out, torch.autograd.grad((out * w).sum(), leaves)))
    (got, got_grads), (want, want_grads) = grads
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):  # q, then k_0..k_j, then v_0..v_j
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(EngineError, match="no mask"):
        D.ttt_attention(leaves[0], leaves[1:j + 2], leaves[j + 2:], D.ttt_mask(T, j))


def test_ttt_loss_and_gradients_equal_the_masked_path(monkeypatch):
    """The whole training-time test of a tiny GQA drafter (4 query heads, 2 KV heads) through ttt_attention gives
    the loss, accuracies and gradients of the masked form; the module's own attention is restored after."""
    torch.manual_seed(0)
    target = random_model(tiny_config(64), seed=1)
    drafter = new_drafter(target.cfg, torch.arange(0, 64, 2), target.embed_tokens, seed=2)
    own = drafter.midlayer.self_attn.attend
    x = torch.randint(0, 64, (2, 12))
    tg = D.target_outputs(target, drafter, x)
    params = [p for p in drafter.parameters() if p.requires_grad]
    results = []
    for attend in (D.ttt_attention, masked_ttt_attention):
        monkeypatch.setattr(D, "ttt_attention", attend)  # what unrolled() swaps in
        loss, accs = D.ttt_loss(drafter, x, tg, 4, 0.8)
        results.append((loss, accs, torch.autograd.grad(loss, params)))
        assert drafter.midlayer.self_attn.attend is own and drafter.midlayer.self_attn.cache is None
    (loss, accs, grads), (ref_loss, ref_accs, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert accs == ref_accs
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_kl_term_at_a_temperature_adds_to_the_loss_and_trains_the_tempered_distribution():
    """Off unless asked; on, T**2 * KL(p_T || q_T) per step, which a few optimizer steps lower."""
    torch.manual_seed(0)
    target = random_model(tiny_config(64), seed=1)
    drafter = new_drafter(target.cfg, torch.arange(0, 64, 2), target.embed_tokens, seed=2)
    x = torch.randint(0, 64, (2, 12))
    plain, tempered = D.target_outputs(target, drafter, x), D.target_outputs(target, drafter, x, 0.7)
    assert plain.tempered is None
    with pytest.raises(EngineError, match="tempered"):
        D.ttt_loss(drafter, x, plain, 3, 0.8, 0.7)

    def kl_part() -> float:
        with torch.no_grad():
            return float(D.ttt_loss(drafter, x, tempered, 3, 0.8, 0.7)[0] - D.ttt_loss(drafter, x, plain, 3, 0.8)[0])

    before = kl_part()
    assert before > 0.01
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(15):
        opt.zero_grad()
        D.ttt_loss(drafter, x, tempered, 3, 0.8, 0.7)[0].backward()
        opt.step()
    assert kl_part() < before / 2


def test_ttt_steps_equal_sequential_drafting_with_the_kv_cache():
    """Unrolled step j at base t gives exactly the logits the inference path gives for draft step j+1 after
    extending positions 0..t with target features (tokens teacher-forced)."""
    torch.manual_seed(0)
    target = random_model(tiny_config(64), seed=1)
    drafter = new_drafter(target.cfg, torch.arange(0, 64, 2), target.embed_tokens, seed=2)
    x = torch.randint(0, 64, (1, 10))
    _, feats = target(x, torch.arange(10), hidden_layers=drafter.aux_layers)
    with torch.no_grad():
        unrolled = list(D.ttt_logits(drafter, x, feats, 4))
        for t in (0, 3, 5):
            drafter.setup_caches(16)
            logits, out = drafter(feats[:, :t + 1], x[:, 1:t + 2], torch.arange(t + 1))
            torch.testing.assert_close(logits[0, -1], unrolled[0][0, t])
            for j in range(1, 4):
                logits, out = drafter(out[:, -1:], x[:, t + j + 1:t + j + 2], torch.tensor([t + j]))
                torch.testing.assert_close(logits[0, -1], unrolled[j][0, t], atol=1e-5, rtol=1e-5)
            drafter.drop_caches()


def drafter_run(**kw) -> DrafterRun:
    return DrafterRun(**{**dict(mix="A", steps=30, lr=3e-3, warmup=3, batch_size=4, seq_len=32, data_bytes=10**9,
                                draft_vocab_size=200, samples=64, regen_tokens=12, regen_batch=16, ttt_steps=3,
                                ckpt_every=10), **kw})


def sensitive_model(cfg: ModelConfig, device: str = "cpu", dtype: str = "float32"):
    model = random_model(cfg, device, dtype, seed=3)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if w.dim() > 1 and "embed" not in name:
                w.mul_(8)
    return model


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("regen_tokens", [1, 2, 9])  # 1 and 2: too short for a capture's two warm-up steps
def test_regeneration_continues_each_window_with_the_targets_greedy_answer(world, family, regen_tokens):
    """Each row: regenerate's seeded corpus window, then the target's own greedy answer as the engine's decoder
    gives it one sequence at a time, also for the last, smaller batch. Random weights, scaled up so that every
    token and position moves the argmax (at N(0, 0.02) a tiny model's answer hardly depends on its input)."""
    from engine.target_decoder import TargetDecoder

    target = sensitive_model(tiny_config(world["tok"].get_vocab_size(), family))
    stream = torch.randint(0, target.cfg.vocab_size, (4000,), generator=torch.Generator().manual_seed(0))
    run = drafter_run(samples=5, seq_len=20, regen_tokens=regen_tokens, regen_batch=2)
    prompt_len = run.seq_len - regen_tokens
    seqs = D.regenerate(target, stream, run)
    assert torch.equal(seqs[:, :prompt_len],
                       random_windows(stream, run.samples, prompt_len, torch.Generator().manual_seed(run.seed)))
    assert len({tuple(r) for r in seqs[:, prompt_len:].tolist()}) > 1  # rows of their own, not one loop
    for row in seqs:
        got = TargetDecoder(target, 64, cuda_graphs=False).generate(row[:prompt_len].tolist(), regen_tokens)
        target.drop_caches()
        assert got.token_ids == row[prompt_len:].tolist()
    with pytest.raises(EngineError, match="new_tokens"):
        D.greedy_continue(target, seqs[:1, :4], 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_captured_regeneration_equals_the_eager_one_on_cuda(world, family):
    target = sensitive_model(tiny_config(world["tok"].get_vocab_size(), family), "cuda", "bfloat16")
    stream = torch.randint(0, target.cfg.vocab_size, (4000,), generator=torch.Generator().manual_seed(0))
    run = drafter_run(samples=6, seq_len=40, regen_tokens=16, regen_batch=4)
    assert torch.equal(D.regenerate(target, stream, run), D.regenerate(target, stream, run, cuda_graphs=False))


def test_drafter_training_lowers_loss_and_saves_the_published_format(world, tmp_path):
    r = D.train_drafter(tmp_path / "d", drafter_run(), world["target"].path)
    loss = r.log.history["loss"]
    assert sum(loss[-5:]) < sum(loss[:5])
    cfg = json.loads((r.path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 200 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    keys = set(load_file(r.path / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "d2t", "t2d", "lm_head.weight"} <= keys
    assert "embed_tokens.weight" not in keys
    # the draft vocabulary is the most frequent ids of the (regenerated) training data
    ids = load_file(r.path / "model.safetensors")["d2t"] + torch.arange(200)
    from engine.train.data import token_stream

    seqs = D.regenerate(load_model(world["target"].path), token_stream(world["tok"], corpus.texts("A", "train", 10**9)),
                        drafter_run())
    counts = torch.bincount(seqs.flatten(), minlength=world["tok"].get_vocab_size())
    chosen = torch.zeros_like(counts, dtype=torch.bool)
    chosen[ids] = True
    assert counts[chosen].min() >= counts[~chosen].max() and counts.argmax() in ids
    world["drafter"] = r.path


def test_a_drafter_run_with_a_kl_temperature_trains_on_the_kl_loss(world, tmp_path):
    """DrafterRun.kl_temperature reaches the training loss (off by default: the same losses as before)."""
    runs = {t: D.train_drafter(tmp_path / f"d{t}", drafter_run(steps=4, kl_temperature=t), world["target"].path)
            for t in (0.0, 0.7)}
    plain, kl = (runs[t].log.history["loss"] for t in (0.0, 0.7))
    assert kl[0] > plain[0]  # the same first batch and weights, plus a KL term >= 0
    with pytest.raises(EngineError, match="kl_temperature"):
        D.train_drafter(tmp_path / "bad", drafter_run(kl_temperature=float("nan")), world["target"].path)


def test_finetuning_keeps_the_draft_vocab_and_measures_accept_length_as_it_goes(world, tmp_path):
    from engine.drafter import load_drafter

    prompts = D.held_out_prompts(world["tok"], 2, 200)
    seen = []

    def measure(draft, target):
        seen.append(draft.training)
        return {"accept_length": D.accept_length(target, draft, prompts, 3, 12)}

    r = D.train_drafter(tmp_path / "ft", drafter_run(steps=6, mix="B", lr=1e-3, samples=4), world["target"].path,
                        init_from=world["drafter"], eval_fn=measure, eval_every=3)
    assert [e["step"] for e in r.log.evals] == [3, 6] and seen == [False, False]
    assert all(1.0 <= e["accept_length"] <= 4.0 for e in r.log.evals)
    before, after = (load_file(d / "model.safetensors") for d in (world["drafter"], r.path))
    assert torch.equal(before["d2t"], after["d2t"]) and not torch.equal(before["fc.weight"], after["fc.weight"])


def test_drafter_and_target_with_different_tokenizers_are_refused(world, tmp_path):
    other_tok = train_tokenizer(corpus.texts("B", "train", 10**9), 280)
    other = save_tokenizer(other_tok, tmp_path / "other")
    target = random_model(tiny_config(280))
    drafter = new_drafter(target.cfg, torch.arange(100), target.embed_tokens)
    save_drafter(drafter, other)
    with pytest.raises(EngineError, match="vocab_size 280.* different vocabularies"):
        D.train_drafter(tmp_path / "ft", drafter_run(), world["target"].path, init_from=other)
    # same vocabulary size, another tokenizer
    same_size = train_tokenizer([t.upper() for t in corpus.texts("A", "train", 10**9)], world["tok"].get_vocab_size())
    assert same_size.to_str() != world["tok"].to_str()
    save_tokenizer(same_size, other)
    config = (other / "config.json").read_text()
    (other / "config.json").write_text(config.replace('"vocab_size": 280', f'"vocab_size": {same_size.get_vocab_size()}'))
    with pytest.raises(EngineError, match="another tokenizer"):
        D.check_pair(world["target"].path, other)


def test_target_vocab_must_match_the_tokenizer(world, tmp_path):
    with pytest.raises(EngineError, match="vocab_size is 999 but the tokenizer"):
        train_target(tmp_path / "t", world["run"], world["tok_dir"], tiny_config(999))


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "engine", "train", "drafter", str(tmp_path / "d"), "--target",
                        str(tmp_path / "missing")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no tokenizer.json" in r.stderr, r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_target_and_drafter_train_on_cuda_in_bf16_autocast(world, tmp_path):
    run = dataclasses.replace(world["run"], steps=20)
    r = train_target(tmp_path / "t", run, world["tok_dir"], world["cfg"], device="cuda", save_dtype="bfloat16")
    loss = r.log.history["loss"]
    assert sum(loss[-3:]) < sum(loss[:3])
    d = D.train_drafter(tmp_path / "d", drafter_run(steps=20), r.path, device="cuda", save_dtype="bfloat16")
    assert sum(d.log.history["loss"][-3:]) < sum(d.log.history["loss"][:3])
    target = load_model(r.path, device="cuda", dtype="bfloat16")
    from engine.drafter import load_drafter

    prompts = D.held_out_prompts(world["tok"], 2, 200)
    assert 1.0 <= D.accept_length(target, load_drafter(d.path, target), prompts, 3, 16) <= 4.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_training_reproduces_its_losses_bit_for_bit(world, tmp_path):
    """Deterministic kernels (loop.reproducible): two runs of the same target and drafter training on a GPU give
    the same loss at every step, so GPU records of losses and accept lengths verify exactly."""
    run = dataclasses.replace(world["run"], steps=12)
    targets = [train_target(tmp_path / f"t{i}", run, world["tok_dir"], world["cfg"], device="cuda") for i in (0, 1)]
    assert targets[0].log.history["loss"] == targets[1].log.history["loss"]
    drafters = [D.train_drafter(tmp_path / f"d{i}", drafter_run(steps=12), targets[0].path, device="cuda")
                for i in (0, 1)]
    assert drafters[0].log.history["loss"] == drafters[1].log.history["loss"]


def test_profile_train_script_times_and_profiles_a_step(capsys):
    """scripts/profile-train.py (the diagnostic for a lent GPU): ms per step in both modes and the ops with the most
    self time, as JSON; bad arguments exit 2."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "profile-train.py"
    spec = importlib.util.spec_from_file_location("profile_train", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--preset", "cpu", "--what", "target", "--device", "cpu", "--steps", "1", "--warmup", "0",
                     "--profile-steps", "1", "--rows", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["target"]
    assert set(out) == {"preset", "family", "device", "target"} and out["device"] == "cpu"
    assert r["deterministic_ms"] > 0 and r["default_ms"] > 0 and len(r["ops"]) == 3
    assert r["ops"][0]["self_ms"] >= r["ops"][-1]["self_ms"] > 0 and all(op["name"] for op in r["ops"])
    with pytest.raises(SystemExit) as e:
        mod.main(["--steps", "0"])
    assert e.value.code == 2


def load_script(name: str):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / name
    spec = importlib.util.spec_from_file_location(name.replace("-", "_").removesuffix(".py"), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ab_train_script_measures_each_variant_exactly_and_apart(world, tmp_path, capsys):
    """scripts/ab-train.py: the base run and each variant train on one target and get exact accept lengths (a
    variant equal to the base gets the base's numbers; one with other training gets its own); bad input exits 2."""
    mod = load_script("ab-train.py")
    tiny = ("seq_len=32,regen_tokens=12,samples=16,regen_batch=16,steps=6,warmup=1,batch_size=4,ttt_steps=3,"
            "draft_vocab_size=200,data_bytes=1000000000")
    args = [str(tmp_path / "ab"), "--preset", "cpu", "--device", "cpu", "--target", str(world["target"].path),
            "--base", tiny, "--variant", "same:lr=0.003", "--variant", "long:steps=30", "--chain", "3",
            "--eval-prompts", "2", "--headline-prompts", "2", "--prompt-len", "16", "--new-tokens", "12",
            "--temperature", "0.7", "--json"]
    assert mod.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["variant"]: r for r in out["rows"]}
    assert set(rows) == {"base", "same", "long"} and out["failed"] == []
    assert rows["same"]["final_loss"] == rows["base"]["final_loss"]  # cpu preset lr is 3e-3: the same run
    assert rows["same"]["headline"] == rows["base"]["headline"] and rows["same"]["heldout"] == rows["base"]["heldout"]
    assert rows["long"]["run"]["steps"] == 30 and rows["long"]["final_loss"] != rows["base"]["final_loss"]
    assert rows["same"]["sampled"] == rows["base"]["sampled"]  # seeded draws: exact as well
    for r in rows.values():
        for k in ("headline", "heldout", "sampled"):
            assert 1.0 <= r[k] <= 4.0, (k, r[k])  # chain of 3, bonus token included
    assert json.loads((tmp_path / "ab" / "ab-train.json").read_text())["rows"] == out["rows"]
    for bad in (["--variant", "x:nosuchfield=1"], ["--variant", "base:lr=1"], ["--variant", "noequals"],
                ["--jobs", "0"], ["--temperature", "-1"]):
        with pytest.raises(SystemExit) as e:
            mod.main([str(tmp_path / "ab2"), "--preset", "cpu", *bad])
        assert e.value.code == 2
