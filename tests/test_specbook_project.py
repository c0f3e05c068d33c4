"""specbook/project.py: what specbook fingerprints comes from the project's [tool.specbook], never from names
written into specbook itself."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specbook import SpecbookError, provenance, records, runbooks
from specbook_testing import make_repo, runbook_text

ROOT = Path(__file__).resolve().parents[1]


def configure(root: Path, body: str) -> None:
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n\n" + body)


def test_a_configured_input_is_known_to_headers_and_fingerprinted(tmp_path, monkeypatch):
    root = make_repo(tmp_path / "repo", up=runbook_text(extra_header="inputs: [weather]"))
    with pytest.raises(SpecbookError, match=r"unknown inputs \['weather'\]"):
        runbooks.load(root, "up")
    (tmp_path / "lib" / "weatherlib").mkdir(parents=True)
    (tmp_path / "lib" / "weatherlib" / "__init__.py").write_text("")
    (tmp_path / "lib" / "weatherlib" / "obs.py").write_text("def digest():\n    return 'sunny-1'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    configure(root, '[tool.specbook.inputs]\nweather = "weatherlib.obs:digest"\n')
    assert runbooks.load(root, "up").inputs == ["weather"]
    assert provenance.input_fingerprint(root, "weather") == "sunny-1"
    configure(root, '[tool.specbook.inputs]\nweather = "weatherlib.gone:digest"\n')
    with pytest.raises(SpecbookError, match="input weather unavailable: ModuleNotFoundError"):
        provenance.input_fingerprint(root, "weather")


@pytest.mark.parametrize("body, message", [
    ('[tool.specbook.inputs]\nweather = "weatherlib.obs"\n', r'inputs.weather must be "module:function"'),
    ('[tool.specbook]\nengine_package = "a/b"\n', "engine_package must be a top-level package name"),
    ('[tool.specbook]\ninputs = ["corpus"]\n', r"\[tool.specbook.inputs\] must be a table"),
    ("[tool.specbook\n", "pyproject.toml: unreadable"),
    ('[tool.specbook]\ntiming_lock = "yes"\n', "timing_lock must be true or false"),
])
def test_bad_configuration_is_one_clear_line(tmp_path, body, message):
    root = make_repo(tmp_path / "repo", up=runbook_text())
    configure(root, body)
    with pytest.raises(SpecbookError, match=message):
        runbooks.load(root, "up")


def test_the_timing_lock_is_off_unless_the_project_says_its_engine_keeps_it(tmp_path):
    from specbook import project

    root = make_repo(tmp_path / "repo")
    assert project.settings(root).timing_lock is False
    configure(root, '[tool.specbook]\nengine_package = "engine"\ntiming_lock = true\n')
    assert project.settings(root).timing_lock is True


def test_the_engine_hash_covers_the_configured_package(tmp_path):
    root = make_repo(tmp_path / "repo")
    for pkg in ("engine", "mylib"):
        (root / pkg).mkdir()
        (root / pkg / "a.py").write_text("x = 1\n")
    configure(root, '[tool.specbook]\nengine_package = "mylib"\n')
    before = provenance.engine_hash(root)
    (root / "engine" / "a.py").write_text("x = 2\n")  # not the configured package
    assert provenance.engine_hash(root) == before
    (root / "mylib" / "a.py").write_text("x = 2\n")
    assert provenance.engine_hash(root) != before
    src = "from mylib.a import x\n"
    assert provenance.engine_files(root, src, "mylib") == {root / "mylib" / "a.py"}


def test_specbook_imports_no_project_package():
    for path in sorted((ROOT / "specbook").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            assert not any(n == "engine" or n.startswith("engine.") for n in names), (path.name, names)


@pytest.mark.content
def test_this_repository_declares_its_engine_and_corpus():
    s = runbooks.load(ROOT, "train-target")
    assert s.inputs == ["corpus"] and "corpus" in provenance.known_inputs(ROOT)
    assert provenance.project.settings(ROOT).engine_package == "engine"


def test_a_machine_of_same_parameters_runs_the_other_profiles_recorded_apart(tmp_path):
    root = make_repo(tmp_path / "repo", up=runbook_text(profiles="{cpu: {}, h200: {value: 2.0}, h200.big: {value: 3.0}}"))
    assert set(runbooks.load(root, "up").profiles) == {"cpu", "h200", "h200.big"}
    configure(root, '[tool.specbook]\nengine_package = "engine"\n[tool.specbook.same_parameters]\nh100 = "h200"\n')
    rb = runbooks.load(root, "up")
    assert rb.params_for("h100")["value"] == 2.0 and rb.params_for("h100.big")["value"] == 3.0
    assert provenance.profile_of(("NVIDIA H100 80GB HBM3",)) == "h100"
    assert provenance.profile_of(("NVIDIA H200",)) == "h200"
    configure(root, '[tool.specbook.same_parameters]\nh100 = "../h200"\n')
    with pytest.raises(SpecbookError, match="same_parameters"):
        runbooks.load(root, "up")


@pytest.mark.content
def test_every_runbook_declares_the_gpu_memory_its_records_saw():
    """The scheduler packs a GPU by the headers' gpu_memory_gib: a header under a peak a record kept (gpu_peak_gib)
    would put runbooks beside each other on a card that cannot hold them."""
    short = []
    for name, rf in records.load_all(ROOT).items():
        declared = runbooks.load(ROOT, name).gpu_memory_gib
        for profile, entry in rf.data.get("profiles", {}).items():
            peaks = [r["provenance"].get("gpu_peak_gib") or 0 for r in entry.get("runs", [])]
            if peaks and max(peaks) > declared:
                short.append(f"{name}/{profile}: peak {max(peaks)} GiB, header {declared:g}")
    assert not short, short
