"""XLA's dot as a matmul backend: the default everywhere (TPU, a GPU without the Pallas kernel, CPU with
`engine.cpu_matmul: xla` or where the native kernels cannot run) and the reference the kernels are tested
against. Stacked layer kernels are sliced per layer by the scan (`reads_whole` False)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from raydeploy.model.projection import dot


class Xla:
    """Every projection through `raydeploy.model.projection.dot`."""

    reads_whole = False

    def matmul(self, x: jax.Array, w: Any, out_first: bool = False) -> jax.Array:
        return dot(x, w, out_first)

    def matmuls(self, x: jax.Array, ws: Sequence[Any]) -> list[jax.Array] | None:
        return None  # one dot per weight

    def tied_head(self, h: jax.Array, table: jax.Array) -> jax.Array:
        return dot(h, table, out_first=True)


XLA = Xla()
