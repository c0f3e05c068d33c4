"""Docs that drift from the project without a number changing: a page's `updated:` date behind its last edit, an
executed notebook's name that runbooks do not write, a sample count the runbooks do not use, a pair named after a
profile that does not exist. Claims and checks hold the measured numbers; these hold the rest that can be checked."""
import re
import subprocess
from pathlib import Path

import pytest

from specbook import claims
from specbook.runbooks import discover, known_profiles, load

pytestmark = pytest.mark.content

ROOT = Path(__file__).resolve().parents[1]
CLAIM_LITERAL = re.compile(r"(<!-- claim: [^>]*?-->).*?(<!-- /claim -->)", re.S)


def _pages() -> list[Path]:
    """The docs pages people write (the generated status page follows the records, not an author)."""
    return [p for p in claims.doc_files(ROOT)
            if p.is_relative_to(ROOT / "docs") and (claims.split_front_matter(p.read_text())[0] or {}).get("status")
            != "generated"]


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def last_edit(page: Path) -> str | None:
    """The date of the last commit that changed the page other than in its claim literals (`runbook run --record`
    rewrites those and leaves `updated:` alone)."""
    rel = page.relative_to(ROOT).as_posix()
    log = _git("log", "--format=%H %cs", "--", rel)
    for line in (log or "").splitlines():
        commit, date = line.split()
        after, before = _git("show", f"{commit}:{rel}"), _git("show", f"{commit}^:{rel}")
        if before is None or CLAIM_LITERAL.sub(r"\1\2", after or "") != CLAIM_LITERAL.sub(r"\1\2", before):
            return date
    return None


def test_every_pages_updated_date_is_not_older_than_its_last_edit():
    if _git("rev-parse", "HEAD") is None:
        pytest.skip("needs the git history (a checkout, not an archive)")
    behind = []
    for page in _pages():
        updated = str((claims.split_front_matter(page.read_text())[0] or {}).get("updated"))
        edited = last_edit(page)
        if edited and updated < edited:
            behind.append(f"{page.relative_to(ROOT)}: updated {updated}, last edited {edited}")
    assert not behind, behind


def test_executed_notebook_names_in_the_docs_are_the_ones_runbooks_write():
    """`runbook run` writes NAME-PROFILE.ipynb (specbook/execute.py); a name in the docs is that pattern or a file."""
    executed = ROOT / "docs" / "runbooks" / "executed"
    wrong = []
    for page in [*_pages(), ROOT / "README.md", ROOT / "AGENTS.md"]:
        for name in re.findall(r"([\w.-]+)\.ipynb", page.read_text()):
            if name != "NAME-PROFILE" and not (executed / f"{name}.ipynb").is_file():
                wrong.append(f"{page.relative_to(ROOT)}: {name}.ipynb")
    assert not wrong, wrong


def _sample_counts(runbook: str) -> set[int]:
    """Every sample count a runbook uses: its `samples` / `sample_counts` parameters and each profile's values."""
    rb = load(ROOT, runbook)
    values = [p.default for n, p in rb.parameters.items() if n in ("samples", "sample_counts")]
    values += [v for prof in rb.profiles.values() for k, v in prof.items() if k in ("samples", "sample_counts")]
    return {int(x) for v in values for x in (v if isinstance(v, list) else [v]) if isinstance(x, int)}


def test_sample_counts_in_the_docs_are_the_runbooks():
    """A count of training samples in prose ("fine-tuning drafter A on 1024 samples") is one its runbook uses: the
    one a paragraph's runbook link names, or any runbook's where the paragraph names none."""
    everything = set().union(*(_sample_counts(n) for n in discover(ROOT)))
    wrong = []
    for page in _pages():
        current = None
        for para in re.split(r"\n\s*\n", claims.prose_mask(page.read_text())):
            if linked := re.findall(r"runbooks/index\.md#([\w-]+)", para):
                current = linked[0]
            elif para.lstrip().startswith("#"):
                current = None
            allowed = _sample_counts(current) if current in discover(ROOT) else everything
            for n in re.findall(r"(?<![\w.,])(\d+)\s+(?:(?:B|K2\.5|training|regenerated)\s+)?samples\b", para):
                if int(n) not in allowed:
                    wrong.append(f"{page.relative_to(ROOT)}: {n} samples ({current or 'no runbook'}: "
                                 f"{sorted(allowed)})")
    assert not wrong, wrong


def test_pairs_are_named_after_profiles():
    """"the `h200` pair": the models a profile trains; a name that is no profile (a preset's) is another word."""
    known = known_profiles(ROOT)
    wrong = [f"{p.relative_to(ROOT)}: `{name}` pair" for p in [*_pages(), ROOT / "README.md"]
             for name in re.findall(r"`([\w.-]+)`\s+pair", p.read_text()) if name not in known]
    assert not wrong, wrong
