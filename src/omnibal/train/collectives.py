"""The trainer's collectives over the whole world, each turning a backend failure (a peer died, a timeout)
into a :class:`~omnibal.errors.PeerFailure` naming this rank and what it was doing; a one-rank world runs
none of them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from omnibal.train.distributed import World, is_comm_error, peer_failure


def all_reduce(world: World, tensor: torch.Tensor, what: str) -> None:
    """Sum ``tensor`` over every rank, in place."""
    if world.world_size > 1:
        _call(world, what, dist.all_reduce, tensor)


def all_gather(world: World, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), in rank order, on every rank."""
    if world.world_size == 1:
        return [tensor]
    out = [torch.zeros_like(tensor) for _ in range(world.world_size)]
    _call(world, what, dist.all_gather, out, tensor)
    return out


def gather_objects(world: World, obj: Any, what: str) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if world.world_size == 1:
        return [obj]
    out: list = [None] * world.world_size
    _call(world, what, dist.all_gather_object, out, obj)
    return out


def broadcast_object(world: World, obj: Any, what: str) -> Any:
    """Global rank 0's ``obj`` on every rank."""
    if world.world_size == 1:
        return obj
    box = [obj]
    _call(world, what, dist.broadcast_object_list, box, src=0)
    return box[0]


def barrier(world: World, what: str) -> None:
    """Wait until every rank is here."""
    if world.world_size > 1:
        _call(world, what, dist.barrier)


def _call(world: World, what: str, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        if is_comm_error(exc):
            raise peer_failure(world, what, exc) from exc
        raise
