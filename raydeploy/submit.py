"""`raydeploy submit CONFIG -- serve|predict ARGS`: run raydeploy as a Ray job on a running cluster.

Uses the Ray Jobs API (the dashboard's HTTP endpoint, `JobSubmissionClient`). The job's working dir is a
small staging directory holding the config as `config.yaml` (and the model config.json it names, if
any), so the job does not depend on the submitter's checkout; the entry point is
`python -m raydeploy serve|predict config.yaml ARGS` run by the cluster's own Python, which must have
raydeploy installed (the container image). Input and output paths of `predict` must be on storage the
cluster sees (a bucket or volume mount); paths that exist here are made absolute. With Ray token auth
(the default in Ray >= 2.52) the submitter needs `RAY_AUTH_MODE=token` and the cluster's token
(`RAY_AUTH_TOKEN` or the token file). After submitting it prints the job id and how to follow the logs,
then follows them until the job ends (unless --no-wait; bounded by --timeout-s when given).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from raydeploy.config import ConfigError, load_config

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
COMMANDS = ("serve", "predict")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class SubmitError(RuntimeError):
    """The job cannot be submitted or followed; says where and why."""


def dashboard_address(address: str | None) -> str:
    addr = address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS
    if addr.startswith("ray://") or not addr.startswith(("http://", "https://")):
        raise SubmitError(f"the Jobs API needs the dashboard's http(s) address (e.g. {DEFAULT_ADDRESS}), "
                          f"found {addr!r}")
    return addr.rstrip("/")


def _options_before_dashes(args: argparse.Namespace) -> list[str]:
    """`submit CONFIG --address X -- predict ...`: argparse leaves `--address X --` inside the remainder;
    parse those options here and return what follows `--`."""
    entry = list(args.entry or [])
    if "--" not in entry or entry[0] == "--":
        return entry
    cut = entry.index("--")
    opts = argparse.ArgumentParser(prog="raydeploy submit", add_help=False, exit_on_error=False)
    opts.add_argument("--address")
    opts.add_argument("--no-wait", action="store_true")
    opts.add_argument("--timeout-s", type=float)
    try:
        found, unknown = opts.parse_known_args(entry[:cut])
    except argparse.ArgumentError as e:
        raise SubmitError(f"cannot parse options {entry[:cut]} before `--`: {e}") from None
    if unknown:
        raise SubmitError(f"unknown option(s) {unknown} before `--`; submit takes --address, --no-wait, --timeout-s")
    args.address = found.address or args.address
    args.no_wait = found.no_wait or args.no_wait
    args.timeout_s = found.timeout_s if found.timeout_s is not None else getattr(args, "timeout_s", None)
    return entry[cut:]


def split_entry(entry: list[str]) -> tuple[str, list[str]]:
    """`-- predict --input a --output b` -> ("predict", [...])."""
    rest = entry[1:] if entry and entry[0] == "--" else list(entry)
    if not rest or rest[0] not in COMMANDS:
        found = rest[0] if rest else "nothing"
        raise SubmitError(f"after the config give `-- serve ARGS` or `-- predict ARGS`; found {found!r}")
    return rest[0], rest[1:]


def _absolute_paths(cmd: str, argv: list[str]) -> list[str]:
    """Make predict's --input/--output absolute when they exist here (a shared filesystem)."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if cmd == "predict" and a in ("--input", "--output"):
            p = Path(out[i + 1])
            if p.exists() or p.parent.exists():
                out[i + 1] = str(p.resolve())
    return out


def stage_working_dir(config_path: Path, dest: Path) -> Path:
    """Copy the config (and a relative model.hf_config it names) into `dest`; returns dest/config.yaml."""
    cfg = load_config(config_path)  # fail here, naming the key, not on the cluster
    dest.mkdir(parents=True, exist_ok=True)
    raw = yaml.safe_load(config_path.read_text()) or {}
    hf = cfg.model.hf_config
    if hf and not Path(hf).is_absolute():
        src = config_path.parent / hf
        if not src.is_file():
            raise ConfigError(f"model config.json {src} does not exist", file=str(config_path), key="model.hf_config")
        shutil.copy(src, dest / "model-config.json")
        raw["model"]["hf_config"] = "model-config.json"
    out = dest / "config.yaml"
    out.write_text(f"# staged by `raydeploy submit` from {config_path}\n" + yaml.safe_dump(raw, sort_keys=False))
    return out


def entrypoint(cmd: str, argv: list[str]) -> str:
    return shlex.join(["python", "-m", "raydeploy", cmd, "config.yaml", *argv])


def _client(address: str) -> Any:
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as e:  # noqa: BLE001 - the client raises ConnectionError/RuntimeError/PermissionError variants
        hint = ""
        text = str(e)
        if "401" in text or "403" in text or "auth" in text.lower() or "token" in text.lower():
            hint = ("; the cluster uses Ray token auth: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or the "
                    "token file) in this shell")
        raise SubmitError(f"cannot reach the Ray Jobs API at {address}: {text.splitlines()[0] if text else e!r}"
                          f"{hint}") from None


async def _follow(client: Any, job_id: str, timeout_s: float | None) -> None:
    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            sys.stdout.write(lines)
            sys.stdout.flush()

    await asyncio.wait_for(tail(), timeout_s)


def wait_for_job(client: Any, job_id: str, timeout_s: float | None, poll_s: float = 1.0) -> str:
    """Poll until the job ends; returns its final status (raises SubmitError after timeout_s)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(job_id)).split(".")[-1]
        if status in TERMINAL:
            return status
        if deadline is not None and time.monotonic() > deadline:
            raise SubmitError(f"job {job_id} still {status} after {timeout_s:g}s (it keeps running; "
                              f"`ray job stop {job_id}` stops it)")
        time.sleep(poll_s)


def run_submit(args: argparse.Namespace) -> int:
    """Submit; print the job id and how to follow it; follow it unless --no-wait. 0 when it succeeded."""
    try:
        cmd, argv = split_entry(_options_before_dashes(args))
        address = dashboard_address(args.address)
        with tempfile.TemporaryDirectory(prefix="raydeploy-submit-") as tmp:
            stage_working_dir(Path(args.config), Path(tmp))  # a bad config fails here, before any connection
            ep = entrypoint(cmd, _absolute_paths(cmd, argv))
            client = _client(address)
            runtime_env = {"working_dir": tmp, "env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}}
            job_id = client.submit_job(entrypoint=ep, runtime_env=runtime_env,
                                       submission_id=f"raydeploy-{cmd}-{time.strftime('%Y%m%d-%H%M%S')}"
                                                     f"-{os.getpid()}",
                                       metadata={"raydeploy": cmd, "config": str(args.config)})
    except SubmitError as e:
        print(f"raydeploy submit: {e}", file=sys.stderr)
        return 1
    print(f"submitted job {job_id}: {ep}")
    print(f"  follow logs: ray job logs --address {address} --follow {job_id}")
    print(f"  status:      ray job status --address {address} {job_id}")
    print(f"  stop:        ray job stop --address {address} {job_id}")
    if args.no_wait:
        return 0
    timeout_s = getattr(args, "timeout_s", None)
    try:
        asyncio.run(_follow(client, job_id, timeout_s))
        status = wait_for_job(client, job_id, timeout_s=60.0)
    except TimeoutError:
        print(f"raydeploy submit: stopped following job {job_id} after {timeout_s:g}s; it keeps running",
              file=sys.stderr)
        return 1
    except SubmitError as e:
        print(f"raydeploy submit: {e}", file=sys.stderr)
        return 1
    print(f"job {job_id} {status}")
    return 0 if status == "SUCCEEDED" else 1
