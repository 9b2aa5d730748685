"""Analytic per-layer costs: FLOPs and bytes from the dimensions, times from a :class:`HardwareSpec`.

Every quantity is a coefficient vector over the micro-batch features ``(one, tiles, tokens, tokens_sq)``
(see :mod:`omnibal.cost.table`). Notation: H/M vision width/MLP width, n ViT tokens per tile, P patches per
tile, r LLM tokens per tile, D/F LLM width/MLP width, Dkv = kv heads x head dim, V vocabulary, b bytes per
element of the training dtype, t the tensor-parallel size.

Forward FLOPs (a multiply-add is 2 FLOPs):

- vision block, per tile: GEMMs ``2 n (4H^2 + 2HM) / t``; attention (full, per tile) ``4 n^2 H / t``.
- vision embed, per tile: patch GEMM ``2 P (3 p^2) H``.
- projector, per tile: ``2 r (in D + D D) / t`` (in = H / downsample_ratio^2).
- LLM block, per token: GEMMs ``2 (D (D + 2 Dkv) + D D + 3 D F) / t``; causal attention per attention
  segment of length s: ``2 s^2 D / t`` (QK^T and AV, the masked half skipped as flash attention does),
  i.e. the ``tokens_sq`` column.
- LM head, per token: ``2 D V / t``; the embedding lookup has no FLOPs.

Backward is 2x forward for GEMMs and element-wise traffic and 2.5x for the attention core (flash attention's
backward recomputes QK^T: 5 GEMM-like products instead of 2). Recomputation adds one more forward; the
consumers (planner, simulator) add ``fwd_time`` for each checkpointed layer.

Time of a pass = GEMM FLOPs / (peak x eff_matmul) + attention FLOPs / (peak x eff_attention)
+ element-wise bytes / (memory_bandwidth x eff_memory) + ``layer_overhead_s`` in the ``one`` column.

Activation bytes kept for backward (``act_bytes``) follow Korthikanti et al. 2022 ("Reducing activation
recomputation in large transformer models"), section 4, for a pre-norm block with flash attention (no s^2
score matrix is stored), no dropout and no sequence parallelism; per token of a block:
vision ``b (4H + (4H + 2M)/t)`` (+ ``2bH/t + 8`` with QK norm: q and k before the norm and two fp32
statistics; + ``2bH`` with layer scale: both branch outputs, which the scales' gradients need) (two norm
inputs, qkv and fc1 inputs replicated; q, k, v, attention output, GELU input and fc2 input split), LLM
``b (4D + (2D + 2Dkv + 4F)/t)`` (SwiGLU keeps gate, up, silu(gate) and their product), plus fp32 norm
statistics and the softmax log-sum-exp. With M = 4H, t = 1 and b = 2 the vision figure is 32 H bytes per
token: Korthikanti's 34 s b h less the two 1-byte dropout masks. Implementation details the spec states add
to it: CLIP's quick GELU keeps its sigmoid too (``b M / t``), and transformers' eager RMSNorm keeps an fp32
copy of each norm's input (``2 x 4 D`` for the two norms of an LLM block, when b < 4). A kernel that cannot
share key/value heads (grouped-query attention expanded before it) keeps k and v at the query's head count:
not counted (flash-attn and torch >= 2.12 share them).
A checkpointed layer keeps only its input (``ckpt_bytes``); the layer's full activations exist again for a
moment during its recomputation, which consumers account as a transient.

Parameter, gradient and optimizer bytes per parameter come from the software stack
(:mod:`omnibal.cost.stack`): ``megatron-deepspeed`` keeps bf16 weights (2 B), an fp32 gradient buffer
(4 B) and fp32 master weights + two Adam moments (12 B); ``omnibal`` bf16 gradients (2 B) instead; fp32
training: 4 + 4 + 8. ``optim_bytes`` is before ZeRO sharding: with ZeRO-1 over ``dp`` data-parallel ranks a
rank holds ``optim_bytes / dp`` (ZeRO-2 also divides ``grad_bytes``); :func:`zero_sharded_bytes` does this.

Tensor parallelism (Megatron-style): GEMM and attention FLOPs, the split activations and the block weights
are divided by t; each transformer block does two all-reduces of its ``tokens x width`` activation in the
forward and two in the backward (``tp_comm_time``); the projector one each way, the vocabulary-parallel
embedding one forward, the vocabulary-parallel LM head two small fp32 ones forward (max, sum of exp) and one
of its input gradient backward. A ring all-reduce of B bytes costs ``2 (t-1)/t B / bandwidth + 2 (t-1)
latency``, over the intra-node link when ``t <= gpus_per_node``. Activations crossing a pipeline boundary are
counted whole (no scatter/gather optimisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal.cost.hardware import HardwareSpec
from omnibal.cost.params import layer_param_counts
from omnibal.cost.spec import ModelSpec
from omnibal.cost.stack import FP32_STACK, StackConfig, get_stack
from omnibal.cost.table import NUM_FEATURES, LayerCostTable
from omnibal.errors import InputError
from omnibal.validate import is_int

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
BWD_FACTOR = {"matmul": 2.0, "attention": 2.5, "memory": 2.0}
# Bytes per LLM token that travel with the activations across a boundary: input ids + position ids (int64)
# before llm.embed, position ids after it.
META_BYTES_BEFORE_EMBED = 16
META_BYTES_AFTER_EMBED = 8

ONE, TILES, TOKENS, TOKENS_SQ = range(NUM_FEATURES)
SELECTIVE_KINDS = ("vision_block", "llm_block")
"""Layers selective recompute applies to: the transformer blocks (the other layers recompute whole or not)."""


@dataclass(frozen=True)
class LayerWork:
    """Forward work of every layer as ``[L, 4]`` coefficient arrays (per device, after the TP split)."""

    matmul_flops: np.ndarray
    attention_flops: np.ndarray
    memory_bytes: np.ndarray
    """Element-wise (memory-bound) traffic, bytes."""
    act_bytes: np.ndarray
    ckpt_bytes: np.ndarray
    sel_act_bytes: np.ndarray
    """Bytes kept under selective recompute: the layer's input and the outputs of its matrix products and
    attention; the element-wise ops (norms, activation, rotary, residual adds, scales) are recomputed."""
    out_bytes: np.ndarray
    tp_allreduce_bytes: np.ndarray
    """Bytes all-reduced inside the layer, forward + backward (per all-reduce payload, summed)."""
    tp_allreduce_count: np.ndarray
    """``[L]`` number of all-reduces (forward + backward) for the latency term."""
    trainable: np.ndarray
    """``[L]`` bool: whether the layer gets gradients (a frozen vision encoder does not)."""


def _vec(**cols: float) -> np.ndarray:
    out = np.zeros(NUM_FEATURES)
    for key, value in cols.items():
        out[{"one": ONE, "tiles": TILES, "tokens": TOKENS, "tokens_sq": TOKENS_SQ}[key]] = value
    return out


def check_tp(spec: ModelSpec, tp_size: int, *, tp_vision: bool = True) -> None:
    """InputError naming the field when ``tp_size`` does not divide a split dimension."""
    if not is_int(tp_size) or tp_size < 1:
        raise InputError(f"must be a positive integer, got {tp_size!r}", source="tp_size", field="tp_size")
    checks = [("llm.num_heads", spec.llm.num_heads), ("llm.num_kv_heads", spec.llm.num_kv_heads),
              ("llm.mlp_hidden", spec.llm.mlp_hidden), ("llm.hidden", spec.llm.hidden)]
    if tp_vision:
        checks += [("vision.num_heads", spec.vision.num_heads), ("vision.mlp_hidden", spec.vision.mlp_hidden)]
    for field, value in checks:
        if value % tp_size:
            hint = " (pass tp_vision=False to replicate the vision encoder)" if field.startswith("vision") else ""
            raise InputError(f"{field} = {value} is not divisible by tp_size {tp_size}{hint}",
                             source=spec.name, field=field)


def _internvit_extras(v, b: int, tv: int) -> tuple[float, float]:
    """Per-token (kept activation bytes, element-wise traffic bytes) of InternViT's QK norm and layer scale:
    QK norm keeps q and k before the RMSNorm (2H) and two fp32 statistics; layer scale keeps both branch
    outputs (2H), which the scales' gradients need. Traffic: each op reads and writes its operands."""
    h = v.hidden
    act = (2 * b * h / tv + 8) * int(v.qk_norm) + 2 * b * h * int(v.layer_scale)
    mem = 4 * b * h / tv * int(v.qk_norm) + 4 * b * h * int(v.layer_scale)
    return act, mem


def layer_work(spec: ModelSpec, *, tp_size: int = 1, dtype: str = "bf16", tp_vision: bool = True) -> LayerWork:
    """FLOPs and bytes of every layer (see the module docstring for the formulas)."""
    if dtype not in DTYPE_BYTES:
        raise InputError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}", source="dtype",
                         field="dtype")
    check_tp(spec, tp_size, tp_vision=tp_vision)
    b = DTYPE_BYTES[dtype]
    kinds = {**_vision_kinds(spec, b, tp_size if tp_vision else 1), **_llm_kinds(spec, b, tp_size)}
    layers = spec.layers()
    trainable = np.array([not (spec.freeze_vision and layer.kind in ("vision_embed", "vision_block"))
                          for layer in layers])

    def stack(key: str) -> np.ndarray:
        return np.stack([kinds[layer.kind][key] for layer in layers])

    act = stack("act")
    ckpt = np.minimum(stack("ckpt"), act)  # checkpointing never keeps more than the layer itself
    sel = np.array([kinds[layer.kind].get("sel", kinds[layer.kind]["act"]) for layer in layers])
    sel = np.minimum(np.maximum(sel, ckpt), act)
    act[~trainable] = 0.0  # a frozen encoder runs without autograd
    ckpt[~trainable] = 0.0
    sel[~trainable] = 0.0
    return LayerWork(
        matmul_flops=stack("matmul"), attention_flops=stack("attention"), memory_bytes=stack("memory"),
        act_bytes=act, ckpt_bytes=ckpt, sel_act_bytes=sel, out_bytes=stack("out"),
        tp_allreduce_bytes=stack("ar_bytes"),
        tp_allreduce_count=np.array([kinds[layer.kind]["ar_count"] for layer in layers], dtype=np.float64),
        trainable=trainable,
    )


def _vision_kinds(spec: ModelSpec, b: int, tv: int) -> dict[str, dict]:
    """Per-kind work of the vision encoder's layers (patch embedding, blocks) with ``b`` bytes per value,
    split over ``tv`` tensor-parallel ranks."""
    v = spec.vision
    n, h, m = v.tokens_per_tile, v.hidden, v.mlp_hidden
    patches = v.patches_per_side**2
    pixels = 3 * v.image_size**2
    kinds: dict[str, dict] = {}
    kinds["vision_embed"] = dict(
        matmul=_vec(tiles=2 * patches * 3 * v.patch_size**2 * h),
        attention=_vec(),
        memory=_vec(tiles=b * (pixels + 3 * n * h)),  # read pixels; write, add position, copy out
        act=_vec(tiles=b * pixels),  # the conv weight gradient needs its input
        ckpt=_vec(tiles=b * pixels),
        out=_vec(tiles=b * n * h, tokens=META_BYTES_BEFORE_EMBED),
        ar_bytes=_vec(), ar_count=0,
    )
    extra_act, extra_mem = _internvit_extras(v, b, tv)
    extra_act += b * m / tv * int(v.mlp_act == "quick_gelu")  # the sigmoid beside the input
    kinds["vision_block"] = dict(
        matmul=_vec(tiles=2 * n * (4 * h * h + 2 * h * m) / tv),
        attention=_vec(tiles=4 * n * n * h / tv),
        memory=_vec(tiles=n * (b * (12 * h + 2 * m / tv) + extra_mem)),  # 2 norms, 2 residual adds; GELU
        act=_vec(tiles=n * (b * (4 * h + (4 * h + 2 * m) / tv) + 16 + 4 * v.num_heads / tv + extra_act)),
        # selective: the input, qkv, attention output (+ log-sum-exp), proj, fc1 and fc2 outputs
        sel=_vec(tiles=n * (b * (3 * h + (4 * h + m) / tv) + 4 * v.num_heads / tv)),
        ckpt=_vec(tiles=n * b * h),
        out=_vec(tiles=b * n * h, tokens=META_BYTES_BEFORE_EMBED),
        ar_bytes=_vec(tiles=4 * n * h * b) if tv > 1 else _vec(), ar_count=4 if tv > 1 else 0,
    )
    return kinds


def _llm_kinds(spec: ModelSpec, b: int, t: int) -> dict[str, dict]:
    """Per-kind work of the projector and the language model's layers (embedding, blocks, head) with ``b``
    bytes per value, split over ``t`` tensor-parallel ranks."""
    v, llm = spec.vision, spec.llm
    n, h = v.tokens_per_tile, v.hidden
    r, d_in = spec.llm_tokens_per_tile, spec.projector_in
    d, f = llm.hidden, llm.mlp_hidden
    dkv = llm.num_kv_heads * llm.head_dim
    vocab_t = llm.padded_vocab(t) // t  # vocabulary-parallel shard of the padded vocabulary
    kinds: dict[str, dict] = {}
    norm_in = d_in * int(spec.projector_norm)
    kinds["projector"] = dict(
        matmul=_vec(tiles=2 * r * (d_in * d + d * d) / t),
        attention=_vec(),
        memory=_vec(tiles=r * b * (2 * d_in + 2 * norm_in + 2 * d / t)),  # pixel shuffle copy, norm, GELU
        act=_vec(tiles=r * (b * (norm_in + d_in + 2 * d / t) + 8 * int(spec.projector_norm))),
        ckpt=_vec(tiles=b * n * h),
        out=_vec(tiles=b * r * d, tokens=META_BYTES_BEFORE_EMBED),
        ar_bytes=_vec(tiles=2 * r * d * b) if t > 1 else _vec(), ar_count=2 if t > 1 else 0,
    )
    kinds["llm_embed"] = dict(
        matmul=_vec(), attention=_vec(),
        memory=_vec(tokens=3 * d * b),  # gather rows, write, scatter image features into their slots
        act=_vec(tokens=8 + 1),  # token ids for the embedding gradient, image-slot mask
        ckpt=_vec(tokens=8 + 1),
        out=_vec(tokens=b * d + META_BYTES_AFTER_EMBED),
        ar_bytes=_vec(tokens=d * b) if t > 1 else _vec(), ar_count=1 if t > 1 else 0,
    )
    kinds["llm_block"] = dict(
        matmul=_vec(tokens=2 * (d * (d + 2 * dkv) + d * d + 3 * d * f) / t),
        attention=_vec(tokens_sq=2 * d / t),
        memory=_vec(tokens=b * (14 * d + 5 * f / t)),  # 2 norms, 2 residual adds, rotary, reshape; SwiGLU
        act=_vec(tokens=b * (4 * d + (2 * d + 2 * dkv + 4 * f) / t) + 8 + 4 * llm.num_heads / t
                 + 2 * 4 * d * int(llm.norm_fp32_copy and b < 4)),  # two norms' fp32 input copies
        # selective: the input, q, k, v, attention output (+ log-sum-exp), o, gate, up and down outputs
        sel=_vec(tokens=b * (3 * d + (2 * d + 2 * dkv + 2 * f) / t) + 4 * llm.num_heads / t),
        ckpt=_vec(tokens=b * d),
        out=_vec(tokens=b * d + META_BYTES_AFTER_EMBED),
        ar_bytes=_vec(tokens=4 * d * b) if t > 1 else _vec(), ar_count=4 if t > 1 else 0,
    )
    kinds["lm_head"] = dict(
        matmul=_vec(tokens=2 * d * vocab_t),
        attention=_vec(),
        memory=_vec(tokens=4 * d * b + 3 * 4 * vocab_t),  # final norm; fp32 log-softmax + loss over logits
        act=_vec(tokens=2 * d * b + 4 * vocab_t + 8),  # norm + head inputs, fp32 log-probs, labels
        ckpt=_vec(tokens=d * b + 8),
        out=_vec(one=4),  # the loss
        ar_bytes=_vec(tokens=8 + d * b) if t > 1 else _vec(), ar_count=3 if t > 1 else 0,
    )
    return kinds


def layer_param_bytes(spec: ModelSpec, *, tp_size: int = 1, dtype: str = "bf16", tp_vision: bool = True,
                      stack: StackConfig | str = "reference") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(param, grad, optim)`` bytes per layer per device under ``stack`` (see the module docstring)."""
    stack = FP32_STACK if DTYPE_BYTES.get(dtype) == 4 else get_stack(stack)
    check_tp(spec, tp_size, tp_vision=tp_vision)
    counts = layer_param_counts(spec).astype(np.float64)
    kinds = [layer.kind for layer in spec.layers()]
    # The patch embedding is replicated; vision blocks are split only with tp_vision; norms are ignored.
    split = np.array([1 if k == "vision_embed" or (k == "vision_block" and not tp_vision) else tp_size
                      for k in kinds], dtype=np.float64)
    counts = counts / split
    frozen = np.array([spec.freeze_vision and k in ("vision_embed", "vision_block") for k in kinds])
    grads = np.where(frozen, 0.0, counts * stack.grad_bytes)
    optim = np.where(frozen, 0.0, counts * stack.state_bytes)
    return counts * stack.weight_bytes, grads, optim


def analytic_cost_table(spec: ModelSpec, hardware: HardwareSpec, *, tp_size: int = 1, dtype: str = "bf16",
                        tp_vision: bool = True, stack: StackConfig | str = "reference") -> LayerCostTable:
    """The :class:`LayerCostTable` of ``spec`` on ``hardware`` with tensor parallelism ``tp_size``.

    ``tp_vision=False`` replicates the vision encoder on every tensor-parallel rank instead of splitting it
    (needed when its heads do not divide, e.g. InternViT-6B's 25 heads). ``stack``: the software stack
    whose weight, gradient and optimizer bytes per parameter the table carries (:mod:`omnibal.cost.stack`).
    """
    work = layer_work(spec, tp_size=tp_size, dtype=dtype, tp_vision=tp_vision)
    peak = hardware.peak_flops(dtype)
    rate_mm = peak * hardware.eff_matmul
    rate_attn = peak * hardware.eff_attention
    rate_mem = hardware.memory_bandwidth * hardware.eff_memory

    def pass_time(factor: dict[str, float]) -> np.ndarray:
        return (factor["matmul"] * work.matmul_flops / rate_mm + factor["attention"] * work.attention_flops / rate_attn
                + factor["memory"] * work.memory_bytes / rate_mem)

    fwd = pass_time({"matmul": 1.0, "attention": 1.0, "memory": 1.0})
    selective = np.isin([layer.kind for layer in spec.layers()], SELECTIVE_KINDS)
    sel_fwd = pass_time({"matmul": 0.0, "attention": 0.0, "memory": 1.0}) * selective[:, None]
    bwd = pass_time(BWD_FACTOR)
    fwd[:, ONE] += hardware.layer_overhead_s
    bwd[:, ONE] += 2 * hardware.layer_overhead_s
    bwd[~work.trainable] = 0.0
    tp_comm = None
    if tp_size > 1:
        bandwidth, latency = hardware.link(inter_node=tp_size > hardware.gpus_per_node)
        ring = 2.0 * (tp_size - 1) / tp_size
        tp_comm = ring * work.tp_allreduce_bytes / bandwidth
        tp_comm[:, ONE] += 2.0 * (tp_size - 1) * latency * work.tp_allreduce_count
    param, grad, optim = layer_param_bytes(spec, tp_size=tp_size, dtype=dtype, tp_vision=tp_vision, stack=stack)
    layers = spec.layers()
    return LayerCostTable(
        names=tuple(layer.name for layer in layers), kinds=tuple(layer.kind for layer in layers),
        fwd_time=fwd, bwd_time=bwd, act_bytes=work.act_bytes, ckpt_bytes=work.ckpt_bytes,
        sel_act_bytes=np.where(selective[:, None], work.sel_act_bytes, work.act_bytes), sel_fwd_time=sel_fwd,
        working_copies=get_stack(stack).working_copies and DTYPE_BYTES.get(dtype) != 4,
        out_bytes=work.out_bytes, param_bytes=param, grad_bytes=grad, optim_bytes=optim, tp_comm_time=tp_comm,
    )


def zero_sharded_bytes(table: LayerCostTable, *, dp_size: int, zero_stage: int = 1
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-device ``(param, grad, optim)`` bytes per layer under ZeRO ``zero_stage`` over ``dp_size`` ranks:
    stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters. A table
    whose weights and gradients are working copies of the sharded state (``working_copies``: FSDP) keeps none
    of them resident under ZeRO-3 (the layer being computed is the gathered working set,
    :func:`zero3_gather_reserve`) and both of them whole under ZeRO-2, beside the sharded state."""
    if not is_int(dp_size) or dp_size < 1:
        raise InputError(f"must be a positive integer, got {dp_size!r}", source="dp_size", field="dp_size")
    if zero_stage not in (0, 1, 2, 3):
        raise InputError(f"must be 0, 1, 2 or 3, got {zero_stage!r}", source="zero_stage", field="zero_stage")
    param, grad, optim = table.param_bytes, table.grad_bytes, table.optim_bytes
    if table.working_copies:  # the sharded state is optim; the copies are resident (ZeRO-2) or per layer (3)
        if zero_stage >= 3:
            return np.zeros_like(param), np.zeros_like(grad), optim / dp_size
        return param, grad, optim / dp_size
    return (param / dp_size if zero_stage >= 3 else param, grad / dp_size if zero_stage >= 2 else grad,
            optim / dp_size if zero_stage >= 1 else optim)


def zero3_active(zero_stage: int, dp_size: int) -> bool:
    """Whether weights are sharded and gathered layer by layer (ZeRO-3 over more than one rank)."""
    return zero_stage >= 3 and dp_size > 1


def _ring(nbytes: np.ndarray, dp_size: int, bandwidth: float, latency: float) -> np.ndarray:
    """Seconds of a ring all-gather / reduce-scatter of ``nbytes`` (per layer): ``(D - 1) / D`` of the bytes
    over ``bandwidth`` plus ``D - 1`` latencies; 0 for nothing to move."""
    nbytes = np.asarray(nbytes, np.float64)
    return np.where(nbytes > 0, (dp_size - 1) / dp_size * nbytes / bandwidth + (dp_size - 1) * latency, 0.0)


def zero3_layer_comm(table: LayerCostTable, *, zero_stage: int, dp_size: int, bandwidth: float, latency: float
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer ``(forward, backward)`` collective seconds of ZeRO-3 over ``dp_size`` ranks, per micro-batch
    (zeros unless :func:`zero3_active`): the forward all-gathers the layer's weights (``param_bytes``, as
    they are computed with); the backward phase (the recomputed forward when checkpointed, then the
    backward) gathers them once more, for layers that have a backward, and reduce-scatters the gradients of
    trainable layers in the same dtype (DeepSpeed's default communication dtype is the model's; FSDP2 reducing
    in fp32 moves twice that). How they overlap with compute: ``omnibal.sim.costs``."""
    if not zero3_active(zero_stage, dp_size):
        return np.zeros(table.num_layers), np.zeros(table.num_layers)
    gather = _ring(table.param_bytes, dp_size, bandwidth, latency)
    has_backward = np.any(np.asarray(table.bwd_time) > 0, axis=1)
    trainable = np.asarray(table.grad_bytes) > 0
    return gather, np.where(has_backward, gather, 0.0) + np.where(trainable, gather, 0.0)


def zero3_gather_reserve(table: LayerCostTable, *, zero_stage: int, dp_size: int) -> float:
    """Bytes ZeRO-3 holds beyond the shards on a device (0 unless :func:`zero3_active`): the layer being
    computed and the one prefetched (twice the largest layer's weights) and, in the backward, one layer's
    whole gradient before its reduce-scatter (the largest); a bound the planner and the simulator both use."""
    if not zero3_active(zero_stage, dp_size) or not table.num_layers:
        return 0.0
    return 2.0 * float(np.max(table.param_bytes)) + float(np.max(table.grad_bytes))


def forward_flops(spec: ModelSpec, tiles, tokens, tokens_sq, *, tp_size: int = 1) -> np.ndarray:
    """Forward FLOPs (GEMMs + attention) of the whole model per device for micro-batches with the given
    feature sums (arrays broadcast; ``tokens_sq`` = sum of squared attention-segment lengths)."""
    work = layer_work(spec, tp_size=tp_size)
    coef = (work.matmul_flops + work.attention_flops).sum(axis=0)
    tiles = np.asarray(tiles, dtype=np.float64)
    return coef[ONE] + coef[TILES] * tiles + coef[TOKENS] * np.asarray(tokens, np.float64) + \
        coef[TOKENS_SQ] * np.asarray(tokens_sq, np.float64)


def total_flops_per_sample(spec: ModelSpec, tiles, tokens, *, training: bool = True) -> np.ndarray:
    """FLOPs of whole samples with ``tiles`` tiles and ``tokens`` LLM tokens each (one attention segment
    per sample): forward, or training by default, counted as 3x forward (no recomputation) -- the convention
    of the 6 N rule. The time model charges the attention core's backward 2.5x instead of 2x."""
    tokens = np.asarray(tokens, dtype=np.float64)
    fwd = forward_flops(spec, tiles, tokens, tokens * tokens)
    return 3.0 * fwd if training else fwd
