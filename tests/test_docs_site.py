"""The MkDocs site (strict build), its generated dashboard and llms.txt, and `runbook context`."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from docs_testing import ROOT
from specbook import records, site
from specbook.cli import main
from specbook.context import build_context, tokens


@pytest.mark.content
def test_dashboard_shows_every_record(built):
    site_dir, values = built
    page = (site_dir / "dashboard" / "index.html").read_text()
    shown = dict(re.findall(r'data-record="([^"]+)">([^<]+)<', page))
    assert values and set(shown) == set(values)
    for key, value in values.items():
        assert float(shown[key]) == pytest.approx(value, rel=1e-5), key
    assert "verdict-reported" in page and "8x NVIDIA RTX PRO 6000" in page
    for svg in re.findall(r'src="([^"]+\.svg)"', page):
        assert (site_dir / "dashboard" / svg).read_text().lstrip().startswith("<?xml")


@pytest.mark.content
def test_reported_numbers_carry_an_admonition(built):
    page = (built[0] / "findings" / "index.html").read_text()
    assert 'class="admonition info"' in page and "Some numbers here are reported" in page
    assert '<span class="claim" title="baseline-k25-sglang/8x-rtx-pro-6000/baseline_tok_s' in page


@pytest.mark.content
def test_llms_txt_lists_every_page(built):
    index = (built[0] / "llms.txt").read_text()
    full = (built[0] / "llms-full.txt").read_text()
    for page in ("findings/", "decisions/", "game-plan/", "glossary/", "runbooks/", "status/"):
        assert f"]({page})" in index
    assert "Abandon the CUDA-graph verify path" in full and "# Status of every documented number" in full


@pytest.mark.content
def test_generated_files_are_committed_and_up_to_date():
    """docs/status.md and the llms files are read where they lie (GitHub, an agent's checkout): CI keeps them true."""
    assert site.out_of_date(ROOT) == [], "run `runbook site` and commit"


def test_dashboard_history_plot(tmp_path):
    (tmp_path / "baselines").mkdir()
    rf = records.load(records.path_for(tmp_path, "bench"))
    rf.data["profiles"]["cpu"] = {"runs": [{"id": "a", "date": "2026-11-29T10:00:00Z", "source": "reported",
                                            "provenance": {}}], "metrics": {}}
    rf.data["profiles"]["cpu"]["metrics"]["ms"] = {
        "value": 12.5, "unit": "ms", "direction": "lower", "tolerance": {"rel": 0.1}, "run": "a",
        "history": [{"value": 14.0, "run": "a"}, {"value": 12.5, "run": "a"}]}
    records.save(rf)
    rf.data["profiles"]["cpu"]["metrics"]["tok_s"] = {
        "value": 80.0, "unit": "tok/s", "direction": "higher", "tolerance": {"rel": 0.1}, "run": "a",
        "history": [{"value": 75.0, "run": "a"}, {"value": 80.0, "run": "a"}]}
    records.save(rf)
    text, plots = site.dashboard(tmp_path)
    assert 'data-record="bench/cpu/ms">12.5<' in text and "verdict-reported" in text
    assert list(plots) == ["dashboard/bench-cpu.svg"] and "<svg" in plots["dashboard/bench-cpu.svg"]
    svg = plots["dashboard/bench-cpu.svg"]
    # small multiples: a panel per metric, titled with it, its unit on the y axis (text kept as SVG text)
    assert len(re.findall(r'<g id="axes_\d+"', svg)) == 2, svg[:2000]
    for name, unit in (("ms", "ms"), ("tok_s", "tok/s")):
        assert f">{name}</text>" in svg and f">{unit}</text>" in svg


@pytest.mark.content
def test_context_fits_budget_and_has_the_essentials():
    full = build_context(ROOT, budget=4000)
    assert "baseline-k25-sglang @ 8x-rtx-pro-6000 [reported]" in full and "baseline_tok_s 82.5 tok/s" in full
    assert "D1: Abandon the CUDA-graph verify path" in full and "## Next steps" in full
    assert 'Open because: "architectural limit" was concluded, not measured.\n' in full  # why's first sentence
    assert "D1: Abandon" in build_context(ROOT, budget=700)  # numbers do not crowd out the open decisions
    for budget in (120, 200, 400, 800):
        text = build_context(ROOT, budget=budget)
        assert tokens(text) <= budget
    assert "more:" in build_context(ROOT, budget=200) or "left out" in build_context(ROOT, budget=200)


@pytest.mark.content
def test_context_command():
    runner = CliRunner()
    r = runner.invoke(main, ["--root", str(ROOT), "context", "--budget", "300"])
    assert r.exit_code == 0 and tokens(r.stdout) <= 300 and r.stdout.startswith("# specbook context")
    r = runner.invoke(main, ["--root", str(ROOT), "context", "--budget", "5"])
    assert r.exit_code == 2 and "too small" in r.stderr


@pytest.mark.content
def test_site_builds_without_executed_notebooks(tmp_path):
    """A fresh checkout has no executed notebooks yet (the folder may be missing or empty)."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("executed"))
    shutil.copytree(ROOT / "baselines", tmp_path / "baselines")
    config = (ROOT / "mkdocs.yml").read_text().replace("- specbook/site.py", f"- {ROOT / 'specbook' / 'site.py'}")
    (tmp_path / "mkdocs.yml").write_text(config)
    (tmp_path / "docs" / "runbooks" / "executed").mkdir()
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=tmp_path, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Executed notebook" not in (tmp_path / "site" / "dashboard" / "index.html").read_text()


@pytest.mark.content
def test_search_index_has_the_docs_but_not_the_notebooks(built):
    index = json.loads((built[0] / "search" / "search_index.json").read_text())
    locations = [d["location"] for d in index["docs"]]
    assert "findings/" in locations
    assert not [loc for loc in locations if loc.startswith("runbooks/executed/")]


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs' toc make it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


@pytest.mark.content
def test_docs_links_work_in_plain_markdown_views():
    """Links between docs pages go to files in the repository (not to pages only the site generates, such as
    the dashboard) and to headings they have: GitHub and an agent's checkout show the Markdown as it is."""
    docs = ROOT / "docs"
    texts = {p: p.read_text() for p in [*docs.rglob("*.md"), ROOT / "README.md"]}
    texts[docs / "status.md"] = site.status_page(ROOT)  # as `runbook site` writes it
    dead = []
    for page, text in texts.items():
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)(?:#([^)\s]+))?\)", text):
            if re.match(r"\w+://", target):
                continue
            path = (page.parent / target).resolve()
            if path not in texts and not path.is_file():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", texts.get(path) or
                                                                           path.read_text(), flags=re.M)}:
                dead.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not dead, dead
