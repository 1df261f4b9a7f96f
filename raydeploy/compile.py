"""`raydeploy compile CONFIG`: compile every program of a config for its target, without its hardware.

The target's devices come from the config: a TPU slice's are a deviceless topology through libtpu (no TPU
needed: `jax.experimental.topologies`), a CPU config's are this process's CPU devices. GPU has no deviceless
target in jax, so a GPU config is refused with that reason. Over those devices the same `ProgramSet` that
bring-up uses lowers every program from shapes and shardings alone (no weights, no allocation) and compiles
it. Per program the report gives the compile seconds, the bytes per chip (arguments, outputs, temporaries,
code) against the chip's memory, the collectives (kind, count, bytes, with ops inside the layer scan counted
once per layer), and the compiler's cost analysis with a roofline time on the target chip.

With `--out DIR` the compiled programs are written into DIR as a persistent compilation cache, keyed as JAX
keys them at bring-up; a deployment whose `engine.compilation_cache_dir` is DIR loads them instead of
compiling. Keys include the device kind and topology, the mesh's device assignment, the XLA flags and the
jax/libtpu versions, so DIR serves the same config with the same versions.

The JAX environment must be set before jax initialises: `prepare_environment` does it for the CLI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from raydeploy.compat import jax_backends_started
from raydeploy.config import Config, ConfigError
from raydeploy.model.sharding import build_mesh, merge_rules

GIB = 1024**3


@dataclass(frozen=True)
class Chip:
    """Published figures of one accelerator chip (per chip, dense bfloat16)."""

    name: str
    hbm_gib: float
    hbm_gbps: float
    bf16_tflops: float


CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", 32, 1228, 275),
    "v5e": Chip("TPU v5e", 16, 819, 197),
    "v5p": Chip("TPU v5p", 95, 2765, 459),
    "v6e": Chip("TPU v6e", 32, 1640, 918),
    "v7x": Chip("TPU v7x", 192, 7370, 2307),
    "h100": Chip("H100 SXM", 80, 3350, 989),
    "h200": Chip("H200", 141, 4800, 989),
}

# TPU topologies: chips per host and the slice's chip grid, by accelerator type (2-D slices of v5e/v6e).
_TPU_GRIDS = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_HOST_BOUNDS = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
             "f32": 4, "s64": 8, "u64": 8, "f64": 8}


PROGRAM_KINDS = ("step", "presence", "verify")
"""Program kinds of the engine (`raydeploy.engine.programs.ProgramShape.kind`), for --only. `verify` programs (the
ragged step that checks speculative proposals) exist only where `engine.speculative.method` is not none."""


class CompileError(RuntimeError):
    """A config that cannot be compiled for its target, or a program that does not fit its chip."""


def roofline_s(chip: Chip, flops: float, bytes_read: float) -> float:
    """A step's time on `chip` by the roofline: the larger of its bytes over the HBM bandwidth and its flops over
    the dense bf16 peak. A model (published peaks, no overlap losses), not a measurement; `raydeploy plan`'s
    modelled decode figures and `benchmarks/tpu_decode_model.py` use it as the compile report does."""
    return max(flops / (chip.bf16_tflops * 1e12), bytes_read / (chip.hbm_gbps * 1e9))


def tpu_topology(cfg: Config) -> tuple[str, tuple[int, int, int]]:
    """(topology name for jax, chips per host bounds) of the config's TPU slice, e.g. ('v5e:4x4', (2, 2, 1))."""
    c = cfg.cluster
    kind = (c.accelerator_type or "").lower()
    if kind not in ("v5e", "v6e"):
        raise CompileError(f"cluster.accelerator_type {c.accelerator_type!r}: deviceless compile knows the 2-D "
                           f"TPU slices v5e and v6e")
    chips = c.num_hosts * c.devices_per_host
    if chips not in _TPU_GRIDS or c.devices_per_host not in _HOST_BOUNDS:
        raise CompileError(f"no {kind} slice has {c.num_hosts} hosts x {c.devices_per_host} chips "
                           f"(slices: {', '.join(str(n) for n in _TPU_GRIDS)} chips; 1, 4 or 8 per host)")
    return f"{kind}:{_TPU_GRIDS[chips]}", _HOST_BOUNDS[c.devices_per_host]


def prepare_environment(cfg: Config) -> None:
    """Set the JAX environment for compiling `cfg` in this process; must run before jax is imported.

    A TPU target compiles through libtpu without a TPU: JAX itself runs on CPU, and libtpu is told not to
    ask a cloud metadata server for a TPU that is not there. A CPU target needs as many CPU devices as the
    config's mesh. libtpu takes a machine-wide lock file when it loads, so a second compile at the same time
    (or one on a TPU VM whose server holds the chips) would fail ("libtpu multi-process lockfile"); this
    process opens no TPU, so it loads libtpu without the lock."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # the planner's modules import jax; the flags still apply until jax creates its backends
    if cfg.cluster.platform == "cpu" and not jax_backends_started():
        n = cfg.cluster.num_hosts * cfg.cluster.devices_per_host
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def target_devices(cfg: Config) -> list[Any]:
    """The devices of the config's target: a deviceless TPU topology, or this process's CPU devices."""
    import jax

    c = cfg.cluster
    if c.platform == "gpu":
        raise CompileError("jax has no deviceless GPU target: compile a GPU config on a GPU host "
                           "(bring-up compiles and caches it), or use `raydeploy plan` for its memory")
    if c.platform == "tpu":
        from jax.experimental import topologies

        name, bounds = tpu_topology(cfg)
        try:
            topo = topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name="default",
                                                chips_per_host_bounds=bounds, num_slices=1)
        except Exception as e:  # noqa: BLE001 - libtpu's errors are plain RuntimeErrors
            raise CompileError(f"could not describe TPU topology {name} (is libtpu installed? "
                               f"`pip install 'jax[tpu]'`): {e}") from e
        return list(topo.devices)
    n = c.num_hosts * c.devices_per_host
    devs = jax.devices("cpu")
    if len(devs) < n:
        raise CompileError(f"the config's mesh needs {n} CPU devices, this process has {len(devs)}: run "
                           f"`raydeploy compile` in a fresh process (it sets the device count before jax starts)")
    return devs[:n]


@dataclass
class Collective:
    kind: str
    count: int = 0
    bytes: int = 0
    largest: int = 0
    shapes: set[str] = field(default_factory=set)


@dataclass
class ProgramReport:
    name: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    roofline_s: float | None
    collectives: dict[str, dict[str, Any]] = field(default_factory=dict)
    largest_collective_bytes: int = 0
    weight_reads: dict[str, Any] = field(default_factory=dict)
    """`weight_reads` of the compiled HLO: parameter bytes per element type and where conversions of quantized
    arrays (s8, f8e4m3fn) to float land (fused / on_chip / hbm)."""

    @property
    def peak_bytes(self) -> int:
        """Bytes live on one chip while the program runs: inputs, outputs not aliased to inputs, temporaries
        and the program's code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
        if dtype in _ITEMSIZE:
            total += _ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def collectives(hlo: str, loop_trips: int = 1) -> tuple[dict[str, Collective], int]:
    """Collectives of an optimised HLO module: per kind, how many run, how many bytes they produce per
    call of the program and the largest one's bytes. An op in the body of a while loop counts once per iteration: the loop's
    known_trip_count where the HLO text gives it, else `loop_trips` (the engine's only loop over a
    collective is the layer scan, so the caller passes the layer count). Also the largest single
    collective's bytes."""
    trips: dict[str, int] = {}
    for line in hlo.splitlines():
        m = re.search(r"\swhile\(.*?body=%?([\w.\-]+)", line)
        if m:
            known = re.search(r"known_trip_count[^0-9]*(\d+)", line)
            trips[m.group(1)] = int(known.group(1)) if known else loop_trips
    out: dict[str, Collective] = {}
    largest = 0
    current = ""
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(1)
            continue
        m = re.search(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
        if not m:
            continue
        n = trips.get(current, 1)
        b = _shape_bytes(m.group(1))
        c = out.setdefault(m.group(2), Collective(m.group(2)))
        c.count += n
        c.bytes += n * b
        c.largest = max(c.largest, b)
        c.shapes.update(re.findall(r"\b[a-z]+\d*\[[\d,]*\]", m.group(1)))
        largest = max(largest, b)
    return out, largest


_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*([a-z]+\d*)\[([\d,]*)\](\{[^}]*\})?\s+([\w\-]+)\((.*)$")
_FLOATS = ("bf16", "f16", "f32")
QUANTIZED_TYPES = ("s8", "f8e4m3fn")
"""HLO element types of quantized weights (int8, float8 e4m3)."""


def weight_reads(hlo: str, min_bytes: int = 1 << 20) -> dict[str, Any]:
    """How an optimised HLO module reads its quantized arrays: the entry parameters' bytes per element type, and
    every conversion of a quantized array (s8 / f8e4m3fn) to a float type of at least `min_bytes`, by where its
    result lives: `fused` (consumed inside the fusion that converts it: never written anywhere), `on_chip` (a
    fusion's output in the TPU's on-chip memory, memory space S(1)) or `hbm` (written to HBM: a materialized
    float copy); and `dots`: the dots / convolutions that take a quantized operand as it is (the MXU reads the
    int8 tile and widens it itself). A quantized weight is read from HBM as stored when its parameter is s8 and no
    conversion of it lands in `hbm`."""
    params: dict[str, int] = {}
    fused_comps = set(re.findall(r"\bfusion\(.*?calls=%?([\w.\-]+)", hlo))
    out: dict[str, list[str]] = {"fused": [], "on_chip": [], "hbm": [], "dots": []}
    comp, types = "", dict[str, str]()
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)", line)
            comp, types = (head.group(2) if head else ""), dict[str, str]()
            if line.startswith("ENTRY"):
                for dtype, dims in re.findall(r":\s*([a-z]+\d*)\[([\d,]*)\]", line.split("->")[0]):
                    if dtype in _ITEMSIZE:
                        params[dtype] = params.get(dtype, 0) + _shape_bytes(f"{dtype}[{dims}]")
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        root, name, dtype, dims, layout, op, rest = m.groups()
        types[name] = dtype
        if op in ("dot", "convolution") and dtype in _FLOATS:
            operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
            if any(types.get(o) in QUANTIZED_TYPES for o in operands):
                out["dots"].append(f"{dtype}[{dims}]")
            continue
        if op != "convert" or dtype not in _FLOATS:
            continue
        operand = re.match(r"\s*%([\w.\-]+)", rest)
        if operand is None or types.get(operand.group(1)) not in QUANTIZED_TYPES:
            continue
        size = _shape_bytes(f"{dtype}[{dims}]")
        if size < min_bytes:
            continue
        shape = f"{dtype}[{dims}]"
        if comp in fused_comps and not root:
            out["fused"].append(shape)
        else:
            out["on_chip" if layout and "S(1)" in layout else "hbm"].append(shape)
    return {"parameter_bytes": params, **{k: sorted(v) for k, v in out.items()}}


def _report(name: str, compiled: Any, seconds: float, chip: Chip | None, loop_trips: int = 1) -> ProgramReport:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    flops = float(cost.get("flops", 0.0))
    accessed = float(cost.get("bytes accessed", 0.0))
    roofline = roofline_s(chip, flops, accessed) if chip is not None else None
    hlo = compiled.as_text() or ""
    colls, largest = collectives(hlo, loop_trips)
    return ProgramReport(
        name=name, compile_s=round(seconds, 3),
        argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
        code_bytes=int(mem.generated_code_size_in_bytes), flops=flops, bytes_accessed=accessed,
        roofline_s=roofline, collectives={k: {"count": v.count, "bytes": v.bytes, "largest": v.largest, "shapes": sorted(v.shapes)}
                     for k, v in colls.items()},
        largest_collective_bytes=largest, weight_reads=weight_reads(hlo))


@dataclass
class CompileReport:
    config: str
    target: str
    chip: str
    chip_memory_bytes: int
    programs: list[ProgramReport]
    total_compile_s: float
    weight_bytes_per_chip: int
    kv_cache_bytes_per_chip: int
    problems: list[str]
    lora_bytes_per_chip: int = 0
    """The LoRA adapter slots on each chip (`raydeploy.plan.Plan.lora_bytes_per_device`)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for p, rep in zip(d["programs"], self.programs, strict=True):
            p["peak_bytes"] = rep.peak_bytes
        return d


def chip_for(cfg: Config) -> Chip | None:
    kind = (cfg.cluster.accelerator_type or "").lower()
    return CHIPS.get(kind)


def compile_config(cfg: Config, plan: Any, family: Any, model: Any, out_dir: str | None = None,
                   only: list[str] | None = None, progress: Any = None) -> CompileReport:
    """Compile every program of `cfg` for its target; see the module docstring. `plan` is the config's
    `raydeploy.plan.Plan` and (`family`, `model`) its model (`raydeploy.plan.model_family`): the command layer
    (`raydeploy.commands`) makes them, so this module and the planner do not import each other."""
    import jax

    from raydeploy.engine import compile_cache
    from raydeploy.engine.engine import checkpoint_packing
    from raydeploy.engine.programs import ProgramSet

    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        compile_cache.enable(out_dir)
    devices = target_devices(cfg)
    mesh = build_mesh(plan.mesh, devices)
    # the weights as the engine holds them: quantized projection kernels (int8 / fp8) with their float32 scales
    family = family.with_quantization(cfg.model.quantization)
    # with lora.max_adapters > 0 the step programs take the adapter slots (docs/lora.md)
    ps = ProgramSet(family, model, mesh, merge_rules(cfg.mesh.rules), cfg.model, cfg.engine, lora_cfg=cfg.lora)
    # a CPU engine over weights that pack takes the packed copies: the programs bring-up runs (reads the weights)
    ps.use_packed(checkpoint_packing(cfg, ps))
    chip = chip_for(cfg)
    memory = plan.device_memory_bytes
    reports, problems = [], []
    t_all = time.perf_counter()
    for shape in ps.shapes():
        if only and shape.kind not in only:
            continue
        t0 = time.perf_counter()
        try:
            compiled = ps.lower(shape).compile()
        except Exception as e:  # noqa: BLE001 - XLA raises plain runtime errors; an out-of-memory one is a finding
            text = str(e)
            if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
                raise CompileError(f"program {shape.name} failed to compile for {devices[0].device_kind}: "
                                   f"{text.splitlines()[0] if text else type(e).__name__}") from e
            detail = next((ln.strip() for ln in text.splitlines() if "memory" in ln.lower()), text.splitlines()[0])
            problems.append(f"program {shape.name} does not fit the chip's {memory / GIB:.2f} GiB: the compiler "
                            f"says: {detail}")
            continue
        rep = _report(shape.name, compiled, time.perf_counter() - t0, chip, model.num_layers)
        reports.append(rep)
        if progress:
            progress(rep)
        if rep.peak_bytes > memory:
            problems.append(f"program {rep.name} needs {rep.peak_bytes / GIB:.2f} GiB per chip "
                            f"(arguments {rep.argument_bytes / GIB:.2f} + outputs {rep.output_bytes / GIB:.2f} - "
                            f"aliased {rep.alias_bytes / GIB:.2f} + temporaries {rep.temp_bytes / GIB:.2f} + code "
                            f"{rep.code_bytes / GIB:.3f} GiB), the chip has {memory / GIB:.2f} GiB")
    del jax
    return CompileReport(
        config=plan.source, target=f"{cfg.cluster.platform} {len(devices)} devices ({devices[0].device_kind})",
        chip=chip.name if chip else devices[0].device_kind, chip_memory_bytes=memory, programs=reports,
        total_compile_s=round(time.perf_counter() - t_all, 2),
        weight_bytes_per_chip=plan.param_bytes_per_device, kv_cache_bytes_per_chip=plan.kv_bytes_per_device,
        problems=problems, lora_bytes_per_chip=getattr(plan, "lora_bytes_per_device", 0))


def format_report(r: CompileReport) -> str:
    lines = [f"{r.config}: {r.target}, chip {r.chip} with {r.chip_memory_bytes / GIB:.1f} GiB",
             f"weights {r.weight_bytes_per_chip / GIB:.2f} GiB + KV cache {r.kv_cache_bytes_per_chip / GIB:.2f} GiB "
             + (f"+ LoRA slots {r.lora_bytes_per_chip / GIB:.3f} GiB " if r.lora_bytes_per_chip else "") + "per chip",
             f"{'program':<22}{'compile s':>10}{'peak GiB':>10}{'args':>8}{'out':>8}{'temp':>8}{'GFLOP':>9}"
             f"{'GB acc':>9}{'roofline ms':>12}  collectives (count, MB per call)"]
    for p in r.programs:
        colls = ", ".join(f"{k} {v['count']}x {v['bytes'] / 1e6:.2f}" for k, v in sorted(p.collectives.items()))
        roof = f"{p.roofline_s * 1e3:.3f}" if p.roofline_s is not None else "-"
        lines.append(f"{p.name:<22}{p.compile_s:>10.2f}{p.peak_bytes / GIB:>10.2f}{p.argument_bytes / GIB:>8.2f}"
                     f"{(p.output_bytes - p.alias_bytes) / GIB:>8.2f}{p.temp_bytes / GIB:>8.2f}"
                     f"{p.flops / 1e9:>9.1f}{p.bytes_accessed / 1e9:>9.2f}{roof:>12}  {colls or 'none'}")
    quantized = [p for p in r.programs if any(t in p.weight_reads.get("parameter_bytes", {}) for t in QUANTIZED_TYPES)]
    if quantized:
        q = max(quantized, key=lambda p: len(p.weight_reads["hbm"]))
        stored = sum(q.weight_reads["parameter_bytes"].get(t, 0) for t in QUANTIZED_TYPES)
        lines.append(f"quantized arrays read as stored ({stored / GIB:.2f} GiB of s8/f8 arguments per chip); their "
                     f"conversions to float of >= 1 MiB: fused {len(q.weight_reads['fused'])}, on chip "
                     f"{len(q.weight_reads['on_chip'])}, written to HBM {len(q.weight_reads['hbm'])}; dots reading them "
                     f"as stored {len(q.weight_reads.get('dots', []))} ({q.name}"
                     + (f": {', '.join(q.weight_reads['hbm'][:4])}" if q.weight_reads["hbm"] else "") + ")")
    lines.append(f"{len(r.programs)} programs compiled in {r.total_compile_s:.1f} s")
    lines += [f"DOES NOT FIT: {p}" for p in r.problems]
    return "\n".join(lines)


def only_kinds(only: str | None) -> list[str] | None:
    """`--only step,decode` as program kinds (None: every program); an unknown kind is a ConfigError naming it."""
    kinds = [k.strip() for k in only.split(",")] if only else None
    bad = sorted(set(kinds or ()) - set(PROGRAM_KINDS))
    if bad:
        raise ConfigError(f"--only {only!r}: unknown program kind(s) {', '.join(bad)} "
                          f"(kinds: {', '.join(PROGRAM_KINDS)})")
    return kinds


def run_compile(cfg: Config, plan: Any, family: Any, model: Any, args: argparse.Namespace,
                only: list[str] | None) -> int:
    """`raydeploy compile`: compile `only` these program kinds (None: all; `only_kinds`), print the report (text
    or --json); exit 1 when a program does not fit."""
    try:
        report = compile_config(cfg, plan, family, model, args.out, only, progress=None if args.json else
                                (lambda p: print(f"  compiled {p.name} in {p.compile_s:.2f} s", file=sys.stderr)))
    except CompileError as e:
        raise ConfigError(str(e)) from e
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    if args.out:
        print(f"compiled programs written to {args.out}: set engine.compilation_cache_dir to it", file=sys.stderr)
    return 1 if report.problems else 0
