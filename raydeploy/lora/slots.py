"""Rank 0's table of adapters: which are known (name -> PEFT directory), which are resident in which device slot,
how many requests use each, and which to evict when a slot is needed (LRU among the unused). No JAX, no I/O.

An adapter is registered by `lora.adapters` at start-up or by POST /v1/load_lora_adapter, and stays known until
/v1/unload_lora_adapter. A known adapter is resident or not: loading one when every slot is full evicts the
least recently used adapter that no running request uses (it stays known: a later request for it loads it again
into some slot, as vLLM and Ray Serve's multiplexing do). A request pins its adapter's residence from submit to
its last event, so a slot is never rewritten under a running request; when every slot is pinned a new adapter
waits for one (`AdapterSlotsBusy`: the caller retries, bounded).

Each residence gets a fresh `key` (name and a load number): the prefix cache keys a request's pages under it
(`raydeploy.engine.pages`), so pages computed under one adapter are never reused under another, nor under the
same name loaded again from other files.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class UnknownAdapter(LookupError):
    """A model name that is neither the base model nor a known adapter (HTTP 404 naming it)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"The model `{self.name}` does not exist."

    def __reduce__(self):
        return (UnknownAdapter, (self.name,))


class AdapterConflict(ValueError):
    """A load of a name already known, an unload of an adapter running requests, LoRA off or runtime loading
    disallowed (HTTP 400 with the message)."""


class AdapterSlotsBusy(RuntimeError):
    """Every adapter slot holds an adapter that running requests use (retry when one finishes)."""


@dataclass
class Residence:
    """A resident adapter: its device slot, its prefix-cache key, the requests using it and when it was last used."""

    name: str
    slot: int
    key: str
    pins: int = 0
    last_used_s: float = 0.0


class AdapterTable:
    """See the module docstring. Thread-safe: requests pin on the actor's event loop and unpin from the step loop's
    thread (their last event)."""

    def __init__(self, slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.clock = clock
        self.paths: dict[str, str] = {}
        """Every known adapter: name -> its PEFT directory."""
        self.resident: dict[str, Residence] = {}
        self._by_slot: list[str | None] = [None] * slots
        self._loads = 0
        self._lock = threading.Lock()

    def known(self, name: str) -> bool:
        return name in self.paths

    def names(self) -> list[str]:
        return sorted(self.paths)

    def register(self, name: str, path: str) -> None:
        """Know adapter `name` at `path`; AdapterConflict when the name is known already."""
        with self._lock:
            if name in self.paths:
                raise AdapterConflict(f"The lora adapter '{name}' has already been loaded.")
            self.paths[name] = path

    def forget(self, name: str) -> int | None:
        """Stop knowing `name` (UnknownAdapter if not known; AdapterConflict while requests use it); returns the
        slot it leaves (for the caller to clear), or None when it was not resident."""
        with self._lock:
            if name not in self.paths:
                raise UnknownAdapter(name)
            res = self.resident.get(name)
            if res is not None and res.pins:
                raise AdapterConflict(f"The lora adapter '{name}' is in use by {res.pins} running request(s); "
                                      f"unload it when they are done")
            del self.paths[name]
            if res is None:
                return None
            del self.resident[name]
            self._by_slot[res.slot] = None
            return res.slot

    def pin(self, name: str) -> Residence | None:
        """A request starts under `name`: its residence, pinned (None when known but not resident: load it first);
        UnknownAdapter when not known."""
        with self._lock:
            if name not in self.paths:
                raise UnknownAdapter(name)
            res = self.resident.get(name)
            if res is not None:
                res.pins += 1
                res.last_used_s = self.clock()
            return res

    def unpin(self, name: str, key: str) -> None:
        """A request under residence `key` of `name` ended."""
        with self._lock:
            res = self.resident.get(name)
            if res is not None and res.key == key and res.pins > 0:
                res.pins -= 1
                res.last_used_s = self.clock()

    def place(self, name: str) -> tuple[int, str | None]:
        """A slot for known adapter `name`: a free one, else the least recently used unpinned one (its adapter is
        evicted: known, no longer resident). Returns (slot, evicted name or None); AdapterSlotsBusy when every slot
        is pinned. The slot is reserved for `name` until `loaded` or `abandon`."""
        with self._lock:
            if name not in self.paths:
                raise UnknownAdapter(name)
            if name in self.resident:
                raise AdapterConflict(f"The lora adapter '{name}' is resident already (slot "
                                      f"{self.resident[name].slot})")
            free = [s for s, n in enumerate(self._by_slot) if n is None]
            evicted = None
            if free:
                slot = free[0]
            else:
                idle = [r for r in self.resident.values() if r.pins == 0]
                if not idle:
                    raise AdapterSlotsBusy(f"all {self.slots} adapter slots (lora.max_adapters) hold adapters that "
                                           f"running requests use")
                victim = min(idle, key=lambda r: r.last_used_s)
                slot, evicted = victim.slot, victim.name
                del self.resident[victim.name]
            self._by_slot[slot] = f"\x00loading:{name}"
            return slot, evicted

    def loaded(self, name: str, slot: int) -> Residence:
        """`name` now holds `slot` (its write reached every host): a new residence with a fresh prefix-cache key."""
        with self._lock:
            self._loads += 1
            res = Residence(name, slot, f"{name}#{self._loads}", last_used_s=self.clock())
            self.resident[name] = res
            self._by_slot[slot] = name
            return res

    def abandon(self, slot: int) -> None:
        """A placement whose load failed: the slot is free again (its old contents were overwritten or not: an
        unknown state, so nothing reads it until the next load writes it whole)."""
        with self._lock:
            self._by_slot[slot] = None

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {"known": sorted(self.paths),
                    "resident": {r.name: {"slot": r.slot, "requests": r.pins} for r in self.resident.values()}}
