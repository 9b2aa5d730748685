"""DeepSpeed pipeline parallelism from an omnibal plan (tested with deepspeed 0.19.8; public API only).

``omnibal plan --engine deepspeed`` writes ``exports/deepspeed.json`` (parts, layers to checkpoint per stage)
and ``exports/ds_config.json``. Then, on every rank::

    from omnibal.integrations.deepspeed import check_model, load_export, pipeline_module
    export = load_export("omnibal-out/exports/deepspeed.json")
    check_model(export, num_layers=..., num_vision_layers=...)    # the model's decoder and vision layers
    module = pipeline_module(layers, export, loss_fn=loss_fn)      # layers: the plan's chain, in order
    params = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, config=export["ds_config"], model_parameters=params,
                                      optimizer=torch.optim.AdamW(params))   # ZeRO-1 needs an optimizer
    loss = engine.train_batch(data_iter)

Why a builder: ``PipelineModule(partition_method=...)`` accepts only ``uniform``, ``parameters`` and
``type:regex`` (explicit boundaries raise ``NotImplementedError``; setting ``.parts`` afterwards changes
nothing), and its ``activation_checkpoint_interval`` checkpoints every k-th run of layers of whole classes.
So the builder groups each planned stage's layers into one :class:`StageBlock` and passes the P blocks with
``partition_method="uniform"``: DeepSpeed's uniform split of P items over P stages gives stage ``s`` exactly
block ``s``, i.e. the plan's ``parts``. Each block checkpoints exactly the plan's layers with non-reentrant
``torch.utils.checkpoint`` (per layer, as omnibal planned it). Layers given as ``LayerSpec`` are built only
on the rank that owns their stage, as DeepSpeed does.

Consequences: DeepSpeed's layer index is the stage index (its checkpoint files are per stage, so a new plan
with other parts needs a conversion of saved weights), and tied layers (``TiedLayerSpec``) across stages are
not supported (InternVL and LLaVA do not tie the LM head to the embedding).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from omnibal.errors import InputError
from omnibal.outputs import write_text
from omnibal.plan.exports import deepspeed_fields, kind_of

TESTED_VERSIONS = ">=0.16,<0.20"
"""DeepSpeed versions the builder was written for; CI runs 0.19.8 (only public API is used)."""


def write_exports(plan, out_dir: str | Path) -> list[Path]:
    """``deepspeed.json`` (parts, recompute per stage, layer names) and ``ds_config.json`` into ``out_dir``."""
    fields = deepspeed_fields(plan)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path, cfg = out / "deepspeed.json", out / "ds_config.json"
    write_text(path, json.dumps({"engine": "deepspeed", "tested_versions": TESTED_VERSIONS, **fields}, indent=2) + "\n")
    write_text(cfg, json.dumps(fields["ds_config"], indent=2) + "\n")
    return [path, cfg]


def load_export(path: str | Path) -> dict:
    """Read ``deepspeed.json`` and check its fields (``InputError`` naming the field)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the DeepSpeed export: {exc}", source=str(path)) from None
    parts = doc.get("parts") if isinstance(doc, dict) else None
    if not isinstance(parts, list) or len(parts) < 2 or not all(isinstance(p, int) for p in parts) \
            or any(b <= a for a, b in zip(parts, parts[1:])) or parts[0] != 0:
        raise InputError("must be increasing integers from 0", source="deepspeed", field="parts")
    rec = doc.get("recompute_layers_per_stage")
    if not isinstance(rec, list) or len(rec) != len(parts) - 1:
        raise InputError(f"must list one set per stage ({len(parts) - 1})", source="deepspeed",
                         field="recompute_layers_per_stage")
    return doc


def check_model(export: dict, *, num_layers: int, num_vision_layers: int | None = None) -> None:
    """Refuse an export made for another model: its decoder (LLM) and vision layer counts, read from
    ``layer_names``, must be the model's (a chain of the same length but another split would otherwise pass
    :func:`pipeline_module`). ``InputError`` naming the part and both counts."""
    kinds = [kind_of(n) for n in export.get("layer_names", [])]
    planned = kinds.count("llm_block")
    if planned != num_layers:
        raise InputError(f"the plan ({export.get('model', '?')}) has {planned} decoder layers, the model {num_layers}",
                         source="deepspeed", field="layer_names")
    vision = kinds.count("vision_block")
    if num_vision_layers is not None and vision != num_vision_layers:
        raise InputError(f"the plan ({export.get('model', '?')}) has {vision} vision layers, the model "
                         f"{num_vision_layers}", source="deepspeed", field="layer_names")


class StageBlock(nn.Module):
    """One planned stage: its layers in order, the planned ones checkpointed.

    ``star_args``: layers take the carry unpacked (``layer(*carry)``, omnibal's reference chain) instead of
    DeepSpeed's one-argument convention (``layer(inputs)``).
    """

    def __init__(self, layers: Sequence, checkpointed: Sequence[int], *, star_args: bool = False,
                 checkpoint_fn: Callable | None = None) -> None:
        super().__init__()
        built = [layer.build() if hasattr(layer, "build") and not isinstance(layer, nn.Module) else layer
                 for layer in layers]
        self.layers = nn.ModuleList(m for m in built if isinstance(m, nn.Module))
        self._funcs = built
        self.checkpointed = frozenset(int(i) for i in checkpointed)
        self.star_args = star_args
        self.checkpoint_fn = checkpoint_fn

    def _call(self, layer, x):
        if self.star_args and isinstance(x, tuple):
            return layer(*x)
        return layer(x)

    def forward(self, inputs):
        x = inputs
        for i, layer in enumerate(self._funcs):
            if i in self.checkpointed and torch.is_grad_enabled():
                x = self._checkpoint(layer, x)
            else:
                x = self._call(layer, x)
        return x

    def _checkpoint(self, layer, x):
        packed = isinstance(x, tuple)

        def run(*args):
            return self._call(layer, args if packed else args[0])

        if self.checkpoint_fn is not None:
            return self.checkpoint_fn(run, *(x if packed else (x,)))

        return checkpoint(run, *(x if packed else (x,)), use_reentrant=False)


def stage_specs(layers: Sequence, export: dict, *, star_args: bool = False, checkpoint_fn=None) -> list:
    """One ``LayerSpec(StageBlock, ...)`` per planned stage (``InputError`` for a chain of another length)."""
    # optional engine: imported only when its adapter is used
    from deepspeed.pipe import LayerSpec

    parts = export["parts"]
    if len(layers) != parts[-1]:
        raise InputError(f"{len(layers)} layers given but the plan's chain has {parts[-1]} (model "
                         f"{export.get('model', '?')}); pass the layers of the planned model in order",
                         source="deepspeed", field="parts")
    specs = []
    for s, (a, b) in enumerate(zip(parts, parts[1:])):
        local = [g - a for g in export["recompute_layers_per_stage"][s]]
        if any(not 0 <= i < b - a for i in local):
            raise InputError(f"stage {s} checkpoints layers outside [{a}, {b})", source="deepspeed",
                             field="recompute_layers_per_stage")
        specs.append(LayerSpec(StageBlock, list(layers[a:b]), local, star_args=star_args,
                               checkpoint_fn=checkpoint_fn))
    return specs


def pipeline_module(layers: Sequence, export: dict, *, loss_fn=None, star_args: bool = False,
                    checkpoint_fn=None, **kwargs):
    """A ``deepspeed.pipe.PipelineModule`` whose stage ``s`` holds exactly ``layers[parts[s]:parts[s+1]]``
    with the plan's layers checkpointed. ``kwargs`` go to ``PipelineModule`` (``topology``, ``seed_layers``,
    ...); ``partition_method`` and ``activation_checkpoint_interval`` are set here."""
    # optional engine: imported only when its adapter is used
    from deepspeed.pipe import PipelineModule

    for key in ("partition_method", "activation_checkpoint_interval", "num_stages"):
        if key in kwargs:
            raise InputError("set by the plan", source="deepspeed", field=key)
    specs = stage_specs(layers, export, star_args=star_args, checkpoint_fn=checkpoint_fn)
    module = PipelineModule(layers=specs, num_stages=len(specs), loss_fn=loss_fn, partition_method="uniform",
                            activation_checkpoint_interval=0, **kwargs)
    if list(module.parts) != list(range(len(specs) + 1)):  # DeepSpeed changed its uniform split
        raise InputError(f"DeepSpeed split the {len(specs)} stage blocks as {list(module.parts)}; this builder "
                         f"was tested with deepspeed {TESTED_VERSIONS}", source="deepspeed", field="parts")
    return module
