"""How a quantized cache serves K and V, for teacher-forced scoring: each scheme is a frozen (hashable) description
with the page it works in (``page_size``), the reconstruction of whole sequences page by page (``round_trip``) and
every byte a page of a layer stores, by part (``page_bytes``), so its overall rate is honest.

``Kivi`` (``quant.PageFormat``) and ``Gear`` (GEAR's low-rank and sparse terms, ``kvjax.ops.gear``, stored as
``gear.GearPageFormat``) are what the engine serves; ``Zip`` is ZipCache's mixed precision by saliency
(``kvjax.ops.zipcache``), scored here only. ``parse`` reads the names the command lines use; ``served`` checks an
entry point's ``kv_bits`` (4, 2 or a GEAR name) and ``page_format`` builds a layer's page format from it."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops import gear, zipcache
from kvjax.ops.quant import GROUP, PageFormat, check_bits, simulate


@dataclasses.dataclass(frozen=True)
class Kivi:
    """KIVI-style pages: keys per column over the page, values per token and head (``quant.PageFormat``)."""

    bits: int
    page_size: int = GROUP

    def __post_init__(self):
        check_bits(self.bits)

    @property
    def name(self) -> str:
        return f"kivi{self.bits}"

    def round_trip(self, q, k, v, layout: HeadLayout):
        return simulate(k, v, PageFormat.for_layout(layout, self.page_size, self.bits))

    def page_bytes(self, layout: HeadLayout) -> dict[str, int]:
        return PageFormat.for_layout(layout, self.page_size, self.bits).bytes_by_part()


@dataclasses.dataclass(frozen=True)
class Gear:
    """KIVI-style pages plus GEAR's rank-``spec.rank`` residual and exact outliers per head and page."""

    spec: gear.GearSpec

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def name(self) -> str:
        """``gear<bits>``, then ``-r<rank>`` and ``-o<outliers>`` where they differ from the reference's, and
        ``-p<tokens>`` where its page (the streaming buffer) is not ``quant.GROUP`` (``parse`` reads it back)."""
        spec = self.spec
        rank = f"-r{spec.rank}" if spec.rank != gear.STREAM_RANK else ""
        outliers = f"-o{spec.outliers:g}" if spec.outliers != gear.OUTLIERS else ""
        return f"gear{spec.bits}{rank}{outliers}" + (f"-p{spec.page_size}" if spec.page_size != GROUP else "")

    def round_trip(self, q, k, v, layout: HeadLayout):
        return gear.round_trip(k, v, layout, self.spec)

    def page_bytes(self, layout: HeadLayout) -> dict[str, int]:
        return gear.page_bytes(layout, self.spec)


@dataclasses.dataclass(frozen=True)
class Zip:
    """ZipCache (``kvjax.ops.zipcache``): tokens ranked by normalized attention from probe queries, the salient ones
    at the higher bit width; quantized once over the whole sequence (as after its prefill), read through pages of
    ``page_size`` tokens (the newest exact); its per-channel ranges and normalizers amortized over ``tokens``."""

    spec: zipcache.ZipSpec
    page_size: int = GROUP
    tokens: int = 1024

    @property
    def name(self) -> str:
        return "zipcache" if self.spec.keys == "channel" else f"zipcache-{self.spec.keys}"

    def round_trip(self, q, k, v, layout: HeadLayout):
        return zipcache.round_trip(q, k, v, layout, self.spec)

    def page_bytes(self, layout: HeadLayout) -> dict[str, float]:
        return {part: n * self.page_size for part, n in zipcache.token_bytes(layout, self.spec, self.tokens).items()}


NAMES = ("4", "2", "kivi4", "kivi2", "gear4", "gear2", "zipcache", "zipcache-paged", "zipcache-separable")
_GEAR = re.compile(r"gear([42])(?:-r(\d+))?(?:-o(\d*\.?\d+(?:e-?\d+)?))?(?:-p(\d+))?")


def parse(text: str, page_size: int = GROUP):
    """A scheme from its name: "4"/"kivi4", "2"/"kivi2" (KIVI-style), "gear4"/"gear2" (GEAR at the reference's streaming
    settings, ``GearSpec.paper``; "-r<rank>" and "-o<fraction>" change its rank and outlier share, e.g.
    "gear2-r1-o0.005", and "-p<tokens>" its page, the streaming buffer, over ``page_size``), "zipcache" (its reference's
    4/2 bits, 60% salient; "-paged": keys ranged a page of a class at a time, "-separable": keys channel-separably per
    token, ``zipcache.ZipSpec.keys``); pages of ``page_size`` tokens; a ValueError naming the choices (or saying which
    GEAR setting is out of range)."""
    name = str(text).strip().lower()
    if name in ("4", "2", "kivi4", "kivi2"):
        return Kivi(int(name[-1]), page_size)
    match = _GEAR.fullmatch(name)
    if match:
        bits, rank, outliers, page = match.groups()
        paper = gear.GearSpec.paper(int(bits), page_size if page is None else int(page))
        return Gear(
            dataclasses.replace(
                paper,
                rank=paper.rank if rank is None else int(rank),
                outliers=paper.outliers if outliers is None else float(outliers),
            )
        )
    if name in ("zipcache", "zipcache-paged", "zipcache-separable"):
        keys = name.partition("-")[2] or "channel"
        return Zip(zipcache.ZipSpec(keys=keys, key_group=page_size), page_size)
    raise ValueError(
        f"KV scheme must be one of {', '.join(NAMES)} (GEAR with -r<rank> -o<outliers> -p<page>), got {text!r}"
    )


def token_bytes(scheme, layouts) -> dict[str, float]:
    """Bytes a token takes across ``layouts`` under ``scheme``, by part (a page's bytes over its tokens)."""
    out: dict[str, float] = {}
    for layout in layouts:
        for part, n in scheme.page_bytes(layout).items():
            out[part] = out.get(part, 0.0) + n / scheme.page_size
    return out


# A page format the engine stores (``page_format``): the same interface, KIVI-style or GEAR
AnyPageFormat = PageFormat | gear.GearPageFormat
# What an entry point's kv_bits may be, in the words of its errors
SERVED = "4 or 2 (KIVI-style), or a GEAR name such as gear2 or gear2-r1-o0.01-p128"


class ScoredOnly(ValueError):
    """A scheme ``parse`` knows that the engine does not serve (ZipCache): callers show its own words."""


def served(kv_bits) -> int | str | None:
    """How the engine stores pages for an entry point's ``kv_bits``: None (the cache's dtype); 4 or 2, KIVI-style
    (``quant.PageFormat``; also as "4" or "kivi4"); or a GEAR scheme (``gear.GearPageFormat``), returned as its
    canonical name (``Gear.name``, what ``parse`` reads back). Anything else, ZipCache included (its saliency needs
    the attention of probe queries, which the engine does not compute), is a one-line ValueError."""
    if kv_bits is None:
        return None
    if isinstance(kv_bits, (int, np.integer)) and not isinstance(kv_bits, bool):
        return check_bits(int(kv_bits))
    if isinstance(kv_bits, str):
        try:
            scheme = parse(kv_bits)
        except ValueError:
            raise ValueError(f"kv_bits must be {SERVED}, got {kv_bits!r}") from None
        if isinstance(scheme, Kivi):
            return scheme.bits
        if isinstance(scheme, Gear):
            return scheme.name
        raise ScoredOnly(
            f"kv_bits: {scheme.name} is scored teacher-forced only (bench/accuracy.py), not served by the engine; "
            f"use {SERVED}"
        )
    raise ValueError(f"kv_bits must be {SERVED}, got {kv_bits!r}")


def label(kv_bits) -> str:
    """A served ``kv_bits`` for people: "int4", "int2" or the GEAR name."""
    kv_bits = served(kv_bits)
    return f"int{kv_bits}" if isinstance(kv_bits, int) else str(kv_bits)


def page_of(kv_bits) -> int | None:
    """The page size a served ``kv_bits`` fixes (a GEAR name's ``-p<tokens>``), else None (the engine's)."""
    kv_bits = served(kv_bits)
    return parse(kv_bits).page_size if isinstance(kv_bits, str) and "-p" in kv_bits else None


def page_format(kv_bits, layout: HeadLayout, page_size: int):
    """The page format of ``layout``'s layer for a served ``kv_bits`` (not None) in pages of ``page_size`` tokens
    (which a GEAR name's ``-p<tokens>`` must equal)."""
    kv_bits = served(kv_bits)
    if kv_bits is None:
        raise ValueError("page_format needs kv_bits: pages of the cache's dtype have no page format")
    fixed = page_of(kv_bits)
    if fixed not in (None, page_size):
        raise ValueError(f"kv_bits {kv_bits} stores pages of {fixed} tokens, not {page_size}")
    if isinstance(kv_bits, int):
        return PageFormat.for_layout(layout, page_size, kv_bits)
    return gear.GearPageFormat.for_layout(layout, parse(kv_bits, page_size).spec)
