"""Keep JAX from probing for accelerators a machine does not have.

With libtpu installed (the TPU image, the test extra), a process that imports jax without `JAX_PLATFORMS`
first tries to bring up a TPU backend: libtpu looks for TPU devices and the TPU environment, may ask a cloud
metadata server for them, and prints warnings before jax falls back to CPU. On a machine with no TPU that
is wasted start-up at best and a hang on a metadata query at worst. `keep_jax_off_missing_tpu` runs before
jax is imported (the CLI calls it first thing): where no TPU is present and the user chose no platform, it
restricts jax to the CPU (or leaves the choice to jax where an NVIDIA GPU is present) and tells libtpu not
to ask a metadata server. A user's own `JAX_PLATFORMS` always wins.
"""

from __future__ import annotations

import glob
import os
from collections.abc import MutableMapping

TPU_ENV_VARS = ("TPU_NAME", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE")


def tpu_present(environ: MutableMapping[str, str] | None = None) -> bool:
    """A TPU VM: TPU device files (/dev/accel*, /dev/vfio/N) or the TPU environment set."""
    env = os.environ if environ is None else environ
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
                or any(env.get(v) for v in TPU_ENV_VARS))


def nvidia_gpu_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def keep_jax_off_missing_tpu(environ: MutableMapping[str, str] | None = None) -> None:
    """Set JAX_PLATFORMS=cpu and TPU_SKIP_MDS_QUERY=1 where no TPU (and no GPU) is present and the user
    chose no platform; call before jax is imported."""
    env = os.environ if environ is None else environ
    if tpu_present(env):
        return
    env.setdefault("TPU_SKIP_MDS_QUERY", "1")
    if "JAX_PLATFORMS" not in env and not nvidia_gpu_present():
        env["JAX_PLATFORMS"] = "cpu"
