"""Serve's request router for gang replicas: power of two choices among the replicas whose gang is ready.

Each gang replica reports `{"ready": bool}` through `record_routing_stats` (raydeploy.serve.replica); this
router leaves out replicas that did not report ready (a gang starting, or being rebuilt after losing a host),
draws two of the rest, and Serve's base router sends the request to the one with the shorter queue that still
has room below `max_ongoing_requests` (the gang's slots). When no replica reports ready it draws from all of
them rather than hold the request: a report lags the gang by up to one routing-stats period (a gang that has
just come back still reads "compiling"), and Serve's router, once given no candidate, did not pick the replica
up again when its report turned ready (measured: a request held until the client gave up). A replica whose
gang cannot take the request refuses it at once and the ingress resends it (raydeploy.serve.backend), which
also answers 503 at once when the gangs' own states say that none is ready.
"""

from __future__ import annotations

import random
from typing import Any

from raydeploy.compat import serve_request_router

_serve = serve_request_router()  # Serve's alpha router API, checked for this Ray version
_FIFOMixin: Any = _serve.FIFOMixin
_RequestRouter: Any = _serve.RequestRouter


class ReadyGangRouter(_FIFOMixin, _RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[Any],
                              pending_request: Any | None = None) -> list[list[Any]]:
        ready = [r for r in candidate_replicas if ready_for_requests(r.routing_stats)]
        # No replica says its gang is ready (all starting or rebuilding, or their reports are late): try them all
        # rather than hold the request; a replica whose gang cannot take it refuses at once and the ingress resends
        pool = ready or list(candidate_replicas)
        if not pool:
            return []
        return [random.sample(pool, min(2, len(pool)))]


def ready_for_requests(routing_stats: dict) -> bool:
    """Whether a replica's last report says its gang is ready (no report yet: not ready)."""
    return routing_stats.get("ready") is True
