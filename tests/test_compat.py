"""raydeploy.compat: every private API it wraps resolves on the pinned jax and Ray; a missing one is a clear error
naming the library and its version; the coordination service's timeout is recognised by type and status code
(checked against a real jax.distributed key-value get in a subprocess); nothing else in the package uses those
APIs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from raydeploy import compat

REPO = Path(__file__).resolve().parents[1]


# -- every feature resolves on the pinned versions ------------------------------------------------------------

def test_pinned_jax_features_resolve() -> None:
    assert compat.jax_runtime_error().__name__ == "JaxRuntimeError"
    put = compat.batched_device_put()
    assert put is not None, "the checkpoint reader's fast path is missing on the pinned jax"


def test_batched_device_put_builds_the_same_array_as_the_public_call() -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    put = compat.batched_device_put()
    assert put is not None
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec())
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = put.put(put.aval((3, 4), np.dtype(np.float32), sharding), sharding, [host], list(mesh.devices.flat))
    assert a.shape == (3, 4) and a.dtype == np.float32 and a.sharding == sharding
    np.testing.assert_array_equal(np.asarray(a), host)


def test_pinned_serve_router_resolves() -> None:
    api = compat.serve_request_router()
    from raydeploy.serve.routing import ReadyGangRouter

    cfg = api.RequestRouterConfig(request_router_class=ReadyGangRouter, request_routing_stats_period_s=2.0)
    assert cfg.request_routing_stats_period_s == 2.0
    assert issubclass(ReadyGangRouter, api.RequestRouter) and issubclass(ReadyGangRouter, api.FIFOMixin)


def test_kv_client_outside_jax_distributed_says_so() -> None:
    code = "from raydeploy import compat\ntry:\n    compat.coordination_kv_client()\nexcept RuntimeError as e:\n" \
           "    print(type(e).__name__, e)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=_cpu_env()).stdout
    assert out.strip() == "RuntimeError jax.distributed is not initialised in this process; no key-value client"


# -- a missing API is a clear error -----------------------------------------------------------------------------

def test_missing_kv_client_names_jax_and_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax._src import distributed

    monkeypatch.delattr(distributed, "global_state")
    with pytest.raises(compat.CompatError) as e:
        compat.coordination_kv_client()
    version = compat.library_version("jax")
    assert str(e.value).startswith(
        "raydeploy needs jax's coordination-service client (jax._src.distributed.global_state.client); "
        f"jax {version} does not have it (AttributeError: ")
    assert str(e.value).endswith(": use jax 0.10.x")


def test_missing_kv_method_names_the_method(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax._src import distributed

    class Client:  # a client of some other jax: no blocking get
        def key_value_set_bytes(self, key: str, value: bytes) -> None: ...

    monkeypatch.setattr(distributed.global_state, "client", Client())
    with pytest.raises(compat.CompatError, match=r"key-value methods \(Client\.blocking_key_value_get_bytes\); "
                                                 r"jax \S+ does not have it \(no blocking_key_value_get_bytes, "):
        compat.coordination_kv_client()


def test_runtime_error_without_status_code_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import jax.errors

    class Plain(RuntimeError):
        pass

    monkeypatch.setattr(jax.errors, "JaxRuntimeError", Plain)
    with pytest.raises(compat.CompatError, match=r"the status code of jax's runtime errors "
                                                 r"\(jax\.errors\.JaxRuntimeError\.error_code\); jax \S+ does not"):
        compat.jax_runtime_error()


def test_changed_cache_writer_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax._src import compiler

    def _cache_write(cache_key: str, module_name: str) -> None: ...

    monkeypatch.setattr(compiler, "_cache_write", _cache_write)
    with pytest.raises(compat.CompatError, match=r"jax's persistent-cache writer with the arguments \(cache_key, "
                                                 r".*it takes \(cache_key, module_name\)\): use jax 0\.10\.x"):
        compat.write_cache_from_every_process()
    assert compiler._cache_write is _cache_write  # left alone


def test_cache_writer_hook_is_installed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax._src import compiler

    original = compiler._cache_write
    monkeypatch.setattr(compiler, "_cache_write", original)  # restored after the test
    compat.write_cache_from_every_process()
    hooked = compiler._cache_write
    assert hooked is not original and getattr(hooked, "_every_process", False)
    compat.write_cache_from_every_process()
    assert compiler._cache_write is hooked


def test_missing_batched_device_put_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax._src.lib import xla_client

    monkeypatch.delattr(xla_client, "batched_device_put")
    compat.batched_device_put.cache_clear()
    try:
        assert compat.batched_device_put() is None
    finally:
        compat.batched_device_put.cache_clear()


def test_missing_serve_router_names_ray_and_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.serve.request_router as rr

    monkeypatch.delattr(rr, "RequestRouter")
    compat.serve_request_router.cache_clear()
    try:
        with pytest.raises(compat.CompatError) as e:
            compat.serve_request_router()
    finally:
        compat.serve_request_router.cache_clear()
    assert str(e.value).startswith(
        "raydeploy needs Serve's request-router API (ray.serve.request_router and "
        f"ray.serve.config.RequestRouterConfig); ray {compat.library_version('ray')} does not have it (ImportError: ")
    assert str(e.value).endswith(": use ray 2.60.x")


def test_changed_router_config_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    api = compat.serve_request_router()
    fields = {k: v for k, v in api.RequestRouterConfig.model_fields.items() if k != "request_routing_stats_period_s"}
    monkeypatch.setattr(api.RequestRouterConfig, "model_fields", fields)
    compat.serve_request_router.cache_clear()
    try:
        with pytest.raises(compat.CompatError, match=r"\(RequestRouterConfig\); ray \S+ does not have it "
                                                     r"\(no field request_routing_stats_period_s\)"):
            compat.serve_request_router()
    finally:
        compat.serve_request_router.cache_clear()


# -- the coordination service's timeout, by type and status code ----------------------------------------------

_KV_PROBE = textwrap.dedent("""
    import json, socket
    import jax
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    jax.distributed.initialize(f"127.0.0.1:{port}", 1, 0, coordinator_bind_address=f"127.0.0.1:{port}",
                               initialization_timeout=60)
    from raydeploy import compat
    from raydeploy.gang.dispatch import FollowerLoop, jax_kv_client
    kv = compat.coordination_kv_client()
    out = {}
    try:
        kv.blocking_key_value_get_bytes("raydeploy/test/absent", 50)
    except compat.KeyValueTimeout as e:
        raw = e.__cause__
        out["timeout"] = [type(e).__name__, isinstance(e, TimeoutError), type(raw).__module__ + "." +
                          type(raw).__name__, raw.error_code, compat.is_deadline_exceeded(raw)]
    kv.key_value_set("raydeploy/test/k", "v")
    try:  # another status (ALREADY_EXISTS) stays jax's error
        kv.key_value_set("raydeploy/test/k", "w")
    except Exception as e:
        out["other"] = [type(e).__name__, getattr(e, "error_code", None), compat.is_deadline_exceeded(e)]
    kv.key_value_set_bytes("raydeploy/test/b", b"\\x00\\x01")
    out["get"] = list(kv.blocking_key_value_get_bytes("raydeploy/test/b", 1000))

    class Stop:
        def step(self, plan):
            raise AssertionError("no plan was published")
    loop = FollowerLoop(Stop(), jax_kv_client(), generation=0, rank=1, poll_ms=20)
    import threading
    t = threading.Thread(target=loop.run); t.start()
    timer = threading.Timer(0.3, loop.stop); timer.start()
    t.join(60)
    out["follower_waited_and_stopped"] = not t.is_alive()
    print("RESULT " + json.dumps(out))
    jax.distributed.shutdown()
""")


def _cpu_env() -> dict[str, str]:
    import os

    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}


def test_real_kv_timeout_is_classified_by_type_and_code() -> None:
    proc = subprocess.run([sys.executable, "-c", _KV_PROBE], capture_output=True, text=True, timeout=180,
                          env=_cpu_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    out = json.loads(lines[0][len("RESULT "):])
    assert out["timeout"] == ["KeyValueTimeout", True, "jax.errors.JaxRuntimeError", compat.DEADLINE_EXCEEDED, True]
    assert out["other"] == ["JaxRuntimeError", 6, False]  # ALREADY_EXISTS passes through unchanged
    assert out["get"] == [0, 1]
    assert out["follower_waited_and_stopped"] is True


def test_deadline_is_matched_by_code_not_by_text() -> None:
    from jax.errors import JaxRuntimeError

    assert compat.is_deadline_exceeded(JaxRuntimeError("anything at all", code=compat.DEADLINE_EXCEEDED))
    assert not compat.is_deadline_exceeded(JaxRuntimeError("DEADLINE_EXCEEDED: timed out"))  # code UNKNOWN
    assert not compat.is_deadline_exceeded(RuntimeError("DEADLINE_EXCEEDED: timed out"))


def test_kv_adapter_passes_other_errors_through() -> None:
    from jax.errors import JaxRuntimeError

    class Client:
        def __init__(self, code: int) -> None:
            self.code = code

        def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
            raise JaxRuntimeError("DEADLINE_EXCEEDED in the text only", code=self.code)

    with pytest.raises(compat.KeyValueTimeout, match="no value for key 'k' within 5 ms"):
        compat.CoordinationKV(Client(compat.DEADLINE_EXCEEDED), JaxRuntimeError).blocking_key_value_get_bytes("k", 5)
    with pytest.raises(JaxRuntimeError) as e:
        compat.CoordinationKV(Client(14), JaxRuntimeError).blocking_key_value_get_bytes("k", 5)  # UNAVAILABLE
    assert not isinstance(e.value, TimeoutError)



_CACHE_PROBE = textwrap.dedent("""
    import json, os, sys
    rank, port, cache, every = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    import jax, jax.numpy as jnp
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank, coordinator_bind_address=f"127.0.0.1:{port}",
                               initialization_timeout=60)
    from raydeploy.engine import compile_cache
    compile_cache.enable(cache, share_between_hosts=False, every_process_writes=every)
    with compile_cache.track() as count:
        jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()
    print("RESULT " + json.dumps({"requests": count.requests, "entries": len(os.listdir(cache))}))
    jax.distributed.shutdown()
""")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("every", [True, False])
def test_rank_1_writes_cache_entries_only_with_the_hook(tmp_path: Path, every: bool) -> None:
    """Two real jax.distributed processes, each with its own cache folder: with the hook, rank 1 writes its
    entries; without it (jax's own behaviour, which is why the hook exists) rank 1 writes none."""
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _CACHE_PROBE, str(rank), port, str(tmp_path / f"r{rank}"),
                               "1" if every else "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_cpu_env()) for rank in (0, 1)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, out + err
        results.append(json.loads(lines[0][len("RESULT "):]))
    rank0, rank1 = results
    assert rank0["requests"] > 0 and rank0["entries"] == rank0["requests"]
    assert rank1["requests"] == rank0["requests"]
    assert rank1["entries"] == (rank1["requests"] if every else 0)

# -- nothing outside compat uses the private APIs ---------------------------------------------------------------

_PRIVATE = re.compile(r"jax\._src|jaxlib\._|\._actor_id\b|\._ray_actor_id\b|ray\.serve\._private|"
                      r"ray\.serve\.request_router|serve\.config\.RequestRouterConfig|"
                      r"from\s+ray\.serve\.config\s+import\s+(\([^)]*|[^\n]*)RequestRouterConfig|"
                      r"\bcompiler\._cache_write")


def _private_uses(text: str) -> list[tuple[int, str]]:
    lines = text.splitlines()
    out = []
    for m in _PRIVATE.finditer(text):
        n = text.count("\n", 0, m.start()) + 1
        out.append((n, lines[n - 1].strip()))
    return out


def test_private_apis_only_in_compat() -> None:
    pkg = REPO / "raydeploy"
    hits = []
    for path in sorted(pkg.rglob("*.py")):
        if path == pkg / "compat.py":
            continue
        hits += [f"{path.relative_to(REPO)}:{n}: {line}" for n, line in _private_uses(path.read_text())]
    assert not hits, "private jax/Ray APIs belong in raydeploy/compat.py:\n" + "\n".join(hits)


def test_private_api_grep_can_fail() -> None:
    for text in ("from jax._src import distributed", "key = coordinator._actor_id.hex()",
                 "from ray.serve.request_router import RequestRouter", "from ray.serve._private.common import X",
                 "from ray.serve.config import RequestRouterConfig",
                 "from ray.serve.config import (\n    DeploymentConfig,\n    RequestRouterConfig,\n)",
                 "compiler._cache_write = write"):
        assert _private_uses(text), text
    assert not _private_uses('"request_router_config": compat.serve_request_router().RequestRouterConfig(')
    assert not _private_uses("from ray.serve.config import AutoscalingConfig\nx = RequestRouterConfig")


def test_ray_auto_init_can_be_switched_off_after_ray_is_imported():
    """`raydeploy serve` relies on this: once switched off, a Ray call in a process that is not connected raises
    instead of starting a new local Ray (a subprocess: this one may hold a Ray connection)."""
    code = ("import ray\n"
            "from raydeploy.compat import disable_ray_auto_init\n"
            "disable_ray_auto_init()\n"
            "try:\n"
            "    ray.put(1)\n"
            "except Exception as e:\n"
            "    print('raised', type(e).__name__)\n"
            "print('initialized', ray.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_ENABLE_AUTO_CONNECT": ""})
    assert "raised" in out.stdout and "initialized False" in out.stdout, out.stdout + out.stderr
