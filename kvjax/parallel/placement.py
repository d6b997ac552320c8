"""Which device holds each KV head of every layer under tensor parallelism, so that every device carries the same
cache bytes (issue 38, item 2; ``../shared/DESIGN.md``, "Sharding").

``place`` returns a ``Placement``: every device holds ``H / N`` KV heads a layer (one SPMD program, one shape a
shard), a KV head moves with its whole query group, and each layer places its heads on its own. Within a layer,
heads go heaviest first to the least loaded bin with room (LPT with a cardinality limit); across layers, the heaviest
bins go to the devices least loaded so far, then a layer's bins swap devices while that narrows the pools' spread.
``even`` is the byte-blind baseline, and ``place`` is never worse than it. Fewer KV heads than devices: each head is
replicated on ``N / H`` devices, its query heads split between them, as the Megatron layout does. Heads that
cannot be shared out evenly are refused in one line.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.layout import HeadLayout


@dataclasses.dataclass(frozen=True)
class Placement:
    """KV heads on devices, per layer. ``heads`` [layers, devices, heads a device]: the KV heads each device holds,
    in the order its shard packs them; ``token_bytes`` [layers, KV heads]: the bytes per token it placed;
    ``replicas``: devices holding each head (1 unless there are fewer KV heads than devices)."""

    heads: np.ndarray
    token_bytes: np.ndarray
    replicas: int

    @property
    def devices(self) -> int:
        return self.heads.shape[1]

    def device_bytes(self) -> np.ndarray:
        """[layers, devices]: the bytes per token each device carries in each layer."""
        return np.take_along_axis(self.token_bytes[:, None, :], self.heads, axis=2).sum(-1)

    def memory_imbalance(self) -> float:
        """Max over mean of the devices' bytes per token summed over layers: what sizes each device's page pool."""
        total = self.device_bytes().sum(0)
        return float(total.max() / total.mean())

    def step_imbalance(self) -> float:
        """Sum over layers of the heaviest device's bytes over the sum of the mean's: a decode step's attention time
        over the time of a perfect split (each layer waits for its slowest device)."""
        per = self.device_bytes()
        return float(per.max(1).sum() / per.mean(1).sum())

    def describe(self) -> str:
        return (
            f"{self.devices} devices, {self.heads.shape[2]} KV head(s) each a layer"
            + (f" (each held by {self.replicas})" if self.replicas > 1 else "")
            + f": bytes per device max/mean {self.memory_imbalance():.3f}, step {self.step_imbalance():.3f}"
        )


def layout_bytes(layouts: list[HeadLayout], itemsize: int = 2) -> np.ndarray:
    """[layers, KV heads]: bytes per token of each head's K and V rows at ``itemsize`` bytes an element."""
    _same_heads(layouts)
    return np.array([[(k + v) * itemsize for k, v in zip(lay.k_widths, lay.v_widths)] for lay in layouts], np.int64)


def place(token_bytes, devices: int) -> Placement:
    """Byte-balanced placement of ``token_bytes`` [layers, KV heads] (bytes per token of each head, > 0) on
    ``devices`` (the module's two steps, then pairwise swaps of a layer's bins between devices while they lower the
    pool spread). Never worse than ``even`` by construction: each layer keeps the even split's grouping where LPT's
    heaviest bin is not lighter, and where the result's memory imbalance still exceeds the even split's (possible
    with a heuristic, however rare) the even split is returned. Refused in one line where the heads cannot be
    shared out evenly."""
    cost, bins, replicas = _check(token_bytes, devices)
    layers, heads = cost.shape
    per = heads // bins
    lpt = np.stack([_lpt(c, bins, per) for c in cost])  # [layers, bins, heads a bin]
    contiguous = np.broadcast_to(_contiguous(heads, bins), lpt.shape)
    bin_bytes = lambda groups: Placement(groups, cost, 1).device_bytes()  # noqa: E731  [layers, bins]
    lighter = bin_bytes(lpt).max(1) < bin_bytes(contiguous).max(1)
    groups = np.where(lighter[:, None, None], lpt, contiguous)  # each layer's bins, before they meet devices
    loads = bin_bytes(groups)
    # the layer's heaviest bin to the device least loaded so far, then swaps that narrow the spread
    owner = np.zeros((layers, bins), np.int64)  # owner[layer, bin]: its device
    total = np.zeros(bins, np.int64)
    for layer in range(layers):
        for b, device in zip(np.argsort(-loads[layer], kind="stable"), np.argsort(total, kind="stable")):
            owner[layer, b] = device
            total[device] += loads[layer, b]
    _swap_while_better(loads, owner, total)
    out = np.zeros_like(groups)
    for layer in range(layers):
        out[layer, owner[layer]] = np.sort(groups[layer], axis=1)
    balanced = Placement(np.repeat(out, replicas, axis=1), cost, replicas)
    baseline = even(cost, devices)
    return balanced if balanced.memory_imbalance() <= baseline.memory_imbalance() else baseline


def _contiguous(heads: int, bins: int) -> np.ndarray:
    """[bins, heads a bin]: heads in order, ``heads / bins`` a bin (what sharding the packed head columns gives)."""
    return np.arange(heads).reshape(bins, heads // bins)


def _lpt(cost: np.ndarray, bins: int, per: int) -> np.ndarray:
    """[bins, per]: heads heaviest first to the least loaded bin with room (LPT with a cardinality limit)."""
    load = np.zeros(bins, np.int64)
    members: list[list[int]] = [[] for _ in range(bins)]
    for h in np.argsort(-cost, kind="stable"):
        lightest = min((i for i in range(bins) if len(members[i]) < per), key=lambda i: (load[i], i))
        members[lightest].append(int(h))
        load[lightest] += cost[h]
    return np.array(members, np.int64)


def _swap_while_better(loads: np.ndarray, owner: np.ndarray, total: np.ndarray, rounds: int = 8) -> None:
    """Swap the devices of two bins of one layer wherever that lowers the sum of squared device totals (the pool
    spread), in place, for at most ``rounds`` passes; each swap strictly lowers it, so the loop ends."""
    layers, bins = loads.shape
    for _ in range(rounds):
        changed = False
        for layer in range(layers):
            for a in range(bins):
                for b in range(a + 1, bins):
                    da, db = owner[layer, a], owner[layer, b]
                    moved = loads[layer, a] - loads[layer, b]  # what device da gives to db by the swap
                    if moved and (total[da] - total[db]) * moved > moved * moved:
                        owner[layer, a], owner[layer, b] = db, da
                        total[da] -= moved
                        total[db] += moved
                        changed = True
        if not changed:
            return


def even(token_bytes, devices: int) -> Placement:
    """The even-count placement that ignores bytes: device d holds heads d·H/N .. (d+1)·H/N - 1 of every layer (what
    sharding the packed head columns in order gives); the baseline ``place`` is measured against."""
    cost, bins, replicas = _check(token_bytes, devices)
    layers, heads = cost.shape
    out = np.broadcast_to(_contiguous(heads, bins), (layers, bins, heads // bins))
    return Placement(np.repeat(out, replicas, axis=1), cost, replicas)


def _check(token_bytes, devices) -> tuple[np.ndarray, int, int]:
    """(bytes [layers, heads] int64, bins, replicas), or a one-line ValueError."""
    if isinstance(devices, bool) or not isinstance(devices, (int, np.integer)) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    cost = np.asarray(token_bytes)
    if cost.ndim != 2 or cost.size == 0 or not np.issubdtype(cost.dtype, np.integer) or (cost <= 0).any():
        raise ValueError("token_bytes must be positive integers [layers, KV heads]")
    heads = cost.shape[1]
    if heads >= devices and heads % devices:
        raise ValueError(f"{heads} KV heads cannot be shared evenly by {devices} devices (a multiple of {devices})")
    if heads < devices and devices % heads:
        raise ValueError(f"{heads} KV heads cannot be replicated evenly on {devices} devices (need a multiple)")
    bins = min(heads, devices)
    return cost.astype(np.int64), bins, devices // bins


def _same_heads(layouts: list[HeadLayout]) -> None:
    if not layouts or len({lay.num_kv_heads for lay in layouts}) != 1:
        raise ValueError("placement needs one or more layers with the same number of KV heads")
