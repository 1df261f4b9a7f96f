"""Validation of the combinations that need no model (those that do live in `raydeploy.plan`)."""

from __future__ import annotations

from raydeploy.config.schema import (
    Config,
    ConfigError,
    ReplicasConfig,
    resolve_mesh_axes,
)
from raydeploy.config.slots import DEFAULT_SLOT_RULE, SLOT_AXIS, slots_problem


def validate(cfg: Config) -> None:
    """Checks that need nothing but the config itself."""
    src = cfg.source
    c, e, m, s = cfg.cluster, cfg.engine, cfg.model, cfg.serving
    positive = {
        "cluster.num_hosts": c.num_hosts, "cluster.devices_per_host": c.devices_per_host,
        "cluster.placement_timeout_s": c.placement_timeout_s, "cluster.init_timeout_s": c.init_timeout_s,
        "cluster.heartbeat_timeout_s": c.heartbeat_timeout_s, "cluster.step_timeout_s": c.step_timeout_s,
        "cluster.rpc_timeout_s": c.rpc_timeout_s, "engine.max_slots": e.max_slots,
        "engine.decode_steps": e.decode_steps,
        "model.max_seq_len": m.max_seq_len, "model.load_threads": m.load_threads, "serving.max_queue": s.max_queue,
        "serving.request_timeout_s": s.request_timeout_s, "serving.max_body_bytes": s.max_body_bytes,
        "serving.ingress_replicas": s.ingress_replicas, "serving.body_read_timeout_s": s.body_read_timeout_s,
        "serving.metrics_refresh_s": s.metrics_refresh_s,
    }
    if s.max_ingress_requests is not None:
        positive["serving.max_ingress_requests"] = s.max_ingress_requests
    if s.queue_wait_s is not None:
        positive["serving.queue_wait_s"] = s.queue_wait_s
    if s.max_waiting < 0:
        raise ConfigError(f"must be >= 0 (0: no request waits for capacity), found {s.max_waiting}", file=src,
                          key="serving.max_waiting")
    if e.max_new_tokens is not None:
        positive["engine.max_new_tokens"] = e.max_new_tokens
    if s.max_concurrent_per_key is not None and s.max_concurrent_per_key < 0:
        raise ConfigError(f"must be >= 0 (0 or null: no limit), found {s.max_concurrent_per_key}", file=src,
                          key="serving.max_concurrent_per_key")
    for key, val in positive.items():
        if val <= 0:
            raise ConfigError(f"must be > 0, found {val}", file=src, key=key)
    for key, val in {"cluster.max_restarts": c.max_restarts, "cluster.restart_backoff_s": c.restart_backoff_s,
                     "cluster.host_num_cpus": c.host_num_cpus}.items():
        if val < 0:
            raise ConfigError(f"must be >= 0, found {val}", file=src, key=key)
    if e.max_decode_slowdown != 0 and e.max_decode_slowdown <= 1:
        raise ConfigError(f"must be 0 (never hold a prompt's chunks back) or > 1, found {e.max_decode_slowdown}",
                          file=src, key="engine.max_decode_slowdown")
    if not 0 <= e.burst_wait <= 1:
        raise ConfigError(f"must be a fraction of a decode pass in [0, 1], found {e.burst_wait}", file=src,
                          key="engine.burst_wait")
    if not 0 <= s.port <= 65535:
        raise ConfigError(f"must be a TCP port 0-65535, found {s.port}", file=src, key="serving.port")
    if c.coordinator_port is not None and not 0 <= c.coordinator_port <= 65535:
        raise ConfigError(f"must be a TCP port 0-65535, found {c.coordinator_port}", file=src, key="cluster.coordinator_port")
    if c.simulated and c.platform != "cpu":
        raise ConfigError(f"simulated hosts run on virtual CPU devices; platform is {c.platform!r}",
                          file=src, key="cluster.simulated")
    mesh = resolve_mesh_axes(cfg.mesh.axes, cfg.total_devices, src)
    if e.max_new_tokens is not None and e.max_new_tokens >= m.max_seq_len:
        raise ConfigError(f"max_new_tokens {e.max_new_tokens} leaves no room for a prompt in max_seq_len {m.max_seq_len}",
                          file=src, key="engine.max_new_tokens")
    for key, val in {"engine.page_size": e.page_size, "engine.prefill_chunk": e.prefill_chunk}.items():
        if val <= 0:
            raise ConfigError(f"must be > 0, found {val}", file=src, key=key)
    if e.num_pages < 0:
        raise ConfigError(f"must be >= 0 (0 = auto), found {e.num_pages}", file=src, key="engine.num_pages")
    one_seq = -(-m.max_seq_len // e.page_size)
    if 0 < e.num_pages < one_seq:  # else a request near the context would never fit: a 500 at every submit
        raise ConfigError(f"is {e.num_pages} pages, fewer than one sequence of model.max_seq_len {m.max_seq_len} "
                          f"needs ({one_seq} pages of engine.page_size {e.page_size}); set it >= {one_seq} or 0 "
                          f"(auto)", file=src, key="engine.num_pages")
    slots = slots_problem(e.max_slots, {SLOT_AXIS: cfg.mesh.rules.get(SLOT_AXIS, DEFAULT_SLOT_RULE)}, mesh)
    if slots is not None:
        raise ConfigError(slots, file=src, key="engine.max_slots")
    sp = e.sampling
    if sp.temperature < 0:
        raise ConfigError(f"must be >= 0, found {sp.temperature}", file=src, key="engine.sampling.temperature")
    if not 0 < sp.top_p <= 1:
        raise ConfigError(f"must be in (0, 1], found {sp.top_p}", file=src, key="engine.sampling.top_p")
    if sp.top_k < 0:
        raise ConfigError(f"must be >= 0, found {sp.top_k}", file=src, key="engine.sampling.top_k")
    if sp.repetition_penalty <= 0:
        raise ConfigError(f"must be > 0, found {sp.repetition_penalty}", file=src, key="engine.sampling.repetition_penalty")
    if c.simulated and c.placement_strategy == "STRICT_SPREAD" and c.ray_address is None and c.num_hosts > 1:
        pass  # the gang turns STRICT_SPREAD into PACK for simulated hosts on one node
    for key, values in {"serving.cors_allow_headers": s.cors_allow_headers,
                        "serving.cors_allow_methods": s.cors_allow_methods}.items():
        if values is not None and (not values or any(not v.strip() for v in values)):
            raise ConfigError("must list at least one non-empty name (or be null for the defaults)", file=src,
                              key=key)
    if m.chat_template is not None and not m.chat_template.strip():
        raise ConfigError("is empty; give a template file's path or the template itself, or null for the "
                          "tokenizer's own", file=src, key="model.chat_template")
    if s.api_keys_env and s.api_keys_file:
        raise ConfigError("set api_keys_env or api_keys_file, not both", file=src, key="serving.api_keys_file")
    _validate_replicas(cfg.replicas, src)
    _validate_speculative_and_lora(cfg, src)


def _validate_speculative_and_lora(cfg: Config, src: str) -> None:
    """engine.speculative and lora: the numbers, the methods this version runs, and the pair it cannot run
    together yet (checked again where the engine is built)."""
    sp, lo = cfg.engine.speculative, cfg.lora
    key = "engine.speculative"
    if sp.method == "draft" and not sp.draft_checkpoint:
        raise ConfigError("method draft needs a draft model's checkpoint (a checkpoint directory or a demo: name of "
                          "the target's tokenizer)", file=src, key=f"{key}.draft_checkpoint")
    if sp.num_tokens < 1:
        raise ConfigError(f"must be >= 1, found {sp.num_tokens}", file=src, key=f"{key}.num_tokens")
    if not 1 <= sp.ngram_min <= sp.ngram_max:
        raise ConfigError(f"ngram_min {sp.ngram_min} and ngram_max {sp.ngram_max} need 1 <= ngram_min <= ngram_max",
                          file=src, key=f"{key}.ngram_min")
    if sp.max_rows < 0:
        raise ConfigError(f"must be >= 0, found {sp.max_rows}", file=src, key=f"{key}.max_rows")
    if not 0.0 <= sp.min_acceptance <= 1.0:
        raise ConfigError(f"must be in [0, 1], found {sp.min_acceptance}", file=src, key=f"{key}.min_acceptance")
    if lo.max_adapters < 0:
        raise ConfigError(f"must be >= 0 (0: no LoRA), found {lo.max_adapters}", file=src, key="lora.max_adapters")
    if lo.max_rank < 1:
        raise ConfigError(f"must be >= 1, found {lo.max_rank}", file=src, key="lora.max_rank")
    if lo.adapters and len(lo.adapters) > lo.max_adapters:
        raise ConfigError(f"{len(lo.adapters)} adapters to preload but lora.max_adapters is {lo.max_adapters} "
                          f"(slots on the devices; 0 turns LoRA off)", file=src, key="lora.adapters")
    if lo.max_adapters > 0 and sp.method == "draft":
        raise ConfigError(f"the draft method does not run LoRA adapters yet: set engine.speculative.method ngram "
                          f"or none, or lora.max_adapters 0 (found draft and {lo.max_adapters})", file=src,
                          key="engine.speculative.method")


def _validate_replicas(r: ReplicasConfig, src: str) -> None:
    if r.min < 1:
        raise ConfigError(f"must be >= 1 (a deployment serves with at least one gang), found {r.min}", file=src,
                          key="replicas.min")
    if r.max < r.min:
        raise ConfigError(f"must be >= replicas.min={r.min}, found {r.max}", file=src, key="replicas.max")
    if r.initial is not None and not r.min <= r.initial <= r.max:
        raise ConfigError(f"must lie between replicas.min={r.min} and replicas.max={r.max}, found {r.initial}",
                          file=src, key="replicas.initial")
    for key, val in {"target_ongoing_requests": r.target_ongoing_requests, "look_back_period_s": r.look_back_period_s,
                     "upscaling_factor": r.upscaling_factor, "downscaling_factor": r.downscaling_factor,
                     "health_check_period_s": r.health_check_period_s,
                     "routing_stats_period_s": r.routing_stats_period_s}.items():
        if val is not None and val <= 0:
            raise ConfigError(f"must be > 0, found {val}", file=src, key=f"replicas.{key}")
    for key, val in {"upscale_delay_s": r.upscale_delay_s, "downscale_delay_s": r.downscale_delay_s}.items():
        if val < 0:
            raise ConfigError(f"must be >= 0, found {val}", file=src, key=f"replicas.{key}")
