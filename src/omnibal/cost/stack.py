"""Bytes per parameter a software stack keeps on each device: the static part of the memory model.

Mixed-precision Adam keeps bf16 weights, a gradient buffer and fp32 optimizer state, but stacks differ in
which of them exist, in what precision, and which are sharded over data parallelism. A stack is three
numbers per parameter (before sharding; ``zero_sharded_bytes`` divides them by the job's ZeRO stage):

* ``weight_bytes``: the weights the forward and backward read (replicated on every DP rank);
* ``grad_bytes``: the gradient buffer that accumulates over the step's micro-batches (replicated under
  ZeRO-1, as every stack here keeps it through the step); the DP gradient all-reduce moves these bytes;
* ``state_bytes``: what the optimizer step owns (sharded over DP under ZeRO-1).

The stacks (``--stack``):

* ``megatron-deepspeed`` (the paper's, the default): bf16 weights (2) and an **fp32 gradient buffer** (4):
  Megatron's ``main_grad`` with ``accumulate_allreduce_grads_in_fp32`` / ``grad_reduce_in_fp32``, and
  DeepSpeed's ``BF16_Optimizer``, which allocates ``fp32_groups_gradients_flat`` as ``zeros_like`` the
  whole (unsharded) bf16 parameter group (``deepspeed/runtime/bf16_optimizer.py``); fp32 master weights and
  two Adam moments (12) sharded by the distributed optimizer / ZeRO-1: ``6 + 12 / DP``.
* ``reference`` (omnibal's reference trainer): bf16 weights and bf16 gradients (2 + 2), fp32 master + Adam
  (12) sharded: ``4 + 12 / DP``.
* ``fsdp`` (FSDP2 as torchtitan configures it: bf16 compute, fp32 reduce): the sharded fp32 parameters, fp32
  gradients and Adam moments (4 + 4 + 8 = 16, ``state_bytes``) and unsharded working copies of the first
  two: bf16 weights (2) and the gradient accumulated in the fp32 reduce dtype (4). With parameters kept
  unsharded between micro-batches (ZeRO-2, ``reshard_after_forward="never"``) the copies stay: ``6 + 16 / DP``.
  Under ZeRO-3 (``"always"``) they exist only for the layer being computed (the gathered working set the
  memory model adds once per device, ``zero3_gather_reserve``): ``16 / DP``, with gradients reduce-scattered
  after each backward. FSDP has no ZeRO-0/1 form: other ZeRO stages are refused.

fp32 training (``dtype="fp32"``) has no separate master copy: weights 4, gradients 4, Adam moments 8 in
every stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnibal.errors import InputError


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    """Bytes per parameter a training stack keeps on a device, before ZeRO sharding."""

    name: str
    """Stack name (``--stack``)."""
    weight_bytes: float
    """Weights read by forward and backward (bf16: 2)."""
    grad_bytes: float
    """Gradient buffer accumulated over the step (bf16: 2, fp32: 4); ZeRO-2 shards it."""
    state_bytes: float
    """Optimizer-owned state: fp32 master weights and Adam moments (12), plus any sharded fp32 gradient;
    ZeRO-1 shards it."""
    working_copies: bool = False
    """Whether the weights and the gradient buffer are unsharded working copies of state kept sharded in
    ``state_bytes`` (FSDP): ZeRO-3 then holds them per layer only, instead of sharding them a second time."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages the stack exists in."""

    def __post_init__(self) -> None:
        for name in ("weight_bytes", "grad_bytes", "state_bytes"):
            value = getattr(self, name)
            if not value >= 0:
                raise InputError(f"must be >= 0, got {value!r}", source=f"stack {self.name}", field=name)


STACKS: dict[str, StackConfig] = {
    "megatron-deepspeed": StackConfig(name="megatron-deepspeed", weight_bytes=2, grad_bytes=4, state_bytes=12),
    "reference": StackConfig(name="reference", weight_bytes=2, grad_bytes=2, state_bytes=12),
    "fsdp": StackConfig(name="fsdp", weight_bytes=2, grad_bytes=4, state_bytes=16, working_copies=True,
                        zero_stages=(2, 3)),
}
"""The stacks ``--stack`` names (see the module docstring for each one's source)."""
DEFAULT_STACK = "megatron-deepspeed"
"""The paper's stack (OmniBal ran on Megatron-DeepSpeed)."""
FP32_STACK = StackConfig(name="fp32", weight_bytes=4, grad_bytes=4, state_bytes=8)
"""fp32 training: no separate master copy."""


def get_stack(name: str | StackConfig) -> StackConfig:
    """The stack called ``name`` (a StackConfig passes through); an unknown name is an InputError."""
    if isinstance(name, StackConfig):
        return name
    try:
        return STACKS[name]
    except (KeyError, TypeError):
        raise InputError(f"unknown stack {name!r}; choose one of {', '.join(STACKS)}", source="--stack",
                         field="stack") from None


def check_stack_zero(stack: str | StackConfig, zero_stage: int) -> None:
    """InputError naming both flags when ``stack`` has no form at ``zero_stage``."""
    config = get_stack(stack)
    if zero_stage not in config.zero_stages:
        raise InputError(f"the {config.name} stack has no ZeRO-{zero_stage} form; use --zero-stage "
                         f"{' or '.join(map(str, config.zero_stages))}", source="--stack", field="zero_stage")
