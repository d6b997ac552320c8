"""The README's links into bench/RESULTS.md (its front-page table cites a section per cell) each name a heading
that exists, by GitHub's anchor rule: lowercased, punctuation dropped, spaces as hyphens."""

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_results_link_in_the_readme_names_a_section():
    headings = Counter(
        anchor(line.lstrip("#")) for line in (ROOT / "bench" / "RESULTS.md").read_text().splitlines() if line[:1] == "#"
    )
    links = re.findall(r"bench/RESULTS\.md#([\w\-]+)", (ROOT / "README.md").read_text())
    assert len(links) >= 40, "the front page cites a section per cell"
    assert [link for link in links if headings[link] != 1] == []  # missing, or ambiguous (GitHub would suffix it)


def test_the_anchor_rule_matches_githubs_on_punctuation():
    assert anchor(" ZACK + 4-bit at 4K windows (SmolLM2)") == "zack--4-bit-at-4k-windows-smollm2"
    assert anchor("Palu's decode kernel") == "palus-decode-kernel"
