"""The Lab's catalog lines: each experiment's README header (Status / Question / Answer) and the
summary table lab/README.md shows, rendered from those headers so it cannot drift from them.

An experiment's README.md begins exactly like this (blank lines between them are allowed):

    # <Title>

    Status: open | answered | graduated
    Question: <one sentence>
    Answer: <one line with the key number(s)>

A README without these lines (or with another status) is read as status "?" with a warning naming
the file: listing the lab never fails on one experiment's README.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mlxbun.errors import MlxbunError

__all__ = ["STATUSES", "TABLE_BEGIN", "TABLE_END", "ExperimentHeader", "read_header", "render_readme",
           "summary_table"]

STATUSES = ("open", "answered", "graduated")
TABLE_BEGIN = "<!-- lab-summary:begin (rendered by `mlxbun lab table --write`; do not edit by hand) -->"
TABLE_END = "<!-- lab-summary:end -->"
_FIELDS = ("Status", "Question", "Answer")


@dataclass
class ExperimentHeader:
    name: str  # the experiment's directory name
    readme: Path | None
    title: str = ""
    status: str = "?"  # one of STATUSES, or "?" when the header is missing or malformed
    question: str = ""
    answer: str = ""
    warning: str | None = None  # why the header could not be read (names the file)


def read_header(name: str, readme: Path | None) -> ExperimentHeader:
    """The header of experiment `name`'s README (None or missing: status "?" with a warning)."""
    h = ExperimentHeader(name, readme)
    if readme is None or not Path(readme).is_file():
        h.warning = f"lab/{name}: no README.md (expected a '# Title' then Status/Question/Answer lines)"
        return h
    try:
        lines = [ln.strip() for ln in Path(readme).read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        h.warning = f"{readme}: cannot be read ({e})"
        return h
    lines = [ln for ln in lines if ln][:4]
    if not lines or not lines[0].startswith("# "):
        h.warning = f"{readme}: does not begin with a '# Title' line"
        return h
    h.title = lines[0][2:].strip()
    values = {}
    for field, line in zip(_FIELDS, lines[1:]):
        m = re.match(rf"{field}:\s*(.*)$", line)
        if m is None or not m.group(1).strip():
            h.warning = f"{readme}: line after the title should be '{field}: ...', found {line!r}"
            return h
        values[field] = m.group(1).strip()
    if len(values) < len(_FIELDS):
        missing = ", ".join(f for f in _FIELDS if f not in values)
        h.warning = f"{readme}: the header lacks {missing}"
        return h
    h.question, h.answer = values["Question"], values["Answer"]
    status = values["Status"].lower()
    if status not in STATUSES:
        h.warning = f"{readme}: Status {values['Status']!r} is not one of {', '.join(STATUSES)}"
        return h
    h.status = status
    return h


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or "-"


def summary_table(headers: list[ExperimentHeader]) -> str:
    """lab/README.md's summary table: one row per experiment (name, status, question, answer, README link)."""
    out = ["| experiment | status | question | answer | README |", "|---|---|---|---|---|"]
    for h in sorted(headers, key=lambda h: h.name):
        out.append(f"| {_cell(h.name)} | {_cell(h.status)} | {_cell(h.question)} | {_cell(h.answer)} | "
                   f"[{h.name}/README.md]({h.name}/README.md) |")
    return "\n".join(out)


def render_readme(text: str, headers: list[ExperimentHeader]) -> str:
    """`text` (lab/README.md) with the part between TABLE_BEGIN and TABLE_END replaced by the summary table."""
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        raise MlxbunError(f"lab/README.md: no summary table markers ({TABLE_BEGIN!r} ... {TABLE_END!r})")
    return text[:begin + len(TABLE_BEGIN)] + "\n" + summary_table(headers) + "\n" + text[end:]
