"""Render a report (sections of tables and plots) as Markdown (plots as PNG files beside it) and as one
self-contained HTML file (plots embedded as base64 PNG, inline CSS, no scripts, nothing fetched from the network).

A report is a list of Section; a table cell is a str, or a (text, href) pair for a link.
"""
from __future__ import annotations

import base64
import html
import os
import re
from dataclasses import dataclass, field
from typing import Any, Union

Cell = Union[str, tuple]


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Cell]]
    numeric: tuple = ()  # columns aligned right


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)  # paragraphs (plain text; `code` allowed)
    tables: list[Table] = field(default_factory=list)
    plots: list[tuple] = field(default_factory=list)  # (title, png bytes)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "plot"


def _md_cell(cell: Cell) -> str:
    if isinstance(cell, tuple):
        text, href = cell
        return f"[{text}]({href})" if href else str(text)
    return str(cell).replace("|", "\\|")


def to_markdown(title: str, intro: list[str], sections: list[Section], out_dir: str) -> str:
    """Markdown text; each plot is written to out_dir/plots/<section>_<plot>.png and linked."""
    os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)
    lines = [f"# {title}", "", *intro, ""]
    for sec in sections:
        lines += [f"## {sec.title}", ""]
        lines += [*(f"{line}  " for line in sec.lines), ""] if sec.lines else []
        for table in sec.tables:
            if table.title:
                lines += [f"### {table.title}", ""]
            lines.append("| " + " | ".join(table.columns) + " |")
            lines.append("| " + " | ".join("---:" if i in table.numeric else "---"
                                           for i in range(len(table.columns))) + " |")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table.rows]
            lines.append("")
        for plot_title, png in sec.plots:
            name = f"plots/{_slug(sec.title)}_{_slug(plot_title)}.png"
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(png)
            lines += [f"![{plot_title}]({name})", ""]
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
"""


def _inline(text: str) -> str:
    escaped = html.escape(text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)


def _html_cell(cell: Cell) -> str:
    if isinstance(cell, tuple):
        text, href = cell
        return f'<a href="{html.escape(href)}">{html.escape(str(text))}</a>' if href else html.escape(str(text))
    return html.escape(str(cell))


def to_html(title: str, intro: list[str], sections: list[Section]) -> str:
    out: list[Any] = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
                      f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
                      f"<h1>{html.escape(title)}</h1>", *(f"<p>{_inline(p)}</p>" for p in intro)]
    toc = "".join(f'<li><a href="#{_slug(s.title)}">{html.escape(s.title)}</a></li>' for s in sections)
    out.append(f"<ul>{toc}</ul>")
    for sec in sections:
        out.append(f'<h2 id="{_slug(sec.title)}">{html.escape(sec.title)}</h2>')
        out += [f"<p>{_inline(line)}</p>" for line in sec.lines]
        for table in sec.tables:
            if table.title:
                out.append(f"<h3>{html.escape(table.title)}</h3>")
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in table.columns) + "</tr>")
            for row in table.rows:
                out.append("<tr>" + "".join(
                    f'<td{" class=num" if i in table.numeric else ""}>{_html_cell(c)}</td>'
                    for i, c in enumerate(row)) + "</tr>")
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
