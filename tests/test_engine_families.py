"""Every model family through the real paged `Engine`, against transformers float32.

Each family is built tiny with random weights by transformers (`AutoModelForCausalLM.from_config`, fixed seed,
no download), saved with `save_pretrained`, converted by our safetensors converter and loaded by the checkpoint
reader; the family and its config come from the registry (`from_hf_config(reader.hf_config)`), exactly as
bring-up and `raydeploy generate` do. Then, on one device and on a mesh with tp=2 (MoE: ep=2 x tp=2):
- 32 greedy tokens from the engine's step programs (a slot-form plan: the prompt's prefill chunk, then 31
  decode steps on the device) are identical to transformers' greedy tokens;
- each of those tokens' logprobs (the engine's fused sampling) is within 1e-3 of transformers' log-softmax;
- the last-position logits of the engine's own (stacked, placed) parameters are within 1e-3 of transformers.
Gemma 3's local layers have a window of 4 tokens, far shorter than the 42 decoded, so the window passed per
layer to the attention backend is checked past its end; a Mistral config's window (every layer) likewise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tests.jaxpr_walk import primitives, walk  # noqa: E402
from tests.test_families import MOE, PROMPT, STEPS, TINY, _hf_greedy, _hf_model  # noqa: E402

# A Mistral config whose window (4 tokens) every layer applies: the Llama family's own sliding_window.
CASES: dict[str, dict[str, Any]] = {
    **TINY,
    "mistral": dict(model_type="mistral", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    sliding_window=4, tie_word_embeddings=False, initializer_range=0.2),
}
MAX_SEQ_LEN = 64
LOGIT_ATOL = 1e-3


def _convert(kind: str, tmp: Any, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """transformers' tiny `kind` model (or one built from `config`) converted into our checkpoint, with its 32
    greedy tokens, their log-softmax values and the prompt's last-position logits."""
    from raydeploy.checkpoint.convert import convert

    if config is None and kind in TINY:
        model, src = _hf_model(kind, tmp)
    else:
        torch.manual_seed(0)
        cfg = transformers.AutoConfig.for_model(**(config or CASES[kind]))
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        src = tmp / f"hf-{kind}"
        model.save_pretrained(src)
    dst = tmp / "ckpt"
    convert(src, dst, progress=False)
    greedy = _hf_greedy(model, PROMPT, STEPS)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + greedy[:-1]])).logits[0].float()
    ref_lp = torch.log_softmax(logits, dim=-1).numpy()
    n = len(PROMPT)
    return {"kind": kind, "ckpt": dst, "greedy": greedy,
            "logprobs": [float(ref_lp[n - 1 + i, t]) for i, t in enumerate(greedy)],
            "last_logits": logits[n - 1].numpy()}


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory) -> dict[str, Any]:
    return _convert(request.param, tmp_path_factory.mktemp(f"engine-{request.param}"))


def _engine(ckpt: Any, mesh_shape: dict[str, int], window_pages: str = "ring", page_size: int = 8,
            attention: str = "auto", backends: Any = None, param_dtype: str = "float32", **engine_kw: Any) -> Any:
    """An engine over the converted checkpoint; `backends`: attention functions to use instead of those that
    `attention` names (`Attention` or one function); `engine_kw`: other `EngineConfig` fields."""
    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.engine.engine import Engine
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    n = int(np.prod(list(mesh_shape.values())))
    mesh = build_mesh(mesh_shape, jax.devices()[:n])
    rules = merge_rules(None)
    reader = CheckpointReader(ckpt)
    family, cfg = from_hf_config(reader.hf_config)
    params, _ = reader.load(reader.param_specs(), mesh, {**family.rules, **rules}, param_dtype, 2, progress=False)
    engine_cfg = EngineConfig(max_slots=2, page_size=page_size, prefill_chunk=16, decode_steps=4,
                              compilation_cache_dir=None, warmup=False, window_pages=window_pages, attention=attention,
                              **engine_kw)
    return Engine(family, cfg, params, mesh, rules, ModelConfig(max_seq_len=MAX_SEQ_LEN, param_dtype=param_dtype),
                  engine_cfg, backends)


def _engine_greedy(engine: Any) -> tuple[list[int], list[float]]:
    """The prompt prefilled into slot 0, then STEPS - 1 decode steps in one plan."""
    from raydeploy.engine.step import SamplingParams
    from raydeploy.testing.plans import prefill_and_decode

    toks, lps = prefill_and_decode(engine, [(0, PROMPT, SamplingParams())], STEPS - 1)
    return toks[:, 0].tolist(), lps[:, 0].tolist()


def _engine_last_logits(engine: Any) -> np.ndarray:
    """Last-position logits of the family's forward over the engine's own parameters (stacked, in its kernel
    layout, placed on its mesh)."""
    ps = engine.programs_set

    @jax.jit
    def fwd(leaves: list[jax.Array], tokens: jax.Array) -> jax.Array:
        return ps.model(leaves)(tokens)[0, -1]

    with jax.set_mesh(engine.mesh):
        return np.asarray(fwd(engine._param_leaves, jnp.asarray([PROMPT], jnp.int32)))


def _check(engine: Any, converted: dict[str, Any]) -> None:
    tokens, logprobs = _engine_greedy(engine)
    assert tokens == converted["greedy"]
    np.testing.assert_allclose(logprobs, converted["logprobs"], atol=LOGIT_ATOL, rtol=0)
    ref = converted["last_logits"]
    assert np.abs(ref).max() > 0.1  # not two near-zero vectors
    np.testing.assert_allclose(_engine_last_logits(engine), ref, atol=LOGIT_ATOL, rtol=0)


def test_engine_one_device_matches_transformers(converted):
    engine = _engine(converted["ckpt"], {"tp": 1})
    assert engine.family.name == {"gemma3_text": "gemma3", "mistral": "llama"}.get(converted["kind"],
                                                                                  converted["kind"])
    _check(engine, converted)


def test_engine_tp_mesh_matches_transformers(converted):
    """tp=2 (heads, MLP and vocab split); MoE families ep=2 x tp=2 (experts over ep, their units over tp)."""
    moe = converted["kind"] in MOE
    engine = _engine(converted["ckpt"], {"ep": 2, "tp": 2} if moe else {"tp": 2})
    leaves = dict(zip(_state_names(engine), engine._param_leaves, strict=True))
    q = leaves["layers.attn.q_proj.kernel"]  # [L, D, heads, head_dim]: heads really split over tp
    assert q.sharding.shard_shape(q.shape)[2] == engine.cfg.num_heads // 2
    if moe:
        gate = leaves["layers.mlp.experts.gate_proj.kernel"]  # [L, E, D, F]: E over ep, F over tp
        cfg = engine.cfg
        assert gate.sharding.shard_shape(gate.shape) == (cfg.num_layers, cfg.num_experts // 2, cfg.hidden_size,
                                                         cfg.moe_intermediate_size // 2)
        # the step program computes the experts per ep shard (shard_map over ep), no expert weight gathered
        text = engine.programs_set.lower(engine.programs_set.shapes()[0]).as_text()
        assert '"ep"' in text and "manual_computation" in text
    _check(engine, converted)


def _state_names(engine: Any) -> list[str]:
    import flax.nnx as nnx

    ps = engine.programs_set
    _, abstract = ps.family.abstract_model(ps.cfg, "float32", "float32", ps.kernel_layout)
    return [".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(abstract)]


@pytest.mark.parametrize("kind", MOE)
def test_engine_refuses_ep_that_does_not_divide_the_experts(kind, tmp_path):
    """The engine checks the mesh against the family before it reads or places anything."""
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.engine.engine import Engine
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    family, cfg = from_hf_config(TINY[kind])
    mesh = build_mesh({"ep": 3}, jax.devices()[:3])
    with pytest.raises(ValueError, match=r"mesh axis ep=3 does not divide the model's 4 experts \(ep must be a "
                                         r"divisor of 4\)"):
        Engine(family, cfg, {}, mesh, merge_rules(None), ModelConfig(max_seq_len=MAX_SEQ_LEN),
               EngineConfig(max_slots=3, compilation_cache_dir=None))


# -- a gang: real Ray, real jax.distributed, one MoE family with its experts across the hosts ----------------


@pytest.mark.ray
@pytest.mark.slow
def test_gang_serves_moe_with_experts_across_hosts(tmp_path_factory):
    """Qwen3-MoE on a 2-host gang (2 virtual CPU devices each), mesh ep=2 (across the hosts) x tp=2 (inside
    each): each host builds its engine through `load_checkpoint_engine` (family from the checkpoint's config,
    the mesh checked against the experts, its shards of the experts placed), and the gang's greedy tokens equal
    transformers'."""
    import os
    import shutil

    import ray

    from raydeploy.config import load_config
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.gang.gang import start_gang

    case = _convert("qwen3_moe", tmp_path_factory.mktemp("gang-qwen3_moe"))
    cache = tmp_path_factory.mktemp("gang-cache")
    cfg = load_config(None, [
        "cluster.devices_per_host=2", "mesh.axes={ep: 2, tp: 2}", f"model.checkpoint={case['ckpt']}",
        f"model.max_seq_len={MAX_SEQ_LEN}", "engine.max_new_tokens=32",
        "engine.max_slots=2", "engine.page_size=8", "engine.prefill_chunk=16", "cluster.heartbeat_timeout_s=10",
        "cluster.init_timeout_s=60", "cluster.rpc_timeout_s=1200", f"engine.compilation_cache_dir={cache}"])
    temp = f"/tmp/rdf-{os.getpid()}"
    ray.init(num_cpus=2, _temp_dir=temp, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        gang = start_gang(cfg, checkpoint_path=str(case["ckpt"]))
        try:
            gang.wait_ready(900)
            req = GenerationRequest("moe", tuple(PROMPT), max_tokens=STEPS, ignore_eos=True)
            events = gang.generate(req, timeout_s=600)
            meshes = [h["init"]["mesh"] for h in gang.status()["host_status"]]
        finally:
            gang.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    assert events[-1].finish_reason == "length", events[-1]
    assert [e.token_id for e in events] == case["greedy"]
    assert meshes == [{"ep": 2, "tp": 2}] * 2


# -- sliding-window layers keep rings of pages ------------------------------------------------------------------


def _scheduled(engine: Any, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprobs) of the prompts through the real scheduler (config defaults: prefix caching on unless
    the engine's rings forbid it) and an in-process step loop, all submitted at once."""
    from raydeploy.config import load_config
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.scheduler import Scheduler

    sched = Scheduler.for_engine(engine, load_config(None, ["engine.max_slots=2"]))
    outs = LocalRunner(engine, sched).generate(
        [GenerationRequest(f"r{i}", tuple(p), new_tokens, ignore_eos=True) for i, p in enumerate(prompts)])
    return [(o.token_ids, o.logprobs) for o in outs]


def _check_scheduled(got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], list[float]]]) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        np.testing.assert_allclose(logprobs, ref_logprobs, atol=LOGIT_ATOL, rtol=0)


# Deep enough (4 layers of window 4: the last prompt token sees 12 positions back) that a key overwritten in a
# ring while a chunk's query still needs it changes the first generated token's logprob.
RING_CASES = {"gemma3_text": TINY["gemma3_text"], "mistral": {**CASES["mistral"], "num_hidden_layers": 4}}


@pytest.mark.parametrize("kind", sorted(RING_CASES))
def test_sliding_window_layers_keep_rings_through_the_scheduler(kind, tmp_path):
    """With `engine.window_pages: ring` (the default) a sliding-window layer (window 4) keeps a ring of
    ceil((4 + 16 - 1) / 8) + 1 = 4 pages per slot in a window pool, and the main pool holds only the other
    layers (Gemma 3: 2 of 4; Mistral: none). A 41-token prompt alone (chunks of 16, 16 and 9: a chunk's
    writes land in the ring while its first queries still read the keys before it), then with a 30-token one
    beside it, each decoded 14 tokens (positions up to 54, so the 32-token rings wrap), give transformers'
    greedy tokens and logprobs (1e-3), as with every page kept (`all`); prefix caching is off with rings and on
    without. (A ring of 2 pages, without room for the chunk, fails it.)"""
    from raydeploy.checkpoint.convert import convert
    from tests.test_families import _hf_greedy

    torch.manual_seed(0)
    hf_cfg = transformers.AutoConfig.for_model(**RING_CASES[kind])
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    src, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    model.save_pretrained(src)
    convert(src, ckpt, progress=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (41, 30)]
    want = []
    for p in prompts:
        tokens = _hf_greedy(model, p, 14)
        with torch.no_grad():
            logits = model(torch.tensor([p + tokens[:-1]])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1).numpy()
        want.append((tokens, [float(lp[len(p) - 1 + i, t]) for i, t in enumerate(tokens)]))

    ring = _engine(ckpt, {"dp": 1})
    layout = ring.programs_set.layout
    windows = ring.family.layer_windows(ring.cfg)
    assert layout.ring_pages == 4 and ring.window_rings
    assert layout.window_layers == tuple(i for i, w in enumerate(windows) if w)
    main, window = ring.pool
    assert main.shape[0] == len(windows) - len(layout.window_layers)
    assert window.shape[:2] == (len(layout.window_layers), 2 * 4)  # 2 slots x a 4-page ring
    _check_scheduled(_scheduled(ring, prompts[:1], 14), want[:1])  # alone: whole 16-token chunks
    _check_scheduled(_scheduled(ring, prompts, 14), want)

    full = _engine(ckpt, {"dp": 1}, "all")
    assert full.programs_set.layout.ring_pages == 0 and not full.window_rings
    assert full.pool[0].shape[0] == len(windows) and full.pool[1].shape[0] == 0
    assert full.pool[0].size > main.size + window.size
    _check_scheduled(_scheduled(full, prompts, 14), want)

    from raydeploy.config import load_config
    from raydeploy.engine.scheduler import Scheduler

    cfg = load_config(None, ["engine.max_slots=2"])
    assert cfg.engine.prefix_caching
    assert not Scheduler.for_engine(ring, cfg).paging.prefix_caching
    assert Scheduler.for_engine(full, cfg).paging.prefix_caching


# -- the GPU's two attention paths, chosen once per step ------------------------------------------------------


def _step_jaxpr(engine: Any, single_token: bool) -> Any:
    """The smallest step program whose layers run in a loop, as on a GPU (CPU unrolls its one-token programs)."""
    ps = engine.programs_set
    shape = next(s for s in ps.shapes() if s.kind == "step" and not ps.unrolled(s) and s.single_token == single_token)
    fn, args = ps.abstract_args(shape)
    with jax.set_mesh(engine.mesh):
        return jax.make_jaxpr(fn)(*args).jaxpr


def _conds_in_loops(jaxpr: Any) -> list[Any]:
    return [e for e, in_loop in walk(jaxpr) if e.primitive.name == "cond" and in_loop]


def _pool_copies(engine: Any, programs: int | None = None) -> list[str]:
    """Copies as large as a (non-empty) KV pool, of any shape, in the engine's compiled step programs (the
    first `programs` of them, or all)."""
    import re

    ps = engine.programs_set
    smallest = min(int(np.prod(shape)) for shape in ps.pool_shapes if 0 not in shape)
    found = []
    for shape in [s for s in ps.shapes() if s.kind == "step"][:programs]:
        with jax.set_mesh(engine.mesh):
            hlo = ps.lower(shape).compile().as_text()
        for ln in hlo.splitlines():
            m = re.match(r"\s*(?:ROOT )?%\S+ = f32\[([\d,]*)\]\S* (copy|fusion)\(", ln)
            if m and (m.group(2) == "copy" or "copy" in ln.split("calls=")[-1][:40]):
                if int(np.prod([int(x) for x in m.group(1).split(",") if x])) >= smallest:
                    found.append(f"{shape.name}: {ln.strip()[:120]}")
    return found


# one kv head, long head dim: the XLA attention path's reshaped pool took another layout and was copied
KV1 = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=1, head_dim=128, max_position_embeddings=256,
           tie_word_embeddings=False, initializer_range=0.2)


@pytest.mark.parametrize("kind,window_pages", [("gemma3_text", "ring"), ("gemma3_text", "all"), ("qwen3", "ring"),
                                               ("mixtral", "ring")])
def test_no_step_program_copies_the_kv_pool(kind, window_pages, tmp_path):
    """The pool is donated and carried through the layer loop, and every write updates it in place: no step
    program copies it, in any shape (a copy is a pass over the whole cache, per step or per layer). Two ways it
    was copied: Gemma 3 mixes local and global layers in one scan, and a `lax.cond` between two whole
    attention calls carried the pools through its branches (XLA copied the main pool twice a step; the engine
    now writes outside any cond and chooses only the read, `attend(..., local=)`); and the XLA attention path's
    reshaped pool (next test)."""
    case = _convert(kind, tmp_path)
    assert not _pool_copies(_engine(case["ckpt"], {"tp": 1}, window_pages=window_pages))


def test_no_step_program_copies_a_long_context_pool_with_one_kv_head(tmp_path):
    """The XLA attention path's copy showed with a long-context pool (8 slots of 8192 tokens) and one kv head:
    its reshape of the pool to split K from V took another layout, copied into the query-block loop for every
    block of every layer (an 805 MB pool: 8 prompts took 7.4 s to prefill instead of 0.6). The path now gathers
    a block's pages and splits those; the step programs that run it hold no pool-sized copy."""
    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.engine.engine import Engine
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    case = _convert("llama_kv1", tmp_path, KV1)
    mesh = build_mesh({"tp": 1}, jax.devices()[:1])
    rules = merge_rules(None)
    reader = CheckpointReader(case["ckpt"])
    family, cfg = from_hf_config(reader.hf_config)
    params, _ = reader.load(reader.param_specs(), mesh, {**family.rules, **rules}, "float32", 2, progress=False)
    engine_cfg = EngineConfig(max_slots=8, page_size=16, prefill_chunk=64, compilation_cache_dir=None, warmup=False)
    engine = Engine(family, cfg, params, mesh, rules, ModelConfig(max_seq_len=8192), engine_cfg)
    assert not _pool_copies(engine, programs=3)


def test_single_token_programs_take_the_kernel_without_a_choice_on_data(tmp_path_factory):
    """The GPU's attention (`get_attention("pallas", "gpu")`: the XLA path for any step, jax's Pallas GPU decode
    kernel for steps whose live sequences all carry one token), here with the kernel in Pallas interpret mode on
    CPU. The decode-sized step programs get a single-token variant that calls the kernel, the engine picks it
    on the host, and no program chooses on its data: on a GPU a cond reads its predicate back to the host, and
    the backend's own per-call cond inside the layer scan did so in every layer (an H100 profile: 16 host-device
    synchronisations a pass). The engine still gives transformers' greedy tokens and logprobs (the prompt
    through the XLA path, the 31 decode passes through the kernel), and no compiled program copies the KV pool
    (one cond around the whole layer scan, the first way tried, copied it two or three times a step)."""
    from functools import partial

    from raydeploy.engine.attention import Attention, get_attention, pallas_gpu, xla

    gpu = get_attention("pallas", "gpu")
    assert gpu.ragged is xla.ragged_paged_attention and gpu.single_token is pallas_gpu.single_token_attention
    case = _convert("qwen3", tmp_path_factory.mktemp("engine-single-token"))
    both = Attention(xla.ragged_paged_attention, partial(pallas_gpu.single_token_attention, interpret=True))
    engine = _engine(case["ckpt"], {"tp": 1}, backends=both)
    ps = engine.programs_set
    singles = [s for s in ps.shapes() if s.single_token]
    assert singles and all(s.tokens <= ps.slots_per_group and s.name.endswith("_single") for s in singles)
    _check(engine, case)
    ran = {name for name in engine.programs}
    assert any(name.endswith("_single") for name in ran) and any(not name.endswith("_single") for name in ran)

    for single_token in (False, True):
        jaxpr = _step_jaxpr(engine, single_token)
        assert ("pallas_call" in primitives(jaxpr)) == single_token
        assert "scan" in primitives(jaxpr) and not _conds_in_loops(jaxpr)
    assert not _pool_copies(engine)

    # the backend's own per-call choice (one function for any step) puts a cond in every layer: what the check
    # above would find
    per_call = _engine(case["ckpt"], {"tp": 1}, backends=partial(pallas_gpu.ragged_paged_attention, interpret=True))
    assert not [s for s in per_call.programs_set.shapes() if s.single_token]
    assert _conds_in_loops(_step_jaxpr(per_call, False))


# local and global layers in a pattern of two, with one layer past the last whole block
GEMMA5 = {**TINY["gemma3_text"], "num_hidden_layers": 5,
          "layer_types": ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]}


@pytest.mark.parametrize("window_pages,mesh_shape", [("ring", {"tp": 1}), ("all", {"tp": 2})])
def test_static_layer_kinds_leave_no_choice_on_data(window_pages, mesh_shape, tmp_path):
    """On a GPU a `lax.cond` copies its predicate to the host and waits, and Gemma 3 chose each layer's read
    (local or global) with one. With `Attention.static_layer_kinds` (every GPU backend asks for it) the family
    scans its layers in blocks of its local/global pattern instead, so each layer's kind is a Python value. A
    5-layer model (blocks of local, global; one local layer after the last block; on one device, and with its
    weights and heads split over tp=2) through the GPU's attention (the decode kernel in Pallas interpret mode)
    still gives transformers' greedy tokens and logprobs, no step
    program holds a cond for a layer (in the layer loop or after it: only sampling's), and none copies the KV
    pool; the same engine without the flag has the cond in its layer loop (what the check would find)."""
    from functools import partial

    from raydeploy.engine.attention import Attention, get_attention, pallas_gpu, xla

    assert get_attention("pallas", "gpu").static_layer_kinds and get_attention("xla", "gpu").static_layer_kinds
    assert not get_attention("auto", "cpu").static_layer_kinds and not get_attention("auto", "tpu").static_layer_kinds
    case = _convert("gemma3_text", tmp_path, GEMMA5)
    gpu = Attention(xla.ragged_paged_attention, partial(pallas_gpu.single_token_attention, interpret=True),
                    static_layer_kinds=True)
    engine = _engine(case["ckpt"], mesh_shape, window_pages=window_pages, backends=gpu)
    _check(engine, case)
    traced = _engine(case["ckpt"], mesh_shape, window_pages=window_pages,
                     backends=Attention(xla.ragged_paged_attention))
    traced_jaxpr = _step_jaxpr(traced, False)
    assert _conds_in_loops(traced_jaxpr)
    # outside the layers, sampling's own conds (whether any row samples, filters): the same in both
    sampling_conds = [e for e, in_loop in walk(traced_jaxpr) if e.primitive.name == "cond" and not in_loop]
    for single_token in (False, True):
        jaxpr = _step_jaxpr(engine, single_token)
        conds = [e for e, _ in walk(jaxpr) if e.primitive.name == "cond"]
        assert "scan" in primitives(jaxpr) and not _conds_in_loops(jaxpr)
        assert len(conds) == len(sampling_conds)  # none for the layer after the last block either
        assert ("pallas_call" in primitives(jaxpr)) == single_token  # the global layers' decode kernel
    assert not _pool_copies(engine, programs=2)


def test_layer_blocks_follow_the_kinds_pattern():
    """`scan_layers` with per-layer kinds: blocks of the kinds' period scanned, the rest unrolled; each layer gets
    its own parameters, index and kind, in order, as a plain loop over the layers would."""
    from raydeploy.model.llama import RMSNorm
    from raydeploy.model.scan import kinds_period, scan_layers

    assert kinds_period((True,) * 5 + (False,) + (True,) * 5 + (False,) + (True,) * 2) == 6
    assert kinds_period((1, 2, 1, 2, 1)) == 2 and kinds_period((1, 1, 2)) == 3 and kinds_period((3, 3)) == 1
    assert kinds_period((1, 2, 3)) == 3

    n = 14
    norms = RMSNorm(4, 1e-6, jnp.float32, lead=(n,))
    norms.scale.value = jnp.arange(n * 4, dtype=jnp.float32).reshape(n, 4)
    kinds = tuple(((i + 1) % 6 != 0) for i in range(n))

    def body(layer: Any, carry: jax.Array, i: jax.Array, local: bool) -> tuple[jax.Array, jax.Array]:
        assert isinstance(local, bool)  # static in the program
        return carry * 0.5 + jnp.sum(layer.scale[...]) * (3 if local else 5) + i, layer.scale[...][0] + i

    got_carry, got_ys = jax.jit(lambda: scan_layers(norms, body, jnp.float32(0), jnp.arange(n) * 100, kinds))()
    want, ys = jnp.float32(0), []
    for i in range(n):
        scale = jnp.arange(i * 4, i * 4 + 4, dtype=jnp.float32)
        want = want * 0.5 + jnp.sum(scale) * (3 if kinds[i] else 5) + i * 100
        ys.append(scale[0] + i * 100)
    np.testing.assert_allclose(got_carry, want, rtol=1e-6)
    np.testing.assert_allclose(got_ys, np.asarray(ys))
    with pytest.raises(ValueError, match="3 layer kinds for a stack of 14 layers"):
        scan_layers(norms, body, jnp.float32(0), None, (True, False, True))


def test_moe_layer_scan_takes_one_kind():
    """An MoE stack (its own scan, experts read by layer index) passes a uniform kind to the body and names
    mixed kinds, which it cannot scan."""
    import flax.nnx as nnx

    from raydeploy.model.moe import MoEDecoderLayer
    from raydeploy.model.registry import from_hf_config

    _, cfg = from_hf_config(TINY["qwen3_moe"])
    stack = MoEDecoderLayer(cfg, jnp.float32, nnx.Rngs(0), lead=(cfg.num_layers,))
    seen = []

    def body(layer: Any, c: jax.Array, x: Any, kind: str) -> tuple[jax.Array, None]:
        seen.append(kind)
        return c + jnp.sum(layer.attn_norm.scale[...]), None

    total, _ = stack.scan(body, jnp.float32(0), kinds=("global",) * cfg.num_layers)
    assert seen == ["global"] and float(total) == cfg.num_layers * cfg.hidden_size  # one traced layer, scanned
    with pytest.raises(ValueError, match=r"an MoE layer stack scans layers of one kind, got kinds \[False, True\]"):
        stack.scan(body, jnp.float32(0), kinds=(True, False))


@pytest.mark.parametrize("kind,mesh_shape", [("qwen3", {"tp": 1}), ("qwen3", {"tp": 2}), ("gemma3_text", {"dp": 2})])
def test_stacked_matmul_reads_layers_in_place(kind, mesh_shape, tmp_path):
    """`engine.gpu_matmul: pallas` (what auto is on a GPU), here in Pallas interpret mode: a step's few rows by a
    layer's bfloat16 weights go to the kernel that takes the whole stack and the layer index, so no program
    slices a projection weight out of the stack; the tokens and logprobs are those of XLA's gemm over the same
    weights (the same bfloat16 products, float32 sums in another order). Qwen3 on one device and over tp=2
    (each device multiplies by its shard: q, k, v, gate and up split by columns, o and down by rows and summed
    over tp); Gemma 3 (layers in blocks of its pattern, static kinds as on a GPU) over dp=2, each group's rows
    through the kernel."""
    from raydeploy.engine.attention import Attention, xla

    case = _convert(kind, tmp_path)
    kw = dict(param_dtype="bfloat16", kernel_layout="in_out", cpu_matmul="xla", unroll_layers="off",
              backends=Attention(xla.ragged_paged_attention, static_layer_kinds=kind == "gemma3_text"))
    ours = _engine(case["ckpt"], mesh_shape, gpu_matmul="pallas", **kw)
    peer = _engine(case["ckpt"], mesh_shape, gpu_matmul="xla", **kw)
    assert ours.programs_set.stacked_matmul is None and ours.matmul == "pallas"
    assert peer.programs_set.stacked_matmul == "engine.gpu_matmul is xla on cpu"
    assert peer.matmul == "xla (engine.cpu_matmul is xla)"  # on CPU the status names the CPU kernel's reason
    tokens, logprobs = _engine_greedy(ours)
    want_tokens, want_logprobs = _engine_greedy(peer)
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_logprobs, atol=2e-3, rtol=0)
    # bfloat16 weights still follow transformers' greedy path on this tiny model for the first tokens
    assert tokens[:8] == case["greedy"][:8]

    def kernel_calls(engine: Any) -> int:
        return sum(e.primitive.name == "pallas_call" and str(e.params.get("name", "")).startswith("stacked_matmul")
                   for e, _ in walk(_step_jaxpr(engine, False)))

    assert kernel_calls(peer) == 0
    # every projection of a layer: q, k, v, o, gate, up, down (Gemma 3: per layer of its block)
    per_layer = 7
    assert kernel_calls(ours) % per_layer == 0 and kernel_calls(ours) >= per_layer


def test_stacked_matmul_choice_says_why_not():
    """Where the kernel does not apply, the engine says why (and multiplies in XLA)."""
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.engine.programs import ProgramSet
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    family, cfg = from_hf_config(TINY["qwen3"])

    def why(mesh_shape: dict[str, int], param_dtype: str = "bfloat16", **kw: Any) -> str | None:
        n = int(np.prod(list(mesh_shape.values())))
        engine_cfg = EngineConfig(max_slots=2, page_size=8, prefill_chunk=16, compilation_cache_dir=None,
                                  warmup=False, **{"gpu_matmul": "pallas", "kernel_layout": "in_out", **kw})
        ps = ProgramSet(family, cfg, build_mesh(mesh_shape, jax.devices()[:n]), merge_rules(None),
                        ModelConfig(max_seq_len=MAX_SEQ_LEN, param_dtype=param_dtype), engine_cfg)
        return ps.stacked_matmul

    assert why({"dp": 2}) is None
    assert why({"tp": 1}, gpu_matmul="auto") == "engine.gpu_matmul is auto on cpu"
    assert why({"tp": 1}, "float32") == "param_dtype float32 (the kernel multiplies bfloat16 weights)"
    assert why({"tp": 1}, kernel_layout="out_in") == "kernel layout out_in (the kernel reads in_out weights)"
    assert why({"tp": 2}) is None  # each device multiplies by its shard
    assert why({"tp": 1}, unroll_layers="off") is None
