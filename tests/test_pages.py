"""The page pool and prefix cache (pure Python: allocation, refcounts, full-page prefix matching, LRU eviction
of unreferenced cached pages only, reservations, exhaustion, counters)."""

from __future__ import annotations

import pickle

import pytest

from raydeploy.engine.pages import PagePool, PagesExhaustedError, SequencePages, page_key, prefix_keys

PS = 4  # tokens per page in these tests


def test_allocate_and_release_plain_pages():
    pool = PagePool(6, PS, group=1)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert a == [0, 1] and b == [2, 3, 4] and pool.used_pages == 5 and pool.free_pages == 1
    assert all(pool.refcount(p) == 1 for p in a + b)
    pool.release(a)
    assert pool.used_pages == 3 and pool.free_pages == 3 and pool.refcount(0) == 0
    assert sorted(pool.allocate(3)) == [0, 1, 5]  # freed pages are reused
    assert pool.headroom == 0


def test_exhaustion_names_the_group_and_counts_and_pickles():
    pool = PagePool(3, PS, group=2)
    pool.allocate(2)
    with pytest.raises(PagesExhaustedError, match=r"dp group 2: page pool exhausted: 2 page\(s\) wanted, 1 "
                                                  r"available \(pool of 3 pages"):
        pool.allocate(2)
    assert pool.used_pages == 2  # a failed allocation takes nothing
    err = pickle.loads(pickle.dumps(PagesExhaustedError(2, 5, 1, 3)))
    assert isinstance(err, PagesExhaustedError) and err.wanted == 5 and "5 page(s) wanted" in str(err)


def test_bad_arguments_have_clear_messages():
    with pytest.raises(ValueError, match="dp group 0: a page pool needs at least 1 page, got num_pages=0"):
        PagePool(0, PS)
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        PagePool(4, 0)
    pool = PagePool(4, PS)
    with pytest.raises(ValueError, match=r"page 9 is out of range \(pool of 4 pages\)"):
        pool.release([9])
    p = pool.allocate(1)
    pool.release(p)
    with pytest.raises(ValueError, match="page 0 released more often than it was taken"):
        pool.release(p)
    with pytest.raises(ValueError, match="page 1 is not in use; only a sequence's own page can be cached"):
        pool.register(1, b"k")
    with pytest.raises(ValueError, match="page 2 is not a cached page"):
        pool.acquire([2])
    with pytest.raises(ValueError, match="cannot unreserve 1 pages, 0 are reserved"):
        pool.unreserve(1)
    with pytest.raises(ValueError, match="allocating 1 reserved pages but only 0 are reserved"):
        pool.allocate(1, reserved=True)


def test_keys_chain_over_the_whole_prefix():
    a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], PS)
    assert len(a) == 2  # only full pages get keys
    b = prefix_keys([0, 2, 3, 4, 5, 6, 7, 8], PS)  # same second page, different first page
    assert a[0] != b[0] and a[1] != b[1]
    assert a[1] == page_key(a[0], [5, 6, 7, 8])
    assert prefix_keys([1, 2, 3, 4, 5, 6, 7, 8], PS, max_pages=1) == a[:1]


def run_sequence(pool: PagePool, tokens: list[int], extra: int = 0) -> SequencePages:
    """Admit `tokens`, compute them all (grow + commit), as the scheduler does over a prompt's steps."""
    seq = SequencePages.admit(pool, tokens, len(tokens) + extra)
    assert seq is not None
    seq.grow(len(tokens))
    seq.commit(tokens, len(tokens))
    return seq


def test_second_request_reuses_full_pages_of_its_prefix():
    pool = PagePool(16, PS)
    prompt = list(range(100, 110))  # 2 full pages + 2 tokens
    first = run_sequence(pool, prompt)
    assert first.shared == 0 and pool.cached_pages == 2
    assert pool.counters.hits == 0 and pool.counters.misses == 2
    second = SequencePages.admit(pool, prompt + [7, 7], 20)
    assert second is not None and second.shared == 2 and second.pages == first.pages[:2]
    assert pool.refcount(first.pages[0]) == 2 and pool.refcount(first.pages[2]) == 1
    assert pool.counters.hits == 2 and pool.counters.misses == 2  # its 3rd page holds its last prompt token
    new = second.grow(12)
    assert len(new) == 1 and new[0] not in first.pages  # the partial 3rd page is never shared


def test_divergence_mid_page_does_not_reuse_that_page():
    pool = PagePool(16, PS)
    prompt = list(range(100, 113))  # 3 full pages + 1
    first = run_sequence(pool, prompt)
    diverged = prompt[:6] + [999] + prompt[7:]  # differs at position 6, inside page 1
    other = SequencePages.admit(pool, diverged, len(diverged))
    assert other is not None and other.shared == 1 and other.pages == first.pages[:1]
    other.grow(len(diverged))
    other.commit(diverged, len(diverged))
    assert other.pages[1] not in first.pages and other.pages[2] not in first.pages
    # the same tokens after a different page never match either (keys chain over the prefix)
    assert pool.lookup(prefix_keys(diverged, PS)) == other.pages[:3]
    assert pool.lookup(prefix_keys(prompt, PS)) == first.pages[:3]


def test_prompt_of_whole_cached_pages_recomputes_its_last_page():
    pool = PagePool(16, PS)
    prompt = list(range(8))  # exactly 2 pages
    first = run_sequence(pool, prompt)
    again = SequencePages.admit(pool, prompt, 12)
    assert again is not None and again.shared == 1  # the last prompt token must be computed to sample from
    assert again.pages == first.pages[:1]


def test_pages_are_cached_only_once_computed():
    pool = PagePool(16, PS)
    prompt = list(range(50, 62))
    seq = SequencePages.admit(pool, prompt, 16)
    assert seq is not None
    seq.grow(8)
    assert seq.commit(prompt, 6) == 1  # positions 0-5 computed: only page 0 is full
    assert SequencePages.fits(pool, SequencePages.prompt_keys(prompt, PS), 16) == (1, True)
    seq.grow(12)
    assert seq.commit(prompt, 12) == 2
    assert pool.cached_pages == 3


def test_generated_tokens_fill_pages_that_get_cached():
    pool = PagePool(16, PS)
    prompt = [1, 2, 3]
    seq = run_sequence(pool, prompt, extra=6)
    tokens = prompt + [4, 5, 6, 7, 8]  # 5 generated tokens, the last not yet in the cache
    seq.grow(len(tokens))
    assert seq.commit(tokens, 7) == 1 and pool.cached_pages == 1  # positions 0-6 computed
    assert seq.commit(tokens, 8) == 1 and pool.cached_pages == 2


def test_duplicate_computation_keeps_the_first_page_cached():
    pool = PagePool(16, PS)
    prompt = list(range(9))
    a = SequencePages.admit(pool, prompt, 9)
    b = SequencePages.admit(pool, prompt, 9)  # admitted together, before either computed anything
    assert a is not None and b is not None and b.shared == 0
    for s in (a, b):
        s.grow(9)
    assert a.commit(prompt, 9) == 2 and b.commit(prompt, 9) == 0
    b_pages = list(b.pages)
    b.free()
    assert all(pool.refcount(p) == 0 and pool.key(p) is None for p in b_pages) and pool.cached_idle_pages == 0
    a.free()
    assert pool.cached_idle_pages == 2 and pool.free_pages == 14


def test_release_keeps_cached_pages_for_a_later_hit():
    pool = PagePool(8, PS)
    prompt = list(range(9))
    a = run_sequence(pool, prompt)
    pages = list(a.pages)
    a.free()
    assert pool.used_pages == 0 and pool.cached_idle_pages == 2 and pool.free_pages == 6
    b = SequencePages.admit(pool, prompt, 9)
    assert b is not None and b.pages == pages[:2] and pool.cached_idle_pages == 0
    assert pool.refcount(pages[0]) == 1


def test_lru_eviction_takes_only_unreferenced_cached_pages_oldest_first():
    pool = PagePool(6, PS)
    a = run_sequence(pool, [1] * 9)  # pages 0, 1 cached + page 2
    b = run_sequence(pool, [2] * 9)  # pages 3, 4 cached + page 5
    a_pages, b_pages = list(a.pages), list(b.pages)
    a.free()  # a's cached pages go idle first (older), then b's
    b.free()
    assert pool.free_pages == 2 and pool.cached_idle_pages == 4
    c = SequencePages.admit(pool, [2] * 8 + [3], 9)  # reuses b's 2 pages, needs 1 more
    assert c is not None and c.pages == b_pages[:2]
    got = pool.allocate(3)  # 2 free, then the oldest idle cached page: a's tail
    assert pool.counters.evictions == 1 and a_pages[1] in got and a_pages[0] not in got
    assert pool.lookup(prefix_keys([1] * 9, PS)) == [a_pages[0]]  # a's head is still cached
    with pytest.raises(PagesExhaustedError):
        pool.allocate(2)  # 1 idle cached page left and c holds a reservation: b's pages are never evicted
    assert pool.refcount(b_pages[0]) == 1 and pool.key(b_pages[0]) is not None


def test_reservations_bound_admission_and_never_fail_a_running_sequence():
    pool = PagePool(8, PS)
    a = SequencePages.admit(pool, [1, 2, 3], 20)  # may grow to 5 pages
    assert a is not None and a.reserved == 5 and pool.headroom == 3
    assert SequencePages.admit(pool, [4, 5, 6], 16) is None  # needs 4: waits (nothing taken)
    assert pool.headroom == 3 and pool.reserved == 5
    b = SequencePages.admit(pool, [4, 5, 6], 12)
    assert b is not None and pool.headroom == 0
    with pytest.raises(PagesExhaustedError):
        pool.allocate(1)
    assert len(a.grow(20)) == 5 and len(b.grow(12)) == 3  # both still get every page they may need
    with pytest.raises(ValueError, match="grows to 24 tokens beyond its reservation"):
        a.grow(24)
    a.free()
    assert pool.headroom == 5 and pool.reserved == 0
    b.free()
    assert pool.free_pages == 8 and pool.used_pages == 0


def test_admission_counts_idle_cached_pages_it_would_take():
    pool = PagePool(4, PS)
    a = run_sequence(pool, list(range(9)))  # 3 pages, 2 cached
    a.free()
    busy = SequencePages.admit(pool, [7], 8)  # reserves 2 of the 4
    assert busy is not None and pool.headroom == 2
    # reusing the 2 idle cached pages leaves 0 for its own 1 page: it waits rather than over-promising
    assert SequencePages.admit(pool, list(range(9)), 9) is None
    assert pool.cached_idle_pages == 2 and pool.counters.hits == 0


def test_clear_cache_frees_idle_cached_pages():
    pool = PagePool(8, PS)
    a = run_sequence(pool, list(range(9)))
    b = run_sequence(pool, [5] * 9)
    a.free()
    pool.clear_cache()
    assert pool.cached_pages == 0 and pool.free_pages == 8 - 3 and pool.used_pages == 3
    assert pool.lookup(prefix_keys([5] * 9, PS)) == []
    b.free()
    assert pool.free_pages == 8


def test_stats_keys():
    pool = PagePool(8, PS)
    run_sequence(pool, list(range(9))).free()
    assert pool.stats() == {"pages_total": 8, "pages_used": 0, "pages_free": 6, "pages_cached_idle": 2,
                            "pages_reserved": 0, "prefix_cache_hits": 0, "prefix_cache_misses": 2,
                            "prefix_cache_evictions": 0}
