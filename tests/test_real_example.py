"""``omnibal example``: rendered charts and pages, annotations, a BPE tokenizer and two tiny HF VLMs that train."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

from omnibal.cli import main  # noqa: E402
from omnibal.data.collate import collate  # noqa: E402
from omnibal.data.realdata import RealDataConfig, RealDataset  # noqa: E402
from omnibal.examples import real_example as rx  # noqa: E402
from omnibal.examples import render  # noqa: E402
from omnibal.stats.records import parse_record  # noqa: E402
from omnibal.stats.tiles import count_tiles, image_size  # noqa: E402
from omnibal.train.hf_adapter import from_hf  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def example(tmp_path_factory):
    out = tmp_path_factory.mktemp("real-example") / "ex"
    summary = rx.make_real_example(out, num_records=60, seed=0)
    records = [json.loads(line) for line in (out / "annotations.jsonl").read_text().splitlines()]
    return out, summary, records


def _images(rec) -> list[str]:
    return [] if "image" not in rec else [rec["image"]] if isinstance(rec["image"], str) else rec["image"]


def test_every_record_is_valid_and_its_images_exist(example):
    out, summary, records = example
    assert len(records) == summary["records"] == 60 and len({r["id"] for r in records}) == 60
    kinds = {"none": 0, "one": 0, "two": 0}
    for rec in records:
        parsed = parse_record(rec, "annotations.jsonl")  # the reader of `omnibal stats` / `omnibal train`
        images = _images(rec)
        assert parsed["images"] == images
        kinds[("none", "one", "two")[len(images)]] += 1
        convs = rec["conversations"]
        assert 2 <= len(convs) <= 6 and len(convs) % 2 == 0
        assert [t["from"] for t in convs] == ["human", "gpt"] * (len(convs) // 2)
        assert convs[0]["value"].count("<image>") == len(images)
        assert all("<image>" not in t["value"] for t in convs[1:])
        for rel in images:
            w, h = image_size(out / "images" / rel)
            assert 64 <= min(w, h) and max(w, h) <= 640, (rel, w, h)
    assert min(kinds.values()) >= 1, kinds
    referenced = {p for r in records for p in _images(r)}
    on_disk = {p.relative_to(out / "images").as_posix() for p in (out / "images").rglob("*.png")}
    assert on_disk == referenced and summary["images"] == len(referenced)


def test_tile_counts_and_lengths_vary_and_match_the_summary(example):
    out, summary, records = example
    per_image = {}
    for rel in {p for r in records for p in _images(r)}:
        w, h = image_size(out / "images" / rel)
        per_image[rel] = int(count_tiles([w], [h], rx.INTERNVL.tiles)[0])
    assert {1, 3, 4, 5, 7} <= set(per_image.values()) <= set(range(1, rx.MAX_TILES + 2))
    internvl = [sum(per_image[p] for p in _images(r)) or 1 for r in records]  # text-only: one dummy tile
    llava = [len(_images(r)) or 1 for r in records]  # LLaVA-1.5: one tile per image
    hist = lambda v: {int(k): int(n) for k, n in zip(*np.unique(v, return_counts=True))}  # noqa: E731
    assert summary["models"]["internvl"]["tiles_per_sample"] == hist(internvl)
    assert summary["models"]["llava"]["tiles_per_sample"] == hist(llava)
    assert summary["turns"].keys() == {1, 2, 3}
    text = summary["text_tokens"]
    assert text["max"] >= 4 * text["min"]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["records"] == 60 and saved["models"]["internvl"]["tiles_per_sample"] == {
        str(k): v for k, v in hist(internvl).items()}


def test_chart_answers_come_from_the_plotted_data(tmp_path, monkeypatch):
    figures = []
    real_save = render._save_figure
    monkeypatch.setattr(render, "_save_figure",
                        lambda fig, size, path: (figures.append(fig), real_save(fig, size, path)))
    rng = np.random.default_rng(5)
    for i in range(4):
        title, qa = render.bar_chart(rng, (320, 160), tmp_path / f"bar{i}.png")
        ax = figures[-1].axes[0]
        labels = [t.get_text() for t in ax.get_xticklabels()]
        heights = [int(p.get_height()) for p in ax.patches]
        assert sorted(t.get_text() for t in ax.texts) == sorted(str(v) for v in heights)  # values drawn on the bars
        answers = dict(qa)
        assert ax.get_title() == title and answers["What is the title of the chart?"] == f"{title}."
        top = labels[int(np.argmax(heights))]
        assert any(a == f"{top}, with {max(heights)}." for q, a in qa if "highest" in q)
        assert answers["How many bars does the chart show?"] == f"{len(heights)}."
        assert answers["What is the difference between the highest and the lowest bar?"] == \
            f"{max(heights) - min(heights)}."
        detail = answers["Describe the chart in detail."]
        assert all(f"{lab} at {v}" in detail for lab, v in zip(labels, heights))
        from PIL import Image

        with Image.open(tmp_path / f"bar{i}.png") as img:
            assert img.size == (320, 160) and len(img.getcolors(1 << 16) or range(1 << 16)) > 10
    title, qa = render.line_chart(rng, (300, 100), tmp_path / "line.png")
    line = figures[-1].axes[0].lines[0]
    years, values = [int(x) for x in line.get_xdata()], [int(y) for y in line.get_ydata()]
    assert dict(qa)[f"What is the value in {years[len(years) // 2]}?"] == f"{values[len(years) // 2]}."
    title, qa = render.pie_chart(rng, (120, 120), tmp_path / "pie.png")
    shown = [t.get_text() for t in figures[-1].axes[0].texts if t.get_text().endswith("%")]
    assert sum(int(s[:-1]) for s in shown) == 100
    assert all(s in dict(qa)["Describe the pie chart."] for s in shown)


def test_page_answers_are_the_text_drawn(tmp_path, monkeypatch):
    from PIL import ImageDraw

    drawn = []
    real_text = ImageDraw.ImageDraw.text
    monkeypatch.setattr(ImageDraw.ImageDraw, "text", lambda self, xy, text, *a, **k: (
        drawn.append((xy, text)), real_text(self, xy, text, *a, **k)))
    rng = np.random.default_rng(1)
    for size in [(64, 70), (200, 600), (640, 160), (107, 640)]:
        drawn.clear()
        title, qa = render.document_page(rng, size, tmp_path / "page.png")
        answers = dict(qa)
        texts = [t for _, t in drawn]
        assert texts[0] == title and answers["What is the title of the page?"] == f"The title is \"{title}\"."
        assert answers["How many lines of text are below the title?"] == f"{len(texts) - 1}."
        assert answers["Transcribe the page."] == "\n".join(texts)
        assert all(y + 1 < size[1] for (_, y), _ in drawn)  # every line starts on the page


def test_same_seed_same_files_and_a_rerun_replaces_the_folder_cleanly(tmp_path):
    out = tmp_path / "ex"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    files = ("annotations.jsonl", "tokenizer/tokenizer.json", "internvl/model.safetensors")
    first = rx.make_real_example(out, num_records=12, seed=3)
    before = {f: (out / f).read_bytes() for f in files}
    second = rx.make_real_example(out, num_records=12, seed=3)
    assert {f: (out / f).read_bytes() for f in files} == before
    assert {k: v for k, v in first.items() if k != "seconds"} == {k: v for k, v in second.items() if k != "seconds"}
    rx.make_real_example(out, num_records=7, seed=4)
    records = [json.loads(line) for line in (out / "annotations.jsonl").read_text().splitlines()]
    assert len(records) == 7 and (out / "annotations.jsonl").read_bytes() != before["annotations.jsonl"]
    on_disk = {p.relative_to(out / "images").as_posix() for p in (out / "images").rglob("*.png")}
    assert on_disk == {p for r in records for p in _images(r)}  # the first run's images are gone
    assert sorted(p.name for p in out.iterdir()) == sorted([*rx.OUTPUTS, "keep.txt"])  # no staging folder left
    assert (out / "keep.txt").read_text() == "mine"


def test_tokenizer_loads_with_tokenizers_and_auto_tokenizer(example):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    out, summary, _ = example
    for folder in ("tokenizer", "llava", "internvl"):
        raw = Tokenizer.from_file(str(out / folder / "tokenizer.json"))
        auto = AutoTokenizer.from_pretrained(out / folder, local_files_only=True)
        assert raw.get_vocab_size() == len(auto) == summary["vocab_size"] > 32
        assert [raw.token_to_id(t) for t in rx.SPECIAL_TOKENS] == list(range(len(rx.SPECIAL_TOKENS)))
        assert [auto.convert_tokens_to_ids(t) for t in rx.SPECIAL_TOKENS] == list(range(len(rx.SPECIAL_TOKENS)))
        assert (auto.pad_token, auto.bos_token, auto.eos_token) == ("<pad>", "<s>", "</s>")
        ids = raw.encode("<image>\nWhat is the title of the chart?").ids
        assert ids[0] == raw.token_to_id("<image>") and raw.decode(ids[1:]) == "\nWhat is the title of the chart?"
        assert auto.decode(auto("Sales by city.")["input_ids"]) == "Sales by city."


@pytest.mark.parametrize("spec", [rx.LLAVA, rx.INTERNVL], ids=lambda s: s.kind)
def test_checkpoints_load_completely_and_wrap_as_a_chain(example, spec):
    out, summary, _ = example
    cls = (transformers.LlavaForConditionalGeneration if spec.kind == "llava"
           else transformers.InternVLForConditionalGeneration)
    model, info = cls.from_pretrained(out / spec.kind, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg, vocab = model.config, summary["vocab_size"]
    assert cfg.image_token_id == rx.SPECIAL_TOKENS.index(spec.image_token)
    assert cfg.image_token_id == summary["models"][spec.kind]["image_token_id"]
    tc = cfg.text_config
    assert (tc.vocab_size, tc.pad_token_id, tc.bos_token_id, tc.eos_token_id) == (vocab, 0, 1, 2)
    chain = from_hf(model)
    assert chain.spec.vision.image_size == spec.image_size
    assert chain.spec.llm_tokens_per_tile == spec.tokens_per_tile == 16
    assert chain.spec.vision.num_layers == spec.vision_layers and not chain.spec.llm.tie_embeddings


def _dataset(out, spec, model):
    cfg = RealDataConfig(tokenizer=str(out / "tokenizer"), image_root=str(out / "images"), tiles=spec.tiles,
                         tokens_per_tile=spec.tokens_per_tile, image_token_id=model.config.image_token_id,
                         image_marker_tokens=spec.image_marker_tokens)
    return RealDataset(out / "annotations.jsonl", cfg)


def _loss(chain, samples):
    cfg = chain.collate_config(num_tiles=sum(s["pixel_values"].shape[0] for s in samples),
                               num_tokens=sum(len(s["input_ids"]) for s in samples))
    loss_sum, count = chain(*collate(samples, cfg).carry())
    return loss_sum.sum() / count.sum()


def test_llava_runs_on_the_samples_like_hugging_face(example):
    out, summary, records = example
    model = transformers.LlavaForConditionalGeneration.from_pretrained(out / "llava")
    ds = _dataset(out, rx.LLAVA, model)
    stats = ds.measure_stats()
    assert int(stats.tokens.sum()) == summary["models"]["llava"]["tokens"]["total"]
    i = next(k for k, r in enumerate(records) if isinstance(r.get("image"), str))
    s = ds[i]
    ref = model(input_ids=s["input_ids"][None], pixel_values=s["pixel_values"], labels=s["labels"][None]).loss
    got = _loss(from_hf(model), [s])
    got, ref = float(got.detach()), float(ref.detach())
    assert np.isfinite(got) and abs(got - ref) < 1e-4 * max(1.0, ref)


def test_internvl_learns_the_example(example):
    out, summary, _ = example
    model = transformers.InternVLForConditionalGeneration.from_pretrained(out / "internvl")
    ds = _dataset(out, rx.INTERNVL, model)
    samples = [ds[i] for i in range(len(ds))]
    assert sum(s["pixel_values"].shape[0] for s in samples) == summary["models"]["internvl"]["tiles"]["total"]
    assert sum(len(s["input_ids"]) for s in samples) == summary["models"]["internvl"]["tokens"]["total"]
    chain = from_hf(model)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    packs = np.random.default_rng(0).permutation(len(samples))[:16].reshape(4, 4)  # 4 packs of 4, cycled
    losses = []
    for step in range(40):
        loss = _loss(chain, [samples[int(k)] for k in packs[step % len(packs)]])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses


def test_cli_writes_the_example_and_names_bad_flags(tmp_path, capsys):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert main(["example", "--out", str(a_file)]) == 2
    assert "omnibal example: error: --out:" in capsys.readouterr().err
    assert main(["example", "--out", str(tmp_path / "x"), "--records", "0"]) == 2
    assert "--records" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["example", "--out", str(tmp_path / "x"), "--seed", "-1"]) == 2
    assert "--seed" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["example", "--out", str(a_file / "sub")]) == 2
    assert "--out" in capsys.readouterr().err
    out = tmp_path / "ex"
    assert main(["example", "--out", str(out), "--records", "5", "--seed", "2"]) == 0
    printed = capsys.readouterr().out
    assert "wrote 5 records" in printed
    assert (f"omnibal train --annotations {out / 'annotations.jsonl'} --image-root {out / 'images'} "
            f"--tokenizer {out / 'tokenizer'} --hf-model {out / 'llava'}") in printed
    assert len((out / "annotations.jsonl").read_text().splitlines()) == 5
