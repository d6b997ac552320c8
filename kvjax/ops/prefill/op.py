"""The prefill op as the engine holds it: its work items are built at trace time, so it only runs."""

from __future__ import annotations

from kvjax.layout import HeadLayout
from kvjax.ops.prefill.config import PREFILL, PrefillConfig
from kvjax.ops.prefill.kernel import prefill_attention


class PrefillOp:
    """Causal attention of prompt chunks that also writes their K/V into the pages (``kernel.prefill_attention``),
    one kernel shared by the layers of ``layouts`` (default: each layer its own)."""

    def __init__(self, layouts=None, *, config: PrefillConfig = PREFILL, interpret: bool = False):
        self.layouts = None if layouts is None else tuple(layouts)
        self.config, self.interpret = config, interpret

    def run(self, q, k, v, layout: HeadLayout, lengths, k_pages, v_pages, block_table, starts=None, lse=False):
        """(out, k_pages, v_pages) for chunks q/k/v [B, T, cols] of ``lengths`` tokens from positions ``starts``;
        ``lse``: and each row's log2 softmax denominator [B, T, num_heads]."""
        return prefill_attention(
            q,
            k,
            v,
            layout,
            lengths,
            k_pages,
            v_pages,
            block_table,
            starts,
            config=self.config,
            interpret=self.interpret,
            shared=self.layouts,
            lse=lse,
        )
