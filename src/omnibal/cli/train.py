"""``omnibal train``: run the reference DP x PP trainer (baseline or offline mode).

One process (dp = pp = 1) runs in place; a larger world on one machine is started as local processes
(``--nproc`` defaults to dp x pp); under ``torchrun`` every rank runs the same command:
``torchrun --nproc-per-node N -m omnibal train ARGS`` (it reads RANK / WORLD_SIZE from the environment,
also across nodes).
"""

from __future__ import annotations

import argparse
import os
import sys

from omnibal.cli.fields import add_config_arguments, config_from_args
from omnibal.cli.options import check_layout_args
from omnibal.errors import InputError, OmnibalError
from omnibal.train.rank_exceptions import remote_traceback

CUDA_ALLOC_CONF = "expandable_segments:True"
"""PyTorch's caching allocator setting of a CUDA run, unless the user set ``PYTORCH_CUDA_ALLOC_CONF``: on
variable-length packs the default allocator holds far more than it hands out (docs/gpu.md, fragmentation)."""

CPP_LOG_LEVEL = "FATAL"
"""torch's C++ log level in a multi-rank run, unless the user set ``TORCH_CPP_LOG_LEVEL``: once a rank fails,
its peers' backends log their broken connections with C++ stack frames (20-80 lines per rank) before the
launcher can say the cause; every error still reaches the rank's Python code and its one-line report."""

HELP = "run the reference DP x PP trainer (baseline or offline mode) on a plan"
DESCRIPTION = (HELP + ". Examples: `omnibal train --stats stats.json --dp 2 --mode offline --steps 20`; "
               "`torchrun --nproc-per-node 4 -m omnibal train --stats stats.json --dp 2 --pp 2 --plan plan.json`.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trainer's knobs, one per :class:`omnibal.train.config.TrainConfig` field (its docstring is the
    help), plus ``--nproc``, which only says how many local processes to start."""
    from omnibal.train.config import TrainConfig

    add_config_arguments(parser.add_argument_group("training run (omnibal.train.config.TrainConfig)"),
                         TrainConfig, skip=("tp_size", "zero_stage"))
    parser.add_argument("--nproc", type=int, help="local processes to start (default dp x pp; not under torchrun)")


def train_config(args: argparse.Namespace):
    """The :class:`omnibal.train.config.TrainConfig` of the parsed arguments."""
    from omnibal.train.config import TrainConfig

    check_layout_args(args)
    return config_from_args(TrainConfig, args)


def run(args: argparse.Namespace) -> int:
    cfg = train_config(args)
    nproc = args.nproc or cfg.world_size
    if nproc != cfg.world_size:
        raise InputError(f"--nproc {nproc} but dp {cfg.layout.dp_size} x pp {cfg.layout.pp_size} = {cfg.world_size}",
                         source="--nproc")
    torchrun = "RANK" in os.environ
    if not cfg.quiet and os.environ.get("RANK", "0") == "0":
        say(start_line(cfg, nproc, torchrun))  # before torch is imported and the ranks start: seconds to minutes
    if nproc > 1:  # read when torch loads (here, or in the ranks this process starts); the user's setting wins
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", CPP_LOG_LEVEL)
    from omnibal.train.run import preflight, train_rank

    preflight(cfg)
    if cfg.device == "cuda":  # before any CUDA call, for this process and the ranks it starts
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
    if nproc == 1 or torchrun:
        _finish(cfg, train_rank(cfg, notice, say))
        return 0
    from omnibal.processes import start_method
    from omnibal.train.distributed import root_causes_first, spawn_local

    # once a rank fails, the others' collectives fail within the timeout; a rank still there after twice that
    # is stopped or hung, and is killed and named rather than waited on
    method = start_method(cfg.device)
    if method == "fork":  # a tokenizer the parent used cannot take its thread pool across a fork (it warns)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = spawn_local(train_rank, nproc, args=(cfg, notice, say), deadline_s=7 * 24 * 3600.0,
                          failure_grace_s=2 * cfg.timeout_s + 10, print_tracebacks=False, start_method=method)
    failed = root_causes_first(results)
    if not failed:
        _finish(cfg, results[0].value)
        return 0
    if all(r.input_error is not None for r in failed):
        raise failed[0].input_error  # every rank refused the same input: one line, exit status 2
    report_failures(failed)
    causes = [r for r in failed if not r.peer_failure]
    # a rank's bad input (an image, a path it could not write) is the cause, the others' failures its echo
    return 2 if causes and all(r.input_error is not None or r.path_error is not None for r in causes) else 1


def start_line(cfg, nproc: int, torchrun: bool) -> str:
    """What runs where, said before anything slow (importing torch, starting ranks, loading the model)."""
    data = cfg.annotations_path or cfg.stats_path
    where = (f"torchrun's {os.environ.get('WORLD_SIZE', '?')} ranks" if torchrun else
             "one process" if nproc == 1 else f"{nproc} local processes")
    return (f"omnibal train: {cfg.mode} mode, model {cfg.hf_model or cfg.model}, data {data}, "
            f"dp {cfg.layout.dp_size} x pp {cfg.layout.pp_size} on {cfg.device} ({where}); loading")


def report_failures(failed) -> None:
    """One line per failed rank on stderr, the cause first (:func:`root_causes_first`): a rank's own error
    (an input error names its file and record), a signal or a hang, then the ranks that saw it; then the
    traceback of any rank that raised something other than an omnibal error (a bug)."""
    for r in failed:
        own = isinstance(r.exception, OmnibalError)  # its message is the whole story, no type name needed
        line = (str(r.exception) if own else f"{r.path_error.filename}: {r.path_error.strerror}" if r.path_error
                else (r.message or f"exit code {r.exitcode}"))
        print(f"omnibal train: {'' if line.startswith(f'rank {r.rank} ') else f'rank {r.rank}: '}{line}",
              file=sys.stderr)
    for r in failed:
        if trace := remote_traceback(r.exception):
            print(f"\nomnibal train: rank {r.rank}'s traceback:\n{trace.rstrip()}", file=sys.stderr)


def notice(line: str) -> None:
    """What the trainer tells about the data (quiet or not): one line on stderr. Module-level: spawned ranks
    pickle it."""
    print(f"omnibal train: {line}", file=sys.stderr, flush=True)


def say(line: str) -> None:
    """The run's own lines (start, loss, checkpoints, summary, saved to) on stdout, flushed: a spawned rank's
    stdout is a pipe or file more often than not. Module-level: spawned ranks pickle it."""
    print(line, flush=True)


def _finish(cfg, summary: dict | None) -> None:
    """The end-of-run table and what the run saved where, on stdout (rank 0 returns the summary; other ranks
    an empty one)."""
    from omnibal.train.metrics_log import format_summary

    if not summary or cfg.quiet:
        return
    say(format_summary(summary, f"{cfg.mode} dp{cfg.layout.dp_size} x pp{cfg.layout.pp_size}"))
    say(saved_line(cfg))


def saved_line(cfg) -> str:
    """``omnibal train: saved ...``: every output of the run, by flag order (the newest checkpoint's folder)."""
    from omnibal.train.checkpoint import list_steps, step_dir

    saved = []
    if cfg.save_dir:
        saved.append(f"the model to {cfg.save_dir} (from_pretrained loads it)")
    steps = list_steps(cfg.checkpoint_dir) if cfg.checkpoint_dir else []
    if steps:
        saved.append(f"checkpoint {step_dir(cfg.checkpoint_dir, steps[-1])}")
    for what, path in (("metrics", cfg.log_path), ("ledger", cfg.ledger_path), ("summary", cfg.summary_path)):
        if path:
            saved.append(f"{what} {path}")
    return "omnibal train: saved " + ", ".join(saved) if saved else \
        "omnibal train: nothing saved (--save-dir, --checkpoint-dir, --metrics-log keep what a run did)"
