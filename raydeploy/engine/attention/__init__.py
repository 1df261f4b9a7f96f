"""Attention backends for the paged KV cache, chosen once per engine (`engine.attention`).

Every backend is one function with the signature of jax's TPU ragged paged attention kernel:

    ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, soft_cap=None) -> out

q [T, Hq, D] holds the new tokens of every sequence back to back (decode rows and prefill chunks mixed),
kv_pages [P, page_size, 2*Hkv, D] the page pool with K and V interleaved on the head axis (or, for an int8 or
float8 `engine.kv_dtype`, a `QuantizedPool` of such values and their per-token float32 scales; every backend
reads both: `kv_quant`), and the int32
kv_lens [S], page_indices [S, pages_per_seq], cu_q_lens [S+1], num_seqs [1] describe the sequences. The engine
writes this step's K/V into the pages before it calls the backend, and calls it per shard inside `shard_map`.

- `xla`: plain XLA (`xla.py`); the CPU backend and the reference for the others; runs anywhere.
- `pallas` on TPU: jax's own Pallas TPU kernel with block sizes chosen from the shapes (`pallas_tpu.py`).
- `pallas` on GPU: jax's Pallas GPU paged attention for decode steps, XLA for steps with prefill rows
  (`pallas_gpu.py`).
- `auto`: `pallas` on TPU and GPU, `xla` on CPU.

`get_attention(name, platform)` gives the engine both paths of a backend (`Attention`): `ragged` for any step,
and, where a faster kernel serves only steps whose live sequences all carry one token (the GPU's), that kernel
as `single_token`. The engine then compiles a single-token variant of its decode-sized step programs and
picks it on the host, so no program chooses on its data: on a GPU a `lax.cond` copies its predicate to the
host and waits for it, and the backend's own choice inside the layer scan did so in every layer (16 times a
pass of a Llama-1B shape, in a profile on an H100).

`work_follows_table(name, platform)` says whether a backend's cost grows with the page table's width rather
than with the live tokens: only then does the engine compile several page-count buckets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import jax

from raydeploy.engine.attention.kv_quant import QuantizedPool, is_quantized

BACKEND_NAMES = ("auto", "xla", "pallas")
PLATFORMS = ("cpu", "tpu", "gpu")
_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


class AttentionBackend(Protocol):
    def __call__(self, q: jax.Array, kv_pages: jax.Array | QuantizedPool, kv_lens: jax.Array, page_indices: jax.Array,
                 cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array: ...


def resolve(name: str, platform: str) -> tuple[str, str]:
    """(backend, platform) that `name` means on `platform` ("auto" resolved); ValueError naming the valid
    choices for an unknown name or platform, or for `pallas` on CPU."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"engine.attention: unknown attention backend {name!r}; valid: {', '.join(BACKEND_NAMES)}")
    plat = _PLATFORM_ALIASES.get(platform, platform)
    if plat not in PLATFORMS:
        raise ValueError(f"engine.attention: unknown platform {platform!r}; valid: {', '.join(PLATFORMS)}")
    if name == "auto":
        name = "xla" if plat == "cpu" else "pallas"
    if name == "pallas" and plat == "cpu":
        raise ValueError("engine.attention: 'pallas' needs a TPU or GPU platform, got 'cpu'; use 'xla' or "
                         "'auto' on CPU")
    return name, plat


def for_device(name: str, device: Any) -> str:
    """`name` as the engine on `device` takes it: `auto` on a GPU older than Ampere is `xla` (jax's Pallas GPU
    kernel multiplies bfloat16 with Triton's dot, which needs sm_80: `pallas_gpu.device_problem` of the matmul
    backends); an explicit choice stays as given."""
    from raydeploy.engine.matmul.pallas_gpu import device_problem

    if name == "auto" and getattr(device, "platform", "") == "gpu" and device_problem(device) is not None:
        return "xla"
    return name


def get_backend(name: str, platform: str) -> AttentionBackend:
    """The attention function for backend `name` ("auto" | "xla" | "pallas") on `platform` ("cpu" | "tpu" |
    "gpu"; "cuda" and "rocm" mean "gpu")."""
    backend, plat = resolve(name, platform)
    if backend == "xla":
        from raydeploy.engine.attention import xla

        return xla.ragged_paged_attention
    if plat == "tpu":
        from raydeploy.engine.attention import pallas_tpu

        return pallas_tpu.ragged_paged_attention
    from raydeploy.engine.attention import pallas_gpu

    return pallas_gpu.ragged_paged_attention


@dataclasses.dataclass(frozen=True)
class Attention:
    """An engine's attention: `ragged` serves any step; `single_token`, where set, serves steps in which every
    live sequence carries one token (every decode pass), faster, in programs of their own.
    `static_layer_kinds`: a choice on data costs a host round trip on this platform (a GPU copies a `lax.cond`'s
    predicate to the host), so a family whose layers differ in kind (Gemma 3's local and global layers) makes
    each layer's kind static, at a program that holds one block of its layer pattern instead of one layer."""

    ragged: AttentionBackend
    single_token: AttentionBackend | None = None
    static_layer_kinds: bool = False

    @property
    def decode_rows(self) -> bool:
        """Whether `ragged` asks a decode-row kernel first for its one-token rows (`with_decode_rows`)."""
        return isinstance(self.ragged, partial) and self.ragged.keywords.get("decode_rows") is not None

    def with_decode_rows(self, kernel: Callable[..., jax.Array | None] | None) -> Attention:
        """This attention with `kernel` for its decode rows where `ragged` is the XLA backend (its `decode_rows`:
        the native CPU kernel of an engine whose matmul backend is `cpu_native`); else unchanged."""
        from raydeploy.engine.attention import xla

        if kernel is None or self.ragged is not xla.ragged_paged_attention:
            return self
        return dataclasses.replace(self, ragged=partial(xla.ragged_paged_attention, decode_rows=kernel))


def get_attention(name: str, platform: str) -> Attention:
    """Both paths of backend `name` on `platform` (see `Attention`): on GPU, `pallas` is the XLA path for steps
    with prompt tokens and jax's Pallas GPU decode kernel for single-token steps; elsewhere one function
    (`get_backend`'s) serves every step. On GPU every backend asks for static layer kinds."""
    backend, plat = resolve(name, platform)
    if backend == "pallas" and plat == "gpu":
        from raydeploy.engine.attention import pallas_gpu, xla

        return Attention(xla.ragged_paged_attention, pallas_gpu.single_token_attention, static_layer_kinds=True)
    return Attention(get_backend(name, platform), static_layer_kinds=plat == "gpu")


def work_follows_table(name: str, platform: str, kv_dtype: str | None = None) -> bool:
    """True when the backend's work grows with pages_per_seq (the width of the page table), not with kv_lens:
    the GPU backend copies every page its table names into the kernel's layout, and so does the TPU backend over
    a quantized pool (`kv_dtype` int8 / float8_e4m3fn: it dequantizes the table's pages for jax's kernel). The
    XLA backend's loops and the TPU kernel over a float pool stop at each sequence's live pages, so for them one
    program with the widest table serves every length (fewer programs to compile; measured on CPU: the same
    decode step time with a 32-page table as with a 16-page one, 8 rows at 200-odd tokens)."""
    backend, plat = resolve(name, platform)
    return backend == "pallas" and (plat == "gpu" or (plat == "tpu" and kv_dtype is not None
                                                      and is_quantized(kv_dtype)))
