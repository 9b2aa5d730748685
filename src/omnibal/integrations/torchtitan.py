"""torchtitan from an omnibal plan (tested with torchtitan 0.3.0).

``omnibal plan --engine torchtitan`` writes ``exports/torchtitan.toml``: a ``[parallelism]`` table whose keys
are ``torchtitan.config.ParallelismConfig`` fields (``module_fqns_per_model_part`` in torchtitan's module
names) and an ``[activation_checkpoint]`` mode. torchtitan 0.2.x reads such tables from its job TOML; 0.3.0
builds its config in Python (``config_registry`` functions), so apply the fragment there::

    from omnibal.integrations.torchtitan import activation_checkpoint_config, load_fragment, parallelism_config
    fragment = load_fragment("omnibal-out/exports/torchtitan.toml")
    config = dataclasses.replace(my_config_registry_fn(), parallelism=parallelism_config(fragment),
                                 activation_checkpoint=activation_checkpoint_config(fragment))

What torchtitan expresses and omnibal plans for (``omnibal plan --engine torchtitan``): its VLMs
(``pipeline_vlm``: Qwen3.5, Kimi) run ``vision_encoder`` (ViT + projector) with ``tok_embeddings`` on the first
stage; its splitter keeps top-level children and entries of ``layers``; activation checkpointing is one mode
for every block (``none`` or ``full``), applied to the decoder's and the vision encoder's blocks alike.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnibal.errors import InputError
from omnibal.outputs import write_text
from omnibal.plan.exports import kind_of, torchtitan_fields

TESTED_VERSIONS = ">=0.3,<0.4"
CHAIN_LINE = "# omnibal-chain:"
"""Comment line of the fragment recording the layer counts it was planned for (``vision_layers=N
decoder_layers=M``): torchtitan's own tables have no key for them, a comment keeps the file a valid job TOML
for torchtitan 0.2.x (which refuses unknown tables), and :func:`check_model` compares them with the model."""


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        inner = [_toml_value(v) for v in value]
        if value and isinstance(value[0], list):
            return "[\n  " + ",\n  ".join(inner) + ",\n]"
        return "[" + ", ".join(inner) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def fragment_text(fields: dict) -> str:
    lines = [f"# omnibal plan for torchtitan ({TESTED_VERSIONS}), model {fields['model']}; "
             "see docs/engines/torchtitan.md"]
    if "chain" in fields:
        lines.append(f"{CHAIN_LINE} " + " ".join(f"{k}={v}" for k, v in fields["chain"].items()))
    lines.append("")
    for table in ("parallelism", "activation_checkpoint", "training"):
        lines.append(f"[{table}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in fields[table].items()]
        lines.append("")
    return "\n".join(lines)


def write_exports(plan, out_dir: str | Path) -> list[Path]:
    """``torchtitan.toml`` into ``out_dir`` (``InputError`` when torchtitan cannot express the plan)."""
    kinds = [kind_of(m) for st in plan.stages for m in st.modules]
    fields = {**torchtitan_fields(plan), "chain": {"vision_layers": kinds.count("vision_block"),
                                                   "decoder_layers": kinds.count("llm_block")}}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "torchtitan.toml"
    write_text(path, fragment_text(fields))
    return [path]


def load_fragment(path: str | Path) -> dict:
    """The fragment's tables, plus ``"omnibal"``: the layer counts it was planned for (its chain line), when
    it has one."""
    # Python >= 3.11; the rest of the module works on 3.10
    import tomllib

    try:
        text = Path(path).read_text()
        doc = tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the torchtitan fragment: {exc}", source=str(path)) from None
    chain = next((line[len(CHAIN_LINE):].split() for line in text.splitlines() if line.startswith(CHAIN_LINE)), None)
    if chain is not None:
        try:
            doc["omnibal"] = {k: int(v) for k, v in (item.split("=", 1) for item in chain)}
        except ValueError:
            raise InputError(f"expected NAME=COUNT pairs, got {' '.join(chain)!r}", source=str(path),
                             field="omnibal-chain") from None
    fqns = doc.get("parallelism", {}).get("module_fqns_per_model_part")
    if not isinstance(fqns, list) or not fqns or not all(isinstance(p, list) for p in fqns):
        raise InputError("must be a list of lists of module names", source="torchtitan",
                         field="module_fqns_per_model_part")
    mode = doc.get("activation_checkpoint", {}).get("mode")
    if mode not in ("none", "full"):
        raise InputError(f"must be none or full, got {mode!r}", source="torchtitan", field="activation_checkpoint.mode")
    return doc


def parallelism_config(fragment: dict):
    """torchtitan's ``ParallelismConfig`` from the fragment (an unknown key is refused by torchtitan)."""
    # optional engine: imported only when its adapter is used
    from torchtitan.config import ParallelismConfig

    try:
        return ParallelismConfig(**fragment["parallelism"])
    except TypeError as exc:
        raise InputError(f"torchtitan refused the fragment: {exc}", source="torchtitan", field="parallelism") from None


def activation_checkpoint_config(fragment: dict):
    """``FullAC.Config()`` or None (torchtitan 0.3's ``Trainer.Config.activation_checkpoint``)."""
    if fragment["activation_checkpoint"]["mode"] == "none":
        return None
    # optional engine: imported only when its adapter is used
    from torchtitan.distributed.activation_checkpoint import FullAC

    return FullAC.Config()


def check_model(model, fragment: dict) -> None:
    """Refuse a fragment made for another model: its decoder layers (``layers``), vision encoder and the
    vision encoder's layers (``vision_encoder.layers``) must be ``model``'s (a torchtitan model); an
    ``InputError`` names the part and both counts."""
    fqns = [m for part in fragment["parallelism"]["module_fqns_per_model_part"] for m in part]
    planned = sum(m.startswith("layers.") for m in fqns)
    layers = len(model.layers)
    if planned != layers or sorted(fqns) != sorted(set(fqns)):
        raise InputError(f"the fragment names {planned} decoder layers, the model has {layers}", source="torchtitan",
                         field="module_fqns_per_model_part")
    encoder = getattr(model, "vision_encoder", None)
    if ("vision_encoder" in fqns) != (encoder is not None):
        raise InputError("the fragment and the model disagree on a vision_encoder", source="torchtitan",
                         field="module_fqns_per_model_part")
    chain = fragment.get("omnibal")
    if chain is None or "vision_layers" not in chain or "decoder_layers" not in chain:
        raise InputError(f"no '{CHAIN_LINE} vision_layers=N decoder_layers=M' line: the layer counts the plan was "
                         "made for are unknown; export it again with omnibal plan --engine torchtitan",
                         source="torchtitan", field="omnibal-chain")
    if chain["decoder_layers"] != planned:
        raise InputError(f"the fragment was planned for {chain['decoder_layers']} decoder layers but names {planned}",
                         source="torchtitan", field="module_fqns_per_model_part")
    vision = len(encoder.layers) if encoder is not None and hasattr(encoder, "layers") else 0
    if encoder is not None and chain["vision_layers"] != vision:
        raise InputError(f"the fragment was planned for {chain['vision_layers']} vision layers, the model's "
                         f"vision_encoder has {vision}", source="torchtitan", field="vision_encoder.layers")
