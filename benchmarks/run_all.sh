#!/usr/bin/env bash
# Run every benchmark, cheapest first; each writes benchmarks/results/NAME.{json,md} with its provenance.
#   benchmarks/run_all.sh                  # all of them (hours on a 2-core machine: the trainer benchmarks)
#   benchmarks/run_all.sh bench_stats ...  # only the named ones
# PYTHON picks the interpreter (default: python); src/ and the repository root go on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"

ALL=(
  bench_cost_flops        # analytic FLOPs vs 6ND (arithmetic)
  bench_plan_partition    # exact partition and joint search timings
  bench_sim_epoch         # one simulated 1.2M-sample epoch
  bench_plan_default      # omnibal plan with its defaults
  bench_plan_variants     # omnibal plan over model / cluster variants
  bench_paper_rows        # what the paper's published rows imply (arithmetic)
  bench_balance           # balancer quality and speed
  bench_stats             # stats loading and `omnibal stats` throughput
  bench_load              # balancer, sampler and DataLoader at scale
  bench_cost_validation   # analytic + profiled cost tables vs measured layers
  bench_sim_validation    # simulator vs measured trainer steps
  bench_sim_ranking       # the candidate plans of run 3 ordered by 20 rounds of measurement
  bench_plan_cpu          # planned vs even partition on the CPU trainer
  bench_train             # omnibal vs baseline on the CPU trainer
  bench_online_sim        # online mode predicted for a cluster, with the control baseline
  bench_online            # online vs offline balance on the CPU trainer
  bench_train_hf          # omnibal vs baseline on an HF InternVL checkpoint
  bench_online_hf         # online vs offline on the HF checkpoint
  bench_hbp               # HBP vs single-level packing, predicted (long-context mixture)
  bench_sp                # Ulysses SP and HBP levels on the CPU trainer
  bench_hbp_pp            # HBP levels inside a pipeline (dp 2 x pp 2) on the CPU trainer
)
names=("${@:-${ALL[@]}}")
for name in "${names[@]}"; do
  echo "== $name ($(date -u +%H:%M:%S), load $(cut -d' ' -f1 /proc/loadavg))" >&2
  "$PY" -m "benchmarks.$name"
done
