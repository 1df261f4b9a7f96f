"""The paged KV cache: the device pool, the host mirror of the page tables, and one step's inputs as data.

Device side: a main pool, [layers, pages, page_size, 2 * kv_heads, head_dim] (`kv_pool_spec`), K and V
interleaved on the head axis; with a quantized `engine.kv_dtype` (int8, float8_e4m3fn) a `QuantizedPool` of those
values and a float32 scale per token and combined head, [..., 2 * kv_heads, 1], sharded alike
(`raydeploy.engine.attention.kv_quant`). The pages axis is split over the dp mesh axes, so each dp group owns
`pages_per_group` pages and a sequence's page ids are local to its group; the kv-heads axis follows the
`cache_kv_heads` rule (tp). Beside it a window pool of the same form holds the rings of sliding-window layers
(`PoolLayout`; no layers when the model has no windows or `engine.window_pages` is all). `allocate_pool`
creates both directly on the mesh (one jitted zeros).

Host side: `PageTables` is what every host keeps identical by applying the same `StepPlan`s: each slot's row
of page ids and its sampling parameters. The scheduler (rank 0) owns the pool's allocation and prefix cache;
it sends page-table changes in the plan.

`StepInputs` is one ragged step as a registered pytree of arrays (no positional packing): the tokens of every
dp group's sequences laid out group after group ([groups * tokens_per_group]), with explicit positions, write
addresses, per-sequence attention metadata in jax's ragged paged attention form, and per-row sampling (a
`RowSampling` holding each row's `SamplingParams`, the one sampling type, as arrays) with each row's allowed-token
bits (structured outputs). `build_inputs` makes it from a plan's `SeqStep`s, as one host array per name of
`FIELD_LAYOUT`; `StepInputs.from_flat` nests them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from raydeploy.engine.attention.kv_quant import (
    abstract_pool,
    is_quantized,
    pack,
    token_bytes,
    zeros_pool,
)
from raydeploy.engine.sampling import (
    BIAS_PAD,
    BITS,
    MAX_LOGIT_BIAS,
    NEUTRAL,
    ROW_DTYPES,
    ROW_WIDTHS,
    LogitBiasRows,
    RowSampling,
    bias_table,
    mask_words,
    row_value,
)
from raydeploy.engine.step import PageUpdate, SamplingParams, SeqStep
from raydeploy.model.quant import fp8_support
from raydeploy.model.spec import POOL_RULES

if TYPE_CHECKING:
    from raydeploy.model.registry import Family


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Which layers keep which pages. Layers without a window keep every page of a sequence in the main pool
    (page ids from the plan's tables). With `engine.window_pages: ring`, the sliding-window layers keep a ring
    instead, in a window pool of their own: each slot owns `ring_pages` consecutive pages of its group's window
    pool, and a sequence's logical page j lives in ring page j % ring_pages. The ring covers the widest window
    plus one step's tokens, so a step's writes never overwrite a key that a query of the same step still sees
    (keys older than the window are masked, whatever their ring page holds now)."""

    ring_pages: int                  # per slot; 0 = no window pool
    main_layers: tuple[int, ...]     # model layers in the main pool, in order
    window_layers: tuple[int, ...]   # model layers in the window pool, in order
    index: tuple[int, ...]           # each model layer's index in its own pool

    @staticmethod
    def create(windows: Sequence[int | None], mode: str, page_size: int, step_tokens: int,
               max_pages_per_seq: int) -> PoolLayout:
        widest = max((w for w in windows if w), default=0)
        ring = -(-(widest + step_tokens - 1) // page_size) + 1 if widest and mode == "ring" else 0
        if ring >= max_pages_per_seq:  # a ring as long as the sequence saves nothing
            ring = 0
        in_ring = [bool(ring and w) for w in windows]
        main = tuple(i for i, r in enumerate(in_ring) if not r)
        window = tuple(i for i, r in enumerate(in_ring) if r)
        index = tuple(window.index(i) if r else main.index(i) for i, r in enumerate(in_ring))
        return PoolLayout(ring, main, window, index)

    @staticmethod
    def for_engine(family: Family, cfg: Any, engine_cfg: Any, max_seq_len: int, groups: int) -> PoolLayout:
        """The layout an engine with `engine_cfg` uses for this model (the engine, `raydeploy plan`)."""
        from raydeploy.model.spec import pages_per_seq

        return PoolLayout.create(family.layer_windows(cfg), engine_cfg.window_pages, engine_cfg.page_size,
                                 step_tokens(engine_cfg, groups), pages_per_seq(max_seq_len, engine_cfg.page_size))

    def window_pool_pages(self, max_slots: int) -> int:
        """Pages of the window pool over every dp group (each slot's ring)."""
        return max_slots * self.ring_pages


F16_MAX = 65504.0  # float16's largest finite value


def resolve_kv_dtype(kv_dtype: str, model_dtype: str, attention: str, platform: str, device_kind: str = "",
                     compute_capability: str | None = None) -> str:
    """The pools' dtype name for `engine.kv_dtype` (auto = model.dtype); ValueError naming the settings otherwise.

    int8 and float8_e4m3fn (quantized, with per-token scales: `kv_quant`) run with every attention backend; fp8
    only on a chip that has fp8, by the rule of fp8 weights (`raydeploy.model.quant.fp8_support`, given the
    device's `device_kind` and `compute_capability` where known). Another float dtype than the model's only with
    the xla attention backend, which widens what it reads to float32: the Pallas kernels read the model's."""
    if kv_dtype in ("auto", model_dtype):
        return model_dtype
    if is_quantized(kv_dtype):
        if kv_dtype == "float8_e4m3fn":
            problem = fp8_support(platform, device_kind, compute_capability)
            if problem is not None:
                raise ValueError(f"engine.kv_dtype float8_e4m3fn needs fp8 on the chip, as fp8 weights do: {problem}; "
                                 f"set engine.kv_dtype int8")
        return kv_dtype
    from raydeploy.engine.attention import resolve

    backend, plat = resolve(attention, platform)
    if backend != "xla":
        raise ValueError(f"engine.kv_dtype {kv_dtype} differs from model.dtype {model_dtype}, but the {backend} "
                         f"attention kernels on {plat} read a float KV cache in the model's dtype: set engine.kv_dtype "
                         f"auto, int8, or engine.attention xla")
    return kv_dtype


def to_pool_dtype(kv: jax.Array, dtype: Any) -> jax.Array:
    """New keys and values in the pools' dtype; into float16 they saturate at +-65504 (a key past it would be inf,
    and every score it meets NaN). Into a quantized pool (int8, float8_e4m3fn) they are quantized per token and
    head, and travel to the write packed with their scales (`kv_quant.pack`: int8 [T, 2*Hkv, D + 4])."""
    import jax.numpy as jnp

    if is_quantized(dtype):
        return pack(kv, dtype)
    if jnp.dtype(dtype) == jnp.float16 and kv.dtype != jnp.float16:
        kv = jnp.clip(kv, -F16_MAX, F16_MAX)
    return kv.astype(dtype)


def kv_bytes_per_token(kv_dtype: str, kv_heads: int, head_dim: int) -> int:
    """Bytes one token's K and V take in one layer's pool (a quantized dtype's scales included)."""
    return token_bytes(kv_dtype, kv_heads, head_dim)


def step_tokens(engine_cfg: Any, groups: int) -> int:
    """Most tokens one step computes per dp group: the prefill chunk, or one per slot of the group if more."""
    return max(engine_cfg.prefill_chunk, engine_cfg.max_slots // groups)


def pool_specs(family: Family, cfg: Any, layout: PoolLayout, total_pages: int, page_size: int, max_slots: int
               ) -> tuple[Any, Any]:
    """TensorSpecs of (main pool, window pool); a pool with no layers has a zero-length layer axis."""
    return (family.kv_pool_spec(cfg, total_pages, page_size, len(layout.main_layers)),
            family.kv_pool_spec(cfg, layout.window_pool_pages(max_slots), page_size, len(layout.window_layers)))


def pool_sharding(family: Family, cfg: Any, layout: PoolLayout, total_pages: int, page_size: int, max_slots: int,
                  mesh: Any, rules: Mapping[str, Any]) -> tuple[Any, Any]:
    """The pools' shardings on `mesh` (`Family.kv_pool_spec` placed by its logical axes)."""
    from jax.sharding import NamedSharding

    from raydeploy.model.sharding import check_divisible, partition_spec

    all_rules = {**rules, **POOL_RULES}
    mesh_shape = dict(mesh.shape)
    out = []
    for spec in pool_specs(family, cfg, layout, total_pages, page_size, max_slots):
        check_divisible(spec, all_rules, mesh_shape)
        out.append(NamedSharding(mesh, partition_spec(spec.logical_axes, all_rules, mesh_shape, "kv_pages")))
    return out[0], out[1]


def allocate_pool(family: Family, cfg: Any, layout: PoolLayout, total_pages: int, page_size: int, max_slots: int,
                  dtype: Any, mesh: Any, rules: Mapping[str, Any]) -> tuple[Any, Any]:
    """The zeroed (main, window) pools, sharded on the mesh (never pass through host memory; work across
    processes): arrays, or `QuantizedPool`s (values and their scales) for a quantized `dtype`."""
    import jax.numpy as jnp

    shardings = pool_sharding(family, cfg, layout, total_pages, page_size, max_slots, mesh, rules)
    shapes = tuple(s.shape for s in pool_specs(family, cfg, layout, total_pages, page_size, max_slots))
    if is_quantized(dtype):  # values and scales, in the layout of the sharding's platform: its spec places both
        return jax.jit(lambda: tuple(zeros_pool(sh, dtype, s) for sh, s in zip(shapes, shardings, strict=True)),
                       out_shardings=shardings)()
    return jax.jit(lambda: tuple(jnp.zeros(sh, dtype) for sh in shapes), out_shardings=shardings)()


def abstract_pools(shapes: Sequence[tuple[int, ...]], dtype: Any, shardings: Sequence[Any]) -> tuple[Any, ...]:
    """The pools' ShapeDtypeStructs: one array each, or a `QuantizedPool` of values and scales for a quantized
    dtype (the step programs' abstract arguments)."""
    if is_quantized(dtype):
        return tuple(abstract_pool(sh, dtype, s) for sh, s in zip(shapes, shardings, strict=True))
    return tuple(jax.ShapeDtypeStruct(sh, dtype, sharding=s) for sh, s in zip(shapes, shardings, strict=True))


class PageTables:
    """Host mirror of every slot's page-table row and sampling parameters (identical on every host)."""

    def __init__(self, max_slots: int, groups: int, max_pages_per_seq: int, pages_per_group: int,
                 ring_pages: int = 0) -> None:
        self.max_slots = max_slots
        self.groups = groups
        self.slots_per_group = max_slots // groups
        self.max_pages_per_seq = max_pages_per_seq
        self.pages_per_group = pages_per_group
        self.ring_pages = ring_pages  # pages of each slot's ring in the window pool (0: no window pool)
        self.table = np.zeros((max_slots, max_pages_per_seq), np.int32)
        self.sampling: list[SamplingParams] = [SamplingParams() for _ in range(max_slots)]
        self.started = np.zeros(max_slots, bool)
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * max_slots
        """Each slot's logit-bias row (`bias_table`), None without a logit_bias."""
        self.ban: list[tuple[np.ndarray, int] | None] = [None] * max_slots
        """Each slot's min_tokens ban: the packed bits of its stop ids and the position its draws may take them
        from (`SeqStep.stop_ids`, `stop_until`); None without one."""

    def start(self, q: SeqStep, vocab: int) -> None:
        """A request starts in `q.slot` (its first chunk): keep its sampling, logit-bias row and min_tokens ban."""
        assert q.sampling is not None
        self.sampling[q.slot] = q.sampling
        self.started[q.slot] = True
        self.bias[q.slot] = bias_table(q.sampling) if q.sampling.logit_bias else None
        self.ban[q.slot] = None
        if q.stop_ids is not None and q.stop_ids.size and vocab:
            ids = np.asarray(q.stop_ids, np.int64).reshape(-1)
            ids = ids[(ids >= 0) & (ids < vocab)]
            bits = np.zeros(mask_words(vocab), np.uint32)
            np.bitwise_or.at(bits, ids // BITS, (np.uint32(1) << (ids % BITS).astype(np.uint32)))
            self.ban[q.slot] = (bits, int(q.stop_until))

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is out of range: the engine has {self.max_slots} slots "
                             f"(0..{self.max_slots - 1})")

    def apply(self, updates: Sequence[PageUpdate]) -> None:
        for u in updates:
            self.check_slot(u.slot)
            pages = np.asarray(u.pages, np.int32).reshape(-1)
            if u.first < 0 or u.first + pages.size > self.max_pages_per_seq:
                raise ValueError(f"page update of slot {u.slot}: entries {u.first}..{u.first + pages.size - 1} "
                                 f"are outside its row of {self.max_pages_per_seq} (max_seq_len / page_size)")
            if pages.size and (pages.min() < 0 or pages.max() >= self.pages_per_group):
                raise ValueError(f"page update of slot {u.slot}: page ids {pages.min()}..{pages.max()} are outside "
                                 f"its dp group's pool of {self.pages_per_group} pages (ids are local to the group)")
            self.table[u.slot, u.first:u.first + pages.size] = pages

    def release(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.check_slot(s)
            self.started[s] = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """One ragged step's device inputs. G dp groups, T token places and R sequence rows per group; every array
    is laid out group after group (its leading axis split over dp). Sequence rows are compact: a group's
    sequences first, padding rows after them (num_seqs says how many are live)."""

    tokens: jax.Array          # i32[G*T] input tokens (decode rows: ignored, taken from the slot's last token)
    from_last: jax.Array       # i32[G*T] global slot whose last sampled token is this place's input, or -1
    positions: jax.Array       # i32[G*T] position of each token in its sequence
    token_slot: jax.Array      # i32[G*T] global slot of each token; max_slots for padding places
    write_page: jax.Array      # i32[G*T] local page the token's K/V go to; pages_per_group (dropped) for padding
    write_offset: jax.Array    # i32[G*T] offset in that page
    ring_write_page: jax.Array  # i32[G*T] the same in the window pool: page of the slot's ring; out of range for padding
    kv_lens: jax.Array         # i32[G*R] tokens in each row's cache after this step's write
    page_indices: jax.Array    # i32[G*R, P] each row's page ids (local to the group)
    ring_page_indices: jax.Array  # i32[G*R, P] the same in the window pool: logical page j in ring page j % W
    cu_q_lens: jax.Array       # i32[G*(R+1)] token offsets of each row within its group
    num_seqs: jax.Array        # i32[G] live rows per group
    logit_index: jax.Array     # i32[G*R] place (within the group) of each row's last token
    sampling: RowSampling      # [G*R] each row's slot (max_slots: no sample), token position and SamplingParams
    reset: jax.Array           # bool[max_slots] slots whose repetition-penalty set starts over this step
    any_sampled: jax.Array     # bool[] some row samples with temperature > 0
    any_filtered: jax.Array    # bool[] some sampling row has a top-k, a top-p or a min_p
    any_adjusted: jax.Array    # bool[] some sampling row has a logit bias or a presence / frequency penalty
    allowed: jax.Array         # u32[G*R, W] each row's allowed tokens, packed bits (W = ceil(vocab / 32)); all ones
    #                            for a row without a constraint
    next_token: jax.Array      # i32[G*R] a prompt chunk's next prompt token (its last place's logprob target), or -1
    any_top_logprobs: jax.Array  # bool[] some sampling row asks for its alternatives (raydeploy.engine.logprobs)
    any_prompt_logprobs: jax.Array  # bool[] some prompt chunk asks for its places' logprobs

    @classmethod
    def from_flat(cls, arrays: Mapping[str, Any]) -> StepInputs:
        """The step from one array per name of `FIELD_LAYOUT` (`sampling.params.top_p` for a nested field)."""
        params = SamplingParams(**{n: arrays[f"{PARAMS}.{n}"] for n in ROW_DTYPES})
        bias = LogitBiasRows(ids=arrays[BIAS_IDS], values=arrays[BIAS_VALUES])
        sampling = RowSampling(slot=arrays["sampling.slot"], position=arrays["sampling.position"], params=params,
                               bias=bias)
        return cls(sampling=sampling, **{n: arrays[n] for n in FIELD_LAYOUT if "." not in n})


PARAMS = "sampling.params"
"""The flat name prefix of the rows' `SamplingParams` fields."""
BIAS_IDS, BIAS_VALUES = "sampling.bias.ids", "sampling.bias.values"
"""The flat names of the rows' logit-bias tables."""
BIAS_FIELDS = (BIAS_IDS, BIAS_VALUES)
"""Fields `build_inputs` leaves out of a step without a logit_bias row: the engine passes device-resident
neutral tables instead (`Engine._neutral_bias`), so such a step moves no table."""

# Leading-axis layout of each field by flat name: "tokens" = [G*T], "rows" = [G*R...], "replicated".
FIELD_LAYOUT = {
    "tokens": "tokens", "from_last": "tokens", "positions": "tokens", "token_slot": "tokens",
    "write_page": "tokens", "write_offset": "tokens", "ring_write_page": "tokens",
    "kv_lens": "rows", "page_indices": "rows", "ring_page_indices": "rows", "cu_q_lens": "rows", "num_seqs": "rows",
    "logit_index": "rows", "sampling.slot": "rows", "sampling.position": "rows",
    **{f"{PARAMS}.{n}": "rows" for n in ROW_DTYPES}, BIAS_IDS: "rows", BIAS_VALUES: "rows",
    "any_adjusted": "replicated",
    "allowed": "rows", "next_token": "rows",
    "reset": "replicated", "any_sampled": "replicated", "any_filtered": "replicated",
    "any_top_logprobs": "replicated", "any_prompt_logprobs": "replicated",
}


def abstract_inputs(groups: int, tokens: int, rows: int, pages: int, max_slots: int, vocab: int
                    ) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    """Shape and dtype of every StepInputs field for one (tokens, rows, pages) program over a model of `vocab`
    tokens."""
    g, t, r = groups, tokens, rows
    i32 = np.dtype(np.int32)
    out: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {n: ((g * t,), i32) for n, lay in FIELD_LAYOUT.items() if lay == "tokens"}
    out.update({n: ((g * r,), i32) for n in ("kv_lens", "logit_index", "sampling.slot", "sampling.position",
                                             "next_token")})
    out.update({f"{PARAMS}.{n}": ((g * r, *ROW_WIDTHS.get(n, ())), dt) for n, dt in ROW_DTYPES.items()})
    out[BIAS_IDS] = ((g * r, MAX_LOGIT_BIAS), i32)
    out[BIAS_VALUES] = ((g * r, MAX_LOGIT_BIAS), np.dtype(np.float32))
    out["any_adjusted"] = ((), np.dtype(bool))
    out["page_indices"] = ((g * r, pages), i32)
    out["ring_page_indices"] = ((g * r, pages), i32)
    out["cu_q_lens"] = ((g * (r + 1),), i32)
    out["num_seqs"] = ((g,), i32)
    out["reset"] = ((max_slots,), np.dtype(bool))
    out["any_sampled"] = ((), np.dtype(bool))
    out["any_filtered"] = ((), np.dtype(bool))
    out["any_top_logprobs"] = ((), np.dtype(bool))
    out["any_prompt_logprobs"] = ((), np.dtype(bool))
    out["allowed"] = ((g * r, mask_words(vocab)), np.dtype(np.uint32))
    return out


ALLOWED_FIELD = "allowed"
"""The field `build_inputs` leaves out of a step without constrained rows: the engine passes a device-resident
all-ones array of the step's shape instead (`Engine._all_allowed`), so unconstrained steps move no mask."""


@dataclasses.dataclass
class HostStep:
    """A step's inputs on the host, and where each plan sequence's result lands ([G*R] rows)."""

    arrays: dict[str, np.ndarray]
    """One array per `FIELD_LAYOUT` name; `allowed` only where some sampling row is constrained."""
    rows: list[int]
    """rows[i] = result row of plan.seqs[i]."""
    places: list[int] = dataclasses.field(default_factory=list)
    """places[i] = the flat token place ([G*T]) of plan.seqs[i]'s first token."""


def build_inputs(seqs: Sequence[SeqStep], tables: PageTables, page_size: int, tokens: int, rows: int,
                 pages: int, step: int = 0, reset: Sequence[int] = (), vocab: int = 0) -> HostStep:
    """The host arrays of one pass over `seqs` (pass `step` of a multi-step decode: every position + step).

    `tokens`, `rows`, `pages` are the program's static sizes per group (T, R, P); the caller chose them large
    enough. Padding token places write nowhere (their page id is out of range, so the write is dropped), and
    padding rows have no tokens. `vocab`: the model's vocabulary (the width of the rows' allowed-token masks,
    0: no row may be constrained). Only a pass with a constrained sampling row carries `allowed` (its rows'
    words, every other row all ones); without one it is left out (the engine passes its cached all-ones array).

    A row whose slot has a min_tokens ban (`PageTables.ban`) and whose draw takes a position below its end has
    its stop ids' bits cleared (unless that leaves a constrained row nothing: the grammar's end wins), so the
    pass carries `allowed` too; likewise only a pass with a logit_bias row carries the bias tables
    (`BIAS_FIELDS`)."""
    g_n, t_n, r_n, spg = tables.groups, tokens, rows, tables.slots_per_group
    ms = tables.max_slots

    def banned(q: SeqStep) -> np.ndarray | None:
        ban = tables.ban[q.slot]
        return ban[0] if q.sample and ban is not None and q.start + step + q.num_tokens < ban[1] else None

    shapes = abstract_inputs(g_n, t_n, r_n, pages, ms, vocab)
    constrained = any(q.sample and (q.allowed is not None or banned(q) is not None) for q in seqs)
    biased = any(q.sample and tables.bias[q.slot] is not None for q in seqs)
    left_out = ({} if constrained else {ALLOWED_FIELD: 0}) | ({} if biased else dict.fromkeys(BIAS_FIELDS, 0))
    a = {n: np.zeros(shape, dt) for n, (shape, dt) in shapes.items() if n not in left_out}
    if constrained:
        shape, dt = shapes[ALLOWED_FIELD]
        a[ALLOWED_FIELD] = np.full(shape, np.iinfo(np.uint32).max, dt)
    if biased:
        a[BIAS_IDS][:] = BIAS_PAD
    a["from_last"][:] = -1
    a["token_slot"][:] = ms
    a["write_page"][:] = tables.pages_per_group
    ring = tables.ring_pages
    a["ring_write_page"][:] = spg * ring  # past the group's window pool: dropped
    a["sampling.slot"][:] = ms
    a["next_token"][:] = -1
    params = {n: a[f"{PARAMS}.{n}"] for n in ROW_DTYPES}
    for name, column in params.items():  # rows that do not sample: the neutral params
        column[:] = row_value(NEUTRAL, name)
    fill_t = np.zeros(g_n, np.int64)
    fill_r = np.zeros(g_n, np.int64)
    out_rows, out_places = [], []
    any_sampled = any_filtered = any_top = any_prompt = any_adjusted = False
    for q in seqs:
        g = q.slot // spg
        r, t0 = int(fill_r[g]), int(fill_t[g])
        toks = np.asarray(q.tokens, np.int32).reshape(-1)
        decode = toks.size == 0
        n = 1 if decode else toks.size
        start = q.start + step
        pos = np.arange(start, start + n)
        sl = slice(g * t_n + t0, g * t_n + t0 + n)
        if decode:
            a["from_last"][sl] = q.slot
        else:
            a["tokens"][sl] = toks
        a["positions"][sl] = pos
        a["token_slot"][sl] = q.slot
        a["write_page"][sl] = tables.table[q.slot, pos // page_size]
        a["write_offset"][sl] = pos % page_size
        ring_base = (q.slot % spg) * ring  # the slot's ring in its group's window pool
        if ring:
            a["ring_write_page"][sl] = ring_base + (pos // page_size) % ring
        row = g * r_n + r
        kv_len = start + n
        a["kv_lens"][row] = kv_len
        a["page_indices"][row] = tables.table[q.slot, :pages]
        if ring:
            a["ring_page_indices"][row] = ring_base + np.arange(pages) % ring
        a["cu_q_lens"][g * (r_n + 1) + r + 1] = t0 + n
        a["logit_index"][row] = t0 + n - 1
        if q.prompt_logprobs and not decode:
            any_prompt = True
            a["next_token"][row] = q.next_token
        if q.sample:
            sp = tables.sampling[q.slot]
            a["sampling.slot"][row] = q.slot
            a["sampling.position"][row] = kv_len
            for name, column in params.items():
                column[row] = row_value(sp, name)
            any_sampled |= sp.temperature > 0
            any_filtered |= sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0)
            bias = tables.bias[q.slot]
            any_adjusted |= bias is not None or sp.presence_penalty != 0 or sp.frequency_penalty != 0
            if bias is not None:
                a[BIAS_IDS][row], a[BIAS_VALUES][row] = bias
            any_top |= q.top_logprobs
            if q.allowed is not None:
                words = np.asarray(q.allowed, np.uint32).reshape(-1)
                if words.size != a[ALLOWED_FIELD].shape[1]:
                    raise ValueError(f"slot {q.slot}: an allowed-token mask of {words.size} words, the step's "
                                     f"masks have {a[ALLOWED_FIELD].shape[1]} (vocabulary {vocab})")
                a[ALLOWED_FIELD][row] = words
            ban = banned(q)
            if ban is not None:
                kept = a[ALLOWED_FIELD][row] & ~ban
                if kept.any() or q.allowed is None:
                    a[ALLOWED_FIELD][row] = kept
        fill_t[g] += n
        fill_r[g] += 1
        out_rows.append(row)
        out_places.append(g * t_n + t0)
    for g in range(g_n):  # padding rows repeat the group's last offset (no tokens)
        base = g * (r_n + 1)
        r_live = int(fill_r[g])
        a["cu_q_lens"][base + r_live + 1: base + r_n + 1] = fill_t[g]
        a["num_seqs"][g] = r_live
    a["reset"][list(reset)] = True
    a["any_sampled"] = np.asarray(any_sampled)
    a["any_filtered"] = np.asarray(any_filtered)
    a["any_adjusted"] = np.asarray(any_adjusted)
    a["any_top_logprobs"] = np.asarray(any_top)
    a["any_prompt_logprobs"] = np.asarray(any_prompt)
    return HostStep(a, out_rows, out_places)
