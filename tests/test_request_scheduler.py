"""Continuous batching: the scheduler and runner over a page-exact fake engine (fast, thousands of steps) and over a
real tiny model (greedy tokens equal the repeated-argmax loop whatever the arrival order, preemptions included)."""

import hashlib

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS
from test_generate import argmax_continuation

import kvjax
from kvjax.runtime.cache import window_span
from kvjax.runtime.engine import Engine, Rows, bucket
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request, Scheduler, State

VOCAB = 50


def next_token(context) -> int:
    """The fake model: the next token is a hash of the whole context, so a page read wrong changes it."""
    return hashlib.blake2b(np.asarray(context, np.int64).tobytes(), digest_size=4).digest()[0] % VOCAB


def single_run(prompt, max_new, stops) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < max_new:
        tokens.append(next_token(prompt + tokens))
        if tokens[-1] in stops:
            break
    return tokens


class FakeEngine:
    """The engine's contract on token ids instead of K/V: pages hold the ids written at each position, and a
    sampled token is ``next_token`` of the ids read back through the block table. ``windows`` ({window: pages}):
    sliding-window pools, written alike; each read checks that the last ``window`` ids read through a window's
    table are the context's."""

    def __init__(
        self,
        num_pages,
        page_size,
        max_batch,
        pages_per_seq,
        batch_invariant=False,
        prefill_limit=1 << 20,
        windows=None,
        prefix_caching=False,
    ):
        self.num_pages, self.page_size, self.max_batch = num_pages, page_size, max_batch
        self.pages_per_seq, self.batch_invariant = pages_per_seq, batch_invariant
        self.chunk_tokens, self.prefill_limit = 1 << 20, prefill_limit
        self.prefill_min, self.prefill_rows = page_size, max_batch  # the Engine's defaults
        self.window_pages = dict(windows or {})
        self.windows = (None, *sorted(self.window_pages))
        counts = [num_pages, *(self.window_pages[w] for w in self.windows[1:])]
        self.pages = [np.full((n, page_size), -1, np.int64) for n in counts]
        self.slot_tokens = np.zeros(max_batch, np.int64)
        self.eviction = None  # keeps every token (test_engine_eviction's fake evicts)
        self.devices = 1  # one device: one per-head pool
        self.prefix_caching = prefix_caching

    def rows(self, n):
        return Rows.empty(n, self.pages_per_seq, len(self.windows))

    def _write(self, tables, position, token):
        for pool, table in zip(self.pages, tables):
            page = table[position // self.page_size]
            assert page != 0, "a write through the null page"
            pool[page, position % self.page_size] = token

    def _read(self, tables, end):
        def ids(pool, positions):
            return [int(self.pages[pool][tables[pool][p // self.page_size], p % self.page_size]) for p in positions]

        context = ids(0, range(end))
        for pool, w in enumerate(self.windows[1:], 1):
            seen = range(max(end - w, 0), end)
            assert ids(pool, seen) == context[seen.start :], "a window read other ids than the context's"
        return context

    def prefill(self, chunks, starts, rows, slots, tail_slots=None, heads=None):
        assert len(chunks) <= self.prefill_rows
        assert bucket(len(chunks)) * bucket(max(map(len, chunks)), self.prefill_min) <= self.prefill_limit
        new = np.zeros(len(chunks), np.int64)
        for i, (ids, start) in enumerate(zip(chunks, starts)):
            for j, token in enumerate(ids):
                self._write(rows.table[:, i], start + j, token)
            new[i] = next_token(self._read(rows.table[:, i], start + len(ids)))
            if slots[i] >= 0:
                self.slot_tokens[slots[i]] = new[i]
        return jnp.asarray(new)

    def decode(self, positions, active, rows, entries=None):
        for slot in np.flatnonzero(active):
            self._write(rows.table[:, slot], positions[slot], self.slot_tokens[slot])
        for slot in np.flatnonzero(active):
            self.slot_tokens[slot] = next_token(self._read(rows.table[:, slot], positions[slot] + 1))
        return jnp.asarray(self.slot_tokens.copy())


def check(scheduler: Scheduler):
    scheduler.check()
    for r in scheduler.running:
        assert all(len(pages) == scheduler.pages.pages_for(r.computed) for pages in scheduler.pages.table(r.id))


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_finish_with_their_single_run_tokens(seed):
    random_arrivals(seed, prefix=False)


@pytest.mark.parametrize("seed", range(12))
def test_shared_prefixes_read_cached_pages_and_every_request_keeps_its_tokens(seed):
    """Prefix caching: prompts over a few shared documents, random arrivals, lag and preemption; the fake engine's
    pages hold token ids, so a page shared wrongly (or written while shared) reads another context's ids. Some
    requests hit, and at the end no cached page has an owner."""
    scheduler = random_arrivals(seed + 1000, prefix=True)
    stats = scheduler.pages.stats()
    assert stats["prefix_hit_tokens"] > 0, stats
    assert scheduler.pages.prefix.idle_pages == stats["prefix_cached_pages"], "a cached page kept an owner"


def random_arrivals(seed, prefix):
    """30 random requests through a runner on the fake engine, each checked against a single run; the scheduler."""
    rng = np.random.default_rng(seed)
    page_size, num_pages = int(rng.choice([2, 4, 8])), int(rng.integers(12, 40))
    lag, invariant = int(rng.integers(0, 3)), bool(rng.integers(0, 2)) and not prefix
    chunk_tokens = int(rng.integers(1, 24))
    limit = 2 * bucket(max(chunk_tokens, page_size))  # the engine's bound on a prefill call's padded tokens
    batch = int(rng.integers(1, 6))
    engine = FakeEngine(num_pages, page_size, batch, (num_pages - 1), invariant, limit, prefix_caching=prefix)
    runner = Runner(engine, chunk_tokens=chunk_tokens, lag=lag)
    stops = set(rng.choice(VOCAB, 3, replace=False).tolist())
    capacity = (num_pages - 1) * page_size
    documents = [rng.integers(0, VOCAB, capacity // 2).tolist() for _ in range(3)]
    arrivals, requests, done = sorted(rng.integers(0, 60, 30).tolist()), [], []
    step = 0
    while arrivals or not runner.scheduler.idle or runner._pending:
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            n_prompt = int(rng.integers(1, capacity // 2))
            prompt = rng.integers(0, VOCAB, n_prompt).tolist()
            if prefix:  # a shared document's start, then a question of its own
                shared = int(rng.integers(0, n_prompt + 1))
                prompt = documents[int(rng.integers(0, 3))][:shared] + prompt[shared:]
            max_new = int(rng.integers(1, capacity - n_prompt + 2))
            r = Request(prompt, max_new, stop=lambda toks: toks[-1] in stops)
            requests.append(runner.add(r))
        done += runner.step()
        check(runner.scheduler)
        step += 1
        assert step < 20_000
    assert sorted(r.id for r in done) == sorted(r.id for r in requests if r.finish_reason != "error")
    for r in requests:
        assert r.state is State.FINISHED
        if r.finish_reason == "error":
            assert len(r.prompt) + r.max_new_tokens - 1 > capacity and "more than the" in r.error
            continue
        assert r.tokens == single_run(r.prompt, r.max_new_tokens, stops), r.id
        assert r.finish_reason == ("stop" if r.tokens[-1] in stops else "length")
        assert r.arrival <= r.first_token_time <= r.finish_time and r.token_times == sorted(r.token_times)
    assert runner.scheduler.pages.stats()["free_pages"] == num_pages - 1
    return runner.scheduler


@pytest.mark.parametrize("seed", range(6))
def test_window_pools_give_pages_back_and_every_request_keeps_its_tokens(seed):
    """Random arrivals over a whole-context pool and one or two sliding-window pools far smaller than the context:
    each window's pages go back as it passes them (the window pools hold a few windows, the contexts are long),
    pages add up in every pool after every step, and every request finishes with its single-run tokens."""
    rng = np.random.default_rng(100 + seed)
    page_size, chunk_tokens, max_batch = int(rng.choice([2, 4])), int(rng.integers(1, 12)), int(rng.integers(1, 4))
    num_pages = int(rng.integers(30, 60))
    windows = {}
    for w in rng.choice(np.arange(2, 24), int(rng.integers(1, 3)), replace=False).tolist():
        span = window_span(w, page_size, chunk_tokens, num_pages - 1)
        windows[w] = span + 1 + int(rng.integers(0, max_batch * span))
    engine = FakeEngine(num_pages, page_size, max_batch, num_pages - 1, windows=windows)
    runner = Runner(engine, chunk_tokens=chunk_tokens, lag=int(rng.integers(0, 3)))
    capacity = (num_pages - 1) * page_size
    requests, done, held = [], [], 0
    for _ in range(12):
        n_prompt = int(rng.integers(1, capacity // 2))
        prompt = rng.integers(0, VOCAB, n_prompt).tolist()
        requests.append(runner.add(Request(prompt, int(rng.integers(1, capacity - n_prompt + 2)))))
    step = 0
    while runner.busy:
        done += runner.step()
        check(runner.scheduler)
        pages = runner.scheduler.pages
        for i, w in enumerate(pages.windows[1:], 1):
            for r in runner.scheduler.running:
                live = [p for p in pages.table(r.id)[i] if p]
                assert len(live) <= window_span(w, page_size, chunk_tokens, num_pages - 1)
                held = max(held, len(pages.table(r.id)[0]) - len(live))
        step += 1
        assert step < 20_000
    assert held > 0  # some window gave pages back
    for r in requests:
        assert r.finish_reason == "length" and r.tokens == single_run(r.prompt, r.max_new_tokens, set()), r.id
    assert [a.free_pages for a in runner.scheduler.pages.allocators] == [
        num_pages - 1,
        *(n - 1 for n in windows.values()),
    ]


def test_a_request_whose_window_cannot_fit_its_pool_gets_its_own_error():
    engine = FakeEngine(num_pages=40, page_size=4, max_batch=2, pages_per_seq=39, windows={16: 3})
    runner = Runner(engine, chunk_tokens=8)
    ok = runner.add(Request([1, 2], 2))  # 3 positions: one page of the window pool
    too_wide = runner.add(Request(list(range(20)), 4))  # 16 + 8 - 1 positions ahead of a query: 7 pages at once
    assert too_wide.finish_reason == "error" and "16-token window's pool, which holds 2" in too_wide.error
    assert [r.id for r in runner.run()] == [ok.id] and ok.tokens == single_run([1, 2], 2, set())


@pytest.mark.parametrize("seed", range(4))
def test_cancelled_requests_free_their_pages_and_the_others_keep_their_tokens(seed):
    """Requests cancelled at random moments (waiting, prefilling, decoding, with tokens in flight): pages and slots
    add up after every step, a cancelled request keeps a prefix of its single-run tokens, the others all of them."""
    rng = np.random.default_rng(seed)
    engine = FakeEngine(num_pages=20, page_size=4, max_batch=3, pages_per_seq=19)
    runner = Runner(engine, chunk_tokens=6, lag=int(rng.integers(0, 3)))
    requests = [runner.add(Request(rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist(), 30)) for _ in range(12)]
    doomed = set(rng.choice(12, 5, replace=False).tolist())
    step = 0
    while not runner.scheduler.idle or runner._pending:
        for i in doomed:
            if rng.random() < 0.05 and runner.cancel(requests[i]):
                assert requests[i].finish_reason == "abort"
        runner.step()
        check(runner.scheduler)
        step += 1
        assert step < 5_000
    assert runner.scheduler.pages.allocators[0].free_pages == 19
    for i, r in enumerate(requests):
        want = single_run(r.prompt, 30, set())
        if r.finish_reason == "abort":
            assert i in doomed and r.tokens == want[: len(r.tokens)]
        else:
            assert r.tokens == want and r.finish_reason == "length"
    assert not runner.cancel(requests[0])  # already finished


def test_preemption_recomputes_and_keeps_every_token():
    """Four long requests in a pool that holds about two: the newest are preempted, recomputed, and finish right."""
    engine = FakeEngine(num_pages=17, page_size=4, max_batch=4, pages_per_seq=16)
    runner = Runner(engine, chunk_tokens=8)
    rng = np.random.default_rng(3)
    requests = [runner.add(Request(rng.integers(0, VOCAB, 10).tolist(), 40)) for _ in range(4)]
    while not runner.scheduler.idle or runner._pending:
        runner.step()
        check(runner.scheduler)
    assert sum(r.preemptions for r in requests) > 0
    assert requests[0].preemptions == 0  # the oldest is never the victim
    for r in requests:
        assert r.tokens == single_run(r.prompt, 40, set()) and r.finish_reason == "length"


def test_a_request_that_can_never_fit_gets_its_own_error_and_the_others_finish():
    engine = FakeEngine(num_pages=9, page_size=4, max_batch=2, pages_per_seq=8)
    runner = Runner(engine, chunk_tokens=16)
    ok = runner.add(Request([1, 2, 3], 5))
    too_big = runner.add(Request(list(range(30)), 10))
    assert too_big.state is State.FINISHED and too_big.finish_reason == "error"
    assert "needs 39 cache positions" in too_big.error and "32" in too_big.error
    assert [r.id for r in runner.run()] == [ok.id]
    assert ok.tokens == single_run([1, 2, 3], 5, set())


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_greedy_equals_repeated_argmax_for_any_arrival_order_with_preemption(backend):
    model = kvjax.Model.random(TINY_CONFIGS["mistral"], seed=4, scale=10.0)  # sliding window 5
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in (3, 21, 9, 14)]
    want = [argmax_continuation(model, p, 10) for p in prompts]
    engine = Engine(model, max_batch=3, max_seq_len=32, page_size=4, num_pages=12, backend=backend)
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
        runner = Runner(engine, chunk_tokens=6)
        requests = {}
        for n in order:
            requests[n] = runner.add(Request(prompts[n], 10))
            runner.step()  # arrivals interleave with steps
        for _ in runner.run():
            check(runner.scheduler)
        assert [requests[n].tokens for n in range(4)] == want
        assert sum(r.preemptions for r in requests.values()) > 0
