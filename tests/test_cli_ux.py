"""What a person reads from the command line: choices as the words to type, messages that name current flags,
help that names a launch command that works, numbers of a tiny model that do not print as zero."""

from __future__ import annotations

import argparse
import ast
import enum
import re
from pathlib import Path

import pytest

from omnibal.cli import COMMANDS, build_parser, main

SRC = Path(__file__).resolve().parents[1] / "src" / "omnibal"
ROOT = SRC.parents[1]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in COMMANDS}


def test_every_choice_is_a_plain_word_and_errors_list_the_words(capsys):
    bad = [f"{name} {action.option_strings}: {c!r}" for name, parser in _subparsers().items()
           for action in parser._actions if action.choices is not None
           for c in action.choices if isinstance(c, enum.Enum) or not isinstance(c, (str, int))]
    assert not bad, bad
    with pytest.raises(SystemExit):
        main(["plan", "--engine", "nope"])
    err = capsys.readouterr().err
    assert "choose from 'reference', 'deepspeed', 'megatron', 'torchtitan'" in err and "<Engine" not in err, err


def test_no_message_or_help_names_a_removed_spelling():
    """A message that asked for ``--preset`` (then deprecated, now removed) made a new user type the old
    spelling."""
    from test_cli_flags import REMOVED

    pattern = re.compile(r"(?<![\w-])(" + "|".join(re.escape(f) for f in sorted(REMOVED)) + r")(?![\w-])")
    hits = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.search(node.value):
                hits.append(f"{rel}:{node.lineno}: {pattern.search(node.value).group(0)}")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for para in path.read_text().split("\n\n"):  # a paragraph that lists the old spellings as such
            if pattern.search(para) and not re.search(r"removed", para, re.I):
                hits.append(f"{path.relative_to(ROOT)}: {pattern.search(para).group(0)} in {para.strip()[:80]!r}")
    assert not hits, "\n".join(hits)


def test_train_help_names_a_launch_command_that_runs():
    """``train --help`` suggested ``torchrun ... -m omnibal.train``, a module with no ``__main__``."""
    import importlib.util

    from omnibal.cli import train as cli_train

    modules = re.findall(r"-m ([\w.]+)", f"{cli_train.__doc__}\n{cli_train.DESCRIPTION}")
    assert modules and set(modules) == {"omnibal"}, modules
    assert all(importlib.util.find_spec(f"{m}.__main__") is not None for m in modules)


def test_a_tiny_models_plan_prints_its_numbers_not_zeros(tmp_path, capsys):
    """``plan --hf-model`` of the example's 0.8M-parameter InternVL printed 0.00 s, 0.0 GPU days and 0.0 GiB: its
    ~4 ms steps and MiB of memory are real, the fixed decimals hid them."""
    from omnibal.tables import fixed

    assert [fixed(v, d) for v, d in ((0.0043, 2), (62.14, 1), (0.006, 1), (0.0, 1), (0.05, 1))] == \
        ["0.0043", "62.1", "0.006", "0.0", "0.1"]
    tf = pytest.importorskip("transformers")
    text = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                num_key_value_heads=2, vocab_size=512)
    vision = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                  image_size=[64, 64], patch_size=[8, 8])
    tf.InternVLConfig(vision_config=tf.InternVLVisionConfig(**vision), text_config=tf.Qwen2Config(**text),
                      image_token_id=5, image_seq_length=16, downsample_ratio=0.5).save_pretrained(tmp_path / "m")
    assert main(["plan", "--hf-model", str(tmp_path / "m"), "--samples", "1000", "--balance-samples", "all",
                 "--gpus", "8", "--pp", "2", "--no-timelines", "--pack-microbatches", "none", "--quiet",
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("Plan: "))
    step, days = re.fullmatch(r"Plan: (\S+) s per step, (\S+) GPU days per epoch, .*", line).groups()
    assert float(step) > 0 and float(days) > 0, line
    stage0 = next(x for x in out.splitlines() if x.startswith("0 "))
    assert float(stage0.split()[-1]) > 0, stage0  # simulated peak GiB


def test_plan_hbp_says_what_it_does_and_how_long_before_the_search(monkeypatch, tmp_path, capsys):
    """``plan --hbp`` printed nothing for 3-6 minutes: its first line came after the search."""
    from omnibal.cli.plan_hbp import search_estimate
    from omnibal.jobs import hbp as hbp_job

    assert "200,000 samples" in search_estimate(1_200_000, 200_000) and " min on 2 CPU cores" in \
        search_estimate(1_200_000, 200_000)
    assert "under a minute" in search_estimate(3000, None)

    def search(*args, **kwargs):
        raise KeyboardInterrupt  # what a person does after a silent minute

    monkeypatch.setattr(hbp_job, "run_hbp_job", search)
    assert main(["plan", "--hbp", "--samples", "2000", "--out", str(tmp_path / "o")]) == 130
    out, err = capsys.readouterr()
    assert out.startswith("omnibal plan --hbp: internvl-chat-1.5 on 128 x a100-80g"), out
    assert "samples and simulating" in err and "interrupted" in err.splitlines()[-1], err
