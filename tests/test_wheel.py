"""The wheel carries everything the package reads at run time, and the native CPU kernels build from an installed
copy; without a C++ compiler they say so once and the model keeps XLA.

An editable install reads the sources from the checkout, so it hides a file missing from `package-data`: the
wheel test builds the wheel from a copy of the sources alone (no egg-info, no build directory), installs it into
a fresh virtual environment without dependencies, lends it this environment's dependencies (a .pth naming this
site-packages directory: a plain path line, so the editable raydeploy's finder there is not loaded) and builds and
registers the kernels from the installed copy in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "raydeploy"

# what the subprocess reports: where raydeploy came from, the kernels' sources, and why they are unavailable
_PROBE = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
import raydeploy
from raydeploy.model import native
first, second = native.unavailable(), native.unavailable()
print(json.dumps({"raydeploy": raydeploy.__file__, "sources": [str(p) for p in (*native.SOURCES, *native.HEADERS)],
                  "cpu_problem": native._cpu_problem(), "unavailable": first, "again": second}))
"""


def _data_files(root: Path) -> set[str]:
    """The package's files that are not Python sources (what `package-data` must list), relative to `root`."""
    return {p.relative_to(root).as_posix() for p in (root / "raydeploy").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}


def _probe(python: str, cwd: Path, env: dict[str, str]) -> tuple[dict, str]:
    r = subprocess.run([python, "-c", _PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _clean_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CXX", "RAYDEPLOY_NATIVE_CACHE")}
    env.update(JAX_PLATFORMS="cpu", RAYDEPLOY_NATIVE_CACHE=str(tmp / "native-cache"), **extra)
    return env


@pytest.mark.slow
def test_the_installed_wheel_builds_and_registers_the_native_kernels(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(PACKAGE, src / "raydeploy", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    # build offline with this environment's setuptools (no isolated build environment to download)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("raydeploy-*.whl")
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {n for n in z.namelist() if n.startswith("raydeploy/")}
    missing = sorted(_data_files(REPO) - in_wheel)
    assert not missing, f"package files the wheel lacks (add them to package-data in pyproject.toml): {missing}"

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    r = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    # this environment's dependencies, after the fresh environment's own site-packages (so its raydeploy wins)
    (Path(site) / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    out, err = _probe(python, tmp_path, _clean_env(tmp_path))
    installed = Path(out["raydeploy"]).resolve()
    assert installed.is_relative_to(env_dir.resolve()), f"raydeploy imported from {installed}, not the wheel"
    assert all(Path(p).resolve().is_relative_to(env_dir.resolve()) and Path(p).is_file() for p in out["sources"])
    if out["cpu_problem"] is not None:
        pytest.skip(out["cpu_problem"])
    assert out["unavailable"] is None, out["unavailable"] + "\n" + err[-2000:]
    assert list((tmp_path / "native-cache").glob("kernels-*.so")), "no kernel library was built"


def test_without_a_compiler_one_log_line_says_why(tmp_path: Path) -> None:
    """No `$CXX` and no compiler on PATH: `unavailable()` names the cause and one warning says it, once."""
    bare = tmp_path / "bin"  # a PATH with no compiler on it
    bare.mkdir()
    out, err = _probe(sys.executable, REPO, _clean_env(tmp_path, CXX="/nonexistent/c++", PATH=str(bare)))
    if out["cpu_problem"] is not None:
        pytest.skip(out["cpu_problem"])
    why = "native CPU kernels unavailable: no C++ compiler found ($CXX, c++, g++ or clang++)"
    assert out["unavailable"] == out["again"] == why
    lines = [ln for ln in err.splitlines() if "native CPU kernels unavailable" in ln]
    assert lines == [f"raydeploy.native WARNING {why}; the model keeps XLA's dot and attention"], err[-2000:]
    assert not list((tmp_path / "native-cache").glob("kernels-*.so"))
