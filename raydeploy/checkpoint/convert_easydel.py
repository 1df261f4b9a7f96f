"""EasyDeL / fjformer streaming msgpack checkpoint -> raydeploy checkpoint.

The older EasyDeL JAXServer and fjformer's `StreamingCheckpointer` (after EasyLM) wrote one file: a plain
concatenation of msgpack-packed pairs `(key, value)`, where `key` is a parameter path as a list of strings
(`flax.traverse_util.flatten_dict` of the params, e.g. ['params', 'model', 'layers', '0', 'self_attn',
'q_proj', 'kernel']) and `value` is `flax.serialization.to_bytes(array)` (msgpack with flax's ndarray ext
type, or flax's chunked form for arrays over 1 GiB). Flax kernels are already [in, out]; names map with
`raydeploy.model.names.EASYDEL_NAMES`, with or without the leading 'params'. The file carries no config or
tokenizer: `--hf-config` gives config.json, and tokenizer files beside it are copied.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raydeploy.checkpoint.format import CheckpointError
from raydeploy.checkpoint.layout import NameMap, TensorSink, cast, check_against_specs, to_ours
from raydeploy.checkpoint.writer import CheckpointWriter
from raydeploy.model.names import EASYDEL_NAMES
from raydeploy.model.registry import family_for
from raydeploy.model.spec import LlamaConfig

READ_SIZE_BYTES = 16 << 20
# Train-state entries that are not parameters (a 'streaming_train_state' file holds them too).
EASYDEL_IGNORED = (r"(opt_state|step|tx)(/.*)?",)


def convert_easydel(src: str | Path, dst: str | Path, hf_config: str | Path | None, dtype: str = "keep",
                    shard_size_bytes: int = 1 << 30, progress: bool = True,
                    splits: Mapping[str, int] | None = None, stacked: bool = True) -> dict[str, Any]:
    """Convert one streaming msgpack file (storing tensors split for `splits` and, with `stacked`, stacked
    over the layers: see layout.TensorSink).
    Returns {'bytes': ..., 'tensors': ...}."""
    import msgpack
    from flax.serialization import msgpack_restore
    from tqdm import tqdm

    src = Path(src)
    if not src.is_file():
        raise CheckpointError("EasyDeL checkpoint file does not exist", str(src))
    if hf_config is None:
        raise CheckpointError("an EasyDeL checkpoint carries no model config: pass --hf-config PATH/config.json "
                              "(tokenizer files beside it are copied too)", str(src))
    cfg_path = Path(hf_config)
    if cfg_path.is_dir():
        cfg_path = cfg_path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError("--hf-config file does not exist", str(cfg_path))
    try:
        cfg = LlamaConfig.from_hf_dict(json.loads(cfg_path.read_text()))
    except (json.JSONDecodeError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"not a usable Hugging Face Llama-family config: {e!r}", str(cfg_path)) from e

    name_map = NameMap(EASYDEL_NAMES, ignored=EASYDEL_IGNORED, source="EasyDeL")
    shapes: dict[str, tuple[int, ...]] = {}
    writer = CheckpointWriter(dst, shard_size_bytes=shard_size_bytes)
    sink = TensorSink(writer, family_for("llama"), cfg, splits, stacked)
    bar = tqdm(total=src.stat().st_size, unit="B", unit_scale=True, desc="convert easydel", disable=not progress)
    try:
        with open(src, "rb") as f:
            unpacker = msgpack.Unpacker(f, read_size=READ_SIZE_BYTES, max_buffer_size=0, raw=False)
            pos = 0
            for n, item in enumerate(unpacker):
                if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], bytes)):
                    raise CheckpointError(f"record {n} is not a (key, flax bytes) pair", str(src))
                key, value = item
                path = "/".join(str(k) for k in key) if isinstance(key, (list, tuple)) else str(key)
                for _ in range(2):  # params, or a whole train state's params/params
                    if path.startswith("params/"):
                        path = path[len("params/"):]
                try:
                    arr = msgpack_restore(value)
                except (ValueError, TypeError, msgpack.UnpackException) as e:
                    raise CheckpointError(f"record {n} ({path}) does not hold a flax-serialized array: {e}",
                                          str(src), tensor=path) from e
                mapped = name_map.lookup(path)
                if mapped is None:
                    continue
                ours, kind = mapped
                if ours == "lm_head.kernel" and cfg.tie_word_embeddings:
                    continue
                out = cast(to_ours(kind, arr, cfg, name=path), dtype)
                shapes[ours] = tuple(out.shape)
                sink.add(ours, out)
                new_pos = unpacker.tell()
                bar.update(new_pos - pos)
                pos = new_pos
        check_against_specs(shapes, cfg, str(src))
    except msgpack.UnpackException as e:
        writer.abort()
        raise CheckpointError(f"not a msgpack stream of (key, value) records: {e}", str(src)) from e
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    writer.close(config=cfg_path, tokenizer_dir=cfg_path.parent)
    return {"bytes": writer.bytes_written, "tensors": len(shapes)}
