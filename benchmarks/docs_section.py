"""The one writer of generated text in docs/: a ``## heading`` section of a markdown file,
or the text between two marker lines, leaving the rest of the file alone. Every script in
benchmarks/ writes through it, into its topic's page under ``docs/benchmarks/`` (``PAGES``;
the index is ``docs/benchmarks/README.md``) or into a page of ``docs/`` (``DOCS``)."""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = DOCS / "benchmarks"


def replace_section(heading: str, body: str, doc: Path) -> None:
    """Replace (or append) the section ``## heading`` of ``doc`` with ``body``."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"## {heading}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: block + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + block
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text.rstrip() + "\n")


def with_marked(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with the lines between ``begin`` and ``end`` replaced by ``body`` (the pair
    appended at the end when missing)."""
    if begin not in text:
        text = text.rstrip() + f"\n\n{begin}\n{end}\n"
    pre, rest = text.split(begin, 1)
    post = rest.split(end, 1)[1]
    return pre + begin + "\n" + body + end + post


def replace_marked(begin: str, end: str, body: str, doc: Path, title: str = "# Benchmarks") -> None:
    """Replace the text between the lines ``begin`` and ``end`` of ``doc`` with ``body``
    (appending the pair, or creating ``doc`` under ``title``, when missing)."""
    text = doc.read_text() if doc.exists() else f"{title}\n\n{begin}\n{end}\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(with_marked(text, begin, end, body))


def host() -> str:
    """The machine a section was measured on, as its text says it: ``"2 cores (load average
    9.3 at the end, from other jobs)"``."""
    return f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f} at the end, from other jobs)"
