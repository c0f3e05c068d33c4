"""The drift dial (runbooks/drift-dial.py): the distances between two targets (engine.train.drift), the fits and the
samples-to-recover read off the dial, the kept share, the snapshots of one training run, the runbook's header."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.errors import EngineError
from engine.loading import random_model
from engine.metrics import kept_share
from engine.train import corpus
from engine.train.drafter import train_drafter, training_sequences
from engine.train.drift import (layer_cosines, linear_fit, log_distance, next_token_kl, on_the_dial,
                                probe_similarity, samples_to_recover, similarity_at, weight_distance)
from engine.train.presets import DrafterRun, TargetRun, get_preset, target_config
from engine.train.target import snapshot_dir, train_target
from engine.train.tokenizer import save_tokenizer, train_tokenizer
from specbook.runbooks import load

from corpus_testing import make_archives

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(vocab: int = 64):
    preset = dataclasses.replace(get_preset("cpu"), model=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=128, rope_theta=10000.0))
    return target_config(preset, vocab_size=vocab)


# ---- samples to recover ----------------------------------------------------------------------------------------

def test_samples_to_recover_interpolates_in_log_samples():
    # half way from 2.0 to 3.0 in accept length is half way from 100 to 1000 in log samples: their geometric mean
    assert samples_to_recover([100, 1000], [2.0, 3.0], 2.5) == pytest.approx(math.sqrt(100 * 1000))
    # the first crossing counts, and the order of the points does not
    assert samples_to_recover([1000, 10, 100], [3.0, 1.0, 2.0], 1.5) == pytest.approx(math.sqrt(10 * 100))


def test_samples_to_recover_at_the_ends():
    assert samples_to_recover([100, 1000], [2.0, 3.0], 2.5, before=2.6) == 0.0  # no fine-tune needed
    assert samples_to_recover([100, 1000], [2.0, 3.0], 1.5, before=1.2) == 100.0  # at most the smallest count
    assert samples_to_recover([100, 1000], [2.0, 3.0], 3.5) is None  # more than the largest count


@pytest.mark.parametrize("counts, accepts, goal", [
    ([100, 1000], [2.0], 2.5),  # a count without its accept length
    ([0, 1000], [2.0, 3.0], 2.5),  # no log of 0 samples
    ([100, 100], [2.0, 3.0], 2.5),  # the same count twice
    ([100, 1000], [2.0, float("nan")], 2.5),
])
def test_samples_to_recover_refuses_planted_wrong_input(counts, accepts, goal):
    with pytest.raises(EngineError):
        samples_to_recover(counts, accepts, goal)


# ---- the straight-line fit -------------------------------------------------------------------------------------

def test_linear_fit_recovers_a_known_line_and_its_error():
    # y = 1 + 2x plus residuals orthogonal to x: the line is exact, the residual deviation sqrt(0.04 / 2)
    x = [0.0, 1.0, 2.0, 3.0]
    y = [1.1, 2.9, 4.9, 7.1]
    fit = linear_fit(x, y)
    assert (fit.slope, fit.intercept) == (pytest.approx(2.0), pytest.approx(1.0))
    assert fit.resid_std == pytest.approx(math.sqrt(0.02))
    assert fit.se(1.5) == pytest.approx(math.sqrt(0.02) / 2)  # at the mean of x: s / sqrt(n)
    assert fit.se(10.0) > fit.se(3.0) > fit.se(1.5)  # wider away from the data
    assert fit(2.5) == pytest.approx(6.0)
    assert fit.solve(6.0) == pytest.approx(2.5)


def test_the_band_around_a_solution_is_where_the_line_is_k_errors_from_the_goal():
    fit = linear_fit([0.0, 1.0, 2.0, 3.0], [1.1, 2.9, 4.9, 7.1])
    lo, hi = fit.solve_band(6.0, k=2.0)
    assert lo < fit.solve(6.0) < hi
    for x in (lo, hi):
        assert abs(fit(x) - 6.0) == pytest.approx(2.0 * fit.se(x))
    assert fit.solve_band(6.0, k=1.0)[1] - fit.solve_band(6.0, k=1.0)[0] < hi - lo  # narrower at fewer errors
    # a slope within its errors of flat: the goal could be reached anywhere
    noisy = linear_fit([0.0, 1.0, 2.0, 3.0], [1.0, 3.0, 0.0, 2.0])
    assert noisy.solve_band(1.5, k=1.0) is None


def test_a_fit_is_rebuilt_from_its_recorded_fields():
    fit = linear_fit([0.9, 0.8, 0.7], [0.95, 0.6, 0.3])
    again = type(fit)(**{k: float(v) for k, v in dataclasses.asdict(fit).items()})
    assert again(0.85) == pytest.approx(fit(0.85)) and again.se(0.5) == pytest.approx(fit.se(0.5))
    assert (again.x_min, again.x_max) == (0.7, 0.9)


def test_linear_fit_agrees_with_numpy():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.8, 1.0, 7)
    y = 3 * x - 2 + rng.normal(0, 0.05, 7)
    fit = linear_fit(x.tolist(), y.tolist())
    slope, intercept = np.polyfit(x, y, 1)
    assert (fit.slope, fit.intercept) == (pytest.approx(slope), pytest.approx(intercept))


@pytest.mark.parametrize("x, y", [([1.0, 2.0], [1.0, 2.0]), ([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]),
                                  ([1.0, 2.0, 3.0], [1.0, 2.0]), ([1.0, 2.0, float("inf")], [1.0, 2.0, 3.0])])
def test_linear_fit_refuses_planted_wrong_input(x, y):
    with pytest.raises(EngineError):
        linear_fit(x, y)


def test_a_flat_line_solves_for_nothing():
    with pytest.raises(EngineError):
        linear_fit([1.0, 2.0, 3.0], [1.0, 1.0, 1.0]).solve(2.0)


# ---- kept share ---------------------------------------------------------------------------------------------------

def test_kept_share_counts_draft_tokens_not_the_bonus():
    assert kept_share(3.0, 5.0) == pytest.approx(0.5)  # 2 of 4 accepted draft tokens kept
    assert kept_share(1.0, 5.0) == 0.0
    with pytest.raises(EngineError):
        kept_share(1.0, 1.0)  # nothing was accepted before


# ---- distances between targets -------------------------------------------------------------------------------

def test_weight_distance_of_scaled_weights():
    a = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    b = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    b.load_state_dict({k: 1.1 * v for k, v in a.state_dict().items()})
    assert weight_distance(a, b) == pytest.approx(0.1)
    assert weight_distance(a, a) == 0.0
    with pytest.raises(EngineError):
        weight_distance(a, torch.nn.Sequential(torch.nn.Linear(4, 3)))


@pytest.fixture(scope="module")
def two_models():
    cfg = tiny_config()
    a, b = random_model(cfg, seed=0), random_model(cfg, seed=1)
    prompts = [[int(t) for t in torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (7, 12)]
    return a, b, prompts


def test_a_target_is_at_no_distance_from_itself(two_models):
    a, b, prompts = two_models
    assert layer_cosines(a, a, prompts) == pytest.approx([1.0] * 4, abs=1e-5)
    assert next_token_kl(a, a, prompts) == pytest.approx(0.0, abs=1e-6)
    cos = layer_cosines(a, b, prompts)
    assert len(cos) == 4 and all(c < 0.9 for c in cos[1:])  # two random models' streams point elsewhere
    assert next_token_kl(a, b, prompts) > 0.01


def test_kl_against_a_uniform_target_is_log_v_less_the_entropy(two_models):
    a, b, prompts = two_models
    flat = random_model(a.cfg, seed=1)
    with torch.no_grad():
        flat.lm_head.weight.zero_()  # every logit 0: B says nothing, KL(A || uniform) = log V - H(A)
    entropy, tokens = 0.0, 0
    for ids in prompts:
        with torch.no_grad():
            logits, _ = a(torch.tensor([ids]), torch.arange(len(ids)))
        p = logits[0].float().softmax(-1)
        entropy += -(p * p.log()).sum().item()
        tokens += len(ids)
    assert next_token_kl(a, flat, prompts) == pytest.approx(math.log(64) - entropy / tokens, rel=1e-4)


def test_probe_similarity_is_the_mean_at_the_feature_layers():
    assert probe_similarity([1.0, 0.9, 0.8, 0.7, 0.6], (1, 2, 4)) == pytest.approx((0.9 + 0.8 + 0.6) / 3)


# ---- snapshots of one training run ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dial")
    files = corpus.scan(make_archives(root / "src", 60, 60))
    mp = pytest.MonkeyPatch()
    mp.setattr(corpus, "scan", lambda sources=None: files)
    tok = train_tokenizer(corpus.texts("A", "train", 10**9), 200)
    yield save_tokenizer(tok, root / "tok"), tok.get_vocab_size()
    mp.undo()


def test_snapshots_leave_the_run_unchanged_and_hold_the_model_after_their_step(tok_dir, tmp_path):
    tok, vocab = tok_dir
    run = TargetRun(mix="AB", steps=4, lr=1e-2, warmup=1, batch_size=4, seq_len=16, data_bytes=10**9, ckpt_every=2)
    cfg = tiny_config(vocab)
    plain = train_target(tmp_path / "plain", run, tok, cfg)
    dial = train_target(tmp_path / "dial", run, tok, cfg, snapshots=[4, 1, 2])
    weights = {s: load_file(p / "model.safetensors") for s, p in dial.snapshots.items()}
    assert sorted(weights) == [1, 2, 4] and dial.snapshots[2] == snapshot_dir(dial.path, 2)
    final = load_file(plain.path / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in load_file(dial.path / "model.safetensors").items())
    assert all(torch.equal(final[k], v) for k, v in weights[4].items())  # the last snapshot is the final model
    assert not all(torch.equal(weights[1][k], v) for k, v in weights[2].items())  # each after its own step
    assert (dial.snapshots[1] / "tokenizer.json").is_file()  # a checkpoint of its own
    assert train_target(tmp_path / "dial", run, tok, cfg, snapshots=[1, 2, 4]).snapshots == dial.snapshots  # reused


def test_snapshot_steps_outside_the_run_and_lost_snapshots_are_refused(tok_dir, tmp_path):
    tok, vocab = tok_dir
    run = TargetRun(mix="A", steps=2, lr=1e-2, warmup=1, batch_size=4, seq_len=16, data_bytes=10**9)
    for bad in ([0], [3]):
        with pytest.raises(EngineError, match="snapshot steps"):
            train_target(tmp_path / "t", run, tok, tiny_config(vocab), snapshots=bad)
    r = train_target(tmp_path / "t", run, tok, tiny_config(vocab), snapshots=[1])
    (r.snapshots[1] / "model.safetensors").unlink()
    with pytest.raises(EngineError, match="gone"):
        train_target(tmp_path / "t", run, tok, tiny_config(vocab), snapshots=[1])


def test_a_drafter_on_sequences_made_once_trains_as_on_its_own(tok_dir, tmp_path):
    """A fine-tune and a drafter from scratch share one regeneration (training_sequences, train_drafter(seqs=)):
    the same training as a drafter that regenerates its samples itself."""
    tok, vocab = tok_dir
    tgt = train_target(tmp_path / "t", TargetRun(mix="A", steps=2, lr=1e-2, warmup=1, batch_size=4, seq_len=16,
                                                  data_bytes=10**9), tok, tiny_config(vocab)).path
    run = DrafterRun(mix="B", steps=3, lr=3e-3, warmup=1, batch_size=4, seq_len=16, data_bytes=10**9,
                     draft_vocab_size=100, samples=8, regen_tokens=6, regen_batch=4, ttt_steps=2)
    seqs = training_sequences(tgt, run)
    own = train_drafter(tmp_path / "own", run, tgt)
    given = train_drafter(tmp_path / "given", run, tgt, seqs=seqs)
    assert own.log.history["loss"] == given.log.history["loss"]
    assert all(torch.equal(v, load_file(given.path / "model.safetensors")[k])
               for k, v in load_file(own.path / "model.safetensors").items())
    with pytest.raises(EngineError, match="shape"):
        train_drafter(tmp_path / "short", run, tgt, seqs=seqs[:4])


# ---- the runbook ----------------------------------------------------------------------------------------------

def test_the_runbooks_header_parses():
    rb = load(ROOT, "drift-dial")
    assert {"cpu", "cpu.dsv3", "h200", "h200.dsv3"} <= set(rb.profiles)
    assert rb.depends == ["train-target", "train-drafter"] and rb.inputs == ["corpus"]
    assert {"dials", "sample_counts", "recover_share"} <= set(rb.parameters)


# ---- the real reading on the recorded curve --------------------------------------------------------------------

def recorded_dial_fit() -> dict[str, float]:
    """A kept-share fit as drift-dial records it: kept = -0.6 x - 0.3 in x = log10(1 - similarity)."""
    xs = [-2.0, -1.5, -1.0, -0.5]
    fit = linear_fit(xs, [-0.6 * x - 0.3 for x in xs])
    return {f"kept_fit.{k}": float(v) for k, v in dataclasses.asdict(fit).items()}


def test_log_distance_is_the_probes_reading_as_a_distance():
    assert log_distance(0.99) == pytest.approx(-2.0) and similarity_at(-2.0) == pytest.approx(0.99)
    with pytest.raises(EngineError):
        log_distance(1.0)  # the same target: no distance to take a log of


def test_a_reading_is_placed_on_the_recorded_fit_and_its_thresholds():
    values = recorded_dial_fit() | {"w_keep": 0.99, "w_keep_lo": 0.98, "w_recover_n128": 0.9, "w_recover_n16": 0.95}
    lines = on_the_dial(similarity_at(-1.25), values, 0.9, kept=0.5)  # a similarity of 0.9438
    assert "kept share of 0.45" in lines[0] and "inside" in lines[0] and "measured here: 0.50" in lines[0]
    assert "0.6838..0.9900" in lines[0]  # the dial's range, as similarities
    assert lines[1].startswith("below W = 0.9900") and "unchanged" in lines[1]
    assert lines[2].startswith("below W = 0.9500") and "16 samples" in lines[2]  # the counts in order
    assert lines[3].startswith("above W = 0.9000") and "128 samples" in lines[3]
    assert len(lines) == 5 and lines[-1].startswith("caveat of scale")
    assert "outside" in on_the_dial(0.5, values, 0.9)[0]
    with pytest.raises(KeyError):
        on_the_dial(0.9, {"w_keep": 0.95}, 0.9)  # no fit recorded
    assert not any(line.startswith("no forecast") for line in lines)  # a clear slope forecasts


def test_a_curve_whose_slope_is_within_its_noise_forecasts_nothing():
    """Kept shares that do not follow the similarity (as the first GPU dial's): the line is printed with its band,
    and a line says the slope is within one standard error of flat, so the reading forecasts nothing."""
    xs, ys = [-1.52, -1.37, -1.38, -1.15], [0.41, 0.63, 1.00, 0.44]
    values = {f"kept_fit.{k}": float(v) for k, v in dataclasses.asdict(linear_fit(xs, ys)).items()}
    lines = on_the_dial(0.95, values, 0.9)
    flat = [line for line in lines if line.startswith("no forecast")]
    assert len(flat) == 1 and "within one standard error of flat" in flat[0]


def test_probe_plugin_at_scale_prints_its_reading_on_the_recorded_dial(tmp_path, monkeypatch, capsys):
    """The end of probe-plugin's real-scale cell, run against a drift-dial record (and against none)."""
    import textwrap
    from types import SimpleNamespace

    from specbook.record import make_metric
    from specbook.records import add_run

    src = (ROOT / "runbooks" / "probe-plugin.py").read_text()
    start = src.index("    # where the reading falls on drift-dial's recorded fits")
    snippet = textwrap.dedent(src[start:src.index("\n# %%", start)])
    scope = dict(sim=SimpleNamespace(aux_mean=similarity_at(-1.25)), tau={"a": 3.0, "b": 2.0}, kept_share=kept_share,
                 Path=Path)
    monkeypatch.chdir(tmp_path)
    exec(snippet, dict(scope))
    assert "no drift-dial record yet" in capsys.readouterr().out

    values = recorded_dial_fit() | {"w_keep": 0.99}
    for profile, share in (("cpu", 0.9), ("h200.dsv3", 0.8)):
        run = dict(id=f"r-{profile}", source="measured", date="2026-12-05T10:00:00Z", provenance={}, inputs_hash="x",
                   parameters={"recover_share": share})
        add_run(tmp_path, "drift-dial", profile, run,
                [make_metric(k, v, unit="-", direction="none", kind="exact") for k, v in values.items()])
    exec(snippet, dict(scope))
    out = capsys.readouterr().out
    assert out.index("profile h200.dsv3") < out.index("profile cpu")  # the K2 family's curve first
    assert "kept share of 0.45" in out and "measured here: 0.50" in out and "keeps 80%" in out
    assert "caveat of scale" in out
