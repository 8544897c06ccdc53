"""The benchmark pages (docs/benchmarks/) and what is generated from them: the headline
table and contents of docs/benchmarks/README.md and README.md's "Where compression wins"
are what ``python -m benchmarks.headlines`` writes from docs/benchmarks/results.json, whose
figures are still on their pages; every link resolves; benchmarks/README.md lists every
script. Reads files only (no benchmark runs)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import headlines

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "benchmarks"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_generated_blocks_and_recorded_results_are_up_to_date(capsys):
    assert headlines.main(["--check"]) == 0, capsys.readouterr().err


def test_check_names_a_figure_its_page_no_longer_shows(tmp_path, monkeypatch, capsys):
    data = json.loads(headlines.RESULTS.read_text())
    data["results"]["step_vs_ddp_epyc"]["values"]["1 Gbit/s"]["efsgd-topk1%"] = "0.17"
    stale = tmp_path / "results.json"
    stale.write_text(json.dumps(data))
    monkeypatch.setattr(headlines, "RESULTS", stale)
    assert headlines.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "step_vs_ddp_epyc: 1 Gbit/s / efsgd-topk1% = 0.17 is not in" in err
    assert "the headlines block of docs/benchmarks/README.md is out of date" in err


def _markdown_files():
    return sorted(PAGES.glob("*.md")) + [ROOT / "README.md", ROOT / "docs" / "benchmarks.md",
                                         ROOT / "benchmarks" / "README.md"]


@pytest.mark.parametrize("doc", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name}: {target}"
        if anchor and file.suffix == ".md":
            slugs = {headlines.slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
            assert anchor in slugs, f"{doc.name}: {target}"


@pytest.mark.parametrize("page", sorted(PAGES.glob("*.md")), ids=lambda p: p.name)
def test_a_page_has_each_section_once(page):
    """benchmarks/docs_section.replace_section rewrites a page's ``## heading`` by name."""
    headings = re.findall(r"^## (.+)$", page.read_text(), re.M)
    assert len(headings) == len(set(headings)), page.name


def test_nothing_points_at_the_old_single_page():
    old = "docs/benchmarks" + ".md"
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.py"),
             *ROOT.glob("benchmarks/*.md"), *ROOT.glob("src/gradzip/**/*.py"), *ROOT.glob("tests/*.py")]
    stale = [str(f.relative_to(ROOT)) for f in files
             if f.name != "benchmarks.md" and old in f.read_text()]
    assert stale == []


def test_benchmarks_readme_lists_every_script():
    listed = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = [p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py"]
    assert [s for s in scripts if f"`{s}`" not in listed] == []
