"""The one writer of generated text in docs/: a ``## heading`` section of a markdown file
(docs/benchmarks.md by default), or the text between two marker lines, leaving the rest
of the file alone. Every script in benchmarks/ writes through it."""
from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def replace_section(heading: str, body: str, doc: Path = DOC) -> None:
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


def replace_marked(begin: str, end: str, body: str, doc: Path, title: str = "# Benchmarks") -> None:
    """Replace the text between the lines ``begin`` and ``end`` of ``doc`` with ``body``
    (appending the pair, or creating ``doc`` under ``title``, when missing)."""
    text = doc.read_text() if doc.exists() else f"{title}\n\n{begin}\n{end}\n"
    if begin not in text:
        text = text.rstrip() + f"\n\n{begin}\n{end}\n"
    pre, rest = text.split(begin, 1)
    post = rest.split(end, 1)[1]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(pre + begin + "\n" + body + end + post)
