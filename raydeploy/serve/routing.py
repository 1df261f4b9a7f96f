"""Serve's request router for gang replicas: power of two choices among the replicas whose gang is ready.

Each gang replica reports `{"ready": bool}` through `record_routing_stats` (raydeploy.serve.replica); this
router leaves out replicas that did not report ready (a gang starting, or being rebuilt after losing a host),
draws two of the rest, and Serve's base router sends the request to the one with the shorter queue that still
has room below `max_ongoing_requests` (the gang's slots). With no ready replica it returns no candidate and
Serve's router waits with backoff; the ingress answers 503 at once instead when the gangs' own states say
that none is ready (raydeploy.serve.backend).
"""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class ReadyGangRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ready = [r for r in candidate_replicas if ready_for_requests(r.routing_stats)]
        if not ready:
            return []
        return [random.sample(ready, min(2, len(ready)))]


def ready_for_requests(routing_stats: dict) -> bool:
    """Whether a replica's last report says its gang is ready (no report yet: not ready)."""
    return routing_stats.get("ready") is True
