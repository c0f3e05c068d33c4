"""Runbook headers, parameters cells, names and provenance: every bad input is one clear SpecbookError."""

import sys
from pathlib import Path

import pytest

from specbook import RunFailed, SpecbookError, provenance
from specbook.runbooks import find_root, load, parse_cli
from specbook_testing import make_repo, runbook_text

PARAMS = """
n = 2
rate = 0.5
name = "a"
flag = False
sizes = [1, 2]
maybe: int | None = None
opt: Optional[float] = 1.0
ids: list[int] = [1]
"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_repo(tmp_path, bench=runbook_text(profiles="{cpu: {n: 3, rate: 1}, h200: {n: 64}}", params=PARAMS))


def test_header_parameters_and_profiles(root):
    rb = load(root, "bench")
    assert rb.title == "T" and set(rb.profiles) == {"cpu", "h200"}
    assert {n: p.describe() for n, p in rb.parameters.items()} == {
        "n": "int", "rate": "float", "name": "str", "flag": "bool", "sizes": "list", "maybe": "int | None",
        "opt": "float | None", "ids": "list"}
    cpu = rb.params_for("cpu")
    assert cpu["n"] == 3 and cpu["rate"] == 1.0 and isinstance(cpu["rate"], float)  # an int is a valid float
    assert rb.params_for("h200", {"flag": True}) == {**rb.params_for("h200"), "flag": True}
    with pytest.raises(RunFailed, match="cannot run on profile 8x-rtx-pro-6000"):
        rb.params_for("8x-rtx-pro-6000")


def test_cli_parameters_are_typed(root):
    rb = load(root, "bench")
    assert parse_cli(rb, ("n=5", "rate=2", "name=7", "flag=true", "sizes=[3]", "maybe=none")) == {
        "n": 5, "rate": 2.0, "name": "7", "flag": True, "sizes": [3], "maybe": None}


@pytest.mark.parametrize("pair, message", [
    ("nn=3", "no parameter 'nn'; did you mean n"),
    ("n=abc", "n of runbook bench must be int, got 'abc'"),
    ("n=1.5", "must be int"),
    ("flag=3", "must be bool"),
    ("n=true", "must be int"),
    ("outputs_dir=/x", "set by specbook"),
    ("novalue", "expected key=value"),
])
def test_bad_cli_parameters(root, pair, message):
    with pytest.raises(SpecbookError, match=message):
        parse_cli(load(root, "bench"), (pair,))


@pytest.mark.parametrize("name", ["../bench", "a/b", "..", "x\\y", "/etc/passwd"])
def test_names_with_paths_are_rejected(root, name):
    with pytest.raises(SpecbookError, match="invalid runbook name"):
        load(root, name)


def test_unknown_name_suggests_close_ones(root):
    with pytest.raises(SpecbookError, match="unknown runbook 'bnech'; did you mean bench"):
        load(root, "bnech")


@pytest.mark.parametrize("text, message", [
    ("# %%\nx = 1\n", "no ```yaml header"),
    (runbook_text(extra_header="colour: red"), "unknown header keys \\['colour'\\]"),
    (runbook_text(profiles="[cpu]"), "profile|profiles"),
    (runbook_text(profiles="{}"), "needs profiles"),
    (runbook_text(profiles="{cpu: {nope: 1}}"), "profile cpu: runbook bad has no parameter 'nope'"),
    (runbook_text(profiles="{cpu: {value: abc}}"), "profile cpu: value of runbook bad must be float"),
    (runbook_text(params="value = 1.0\nn = 2 * 3"), "line 2: n must be a literal"),
    (runbook_text(params="import os"), "only `name = literal` assignments"),
    (runbook_text(params="x: Path = 1"), "annotation must use"),
    (runbook_text(params="value = 1.0\nx: int = 'a'"), "line 2: default of x is not int"),
    (runbook_text(extra_header="timeout: -1"), "timeout must be a positive number"),
    (runbook_text(extra_header="depends: x"), "depends must be a list of strings"),
    (runbook_text(extra_header="inputs: [weather]"), "unknown inputs \\['weather'\\]"),
    (runbook_text(title="T: {"), "malformed YAML header"),
])
def test_bad_runbooks(tmp_path, text, message):
    root = make_repo(tmp_path, bad=text)
    with pytest.raises(SpecbookError, match=message):
        load(root, "bad")


def test_find_root(tmp_path, monkeypatch):
    root = make_repo(tmp_path / "repo")
    (root / "sub").mkdir()
    monkeypatch.chdir(root / "sub")
    monkeypatch.delenv("SPECBOOK_ROOT", raising=False)
    assert find_root() == root
    monkeypatch.setenv("SPECBOOK_ROOT", str(tmp_path))
    with pytest.raises(SpecbookError, match="has no runbooks/"):
        find_root()
    assert find_root(root) == root


@pytest.mark.parametrize("names, profile", [
    ((), "cpu"),
    (("NVIDIA H200",), "h200"),
    (("NVIDIA H200",) * 2, "h200"),
    (("NVIDIA RTX PRO 6000 Blackwell Server Edition",) * 8, "8x-rtx-pro-6000"),
    (("NVIDIA RTX PRO 6000 Blackwell Server Edition",) * 2, "gpu-2x-rtx-pro-6000-blackwell-server-edition"),
    (("NVIDIA A100-SXM4-80GB",), "gpu-a100-sxm4-80gb"),
])
def test_profiles(names, profile):
    assert provenance.profile_of(names) == profile


def test_inputs_hash_depends_on_every_input():
    base = dict(runbook_source="a", params={"n": 1}, engine="e", upstream={"d": "h"}, inputs={"corpus": "c"})
    h = provenance.inputs_hash(**base)
    for key, value in [("runbook_source", "b"), ("params", {"n": 2}), ("engine", "f"), ("upstream", {"d": "i"}),
                       ("inputs", {"corpus": "d"})]:
        assert provenance.inputs_hash(**{**base, key: value}) != h, key


def test_unavailable_input_is_reported_not_raised_raw(tmp_path, monkeypatch):
    def broken(root):
        raise ModuleNotFoundError("No module named 'engine.train.corpus'")

    monkeypatch.setitem(provenance.INPUTS, "corpus", broken)
    with pytest.raises(RunFailed, match="input corpus unavailable: ModuleNotFoundError"):
        provenance.input_fingerprint(tmp_path, "corpus")


def test_fingerprint_sees_env_and_sitecustomize(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ.setdefault('NCCL_P2P_LEVEL', 'NVL')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("UNRELATED_VAR", "1")
    root = make_repo(tmp_path / "repo")
    (root / "engine").mkdir()
    (root / "engine" / "a.py").write_text("x = 1\n")
    fp = provenance.fingerprint(root, "src", {"n": 1}, {"corpus": "abc"})
    assert fp["env"]["NCCL_ALGO"] == "Ring" and "UNRELATED_VAR" not in fp["env"]
    site = fp["sitecustomize"]["sitecustomize"]
    if "sitecustomize" not in sys.modules:  # an interpreter-wide one would shadow ours
        assert site["importable"] and not site["active"]
        assert site["hash"] == provenance.file_hash(tmp_path / "sitecustomize.py")
    assert fp["corpus_manifest"] == "abc" and fp["profile"] in ("cpu", provenance.detect_profile())
    before = fp["engine_hash"]
    (root / "engine" / "a.py").write_text("x = 2\n")
    assert provenance.engine_hash(root) != before


@pytest.mark.gpu
def test_gpu_profile_and_fingerprint():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    provenance.gpus.cache_clear()
    assert provenance.detect_profile() != "cpu"
    fp = provenance.fingerprint(Path.cwd())
    assert fp["gpu"]["count"] == torch.cuda.device_count() and fp["versions"]["cuda"] == torch.version.cuda
    assert fp["gpu"]["names"] and fp["gpu"]["driver"]
    uuids = fp["gpu"]["uuids"]  # the physical cards: one per visible device, all different
    assert len(uuids) == len(set(uuids)) == torch.cuda.device_count() and all(u.startswith("GPU-") for u in uuids)
    sizes = fp["gpu"]["memory_gib"]  # what verify --plan packs the card by, from another machine
    assert len(sizes) == torch.cuda.device_count() and all(s > 1 for s in sizes)


def test_declared_gpu_memory_is_read_checked_and_left_out_of_the_hash(tmp_path):
    """`gpu_memory_gib` in the header reaches the Runbook; a non-positive one is one clear error; declaring it (or
    changing it) leaves the runbook's hashed source, and so its records, as they were."""
    from specbook.runbooks import load

    root = make_repo(tmp_path, plain=runbook_text(), big=runbook_text(extra_header="gpu_memory_gib: 40"),
                     bad=runbook_text(extra_header="gpu_memory_gib: -1"))
    assert load(root, "big").gpu_memory_gib == 40 and load(root, "plain").gpu_memory_gib == 0
    assert load(root, "big").hashed_source == load(root, "plain").hashed_source
    with pytest.raises(SpecbookError, match="gpu_memory_gib must be a positive number of GiB"):
        load(root, "bad")
