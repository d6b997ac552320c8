"""The decode op's schedule cache: one schedule kept until a sequence outgrows it, the next built ahead on a thread.

Each sequence is scheduled ``min(config.headroom_tokens, length)`` tokens past its length, in whole pages, so a
schedule lives about ``headroom_tokens`` steps. The kernel loops only up to the real lengths, so spare pages cost
no bandwidth, only balance; each doubling of the headroom halves the rebuilds and about doubles the balance lost
(bench/results/kernels.md "Host cost of the plan"). Capping at the length keeps rows that barely started (padding rows
have length 1) from weighing like long ones.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools

import numpy as np

from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.schedule import (
    BuiltSchedule,
    DecodeSchedule,
    ScheduleShape,
    as_layouts,
    build_decode_schedule,
    fixed_chunk_schedule,
)


@functools.cache
def keep_heap() -> None:
    """Ask glibc to keep freed memory, once per process: a build's numpy temporaries are ~0.5 MB each, and handing
    them back to the OS after every build means faulting them in again next time (5x slower builds in VMs)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 512 << 20)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


@functools.cache
def _scheduling_thread() -> concurrent.futures.ThreadPoolExecutor:
    """One worker for all schedule caches: builds run beside the steps (numpy drops the GIL in its loops). Started
    with the cache: a step that started it would wait out the GIL's switch interval while it runs a build."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvjax-schedule")
    pool.submit(int).result()
    return pool


class ScheduleCache:
    """Keeps one schedule (``built``, a ``BuiltSchedule``) until a sequence outgrows it or the batch changes (as
    vLLM's and FlashInfer's builders do).

    ahead: when the sequences that grew in the last step will outgrow the schedule within ``headroom_tokens // 4``
    steps, the next schedule is built on a background thread for the lengths expected then, and taken if it covers
    the lengths (else the step builds one), so steps do not wait for builds. ``rebuilds`` counts the schedules
    taken, ``built_ahead`` those of them built ahead. ``chunk_pages`` > 0 schedules batch-invariantly
    (``schedule.fixed_chunk_schedule`` with ``splits`` slots a group).

    classes: per layer, each unit's class, scheduled a class at a time (``schedule.build_decode_schedule``; not
    with ``chunk_pages``, whose split depends on a sequence's length alone).

    shape: every schedule comes padded to this shape (``schedule.compiled_shape``), so a jitted step taking them
    compiles once; a schedule that does not fit widens it for good (``reshaped`` counts how often: each compiles
    the step again).
    """

    def __init__(
        self,
        layouts,
        page_size: int,
        num_programs: int | None = None,
        *,
        config: DecodeConfig = DECODE,
        ahead: bool = True,
        chunk_pages: int = 0,
        splits: int = 0,
        shape: ScheduleShape | None = None,
        classes=None,
    ):
        self.layouts, self.page_size, self.config = as_layouts(layouts), page_size, config
        self.classes = classes
        self.chunk_pages, self.splits = chunk_pages, splits
        self.num_programs = num_programs or config.num_programs()
        self.headroom_tokens, self.ahead = config.headroom_tokens, ahead
        self.built: BuiltSchedule | None = None
        self.shape = ScheduleShape(1, 1, 1) if shape is None else shape
        self.rebuilds = self.built_ahead = self.reshaped = 0
        self._next: concurrent.futures.Future | None = None
        self._last = np.zeros(0, np.int64)  # the lengths of the previous call
        keep_heap()
        if ahead:
            _scheduling_thread()

    def build(self, lengths) -> BuiltSchedule:
        """A schedule for these lengths with this cache's headroom, built in the calling thread."""
        lengths = np.asarray(lengths)
        if self.chunk_pages:
            built = fixed_chunk_schedule(
                lengths,
                self.layouts,
                self.page_size,
                self.num_programs,
                chunk_pages=self.chunk_pages,
                splits=self.splits,
                config=self.config,
            )
        else:
            headroom = -(-np.minimum(self.headroom_tokens, lengths) // self.page_size)
            built = build_decode_schedule(
                lengths,
                self.layouts,
                self.page_size,
                self.num_programs,
                config=self.config,
                headroom_pages=headroom,
                fit=self.shape,
                classes=self.classes,
            )
        return self._fitted(built)

    def _fitted(self, built: BuiltSchedule) -> BuiltSchedule:
        """``built`` padded to the cache's shape, or to the shape that holds both."""
        shape = self.shape.cover(built.schedule.shape)
        if shape == built.schedule.shape:
            return built
        return dataclasses.replace(built, schedule=built.schedule.padded(shape))

    def __call__(self, lengths) -> DecodeSchedule:
        """The kept schedule if it covers ``lengths``, else a new one."""
        lengths = np.asarray(lengths)
        last, self._last = self._last, lengths.copy()
        if self.built is None or not self.built.covers(lengths):
            ahead, self._next = self._next, None
            built = ahead.result() if ahead is not None else None
            if built is not None and built.covers(lengths):
                self.built_ahead += 1
            else:
                built = self.build(lengths)
            built = self._fitted(built)  # a schedule built ahead may predate a wider shape
            if built.schedule.shape != self.shape:
                self.shape, self.reshaped = built.schedule.shape, self.reshaped + 1
            self.built, self.rebuilds = built, self.rebuilds + 1
        elif self.ahead and self._next is None and last.shape == lengths.shape and np.any(grows := lengths > last):
            steps_left = int((self.built.capacity - lengths)[grows].min())
            if steps_left <= self.headroom_tokens // 4:
                expected = np.where(grows, lengths + steps_left + 1, lengths)
                self._next = _scheduling_thread().submit(self.build, expected)
        return self.built.schedule
