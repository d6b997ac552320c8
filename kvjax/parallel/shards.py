"""Each device's share of a layer under tensor parallelism (issue 38, item 1): which packed columns of q, k, v and
which rows of o hold the KV heads a device was given (``placement``), the layout those heads form on the device
(``local_layout``, ``padded_layout``), and the even splits of the MLP and the vocabulary (``even_split``). Index
arithmetic only, over the packed layout of ``kvjax.layout``; the sum of the devices' partial outputs is the layer's
(tested). Fewer KV heads than devices (``replicas`` > 1): a device holds one KV head whole and its replica's share
of the group's query heads, as the Megatron layout replicates KV heads.
"""

from __future__ import annotations

import numpy as np

from kvjax.layout import HeadLayout
from kvjax.parallel.placement import Placement

PARTS = ("q", "k", "v", "o", "q_full", "k_full")
QUERY_PARTS = ("q", "o", "q_full")  # G blocks a KV head, one a query head


def block_widths(layout: HeadLayout, part: str, replicas: int = 1) -> list[int]:
    """Each KV head's block width in the packed ``part`` (``PARTS``); with ``replicas``, one replica's share of
    the query parts (G / replicas query heads a block)."""
    g, d = _group(layout, replicas), layout.head_dim
    widths = {
        "q": [g * w for w in layout.k_widths],
        "k": list(layout.k_widths),
        "v": list(layout.v_widths),
        "o": [g * w for w in layout.v_widths],
        "q_full": [g * d] * layout.num_kv_heads,
        "k_full": [d] * layout.num_kv_heads,
    }
    if part not in widths:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    return widths[part]


def columns(layout: HeadLayout, heads, part: str, replica: int = 0, replicas: int = 1) -> np.ndarray:
    """int [n]: the packed ``part``'s columns (o: rows) that hold KV heads ``heads``, in their order: a device's
    slice of the projection, its heads side by side as its local layout packs them. With ``replicas``, the query
    parts keep replica ``replica``'s G / replicas query heads of each group."""
    widths = block_widths(layout, part)
    starts = np.concatenate([[0], np.cumsum(widths)])
    heads = _heads(layout, heads)
    if part not in QUERY_PARTS or replicas == 1:
        return np.concatenate([np.arange(starts[h], starts[h] + widths[h]) for h in heads]).astype(np.int64)
    g, mine = layout.group_size, _group(layout, replicas)
    blocks = [
        starts[h] + (replica * mine + j) * (widths[h] // g) + np.arange(widths[h] // g)
        for h in heads
        for j in range(mine)
    ]
    return np.concatenate(blocks).astype(np.int64)


def local_layout(layout: HeadLayout, heads, replicas: int = 1) -> HeadLayout:
    """The layout of KV heads ``heads`` (in order) with their query groups (a replica's share of them): what a
    device attends over."""
    heads = _heads(layout, heads)
    k, v = tuple(layout.k_widths[h] for h in heads), tuple(layout.v_widths[h] for h in heads)
    return _local(layout, k, v, replicas)


def widest_first(placement: Placement) -> list[list[list[int]]]:
    """[layer][device]: each device's heads, the most bytes per token first (ties in head order), so that the
    devices' j-th heads are of similar widths and pad little (``padded_layout``)."""
    out = []
    for row, shares in zip(placement.token_bytes, placement.heads):
        rank = {int(h): (-int(row[h]), int(h)) for h in range(len(row))}
        out.append([sorted((int(h) for h in heads), key=rank.__getitem__) for heads in shares])
    return out


def padded_widths(layout: HeadLayout, per_device) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(K widths, V widths) of the one local layout every device runs: local head j as wide as the widest j-th head
    of any device (``per_device``: each device's heads in local order; order them widest first so similar widths
    share a slot). One SPMD program needs one shape a shard; a narrower head's extra columns are zeros (its rotation
    and V columns, its o rows), which add exactly nothing to its scores and outputs."""
    rows = [_heads(layout, heads) for heads in per_device]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("every device must hold the same number of KV heads")
    k = tuple(max(layout.k_widths[r[j]] for r in rows) for j in range(len(rows[0])))
    v = tuple(max(layout.v_widths[r[j]] for r in rows) for j in range(len(rows[0])))
    return k, v


def padded_layout(layout: HeadLayout, per_device, replicas: int = 1) -> HeadLayout:
    """The local layout of ``padded_widths``: one device's query groups (a replica's share of them) over its KV
    heads at the padded widths."""
    return _local(layout, *padded_widths(layout, per_device), replicas)


def padded_imbalance(layouts, placement: Placement, itemsize: int = 2) -> float:
    """What the one padded local layout costs: each layer's ``padded_layout`` (devices' heads ``widest_first``) in
    bytes per token, summed over layers, over the mean device's actual bytes. K and V are padded separately, so it
    passes what the heaviest device holds. Kernels that take each device's widths as data (the per-head kernel
    switches on a head's width pair) would not pay it."""
    order = widest_first(placement)
    locals_ = [padded_layout(lay, heads, placement.replicas) for lay, heads in zip(layouts, order)]
    padded = sum((lay.k_cols + lay.v_cols) * itemsize for lay in locals_)
    return float(padded / placement.device_bytes().mean(1).sum())


def into(
    layout: HeadLayout, heads, local: HeadLayout, part: str, replica: int = 0, replicas: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) columns: ``heads``' columns of the packed ``part`` in ``layout`` (replica
    ``replica``'s query heads) and where they sit in the padded ``local`` layout (each head's block at the start of
    its wider local block; the rest stays zero)."""
    heads = _heads(layout, heads)
    src = columns(layout, heads, part, replica, replicas)
    starts = np.concatenate([[0], np.cumsum(block_widths(local, part))])
    widths = block_widths(layout, part, replicas)
    if part in ("q", "o"):  # G blocks a head, each at its own width: place each query head's block
        g = local.group_size
        mine = [w // g for w in widths]
        theirs = [w // g for w in block_widths(local, part)]
        dst = [starts[j] + q * theirs[j] + np.arange(mine[h]) for j, h in enumerate(heads) for q in range(g)]
    else:
        dst = [starts[j] + np.arange(widths[h]) for j, h in enumerate(heads)]
    return src, np.concatenate(dst).astype(np.int64)


def even_split(size: int, devices: int) -> tuple[int, int]:
    """(per, padded): each device's share of ``size`` rows or columns (the MLP's intermediate width, the
    vocabulary) as one shape on every device, ``per = ceil(size / devices)``, and the padded total ``per * devices``
    (the last device's rows past ``size`` are zeros: a padded vocabulary row is never the argmax, its logit masked)."""
    if devices < 1 or size < 1:
        raise ValueError(f"size and devices must be positive, got {size} and {devices}")
    per = -(-size // devices)
    return per, per * devices


def _local(layout: HeadLayout, k_widths: tuple[int, ...], v_widths: tuple[int, ...], replicas: int = 1) -> HeadLayout:
    """A device's layout: ``layout``'s query groups (a replica's share) over KV heads of these widths."""
    n = len(k_widths)
    return HeadLayout(_group(layout, replicas) * n, n, layout.head_dim, k_widths, v_widths, layout.sliding_window)


def _group(layout: HeadLayout, replicas: int) -> int:
    """Query heads a replica holds of each group: G / replicas, which must divide."""
    if replicas < 1 or layout.group_size % replicas:
        raise ValueError(f"{layout.group_size} query heads a KV head cannot be split among {replicas} replicas")
    return layout.group_size // replicas


def _heads(layout: HeadLayout, heads) -> list[int]:
    heads = [int(h) for h in np.asarray(heads).ravel()]
    if not heads or len(set(heads)) != len(heads) or not all(0 <= h < layout.num_kv_heads for h in heads):
        raise ValueError(f"heads must be distinct KV heads of 0..{layout.num_kv_heads - 1}, got {heads}")
    return heads
