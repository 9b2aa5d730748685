"""One ledger format (``omnibal.train.ledger``) for the reference trainer and the Hugging Face trainer."""

from __future__ import annotations

import json

import pytest

from omnibal.errors import InputError
from omnibal.train.ledger import LedgerWriter, final_steps, read_ledger, trained_counts


def test_micro_batch_records_count_once_and_a_resume_replaces_what_it_redoes(tmp_path):
    """The HF trainer logs each rank's micro-batches; a run resumed at step 1 replaces the steps it trains again."""
    path = tmp_path / "ledger-rank0.jsonl"
    first = LedgerWriter(path, {"resumed_at": 0, "rank": 0})
    first.step(0, [10, 11], [0, 1], rank=0, micro=0, epoch=0)
    first.step(0, [12], [2], rank=0, micro=1, epoch=0)
    first.step(1, [13], [3], rank=0, micro=0, epoch=0)  # not in the checkpoint the next run resumes
    first.close()
    again = LedgerWriter(path, {"resumed_at": 1, "rank": 0})
    again.step(1, [13], [3], rank=0, micro=0, epoch=0)
    again.step(1, [14], [4], rank=0, micro=1, epoch=0)
    again.close()
    events = read_ledger(path)
    assert [e["event"] for e in events].count("start") == 2 and events[0]["format"] == "omnibal.ledger"
    assert {s: len(parts) for s, parts in final_steps(events).items()} == {0: 2, 1: 2}
    assert trained_counts(path) == {10: 1, 11: 1, 12: 1, 13: 1, 14: 1}


def test_a_ledger_of_the_older_hf_format_is_refused_by_name_and_left_alone(tmp_path):
    """The HF trainer wrote ``{rank, epoch, step, micro, indices}`` lines; resuming into such a file would mix
    two formats (and a single such line read as a torn last line would vanish): an InputError instead."""
    path = tmp_path / "ledger-rank0.jsonl"
    old = json.dumps({"rank": 0, "epoch": 0, "step": 0, "micro": 0, "indices": [3, 1]}) + "\n"
    path.write_text(old)
    with pytest.raises(InputError, match=r"ledger-rank0.jsonl: line 1: .*older omnibal Hugging Face trainer"):
        read_ledger(path)
    with pytest.raises(InputError, match="older omnibal Hugging Face trainer"):
        LedgerWriter(path, {"resumed_at": 0})
    assert path.read_text() == old
