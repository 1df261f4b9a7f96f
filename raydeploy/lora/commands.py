"""Adapter commands: the changes of the LoRA slots rank 0's dispatcher sends every host between two steps
(`raydeploy.gang.dispatch`), as bytes in the plans' sequence of keys, and where a configured adapter directory is
read from. Free of JAX at import (the dispatcher and the host module import it before JAX is set up)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgpack

COMMAND_MARK = b"\xc1lora"
"""How a dispatched adapter command's bytes begin (0xc1 never begins msgpack data, so no plan's bytes do)."""


@dataclass(frozen=True)
class AdapterCommand:
    """A change of the adapter slots every host makes between two steps: `load` the PEFT adapter at `path` into
    `slot`, or `unload` (clear) `slot`. Sent by rank 0's dispatcher in the plans' order (`raydeploy.gang.dispatch`)."""

    op: Literal["load", "unload"]
    slot: int
    path: str = ""

    def to_bytes(self) -> bytes:
        return COMMAND_MARK + msgpack.packb([self.op, self.slot, self.path], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> AdapterCommand:
        op, slot, path = msgpack.unpackb(data[len(COMMAND_MARK):], raw=False)
        if op not in ("load", "unload"):
            raise ValueError(f"adapter command {op!r} is not load or unload")
        return cls(op, int(slot), str(path))

    @staticmethod
    def is_command(data: bytes) -> bool:
        return data.startswith(COMMAND_MARK)

    def check(self, slots: Any) -> None:
        """What can fail before any device work (the slot; a load's files: AdapterError naming them), run on rank 0
        before the command is sent, so a bad adapter changes nothing on any host. `slots`: the engine's
        `raydeploy.lora.device.AdapterSlots`."""
        slots.check_slot(self.slot)
        if self.op == "load":
            slots.read(self.path)

    def apply(self, slots: Any) -> dict[str, Any]:
        if self.op == "load":
            return slots.load(self.slot, self.path)
        slots.unload(self.slot)
        return {"slot": self.slot}


def adapter_path(cfg: Any, path: str) -> str:
    """A `lora.adapters` directory as the hosts read it: an absolute path as it is, a relative one from the YAML
    file's directory (the working directory for a config not read from a file)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    src = getattr(cfg, "source", "") or ""
    base = Path(src).parent if src and not src.startswith("<") else Path.cwd()
    return str(base / p)
