"""Continuous batching on the host (vLLM's scheduler, in its recompute-preemption form): ``Scheduler`` decides each
``Step``: which requests run, which prompt chunks they prefill, and which pages they own.

Running requests go first, oldest first; then waiting ones are admitted, first come first served, while a slot, the
step's token budget and free pages allow. When a running request needs a page and none is free, the most recently
admitted one is preempted and later prefills its prompt and tokens again, so no token is dropped, repeated or
reordered. Pages are the page manager's (``kvjax.runtime.pages``); the scheduler knows nothing of devices, and a
step's sampled tokens may reach it a step or more late. With eviction (``heads``) a request's prompt moves to
per-head pages at its end, and continual eviction (``continual``) cuts decoding requests' heads before any preemption.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from kvjax.eviction.continual import halved
from kvjax.runtime.pages import PageManager


class State(enum.Enum):
    WAITING = "waiting"  # queued: not admitted yet, or preempted
    RUNNING = "running"  # owns a slot and pages; prefilling or decoding
    DRAINING = "draining"  # every token's sampling is enqueued; waits for the last tokens (its pages go back
    # once the next step is scheduled: a step never reuses a page or slot that one of its own rows still reads)
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One prompt to continue, its sampling stream, and its timeline (``time.perf_counter`` seconds)."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0  # the sampling stream is (seed, stream); token i draws from it folded with i
    stream: int = 0
    stop: Callable[[list[int]], bool] | None = None  # called with the new tokens after each one: True stops
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    id: int = -1  # set by Scheduler.add

    tokens: list[int] = dataclasses.field(default_factory=list)  # new tokens, as they arrive
    token_times: list[float] = dataclasses.field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None  # "stop", "length", "error" or "abort" (``Scheduler.cancel``)
    error: str | None = None
    preemptions: int = 0

    state: State = State.WAITING
    slot: int | None = None  # its row in the decode step
    computed: int = 0  # context positions whose K/V are written or enqueued
    target: int = 0  # context positions to prefill before decoding: the prompt, plus the tokens kept at a preemption
    sampled: int = 0  # new tokens whose sampling is enqueued

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Prefill positions [start, end) of ``request``'s context into ``pages`` (per pool, by logical page);
    ``index`` >= 0: the chunk ends the prefill, and its last row's logits give new token ``index``, kept in row
    ``slot`` for the next decode (-1: none follows). ``tail_slot``: the request's slot whatever the chunk samples,
    whose tail page a quantized cache's chunks continue (``kvjax.ops.quant_paging``)."""

    request: Request
    start: int
    end: int
    pages: tuple[tuple[int, ...], ...]
    index: int
    slot: int
    tail_slot: int = -1
    heads: np.ndarray | None = (
        None  # evicting: the chunk ends the prompt, and these are its per-head tables (HeadPages.table)
    )


@dataclasses.dataclass(frozen=True)
class Decode:
    """Feed ``request``'s latest token (on the device, in row ``slot``) at ``position`` of ``pages``; sample new
    token ``index`` into the same row."""

    request: Request
    slot: int
    position: int
    pages: tuple[tuple[int, ...], ...]
    index: int
    entries: np.ndarray | None = None  # evicting: the per-head table entries this token filled (HeadPages.grow's rows)


@dataclasses.dataclass(frozen=True)
class Compress:
    """Continual eviction of ``request`` in row ``slot``, before the step runs: each head cut to ``target`` [L, Hkv]
    tokens, scored by its last queries, the latest at position ``last``."""

    request: Request
    slot: int
    last: int
    target: np.ndarray


@dataclasses.dataclass
class Step:
    chunks: list[Chunk]
    decodes: list[Decode]
    preempted: list[Request]
    compress: list[Compress] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.chunks or self.decodes)


class Scheduler:
    """Requests, a page pool of ``num_pages`` pages of ``page_size`` tokens, ``max_batch`` slots and a budget of
    ``chunk_tokens`` prompt tokens per step. ``windows``: sliding-window pools beside it, {window: pages}, whose
    pages a request gives back as its window passes them. ``fixed_chunks``: chunk boundaries fall every
    ``chunk_tokens`` positions of a context whatever else runs (batch-invariant prefill). ``heads``: evict into this
    per-head pool (``runtime.head_pages.HeadPages``), the pages stage prompts; ``last_chunk``: the fewest tokens a
    prompt's last chunk holds where the prompt has them; ``continual``: the eviction policy (``Eviction``) that cuts
    decoding requests' heads before the per-head pool preempts (None: preempt at once); ``cut_group``: such a cut keeps
    whole groups of this many slots and each head's partial group (quantized per-head pages; 0: any slot)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_batch: int,
        chunk_tokens: int,
        *,
        max_pages_per_seq: int | None = None,
        fixed_chunks: bool = False,
        windows: dict[int, int] | None = None,
        heads=None,
        last_chunk: int = 1,
        continual=None,
        cut_group: int = 0,
        prefix_caching: bool = False,
    ):
        self.pages = PageManager(
            num_pages,
            page_size,
            chunk_tokens,
            windows=windows,
            max_pages_per_seq=max_pages_per_seq,
            heads=heads,
            prefix_caching=prefix_caching,
        )
        if last_chunk > chunk_tokens:
            raise ValueError(f"a prompt's last chunk of {last_chunk} tokens does not fit chunk_tokens={chunk_tokens}")
        self.evicting, self.last_chunk = heads is not None, last_chunk
        self._staged: list[Request] = []  # evicted in the step just scheduled: their staging pages go back next
        self.continual = continual if heads is not None else None
        self.cut_group = cut_group  # a cut keeps whole groups of this many slots (quantized pages), 0: any slot
        self._settled: set[int] = set()  # requests whose prompt eviction's kept counts have arrived
        self.max_batch, self.chunk_tokens = max_batch, chunk_tokens
        self.fixed_chunks = fixed_chunks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.draining: list[Request] = []
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._next_id = 0

    # requests in

    def add(self, request: Request) -> Request:
        """Queue ``request``; one that could never fit the cache finishes at once with an error of its own."""
        request.id, self._next_id = self._next_id, self._next_id + 1
        positions = len(request.prompt) + request.max_new_tokens - 1
        refusal = self.pages.refusal(
            positions, f"{len(request.prompt)} prompt tokens + {request.max_new_tokens} new - 1"
        )
        if refusal is not None:
            self._finish(request, "error", f"request {request.id} {refusal}")
            return request
        request.target = len(request.prompt)
        self.waiting.append(request)
        return request

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.draining)

    # the next step

    def schedule(self) -> Step:
        """The next step's chunks and decode rows, with the pages they need allocated (preempting if none are
        free)."""
        for r in self.draining:  # their last step is enqueued: a later one may reuse what they held
            self._release(r)
        for r in self._staged:  # evicted into per-head pages by the step before
            self.pages.end_prompt(r.id)
        self._staged = []
        self.pages.commit()  # the pages the step before filled are enqueued: now they may be shared
        step = Step([], [], [])
        budget = self.chunk_tokens
        if self.evicting:  # per-head pages the next query of a sliding-window head no longer sees
            self.pages.release_passed_heads([r.id for r in self.running if not r.prefilling])
        for r in list(self.running):
            if r.state is not State.RUNNING:  # preempted earlier in this loop
                continue
            if r.prefilling:
                budget -= self._schedule_chunk(r, budget, step)
            else:
                self._schedule_decode(r, step)
        while self.waiting and self._free_slots and budget > 0:
            r = self.waiting[0]
            if r.sampled > len(r.tokens):  # preempted with tokens in flight: wait for them
                break
            prefix = self._cached_prefix(r)
            r.computed = len(prefix) * self.pages.page_size
            first = self._chunk_end(r, budget) - r.computed
            if first <= 0 or not self._admissible(r, first, prefix):
                r.computed = 0
                break
            self.pages.take_prefix(r.id, prefix, r.target)
            self.waiting.popleft()
            r.state, r.slot = State.RUNNING, self._free_slots.pop()
            self.running.append(r)
            budget -= self._schedule_chunk(r, budget, step)
        return step

    def _cached_prefix(self, r: Request) -> list[int]:
        """The cached pages of waiting r's context (prefix caching): full pages only, never its last token, whose
        logits the last chunk must compute."""
        if self.pages.prefix is None:
            return []
        return self.pages.cached_prefix(r.context[: r.target], (r.target - 1) // self.pages.page_size)

    def _admissible(self, r: Request, first: int, prefix: list[int]) -> bool:
        """Whether waiting r can start now with a first chunk of ``first`` tokens after its cached ``prefix``: its
        pages for them; evicting, the staging pages of its whole prompt and room in the per-head pool for all of
        it."""
        if not self.evicting:
            return self.pages.can_take_prefix(r.id, prefix, r.computed + first)
        return self.pages.can_grow(r.id, r.target) and self.pages.can_hold_heads(r.id, r.target)

    def _chunk_end(self, r: Request, budget: int) -> int:
        """Where r's next chunk ends: within ``budget`` (at the next multiple of ``chunk_tokens`` with
        ``fixed_chunks``), leaving the prompt's last chunk at least ``last_chunk`` tokens; r.computed: none fits."""
        if self.fixed_chunks:
            end = min(r.target, (r.computed // self.chunk_tokens + 1) * self.chunk_tokens)
        else:
            end = min(r.target, r.computed + budget)
        if 0 < r.target - end < self.last_chunk:  # a last chunk too short for eviction's window of queries
            end = r.target - self.last_chunk if r.target - self.last_chunk > r.computed else r.target
        return end if end - r.computed <= budget else r.computed

    def _schedule_chunk(self, r: Request, budget: int, step: Step) -> int:
        """Schedule r's next chunk within ``budget``; returns the tokens it takes."""
        end = self._chunk_end(r, budget)
        if end <= r.computed or not self._grow(r, r.target if self.evicting else end, step):
            return 0
        sample = end == r.target
        heads = None
        if sample and self.evicting:  # the prompt ends here: every head takes pages for all of it
            if self._grow_heads(r, r.target, step) is None:
                return 0
            heads = self.pages.heads.table(r.id)
            self._staged.append(r)
        start, pages, index = r.computed, self.pages.table(r.id), r.sampled if sample else -1
        taken, r.computed = end - r.computed, end
        if self.pages.prefix is not None:
            self.pages.filled(r.id, r.context, start, end)
        if sample:
            self._sampled_one(r)
        slot = -1 if r.slot is None else r.slot
        step.chunks.append(Chunk(r, start, end, pages, index, slot if sample else -1, slot, heads))
        return taken

    def _schedule_decode(self, r: Request, step: Step) -> None:
        entries = None
        if self.evicting:
            entries = self._grow_heads(r, 1, step)
            if entries is None:
                return
        elif not self._grow(r, r.computed + 1, step):
            return
        assert r.slot is not None
        step.decodes.append(Decode(r, r.slot, r.computed, self.pages.table(r.id), r.sampled, entries))
        r.computed += 1
        self._sampled_one(r)

    def _sampled_one(self, r: Request) -> None:
        r.sampled += 1
        if r.sampled == r.max_new_tokens:  # nothing more to run: its pages and slot go back after this step
            self.running.remove(r)
            r.state = State.DRAINING
            self.draining.append(r)

    def _grow(self, r: Request, positions: int, step: Step) -> bool:
        """Give r pages for ``positions`` tokens (first giving back the window pages its queries from ``r.computed``
        on can no longer see), preempting the newest other requests if needed; False if r itself had to be
        preempted."""
        self.pages.release_passed(r.id, r.computed)
        return self._preempting(r, step, lambda: self.pages.grow(r.id, positions) or None) is not None

    def _grow_heads(self, r: Request, tokens: int, step: Step):
        """``tokens`` more tokens in every head of r's per-head pages, preempting the newest others if needed: the
        table entries filled, or None if r itself had to be preempted."""
        return self._preempting(r, step, lambda: self.pages.grow_heads(r.id, tokens), relieve=self._cut)

    def _preempting(self, r: Request, step: Step, take, relieve=None):
        """``take()`` until it gives something other than None (it changes nothing when it gives None), first
        ``relieve(r, step)`` while it frees something, then preempting the newest running request before each retry;
        what it gave, or None once r itself was preempted."""
        while (got := take()) is None:
            if relieve is not None and relieve(r, step):
                continue
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is r:
                return None
        return got

    def _cut(self, r: Request, step: Step) -> bool:
        """Continual eviction for r's growth: of the decoding requests this step has not scheduled yet (r and those
        admitted after it) whose prompt eviction has been heard back, and not cut in this step already, cut the one
        whose cut frees the most per-head pages; False if none frees any."""
        if self.continual is None:
            return False
        cut = {c.request.id for c in step.compress}
        later = self.running[self.running.index(r) :] if r in self.running else []
        best, most = None, 0
        for x in later:
            if x.prefilling or x.id not in self._settled or x.id in cut:
                continue
            counts, windows = self.pages.head_counts(x.id), self.pages.heads.windows
            target = halved(self.continual, counts, x.computed, windows, group=self.cut_group)
            freed = self.pages.cut_frees(x.id, target)
            if freed > most:
                best, most = (x, target), freed
        if best is None:
            return False
        x, target = best
        self.pages.cut_heads(x.id, target)
        assert x.slot is not None
        step.compress.append(Compress(x, x.slot, x.computed - 1, target.astype(np.int32)))
        return True

    def _preempt(self, r: Request, step: Step) -> None:
        self.running.remove(r)
        self._release(r)
        r.state, r.computed, r.preemptions = State.WAITING, 0, r.preemptions + 1
        r.target = len(r.prompt) + r.sampled  # its tokens so far are prefilled again
        self.waiting.appendleft(r)
        step.preempted.append(r)

    def _release(self, r: Request) -> None:
        self.pages.free(r.id)
        self._settled.discard(r.id)
        if r.slot is not None:
            self._free_slots.append(r.slot)
            self._free_slots.sort(reverse=True)  # the lowest slot goes first: decode rows stay packed
            r.slot = None

    # tokens out

    def evicted(self, r: Request, epoch: int, prompt: int, kept) -> None:
        """The device kept ``kept`` [layers, heads] tokens of each head of r's ``prompt``-token prompt, evicted at
        preemption count ``epoch``: the per-head pages past them go back. Nothing to do for a request since
        preempted, finished or draining (its pages have gone or will go back whole)."""
        if r.state is State.RUNNING and r.preemptions == epoch and self.pages.holds_heads(r.id):
            self.pages.evicted(r.id, prompt, kept)
            self._settled.add(r.id)

    def arrived(self, r: Request, index: int, token: int, now: float) -> bool:
        """Record new token ``index`` of r (sampled in a step now read); tokens after r finished are dropped.
        Returns whether r finished with it."""
        if r.state is State.FINISHED:
            return False
        if index != len(r.tokens):
            raise RuntimeError(f"request {r.id}: token {index} arrived after {len(r.tokens)} tokens")
        r.tokens.append(token)
        r.token_times.append(now)
        if r.stop is not None and r.stop(r.tokens):
            self._finish(r, "stop")
        elif len(r.tokens) == r.max_new_tokens:
            self._finish(r, "length")
        else:
            return False
        return True

    def cancel(self, r: Request, reason: str = "abort") -> bool:
        """Finish ``r`` now (a client gone, a server stopping): its pages and slot go back at once, tokens still in
        flight for it are dropped as they arrive. Returns False if it had already finished."""
        if r.state is State.FINISHED:
            return False
        self._finish(r, reason)
        return True

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        for queue in (self.running, self.draining):
            if r in queue:
                queue.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self._release(r)
        r.state, r.finish_reason, r.error, r.finish_time = State.FINISHED, reason, error, time.perf_counter()

    def check(self) -> None:
        """Raise AssertionError unless pages and slots add up: the page manager's invariants for the requests that
        hold pages (``PageManager.check``), one slot per request that holds one, none held by a waiting request (the
        scheduler tests call it after every step)."""
        holders = [*self.running, *(r for r in self.draining if r.slot is not None)]  # not yet released
        if self.evicting:  # staging: the whole prompt from its first chunk to the step after its last
            staged = [r for r in holders if r.prefilling or r in self._staged]
            self.pages.check({r.id: r.target for r in staged})
            with_heads = {r.id for r in holders if not r.prefilling}
            assert all(self.pages.holds_heads(i) for i in with_heads), "a decoding request holds no per-head pages"
            assert not any(self.pages.holds_heads(r.id) for r in holders if r.prefilling), "a prompt holds heads early"
        else:
            self.pages.check({r.id: r.computed for r in holders})
        slots = [r.slot for r in self.running] + [r.slot for r in self.draining if r.slot is not None]
        assert None not in slots and len(set(slots)) == len(slots), "slots are not one per running request"
        assert len(slots) + len(self._free_slots) == self.max_batch, "slots leaked"
        assert all(not self.pages.holds(r.id) and r.slot is None for r in self.waiting), "a waiting request holds pages"
