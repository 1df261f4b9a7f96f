"""The code base stays ruff-clean and mypy-clean (the rules are in pyproject.toml)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the `test` extra)")
    proc = subprocess.run([ruff, "check", "raydeploy", "tests", "benchmarks"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_clean() -> None:
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent)) or shutil.which("mypy")
    if mypy is None:
        pytest.skip("mypy is not installed (it is in the `test` extra)")
    # no arguments: files, Python version and options come from [tool.mypy] in pyproject.toml
    proc = subprocess.run([mypy], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- function-local imports of raydeploy modules ------------------------------------------------------------
# An import inside a function hides a dependency from the reader and from import-order tools, and it is how
# import cycles hide. Each one that stays has a reason here, by (importing module, imported module), so a moved
# line keeps its entry. A new function-local import fails `test_no_new_function_local_imports`: import at the
# top of the module, or add the pair here with the reason it must wait.

_CLI = "entry point: a command's module is imported only when that command runs (start-up stays free of JAX and Ray)"
_JAX = "imports jax: the importer stays JAX-free at import, so its caller can set JAX's environment first"
_COMPILE = "imports jax: only after `prepare_environment` has set JAX's platform and devices for the target"
_ACTOR = ("gang module of the driver and the host actors: what it needs loads inside the actor, after the actor "
          "has set its JAX environment (test_host_module_does_not_import_jax)")
_INGRESS = ("Serve ingress and replica: the gang's driver side, the engine and JAX stay out of the HTTP process "
            "until used (test_the_ingress_imports_no_jax)")
_RAY = "imports Ray Serve: loaded when a deployment is built or run, not when the module is imported"
_BACKEND = ("kernel backend chosen at run time: only the chosen backend's module loads (the backend modules import "
            "this package, so a top-level import would be a cycle)")
_FORMAT = "one converter per source format, imported when that format is converted"
_COMPAT = "private library hook (raydeploy.compat), loaded only on the path that uses it"
_PACKING = "read only when a CPU engine packs weights at load (`checkpoint_packing`)"
_GENERATE = "`raydeploy generate`'s body: the engine parts load when the command runs, after its mesh is set"
_PREDICT = "`raydeploy predict`'s body: the gang driver, Ray and the serve text helpers load when a run starts"
_TOY = "test stand-in engine, run inside host actors: the engine's plan types and the host loader load on use"
_DEFERRED = "deferred to the one function that uses it; no import cycle (a candidate to move to the top)"

LOCAL_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {
    ("raydeploy.checkpoint.convert", "raydeploy.checkpoint.convert_easydel"): _FORMAT,
    ("raydeploy.checkpoint.convert", "raydeploy.checkpoint.convert_gguf"): _FORMAT,
    ("raydeploy.checkpoint.convert", "raydeploy.checkpoint.convert_safetensors"): _FORMAT,
    ("raydeploy.checkpoint.demo", "raydeploy.checkpoint.convert_gguf"):
        "the GGUF converter runs only when a demo checkpoint is first built",
    ("raydeploy.cli", "raydeploy.commands"): _CLI,
    ("raydeploy.cli", "raydeploy.platform_env"): _CLI,
    ("raydeploy.commands", "raydeploy.checkpoint.convert"): _CLI,
    ("raydeploy.commands", "raydeploy.checkpoint.demo"): _CLI,
    ("raydeploy.commands", "raydeploy.gang.gang"): _CLI,
    ("raydeploy.commands", "raydeploy.serve.text"): _CLI,
    ("raydeploy.commands", "raydeploy.compile"): _CLI,
    ("raydeploy.commands", "raydeploy.engine.generate"): _CLI,
    ("raydeploy.commands", "raydeploy.plan"): _CLI,
    ("raydeploy.commands", "raydeploy.predict"): _CLI,
    ("raydeploy.commands", "raydeploy.serve.run"): _CLI,
    ("raydeploy.commands", "raydeploy.status"): _CLI,
    ("raydeploy.commands", "raydeploy.submit"): _CLI,
    ("raydeploy.compile", "raydeploy.engine.compile_cache"): _COMPILE,
    ("raydeploy.compile", "raydeploy.engine.engine"): _COMPILE,
    ("raydeploy.compile", "raydeploy.engine.programs"): _COMPILE,
    ("raydeploy.engine.attention", "raydeploy.engine.attention.pallas_gpu"): _BACKEND,
    ("raydeploy.engine.attention", "raydeploy.engine.attention.pallas_tpu"): _BACKEND,
    ("raydeploy.engine.attention", "raydeploy.engine.attention.xla"): _BACKEND,
    ("raydeploy.engine.attention", "raydeploy.engine.matmul.pallas_gpu"):
        "the Pallas GPU kernels' device check, asked only for a GPU device",
    ("raydeploy.engine.compile_cache", "raydeploy.compat"): _COMPAT,
    ("raydeploy.engine.engine", "raydeploy.checkpoint.demo"): _PACKING,
    ("raydeploy.engine.engine", "raydeploy.checkpoint.reader"): _PACKING,
    ("raydeploy.engine.engine", "raydeploy.model.native.packing"): _PACKING,
    ("raydeploy.engine.engine", "raydeploy.model.sharding"): _PACKING,
    ("raydeploy.engine.generate", "raydeploy.checkpoint.demo"): _GENERATE,
    ("raydeploy.engine.generate", "raydeploy.checkpoint.format"): _GENERATE,
    ("raydeploy.engine.generate", "raydeploy.engine.local"): _GENERATE,
    ("raydeploy.engine.generate", "raydeploy.engine.request"): _GENERATE,
    ("raydeploy.engine.generate", "raydeploy.engine.scheduler"): _GENERATE,
    ("raydeploy.engine.generate", "raydeploy.engine.step"): _GENERATE,
    ("raydeploy.engine.generate", "raydeploy.model.sharding"): _GENERATE,
    ("raydeploy.engine.generate", "raydeploy.loading"): _GENERATE,
    ("raydeploy.engine.kv_cache", "raydeploy.engine.attention"):
        "the attention backends' table is read only for a KV dtype other than the model's",
    ("raydeploy.engine.kv_cache", "raydeploy.model.sharding"): _DEFERRED,
    ("raydeploy.engine.kv_cache", "raydeploy.model.spec"): _DEFERRED,
    ("raydeploy.gang.bringup", "raydeploy.gang.fingerprint"): _ACTOR,
    ("raydeploy.gang.coordinator", "raydeploy.compat"): _COMPAT,
    ("raydeploy.gang.directory", "raydeploy.gang.bringup"): _ACTOR,
    ("raydeploy.gang.directory", "raydeploy.gang.gang"): _ACTOR,
    ("raydeploy.gang.dispatch", "raydeploy.compat"): _COMPAT,
    ("raydeploy.gang.gang", "raydeploy.checkpoint.demo"): "a `demo:` checkpoint is converted on the driver, only then",
    ("raydeploy.gang.host", "raydeploy.engine.engine"): _ACTOR,
    ("raydeploy.gang.host", "raydeploy.gang.coordinator"): _ACTOR,
    ("raydeploy.gang.host", "raydeploy.gang.dispatch"): _ACTOR,
    ("raydeploy.gang.host", "raydeploy.gang.fingerprint"): _ACTOR,
    ("raydeploy.gang.host", "raydeploy.gang.preflight"): _ACTOR,
    ("raydeploy.gang.host", "raydeploy.gang.runtime"): _ACTOR,
    ("raydeploy.gang.placement", "raydeploy.gang.preflight"): _ACTOR,
    ("raydeploy.gang.runtime", "raydeploy.checkpoint.reader"): _ACTOR,
    ("raydeploy.gang.runtime", "raydeploy.engine.compile_cache"): _ACTOR,
    ("raydeploy.gang.runtime", "raydeploy.engine.scheduler"): _ACTOR,
    ("raydeploy.gang.runtime", "raydeploy.gang.preflight"): _ACTOR,
    ("raydeploy.gang.runtime", "raydeploy.loading"): _ACTOR,
    ("raydeploy.gang.runtime", "raydeploy.model.sharding"): _ACTOR,
    ("raydeploy.gang.supervisor", "raydeploy.gang.host"): _ACTOR,
    ("raydeploy.gang.supervisor", "raydeploy.gang.placement"): _ACTOR,
    ("raydeploy.gang.supervisor", "raydeploy.gang.preflight"): _ACTOR,
    ("raydeploy.model.registry", "raydeploy.model.state"):
        "imports flax: the registry stays JAX-free (the planner, config checks and the ingress read families)",
    ("raydeploy.plan", "raydeploy.engine.attention"): _JAX,
    ("raydeploy.plan", "raydeploy.engine.kv_cache"): _JAX,
    ("raydeploy.plan", "raydeploy.lora.layout"): _JAX,
    ("raydeploy.plan", "raydeploy.model.native.packing"): _JAX,
    ("raydeploy.predict.run", "raydeploy.gang.feed"): _PREDICT,
    ("raydeploy.predict.run", "raydeploy.gang.gang"): _PREDICT,
    ("raydeploy.predict.run", "raydeploy.serve.run"): _PREDICT,
    ("raydeploy.predict.run", "raydeploy.serve.text"): _PREDICT,
    ("raydeploy.serve.builder", "raydeploy.gang.gang"): _RAY,
    ("raydeploy.serve.builder", "raydeploy.serve.deployment"): _RAY,
    ("raydeploy.serve.deployment", "raydeploy.compat"): _COMPAT,
    ("raydeploy.serve.deployment", "raydeploy.gang.directory"): _INGRESS,
    ("raydeploy.serve.deployment", "raydeploy.gang.gang"): _INGRESS,
    ("raydeploy.serve.deployment", "raydeploy.gang.placement"): _INGRESS,
    ("raydeploy.serve.deployment", "raydeploy.serve.replica"): _INGRESS,
    ("raydeploy.serve.deployment", "raydeploy.serve.routing"): _RAY,
    ("raydeploy.serve.generation", "raydeploy.serve.errors"): _DEFERRED,
    ("raydeploy.serve.replica", "raydeploy.gang.bringup"): _INGRESS,
    ("raydeploy.serve.replica", "raydeploy.gang.directory"): _INGRESS,
    ("raydeploy.serve.replica", "raydeploy.gang.feed"): _INGRESS,
    ("raydeploy.serve.replica", "raydeploy.gang.gang"): _INGRESS,
    ("raydeploy.serve.replica", "raydeploy.gang.placement"): _INGRESS,
    ("raydeploy.serve.replica", "raydeploy.serve.backend"): _INGRESS,
    ("raydeploy.serve.run", "raydeploy.gang.bringup"): _RAY,
    ("raydeploy.serve.run", "raydeploy.gang.directory"): _RAY,
    ("raydeploy.serve.run", "raydeploy.gang.gang"): _RAY,
    ("raydeploy.serve.run", "raydeploy.serve.deployment"): _RAY,
    ("raydeploy.serve.run", "raydeploy.serve.launcher"):
        "used only when `raydeploy serve` starts Ray itself (it may re-run the command in its own session)",
    ("raydeploy.testing.toy", "raydeploy.engine.request"): _TOY,
    ("raydeploy.testing.toy", "raydeploy.gang.runtime"): _TOY,
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def local_imports(root: Path, package: str = "raydeploy") -> dict[tuple[str, str], list[str]]:
    """Every import of a `package` module inside a function body of `root/package`, by (importing module,
    imported module) -> ['path:line', ...]. `from a.b import c` names `a.b.c` when that is a module of the package."""
    modules = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    found: dict[tuple[str, str], list[str]] = {}

    def imported(node: ast.Import | ast.ImportFrom, here: str) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:  # relative: resolve against the importing module's package
            pkg = here.split(".") if modules[here].name == "__init__.py" else here.split(".")[:-1]
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]

    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                for target in imported(node, name):
                    if target == package or target.startswith(package + "."):
                        where = f"{path.relative_to(root)}:{node.lineno}"
                        sites = found.setdefault((name, target), [])
                        if where not in sites:  # a nested function's import is seen from every enclosing def
                            sites.append(where)
    return found


def test_no_new_function_local_imports() -> None:
    found = local_imports(REPO)
    new = {pair: sites for pair, sites in found.items() if pair not in LOCAL_IMPORTS_ALLOWED}
    assert not new, ("function-local imports of raydeploy modules not in LOCAL_IMPORTS_ALLOWED (import at the top "
                     "of the module, or add the pair with the reason it must wait):\n"
                     + "\n".join(f"  {a} -> {b} at {', '.join(s)}" for (a, b), s in sorted(new.items())))


def test_every_allowed_local_import_says_why() -> None:
    short = [pair for pair, why in LOCAL_IMPORTS_ALLOWED.items() if len(why.split()) < 4]
    assert not short, f"allow-list entries without a reason: {short}"


def test_the_local_import_lint_sees_imports_in_functions_only(tmp_path: Path) -> None:
    pkg = tmp_path / "raydeploy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("X = 1\n")
    (pkg / "top.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import raydeploy.sub\n"
        "if TYPE_CHECKING:\n    from raydeploy.sub import leaf\n"
        "def f():\n    import json\n    from raydeploy.sub import leaf\n    return leaf\n"
        "class C:\n    async def g(self):\n        def inner():\n            from . import sub\n        import raydeploy\n")
    found = local_imports(tmp_path)
    assert found == {("raydeploy.top", "raydeploy.sub.leaf"): ["raydeploy/top.py:7"],
                     ("raydeploy.top", "raydeploy.sub"): ["raydeploy/top.py:12"],
                     ("raydeploy.top", "raydeploy"): ["raydeploy/top.py:13"]}
