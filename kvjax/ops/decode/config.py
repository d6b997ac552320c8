"""The decode op's tuned defaults, in one place: the cost model, the schedule builder and the kernel all read them.

Each field names what it controls; the figures behind the defaults are in bench/results/kernels.md ("Decode: runs of
heads and head order", "Decode schedule: orders side by side", "Decode kernel: time beside the floor"). Benchmarks sweep
a field with ``dataclasses.replace(DECODE, field=value)``.
"""

from __future__ import annotations

import dataclasses

from kvjax import validate

ORDERS = ("auto", "lpt", "stream", "naive")
HEAD_SCHEDULES = ("slots", "live")
QUANT_HEAD_LAUNCHES = ("class", "k-class", "layer")  # ``quant_head_kernel.LAUNCH_FORMS``
H100_SMS = 132
# Fields that are counts or sizes of at least one; every other integer field must be >= 0.
AT_LEAST_ONE = (
    "min_chunk_tokens",
    "items_per_program",
    "programs_per_sm",
    "fixed_chunk_tokens",
    "block_tokens",
    "max_step_tokens",
    "fold_tokens",
    "max_segments",
    "num_warps",
    "num_stages",
    "kernel_classes",
    "pack_max_heads",
    "band_blocks",
    "band_seqs",
)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How decode cuts its work and runs it (hashable: a static argument of the jitted kernel)."""

    # Work units: runs of adjacent KV heads (``units.head_runs``).
    pack_tile: int = 256  # widest tile a run of several heads may read for its K or its V (0: one head per unit)
    pack_min_cols: int = 0  # a run of several heads has at least this many K and V columns each (quantized pages)
    pack_max_heads: int = 16  # the most heads a run holds (quantized pages: ``quant_kernel.RUN_HEADS``)
    quant_runs: bool = False  # quantized decode reads runs of heads as units (``quant_kernel.plan_config``)
    # The cost of one token of a unit (``cost.token_cost``), in columns of width.
    token_cost: int = 32  # per-token work that does not shrink with width (page lookup, softmax)
    floor_tile: int = 128  # a unit's token costs at least one of a floor_tile + floor_tile unit (0: no floor)
    tile_weight: int = 1  # weight of the tile columns (instructions) beside the K + V columns (bytes)
    piece_saving: int = 64  # with max_segments > 1: a run is read as pieces only where that saves this many columns
    # The schedule (``schedule``).
    order: str = "auto"  # "auto" (LPT if it balances to auto_balance, else stream), "lpt", "stream" or "naive"
    auto_balance: float = 0.95
    item_overhead: int = 32 * 64  # an item's fixed cost, in tokens x columns
    min_chunk_tokens: int = 256  # LPT never cuts shorter chunks; stream snaps cuts this close (/4) to a group's edge
    items_per_program: int = 1  # LPT splits groups costlier than 1/items_per_program of a program's average load
    programs_per_sm: int = 2  # persistent programs per streaming multiprocessor
    headroom_tokens: int = 128  # a schedule covers this many tokens past each length (``schedule_cache.ScheduleCache``)
    fixed_chunk_tokens: int = 512  # batch-invariant schedules cut every sequence at multiples of this
    # The kernel (``kernel.paged_decode``).
    block_tokens: int = 64  # tokens per loop step for a 128 + 128-column unit (narrower units take more)
    max_step_tokens: int = 512
    fold_tokens: int = 64  # least tokens per fold when spare score-tile rows fold a step's tokens
    band_blocks: int = 1  # banded decode: blocks of bands a program of the band queries' kernel makes (``bands``)
    band_seqs: int = 1  # banded decode: sequences a program of the band queries' kernel makes
    # Power-of-two pieces a run's K (or V) columns may be read as. One piece a run compiles 20-33% faster for
    # under 1% more device time (bench/results/engine.md "Engine: one piece a run").
    max_segments: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # Steps with every token visible in a loop of their own, without masks: twice the loop code, so compile time,
    # and no faster (bench/results/startup.md "Engine: compile times").
    unmasked_steps: bool = False
    kernel_classes: int = 1  # layers share compiled kernels while these run classes cover them (``tables``)
    # The per-head pages' decode (``head_kernel.head_paged_decode``, eviction's cache): "live" (the live slots'
    # heads, their work list built once a step: 1.31x faster a step with 2 of 64 slots live, within 4% of the slot
    # grid's kernel with 32 full slots) or "slots" (a grid of every slot's heads): bench/results/eviction.md "The live
    # schedule".
    head_schedule: str = "live"
    # Launches of the decode over quantized per-head pages (``quant_head_kernel.quant_head_decode``'s ``launches``):
    # "k-class", a launch a K class of the layer's heads switching between its classes (4 modules for a rate-0.5
    # int4 model, 21% faster a layer than "class"), "class", a launch a class (11 modules), or "layer", one launch
    # switching between every class (5% faster again, one module of 137 s of Triton): bench/results/eviction.md
    # "Eviction on quantized pages: a launch a K class (H100)".
    quant_head_launches: str = "k-class"

    def for_run(self) -> DecodeConfig:
        """This config with the schedule-only fields at their defaults: what the kernel compiles for (a schedule
        that switches order, as "auto" does, must not make the jitted step compile again)."""
        return dataclasses.replace(self, **{f: getattr(DECODE, f) for f in SCHEDULE_ONLY})

    def num_programs(self) -> int:
        """``programs_per_sm`` programs per SM of the first GPU (the H100's 132 SMs where there is none)."""
        import jax

        try:
            sms = int(getattr(jax.devices("gpu")[0], "core_count", 0) or H100_SMS)
        except RuntimeError:
            sms = H100_SMS
        return self.programs_per_sm * sms

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, not {self.order!r}")
        if self.head_schedule not in HEAD_SCHEDULES:
            raise ValueError(f"head_schedule must be one of {HEAD_SCHEDULES}, not {self.head_schedule!r}")
        if self.quant_head_launches not in QUANT_HEAD_LAUNCHES:
            raise ValueError(
                f"quant_head_launches must be one of {QUANT_HEAD_LAUNCHES}, not {self.quant_head_launches!r}"
            )
        validate.int_fields(self, at_least_one=AT_LEAST_ONE)
        if not 0.0 <= self.auto_balance <= 1.0:
            raise ValueError(f"auto_balance must be in [0, 1], got {self.auto_balance}")


DECODE = DecodeConfig()
# Fields that shape the schedule but neither the units nor the kernel.
SCHEDULE_ONLY = (
    "order",
    "auto_balance",
    "item_overhead",
    "min_chunk_tokens",
    "items_per_program",
    "programs_per_sm",
    "headroom_tokens",
    "fixed_chunk_tokens",
)
