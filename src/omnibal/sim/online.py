"""The online mode (OrchMLLM-style post-balancing, ``omnibal train --mode online``) in the simulator.

Each DP rank draws ``num_microbatches x batch_size`` random samples (the baseline's draws); per step the
sizes are all-gathered, the vision phase is dealt by tile and the LLM phase by LLM cost
(:func:`omnibal.data.online.balance_phases`), samples move by one all-to-all and the visual features by a
second one (and their gradients back by its reverse). Modelled here:

- **compute**: each rank's micro-batch ``k`` carries the ``k``-th share of its *vision* tiles and the
  tokens of the ``k``-th share of its *LLM* samples, so the pipeline engine charges the
  encoder layers for the vision assignment and the LLM layers for the LLM assignment (no padding: varlen
  packs). With pp > 1 that is OrchMLLM's dispatch per pipeline (idealised: the features are assumed to
  reach the LLM phase's pipeline where the encoder ends);
- **communication**, added to every step, not overlapped: the all-gather of 4 integers per sample (a ring:
  ``(D-1)`` latencies), the sample all-to-all (pixels to the vision owner, token ids to the LLM owner) and the
  feature all-to-all forward and backward, each timed by the busiest rank's bytes (the larger of sent and
  received, of tiles and samples that change rank) over the DP link of :class:`~omnibal.sim.costs.SimConfig` plus
  ``(D-1)`` latencies.

:func:`compare_online_offline` runs baseline, online and omnibal (offline) on the same draws for a cluster
(default: ``omnibal plan``'s 128-GPU job) and returns the per-phase max/mean, step time, communication and
epoch GPU days of each.
"""

from __future__ import annotations

import numpy as np

from omnibal.cost.table import microbatch_features
from omnibal.data.balance.cost import DEFAULT_COST, BalanceCost
from omnibal.data.online import PhaseAssignment, balance_phases, llm_packs, phase_loads
from omnibal.data.online_owners import TransferBytes, moved_bytes, tile_positions


def online_step(tiles, tokens, draws, *, num_microbatches: int, cost: BalanceCost | None = None,
                transfer: TransferBytes | None = None, keep_on_owner: bool = True, balance: bool = True):
    """One online step from the local ``draws`` (per rank, its sample rows; ``[D, n]`` or a list). Returns
    ``(features [D, M, 4], assignment, owners)``; ``owners`` is ``(data rank of every position, vision rank
    of every tile, LLM rank of every position)``, positions rank-major, tiles in position order.
    ``keep_on_owner``: place the work as the trainer does (fewest moved bytes, weighed by ``transfer``), else
    owner-blind. ``balance`` False: the control, every sample stays where it was drawn (online's varlen
    packs without its re-deal)."""
    cost = cost or DEFAULT_COST
    draws = [np.asarray(d, np.int64) for d in draws]
    dp = len(draws)
    rows = np.concatenate(draws)
    t, k = np.asarray(tiles)[rows], np.asarray(tokens)[rows]
    data = np.repeat(np.arange(dp), [len(d) for d in draws])
    if balance:
        a = balance_phases(t, k, dp_size=dp, cost=cost, owner=data if keep_on_owner else None, transfer=transfer,
                           num_packs=num_microbatches)
    else:
        mine = [np.flatnonzero(data == r).tolist() for r in range(dp)]
        lv, ll = phase_loads(mine, t, k, cost=cost)
        a = PhaseAssignment(vision_tiles=data[tile_positions(t)], llm=mine, vision_load=lv, llm_load=ll)
    llm = cost.sample_costs(t, k)[1]
    vision_tiles = np.bincount(a.vision_tiles, minlength=dp)
    feats = np.zeros((dp, num_microbatches, 4))
    kf = k.astype(np.float64)
    for r in range(dp):
        packs = llm_packs(a.llm[r], llm, num_microbatches)
        packs += [np.zeros(0, np.int64)] * (num_microbatches - len(packs))
        for j, ls in enumerate(packs):
            tiles_j = vision_tiles[r] // num_microbatches + (j < vision_tiles[r] % num_microbatches)
            feats[r, j] = microbatch_features(tiles_j, kf[ls].sum(), (kf[ls] ** 2).sum())
    return feats, a, (data, a.vision_tiles, a.llm_owner)


def _a2a_time(src, dst, nbytes, dp: int, bandwidth: float, latency: float) -> float:
    moved = src != dst
    sent = np.bincount(src[moved], weights=nbytes[moved], minlength=dp)
    recv = np.bincount(dst[moved], weights=nbytes[moved], minlength=dp)
    busiest = float(max(sent.max(initial=0.0), recv.max(initial=0.0)))
    return busiest / bandwidth + (dp - 1) * latency


def online_comm_time(tiles, tokens, owners, *, dp_size: int, bandwidth: float, latency: float,
                     pixel_bytes_per_tile: float, feature_bytes_per_tile: float, token_bytes: float = 16.0) -> dict:
    """Seconds of one step's all-gather and all-to-alls (see the module docstring); ``owners`` as
    :func:`online_step` returns them."""
    data, vis, llm = (np.asarray(o, np.int64) for o in owners)
    pos = tile_positions(tiles)
    per_tile = np.ones(len(pos))
    k = np.asarray(tokens, np.float64)
    gather = (dp_size - 1) * latency + len(k) * 32.0 / bandwidth if dp_size > 1 else 0.0
    samples = (_a2a_time(data[pos], vis, per_tile * pixel_bytes_per_tile, dp_size, bandwidth, latency)
               + _a2a_time(data, llm, k * token_bytes, dp_size, bandwidth, latency)) if dp_size > 1 else 0.0
    feats = (2 * _a2a_time(vis, llm[pos], per_tile * feature_bytes_per_tile, dp_size, bandwidth, latency)
             if dp_size > 1 else 0.0)
    return {"all_gather_s": gather, "samples_a2a_s": samples, "features_a2a_s": feats,
            "total_s": gather + samples + feats}


def compare_online_offline(*, model: str = "internvl-chat-1.5", hardware="a100-80g", dp_size: int = 32,
                           pp_size: int = 4, num_microbatches: int = 8, batch_size: int = 4,
                           num_samples: int = 40_000, epoch_samples: int = 1_200_000, seed: int = 0,
                           dtype_bytes: int = 2) -> dict:
    """On one cluster and the same random draws: ``baseline`` (padded rows), ``control`` (the draws packed
    varlen where they were drawn: no padding, no re-deal), ``online`` (the draws post-balanced per phase,
    placed to move the fewest bytes, plus its collectives), ``online (owner-blind)`` (the same balance
    placed by bin index) and ``offline`` (the balancer's packs, made before training); even partition and full recompute
    for all, so only the data differs, and control vs online isolates the balance from the padding.
    ``num_samples`` of the synthetic InternVL-like mixture are simulated and the epoch is scaled to
    ``epoch_samples``. ``hardware``: a preset name or a ``HardwareSpec`` (``cpu`` is measured: the caller
    passes ``omnibal.measure.hardware.hardware_by_name``'s)."""
    from omnibal.cost.analytic import analytic_cost_table
    from omnibal.cost.hardware import HardwareSpec, get_hardware
    from omnibal.cost.presets import get_model_preset
    from omnibal.cost.units import model_stats
    from omnibal.data.balance import BalanceConfig, balance
    from omnibal.sim.costs import config_for_hardware, even_cuts
    from omnibal.sim.epoch import simulate_epoch
    from omnibal.stats.synthetic import synthetic_internvl_mixture

    spec = get_model_preset(model)
    hw = hardware if isinstance(hardware, HardwareSpec) else get_hardware(hardware)
    table = analytic_cost_table(spec, hw)
    raw = synthetic_internvl_mixture(num_samples, seed=seed)
    stats = model_stats(raw, spec, convert=True)  # the mixture stands in for any model's data, as plan's
    cost = BalanceCost.from_cost_table(table)
    config = config_for_hardware(hw, dp_size=dp_size, pp_size=pp_size, memory_headroom=None)
    cuts = even_cuts(table.num_layers, pp_size)
    rec = np.array([("blocks" in n) for n in table.names])
    rand = balance(stats, dp_size=dp_size, num_microbatches=num_microbatches, seed=seed,
                   config=BalanceConfig(method="random", batch_size=batch_size, cost=cost))
    omni = balance(stats, dp_size=dp_size, num_microbatches=num_microbatches, seed=seed,
                   config=BalanceConfig(cost=cost))
    transfer = TransferBytes.of(image_size=spec.vision.image_size, tokens_per_tile=spec.llm_tokens_per_tile,
                                hidden=spec.llm.hidden, element_bytes=dtype_bytes)
    out = {"setting": f"{model} on {dp_size * pp_size} x {hardware} (DP{dp_size} x PP{pp_size}), {num_microbatches} "
                      f"micro-batches of {batch_size} random samples per rank per step (baseline, control, online), "
                      f"even partition, full recompute, {num_samples:,} synthetic samples scaled to an epoch of "
                      f"{epoch_samples:,}", "modes": {}}

    def summarize(name, sched, feats, comm, vis_mm, llm_mm, moved, steps_per_sample):
        step = simulate_epoch(table, cuts, rec, feats, config).step_time + comm
        out["modes"][name] = {"vision_max_mean": float(np.mean(vis_mm)), "llm_max_mean": float(np.mean(llm_mm)),
                              "step_s": float(step.mean()), "comm_s": float(np.mean(comm)),
                              "moved_gb_per_step": float(np.mean(moved)) / 1e9,
                              "gpu_days": float(step.mean() * steps_per_sample * epoch_samples * dp_size * pp_size
                                                / 86400)}

    def rank_rows(sched, s):
        return [np.concatenate([np.asarray(sched.microbatch(s, r, k), np.int64) for k in range(num_microbatches)])
                for r in range(dp_size)]

    used = sum(len(r) for s in range(rand.num_steps) for r in rank_rows(rand, s))
    zeros = np.zeros(rand.num_steps)
    vm, lm = _local_balance(rand, rank_rows, stats, cost)
    summarize("baseline", rand, rand.features(stats), zeros, vm, lm, zeros, rand.num_steps / used)
    for name, kwargs in (("control", {"balance": False}), ("online", {}),
                         ("online (owner-blind)", {"keep_on_owner": False})):
        steps = [_online_rows(stats, rank_rows(rand, s), num_microbatches, cost, transfer, config, kwargs)
                 for s in range(rand.num_steps)]
        feats, comm, vm, lm, moved = (np.array(x) for x in zip(*steps))
        summarize(name, rand, feats, comm, vm, lm, moved, rand.num_steps / used)
    vm, lm = _local_balance(omni, rank_rows, stats, cost)
    zeros = np.zeros(omni.num_steps)
    summarize("offline", omni, omni.features(stats), zeros, vm, lm, zeros, omni.num_steps / len(stats))
    return out


def _local_balance(sched, rank_rows, stats, cost) -> tuple[list[float], list[float]]:
    """Per step, the per-phase max/mean across ranks of what each rank's own rows carry."""
    vm, lm = [], []
    for s in range(sched.num_steps):
        a, b = phase_loads(rank_rows(sched, s), stats.tiles, stats.tokens, cost=cost)
        vm.append(a.max() / a.mean())
        lm.append(b.max() / b.mean())
    return vm, lm


def _online_rows(stats, draws, num_microbatches, cost, transfer, config, kwargs):
    """One simulated online step: ``(features, collective seconds, vision max/mean, LLM max/mean, moved
    bytes)``; a step whose samples all stay put (the control) makes no collective."""
    f, a, owners = online_step(stats.tiles, stats.tokens, draws, num_microbatches=num_microbatches, cost=cost,
                               transfer=transfer, **kwargs)
    rows = np.concatenate(draws)
    moved = moved_bytes(*owners, stats.tiles[rows], stats.tokens[rows], transfer)["total"]
    comm = 0.0
    if kwargs.get("balance", True):
        comm = online_comm_time(stats.tiles[rows], stats.tokens[rows], owners, dp_size=len(draws),
                                bandwidth=config.dp_bandwidth, latency=config.dp_latency,
                                pixel_bytes_per_tile=transfer.pixel_tile, feature_bytes_per_tile=transfer.feature_tile,
                                token_bytes=transfer.token)["total_s"]
    return f, comm, a.vision_max_mean, a.llm_max_mean, moved


def comparison_markdown(result: dict) -> str:
    """:func:`compare_online_offline`'s result as a markdown table."""
    from omnibal.tables import markdown_table

    rows = [["mode", "vision max/mean", "LLM max/mean", "step s", "collectives s per step", "moved GB per step",
             "epoch GPU days"]]
    rows += [[name, f"{r['vision_max_mean']:.3f}", f"{r['llm_max_mean']:.3f}", f"{r['step_s']:.2f}",
              f"{r['comm_s']:.3f}", f"{r['moved_gb_per_step']:.2f}", f"{r['gpu_days']:.1f}"]
             for name, r in result["modes"].items()]
    return f"Predicted, {result['setting']}:\n\n" + markdown_table(rows) + "\n"
