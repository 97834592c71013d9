"""``polyaccel-moe``: fine-tune (``finetune``) and benchmark (``bench``) MoE models; examples in ``--help``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

_EPILOG = """examples:
  polyaccel-moe presets
  polyaccel-moe finetune packages/moe/examples/tiny_synthetic_cpu.yaml
  polyaccel-moe finetune sft.yaml --set train.lr=2e-5 --set train.max_steps=500
  torchrun --nproc-per-node 8 -m polyaccel.moe.cli finetune sft.yaml
  ray job submit -- polyaccel-moe finetune sft.yaml --ray --workers 8
  polyaccel-moe bench --preset qwen3-30b-a3b-L8 --steps 10 --peak-tflops 800

config precedence: --set key=value > the YAML file > the preset named by model.preset.
outputs: finetune needs output_dir (the final model) or checkpoint.dir, else it refuses to start
(exit 2): nothing else would keep what it trains. Output locations are proven writable first,
and locked for the run (a <folder>.lock beside each): a second run on them exits 2.
exit status: 0 done (also: the run had already finished), 1 another error, named in one line
(a pipe other than stdout broke), 2 configuration or checkpoint error (nothing trained; with --ray also a run summary
Ray hands back unreadable, the run itself finished), 3 a non-finite loss or gradient norm
stopped training (or every step was skipped, or the final weights are not finite: nothing
saved), 4 training ran but its model could not be written (output_dir or a checkpoint: full
disk...); nothing partial is left, and the message names where the trained weights are: the
final checkpoint (rerun the same command to write output_dir from it), or, without
checkpoint.dir, a fallback folder polyaccel-moe-rescue-* next to output_dir, else in $TMPDIR or
the working directory.
130: interrupted (Ctrl-C), 143: terminated (SIGTERM: kill, timeout, a scheduler's pre-emption),
129: hung up (SIGHUP: the terminal closed; not under nohup):
one line names the newest complete checkpoint, which rerunning the same command resumes from (a
checkpoint cut off while being written never counts: the previous one stays the newest); a
second Ctrl-C while the run unwinds ends the process at once.
141: the reader of stdout went away (| head). JSON printed is strict (NaN, infinity: null).
docs: docs/moe_finetune.md"""

EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_SAVE = 4


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = list(args.set or [])
    if getattr(args, "peak_tflops", None):
        extra.append(f"log.peak_tflops={args.peak_tflops}")
    return extra


def _finetune(args: argparse.Namespace) -> int:
    from polyaccel.core.clitools import dumps, printable
    from polyaccel.moe.train_config import ConfigError, load_config

    ray_only = [flag for flag, value in (("--workers", args.workers), ("--address", args.address),
                                         ("--storage-path", args.storage_path)) if value is not None]
    if ray_only and not args.ray:  # else silently one process, not the workers asked for
        raise ConfigError(f"{' and '.join(ray_only)} only appl{'ies' if len(ray_only) == 1 else 'y'} with --ray (Ray Train workers); add --ray, or "
                          "use torchrun for several processes without Ray")
    cfg = load_config(args.config, _overrides(args))
    args.loaded_config = cfg  # for the line an interrupt prints
    if not cfg.output_dir and not cfg.checkpoint.dir:
        raise ConfigError("neither output_dir nor checkpoint.dir is set, so the trained model would be thrown "
                          "away; set output_dir (where the final model is saved), e.g. --set output_dir=runs/my-run, "
                          "or checkpoint.dir (to only time a workload: polyaccel-moe bench)")
    if args.ray:
        from polyaccel.core.ray_local import check_address, starts_private_cluster
        from polyaccel.moe.ray_train import run_with_ray

        if not starts_private_cluster(args.address):
            try:
                check_address(args.address)
            except ValueError as e:
                raise ConfigError(f"--address: {e}") from None
        summary = run_with_ray(cfg, workers=args.workers or 1, address=args.address,
                               storage_path=args.storage_path)
        print(dumps(summary))
        return 0
    from polyaccel.moe.train import NonFiniteError, SaveError, finetune

    try:
        result = finetune(cfg)
    except NonFiniteError as e:
        print(f"polyaccel-moe: error: {printable(e)}", file=sys.stderr)
        return EXIT_NONFINITE
    except SaveError as e:
        print(f"polyaccel-moe: error: {printable(e)}", file=sys.stderr)
        return EXIT_SAVE
    if int(os.environ.get("RANK", "0")) == 0:
        print(dumps(result.summary()))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from polyaccel.core.clitools import dumps, printable
    from polyaccel.moe.train import NonFiniteError, benchmark
    from polyaccel.moe.train_config import load_config

    overrides = _overrides(args)
    if args.preset:
        overrides.insert(0, f"model.preset={args.preset}")
    cfg = load_config(args.config, overrides)
    try:
        result = benchmark(cfg, steps=args.steps, warmup=args.warmup)
    except NonFiniteError as e:
        print(f"polyaccel-moe: error: {printable(e)}", file=sys.stderr)
        return EXIT_NONFINITE
    print(dumps(result))
    return 0


def _presets(args: argparse.Namespace) -> int:
    from polyaccel.moe.flops import train_flops_per_token
    from polyaccel.moe.train_config import PRESETS

    for name, fn in PRESETS.items():
        cfg = fn()
        mc, t = cfg.model.config, cfg.train
        gflop = train_flops_per_token(mc, t.seq_len) / 1e9
        print(f"{name:<20} {mc.get('model_type')}: {mc.get('num_hidden_layers')} layers, hidden "
              f"{mc.get('hidden_size')}, {mc.get('num_experts') or mc.get('num_local_experts') or mc.get('n_routed_experts', 0)} experts "
              f"top-{mc.get('num_experts_per_tok', 0)}{f' + {shared} shared' if (shared := mc.get('n_shared_experts')) else ''}; "
              f"seq {t.seq_len} x micro-batch {t.micro_batch} x accum {t.grad_accum}, {t.dtype}; "
              f"{gflop:.3g} GFLOP/token fwd+bwd")
        if args.verbose:
            print("  " + (fn.__doc__ or "").strip().replace("\n", "\n  "))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``polyaccel-moe`` argument parser."""
    from polyaccel.core.argtypes import integer, number

    p = argparse.ArgumentParser(prog="polyaccel-moe", description="Fine-tune and benchmark Mixture-of-Experts models.",
                                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("finetune", help="train a model from a YAML config (in-process, torchrun or Ray)",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    f.add_argument("config", help="YAML config file (see packages/moe/examples/)")
    f.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one config key, e.g. --set train.lr=2e-5 (repeatable)")
    f.add_argument("--ray", action="store_true", help="run on Ray Train workers")
    f.add_argument("--workers", type=integer(1), default=None,
                   help="with --ray: Ray Train workers (one GPU each when GPUs exist; default: 1)")
    f.add_argument("--address", help="with --ray: Ray cluster address (default: RAY_ADDRESS, else a private local cluster on "
                   "loopback; 'auto' is refused: it joins whatever cluster a local user advertises)")
    f.add_argument("--storage-path", help="with --ray: Ray Train run storage: shared storage on several nodes (default: a "
                   "private temporary folder on a local cluster, else ~/ray_results)")
    f.add_argument("--peak-tflops", type=number(0, strict=True), help="peak bf16 TFLOP/s per device for MFU (default: datasheet)")
    f.set_defaults(fn=_finetune)

    b = sub.add_parser("bench", help="measure tokens/s, MFU and peak memory of a preset or config",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--preset", help="preset name (polyaccel-moe presets)")
    b.add_argument("--config", help="YAML config instead of / on top of the preset")
    b.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one config key (repeatable)")
    b.add_argument("--steps", type=integer(1), default=10, help="measured optimizer steps (default: 10)")
    b.add_argument("--warmup", type=integer(0), default=3, help="steps run before measuring (default: 3)")
    b.add_argument("--peak-tflops", type=number(0, strict=True), help="peak bf16 TFLOP/s per device for MFU")
    b.set_defaults(fn=_bench)

    pr = sub.add_parser("presets", help="list the named presets")
    pr.add_argument("-v", "--verbose", action="store_true", help="also describe each preset (what it is for)")
    pr.set_defaults(fn=_presets)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (see ``_EPILOG``)."""
    from polyaccel.core.clitools import (
        broken_pipe,
        interrupt_status,
        printable,
        second_ctrl_c_ends_at_once,
        sigterm_as_interrupt,
    )
    from polyaccel.moe.train_config import ConfigError

    args = build_parser().parse_args(argv)
    if args.command == "bench" and not (args.preset or args.config):
        build_parser().error("bench needs --preset or --config")
    try:
        with sigterm_as_interrupt(), second_ctrl_c_ends_at_once():
            return args.fn(args)
    except (ConfigError, NotImplementedError) as e:
        print(f"polyaccel-moe: error: {printable(e)}", file=sys.stderr)  # data text may hold escape sequences
        return EXIT_CONFIG
    except BrokenPipeError as e:  # `polyaccel-moe presets | head`: the reader left; no traceback
        return broken_pipe(e, "polyaccel-moe")
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: one line, no traceback
        status, word = interrupt_status(e)
        print(f"polyaccel-moe: {_interrupted(args, word)}", file=sys.stderr)
        return status


def _interrupted(args: argparse.Namespace, word: str = "interrupted") -> str:
    """The line for a run stopped by Ctrl-C or SIGTERM (``word``): where rerunning the same
    command resumes from.
    Checkpoints and output_dir are written atomically (a save cut off leaves the previous ones
    as they were), so the newest checkpoint with a manifest is the one a resume picks."""
    if args.command != "finetune":
        return f"{word}; {args.command} writes nothing, so nothing was saved"
    cfg = getattr(args, "loaded_config", None)
    root = cfg.checkpoint.dir if cfg is not None else None
    if not root:
        return (f"{word}; nothing of this run was saved (without checkpoint.dir there are no checkpoints to "
                "resume from: a rerun starts over; set one, e.g. --set checkpoint.dir=runs/ck)" if cfg is not None
                else f"{word}; nothing was saved")
    try:
        from polyaccel.moe.checkpoint import latest_checkpoint

        newest = latest_checkpoint(root)
    except Exception:  # (a file system gone): the line must still come out
        newest = None
    if newest is None:
        return (f"{word}; no checkpoint was completed in checkpoint.dir {root} yet: rerunning the same "
                "command starts over")
    return f"{word}; rerun the same command to resume from the last checkpoint ({newest})"


def run() -> None:
    """The ``polyaccel-moe`` command: :func:`main`'s status as the exit code (see
    :func:`polyaccel.core.clitools.exit_process` for the ranks of a multi-process run). A
    Ctrl-C while torch loads (seconds, before :func:`main` can catch it) is one line, 130."""
    try:
        from polyaccel.core.clitools import exit_process
    except KeyboardInterrupt:
        print("polyaccel-moe: interrupted while starting; nothing was run or saved", file=sys.stderr)
        raise SystemExit(130) from None
    exit_process(main())


if __name__ == "__main__":
    run()
