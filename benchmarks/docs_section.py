"""Write one ``## heading`` section of docs/benchmarks.md, leaving the others alone."""
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
