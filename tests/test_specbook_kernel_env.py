"""[tool.specbook.kernel_env]: the variables every runbook kernel starts with (this project pins the CPU's code
paths with them, so exact cpu numbers are the same on AVX-512 and AVX2 machines), recorded in the provenance."""

from __future__ import annotations

import pytest

from specbook import SpecbookError, project, provenance
from specbook.verify import environment_changes
from specbook_testing import baseline, cli, make_repo, runbook_text

BODY = '''
import torch
record("scalar_path", float(torch.backends.cpu.get_cpu_capability() == "DEFAULT"), unit="n", direction="none",
       kind="exact")
'''


def configure(root, table: str) -> None:
    (root / "pyproject.toml").write_text((root / "pyproject.toml").read_text() + f"\n[tool.specbook.kernel_env]\n{table}")


def test_the_kernel_starts_with_the_configured_variables_and_the_record_names_them(tmp_path, monkeypatch):
    """ATEN_CPU_CAPABILITY=default sends torch's kernels down their scalar path: torch in the runbook's kernel
    sees it, so the variable was there before torch chose its path."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    root = make_repo(tmp_path, one=runbook_text(body=BODY))
    assert cli(root, "run", "one", "--record").exit_code == 0
    assert baseline(root, "one")["profiles"]["cpu"]["metrics"]["scalar_path"]["value"] == 0.0  # not configured
    configure(root, 'ATEN_CPU_CAPABILITY = "default"\n')
    assert cli(root, "run", "one", "--record").exit_code == 0
    cpu = baseline(root, "one")["profiles"]["cpu"]
    assert cpu["metrics"]["scalar_path"]["value"] == 1.0
    assert cpu["runs"][-1]["provenance"]["env"]["ATEN_CPU_CAPABILITY"] == "default"
    assert cpu["runs"][-1]["provenance"]["cpu"]["isa"] == provenance.cpu_isa()


def test_the_environment_wins_over_the_configuration(tmp_path, monkeypatch):
    root = make_repo(tmp_path)
    configure(root, 'MKL_CBWR = "AVX2"\nATEN_CPU_CAPABILITY = "avx2"\n')
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert provenance.kernel_environ(root) == {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"}
    assert provenance.fingerprint(root)["env"]["MKL_CBWR"] == "COMPATIBLE"


def test_a_bad_table_is_one_clear_line(tmp_path):
    root = make_repo(tmp_path)
    configure(root, "MKL_CBWR = 2\n")
    with pytest.raises(SpecbookError, match=r"kernel_env\] must be a table of NAME = \"value\""):
        project.settings(root)


def test_another_processor_or_pinned_path_is_named_as_an_environment_change():
    then = {"provenance": {"cpu": {"isa": "avx512"}, "env": {}}}
    now = {"cpu": {"isa": "avx2"}, "env": {"MKL_CBWR": "AVX2"}}
    assert environment_changes(then, now) == ["CPU instructions avx512 -> avx2", "MKL_CBWR=(unset) -> AVX2"]
    assert environment_changes({"provenance": {"cpu": {"model": "x"}}}, now)[:1] == ["MKL_CBWR=(unset) -> AVX2"]


@pytest.mark.content
def test_this_project_pins_the_cpu_code_paths():
    from pathlib import Path

    env = project.settings(Path(__file__).resolve().parents[1]).kernel_env
    assert env == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
