"""Per-head paging's host side (issue 37, item 2): ``HeadPages``, which pages each (layer, KV head) of each sequence
owns in one pool of fixed-size pages, how many tokens each head stores, and the moves that compact a head after
eviction.

Every page has one size and a head stores as many of its tokens in it as fit (``per_page[layer, head]``), so pages
one head frees serve every other. Each head stores ``positions - evicted[layer, head]`` tokens, in slot order; every
operation works on all (layer, head) pairs at once. With ``devices`` > 1 each device has a pool of ``num_pages`` for
its run of heads, and one manager still answers for all (``fits``: pages on every device, or a refusal). The format:
bench/notes/2026-11-28-eviction-start.md, "Per-head pages".
"""

from __future__ import annotations

import numpy as np

from kvjax.ops.paging import NULL_PAGE


class HeadPages:
    """A pool of ``num_pages`` pages (page 0 the null page) shared by every (layer, KV head), one such pool a
    device where ``devices`` > 1 (each shared by its run of heads); head (l, h) stores ``per_page[l, h]`` tokens a page
    and holds at most ``max_pages`` pages. ``windows``: each layer's sliding window, None (or all None) where a
    layer's queries see every stored token."""

    def __init__(self, num_pages: int, per_page, max_pages: int, devices: int = 1, windows=None):
        self.per_page = np.asarray(per_page, np.int64)
        if self.per_page.ndim != 2 or (self.per_page < 1).any():
            raise ValueError(f"per_page must be positive tokens per page, [layers, heads], got {self.per_page!r}")
        if num_pages < 2 or max_pages < 1:
            raise ValueError(f"a pool needs at least 2 pages and a head at least 1, got {num_pages} and {max_pages}")
        if devices < 1 or self.per_page.shape[1] % devices:
            raise ValueError(f"{self.per_page.shape[1]} heads cannot be split evenly over {devices} devices")
        self.num_pages, self.max_pages, self.devices = num_pages, max_pages, devices
        self.device_of = np.arange(self.per_page.shape[1]) // (self.per_page.shape[1] // devices)  # each head's
        # a stack of free pages a device: the top is the end
        self._free = np.tile(np.arange(num_pages - 1, NULL_PAGE, -1, dtype=np.int32), (devices, 1))
        self._top = np.full(devices, num_pages - 1, np.int64)
        self._tables: dict[int, np.ndarray] = {}  # owner -> int32 [layers, heads, max_pages]
        self._stored: dict[int, np.ndarray] = {}  # owner -> int64 [layers, heads]: tokens each head stores
        windows = [None] * self.per_page.shape[0] if windows is None else list(windows)
        if len(windows) != self.per_page.shape[0] or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must be a window or None per layer ({self.per_page.shape[0]}), got {windows!r}")
        self.windows = np.array([w or 0 for w in windows], np.int64)  # 0: the whole context
        self._released: dict[int, np.ndarray] = {}  # owner -> int64 [layers, heads]: first entries given back
        self._none = np.zeros(self.per_page.shape, np.int64)  # an owner's ``_released`` before any
        self._prompt: dict[int, np.ndarray] = {}  # owner -> int64 [layers, heads]: prompt tokens each head kept

    @property
    def shape(self) -> tuple[int, int]:
        """(layers, KV heads)."""
        layers, heads = self.per_page.shape
        return layers, heads

    @property
    def free_pages(self) -> int:
        """Free pages of the pool, or of the device with the fewest."""
        return int(self._top.min())

    @property
    def free_per_device(self) -> np.ndarray:
        """Free pages of each device's pool, [devices]."""
        return self._top.copy()

    def _pages(self, stored: np.ndarray) -> np.ndarray:
        return -(-stored // self.per_page)

    def holds(self, owner: int) -> bool:
        return owner in self._tables

    def stored(self, owner: int) -> np.ndarray:
        """Tokens each head of ``owner`` stores, [layers, heads] (zeros for an owner holding nothing)."""
        return self._stored.get(owner, np.zeros(self.shape, np.int64)).copy()

    def table(self, owner: int) -> np.ndarray:
        """``owner``'s block tables, int32 [layers, heads, max_pages], unused entries the null page."""
        return self._tables.get(owner, np.full((*self.shape, self.max_pages), NULL_PAGE, np.int32)).copy()

    def need(self, owner: int, new_tokens) -> int:
        """Pages ``owner`` lacks to store ``new_tokens`` more tokens in every head (an int, or [layers, heads]), over
        every device."""
        return int(self._lacking(owner, new_tokens).sum())

    def fits(self, owner: int, new_tokens) -> bool:
        """Whether ``grow(owner, new_tokens)`` would find its pages on every device now."""
        return bool((self._lacking(owner, new_tokens) <= self._top).all())

    def _lacking(self, owner: int, new_tokens) -> np.ndarray:
        """Pages ``owner`` lacks on each device, [devices]."""
        stored = self._stored.get(owner, np.zeros(self.shape, np.int64))
        return self._by_device(self._pages(stored + np.asarray(new_tokens, np.int64)) - self._pages(stored))

    def _by_device(self, pages: np.ndarray) -> np.ndarray:
        """Pages [..., heads] summed over each device's heads (and every leading axis), [devices]."""
        per_head = pages.reshape(-1, pages.shape[-1]).sum(0)
        return np.bincount(self.device_of, per_head, minlength=self.devices).astype(np.int64)

    def grow(self, owner: int, new_tokens) -> np.ndarray | None:
        """Append ``new_tokens`` tokens to every head of ``owner`` (an int, or [layers, heads]), taking pages from
        the pool. Returns the table entries it filled, int32 [n, 4] rows of (layer, head, index, page): what a
        block table kept on the device needs this step (one page a head at most, per decode step), where sending
        whole tables would copy [layers x heads x pages] a sequence every step. None, and nothing changed, when
        the pool has too few pages or a head would pass ``max_pages``."""
        filled = self.grow_many([owner], new_tokens)
        return None if filled is None else filled[:, 1:]

    def grow_many(self, owners: list[int], new_tokens) -> np.ndarray | None:
        """``grow`` for several distinct owners at once, as one set of array operations (a decode step grows every
        running sequence by one token): all or nothing. Rows are (i, layer, head, index, page), i indexing
        ``owners``."""
        empty = np.zeros(self.shape, np.int64)
        stored = np.stack([self._stored.get(o, empty) for o in owners])  # [B, layers, heads]
        after = stored + np.asarray(new_tokens, np.int64)
        have, want = self._pages(stored), self._pages(after)
        delta = want - have
        total = int(delta.sum())
        per_device = self._by_device(delta)
        if (per_device > self._top).any() or (want > self.max_pages).any():
            return None
        row, layer, head = np.nonzero(delta)
        counts = delta[row, layer, head]
        row, layer, head = (np.repeat(x, counts) for x in (row, layer, head))
        fresh = np.zeros(total, np.int32)
        for d in np.nonzero(per_device)[0]:  # each device's pages from its own stack, its top first
            mine, top = self.device_of[head] == d, self._top[d]
            fresh[mine] = self._free[d, top - per_device[d] : top][::-1]
            self._top[d] -= per_device[d]
        index = have[row, layer, head] + np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        bounds = np.searchsorted(row, np.arange(len(owners) + 1))
        for i, owner in enumerate(owners):
            mine = slice(bounds[i], bounds[i + 1])
            table = self._tables.get(owner)
            if table is None:
                table = self._tables[owner] = np.full((*self.shape, self.max_pages), NULL_PAGE, np.int32)
            table[layer[mine], head[mine], index[mine]] = fresh[mine]
            self._stored[owner] = after[i]
        return np.stack([row, layer, head, index, fresh], 1).astype(np.int32)

    def free(self, owner: int) -> None:
        """Give back every page ``owner`` holds (none held: nothing to do)."""
        if owner not in self._tables:
            return
        table = self._tables.pop(owner)
        del self._stored[owner]
        self._released.pop(owner, None)
        self._prompt.pop(owner, None)
        self._push(table, table != NULL_PAGE)

    def evicted(self, owner: int, prompt: int, kept) -> np.ndarray:
        """The device evicted ``owner``'s ``prompt``-token prompt, each head keeping ``kept`` [layers, heads] of it,
        and decode has appended the same number of tokens to every head since (``grow`` gave every head the whole
        prompt): the pages past what each head now stores go back (``shrink``), and a sliding-window layer's heads
        count their window from ``kept`` on (``release_passed``). Returns the pages given back."""
        kept = np.asarray(kept, np.int64)
        grown = self._stored[owner] - prompt  # tokens decoded since, the same in every head
        freed = self.shrink(owner, kept + grown)
        self._prompt[owner] = kept
        return freed

    def release_passed(self, owners: list[int], appended: int = 1) -> np.ndarray:
        """Give back the pages of each of ``owners``' sliding-window heads that the query of the token a step is about
        to append (``appended`` tokens from now), and every later one, cannot see. Returns the pages given back.

        A head's slots hold its kept prompt tokens, then every decoded one; once d decoded tokens are stored and
        d >= W, its window (W positions) starts at slot kept + d - W, exactly ``head_paging.window_first``'s.
        Before that, the window starts among the kept prompt tokens at a slot only the device knows, and nothing
        is given back: a head holds at most its kept prompt and W decoded tokens. Called before the step is
        scheduled: that step never reads these pages (the kernel starts at the first seen slot's page), so another
        row of it may write them. Owners whose ``evicted`` has not been heard back are skipped. One set of array
        operations for every owner, as ``grow_many``: a step calls it once for its decoding rows."""
        owners = [o for o in owners if o in self._prompt]
        if not owners or not self.windows.any():
            return np.zeros(0, np.int32)
        kept = np.stack([self._prompt[o] for o in owners])  # [B, layers, heads]
        released = np.stack([self._released.get(o, self._none) for o in owners])
        decoded = np.stack([self._stored[o] for o in owners]) + appended - kept
        w = self.windows[None, :, None]
        first = np.where((w > 0) & (decoded >= w), kept + decoded - w, 0)
        done = np.maximum(first // self.per_page, released)
        row, layer, head = np.nonzero(done > released)  # most steps: none, no window having passed a whole page since
        if not len(row):
            return np.zeros(0, np.int32)
        counts = done[row, layer, head] - released[row, layer, head]
        starts = np.repeat(released[row, layer, head] - np.cumsum(counts) + counts, counts)
        row, layer, head = (np.repeat(x, counts) for x in (row, layer, head))
        index = starts + np.arange(int(counts.sum()))
        freed = []
        for i in np.unique(row):
            mine = row == i
            table = self._tables[owners[i]]
            freed.append(table[layer[mine], head[mine], index[mine]])
            table[layer[mine], head[mine], index[mine]] = NULL_PAGE
            self._released[owners[i]] = done[i]
        pages = np.concatenate(freed)
        self._give(pages, head)
        return pages

    def _push(self, table: np.ndarray, gone: np.ndarray) -> None:
        """Give back the pages of ``table`` [layers, heads, pages] that ``gone`` marks, each to its device's stack."""
        heads = np.broadcast_to(np.arange(table.shape[1])[None, :, None], table.shape)
        self._give(table[gone], heads[gone])

    def _give(self, pages: np.ndarray, heads: np.ndarray) -> None:
        """Give back ``pages`` (flat), each held by the head of the same place in ``heads``, to its device's stack."""
        device = self.device_of[heads]
        for d in range(self.devices):
            mine = pages[device == d]
            n, top = len(mine), self._top[d]
            self._free[d, top : top + n] = mine[::-1]
            self._top[d] += n

    def evict(self, owner: int, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keep, of each head's stored tokens, those ``keep`` marks (bool [layers, heads, >= max stored]; entries
        past a head's stored count are ignored), moved to the head's first slots in their order, and give back the
        pages no longer needed. Returns the moves, (source, destination) int64 [n, 4] rows of (layer, head, page,
        token in page; the page in the head's device's pool): a device gather reading every source before any
        write (``jnp`` scatter of gathered rows) applies them in place, and must run before anything is written to
        the pages given back (sources may lie in them)."""
        stored = self._stored[owner]
        table = self._tables[owner]
        keep = np.asarray(keep, bool)
        slots = np.arange(keep.shape[-1])
        keep = keep & (slots < stored[..., None])
        kept = keep.sum(-1)
        rank = np.cumsum(keep, -1) - 1  # each survivor's new slot
        layer, head, src = np.nonzero(keep)
        dst = rank[layer, head, src]
        per = self.per_page[layer, head]
        moved = src != dst
        layer, head, src, dst, per = layer[moved], head[moved], src[moved], dst[moved], per[moved]
        source = np.stack([layer, head, table[layer, head, src // per], src % per], 1)
        destination = np.stack([layer, head, table[layer, head, dst // per], dst % per], 1)
        self.shrink(owner, kept)
        return source.astype(np.int64), destination.astype(np.int64)

    def shrink(self, owner: int, kept) -> np.ndarray:
        """What eviction leaves on the host once the device has compacted ``owner``'s heads
        (``ops.head_paging.compact``): each head now stores ``kept`` [layers, heads] tokens (at most what it stored)
        in its first slots, so the pages past them go back to the pool. Host work over [layers, heads] only; the
        survivors and their moves never leave the device. Returns the pages given back."""
        stored, table = self._stored[owner], self._tables[owner]
        kept = np.asarray(kept, np.int64)
        if kept.shape != self.shape or (kept < 0).any() or (kept > stored).any():
            raise ValueError(f"kept must be [layers, heads] counts within what each head stores, got {kept!r}")
        have, want = self._pages(stored), self._pages(kept)
        pages = np.arange(self.max_pages)
        gone = (pages >= want[..., None]) & (pages < have[..., None]) & (table != NULL_PAGE)  # not those released
        freed = table[gone]
        self._push(table, gone)
        table[gone] = NULL_PAGE
        self._stored[owner] = kept
        return freed

    def freed_by(self, owner: int, kept) -> int:
        """How many pages ``shrink(owner, kept)`` would give back."""
        want = np.maximum(self._pages(np.asarray(kept, np.int64)), self._released.get(owner, 0))
        return int(np.maximum(self._pages(self._stored[owner]) - want, 0).sum())

    def check(self) -> None:
        """Raise AssertionError unless pages add up: owned + free = the pool, none owned twice or both owned and free,
        and each head holds exactly the pages its stored tokens need, in its first table entries but those its
        window has passed (``release_passed``)."""
        for d in range(self.devices):
            tables = [t[:, self.device_of == d] for t in self._tables.values()]
            owned = np.concatenate([t[t != NULL_PAGE] for t in tables] or [np.zeros(0, np.int32)])
            free = self._free[d, : self._top[d]]
            assert len(np.unique(owned)) == len(owned), f"device {d}: a page is owned twice"
            assert len(np.unique(free)) == len(free), f"device {d}: a page is free twice"
            assert len(owned) + len(free) == self.num_pages - 1, f"device {d}: pages leaked"
            assert not np.intersect1d(owned, free).size and NULL_PAGE not in free, f"device {d}: an owned page is free"
        for owner, table in self._tables.items():
            want, released = self._pages(self._stored[owner]), self._released.get(owner, self._none)
            assert (released <= want).all(), f"owner {owner}: pages released past its stored tokens"
            held = (table != NULL_PAGE).sum(-1)
            assert (held == want - released).all(), f"owner {owner}: pages not those of its stored tokens"
            index = np.arange(self.max_pages)
            first = (index >= released[..., None]) & (index < want[..., None])
            assert (table[first] != NULL_PAGE).all(), f"owner {owner}: a gap in a head's pages"
