"""The contract between the cost model and everything that uses it (balancer, planner, simulator).

Every per-layer cost of one micro-batch (time, activation memory, bytes crossing a stage boundary) is
linear in four features of the micro-batch:

    one         1 (fixed per-micro-batch overhead: kernel launches, norms of tiny tensors)
    tiles       vision tiles in the micro-batch (each tile is a fixed-length ViT sequence)
    tokens      LLM tokens in the micro-batch (padded tokens count when the batch is padded)
    tokens_sq   sum over the micro-batch's attention segments of length**2 (causal attention cost;
                varlen packing: sum of t_i**2 per sample; padding to t_max: B * t_max**2)

so a whole epoch of micro-batches is costed by one matrix product: ``features @ coef.T``. The analytic
model (FLOPs / achievable rate) and the measured profiles (fitted per layer kind) both produce a
:class:`LayerCostTable`; consumers never care which.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FEATURES: tuple[str, ...] = ("one", "tiles", "tokens", "tokens_sq")
NUM_FEATURES = len(FEATURES)


def microbatch_features(tiles, tokens, tokens_sq) -> np.ndarray:
    """Stack per-micro-batch sums into an ``[N, 4]`` float64 feature matrix (any array shape works:
    the result has shape ``tiles.shape + (4,)``)."""
    tiles = np.asarray(tiles, dtype=np.float64)
    return np.stack(
        [np.ones_like(tiles), tiles, np.asarray(tokens, np.float64), np.asarray(tokens_sq, np.float64)],
        axis=-1,
    )


RECOMPUTE_NONE, RECOMPUTE_FULL, RECOMPUTE_SELECTIVE = 0, 1, 2
"""Per-layer recompute codes of a recompute mask: a bool mask (full where true) reads the same."""
RECOMPUTE_NAMES = {RECOMPUTE_NONE: "none", RECOMPUTE_FULL: "full", RECOMPUTE_SELECTIVE: "selective"}


def recompute_codes(mask) -> np.ndarray:
    """A recompute mask as ``int8`` codes (:data:`RECOMPUTE_NONE`, :data:`RECOMPUTE_FULL`,
    :data:`RECOMPUTE_SELECTIVE`); a bool mask means full recompute where true."""
    codes = np.asarray(mask)
    codes = codes.astype(np.int8) if codes.dtype == bool else codes.astype(np.int8, copy=False)
    assert ((codes >= 0) & (codes <= RECOMPUTE_SELECTIVE)).all(), "recompute codes are 0, 1 or 2"
    return codes


def pack_features(tiles: np.ndarray, tokens: np.ndarray, pack_offsets: np.ndarray) -> np.ndarray:
    """Features of packs given in CSR form: pack ``k`` holds samples ``order[pack_offsets[k]:pack_offsets[k+1]]``
    and ``tiles``/``tokens`` are already gathered in that order. Varlen attention (sum of squares)."""
    offsets = np.asarray(pack_offsets, dtype=np.int64)
    starts = offsets[:-1]
    # A trailing zero lets reduceat take a start equal to the data length (an empty last pack).
    t = np.append(np.asarray(tokens, dtype=np.float64), 0.0)
    v = np.append(np.asarray(tiles, dtype=np.float64), 0.0)
    if len(starts) == 0:
        return np.zeros((0, NUM_FEATURES))
    out = microbatch_features(
        np.add.reduceat(v, starts), np.add.reduceat(t, starts), np.add.reduceat(t * t, starts)
    )
    out[np.diff(offsets) == 0, 1:] = 0.0  # reduceat yields the element at the start for empty segments
    return out


def csr_features(tiles: np.ndarray, tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Varlen features of CSR packs; like :func:`pack_features` but safe for empty packs anywhere
    (``np.add.reduceat`` rejects an empty pack at the end)."""
    sizes = np.diff(offsets)
    if len(tiles) == 0 or not (sizes == 0).any():
        return pack_features(tiles, tokens, offsets)
    label = np.repeat(np.arange(len(sizes)), sizes)
    num = len(sizes)
    return microbatch_features(np.bincount(label, tiles, num), np.bincount(label, tokens, num),
                               np.bincount(label, tokens * tokens, num))


def segment_max(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Max of each CSR segment (0 for empty ones)."""
    out = np.zeros(len(offsets) - 1)
    sizes = np.diff(offsets)
    nonempty = sizes > 0
    if len(values):
        out[nonempty] = np.maximum.reduceat(values, offsets[:-1][nonempty])
    return out


@dataclass(frozen=True, eq=False)
class LayerCostTable:
    """Per-layer cost coefficients for one model on one device type (after the tensor-parallel split).

    Arrays with a trailing axis of 4 are coefficients over ``FEATURES``: ``value = coef @ features``.
    Times are seconds, memory is bytes, all per device.
    """

    names: tuple[str, ...]
    """Module names of the layer chain (``ModelSpec.layers()``)."""
    kinds: tuple[str, ...]
    """Layer kinds, parallel to ``names``."""
    fwd_time: np.ndarray
    """``[L, 4]`` forward time."""
    bwd_time: np.ndarray
    """``[L, 4]`` backward time (input and weight gradients; recomputation not included)."""
    act_bytes: np.ndarray
    """``[L, 4]`` activation bytes a layer keeps for its backward when it is not checkpointed."""
    ckpt_bytes: np.ndarray
    """``[L, 4]`` bytes it keeps when checkpointed (its input; the rest is recomputed)."""
    out_bytes: np.ndarray
    """``[L, 4]`` bytes of its output (what crosses a pipeline boundary placed after it)."""
    param_bytes: np.ndarray
    """``[L]`` parameter bytes (training dtype)."""
    grad_bytes: np.ndarray
    """``[L]`` gradient bytes (0 for frozen layers)."""
    optim_bytes: np.ndarray
    """``[L]`` optimizer-state bytes before ZeRO sharding (fp32 master + Adam moments; 0 when frozen)."""
    tp_comm_time: np.ndarray | None = None
    """``[L, 4]`` tensor-parallel collective time inside the layer (forward + backward); None when TP = 1."""
    sel_act_bytes: np.ndarray | None = None
    """``[L, 4]`` bytes it keeps under selective recompute (inputs and matrix-product / attention outputs;
    :data:`omnibal.cost.analytic.SELECTIVE_KINDS`); None: ``act_bytes`` (selective frees nothing)."""
    sel_fwd_time: np.ndarray | None = None
    """``[L, 4]`` time of the element-wise forward ops selective recompute runs again; None: zeros."""
    working_copies: bool = False
    """Whether ``param_bytes`` and ``grad_bytes`` are unsharded working copies of state that ``optim_bytes``
    keeps sharded (the ``fsdp`` stack, :mod:`omnibal.cost.stack`): ZeRO-3 holds them per layer only."""

    def __post_init__(self) -> None:
        num_layers = len(self.names)
        assert len(self.kinds) == num_layers
        if self.sel_act_bytes is None:
            object.__setattr__(self, "sel_act_bytes", self.act_bytes)
        if self.sel_fwd_time is None:
            object.__setattr__(self, "sel_fwd_time", np.zeros((num_layers, NUM_FEATURES)))
        for name in ("fwd_time", "bwd_time", "act_bytes", "ckpt_bytes", "out_bytes", "sel_act_bytes", "sel_fwd_time"):
            arr = np.asarray(getattr(self, name), dtype=np.float64)
            assert arr.shape == (num_layers, NUM_FEATURES), (name, arr.shape)
            object.__setattr__(self, name, arr)
        for name in ("param_bytes", "grad_bytes", "optim_bytes"):
            arr = np.asarray(getattr(self, name), dtype=np.float64)
            assert arr.shape == (num_layers,), (name, arr.shape)
            object.__setattr__(self, name, arr)
        if self.tp_comm_time is not None:
            arr = np.asarray(self.tp_comm_time, dtype=np.float64)
            assert arr.shape == (num_layers, NUM_FEATURES)
            object.__setattr__(self, "tp_comm_time", arr)

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def evaluate(self, name: str, features: np.ndarray) -> np.ndarray:
        """``features [..., 4]`` -> ``[..., L]`` values of coefficient array ``name``."""
        return np.asarray(features, dtype=np.float64) @ getattr(self, name).T
