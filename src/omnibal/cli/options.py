"""Every option more than one subcommand takes, spelled once: flag, type, choices, help.

A subcommand adds a shared option with :func:`add_option` (``add_option(group, "dp_size", default=1)``); it
may give its own default and help, never its own spelling, so ``--dp`` is ``--dp`` in every subcommand
(tests/test_cli_flags.py checks it). The layout options come from :data:`omnibal.layout.LAYOUT_FLAGS`,
declared beside :class:`omnibal.layout.Layout`; choice lists are the ``StrEnum`` vocabularies of
:mod:`omnibal.layout`.

To add a knob: one :class:`Option` entry in :data:`OPTIONS` (keyed by its ``dest``: the config field name
where one exists), then ``add_option`` in each subcommand that takes it, or the field's ``option`` metadata
(:mod:`omnibal.cli.fields`). To rename one: change its flag here and say so in CHANGELOG.md; the old
spelling is not kept.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from omnibal.cost.stack import STACKS
from omnibal.layout import (
    LAYOUT_FLAGS,
    ZERO_STAGES,
    BalanceMethod,
    Device,
    Dtype,
    Engine,
    OnError,
    OversizePolicy,
    PipelineSchedule,
    check_layout_fields,
)


@dataclass(frozen=True)
class Option:
    """One command-line knob."""

    flag: str
    """Its spelling, e.g. ``--dp``."""
    help: str
    """Default help (a subcommand may say more)."""
    kwargs: dict = field(default_factory=dict)
    """More ``add_argument`` keywords: type, choices, metavar, action."""
    short: tuple[str, ...] = ()
    """Short spellings offered beside ``flag``."""


OPTIONS: dict[str, Option] = {
    # cluster layout (omnibal.layout.Layout)
    **{dest: Option(spec["flag"], spec["help"],
                    {"type": int, **({"choices": ZERO_STAGES} if dest == "zero_stage" else {"metavar": "N"})})
       for dest, spec in LAYOUT_FLAGS.items()},
    "num_gpus": Option("--gpus", "devices in the job; DP x PP x TP must equal it", {"type": int, "metavar": "N"}),
    # model and hardware
    "model": Option("--model", "model preset (omnibal.cost.presets)"),
    "hf_model": Option("--hf-model", "local Hugging Face checkpoint (Llava / InternVL)", {"metavar": "DIR"}),
    "hardware": Option("--hardware", "hardware preset: a100-40g, a100-80g, h100, h200, cpu"),
    "profile": Option("--profile", "measured layer profile JSON (omnibal profile) instead of the analytic cost "
                      "model", {"metavar": "FILE"}),
    "stack": Option("--stack", "software stack whose weight/gradient/optimizer bytes the memory model counts",
                    {"choices": tuple(STACKS)}),
    "dtype": Option("--dtype", "training dtype", {"choices": tuple(Dtype)}),
    "device": Option("--device", "device type", {"choices": tuple(Device)}),
    "threads": Option("--threads", "torch CPU threads", {"type": int}),
    "engine": Option("--engine", "engine that will run the plan", {"choices": tuple(Engine)}),
    # pipeline
    "pp_schedule": Option("--pp-schedule", "pipeline schedule", {"choices": tuple(PipelineSchedule)}),
    "chunks": Option("--chunks", "model chunks per pipeline device"),
    "selective_recompute": Option("--selective-recompute", "let adaptive recompute run blocks selectively (stored "
                                  "apart from the trainer's per-stage --selective sets)"),
    "plan": Option("--plan", "plan JSON (omnibal plan)", {"metavar": "FILE"}),
    "recompute": Option("--recompute", "activation recompute per stage"),
    # data
    "stats": Option("--stats", "per-sample statistics file (omnibal stats)", {"metavar": "FILE"}),
    "samples": Option("--samples", "size of the synthetic InternVL-like mixture used without --stats",
                      {"type": int, "metavar": "N"}),
    "convert_stats": Option("--convert-stats", "convert statistics of another image convention (InternVL tiles / "
                            "LLaVA single image) to the model's instead of refusing them",
                            {"action": "store_true"}),
    "schedule_file": Option("--schedule-file", "balanced schedule JSON (omnibal balance) instead of balancing "
                            "here", {"metavar": "FILE"}),
    "balance_method": Option("--balance-method", "balancer: how samples are packed into micro-batches",
                             {"choices": tuple(BalanceMethod)}),
    "batch_size": Option("--batch-size", "samples per micro-batch of the random and length-grouped baselines",
                         {"type": int, "metavar": "N"}),
    "padding": Option("--padding", "how a micro-batch runs"),
    "max_tokens": Option("--max-tokens", "fixed Q_t, the token buffer of a pack (default: cap search)",
                         {"type": int, "metavar": "N"}),
    "oversize": Option("--oversize", "samples over a fixed cap: an error, a pack of their own, or dropped "
                       "(counted in the metrics)", {"choices": tuple(OversizePolicy)}),
    "seed": Option("--seed", "seed of data, shuffles and sampling", {"type": int}),
    "epoch": Option("--epoch", "epoch to balance", {"type": int}),
    "image_root": Option("--image-root", "folder image paths are relative to", {"metavar": "DIR"}),
    "tokenizer": Option("--tokenizer", "local tokenizer.json or tokenizer folder", {"metavar": "PATH"}),
    "on_error": Option("--on-error", "bad input records: stop at the first, or skip and report them",
                       {"choices": tuple(OnError)}),
    # output
    "out": Option("--out", "output path", short=("-o",)),
    "quiet": Option("--quiet", "no progress output", {"action": "store_true"}),
}


def add_option(group, dest: str, *, help: str | None = None, **overrides) -> argparse.Action:
    """Add the shared option ``dest`` to ``group`` (a parser, argument group or mutually exclusive group).
    ``overrides``: ``add_argument`` keywords of this subcommand (default, choices narrowed to what it
    supports, metavar)."""
    opt = OPTIONS[dest]
    kwargs = {**opt.kwargs, **overrides}
    return group.add_argument(opt.flag, *opt.short, dest=dest, help=help or opt.help, **kwargs)


def check_layout_args(args: argparse.Namespace) -> None:
    """Refuse a layout value given on the command line (None: not given) that no layout can have, naming its
    flag; ``--gpus`` too where the subcommand takes it."""
    for dest in (*LAYOUT_FLAGS, "num_gpus"):
        value = getattr(args, dest, None)
        if value is not None:
            check_layout_fields({dest: value}, source=OPTIONS[dest].flag)


def add_layout_options(group, *, defaults: dict, helps: dict | None = None, only: tuple[str, ...] | None = None
                       ) -> None:
    """The layout options (:data:`omnibal.layout.LAYOUT_FLAGS`) in their declared order: ``defaults`` per
    dest (a dest missing from it defaults to None: resolved later), ``helps`` to say more, ``only`` to
    offer a subset (the trainer has no TP or ZeRO)."""
    helps = helps or {}
    for dest in LAYOUT_FLAGS:
        if only is None or dest in only:
            add_option(group, dest, default=defaults.get(dest), help=helps.get(dest))
