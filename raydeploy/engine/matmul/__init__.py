"""Matmul backends for the model's projections, chosen once per engine and handed to the model explicitly (like the
attention backends in `raydeploy.engine.attention`):

- `xla` (`xla.py`): XLA's dot; the default, and the reference the others are tested against.
- `cpu_native` (`cpu_native.py`): the C++ CPU kernels (`raydeploy.model.native`, built on first use) for few
  float32 rows per dp group by replicated weights, packed 4-bit layer kernels and an 8-bit tied table; its
  decode-row attention serves the XLA attention backend of the same engine (`decode_rows`).
- `pallas_gpu` (`pallas_gpu.py`): a Pallas (Triton) kernel that reads one layer of a stacked bfloat16 weight in
  place, for few rows on a GPU.

The engine chooses once, from the config, the platform, the mesh and the weights (`raydeploy.engine.programs.kernels`,
which says why each kernel is not used; hosts report it), and holds the result as a `MatmulChoice`. A step
program asks it for its backend (`MatmulChoice.backend`, with that trace's packed copies) and passes it to the
model's forward (`matmul=`); every projection multiplies with it. Nothing is found through ambient state.

Where the native kernels cannot be built (no C++ compiler, a CPU without AVX2), one warning of the
`raydeploy.native` logger says why and the engine keeps XLA (`raydeploy.model.native.unavailable`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
from jax.sharding import PartitionSpec

from raydeploy.engine.matmul.cpu_native import CpuNative, decode_attention
from raydeploy.engine.matmul.pallas_gpu import PallasGpu
from raydeploy.engine.matmul.xla import XLA, Xla
from raydeploy.model.projection import Matmul

__all__ = ["XLA", "CpuNative", "Matmul", "MatmulChoice", "PallasGpu", "Xla"]


@dataclass(frozen=True)
class MatmulChoice:
    """An engine's matmul backend, chosen once: `native` and `pallas` say why each kernel is not used (None:
    used; the native kernels win where both could run)."""

    native: str | None
    pallas: str | None
    platform: str

    @property
    def name(self) -> str:
        """"native", "pallas" or "xla"."""
        return "native" if self.native is None else "pallas" if self.pallas is None else "xla"

    def backend(self, mesh: jax.sharding.Mesh, row_axes: Sequence[str], packed: Mapping[str, jax.Array] | None = None,
                specs: Mapping[str, PartitionSpec] | None = None) -> Matmul:
        """The backend a step program traced over `mesh` hands to the model: rows split over `row_axes` (the dp
        groups); `packed`: the trace's packed copies (native); `specs`: the stacked layer weights' partitions
        (pallas; interpret mode off a GPU)."""
        if self.native is None:
            return CpuNative(mesh, row_axes, packed)
        if self.pallas is None:
            return PallasGpu(mesh, row_axes, self.platform != "gpu", specs)
        return XLA

    @property
    def decode_rows(self) -> Callable[..., jax.Array | None] | None:
        """The decode-row attention kernel the XLA attention backend asks first (`cpu_native.decode_attention`),
        or None: the native kernels' engines only."""
        return decode_attention if self.native is None else None

    def describe(self, packed: int = 0) -> str:
        """What multiplies the step programs' few rows by the weights: "native" (with how many weights are
        packed), "pallas", or "xla (why not the platform's kernel)"; hosts report it in their status."""
        if self.native is None:
            return f"native ({packed} weights packed)" if packed else "native"
        if self.pallas is None:
            return "pallas"
        return f"xla ({self.pallas if self.platform == 'gpu' else self.native})"
