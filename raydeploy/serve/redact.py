"""What `/status` may publish: the deployment's state without its internal network addresses.

The gangs' status (raydeploy.gang.supervisor) carries, for operators reading the driver's log, the
jax.distributed coordinator's `ip:port` and each host's node IP, and the config names the coordinator's bind
address and the Ray cluster's; an error text can name an address too (a placement or preflight message, a
JAX error). Over HTTP none of these is needed, and each tells a caller
where the gang's unauthenticated coordination port listens. `without_addresses` drops the keys that hold
one and masks IPv4 addresses (with an optional port) and bracketed IPv6 addresses in every string; it scans
each string once, in time linear in its length.
"""

from __future__ import annotations

import re
from typing import Any

INTERNAL_KEYS = frozenset({"coordinator_address", "coordinator_bind_address", "node_ip", "ray_address"})
"""Keys whose value is an internal address (the gang's status, the config's cluster section): dropped wherever
they occur."""

MASK = "<internal address>"

_ADDRESS = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?(?![\w.])"  # 10.0.0.7, 10.0.0.7:8476
                      r"|\[[0-9A-Fa-f:.]{2,45}\](?::\d{1,5})?")  # [fd00::7]:8476


def without_addresses(value: Any) -> Any:
    """`value` (JSON-like: dicts, lists, strings, numbers) with internal addresses dropped or masked."""
    if isinstance(value, dict):
        return {k: without_addresses(v) for k, v in value.items() if k not in INTERNAL_KEYS}
    if isinstance(value, list | tuple):
        return [without_addresses(v) for v in value]
    if isinstance(value, str):
        return _ADDRESS.sub(MASK, value)
    return value
