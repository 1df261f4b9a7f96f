"""Checkpoint format, writer and reader: round trips, partial reads, sharded loads and every bad-input path.

Uses a tiny random Llama (a few KB) written with `CheckpointWriter`; the demo checkpoint only where the
real model matters (1-device vs 2x2 mesh equality).
"""

from __future__ import annotations

import json
import math
import pickle
import re
import shutil
import threading
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest

from raydeploy.checkpoint.format import INDEX_FILE, PAD_KEY, CheckpointError
from raydeploy.checkpoint.reader import CheckpointReader, LoadStats, merge_intervals
from raydeploy.checkpoint.writer import CheckpointWriter, parse_size
from raydeploy.model.sharding import build_mesh, merge_rules
from raydeploy.model.spec import LlamaConfig, param_specs, stacked_param_specs

TINY_HF = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def tiny_params(seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    cfg = LlamaConfig.from_hf_dict(TINY_HF)
    return {n: rng.standard_normal(s.shape).astype(dtype) for n, s in param_specs(cfg).items()}


def stacked(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-layer tensors -> `layers.x` [L, ...], as the converters store them (independently of the writer)."""
    cfg = LlamaConfig.from_hf_dict(TINY_HF)
    return {n: np.stack([params[f"layers.{i}.{n[len('layers.'):]}"] for i in range(cfg.num_layers)])
            if n.startswith("layers.") else params[n] for n in stacked_param_specs(cfg)}


def write_tiny(dst: Path, params: dict[str, np.ndarray] | None = None, **writer_kw) -> Path:
    params = tiny_params() if params is None else params
    with CheckpointWriter(dst, **writer_kw) as w:
        for n, a in params.items():
            w.add(n, a)
        w.close(config=TINY_HF, extra_files={"tokenizer.json": b"{}"})
    return dst


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    # small shards and checksum blocks so that several files and partial blocks are exercised
    return write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", shard_size_bytes=4096, block_bytes=256)


def tiny_specs():
    return param_specs(LlamaConfig.from_hf_dict(TINY_HF))


def unpack_shard(path: Path) -> dict:
    from flax.serialization import msgpack_restore

    return msgpack_restore(path.read_bytes())


# ---------------------------------------------------------------- format and round trip

def test_round_trip_files_are_flax_msgpack_and_aligned(tiny_ckpt):
    params = tiny_params()
    r = CheckpointReader(tiny_ckpt)
    assert len(r.index.files) > 1  # 4 KB shards
    seen = {}
    for fname in r.index.files:
        d = unpack_shard(tiny_ckpt / fname)
        d.pop(PAD_KEY, None)
        seen.update(d)
        # plain msgpack reads it too (flax ndarrays are ext type 1)
        raw = msgpack.unpackb((tiny_ckpt / fname).read_bytes(), strict_map_key=False)
        assert all(isinstance(v, msgpack.ExtType) and v.code == 1 for k, v in raw.items() if k != PAD_KEY)
    assert set(seen) == set(params)
    for n, a in params.items():
        np.testing.assert_array_equal(seen[n], a)
        np.testing.assert_array_equal(r.read_tensor(n), a)
        e = r.index.tensors[n]
        assert e.offset % 64 == 0
        # the index's offset/length point at exactly the raw bytes
        with open(tiny_ckpt / e.file, "rb") as f:
            f.seek(e.offset)
            assert f.read(e.length) == a.tobytes()
    assert LlamaConfig.from_hf_dict(r.hf_config).num_layers == 2
    assert r.index.total_bytes == sum(a.nbytes for a in params.values())


def test_chunked_array_matches_flax_layout(tmp_path):
    """Arrays above the chunk limit are written the way flax chunks them; both readers agree."""
    params = tiny_params(1)
    d = write_tiny(tmp_path / "c", params, max_chunk_bytes=1000, block_bytes=128)
    r = CheckpointReader(d)
    emb = r.index.tensors["embed.embedding"]
    assert len(emb.segments) > 1
    flax_view = unpack_shard(d / emb.file)
    np.testing.assert_array_equal(flax_view["embed.embedding"], params["embed.embedding"])
    np.testing.assert_array_equal(r.read_tensor("embed.embedding"), params["embed.embedding"])
    mesh = build_mesh({"fsdp": 2, "tp": 2})
    loaded, _ = r.load(tiny_specs(), mesh, merge_rules({}), progress=False)
    for n, a in params.items():
        np.testing.assert_array_equal(np.asarray(loaded[n]), a)


def test_bfloat16_round_trip_and_cast(tmp_path):
    import ml_dtypes

    params = tiny_params(2, dtype="float32")
    bf = {n: a.astype(ml_dtypes.bfloat16) for n, a in params.items()}
    r = CheckpointReader(write_tiny(tmp_path / "bf", bf))
    assert r.index.tensors["final_norm.scale"].dtype == "bfloat16"
    loaded, _ = r.load(tiny_specs(), build_mesh({"tp": 1}, devices=_devices()[:1]), merge_rules({}),
                       dtype="float32", progress=False)
    assert loaded["final_norm.scale"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(loaded["layers.1.mlp.up_proj.kernel"]),
                                  bf["layers.1.mlp.up_proj.kernel"].astype(np.float32))


def _devices():
    import jax

    return jax.devices()


def test_fingerprint_stable_and_sensitive(tiny_ckpt, tmp_path):
    a = CheckpointReader(tiny_ckpt).fingerprint()
    assert a == CheckpointReader(tiny_ckpt).fingerprint()
    other = write_tiny(tmp_path / "o", tiny_params(5), shard_size_bytes=4096, block_bytes=256)
    assert CheckpointReader(other).fingerprint() != a


def test_parse_size():
    assert parse_size("1GB") == 10**9
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("4096") == 4096
    with pytest.raises(CheckpointError, match="'lots'"):
        parse_size("lots")


# ---------------------------------------------------------------- sharded loads and byte accounting

@pytest.mark.parametrize("threads", [1, 3])  # 1: read in the calling thread, no pool
@pytest.mark.parametrize("use_mmap", [True, False])
def test_load_sharded_equals_single_device(tiny_ckpt, use_mmap, threads):
    params = tiny_params()
    r = CheckpointReader(tiny_ckpt)
    rules = merge_rules({})
    mesh = build_mesh({"fsdp": 2, "tp": 2})
    loaded, stats = r.load(tiny_specs(), mesh, rules, threads=threads, progress=False, use_mmap=use_mmap)
    assert isinstance(stats, LoadStats) and stats.tensors == len(params)
    assert stats.to_dict()["bytes_read"] == r.index.total_bytes  # one process holds every device
    for n, a in params.items():
        arr = loaded[n]
        np.testing.assert_array_equal(np.asarray(arr), a)
        assert tuple(arr.sharding.mesh.shape.values()) == (2, 2)
    # vocab over tp, embed over fsdp: each device holds a quarter of the embedding
    emb = loaded["embed.embedding"]
    assert {s.data.shape for s in emb.addressable_shards} == {(32, 8)}
    for s in emb.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), params["embed.embedding"][s.index])


@pytest.mark.parametrize("use_mmap", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_copied_slices_with_rows_straddling_blocks(tmp_path, use_mmap, dtype):
    """Column slices and dtype casts are copied row by row as blocks are verified: rows that straddle
    checksum blocks (100-byte blocks, 64- and 128-byte rows) still land whole in every device's slice."""
    import ml_dtypes

    params = {n: a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype) for n, a in tiny_params(3).items()}
    r = CheckpointReader(write_tiny(tmp_path / dtype, params, shard_size_bytes=4096, block_bytes=100))
    loaded, stats = r.load(tiny_specs(), build_mesh({"fsdp": 2, "tp": 2}), merge_rules({}), threads=2,
                           progress=False, use_mmap=use_mmap)
    assert stats.bytes_read == r.index.total_bytes
    for n, a in params.items():
        assert loaded[n].dtype == np.float32
        for shard in loaded[n].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), a.astype(np.float32)[shard.index], err_msg=n)


def _mapped_ranges(ckpt: Path) -> dict[str, list[tuple[int, int]]]:
    """Address ranges of this process's mappings of the checkpoint's files, per file name."""
    maps: dict[str, list[tuple[int, int]]] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 6 and fields[5].startswith(str(ckpt)):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            maps.setdefault(Path(fields[5]).name, []).append((lo, hi))
    return maps


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_tensors_of_one_layout_at_differently_aligned_offsets(tmp_path, monkeypatch):
    """The reader works out each (shape, sharding, split) layout once and reuses it for every layer, but
    whether a slice can be aliased depends on where the tensor starts in its file: with every other tensor
    written 16 bytes off the 64-byte grid (as another writer might), layer 0's and layer 1's kernels of one
    kind start differently aligned, all load equal, and the aligned ones still alias the mapped file."""
    from raydeploy.checkpoint import writer

    pad_for = writer.CheckpointWriter._pad_for

    def shifted(self: writer.CheckpointWriter, head_bytes: int) -> None:
        pad_for(self, head_bytes)
        if len(self._entries) % 2:  # a 16-byte padding entry: the tensor's bytes start 16 past the grid
            self._f.write(msgpack.packb(PAD_KEY) + b"\xc4\x06" + bytes(6))
            self._count += 1

    monkeypatch.setattr(writer.CheckpointWriter, "_pad_for", shifted)
    params = tiny_params(5)
    ckpt = write_tiny(tmp_path / "a16", params)
    r = CheckpointReader(ckpt)
    pair = ["layers.0.mlp.down_proj.kernel", "layers.1.mlp.down_proj.kernel"]
    assert sorted(r.index.tensors[n].offset % 64 for n in pair) == [0, 16]
    assert set(msgpack.unpackb((ckpt / "shard-00000.msgpack").read_bytes(), raw=False)) == set(params) | {PAD_KEY}
    rules = merge_rules({"embed": None, "q_heads": None, "kv_heads": None})  # dim 0 (vocab, mlp) over tp
    mesh = build_mesh({"tp": 2}, devices=_devices()[:2])
    for use_mmap in (True, False):
        loaded, _ = r.load(tiny_specs(), mesh, rules, progress=False, use_mmap=use_mmap)
        for n, a in params.items():
            for shard in loaded[n].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), a[shard.index], err_msg=n)
        if use_mmap:
            aligned = next(n for n in pair if r.index.tensors[n].offset % 64 == 0)
            file_maps = _mapped_ranges(ckpt)[r.index.tensors[aligned].file]
            for shard in loaded[aligned].addressable_shards:
                assert any(lo <= shard.data.unsafe_buffer_pointer() < hi for lo, hi in file_maps), aligned


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_float32_rows_alias_the_mapped_file(tiny_ckpt):
    """Whole-row float32 slices are handed to jax as views of the mapped shard file: nothing is copied."""
    r = CheckpointReader(tiny_ckpt)
    rules = merge_rules({"embed": None, "q_heads": None, "kv_heads": None})  # dim 0 (vocab, mlp) over tp
    loaded, _ = r.load(tiny_specs(), build_mesh({"tp": 2}, devices=_devices()[:2]), rules, progress=False)
    maps = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 6 and fields[5].startswith(str(tiny_ckpt)):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            maps.setdefault(Path(fields[5]).name, []).append((lo, hi))
    for name in ("embed.embedding", "layers.0.mlp.down_proj.kernel", "final_norm.scale"):
        file_maps = maps.get(r.index.tensors[name].file, [])
        for shard in loaded[name].addressable_shards:
            ptr = shard.data.unsafe_buffer_pointer()
            assert any(lo <= ptr < hi for lo, hi in file_maps), name


def test_partial_reads_cover_exactly_the_needed_rows(tiny_ckpt):
    """A process holding one of 4 devices reads only its blocks: less than the total, and exactly the
    block-widened union of its devices' row ranges."""
    r = CheckpointReader(tiny_ckpt)
    specs = tiny_specs()
    # only tp sharding: vocab and mlp dims over tp=4 (2 KV heads cannot split 4 ways: replicate heads)
    rules = merge_rules({"embed": None, "q_heads": None, "kv_heads": None})
    mesh = build_mesh({"tp": 4})
    dev = mesh.devices.flat[1]
    ranges = r.byte_ranges(specs, mesh, rules, devices=[dev])
    bb = r.index.block_bytes
    expected = 0
    for name, spec in specs.items():
        e = r.index.tensors[name]
        if spec.logical_axes[0] in ("vocab", "mlp"):  # dim 0 sharded over tp=4: rows of device 1
            rows = spec.shape[0] // 4
            a, b = 1 * rows * e.row_bytes, 2 * rows * e.row_bytes
        else:
            a, b = 0, e.length
        a, b = (a // bb) * bb, min(-(-b // bb) * bb, e.length)
        assert ranges[name] == [(a, b)], name
        expected += b - a
    got = sum(b - a for rs in ranges.values() for a, b in rs)
    assert got == expected
    assert got < r.index.total_bytes
    # all four devices together need everything once
    assert sum(b - a for rs in r.byte_ranges(specs, mesh, rules).values() for a, b in rs) == r.index.total_bytes


def test_merge_intervals():
    assert merge_intervals([(4, 8), (0, 4), (10, 12), (11, 13)]) == [(0, 8), (10, 13)]
    assert merge_intervals([(0, 5), (0, 5)]) == [(0, 5)]


@pytest.mark.model
def test_demo_one_device_equals_2x2_mesh(demo_checkpoint):
    import jax

    r = CheckpointReader(demo_checkpoint)
    specs = r.param_specs()
    rules = merge_rules({"q_heads": None, "kv_heads": None, "cache_kv_heads": None})
    one, s1 = r.load(specs, build_mesh({"tp": 1}, devices=jax.devices()[:1]), rules, progress=False)
    four, s4 = r.load(specs, build_mesh({"dp": 2, "tp": 2}), rules, progress=False, use_mmap=False)
    assert s1.bytes_read == s4.bytes_read == r.index.total_bytes
    for n in ("embed.embedding", "layers.0.attn.q_proj.kernel", "layers.29.mlp.gate_proj.kernel",
              "layers.7.mlp.down_proj.kernel", "final_norm.scale"):
        np.testing.assert_array_equal(np.asarray(one[n]), np.asarray(four[n]))
    assert four["layers.3.mlp.gate_proj.kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    assert len(one) == len(four) == len(specs)


# ---------------------------------------------------------------- bad input

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_index(d: Path, fn) -> None:
    idx = json.loads((d / INDEX_FILE).read_text())
    fn(idx)
    (d / INDEX_FILE).write_text(json.dumps(idx))


def test_error_is_picklable_and_names_things():
    e = CheckpointError("checksum mismatch", "/x/shard-00000.msgpack", tensor="layers.0.mlp.up_proj.kernel")
    e2 = pickle.loads(pickle.dumps(e))
    assert isinstance(e2, ValueError) and str(e2) == str(e)
    assert "shard-00000.msgpack" in str(e2) and "layers.0.mlp.up_proj.kernel" in str(e2)


def test_missing_dir_index_and_config(tmp_path, tiny_ckpt):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="index.json is missing"):
        CheckpointReader(tmp_path / "empty")
    d = _copy(tiny_ckpt, tmp_path / "nocfg")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        CheckpointReader(d)


def test_bad_index_json_and_version(tmp_path, tiny_ckpt):
    d = _copy(tiny_ckpt, tmp_path / "badjson")
    (d / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json.*not valid JSON"):
        CheckpointReader(d)
    d = _copy(tiny_ckpt, tmp_path / "ver")
    _edit_index(d, lambda i: i.update(version=99))
    with pytest.raises(CheckpointError, match="version 99 is not supported"):
        CheckpointReader(d)


def test_index_path_escaping_checkpoint_dir(tmp_path, tiny_ckpt):
    d = _copy(tiny_ckpt, tmp_path / "esc")

    def escape(i):
        i["tensors"]["final_norm.scale"]["file"] = "../evil.msgpack"
    _edit_index(d, escape)
    with pytest.raises(CheckpointError, match=r"tensor final_norm.scale.*'\.\./evil\.msgpack' escapes"):
        CheckpointReader(d)
    d2 = _copy(tiny_ckpt, tmp_path / "esc2")
    _edit_index(d2, lambda i: i["files"].update({"/etc/passwd": 10}))
    with pytest.raises(CheckpointError, match="escapes the checkpoint directory"):
        CheckpointReader(d2)


def test_offset_beyond_file_size(tmp_path, tiny_ckpt):
    d = _copy(tiny_ckpt, tmp_path / "off")

    def push(i):
        e = i["tensors"]["layers.1.mlp.down_proj.kernel"]
        e["offset"] = i["files"][e["file"]] - 8
    _edit_index(d, push)
    with pytest.raises(CheckpointError, match=r"tensor layers\.1\.mlp\.down_proj\.kernel: bytes .* beyond the end"):
        CheckpointReader(d)


def test_truncated_shard_file(tmp_path, tiny_ckpt):
    d = _copy(tiny_ckpt, tmp_path / "trunc")
    shard = d / "shard-00001.msgpack"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"shard-00001\.msgpack.*index declares"):
        CheckpointReader(d)


def test_checksum_mismatch_names_file_and_tensor(tmp_path, tiny_ckpt):
    d = _copy(tiny_ckpt, tmp_path / "crc")
    r0 = CheckpointReader(d)
    e = r0.index.tensors["layers.1.attn.k_proj.kernel"]
    data = bytearray((d / e.file).read_bytes())
    data[e.offset + e.length - 1] ^= 0xFF  # last block of the tensor
    (d / e.file).write_bytes(bytes(data))
    r = CheckpointReader(d)  # sizes still match: only reading finds it
    mesh = build_mesh({"tp": 1}, devices=_devices()[:1])
    for use_mmap in (True, False):
        for threads in (1, 2):
            with pytest.raises(CheckpointError, match=rf"file .*{e.file}, tensor layers\.1\.attn\.k_proj\.kernel: "
                                                      r"checksum mismatch in block \d+"):
                r.load(tiny_specs(), mesh, merge_rules({}), progress=False, use_mmap=use_mmap, threads=threads)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        r.read_tensor("layers.1.attn.k_proj.kernel")
    # verify=False skips the check (the caller asked for it)
    r.load(tiny_specs(), mesh, merge_rules({}), progress=False, verify=False)


def test_missing_extra_shape_and_dtype_against_specs(tmp_path):
    mesh = build_mesh({"tp": 1}, devices=_devices()[:1])
    rules = merge_rules({})
    params = tiny_params()
    missing = dict(params)
    missing.pop("layers.1.mlp_norm.scale")
    r = CheckpointReader(write_tiny(tmp_path / "miss", missing))
    with pytest.raises(CheckpointError, match=r"lacks tensor\(s\) the model needs: layers\.1\.mlp_norm\.scale"):
        r.load(tiny_specs(), mesh, rules, progress=False)

    extra = dict(params, **{"layers.2.mlp_norm.scale": np.ones(16, np.float32)})
    r = CheckpointReader(write_tiny(tmp_path / "extra", extra))
    with pytest.raises(CheckpointError, match=r"does not use: layers\.2\.mlp_norm\.scale"):
        r.load(tiny_specs(), mesh, rules, progress=False)

    shaped = dict(params, **{"layers.0.attn.o_proj.kernel": np.zeros((4, 4, 8), np.float32)})
    r = CheckpointReader(write_tiny(tmp_path / "shape", shaped))
    with pytest.raises(CheckpointError, match=r"tensor layers\.0\.attn\.o_proj\.kernel: shape \[4, 4, 8\] in the "
                                              r"checkpoint, the model expects \[4, 4, 16\]"):
        r.load(tiny_specs(), mesh, rules, progress=False)

    ints = dict(params, **{"final_norm.scale": np.ones(16, np.int8)})
    r = CheckpointReader(write_tiny(tmp_path / "int", ints))
    with pytest.raises(CheckpointError, match=r"tensor final_norm\.scale: dtype int8 is not a float type"):
        r.load(tiny_specs(), mesh, rules, progress=False)


def test_index_entry_inconsistent_length_and_crc_count(tmp_path, tiny_ckpt):
    d = _copy(tiny_ckpt, tmp_path / "len")
    _edit_index(d, lambda i: i["tensors"]["final_norm.scale"].update(shape=[17]))
    with pytest.raises(CheckpointError, match=r"final_norm\.scale: length is 64 bytes but shape \[17\]"):
        CheckpointReader(d)
    d = _copy(tiny_ckpt, tmp_path / "crcn")
    _edit_index(d, lambda i: i["tensors"]["final_norm.scale"].update(crc32=[]))
    with pytest.raises(CheckpointError, match=r"final_norm\.scale: crc32 must list 1 block checksums"):
        CheckpointReader(d)


def test_writer_refuses_existing_checkpoint_and_duplicates(tiny_ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        CheckpointWriter(tiny_ckpt)
    w = CheckpointWriter(tmp_path / "dup")
    w.add("a", np.zeros(3, np.float32))
    with pytest.raises(CheckpointError, match="tensor written twice: a"):
        w.add("a", np.zeros(3, np.float32))
    with pytest.raises(CheckpointError, match="reserved"):
        w.add(PAD_KEY, np.zeros(3, np.float32))
    w.abort()
    assert not (tmp_path / "dup" / INDEX_FILE).exists()


def test_unsharded_divisibility_error_before_reading(tiny_ckpt):
    r = CheckpointReader(tiny_ckpt)
    from raydeploy.config import ConfigError

    # 4 q heads over tp=... a mesh of 3 is not available; 2 kv heads over tp=4 is not divisible
    with pytest.raises(ConfigError, match=r"layers\.0\.attn\.k_proj\.kernel.*kv_heads.*not divisible"):
        r.load(tiny_specs(), build_mesh({"tp": 4}), merge_rules({}), progress=False)


# ---------------------------------------------------------------- checkpoint references and the demo cache

def test_resolve_checkpoint_errors(tmp_path, tiny_ckpt):
    from raydeploy.checkpoint.demo import resolve_checkpoint

    assert resolve_checkpoint(str(tiny_ckpt)) == tiny_ckpt
    with pytest.raises(CheckpointError, match="'/no/such/ckpt' does not exist"):
        resolve_checkpoint("/no/such/ckpt")
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match="index.json is missing"):
        resolve_checkpoint(str(tmp_path / "plain"))
    with pytest.raises(CheckpointError, match="unknown demo model 'gpt-5'"):
        resolve_checkpoint("demo:gpt-5")


def test_demo_cache_converts_once_under_lock(tmp_path, monkeypatch):
    """Concurrent resolvers: one converts (into a temp dir, renamed when complete), the others wait."""
    import raydeploy.checkpoint.convert_gguf as cg
    from raydeploy.checkpoint import demo

    monkeypatch.setenv("RAYDEPLOY_CACHE", str(tmp_path / "cache"))
    calls = []
    started = threading.Event()

    def fake_convert(src, dst, **kw):
        calls.append(dst)
        started.set()
        threading.Event().wait(0.3)  # hold the lock while the others arrive
        write_tiny(Path(dst))

    monkeypatch.setattr(cg, "convert_gguf", fake_convert)
    results, errors = [], []

    def resolve():
        try:
            results.append(demo.resolve_checkpoint("demo:smollm2-135m-instruct", lock_timeout_s=30))
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(calls) == 1
    final = tmp_path / "cache" / "smollm2-135m-instruct"
    assert results == [final] * 3 and (final / INDEX_FILE).is_file()
    assert calls[0] != final  # converted elsewhere, then renamed into place
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name]


def test_demo_cache_lock_timeout(tmp_path, monkeypatch):
    import fcntl
    import os

    from raydeploy.checkpoint import demo

    monkeypatch.setenv("RAYDEPLOY_CACHE", str(tmp_path))
    fd = os.open(tmp_path / ".smollm2-135m-instruct.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(CheckpointError, match="timed out after 0 s waiting for another process"):
            demo.resolve_checkpoint("demo:smollm2-135m-instruct", lock_timeout_s=0.3)
    finally:
        os.close(fd)


def test_demo_failed_conversion_leaves_no_checkpoint(tmp_path, monkeypatch):
    import raydeploy.checkpoint.convert_gguf as cg
    from raydeploy.checkpoint import demo

    monkeypatch.setenv("RAYDEPLOY_CACHE", str(tmp_path))

    def broken(src, dst, **kw):
        (Path(dst) / "shard-00000.msgpack").write_bytes(b"partial")
        raise CheckpointError("disk full", str(dst))

    monkeypatch.setattr(cg, "convert_gguf", broken)
    with pytest.raises(CheckpointError, match="disk full"):
        demo.resolve_checkpoint("demo:smollm2-135m-instruct")
    assert [p.name for p in tmp_path.iterdir()] == [".smollm2-135m-instruct.lock"]


# ---------------------------------------------------------------- multi-process (real jax.distributed)

def test_multi_process_load_reads_only_local_rows(tiny_ckpt):
    """Two processes with two CPU devices each share one tp=4 mesh: each reads only its devices' rows
    (less than the whole checkpoint, exactly its planned byte ranges) and gets correct shards."""
    results = _run_two_processes(tiny_ckpt, "tp4")
    assert results[0]["fingerprint"] == results[1]["fingerprint"]


def test_multi_process_fsdp_tp_split_reads_only_the_host_slices(tmp_path):
    """Two processes (hosts) of fsdp=2 x tp=2 on a checkpoint split for that mesh, checksum blocks of one
    element: each reads exactly the bytes of its devices' slices (jax's index map, element by element)."""
    ckpt = write_split(tmp_path / "split", block_bytes=4)
    results = _run_two_processes(ckpt, "fsdp_tp")
    norms = sum(e.length for n, e in CheckpointReader(ckpt).index.tensors.items() if n.endswith(".scale"))
    total = results[0]["total_bytes"]
    assert results[0]["bytes_read"] == results[1]["bytes_read"] == (total - norms) // 2 + norms


def _run_two_processes(ckpt: Path, mode: str) -> list[dict]:
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).with_name("checkpoint_mp_worker.py")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    procs = [subprocess.Popen([sys.executable, str(worker), str(ckpt), f"127.0.0.1:{port}", "2", str(i), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    total = results[0]["total_bytes"]
    for res in results:
        assert res["local_devices"] == 2
        assert res["bytes_read"] == res["planned_bytes"] == res["expected_bytes"] < total
        assert res["shards_checked"] == 2 * len(tiny_specs())
    return results


# ---------------------------------------------------------------- format version 2: tensors stored split

FSDP_TP = {"fsdp": 2, "tp": 2}
HEADS_REPLICATED = {"q_heads": None, "kv_heads": None}  # as in configs/cpu-fsdp.yaml


def split_plan_for(mesh_shape: dict[str, int], overrides: dict) -> dict[str, tuple[int, int]]:
    from raydeploy.checkpoint.layout import SplitPlan, column_splits

    return SplitPlan.build(LlamaConfig.from_hf_dict(TINY_HF), column_splits(mesh_shape, merge_rules(overrides))).splits


def write_split(dst: Path, params: dict[str, np.ndarray] | None = None, plan: dict | None = None,
                **writer_kw) -> Path:
    params = tiny_params() if params is None else params
    plan = split_plan_for(FSDP_TP, HEADS_REPLICATED) if plan is None else plan
    with CheckpointWriter(dst, **writer_kw) as w:
        for n, a in params.items():
            w.add(n, a, splits=plan.get(n))
        w.close(config=TINY_HF)
    return dst


@pytest.fixture(scope="module")
def split_ckpt(tmp_path_factory) -> Path:
    return write_split(tmp_path_factory.mktemp("split") / "tiny", shard_size_bytes=4096, block_bytes=256)


def test_split_plan_cuts_the_column_dims_the_mesh_shards():
    plan = split_plan_for(FSDP_TP, HEADS_REPLICATED)
    # embed -> fsdp, mlp and vocab -> tp; heads replicated: q/k/v are cut along dim 0 only (rows: no split)
    assert plan["embed.embedding"] == ((1, 2),) and plan["lm_head.kernel"] == ((1, 2),)
    assert plan["layers.0.attn.o_proj.kernel"] == ((2, 2),)
    assert plan["layers.1.mlp.gate_proj.kernel"] == plan["layers.1.mlp.down_proj.kernel"] == ((1, 2),)
    assert "layers.0.attn.q_proj.kernel" not in plan and "final_norm.scale" not in plan
    # heads over tp=2 too: q is then cut along its heads dim; k/v (2 KV heads) as well
    assert split_plan_for(FSDP_TP, {})["layers.0.attn.q_proj.kernel"] == ((1, 2),)
    # tp=4 over mlp and vocab only: gate/up and the head are cut into 4 column parts; down_proj's mlp is its
    # first dim (rows: no split); dp only: nothing to split
    tp4 = split_plan_for({"tp": 4}, {"embed": None, "q_heads": None, "kv_heads": None})
    assert tp4["layers.0.mlp.up_proj.kernel"] == tp4["lm_head.kernel"] == ((1, 4),)
    assert "layers.0.mlp.down_proj.kernel" not in tp4 and "embed.embedding" not in tp4
    assert split_plan_for({"dp": 2}, {}) == {}


def test_split_round_trip_index_and_flax_view(split_ckpt):
    from flax.serialization import msgpack_restore

    params = tiny_params()
    r = CheckpointReader(split_ckpt)
    assert r.index.version == 3 and json.loads((split_ckpt / INDEX_FILE).read_text())["version"] == 3
    e = r.index.tensors["layers.0.attn.o_proj.kernel"]
    assert e.splits == ((2, 2),) and e.shape == (4, 4, 16) and e.row_shape == (4, 8) and e.stored_rows == 8
    assert json.loads((split_ckpt / INDEX_FILE).read_text())["tensors"][e.name]["split"] == [2, 2]
    for n, a in params.items():
        np.testing.assert_array_equal(r.read_tensor(n), a, err_msg=n)
        e = r.index.tensors[n]
        stored = msgpack_restore((split_ckpt / e.file).read_bytes())[n]  # flax sees the stacked pieces
        want = np.stack(np.split(a, e.splits[0][1], axis=e.splits[0][0])) if e.splits else a
        np.testing.assert_array_equal(stored, want, err_msg=n)


@pytest.mark.parametrize("use_mmap", [True, False])
@pytest.mark.parametrize("mesh_shape,overrides", [
    (FSDP_TP, HEADS_REPLICATED), ({"dp": 2, "tp": 2}, HEADS_REPLICATED), ({"tp": 1}, {}),
    ({"tp": 4}, {"embed": None, "q_heads": None, "kv_heads": None}), ({"fsdp": 4}, {})])
def test_split_checkpoint_loads_on_any_mesh(split_ckpt, use_mmap, mesh_shape, overrides):
    """Stored split for fsdp=2 x tp=2, read on meshes that cut the pieces differently (whole tensors,
    rows only, four column parts): every device shard equals the tensor's slice."""
    import ml_dtypes

    params = tiny_params()
    r = CheckpointReader(split_ckpt)
    devices = _devices()[:math.prod(mesh_shape.values())]
    for dtype in ("float32", "bfloat16"):
        loaded, stats = r.load(tiny_specs(), build_mesh(mesh_shape, devices=devices), merge_rules(overrides),
                               dtype=dtype, threads=2, progress=False, use_mmap=use_mmap)
        assert stats.bytes_read == r.index.total_bytes  # one process holds every device
        for n, a in params.items():
            want = a.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else a
            for shard in loaded[n].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=n)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_split_checkpoint_on_its_mesh_is_copied_nowhere(split_ckpt, tiny_ckpt):
    """On the mesh it was split for, every float32 device shard of every tensor is a view of the mapped
    shard file; the same mesh on the unsplit checkpoint must copy the column slices."""
    mesh, rules = build_mesh(FSDP_TP), merge_rules(HEADS_REPLICATED)

    def aliased(ckpt: Path) -> dict[str, bool]:
        r = CheckpointReader(ckpt)
        loaded, _ = r.load(tiny_specs(), mesh, rules, progress=False)
        maps = []
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split()
            if len(fields) == 6 and fields[5].startswith(str(ckpt)):
                maps.append(tuple(int(x, 16) for x in fields[0].split("-")))
        return {n: all(any(lo <= s.data.unsafe_buffer_pointer() < hi for lo, hi in maps)
                       for s in arr.addressable_shards) for n, arr in loaded.items()}

    assert all(aliased(split_ckpt).values())
    plain = aliased(tiny_ckpt)
    assert not plain["layers.0.mlp.gate_proj.kernel"] and not plain["embed.embedding"]


# ---------------------------------------------- stacked layer tensors, split along two dims (version 4)

def tiny_stacked_specs():
    return stacked_param_specs(LlamaConfig.from_hf_dict(TINY_HF))


def write_stacked(dst: Path, seed: int = 0, **writer_kw) -> Path:
    """The tiny model stacked over its layers, split for fsdp=2 x tp=2 (heads replicated), every stacked
    tensor written one layer at a time through reserve / put, as the converters do."""
    from raydeploy.checkpoint.layout import SplitPlan, column_splits

    cfg = LlamaConfig.from_hf_dict(TINY_HF)
    plan = SplitPlan.build(cfg, column_splits(FSDP_TP, merge_rules(HEADS_REPLICATED)), stacked_param_specs(cfg))
    params = tiny_params(seed)
    with CheckpointWriter(dst, **writer_kw) as w:
        for n, spec in stacked_param_specs(cfg).items():
            if not n.startswith("layers."):
                w.add(n, params[n], splits=plan.splits.get(n))
                continue
            w.reserve(n, spec.shape, "float32", plan.splits.get(n))
            for i in reversed(range(cfg.num_layers)):  # in any order
                w.put(n, i, params[f"layers.{i}.{n[len('layers.'):]}"])
        w.close(config=TINY_HF)
    return dst


@pytest.fixture(scope="module")
def stacked_ckpt(tmp_path_factory) -> Path:
    return write_stacked(tmp_path_factory.mktemp("stacked") / "tiny", shard_size_bytes=4096, block_bytes=256)


def test_stacked_split_round_trip_index_and_flax_view(stacked_ckpt, tmp_path):
    """reserve / put store exactly what `add` of the whole stacked tensor stores (bytes, checksums, index);
    the MLP kernels are split along embed and mlp (format version 4), read back whole and per layer."""
    from flax.serialization import msgpack_restore

    from raydeploy.checkpoint.format import join_pieces, split_pieces

    params, want = tiny_params(), stacked(tiny_params())
    r = CheckpointReader(stacked_ckpt)
    assert r.index.version == 4 and set(r.index.tensors) == set(tiny_stacked_specs())
    e = r.index.tensors["layers.mlp.gate_proj.kernel"]
    assert e.splits == ((1, 2), (2, 2)) and e.shape == (2, 16, 32) and e.row_shape == (8, 16) and e.parts == 4
    assert json.loads((stacked_ckpt / INDEX_FILE).read_text())["tensors"][e.name]["split"] == [[1, 2], [2, 2]]
    for n, a in want.items():
        np.testing.assert_array_equal(r.read_tensor(n), a, err_msg=n)
        e = r.index.tensors[n]
        stored = msgpack_restore((stacked_ckpt / e.file).read_bytes())[n]
        np.testing.assert_array_equal(stored, split_pieces(a, e.splits) if e.splits else a, err_msg=n)
        if e.splits:
            np.testing.assert_array_equal(join_pieces(stored, e.splits), a, err_msg=n)
    for n, a in params.items():  # per-layer names read as rows of the stacked tensors
        np.testing.assert_array_equal(r.read_tensor(n), a, err_msg=n)
    with CheckpointWriter(tmp_path / "whole", shard_size_bytes=4096, block_bytes=256) as w:
        for n, a in want.items():
            w.add(n, a, splits=r.index.tensors[n].splits)
        w.close(config=TINY_HF)
    whole = CheckpointReader(tmp_path / "whole").index
    for n, e in r.index.tensors.items():
        assert (whole.tensors[n].crc32, whole.tensors[n].length) == (e.crc32, e.length), n


@pytest.mark.parametrize("use_mmap", [True, False])
@pytest.mark.parametrize("mesh_shape,overrides", [
    (FSDP_TP, HEADS_REPLICATED), ({"dp": 2, "tp": 2}, HEADS_REPLICATED), ({"tp": 1}, {}),
    ({"tp": 4}, {"embed": None, "q_heads": None, "kv_heads": None}), ({"fsdp": 4}, {}), ({"fsdp": 2, "tp": 2}, {})])
def test_stacked_checkpoint_loads_on_any_mesh(stacked_ckpt, use_mmap, mesh_shape, overrides):
    """Stacked and split along two dims for fsdp=2 x tp=2, read on meshes that cut the pieces differently:
    every device shard equals the stacked tensor's slice."""
    want = stacked(tiny_params())
    r = CheckpointReader(stacked_ckpt)
    devices = _devices()[:math.prod(mesh_shape.values())]
    loaded, stats = r.load(r.param_specs(), build_mesh(mesh_shape, devices=devices), merge_rules(overrides),
                           threads=2, progress=False, use_mmap=use_mmap)
    assert stats.bytes_read == r.index.total_bytes and stats.tensors == len(want)
    for n, a in want.items():
        for shard in loaded[n].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), a[shard.index], err_msg=n)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_stacked_checkpoint_on_its_mesh_is_copied_nowhere(stacked_ckpt):
    """On the mesh it was split for, every device shard of every stacked tensor (the MLP kernels cut on two
    dims) is a view of the mapped shard file."""
    r = CheckpointReader(stacked_ckpt)
    loaded, _ = r.load(r.param_specs(), build_mesh(FSDP_TP), merge_rules(HEADS_REPLICATED), progress=False)
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 6 and fields[5].startswith(str(stacked_ckpt)):
            maps.append(tuple(int(x, 16) for x in fields[0].split("-")))
    copied = [n for n, arr in loaded.items()
              if not all(any(lo <= s.data.unsafe_buffer_pointer() < hi for lo, hi in maps)
                         for s in arr.addressable_shards)]
    assert maps and copied == []


def test_reserve_put_errors_name_the_tensor_and_leave_no_checkpoint(tmp_path):
    name = "layers.mlp.up_proj.kernel"
    w = CheckpointWriter(tmp_path / "w")
    w.reserve(name, (2, 16, 32), "float32", [(1, 2)])
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)}: row 0: float64 \[16, 32\] does not "
                                              r"match the reserved float32 \[16, 32\]"):
        w.put(name, 0, np.zeros((16, 32)))
    with pytest.raises(CheckpointError, match=r"row 0: float32 \[32, 16\] does not match"):
        w.put(name, 0, np.zeros((32, 16), np.float32))
    w.put(name, 1, np.ones((16, 32), np.float32))
    for i in (1, 2, -1):
        with pytest.raises(CheckpointError, match=rf"row {i} is out of range \[0, 2\) or written twice"):
            w.put(name, i, np.ones((16, 32), np.float32))
    with pytest.raises(CheckpointError, match=r"tensor layers\.x: put into a tensor that was not reserved"):
        w.put("layers.x", 0, np.ones((16, 32), np.float32))
    with pytest.raises(CheckpointError, match=rf"tensor written twice: {re.escape(name)}"):
        w.add(name, np.ones((2, 16, 32), np.float32))
    with pytest.raises(CheckpointError, match=r"split into 3 parts must be >= 2 parts that divide dimension 2"):
        w.reserve("layers.y", (2, 16, 32), "float32", [(2, 3)])
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)}: reserved tensor is incomplete: rows "
                                              r"\[0\] of 2 were never put"):
        w.close(config=TINY_HF)
    assert not (tmp_path / "w" / INDEX_FILE).exists()


def test_reserved_tensor_over_the_chunk_limit_spans_segments(tmp_path):
    """A reserved tensor bigger than the msgpack chunk limit is stored in flax's chunked form; its puts land
    across the segments, and it reads back (and flax restores it) whole."""
    from flax.serialization import msgpack_restore

    a = np.random.default_rng(5).standard_normal((3, 8, 20)).astype(np.float32)
    with CheckpointWriter(tmp_path / "c", max_chunk_bytes=700, block_bytes=100) as w:
        w.reserve("layers.k", a.shape, "float32", [(2, 2)])
        for i in (2, 0, 1):
            w.put("layers.k", i, a[i])
        w.close(config=TINY_HF)
    r = CheckpointReader(tmp_path / "c")
    e = r.index.tensors["layers.k"]
    assert len(e.segments) > 1 and e.splits == ((2, 2),)
    np.testing.assert_array_equal(r.read_tensor("layers.k"), a)
    from raydeploy.checkpoint.format import split_pieces

    stored = msgpack_restore((tmp_path / "c" / e.file).read_bytes())["layers.k"]
    np.testing.assert_array_equal(stored, split_pieces(a, e.splits))


def test_multi_dim_split_needs_version_4(tmp_path, stacked_ckpt):
    name = "layers.mlp.gate_proj.kernel"
    d = _copy(stacked_ckpt, tmp_path / "v3")
    _edit_index(d, lambda idx: idx.update(version=3))
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)}: 'split' along several dimensions needs "
                                              r"format version 4 \(the index says 3\)"):
        CheckpointReader(d)
    d = _copy(stacked_ckpt, tmp_path / "order")
    _edit_index(d, lambda idx: idx["tensors"][name].update(split=[[2, 2], [1, 2]]))
    with pytest.raises(CheckpointError, match=r"split dims \[2, 1\] must be distinct and increasing"):
        CheckpointReader(d)


def _host_bytes(r: CheckpointReader, specs, mesh, rules, devices) -> int:
    """Bytes of the union of the devices' slices, counted element by element from jax's own index map."""
    from jax.sharding import NamedSharding

    from raydeploy.model.sharding import partition_spec

    total = 0
    for name, spec in specs.items():
        sharding = NamedSharding(mesh, partition_spec(spec.logical_axes, rules, dict(mesh.shape)))
        need = np.zeros(spec.shape, bool)
        for d, idx in sharding.devices_indices_map(spec.shape).items():
            if d in devices:
                need[idx] = True
        total += int(need.sum()) * r.index.tensors[name].itemsize
    return total


def test_split_partial_reads_on_fsdp_tp_read_only_the_host_bytes(tmp_path):
    """A host of fsdp=2 x tp=2 (one fsdp row: 2 devices) plans exactly the bytes of its devices' slices
    (checksum blocks of one element: no widening), half the checkpoint; unsplit, it reads more."""
    params = tiny_params()
    specs, mesh, rules = tiny_specs(), build_mesh(FSDP_TP), merge_rules(HEADS_REPLICATED)
    split = CheckpointReader(write_split(tmp_path / "s", params, block_bytes=4))
    plain = CheckpointReader(write_tiny(tmp_path / "p", params, block_bytes=4))
    for host in range(2):
        devices = list(mesh.devices[host])  # fsdp index = host, both tp devices
        need = _host_bytes(split, specs, mesh, rules, devices)
        got = sum(b - a for rs in split.byte_ranges(specs, mesh, rules, devices=devices).values() for a, b in rs)
        assert got == need
        norms = sum(e.length for n, e in split.index.tensors.items() if n.endswith(".scale"))  # replicated
        assert got == (split.index.total_bytes - norms) // 2 + norms
        plain_got = sum(b - a for rs in plain.byte_ranges(specs, mesh, rules, devices=devices).values()
                        for a, b in rs)
        assert plain_got > 1.3 * got  # column slices of unsplit tensors: whole rows (o_proj, down_proj, embedding)


def test_split_checksum_mismatch_names_file_and_tensor(tmp_path, split_ckpt):
    d = _copy(split_ckpt, tmp_path / "crc")
    e = CheckpointReader(d).index.tensors["layers.1.mlp.down_proj.kernel"]
    assert e.splits
    data = bytearray((d / e.file).read_bytes())
    data[e.offset + e.length - 1] ^= 0xFF  # the last stored row of the second piece
    (d / e.file).write_bytes(bytes(data))
    r = CheckpointReader(d)
    for mesh_shape, overrides in ((FSDP_TP, HEADS_REPLICATED), ({"tp": 1}, {})):
        mesh = build_mesh(mesh_shape, devices=_devices()[:math.prod(mesh_shape.values())])
        for use_mmap in (True, False):
            with pytest.raises(CheckpointError, match=rf"file .*{e.file}, tensor layers\.1\.mlp\.down_proj\.kernel: "
                                                      r"checksum mismatch in block \d+"):
                r.load(tiny_specs(), mesh, merge_rules(overrides), progress=False, use_mmap=use_mmap)
    with pytest.raises(CheckpointError, match=r"tensor layers\.1\.mlp\.down_proj\.kernel: checksum mismatch"):
        r.read_tensor("layers.1.mlp.down_proj.kernel")


def test_split_truncated_shard_names_the_file(tmp_path, split_ckpt):
    d = _copy(split_ckpt, tmp_path / "trunc")
    e = CheckpointReader(d).index.tensors["embed.embedding"]
    (d / e.file).write_bytes((d / e.file).read_bytes()[:e.offset + e.length // 2])
    with pytest.raises(CheckpointError, match=rf"{e.file}.*index declares"):
        CheckpointReader(d)
    # an index that agrees with the truncated file still cannot place the tensor's bytes
    _edit_index(d, lambda i: i["files"].update({e.file: e.offset + e.length // 2}))
    with pytest.raises(CheckpointError, match=r"tensor embed\.embedding: bytes .* lie beyond the end"):
        CheckpointReader(d)


def test_split_index_errors_name_the_tensor(tmp_path, split_ckpt, tiny_ckpt):
    name = "layers.0.mlp.gate_proj.kernel"
    cases = [([0, 2], r"split dim 0 must be a dimension after the first"),
             ([1, 3], r"3 parts must be >= 2 parts that divide dimension 1 \(size 32\)"),
             ([1, 1], r"must be >= 2 parts"), ("1x2", r"must be \[dim, parts\]")]
    for i, (split, msg) in enumerate(cases):
        d = _copy(split_ckpt, tmp_path / f"bad{i}")
        _edit_index(d, lambda idx, s=split: idx["tensors"][name].update(split=s))
        with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)}: .*{msg}"):
            CheckpointReader(d)
    d = _copy(tiny_ckpt, tmp_path / "v1split")
    _edit_index(d, lambda idx: idx.update(version=1, checksum={"algorithm": "crc32", "block_bytes": 256})
                or idx["tensors"][name].update(split=[1, 2]))
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)}: 'split' needs format version 2"):
        CheckpointReader(d)
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)}: split into 3 parts"):
        CheckpointWriter(tmp_path / "w").add(name, tiny_params()[name], splits=[(1, 3)])


def test_version_1_checkpoint_still_reads(tmp_path):
    """An index written by the version-1 writer (no splits, "version": 1) loads as before and keeps its
    version (and so its fingerprint) when re-serialised."""
    params = tiny_params(4)
    d = write_tiny(tmp_path / "v1", params, block_bytes=1 << 20, checksum="crc32")
    _edit_index(d, lambda i: i.update(version=1))
    r = CheckpointReader(d)
    assert r.index.version == 1 and r.index.to_json()["version"] == 1
    loaded, stats = r.load(tiny_specs(), build_mesh(FSDP_TP), merge_rules(HEADS_REPLICATED), progress=False)
    assert stats.bytes_read == r.index.total_bytes
    for n, a in params.items():
        np.testing.assert_array_equal(np.asarray(loaded[n]), a)


def test_version_3_block_checksums_are_crc32c(tmp_path):
    """The writer (format version 3) stores crc32c block checksums: each equals the crc32c of that block of the
    tensor's raw bytes in the shard file, computed here independently."""
    import crc32c

    params = tiny_params(6)
    d = write_tiny(tmp_path / "v3", params, block_bytes=100)
    raw = json.loads((d / INDEX_FILE).read_text())
    assert raw["version"] == 3 and raw["checksum"] == {"algorithm": "crc32c", "block_bytes": 100}
    e = CheckpointReader(d).index.tensors["layers.1.mlp.down_proj.kernel"]
    data = (d / e.file).read_bytes()[e.offset: e.offset + e.length]
    assert list(e.crc32) == [crc32c.crc32c(data[i:i + 100]) for i in range(0, len(data), 100)]
    assert list(e.crc32) != [zlib.crc32(data[i:i + 100]) for i in range(0, len(data), 100)]
    loaded, _ = CheckpointReader(d).load(tiny_specs(), build_mesh(FSDP_TP), merge_rules(HEADS_REPLICATED),
                                         progress=False)
    for n, a in params.items():
        np.testing.assert_array_equal(np.asarray(loaded[n]), a)


@pytest.mark.parametrize("use_mmap", [True, False])
def test_version_2_crc32_checkpoint_still_reads_and_checks(tmp_path, use_mmap):
    """An index of the version-2 writer (crc32 block checksums) loads and is verified with crc32: a flipped
    byte is reported naming the file, the tensor and the block."""
    params = tiny_params(7)
    d = write_tiny(tmp_path / "v2", params, block_bytes=128, checksum="crc32")
    _edit_index(d, lambda i: i.update(version=2))
    r = CheckpointReader(d)
    assert r.index.version == 2 and r.index.checksum == "crc32"
    loaded, _ = r.load(tiny_specs(), build_mesh(FSDP_TP), merge_rules(HEADS_REPLICATED), progress=False,
                       use_mmap=use_mmap)
    for n, a in params.items():
        np.testing.assert_array_equal(np.asarray(loaded[n]), a)
    e = r.index.tensors["layers.0.attn.q_proj.kernel"]
    data = bytearray((d / e.file).read_bytes())
    data[e.offset + 200] ^= 0x01  # block 1 of 128 bytes
    (d / e.file).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"file .*{e.file}, tensor layers\.0\.attn\.q_proj\.kernel: "
                                              r"checksum mismatch in block 1 "):
        CheckpointReader(d).load(tiny_specs(), build_mesh(FSDP_TP), merge_rules(HEADS_REPLICATED),
                                 progress=False, use_mmap=use_mmap)


def test_checksum_algorithm_errors(tmp_path, tiny_ckpt):
    d = _copy(tiny_ckpt, tmp_path / "c2")
    _edit_index(d, lambda i: i.update(version=2))  # crc32c is a version-3 algorithm
    with pytest.raises(CheckpointError, match=r"index\.json: checksum algorithm 'crc32c' needs format version 3 "
                                              r"\(the index says 2\)"):
        CheckpointReader(d)
    d = _copy(tiny_ckpt, tmp_path / "md5")
    _edit_index(d, lambda i: i["checksum"].update(algorithm="md5"))
    with pytest.raises(CheckpointError, match=r"checksum algorithm 'md5' is not supported \(crc32, crc32c\)"):
        CheckpointReader(d)
    with pytest.raises(CheckpointError, match=r"checksum 'sha1' is not one of crc32, crc32c"):
        CheckpointWriter(tmp_path / "w", checksum="sha1")


def test_demo_cache_for_a_config_is_stacked_and_split_and_stale_layouts_replaced(tmp_path, monkeypatch):
    """The plain demo conversion (no config) keeps one tensor per layer: a cached version-1 one is used as it
    is. A config gets its own conversion, stacked over the layers (`@stacked`) and split for its mesh when it
    cuts column dims (the stacked MLP kernels along both); a cache in the other layout than its name says
    is converted again, in its place."""
    import raydeploy.checkpoint.convert_gguf as cg
    from raydeploy.checkpoint import demo
    from raydeploy.checkpoint.layout import SplitPlan
    from raydeploy.config import load_config

    monkeypatch.setenv("RAYDEPLOY_CACHE", str(tmp_path))
    plain = write_tiny(tmp_path / "smollm2-135m-instruct", checksum="crc32")
    _edit_index(plain, lambda i: i.update(version=1))
    calls = []
    cfg = LlamaConfig.from_hf_dict(TINY_HF)

    def fake_convert(src, dst, splits=None, **kw):
        calls.append((splits, kw["stacked"]))
        if kw["stacked"]:
            write_split(Path(dst), stacked(tiny_params()), SplitPlan.build(cfg, splits, stacked_param_specs(cfg)).splits)
        else:
            write_tiny(Path(dst))

    monkeypatch.setattr(cg, "convert_gguf", fake_convert)
    assert demo.resolve_checkpoint("demo:smollm2-135m-instruct") == plain and calls == []
    dp = load_config(None, ["cluster.num_hosts=2", "cluster.devices_per_host=1", "mesh.axes={dp: 2}"])
    got = demo.resolve_checkpoint("demo:smollm2-135m-instruct", split_for=dp)
    assert got == tmp_path / "smollm2-135m-instruct@stacked" and calls == [({}, True)]
    assert "layers.mlp.up_proj.kernel" in CheckpointReader(got).index.tensors
    fsdp = load_config(Path(__file__).resolve().parents[1] / "configs" / "cpu-fsdp.yaml", [])
    got = demo.resolve_checkpoint("demo:smollm2-135m-instruct", split_for=fsdp)
    assert got == tmp_path / "smollm2-135m-instruct@stacked-embed2-mlp2-vocab2"
    assert calls[1:] == [({"embed": 2, "mlp": 2, "vocab": 2}, True)]
    r = CheckpointReader(got)
    assert r.index.tensors["layers.mlp.up_proj.kernel"].splits == ((1, 2), (2, 2)) and r.index.version == 4
    assert demo.resolve_checkpoint("demo:smollm2-135m-instruct", split_for=fsdp) == got and len(calls) == 2
    shutil.rmtree(got)  # a per-layer conversion where a stacked one belongs is converted again
    write_tiny(got)
    assert demo.resolve_checkpoint("demo:smollm2-135m-instruct", split_for=fsdp) == got and len(calls) == 3
    assert "layers.mlp.up_proj.kernel" in CheckpointReader(got).index.tensors
