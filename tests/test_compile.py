"""`raydeploy compile`: every program of the real TPU configs compiled deviceless through libtpu.

These run the real CLI in a fresh process (it must set the JAX environment before jax starts), with the real
libtpu from the test extra and no TPU. Each TPU config is compiled once per session and its JSON report is
shared by the checks below. A deviceless compile of a large model takes minutes on a small machine, so no config
is compiled twice: tpu-v5e-16 is compiled with speculation on (its step programs are the same programs as without
it, and the verify programs come with them), and the 70B int8 config compiles the widest page table of each token
bucket unless RAYDEPLOY_FULL_COMPILE=1 (`test_quantized_configs_compile_deviceless_and_every_program_fits`).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow
GIB = 1024**3
FULL_COMPILE = os.environ.get("RAYDEPLOY_FULL_COMPILE") == "1"
"""Compile every program of the 70B int8 config (19; about 7 minutes here) instead of the widest page table of
each token bucket (7 programs)."""

_WIDEST_TABLES = """
import sys
from raydeploy.platform_env import keep_jax_off_missing_tpu
keep_jax_off_missing_tpu()  # as `raydeploy` does, before jax is imported
from raydeploy.cli import main
from raydeploy.engine.programs import ProgramSet
every = ProgramSet.shapes
ProgramSet.shapes = lambda self: [s for s in every(self) if s.kind == "presence" or s.pages == self.page_buckets[-1]]
sys.exit(main(sys.argv[1:]))
"""
"""`raydeploy ARGS` with the programs of the widest page table only (and presence_row): the same programs, a
subset of them (`raydeploy compile --only` selects kinds, not tables)."""


def _run(*args: str, env: dict[str, str] | None = None, timeout_s: int = 1500,
         widest_tables: bool = False) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "TPU_SKIP_MDS_QUERY", "PJRT_NPROC")}
    cmd = ["-c", _WIDEST_TABLES] if widest_tables else ["-m", "raydeploy"]
    return subprocess.run([sys.executable, *cmd, "compile", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s, env={**base, **(env or {})})


TPU_CONFIGS = {  # name -> --set overrides: tpu-v5e-16 with speculation, so its verify programs come in one compile
    "tpu-v5e-16": ["engine.speculative.method=ngram"],
    "tpu-v6e-16": [],
}


@pytest.fixture(scope="session")
def tpu_reports() -> dict[str, dict]:
    """Every program of each TPU config, compiled once. tpu-v5e-16 speculates (ngram): its step programs are the
    programs of the config as it is (an n-gram proposer adds no weights, and the step programs take no speculation
    inputs: the verify programs do), and its verify programs are compiled beside them instead of in a second
    compile of the same config; tpu-v6e-16 does not, so it has no verify programs."""
    pytest.importorskip("libtpu")
    out = {}
    for name, sets in TPU_CONFIGS.items():
        r = _run(f"configs/{name}.yaml", "--json", *(a for s in sets for a in ("--set", s)))
        assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        out[name] = json.loads(r.stdout)
    return out


def llama_layers(name: str) -> int:
    from raydeploy.config import load_config
    from raydeploy.model.spec import LlamaConfig
    from raydeploy.plan import model_config_path

    return LlamaConfig.from_json(model_config_path(load_config(REPO / "configs" / f"{name}.yaml"))).num_layers


@pytest.mark.parametrize("name", ["tpu-v5e-16", "tpu-v6e-16"])
def test_tpu_configs_compile_deviceless_and_every_program_fits(tpu_reports, name):
    rep = tpu_reports[name]
    assert "TPU v5 lite" in rep["target"] if name == "tpu-v5e-16" else "TPU v6" in rep["target"]
    names = [p["name"] for p in rep["programs"]]
    # verify programs only where the config speculates (test_speculation_adds_verify_programs_that_compile_and_fit)
    assert {n.split("_")[0] for n in names} == {"step", "presence"} | ({"verify"} if TPU_CONFIGS[name] else set())
    # a few token buckets, one page-table width: the decode rows of a dp group in powers of four up to its
    # slots (v5e: 168 slots / dp 4 = 42; v6e: 65 slots, dp 1), a 256-token chunk and its quarter; the TPU
    # kernel reads only live pages, so every program takes the table of 8192 tokens (512 pages of 16)
    tokens = (1, 4, 16, 42, 64, 256) if name == "tpu-v5e-16" else (1, 4, 16, 64, 65, 256)
    assert sorted(n for n in names if n.startswith("step_")) == sorted(f"step_{t}x512" for t in tokens)
    assert rep["problems"] == []
    for p in rep["programs"]:
        assert 0 < p["peak_bytes"] <= rep["chip_memory_bytes"], p["name"]
        # the KV pool is carried through the layer scan and updated in place: no cache-sized temporaries
        assert p["temp_bytes"] < rep["kv_cache_bytes_per_chip"] / llama_layers(name), p["name"]
    # the weights and the KV pool are really arguments of the step programs (the report is not empty)
    steps = [p for p in rep["programs"] if p["name"].startswith("step_")]
    assert min(p["argument_bytes"] for p in steps) >= rep["weight_bytes_per_chip"] + rep["kv_cache_bytes_per_chip"]


@pytest.mark.parametrize("name", ["tpu-v5e-16", "tpu-v6e-16"])
def test_no_collective_moves_weights_tables_or_kv_cache(tpu_reports, name):
    """No all-gather of weight or embedding-table size in decode; nothing KV-cache-sized crosses chips."""
    from raydeploy.config import load_config
    from raydeploy.model.spec import LlamaConfig
    from raydeploy.plan import model_config_path

    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    llama = LlamaConfig.from_json(model_config_path(cfg))
    table_per_chip = llama.vocab_size * llama.hidden_size * 2 / 16  # the smallest shard the table could have
    layer_kernel = llama.hidden_size * llama.intermediate_size * 2 / 16
    rep = tpu_reports[name]
    one_layer_kv = rep["kv_cache_bytes_per_chip"] / llama.num_layers  # K and V of one layer, every slot
    for p in rep["programs"]:
        if p["name"].startswith("step_") and int(p["name"][5:].split("x")[0]) <= 16:
            # a decode-shaped step gathers logits rows, never a weight or the table
            gathered = p["collectives"].get("all-gather", {}).get("largest", 0)
            assert gathered < min(table_per_chip, layer_kernel), p["name"]
            assert p["largest_collective_bytes"] < one_layer_kv, p["name"]
        # activations cross chips (partial sums all-reduced, an fsdp all-gather of [tokens, hidden]); no data
        # movement is shaped like cache contents (head_dim last, with at least 256 pages or positions)
        for kind, c in p["collectives"].items():
            if kind in ("all-reduce", "reduce-scatter"):  # sums of a matmul's partial products, never the cache
                continue
            for shape in c["shapes"]:
                dims = [int(d) for d in shape[shape.index("[") + 1:-1].split(",") if d]
                kv_like = len(dims) >= 2 and dims[-1] == llama.head_dim and max(dims[:-1]) >= 256
                assert not kv_like, f"{p['name']}: {kind} of {shape}"
    decode = next(p for p in rep["programs"] if p["name"].startswith("step_1x"))
    # the tp all-reduces of every layer are there, counted once per layer of the scan
    assert decode["collectives"]["all-reduce"]["count"] >= 2 * llama.num_layers


@pytest.mark.parametrize("name", ["tpu-v5e-16", "tpu-v6e-16"])
def test_no_collective_moves_the_allowed_token_mask(tpu_reports, name):
    """Constrained rows' allowed-token bits (`StepInputs.allowed`, u32 [rows, ceil(vocab / 32)], rows over dp) are
    an argument of every step program, applied where the logits are: no step collective carries words or bits
    (u32 or pred), nor any int32 data (the mask is never widened to move). The v5e-16 step programs grew by at
    most 0.9 MB peak per chip with it (0.26 MB of it the argument)."""
    for p in tpu_reports[name]["programs"]:
        if not p["name"].startswith("step_"):
            continue
        for kind, c in p["collectives"].items():
            for shape in c["shapes"]:
                assert not shape.startswith(("u32", "pred", "s32")), f"{p['name']}: {kind} of {shape}"


def _report_and_plan(name: str) -> tuple[dict, Any]:
    """`raydeploy compile configs/NAME.yaml --json` (must succeed) and the config's plan."""
    from raydeploy.config import load_config
    from raydeploy.plan import make_plan

    r = _run(f"configs/{name}.yaml", "--json")
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout), make_plan(load_config(REPO / "configs" / f"{name}.yaml"))


def test_moe_config_compiles_deviceless_with_experts_over_ep():
    """Qwen3-30B-A3B (48 layers, 128 experts, 8 per token, bfloat16) on v5e-16 with ep=4 x tp=4: every program
    compiles through libtpu, fits the chip, and moves only activations and logits between chips (per layer a
    tp all-reduce after attention and one psum of the experts' parts over ep x tp); no expert weight is
    gathered (no collective has an expert's hidden-unit dimension, 768 or its tp shard 192)."""
    pytest.importorskip("libtpu")
    rep, plan = _report_and_plan("tpu-v5e-16-qwen3-30b-a3b")
    raw = json.loads((REPO / "configs/models/qwen3-30b-a3b/config.json").read_text())
    layers, vocab_shard = raw["num_hidden_layers"], raw["vocab_size"] // plan.mesh["tp"]
    assert rep["target"] == "tpu 16 devices (TPU v5 lite)" and rep["problems"] == []
    assert rep["weight_bytes_per_chip"] == plan.param_bytes_per_device
    names = sorted(p["name"] for p in rep["programs"])
    # 16 slots (no dp): decode rows 1, 4, 16; the 256-token chunk and its quarter; 8192 tokens in pages of 16
    assert names == sorted(["presence_row", *(f"step_{t}x512" for t in (1, 4, 16, 64, 256))])
    for p in rep["programs"]:
        assert 0 < p["peak_bytes"] <= rep["chip_memory_bytes"], p["name"]
        if not p["name"].startswith("step_"):
            continue
        assert p["argument_bytes"] >= rep["weight_bytes_per_chip"] + rep["kv_cache_bytes_per_chip"], p["name"]
        assert p["collectives"]["all-reduce"]["count"] >= 2 * layers, p["name"]
        for kind, c in p["collectives"].items():
            for shape in c["shapes"]:
                dims = [int(d) for d in shape[shape.index("[") + 1:-1].split(",") if d]
                assert not {192, 768} & set(dims), f"{p['name']}: {kind} of {shape}"
                if kind == "all-gather":  # only logits rows come together (the LM head is split over tp)
                    assert vocab_shard in dims, f"{p['name']}: {kind} of {shape}"


def test_gemma3_long_context_config_compiles_deviceless_with_window_rings():
    """Gemma 3 27B (62 layers, 52 local with a 1024-token window, bfloat16) with 59 slots of 32768 tokens on
    v5e-16, tp=16: every step program, with the Pallas ragged paged attention kernel reading the main pool on
    the global layers and the rings of the window pool on the local ones, compiles through libtpu and fits the
    chip; the KV bytes per chip are the plan's (main pool + rings, 11.1 GiB; at 16 slots without rings 15.5 GiB,
    which does not fit: test_plan); only activations and logits move between chips."""
    pytest.importorskip("libtpu")
    rep, plan = _report_and_plan("tpu-v5e-16-gemma3-27b")
    assert plan.window_ring_pages == 81 and plan.window_layers == 52
    assert rep["target"] == "tpu 16 devices (TPU v5 lite)" and rep["problems"] == []
    assert rep["weight_bytes_per_chip"] == plan.param_bytes_per_device
    assert rep["kv_cache_bytes_per_chip"] == plan.kv_bytes_per_device
    steps = [p for p in rep["programs"] if p["name"].startswith("step_")]
    assert sorted(p["name"] for p in steps) == sorted(f"step_{t}x2048" for t in (1, 4, 16, 59, 64, 256))
    vocab_shard = 262208 // 16
    for p in steps:
        assert 0 < p["peak_bytes"] <= rep["chip_memory_bytes"], p["name"]
        assert p["argument_bytes"] >= rep["weight_bytes_per_chip"] + rep["kv_cache_bytes_per_chip"], p["name"]
        assert p["collectives"]["all-reduce"]["count"] >= 2 * 62, p["name"]  # attention and MLP, per layer
        for shape in p["collectives"].get("all-gather", {}).get("shapes", []):
            dims = [int(d) for d in shape[shape.index("[") + 1:-1].split(",") if d]
            assert vocab_shard in dims, f"{p['name']}: all-gather of {shape}"  # logits rows only


def test_an_override_that_cannot_fit_names_the_program_and_the_numbers():
    pytest.importorskip("libtpu")
    r = _run("configs/tpu-v5e-16.yaml", "--only", "step", "--set", "engine.max_slots=256")
    assert r.returncode == 1, r.stderr[-2000:]
    # either our accounting or the TPU compiler's own out-of-memory check catches it; both name the numbers
    assert "DOES NOT FIT: program step_" in r.stdout, r.stdout[-2000:]
    assert "16.00 GiB" in r.stdout and re.search(r"\d+(\.\d+)? ?Gi?B?", r.stdout)


_HOLD_TOPOLOGY = """
import sys, time
from raydeploy.compile import prepare_environment, target_devices
from raydeploy.config import load_config
cfg = load_config("configs/tpu-v5e-16.yaml")
prepare_environment(cfg)
print(len(target_devices(cfg)), flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_two_deviceless_compiles_at_once():
    """libtpu's machine-wide lock file: a second process describing a TPU topology while another holds libtpu
    failed ("Internal error when accessing libtpu multi-process lockfile"); the compile environment loads it
    without the lock, so two compiles (or one on a TPU VM that is serving) run side by side."""
    pytest.importorskip("libtpu")
    base = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_SKIP_MDS_QUERY",
                                                            "ALLOW_MULTIPLE_LIBTPU_LOAD")}
    first = subprocess.Popen([sys.executable, "-c", _HOLD_TOPOLOGY, "30"], cwd=REPO, env=base, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "16"  # holds libtpu now
        second = subprocess.run([sys.executable, "-c", _HOLD_TOPOLOGY, "0"], cwd=REPO, env=base, text=True,
                                capture_output=True, timeout=300)
        assert second.returncode == 0 and second.stdout.strip() == "16", second.stderr[-2000:]
    finally:
        first.kill()
        first.wait(60)


def test_unknown_program_kind_is_named():
    r = _run("configs/tpu-v5e-16.yaml", "--only", "decode")
    assert r.returncode == 1
    assert "unknown program kind(s) decode (kinds: step, presence, verify)" in r.stderr


def test_gpu_configs_say_there_is_no_deviceless_gpu_target():
    r = _run("configs/gpu-2x8-h100.yaml")
    assert r.returncode == 1
    assert "jax has no deviceless GPU target" in r.stderr


def test_depth_does_not_grow_the_programs(tmp_path: Path):
    """A 32-layer and an 80-layer model of the same width compile to programs of nearly the same size (the
    layers are one scan), so compile time stops growing with depth; the times are printed for the record."""
    pytest.importorskip("libtpu")
    src = json.loads((REPO / "configs/models/llama-3-8b-instruct/config.json").read_text())
    sizes, times = {}, {}
    for layers in (32, 80):
        d = tmp_path / f"l{layers}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**src, "num_hidden_layers": layers}))
        r = _run("configs/tpu-v5e-16.yaml", "--json", "--only", "step", "--set", f"model.hf_config={d}/config.json",
                 "--set", "model.max_seq_len=512",
                 # one slot per dp group and a 4-token chunk: two step programs (1 and 4 tokens) per depth
                 "--set", "engine.max_slots=4", "--set", "engine.prefill_chunk=4", "--set", "engine.max_new_tokens=256")
        assert r.returncode == 0, r.stderr[-2000:]
        rep = json.loads(r.stdout)
        assert sorted(p["name"] for p in rep["programs"]) == ["step_1x32", "step_4x32"]
        sizes[layers] = sum(p["code_bytes"] for p in rep["programs"])
        times[layers] = rep["total_compile_s"]
    print(f"compile seconds 32 vs 80 layers: {times}; code bytes {sizes}")
    assert sizes[80] <= sizes[32] * 1.1


def test_cpu_target_compiles_the_embedded_default_like_bring_up(tmp_path: Path):
    """A CPU config compiles over this process's CPU devices; --out writes a compilation cache."""
    r = _run("configs/local.yaml", "--json", "--only", "step", "--out", str(tmp_path / "cache"),
             "--set", "model.max_seq_len=64",
             "--set", "engine.max_new_tokens=32", "--set", "engine.prefill_chunk=16")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["target"].startswith("cpu 2 devices")
    assert len(list((tmp_path / "cache").iterdir())) >= len(rep["programs"])
    # libtpu is installed here, but the CLI kept jax off the TPU that is not there (no libtpu start-up)
    assert "TPU" not in r.stderr and "libtpu" not in r.stderr, r.stderr[-2000:]


def test_plan_with_compile_uses_the_compiled_memory_figures():
    base = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "TPU_SKIP_MDS_QUERY")}
    r = subprocess.run([sys.executable, "-m", "raydeploy", "plan", "configs/local.yaml", "--compile",
                        "--set", "model.max_seq_len=64",
                        "--set", "engine.max_new_tokens=32"], cwd=REPO, capture_output=True, text=True,
                       timeout=900, env=base)
    assert r.returncode == 0, r.stderr[-2000:]
    # dp=2 over the 2 devices: 4 slots per group (1 and 4 tokens), a 256-token chunk and, on CPU, every power of
    # two from 16 below it (16, 32, 64, 128) and 3/2 of those from 64 (96, 192), one page bucket, and presence_row
    assert "programs      10 compiled for cpu 2 devices" in r.stdout, r.stdout
    assert "largest step_" in r.stdout


def test_keep_jax_off_missing_tpu_respects_a_tpu_and_the_user():
    from raydeploy.platform_env import keep_jax_off_missing_tpu

    env: dict[str, str] = {}
    keep_jax_off_missing_tpu(env)
    assert env == {"TPU_SKIP_MDS_QUERY": "1", "JAX_PLATFORMS": "cpu"}  # no TPU (and no GPU) on this machine
    env = {"JAX_PLATFORMS": "cuda"}
    keep_jax_off_missing_tpu(env)
    assert env["JAX_PLATFORMS"] == "cuda"  # the user's choice wins
    env = {"TPU_WORKER_ID": "0"}
    keep_jax_off_missing_tpu(env)
    assert env == {"TPU_WORKER_ID": "0"}  # a TPU host: untouched


_BRING_UP = """
import json, sys
import jax
from raydeploy.checkpoint.reader import CheckpointReader
from raydeploy.config import load_config
from raydeploy.engine.engine import Engine
from raydeploy.model.registry import from_hf_config
from raydeploy.model.sharding import build_mesh, merge_rules
from raydeploy.model.spec import param_specs
from raydeploy.plan import make_plan

cfg = load_config(sys.argv[1])
mesh = build_mesh(make_plan(cfg).mesh, jax.devices()[:cfg.cluster.devices_per_host])
rules = merge_rules(cfg.mesh.rules)
reader = CheckpointReader(sys.argv[2])
params, _ = reader.load(reader.param_specs(), mesh, rules, cfg.model.param_dtype, 2, progress=False)
engine = Engine(*from_hf_config(reader.hf_config), params, mesh, rules, cfg.model, cfg.engine)
engine.warmup()
print(json.dumps({"counts": engine.program_counts(), "programs": engine.programs}))
"""


@pytest.mark.model
def test_bring_up_loads_the_programs_that_compile_wrote(tmp_path: Path, demo_checkpoint):
    """`raydeploy compile --out DIR` then an engine bring-up over the same mesh with
    engine.compilation_cache_dir=DIR: every program is loaded from DIR, none compiled (the cache keys of the
    abstract programs and the real engine's are the same)."""
    cache = tmp_path / "programs"
    cfg = tmp_path / "one-host.yaml"
    text = (REPO / "configs/local.yaml").read_text()
    for old, new in [("num_hosts: 2", "num_hosts: 1"), ("devices_per_host: 1", "devices_per_host: 2"),
                     ("max_seq_len: 2048", "max_seq_len: 256"), ("max_new_tokens: null", "max_new_tokens: 64"),
                     ("engine:\n", f"engine:\n  compilation_cache_dir: {cache}\n  prefill_chunk: 64\n")]:
        assert old in text, old
        text = text.replace(old, new, 1)
    cfg.write_text(text)
    r = _run(str(cfg), "--json", "--out", str(cache))
    assert r.returncode == 0, r.stderr[-2000:]
    compiled = {p["name"] for p in json.loads(r.stdout)["programs"]}
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    b = subprocess.run([sys.executable, "-c", _BRING_UP, str(cfg), str(demo_checkpoint)], cwd=REPO,
                       capture_output=True, text=True, timeout=1200, env=env)
    assert b.returncode == 0, b.stderr[-3000:]
    out = json.loads(b.stdout.strip().splitlines()[-1])
    assert set(out["programs"]) == compiled  # one list of programs for compile and bring-up
    assert out["counts"] == {"loaded": len(compiled), "compiled": 0}, out["programs"]


# -- quantized weights (model.quantization int8) and an int8 KV cache ------------------------------------------------

QUANT_CASES = {  # name -> (config, extra --set overrides, the widest page table only unless FULL_COMPILE)
    "v5e-8-70b-int8": ("configs/tpu-v5e-8-llama3-70b-int8.yaml", [], True),
    "v5e-16-int8": ("configs/tpu-v5e-16.yaml", ["model.quantization=int8"], False),
}
V5E_8_70B_TOKENS, V5E_8_70B_TABLES = (1, 4, 16, 36, 64, 256), (16, 128, 512)
"""The 70B int8 config's step buckets: token places (decode rows in powers of four up to its 36 slots, a 256-token
chunk and its quarter) by page-table width (with the int8 KV cache the attention's work follows the table, so the
table is bucketed: 256 tokens, then 8x, up to 8192 tokens in pages of 16)."""


class _QuantReports(dict):
    """Each quantized case compiled once, when a test first asks for it (--json; every program, or those of the
    widest page table where QUANT_CASES says so and RAYDEPLOY_FULL_COMPILE is not 1), with its plan and its model's
    config."""

    def __missing__(self, name: str) -> tuple[dict, Any, Any]:
        from raydeploy.config import load_config
        from raydeploy.plan import make_plan, model_family

        config, sets, widest = QUANT_CASES[name]
        r = _run(config, "--json", *(a for s in sets for a in ("--set", s)), widest_tables=widest and not FULL_COMPILE)
        assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        cfg = load_config(REPO / config, sets)
        family, model, _ = model_family(cfg)
        self[name] = (json.loads(r.stdout), make_plan(cfg), (cfg, family, model))
        return self[name]


@pytest.fixture(scope="session")
def quant_reports() -> _QuantReports:
    pytest.importorskip("libtpu")
    return _QuantReports()


def _kernel_shards(cfg: Any, family: Any, model: Any) -> tuple[int, set[int]]:
    """(int8 bytes of the quantized kernels on one chip, the element counts of one kernel's shard: per layer and
    stacked over the layers), from the family's specs and the config's sharding rules."""
    from raydeploy.model.quant import quantized_kernel
    from raydeploy.model.sharding import merge_rules
    from raydeploy.plan import _shard_numel

    rules = {**family.rules, **merge_rules(cfg.mesh.rules)}
    shards = {n: _shard_numel(s, rules, cfg.mesh_shape) for n, s in family.param_specs(model).items()
              if quantized_kernel(n)}
    per_layer = set(shards.values())
    return sum(shards.values()), per_layer | {n * model.num_layers for n in per_layer}


QUANT_PARAMS = list(QUANT_CASES)


@pytest.mark.parametrize("name", QUANT_PARAMS)
def test_quantized_configs_compile_deviceless_and_every_program_fits(quant_reports, name):
    """Llama-3-70B int8 weights + int8 KV on v5e-8 (tp=8 over 2 hosts x 4 chips, 36 slots of 8192 tokens) and
    Llama-3-8B int8 on v5e-16 (dp=4 x tp=4, 168 slots): every program compiles through libtpu and fits the chip;
    the weight and KV bytes per chip are the plan's (int8 + float32 scales).

    With the int8 KV cache the pool is held once: in its TPU layout (`kv_quant.stored_shapes`) XLA keeps it as
    it is through the layer loop, so the temporaries are one layer's work, at most the dequantized copy of the
    pages a step's table names in one layer (0.29 GiB at 36 rows x 512 pages), never the pool (5.8 GiB a chip).
    In the rows layout XLA relaid the pool out, padded, around and inside the loop: 25.7 GiB a step program.

    The 70B config has 19 programs: 6 token buckets x 3 page-table widths (16, 128, 512 pages) and presence_row.
    All 19 compiled take about 7 minutes here (peak 14.29-14.60 GiB, docs/quantization.md), so by default only
    the 512-page table of each token bucket is compiled, with presence_row (7 programs). A narrower table's step
    program is the same program over fewer pages per row: the same weights and pool, a smaller table, and smaller
    temporaries (the dequantized copy of the pages the table names is rows x pages a layer), so each token
    bucket's peak is at its widest table. Every token bucket is kept: the peak grows with the tokens (14.29 GiB
    at 1 to 14.60 at 256, at 512 pages), and the weights are read differently at one row (converts fused) and
    from 4 rows up (the dot takes the s8 kernel), which `test_decode_reads_the_int8_weights_as_stored` checks
    per program. RAYDEPLOY_FULL_COMPILE=1 compiles all 19 and checks that bound: no program's peak is above its
    token bucket's at 512 pages."""
    rep, plan, _ = quant_reports[name]
    assert "TPU v5 lite" in rep["target"] and rep["problems"] == [], rep["problems"]
    assert rep["weight_bytes_per_chip"] == plan.param_bytes_per_device
    assert rep["kv_cache_bytes_per_chip"] == plan.kv_bytes_per_device
    steps = [p for p in rep["programs"] if p["name"].startswith("step_")]
    assert steps and {p["name"].split("_")[0] for p in rep["programs"]} >= {"step", "presence"}
    if name == "v5e-8-70b-int8":
        tables = V5E_8_70B_TABLES if FULL_COMPILE else V5E_8_70B_TABLES[-1:]
        assert sorted(p["name"] for p in steps) == sorted(f"step_{t}x{n}" for t in V5E_8_70B_TOKENS for n in tables)
        peak = {p["name"]: p["peak_bytes"] for p in steps}
        print("70B int8 step programs, peak GiB per chip:", {n: round(b / GIB, 3) for n, b in peak.items()})
        widest = V5E_8_70B_TABLES[-1]
        for n, b in peak.items():  # the bound the default subset rests on (checked where all are compiled)
            assert b <= peak[f"{n.rsplit('x', 1)[0]}x{widest}"], n
    for p in rep["programs"]:
        assert 0 < p["peak_bytes"] <= rep["chip_memory_bytes"], p["name"]
    for p in steps:  # the quantized weights (and pool) are really the programs' arguments, scales included
        assert p["argument_bytes"] >= rep["weight_bytes_per_chip"] + rep["kv_cache_bytes_per_chip"], p["name"]
        if plan.kv_dtype == "int8":  # no copy of the pool: a tenth of it is 8 of the 80 layers
            assert p["temp_bytes"] < rep["kv_cache_bytes_per_chip"] / 10, (p["name"], p["temp_bytes"])


@pytest.mark.parametrize("name", QUANT_PARAMS)
def test_decode_reads_the_int8_weights_as_stored(quant_reports, name):
    """The step programs take every quantized kernel as an s8 argument (the int8 bytes per chip, plus the int8 KV
    values where the cache is int8), and no conversion of a weight to float is written to HBM: XLA fuses each
    layer's dynamic-slice + convert of the int8 kernel into the dot's fusion, or into a loop fusion whose float
    output stays in the chip's on-chip memory (S(1)) for the next fusion; none lands in HBM, so HBM reads 1
    byte a weight and the temporaries hold no float copy of a weight. From 4 rows up XLA's convolution takes the
    s8 kernel as its operand (`dots`) and widens it in the MXU."""
    rep, plan, (cfg, family, model) = quant_reports[name]
    int8_bytes, kernel_shards = _kernel_shards(cfg, family, model)
    kv_values = plan.kv_bytes_per_device - plan.kv_scale_bytes_per_device if plan.kv_dtype == "int8" else 0
    for p in rep["programs"]:
        if not p["name"].startswith("step_"):
            continue
        reads = p["weight_reads"]
        assert reads["parameter_bytes"].get("s8", 0) == int8_bytes + kv_values, (p["name"], reads["parameter_bytes"])
        # the weights are widened somewhere, never in HBM: in a fusion, on chip, or by the dot itself
        assert reads["fused"] or reads["on_chip"] or reads["dots"], (p["name"], reads)
        for shape in reads["hbm"]:
            dims = [int(d) for d in shape[shape.index("[") + 1:-1].split(",") if d]
            assert math.prod(dims) not in kernel_shards, f"{p['name']}: a float copy of a weight in HBM: {shape}"
        # the temporaries are smaller than the largest (stacked) kernel in bfloat16: no whole weight converted
        assert p["temp_bytes"] < 2 * max(kernel_shards), p["name"]


# -- speculative decoding: the verify programs ------------------------------------------------------------------------

def test_speculation_adds_verify_programs_that_compile_and_fit(tpu_reports):
    """tpu-v5e-16 with `--set engine.speculative.method=ngram`: `raydeploy compile` lists and compiles the verify
    programs (`verify_{T}x{P}`: a dp group's 4 speculating rows of k + 1 = 5 places beside a decode row for each
    of its other 38 slots, in the step's token buckets from 2 to 4 x 5 + 38 = 58), each fits the chip and takes
    the weights and the KV pool as arguments (and updates the pool in place: no cache-sized temporaries); without
    speculation the config has none (`--only verify` of it compiles nothing). The verify programs are those of
    the session's compile of the speculating config (`tpu_reports`: its step programs beside them are the plain
    config's). Their peak bytes per chip are printed for the record."""
    pytest.importorskip("libtpu")
    plain = _run("configs/tpu-v5e-16.yaml", "--json", "--only", "verify")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert json.loads(plain.stdout)["programs"] == []
    assert TPU_CONFIGS["tpu-v5e-16"] == ["engine.speculative.method=ngram"]
    rep = tpu_reports["tpu-v5e-16"]
    assert "TPU v5 lite" in rep["target"] and rep["problems"] == [], rep["problems"]
    verifies = [p for p in rep["programs"] if p["name"].startswith("verify_")]
    assert sorted(p["name"] for p in verifies) == sorted(f"verify_{t}x512" for t in (4, 16, 42, 64))
    print("verify programs, peak GiB per chip:", {p["name"]: round(p["peak_bytes"] / GIB, 3) for p in verifies})
    for p in verifies:
        assert 0 < p["peak_bytes"] <= rep["chip_memory_bytes"], p["name"]
        assert p["argument_bytes"] >= rep["weight_bytes_per_chip"] + rep["kv_cache_bytes_per_chip"], p["name"]
        assert p["temp_bytes"] < rep["kv_cache_bytes_per_chip"] / llama_layers("tpu-v5e-16"), p["name"]
