"""vLLM's metric names on /metrics, the Grafana dashboard's queries against them, and the sums over several
ingress processes (prometheus_client's multiprocess mode: in-process units, separate processes, and two real
Serve ingress replicas over the stand-in gang).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from raydeploy.engine.pages import PagePool
from raydeploy.serve.metrics import (
    E2E_BUCKETS_S,
    FINISH_REASONS,
    ITL_BUCKETS_S,
    MULTIPROC_ENV,
    TTFT_BUCKETS_S,
    VLLM_NAMES,
    ServingMetrics,
    multiprocess_env,
)

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "k8s" / "grafana" / "raydeploy-dashboard.json"


def _samples(text: str) -> dict[str, list]:
    """Every sample of an exposition by sample name (`x_total`, `x_bucket`, ...)."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _value(samples: dict[str, list], name: str, **labels: str) -> float:
    hits = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


def _one_request(m: ServingMetrics, *, prompt: int, batches: list[tuple[int, float]], reason: str) -> None:
    """A request as generation.py reports it: arrival, token batches (count, seconds after the previous), end."""
    m.started()
    m.sequences_admitted(1)
    first = True
    total = 0
    for count, gap in batches:
        if first:
            m.first_token(gap)
        m.tokens_arrived(count, None if first else gap)
        first = False
        total += count
    m.finished(got_first_token=total > 0, prompt_tokens=prompt, output_tokens=total, duration_s=2.0,
               decode_s=sum(g for _, g in batches[1:]), finish_reason=reason)
    m.sequences_admitted(-1)


@pytest.fixture(scope="module")
def exposition() -> str:
    """A live exposition: two requests recorded and answered, rendered with the gangs' figures."""
    m = ServingMetrics("demo-model")
    _one_request(m, prompt=7, batches=[(1, 0.05), (2, 0.02), (1, 0.01)], reason="stop")
    _one_request(m, prompt=5, batches=[(3, 0.04), (1, 0.03)], reason="length")
    m.count_response("/v1/completions", 200)
    m.count_response("/v1/chat/completions", 200)
    stats = {"slots_in_use": 3, "queue_depth": 1, "pages_total": 40, "pages_used": 10}
    return m.render({"state": "ready", "ready_gangs": 1, "total_gangs": 1, "restarts": 0}, stats, 0.5)


def test_vllm_families_are_exported_with_model_name_and_vllm_buckets(exposition):
    s = _samples(exposition)
    fams = {f.name: f for f in text_string_to_metric_families(exposition)}
    assert set(VLLM_NAMES) <= set(fams), set(VLLM_NAMES) - set(fams)
    for name in VLLM_NAMES:
        assert fams[name].samples, name
        assert all(x.labels.get("model_name") == "demo-model" for x in fams[name].samples), name
    m = {"model_name": "demo-model"}
    assert _value(s, "vllm:prompt_tokens_total", **m) == 12
    assert _value(s, "vllm:generation_tokens_total", **m) == 8
    assert _value(s, "vllm:request_success_total", finished_reason="stop", **m) == 1
    assert _value(s, "vllm:request_success_total", finished_reason="length", **m) == 1
    for reason in ("abort", "error"):  # shown at 0 from the start
        assert _value(s, "vllm:request_success_total", finished_reason=reason, **m) == 0
    assert _value(s, "vllm:time_to_first_token_seconds_count", **m) == 2
    assert _value(s, "vllm:time_to_first_token_seconds_sum", **m) == pytest.approx(0.09)
    # one ITL observation per output token after the first: (4 - 1) + (4 - 1); their sum is the decode time
    assert _value(s, "vllm:inter_token_latency_seconds_count", **m) == 6
    assert _value(s, "vllm:inter_token_latency_seconds_sum", **m) == pytest.approx(0.02 + 0.01 + 0.03)
    assert _value(s, "vllm:time_per_output_token_seconds_count", **m) == 6
    assert _value(s, "vllm:request_time_per_output_token_seconds_count", **m) == 2
    assert _value(s, "vllm:e2e_request_latency_seconds_count", **m) == 2
    for name, buckets in (("vllm:time_to_first_token_seconds", TTFT_BUCKETS_S),
                          ("vllm:inter_token_latency_seconds", ITL_BUCKETS_S),
                          ("vllm:e2e_request_latency_seconds", E2E_BUCKETS_S)):
        les = [float(x.labels["le"]) for x in s[f"{name}_bucket"]]
        assert les == [*buckets, float("inf")], name
    assert _value(s, "vllm:num_requests_running", **m) == 3
    assert _value(s, "vllm:num_requests_waiting", **m) == 1  # the gang's queue; no sequence admitted now
    assert _value(s, "vllm:kv_cache_usage_perc", **m) == pytest.approx(10 / 40)
    assert "raydeploy_tokens_generated_total 8.0" in exposition  # our own names stay
    assert set(FINISH_REASONS) == {"stop", "length", "abort", "error"}


def test_waiting_counts_sequences_sent_without_a_slot_and_kv_from_a_real_page_pool():
    m = ServingMetrics("demo")
    for _ in range(7):
        m.started()
    pool = PagePool(num_pages=32, page_size=16)
    stats = {"slots_in_use": 4, "queue_depth": 0, **pool.stats()}
    s = _samples(m.render({"state": "ready"}, stats))
    assert _value(s, "vllm:num_requests_waiting", model_name="demo") == 3
    assert _value(s, "vllm:kv_cache_usage_perc", model_name="demo") == 0.0
    m.line.inc(5)  # five more wait in the ingress's line for room: waiting, not yet admitted
    s = _samples(m.render({"state": "ready"}, stats))
    assert _value(s, "vllm:num_requests_waiting", model_name="demo") == 8
    m.line.dec(5)
    # no figures from the gangs yet: no vLLM gauge rather than a made-up 0
    s = _samples(m.render({"state": "starting"}, {}))
    assert "vllm:num_requests_running" not in s and "vllm:kv_cache_usage_perc" not in s


_PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "inf", "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions (followed by '('),
    keywords, label names in matchers or in by/without lists, strings, ranges or dashboard variables."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?\w+\}?", " ", e)  # $variables
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or m.group(0) in _PROMQL_WORDS:
            continue
        if m.start() > 0 and (e[m.start() - 1].isdigit() or e[m.start() - 1] == "."):
            continue  # part of a number such as 1e-9
        names.add(m.group(0))
    return names


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for k, v in node.items():
                if k == "query" and isinstance(v, dict) and isinstance(v.get("query"), str):
                    exprs.append(re.sub(r"^label_values\((.*?),\s*\w+\)$", r"\1", v["query"]))
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dash)
    return exprs


def test_promql_name_extraction():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(vllm:x_bucket{model_name=~"$model_name"}[$__rate_interval])))'
    ) == {"vllm:x_bucket"}
    assert promql_metric_names("sum(rate(a_total[5m])) / clamp_min(b, 1e-9) and on (job) c") == {"a_total", "b", "c"}


def test_every_dashboard_query_names_an_exported_metric(exposition):
    exprs = _dashboard_exprs()
    assert len(exprs) >= 10, exprs
    exported = set(_samples(exposition)) | {f.name for f in text_string_to_metric_families(exposition)}
    used = set()
    for expr in exprs:
        names = promql_metric_names(expr)
        assert names, expr
        missing = names - exported
        assert not missing, f"{expr!r} reads {sorted(missing)}, which /metrics does not export"
        used |= names
    # the panels the dashboard is for: TTFT/ITL/e2e percentiles, running/waiting, KV, token rates, reasons
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total"):
        assert name in used, name


def test_a_dashboard_query_naming_an_unexported_metric_is_caught(exposition):
    exported = set(_samples(exposition))
    assert promql_metric_names("rate(vllm:num_preemptions_total[5m])") - exported == {"vllm:num_preemptions_total"}


# -- several processes -------------------------------------------------------------------------------------

_RECORDER = textwrap.dedent("""
    import sys
    from raydeploy.serve.metrics import ServingMetrics
    m = ServingMetrics("demo")
    n, left_open = int(sys.argv[1]), int(sys.argv[2])
    for _ in range(n):
        m.started(); m.sequences_admitted(1); m.first_token(0.01); m.tokens_arrived(2, None)
        m.finished(got_first_token=True, prompt_tokens=3, output_tokens=2, duration_s=0.1, decode_s=0.0,
                   finish_reason="stop")
        m.sequences_admitted(-1)
    for _ in range(left_open):
        m.started(); m.sequences_admitted(1)
    if len(sys.argv) > 3:
        sys.stdout.write(m.render({"state": "ready"}, {"slots_in_use": 0, "queue_depth": 0}))
""")


def _run(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", _RECORDER, *args], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_processes_sharing_a_directory_add_up_and_a_gone_ones_live_gauges_drop(tmp_path):
    env = {MULTIPROC_ENV: str(tmp_path / "m")}
    _run(env, "3", "2")  # gone, with two requests it never finished
    _run(env, "4", "0")
    text = _run(env, "5", "1", "render")  # alive while it renders, one request open
    s = _samples(text)
    assert _value(s, "vllm:request_success_total", model_name="demo", finished_reason="stop") == 12
    assert _value(s, "vllm:generation_tokens_total", model_name="demo") == 24
    assert _value(s, "raydeploy_requests_served_total") == 0  # no HTTP here: counted by responses only
    assert _value(s, "raydeploy_tokens_generated_total") == 24
    assert _value(s, "vllm:time_to_first_token_seconds_count", model_name="demo") == 12
    assert _value(s, "raydeploy_requests_in_flight") == 1  # the gone process's two open ones are not counted
    assert _value(s, "raydeploy_sequences_admitted") == 1
    assert _value(s, "vllm:num_requests_waiting", model_name="demo") == 1


def test_without_the_directory_each_metrics_object_is_its_own(monkeypatch):
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    a, b = ServingMetrics("a"), ServingMetrics("b")
    _one_request(a, prompt=2, batches=[(1, 0.1)], reason="stop")
    s = _samples(b.render({}, {}))
    assert _value(s, "vllm:request_success_total", model_name="b", finished_reason="stop") == 0


def test_multiprocess_env_is_new_per_deployment():
    a, b = multiprocess_env("raydeploy")[MULTIPROC_ENV], multiprocess_env("raydeploy")[MULTIPROC_ENV]
    assert a != b and os.path.isabs(a) and "raydeploy" in os.path.basename(a)
    # a directory the job (or the operator) already chose is kept: every replica must write where it is scraped
    assert multiprocess_env("raydeploy", {MULTIPROC_ENV: "/srv/metrics"}) == {MULTIPROC_ENV: "/srv/metrics"}


# -- two real ingress replicas -----------------------------------------------------------------------------

@pytest.mark.ray
@pytest.mark.e2e
@pytest.mark.slow
def test_two_ingress_replicas_add_up_to_the_requests_sent(demo_checkpoint, tmp_path):
    """Serve's two ingress replicas, each its own process, both writing to the deployment's directory: N
    requests sent through the proxy, spread over both; any scrape (whichever replica answers) counts N."""
    import asyncio

    import httpx
    import ray

    from raydeploy.config import load_config
    from raydeploy.serve.run import start_serving

    env = multiprocess_env("raydeploy")
    # the job's runtime_env: Serve's replicas inherit it (deployment.py may also set it per deployment)
    ray.init(include_dashboard=False, namespace="raydeploy", log_to_driver=False, num_cpus=2,
             _temp_dir=f"/tmp/rdmet-{os.getpid()}", runtime_env={"env_vars": env})
    serving = None
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cfg = load_config(None, ["cluster.num_hosts=1", "cluster.devices_per_host=1", "mesh.axes={dp: 1}",
                                 "engine.max_slots=4", "serving.max_queue=32", f"serving.port={port}",
                                 "serving.ingress_replicas=2", "cluster.init_timeout_s=60"])
        serving = start_serving(cfg, checkpoint_path=str(demo_checkpoint), engine="toy")
        serving.wait_ready(600, count=1)
        deadline = time.monotonic() + 600
        while True:  # both replicas up: /ready answers 200 through the proxy
            try:
                if httpx.get(serving.url + "/ready", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the HTTP ingress did not become ready"
            time.sleep(0.5)
        n = 24
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "temperature": 0}

        async def main() -> list[int]:
            async with httpx.AsyncClient(timeout=120) as client:
                rs = await asyncio.gather(*[client.post(serving.url + "/v1/completions", json=body) for _ in range(n)])
                return [r.status_code for r in rs]

        assert asyncio.run(main()) == [200] * n
        pids = {p.name.rsplit("_", 1)[-1] for p in Path(env[MULTIPROC_ENV]).glob("counter_*.db")}
        assert len(pids) == 2, f"the requests did not reach both replicas' processes: {pids}"
        deadline = time.monotonic() + 30
        for _ in range(6):  # several scrapes, answered by either replica: each counts all N
            s = _samples(httpx.get(serving.url + "/metrics", timeout=30).text)
            model = cfg.model.name or Path(demo_checkpoint).name
            assert _value(s, "vllm:request_success_total", model_name=model, finished_reason="length") == n
            assert _value(s, "raydeploy_requests_served_total") == n
            assert _value(s, "vllm:generation_tokens_total", model_name=model) == 4 * n
            assert _value(s, "vllm:e2e_request_latency_seconds_count", model_name=model) == n
            assert time.monotonic() < deadline
    finally:
        if serving is not None:
            serving.shutdown()
        ray.shutdown()
