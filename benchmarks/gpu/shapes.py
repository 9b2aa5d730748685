"""What the GPU check measures, in two sizes: ``FULL`` (real model widths on one GPU, bf16) and ``DRY`` (tiny
shapes on the CPU, fp32), the same code path with other numbers. Every section reads its part from here."""

from __future__ import annotations

from dataclasses import dataclass, replace

from omnibal.cost.presets import TINY_LLM, TINY_VISION, get_model_preset
from omnibal.cost.profile import ProfileGrid
from omnibal.cost.spec import ModelSpec
from omnibal.examples.real_example import TinyVLM


@dataclass(frozen=True, kw_only=True)
class LayerCase:
    """One model whose layers are timed against the analytic cost model."""

    label: str
    """What the model is, for the report."""
    spec: ModelSpec
    """The model (its real widths in the full check)."""
    kinds: tuple[str, ...]
    """Layer kinds to time."""
    grid: ProfileGrid
    """Shapes per kind (see :meth:`omnibal.cost.profile.ProfileGrid.shapes`)."""
    calibrate: bool
    """Whether the efficiency factors are fitted on this case (the others validate the fit, held out)."""


@dataclass(frozen=True, kw_only=True)
class MemoryCase:
    """Layers whose kept bytes are compared with the memory model, at every recompute granularity."""

    label: str
    """What the layers are, for the report."""
    spec: ModelSpec | None
    """A reference-model spec, or None for a Hugging Face model built from ``hf``."""
    hf: TinyVLM | None = None
    """Shape of a Hugging Face Llava / InternVL model (one layer per tower suffices: memory is per layer)."""
    kinds: tuple[str, ...] = ("vision_block", "llm_block")
    """Layer kinds measured."""
    tiles: tuple[int, ...] = (1, 4)
    """Tiles per micro-batch of the vision layers."""
    tokens: tuple[int, ...] = (1024, 4096)
    """LLM tokens per micro-batch (packs of equal samples of ``segment`` tokens)."""
    segment: int = 1024
    """Sample length inside an LLM pack."""


@dataclass(frozen=True, kw_only=True)
class FragmentationConfig:
    """A stack of LLM blocks trained on a sequence of variable-length packs, to see what the caching
    allocator reserves beyond what it hands out."""

    spec: ModelSpec
    """Model whose LLM block is stacked."""
    blocks: int
    """Blocks in the stack."""
    packs: int
    """Packs run (forward + backward each)."""
    samples: int
    """Rows of the synthetic InternVL mixture the packs come from (balanced by omnibal)."""
    scale: float = 1.0
    """Token counts are multiplied by this (the dry run shrinks them)."""


@dataclass(frozen=True, kw_only=True)
class EndToEndConfig:
    """One GPU trains an InternVL-shaped Hugging Face model on the real example, baseline vs omnibal."""

    model: TinyVLM
    """Shape of the random-init checkpoint."""
    records: int
    """Records the example renders."""
    replicas: int
    """Times the annotations are repeated (the same images)."""
    microbatches: int = 4
    """Micro-batches per step (both modes)."""
    batch_size: int = 4
    """Samples per baseline micro-batch."""
    max_tiles: int = 6
    """Dynamic-resolution tiles per image (thumbnail not counted)."""
    profile_grid: ProfileGrid = ProfileGrid(tiles=(1, 4, 8, 16), tokens=(1024, 2048, 4096, 8192),
                                            segments=(256, 512, 1024))
    """Shapes at which the model's layers are timed for the simulator's prediction."""


@dataclass(frozen=True, kw_only=True)
class CheckShapes:
    """Everything one run of the check measures."""

    device: str
    """``cuda`` or ``cpu`` (the dry run)."""
    dtype: str
    """Layer dtype of the layer and memory sections (``bf16`` on a GPU)."""
    precision: str
    """``omnibal train --precision`` of the end-to-end runs."""
    warmup: int
    """Untimed runs per shape."""
    repeats: int
    """Timed runs per shape."""
    layers: tuple[LayerCase, ...]
    memory: tuple[MemoryCase, ...]
    fragmentation: FragmentationConfig
    end_to_end: EndToEndConfig


_INTERNVL_20B = get_model_preset("internvl-chat-1.5")
_LLM_7B = get_model_preset("internvl2-8b")  # InternLM2.5-7B
_UNPADDED_20B = replace(_INTERNVL_20B, name="internvl-chat-1.5-unpadded-vocab",
                        llm=replace(_INTERNVL_20B.llm, vocab_multiple=1))
"""The 20B model's LM head as a Hugging Face checkpoint runs it: no vocabulary padding."""
_E2E_MODEL = TinyVLM(kind="internvl", image_size=448, patch_size=14, image_token="<IMG_CONTEXT>",
                     vision_hidden=1024, vision_layers=24, vision_heads=16, text_hidden=2048, text_layers=20,
                     text_heads=16, text_kv_heads=8, mlp_ratio=4)
"""~1.4B parameters: an InternViT-300M-sized encoder at 448 px tiles and a 1.1B Qwen2-style decoder."""

FULL = CheckShapes(
    device="cuda", dtype="bf16", precision="bf16-mixed", warmup=2, repeats=5,
    layers=(
        LayerCase(label="InternViT-6B + InternLM2-20B (internvl-chat-1.5)", spec=_INTERNVL_20B,
                  kinds=("vision_embed", "vision_block", "projector", "llm_embed", "llm_block", "lm_head"),
                  grid=ProfileGrid(tiles=(1, 2, 4, 8), tokens=(2048, 4096, 8192), segments=(512, 2048, 8192)),
                  calibrate=True),
        LayerCase(label="InternLM2.5-7B block (internvl2-8b)", spec=_LLM_7B, kinds=("llm_block",),
                  grid=ProfileGrid(tiles=(1,), tokens=(2048, 8192, 16384), segments=(512, 4096)), calibrate=False),
        LayerCase(label="InternLM2-20B LM head, vocabulary unpadded (92553 rows)", spec=_UNPADDED_20B,
                  kinds=("lm_head",), grid=ProfileGrid(tiles=(1,), tokens=(2048, 8192), segments=(8192,)),
                  calibrate=False),
    ),
    memory=(
        MemoryCase(label="reference InternViT-6B / InternLM2-20B blocks", spec=_INTERNVL_20B,
                   tiles=(1, 4), tokens=(2048, 8192), segment=2048),
        MemoryCase(label="HF InternVL (transformers) at the end-to-end widths", spec=None,
                   hf=replace(_E2E_MODEL, vision_layers=1, text_layers=1),
                   tiles=(1, 4), tokens=(2048, 8192), segment=2048),
        MemoryCase(label="HF Llava (transformers), CLIP-L/Vicuna-7B widths", spec=None,
                   hf=TinyVLM(kind="llava", image_size=336, patch_size=14, image_token="<image>", vision_hidden=1024,
                              vision_layers=1, vision_heads=16, text_hidden=4096, text_layers=1, text_heads=32,
                              text_kv_heads=32, mlp_ratio=3),
                   tiles=(1, 4), tokens=(2048, 8192), segment=2048),
    ),
    fragmentation=FragmentationConfig(spec=_LLM_7B, blocks=4, packs=48, samples=30_000),
    end_to_end=EndToEndConfig(model=_E2E_MODEL, records=400, replicas=2),
)

_TINY = ModelSpec(name="tiny-internvit", vision=replace(TINY_VISION, qk_norm=True, layer_scale=True), llm=TINY_LLM,
                  downsample_ratio=0.5)
"""The tiny preset with InternViT-6B's QK norm and layer scale, so the dry run passes through them."""
_TINY_GRID = ProfileGrid(tiles=(1, 2, 4), tokens=(64, 128), segments=(32, 128))

DRY = CheckShapes(
    device="cpu", dtype="fp32", precision="fp32", warmup=1, repeats=2,
    layers=(
        LayerCase(label="tiny, InternViT features", spec=_TINY,
                  kinds=("vision_embed", "vision_block", "projector", "llm_embed", "llm_block", "lm_head"),
                  grid=_TINY_GRID, calibrate=True),
        LayerCase(label="tiny LLM block", spec=get_model_preset("tiny"), kinds=("llm_block",),
                  grid=_TINY_GRID, calibrate=False),
    ),
    memory=(
        MemoryCase(label="reference tiny blocks", spec=_TINY, tiles=(1, 2), tokens=(64, 128), segment=32),
        MemoryCase(label="HF InternVL (transformers), tiny", spec=None,
                   hf=TinyVLM(kind="internvl", image_size=64, patch_size=8, image_token="<IMG_CONTEXT>", text_layers=1,
                              vision_layers=1), tiles=(1, 2), tokens=(64, 128), segment=32),
        MemoryCase(label="HF Llava (transformers), tiny", spec=None,
                   hf=TinyVLM(kind="llava", image_size=56, patch_size=14, image_token="<image>", text_layers=1,
                              vision_layers=1), tiles=(1, 2), tokens=(64, 128), segment=32),
    ),
    fragmentation=FragmentationConfig(spec=get_model_preset("tiny"), blocks=2, packs=4, samples=2_000, scale=0.05),
    end_to_end=EndToEndConfig(model=TinyVLM(kind="internvl", image_size=64, patch_size=8,
                                            image_token="<IMG_CONTEXT>"),
                              records=24, replicas=2, microbatches=2, batch_size=2,
                              profile_grid=ProfileGrid(tiles=(1, 4), tokens=(64, 256), segments=(64,))),
)
