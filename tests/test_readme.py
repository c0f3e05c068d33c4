"""The README's two commands are the ones users and CI run: .ci/run must run the README's test command verbatim, and
the main job installs only what it runs."""
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.content

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_two_commands_one_main_job_one_test():
    setup, tests = readme_commands()[:2]
    assert "runbook run baseline-eagle3" in setup and "pytest" in tests
    assert setup.split("&&")[0] == tests.split("&&")[0]  # the same venv
    for command in (setup, tests):  # the same pinned environment
        assert "-c requirements/lock.txt torch==2.13.0" in command


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1]
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_main_job_installs_only_the_base_dependencies():
    """The main job runs CPU runbooks: no test extra (playwright, the triton interpreter, pytest, mkdocs)."""
    from specbook.project import tomllib

    setup = readme_commands()[0]
    assert re.search(r"pip install .* -e \. ", setup) and "[" not in setup.split("&&")[1], setup
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].lower() for d in base}
    assert not names & {"triton", "playwright", "pytest", "pytest-timeout", "mkdocs", "fastapi", "speculators"}, names


def test_the_readme_says_the_browser_test_is_skipped_without_chromium_and_how_to_install_it():
    """The test command passes without Chromium by skipping the browser test, while CI installs it: a user must
    read why a local run and CI differ, and the browser test's skip must give the same install command."""
    text = (ROOT / "README.md").read_text()
    assert "tests/test_browser.py" in text and "skipped" in text and "apt-get install chromium" in text
    assert "apt-get install chromium" in (ROOT / "tests" / "test_browser.py").read_text()
    assert "apt-get install" in (ROOT / ".ci" / "run").read_text() and "chromium" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_builds_and_serves_the_site_without_the_banner():
    """mkdocs prints an end-of-life banner unless NO_MKDOCS_2_WARNING=1: the README's site commands set it, as CI."""
    blocks = re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    commands = [c for block in blocks for c in block.splitlines() if "mkdocs " in c]
    assert any("mkdocs build" in c for c in commands) and any("mkdocs serve" in c for c in commands), commands
    assert all(c.startswith("NO_MKDOCS_2_WARNING=1 ") for c in commands), commands
    assert "export NO_MKDOCS_2_WARNING=1" in (ROOT / ".ci" / "run").read_text()
