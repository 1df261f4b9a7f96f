"""What every benchmark prints beside its figures: the CPU's vector-unit flags that decide XLA:CPU speed."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_flags() -> str:
    """The flags among avx2, fma, avx512f, avx512_bf16, amx_bf16 that this CPU has ("none" if none)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()
    have = set(flags.split(":", 1)[1].split())
    return " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in have) or "none"
