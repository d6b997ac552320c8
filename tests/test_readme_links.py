"""Every citation of a measured result names something that exists. The README's links into bench/results/ (its
front-page table cites a section per cell) and bench/RESULTS.md's index each name a heading of their file, by
GitHub's anchor rule (lowercased, punctuation dropped, spaces as hyphens); a docstring's or comment's
``bench/results/<area>.md "Name"`` names a heading or a bold paragraph label of that file."""

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CITATION = re.compile(r'bench/results/(\w+)\.md(?P<sep>(?:[ \t,:(]|\n[ \t]*#?[ \t]*)*)"(?P<name>[^"]{3,200})"')


def anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(area: str) -> Counter:
    lines = (RESULTS / f"{area}.md").read_text().splitlines()
    return Counter(anchor(line.lstrip("#")) for line in lines if line[:1] == "#")


def labels(area: str) -> set[str]:
    """Headings and bold paragraph labels (``**Label** (date, ...)``), whitespace collapsed."""
    text = (RESULTS / f"{area}.md").read_text()
    found = {line.lstrip("#").strip() for line in text.splitlines() if line[:1] == "#"}
    found |= {" ".join(m.split()) for m in re.findall(r"\*\*([^*]+)\*\*", text)}
    return found


def test_every_results_link_in_the_readme_and_the_index_names_a_section():
    cited = re.findall(r"bench/results/(\w+)\.md#([\w\-]+)", (ROOT / "README.md").read_text())
    cited += re.findall(r"\(results/(\w+)\.md#([\w\-]+)\)", (ROOT / "bench" / "RESULTS.md").read_text())
    assert len(cited) >= 80, "the front page cites a section per cell, the index every section"
    # missing, or ambiguous (GitHub would suffix it)
    assert [(area, link) for area, link in cited if headings(area)[link] != 1] == []


def test_every_results_citation_in_the_code_names_a_heading_or_label_of_its_file():
    files = [*(ROOT / "kvjax").rglob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "tests").glob("*.py")]
    files.append(ROOT / "README.md")
    cited = [(f.name, m["name"], area) for f in files for m in CITATION.finditer(f.read_text()) for area in [m[1]]]
    assert len(cited) >= 60
    missing = []
    for name, text, area in cited:
        text = " ".join(re.sub(r"\n[ \t]*#?[ \t]*", " ", text).split())
        if not (RESULTS / f"{area}.md").exists() or not any(label.startswith(text) for label in labels(area)):
            missing.append((name, area, text))
    assert missing == []


def test_the_anchor_rule_matches_githubs_on_punctuation():
    assert anchor(" ZACK + 4-bit at 4K windows (SmolLM2)") == "zack--4-bit-at-4k-windows-smollm2"
    assert anchor("Palu's decode kernel") == "palus-decode-kernel"
