"""The continuous-batching loop: schedule step n + 1 and enqueue it on the device, then read step n's tokens.

Sampled tokens stay on the device between steps (``Engine.slot_tokens``), so the host never waits for a token before
it launches the next step; it learns of an EOS or a stop string one step late and drops the extra token. In each
step the decode rows run before the prompt chunks: a slot or page handed from a request that just finished to one
just admitted is then written by the newcomer last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Iterator

import jax
import numpy as np

from kvjax.runtime.engine import Engine, prefill_groups
from kvjax.runtime.scheduler import Chunk, Decode, Request, Scheduler, Step


@dataclasses.dataclass
class _Pending:
    """Tokens of an enqueued step, still on the device: ``tokens[row]`` is new token ``index`` of ``request``."""

    tokens: jax.Array
    rows: list[tuple[Request, int, int]]
    kept: jax.Array | None = None  # an evicting prefill call's kept counts [rows, L, Hkv]
    evicted: list[tuple[Request, int, int, int]] = dataclasses.field(default_factory=list)  # (r, row, epoch, prompt)


class Runner:
    """Requests in, finished requests out, over one engine. ``chunk_tokens``: prompt tokens prefilled per step (at
    most, and by default, the engine's); ``lag``: steps enqueued ahead of the one read (0: read each step before
    the next, as a plain loop would)."""

    def __init__(self, engine: Engine, *, chunk_tokens: int | None = None, lag: int = 1):
        self.engine, self.lag = engine, lag
        chunk_tokens = chunk_tokens or engine.chunk_tokens
        if chunk_tokens > engine.chunk_tokens:
            raise ValueError(
                f"chunk_tokens={chunk_tokens} is more than the {engine.chunk_tokens} the engine's memory was sized for"
            )
        self.scheduler = Scheduler(
            engine.num_pages,
            engine.page_size,
            engine.max_batch,
            chunk_tokens,
            max_pages_per_seq=engine.pages_per_seq,
            fixed_chunks=engine.batch_invariant,
            windows=engine.window_pages,
            prefix_caching=engine.prefix_caching,
            **_eviction(engine),
        )
        self._pending: deque[list[_Pending]] = deque()
        self.steps = 0

    @property
    def busy(self) -> bool:
        """Requests remain to schedule, or steps remain to read."""
        return not self.scheduler.idle or bool(self._pending)

    def add(self, request: Request) -> Request:
        return self.scheduler.add(request)

    def step(self) -> list[Request]:
        """Schedule and enqueue one step, then read the steps more than ``lag`` behind it; returns the requests
        that finished (an error on add finishes a request too: ``add`` returns it finished)."""
        step = self.scheduler.schedule()
        if not step:  # all waits on tokens in flight (or nothing is left): read them
            if not self._pending and not self.scheduler.idle:
                raise RuntimeError("the scheduler can run nothing and waits for nothing")  # a bug, never a load
            return self.drain()
        self._pending.append(self._enqueue(step))
        self.steps += 1
        finished = []
        while len(self._pending) > self.lag:
            finished += self._read(self._pending.popleft())
        return finished

    def cancel(self, request: Request) -> bool:
        """Finish ``request`` now, its pages freed (``Scheduler.cancel``); False if it had already finished."""
        return self.scheduler.cancel(request)

    def drain(self) -> list[Request]:
        """Read every enqueued step (waiting for the device); returns the requests that finished."""
        finished = []
        while self._pending:
            finished += self._read(self._pending.popleft())
        return finished

    def run(self) -> Iterator[Request]:
        """Step until every added request has finished, yielding each as it finishes. Left early (an exception such
        as KeyboardInterrupt, or the iteration dropped), it first waits for the steps already on the device
        (``settle``)."""
        try:
            while self.busy:
                yield from self.step()
        except BaseException:
            with contextlib.suppress(Exception):  # a failed step's arrays raise again: the first error is the one
                self.settle()
            raise

    def settle(self) -> None:
        """Wait until the device has run every step enqueued so far; their tokens stay to be read.

        Steps run asynchronously: ``step`` returns with the next one still computing (``lag``). A process that exits
        with one in flight, say on Ctrl-C, tears the runtime down under the computing thread: "terminate called
        without an active exception" and SIGABRT (exit 134). So whoever stops stepping calls this before exiting.
        The engine's state is the output of the last step enqueued, so it covers that one even when it was
        interrupted before joining ``_pending``."""
        jax.block_until_ready(
            ([p.tokens for pending in self._pending for p in pending], self.engine.slot_tokens, self.engine.cache)
        )

    def _enqueue(self, step: Step) -> list[_Pending]:
        for c in step.compress:  # before the step: it may write pages the cut gave back
            if c.request not in step.preempted:
                self.engine.compress(c.slot, c.last, c.target)
        out = []
        if step.decodes:
            out.append(self._decode(step.decodes))
        if step.chunks:
            if self.engine.batch_invariant:
                groups = [[c] for c in step.chunks]
            else:
                lengths = [c.end - c.start for c in step.chunks]
                engine = self.engine
                calls = prefill_groups(lengths, engine.prefill_limit, engine.prefill_min, engine.prefill_rows)
                groups = [[step.chunks[i] for i in call] for call in calls]
            out += [self._prefill(g) for g in groups]
        for p in out:
            p.tokens.copy_to_host_async()
            if p.kept is not None:
                p.kept.copy_to_host_async()
        return out

    def _decode(self, decodes: list[Decode]) -> _Pending:
        engine = self.engine
        rows = engine.max_batch  # row i is slot i
        meta = engine.rows(rows)
        positions, active = np.zeros(rows, np.int32), np.zeros(rows, bool)
        entries = []
        for d in decodes:
            r = d.request
            meta.set(d.slot, d.pages, r.seed, r.stream, d.index, r.temperature, r.top_p)
            positions[d.slot], active[d.slot] = d.position, True
            if d.entries is not None and len(d.entries):
                entries.append(np.concatenate([np.full((len(d.entries), 1), d.slot, np.int32), d.entries], 1))
        tokens = engine.decode(positions, active, meta, np.concatenate(entries) if entries else None)
        return _Pending(tokens, [(d.request, d.slot, d.index) for d in decodes])

    def _prefill(self, chunks: list[Chunk]) -> _Pending:
        meta = self.engine.rows(len(chunks))
        for row, c in enumerate(chunks):
            r = c.request
            meta.set(row, c.pages, r.seed, r.stream, max(c.index, 0), r.temperature, r.top_p)
        tokens = self.engine.prefill(
            [c.request.context[c.start : c.end] for c in chunks],
            [c.start for c in chunks],
            meta,
            [c.slot for c in chunks],
            [c.tail_slot for c in chunks],
            [c.heads for c in chunks],
        )
        rows = [(c.request, row, c.index) for row, c in enumerate(chunks) if c.index >= 0]
        evicted = [
            (c.request, row, c.request.preemptions, c.end) for row, c in enumerate(chunks) if c.heads is not None
        ]
        return _Pending(tokens, rows, self.engine.kept if evicted else None, evicted)

    def _read(self, pending: list[_Pending]) -> list[Request]:
        finished = []
        for p in pending:
            tokens = np.asarray(p.tokens)
            now = time.perf_counter()
            for request, row, index in p.rows:
                if self.scheduler.arrived(request, index, int(tokens[row]), now):
                    finished.append(request)
            if p.evicted:
                kept = np.asarray(p.kept)
                for request, row, epoch, prompt in p.evicted:
                    self.scheduler.evicted(request, epoch, prompt, kept[row])
        return finished


def _eviction(engine: Engine) -> dict:
    """The scheduler's eviction settings for ``engine``: its per-head pool (a ``HeadPages`` of the engine's format)
    and the fewest tokens of a prompt's last chunk (the eviction's window of queries); none for one that keeps every
    token."""
    if engine.eviction is None:
        return {}
    from kvjax.runtime.head_pages import HeadPages

    heads = HeadPages(
        engine.head_pages, engine.head_per_page, engine.head_max_pages, engine.devices, windows=engine.head_windows
    )
    continual = engine.eviction if engine.continual else None
    return dict(heads=heads, last_chunk=engine.eviction.window, continual=continual, cut_group=engine.continual_group)
