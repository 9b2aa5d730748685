"""Ulysses sequence parallelism inside a pipeline stage (SP x PP x DP).

The SP group of stage ``s`` for degree ``d`` is the ``d`` ranks with pipeline rank ``s`` whose DP ranks are
one group of ``d`` consecutive DP ranks (they hold the same micro-batches). Every rank of the group runs the
same pipeline schedule on its share of each pack, so the stage-to-stage activations are shards with fixed
shapes (the pipeline's receive buffers are sized once): for a fixed buffer of ``(Q_v, Q_t)`` tiles and
tokens,

- before ``llm.embed`` a boundary carries this rank's tile chunk, ``ceil(Q_v/d)`` tile slots (the active
  chunk is ``ceil(n_tiles/d)`` tiles of the pack, padded), with the pack's whole ``token_meta`` and its
  ``sizes`` unchanged (the stage that shards the tokens needs the pack's counts);
- the stage holding ``llm.embed`` all-gathers the image features of the group (as
  :class:`omnibal.train.sp.SequenceParallelStage` at pp = 1) and keeps tokens
  ``[j*m, (j+1)*m)``, ``m = ceil(n_tokens/d)``, of the pack padded to ``d*m`` (ignored tokens of a segment
  of their own), in ``ceil(Q_t/d)`` token slots; ``sizes`` says ``m`` active tokens;
- after it, a boundary carries that token shard; each LLM block's attention exchanges heads for tokens
  (:class:`omnibal.train.sp.UlyssesAttention`), gathering the pack's segment ids from the group's shards at
  every call, because a 1F1B schedule runs later micro-batches' forwards before an earlier one's recomputed
  blocks re-run in its backward.

Each degree's wrapper has its own boundary shapes, so the runner keeps one pipeline (stage, schedule) per
(micro-batch count, degree) (:class:`omnibal.train.pipeline.StageRunner`); all wrap the one stage module.
"""

from __future__ import annotations

import torch
from torch import nn

from omnibal.data.collate import SIZE_TILES, SIZE_TOKENS
from omnibal.errors import InputError
from omnibal.train.sp import SequenceParallel, UlyssesAttention, _GatherChunks, check_sp_run, pad_tokens
from omnibal.train.stage import example_carry


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _fixed_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` [1, r, ...] padded with zero rows to ``rows`` (dim 1)."""
    if x.shape[1] == rows:
        return x
    return torch.cat([x, x.new_zeros(1, rows - x.shape[1], *x.shape[2:])], dim=1)


class PipelineSPStage(nn.Module):
    """One pipeline stage's layers run on group rank ``index``'s share of every pack (module docstring).
    ``split``: the chain index of ``llm.embed``; ``tiles``/``tokens``: the pipeline's fixed buffer."""

    def __init__(self, stage: nn.Module, *, group, degree: int, index: int, split: int, tiles: int,
                 tokens: int) -> None:
        super().__init__()
        self.stage = stage
        self.group, self.degree, self.index, self.split = group, degree, index, split
        self.exchange = UlyssesAttention(group, degree, gather_segments=True)
        self.tile_slots, self.token_slots = _ceil(tiles, degree), _ceil(tokens, degree)
        self._vision = min(max(split - stage.start, 0), len(stage.layer_names))
        """Local index of the first LLM layer (the stage's vision layers come before it)."""

    def forward(self, act: torch.Tensor, token_meta: torch.Tensor, sizes: torch.Tensor):
        d, j, stage = self.degree, self.index, self.stage
        n_layers = len(stage.layer_names)
        if stage.start > self.split:  # a token shard comes in
            return stage.run_layers(0, n_layers, act, token_meta, sizes)
        n_tiles, n_tokens = int(sizes[0, SIZE_TILES]), int(sizes[0, SIZE_TOKENS])
        per_tile = max(1, _ceil(n_tiles, d))
        lo, hi = min(j * per_tile, n_tiles), min((j + 1) * per_tile, n_tiles)
        if stage.start == 0:  # the whole pack's pixels: keep this rank's chunk
            act = _fixed_rows(act[:, lo:hi], self.tile_slots)
        if self._vision:
            tile_sizes = torch.tensor([[hi - lo, 0]], dtype=sizes.dtype, device=sizes.device)
            act = stage.run_layers(0, self._vision, act, token_meta, tile_sizes)[0]
        if self._vision == n_layers:  # a vision-only stage: the pack's meta and sizes travel on unchanged
            return act, token_meta, sizes
        features = _GatherChunks.apply(act[0, :per_tile], self.group, j, d).unsqueeze(0)  # tile t at row t
        per_token = max(1, _ceil(n_tokens, d))
        meta = pad_tokens(token_meta[:, :, :n_tokens], per_token * d)
        local = pad_tokens(meta[:, :, j * per_token:(j + 1) * per_token].contiguous(), self.token_slots)
        token_sizes = torch.tensor([[n_tiles, per_token]], dtype=sizes.dtype, device=sizes.device)
        return stage.run_layers(self._vision, n_layers, features, local, token_sizes)


def sp_example_carries(model, start: int, end: int, *, split: int, degree: int, tiles: int, tokens: int,
                       dtype: torch.dtype, device) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(inputs, outputs) example carries of stage ``[start, end)`` run by :class:`PipelineSPStage` at
    ``degree`` on a ``(tiles, tokens)`` buffer: the whole pack at layer 0, tile chunks up to ``llm.embed``,
    token shards after it."""

    def at(boundary: int):
        if boundary == 0:
            num_tiles, num_tokens = tiles, tokens
        elif boundary <= split:
            num_tiles, num_tokens = _ceil(tiles, degree), tokens
        else:
            num_tiles, num_tokens = tiles, _ceil(tokens, degree)
        return example_carry(model, boundary, num_tiles=num_tiles, num_tokens=num_tokens, dtype=dtype,
                             device=device)

    return at(start), at(end)


def build_sp(model, stage: nn.Module, *, world, runner, step_sp, mode: str, dp_sync: str, buffer,
             dtype: torch.dtype):
    """The :class:`omnibal.train.sp.SequenceParallel` of a run whose steps use the SP degrees ``step_sp``
    (None when every step is 1), built on every rank; with a pipeline, every degree's wrapper is registered
    with ``runner`` as the variant of that degree (:meth:`omnibal.train.pipeline.StageRunner.add_variant`)."""
    if int(max(step_sp, default=1)) <= 1:
        return None
    names = [layer.name for layer, _ in model.chain()]
    check_sp_run(names, mode=mode, dp_sync=dp_sync)
    if isinstance(stage, nn.ModuleList):  # an interleaved rank's chunks
        raise InputError("sequence parallelism runs one layer range per pipeline stage, not interleaved chunks; "
                         "plan with --chunks 1", source="--sp-degree", field="num_chunks")
    split = names.index("llm.embed")
    wrap = None
    if world.pp_size > 1:
        def wrap(stage, **group):
            return PipelineSPStage(stage, split=split, tiles=buffer.tiles, tokens=buffer.tokens, **group)

    sp = SequenceParallel(stage, world=world, degrees={int(d) for d in step_sp}, num_heads=model.spec.llm.num_heads,
                          wrap=wrap)
    if world.pp_size > 1:
        for degree, module in sp.modules.items():
            if degree > 1:
                inputs, outputs = sp_example_carries(model, stage.start, stage.end, split=split, degree=degree,
                                                     tiles=buffer.tiles, tokens=buffer.tokens, dtype=dtype,
                                                     device=world.device)
                runner.add_variant(degree, module, inputs, outputs)
    return sp
