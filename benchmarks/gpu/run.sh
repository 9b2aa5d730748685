#!/usr/bin/env bash
# The GPU check: what omnibal's cost and memory models and its speed-up look like on a real accelerator.
#   bash benchmarks/gpu/run.sh --out DIR             # one CUDA device, at most ~8 minutes
#   bash benchmarks/gpu/run.sh --dry-run --out DIR   # tiny shapes on the CPU (CI runs this)
# Writes DIR/result.json, DIR/result.md, DIR/profiles.json, DIR/log.txt (docs/gpu.md). PYTHON picks the
# interpreter (default: python3); src/ and the repository root go on PYTHONPATH, nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m benchmarks.gpu.check "$@"
