"""docs/hf.md's recipe (``docs/examples/hf_trainer.py``, quoted verbatim in the doc) runs as written under
``torchrun --nproc-per-node 2`` on ``omnibal example``'s data and tiny InternVL checkpoint (gloo on CPU): it
trains, every sample is trained exactly once across the two ranks, and the saved weights are new and finite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from omnibal.train.distributed import free_port  # noqa: E402
from omnibal.train.ledger import read_ledger  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "docs" / "examples" / "hf_trainer.py"
RUN_TIMEOUT_S = 150
RECORDS = 32


def test_the_doc_quotes_the_tested_script_verbatim():
    doc = (ROOT / "docs" / "hf.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert RECIPE.read_text() in blocks, "docs/hf.md must quote docs/examples/hf_trainer.py whole"


@pytest.mark.multiprocess
def test_the_recipe_trains_every_sample_once_on_two_ranks(tmp_path):
    import safetensors.torch as st
    import torch

    from omnibal.examples.real_example import make_real_example

    ex = tmp_path / "ex"
    make_real_example(ex, num_records=RECORDS, seed=0)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(RECIPE), str(ex / "internvl"), str(ex / "annotations.jsonl"),
           str(ex / "images"), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [e for r in (0, 1) for e in read_ledger(out / f"ledger-rank{r}.jsonl") if e["event"] == "step"]
    assert {x["rank"] for x in lines} == {0, 1}
    trained = sorted(i for x in lines for i in x["rows"])
    assert trained == list(range(RECORDS)), "every sample exactly once across the two ranks"
    before = st.load_file(str(ex / "internvl" / "model.safetensors"))
    after = st.load_file(str(out / "model.safetensors"))
    assert after.keys() == before.keys()
    assert all(torch.isfinite(t).all() for t in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in before), "the weights were trained"
