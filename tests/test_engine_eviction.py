"""Eviction in the engine (issue 37, items 4 and 5): prompts prefilled into staging pages, evicted at their end into
per-head pages on the device, decoded from those. A page-exact fake engine drives the scheduler, page manager and
runner through thousands of steps where pages change hands (every head's survivors read back after every step); a
tiny real model gives ``eviction.reference``'s tokens, and a budget past every prompt changes no token."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed
from test_gemma3 import local_then_global
from test_request_scheduler import VOCAB, FakeEngine, next_token, single_run

import kvjax
from kvjax.eviction.reference import evicted_hidden
from kvjax.eviction.select import Eviction, parse
from kvjax.ops.decode.config import DECODE
from kvjax.ops.paging import NULL_PAGE
from kvjax.runtime.config import EngineConfig
from kvjax.runtime.engine import Engine
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request, State

WIDE = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)
CALIBRATION_SMALL = dict(calibration="random", num_tokens=256, seq_len=64, progress=False)


def kept_by_rule(position: int, token: int, layer: int, head: int) -> bool:
    """The fake eviction's choice: a head keeps a token by a hash of where and what it is (about two in three)."""
    return (position * 7919 + token * 104729 + layer * 31 + head * 17) % 3 != 0


class FakeEvictingEngine(FakeEngine):
    """``FakeEngine`` with eviction: at a prompt's end each (layer, head) keeps its ``kept_by_rule`` tokens (and the
    last ``protect``), written through the per-head tables the host gave into a pool of token ids; decode applies the
    host's table entries, appends each token to every head, then reads every active head back through its tables and
    checks it against the survivors it was given plus what was appended since. Sampling follows the whole context
    (``next_token``), so every request still finishes with its single-run tokens whatever was evicted.

    ``head_windows`` (a window or None per layer): a sliding-window layer's heads keep only tokens of the prompt's
    last window, and each decode reads back only the slots the new token's window sees, as the real engine does
    (``head_paging.window_first``); the host may give back the pages before them. A cut never touches them."""

    def __init__(self, head_pages, per_page, head_max_pages, window, eviction=None, head_windows=None, **kw):
        super().__init__(**kw)
        self.head_windows = head_windows
        self.continual = not all(head_windows or (None,))  # as the engine: some layer sees the whole context
        self.continual_group = 0  # cuts keep any slot (bf16 pages)
        self.eviction = eviction or Eviction("snapkv", ratio=2.0, window=window)
        self.head_pages, self.head_per_page, self.head_max_pages = head_pages, np.asarray(per_page), head_max_pages
        layers, heads = self.head_per_page.shape
        self.pool = np.full((head_pages, int(self.head_per_page.max())), -1, np.int64)
        self.tables = np.full((self.max_batch, layers, heads, head_max_pages), NULL_PAGE, np.int64)
        self.stored = np.zeros((self.max_batch, layers, heads), np.int64)
        self.expected: dict[int, list] = {}  # slot -> [layer][head]: the ids each head must read back
        self.where: dict[int, list] = {}  # slot -> [layer][head]: each stored id's position
        self.owner_of: dict[int, tuple] = {}  # page -> the (slot, layer, head) the host gave it to last
        self.contexts: dict[int, list[int]] = {}  # slot -> its request's context so far
        self.kept, self.evictions, self.protect = None, 0, window
        self.compressions = 0

    def _head_slot(self, slot, layer, head, i):
        per = self.head_per_page[layer, head]
        page = self.tables[slot, layer, head, i // per]
        assert page != NULL_PAGE, "a per-head slot through the null page"
        assert self.owner_of[page] == (slot, layer, head), "a slot through a page the host gave to another head"
        return page, i % per

    def _own(self, slot, layer, head, page):
        if page != NULL_PAGE:
            self.owner_of[page] = (slot, layer, head)

    def prefill(self, chunks, starts, rows, slots, tail_slots=None, heads=None):
        new = super().prefill(chunks, starts, rows, slots, tail_slots)
        layers, kv_heads = self.head_per_page.shape
        kept = np.zeros((len(chunks), layers, kv_heads), np.int32)
        for i, table in enumerate(heads or []):
            if table is None:
                continue
            end = starts[i] + len(chunks[i])
            assert len(chunks[i]) >= min(self.eviction.window, end), "a prompt's last chunk shorter than the window"
            context = self._read(rows.table[:, i], end)
            slot = slots[i]
            self.tables[slot], self.stored[slot] = table, 0
            for (layer, head, _), page in np.ndenumerate(table):
                self._own(slot, layer, head, page)
            self.expected[slot] = [[[] for _ in range(kv_heads)] for _ in range(layers)]
            self.where[slot] = [[[] for _ in range(kv_heads)] for _ in range(layers)]
            for layer in range(layers):
                w = self._window(layer) or end
                for head in range(kv_heads):
                    for p, token in enumerate(context):
                        if p >= end - w and (p >= end - self.protect or kept_by_rule(p, token, layer, head)):
                            self._append(slot, layer, head, token, p)
            kept[i] = self.stored[slot]
            self.contexts[slot] = context + [int(new[i])]
            self.evictions += 1
        self.kept = jnp.asarray(kept)
        return new

    def _window(self, layer):
        return None if self.head_windows is None else self.head_windows[layer]

    def _append(self, slot, layer, head, token, position):
        page, row = self._head_slot(slot, layer, head, self.stored[slot, layer, head])
        self.pool[page, row] = token
        self.expected[slot][layer][head].append(token)
        self.where[slot][layer][head].append(position)
        self.stored[slot, layer, head] += 1

    def compress(self, slot, last, target):
        """Continual eviction: each head keeps its last ``Eviction.recent`` slots and, of the others, those first in a
        hash order, ``target`` in all, moved to its first slots through the pages the host left it."""
        assert last == len(self.contexts[slot]) - 2, "the latest query is not the last token written"
        guard = self.eviction.recent
        for layer, head in np.ndindex(*self.head_per_page.shape):
            tokens = self.expected[slot][layer][head]
            n, want = len(tokens), int(target[layer, head])
            if self._window(layer):
                assert want == n, "a cut of a sliding-window head"
                continue
            assert min(n, guard) <= want <= n, "a cut past a head's recent slots or past what it stores"
            others = sorted(range(n - min(n, guard)), key=lambda i: ((i * 7919 + tokens[i] * 31 + layer) % 11, i))
            keep = sorted(others[: want - min(n, guard)]) + list(range(n - min(n, guard), n))
            where = self.where[slot][layer][head]
            self.expected[slot][layer][head], self.where[slot][layer][head], self.stored[slot, layer, head] = [], [], 0
            for i in keep:
                self._append(slot, layer, head, tokens[i], where[i])
        self.compressions += 1

    def decode(self, positions, active, rows, entries=None):
        for slot, layer, head, index, page in entries if entries is not None else []:
            self.tables[slot, layer, head, index] = page
            self._own(slot, layer, head, page)
        live = np.flatnonzero(active)
        for slot in live:
            for layer, head in np.ndindex(*self.head_per_page.shape):
                self._append(slot, layer, head, int(self.slot_tokens[slot]), len(self.contexts[slot]) - 1)
        for slot in live:  # after every row wrote: a page two heads share shows here
            now = len(self.contexts[slot]) - 1  # the query's position
            for layer, head in np.ndindex(*self.head_per_page.shape):
                w = self._window(layer)
                first = 0 if w is None else sum(p <= now - w for p in self.where[slot][layer][head])
                got = [
                    int(self.pool[self._head_slot(slot, layer, head, i)])
                    for i in range(first, self.stored[slot, layer, head])
                ]
                want = self.expected[slot][layer][head][first:]
                assert got == want, f"slot {slot} head ({layer}, {head}) read other tokens"
            self.slot_tokens[slot] = next_token(self.contexts[slot])
            self.contexts[slot].append(int(self.slot_tokens[slot]))
        return jnp.asarray(self.slot_tokens.copy())


@pytest.mark.parametrize("seed", range(16))
def test_random_arrivals_with_eviction_keep_every_heads_survivors_and_every_token(seed):
    """The scheduler fuzz with eviction on: random arrivals, stops, lags and pools small enough to preempt; after every
    step the staging and per-head pages add up (none owned twice, owned + free = the pool, each head's pages those of
    its stored tokens), every decode reads each head's survivors back exactly, and every request finishes with its
    single-run tokens; at the end every page is free. Seeds 8 on give a tight per-head pool, where continual eviction
    cuts decoding heads (every cut head read back exactly after it) before anyone is preempted."""
    _fuzz(seed, windowed=False)


@pytest.mark.parametrize("seed", range(8))
def test_random_arrivals_on_sliding_windows_give_back_passed_head_pages(seed):
    """The same fuzz with a sliding window on one or both layers: each decode reads back exactly the slots its
    window sees while the host gives back the pages before them (``HeadPages.release_passed``) and hands them to
    other heads and requests; the pages add up after every step (released ones neither owned nor lost), and pages
    were given back while their owner still ran. Odd seeds have a tight pool: a layer without a window is cut
    (continual eviction) and a windowed one never is."""
    released = _fuzz(seed, windowed=True)
    assert released, f"seed {seed}: no window ever gave a page back"


def _fuzz(seed: int, windowed: bool) -> int:
    """The eviction fuzz of ``seed``; returns the most pages sliding windows had given back at once."""
    rng = np.random.default_rng(seed)
    page_size, max_batch = int(rng.choice([2, 4, 8])), int(rng.integers(1, 5))
    chunk_tokens = int(rng.integers(4, 24))
    window = int(rng.integers(1, chunk_tokens + 1))
    pages_per_seq = int(rng.integers(6, 14))
    per_page = rng.choice([page_size, 2 * page_size, 4 * page_size], size=(2, 2))
    if windowed:
        per_page[0, 0] = page_size  # a head of small pages: its window passes whole pages often
    one = int((-(-pages_per_seq * page_size // per_page)).sum())
    tight = seed % 2 == 1 if windowed else seed >= 8  # a tight pool cuts (or, with windows only, preempts)
    head_pages = int(rng.integers(one + 1, one + one // 2 + 2 if tight else 3 * one))
    # continual eviction's floor is the policy's budget: a small one cuts often
    policy = dict(budget=int(rng.integers(2, 12))) if rng.integers(0, 2) else dict(ratio=2.0)
    head_windows = None
    if windowed:  # its own stream: the other seeds' draws stay as they were
        draw = np.random.default_rng(seed + 1000).integers
        span = pages_per_seq * page_size // 2
        head_windows = (int(draw(1, span // 4 + 2)), None if tight or draw(0, 2) else int(draw(1, span)))
    engine = FakeEvictingEngine(
        head_pages,
        per_page,
        -(-pages_per_seq * page_size // int(per_page.min())),
        window,
        Eviction("snapkv", window=window, page_size=page_size, **policy),
        num_pages=2 * pages_per_seq + 1,
        page_size=page_size,
        max_batch=max_batch,
        pages_per_seq=pages_per_seq,
        batch_invariant=bool(rng.integers(0, 2)),
        head_windows=head_windows,
    )
    runner = Runner(engine, chunk_tokens=chunk_tokens, lag=int(rng.integers(0, 3)))
    released = 0
    stops = set(rng.choice(VOCAB, 2, replace=False).tolist())
    capacity = pages_per_seq * page_size
    arrivals, requests, done, step = sorted(rng.integers(0, 50, 20).tolist()), [], [], 0
    while arrivals or runner.busy:
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            n_prompt = int(rng.integers(1, capacity - 1))
            max_new = int(rng.integers(1, capacity - n_prompt + 1))
            requests.append(
                runner.add(Request(rng.integers(0, VOCAB, n_prompt).tolist(), max_new, stop=lambda t: t[-1] in stops))
            )
        done += runner.step()
        runner.scheduler.check()
        released = max(released, sum(int(r.sum()) for r in runner.scheduler.pages.heads._released.values()))
        step += 1
        assert step < 20_000
    assert sorted(r.id for r in done) == sorted(r.id for r in requests)
    for r in requests:
        assert r.state is State.FINISHED and r.tokens == single_run(r.prompt, r.max_new_tokens, stops), r.id
    pages = runner.scheduler.pages
    assert pages.allocators[0].free_pages == engine.num_pages - 1 and pages.heads.free_pages == head_pages - 1
    assert engine.evictions >= len(requests)
    return released


@pytest.mark.parametrize("head_windows", [None, (6, None)], ids=["whole", "local-global"])
def test_a_full_head_pool_cuts_decoding_heads_before_it_preempts(head_windows):
    """Continual eviction: four long requests in a per-head pool of about two sequences. Cutting heads (each to the
    policy's floor, its recent slots kept) comes first, and every cut head reads back exactly what the cut kept
    (the fake checks every decode); fewer requests are preempted than with preemption alone, and all finish with
    their single-run tokens. With a sliding window on layer 0 only layer 1 is cut (the fake checks it)."""

    def run(continual: bool):
        spec = Eviction("snapkv", budget=4, window=2, page_size=2)
        engine = FakeEvictingEngine(
            2 * 4 * 10 + 3,
            np.full((2, 2), 4),
            10,
            2,
            spec,
            head_windows=head_windows,
            num_pages=21,
            page_size=4,
            max_batch=4,
            pages_per_seq=10,
        )
        runner = Runner(engine, chunk_tokens=8)
        if not continual:
            runner.scheduler.continual = None
        rng = np.random.default_rng(5)
        requests = [runner.add(Request(rng.integers(0, VOCAB, 12).tolist(), 25)) for _ in range(4)]
        while runner.busy:
            runner.step()
            runner.scheduler.check()
        for r in requests:
            assert r.tokens == single_run(r.prompt, 25, set())
        return engine.compressions, sum(r.preemptions for r in requests)

    cuts, preempted = run(True)
    none, alone = run(False)
    assert none == 0 and cuts > 0 and preempted < alone, (cuts, preempted, alone)


def test_the_head_pool_preempts_when_full_and_every_request_still_finishes():
    """A per-head pool that holds about two sequences, four long requests: the newest are preempted (their per-head
    pages freed), recomputed and evicted again, and all finish with their single-run tokens."""
    engine = FakeEvictingEngine(
        2 * 4 * 10 + 3, np.full((2, 2), 4), 10, 4, num_pages=21, page_size=4, max_batch=4, pages_per_seq=10
    )
    runner = Runner(engine, chunk_tokens=8)
    rng = np.random.default_rng(5)
    requests = [runner.add(Request(rng.integers(0, VOCAB, 12).tolist(), 25)) for _ in range(4)]
    while runner.busy:
        runner.step()
        runner.scheduler.check()
    assert sum(r.preemptions for r in requests) > 0
    for r in requests:
        assert r.tokens == single_run(r.prompt, 25, set())


def _greedy(engine, prompts, new):
    runner = Runner(engine)
    requests = [runner.add(Request(p, new)) for p in prompts]
    for _ in runner.run():
        runner.scheduler.check()
    return [r.tokens for r in requests]


@pytest.mark.parametrize("plan", ["none", "zack"])
def test_a_budget_past_every_prompt_evicts_nothing_and_changes_no_token(plan):
    """Eviction whose budget holds every prompt: the engine's greedy tokens through staging and per-head pages equal
    the plain engine's, uncompressed and ZACK 0.5, prompts longer than a chunk."""
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    if plan == "zack":
        model = kvjax.compress(model, removal_rate=0.5, seed=seed % 1000, max_context=128, **CALIBRATION_SMALL)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in rng.integers(2, 90, 4)]
    settings = dict(max_batch=2, max_seq_len=128, chunk_tokens=32, backend="reference")
    plain = _greedy(Engine(model, **settings), prompts, 8)
    evicting = Engine(model, **settings, eviction="kvcompress:1000")
    assert _greedy(evicting, prompts, 8) == plain, f"seed {seed}"
    assert "evicting with kvcompress:1000" in evicting.describe()


def _reference_tokens(model, prompt, tokens, spec):
    """The greedy tokens ``eviction.reference`` gives after ``prompt`` evicted by ``spec``, teacher-forced on
    ``tokens``: its argmax at every position from the prompt's last."""
    hidden, _ = evicted_hidden(model, np.array([prompt + tokens[:-1]]), len(prompt), spec)
    logits = np.asarray(model.module.logits(hidden[0, len(prompt) - 1 :]))
    return logits.argmax(-1).tolist()


def _eviction_moved(model, prompt, tokens, spec) -> bool:
    """Whether ``spec`` moves the reference's hidden states after ``prompt`` (teacher-forced on ``tokens``) off those
    of a budget that keeps everything: the check that equal tokens were not equal because nothing was evicted.
    Greedy tokens are too coarse for it (seed 3010246055 at scale 0.5 gave the plain engine's tokens)."""
    context = np.array([prompt + tokens[:-1]])
    evicted, _ = evicted_hidden(model, context, len(prompt), spec)
    kept_all, _ = evicted_hidden(model, context, len(prompt), parse(f"{spec.method}:100000"))
    return float(jnp.abs(evicted - kept_all).max()) > 1e-3


@pytest.mark.parametrize("backend", ["reference", "interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("spec", ["kvcompress:3x", "snapkv:2x", "kvcompress:24:uniform"])
def test_the_evicting_engine_gives_the_reference_tokens(backend, spec, schedule="live"):
    """Greedy decoding after eviction on the device (scores from the last chunk's queries, selection, per-head
    pages, decode over them; the kernels in interpret mode) gives the tokens of ``eviction.reference``'s forward, in
    which each head of the prompt sees only the selection: prompts longer than a chunk, of several lengths."""
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in (70, 41, 6)]
    settings = dict(max_batch=2, max_seq_len=96, chunk_tokens=32, backend=backend)
    config = dataclasses.replace(DECODE, head_schedule=schedule)
    engine = Engine(model, **settings, eviction=spec, decode_config=config)
    got = _greedy(engine, prompts, 6)
    for prompt, tokens in zip(prompts, got):
        assert tokens == _reference_tokens(model, prompt, tokens, engine.eviction), f"seed {seed}, prompt {len(prompt)}"
    assert _eviction_moved(model, prompts[0], got[0], engine.eviction), f"seed {seed}"


@pytest.mark.parametrize(
    "spec, plan, backend",
    [
        ("h2o:3x", "none", "reference"),
        ("kvcompress-full:2x", "zack", "reference"),
        ("keyformer:3x", "none", "reference"),
        ("h2o:3x", "zack", "interpret"),
        ("keyformer:3x", "zack", "interpret"),  # the noise hashed in the mass kernel
        pytest.param("h2o:3x", "zack", "pallas", marks=pytest.mark.gpu),
        pytest.param("keyformer:3x", "none", "pallas", marks=pytest.mark.gpu),
    ],
)
def test_full_history_eviction_accumulated_over_chunks_gives_the_reference_tokens(spec, plan, backend):
    """H2O, KV-Compress's full form and Keyformer in the engine: each prefill chunk adds what its queries give the
    staged keys (``EvictingCache.mass``), and at the prompt's end the sums select as ``eviction.reference``'s
    whole-prompt scores do: greedy tokens equal the reference's, prompts of one to three chunks, the third prompt in
    staging pages the first left (their mass starts afresh), uncompressed and ZACK 0.5 (the rotated queries)."""
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    if plan == "zack":
        model = kvjax.compress(model, removal_rate=0.5, seed=seed % 1000, max_context=128, **CALIBRATION_SMALL)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in (70, 20, 45)]  # the third evicts in the first's pages
    settings = dict(max_batch=2, max_seq_len=96, chunk_tokens=32, backend=backend)
    engine = Engine(model, **settings, eviction=spec)
    assert engine.cache.mass is not None
    assert engine.continual and engine.cache.heads.sums is not None  # every one of them cuts mid-decode
    got = _greedy(engine, prompts, 6)
    for prompt, tokens in zip(prompts, got):
        assert tokens == _reference_tokens(model, prompt, tokens, engine.eviction), f"seed {seed}, prompt {len(prompt)}"
    assert _eviction_moved(model, prompts[0], got[0], engine.eviction), f"seed {seed}"


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_the_slot_schedule_gives_the_reference_tokens(backend):
    """The same with the decode kernel's slot grid (``DecodeConfig.head_schedule="slots"``) in place of the
    default live schedule, whose work list is built once a step from the live slots and read by every layer."""
    test_the_evicting_engine_gives_the_reference_tokens(backend, "kvcompress:3x", schedule="slots")


@pytest.mark.parametrize(
    "spec, plan, bits, backend, launches",
    [
        ("kvcompress:3x", "none", 4, "reference", "class"),
        ("snapkv:2x", "zack", 2, "interpret", "class"),  # the kernels: prefill stages, quant_head_kernel decodes
        ("snapkv:2x", "zack", 4, "interpret", "layer"),  # one decode launch a layer (DecodeConfig)
        ("kvcompress:3x", "zack", 2, "interpret", "k-class"),  # a decode launch a K class
        ("h2o:3x", "zack", 4, "reference", "class"),
        ("kvcompress:3x", "local-global", 4, "reference", "class"),
        pytest.param("kvcompress:3x", "zack", 4, "pallas", "class", marks=pytest.mark.gpu),
    ],
)
def test_eviction_on_quantized_pages_gives_the_teacher_forced_tokens(spec, plan, bits, backend, launches):
    """Eviction with ``kv_bits`` (KIVI-style, ``ops.quant_head_paging``): prompts staged exactly, each head's
    survivors compacted then quantized a page of slots at a time, the partial group exact until decode completes it;
    greedy tokens equal ``eviction.reference.hidden_after``'s with the same survivors served from its quantized
    pages (``compacted_round_trip``): uncompressed, ZACK 0.5, and Gemma 3's local-then-global layers decoding past
    their windows (local heads giving passed pages back); prompts longer than a chunk. No continual cut (a full pool
    preempts) and no sums for H2O (they only rank cuts)."""
    seed = fresh_seed()
    if plan in SLIDING:  # windows of 32 passed by 40 decoded tokens
        model, new = kvjax.Model.random(SLIDING[plan], seed=seed % 1000, scale=0.5), 40
    else:
        model, new = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0), 8
    if plan == "zack":
        model = kvjax.compress(model, removal_rate=0.5, seed=seed % 1000, max_context=128, **CALIBRATION_SMALL)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in (70, 41, 6)]
    settings = dict(max_batch=2, max_seq_len=128, chunk_tokens=32, backend=backend)
    settings |= dict(decode_config=dataclasses.replace(DECODE, quant_head_launches=launches))
    # quantization is discontinuous: a float32 matmul XLA rounds to TF32 on a GPU (the reference's attention; the
    # Pallas kernels' dots are exact) can move a code and then a token (one did on an H100), so both run exact
    precision = jax.default_matmul_precision("highest") if backend == "pallas" else contextlib.nullcontext()
    with precision:
        _quantized_run_matches_the_reference(model, prompts, settings, spec, bits, new, seed)


def _quantized_run_matches_the_reference(model, prompts, settings, spec, bits, new, seed):
    from kvjax.eviction.reference import hidden_after, prompt_keep
    from kvjax.ops.kv_schemes import Kivi

    engine = Engine(model, **settings, eviction=spec, kv_bits=bits)
    assert engine.cache.heads.sums is None and engine.cache.heads.pool.dtype == jnp.uint8
    assert engine.continual == (engine._evict.history is None) and engine.continual_group == engine.page_size
    got = _greedy(engine, prompts, new)
    scheme = Kivi(bits, engine.page_size)
    moved = []
    for prompt, tokens in zip(prompts, got):
        context = np.array([prompt + tokens[:-1]])
        kept = prompt_keep(model, context[:, : len(prompt)], engine.eviction)
        hidden = hidden_after(model, context, kept, kv=scheme)
        want = np.asarray(model.module.logits(hidden[0, len(prompt) - 1 :])).argmax(-1).tolist()
        assert tokens == want, f"seed {seed}, prompt {len(prompt)}"
        moved.append(float(jnp.abs(hidden - hidden_after(model, context, kept)).max()))
    assert moved[0] > 1e-3, f"seed {seed}: the quantized pages did not move the reference"  # not vacuous


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(eviction="kvcompress:4x", kv_bits="gear2"), "KIVI-style 4 or 2 bits only"),
        (dict(eviction="kvcompress"), "METHOD:BUDGET"),
        (dict(eviction="tova:4x"), "eviction method must be one of"),
        (dict(eviction=4), "eviction must be an Eviction or a string"),
        (dict(eviction="snapkv:2x", chunk_tokens=4), "window of 8 queries"),
    ],
)
def test_unsupported_eviction_settings_are_one_line_errors(settings, message):
    with pytest.raises((ValueError, TypeError), match=message) as info:
        EngineConfig(**settings)
    assert "\n" not in str(info.value)


def test_models_the_engine_cannot_evict_yet_are_refused_in_one_line():
    """Palu (keys rebuilt at decode) gets a one-line refusal, before any cache is taken."""
    palu = kvjax.compress(kvjax.Model.random(WIDE), method="palu", removal_rate=0.5, **CALIBRATION_SMALL)
    with pytest.raises(ValueError, match="keys are rebuilt"):
        Engine(palu, max_batch=2, max_seq_len=64, eviction="snapkv:2x")


SLIDING = {  # windows of 32: past the 16 most recent tokens every head keeps, so eviction chooses inside them
    "local-global": dataclasses.replace(local_then_global(2, 64), sliding_window=32),  # Gemma 3's pattern
    "all-local": dataclasses.replace(TINY_CONFIGS["mistral"], head_dim=64, hidden_size=128, sliding_window=32),
}


@pytest.mark.parametrize("config", SLIDING, ids=list(SLIDING))
def test_a_budget_past_every_prompt_on_sliding_windows_changes_no_token(config):
    """Sliding-window layers in per-head pages: with nothing evicted, each head's window starts where the plain
    engine's window pools start it, so greedy tokens equal the plain engine's, prompts shorter and longer than the
    window and decoding past it many times over."""
    seed = fresh_seed()
    model = kvjax.Model.random(SLIDING[config], seed=seed % 1000, scale=0.5)  # at 3, Gemma's repeats one token
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in (3, 29, 70)]
    settings = dict(max_batch=2, max_seq_len=128, chunk_tokens=32, backend="reference")
    plain = _greedy(Engine(model, **settings), prompts, 40)
    evicting = Engine(model, **settings, eviction="kvcompress:1000")
    assert evicting.continual == (config == "local-global") and evicting.windows == (None,)
    assert _greedy(evicting, prompts, 40) == plain, f"seed {seed}"


@pytest.mark.parametrize("backend", ["reference", "interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("config", SLIDING, ids=list(SLIDING))
def test_eviction_on_sliding_windows_gives_the_reference_tokens(config, backend, spec="kvcompress:3x"):
    """Eviction inside each sliding window (``select.device_keep``: a local head keeps only its window's tokens),
    then decoding past the window: the engine's greedy tokens equal ``eviction.reference``'s forward, where each
    query sees the kept prompt tokens its window covers and every decoded token it covers."""
    seed = fresh_seed()
    model = kvjax.Model.random(SLIDING[config], seed=seed % 1000, scale=0.5)  # at 3, Gemma's repeats one token
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in (70, 41, 6)]
    settings = dict(max_batch=2, max_seq_len=128, chunk_tokens=32, backend=backend)
    engine = Engine(model, **settings, eviction=spec)
    got = _greedy(engine, prompts, 40)
    for prompt, tokens in zip(prompts, got):
        assert tokens == _reference_tokens(model, prompt, tokens, engine.eviction), f"seed {seed}, prompt {len(prompt)}"
    assert _eviction_moved(model, prompts[0], got[0], engine.eviction), f"seed {seed}"
    if config == "all-local":  # nothing a cut may touch
        with pytest.raises(ValueError, match="sliding layers only"):
            engine.compress(0, 10, np.zeros((2, 2), np.int32))


def test_h2o_on_sliding_windows_sums_only_what_each_window_saw():
    """H2O in the engine on Gemma 3's local-then-global layers: a local layer's sums count only the queries whose
    window covers a key, its budget and protected share are of its window, and the tokens are the reference's."""
    test_eviction_on_sliding_windows_gives_the_reference_tokens("local-global", "reference", spec="h2o:3x")


def test_sliding_heads_give_back_passed_pages_and_a_small_pool_then_holds_more(monkeypatch):
    """A local head gives back the per-head pages its window has passed (``HeadPages.release_passed``): three
    requests decoding 60 tokens past windows of 32 fit a per-head pool that, without it, must preempt one; the pages
    given back go to other heads at once (the top of the free stack), and every request still gets
    ``eviction.reference``'s tokens, so no head read a page after giving it back."""
    seed = fresh_seed()
    model = kvjax.Model.random(SLIDING["all-local"], seed=seed % 1000, scale=3.0)  # at 0.5 a misread barely shows
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in (60, 52, 44)]
    settings = dict(max_batch=3, max_seq_len=128, chunk_tokens=32, page_size=8, num_pages=81, backend="interpret")

    def run():
        engine = Engine(model, **settings, eviction="kvcompress:3x")
        runner = Runner(engine)
        requests = [runner.add(Request(p, 60)) for p in prompts]
        for _ in runner.run():
            runner.scheduler.check()
        return engine, requests

    engine, requests = run()
    assert [r.preemptions for r in requests] == [0, 0, 0], f"seed {seed}"
    for prompt, r in zip(prompts, requests):
        assert r.tokens == _reference_tokens(model, prompt, r.tokens, engine.eviction), f"seed {seed}"
    monkeypatch.setattr(Engine, "head_windows", property(lambda self: None))  # the host keeps every page
    _, kept_all = run()
    assert sum(r.preemptions for r in kept_all) > 0, f"seed {seed}"


def _packed_queries(model, context):
    """Each layer's packed queries [T, q_cols] of ``context`` (the model's own forward, teacher-forced)."""
    from kvjax.ops.prefill.reference import causal_attention

    queries = []
    t = len(context)
    positions = jnp.arange(t, dtype=jnp.int32)[None]

    def attend(i, q, k, v, rebuild=None, rotation=None):
        if rotation is not None:
            q, k = rotation.packed(q, k)
        queries.append(q[0])
        return causal_attention(q, k, v, model.module.layouts[i], rebuild)

    model.module.hidden(jnp.asarray([context], jnp.int32), positions, attend)
    return queries


@pytest.mark.parametrize("plan", ["none", "zack"])
def test_the_engines_cut_scores_with_the_last_queries_and_keeps_its_selection(plan):
    """Continual eviction in the engine: each slot's query ring holds the model's last W packed queries (ZACK's
    rotated ones), in order once unrolled, and ``Engine.compress`` leaves each head exactly the tokens
    ``continual.compress`` selects from them, in order, with the host's counts stored."""
    from kvjax.eviction.continual import compress, halved
    from kvjax.ops import head_paging

    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    if plan == "zack":
        model = kvjax.compress(model, removal_rate=0.5, seed=seed % 1000, max_context=128, **CALIBRATION_SMALL)
    rng = np.random.default_rng(seed)
    engine = Engine(model, max_batch=2, max_seq_len=128, chunk_tokens=32, backend="reference", eviction="snapkv:1000")
    runner = Runner(engine, lag=0)
    r = runner.add(Request(rng.integers(0, 97, int(rng.integers(20, 60))).tolist(), 40))
    while len(r.tokens) < int(rng.integers(3, 12)):
        runner.step()
    written = (r.prompt + r.tokens)[: r.computed]
    spec, w, slot, last = engine.eviction, engine.eviction.window, r.slot, r.computed - 1
    order = (last - w + 1 + np.arange(w)) % w
    heads = engine.cache.heads
    ring = [np.asarray(q[slot])[order] for q in heads.queries]
    for layer, (got, want) in enumerate(zip(ring, _packed_queries(model, written))):
        np.testing.assert_allclose(got, want[-w:], rtol=2e-4, atol=2e-4, err_msg=f"seed {seed}, layer {layer}")
    stored = np.asarray(heads.stored[slot])
    assert (stored == len(written)).all(), f"seed {seed}"  # a budget past the prompt keeps every token
    target = halved(spec, stored)
    layouts, elems = model.module.layouts, engine._evict.page_elems
    before = [[head_paging.read(heads.pool, heads.tables[slot][None, i], h, lay, elems, len(written)) for h in
               range(lay.num_kv_heads)] for i, lay in enumerate(layouts)]  # fmt: skip
    _, _, keep = compress(spec, [jnp.asarray(q[None]) for q in ring], heads.pool, heads.tables[slot][None],
                          heads.stored[slot][None], jnp.asarray(target[None]), layouts, elems, 128)  # fmt: skip
    runner.scheduler.pages.heads.shrink(r.id, target)
    engine.compress(slot, last, target)
    after = engine.cache.heads
    np.testing.assert_array_equal(after.stored[slot], target, f"seed {seed}")
    for i, lay in enumerate(layouts):
        for h in range(lay.num_kv_heads):
            n = int(target[i, h])
            k, v = head_paging.read(after.pool, after.tables[slot][None, i], h, lay, elems, n)
            chosen = np.flatnonzero(np.asarray(keep[0, i, h]))
            assert len(chosen) == n, f"seed {seed}"
            np.testing.assert_array_equal(k[0], before[i][h][0][0, chosen], f"seed {seed}, layer {i}, head {h}")
            np.testing.assert_array_equal(v[0], before[i][h][1][0, chosen], f"seed {seed}, layer {i}, head {h}")


def _decoding(model, spec: str, backend: str, seed: int):
    """An engine of ``spec`` with one request of a random 40-70 token prompt, stepped until it has decoded 3-12
    tokens (its prompt cut at its end). Returns (engine, runner, request, the positions written). A head evicts
    whole pages' worth (16 tokens), so a 2x cut of a prompt under 32 tokens evicts nothing: a seed drawing 30 once
    did (seed 2509448807)."""
    rng = np.random.default_rng(seed)
    engine = Engine(model, max_batch=2, max_seq_len=128, chunk_tokens=32, backend=backend, eviction=spec)
    runner = Runner(engine, lag=0)
    r = runner.add(Request(rng.integers(0, 97, int(rng.integers(40, 70))).tolist(), 40))
    while len(r.tokens) < int(rng.integers(3, 12)):
        runner.step()
    return engine, runner, r, (r.prompt + r.tokens)[: r.computed]


@pytest.mark.parametrize(
    "spec, plan, backend",
    [
        ("h2o:3x", "none", "reference"),
        ("kvcompress-full:2x", "zack", "reference"),
        ("h2o:2x", "zack", "interpret"),  # the prompt's sums from the mass kernel, the decode's from the decode kernel
        ("keyformer:3x", "none", "reference"),
        ("keyformer:2x", "zack", "interpret"),  # the decode's noisy softmax from the decode kernel's weights
        pytest.param("kvcompress-full:3x", "zack", "pallas", marks=pytest.mark.gpu),
        pytest.param("keyformer:3x", "zack", "pallas", marks=pytest.mark.gpu),
    ],
)
def test_decode_adds_each_steps_softmax_to_the_stored_tokens_sums(spec, plan, backend):
    """H2O, KV-Compress's full form and Keyformer keep a sum a stored token (``HeadKVCache.sums``): after a prompt's
    cut and a few decode steps each head's slots hold, in order, the brute-force sums of
    ``eviction.reference.decode_sums`` (the prompt's exact scores plus every later query's softmax over what the head
    kept, squared for KV-Compress, of noisy scores for Keyformer, its draws keyed by slot), slots past what a head
    stores hold 0, and the prompt's cut was the reference's."""
    from kvjax.eviction.reference import decode_sums

    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    if plan == "zack":
        model = kvjax.compress(model, removal_rate=0.5, seed=seed % 1000, max_context=128, **CALIBRATION_SMALL)
    engine, _, r, written = _decoding(model, spec, backend, seed)
    assert engine.continual
    # a GPU runs the model's float32 matmuls in TF32 (10-bit mantissa), the engine's and the reference's rounded
    # apart: 0.39% and 1.5% at most in two H100 runs of fresh seeds, KV-Compress squaring each weight's error
    # (bench/results/eviction.md, "Eviction on the H100 (2026-12-06, third session)"). A sum a slot out of place is
    # off by more: in that run, neighbouring slots differed by 9% to 16x.
    rtol = 3e-2 if backend == "pallas" else 2e-4
    want, kept = decode_sums(model, np.array([written]), len(r.prompt), engine.eviction)
    heads = engine.cache.heads
    sums, stored = np.asarray(heads.slot_sums(r.slot)), np.asarray(heads.stored[r.slot])
    for layer, (ref, mask) in enumerate(zip(want, kept)):
        for h in range(ref.shape[1]):
            held = np.flatnonzero(np.concatenate([mask[0, h], np.ones(len(written) - len(r.prompt), bool)]))
            where = f"seed {seed}, layer {layer}, head {h}"
            assert stored[layer, h] == len(held), where
            np.testing.assert_allclose(
                sums[layer, h, : len(held)], ref[0, h, held], rtol=rtol, atol=2e-5, err_msg=where
            )
            assert not sums[layer, h, len(held) :].any(), where
    assert int(stored.sum()) < len(written) * stored.size, f"seed {seed}: nothing was evicted"


def test_the_brute_force_sums_refuse_what_decode_does_not_add_to():
    from kvjax.eviction.reference import decode_sums

    with pytest.raises(ValueError, match="decode adds to the sums of"):
        decode_sums(None, np.zeros((1, 8), np.int32), 4, parse("snapkv:2x"))
    for prompt in (0, 8):  # nothing prefilled, or nothing decoded
        with pytest.raises(ValueError, match="prompt must be 1..7 tokens"):
            decode_sums(None, np.zeros((1, 8), np.int32), prompt, parse("h2o:2x"))


@pytest.mark.parametrize("plan, spec", [("none", "h2o:2x"), ("zack", "h2o:2x"), ("none", "keyformer:2x")])
def test_a_cut_ranks_by_the_sums_and_moves_them_with_the_survivors(plan, spec):
    """Continual eviction by H2O (and Keyformer) mid-decode: ``Engine.compress`` keeps each head's last
    ``Eviction.recent`` slots and its highest sums (``continual.keep_counts`` over ``HeadKVCache.sums``), its K and V
    and its sums moved to its first slots in order, and the host's counts stored; the sums it ranked are the
    brute-force ones."""
    from kvjax.eviction.continual import halved, keep_counts
    from kvjax.eviction.reference import decode_sums
    from kvjax.ops import head_paging

    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    if plan == "zack":
        model = kvjax.compress(model, removal_rate=0.5, seed=seed % 1000, max_context=128, **CALIBRATION_SMALL)
    engine, runner, r, written = _decoding(model, spec, "reference", seed)
    spec, slot, heads = engine.eviction, r.slot, engine.cache.heads
    stored, sums = np.asarray(heads.stored[slot]), np.asarray(heads.slot_sums(slot))
    want, kept = decode_sums(model, np.array([written]), len(r.prompt), spec)
    for layer, (ref, mask) in enumerate(zip(want, kept)):  # the sums the cut ranks are the brute-force ones
        for h in range(ref.shape[1]):
            held = np.flatnonzero(np.concatenate([mask[0, h], np.ones(len(written) - len(r.prompt), bool)]))
            np.testing.assert_allclose(sums[layer, h, : len(held)], ref[0, h, held], rtol=2e-4, atol=2e-5)
    target = halved(spec, stored, len(written))
    assert (target < stored).any(), f"seed {seed}: the cut cuts nothing"
    layouts, elems = model.module.layouts, engine._evict.page_elems
    before = [[head_paging.read(heads.pool, heads.tables[slot][None, i], h, lay, elems, 128) for h in
               range(lay.num_kv_heads)] for i, lay in enumerate(layouts)]  # fmt: skip
    keep = np.asarray(keep_counts(jnp.asarray(sums), stored, target, spec.recent))
    runner.scheduler.pages.heads.shrink(r.id, target)
    engine.compress(slot, r.computed - 1, target)
    after = engine.cache.heads
    np.testing.assert_array_equal(after.stored[slot], target, f"seed {seed}")
    moved = np.asarray(after.slot_sums(slot))
    for i, lay in enumerate(layouts):
        for h in range(lay.num_kv_heads):
            n, chosen = int(target[i, h]), np.flatnonzero(keep[i, h])
            where = f"seed {seed}, layer {i}, head {h}"
            assert len(chosen) == n and chosen[-1] == stored[i, h] - 1, where  # the latest token survives
            k, v = head_paging.read(after.pool, after.tables[slot][None, i], h, lay, elems, n)
            np.testing.assert_array_equal(k[0], before[i][h][0][0, chosen], where)
            np.testing.assert_array_equal(v[0], before[i][h][1][0, chosen], where)
            np.testing.assert_array_equal(moved[i, h, :n], sums[i, h, chosen], where)
            assert not moved[i, h, n:].any(), where


def run_tight(model, seed: int, new: int, exact_cuts: bool = False, **settings):
    """An engine of ``settings`` whose per-head pool holds about two sequences (on each device, under tensor
    parallelism), four 40-token requests of ``new`` tokens that outgrow it, run to the end with the pages checked
    after every step (``exact_cuts``: and each cut slot's counts on the device equal to the host's targets after
    it). Returns (engine, runner, requests, the continual cuts' arguments)."""
    probe = Engine(model, **settings)
    one = int((-(-probe.max_seq_len // probe.head_per_page)).sum()) // probe.devices  # a sequence's pages a device
    del probe
    engine = Engine(model, **settings, num_pages=2 * one + 1)
    cuts: list = []
    compress = engine.compress

    def recorded(slot, last, target):
        cuts.append((slot, last, target))
        compress(slot, last, target)
        if exact_cuts:  # under tensor parallelism stored is [devices, slots, L, heads a device]: placed order
            stored = np.asarray(engine.cache.heads.stored)
            if engine.devices > 1:
                stored = np.concatenate(list(stored), axis=-1)
            np.testing.assert_array_equal(stored[slot], target, f"seed {seed}")

    engine.compress = recorded
    runner = Runner(engine)
    rng = np.random.default_rng(seed)
    requests = [runner.add(Request(rng.integers(0, 97, 40).tolist(), new)) for _ in range(4)]
    for _ in runner.run():
        runner.scheduler.check()
    return engine, runner, requests, cuts


@pytest.mark.parametrize("spec", ["snapkv:16", "h2o:16"])
def test_a_tight_pool_of_quantized_head_pages_cuts_whole_groups_and_every_request_finishes(spec):
    """Eviction on quantized pages under a per-head pool of about two sequences and four requests that outgrow it:
    SnapKV cuts heads mid-decode by whole quantized groups (``continual.compress_groups``: each head's count after a
    cut is whole groups plus its partial group), H2O, whose sums decode does not keep there, preempts instead. The
    pages add up after every step, and every request finishes with all its tokens."""
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    settings = dict(max_batch=4, max_seq_len=96, chunk_tokens=32, backend="reference", eviction=spec, kv_bits=4)
    engine, runner, requests, cuts = run_tight(model, seed, 50, exact_cuts=True, **settings)
    group = engine.continual_group
    if spec == "snapkv:16":
        assert cuts and group == engine.page_size, f"seed {seed}: no head was cut"
        for _, _, target in cuts:  # the host's targets, which the device kept exactly (``exact_cuts``)
            assert target.min() >= engine.eviction.recent
    else:
        assert not cuts and sum(r.preemptions for r in requests) > 0, f"seed {seed}"
    assert all(r.finish_reason == "length" and len(r.tokens) == 50 for r in requests), f"seed {seed}"
    assert runner.scheduler.pages.heads.free_pages == engine.head_pages - 1


@pytest.mark.parametrize("spec", ["snapkv:16", "h2o:16", "keyformer:16"])
def test_a_tight_head_pool_on_the_engine_cuts_and_every_request_finishes(spec):
    """The engine end to end with continual eviction: a per-head pool of about two sequences, four requests that
    outgrow it. Heads are cut on the device before the steps that reuse their pages (by the last queries, or by
    H2O's or Keyformer's sums), the pages add up after every step, and every request finishes with all its tokens."""
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    settings = dict(max_batch=4, max_seq_len=96, chunk_tokens=32, backend="reference", eviction=spec)
    engine, runner, requests, cuts = run_tight(model, seed, 50, **settings)
    assert cuts, f"seed {seed}: no head was cut"
    assert all(r.finish_reason == "length" and len(r.tokens) == 50 for r in requests), f"seed {seed}"
    pages = runner.scheduler.pages
    assert pages.heads.free_pages == engine.head_pages - 1


def test_a_tight_pool_cuts_only_the_global_layers_of_a_local_global_model():
    """Continual eviction on Gemma 3's pattern (windows of 32 on local layers): a cut leaves every local head's slots
    as they were (its stored count, its K and V from its window's first slot on), since those slots say where the
    window starts and its pages already go back as it passes; global heads are cut. Four requests outgrow a pool of
    about two, the pages add up after every step, and every request finishes with all its tokens."""
    from kvjax.ops import head_paging

    seed = fresh_seed()
    model = kvjax.Model.random(SLIDING["local-global"], seed=seed % 1000, scale=0.5)
    settings = dict(max_batch=4, max_seq_len=96, chunk_tokens=32, backend="reference", eviction="snapkv:16")
    probe = Engine(model, **settings)
    one = int((-(-probe.max_seq_len // probe.head_per_page)).sum())
    engine = Engine(model, **settings, num_pages=2 * one + 1)
    del probe
    assert engine.continual
    layouts, elems, windows = model.module.layouts, engine._evict.page_elems, engine.head_windows
    compress, cut = engine.compress, []

    def checked(slot, last, target):
        heads = engine.cache.heads

        def local(h):  # every local head's stored count and its seen K, V
            out = []
            for i, lay in enumerate(layouts):
                if windows[i] is None:
                    continue
                first = np.asarray(head_paging.window_first(h.before[slot][i], h.stored[slot][i], windows[i]))
                for j in range(lay.num_kv_heads):
                    n = int(h.stored[slot][i, j])
                    k, v = head_paging.read(h.pool, h.tables[slot][None, i], j, lay, elems, n)
                    out.append((n, np.asarray(k[0, first[j] :]), np.asarray(v[0, first[j] :])))
            return out

        was, stored = local(heads), np.asarray(heads.stored[slot])
        rows = [i for i, w in enumerate(windows) if w is not None]
        np.testing.assert_array_equal(target[rows], stored[rows], f"seed {seed}: the host cut a local head")
        compress(slot, last, target)
        now = local(engine.cache.heads)
        for (n0, k0, v0), (n1, k1, v1) in zip(was, now):
            assert n0 == n1, f"seed {seed}: a local head was cut"
            np.testing.assert_array_equal(k0, k1, f"seed {seed}")
            np.testing.assert_array_equal(v0, v1, f"seed {seed}")
        cut.append(stored - np.asarray(engine.cache.heads.stored[slot]))

    engine.compress = checked
    runner = Runner(engine)
    rng = np.random.default_rng(seed)
    requests = [runner.add(Request(rng.integers(0, 97, 40).tolist(), 50)) for _ in range(4)]
    for _ in runner.run():
        runner.scheduler.check()
    assert cut and any(c.any() for c in cut), f"seed {seed}: no head was cut"
    assert all(r.finish_reason == "length" and len(r.tokens) == 50 for r in requests), f"seed {seed}"
    assert runner.scheduler.pages.heads.free_pages == engine.head_pages - 1


def test_a_cut_is_exact_when_its_slots_tables_name_pages_it_gave_back():
    """A prompt's eviction gives pages back on the host while the slot's device tables still name them, and decode
    growth then hands them to the same slot's other heads. A cut compacts every page it is given, so given those
    stale entries two heads would write one page; it must be given only the pages each head's stored tokens fill,
    and leave each head exactly its selection."""
    from kvjax.eviction.continual import compress, halved
    from kvjax.ops import head_paging

    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    rng = np.random.default_rng(seed)
    engine = Engine(model, max_batch=2, max_seq_len=128, chunk_tokens=64, backend="reference", eviction="kvcompress:16")
    runner = Runner(engine, lag=0)
    pages = runner.scheduler.pages.heads
    r = runner.add(Request(rng.integers(0, 97, 60).tolist(), 60))

    def hazard():  # a device table entry past a head's pages names a page another head of the slot now holds
        if r.slot is None or not pages.holds(r.id):
            return False
        host = pages.table(r.id)
        stale = np.asarray(engine.cache.heads.tables[r.slot])[host == NULL_PAGE]
        return np.isin(stale[stale != NULL_PAGE], host).any()

    while not hazard():  # evicted to 16 tokens a head on average, then grown onto pages other heads gave back
        runner.step()
        assert len(r.tokens) < 50, f"seed {seed}: the test lost its hazard"
    heads, layouts, elems = engine.cache.heads, model.module.layouts, engine._evict.page_elems
    host = pages.table(r.id)
    stored = pages.stored(r.id)
    tokens = int(stored.max())
    before = [[head_paging.read(heads.pool, jnp.asarray(host[None, i]), h, lay, elems, tokens) for h in
               range(lay.num_kv_heads)] for i, lay in enumerate(layouts)]  # fmt: skip
    w, last = engine.eviction.window, r.computed - 1
    ring = [jnp.asarray(np.asarray(q[r.slot])[(last - w + 1 + np.arange(w)) % w][None]) for q in heads.queries]
    target = halved(engine.eviction, stored)
    assert (target < stored).any()
    _, _, keep = compress(engine.eviction, ring, heads.pool, jnp.asarray(host[None]), jnp.asarray(stored[None]),
                          jnp.asarray(target[None]), layouts, elems, 128)  # fmt: skip
    pages.shrink(r.id, target)
    engine.compress(r.slot, last, target)
    after = engine.cache.heads
    for i, lay in enumerate(layouts):
        for h in range(lay.num_kv_heads):
            n = int(target[i, h])
            k, v = head_paging.read(after.pool, jnp.asarray(pages.table(r.id)[None, i]), h, lay, elems, n)
            chosen = np.flatnonzero(np.asarray(keep[0, i, h]))
            np.testing.assert_array_equal(k[0], before[i][h][0][0, chosen], f"seed {seed}, layer {i}, head {h}")
            np.testing.assert_array_equal(v[0], before[i][h][1][0, chosen], f"seed {seed}, layer {i}, head {h}")
