"""Text from run records made safe for a Markdown verdict (for the terminal: kvbench.console.visible).

    markdown_text(s)  -> one line of Markdown that renders as the literal text (no link, image, HTML, table cell
                         break, heading or emphasis; line breaks become spaces; control characters as \\xNN)

A run's `error` text, a model or method name, a folder name: any of them can hold what a user (or an exception
message) put there, so kvbench-compare's Markdown (pasted into a CI summary) passes them through this first. JSON
output keeps the raw text.
"""
from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_MD_SPECIAL = re.compile(r"([\\`*\[\]<>|!#~])")
_AUTOLINK = re.compile(r"(?i)\b(https?|ftp|file|mailto|javascript|data)(:)|\b(www)(\.)")
_ZWSP = "\u200b"  # breaks GitHub's bare-URL autolinks without changing what is read


def markdown_text(text: object) -> str:
    """One line of literal Markdown text (see the module docstring)."""
    s = " ".join(str(text).replace("\r", " ").split("\n"))
    s = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", s)
    s = _MD_SPECIAL.sub(r"\\\1", s)
    s = s.replace("&", "&amp;")  # no HTML entities
    return _AUTOLINK.sub(lambda m: (m.group(1) or m.group(3)) + _ZWSP + (m.group(2) or m.group(4)), s)

