"""Container images (images/): each image's complete Python requirements resolve, and every file names the same
images.

No container daemon runs in CI, so the images are not built here. What breaks an image build short of a
daemon is a version conflict between raydeploy's own requirements, the image's jax extra (`tpu`: libtpu;
`cuda`: the CUDA plugin) and what the official Ray base image already holds (images/ray-image.txt). pip's
resolver finds such a conflict for the image's platform without installing anything:
`pip install --dry-run --report --ignore-installed --platform ... --python-version ... --only-binary=:all:`.
The platform is the Ray images' Ubuntu 22.04 (glibc 2.35) on x86_64; the Python version is read from the base
image tag. These tests need PyPI (marker `network`); pip reads only the wheels' metadata (about a minute for both images).

The Makefile pins every image name and tag once; the Dockerfiles, the Ray version pins and the docs must
agree with it (the k8s/ manifests are checked in tests/test_k8s.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "images"
VARIANTS = ("tpu", "cuda")
GLIBC_MINOR = 35  # Ubuntu 22.04, the base of the Ray images
RESOLVE_TIMEOUT_S = 900.0
# pip settings of the machine the tests run on that would change the answer (a local wheel folder, a local
# constraint cap); the index URL and certificates are kept, so a CI mirror of PyPI still works
_DROPPED_PIP_ENV = ("PIP_CONSTRAINT", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_REQUIREMENT", "PIP_NO_INDEX")


def makefile_vars() -> dict[str, str]:
    """`NAME := value` / `NAME ?= value` assignments of the Makefile (the image pins)."""
    out = {}
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Z_]+)\s*[:?]?=\s*(\S.*?)\s*$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _ray_image_requirements() -> list[str]:
    lines = (IMAGES / "ray-image.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def image_requirements(variant: str) -> list[str]:
    """Everything the image's Python environment must hold: the Ray base image's own packages, raydeploy's
    requirements and the variant's extra (what `pip install raydeploy-*.whl[<variant>]` adds)."""
    project = _pyproject()["project"]
    return _ray_image_requirements() + list(project["dependencies"]) + list(
        project["optional-dependencies"][variant])


def python_version(base_image: str) -> str:
    """'3.11' from a Ray image tag such as rayproject/ray:2.60.0-py311-cu128."""
    m = re.search(r":[^-]+-py3(\d+)", base_image)
    if not m:
        raise ValueError(f"no -py3NN Python tag in base image {base_image!r} (Makefile)")
    return f"3.{m.group(1)}"


def platform_args() -> list[str]:
    """Every manylinux tag a glibc-2.35 x86_64 system accepts (pip does not expand a --platform downwards)."""
    args = []
    for minor in range(GLIBC_MINOR, 16, -1):
        args += ["--platform", f"manylinux_2_{minor}_x86_64"]
    for legacy in ("manylinux2014", "manylinux2010", "manylinux1"):
        args += ["--platform", f"{legacy}_x86_64"]
    return args


class ResolutionError(RuntimeError):
    pass


def resolve(name: str, requirements: list[str], py_version: str, report: Path) -> dict[str, str]:
    """Resolve `requirements` for linux x86_64 / CPython `py_version` with pip; {canonical name: version}.

    Raises ResolutionError naming the image and quoting pip's explanation when they do not resolve."""
    abi = "cp" + py_version.replace(".", "")
    # fast-deps reads each wheel's metadata with HTTP range requests instead of downloading the wheel (jaxlib,
    # ray and the CUDA libraries are hundreds of MB); pip falls back to a download where ranges are refused
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--use-feature=fast-deps",
           "--report", str(report),
           "--ignore-installed", "--only-binary=:all:", *platform_args(), "--python-version", py_version,
           "--implementation", "cp", "--abi", abi, *requirements]
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_PIP_ENV}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf of this machine
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise ResolutionError(f"image {name}: pip did not resolve its requirements within {RESOLVE_TIMEOUT_S:.0f} s"
                              " (is PyPI reachable?)") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ResolutionError(f"image {name}: its Python requirements do not resolve for linux x86_64 / "
                              f"Python {py_version}:\n{tail}")
    data = json.loads(report.read_text())
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in data["install"]}


@pytest.fixture(scope="module")
def resolved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Both images resolved once, side by side (pip mostly waits on the network)."""
    mk = makefile_vars()
    tmp = tmp_path_factory.mktemp("resolve")

    def one(variant: str) -> dict[str, str]:
        base = mk[f"RAY_IMAGE_{variant.upper()}"]
        return resolve(mk[f"IMAGE_{variant.upper()}"], image_requirements(variant), python_version(base),
                       tmp / f"{variant}.json")

    with ThreadPoolExecutor(len(VARIANTS)) as pool:
        return dict(zip(VARIANTS, pool.map(one, VARIANTS), strict=True))


@pytest.mark.network
@pytest.mark.parametrize("variant", VARIANTS)
def test_image_requirements_resolve(variant: str, resolved: dict[str, dict[str, str]]) -> None:
    versions = resolved[variant]
    # every pinned requirement holds in the answer (the report is the resolution of what we asked for)
    for req in map(Requirement, image_requirements(variant)):
        name = canonicalize_name(req.name)
        assert name in versions, f"{variant}: {req} missing from the resolution"
        assert req.specifier.contains(versions[name], prereleases=True), f"{variant}: {req} -> {versions[name]}"
    assert versions["jax"] == versions["jaxlib"] == "0.10.2"
    assert versions["ray"] == "2.60.0"
    if variant == "tpu":
        assert versions.get("libtpu", "").startswith("0.0.42"), versions.get("libtpu")
        assert not any(n.startswith("jax-cuda") for n in versions)
    else:
        assert versions.get("jax-cuda12-plugin") == versions.get("jax-cuda12-pjrt") == "0.10.2"
        assert {"nvidia-cudnn-cu12", "nvidia-nccl-cu12", "nvidia-cublas-cu12"} <= set(versions)
        assert "libtpu" not in versions


@pytest.mark.network
def test_conflict_is_reported(tmp_path: Path) -> None:
    """A requirement that contradicts the image's pins fails with the image named and pip's reason."""
    with pytest.raises(ResolutionError) as e:
        resolve("example:tpu", ["jax[tpu]==0.10.2", "jaxlib==0.10.1"], "3.11", tmp_path / "r.json")
    msg = str(e.value)
    assert "image example:tpu" in msg and "Python 3.11" in msg
    assert "jaxlib" in msg and "conflict" in msg.lower()


def test_python_version_from_tag() -> None:
    assert python_version("rayproject/ray:2.60.0-py311-cu128") == "3.11"
    assert python_version("rayproject/ray:2.60.0-py312") == "3.12"
    with pytest.raises(ValueError, match="no -py3NN Python tag in base image 'rayproject/ray:2.60.0'"):
        python_version("rayproject/ray:2.60.0")


def test_makefile_pins_the_images() -> None:
    mk = makefile_vars()
    version = _pyproject()["project"]["version"]
    ray_pins = {str(Requirement(r).specifier) for r in _pyproject()["project"]["dependencies"]
                if canonicalize_name(Requirement(r).name) == "ray"}
    assert ray_pins == {"==2.60.0"}
    assert [str(Requirement(r).specifier) for r in _ray_image_requirements()] == ["==2.60.0"]
    for variant in VARIANTS:
        base, image = mk[f"RAY_IMAGE_{variant.upper()}"], mk[f"IMAGE_{variant.upper()}"]
        assert base.startswith("rayproject/ray:2.60.0-py3"), base  # the official image of the pinned Ray
        assert image.endswith(f":{version}-{variant}"), f"{image}: tag is not <pyproject version>-{variant}"
    assert mk["RAY_IMAGE_CUDA"].split("-")[-1].startswith("cu12"), "the CUDA base must be a CUDA 12 image"
    assert python_version(mk["RAY_IMAGE_TPU"]) == python_version(mk["RAY_IMAGE_CUDA"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_dockerfile_agrees_with_makefile(variant: str) -> None:
    mk = makefile_vars()
    text = (IMAGES / f"Dockerfile.{variant}").read_text()
    (default,) = re.findall(r"^ARG RAY_IMAGE=(\S+)$", text, re.M)
    assert default == mk[f"RAY_IMAGE_{variant.upper()}"]
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert froms and all(f == "${RAY_IMAGE}" for f in froms), froms
    # raydeploy is installed from its own wheel, with this variant's extra
    assert re.search(rf'pip install [^\n]*raydeploy-\*\.whl\)\[{variant}\]', text), "wheel[extra] install"
    assert "pip wheel" in text and "pip check" in text
    assert variant in _pyproject()["project"]["optional-dependencies"]
    rule = re.search(rf"^image-{variant}:\n\t(.*)$", (REPO / "Makefile").read_text(), re.M)
    assert rule, f"no make target image-{variant}"
    recipe = rule.group(1)
    for needed in (f"-f images/Dockerfile.{variant}", f"RAY_IMAGE=$(RAY_IMAGE_{variant.upper()})",
                   f"-t $(IMAGE_{variant.upper()})"):
        assert needed in recipe, f"image-{variant}: {needed!r} not in {recipe!r}"
    # the build context lets through what the wheel stage copies (default_config.yaml links into configs/)
    ignore = (IMAGES / f"Dockerfile.{variant}.dockerignore").read_text().splitlines()
    copied = re.findall(r"^COPY --chown=\S+ (.+) \S+$", text, re.M)
    for src in " ".join(copied).split():
        assert f"!{src}" in ignore or f"!{src}/" in ignore, f"{src} is copied but excluded from the context"


def test_docs_name_the_pinned_images() -> None:
    mk = makefile_vars()
    pinned = {mk[k] for k in ("RAY_IMAGE_TPU", "RAY_IMAGE_CUDA", "IMAGE_TPU", "IMAGE_CUDA")}
    guide = (REPO / "docs" / "kuberay.md").read_text()
    for image in pinned:
        assert image in guide, f"docs/kuberay.md does not name {image}"
    pattern = re.compile(r"(?:rayproject/ray|ghcr\.io/raydeploy/raydeploy):[\w.\-]+")
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(IMAGES.iterdir())]:
        for found in pattern.findall(path.read_text()):
            assert found in pinned, f"{path.relative_to(REPO)} names {found}, which the Makefile does not pin"
