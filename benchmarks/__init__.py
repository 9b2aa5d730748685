"""omnibal's benchmarks: each ``bench_*.py`` measures one thing and writes ``benchmarks/results/NAME.{json,md}``
with its provenance. Run one from the repository root as ``python -m benchmarks.bench_NAME`` (``src`` on
``PYTHONPATH`` or omnibal installed), or all with ``benchmarks/run_all.sh``. Shared pieces live in helper
modules (``common``, ``cpu_runs``, ``trainer_runs``); a benchmark never imports another benchmark or the tests.
"""
