"""Automatic prefix caching (issue 39, item 3; vLLM's and SGLang's idea): full pages of the whole-context pool are
known by a hash of their tokens and of every token before them, so a request whose context starts with the same
tokens reads those pages instead of prefilling them again.

A page is shared only once it is full and its prefill is enqueued, and a request only ever writes past its own
prefix, so shared pages are never written: read-only by construction, with no copy-on-write. Each cached page counts
its owners; at zero it stays cached, least recently freed first in line to be handed out again when the pool's free
list runs dry (its hash then forgotten). The page manager (``runtime.pages``) owns the allocator; this class only
knows hashes, owners' counts and the unreferenced pages it holds. Same tokens, same model and plan: one engine's
cache, so the engine's model and plan are in every key implicitly.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

ROOT = b"kvjax-prefix"


def page_hashes(tokens, page_size: int, pages: int, start: bytes = ROOT) -> Iterator[bytes]:
    """The chained hashes of the first ``pages`` full pages of ``tokens``, one at a time: page i's covers every
    token before its end, so equal hashes mean equal prefixes (16-byte BLAKE2b)."""
    prev = start
    for i in range(pages):
        block = np.asarray(tokens[i * page_size : (i + 1) * page_size], np.int64).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        yield prev


class PrefixCache:
    """Hash -> page of the full pages whose prefill is enqueued, each page's owner count, and the pages no owner
    holds (cached, in the order they were freed)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._page: dict[bytes, int] = {}
        self._hash: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages no owner holds, oldest first
        self._pending: dict[int, list[tuple[bytes, int]]] = {}  # owner -> (hash, page) filled in the step scheduled
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def idle_pages(self) -> int:
        """Cached pages no owner holds: free to hand out, at the cost of their hash."""
        return len(self._idle)

    def match(self, tokens, limit: int) -> list[int]:
        """The cached pages of ``tokens``' longest cached prefix of full pages, at most ``limit`` pages (hashing
        stops at the first page not cached: a request waiting at the queue's head asks again every step)."""
        pages = []
        for h in page_hashes(tokens, self.page_size, limit):
            page = self._page.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def idle_among(self, pages) -> int:
        return sum(p in self._idle for p in pages)

    def take(self, pages, context: int) -> None:
        """An owner starts with ``pages`` (a ``match``) of its ``context``-token context: their counts go up."""
        self.query_tokens += context
        self.hit_tokens += len(pages) * self.page_size
        for p in pages:
            self._idle.pop(p, None)
            self._refs[p] = self._refs.get(p, 0) + 1

    def filled(self, owner: int, tokens, table, done: int, upto: int) -> None:
        """``owner``'s pages (``table``) now hold full pages ``done`` .. ``upto`` - 1 of ``tokens``, their prefill
        enqueued in the step being scheduled: cached from the next step on (``commit``), so no row of this step
        reads a page another row of it writes."""
        if upto <= done:
            return
        start = self._hash.get(table[done - 1], None) if done else ROOT
        if start is None:  # the page before was not cached (a duplicate of another's): the chain stops there
            return
        hashes = page_hashes(tokens[done * self.page_size :], self.page_size, upto - done, start)
        self._pending.setdefault(owner, []).extend(zip(hashes, table[done:upto]))

    def commit(self) -> None:
        """Cache the pages filled in the step scheduled last (each hash's first page kept; a duplicate stays the
        owner's alone)."""
        for entries in self._pending.values():
            for h, page in entries:
                if h not in self._page and page not in self._hash:
                    self._page[h], self._hash[page] = page, h
                    self._refs[page] = self._refs.get(page, 0) + 1  # its filling owner holds it
        self._pending.clear()

    def release(self, owner: int, pages) -> list[int]:
        """``owner`` gives ``pages`` back: the cached ones lose an owner (idle at zero); returns the uncached ones,
        for the free list."""
        self._pending.pop(owner, None)
        free = []
        for p in pages:
            if p not in self._hash:
                free.append(p)
                continue
            self._refs[p] -= 1
            if self._refs[p] == 0:
                del self._refs[p]
                self._idle[p] = None
        return free

    def reclaim(self, n: int) -> list[int]:
        """Forget the ``n`` longest-idle cached pages and return them, for an owner to fill anew."""
        pages = []
        for _ in range(n):
            page, _ = self._idle.popitem(last=False)
            del self._page[self._hash.pop(page)]
            pages.append(page)
        return pages

    def shared(self, page: int) -> bool:
        return page in self._hash

    def holders(self, page: int) -> int:
        return self._refs.get(page, 0)

    def idle_set(self) -> set[int]:
        return set(self._idle)

    def stats(self) -> dict:
        return dict(
            prefix_cached_pages=len(self._hash),
            prefix_hit_tokens=self.hit_tokens,
            prefix_query_tokens=self.query_tokens,
        )
