"""``omnibal train``: run the reference DP x PP trainer (baseline or omnibal mode).

One process (dp = pp = 1) runs in place; a larger world on one machine is started as local processes
(``--nproc`` defaults to dp x pp); under ``torchrun`` every rank runs the same command:
``torchrun --nproc-per-node N -m omnibal train ARGS`` (it reads RANK / WORLD_SIZE from the environment,
also across nodes).
"""

from __future__ import annotations

import argparse
import os
import sys

from omnibal.cli.options import ScheduleOrFile, add_layout_options, add_option, check_layout_args
from omnibal.errors import InputError, OmnibalError
from omnibal.layout import DpSync, Precision, TrainMode

CUDA_ALLOC_CONF = "expandable_segments:True"
"""PyTorch's caching allocator setting of a CUDA run, unless the user set ``PYTORCH_CUDA_ALLOC_CONF``: on
variable-length packs the default allocator holds far more than it hands out (docs/gpu.md, fragmentation)."""

CPP_LOG_LEVEL = "FATAL"
"""torch's C++ log level in a multi-rank run, unless the user set ``TORCH_CPP_LOG_LEVEL``: once a rank fails,
its peers' backends log their broken connections with C++ stack frames (20-80 lines per rank) before the
launcher can say the cause; every error still reaches the rank's Python code and its one-line report."""

HELP = "run the reference DP x PP trainer (baseline or omnibal mode) on a plan"
DESCRIPTION = (HELP + ". Examples: `omnibal train --stats stats.json --dp 2 --mode omnibal --steps 20`; "
               "`torchrun --nproc-per-node 4 -m omnibal train --stats stats.json --dp 2 --pp 2 --plan plan.json`.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("run")
    g.add_argument("--mode", choices=tuple(TrainMode), default="omnibal",
                   help="baseline: random padded micro-batches, even split, full recompute; omnibal: balanced "
                        "packs, planned partition and recompute; online: the baseline's random draws "
                        "re-dealt every step, vision and LLM phases balanced separately (OrchMLLM; with --pp > 1 "
                        "the vision phase runs on stage 0)")
    add_option(g, "model", default="tiny")
    add_option(g, "stats", help="per-sample statistics: the synthetic data follows them, or with --annotations the "
               "rows to train (omnibal stats of that file with the model's settings; default: computed from the "
               "annotations)")
    r = parser.add_argument_group("real data and Hugging Face models")
    r.add_argument("--annotations", dest="annotations_path", metavar="FILE",
                   help="LLaVA/InternVL annotation file (.json/.jsonl) to train on: real images and text")
    add_option(r, "image_root", help="folder image paths are relative to (default: the annotation file's folder)")
    add_option(r, "tokenizer")
    add_option(r, "hf_model", help="local Hugging Face checkpoint (Llava or InternVL) to fine-tune instead of the "
               "reference model")
    r.add_argument("--save-dir", metavar="DIR", help="write the fine-tuned model here as an HF checkpoint at the end "
                                                     "(and to DIR/checkpoint-STEP at every checkpoint)")
    r.add_argument("--max-tiles", type=int,
                   help="dynamic-resolution tiles per image, thumbnail not counted (InternVL-style models; a Llava "
                        "image is one tile; default: the checkpoint's preprocessor max_patches, else 12)")
    add_option(r, "on_error", default="raise")
    g.add_argument("--max-samples", type=int, help="seeded random subset of the statistics")
    g.add_argument("--stats-tokens-per-tile", type=int, default=256,
                   help="image tokens per tile counted in statistics without a recorded convention (rescaled to "
                   "the model's)")
    g.add_argument("--convert-stats", action="store_true",
                   help="convert statistics made in another image layout (InternVL tiles, LLaVA single images) to "
                   "the model's")
    g.add_argument("--steps", dest="num_steps", type=int, default=10, help="optimizer steps in total, counting resumed "
                   "ones (0: to the end of the epoch)")
    g.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    add_option(g, "seed", default=0, help="model init and baseline sampling seed")
    w = parser.add_argument_group("world")
    add_layout_options(w, defaults={"dp_size": 1, "pp_size": 1}, only=("dp_size", "pp_size"))
    w.add_argument("--nproc", type=int, help="local processes to start (default dp x pp; not under torchrun)")
    add_option(w, "device", default="cpu", help="gloo on cpu, NCCL on cuda")
    w.add_argument("--timeout", dest="timeout_s", type=float, default=60.0,
                   help="seconds a collective may block before the rank fails (dead or stuck peer)")
    add_option(w, "threads", default=1, help="torch threads per rank")
    w.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                   help="load the next step's samples on a background thread while the step computes "
                        "(default: on with --device cuda, off on cpu)")
    w.add_argument("--precision", choices=[p.value for p in Precision], default="fp32",
                   help="fp32, or bf16-mixed: fp32 weights and optimizer, forward under torch.autocast in bf16")
    p = parser.add_argument_group("pipeline and data")
    add_option(p, "num_microbatches", default=4, help="micro-batches per DP rank per step (omnibal balance's "
               "default too; omnibal plan's 8 is its 128-GPU default job's)")
    add_option(p, "schedule", default="1f1b", action=ScheduleOrFile, choices=None, metavar="{1f1b,gpipe}",
               help="pipeline schedule (a file name here is the deprecated spelling of --schedule-file)")
    p.add_argument("--dp-sync", choices=tuple(DpSync), default="flat",
                   help="gradient sum over DP: one flat all-reduce after the step (its wait is logged) or "
                        "DistributedDataParallel (overlaps the last backward)")
    add_option(p, "plan", help="Plan JSON (stage ranges and recompute sets; omnibal mode)")
    p.add_argument("--stage-layers", help='explicit half-open layer ranges per stage, e.g. "0:9,9:20"')
    add_option(p, "recompute", help='per-stage layer names to recompute: stages split by ";", names by ",", '
               'e.g. "vision.blocks.0,vision.blocks.1;" (empty stage: none)')
    p.add_argument("--selective", help='per-stage layer names under selective recompute (keep matrix-product '
                   'and attention outputs, recompute the rest), as --recompute: e.g. "llm.blocks.0,llm.blocks.1;"')
    add_option(p, "schedule_file", help="balanced schedule JSON (omnibal mode; default: balance the statistics now)")
    p.add_argument("--node-size", type=int, default=0, metavar="N",
                   help="online mode: DP ranks per node; samples and features move intra-node first, then "
                        "inter-node (must divide --dp; 0: one flat all-to-all)")
    p.add_argument("--online-balance", action=argparse.BooleanOptionalAction, default=True,
                   help="online mode: re-deal each step's draws across DP ranks; --no-online-balance is the "
                        "control run (unpadded packs, no recompute, every sample where it was drawn)")
    add_option(p, "batch_size", default=4, help="samples per micro-batch in baseline mode; online mode draws "
               "--microbatches x this many samples per rank per step")
    s = parser.add_argument_group("sequence parallelism")
    s.add_argument("--sp-degree", type=int, default=1, help="Ulysses SP degree: each group of N consecutive DP ranks "
                   "splits every pack (data balanced for dp/N groups; with --pp, inside each stage). A multi-level "
                   "schedule sets its own")
    s.add_argument("--level-curriculum", type=int, default=0, metavar="EPOCHS",
                   help="multi-level schedule of one of the first EPOCHS epochs: short levels first (default 0)")
    s.add_argument("--level-warmup", type=int, default=0, metavar="STEPS",
                   help="multi-level schedule, epoch 0: up to STEPS steps of the shortest level first, then the "
                   "levels alternate (HBP's warm-up; default 0)")
    _add_output_arguments(parser.add_argument_group("output"))


def _add_output_arguments(o) -> None:
    o.add_argument("--metrics-log", "--log", dest="log_path", metavar="FILE",
                   help="JSONL metrics log (one line per step); under torchrun spell it --metrics-log (torchrun's own "
                        "--log-dir/--logs-specs make --log ambiguous to its parser)")
    o.add_argument("--summary-json", dest="summary_path", help="write the end-of-run summary as JSON")
    o.add_argument("--ledger", dest="ledger_path", metavar="FILE", help="append the sample keys every step trained "
                   "(one JSON line per step; what exactly-once is checked from, omnibal.train.ledger)")
    o.add_argument("--checkpoint-dir", help="folder of step checkpoints (shared by all ranks)")
    o.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)")
    o.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    o.add_argument("--reshard", action="store_true", help="with --resume: accept a checkpoint written with another "
                   "dp size (same pp and stage layers) and re-balance the rest of its epoch for this one")
    o.add_argument("--print-every", type=int, default=0, metavar="N",
                   help="steps between the loss lines printed where stdout is not a terminal (a log file, a pipe); "
                        "default: about 20 lines per run, and at least one a minute")
    add_option(o, "quiet", help="no start line, progress bar, loss lines, summary table or saved-to line; notices "
               "about the data (records, samples or checkpoints skipped, samples left untrained) still go to "
               "stderr and --summary-json")


def config_from_args(args: argparse.Namespace):
    from omnibal.train.config import TrainConfig
    from omnibal.train.stage_layout import parse_stage_layers

    stage_layers = parse_stage_layers(args.stage_layers) if args.stage_layers else None
    recompute, selective = (None if text is None else
                            tuple(tuple(n.strip() for n in part.split(",") if n.strip()) for part in text.split(";"))
                            for text in (args.recompute, args.selective))
    check_layout_args(args)
    return TrainConfig(
        mode=args.mode, dp_size=args.dp_size, pp_size=args.pp_size, num_microbatches=args.num_microbatches,
        pipeline_schedule=args.schedule, dp_sync=args.dp_sync, stage_layers=stage_layers, recompute=recompute,
        selective=selective,
        plan_path=args.plan, model=args.model, stats_path=args.stats, schedule_path=args.schedule_file,
        max_samples=args.max_samples, stats_tokens_per_tile=args.stats_tokens_per_tile,
        convert_stats=args.convert_stats,
        annotations_path=args.annotations_path, image_root=args.image_root, tokenizer_path=args.tokenizer,
        hf_model=args.hf_model, save_dir=args.save_dir, max_tiles=args.max_tiles, on_error=args.on_error,
        baseline_batch_size=args.batch_size, num_steps=args.num_steps, lr=args.lr, seed=args.seed,
        device=args.device, precision=args.precision, prefetch=args.prefetch, timeout_s=args.timeout_s,
        torch_threads=args.threads,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
        reshard=args.reshard, log_path=args.log_path, summary_path=args.summary_path, ledger_path=args.ledger_path,
        quiet=args.quiet, sp_degree=args.sp_degree, level_curriculum=args.level_curriculum,
        level_warmup=args.level_warmup,
        print_every=args.print_every, node_size=args.node_size,
        online_balance=args.online_balance)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    nproc = args.nproc or cfg.world_size
    if nproc != cfg.world_size:
        raise InputError(f"--nproc {nproc} but dp {cfg.dp_size} x pp {cfg.pp_size} = {cfg.world_size}",
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
    from omnibal.train.distributed import root_causes_first, spawn_local

    # once a rank fails, the others' collectives fail within the timeout; a rank still there after twice that
    # is stopped or hung, and is killed and named rather than waited on
    results = spawn_local(train_rank, nproc, args=(cfg, notice, say), deadline_s=7 * 24 * 3600.0,
                          failure_grace_s=2 * cfg.timeout_s + 10, print_tracebacks=False)
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
    return (f"omnibal train: {cfg.mode} mode, model {cfg.hf_model or cfg.model}, data {data}, dp {cfg.dp_size} x "
            f"pp {cfg.pp_size} on {cfg.device} ({where}); loading")


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
        if r.traceback_text:
            print(f"\nomnibal train: rank {r.rank}'s traceback:\n{r.traceback_text.rstrip()}", file=sys.stderr)


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
    say(format_summary(summary, f"{cfg.mode} dp{cfg.dp_size} x pp{cfg.pp_size}"))
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
