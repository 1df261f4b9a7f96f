"""Serving figures in the Prometheus text format (GET /metrics), kept by the ingress replica.

Latency (time to first token, time per output token, request duration) is measured here, where the
client's clock is; gang figures (queue depth, slots in use, engine steps, restarts, load and start-up
times) are read from the coordinator's stats and the supervisor's state at scrape time and exported as
gauges. No label ever carries user input.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Mapping
from typing import Any

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "raydeploy"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Iterable[float] = LATENCY_BUCKETS_S) -> None:
        self.name, self.help = name, help_text
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0
        self.samples: list[float] = []  # bounded reservoir for quantiles in /status
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1
            if len(self.samples) >= 4096:
                del self.samples[:2048]
            self.samples.append(value)

    def quantile(self, q: float) -> float | None:
        with self._lock:
            if not self.samples:
                return None
            s = sorted(self.samples)
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

    def render(self) -> list[str]:
        n = f"{PREFIX}_{self.name}"
        lines = [f"# HELP {n} {self.help}", f"# TYPE {n} histogram"]
        with self._lock:
            acc = 0
            for le, c in zip(self.buckets, self.counts, strict=False):
                acc += c
                lines.append(f'{n}_bucket{{le="{le:g}"}} {acc}')
            lines.append(f'{n}_bucket{{le="+Inf"}} {self.count}')
            lines.append(f"{n}_sum {self.sum:.6f}")
            lines.append(f"{n}_count {self.count}")
        return lines


class ServingMetrics:
    """Counters and histograms of one ingress replica."""

    def __init__(self) -> None:
        self.ttft_s = Histogram("time_to_first_token_seconds", "Time from request arrival to its first token.")
        self.tpot_s = Histogram("time_per_output_token_seconds",
                                "Mean time between a request's tokens after the first.")
        self.e2e_s = Histogram("request_duration_seconds", "Time from request arrival to its last token.")
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.requests: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.waiting_first_token = 0
        self.peak_in_flight = 0
        self._lock = threading.Lock()

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.waiting_first_token += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def first_token(self, ttft_s: float) -> None:
        self.ttft_s.observe(ttft_s)
        with self._lock:
            self.waiting_first_token -= 1

    def finished(self, *, got_first_token: bool, prompt_tokens: int, output_tokens: int,
                 duration_s: float, decode_s: float) -> None:
        with self._lock:
            self.in_flight -= 1
            if not got_first_token:
                self.waiting_first_token -= 1
            self.tokens_generated += output_tokens
            self.prompt_tokens += prompt_tokens
        if output_tokens > 0:
            self.e2e_s.observe(duration_s)
        if output_tokens > 1:
            self.tpot_s.observe(decode_s / (output_tokens - 1))

    def count_response(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    @property
    def requests_served(self) -> int:
        with self._lock:
            return sum(n for (_, status), n in self.requests.items() if status < 400)

    def snapshot(self) -> dict[str, Any]:
        """Figures for /status."""
        return {
            "requests_served": self.requests_served,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "tokens_generated": self.tokens_generated,
            "ttft_s": {"p50": self.ttft_s.quantile(0.5), "p99": self.ttft_s.quantile(0.99)},
            "tpot_s": {"p50": self.tpot_s.quantile(0.5), "p99": self.tpot_s.quantile(0.99)},
        }

    def render(self, gang_state: Mapping[str, Any], engine_stats: Mapping[str, Any]) -> str:
        lines: list[str] = []
        for h in (self.ttft_s, self.tpot_s, self.e2e_s):
            lines += h.render()
        with self._lock:
            lines += _metric("tokens_generated_total", "counter", "Output tokens streamed to clients.",
                             self.tokens_generated)
            lines += _metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
                             self.prompt_tokens)
            lines += [f"# HELP {PREFIX}_http_requests_total HTTP responses by endpoint and status.",
                      f"# TYPE {PREFIX}_http_requests_total counter"]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'{PREFIX}_http_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            lines += _metric("requests_in_flight", "gauge", "Requests admitted by this ingress and not finished.",
                             self.in_flight)
            lines += _metric("requests_waiting_first_token", "gauge",
                             "Admitted requests that have no token yet (queued or prefilling).",
                             self.waiting_first_token)
        state = str(gang_state.get("state", "unknown"))
        lines += [f"# HELP {PREFIX}_gang_ready 1 when the gang is ready to serve.",
                  f"# TYPE {PREFIX}_gang_ready gauge", f"{PREFIX}_gang_ready {int(state == 'ready')}",
                  f"# HELP {PREFIX}_gang_state The gang's state (1 for the current one).",
                  f"# TYPE {PREFIX}_gang_state gauge", f'{PREFIX}_gang_state{{state="{_label(state)}"}} 1']
        restarts = gang_state.get("restarts")
        if isinstance(restarts, int | float):
            lines += _metric("gang_restarts_total", "counter", "Gang restarts since the server started.", restarts)
        for key, value in sorted(_numbers(gang_state, "gang").items()):
            if key not in ("gang_restarts",):
                lines += _metric(key, "gauge", f"Gang figure '{key}' reported by the supervisor.", value)
        for key, value in sorted(_numbers(engine_stats, "engine").items()):
            lines += _metric(key, "gauge", f"Engine figure '{key}' reported by the coordinator.", value)
        return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, help_text: str, value: float) -> list[str]:
    n = f"{PREFIX}_{name}"
    return [f"# HELP {n} {help_text}", f"# TYPE {n} {kind}", f"{n} {_fmt(value)}"]


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{float(value):.6g}"


def _label(text: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in text)[:64]


def _numbers(d: Mapping[str, Any], prefix: str, depth: int = 0) -> dict[str, float]:
    """Flatten the numeric leaves of a stats dict into metric names (nested dicts joined by '_')."""
    out: dict[str, float] = {}
    for k, v in d.items():
        name = f"{prefix}_{_label(str(k))}"
        if isinstance(v, bool):
            out[name] = float(v)
        elif isinstance(v, int | float) and math.isfinite(v):
            out[name] = float(v)
        elif isinstance(v, Mapping) and depth < 2:
            out.update(_numbers(v, name, depth + 1))
    return out
