"""The adapter slots as one engine holds them on its devices (`AdapterSlots`): the stacked A/B arrays, each engine
slot's adapter, and writing or clearing a slot between steps.

Every host of a gang holds the same slots: a load or unload reaches every host through the dispatcher between two
steps (`raydeploy.gang.dispatch`), each host reads the adapter's files itself and runs the same write program, as
it runs the same step programs. The engine slot -> adapter slot table (`slot_adapter` [max_slots]) is host data
set from each request's first chunk (`SeqStep.adapter`) and moved to the devices only when it changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from raydeploy.lora.batched import LoraWeights
from raydeploy.lora.layout import LoraLayout, replicated
from raydeploy.lora.peft import HostAdapter, empty_adapter, read_adapter


class AdapterSlots:
    """`layout.slots` adapter slots on `mesh` (see the module docstring)."""

    def __init__(self, layout: LoraLayout, mesh: jax.sharding.Mesh, rules: Mapping[str, Any], max_slots: int) -> None:
        self.layout = layout
        self.mesh = mesh
        self.weights: LoraWeights = layout.allocate(mesh, rules)
        self._write = layout.write_program(mesh, rules)
        self._replicated = replicated(mesh)
        self.slot_adapter = np.full(max_slots, -1, np.int32)
        """Each engine slot's adapter slot (-1: the base model), as its request's first chunk set it."""
        self._device_table: jax.Array | None = None
        self.loaded: dict[int, str] = {}
        """Adapter slot -> the path loaded there (what `status` reports)."""

    def _put(self, x: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(x.shape, self._replicated, lambda idx: x[idx])

    def use(self, slot: int, adapter: int) -> None:
        """Engine slot `slot` runs adapter slot `adapter` (-1: none) from this step on."""
        if self.slot_adapter[slot] != adapter:
            self.slot_adapter[slot] = adapter
            self._device_table = None

    def step_arg(self) -> tuple[LoraWeights, jax.Array]:
        """The step programs' adapter argument: the stacks and the slot table on the devices."""
        if self._device_table is None:
            self._device_table = self._put(self.slot_adapter.copy())
        return self.weights, self._device_table

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.layout.slots:
            raise ValueError(f"adapter slot {slot} is out of range: the engine has {self.layout.slots} "
                             f"(lora.max_adapters)")

    def write(self, slot: int, adapter: HostAdapter | None) -> None:
        """Put `adapter` into `slot` (None: clear it; an empty slot adds exact zeros)."""
        self.check_slot(slot)
        if adapter is None:
            a, b = empty_adapter(self.layout)
            scale = 0.0
        else:
            a, b, scale = adapter.a, adapter.b, adapter.scale
        put = {n: self._put(x) for n, x in a.items()}, {n: self._put(x) for n, x in b.items()}
        self.weights = self._write(self.weights, self._put(np.asarray(slot, np.int32)), put[0], put[1],
                                   self._put(np.asarray(scale, np.float32)))

    def read(self, path: str) -> HostAdapter:
        """The adapter at `path` as a slot holds it (AdapterError naming what is wrong; no device work)."""
        return read_adapter(path, self.layout)

    def load(self, slot: int, path: str) -> dict[str, Any]:
        """Read the PEFT adapter at `path` and write it into `slot` (AdapterError naming what is wrong, before any
        device work). Returns its rank, alpha and bytes."""
        self.check_slot(slot)
        adapter = read_adapter(path, self.layout)
        self.write(slot, adapter)
        self.loaded[slot] = str(path)
        return {"slot": slot, "rank": adapter.rank, "alpha": adapter.alpha, "bytes": adapter.nbytes}

    def unload(self, slot: int) -> None:
        """Clear `slot` (its requests are done: rank 0's slot table unloads only an adapter no request uses)."""
        self.write(slot, None)
        self.loaded.pop(slot, None)

