"""Which cache pages each request owns: ``PageManager``, the page manager (vLLM's ``KVCacheManager``) over the pools of
``kvjax.runtime.cache``, and ``PageAllocator``, the allocator of one pool. It decides nothing but counts pages.

``grow`` either hands a request pages for the positions asked in every pool or changes nothing and says no (the
scheduler then preempts and asks again). ``can_grow``, ``free``, ``release_passed`` (pages a sliding window has
passed; ``release_passed_heads``, per-head ones), ``table`` (a block table per pool; a page given back reads as the
null page), ``stats`` and ``check`` (the invariants the fuzz tests check) complete it. An evicting cache (``heads``)
stages a prompt in pool 0 and moves it to per-head pages (``grow_heads``, ``end_prompt``, ``evicted``,
``cut_heads``); with ``prefix_caching``, pool 0's full pages are shared, never written, by the hash of the tokens up
to their end (``cached_prefix``, ``take_prefix``).
"""

from __future__ import annotations

from collections import Counter

from kvjax.ops.paging import NULL_PAGE
from kvjax.runtime.cache import first_kept_page, window_span
from kvjax.runtime.prefix import PrefixCache


class CacheFullError(RuntimeError):
    """The page pool has no free pages left for a request."""


class PageAllocator:
    """Hands out and takes back the page numbers of one pool; never hands out the null page."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("a cache needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def free_set(self) -> set[int]:
        """The free page numbers (for invariant checks)."""
        return set(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(
                f"KV cache is full: {n} pages requested, {len(self._free)} of "
                f"{self.num_pages - 1} free; use fewer or shorter sequences, or a larger cache"
            )
        if n <= 0:
            return []
        pages, self._free = self._free[-n:][::-1], self._free[:-n]
        return pages

    def free(self, pages) -> None:
        pages = [int(p) for p in pages]
        if any(p == NULL_PAGE or not 0 < p < self.num_pages for p in pages) or len(set(pages)) != len(pages):
            raise ValueError(f"cannot free pages {pages}: not pages of this pool")
        taken = set(self._free) & set(pages)
        if taken:
            raise ValueError(f"pages {sorted(taken)} are already free")
        self._free.extend(reversed(pages))


class PageManager:
    """The pages of a whole-context pool of ``num_pages`` pages of ``page_size`` tokens and of each sliding-window
    pool of ``windows`` ({window: pages}), and which owner (a request id) holds which. One sequence holds at most
    ``max_pages_per_seq`` pages of pool 0; prompts are prefilled ``chunk_tokens`` positions at a time at most
    (what a window pool must hold at once: ``window_span``)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        chunk_tokens: int,
        *,
        windows: dict[int, int] | None = None,
        max_pages_per_seq: int | None = None,
        heads=None,
        prefix_caching: bool = False,
    ):
        short = sorted((windows or {}).items())
        if heads is not None and short:
            raise ValueError("an evicting cache has no sliding-window pools")
        if prefix_caching and (heads is not None or short):
            raise ValueError("prefix caching shares whole-context pages: not with eviction or sliding-window pools")
        self.prefix = PrefixCache(page_size) if prefix_caching else None
        self.heads = heads
        self.windows: tuple[int | None, ...] = (None, *(w for w, _ in short))
        self.allocators = [PageAllocator(num_pages), *(PageAllocator(n) for _, n in short)]
        self.page_size, self.chunk_tokens = page_size, chunk_tokens
        self.max_pages_per_seq = min(num_pages - 1, max_pages_per_seq or num_pages)
        self._tables: dict[int, list[list[int]]] = {}  # owner -> per pool, by logical page
        self._released: dict[int, list[int]] = {}  # owner -> per pool: its first pages given back so far

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    @property
    def capacity(self) -> int:
        """The most positions one sequence can hold."""
        return self.max_pages_per_seq * self.page_size

    def refusal(self, positions: int, count: str = "") -> str | None:
        """Why a sequence reaching ``positions`` positions could never fit, however empty the cache (a clause to
        follow "request N"; ``count`` says where the positions come from); None if it could."""
        need = self.pages_for(positions)
        if need > self.max_pages_per_seq:
            count = f" ({count})" if count else ""
            return f"needs {positions} cache positions{count}, more than the {self.capacity} one sequence can hold"
        for w, alloc in zip(self.windows[1:], self.allocators[1:]):
            span = min(need, window_span(w, self.page_size, self.chunk_tokens, self.max_pages_per_seq))
            if span > alloc.num_pages - 1:
                return f"needs {span} pages at once in the {w}-token window's pool, which holds {alloc.num_pages - 1}"
        return None

    def _missing(self, owner: int, positions: int) -> list[int]:
        """Pages per pool that ``owner`` lacks to cover ``positions`` positions."""
        need = self.pages_for(positions)
        return [need - len(pages) for pages in self._tables.get(owner, [[]] * len(self.windows))]

    def _free(self) -> list[int]:
        """Pages each pool can hand out now: its free list, and in pool 0 the cached pages no owner holds."""
        idle = self.prefix.idle_pages if self.prefix is not None else 0
        return [a.free_pages + (idle if i == 0 else 0) for i, a in enumerate(self.allocators)]

    def can_grow(self, owner: int, positions: int) -> bool:
        """Whether ``grow(owner, positions)`` would succeed now."""
        return all(n <= free for n, free in zip(self._missing(owner, positions), self._free()))

    def grow(self, owner: int, positions: int) -> bool:
        """Give ``owner`` the pages ``positions`` positions need in every pool; False, and nothing changed, when a
        pool has too few free."""
        missing = self._missing(owner, positions)
        if any(n > free for n, free in zip(missing, self._free())):
            return False
        self._start(owner)
        for i, (pages, alloc, n) in enumerate(zip(self._tables[owner], self.allocators, missing)):
            got = alloc.allocate(min(n, alloc.free_pages))
            if i == 0 and len(got) < n:  # the free list ran dry: the longest-idle cached pages, forgotten
                assert self.prefix is not None
                got += self.prefix.reclaim(n - len(got))
            pages += got
        return True

    def _start(self, owner: int) -> None:
        if owner not in self._tables:
            self._tables[owner], self._released[owner] = [[] for _ in self.windows], [0] * len(self.windows)

    def cached_prefix(self, context, limit: int) -> list[int]:
        """The cached pages of ``context``'s longest cached prefix, at most ``limit`` (none without prefix caching)."""
        return [] if self.prefix is None else self.prefix.match(context, limit)

    def can_take_prefix(self, owner: int, pages: list[int], positions: int) -> bool:
        """Whether ``owner`` (holding nothing) could start with ``pages`` (a ``cached_prefix``) and then grow to
        ``positions``: the rest from what is free besides those pages."""
        missing, free = self._missing(owner, positions), self._free()
        missing[0] -= len(pages)
        free[0] -= self.prefix.idle_among(pages) if self.prefix is not None else 0
        return all(n <= f for n, f in zip(missing, free))

    def take_prefix(self, owner: int, pages: list[int], context: int) -> None:
        """``owner`` (holding nothing) starts with the cached ``pages`` of its ``context``-token context."""
        if self.prefix is None:
            return
        assert owner not in self._tables, "a prefix is taken by an owner that holds pages"
        self.prefix.take(pages, context)
        if pages:
            self._start(owner)
            self._tables[owner][0] += pages

    def filled(self, owner: int, tokens, start: int, end: int) -> None:
        """``owner``'s prefill of positions ``start`` .. ``end`` is in the step being scheduled: its full pages are
        cached from the next step on (prefix caching)."""
        if self.prefix is not None and owner in self._tables:
            self.prefix.filled(owner, tokens, self._tables[owner][0], start // self.page_size, end // self.page_size)

    def commit(self) -> None:
        """The step scheduled last is enqueued: the pages it filled are cached (prefix caching)."""
        if self.prefix is not None:
            self.prefix.commit()

    def release_passed(self, owner: int, position: int) -> None:
        """Give back the window pages that queries at ``position`` and after can no longer see. Called before the
        step whose first row is at ``position`` is scheduled: that step reads none of them, so another row of it
        may write them."""
        if owner not in self._tables:
            return
        tables, released = self._tables[owner], self._released[owner]
        for i, w in enumerate(self.windows[1:], 1):
            done = first_kept_page(w, position, self.page_size)
            if done > released[i]:
                self.allocators[i].free(tables[i][released[i] : done])
                tables[i][released[i] : done] = [NULL_PAGE] * (done - released[i])
                released[i] = done

    def release_passed_heads(self, owners: list[int]) -> None:
        """Evicting: give back the per-head pages that the next query of each of ``owners`` (decoding requests) no
        longer sees in its sliding-window heads (``HeadPages.release_passed``, one call for them all). Called before
        the step is scheduled, as ``release_passed``."""
        self.heads.release_passed(owners)

    def free(self, owner: int) -> None:
        """Give back every page ``owner`` holds (none held: nothing to do)."""
        if self.heads is not None:
            self.heads.free(owner)
        if owner not in self._tables:
            return
        tables, released = self._tables.pop(owner), self._released.pop(owner)
        for i, (pages, alloc, done) in enumerate(zip(tables, self.allocators, released)):
            pages = pages[done:]
            if i == 0 and self.prefix is not None:  # cached pages lose an owner; the rest are free
                pages = self.prefix.release(owner, pages)
            alloc.free(pages)

    def can_hold_heads(self, owner: int, tokens: int) -> bool:
        """Whether the per-head pool has the pages ``tokens`` more tokens in every head of ``owner`` need, now."""
        return self.heads.fits(owner, tokens)

    def grow_heads(self, owner: int, tokens: int):
        """Append ``tokens`` tokens to every head of ``owner`` in the per-head pool; the table entries filled
        (``HeadPages.grow``), or None, and nothing changed, when it has too few pages."""
        return self.heads.grow(owner, tokens)

    def end_prompt(self, owner: int) -> None:
        """Give back ``owner``'s staging pages: its prompt now lives in its per-head pages. Called before the step
        after the one that evicted it is scheduled: that step's rows never read them."""
        tables = self._tables.pop(owner, None)
        if tables is not None:
            self.allocators[0].free(tables[0])
            del self._released[owner]

    def evicted(self, owner: int, prompt: int, kept) -> None:
        """The device evicted ``owner``'s ``prompt``-token prompt and each head kept ``kept`` [layers, heads] tokens;
        decode has appended the same number of tokens to every head since (the host grew every head by the whole
        prompt). The pages past what each head now stores go back."""
        self.heads.evicted(owner, prompt, kept)

    def head_counts(self, owner: int):
        """Tokens each head of ``owner`` stores now, [layers, heads]."""
        return self.heads.stored(owner)

    def cut_frees(self, owner: int, kept) -> int:
        """Per-head pages ``cut_heads(owner, kept)`` would give back."""
        return self.heads.freed_by(owner, kept)

    def cut_heads(self, owner: int, kept) -> None:
        """Continual eviction: each head of ``owner`` keeps ``kept`` [layers, heads] tokens, in its first slots once
        the device has compacted it (``Engine.compress``, enqueued before any step that writes the pages given back
        now)."""
        self.heads.shrink(owner, kept)

    def holds_heads(self, owner: int) -> bool:
        return self.heads is not None and self.heads.holds(owner)

    def table(self, owner: int) -> tuple[tuple[int, ...], ...]:
        """``owner``'s block tables, per pool (empty ones for an owner holding nothing)."""
        return tuple(map(tuple, self._tables.get(owner, [[] for _ in self.windows])))

    def holds(self, owner: int) -> bool:
        return owner in self._tables or self.holds_heads(owner)

    def stats(self) -> dict:
        """Free and total pages of pool 0, and [free, total] of each window pool by window (the server's
        /health)."""
        out: dict = dict(
            free_pages=self._free()[0],  # with prefix caching, cached pages no owner holds too: handed out when needed
            total_pages=self.allocators[0].num_pages - 1,
            window_pages={
                str(w): [a.free_pages, a.num_pages - 1] for w, a in zip(self.windows[1:], self.allocators[1:])
            },
        )
        if self.heads is not None:  # pool 0 stages prompts; the per-head pool holds what they keep
            out["head_pages"] = [self.heads.free_pages, self.heads.num_pages - 1]
        if self.prefix is not None:
            out.update(self.prefix.stats())
        return out

    def check(self, reached: dict[int, int]) -> None:
        """Raise AssertionError unless the pages add up for owners at ``reached`` positions ({owner: positions}):
        exactly those owners hold pages, owned + free == the pool, none owned twice, each owner holds the pages of
        the positions it reached, and none its window still sees was given back (the fuzz tests call it after
        every step). An evicting cache's ``reached`` names the owners that stage a prompt (holding its whole
        length); its per-head pool is checked by ``HeadPages.check``."""
        if self.heads is not None:
            self.heads.check()
        assert set(self._tables) == set(reached), "pages held by an owner that should hold none, or the reverse"
        for i, (w, alloc) in enumerate(zip(self.windows, self.allocators)):
            owned = [p for t in self._tables.values() for p in t[i] if p != NULL_PAGE]
            idle: set[int] = set()
            if i == 0 and self.prefix is not None:  # a cached page is held by as many owners as it counts
                idle = self.prefix.idle_set()
                for p, holders in Counter(owned).items():
                    assert holders == 1 or self.prefix.shared(p), "an uncached page is owned twice"
                    assert not self.prefix.shared(p) or self.prefix.holders(p) == holders, "a cached page's count"
                assert not idle & set(owned), "an idle cached page is owned"
                owned = list(set(owned))
            assert len(owned) == len(set(owned)), "a page is owned twice"
            assert len(owned) + alloc.free_pages + len(idle) == alloc.num_pages - 1, "pages leaked"
            assert not (set(owned) | idle) & alloc.free_set(), "an owned or cached page is free"
            for owner, positions in reached.items():
                pages = self._tables[owner][i]
                assert len(pages) == self.pages_for(positions), "pages not those of the positions reached"
                kept = first_kept_page(w, max(positions - 1, 0), self.page_size)
                assert NULL_PAGE not in pages[kept:], "a page the window still sees was given back"
