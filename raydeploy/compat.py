"""The one place raydeploy uses private or unstable APIs of jax and Ray.

Each function here checks that the API it wraps exists in the installed library (and has the shape raydeploy
expects) before using it, and raises `CompatError` naming the library, its version, what was expected and the
version to use when it does not. Nothing else in the package imports `jax._src`, touches an actor handle's
private fields, or imports Serve's alpha request-router API (tests/test_compat.py checks this by a grep).

What is here, and why no public API does the job (jax 0.10.2, Ray 2.60.0):

- `coordination_kv_client()`: the jax.distributed coordination service's key-value client, which carries the
  step plans from rank 0 to its followers. jax keeps it at `jax._src.distributed.global_state.client`; the
  public `jax.distributed` module exposes only initialize/shutdown/is_initialized. The returned client turns
  the service's DEADLINE_EXCEEDED status into `KeyValueTimeout` (a `TimeoutError`), matched by the type and
  status code of jax's public `jax.errors.JaxRuntimeError`, never by its message.
- `write_cache_from_every_process()`: jax writes persistent compilation-cache entries from process 0 only
  (`jax._src.compiler._cache_write`); no config flag lifts that (`jax_compilation_cache_dir`,
  `jax_persistent_cache_min_*`, `jax_share_binary_between_hosts` and `jax_persistent_cache_enable_xla_caches`
  do not). XLA:CPU gangs need every process to write its own entries (see raydeploy.engine.compile_cache).
- `batched_device_put()`: jax's internal last step of `jax.make_array_from_callback`, a faster path for the
  checkpoint reader. Optional: None when this jax lacks it, and the reader uses the public call.
- `disable_ray_auto_init()`: Ray starts a new local cluster when any Ray call runs in a process that is not
  connected (`ray._private.auto_init_hook`). The switch is the environment variable `RAY_ENABLE_AUTO_CONNECT`,
  but Ray reads it once, when it is first imported; a process that has imported Ray already also needs the
  module's flag set.
- `serve_request_router()`: Serve's request-router extension (`ray.serve.request_router`,
  `ray.serve.config.RequestRouterConfig`), public but marked alpha, so it may change between Ray releases.

This module imports neither jax nor Ray at import time: host actors set JAX's environment before JAX starts,
and the Serve ingress runs without JAX.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

log = logging.getLogger("raydeploy.compat")

TESTED = {"jax": "0.10.x", "ray": "2.60.x"}
"""The library versions raydeploy's private-API uses are known to work with (pyproject.toml pins them)."""

DEADLINE_EXCEEDED = 4
"""The canonical (absl / gRPC) status code of a deadline that passed; `JaxRuntimeError.error_code` carries it."""


class CompatError(RuntimeError):
    """An installed library lacks an API raydeploy relies on, or has it in a shape raydeploy does not know."""


class KeyValueTimeout(TimeoutError):
    """A blocking get on the coordination service's key-value store found no value within its timeout."""


def library_version(name: str) -> str:
    """The installed version of distribution `name` ('unknown' when it is not installed as a distribution)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _missing(lib: str, what: str, where: str, why: Exception | str) -> CompatError:
    detail = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
    return CompatError(f"raydeploy needs {what} ({where}); {lib} {library_version(lib)} does not have it "
                       f"({detail}): use {lib} {TESTED[lib]}")


# -- jax: the coordination service's key-value client ------------------------------------------------------

_KV_METHODS = ("key_value_set_bytes", "blocking_key_value_get_bytes", "key_value_delete", "key_value_set",
               "key_value_dir_get")


class CoordinationKV:
    """The coordination-service client of this process, with the methods the step dispatcher uses; a blocking
    get that times out raises `KeyValueTimeout` instead of jax's generic runtime error."""

    def __init__(self, client: Any, runtime_error: type[BaseException]) -> None:
        self._client = client
        self._runtime_error = runtime_error

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        self._client.key_value_set_bytes(key, value)

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        try:
            return self._client.blocking_key_value_get_bytes(key, timeout_in_ms)
        except self._runtime_error as e:
            if is_deadline_exceeded(e):
                raise KeyValueTimeout(f"no value for key {key!r} within {timeout_in_ms} ms") from e
            raise

    def key_value_delete(self, key: str) -> None:
        self._client.key_value_delete(key)

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._client.key_value_set(key, value, allow_overwrite=allow_overwrite)

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        return list(self._client.key_value_dir_get(key))


def jax_runtime_error() -> type[Exception]:
    """jax's public runtime error type, checked to carry a status code (`error_code`)."""
    try:
        from jax.errors import JaxRuntimeError
    except ImportError as e:
        raise _missing("jax", "jax's runtime error type", "jax.errors.JaxRuntimeError", e) from None
    if not hasattr(JaxRuntimeError, "error_code"):
        raise _missing("jax", "the status code of jax's runtime errors", "jax.errors.JaxRuntimeError.error_code",
                       "no attribute error_code")
    return JaxRuntimeError


def is_deadline_exceeded(e: BaseException) -> bool:
    """Whether `e` is jax's runtime error with the DEADLINE_EXCEEDED status code (by type and code, not text)."""
    return isinstance(e, jax_runtime_error()) and getattr(e, "error_code", None) == DEADLINE_EXCEEDED


def coordination_kv_client() -> CoordinationKV:
    """The key-value client of this process's jax.distributed coordination service (after
    `jax.distributed.initialize`); RuntimeError when jax.distributed is not initialised here."""
    try:
        from jax._src import distributed

        client = distributed.global_state.client
    except (ImportError, AttributeError) as e:
        raise _missing("jax", "jax's coordination-service client",
                       "jax._src.distributed.global_state.client", e) from None
    if client is None:
        raise RuntimeError("jax.distributed is not initialised in this process; no key-value client")
    absent = [m for m in _KV_METHODS if not hasattr(client, m)]
    if absent:
        raise _missing("jax", "the coordination-service client's key-value methods",
                       f"{type(client).__name__}.{absent[0]}", f"no {', '.join(absent)}")
    return CoordinationKV(client, jax_runtime_error())


# -- jax: persistent compilation cache entries from every process -------------------------------------------

_CACHE_WRITE_PARAMS = ("cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks")


def write_cache_from_every_process() -> None:
    """Let processes other than 0 write their persistent compilation-cache entries too (jax writes from process
    0 only, to avoid contention on shared storage; on XLA:CPU each process has keys of its own, so there is
    none). Idempotent. CompatError when jax's cache writer is not the one this was written against."""
    try:
        from jax._src import compilation_cache, compiler, distributed
        from jax._src import config as jax_config

        original = compiler._cache_write
        put = compilation_cache.put_executable_and_time
        min_compile_time = jax_config.persistent_cache_min_compile_time_secs
        distributed.global_state  # noqa: B018 - checked to exist before it is needed
    except (ImportError, AttributeError) as e:
        raise _missing("jax", "jax's persistent-cache writer", "jax._src.compiler._cache_write and "
                       "jax._src.compilation_cache.put_executable_and_time", e) from None
    if getattr(original, "_every_process", False):
        return
    params = tuple(inspect.signature(original).parameters)
    if params != _CACHE_WRITE_PARAMS:
        raise _missing("jax", "jax's persistent-cache writer with the arguments "
                       f"({', '.join(_CACHE_WRITE_PARAMS)})", "jax._src.compiler._cache_write",
                       f"it takes ({', '.join(params)})")

    def write(cache_key: str, compile_time_secs: float, module_name: str, backend: Any, executable: Any,
              host_callbacks: Any) -> None:
        if (distributed.global_state.process_id == 0 or host_callbacks
                or compile_time_secs < min_compile_time.value):
            original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
            return
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as ex:  # noqa: BLE001 - a cache that cannot be written only costs a compile next time
            warnings.warn(f"Error writing persistent compilation cache entry for '{module_name}': "
                          f"{type(ex).__name__}: {ex}", stacklevel=2)

    write._every_process = True  # type: ignore[attr-defined]
    compiler._cache_write = write


# -- jax: the checkpoint reader's fast path to a global array ------------------------------------------------

@dataclass(frozen=True)
class BatchedPut:
    """jax's own last step of `make_array_from_callback`: `aval(shape, dtype, sharding)` once per layout, then
    `put(aval, sharding, host arrays, their devices)` -> the global array (committed)."""

    aval: Callable[[tuple[int, ...], Any, Any], Any]
    put: Callable[[Any, Any, list[Any], list[Any]], Any]


@lru_cache(maxsize=1)
def batched_device_put() -> BatchedPut | None:
    """The fast path, or None when this jax lacks one of its parts (then the caller uses
    `jax.make_array_from_callback`). Called directly it costs a fraction of the public call, which on a host
    reading a few hundred MB of small tensors was a third of the load."""
    try:
        from jax._src.core import ShapedArray, update_aval_with_sharding
        from jax._src.lib import xla_client as xc

        put = xc.batched_device_put
    except (ImportError, AttributeError) as e:
        log.info("jax %s has no batched_device_put (%s): the checkpoint reader uses make_array_from_callback",
                 library_version("jax"), type(e).__name__)
        return None

    def aval(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any:
        return update_aval_with_sharding(ShapedArray(shape, dtype), sharding)

    def call(aval: Any, sharding: Any, xs: list[Any], devices: list[Any]) -> Any:
        return put(aval, sharding, xs, devices, True)  # committed, as make_array_from_callback's arrays
    return BatchedPut(aval, call)


# -- Ray Serve: the request-router extension (alpha) ---------------------------------------------------------

@dataclass(frozen=True)
class ServeRouterAPI:
    """Serve's request-router extension: the classes a custom router derives from and is configured with."""

    RequestRouter: Any
    FIFOMixin: Any
    PendingRequest: Any
    RunningReplica: Any
    RequestRouterConfig: Any


_ROUTER_CONFIG_FIELDS = ("request_router_class", "request_routing_stats_period_s", "request_routing_stats_timeout_s")


@lru_cache(maxsize=1)
def serve_request_router() -> ServeRouterAPI:
    """Serve's request-router API, checked for what raydeploy.serve.routing uses: `RequestRouter` with an
    async `choose_replicas`, `RunningReplica.routing_stats`, and `RequestRouterConfig` with the class and the
    routing-stats period and timeout."""
    where = "ray.serve.request_router and ray.serve.config.RequestRouterConfig"
    try:
        from ray.serve.config import RequestRouterConfig
        from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica
    except ImportError as e:
        raise _missing("ray", "Serve's request-router API", where, e) from None
    if not inspect.iscoroutinefunction(getattr(RequestRouter, "choose_replicas", None)):
        raise _missing("ray", "Serve's request-router API", "RequestRouter.choose_replicas",
                       "no async choose_replicas")
    if not hasattr(RunningReplica, "routing_stats"):
        raise _missing("ray", "Serve's request-router API", "RunningReplica.routing_stats", "no routing_stats")
    fields = getattr(RequestRouterConfig, "model_fields", {})
    absent = [f for f in _ROUTER_CONFIG_FIELDS if f not in fields]
    if absent:
        raise _missing("ray", "Serve's request-router API", "RequestRouterConfig", f"no field {', '.join(absent)}")
    return ServeRouterAPI(RequestRouter, FIFOMixin, PendingRequest, RunningReplica, RequestRouterConfig)


def disable_ray_auto_init() -> None:
    """From now on no Ray call in this process starts a local Ray by itself. `raydeploy serve` needs this: a call
    left running in a thread when a stop signal also stopped Ray's processes would otherwise start a second local
    Ray while the server exits (and keep the process alive)."""
    import os
    import sys

    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"  # read by Ray when it is first imported
    hook = sys.modules.get("ray._private.auto_init_hook")
    if hook is None:
        return
    if not hasattr(hook, "enable_auto_connect"):
        raise _missing("ray", "the auto-connect switch (ray._private.auto_init_hook.enable_auto_connect)",
                       "ray._private.auto_init_hook", "no such attribute")
    setattr(hook, "enable_auto_connect", False)  # noqa: B010 - a module attribute the type checker cannot see



def jax_backends_started() -> bool:
    """Whether jax has created its backends in this process (XLA_FLAGS are read then, not when jax is imported):
    read from `jax._src.xla_bridge._backends` without importing it; False where a jax without it is loaded."""
    import sys

    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))
