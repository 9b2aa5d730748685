"""The GPU check (``bash benchmarks/gpu/run.sh``): see :mod:`benchmarks.gpu.check`."""
