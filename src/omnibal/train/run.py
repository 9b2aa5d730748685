"""Build one rank's run from a :class:`TrainConfig` and train: model preset, statistics, dataset, schedule,
stage layout, world. What ``omnibal train`` and ``torchrun ... -m omnibal train`` execute on every rank.

Same model, same data, same world for both modes; they differ only in what the modes are defined by:

``baseline``  random fixed micro-batches of ``baseline_batch_size`` samples, each padded to its longest
              sample; even layer split; every layer recomputed (InternVL's defaults).
``offline``   the balancer's packs (``--schedule-file``, else ``omnibal.data.balance.balance``), the plan's
              (or ``--stage-layers``) partition and recompute sets.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from omnibal.cost.hf_spec import load_hf_spec
from omnibal.cost.presets import get_model_preset
from omnibal.cost.units import model_stats
from omnibal.data.balance import balance
from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset
from omnibal.data.realdata import RealDataset
from omnibal.errors import InputError
from omnibal.outputs import check_dir, check_file, write_text
from omnibal.stats.io import load_stats
from omnibal.stats.table import ImageConvention
from omnibal.train.config import TrainConfig
from omnibal.train.distributed import World, destroy_world, init_world, local_world
from omnibal.train.feed import (
    check_schedule_covers,
    fixed_buffer,
    load_schedule,
    random_microbatch_schedule,
    schedule_fingerprint,
)
from omnibal.train.hf_run import export_hf, load_hf_chain, real_data_config, real_stats
from omnibal.train.hf_weights import check_weights
from omnibal.train.level_recompute import schedule_level_layout
from omnibal.train.loop import Trainer
from omnibal.train.model import VLM
from omnibal.train.online_pipeline import online_stage_layers
from omnibal.train.reshard import balance_record, reshard_schedule
from omnibal.train.reshard_kinds import hbp_of, hbp_params, hbp_rest, untrained
from omnibal.train.sp import level_order
from omnibal.train.stage_layout import resolve_layout


def max_samples_subset(stats, cfg: TrainConfig):
    """The ``--max-samples`` rows of ``stats``: a seeded random subset in file order (all rows without it)."""
    if cfg.max_samples is None or cfg.max_samples >= len(stats):
        return stats
    rows = np.sort(np.random.default_rng(cfg.seed).choice(len(stats), cfg.max_samples, replace=False))
    return stats.take(rows)


def _raw_training_stats(cfg: TrainConfig):
    """``--stats`` as the file has it (what ``omnibal balance`` balanced), then the ``--max-samples`` subset."""
    if cfg.stats_path is None:
        raise InputError("no statistics given: pass --stats FILE (SampleStats or the OmniBal token-length JSON)",
                         source="--stats")
    return max_samples_subset(load_stats(cfg.stats_path), cfg)


def _in_model_units(stats, cfg: TrainConfig, spec):
    """``stats`` as the model runs them (``omnibal.cost.units.model_stats``, as ``omnibal plan`` and
    ``balance``): a recorded convention is honoured; statistics without one counted ``--stats-tokens-per-tile``
    InternVL tokens per tile."""
    return model_stats(stats, spec, convert=cfg.convert_stats,
                       unrecorded=ImageConvention("internvl", cfg.stats_tokens_per_tile))


def load_training_stats(cfg: TrainConfig, spec):
    """The statistics the synthetic dataset reproduces: a seeded subset, token counts in the model's units."""
    return _in_model_units(_raw_training_stats(cfg), cfg, spec)


def build_schedule(cfg: TrainConfig, stats, stats_fingerprint: str | None = None):
    """The run's schedule (the same on every rank: a pure function of the inputs). A ``--schedule-file`` must
    have been balanced from these statistics (``stats_fingerprint``: of the rows as the stats file has them;
    default ``stats.fingerprint()``) and schedule each of their rows once."""
    groups = cfg.layout.dp_size // cfg.sp_degree  # data-parallel groups: the trainer deals each to its SP ranks
    if cfg.mode in ("baseline", "online"):  # online: the same local draws, re-dealt every step
        return random_microbatch_schedule(len(stats), dp_size=groups, num_microbatches=cfg.layout.num_microbatches,
                                          batch_size=cfg.baseline_batch_size, seed=cfg.seed)
    if cfg.schedule_path is not None:
        schedule = load_schedule(cfg.schedule_path)
        check_schedule_covers(schedule, stats_fingerprint=stats_fingerprint or stats.fingerprint(),
                              num_samples=len(stats), source=cfg.schedule_path,
                              stats_source=f"the statistics of this run ({stats.source})")
        return schedule

    return balance(stats, dp_size=groups, num_microbatches=cfg.layout.num_microbatches, seed=cfg.seed)


def schedule_for_world(old, stats, cfg: TrainConfig, spec):
    """``(old as its world ran it, a schedule of its epoch for this world)`` for a ``--schedule-file`` made for
    another DP size, given with ``--resume --reshard``: the resume finds the checkpoint's untrained samples in
    the first, and the run trains the second only when there is no checkpoint. An HBP schedule is balanced
    again at its levels, the balancer's single level with its recorded config; a hand-made one cannot be."""
    source = getattr(old, "source", "schedule")
    ran = level_order(old, curriculum_epochs=cfg.level_curriculum, warmup_steps=cfg.level_warmup)
    groups = cfg.layout.dp_size // cfg.sp_degree
    if hbp_of(old) is not None:
        return ran, hbp_rest(hbp_params(old), untrained(old, 0), stats, dp_size=groups,
                             num_heads=spec.llm.num_heads, source=source)
    record = balance_record(old)
    if record is None:
        raise InputError(f"schedule is for dp_size {old.dp_size}, the run has {groups}, and it records neither "
                         "levels nor how it was balanced (a hand-made schedule): its epoch cannot be re-balanced "
                         f"for dp {groups}", source=source, field="dp_size")
    manifest = {"sampler": {"next_step": 0, "schedule_fingerprint": schedule_fingerprint(old), "balance": record}}
    return ran, reshard_schedule(manifest, stats, dp_size=groups, num_microbatches=cfg.layout.num_microbatches,
                                 source=source, fingerprint=schedule_fingerprint)


def build_model(cfg: TrainConfig):
    """The model every rank builds whole (its stage keeps only its layers): the user's HF checkpoint wrapped
    as a layer chain, or the reference VLM of the preset."""
    if cfg.hf_model is not None:
        return load_hf_chain(cfg.hf_model)

    return VLM(get_model_preset(cfg.model), seed=cfg.seed)


def build_data(cfg: TrainConfig, model):
    """(statistics, dataset): real annotations and images with ``--annotations`` (samples built exactly as
    ``omnibal stats`` counts them, rows joined by key), else synthetic samples shaped like ``--stats``."""
    stats, dataset, _ = build_inputs(cfg, model)
    return stats, dataset


def build_inputs(cfg: TrainConfig, model, notify=None):
    """:func:`build_data` plus the statistics as their file has them (what a ``--schedule-file`` made by
    ``omnibal balance --stats`` was balanced from and records the fingerprint of). ``notify(line)``: told about
    skipped records."""
    spec = model.spec
    if cfg.annotations_path is not None:
        data = real_data_config(cfg, model)
        stats = max_samples_subset(real_stats(cfg, data, notify), cfg)
        dataset = RealDataset(cfg.annotations_path, data, stats=stats)
        if dataset.vocab_size_needed > spec.llm.vocab_size:
            raise InputError(f"the samples need {dataset.vocab_size_needed} token ids (tokenizer plus image "
                             f"tokens), the model has {spec.llm.vocab_size}", source=str(cfg.tokenizer_path),
                             field="tokenizer")
        return stats, dataset, stats

    raw = _raw_training_stats(cfg)
    stats = _in_model_units(raw, cfg, spec)
    return stats, SyntheticVLMDataset(stats, SyntheticSampleConfig(
        image_size=spec.vision.image_size, tokens_per_tile=spec.llm_tokens_per_tile,
        vocab_size=spec.llm.vocab_size, image_token_id=spec.llm.vocab_size - 1, seed=cfg.seed)), raw


def build_trainer(cfg: TrainConfig, world: World, notify=None, say=None):
    """The rank's :class:`Trainer`; ``notify(line)`` is told what the run decides about its data (global rank
    0, quiet or not: records, samples or checkpoints skipped, samples left untrained; a sample skipped while
    training is told by the rank that read it), ``say(line)`` (not quiet) what it trains, its loss every
    ``cfg.print_every`` steps and the checkpoints it saves."""
    model = build_model(cfg)
    spec = model.spec
    early: list[str] = []  # told before the trainer exists: its notices list them first

    def tell(line: str) -> None:
        early.append(line)
        if notify is not None:
            notify(line)

    stats, dataset, raw = build_inputs(cfg, model, tell if world.rank == 0 else None)
    schedule = build_schedule(cfg, stats, raw.fingerprint())
    balanced_on = raw if cfg.schedule_path is not None and cfg.mode == "offline" else stats
    trained_on = None
    if cfg.resume and cfg.reshard and schedule.dp_size != cfg.layout.dp_size // cfg.sp_degree:
        trained_on, schedule = schedule_for_world(schedule, balanced_on, cfg, spec)
    per_step = cfg.layout.dp_size // cfg.sp_degree * cfg.layout.num_microbatches * cfg.baseline_batch_size
    if world.rank == 0 and cfg.mode != "offline":
        left = len(stats) - schedule.num_steps * per_step
        if left:
            tell(f"{left} of {len(stats)} samples do not fill a whole step of "
                 f"{cfg.layout.dp_size // cfg.sp_degree} x {cfg.layout.num_microbatches} x {cfg.baseline_batch_size} "
                 f"({cfg.mode} mode's fixed micro-batches): they are not trained this epoch")
    names = [layer.name for layer, _ in model.chain()]
    recomputable = [layer.name for layer, _ in model.chain() if layer.kind in ("vision_block", "llm_block")]
    stage_layers = cfg.stage_layers
    if cfg.mode == "online" and cfg.layout.pp_size > 1 and stage_layers is None and cfg.plan_path is None:
        # vision on stage 0
        stage_layers = online_stage_layers(len(names), spec.vision.num_layers + 2, cfg.layout.pp_size)
    layout = resolve_layout(names, pp_size=cfg.layout.pp_size, mode=cfg.mode, stage_layers=stage_layers,
                            recompute=cfg.recompute, selective=cfg.selective, plan_path=cfg.plan_path,
                            model_name=spec.name,
                            recomputable=recomputable)
    if cfg.mode == "offline" and cfg.recompute is None and cfg.selective is None:  # explicit sets win
        layout = schedule_level_layout(layout, schedule, names, model_name=spec.name, notify=tell)
    buffer = fixed_buffer(schedule, stats, mode=cfg.mode) if world.pp_size > 1 else None
    info = {"config": cfg.to_dict(), "num_samples": len(stats), "schedule_steps": schedule.num_steps,
            "buffer": None if buffer is None else [buffer.tiles, buffer.tokens]}
    trainer = Trainer(world=world, model=model, layout=layout, schedule=schedule,
                      dataset=dataset if world.is_first_stage else None,  # the labels reach the last stage in the carry
                      mode=cfg.mode, num_microbatches=cfg.layout.num_microbatches,
                      pp_schedule=cfg.pp_schedule, lr=cfg.lr, dp_sync=cfg.dp_sync,
                      weight_decay=cfg.weight_decay, buffer=buffer,
                      log_path=cfg.log_path, quiet=cfg.quiet, checkpoint_dir=cfg.checkpoint_dir,
                      checkpoint_every=cfg.checkpoint_every, run_info=info, ledger_path=cfg.ledger_path,
                      notify=notify, sp_degree=cfg.sp_degree, level_curriculum=cfg.level_curriculum,
                      level_warmup=cfg.level_warmup,
                      precision=cfg.precision, say=say, print_every=cfg.print_every,
                      prefetch=cfg.device == "cuda" if cfg.prefetch is None else cfg.prefetch,
                      on_error=cfg.on_error, warn=notify, node_size=cfg.node_size,
                      online_balance=cfg.online_balance)
    trainer.notices[:0] = early
    trainer.reshard_source, trainer.schedule_stats = trained_on, balanced_on
    if cfg.save_dir is not None:
        def save(step: int | None) -> None:
            out = Path(cfg.save_dir) if step is None else Path(cfg.save_dir) / f"checkpoint-{step}"
            export_hf(trainer, model, out, tokenizer=cfg.tokenizer_path, model_dir=cfg.hf_model,
                      max_tiles=cfg.max_tiles)

        trainer.on_checkpoint = save
    return trainer


def preflight(cfg: TrainConfig) -> None:
    """Checks that need no process group (model, stage layout, plan, files), run once before ranks are
    started, so a bad argument fails in a second instead of in every rank."""
    for flag, path in (("--stats", cfg.stats_path), ("--schedule-file", cfg.schedule_path),
                       ("--annotations", cfg.annotations_path), ("--plan", cfg.plan_path)):
        if path is not None and not Path(path).is_file():  # a FIFO or device would block or never end
            raise InputError("exists but is not a regular file" if Path(path).exists() else "no such file",
                             source=path, field=flag)
    for flag, path in (("--image-root", cfg.image_root), ("--tokenizer", cfg.tokenizer_path),
                       ("--hf-model", cfg.hf_model)):
        if path is not None and not Path(path).exists():
            raise InputError("no such file or folder", source=path, field=flag)

    # every output before any work: a bad path fails now, not after training
    for flag, path in (("--metrics-log (--log)", cfg.log_path), ("--summary-json", cfg.summary_path),
                       ("--ledger", cfg.ledger_path)):
        check_file(path, flag)
    for flag, path in (("--checkpoint-dir", cfg.checkpoint_dir), ("--save-dir", cfg.save_dir)):
        check_dir(path, flag)
    check_fresh_outputs(cfg)
    if cfg.hf_model is not None:
        spec = load_hf_spec(cfg.hf_model)
        check_weights(cfg.hf_model, field="--hf-model")  # a cut-short file fails here, not in every rank
    else:
        spec = get_model_preset(cfg.model)
    layers = spec.layers()
    resolve_layout([layer.name for layer in layers], pp_size=cfg.layout.pp_size, mode=cfg.mode,
                   stage_layers=cfg.stage_layers, recompute=cfg.recompute, selective=cfg.selective,
                   plan_path=cfg.plan_path, model_name=spec.name,
                   recomputable=[layer.name for layer in layers if layer.kind in ("vision_block", "llm_block")])
    if cfg.stats_path is None and cfg.annotations_path is None:
        raise InputError("no data given: pass --annotations FILE (with --tokenizer) for real data, or --stats FILE "
                         "for synthetic samples shaped like those statistics", source="--stats")


def check_fresh_outputs(cfg: TrainConfig) -> None:
    """Without ``--resume``, refuse a checkpoint folder that holds checkpoints and a ledger that holds steps:
    a new run would silently start over, overwrite the checkpoints step by step and log its samples a second
    time into the same ledger. Continuing is one flag away; starting over is another folder or file."""
    if cfg.resume:
        return
    from omnibal.train.checkpoint import list_steps
    from omnibal.train.ledger import read_ledger

    steps = list_steps(cfg.checkpoint_dir) if cfg.checkpoint_dir else []
    if steps:
        raise InputError(f"holds checkpoints of an earlier run (steps {', '.join(map(str, steps[-3:]))}"
                         f"{', ...' if len(steps) > 3 else ''}): pass --resume to continue from the newest, or give "
                         "another --checkpoint-dir (or remove these) to start over", source=cfg.checkpoint_dir,
                         field="--checkpoint-dir")
    if cfg.ledger_path and Path(cfg.ledger_path).is_file() and Path(cfg.ledger_path).stat().st_size:
        logged = [e for e in read_ledger(cfg.ledger_path) if e["event"] == "step"]
        if logged:
            raise InputError(f"already records {len(logged)} steps of an earlier run: a new run would log its "
                             "samples a second time; pass --resume (with that run's --checkpoint-dir) to continue "
                             "it, or give another --ledger file (or remove this one) to start over",
                             source=cfg.ledger_path, field="--ledger")


def _level_sets(layout) -> list | None:
    """Per level, per stage, ``{"recompute": [...], "selective": [...]}`` (None: one set for every step)."""
    if not layout.level_recompute:
        return None
    return [[{"recompute": list(w), "selective": list(p)} for w, p in zip(whole, part)]
            for whole, part in zip(layout.level_recompute, layout.level_selective)]


def train_rank(cfg: TrainConfig, notify=None, say=None) -> dict:
    """Everything one rank does: join the world, build, resume, train; returns the summary on rank 0.
    ``notify(line)``: told what the run decided about its data (resumed, records, samples or checkpoints
    skipped, samples left untrained), quiet or not; ``say(line)``: the run's own lines, unless quiet
    (:func:`build_trainer`). Both must pickle when the rank is spawned (module-level functions)."""
    torch.set_num_threads(cfg.torch_threads)
    if cfg.world_size == 1 and "RANK" not in os.environ:
        world = local_world(cfg.device, cfg.timeout_s)
    else:
        world = init_world(dp_size=cfg.layout.dp_size, pp_size=cfg.layout.pp_size, device=cfg.device,
                           timeout_s=cfg.timeout_s)
    trainer = build_trainer(cfg, world, notify, say)
    if cfg.resume:
        trainer.maybe_resume(reshard=cfg.reshard)
    summary = trainer.run(cfg.num_steps)
    if trainer.on_checkpoint is not None:
        trainer.on_checkpoint(None)  # the final model
    if summary and cfg.summary_path:
        write_text(cfg.summary_path, json.dumps({"config": cfg.to_dict(), "summary": summary,
                                                      "notices": trainer.notices,
                                                      "skipped_samples": trainer.skipped_samples,
                                                      "skipped_checkpoints": trainer.skipped_checkpoints,
                                                      "stage_layers": [list(r) for r in trainer.layout.ranges],
                                                      "recompute": [list(r) for r in trainer.layout.recompute],
                                                      "selective": [list(r) for r in trainer.layout.selective],
                                                      "level_recompute": _level_sets(trainer.layout),
                                                      "buffer": None if trainer.buffer is None else
                                                      [trainer.buffer.tiles, trainer.buffer.tokens]}, indent=1))

    destroy_world()
    return summary
