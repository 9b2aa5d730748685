"""All-to-all of variable-size chunks over a DP group: flat, or two-level (node-wise, as OrchMLLM's).

Every rank knows the whole ``[D, D]`` split matrix (``splits[s, d]``: elements rank ``s`` sends rank ``d``),
as the online dispatch computes it identically on every rank. A rank's input holds its chunks in
destination order; its output holds what it receives in source order.

The **two-level** exchange groups the DP ranks into nodes of ``node_size`` consecutive ranks (rank
``r = node * S + local``) and replaces one all-to-all among all ``D`` ranks by two among fewer:

1. **intra-node**: each rank sends a node peer with local index ``l`` every chunk bound for local index
   ``l`` on any node (fast links, ``S`` ranks);
2. **inter-node**: each rank sends the rank with its own local index on node ``m`` every chunk (of all its
   node's sources) bound for it (slow links, ``D / S`` ranks; each pair of nodes exchanges ``S`` larger
   messages instead of ``S x S`` small ones).

Both move exactly the flat exchange's data; only the route differs. A split matrix with nothing off its
diagonal makes no collective at all. :class:`Exchange` is differentiable:
its backward sends the gradients back along the transposed splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from omnibal.errors import InputError


@dataclass(frozen=True, kw_only=True)
class AllToAllGroups:
    """The communicators one rank exchanges on (built on every rank by :func:`all_to_all_groups`)."""

    dp_rank: int
    """This rank's index in its DP group."""
    dp_size: int
    """Ranks in the DP group."""
    group: dist.ProcessGroup | None
    """The DP group itself (the flat exchange)."""
    node_size: int = 0
    """Consecutive DP ranks per node; 0: flat, no node level."""
    intra: dist.ProcessGroup | None = None
    """Group of this rank's node (two-level only)."""
    inter: dist.ProcessGroup | None = None
    """Group of the ranks with this rank's local index on every node (two-level only)."""

    @property
    def two_level(self) -> bool:
        return self.node_size > 0


def check_node_size(node_size: int, dp_size: int) -> None:
    """``node_size`` must be 0 (flat) or divide ``dp_size``."""
    if node_size < 0 or (node_size and dp_size % node_size):
        raise InputError(f"node_size {node_size} must be 0 (flat all-to-all) or divide dp_size {dp_size}",
                         source="node_size", field="node_size")


def all_to_all_groups(*, dp_rank: int, dp_size: int, dp_group, global_ranks, node_size: int = 0) -> AllToAllGroups:
    """This rank's communicators. ``global_ranks[g]``: the global ranks of DP group ``g`` in DP order, for
    every DP group of the world (``new_group`` is collective: every rank creates every group, in one order);
    this rank's DP group is the one that holds it."""
    check_node_size(node_size, dp_size)
    if not node_size or dp_size == 1:
        return AllToAllGroups(dp_rank=dp_rank, dp_size=dp_size, group=dp_group)
    me = dist.get_rank()
    nodes = dp_size // node_size
    intra = inter = None
    for ranks in global_ranks:
        ranks = list(ranks)
        for n in range(nodes):
            g = dist.new_group(ranks[n * node_size:(n + 1) * node_size])
            intra = g if me in ranks[n * node_size:(n + 1) * node_size] else intra
        for local in range(node_size):
            g = dist.new_group(ranks[local::node_size])
            inter = g if me in ranks[local::node_size] else inter
    return AllToAllGroups(dp_rank=dp_rank, dp_size=dp_size, group=dp_group, node_size=node_size, intra=intra,
                          inter=inter)


def exchange_raw(x: torch.Tensor, splits: np.ndarray, groups: AllToAllGroups) -> torch.Tensor:
    """The all-to-all of ``x`` (this rank's chunks, destination order) along ``splits`` (not differentiable)."""
    splits = np.asarray(splits, np.int64)
    if not (splits - np.diag(np.diag(splits))).any():  # every chunk stays home (every rank sees the same)
        return x
    if groups.two_level:
        return _two_level(x, splits, groups)
    me = groups.dp_rank
    return _a2a(x, splits[me].tolist(), splits[:, me].tolist(), groups.group)


class Exchange(torch.autograd.Function):
    """Differentiable :func:`exchange_raw`; the backward returns the gradients along ``splits.T``."""

    @staticmethod
    def forward(ctx, x, splits, groups):  # type: ignore[override]
        ctx.splits, ctx.groups = splits, groups
        return exchange_raw(x, splits, groups)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return exchange_raw(grad, np.asarray(ctx.splits).T, ctx.groups), None, None


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(recv))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def _reorder(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """``x`` cut into chunks of ``sizes``, concatenated again in ``order``."""
    parts = torch.split(x, sizes)
    return torch.cat([parts[i] for i in order]) if order else x[:0]


def _two_level(x: torch.Tensor, splits: np.ndarray, g: AllToAllGroups) -> torch.Tensor:
    """The node-wise route (module docstring). Chunk ``(s, d)`` is ``splits[s, d]`` elements."""
    s_n, dp = g.node_size, g.dp_size
    nodes, me = dp // s_n, g.dp_rank
    node, local = divmod(me, s_n)
    rank = np.arange(dp).reshape(nodes, s_n)  # rank[n, l] = n * S + l

    # 1. intra-node: my chunks regrouped by destination local index, then destination node
    order1 = [int(rank[m, lp]) for lp in range(s_n) for m in range(nodes)]
    sent1 = _reorder(x, splits[me].tolist(), order1)
    send1 = [int(splits[me, rank[:, lp]].sum()) for lp in range(s_n)]
    recv1 = [int(splits[rank[node, lp], rank[:, local]].sum()) for lp in range(s_n)]
    got1 = _a2a(sent1, send1, recv1, g.intra) if s_n > 1 else sent1
    # got1: by source local index l, then destination node m: chunk (rank[node, l] -> rank[m, local])
    sizes1 = [int(splits[rank[node, lp], rank[m, local]]) for lp in range(s_n) for m in range(nodes)]
    order2 = [lp * nodes + m for m in range(nodes) for lp in range(s_n)]
    sent2 = _reorder(got1, sizes1, order2)

    # 2. inter-node: to node m, every chunk of my node's sources bound for rank[m, local]
    send2 = [int(splits[rank[node], rank[m, local]].sum()) for m in range(nodes)]
    recv2 = [int(splits[rank[m], me].sum()) for m in range(nodes)]
    # arrives by source node, then source local index = source rank order
    return _a2a(sent2, send2, recv2, g.inter) if nodes > 1 else sent2
