"""The slot KV cache: device buffers [layers, slots, kv_heads, max_seq_len, head_dim], and host bookkeeping.

`allocate_kv_cache` creates the K and V buffers (stacked over the layers) directly on the mesh with the `kv_cache_spec`
shardings (one jitted zeros, so nothing passes through host memory and it works across processes).
`DecodeSlots` is the host-side table the engine keeps in step with the device cache: per slot, whether it is
active, how many tokens its cache holds, the last sampled token (the next decode input) and its sampling
parameters. Every host keeps an identical table because every host applies the same `StepPlan`s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from raydeploy.engine.sampling import SlotSampling
from raydeploy.engine.step import SamplingParams
from raydeploy.model.spec import LlamaConfig, kv_cache_spec


def kv_cache_sharding(cfg: LlamaConfig, max_slots: int, max_seq_len: int, mesh: Any,
                      rules: Mapping[str, Any]) -> Any:
    from jax.sharding import NamedSharding

    from raydeploy.model.sharding import check_divisible, partition_spec

    spec = kv_cache_spec(cfg, max_slots, max_seq_len)
    mesh_shape = dict(mesh.shape)
    check_divisible(spec, rules, mesh_shape)
    return NamedSharding(mesh, partition_spec(spec.logical_axes, rules, mesh_shape, "kv_cache"))


def allocate_kv_cache(cfg: LlamaConfig, max_slots: int, max_seq_len: int, dtype: Any, mesh: Any,
                      rules: Mapping[str, Any]) -> tuple[Any, Any]:
    """Zeroed K and V caches, each one [layers, slots, kv_heads, seq, head_dim] array sharded on the mesh."""
    import jax
    import jax.numpy as jnp

    sharding = kv_cache_sharding(cfg, max_slots, max_seq_len, mesh, rules)
    shape = kv_cache_spec(cfg, max_slots, max_seq_len).shape
    zeros = jax.jit(lambda: (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)), out_shardings=(sharding, sharding))
    return zeros()


class DecodeSlots:
    """Host-side state of every slot, mirrored on all hosts."""

    def __init__(self, max_slots: int, max_seq_len: int) -> None:
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.active = np.zeros(max_slots, bool)
        self.lengths = np.zeros(max_slots, np.int32)
        """Tokens held in the slot's cache; also the position the next decode input is written at."""
        self.last_token = np.zeros(max_slots, np.int32)
        self.sampling: list[SamplingParams] = [SamplingParams() for _ in range(max_slots)]

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is out of range: the engine has {self.max_slots} slots (0..{self.max_slots - 1})")

    def start(self, slot: int, prompt_len: int, first_token: int, sampling: SamplingParams) -> None:
        self.check_slot(slot)
        self.active[slot] = True
        self.lengths[slot] = prompt_len
        self.last_token[slot] = first_token
        self.sampling[slot] = sampling

    def release(self, slot: int) -> None:
        self.check_slot(slot)
        self.active[slot] = False
        self.lengths[slot] = 0

    def advance(self, mask: np.ndarray, tokens: np.ndarray) -> None:
        """After a decode: slots in `mask` hold one more token and `tokens` are their next inputs."""
        self.lengths = np.where(mask, self.lengths + 1, self.lengths).astype(np.int32)
        self.last_token = np.where(mask, tokens, self.last_token).astype(np.int32)

    def longest_active(self) -> int:
        return int(self.lengths[self.active].max()) if self.active.any() else 0

    def check_room(self, steps: int = 1) -> None:
        full = np.nonzero(self.active & (self.lengths + steps > self.max_seq_len))[0]
        if full.size:
            slot = int(full[0])
            raise ValueError(f"slot {slot} has no room for {steps} more token(s): its cache holds "
                             f"{int(self.lengths[slot])} of max_seq_len={self.max_seq_len}; the scheduler must stop "
                             f"it or plan fewer decode steps")

    def slot_sampling(self) -> SlotSampling:
        return SlotSampling.from_params(self.sampling)
