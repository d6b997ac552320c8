"""The decode op as the engine holds it: ``schedule`` on the host (as FlashInfer's ``plan()``), ``run`` on the
device."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.kernel import check_band, paged_decode
from kvjax.ops.decode.schedule import DecodeSchedule, as_layouts, compiled_shape
from kvjax.ops.decode.schedule_cache import ScheduleCache
from kvjax.ops.decode.tables import kernel_groups
from kvjax.ops.tiles import pow2_ceil


def banded_config(config: DecodeConfig, band: int) -> DecodeConfig:
    """``config`` for keys in bands of ``band`` positions: folds of at most a band's tokens, so that each fold's
    chunk lies in one band and reads one band's queries (``kernel._item_queries``), not one a sub-band."""
    return dataclasses.replace(config, fold_tokens=min(config.fold_tokens, band))


class DecodeOp:
    """Paged decode attention over a model's layers: ``schedule(lengths)`` returns the device schedule for a step
    (the kept one while it covers the lengths, so most steps schedule nothing), ``run`` attends one layer with it.

    ``batch_invariant``: each sequence is split by its own length alone (``schedule.fixed_chunk_schedule``), so a
    row's result does not depend on the batch it runs in. Schedules of up to ``max_batch`` sequences come in one
    shape (``schedule.compiled_shape``), so the step that takes them compiles once.

    ``band`` (banded ZACK, at least ``kernel.MIN_BAND``): ``run`` takes whole post-RoPE query heads and the layer's
    banded K rebuild; its config folds chunks of a band's tokens (``banded_config``)."""

    def __init__(
        self,
        layouts,
        page_size: int,
        pages_per_seq: int,
        *,
        max_batch: int = 1,
        config: DecodeConfig = DECODE,
        num_programs: int | None = None,
        batch_invariant: bool = False,
        band: int | None = None,
        interpret: bool = False,
    ):
        if band is not None:
            band = check_band(band)  # before any scheduling: a bad band names itself, not the config it would make
            config = banded_config(config, band)
        self.config, self.band, self.interpret = config, band, interpret
        self.groups = kernel_groups(as_layouts(layouts), config)  # the layers that share each compiled kernel
        self._schedule_cache(layouts, page_size, pages_per_seq, max_batch, config, num_programs, batch_invariant)

    def _schedule_cache(
        self, layouts, page_size, pages_per_seq, max_batch, config, num_programs, batch_invariant, classes=None
    ) -> None:
        """The host schedule cache (``schedules``) and the device copy of its kept schedule; the quantized op
        (``quant_kernel``) schedules the same, a head class at a time (``classes``: per layer, each unit's kernel)."""
        chunk = -(-config.fixed_chunk_tokens // page_size) if batch_invariant else 0
        splits = pow2_ceil(-(-pages_per_seq // chunk)) if chunk else 0
        most = max((len(set(c)) for c in classes), default=1) if classes else 1
        shape = compiled_shape(layouts, max_batch, num_programs, config=config, splits=splits, classes=most)
        self.schedules = ScheduleCache(
            layouts,
            page_size,
            num_programs,
            config=config,
            chunk_pages=chunk,
            splits=splits,
            shape=shape,
            classes=classes,
        )
        self._schedule: DecodeSchedule | None = None
        self._schedule_id = -1

    def schedule(self, lengths) -> DecodeSchedule:
        """The schedule of all layers for sequences of ``lengths`` tokens (new token included), on the device."""
        schedule = self.schedules(np.asarray(lengths))
        if self.schedules.rebuilds != self._schedule_id:
            self._schedule, self._schedule_id = jax.device_put(schedule), self.schedules.rebuilds
        assert self._schedule is not None
        return self._schedule

    def run(
        self, q, k_pages, v_pages, block_table, lengths, schedule: DecodeSchedule, layout: HeadLayout, rebuild=None
    ):
        """One layer's attention (``schedule``: that layer's, ``DecodeSchedule.layer``; ``layout``: one of the op's
        layouts; ``rebuild``: a banded op's ``models.latent.LatentK``, whose band is the op's); see
        ``paged_decode``."""
        shared = self.groups.get(layout)
        if shared is None:
            raise ValueError(f"{layout} is not one of the layouts this decode op was built for")
        banded = {}
        if self.band is not None or rebuild is not None:
            if rebuild is None or rebuild.band != self.band:
                raise ValueError(f"this decode op reads keys in bands of {self.band}; pass the layer's banded rebuild")
            banded = dict(basis=rebuild.basis(), inv_freq=rebuild.inv_freq, band=self.band)
        return paged_decode(
            q,
            k_pages,
            v_pages,
            block_table,
            lengths,
            schedule,
            layout,
            interpret=self.interpret,
            shared=shared,
            **banded,
        )
