"""Serving figures for GET /metrics (Prometheus text format), kept by the ingress with `prometheus_client`.

Latency (time to first token, time per output token, request duration) is measured here, where the
client's clock is, into `prometheus_client` histograms; request and token counts are its counters. Gang
figures are read from every gang's supervisor and coordinator at scrape time and exported by a collector
made for that scrape from `GangFigures`, the figures a background refresh read (at most one refresh per
`serving.metrics_refresh_s`, each bounded, a scrape waiting at most a second for one; the figures' age is
exported as `raydeploy_gang_figures_age_seconds`): the deployment's (`raydeploy_gang_ready` is 1 while any gang is ready,
`raydeploy_gangs_ready`, `raydeploy_gangs`, restarts and the coordinators' figures summed over gangs), and
each gang's own with a `gang` label (`raydeploy_gang_up`, `raydeploy_gang_restarts_by_gang`,
`raydeploy_gang_slots_in_use`, ...). No label ever carries user input (gang labels are supervisor names, and
`model_name` is the served model's name from the config).

vLLM's names, beside ours: dashboards, autoscaling rules and inference gateways written for vLLM read
`vllm:*` series with a `model_name` label (`VLLM_NAMES`, with vLLM's own buckets). Where the meaning is the
same they are the same observations as ours; `vllm:num_requests_running` is the gangs' slots in use,
`vllm:num_requests_waiting` the sequences the ingresses sent that hold no slot yet (in Serve's router or a
gang's queue), `vllm:kv_cache_usage_perc` the gangs' KV pages held by running sequences over all pages (cached
idle pages count as free, as vLLM counts them). Of vLLM's two inter-token names: `vllm:inter_token_latency_seconds`
(its current name) has one observation per output token after the first, and `vllm:time_per_output_token_seconds`
(the name before vLLM 0.11) the same observations, so a dashboard of either version works;
`vllm:request_time_per_output_token_seconds` has one per request (its mean). Tokens that reach the ingress
together (one gang message holds a plan's tokens) share the gap since the previous message.

Several ingress replicas: each replica is its own process, and the Serve proxy sends a scrape to one of them.
With `PROMETHEUS_MULTIPROC_DIR` set in the replicas' environment (`multiprocess_env`, in the ingress's
runtime_env), `prometheus_client`'s multiprocess mode keeps every replica's figures in files in that directory
and any replica answers a scrape with their sums (counters and histograms of every replica that ever ran, so
a restarted replica's counts stay counted and the sums never go down; the in-flight gauges of live replicas
only: files of processes that are gone are dropped at scrape time). The directory is per node: replicas on
one node add up exactly; with ingress replicas on several nodes, scrape each node's Serve proxy (which
prefers its local replicas) and sum in PromQL. Why not `ray.util.metrics`: Ray exports those only through each
node's metrics agent and renames them (a `ray_` prefix; `:` in a name is deprecated there), so the `vllm:`
names that dashboards look for could not be kept. Without the variable (tests, other ASGI servers) each
`ServingMetrics` has its own registry, so one process can hold several apps.

`requests_served` counts generations answered successfully (completions, chat, /chat, /instruct), not
probes, status polls or scrapes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "raydeploy"
GENERATION_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/chat", "/instruct"})
"""The routes whose successful answers count as requests served."""
PER_GANG_STATS = ("slots_in_use", "queue_depth", "tokens_generated", "requests_done", "steps_done")
"""Coordinator figures also exported per gang (labelled `gang`)."""
log = logging.getLogger("raydeploy.serve")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Where the ingress replicas of a node keep their figures (prometheus_client's multiprocess mode), when set."""
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""vLLM's buckets for vllm:time_to_first_token_seconds (vllm/v1/metrics/loggers.py)."""
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
"""vLLM's buckets for its inter-token and time-per-output-token histograms."""
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
"""vLLM's buckets for vllm:e2e_request_latency_seconds."""
FINISH_REASONS = ("stop", "length", "abort", "error")
"""vLLM's `finished_reason` values: stop (an end token or stop string), length (max_tokens or the context),
abort (the client went away, a timeout, the gang ended the stream) and error (the request failed)."""
VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
              "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
              "vllm:e2e_request_latency_seconds")
"""The vLLM metric families /metrics exports (counters get vLLM's `_total` samples), each labelled `model_name`."""


def multiprocess_env(app_name: str, inherited: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment that makes an application's ingress replicas add up their figures: a directory new to
    this deployment (a fresh one per `serve` run, so no earlier run's counts are summed in), for the replicas'
    runtime_env. Its path is the same on every node; each node's replicas share their node's copy. A directory
    already chosen in `inherited` (the job's runtime_env variables, or the driver's environment: an operator's or
    a test's) is kept."""
    chosen = (inherited or {}).get(MULTIPROC_ENV)
    if chosen:
        return {MULTIPROC_ENV: chosen}
    base = os.path.join(tempfile.gettempdir(), "raydeploy-metrics")
    return {MULTIPROC_ENV: os.path.join(base, f"{_name_part(app_name)}-{uuid.uuid4().hex[:12]}")}


RECENT_SAMPLES = 4096
"""How many recent latencies /status keeps for its p50/p99 (the histograms keep every observation)."""


class _Recent:
    """The last RECENT_SAMPLES observations, for quantiles in /status (Prometheus gets the histogram)."""

    def __init__(self) -> None:
        self._values: deque[float] = deque(maxlen=RECENT_SAMPLES)
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._values.append(value)

    def quantile(self, q: float) -> float | None:
        with self._lock:
            s = sorted(self._values)
        if not s:
            return None
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class ServingMetrics:
    """Counters and histograms of one ingress replica, in a registry of its own (or, with MULTIPROC_ENV set
    when the process started, in that directory beside its sibling replicas', summed at scrape time)."""

    def __init__(self, model_name: str = "") -> None:
        self.multiproc_dir = os.environ.get(MULTIPROC_ENV) or None
        if self.multiproc_dir:
            os.makedirs(self.multiproc_dir, exist_ok=True)
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from request arrival to its first token.",
                               buckets=LATENCY_BUCKETS_S, registry=reg)
        self._tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                               "Mean time between a request's tokens after the first.",
                               buckets=LATENCY_BUCKETS_S, registry=reg)
        self._e2e = Histogram(f"{PREFIX}_request_duration_seconds", "Time from request arrival to its last token.",
                              buckets=LATENCY_BUCKETS_S, registry=reg)
        self._tokens = Counter(f"{PREFIX}_tokens_generated", "Output tokens streamed to clients.", registry=reg)
        self._prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests.", registry=reg)
        self._http = Counter(f"{PREFIX}_http_requests", "HTTP responses by endpoint and status.",
                             ("endpoint", "status"), registry=reg)
        self._served = Counter(f"{PREFIX}_requests_served",
                               "Generation requests answered without error (not probes, status polls or scrapes).",
                               registry=reg)
        self._in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Requests admitted by this ingress and not finished.",
                                registry=reg, multiprocess_mode="livesum")
        self._waiting = Gauge(f"{PREFIX}_requests_waiting_first_token",
                              "Admitted requests that have no token yet (queued or prefilling).", registry=reg,
                              multiprocess_mode="livesum")
        self.line = Gauge(f"{PREFIX}_sequences_waiting_for_capacity",
                          "Sequences waiting in the ingress's line for room (serving.max_waiting), not yet admitted.",
                          registry=reg, multiprocess_mode="livesum")
        """Moved by ServingCore.admit around its wait in the line."""
        self.admitted = Gauge(f"{PREFIX}_sequences_admitted",
                              "Sequences admitted by the ingress and not yet released (n counts each choice).",
                              registry=reg, multiprocess_mode="livesum")
        """Moved by `sequences_admitted` (ServingCore's admission); `create_app` may also read the count at
        scrape time (a function, which a multiprocess scrape does not see: there the moves count)."""
        self._vllm_families(reg)
        self.model_name = ""
        self.set_model_name(model_name)
        self._recent_ttft, self._recent_tpot = _Recent(), _Recent()
        self._lock = threading.Lock()
        self._now_in_flight = 0
        self.peak_in_flight = 0

    def _vllm_families(self, reg: CollectorRegistry) -> None:
        """vLLM's names for the same figures (VLLM_NAMES; the gangs' three gauges come with the gang figures)."""
        label = ("model_name",)
        self._v_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", label, registry=reg)
        self._v_gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.", label,
                              registry=reg)
        self._v_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                  (*label, "finished_reason"), registry=reg)
        self._v_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                 label, buckets=TTFT_BUCKETS_S, registry=reg)
        self._v_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                label, buckets=ITL_BUCKETS_S, registry=reg)
        self._v_tpot_old = Histogram("vllm:time_per_output_token_seconds",
                                     "Histogram of time per output token in seconds (vLLM's name before "
                                     "vllm:inter_token_latency_seconds; the same observations).",
                                     label, buckets=ITL_BUCKETS_S, registry=reg)
        self._v_tpot = Histogram("vllm:request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.", label,
                                 buckets=ITL_BUCKETS_S, registry=reg)
        self._v_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                label, buckets=E2E_BUCKETS_S, registry=reg)

    def set_model_name(self, model_name: str) -> None:
        """The `model_name` label of the vLLM series (the served model's name); each finished_reason is shown
        from the start at 0, so a dashboard's panel is not empty and a rate has a first point."""
        self.model_name = _label_value(model_name)
        for reason in FINISH_REASONS:
            self._v_success.labels(self.model_name, reason)

    # -- recording -------------------------------------------------------------------------------------
    def started(self) -> None:
        self._in_flight.inc()
        self._waiting.inc()
        with self._lock:
            self._now_in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._now_in_flight)

    def sequences_admitted(self, delta: int) -> None:
        """`delta` sequences admitted (positive) or released (negative) by the ServingCore."""
        self.admitted.inc(delta)

    def first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)
        self._v_ttft.labels(self.model_name).observe(ttft_s)
        self._recent_ttft.add(ttft_s)
        self._waiting.dec()

    def tokens_arrived(self, count: int, gap_s: float | None) -> None:
        """`count` output tokens reached the ingress together, `gap_s` after the previous ones (None: the first
        token is among them, and the others of its message arrived with it, a gap of 0)."""
        if count <= 0:
            return
        self._v_gen.labels(self.model_name).inc(count)
        later = count - 1 if gap_s is None else count
        each = 0.0 if gap_s is None else gap_s / count
        itl, old = self._v_itl.labels(self.model_name), self._v_tpot_old.labels(self.model_name)
        for _ in range(later):
            itl.observe(each)
            old.observe(each)

    def finished(self, *, got_first_token: bool, prompt_tokens: int, output_tokens: int,
                 duration_s: float, decode_s: float, finish_reason: str = "abort") -> None:
        """One job ended; `finish_reason` as in FINISH_REASONS (what vllm:request_success_total counts by)."""
        self._in_flight.dec()
        with self._lock:
            self._now_in_flight -= 1
        if not got_first_token:
            self._waiting.dec()
        self._tokens.inc(output_tokens)
        self._prompt_tokens.inc(prompt_tokens)
        self._v_prompt.labels(self.model_name).inc(prompt_tokens)
        self._v_success.labels(self.model_name, _name_part(finish_reason)).inc()  # the engine's reasons, no input
        if output_tokens > 0:
            self._e2e.observe(duration_s)
            self._v_e2e.labels(self.model_name).observe(duration_s)
        if output_tokens > 1:
            tpot = decode_s / (output_tokens - 1)
            self._tpot.observe(tpot)
            self._v_tpot.labels(self.model_name).observe(tpot)
            self._recent_tpot.add(tpot)

    def count_response(self, endpoint: str, status: int) -> None:
        """One HTTP response; `endpoint` is the route's path template (never the client's raw path)."""
        self._http.labels(endpoint, str(status)).inc()
        if endpoint in GENERATION_ENDPOINTS and status < 400:
            self._served.inc()

    # -- reading ---------------------------------------------------------------------------------------
    def _value(self, name: str) -> float:
        return self.registry.get_sample_value(f"{PREFIX}_{name}") or 0.0

    @property
    def requests_served(self) -> int:
        return int(self._value("requests_served_total"))

    def snapshot(self) -> dict[str, Any]:
        """Figures for /status (this replica's own)."""
        return {
            "requests_served": self.requests_served,
            "in_flight": int(self._value("requests_in_flight")),
            "peak_in_flight": self.peak_in_flight,
            "tokens_generated": int(self._value("tokens_generated_total")),
            "ttft_s": {"p50": self._recent_ttft.quantile(0.5), "p99": self._recent_ttft.quantile(0.99)},
            "tpot_s": {"p50": self._recent_tpot.quantile(0.5), "p99": self._recent_tpot.quantile(0.99)},
        }

    def exported(self) -> CollectorRegistry:
        """What a scrape reports of the requests: this registry, or with MULTIPROC_ENV every replica's sums."""
        if not self.multiproc_dir:
            return self.registry
        _forget_dead_processes(self.multiproc_dir)
        summed = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(summed, path=self.multiproc_dir)
        return summed

    def render(self, gang_state: Mapping[str, Any], engine_stats: Mapping[str, Any],
               figures_age_s: float | None = None) -> str:
        """The Prometheus text: the requests' figures (`exported`), then the gang figures (read `figures_age_s`
        ago) and vLLM's three gauges of them."""
        requests = self.exported()
        started = requests.get_sample_value(f"{PREFIX}_requests_in_flight")  # jobs: one per sequence
        in_line = requests.get_sample_value(f"{PREFIX}_sequences_waiting_for_capacity")
        scrape = CollectorRegistry(auto_describe=False)
        scrape.register(_GangFigures(gang_state, engine_stats, figures_age_s))
        scrape.register(_VllmGangGauges(self.model_name, engine_stats, started, in_line))
        return (generate_latest(requests) + generate_latest(scrape)).decode("utf-8")


class _VllmGangGauges:
    """vllm:num_requests_running, vllm:num_requests_waiting and vllm:kv_cache_usage_perc for one scrape, from the
    gangs' figures (summed over gangs) and the sequences the ingresses are streaming (each ingress's
    `raydeploy_requests_in_flight`, summed over replicas in multiprocess mode)."""

    def __init__(self, model_name: str, engine_stats: Mapping[str, Any], in_flight: float | None,
                 in_line: float | None = None) -> None:
        self.model_name, self.stats, self.in_flight = model_name, engine_stats, in_flight
        self.in_line = in_line or 0.0
        """Sequences waiting in the ingresses' lines for room (not yet admitted, so not in `in_flight`)."""

    def collect(self) -> Iterator[Metric]:
        running, queued = _number(self.stats.get("slots_in_use")), _number(self.stats.get("queue_depth"))
        total, used = _number(self.stats.get("pages_total")), _number(self.stats.get("pages_used"))
        if running is not None:
            g = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                  labels=["model_name"])
            g.add_metric([self.model_name], running)
            yield g
            # sent by an ingress but in no slot: in Serve's router or a gang's queue (figures read at slightly
            # different times, hence the floor)
            # plus those still in an ingress's line for room (serving.max_waiting)
            waiting = max(0.0, (self.in_flight or 0.0) - running, queued or 0.0) + self.in_line
            g = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                  labels=["model_name"])
            g.add_metric([self.model_name], waiting)
            yield g
        if total and used is not None:
            g = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=["model_name"])
            g.add_metric([self.model_name], used / total)
            yield g
        yield from self._spec_decode()

    def _spec_decode(self) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (`raydeploy.engine.speculative.policy.SpecCounters`), where the gangs
        report them: drafts (a row's proposals in one step), proposed and accepted tokens, accepted per position."""
        for key, help_text in SPEC_COUNTERS.items():
            v = _number(self.stats.get(f"spec_decode_{key}"))
            if v is None:
                continue
            c = CounterMetricFamily(f"vllm:spec_decode_{key}", help_text, labels=["model_name"])
            c.add_metric([self.model_name], v)
            yield c
        per_pos = self.stats.get("spec_decode_accepted_per_pos")
        if isinstance(per_pos, list) and per_pos:
            c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", labels=["model_name", "position"])
            for pos, v in enumerate(per_pos):
                if _number(v) is not None:
                    c.add_metric([self.model_name, str(pos)], float(v))
            yield c


SPEC_COUNTERS = {"num_drafts": "Number of spec decoding drafts.",
                 "num_draft_tokens": "Number of draft tokens.",
                 "num_accepted_tokens": "Number of accepted tokens."}
"""vLLM's speculative-decoding counters (their help texts), from the gangs' `spec_decode_*` figures; the acceptance
rate and the mean accepted length follow from them (and are among the raydeploy_engine_* gauges)."""


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def _forget_dead_processes(path: str) -> None:
    """Drop the live gauges of replicas that are gone (their counters stay summed): prometheus_client keeps a
    file per process and only `mark_process_dead` removes a gone one's `livesum` figures."""
    for name in os.listdir(path):
        m = re.fullmatch(r"gauge_live\w*?_(\d+)\.db", name)
        if m is None:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            mark_process_dead(pid, path)
        except PermissionError:  # alive, another user's
            pass


class _GangFigures:
    """A one-scrape collector of the supervisor's state and the coordinator's stats, as gauges."""

    def __init__(self, gang_state: Mapping[str, Any], engine_stats: Mapping[str, Any],
                 age_s: float | None = None) -> None:
        self.gang_state, self.engine_stats, self.age_s = gang_state, engine_stats, age_s

    def collect(self) -> Iterator[Metric]:
        if self.age_s is not None:
            yield GaugeMetricFamily(f"{PREFIX}_gang_figures_age_seconds",
                                    "Seconds since the gang figures below were read from the gangs.",
                                    value=self.age_s)
        state = str(self.gang_state.get("state", "unknown"))
        yield GaugeMetricFamily(f"{PREFIX}_gang_ready", "1 when the gang is ready to serve.",
                                value=int(state == "ready"))
        g = GaugeMetricFamily(f"{PREFIX}_gang_state", "The gang's state (1 for the current one).", labels=["state"])
        g.add_metric([_name_part(state)], 1)
        yield g
        ready_gangs, total = self.gang_state.get("ready_gangs"), self.gang_state.get("total_gangs")
        if isinstance(ready_gangs, int) and isinstance(total, int):
            yield GaugeMetricFamily(f"{PREFIX}_gangs_ready", "Gangs ready to serve.", value=ready_gangs)
            yield GaugeMetricFamily(f"{PREFIX}_gangs", "Gangs running (any state).", value=total)
        yield from self._per_gang()
        taken = {"gang_ready", "gang_state", "gang_restarts", "gang_ready_gangs", "gang_total_gangs"}
        restarts = self.gang_state.get("restarts")
        if isinstance(restarts, int | float) and not isinstance(restarts, bool):
            yield CounterMetricFamily(f"{PREFIX}_gang_restarts", "Gang restarts since the server started.",
                                      value=restarts)
        for source, prefix, who in ((self.gang_state, "gang", "supervisor"), (self.engine_stats, "engine", "coordinator")):
            for key, value in sorted(_numbers(source, prefix).items()):
                if key in taken:
                    continue
                taken.add(key)
                yield GaugeMetricFamily(f"{PREFIX}_{key}", f"Gang figure '{key}' reported by the {who}.", value=value)

    def _per_gang(self) -> Iterator[Metric]:
        """Each gang's state and its coordinator's figures, labelled with the gang's name."""
        gangs = self.gang_state.get("gangs")
        if not isinstance(gangs, list) or not gangs:
            return
        up = GaugeMetricFamily(f"{PREFIX}_gang_up", "1 when this gang is ready to serve.", labels=["gang"])
        restarts = GaugeMetricFamily(f"{PREFIX}_gang_restarts_by_gang", "Restarts of this gang.", labels=["gang"])
        for g in gangs:
            name = _name_part(str(g.get("gang", "")))
            up.add_metric([name], int(g.get("state") == "ready"))
            if isinstance(g.get("restarts"), int):
                restarts.add_metric([name], g["restarts"])
        yield up
        yield restarts
        per_gang = self.engine_stats.get("gangs")
        if not isinstance(per_gang, Mapping):
            return
        for key in PER_GANG_STATS:
            fam = GaugeMetricFamily(f"{PREFIX}_gang_{key}", f"Coordinator figure '{key}' of this gang.",
                                    labels=["gang"])
            for name, stats in sorted(per_gang.items()):
                v = stats.get(key) if isinstance(stats, Mapping) else None
                if isinstance(v, int | float) and not isinstance(v, bool):
                    fam.add_metric([_name_part(str(name))], float(v))
            yield fam


class _FigureSource(Protocol):
    async def state(self) -> dict[str, Any]: ...

    async def stats(self) -> dict[str, Any]: ...


class GangFigures:
    """The gangs' state and coordinator figures as last read, for /metrics (and /status, which reads them anew).

    `get()` asks the gangs at most once per `refresh_s`, however often Prometheus scrapes: when the figures are
    older than that it starts one background refresh (never two at once) and waits for it at most `wait_s`,
    then answers with the newest figures it has. Each refresh is bounded by `timeout_s`; a failed one keeps the
    old figures (their age says so). A scrape between refreshes calls no gang at all."""

    def __init__(self, source: _FigureSource, refresh_s: float, *, timeout_s: float = 10.0, wait_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.refresh_s, self.timeout_s, self.wait_s = refresh_s, timeout_s, wait_s
        self.clock = clock
        self.state: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.read_at: float | None = None
        self.refreshes = 0
        """Refreshes started (each asks every gang once)."""
        self._task: asyncio.Task | None = None

    async def get(self) -> tuple[dict[str, Any], dict[str, Any], float | None]:
        """(state, stats, age in seconds or None before any figures)."""
        if self._task is None and (self.read_at is None or self.clock() - self.read_at >= self.refresh_s):
            self.refreshes += 1
            self._task = asyncio.get_running_loop().create_task(self._refresh())
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=self.wait_s)  # a bounded wait; never cancels the refresh
        return self._answer()

    async def read_now(self) -> tuple[dict[str, Any], dict[str, Any], float | None]:
        """Ask the gangs now (bounded), for /status; the cache takes the new figures too."""
        self.refreshes += 1
        await self._read()
        return self._answer()

    def _answer(self) -> tuple[dict[str, Any], dict[str, Any], float | None]:
        age = None if self.read_at is None else max(0.0, self.clock() - self.read_at)
        return self.state, self.stats, age

    async def _refresh(self) -> None:
        try:
            await self._read()
        finally:
            self._task = None

    async def _read(self) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                state = await self.source.state()
                stats = await self.source.stats() if state.get("state") == "ready" else {}
            self.state, self.stats, self.read_at = dict(state), dict(stats), self.clock()
        except Exception as e:  # the gangs did not answer: keep the old figures, their age grows
            log.warning("reading the gang figures failed: %s", type(e).__name__)


_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")


def _name_part(text: str) -> str:
    """`text` as part of a metric name or a label value: letters, digits and '_' only, at most 64."""
    return _NOT_NAME.sub("_", text)[:64]


def _label_value(text: str) -> str:
    """A config-given name as a label value: printable, at most 128 characters."""
    return "".join(c for c in text if c.isprintable())[:128]


def _numbers(d: Mapping[str, Any], prefix: str, depth: int = 0) -> dict[str, float]:
    """Flatten the numeric leaves of a stats dict into metric names (nested dicts joined by '_')."""
    out: dict[str, float] = {}
    for k, v in d.items():
        name = f"{prefix}_{_name_part(str(k))}"
        if isinstance(v, bool):
            out[name] = float(v)
        elif isinstance(v, int | float) and math.isfinite(v):
            out[name] = float(v)
        elif isinstance(v, Mapping) and depth < 2 and k != "gangs":  # per gang: labelled, in _per_gang
            out.update(_numbers(v, name, depth + 1))
    return out
