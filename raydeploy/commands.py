"""What each CLI command does: load the config, call the one module that does the work, report errors.

Each function takes the parsed argparse namespace and returns an exit code. Errors a user can fix
(config, checkpoint, input) print one clear line to stderr and exit 1; no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path

from raydeploy.checkpoint.format import CheckpointError
from raydeploy.config import Config, ConfigError, config_reference_markdown, load_config


def _user_errors(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ConfigError as e:
            print(f"raydeploy {args.command}: config error: {e}", file=sys.stderr)
            return 1
        except CheckpointError as e:
            print(f"raydeploy {args.command}: checkpoint error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return run


def check_chat_template(cfg: Config, checkpoint_dir: str | None) -> None:
    """A ConfigError (key model.chat_template) when the deployment could not render a chat: no template in the
    config nor with the checkpoint's tokenizer, or a configured template file that is missing. `checkpoint_dir`
    None: the checkpoint's directory where this machine has it (a demo model's, or a local path); a checkpoint
    elsewhere (a URL) is not checked here, the ingress then refuses chats with a 400 saying the same."""
    from raydeploy.serve.text import template_problem

    if checkpoint_dir is None:
        ref = cfg.model.checkpoint
        if ref.startswith("demo:"):
            from raydeploy.checkpoint.demo import resolve_checkpoint

            checkpoint_dir = str(resolve_checkpoint(ref))
        else:
            base = Path(cfg.source).parent if cfg.source and not cfg.source.startswith("<") else Path.cwd()
            local = Path(ref).expanduser()
            local = local if local.is_absolute() else base / local
            if "://" in ref or not local.is_dir():
                if cfg.model.chat_template:
                    checkpoint_dir = str(local)  # only the configured template's file is checked
                else:
                    return
            else:
                checkpoint_dir = str(local)
    problem = template_problem(cfg.model.chat_template, cfg.source, checkpoint_dir)
    if problem is not None:
        raise ConfigError(problem, file=cfg.source, key="model.chat_template")


@_user_errors
def config_reference(args: argparse.Namespace) -> int:
    print(config_reference_markdown())
    return 0


@_user_errors
def generate(args: argparse.Namespace) -> int:
    from raydeploy.engine.generate import run_generate

    cfg = load_config(args.config, args.overrides)
    return run_generate(cfg, args)


@_user_errors
def convert(args: argparse.Namespace) -> int:
    from raydeploy.checkpoint.convert import run_convert

    return run_convert(args)


@_user_errors
def plan(args: argparse.Namespace) -> int:
    from raydeploy.plan import make_plan, model_family, report_plan

    cfg = load_config(args.config, args.overrides)
    check_chat_template(cfg, None)
    if not getattr(args, "compile", False):
        return report_plan(make_plan(cfg), args)
    # --compile: the same memory figures as `raydeploy compile`, every program compiled for the target
    from raydeploy.compile import CompileError, compile_config, prepare_environment

    prepare_environment(cfg)  # before anything imports jax
    the_plan = make_plan(cfg)
    if not the_plan.ok:
        return report_plan(the_plan, args)
    family, model, _ = model_family(cfg)
    try:
        programs = compile_config(cfg, the_plan, family, model)
    except CompileError as e:
        raise ConfigError(str(e)) from e
    return report_plan(the_plan, args, programs)


@_user_errors
def compile_programs(args: argparse.Namespace) -> int:
    from raydeploy.compile import only_kinds, prepare_environment, run_compile
    from raydeploy.plan import make_plan, model_family

    cfg = load_config(args.config, args.overrides)
    prepare_environment(cfg)  # before anything imports jax
    only = only_kinds(args.only)
    the_plan = make_plan(cfg)
    family, model, _ = model_family(cfg)
    return run_compile(cfg, the_plan, family, model, args, only)


compile = compile_programs  # noqa: A001 - `raydeploy compile` dispatches by command name


@_user_errors
def serve(args: argparse.Namespace) -> int:
    from raydeploy.gang.gang import resolve_checkpoint_path
    from raydeploy.serve.run import run_serve

    cfg = load_config(args.config, args.overrides)
    check_chat_template(cfg, resolve_checkpoint_path(cfg))
    return run_serve(cfg, args)


@_user_errors
def predict(args: argparse.Namespace) -> int:
    from raydeploy.predict import run_predict

    cfg = load_config(args.config, args.overrides)
    return run_predict(cfg, args)


@_user_errors
def submit(args: argparse.Namespace) -> int:
    from raydeploy.submit import run_submit

    return run_submit(args)


@_user_errors
def status(args: argparse.Namespace) -> int:
    from raydeploy.status import run_status

    return run_status(args)
