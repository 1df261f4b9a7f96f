"""The persistent XLA compilation cache: where it lives, and which programs came from it.

Every host of a gang points JAX at the same cache directory (a shared mount or a `gs://` URL) so that a
restarted gang loads what its predecessor compiled. JAX writes entries from process 0 only; with
`jax_share_binary_between_hosts` a multi-process program missing from the cache is compiled by one process and
handed to the others through the distributed key-value store, so a gang compiles each distinct program once.

On XLA:CPU (simulated hosts) the cache key of a multi-process program differs from process to process (it
hashes the process-local CPU topology): sharing binaries, which waits for the key of process 0, would
deadlock, and ranks 1..N-1 would never find their own entries, which only process 0 may write. For CPU gangs
`enable(..., share_between_hosts=False, every_process_writes=True)` turns sharing off and lets every
process write its own entries (distinct keys, so no two processes write the same file).

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
_active: dict[int, list[CacheCount]] = {}  # thread id -> the counts open in that thread
_listening = False


def _on_event(event: str, **_: object) -> None:
    if event not in (_HIT, _REQUEST):
        return
    with _lock:  # JAX records the events in the thread that compiles
        for c in _active.get(threading.get_ident(), ()):
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
    """Count the persistent-cache lookups (and hits) this thread makes inside the block (programs compiling
    side by side in other threads are counted by their own blocks)."""
    _listen()
    count = CacheCount()
    me = threading.get_ident()
    with _lock:
        _active.setdefault(me, []).append(count)
    try:
        yield count
    finally:
        with _lock:
            _active[me].remove(count)
            if not _active[me]:
                del _active[me]


def is_remote(cache_dir: str) -> bool:
    """A URL (gs://, s3://...) rather than a local or mounted path."""
    return "://" in cache_dir


def configured() -> bool:
    """Whether this process already uses a persistent compilation cache."""
    return bool(getattr(jax.config, "jax_compilation_cache_dir", None))  # a flag the stubs do not list


def enable(cache_dir: str | None, share_between_hosts: bool = True, every_process_writes: bool = False) -> None:
    """Use the persistent XLA compilation cache at `cache_dir` (a path or a gs:// URL); None leaves it off.

    `share_between_hosts`: a multi-process program missing from the cache is compiled by one process and
    handed to the others (TPU, GPU). `every_process_writes`: every process writes its own entries (XLA:CPU
    gangs, whose keys differ per process; see the module docstring)."""
    if not cache_dir:
        return
    path = cache_dir if is_remote(cache_dir) else os.path.expanduser(cache_dir)
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_share_binary_between_hosts", share_between_hosts)
    if every_process_writes:
        # jax writes entries from process 0 only and no config flag changes that: a private hook, kept in compat
        from raydeploy.compat import write_cache_from_every_process

        write_cache_from_every_process()
