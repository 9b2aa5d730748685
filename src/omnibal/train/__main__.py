"""Deprecated entry point: ``python -m omnibal.train ARGS`` (and ``torchrun ... -m omnibal.train ARGS``) runs
``omnibal train ARGS`` after one line on stderr (global rank 0) naming the spelling that replaces it,
``-m omnibal train``. Kept for one release so launch scripts written for it keep working meanwhile."""

import os
import sys

from omnibal.cli import main

if os.environ.get("RANK", "0") == "0":
    print("omnibal: `-m omnibal.train` is deprecated and goes away in the next release; launch "
          "`-m omnibal train` instead (e.g. torchrun --nproc-per-node N -m omnibal train ...)", file=sys.stderr,
          flush=True)
raise SystemExit(main(["train", *sys.argv[1:]]))
