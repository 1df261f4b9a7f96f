"""The persistent XLA compilation cache: where it lives, and which programs came from it.

Every host of a gang points JAX at the same cache directory (a shared mount or a `gs://` URL) so that a
restarted gang loads what its predecessor compiled. JAX writes entries from process 0 only; with
`jax_share_binary_between_hosts` a multi-process program missing from the cache is compiled by one process and
handed to the others through the distributed key-value store, so a gang compiles each distinct program once.

`track()` counts, around one program's compile or first run, whether JAX loaded it from the cache or compiled
it, from JAX's own monitoring events; the engine reports that per program.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import jax

_HIT = "/jax/compilation_cache/cache_hits"
_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"


@dataclass
class CacheCount:
    """Compile requests that went through the persistent cache, and how many of them it answered."""

    requests: int = 0
    hits: int = 0

    @property
    def compiled(self) -> int:
        return self.requests - self.hits

    @property
    def source(self) -> str:
        """'cache' when every request was a hit, 'compiled' when any was compiled, 'none' when none was made
        (the program was already in memory)."""
        if self.requests == 0:
            return "none"
        return "cache" if self.hits == self.requests else "compiled"


_lock = threading.Lock()
_active: list[CacheCount] = []
_listening = False


def _on_event(event: str, **_: object) -> None:
    if event not in (_HIT, _REQUEST):
        return
    with _lock:
        for c in _active:
            if event == _HIT:
                c.hits += 1
            else:
                c.requests += 1


def _listen() -> None:
    global _listening
    with _lock:
        if _listening:
            return
        jax.monitoring.register_event_listener(_on_event)
        _listening = True


@contextmanager
def track() -> Iterator[CacheCount]:
    """Count the persistent-cache lookups (and hits) made inside the block, in any thread."""
    _listen()
    count = CacheCount()
    with _lock:
        _active.append(count)
    try:
        yield count
    finally:
        with _lock:
            _active.remove(count)


def is_remote(cache_dir: str) -> bool:
    """A URL (gs://, s3://...) rather than a local or mounted path."""
    return "://" in cache_dir


def enable(cache_dir: str | None) -> None:
    """Use the persistent XLA compilation cache at `cache_dir` (a path or a gs:// URL); None leaves it off."""
    if not cache_dir:
        return
    path = cache_dir if is_remote(cache_dir) else os.path.expanduser(cache_dir)
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_share_binary_between_hosts", True)
