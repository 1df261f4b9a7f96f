"""The config's sections: frozen dataclasses whose fields each carry a one-line docstring (the string right below
it) that says what it is and its unit; the docs' config reference is generated from these. `ConfigError` names
the file, the key and the numbers; `resolve_mesh_axes` resolves the mesh's -1 axis."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:
    from pydantic import GetCoreSchemaHandler
    from pydantic_core import CoreSchema

MESH_AXES = ("dp", "fsdp", "tp", "sp", "ep")
DEFAULT_CONFIG_PATH = Path(__file__).parent.parent / "default_config.yaml"


class ConfigError(ValueError):
    """A config that cannot be used: says which file, which key, what was expected and what was found."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None) -> None:
        where = ", ".join(p for p in (f"file {file}" if file else "", f"key '{key}'" if key else "") if p)
        super().__init__(f"{where}: {message}" if where else message)
        self.file = file
        self.key = key

    def __reduce__(self):  # pickles across Ray intact
        return (_rebuild_config_error, (str(self), self.file, self.key))


def _rebuild_config_error(text: str, file: str | None, key: str | None) -> ConfigError:
    err = ConfigError.__new__(ConfigError)
    ValueError.__init__(err, text)
    err.file, err.key = file, key
    return err


class _Section:
    """Base of every config section: pydantic (``TypeAdapter(Config)``) checks the types of a loaded config.

    Strict: an unknown key is an error, an int is not a bool nor a string, a list is not a tuple; a float field takes
    an int (YAML writes ``10`` for ``10.0``) and holds it as a float. A section is given as a mapping.
    """

    __pydantic_config__ = {"extra": "forbid", "strict": True}  # noqa: RUF012 (read by pydantic, never mutated)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        schema = handler(source)
        if schema["type"] == "dataclass":
            # strict stays on for every field; the section itself is built from the mapping YAML gives (in strict
            # mode pydantic would ask for an instance of the dataclass)
            cast(dict[str, Any], schema)["strict"] = False
        return schema


@dataclass(frozen=True)
class ClusterConfig(_Section):
    """Where the gang runs: how many hosts, what each host is, how long each phase may take."""

    num_hosts: int = 2
    """Number of hosts in the gang; one Ray actor (one process, one JAX process) per host."""
    devices_per_host: int = 2
    """Accelerator devices each host contributes to the mesh (chips, GPUs, or virtual CPU devices)."""
    platform: Literal["cpu", "tpu", "gpu"] = "cpu"
    """JAX platform on the hosts; `cpu` with `simulated: true` is the one-machine simulation."""
    simulated: bool = True
    """Simulate hosts on one machine: each host actor is a process with `devices_per_host` virtual CPU devices."""
    host_resources: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources each host bundle asks for, e.g. {TPU: 4} or {GPU: 8} or a custom label resource."""
    host_num_cpus: float = 0.5
    """CPUs each host bundle reserves in Ray (the actor's own bookkeeping; JAX threads are not limited by it)."""
    tpu_slice_head_resource: str | None = None
    """Resource held only by a TPU slice's first host (e.g. TPU-v5litepod-16-head); rank 0 claims it so a whole slice is taken atomically."""
    accelerator_type: str | None = None
    """Accelerator model per device (v4, v5e, v5p, v6e, A100-40G, A100-80G, H100, H200, L4); `raydeploy plan` takes device memory from it."""
    device_memory_gib: float | None = None
    """Memory of one device in GiB for `raydeploy plan`; null uses the figure known for accelerator_type (CPU: host RAM / devices)."""
    placement_strategy: Literal["STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"] = "STRICT_SPREAD"
    """Ray placement-group strategy; STRICT_SPREAD puts each host on its own node (simulated mode uses PACK)."""
    placement_timeout_s: float = 60.0
    """Seconds to wait for the placement group before failing with what was asked and what the cluster has."""
    ray_address: str | None = None
    """Ray cluster to join (like RAY_ADDRESS); null starts a local Ray cluster."""
    coordinator_bind_address: str | None = None
    """Address the jax.distributed coordinator (inside rank 0) listens on, and only on, and the other hosts dial; null means rank 0's node IP (the pod IP on KubeRay)."""
    coordinator_port: int | None = None
    """TCP port the jax.distributed coordinator (inside rank 0) listens on; null means 8476 (JAX's own default, open it in NetworkPolicies / firewalls) on real clusters and a free port on simulated hosts; 0 always picks a free port."""
    init_timeout_s: float = 60.0
    """Seconds jax.distributed.initialize waits for every host to join before failing."""
    heartbeat_timeout_s: float = 10.0
    """Seconds without a heartbeat after which JAX declares a host dead."""
    step_timeout_s: float = 120.0
    """Watchdog: seconds a host may go without finishing a step before the gang counts as stuck."""
    rpc_timeout_s: float = 300.0
    """Upper bound on any control call to a host actor (load, compile, shutdown)."""
    max_restarts: int = 3
    """Gang restarts allowed after a failure before the state becomes `failed`."""
    restart_backoff_s: float = 2.0
    """Seconds before the first restart; doubles each time."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every host process."""


@dataclass(frozen=True)
class MeshConfig(_Section):
    """The one global mesh every host builds: axis names and sizes, and the sharding rules."""

    axes: dict[str, int] = field(default_factory=lambda: {"dp": 1, "fsdp": 2, "tp": 2, "sp": 1})
    """Mesh axis sizes in order (subset of dp, fsdp, tp, sp, ep); one may be -1 to take the remaining devices."""
    rules: dict[str, list[str] | str | None] = field(default_factory=dict)
    """Overrides of the logical-axis -> mesh-axes table (raydeploy.model.sharding.DEFAULT_RULES); null replicates."""


@dataclass(frozen=True)
class ModelConfig(_Section):
    """Which weights to serve and in which precision."""

    checkpoint: str = "demo:smollm2-135m-instruct"
    """Path of a raydeploy msgpack-sharded checkpoint directory, or `demo:smollm2-135m-instruct` (converted once, cached)."""
    hf_config: str | None = None
    """Hugging Face config.json giving the architecture when the checkpoint is not on this machine (relative to the YAML file); null reads the checkpoint's own."""
    name: str | None = None
    """Model id shown by /v1/models and accepted in requests; null uses the checkpoint's directory name."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Activation / compute dtype."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype weights are held in on the devices (converted at load time if the checkpoint differs)."""
    max_seq_len: int = 2048
    """Longest sequence (prompt + generated tokens) a slot holds; sizes the KV cache."""
    load_threads: int = 8
    """Reader threads per host when loading the checkpoint."""
    verify_checksums: bool = True
    """Verify each tensor's checksum as it is read."""
    tool_parser: Literal["auto", "hermes", "llama3_json", "mistral", "gemma3"] = "auto"
    """How tool calls are written and read (docs/structured-outputs.md): auto = the model family's format when the chat template renders tools, else the fallback prompt with hermes `<tool_call>` blocks."""
    reasoning_parser: Literal["auto", "none", "think"] = "auto"
    """Reasoning split into reasoning_content: think = between `<think>` and `</think>` (Qwen3); auto = the model family's; none = all output is content."""
    chat_template: str | None = None
    """Jinja chat template used instead of the tokenizer's: a file's path (relative to the YAML file) or the template itself; needed for a checkpoint whose tokenizer has none."""
    quantization: Literal["none", "int8", "fp8"] = "none"
    """Weights held quantized on the devices (docs/quantization.md): int8 = symmetric int8 per output channel (weight-only, W8A16), quantized while loading a float checkpoint; fp8 = float8 e4m3 per output channel, on chips with fp8 matmuls only (H100/H200, TPU v7x). A checkpoint stored quantized (`raydeploy convert --quantize`) is read as stored; none keeps a quantized checkpoint's own quantization."""


@dataclass(frozen=True)
class SamplingDefaults(_Section):
    """Sampling used when a request does not say."""

    temperature: float = 0.7
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    repetition_penalty: float = 1.0
    """Penalty > 1 discourages tokens already in the sequence (CTRL-style); 1 disables."""


@dataclass(frozen=True)
class EngineConfig(_Section):
    """The jitted engine: slots, limits, step sizes, kernels."""

    max_slots: int = 8
    """Batch slots decoded together (continuous batching); must divide evenly over dp."""
    max_new_tokens: int | None = None
    """Operator's cap on tokens generated per request (a larger max_tokens is a 400 naming it); null: no cap, prompt + max_tokens only has to fit model.max_seq_len, and a request without max_tokens runs to a stop or the context's end."""
    decode_steps: int = 4
    """Decode steps per plan while no prompt waits to start: tokens then stream in groups of this size, and the
    per-plan costs (broadcast to every host, reading tokens back) are paid once per group. 1 = every token."""
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    """Sampling defaults."""
    kernel_layout: Literal["auto", "in_out", "out_in"] = "auto"
    """How projection kernels are laid out in device memory: in_out as in the checkpoint ([in, out]), or out_in
    (transposed once at load). XLA CPU multiplies bfloat16 kernels faster out_in; auto picks out_in for
    bfloat16 weights on CPU and in_out everywhere else."""
    compilation_cache_dir: str | None = "~/.cache/raydeploy/jax-compilation-cache"
    """Persistent XLA compilation cache every host reads: a path (a shared, writable mount on real clusters) or a gs:// URL (needs etils[epath] and gcsfs); null disables."""
    warmup: bool = True
    """Compile (or load from the compilation cache) every program before reporting ready."""
    compile_threads: int = 0
    """Programs compiled side by side at warmup; 0 = auto: 1 on CPU (simulated hosts share the cores), else
    the host's cores up to 8."""
    page_size: int = 16
    """Tokens per page of the paged KV cache (each dp group has its own pool of pages)."""
    num_pages: int = 0
    """Pages in each dp group's pool; 0 = auto: enough for every slot of the group at max_seq_len (the memory of
    a slot cache of the same size), so requests never wait for pages while a slot is free."""
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "float8_e4m3fn"] = "auto"
    """dtype of the KV cache pages: auto = model.dtype. float16 halves a float32 model's cache, and the bytes every
    decode pass reads from it: the attention widens each key and value to float32 as it reads it and sums in
    float32, so only the stored K/V are rounded (a relative error of ~5e-4; values past float16's 65504 saturate
    there). On CPU the decode rows' attention waits on those reads (the demo model: 1.4x faster with float16 at
    400-800 cached tokens, where it is a third of a decode pass); bfloat16 (~4e-3) is slower than float32 on XLA
    CPU. int8 (and float8_e4m3fn where the chip has fp8) stores each token's key and value per head with its own
    scale (docs/quantization.md), read by every attention backend. Another float dtype than model.dtype needs the
    xla attention backend: the pallas kernels read the model's."""
    prefill_chunk: int = 256
    """Most tokens one engine step computes per dp group (prompt chunks plus decode rows): a longer prompt is
    prefilled over several steps, between which running streams keep decoding."""
    attention: Literal["auto", "xla", "pallas"] = "auto"
    """Attention backend: pallas (jax's ragged paged attention kernels, TPU/GPU), xla (plain XLA, any
    platform), auto = pallas on TPU/GPU, xla on CPU."""
    prefix_caching: bool = True
    """Reuse the KV pages of full pages whose token prefix matches an earlier request's (shared system
    prompts are prefilled once). Off for a model whose sliding-window layers keep rings (window_pages)."""
    unroll_layers: Literal["auto", "off"] = "auto"
    """auto: on CPU the one-token step program runs the layers unrolled, over per-layer views of the stacked
    weights (XLA CPU copies a scanned layer's weights before each matmul: one-row decode ~18% faster, ~8 s more
    compile at a cold start); TPU and GPU always scan. off: every program scans."""
    cpu_matmul: Literal["auto", "xla"] = "auto"
    """auto: on CPU, float32 projections of 2-32 rows per device (1-32 with AVX-512) run in a native kernel (built
    on first use with the machine's C++ compiler for the CPU's vector unit, AVX2 or AVX-512; XLA's dot where none
    is found or the CPU lacks AVX2/FMA) when every weight is replicated over the mesh (dp only): XLA CPU's dot
    takes 1.1-2.2x its time for so few rows; with AVX-512 the kernel also multiplies bfloat16 weights (param_dtype
    bfloat16, dtype float32) from 1 to 128 rows per device. The decode rows' attention then runs in the native
    attention kernel too (2.5x faster than XLA's gathers). TPU and GPU: no effect. xla: always XLA."""
    pack_weights: Literal["auto", "off"] = "auto"
    """auto: where the native CPU kernel runs (cpu_matmul auto, float32 weights; its AVX-512 or AVX2 build), each
    layer projection whose float32 weights are exactly 4-bit blocks (32 weights down a column that are d * q + m,
    q in 0..15: a GGUF Q4_1 checkpoint, the demo model's, dequantized) is also held packed, 0.75 bytes a weight
    instead of 4, and a tied embedding table that is exactly 8-bit blocks (GGUF Q8_0: d * q along each row) is
    held packed too, 1.125 bytes a weight; steps of up to 256 rows per device (64 in the AVX2 build) read the
    packed copies, a fifth of the bytes. The AVX2 build multiplies them by x as it is (the float32 products); the
    AVX-512 build rounds each row's block of 32 values of x to 16-bit integers (a step of 1/65534 of the block's
    largest) and sums integer products, two an instruction (demo: greedy tokens unchanged, logprobs within
    ~3e-3 of the float32 products'). Longer prompt steps keep the float32 weights (about a fifth more memory for
    the packed copies). Checked bit for bit at load; a weight that is not such blocks stays float32 only. off:
    never (float32 products everywhere)."""
    gpu_matmul: Literal["auto", "xla", "pallas"] = "auto"
    """auto: on a GPU, projections of up to 64 rows per dp group by bfloat16 weights run in a Pallas kernel that
    reads the layer's weight inside the stacked one (XLA GPU copies every layer's weight out of the stack before
    a gemm: a decode pass then writes and rereads its weights), each device on its shard of a weight split over
    tp or fsdp; XLA's gemm for the rest. pallas: the same on any platform (Pallas interpret mode off a GPU: slow,
    for checks). xla: always XLA."""
    window_pages: Literal["ring", "all"] = "ring"
    """KV pages of a model's sliding-window layers (Gemma 3's local layers, Mistral's window): ring = each slot
    keeps a ring of pages covering the window plus one step's chunk, in a pool of their own, and the other
    layers' pool holds only the other layers (Gemma 3: 5 of every 6 layers stop growing with the context);
    prefix caching is then off for that model (a reused prefix would lack its window in the rings). all = every
    layer keeps every page of the sequence (prefix caching works). Models without windows: no effect."""
    max_decode_slowdown: float = 1.6
    """While a prompt prefills beside running streams, how much slower their mean time per token may get: after
    each chunk step the prompt's next chunk waits for as many decode-only passes as keep the streams within this
    factor of a decode pass (from the measured step times; at most 64 passes). A chunk step costs a few decode
    passes on CPU and about one on TPU/GPU, where nothing waits. Lower: steadier streams, a longer wait for the
    long prompt's first token; 0 = never wait (a chunk in every step). Prompts that fit one step never wait. The
    engine keeps its own clock within it; clients over HTTP see more (1.75 read 1.97-2.08x at the engine's 1.82x
    on the 2-host CPU default)."""
    burst_wait: float = 1.0
    """A request that finds the engine idle waits until this fraction of a decode pass (measured) has gone by with
    no other arrival (each arrival starts the wait again; at most 8 decode passes after the first request), so
    requests that arrive with it (a burst sent at once reaches rank 0 over tens to hundreds of milliseconds) share
    that step instead of waiting a whole step behind it. A lone request pays this much of a pass in its time to
    first token. 0 = start at once; at most 1."""
    speculative: SpeculativeConfig = field(default_factory=lambda: SpeculativeConfig())
    """Speculative decoding (docs/speculative.md)."""


@dataclass(frozen=True)
class SpeculativeConfig(_Section):
    """Speculative decoding: proposals verified in the ragged step, outputs exactly those of the model alone."""

    method: Literal["none", "ngram", "draft"] = "none"
    """none; ngram = rank 0 proposes the continuation of the latest earlier match of the sequence's last tokens in its own prompt and output that has k tokens after it, else of the earliest (prompt lookup, no model); draft = a small model of the same tokenizer and vocabulary (`draft_checkpoint`) proposes k greedy tokens, run on the same mesh by every host's engine, with its own KV pool under the target's page table (docs/speculative.md)."""
    num_tokens: int = 4
    """Tokens proposed per speculating row and step (k); each such row is verified as a chunk of k + 1 queries."""
    ngram_max: int = 4
    """Longest n-gram (sequence suffix) looked up by the ngram method; shorter ones down to `ngram_min` are tried in turn."""
    ngram_min: int = 2
    """Shortest n-gram the ngram method looks up."""
    draft_checkpoint: str | None = None
    """The draft model's checkpoint (method draft): a raydeploy checkpoint directory or a `demo:` name; it must share the target's tokenizer."""
    max_rows: int = 4
    """Back-off under load: a step with more decode rows than this per dp group speculates for none of them."""
    min_acceptance: float = 0.3
    """Back-off per request: a request whose recent proposals (its last 8 verified rows, from 4 on) were accepted at a lower rate stops speculating for 32 plans, then tries again."""


@dataclass(frozen=True)
class LoraConfig(_Section):
    """LoRA adapters served on the base model (docs/lora.md), chosen per request by model name."""

    max_adapters: int = 0
    """Adapter slots held on the devices; 0 disables LoRA (no slot memory, the step programs take no adapter input)."""
    max_rank: int = 16
    """Largest adapter rank a slot holds; a larger adapter is refused when loaded, naming its rank."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapters loaded at start-up: name -> PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    allow_runtime_loading: bool = False
    """Whether POST /v1/load_lora_adapter and /v1/unload_lora_adapter may load and unload adapters while serving (with the API key, where one is set). Off by default, as in vLLM: a caller names a path the server then reads."""


@dataclass(frozen=True)
class ServingConfig(_Section):
    """The HTTP front door (Ray Serve)."""

    host: str = "127.0.0.1"
    """Bind address of the HTTP proxy; 127.0.0.1 keeps it local, 0.0.0.0 exposes it."""
    port: int = 8000
    """HTTP port."""
    api_keys_env: str | None = None
    """Environment variable holding comma-separated API keys; when set (or api_keys_file), /v1, /chat, /instruct need one."""
    api_keys_file: str | None = None
    """File with one API key per line."""
    max_queue: int = 64
    """Sequences admitted beyond the slots of the ready gangs (they wait in Serve's router for the first free slot); requests beyond wait at the ingress (max_waiting)."""
    max_waiting: int = 2048
    """Requests one ingress replica keeps waiting, first come first served, while the gangs are at capacity; 503 with Retry-After beyond; 0 refuses at once."""
    queue_wait_s: float | None = None
    """Seconds a request may wait for capacity before 503 with Retry-After (the wait counts toward request_timeout_s); null means request_timeout_s."""
    request_timeout_s: float = 300.0
    """Seconds a request may take end to end before it is aborted with 504 and its slot freed."""
    max_body_bytes: int = 1_048_576
    """Largest request body accepted (413 beyond)."""
    ingress_replicas: int = 1
    """Serve replicas of the HTTP ingress (light, no JAX)."""
    cors_origins: list[str] = field(default_factory=list)
    """Origins allowed by CORS; empty disables CORS headers."""
    cors_allow_headers: list[str] | None = None
    """Request headers CORS allows (`*` for any); null: Authorization, Content-Type, X-API-Key and the openai JS SDK's OpenAI-* and X-Stainless-* headers."""
    cors_allow_methods: list[str] | None = None
    """HTTP methods CORS allows (`*` for any); null: GET, POST, OPTIONS."""
    body_read_timeout_s: float = 10.0
    """Seconds a client has, from its request's arrival, to send the whole body; 408 and the connection closed after."""
    max_ingress_requests: int | None = None
    """Requests one ingress replica holds at once (reading, waiting, streaming; not /health, /ready, /metrics); 503 with Retry-After beyond; null means engine.max_slots x replicas.max + max_queue + max_waiting + 256."""
    max_concurrent_per_key: int | None = None
    """Requests one API key may have in one ingress replica at once (429 with Retry-After beyond); null or 0 is no limit; needs API keys."""
    metrics_refresh_s: float = 5.0
    """Seconds between refreshes of the gang figures /metrics shows (a scrape between refreshes asks no gang; one that starts a refresh waits for it at most 1 s)."""


@dataclass(frozen=True)
class ReplicasConfig(_Section):
    """Gangs behind one endpoint: each a Ray Serve replica with its own placement group, routed and scaled by Serve (names follow its autoscaling_config)."""

    min: int = 1
    """Fewest gangs kept running (Serve's min_replicas); min == max runs exactly that many, without autoscaling."""
    max: int = 1
    """Most gangs load may raise the count to (Serve's max_replicas)."""
    initial: int | None = None
    """Gangs started at deploy time (Serve's initial_replicas); null means `min`."""
    target_ongoing_requests: float | None = None
    """Autoscaling target: requests per gang, running and waiting (Serve's target_ongoing_requests); null means engine.max_slots (a full gang)."""
    upscale_delay_s: float = 30.0
    """Seconds load must stay above the target before another gang starts (Serve's upscale_delay_s)."""
    downscale_delay_s: float = 600.0
    """Seconds load must stay below the target before a gang is stopped, after its requests finish (Serve's downscale_delay_s)."""
    look_back_period_s: float = 30.0
    """Seconds of load the autoscaler averages over (Serve's look_back_period_s)."""
    upscaling_factor: float | None = None
    """Damping of each upscaling decision (Serve's upscaling_factor); null is Serve's default."""
    downscaling_factor: float | None = None
    """Damping of each downscaling decision (Serve's downscaling_factor); null is Serve's default."""
    health_check_period_s: float = 10.0
    """Seconds between Serve's health checks of a replica; a gang that has failed for good fails it and Serve replaces the replica."""
    routing_stats_period_s: float = 1.0
    """Seconds between a replica's readiness reports to Serve's router (a gang being rebuilt gets no new requests)."""


@dataclass(frozen=True)
class Config(_Section):
    """A whole deployment."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Hosts and Ray placement."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """The global device mesh."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Weights and precision."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Jitted engine."""
    serving: ServingConfig = field(default_factory=ServingConfig)
    """HTTP serving."""
    replicas: ReplicasConfig = field(default_factory=ReplicasConfig)
    """Gangs behind the endpoint (Serve replicas) and their autoscaling."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the base model."""
    source: str = "<defaults>"
    """Where this config came from (set by the loader)."""

    # -- derived ---------------------------------------------------------------------------------
    @property
    def total_devices(self) -> int:
        return self.cluster.num_hosts * self.cluster.devices_per_host

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Mesh axes with -1 resolved (validated at load time)."""
        return resolve_mesh_axes(self.mesh.axes, self.total_devices, self.source)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d



def resolve_mesh_axes(axes: dict[str, int], total_devices: int, source: str = "<config>") -> dict[str, int]:
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
        raise ConfigError(f"unknown mesh axis {unknown[0]!r}; axes are {', '.join(MESH_AXES)}", file=source, key="mesh.axes")
    if not axes:
        raise ConfigError("at least one mesh axis is needed", file=source, key="mesh.axes")
    wild = [a for a, n in axes.items() if n == -1]
    bad = [a for a, n in axes.items() if n != -1 and n < 1]
    if bad:
        raise ConfigError(f"axis {bad[0]} has size {axes[bad[0]]}; sizes are >= 1 or -1", file=source, key=f"mesh.axes.{bad[0]}")
    if len(wild) > 1:
        raise ConfigError(f"only one axis may be -1, found {', '.join(wild)}", file=source, key="mesh.axes")
    known = math.prod(n for n in axes.values() if n != -1)
    out = dict(axes)
    if wild:
        if total_devices % known:
            raise ConfigError(
                f"cannot fill axis {wild[0]}: {total_devices} devices are not divisible by the other axes' product {known}",
                file=source, key=f"mesh.axes.{wild[0]}")
        out[wild[0]] = total_devices // known
    elif known != total_devices:
        sizes = " x ".join(f"{a}={n}" for a, n in axes.items())
        raise ConfigError(
            f"mesh {sizes} has {known} devices but the cluster has {total_devices} "
            f"(num_hosts x devices_per_host)", file=source, key="mesh.axes")
    return out
