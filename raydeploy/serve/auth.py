"""Optional API keys: from an environment variable (comma-separated) or a file (one per line).

When keys are configured, /v1/*, /chat and /instruct need `Authorization: Bearer <key>` (or `X-API-Key`);
/health and /ready stay open for probes. Keys are compared in constant time and never logged, shown in
/status, or echoed in an error.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from raydeploy.config import ConfigError, ServingConfig


def load_api_keys(serving: ServingConfig, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The accepted keys; () means no authentication. A configured but empty source is an error."""
    env = os.environ if environ is None else environ
    if serving.api_keys_env:
        raw = env.get(serving.api_keys_env)
        if raw is None:
            raise ConfigError(f"environment variable {serving.api_keys_env} is not set",
                              key="serving.api_keys_env")
        keys = [k.strip() for k in raw.split(",")]
        source, key = f"environment variable {serving.api_keys_env}", "serving.api_keys_env"
    elif serving.api_keys_file:
        try:
            text = Path(serving.api_keys_file).expanduser().read_text()
        except OSError as e:
            raise ConfigError(f"cannot read the API keys file: {e.strerror}", key="serving.api_keys_file") from None
        keys = [line.strip() for line in text.splitlines() if not line.strip().startswith("#")]
        source, key = "the API keys file", "serving.api_keys_file"
    else:
        return ()
    keys = [k for k in keys if k]
    if not keys:
        raise ConfigError(f"{source} holds no API key", key=key)
    return tuple(keys)


class ApiKeyCheck:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = tuple(k.encode() for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None, x_api_key: str | None) -> bool:
        return not self._keys or self.key_index(authorization, x_api_key) is not None

    def key_index(self, authorization: str | None, x_api_key: str | None) -> int | None:
        """Which configured key the request carries (its position in the list), or None: an identity for
        per-key limits that is never the key itself."""
        candidate = x_api_key
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer":
                candidate = value.strip()
        if not candidate or not self._keys:
            return None
        given = candidate.encode()
        found = None
        for i, k in enumerate(self._keys):  # no early exit: time does not depend on which key matched
            if hmac.compare_digest(given, k):
                found = i
        return found
