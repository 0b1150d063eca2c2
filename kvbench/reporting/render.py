"""Render a report (sections of tables and plots) as Markdown (plots as PNG files beside it) and as one
self-contained HTML file (plots embedded as base64 PNG, inline CSS, no scripts, nothing fetched from the network).

A report is a list of Section; a table cell is a str, or a (text, href) pair for a link.
"""
from __future__ import annotations

import base64
import hashlib
import html
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union
from urllib.parse import quote

Cell = Union[str, tuple]


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Cell]]
    numeric: tuple = ()  # columns aligned right
    keep: tuple = (0,)  # columns kept even when empty

    def without_empty(self) -> "Table":
        """The table without the columns whose cells are all empty (e.g. decode tok/s of perplexity runs)."""
        cols = [i for i in range(len(self.columns))
                if i in self.keep or any(_text(row[i]).strip() for row in self.rows)]
        return Table(self.title, [self.columns[i] for i in cols], [[row[i] for i in cols] for row in self.rows],
                     tuple(j for j, i in enumerate(cols) if i in self.numeric),
                     tuple(j for j, i in enumerate(cols) if i in self.keep))


def _text(cell: Cell) -> str:
    return str(cell[0]) if isinstance(cell, tuple) else str(cell)


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)  # paragraphs (plain text; `code` allowed)
    tables: list[Table] = field(default_factory=list)
    plots: list[tuple] = field(default_factory=list)  # (title, png bytes)
    verdict: Optional[tuple] = None  # (verdict, summary) of the paper's claims, shown first
    verdicts: list = field(default_factory=list)  # claims.Verdict per claim (for --json and the terminal)


# Cells whose whole text is a verdict are coloured in the HTML.
VERDICT_CLASS = {"reproduced": "good", "not reproduced": "bad", "inconclusive": "unsure", "not run": "none",
                 "no claims": "none"}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "plot"


MAX_FILE_STEM = 96  # plot file names stay far below the 255 bytes a file system allows


def plot_file(section: str, plot: str) -> str:
    """A plot's file name: the section's and the plot's slugs, cut to MAX_FILE_STEM characters with a hash of the
    whole (so two long titles never share a file)."""
    stem = f"{_slug(section)}_{_slug(plot)}"
    if len(stem) > MAX_FILE_STEM:
        stem = stem[:MAX_FILE_STEM - 11].rstrip("_") + "_" + hashlib.sha1(stem.encode()).hexdigest()[:10]
    return stem + ".png"


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|])")


def md_escape(text: Any, one_line: bool = True) -> str:
    """Text for Markdown that renders as itself: HTML escaped (as report.html does: <, >, &), the characters that
    make emphasis, code, links or table cells backslash-escaped, on one line."""
    text = " ".join(str(text).split()) if one_line else str(text).replace("\n", " ")
    return _MD_SPECIAL.sub(r"\\\1", html.escape(text, quote=False))


def _md_inline(text: str) -> str:
    """A paragraph: escaped, except `code` spans (shown as code; a backtick inside ends it)."""
    parts = re.split(r"(`[^`]+`)", " ".join(str(text).split()))
    return "".join(p if p.startswith("`") and p.endswith("`") and len(p) > 1 else md_escape(p, one_line=False)
                   for p in parts)


def _md_href(href: str) -> str:
    return quote(str(href), safe="/._-~%#:")


def _md_cell(cell: Cell) -> str:
    if isinstance(cell, tuple):
        text, href = cell
        return f"[{md_escape(text)}]({_md_href(href)})" if href else md_escape(text)
    return md_escape(cell)


def to_markdown(title: str, intro: list[str], sections: list[Section], out_dir: str) -> str:
    """Markdown text; each plot is written to out_dir/plots/<section>_<plot>.png and linked."""
    os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)
    lines = [f"# {md_escape(title)}", "", *(_md_inline(p) + "  " for p in intro), ""]
    for sec in sections:
        lines += [f"## {md_escape(sec.title)}", ""]
        if sec.verdict:
            lines += [f"**Verdict: {md_escape(sec.verdict[0])}** ({md_escape(sec.verdict[1])})", ""]
        lines += [*(f"{_md_inline(line)}  " for line in sec.lines), ""] if sec.lines else []
        for table in sec.tables:
            table = table.without_empty()
            if table.title:
                lines += [f"### {md_escape(table.title)}", ""]
            lines.append("| " + " | ".join(md_escape(c) for c in table.columns) + " |")
            lines.append("| " + " | ".join("---:" if i in table.numeric else "---"
                                           for i in range(len(table.columns))) + " |")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.rows]
            lines.append("")
        for plot_title, png in sec.plots:
            name = f"plots/{plot_file(sec.title, plot_title)}"
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(png)
            lines += [f"![{md_escape(plot_title)}]({_md_href(name)})", ""]
    return "\n".join(lines) + "\n"


CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; border-bottom: 1px solid #ccc; padding-top: 12px; }
h3 { font-size: 15px; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0 16px 0; }
th, td { border: 1px solid #ccc; padding: 3px 6px; } th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafafa; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; }
.plots figure { margin: 0; } figcaption { font-size: 12px; color: #555; }
p { font-size: 13px; margin: 4px 0; } code { background: #f3f3f3; padding: 0 3px; }
td.good, p.verdict.good { background: #d9f2d9 !important; } td.bad, p.verdict.bad { background: #f8d7d7 !important; }
td.none, p.verdict.none { background: #eeeeee !important; }
td.unsure, p.verdict.unsure { background: #fbeec2 !important; } p.verdict { padding: 4px 8px; display: inline-block; }
"""


def _inline(text: str) -> str:
    escaped = html.escape(text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)


def _html_cell(cell: Cell) -> str:
    if isinstance(cell, tuple):
        text, href = cell
        return f'<a href="{html.escape(href)}">{html.escape(str(text))}</a>' if href else html.escape(str(text))
    return html.escape(str(cell))


def _td_class(i: int, cell: Cell, table: Table) -> str:
    if isinstance(cell, str) and cell in VERDICT_CLASS:
        return f' class="{VERDICT_CLASS[cell]}"'
    return " class=num" if i in table.numeric else ""


def to_html(title: str, intro: list[str], sections: list[Section]) -> str:
    out: list[Any] = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
                      f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
                      f"<h1>{html.escape(title)}</h1>", *(f"<p>{_inline(p)}</p>" for p in intro)]
    toc = "".join(f'<li><a href="#{_slug(s.title)}">{html.escape(s.title)}</a></li>' for s in sections)
    out.append(f"<ul>{toc}</ul>")
    for sec in sections:
        out.append(f'<h2 id="{_slug(sec.title)}">{html.escape(sec.title)}</h2>')
        if sec.verdict:
            out.append(f'<p class="verdict {VERDICT_CLASS.get(sec.verdict[0], "none")}">Verdict: '
                       f"<b>{html.escape(sec.verdict[0])}</b> ({html.escape(sec.verdict[1])})</p>")
        out += [f"<p>{_inline(line)}</p>" for line in sec.lines]
        for table in sec.tables:
            table = table.without_empty()
            if table.title:
                out.append(f"<h3>{html.escape(table.title)}</h3>")
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in table.columns) + "</tr>")
            for row in table.rows:
                out.append("<tr>" + "".join(
                    f'<td{_td_class(i, c, table)}>{_html_cell(c)}</td>' for i, c in enumerate(row)) + "</tr>")
            out.append("</table>")
        if sec.plots:
            out.append('<div class="plots">')
            for plot_title, png in sec.plots:
                data = base64.b64encode(png).decode("ascii")
                out.append(f'<figure><img alt="{html.escape(plot_title)}" src="data:image/png;base64,{data}">'
                           f"<figcaption>{html.escape(plot_title)}</figcaption></figure>")
            out.append("</div>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
