"""What every benchmark prints beside its figures: the CPU's vector-unit flags that decide XLA:CPU speed and which
build of the native kernels runs (AVX-512 F and BW, with VNNI's `vpdpwssd` where present; else AVX2)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_flags() -> str:
    """The flags among avx2, fma, avx512f, avx512bw, avx512_vnni, avx512_bf16, amx_bf16 that this CPU has ("none"
    if none)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()
    have = set(flags.split(":", 1)[1].split())
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16")
    return " ".join(f for f in wanted if f in have) or "none"
