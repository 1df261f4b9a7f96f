"""The old EasyDeL JAXServer bodies: POST /chat (a prompt with its [[user, assistant], ...] history) and POST
/instruct (an instruction with an optional system prompt)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from raydeploy.serve.protocol.common import MAX_HISTORY_TURNS, MAX_TOP_K, _at_most


class LegacyChatRequest(BaseModel):
    """POST /chat of EasyDeL's JAXServer: a prompt, the history as [[user, assistant], ...], greedy or not."""

    model_config = ConfigDict(extra="ignore", strict=True)
    prompt: str
    history: list[Annotated[list[str], Field(min_length=2, max_length=2)]] = Field(default_factory=list)
    _history_count = _at_most("history", MAX_HISTORY_TURNS, "turns")
    greedy: bool = False
    system: str | None = None
    max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] | None = None


class LegacyInstructRequest(BaseModel):
    """POST /instruct of EasyDeL's JAXServer: an instruction with an optional system prompt."""

    model_config = ConfigDict(extra="ignore", strict=True)
    instruction: str
    system: str | None = None
    greedy: bool = False
    max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] | None = None
