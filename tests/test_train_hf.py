"""`omnibal train` on a user's Hugging Face checkpoint and real annotations + images (the embedded example):
DP x PP steps equal the HF model's own unpacked per-sample loss and gradients, the saved folder loads with
``from_pretrained``, loss falls over an epoch, and bad inputs get one named error."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from omnibal.cli import main  # noqa: E402
from omnibal.errors import InputError  # noqa: E402
from omnibal.train.config import TRAIN_LAYOUT, TrainConfig  # noqa: E402
from omnibal.train.distributed import spawn_local  # noqa: E402

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    from omnibal.examples.real_example import make_real_example

    root = tmp_path_factory.mktemp("real-example")
    make_real_example(root, num_records=48, seed=0)
    return root


def _config(root: Path, kind: str, *, hf_model: str | None = None, dp_size: int = 1, pp_size: int = 1,
            **kw) -> TrainConfig:
    return TrainConfig(annotations_path=str(root / "annotations.jsonl"), image_root=str(root / "images"),
                       tokenizer_path=str(root / "tokenizer"), hf_model=hf_model or str(root / kind), max_tiles=6,
                       layout=replace(TRAIN_LAYOUT, dp_size=dp_size, pp_size=pp_size, num_microbatches=4),
                       timeout_s=TIMEOUT_S, quiet=True, lr=1e-3, **kw)


def _hf_names(trainer, chain) -> dict[str, str]:
    names = {id(p): n for n, p in chain.hf_model.named_parameters()}
    return {local: names[id(p)] for local, p in trainer.stage_module.named_parameters()}


def _rank_step(cfg: TrainConfig):
    """One forward/backward of step 0 on this rank: its loss part and its stage's gradients by HF name."""
    torch.set_num_threads(1)
    from omnibal.train import run
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=cfg.layout.dp_size, pp_size=cfg.layout.pp_size, timeout_s=TIMEOUT_S)
    model = run.build_model(cfg)
    run.build_model = lambda _cfg: model  # the trainer wraps this very chain: map its parameters to HF names
    trainer = run.build_trainer(cfg, world)
    result = trainer.forward_backward()
    names = _hf_names(trainer, model)
    grads = {names[n]: p.grad.detach().clone().numpy() for n, p in trainer.stage_module.named_parameters()
             if p.grad is not None}
    destroy_world()
    return {"loss_part": result.loss_sum, "grads": grads, "samples": [int(i) for i in result.fed]}


def _hf_reference(cfg: TrainConfig, samples: list[int]):
    """The HF model's own forward, one sample at a time, unpacked: token-mean loss over the global batch."""
    from omnibal.data.realdata import RealDataset
    from omnibal.train.hf_run import load_hf_chain, real_data_config, real_stats

    chain = load_hf_chain(cfg.hf_model)
    data = real_data_config(cfg, chain)
    ds = RealDataset(cfg.annotations_path, data, stats=real_stats(cfg, data))
    model = chain.hf_model
    total, count = torch.zeros(()), 0
    for i in samples:
        s = ds[i]
        has_image = bool((s["input_ids"] == chain.image_token_id).any())
        out = model(input_ids=s["input_ids"][None], labels=s["labels"][None],
                    pixel_values=s["pixel_values"] if has_image else None)
        n = int((s["labels"][1:] != -100).sum())
        total, count = total + out.loss * n, count + n
    loss = total / count
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,dp,pp,mode", [("llava", 2, 1, "offline"), ("internvl", 1, 2, "offline"),
                                              ("llava", 1, 2, "offline"), ("internvl", 1, 2, "baseline"),
                                              ("llava", 2, 1, "online"), ("internvl", 2, 1, "online")])
def test_a_dp_pp_step_equals_the_hf_models_own_unpacked_loss(example, kind, dp, pp, mode):
    """Balanced packs (block-diagonal attention, positions restarting per sample) split over DP ranks and
    pipeline stages give the loss and gradients of the HF model run sample by sample; so do the baseline's
    padded rows (even split, every block recomputed); so does ``--mode online``, whose samples, visual features
    and feature gradients cross DP ranks by all-to-all."""
    plan = None
    if pp > 1 and mode == "offline":  # the plan omnibal plan --hf-model makes for this checkpoint (config.json only)
        out = example / f"plan-{kind}"
        assert main(["plan", "--hf-model", str(example / kind), "--gpus", str(pp), "--pp", str(pp), "--tp", "1",
                     "--microbatches", "4", "--stats", str(_stats_file(example, kind)), "--balance-samples",
                     "all", "--out", str(out), "--no-timelines", "--quiet"]) == 0
        plan = str(out / "plan.json")
        assert json.loads(Path(plan).read_text())["model"] == f"hf-{kind}"
    cfg = _config(example, kind, dp_size=dp, pp_size=pp, plan_path=plan, mode=mode)
    results = spawn_local(_rank_step, dp * pp, args=(cfg,), deadline_s=180, start_method="fork")
    errors = [r.error for r in results if r.error]
    assert not errors, "\n".join(errors)
    values = [r.value for r in results]
    fed = sorted(i for v in values for i in v["samples"])
    single = replace(cfg, layout=replace(cfg.layout, dp_size=1, pp_size=1), plan_path=None)
    ref_loss, ref_grads = _hf_reference(single, fed)
    loss = sum(v["loss_part"] for v in values)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    got: dict[str, np.ndarray] = {}
    for v in values:
        for name, g in v["grads"].items():
            got[name] = g  # DP replicas hold the same (summed) gradient; stages hold disjoint parameters
    scale = max(np.linalg.norm(g) for g in ref_grads.values())
    for name, ref in ref_grads.items():
        err = np.linalg.norm(got[name] - ref)
        assert err <= 1e-5 * max(np.linalg.norm(ref), 1e-3 * scale), (name, err)


def _stats_file(root: Path, kind: str) -> Path:
    """`omnibal stats` of the example with the checkpoint's conventions (what `omnibal train` computes)."""
    path = root / f"stats-{kind}.jsonl"
    if not path.exists():
        from omnibal.stats.io import save_stats
        from omnibal.train.hf_run import real_data_config, real_stats
        from omnibal.train.run import build_model

        cfg = _config(root, kind)
        save_stats(real_stats(cfg, real_data_config(cfg, build_model(cfg))), path)
    return path


def test_train_saves_an_hf_checkpoint_that_loads_and_loss_falls_over_an_epoch(example, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    save = tmp_path / "model"
    summary = tmp_path / "summary.json"
    log = tmp_path / "log.jsonl"
    cfg = ["--annotations", str(example / "annotations.jsonl"), "--image-root", str(example / "images"),
           "--tokenizer", str(example / "tokenizer"), "--hf-model", str(example / "internvl"), "--max-tiles", "6",
           "--microbatches", "1", "--lr", "5e-3", "--quiet"]
    from omnibal.data.balance import balance
    from omnibal.stats.io import load_stats

    steps = balance(load_stats(_stats_file(example, "internvl")), dp_size=1, num_microbatches=1, seed=0).num_steps
    assert steps >= 8  # the whole epoch
    assert main(["train", *cfg, "--steps", str(steps), "--save-dir", str(save), "--checkpoint-dir",
                 str(tmp_path / "ckpt"), "--checkpoint-every", "4", "--log", str(log),
                 "--summary-json", str(summary)]) == 0
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()[1:]]
    assert len(losses) == steps and all(np.isfinite(losses)), losses
    # training lowers the loss: the HF model's own loss over the whole epoch's samples, before and after (the
    # per-step losses are of different packs, too noisy to compare)
    every = list(range(len(load_stats(_stats_file(example, "internvl")))))
    before = _hf_reference(_config(example, "internvl"), every)[0]
    after = _hf_reference(_config(example, "internvl", hf_model=str(save)), every)[0]
    assert after < 0.9 * before, (before, after)
    for folder in (save, save / "checkpoint-4", save / f"checkpoint-{steps}"):
        model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True)
        assert type(model).__name__ == "InternVLForConditionalGeneration"
        assert len(AutoTokenizer.from_pretrained(folder, local_files_only=True)) == model.config.text_config.vocab_size
    # the saved weights are the trained ones: the first and final model differ, the final equals the last checkpoint
    import safetensors.torch as st

    first = st.load_file(str(example / "internvl" / "model.safetensors"))
    final = st.load_file(str(save / "model.safetensors"))
    last = st.load_file(str(save / f"checkpoint-{steps}" / "model.safetensors"))
    assert final.keys() == first.keys() == last.keys()
    assert all(torch.equal(final[k], last[k]) for k in final)
    assert sum(not torch.equal(final[k], first[k]) for k in final) > 0.9 * len(final)


def test_resume_continues_and_saves_the_same_model(example, tmp_path):
    """A run stopped at step 2 and resumed to step 4 saves the model an uninterrupted 4-step run saves."""
    import safetensors.torch as st

    cfg = ["--annotations", str(example / "annotations.jsonl"), "--image-root", str(example / "images"),
           "--tokenizer", str(example / "tokenizer"), "--hf-model", str(example / "llava"), "--quiet",
           "--microbatches", "2"]
    from omnibal.train.ledger import trained_counts

    assert main(["train", *cfg, "--steps", "4", "--save-dir", str(tmp_path / "whole"), "--ledger",
                 str(tmp_path / "whole.jsonl")]) == 0
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "split"), "--ledger",
            str(tmp_path / "split.jsonl")]
    assert main(["train", *cfg, "--steps", "2", *ckpt]) == 0
    assert main(["train", *cfg, "--steps", "4", "--resume", *ckpt]) == 0
    whole = st.load_file(str(tmp_path / "whole" / "model.safetensors"))
    split = st.load_file(str(tmp_path / "split" / "model.safetensors"))
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)
    # the trainer's own per-sample ledger: the same samples, each once, with and without the stop
    counts = trained_counts(tmp_path / "split.jsonl")
    assert counts == trained_counts(tmp_path / "whole.jsonl") and set(counts.values()) == {1} and len(counts) > 8


def test_bad_inputs_get_one_named_line(example, tmp_path, capsys):
    base = {"--annotations": str(example / "annotations.jsonl"), "--image-root": str(example / "images"),
            "--tokenizer": str(example / "tokenizer"), "--hf-model": str(example / "llava")}

    def run(**change):
        args = {**base, **change}
        code = main(["train", "--quiet", "--steps", "1"] + [x for k, v in args.items() for x in (k, v)])
        return code, capsys.readouterr().err.strip()

    lines = (example / "annotations.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({**rec, "image": "nope.png"}) + "\n" + "\n".join(lines[1:]) + "\n")
    code, err = run(**{"--annotations": str(missing)})
    assert code == 2 and "missing.jsonl" in err and "line 1" in err and "'image'" in err and "nope.png" in err
    no_conv = tmp_path / "noconv.jsonl"
    no_conv.write_text("\n".join(lines[:3] + [json.dumps({"id": "x", "image": rec["image"]})]) + "\n")
    code, err = run(**{"--annotations": str(no_conv)})
    assert code == 2 and "line 4" in err and "'conversations'" in err
    code, err = run(**{"--hf-model": str(example / "images")})
    assert code == 2 and "not a Hugging Face model folder" in err and "images" in err
    from tokenizers import Tokenizer

    small = Tokenizer.from_file(str(example / "tokenizer" / "tokenizer.json"))
    vocab = {t: i for t, i in small.get_vocab().items() if i < 3}  # <pad>, <s>, </s>: no image tokens at all
    from tokenizers import models, pre_tokenizers

    bare = Tokenizer(models.BPE(vocab={**vocab, **{chr(33 + k): 3 + k for k in range(40)}}, merges=[]))
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bare.save(str(tmp_path / "bare.json"))
    code, err = run(**{"--tokenizer": str(tmp_path / "bare.json")})
    assert code == 2 and "bare.json" in err and "image_token_id" in err
    for e in (err,):
        assert "\n" not in e


def test_train_config_refuses_inconsistent_real_data_options():
    with pytest.raises(InputError, match="tokenizer"):
        TrainConfig(annotations_path="a.jsonl")
    with pytest.raises(InputError, match="annotations"):
        TrainConfig(hf_model="m")
    with pytest.raises(InputError, match="hf_model"):
        TrainConfig(annotations_path="a.jsonl", tokenizer_path="t", save_dir="out")


def test_pp2_with_a_plan_saves_the_model_a_single_process_run_saves(example, tmp_path):
    """`omnibal train --pp 2 --plan` (2 local gloo ranks) and one process train the same steps of the same
    schedule: the saved HF checkpoints load and hold the same weights (to float rounding)."""
    import safetensors.torch as st
    from transformers import AutoModelForImageTextToText

    plan = tmp_path / "plan"
    assert main(["plan", "--hf-model", str(example / "internvl"), "--gpus", "2", "--pp", "2", "--microbatches",
                 "2", "--stats", str(_stats_file(example, "internvl")), "--balance-samples", "all", "--out", str(plan),
                 "--no-timelines", "--quiet"]) == 0
    cfg = ["--annotations", str(example / "annotations.jsonl"), "--image-root", str(example / "images"),
           "--tokenizer", str(example / "tokenizer"), "--hf-model", str(example / "internvl"), "--max-tiles", "6",
           "--microbatches", "2", "--steps", "3", "--quiet"]
    assert main(["train", *cfg, "--pp", "2", "--plan", str(plan / "plan.json"), "--save-dir", str(tmp_path / "pp2"),
                 "--timeout", "60"]) == 0
    assert main(["train", *cfg, "--save-dir", str(tmp_path / "pp1")]) == 0
    AutoModelForImageTextToText.from_pretrained(tmp_path / "pp2", local_files_only=True)
    a = st.load_file(str(tmp_path / "pp2" / "model.safetensors"))
    b = st.load_file(str(tmp_path / "pp1" / "model.safetensors"))
    first = st.load_file(str(example / "internvl" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), (k, float((a[k] - b[k]).abs().max()))
    assert sum(not torch.equal(a[k], first[k]) for k in a) > 0.9 * len(a)  # trained, not the input weights


def _internvl_processor(folder: Path):
    """``AutoProcessor.from_pretrained`` of an InternVL folder; without torchvision (transformers 5 needs it for
    InternVL's video processor) the same processor built from the folder's files, its video processor aside."""
    import transformers as tf

    if importlib.util.find_spec("torchvision") is None:
        from transformers.processing_utils import ProcessorMixin

        doc = json.loads((folder / "processor_config.json").read_text())
        assert doc["processor_class"] == "InternVLProcessor" and doc["video_processor"]
        check = ProcessorMixin.check_argument_for_proper_class
        try:
            ProcessorMixin.check_argument_for_proper_class = \
                lambda self, name, arg: None if name == "video_processor" else check(self, name, arg)
            return tf.InternVLProcessor(image_processor=tf.AutoImageProcessor.from_pretrained(folder),
                                        tokenizer=tf.AutoTokenizer.from_pretrained(folder), video_processor=None,
                                        image_seq_length=doc["image_seq_length"])
        finally:
            ProcessorMixin.check_argument_for_proper_class = check
    return tf.AutoProcessor.from_pretrained(folder, local_files_only=True)


@pytest.mark.parametrize("kind", ["llava", "internvl"])
def test_the_saved_folder_has_a_processor_that_prepares_inputs_as_the_trainer_did(example, tmp_path, kind):
    """``--save-dir`` wrote no processor config: ``AutoProcessor.from_pretrained`` failed on the result. The
    processor made for it builds, for a record of the example, the token count ``omnibal stats`` counts for
    it (tiles, image tokens, markers), and the saved model runs on its output."""
    import transformers as tf
    from PIL import Image

    from omnibal.stats.io import load_stats

    save = tmp_path / "model"
    assert main(["train", "--annotations", str(example / "annotations.jsonl"), "--image-root",
                 str(example / "images"), "--tokenizer", str(example / "tokenizer"), "--hf-model",
                 str(example / kind), "--max-tiles", "6", "--microbatches", "1", "--steps", "1", "--quiet",
                 "--save-dir", str(save)]) == 0
    processor = tf.AutoProcessor.from_pretrained(save, local_files_only=True) if kind == "llava" else \
        _internvl_processor(save)
    records = [json.loads(x) for x in (example / "annotations.jsonl").read_text().splitlines()]
    row, rec = next((i, r) for i, r in enumerate(records) if isinstance(r.get("image"), str))
    placeholder = processor.image_token if kind == "llava" else processor.tokenizer.context_image_token
    text = "".join(t["value"] for t in rec["conversations"]).replace("<image>", placeholder)
    inputs = processor(images=[Image.open(example / "images" / rec["image"]).convert("RGB")], text=[text],
                       return_tensors="pt")
    stats = load_stats(_stats_file(example, kind))
    assert int(inputs["pixel_values"].shape[0]) == int(stats.tiles[row])
    image_tokens = int((inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids(placeholder)).sum())
    model = tf.AutoModelForImageTextToText.from_pretrained(save, local_files_only=True)
    assert image_tokens == int(stats.tiles[row]) * model.config.image_seq_length
    assert torch.isfinite(model(**inputs).logits).all()
