"""Tiny model specs and samples shared by the model/stage/collate/dataset tests (fast on CPU)."""

from __future__ import annotations

import torch

from omnibal.cost.spec import LLMSpec, ModelSpec, VisionSpec
from omnibal.data.collate import CollateConfig, collate
from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset
from omnibal.stats.table import SampleStats


def tiny_spec(*, vision_layers: int = 2, llm_layers: int = 2, freeze_vision: bool = False,
              tie: bool = False) -> ModelSpec:
    """32 px tiles of 8 px patches: 16 patches + class token, 4 LLM tokens per tile after pixel shuffle."""
    return ModelSpec(
        name="test-tiny",
        vision=VisionSpec(num_layers=vision_layers, hidden=32, num_heads=4, mlp_hidden=64, image_size=32,
                          patch_size=8),
        llm=LLMSpec(num_layers=llm_layers, hidden=32, num_heads=4, num_kv_heads=2, mlp_hidden=64, vocab_size=64,
                    tie_embeddings=tie),
        downsample_ratio=0.5,
        freeze_vision=freeze_vision,
    )


def tiny_dataset(spec: ModelSpec, tiles, tokens, *, seed: int = 0, target_fraction: float = 0.5):
    stats = SampleStats.from_arrays(tiles=tiles, tokens=tokens, source="test-stats")
    cfg = SyntheticSampleConfig(image_size=spec.vision.image_size, tokens_per_tile=spec.llm_tokens_per_tile,
                          vocab_size=spec.llm.vocab_size, image_token_id=spec.llm.vocab_size - 1,
                          target_fraction=target_fraction, seed=seed)
    return SyntheticVLMDataset(stats, cfg)


def collate_cfg(spec: ModelSpec, num_tiles: int, num_tokens: int, mode: str = "pack") -> CollateConfig:
    return CollateConfig(num_tiles=num_tiles, num_tokens=num_tokens, image_size=spec.vision.image_size,
                         tokens_per_tile=spec.llm_tokens_per_tile, image_token_id=spec.llm.vocab_size - 1,
                         mode=mode)  # type: ignore[arg-type]


def pack(spec, samples, num_tiles=8, num_tokens=64, mode="pack"):
    return collate(samples, collate_cfg(spec, num_tiles, num_tokens, mode))


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in module.named_parameters()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
