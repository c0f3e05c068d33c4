"""Generated parts of the MkDocs site, and the MkDocs hooks that add them at build time.

mkdocs.yml names this file under `hooks:`, so `mkdocs build` adds, without writing into docs/:
- `dashboard.md`: every record in baselines/*.yaml with its verdict badge, hardware, date and a history plot (SVG);
- (committed, written by `runbook site`: `status.md`, `llms.txt`, `llms-full.txt` - see `generated`);
- an admonition on each page whose claims are not fresh (reported, stale, drifted), and the verdict on hover.
"""
from __future__ import annotations

import contextlib
import html
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from specbook import (RunFailed, SpecbookError, claims, headlines, pending, provenance, records, runbooks, verified,
                      verify)
from specbook.execute import EXECUTED
from specbook.fsutil import atomic_write
from specbook.text import md_cell, one_line

VERDICT_ADMONITION = {verify.REPORTED: "info", verify.STALE: "warning", verify.DRIFTED: "danger",
                      verify.FLAKY: "danger", verify.FAILED: "danger"}


@dataclass
class Row:
    runbook: str
    profile: str
    metric: str
    value: float
    unit: str
    direction: str
    tolerance: dict
    verdict: str  # specbook.verify's state, from hashes: current, stale, reported, failed
    stale_why: str  # which inputs changed since it was recorded ("" when its inputs hash is current)
    source: str
    hardware: str
    date: str
    history: list = field(default_factory=list)
    here: bool = False  # whether this machine can re-measure it

    @property
    def inputs_changed(self) -> bool:
        return bool(self.stale_why)

    @property
    def key(self) -> str:
        return f"{self.runbook}/{self.profile}/{self.metric}"


def format_number(value: float) -> str:
    """How the dashboard shows a value: enough digits to read it back exactly as recorded (up to 6)."""
    return f"{value:.6g}"


def _date(value) -> str:
    return records.parse_date(value).strftime("%Y-%m-%d %H:%M") if value else ""


def record_rows(root: Path | str) -> list[Row]:
    """One row per recorded metric of every baselines/*.yaml, with its state (from input hashes; nothing runs)."""
    root = Path(root)
    index = verify.index(root)
    rows = []
    for runbook, rf in records.load_all(root, skip_broken=True).items():  # status names the broken ones
        for profile, prof in rf.data["profiles"].items():
            for name, m in prof["metrics"].items():
                run = records.run_of(prof, m["run"])
                v = index.get(f"{runbook}/{profile}/{name}")
                state = v.state if v else verify.UNRECORDED
                rows.append(Row(runbook, profile, name, m["value"], m["unit"], m["direction"], m.get("tolerance") or {},
                                state, v.inputs if state == verify.STALE else "", run["source"],
                                verify.hardware(profile, run), _date(run["date"]), m.get("history") or [],
                                bool(v and v.here)))
    return rows


# ---------------------------------------------------------------------------------------------- dashboard


def badge(verdict: str, why: str = "") -> str:
    slug = re.sub(r"\W+", "-", verdict).strip("-")
    title = f' title="{html.escape(why)}"' if why else ""
    return f'<span class="verdict verdict-{slug}"{title}>{html.escape(verdict)}</span>'


PANEL_COLUMNS = 4  # small multiples per row of a history plot


def history_svg(rows: list[Row]) -> str:
    """Small multiples of a group's recorded history: one panel per metric, its values over the recorded runs with
    its unit on the y axis, so no two quantities share an axis or a colour. Few ticks and text as SVG text keep the
    build fast (a panel's ticks and glyph paths were most of its cost)."""
    import matplotlib  # noqa: PLC0415 - heavy, only needed when the site is built

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    cols = min(PANEL_COLUMNS, max(1, len(rows)))
    nrows = -(-len(rows) // cols)
    height = 1.6 * nrows + 0.4
    with matplotlib.rc_context({"svg.fonttype": "none", "font.size": 7}):
        fig, axes = plt.subplots(nrows, cols, figsize=(2.2 * cols, height), squeeze=False)
        for ax, row in zip(axes.flat, rows):
            values = [h["value"] for h in row.history] or [row.value]
            ax.plot(range(1, len(values) + 1), values, marker="o", ms=3, lw=1, color="tab:blue")
            ax.set_title(row.metric, fontsize=7)
            ax.set_ylabel(row.unit)
            ax.set_xticks(sorted({1, len(values)}))
            ax.yaxis.set_major_locator(MaxNLocator(nbins=3))
        for ax in list(axes.flat)[len(rows):]:
            ax.set_visible(False)
        fig.supxlabel("recorded run (1 = first, last = the record now)", fontsize=7)
        fig.subplots_adjust(left=0.1, right=0.98, bottom=0.45 / height, top=1 - 0.3 / height, hspace=0.75,
                            wspace=0.6)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
        plt.close(fig)
    return buf.getvalue()


def _badges(row: Row) -> str:
    """The state (with the changed inputs on hover when stale), and where it can be re-measured."""
    where = "" if row.here or row.source == "reported" else " " + badge(f"{row.profile.split('.')[0]} only",
                                                                        "re-measured only on that hardware")
    why = row.stale_why if row.verdict == verify.STALE else verify.MEANING.get(row.verdict, "")
    return badge(row.verdict, why) + where


ARROWS = {"higher": "\u2191", "lower": "\u2193", "none": "="}  # which way is better; "=" any change is drift


def _html(text: str) -> str:
    """Record text inside the dashboard's HTML: escaped, and on one line (a blank line would end the HTML block)."""
    return html.escape(one_line(text))


def _table(rows: list[Row]) -> str:
    head = "<tr><th>metric</th><th>value</th><th>unit</th><th>tolerance</th><th>verdict</th><th>recorded</th></tr>"
    body = []
    for r in rows:
        tol = ", ".join(f"{k} {v:g}" for k, v in r.tolerance.items() if v) or "exact"
        body.append(f'<tr><td>{_html(r.metric)}</td><td class="value" data-record="{_html(r.key)}">'
                    f'{format_number(r.value)}</td><td>{_html(r.unit)} <span title="better: {r.direction}">{ARROWS.get(r.direction, "")}'
                    f"</span></td><td>{tol}</td><td>{_badges(r)}</td><td>{r.date} ({r.source})</td></tr>")
    return f"<table>\n<thead>{head}</thead>\n<tbody>\n" + "\n".join(body) + "\n</tbody>\n</table>"


def dashboard(root: Path | str) -> tuple[str, dict[str, str]]:
    """(dashboard.md text, {docs-relative path: SVG text} of its plots). One function per section."""
    root = Path(root)
    rows = record_rows(root)
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.runbook, r.profile), []).append(r)
    out = _dashboard_intro(rows)
    plots: dict[str, str] = {}
    standing = headlines.standings(root, claims.doc_texts(root))
    if standing:
        out += ["## Headlines", "", *headlines.markdown(root, claims.doc_texts(root)), "",
                "![every recorded value of each headline](dashboard/headlines.svg)", ""]
        plots["dashboard/headlines.svg"] = headlines.history_svg(root, standing)
    for (runbook, profile), group in groups.items():
        out += _dashboard_group(root, runbook, profile, group)
    plots.update({f"dashboard/{rb}-{pf}.svg": history_svg(g) for (rb, pf), g in groups.items()})
    return "\n".join(out) + "\n", plots


def _dashboard_intro(rows: list[Row]) -> list[str]:
    out = ["# Baselines dashboard", "",
           "Every number recorded in `baselines/`, per runbook and hardware profile, with its verdict on this "
           "machine and the history of each number, one panel per metric in its unit. Generated from the records "
           "at build time; see the [runbook guide](runbooks/index.md) for what the verdicts mean and how to "
           "reproduce a number, and the [status page](status.md) for where the docs quote them.", ""]
    return out + (["No records yet: run `runbook run NAME`."] if not rows else [])


def _dashboard_group(root: Path, runbook: str, profile: str, group: list[Row]) -> list[str]:
    """A runbook on a profile: hardware, date, admonitions for numbers that are not fresh, the executed notebook,
    the table and the history plot."""
    latest = max(group, key=lambda r: r.date)
    out = [f"## {runbook} / {profile}", "",
           f"**Hardware:** {_html(latest.hardware)} &nbsp; **Last recorded:** {latest.date}", ""]
    verdicts = {r.verdict for r in group if r.verdict in VERDICT_ADMONITION}
    for v in sorted(verdicts):
        why = {verify.REPORTED: verify.MEANING[verify.REPORTED],
               verify.STALE: _stale_note(runbook, profile, group)}.get(v, f"re-run `runbook verify {runbook}`")
        out += [f'!!! {VERDICT_ADMONITION[v]} "{v.capitalize()}"', f"    Numbers marked *{v}*: {why}.", ""]
    notebook = EXECUTED / f"{runbook}-{profile}.ipynb"  # where `runbook run` keeps the executed notebook
    if (root / notebook).is_file():
        out += [f"Executed notebook: [{notebook.name}]({notebook.relative_to('docs').as_posix()})", ""]
    return out + [_table(group), "", f"![history of {runbook} / {profile}](dashboard/{runbook}-{profile}.svg)", ""]


def _stale_note(runbook: str, profile: str, group: list[Row]) -> str:
    """Why a group's numbers are stale, in words: the changed inputs."""
    reasons = sorted({r.stale_why.removesuffix(" changed") for r in group if r.stale_why})
    note = f"{'; '.join(reasons)} changed since they were recorded"
    return note + f"; re-run `runbook run {runbook} --profile {profile}` on that hardware"


# ---------------------------------------------------------------------------------------------- llms.txt


def _pages(root: Path) -> list[tuple[str, dict, str]]:
    """(docs-relative path, front matter, body) of every docs page."""
    docs = Path(root) / "docs"
    out = []
    for path in claims.doc_files(root):
        if path.is_relative_to(docs):
            text = path.read_text()
            meta, start = claims.split_front_matter(text)
            out.append((path.relative_to(docs).as_posix(), meta or {}, text[start:]))
    return out


def _summary(body: str) -> str:
    paras = [p for p in re.split(r"\n\s*\n", body) if p.strip() and not p.lstrip().startswith(("#", "|", "-", "`"))]
    text = re.sub(r"<!--.*?-->", "", paras[0] if paras else "", flags=re.S)
    return " ".join(text.split())[:200]


def _url(doc_path: str) -> str:
    stem = doc_path.removesuffix(".md")
    return "./" if stem == "index" else (stem.removesuffix("/index") + "/")


def llms_txt(root: Path | str) -> str:
    lines = ["# specbook", "",
             "> The executable knowledge base of an EAGLE-3 speculative-decoding project (a Kimi-K2 drafter moved to "
             "Kimi-K2.5): docs whose numbers are tied to recorded, re-runnable runs.", "",
             "Numbers in these pages are claims tied to records in baselines/; the status page lists each one with "
             "its state (current, stale, reported) and where it was measured. `runbook verify NAME` re-measures.", "",
             "## Docs", ""]
    for path, meta, body in _pages(Path(root)):
        lines.append(f"- [{meta.get('title', path)}]({_url(path)}): {_summary(body)}")
    lines.append("- [Status of every documented number](status/): value, state (current, stale, reported), where "
                 "and when it was measured")
    lines += ["", "## Optional", "", "- [Full text](llms-full.txt): all pages in one file"]
    return "\n".join(lines) + "\n"


def llms_full_txt(root: Path | str) -> str:
    root = Path(root)
    parts = [llms_txt(root)]
    for path, meta, body in _pages(root):
        parts.append(f"\n---\n\n<!-- page: docs/{path} status: {meta.get('status')} updated: {meta.get('updated')} -->"
                     f"\n\n{body.strip()}\n")
    _, start = claims.split_front_matter(status := status_page(root))
    parts.append(f"\n---\n\n<!-- page: {STATUS_PAGE.as_posix()} (generated) -->\n\n{status[start:].strip()}\n")
    return "".join(parts)


# ---------------------------------------------------------------------------------------------- status page

STATUS_PAGE = Path("docs") / "status.md"


class UnknownHere(RunFailed):
    """An input the records are hashed against cannot be hashed on this machine (missing and not to be fetched, or
    damaged): the committed pages would record this machine's problem, so none is written or checked here."""


def check_inputs_here(root: Path) -> None:
    """Raise UnknownHere unless every input the runbooks declare hashes here (project.offline: without fetching)."""
    declared = set()
    for name in runbooks.discover(root):
        with contextlib.suppress(SpecbookError):  # a broken runbook is reported as failed, the same everywhere
            declared.update(runbooks.load(root, name).inputs)
    for name in sorted(declared):
        try:
            provenance.input_fingerprint(root, name)
        except RunFailed as e:
            raise UnknownHere(f"{STATUS_PAGE} not written nor checked: {e} (unknown here: a problem of this machine, "
                              "not of the records; the committed page keeps what the records say)") from None


@dataclass
class Quoted:
    """One documented number: a record's metric (or one run of it, pinned), where the docs quote it, its state."""
    runbook: str
    label: str  # profile/metric, with @RUN when pinned
    literals: list[str]
    unit: str
    state: str
    why: str  # stale: which inputs changed
    measured: str  # date, hardware, commit
    verified: str  # the last saved verify (specbook.verified.describe)
    places: list[str] = field(default_factory=list)  # Markdown links (docs) or code spans (README) of each quote
    date: str = ""
    quotes: int = 0  # claim markers quoting it (two on one line share a place)


def status_numbers(root: Path, index: dict[str, verify.Verdict]) -> list[Quoted]:
    """Every number the docs and README quote, once per record metric (or pinned run) with all its places."""
    last = _last_verified(root)
    out: dict[str, Quoted] = {}
    cache: dict = {}
    for path in [*claims.doc_files(root), *claims.extra_files(root)]:
        if path.resolve() == (root / STATUS_PAGE).resolve():
            continue
        rel = path.relative_to(root).as_posix()
        for c in claims.parse_claims(path.read_text(), rel)[0]:
            link = os.path.relpath(root / rel, (root / STATUS_PAGE).parent)
            place = f"[{rel.removeprefix('docs/')}:{c.line}]({link})" if rel.startswith("docs/") else f"`{rel}:{c.line}`"
            q = out.get(c.label) or _quoted(root, c, index.get(c.key), last, cache)
            out[c.label] = q
            q.quotes += 1
            if place not in q.places:  # two quotes on one line: one place
                q.places.append(place)
            if c.literal not in q.literals:
                q.literals.append(c.literal)
    return list(out.values())


def _quoted(root: Path, c, v, last: dict[str, str], cache: dict) -> Quoted:
    label = c.label.removeprefix(f"{c.runbook}/")
    if v is None:
        return Quoted(c.runbook, label, [], "", verify.UNRECORDED, "", "-", "-")
    if c.run and (run := claims.pinned_run(root, c, cache)) is not None:
        commit = str((run.get("provenance") or {}).get("git_commit") or "-")[:10]
        return Quoted(c.runbook, label, [], v.unit, claims.PINNED, "",
                      f"{str(run.get('date'))[:10]}, {verify.hardware(c.profile, run)}, `{commit}`", "-")
    why = v.inputs if v.state == verify.STALE else ""
    if v.state == verify.STALE and (o := pending.owed(root, c.profile, here="-")):
        why = f"{why}; {o.words()}"
    return Quoted(c.runbook, label, [], v.unit, v.state, why, f"{v.date[:10]}, {v.hardware}, `{v.commit or '-'}`",
                  last.get(c.key, "-"), date=v.date[:10])


def _row(cells: list[str]) -> str:
    """A Markdown table row, each cell escaped where it is written (specbook.text.md_cell): a record's unit or name
    may hold a `|` or a newline, which would start another cell or row."""
    return "| " + " | ".join(md_cell(str(x)) for x in cells) + " |"


def _status_front(numbers: list[Quoted]) -> list[str]:
    newest = max((q.date for q in numbers), default="") or "-"
    return ["---", "title: Status of every documented number", "status: generated", f"updated: {newest}",
            "runbooks: []", "records: []", "---", "", "# Status of every documented number", ""]


def _status_intro() -> list[str]:
    return ["Generated by `runbook site` from `baselines/` and the claims in `docs/` and `README.md`: do not edit. "
            "CI fails when it is out of date. A state here is from input hashes only (runbook, parameters, engine "
            "code, pinned inputs, upstream records), the same on every machine; `runbook verify NAME` re-measures "
            "what a machine can run and says **fresh**, **drifted** or **flaky**.", "",
            "- " + "; ".join(f"**{s}**: {verify.MEANING[s]}" for s in (verify.CURRENT, verify.STALE,
                                                                         verify.REPORTED))
            + f"; **{claims.PINNED}**: {claims.PINNED_MEANING}",
            "- Re-measured: `cpu` numbers by CI on every submission; `h200` numbers by `runbook verify --profile "
            "h200` on a lent H200; `8x-rtx-pro-6000` numbers are reported, never re-run.",
            f"- Last verified: the verdict of the last `runbook verify --save` that re-measured the number, when, on "
            f"what, at which commit (`{verified.PATH.as_posix()}`, committed); `-`: no saved verify yet.", ""]


def _status_counts(numbers: list[Quoted], recorded: int) -> list[str]:
    """The counts of this page (numbers the docs quote) and why they differ from `runbook status`'s (metrics)."""
    counts = {s: sum(q.state == s for q in numbers) for s in (*verify.STATES, claims.PINNED)}
    places = sum(q.quotes for q in numbers)
    return [f"Counts of the numbers the docs quote, each once however often it is quoted ({places} quotes): "
            + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f". `runbook status` counts something else: "
            f"every recorded metric ({recorded}), quoted or not, one per runbook, profile and metric; a pinned "
            "quote is a run of a metric, counted here apart.", ""]


def _status_tables(numbers: list[Quoted]) -> list[str]:
    """One section per runbook (its anchor is the runbook's name), a row per number."""
    out: list[str] = []
    for runbook in sorted({q.runbook for q in numbers}):
        out += [f"## {runbook}", "", "| number | value | state | quoted at | measured | last verified |",
                "|---|---|---|---|---|---|"]
        for q in (q for q in numbers if q.runbook == runbook):
            shown_unit = q.unit and not (q.unit == "fraction" and all(x.endswith("%") for x in q.literals))
            value = " / ".join(q.literals) + (f" {q.unit}" if shown_unit else "")
            state = f"**{q.state}**" + (f": {q.why}" if q.why else "")
            out.append(_row([f"`{q.label}`", value, state, ", ".join(q.places), q.measured, q.verified]))
        out.append("")
    return out


def status_page(root: Path | str) -> str:
    """docs/status.md: every number the docs and README quote, with its value, state from input hashes (the same
    on every machine: nothing runs), where it is quoted, the run that measured it and its last saved verify.
    Generated; CI fails when it is out of date. One function per section."""
    root = Path(root)
    check_inputs_here(root)  # an input this machine cannot hash fails here, never reads "failed" in the page
    index = verify.index(root, here="-")  # "-": no machine's view; where a number can be re-measured is the intro's
    numbers = status_numbers(root, index)
    parts = [_status_front(numbers), _status_intro(), _status_counts(numbers, len(index)), headline_section(root),
             _status_tables(numbers)]
    return "\n".join(line for part in parts for line in part).rstrip("\n") + "\n"


def _last_verified(root: Path) -> dict[str, str]:
    """Each number's last verify (`runbook verify --save`: specbook/verified.py), in words, by key."""
    runs = {f"{n}/{p}/{m}": e.get("run") for n, rf in records.load_all(root, skip_broken=True).items()
            for p, prof in rf.data["profiles"].items() for m, e in prof["metrics"].items()}
    return {k: verified.describe(e, runs.get(k)) for k, e in verified.load(root).items()}


def headline_section(root: Path) -> list[str]:
    """The headlines (headlines.yaml) first: where each stands against its best and its goal."""
    rows = headlines.markdown(root, claims.doc_texts(root))
    if len(rows) <= 2:
        return []
    return ["## Headlines", "",
            "The numbers the mission stands on, each against the best its record's history holds and its goal "
            "(`headlines.yaml`). A headline down by more than its noise must be explained in the docs "
            "(`<!-- regression: KEY@RUN -->`), or CI fails.", "", *rows, ""]



def generated(root: Path | str) -> dict[Path, str]:
    """The committed generated files and their expected text: the status page and the agents' llms files."""
    root = Path(root)
    return {root / STATUS_PAGE: status_page(root), root / "docs" / "llms.txt": llms_txt(root),
            root / "docs" / "llms-full.txt": llms_full_txt(root)}


def out_of_date(root: Path | str) -> list[Path]:
    return [p for p, text in generated(root).items() if not p.is_file() or p.read_text() != text]


def write_generated(root: Path | str) -> list[Path]:
    """Write the generated files that changed (atomically); returns them."""
    changed = out_of_date(root)
    texts = generated(root)
    for p in changed:
        atomic_write(p, texts[p].encode())
    return changed


# ---------------------------------------------------------------------------------------------- MkDocs hooks


def _root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def on_files(files, config):
    from mkdocs.structure.files import File  # noqa: PLC0415 - only inside a MkDocs build

    root = _root(config)
    text, plots = dashboard(root)
    files.append(File.generated(config, "dashboard.md", content=text))
    for path, svg in plots.items():
        files.append(File.generated(config, path, content=svg))
    return files


def on_page_markdown(markdown, page, config, files):
    """Claims and citations rendered as spans that show their record and verdict on hover (the markers are block
    comments to Markdown and would split paragraphs), and an admonition for numbers that are not fresh."""
    root, cache, flagged, edits = _root(config), {}, {}, []
    for c in claims.parse_claims(markdown, page.file.src_uri)[0]:
        verdict = (f"as run {c.run} measured it" if c.run
                   else claims.record_verdict(root, c.runbook, c.profile, c.metric, cache))
        if verdict in VERDICT_ADMONITION:
            flagged.setdefault(verdict, set()).add(f"{c.runbook}/{c.profile}")
        title = html.escape(f"{c.key}: {verdict}")
        edits.append((*c.marker, f'<span class="claim" title="{title}">{c.literal}</span>'))
    for m in claims.CHECK_RE.finditer(claims.prose_mask(markdown)):
        edits.append((m.start(), m.end(), f'<span class="check" title="checked: {html.escape(m.group("expr"))}">'
                                          f'{markdown[m.start("text"):m.end("text")]}</span>'))
    for m in claims.CITE_RE.finditer(claims.prose_mask(markdown)):
        edits.append((m.start(), m.end(), f'<span class="cite" title="{html.escape(m.group("source"))}">'
                                          f'{markdown[m.start("text"):m.end("text")]}</span>'))
    for start, end, new in sorted(edits, reverse=True):
        markdown = markdown[:start] + new + markdown[end:]
    if not flagged:
        return markdown
    up = "../" * page.file.src_uri.count("/")
    notes = []
    for verdict, where in sorted(flagged.items()):
        notes += [f'!!! {VERDICT_ADMONITION[verdict]} "Some numbers here are {verdict}"',
                  f"    Numbers from {', '.join(f'`{w}`' for w in sorted(where))} are *{verdict}*; "
                  f"see the [dashboard]({up}dashboard.md) for their source and date.", ""]
    head, _, rest = markdown.partition("\n")
    if head.startswith("# "):
        return head + "\n\n" + "\n".join(notes) + "\n" + rest
    return "\n".join(notes) + "\n" + markdown


def on_page_content(html_text, page, config, files):
    """Executed notebooks stay out of the search index: their code and outputs are thousands of odd tokens that
    drown the docs in results (and tripped lunr's wildcard search); the dashboard links them."""
    if page.file.src_uri.startswith(EXECUTED.relative_to("docs").as_posix() + "/"):
        page.meta["search"] = {"exclude": True}
    return html_text
