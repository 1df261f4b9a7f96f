"""A request's constraint as plain, picklable data: its kind and its source text."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
"""json_schema: `source` is the schema as JSON text; json_object: any JSON object (`source` empty); regex: a
regular expression the whole output matches; choice: `source` is a JSON list of the strings allowed; grammar: a
Lark grammar (llguidance's dialect, which takes `%json {...}` and regex terminals; vLLM's `grammar`)."""

KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What a request's whole generated text must match."""

    kind: ConstraintKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind {self.kind!r} is not among {list(KINDS)}")

    @property
    def key(self) -> str:
        """A cache key for the compiled grammar: the kind and a digest of the source."""
        return f"{self.kind}:{hashlib.sha256(self.source.encode()).hexdigest()}"
