from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnibal.data.collate import collate  # noqa: E402
from omnibal.errors import InputError  # noqa: E402
from omnibal.train.hf_adapter import from_hf, from_llava  # noqa: E402
from omnibal.train.stage import apply_checkpointing, example_carry, split_model  # noqa: E402
from train_helpers import rel_err, tiny_dataset  # noqa: E402

torch.set_num_threads(1)


def _llava(seed=0, **overrides):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                          image_size=32, patch_size=8, projection_dim=32)
    tc = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_id=63, **overrides)
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(cfg).float()


def _internvl(seed=0, tie=False, **overrides):
    from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig, Qwen2Config

    vc = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=[32, 32], patch_size=[8, 8])
    tc = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, tie_word_embeddings=tie)
    cfg = InternVLConfig(vision_config=vc, text_config=tc, image_token_id=63, tie_word_embeddings=tie, **overrides)
    torch.manual_seed(seed)
    return InternVLForConditionalGeneration(cfg).float()


def _samples(chain, tiles, tokens):
    spec = chain.spec
    ds = tiny_dataset(spec, tiles=tiles, tokens=tokens)  # image token id = vocab - 1 = 63, 16 per tile
    return [ds[i] for i in range(len(tiles))]


def _hf_reference(model, samples):
    """Unsplit HF forward, one sample at a time: sum of (mean loss x targets) and the summed gradients."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for s in samples:
        pixels = s["pixel_values"] if len(s["pixel_values"]) else None
        out = model(input_ids=s["input_ids"][None], pixel_values=pixels, labels=s["labels"][None])
        count = int((s["labels"][1:] != -100).sum())
        (out.loss * count).backward()
        total += float(out.loss.detach()) * count
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_chain_maps_llava_modules_and_skips_the_unused_last_vision_layer():
    chain = from_llava(_llava())
    assert chain.spec.vision.num_layers == 2  # vision_feature_layer=-2 of 3 layers
    assert chain.spec.llm_tokens_per_tile == 16
    assert chain.hf_module_names["vision.blocks.1"] == ("model.vision_tower.encoder.layers.1",)
    assert chain.hf_module_names["llm.head"] == ("model.language_model.norm", "lm_head")
    for hf_names in chain.hf_module_names.values():
        for hf_name in hf_names:
            chain.hf_model.get_submodule(hf_name)
    with pytest.raises(InputError, match="vision_feature_select_strategy"):
        from_llava(_llava(vision_feature_select_strategy="full"))


@pytest.mark.parametrize("kind,bounds", [("llava", [0, 2, 7, 9]), ("llava", [0, 4, 9]),
                                         ("internvl", [0, 2, 6, 10]), ("internvl", [0, 5, 10])])
def test_split_chain_matches_the_unsplit_hf_model(kind, bounds):
    model = _llava(seed=1) if kind == "llava" else _internvl(seed=1)
    chain = from_hf(model)
    assert chain.spec.num_layers == bounds[-1]
    assert chain.spec.llm_tokens_per_tile == (16 if kind == "llava" else 4)
    samples = _samples(chain, tiles=[1, 0, 2], tokens=[24, 7, 40])
    ref_loss, ref_grads = _hf_reference(model, samples)

    model.zero_grad(set_to_none=True)
    batch = collate(samples, chain.collate_config(num_tiles=4, num_tokens=80))
    stages = split_model(chain, bounds)
    apply_checkpointing(stages[1], [stages[1].layer_names[0]])
    carry = batch.carry()
    for start, stage in zip(bounds, stages):
        example = example_carry(chain, start, num_tiles=4, num_tokens=80)
        assert [t.shape for t in example] == [t.shape for t in carry]
        carry = stage(*carry)
    loss, count = carry
    loss.backward()
    assert int(count) == batch.num_targets
    assert rel_err(loss.detach(), torch.tensor([ref_loss])) <= 1e-5
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == ref_grads.keys()
    if kind == "llava":  # vision_feature_layer=-2: the last encoder layer never runs
        unused = [n for n, _ in model.named_parameters() if n not in got]
        assert unused and all("layers.2" in n or "post_layernorm" in n for n in unused)
    scale = max(float(g.norm()) for g in ref_grads.values())
    for name, g in got.items():
        # key-projection biases have a zero true gradient (softmax ignores them): compare to the global scale
        ref = ref_grads[name]
        assert rel_err(g, ref) <= 1e-5 or float((g - ref).norm()) <= 1e-7 * scale, name


def test_tied_internvl_splits_only_with_embedding_and_head_together():
    from omnibal.train.stage import build_stage

    chain = from_hf(_internvl(tie=True))
    assert chain.spec.llm.tie_embeddings
    with pytest.raises(InputError, match="tied"):
        split_model(chain, [0, 6, 10])
    assert build_stage(chain, 5, 10).is_last
    with pytest.raises(InputError, match="no adapter"):
        from_hf(torch.nn.Linear(2, 2))


def test_text_blocks_attend_varlen_unless_the_model_needs_its_own_attention():
    """SDPA / eager decoders switch to omnibal's packed (varlen) attention; one with attention dropout keeps
    the block-diagonal mask; the HF model's own forward keeps working after the switch (it is exercised by
    the split-chain test above, which compares with it)."""
    chain = from_hf(_internvl(seed=1))
    blocks = [m for layer, m in chain.chain() if layer.kind == "llm_block"]
    assert blocks and all(b.packed for b in blocks)
    dropout = _internvl(seed=1)
    dropout.config.text_config.attention_dropout = 0.1
    assert not any(m.packed for layer, m in from_hf(dropout).chain() if layer.kind == "llm_block")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llava", "internvl"])
def test_chain_on_cuda_in_bf16_matches_cpu(kind):
    """The wrapped HF model on CUDA under bf16 autocast (the GPU trainer's path: flash varlen attention for
    the language model) gives the CPU fp32 loss within bf16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = _llava(seed=2) if kind == "llava" else _internvl(seed=2)
    chain = from_hf(model)
    samples = _samples(chain, tiles=[1, 0, 2], tokens=[24, 7, 40])
    batch = collate(samples, chain.collate_config(num_tiles=4, num_tokens=80))
    cpu_loss, _ = chain(*batch.carry())
    chain.to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        gpu_loss, count = chain(*[t.cuda() for t in batch.carry()])
    gpu_loss.backward()
    assert int(count) == batch.num_targets
    assert rel_err(gpu_loss.detach().cpu(), cpu_loss.detach()) < 3e-2
