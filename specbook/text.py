"""Record fields written into lines and table cells: a hand-edited unit or name must stay in its cell.

A field read from a record (a unit, a metric or profile name, a GPU name, a description) may hold a newline, a
terminal escape or a `|`; written as it is, it starts a new line of `runbook show`, a new row of docs/status.md, or
a new column. The writers of lines and cells pass what they write through these, at the point of writing."""

from __future__ import annotations

import unicodedata


def one_line(text: object) -> str:
    """`text` on one line: control characters and line or paragraph separators as their escapes (`\\n`, `\\x1b`)."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(ch if ch == " " or unicodedata.category(ch) not in ("Cc", "Zl", "Zp")
                   else ch.encode("unicode_escape").decode("ascii") for ch in s)


def md_cell(text: object) -> str:
    """`text` as one cell of a Markdown table row: on one line, and `|` escaped so that it does not end the cell."""
    return one_line(text).replace("|", "\\|")
