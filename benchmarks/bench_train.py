"""Measured throughput of the reference trainer: omnibal vs baseline mode, DP2xPP1 and DP1xPP2, on CPU.

    python -m benchmarks.bench_train [--samples 3000] [--steps 8] [--repeats 3]

Same model (the ``tiny`` preset), same data (a seeded subset of the real InternVL-1.2M statistics in
../shared/data, synthetic pixels/tokens of exactly those sizes), same world, one torch thread per rank:

- baseline: random micro-batches of 4 samples padded to their longest, even layer split, full recompute;
- omnibal: the balancer's packs (``omnibal.data.balance``), the min-max partition of *measured* per-layer
  forward+backward times (``omnibal.plan.partition``), no recompute (memory is not binding on this host).

Each configuration runs ``--repeats`` times through the real CLI (``omnibal train``, local gloo ranks);
reported: median real (unpadded) samples/s, the speed-up, per-rank compute / pipeline wait / DP-sync wait
of the median run, machine load, and the simulator's predicted step time for the same steps beside the
measured one. The simulator's layer costs are this CPU's measured profile, calibrated on *separate* runs
on other data (``benchmarks.cpu_runs.CAL_SPECS``, one round before each repeat so both see the same
machine drift), with the gloo links measured by ``omnibal.measure.links``. Writes benchmarks/results/train.json and
train.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks import cpu_runs as sv
from benchmarks.common import RESULTS, logger, write_result
from benchmarks.trainer_runs import run_train
from omnibal.cost.presets import get_model_preset
from omnibal.cost.profile import ProfileConfig, cost_table_from_profile
from omnibal.cost.table import microbatch_features
from omnibal.data.balance import balance
from omnibal.data.collate import collate
from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset
from omnibal.measure.links import measure_links
from omnibal.measure.profile import measure as measure_profile
from omnibal.plan.partition import min_max_partition
from omnibal.plan.plan import measured_plan
from omnibal.sim import SimConfig, simulate_epoch
from omnibal.stats.io import save_stats
from omnibal.train.feed import fixed_buffer, random_microbatch_schedule
from omnibal.train.model import VLM

MODES = ("baseline", "omnibal")


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"2x1,1x2"`` -> [(2, 1), (1, 2)] (DP x PP; this 2-core machine runs at most 2 ranks well)."""
    layouts = []
    for part in text.split(","):
        try:
            dp, pp = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise SystemExit(f"--layouts: {part!r} is not DPxPP (e.g. 2x1)") from None
        if dp < 1 or pp < 1:
            raise SystemExit(f"--layouts: {part!r} needs positive sizes")
        layouts.append((dp, pp))
    return layouts


def profile_layers(spec, schedule, stats, *, num_packs: int = 6, repeats: int = 2) -> np.ndarray:
    """Forward+backward seconds of every chain layer on real-sized balanced packs (one thread, no recompute):
    each layer is run alone on the carry the layers before it produced."""
    torch.set_num_threads(1)
    model = VLM(spec, seed=0)
    ds = SyntheticVLMDataset(stats, SyntheticSampleConfig(image_size=spec.vision.image_size,
                                                    tokens_per_tile=spec.llm_tokens_per_tile,
                                                    vocab_size=spec.llm.vocab_size,
                                                    image_token_id=spec.llm.vocab_size - 1))
    chain = model.chain()
    times = np.zeros(len(chain))
    base = model.collate_config(num_tiles=1, num_tokens=1)
    for k in range(num_packs):
        mb = schedule.microbatch(k % schedule.num_steps, 0, k % schedule.num_microbatches)
        cfg = replace(base, num_tiles=int(stats.tiles[mb].sum()), num_tokens=int(stats.tokens[mb].sum()))
        carry = collate([ds[int(i)] for i in mb], cfg).carry()
        for li, (_, module) in enumerate(chain):
            inp = tuple(t.detach().requires_grad_(t.is_floating_point() and li > 0) for t in carry)
            best = float("inf")
            for _ in range(repeats):
                module.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                out = module(*inp)
                out[0].float().sum().backward()
                best = min(best, time.perf_counter() - t0)
            times[li] += best
            with torch.no_grad():
                carry = module(*carry)
    return times / num_packs


def write_plan(path: Path, spec, parts, layer_times, num_samples: int) -> None:
    """The partition as a real Plan (what `omnibal train --plan` reads), with each stage's measured time."""
    names = [layer.name for layer in spec.layers()]
    times = [float(layer_times[a:b].sum()) for a, b in zip(parts[:-1], parts[1:])]
    measured_plan(model=spec.name, layer_names=names, parts=parts, stage_times_s=times, num_samples=num_samples,
                  source="bench_train: min-max partition of measured per-layer times").save(path)


def predict_step_time(calibrated, links, schedule, stats, *, mode, dp, pp, parts, recompute_names, steps) -> float:
    """Mean simulated step time of ``steps`` as the trainer ran them: the calibrated table (the shared-core
    one for a multi-rank run), measured links, the pipeline's fixed p2p buffer, the rank jitter."""
    cal, alone, shared, jitter = calibrated
    table = shared if dp * pp > 1 else alone
    rec = np.array([name in recompute_names for name in table.names])
    all_feats = sv.step_features(schedule, stats, max(steps) + 1, padded=mode == "baseline")
    feats = all_feats[list(steps)]
    buffer = None
    if pp > 1:
        buf = fixed_buffer(schedule, stats, mode=mode)
        buffer = np.broadcast_to(microbatch_features(buf.tiles, buf.tokens, buf.tokens * buf.tokens), feats.shape)
    config = SimConfig(dp_size=dp, p2p_bandwidth=links["p2p_bandwidth"], p2p_latency=links["p2p_latency"],
                       dp_bandwidth=links["dp_bandwidth"], dp_latency=links["dp_latency"],
                       step_overhead=cal.step_overhead, p2p_occupancy=1.0, compute_jitter=jitter)
    res = simulate_epoch(table, np.asarray(parts), rec, feats, config, buffer_features=buffer)
    return float(np.mean(res.step_time))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=3000, help="rows drawn from the real statistics")
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first is warm-up)")
    ap.add_argument("--epoch", action="store_true",
                    help="run each mode over its whole schedule (every sample of --samples once) instead of "
                         "--steps steps: both modes then train on exactly the same samples")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4, help="baseline samples per micro-batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calibration-steps", type=int, default=8,
                    help="timed steps of each calibration run (separate runs on other data, for the simulator)")
    ap.add_argument("--layouts", default="2x1,1x2", help="DPxPP layouts to compare, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--note", default="", help="free text recorded with the results (e.g. the commits used)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = get_model_preset("tiny")
    # the trainer is given the files' units (it converts them itself); balancer and simulator see the model's
    raw = sv.load_real_subset(args.samples, args.seed)
    stats = sv.model_units(raw)
    work = Path(tempfile.mkdtemp(prefix="bench_train_"))
    stats_path = save_stats(raw, work / "stats.jsonl")
    log = logger("bench_train")
    # the simulator's layer costs: this CPU's measured layer profile, calibrated on separate runs (other data)
    table = cost_table_from_profile(spec, measure_profile(spec, ProfileConfig(threads=1, statistic="cpu", repeats=3)))
    links = measure_links()["wall_clock"]
    calib = sv.CalibrationData(table, [layer.name for layer in spec.layers()],
                               sv.load_stats(args.samples, sv.CAL_SEED), steps=args.calibration_steps + 1)

    results = {
               "model": spec.name, "num_samples": args.samples, "stats": raw.source,
               "steps": "whole schedule (epoch)" if args.epoch else args.steps,
               "num_microbatches": args.microbatches, "baseline_batch_size": args.batch_size,
               "repeats": args.repeats, "note": args.note, "runs": {}, "table": []}
    layouts = []  # per layout: schedules, steps and CLI arguments of each mode
    for dp, pp in parse_layouts(args.layouts):
        sched_omni = balance(stats, dp_size=dp, num_microbatches=args.microbatches, seed=args.seed)
        omni_path = work / f"schedule_dp{dp}.json"
        sched_omni.to_json(omni_path)
        sched_base = random_microbatch_schedule(len(stats), dp_size=dp, num_microbatches=args.microbatches,
                                                batch_size=args.batch_size, seed=args.seed)
        plan_path = None
        layer_times = None
        if pp > 1:
            layer_times = profile_layers(spec, sched_omni, stats)
            plan_path = work / f"plan_pp{pp}.json"
            write_plan(plan_path, spec, min_max_partition(layer_times, pp).parts, layer_times, len(stats))
        schedule_of = {"baseline": sched_base, "omnibal": sched_omni}
        common = ["--model", "tiny", "--stats", str(stats_path), "--dp", str(dp), "--pp", str(pp),
                  "--microbatches", str(args.microbatches), "--seed", str(args.seed), "--threads", "1",
                  "--timeout", "300"]
        extra_of = {"baseline": ["--batch-size", str(args.batch_size)],
                    "omnibal": ["--schedule-file", str(omni_path)] + (["--plan", str(plan_path)] if plan_path else [])}
        steps_of = {m: schedule_of[m].num_steps if args.epoch else args.steps for m in MODES}
        layouts.append({"dp": dp, "pp": pp, "schedule_of": schedule_of, "steps_of": steps_of,
                        "layer_times": layer_times,
                        "args_of": {m: common + ["--mode", m, "--steps", str(steps_of[m])] + extra_of[m]
                                    for m in MODES},
                        "runs_of": {m: [] for m in MODES}})

    # rounds: the calibration runs, then every layout and mode once (interleaved, so a change of machine
    # speed or load hits all of them alike)
    for rep in range(args.repeats):
        calib.run_round(rep, log)
        for lay in layouts:
            for mode in MODES:
                tag = f"{mode}_dp{lay['dp']}_pp{lay['pp']}_r{rep}"
                log(tag)
                lay["runs_of"][mode].append(run_train(lay["args_of"][mode], work, tag, metrics_log=True,
                                                      timeout_s=1800))
    calibrated = calib.fit()
    results["calibration"] = {**calibrated[0].to_dict(), "rank_jitter": calibrated[3], "links": links,
                              "runs": calib.rows}

    for lay in layouts:
        dp, pp = lay["dp"], lay["pp"]
        for mode in MODES:
            runs = lay["runs_of"][mode]
            sps = [r["summary"]["samples_per_s"] for r in runs]
            median_run = sorted(runs, key=lambda r: r["summary"]["samples_per_s"])[len(runs) // 2]
            layout_parts = [median_run["stage_layers"][0][0]] + [b for _, b in median_run["stage_layers"]]
            recompute = [n for stage in median_run["recompute"] for n in stage]
            schedule = lay["schedule_of"][mode]
            measured_steps = list(range(1, lay["steps_of"][mode]))  # the first step (warm-up) is left out
            predicted = predict_step_time(calibrated, links, schedule, stats, mode=mode, dp=dp, pp=pp,
                                          parts=layout_parts, recompute_names=set(recompute), steps=measured_steps)
            mean_step = statistics.mean(r["summary"]["mean_step_s"] for r in runs)
            entry = {
                "mode": mode, "dp": dp, "pp": pp, "steps": lay["steps_of"][mode],
                "samples_timed": sum(len(schedule.microbatch(s, r, k)) for s in measured_steps for r in range(dp)
                                     for k in range(schedule.num_microbatches)),
                "samples_per_s_runs": sps,
                "samples_per_s_median": statistics.median(sps),
                "tokens_per_s_median": statistics.median(r["summary"]["tokens_per_s"] for r in runs),
                "median_step_s_runs": [r["summary"]["median_step_s"] for r in runs],
                "median_step_s": statistics.median(r["summary"]["median_step_s"] for r in runs),
                "mean_step_s_runs": [r["summary"]["mean_step_s"] for r in runs],
                "mean_step_s": mean_step,
                "predicted_step_s": predicted,
                "prediction_error": predicted / mean_step - 1.0,
                "token_pad_ratio": median_run["summary"]["token_pad_ratio"],
                "stage_layers": median_run["stage_layers"], "recompute_layers": len(recompute),
                "buffer": median_run["buffer"], "per_rank": median_run["summary"]["per_rank"],
                "load": [[r["load_before"], r["load_after"]] for r in runs],
            }
            if lay["layer_times"] is not None and mode == "omnibal":
                entry["layer_fwd_bwd_s"] = lay["layer_times"].tolist()
            results["runs"][f"{mode}_dp{dp}_pp{pp}"] = entry
        base = results["runs"][f"baseline_dp{dp}_pp{pp}"]["samples_per_s_median"]
        omni = results["runs"][f"omnibal_dp{dp}_pp{pp}"]["samples_per_s_median"]
        results["table"].append({"layout": f"DP{dp}xPP{pp}", "baseline_sps": base, "omnibal_sps": omni,
                                 "speedup": omni / base})
    write_result("train", results, render_markdown(results), out=Path(args.out))
    print(render_markdown(results))
    return 0


def render_markdown(res: dict) -> str:
    cal = res.get("calibration")
    lines = ["# Reference trainer: omnibal vs baseline (CPU, gloo, tiny preset)", "",
             f"{res['num_samples']} samples drawn from {res['stats']}; steps per run: {res['steps']} (the first "
             f"step = warm-up, excluded from the figures), {res['num_microbatches']} micro-batches per rank per "
             f"step, baseline micro-batch {res['baseline_batch_size']} samples; median of {res['repeats']} runs; one "
             "torch thread per rank (load average noted per run; machine and commit in the last line). Produced by "
             "`python -m benchmarks.bench_train`.",
             *(["", f"Note: {res['note']}"] if res.get("note") else []), "",
             "| layout | baseline samples/s | omnibal samples/s | speed-up |", "| --- | --- | --- | --- |"]
    for row in res["table"]:
        lines.append(f"| {row['layout']} | {row['baseline_sps']:.2f} | {row['omnibal_sps']:.2f} | "
                     f"{row['speedup']:.2f}x |")
    lines += ["", "Per run (median run of each configuration for the per-rank times, mean ms per step; *step ms* is "
              "the mean step over the timed steps, averaged over the runs, and the simulator's prediction of the "
              "same steps):", "",
              "| run | steps | samples timed | samples/s (runs) | step ms measured | step ms simulated | error | token "
              "pad | stages | recompute layers | rank: compute / pipeline wait / DP-sync wait / data / CPU ms | "
              "load (1-min avg) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, e in res["runs"].items():
        ranks = "; ".join(f"r{r['rank']}: {r['compute_s'] * 1e3:.0f} / {r['wait_s'] * 1e3:.0f} / "
                          f"{r['dp_sync_s'] * 1e3:.0f} / {r['data_s'] * 1e3:.0f} / {r['cpu_s'] * 1e3:.0f}"
                          for r in e["per_rank"])
        loads = ", ".join(f"{a:.1f}-{b:.1f}" for a, b in e["load"])
        lines.append(f"| {key} | {e['steps']} | {e['samples_timed']} | "
                     f"{', '.join(f'{x:.2f}' for x in e['samples_per_s_runs'])} | "
                     f"{e['mean_step_s'] * 1e3:.0f} | {e['predicted_step_s'] * 1e3:.0f} | "
                     f"{e['prediction_error']:+.1%} | {e['token_pad_ratio']:.1%} | {e['stage_layers']} | "
                     f"{e['recompute_layers']} | {ranks} | {loads} |")
    if cal:
        scales = ", ".join(f"{g} {f:.3f}" for g, f in zip(cal["groups"], cal["fwd_scale"]))
        lines += ["", "Simulator: this CPU's measured layer profile (`omnibal.measure.profile`), calibrated on "
                  "separate runs on other data (`benchmarks.cpu_runs.CAL_SPECS`: single-process, pipeline and DP "
                  f"runs, one round before each repeat): scales {scales}, shared-core factor "
                  f"{cal['shared_host_scale']:.3f}, step overhead {cal['step_overhead'] * 1e3:.0f} ms, rank jitter "
                  f"{cal['rank_jitter']:.1%}; gloo links measured: p2p {cal['links']['p2p_latency'] * 1e3:.2f} ms + "
                  f"bytes / {cal['links']['p2p_bandwidth'] / 1e9:.2f} GB/s, all-reduce "
                  f"{cal['links']['dp_latency'] * 1e3:.2f} ms per ring step + bytes / "
                  f"{cal['links']['dp_bandwidth'] / 1e9:.2f} GB/s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
