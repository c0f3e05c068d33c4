"""The real-scale paths of probe-plugin, finetune-drafter and scale-data (profile 8x-rtx-pro-6000), without the
hardware: SpecForge's own code (its 0.2.0 wheel from PyPI, without its GPU dependencies) checks the run config,
the launch plan, the checkpoint layout and the export; the bundled OpenAI-compatible server stands in for SGLang.

SpecForge's feature-capture script (scripts/prepare_hidden_states.py) is not in its wheel: its command is checked
against the flags that script declares in SpecForge 0.2.0 (sgl-project/SpecForge, version.txt 0.2.0)."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import jupytext
import pytest
import torch

from engine.backends import LaunchConfig, SpecSettings, features, serving
from engine.backends import specforge as sf
from engine.backends import accept
from engine.backends.accept import accept_by_prompt_set, chain_accept_by_prompt_set, mean_accept
from engine.backends.regenerate import read_conversations, regenerate
from engine.errors import EngineError
from specbook.execute import target
from specbook.runbooks import load
from specbook_testing import make_repo, runbook_text

ROOT = Path(__file__).resolve().parents[1]
SCALE = "8x-rtx-pro-6000"
RUNBOOKS = {  # the parameters each runbook's real-scale cell refuses to run without
    "probe-plugin": ("target", "target_b", "drafter", "capture_data", "specforge_repo"),
    "finetune-drafter": ("target", "drafter", "train_data", "specforge_repo"),
    "scale-data": ("target", "drafter", "source_data", "specforge_repo"),
}
# scripts/prepare_hidden_states.py's argparse flags in SpecForge 0.2.0
CAPTURE_FLAGS = {
    "--target-model-path", "--strategy", "--draft-model-config", "--trust-remote-code", "--data-path",
    "--max-length", "--chat-template", "--is-preformatted", "--num-samples", "--build-dataset-num-proc",
    "--tp-size", "--batch-size", "--cache-dir", "--output-path", "--dist-timeout", "--num-io-threads",
    "--num-workers", "--io-queue-size", "--file-group-size", "--compress", "--compression-level",
    "--sglang-attention-backend", "--sglang-mem-fraction-static", "--sglang-context-length",
    "--sglang-enable-nccl-nvls", "--sglang-enable-symm-mem", "--sglang-enable-torch-compile",
    "--sglang-enable-dp-attention", "--sglang-enable-dp-lm-head", "--sglang-ep-size",
}


@pytest.fixture(scope="module")
def specforge(tmp_path_factory):
    """SpecForge's own package, from its wheel (pip's cache makes this quick after the first time)."""
    d = tmp_path_factory.mktemp("specforge")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"specforge=={sf.SPECFORGE_VERSION}",
                        "-d", str(d)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip download specforge=={sf.SPECFORGE_VERSION} failed: {r.stderr[-500:]}"
    site = d / "site"
    with zipfile.ZipFile(next(d.glob("specforge-*.whl"))) as z:
        z.extractall(site)
    sys.path.insert(0, str(site))
    import specforge.cli  # noqa: F401 - the wheel must hold the CLI the commands here name

    yield site
    sys.path.remove(str(site))
    for name in [m for m in sys.modules if m == "specforge" or m.startswith("specforge.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a drafter for it with a reduced draft vocabulary (so d2t is not all zeros)."""
    from engine.drafter import new_drafter, save_drafter
    from engine.loading import random_model, save_model

    d = tmp_path_factory.mktemp("pair")
    model = random_model("tiny")
    save_model(model, d / "target")
    save_drafter(new_drafter(model.cfg, torch.arange(0, 256, 2), embedding=model.embed_tokens), d / "drafter")
    return d / "target", d / "drafter"


# ------------------------------------------------------------------------------------------------ runbook headers


@pytest.mark.parametrize("name", list(RUNBOOKS))
def test_scale_profile_declares_the_real_scale_parameters(name):
    rb = load(ROOT, name)
    scale = rb.profiles[SCALE]
    assert scale["backend"] == "sglang"
    assert all(scale.get(p) for p in RUNBOOKS[name]), f"{name}: {SCALE} leaves out {RUNBOOKS[name]}"
    for profile in ("cpu", "cpu.dsv3", "h200", "h200.dsv3"):  # the miniature profiles keep the in-process path
        assert rb.params_for(profile)["backend"] == "bundled"
    # a real server runs no miniature training upstream; the miniature profiles still do
    assert target(ROOT, name, SCALE).upstream == {}
    assert set(target(ROOT, name, "cpu").upstream) == set(rb.depends)


@pytest.mark.parametrize("name", list(RUNBOOKS))
def test_scale_cell_records_what_the_runbook_reproduces(name):
    """Every cell after the scale cell is skipped at scale, so the scale cell must record the reproduced metrics."""
    rb = load(ROOT, name)
    cells = [c.source for c in jupytext.read(rb.path, fmt="py:percent").cells if c.cell_type == "code"]
    scale = next(c for c in cells if "at_scale = backend ==" in c)
    rest = cells[cells.index(scale) + 1:]
    assert rest and all(c.startswith("if not at_scale:") for c in rest)
    for metric in rb.reproduces:
        assert f'record("{metric}"' in scale, f"{name}: the scale cell does not record {metric}"


def test_dependency_without_the_profile_is_not_run(tmp_path):
    root = make_repo(tmp_path, up=runbook_text(profiles="{cpu: {}}"),
                     down=runbook_text(profiles="{cpu: {}, big: {}}", extra_header="depends: [up]"))
    assert list(target(root, "down", "cpu").upstream) == ["up"]
    assert target(root, "down", "big").upstream == {}


# ------------------------------------------------------------------------------------------------ SpecForge


def test_capture_command_uses_prepare_hidden_states_flags():
    cap = sf.CaptureRun("/opt/SpecForge", "/m/k25", "/m/k2-eagle3/config.json", "/d/s.jsonl", "/f", tp=8,
                        num_samples=100, mem_fraction=0.8, python="py")
    cmd = cap.command()
    assert cmd[:7] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "8",
                       "/opt/SpecForge/scripts/prepare_hidden_states.py"]
    flags = [a for a in cmd[7:] if a.startswith("--")]
    assert set(flags) <= CAPTURE_FLAGS, set(flags) - CAPTURE_FLAGS
    args = dict(zip(cmd[7:], cmd[8:]))
    assert (args["--strategy"], args["--tp-size"], args["--num-samples"], args["--draft-model-config"]) == (
        "eagle3", "8", "100", "/m/k2-eagle3/config.json")


def test_the_targets_own_code_runs_only_when_asked():
    """trust_remote_code runs Python from the checkpoint: off unless the caller opts in (capture and training)."""
    args = ("/opt/SpecForge", "/m/k25", "/m/k2-eagle3/config.json", "/d/s.jsonl", "/f")
    assert "--trust-remote-code" not in sf.CaptureRun(*args).command()
    assert "--trust-remote-code" in sf.CaptureRun(*args, trust_remote_code=True).command()
    assert sf.TrainRun("/t", "/d/config.json", "/f", "/o").config()["model"]["trust_remote_code"] is False
    assert sf.TrainRun("/t", "/d/config.json", "/f", "/o", trust_remote_code=True).config()["model"][
        "trust_remote_code"] is True

def test_warm_start_needs_the_initial_vocab_mapping():
    with pytest.raises(EngineError, match="vocab mapping"):
        sf.TrainRun("/t", "/d/config.json", "/f", "/o", init_drafter="/d")


def test_train_config_resolves_in_specforge(specforge, pair, tmp_path):
    """SpecForge's CLI parses the command, validates the run config and plans the launch (--plan starts nothing)."""
    from specforge.config import load_config
    import specforge.cli  # noqa: F401 - the wheel must hold the CLI the commands here name

    tgt, drafter = pair
    vocab = sf.save_vocab_mapping(drafter, tmp_path / "vocab.pt")
    (tmp_path / "features").mkdir()
    run = sf.TrainRun(str(tgt), str(drafter / "config.json"), str(tmp_path / "features"), str(tmp_path / "out"),
                      run_id="ft", init_drafter=str(drafter), vocab_mapping=str(vocab), max_steps=50, nproc=8)
    path = run.write_config(tmp_path / "run.yaml")
    cfg = load_config(str(path))
    assert cfg.mode == "offline" and cfg.training.strategy == "eagle3" and cfg.training.max_steps == 50
    assert (cfg.model.draft_checkpoint_path, cfg.model.vocab_mapping_path) == (str(drafter), str(vocab))
    cmd = run.command(path, python="py")
    assert cmd[:3] == ["py", "-m", "specforge.cli"]
    assert specforge.cli.main([*cmd[3:], "--plan"]) == 0


def test_train_config_rejected_by_specforge_on_a_bad_value(specforge, tmp_path):
    from pydantic import ValidationError
    from specforge.config import load_config

    run = sf.TrainRun("/t", "/d/config.json", str(tmp_path), str(tmp_path / "o"), learning_rate=0.0)
    with pytest.raises(ValidationError, match="learning_rate"):  # the schema is live: a bad value fails here
        load_config(str(run.write_config(tmp_path / "bad.yaml")))


def test_vocab_mapping_file_is_what_specforge_loads(pair, tmp_path):
    _, drafter = pair
    got = torch.load(sf.save_vocab_mapping(drafter, tmp_path / "v.pt"))
    assert torch.equal(got["d2t"], torch.arange(0, 256, 2) - torch.arange(128))
    assert got["t2d"].dtype == torch.bool and int(got["t2d"].sum()) == 128


def _checkpoint(specforge_site, out: Path, run_id: str, sd: dict, steps=(5, 10)) -> None:
    from specforge.training.checkpoint import CheckpointManager

    mgr = CheckpointManager(str(out), run_id)
    for step in steps:
        mgr.save({"draft_state_dict": sd, "global_step": step, "strategy": "eagle3", "run_id": run_id}, step,
                 rank_state={"optimizer": None, "rng": None})


def test_checkpoint_layout_written_by_specforge(specforge, pair, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(str(pair[1] / "model.safetensors"))
    _checkpoint(specforge, tmp_path, "ft", sd)
    assert sf.latest_checkpoint(tmp_path, "ft") == (tmp_path / "ft-step10").resolve()
    assert torch.equal(sf.trained_draft_state(tmp_path / "ft-step10")["d2t"], sd["d2t"])
    (tmp_path / "ft-latest").unlink()  # a filesystem without links: the highest step
    assert sf.latest_checkpoint(tmp_path, "ft") == tmp_path / "ft-step10"
    with pytest.raises(EngineError, match="no checkpoint of run 'other'"):
        sf.latest_checkpoint(tmp_path, "other")


def test_vocab_check_catches_a_rebuilt_mapping(pair):
    initial = sf.vocab_mapping(pair[1])
    sf.check_vocab_kept(initial, dict(initial), "same")
    rebuilt = {"d2t": initial["d2t"].roll(1), "t2d": initial["t2d"]}
    with pytest.raises(EngineError, match="d2t differs .* in 128 of 128 entries"):
        sf.check_vocab_kept(initial, rebuilt, "ckpt")
    with pytest.raises(EngineError, match="shape"):
        sf.check_vocab_kept(initial, {"d2t": initial["d2t"][:64], "t2d": initial["t2d"]}, "ckpt")
    with pytest.raises(EngineError, match="no t2d"):
        sf.check_vocab_kept(initial, {"d2t": initial["d2t"]}, "ckpt")


@pytest.mark.parametrize("rebuild", [False, True])
def test_train_and_export_checks_the_vocabulary(specforge, pair, tmp_path, monkeypatch, rebuild):
    """Training stands in (it writes a SpecForge checkpoint, keeping or rebuilding d2t); SpecForge's real export
    runs on the command built here (in this process) and the exported drafter is checked too."""
    import specforge.cli  # noqa: F401 - the wheel must hold the CLI the commands here name
    from safetensors.torch import load_file

    tgt, drafter = pair
    sd = load_file(str(drafter / "model.safetensors"))
    sd.pop("embed_tokens.weight", None)
    if rebuild:
        sd["d2t"] = sd["d2t"].roll(1)

    def run_here(cmd, log_path, env=None, cwd=None):
        assert cmd[1:3] == ["-m", "specforge.cli"]
        if cmd[3] == "train":
            _checkpoint(specforge, tmp_path / "out", "ft", sd, steps=(7,))
        else:
            assert specforge.cli.main(cmd[3:]) == 0

    monkeypatch.setattr(sf, "run_logged", run_here)
    run = sf.TrainRun(str(tgt), str(drafter / "config.json"), str(tmp_path), str(tmp_path / "out"), run_id="ft",
                      init_drafter=str(drafter), vocab_mapping=str(sf.save_vocab_mapping(drafter, tmp_path / "v.pt")))
    initial = sf.vocab_mapping(drafter)
    if rebuild:
        with pytest.raises(EngineError, match="checkpoint .*ft-step7: d2t differs"):
            sf.train_and_export(run, tmp_path / "work", python=sys.executable, initial_vocab=initial)
        return
    got = sf.train_and_export(run, tmp_path / "work", python=sys.executable, initial_vocab=initial)
    assert got.checkpoint.name == "ft-step7" and (got.drafter / "config.json").is_file()
    assert torch.equal(sf.vocab_mapping(got.drafter)["d2t"], initial["d2t"])
    assert (tmp_path / "work" / "ft.yaml").is_file()


def test_run_logged_names_the_log_on_failure(tmp_path):
    with pytest.raises(EngineError, match="(?s)exited with code 3.*log .*boom"):
        sf.run_logged([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], tmp_path / "x.log")


# ------------------------------------------------------------------------------------------------ feature dumps


def _dump(root: Path, samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Path:
    for i, (ids, aux, last) in enumerate(samples):
        f = root / "rows_0-2000" / f"data_{i}.ckpt"
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": ids, "loss_mask": torch.ones_like(ids), "aux_hidden_state": aux[None],
                    "hidden_state": last[None]}, f)
    return root


def test_similarity_per_feature_layer(tmp_path):
    torch.manual_seed(0)
    H, samples_a, samples_b = 8, [], []
    for T in (5, 3):
        ids, aux, last = torch.arange(T), torch.randn(T, 3 * H), torch.randn(T, H)
        samples_a.append((ids, aux, last))
        flipped = aux.clone()
        flipped[:, H:2 * H] *= -1  # the second feature layer points the other way on B
        samples_b.append((ids, 2 * flipped, last))  # scale does not change a cosine
    sim = features.similarity(_dump(tmp_path / "a", samples_a), _dump(tmp_path / "b", samples_b))
    assert sim.aux == pytest.approx([1.0, -1.0, 1.0]) and sim.last == pytest.approx(1.0)
    assert (sim.samples, sim.tokens, sim.min) == (2, 8, pytest.approx(-1.0))
    assert sim.aux_mean == pytest.approx(1 / 3)


def test_similarity_refuses_unmatched_dumps(tmp_path):
    s = (torch.arange(4), torch.randn(4, 6), torch.randn(4, 2))
    a = _dump(tmp_path / "a", [s])
    with pytest.raises(EngineError, match="tokenized the sample differently"):
        features.similarity(a, _dump(tmp_path / "b", [(torch.arange(1, 5), s[1], s[2])]))
    with pytest.raises(EngineError, match="different samples"):
        features.similarity(a, _dump(tmp_path / "c", [s, s]))
    with pytest.raises(EngineError, match="expected"):
        features.similarity(_dump(tmp_path / "d", [(s[0], torch.randn(4, 5), s[2])]),
                            _dump(tmp_path / "e", [(s[0], torch.randn(4, 5), s[2])]))


def test_subsets_are_nested_links(tmp_path):
    full = _dump(tmp_path / "full", [(torch.arange(2), torch.randn(2, 6), torch.randn(2, 2))] * 5)
    small = features.subset(full, tmp_path / "n2", 2)
    big = features.subset(full, tmp_path / "n4", 4)
    names = [p.relative_to(big) for p in features.feature_files(big)]
    assert [p.relative_to(small) for p in features.feature_files(small)] == names[:2]
    assert all(p.is_symlink() for p in features.feature_files(big))
    assert features.subset(full, tmp_path / "n2", 2) == small  # a resumed sweep finds it made
    with pytest.raises(EngineError, match="holds 5 samples; cannot take 6"):
        features.subset(full, tmp_path / "n6", 6)


# ------------------------------------------------------------------------------------- the bundled server for SGLang


def test_accept_length_per_prompt_set(pair, tmp_path):
    tgt, drafter = pair
    (tmp_path / "code.txt").write_text("def f(x):\nclass A:\n")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "hello there"}) + "\n")
    cfg = LaunchConfig(model=str(tgt), drafter=str(drafter), cuda_graphs=False,
                       spec=SpecSettings(steps=2, topk=1, draft_tokens=3))
    sets = {"code": str(tmp_path / "code.txt"), "chat": str(tmp_path / "chat.jsonl")}
    got = accept_by_prompt_set("bundled", cfg, sets, requests=2, max_tokens=8, device="cpu", dtype="float32",
                               max_seq_len=128)
    assert list(got) == ["code", "chat"]
    for s in got.values():
        assert s.ok == 2 and 1.0 <= s.accept_length <= 3.0 and s.accept_source == "meta_info"
    assert mean_accept(got) == pytest.approx((got["code"].accept_length + got["chat"].accept_length) / 2)
    with pytest.raises(EngineError, match="cannot read prompts"):  # before any server starts
        accept_by_prompt_set("sglang", cfg, {"x": str(tmp_path / "missing.txt")}, requests=1, max_tokens=1)


def test_chain_accept_serves_the_drafter_as_a_chain(pair, tmp_path, monkeypatch):
    """The approach runbooks' one way to measure a drafter under a server: a greedy chain of k steps verifies
    k + 1 tokens, so its accept length lies in [1, k + 1]."""
    tgt, drafter = pair
    (tmp_path / "code.txt").write_text("def f(x):\nclass A:\n")
    seen = []
    real = accept.accept_by_prompt_set
    monkeypatch.setattr(accept, "accept_by_prompt_set", lambda backend, cfg, *a, **kw: (
        seen.append(cfg), real(backend, cfg, *a, **kw))[1])
    got = chain_accept_by_prompt_set("bundled", str(tgt), str(drafter), 2, {"code": str(tmp_path / "code.txt")},
                                     requests=2, max_tokens=8, launch={"cuda_graphs": False, "tp": 1},
                                     device="cpu", dtype="float32", max_seq_len=128)
    (cfg,) = seen
    assert (cfg.model, cfg.drafter, cfg.spec, cfg.cuda_graphs) == (str(tgt), str(drafter), SpecSettings(2, 1, 3), False)
    assert list(got) == ["code"] and got["code"].ok == 2 and 1.0 <= got["code"].accept_length <= 3.0


CONVERSATIONS = [
    {"id": "a", "conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "OLD"}]},
    {"id": "b", "conversations": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one"},
                                  {"role": "assistant", "content": "OLD"}, {"role": "user", "content": "two"}]},
    {"id": 3, "conversations": [{"role": "user", "content": "three"}]},
]


def test_regenerate_through_the_server_and_resume(pair, tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS))
    dst = tmp_path / "out" / "regen.jsonl"
    with serving("bundled", LaunchConfig(model=str(pair[0]), cuda_graphs=False), device="cpu", dtype="float32",
                 max_seq_len=128) as url:
        first = regenerate(url, src, dst, limit=2, max_tokens=4, concurrency=2)
        assert (first.written, first.failed, first.skipped) == (2, 0, 0)
        dst.write_text(dst.read_text() + '{"id": "cut')  # a crash mid-line
        second = regenerate(url, src, dst, max_tokens=4, concurrency=2)
    assert (second.written, second.skipped, second.total) == (1, 2, 3)
    rows = {str(r["id"]): r["conversations"] for r in read_conversations(dst)}
    assert set(rows) == {"a", "b", "3"}
    assert [m["role"] for m in rows["b"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in rows["3"]] == ["user", "assistant"]
    assert all(m["content"] != "OLD" for conv in rows.values() for m in conv)


def test_regenerate_rejects_bad_rows(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(CONVERSATIONS[0]) + "\n" + json.dumps({"id": "x", "conversations": [
        {"from": "human", "value": "sharegpt keys"}]}) + "\n")
    with pytest.raises(EngineError, match="bad.jsonl, line 2"):
        regenerate("http://127.0.0.1:9", src, tmp_path / "o.jsonl")
    assert not (tmp_path / "o.jsonl").exists()
