"""Host-side bookkeeping of the paged KV cache: one page pool per dp group, refcounts and a prefix cache.

No JAX here; this runs on rank 0 inside the scheduler, and the hosts learn the outcome only through the page
tables each `StepPlan` carries. Page numbers are local to a dp group's pool (the device cache of a group holds
`num_pages` pages of `page_size` tokens each).

Lifecycle of a page:
- free: on the free list, holds nothing anyone may read.
- in use: referenced by one or more running sequences (`refcount` > 0). A page is shared only when it is a
  cached FULL page: every one of its `page_size` tokens was computed and its key matched.
- cached: a full page whose KV has been computed is registered under a key chained over its whole token
  prefix (`page_key`), so two pages get the same key only when the tokens of every page up to and including
  them are equal. A request whose prompt diverges anywhere inside a page never matches that page.
- cached and unreferenced: when its last sequence lets go, a cached page is not freed but kept in an LRU
  list; a new request may pick it up again (a prefix hit). Allocation takes free pages first and then evicts
  the least recently used unreferenced cached pages (counted as evictions). Referenced pages are never
  evicted.

Reservations make "a running request is never corrupted nor truncated" hold without preemption: a sequence
reserves, when admitted, every page it may still need (prompt + max_tokens, within max_seq_len) and then
allocates them as it grows. `headroom` counts pages neither in use nor promised, so admission can tell
whether a request fits now (else it waits); one that needs more pages than a whole pool holds is an error.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class PagesExhaustedError(RuntimeError):
    """A dp group's page pool cannot supply the pages asked for (a scheduling bug if it reaches a request:
    admission checks `headroom` first)."""

    def __init__(self, group: int, wanted: int, headroom: int, num_pages: int) -> None:
        super().__init__(f"dp group {group}: page pool exhausted: {wanted} page(s) wanted, {headroom} available "
                         f"(pool of {num_pages} pages, the rest in use by running requests or reserved for them)")
        self.group = group
        self.wanted = wanted
        self.headroom = headroom
        self.num_pages = num_pages

    def __reduce__(self) -> tuple[Any, ...]:  # pickles across Ray intact
        return (PagesExhaustedError, (self.group, self.wanted, self.headroom, self.num_pages))


def page_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a full page: a digest of the previous page's key and this page's tokens, so it names the
    whole token prefix up to the end of the page (SHA-256: equal keys mean equal prefixes)."""
    h = hashlib.sha256(parent or b"\x00root")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def adapter_root(adapter_key: str) -> bytes | None:
    """The parent of a sequence's first page key: None for the base model, else a digest of the LoRA adapter's
    residence key (`GenerationRequest.adapter_key`), so the same tokens under two adapters (or under one adapter
    loaded twice) chain to different keys and share no page."""
    return hashlib.sha256(b"\x00adapter" + adapter_key.encode()).digest() if adapter_key else None


def prefix_keys(tokens: Sequence[int], page_size: int, max_pages: int | None = None, adapter_key: str = ""
                ) -> list[bytes]:
    """Keys of the full pages of `tokens` (at most `max_pages`), each chained over the ones before it (the first
    over `adapter_root(adapter_key)`)."""
    n = len(tokens) // page_size
    if max_pages is not None:
        n = min(n, max_pages)
    keys: list[bytes] = []
    parent: bytes | None = adapter_root(adapter_key)
    for i in range(n):
        parent = page_key(parent, tokens[i * page_size:(i + 1) * page_size])
        keys.append(parent)
    return keys


@dataclass
class PoolCounters:
    """Monotonic counters of one pool (pages, not tokens)."""

    hits: int = 0
    """Full prompt pages found in the prefix cache (their tokens were not computed again)."""
    misses: int = 0
    """Full prompt pages looked up and not found."""
    evictions: int = 0
    """Unreferenced cached pages dropped from the prefix cache to make room."""


class PagePool:
    """The pages of one dp group. Not thread-safe: the scheduler calls it under its own lock."""

    def __init__(self, num_pages: int, page_size: int, group: int = 0) -> None:
        if num_pages < 1:
            raise ValueError(f"dp group {group}: a page pool needs at least 1 page, got num_pages={num_pages}")
        if page_size < 1:
            raise ValueError(f"dp group {group}: page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.group = group
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._refs = [0] * num_pages
        self._key_of: list[bytes | None] = [None] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages with refcount 0, oldest first
        self.reserved = 0
        """Pages promised to running sequences and not yet allocated."""
        self.counters = PoolCounters()

    # -- state
    @property
    def free_pages(self) -> int:
        """Pages that hold nothing (not counting unreferenced cached pages, which are also allocatable)."""
        return len(self._free)

    @property
    def cached_idle_pages(self) -> int:
        """Unreferenced cached pages: kept for prefix hits, evicted when allocation needs them."""
        return len(self._lru)

    @property
    def used_pages(self) -> int:
        """Pages referenced by at least one running sequence."""
        return self.num_pages - len(self._free) - len(self._lru)

    @property
    def cached_pages(self) -> int:
        """Pages registered in the prefix cache (referenced or not)."""
        return len(self._page_of)

    @property
    def headroom(self) -> int:
        """Pages that can still be promised: free or evictable, minus what running sequences have reserved."""
        return len(self._free) + len(self._lru) - self.reserved

    def refcount(self, page: int) -> int:
        self._check(page)
        return self._refs[page]

    def key(self, page: int) -> bytes | None:
        """The prefix-cache key a page is registered under, or None."""
        self._check(page)
        return self._key_of[page]

    def _check(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"dp group {self.group}: page {page} is out of range (pool of {self.num_pages} pages)")

    # -- prefix cache
    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest run of `keys` from the start (no side effects; see `acquire`)."""
        pages: list[int] = []
        for k in keys:
            page = self._page_of.get(k)
            if page is None:
                break
            pages.append(page)
        return pages

    def idle_among(self, pages: Sequence[int]) -> int:
        """How many of `pages` are unreferenced (taking them lowers `headroom` by that much)."""
        return sum(1 for p in pages if self._refs[p] == 0)

    def acquire(self, pages: Sequence[int]) -> None:
        """Take a reference on cached pages found by `lookup` (a sequence now reads them)."""
        for p in pages:
            self._check(p)
            if self._key_of[p] is None:
                raise ValueError(f"dp group {self.group}: page {p} is not a cached page; only cached full pages "
                                 f"are shared")
            if self._refs[p] == 0:
                del self._lru[p]
            self._refs[p] += 1

    def register(self, page: int, key: bytes) -> bool:
        """Cache a full page whose KV has been computed under `key`. False (and nothing changes) when another
        page already holds that prefix; that page stays the shared one and this one is freed on release."""
        self._check(page)
        if self._refs[page] < 1:
            raise ValueError(f"dp group {self.group}: page {page} is not in use; only a sequence's own page can "
                             f"be cached")
        if self._key_of[page] is not None:
            return self._key_of[page] == key
        if key in self._page_of:
            return False
        self._key_of[page] = key
        self._page_of[key] = page
        return True

    def clear_cache(self) -> None:
        """Forget every cached prefix (the device cache is gone or no longer trusted): unreferenced cached
        pages become free, referenced ones stay with their sequences uncached."""
        for p in self._lru:
            self._free.append(p)
        self._lru.clear()
        self._page_of.clear()
        self._key_of = [None] * self.num_pages

    # -- allocation
    def reserve(self, n: int) -> None:
        """Promise `n` more pages to a sequence; raises PagesExhaustedError when headroom is smaller."""
        if n < 0:
            raise ValueError(f"dp group {self.group}: cannot reserve {n} pages")
        if n > self.headroom:
            raise PagesExhaustedError(self.group, n, self.headroom, self.num_pages)
        self.reserved += n

    def unreserve(self, n: int) -> None:
        """Give back `n` promised pages that were never allocated."""
        if not 0 <= n <= self.reserved:
            raise ValueError(f"dp group {self.group}: cannot unreserve {n} pages, {self.reserved} are reserved")
        self.reserved -= n

    def allocate(self, n: int, reserved: bool = False) -> list[int]:
        """`n` pages with refcount 1: free ones first, then evicting the least recently used unreferenced
        cached pages. With `reserved`, the pages come out of this pool's reservations."""
        if n < 0:
            raise ValueError(f"dp group {self.group}: cannot allocate {n} pages")
        if reserved:
            if n > self.reserved:
                raise ValueError(f"dp group {self.group}: allocating {n} reserved pages but only {self.reserved} "
                                 f"are reserved")
            self.reserved -= n
        elif n > self.headroom:
            raise PagesExhaustedError(self.group, n, self.headroom, self.num_pages)
        pages: list[int] = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self._lru.popitem(last=False)
                key = self._key_of[p]
                assert key is not None
                del self._page_of[key]
                self._key_of[p] = None
                self.counters.evictions += 1
            self._refs[p] = 1
            pages.append(p)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page; unreferenced cached pages go to the LRU end (most recent), others
        to the free list. Pages released together in sequence order keep their prefix order in the LRU, so a
        prefix's tail is evicted before its head."""
        for p in reversed(pages):  # a prefix's last pages become the older ones
            self._check(p)
            if self._refs[p] < 1:
                raise ValueError(f"dp group {self.group}: page {p} released more often than it was taken")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if self._key_of[p] is not None:
                    self._lru[p] = None
                else:
                    self._free.append(p)

    def stats(self) -> dict[str, int]:
        return {"pages_total": self.num_pages, "pages_used": self.used_pages, "pages_free": self.free_pages,
                "pages_cached_idle": self.cached_idle_pages, "pages_reserved": self.reserved,
                "prefix_cache_hits": self.counters.hits, "prefix_cache_misses": self.counters.misses,
                "prefix_cache_evictions": self.counters.evictions}


@dataclass
class SequencePages:
    """One sequence's page table in its group's pool: the pages it holds, in order, and its reservation.

    `pages[i]` holds positions [i*page_size, (i+1)*page_size). The first `shared` pages came from the
    prefix cache (computed by another request). `keys` holds the chained keys of the sequence's full pages
    whose tokens are known, so new full pages can be registered as they are computed.
    """

    pool: PagePool
    pages: list[int] = field(default_factory=list)
    shared: int = 0
    reserved: int = 0
    registered: int = 0
    """Leading pages already registered in the prefix cache (or matched from it)."""
    keys: list[bytes] = field(default_factory=list)
    root: bytes | None = None
    """The parent of the first page's key (`adapter_root`: the sequence's LoRA adapter; None for the base model)."""

    @staticmethod
    def prompt_keys(tokens: Sequence[int], page_size: int, adapter_key: str = "") -> list[bytes]:
        """Keys of the prompt pages a new sequence may reuse: its full pages except one holding its last
        token (that token must be computed to sample the first new token from); under `adapter_key`'s root."""
        return prefix_keys(tokens, page_size, (len(tokens) - 1) // page_size, adapter_key)

    @staticmethod
    def fits(pool: PagePool, keys: Sequence[bytes], max_total_tokens: int) -> tuple[int, bool]:
        """(cached pages a sequence with these prompt keys would reuse, whether `admit` would succeed now)."""
        hit = pool.lookup(keys)
        need = -(-max_total_tokens // pool.page_size) - len(hit)
        return len(hit), need <= pool.headroom - pool.idle_among(hit)

    @classmethod
    def admit(cls, pool: PagePool, tokens: Sequence[int], max_total_tokens: int,
              keys: Sequence[bytes] | None = None, adapter_key: str = "") -> SequencePages | None:
        """Start a sequence with prompt `tokens` that may grow to `max_total_tokens` positions: reuse the cached
        pages of its `keys` (default `prompt_keys`; pass [] to reuse nothing) and reserve every other page it
        may need. None when the pool lacks the room now (nothing changes, nothing is counted)."""
        ps = pool.page_size
        if keys is None:
            keys = cls.prompt_keys(tokens, ps, adapter_key)
        hit = pool.lookup(keys)
        need = -(-max_total_tokens // ps) - len(hit)
        if need > pool.headroom - pool.idle_among(hit):
            return None
        pool.counters.hits += len(hit)
        pool.counters.misses += len(keys) - len(hit)
        pool.acquire(hit)
        pool.reserve(need)
        return cls(pool, list(hit), len(hit), need, len(hit), list(keys[:len(hit)]), adapter_root(adapter_key))

    @staticmethod
    def pages_for(pool: PagePool, tokens: int) -> int:
        return -(-tokens // pool.page_size)

    def grow(self, total_tokens: int) -> list[int]:
        """Make room for `total_tokens` positions; returns the pages newly added to the table."""
        want = self.pages_for(self.pool, total_tokens) - len(self.pages)
        if want <= 0:
            return []
        if want > self.reserved:
            raise ValueError(f"dp group {self.pool.group}: a sequence grows to {total_tokens} tokens beyond its "
                             f"reservation ({len(self.pages)} pages held, {self.reserved} reserved)")
        new = self.pool.allocate(want, reserved=True)
        self.reserved -= want
        self.pages.extend(new)
        return new

    def shrink(self, total_tokens: int) -> int:
        """Give back the pages past `total_tokens` positions to the pool and keep them in this sequence's
        reservation (it may grow into them again): the pages a speculative step allocated for proposals that were
        rejected (`raydeploy.engine.speculative`). Only pages that were never registered go (their positions are
        past every computed token, so the prefix cache never held them). Returns how many pages went back."""
        keep = self.pages_for(self.pool, total_tokens)
        if keep >= len(self.pages):
            return 0
        if keep < self.registered:
            raise ValueError(f"dp group {self.pool.group}: cannot shrink a sequence to {total_tokens} tokens, "
                             f"{self.registered} of its pages are in the prefix cache")
        extra = self.pages[keep:]
        del self.pages[keep:]
        self.pool.release(extra)
        self.pool.reserve(len(extra))
        self.reserved += len(extra)
        return len(extra)

    def commit(self, tokens: Sequence[int], computed: int) -> int:
        """Register the full pages among the first `computed` positions (whose KV is written once the plan
        that computes them has run; `tokens` are the sequence's tokens from position 0). Returns how many
        pages were newly cached."""
        ps = self.pool.page_size
        full = min(computed // ps, len(self.pages))
        added = 0
        while self.registered < full:
            i = self.registered
            parent = self.keys[i - 1] if i else self.root
            if len(self.keys) == i:
                self.keys.append(page_key(parent, tokens[i * ps:(i + 1) * ps]))
            if self.pool.register(self.pages[i], self.keys[i]):
                added += 1
            self.registered += 1
        return added

    def free(self) -> None:
        """Give every page and the remaining reservation back (cached pages stay cached, unreferenced)."""
        self.pool.release(self.pages)
        self.pool.unreserve(self.reserved)
        self.pages = []
        self.reserved = 0
        self.shared = 0
        self.registered = 0
        self.keys = []
