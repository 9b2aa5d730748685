"""Model presets: published VLM configurations and a CPU-sized ``tiny`` model.

Every dimension below was checked against the model's published ``config.json`` (vision_config /
llm_config of the InternVL chat models, the LLaVA-1.5 configs, the CLIP ViT-L/14-336 config);
:data:`PUBLISHED_PARAMS` holds the published parameter totals the tests compare our counts with.

Vocabulary of the InternVL models: the stand-alone InternLM2 / InternLM2.5 checkpoints have 92,544 rows,
the InternVL chat checkpoints built on them (InternVL-Chat-V1-5, InternVL2-8B/26B) resize the embedding to
92,553 rows (``llm_config.vocab_size`` in their config.json) for the added image and chat tokens
(``<img>``, ``</img>``, ``<IMG_CONTEXT>``, ...). A preset describes the VLM that is trained, so it uses
92,553; the 9-row difference is 0.002% of the model.
"""

from __future__ import annotations

from omnibal.cost.spec import LLMSpec, ModelSpec, VisionSpec
from omnibal.errors import InputError

INTERNVIT_6B = VisionSpec(num_layers=45, hidden=3200, num_heads=25, mlp_hidden=12800, image_size=448,
                          patch_size=14, class_token=True, qk_norm=True, layer_scale=True)
"""InternViT-6B-448px-V1-5 (45 of the original 48 blocks are kept; ``qk_normalization: true`` and layer
scale ``ls1``/``ls2`` in its config and modeling code)."""
INTERNVIT_300M = VisionSpec(num_layers=24, hidden=1024, num_heads=16, mlp_hidden=4096, image_size=448,
                            patch_size=14, class_token=True, layer_scale=True)
"""InternViT-300M-448px (InternVL2-1B..8B; layer scale, no QK norm)."""
CLIP_L_336 = VisionSpec(num_layers=23, hidden=1024, num_heads=16, mlp_hidden=4096, image_size=336,
                        patch_size=14, class_token=True, mlp_act="quick_gelu")
"""CLIP ViT-L/14-336 as LLaVA-1.5 runs it: features of the second to last block, so 23 of 24 blocks run;
``hidden_act: quick_gelu`` in its config."""

INTERNLM2_20B = LLMSpec(num_layers=48, hidden=6144, num_heads=48, num_kv_heads=8, mlp_hidden=16384,
                        vocab_size=92553)
INTERNLM25_7B = LLMSpec(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, mlp_hidden=14336,
                        vocab_size=92553)
YI_34B = LLMSpec(num_layers=60, hidden=7168, num_heads=56, num_kv_heads=8, mlp_hidden=20480, vocab_size=64000)
VICUNA_7B = LLMSpec(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=32, mlp_hidden=11008,
                    vocab_size=32000)
VICUNA_13B = LLMSpec(num_layers=40, hidden=5120, num_heads=40, num_kv_heads=40, mlp_hidden=13824,
                     vocab_size=32000)

TINY_VISION = VisionSpec(num_layers=5, hidden=128, num_heads=4, mlp_hidden=512, image_size=112, patch_size=14,
                         class_token=True)
TINY_LLM = LLMSpec(num_layers=6, hidden=128, num_heads=4, num_kv_heads=2, mlp_hidden=384, vocab_size=2048)

_PRESETS: dict[str, ModelSpec] = {
    "internvl-chat-1.5": ModelSpec(name="internvl-chat-1.5", vision=INTERNVIT_6B, llm=INTERNLM2_20B,
                                   downsample_ratio=0.5),
    # The OmniBal paper's 6B + 34B model: InternViT-6B with Nous-Hermes-2-Yi-34B (as in InternVL-Chat-V1-2-Plus).
    "internvl-chat-1.5-plus": ModelSpec(name="internvl-chat-1.5-plus", vision=INTERNVIT_6B, llm=YI_34B,
                                        downsample_ratio=0.5),
    "internvl2-8b": ModelSpec(name="internvl2-8b", vision=INTERNVIT_300M, llm=INTERNLM25_7B, downsample_ratio=0.5),
    "llava-1.5-7b": ModelSpec(name="llava-1.5-7b", vision=CLIP_L_336, llm=VICUNA_7B, downsample_ratio=1.0,
                              projector_norm=False),
    "llava-1.5-13b": ModelSpec(name="llava-1.5-13b", vision=CLIP_L_336, llm=VICUNA_13B, downsample_ratio=1.0,
                               projector_norm=False),
    # CPU model for tests and measured runs (see docs/cost.md): 112 px tiles of 8 x 8 patches (65 ViT tokens),
    # pixel shuffle 0.5 -> 16 LLM tokens per tile. 5 ViT + 6 LLM blocks: on the real InternVL-1.2M statistics
    # (ai2d + chartqa) the ViT takes about the share of the CPU time it takes of InternViT-6B + InternLM2-20B's
    # predicted A100 time on the same samples, so the baseline's LLM padding costs what it costs there
    # (docs/cost.md has the figures). A balanced pack's forward + backward on one core is far above a gloo
    # p2p transfer per micro-batch, so the pipeline's compute, not its links, sets the step time.
    "tiny": ModelSpec(name="tiny", vision=TINY_VISION, llm=TINY_LLM, downsample_ratio=0.5),
}

PUBLISHED_PARAMS: dict[str, dict[str, float]] = {
    # part -> published parameter count; the tests check ours within a few percent.
    "internvl-chat-1.5": {"vision": 5.54e9, "llm": 19.86e9, "total": 25.5e9},
    "internvl-chat-1.5-plus": {"vision": 5.54e9, "llm": 34.39e9, "total": 40.1e9},
    "internvl2-8b": {"vision": 0.304e9, "llm": 7.74e9, "total": 8.08e9},
    "llava-1.5-7b": {"llm": 6.74e9, "total": 7.06e9},
    "llava-1.5-13b": {"llm": 13.02e9, "total": 13.35e9},
}
"""Published totals: InternViT-6B-448px-V1-5 5.54B (model card: 5540M, last 3 blocks dropped), InternLM2-20B
19.86B, Yi-34B 34.39B, InternViT-300M 0.30B, InternLM2.5-7B 7.74B, Vicuna-7B 6.74B, Vicuna-13B 13.02B,
CLIP ViT-L/14-336 vision tower 0.304B (all 24 blocks); VLM totals from the model cards (InternVL-Chat-V1-5
25.5B, InternVL-Chat-V1-2-Plus 40.1B, InternVL2-8B 8.08B, LLaVA-1.5 7B/13B 7.06B/13.35B)."""


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def get_model_preset(name: str) -> ModelSpec:
    """The preset called ``name``; an unknown name raises InputError listing the known ones."""
    try:
        return _PRESETS[name]
    except (KeyError, TypeError):
        raise InputError(f"unknown model preset {name!r}; known presets: {', '.join(_PRESETS)}",
                         source="preset", field="name") from None
