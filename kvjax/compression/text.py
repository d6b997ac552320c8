"""Real English text without the internet: Python's own ``pydoc_data.topics``, split into two disjoint halves.

The first half calibrates, the second half is held out for perplexity, so no evaluation text was seen while
choosing rotations.
"""

from __future__ import annotations


def pydoc_text(part: str) -> str:
    """``part`` "calibration" (first half of the characters) or "heldout" (second half)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    half = len(text) // 2
    if part == "calibration":
        return text[:half]
    if part == "heldout":
        return text[half:]
    raise ValueError(f"part must be 'calibration' or 'heldout', got {part!r}")
