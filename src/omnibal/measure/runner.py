"""Runs one real layer of the reference model (:mod:`omnibal.train.layers`) on a synthetic micro-batch:
builds the module and its input carry for a shape, times forward and backward, and measures the bytes
autograd saves for backward (:mod:`omnibal.measure.profile` drives it, :mod:`omnibal.cost.profile` fits the
results)."""

from __future__ import annotations

import statistics
import time as _time
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from omnibal.cost.spec import ModelSpec
from omnibal.data import collate as C
from omnibal.train import layers as L
from omnibal.train.recompute import is_saved_op, run_layer


class LayerRunner:
    """Builds one real layer of a kind and the carry for a shape; times forward/backward.

    The layer is the reference model's (:mod:`omnibal.train.layers`, built from ``spec``), or with ``chain``
    (``model.chain()`` of any omnibal chain, e.g. a Hugging Face model wrapped by
    :mod:`omnibal.train.hf_adapter`) the chain's first layer of that kind, moved to the device and dtype.
    ``granularity``: how every forward recomputes in the backward, as the trainer runs it
    (:mod:`omnibal.train.recompute`: ``none``, ``selective`` or ``full``). ``autocast``: the layer keeps fp32
    weights and fp32 inputs and its forward runs under ``torch.autocast`` to ``dtype`` (the trainer's
    ``--precision bf16-mixed``); otherwise weights and inputs are in ``dtype``."""

    def __init__(self, spec: ModelSpec, *, device: str, dtype: str, seed: int = 0, chain=None,
                 granularity: str = "none", autocast: bool = False) -> None:
        self.torch = torch
        self.L = L
        self.spec = spec
        self.device = torch.device(device)
        self.compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        self.autocast = autocast and self.compute_dtype != torch.float32
        self.dtype = torch.float32 if self.autocast else self.compute_dtype
        """Dtype of the weights and of the input carry."""
        self.opts = L.Options(attn_impl="auto", compute_tail=False)
        self.seed = seed
        self.is_cuda = self.device.type == "cuda"
        self.chain = chain
        self.granularity = granularity
        self._modules: dict[str, Any] = {}

    def module(self, kind: str):
        if kind not in self._modules and self.chain is not None:
            mod = next((m for layer, m in self.chain if layer.kind == kind), None)
            if mod is None:
                raise ValueError(f"the chain has no layer of kind {kind!r}")
            self._modules[kind] = mod.to(device=self.device, dtype=self.dtype)
        if kind not in self._modules:
            cls = {"vision_embed": self.L.VisionEmbed, "vision_block": self.L.VisionBlock,
                   "projector": self.L.Projector, "llm_embed": self.L.LLMEmbed, "llm_block": self.L.LLMBlock,
                   "lm_head": self.L.LMHead}[kind]
            mod = cls(self.spec, self.opts)
            self.L.init_parameters(mod, self.seed)
            mod.to(device=self.device, dtype=self.dtype)
            if self.spec.freeze_vision and kind in ("vision_embed", "vision_block"):
                mod.requires_grad_(False)
            self._modules[kind] = mod
        return self._modules[kind]

    def carry(self, kind: str, tiles: int, lengths: list[int]):
        """Inputs of one layer of ``kind`` for a micro-batch of ``tiles`` tiles and LLM attention segments
        of the given ``lengths`` (the packed samples)."""
        torch, spec = self.torch, self.spec
        dev, dt = self.device, self.dtype
        gen = torch.Generator().manual_seed(1234)
        v = spec.vision
        tokens = int(sum(lengths))
        sizes = torch.tensor([[tiles, tokens]], dtype=torch.int64, device=dev)
        needs_grad = not (spec.freeze_vision and kind in ("vision_embed", "vision_block"))
        meta = torch.zeros(1, C.NUM_META_ROWS, max(tokens, 1), dtype=torch.int64)
        if tokens:
            meta[0, C.META_POSITION_IDS] = torch.cat([torch.arange(n) for n in lengths])
            meta[0, C.META_SEGMENT_IDS] = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
            meta[0, C.META_INPUT_IDS] = torch.randint(0, spec.llm.vocab_size - 1, (tokens,), generator=gen)
            meta[0, C.META_LABELS] = torch.randint(0, spec.llm.vocab_size - 1, (tokens,), generator=gen)
            meta[0, C.META_IMAGE_INDEX] = -1
            image_slots = min(tokens, tiles * spec.llm_tokens_per_tile) if kind == "llm_embed" else 0
            meta[0, C.META_IMAGE_INDEX, :image_slots] = torch.arange(image_slots)
        meta = meta.to(dev)
        if kind == "vision_embed":
            x = torch.randn(1, tiles, 3, v.image_size, v.image_size, generator=gen).to(dev, dt)
        elif kind in ("vision_block", "projector"):
            x = torch.randn(1, tiles, v.tokens_per_tile, v.hidden, generator=gen).to(dev, dt)
            x.requires_grad_(needs_grad)
        elif kind == "llm_embed":
            x = torch.randn(1, tiles, spec.llm_tokens_per_tile, spec.llm.hidden, generator=gen).to(dev, dt)
            x.requires_grad_(True)
        else:
            x = torch.randn(1, tokens, spec.llm.hidden, generator=gen).to(dev, dt).requires_grad_(True)
        return x, meta, sizes

    def _sync(self) -> None:
        if self.is_cuda:
            self.torch.cuda.synchronize(self.device)

    def _forward_backward(self, kind: str, carry, clock: Callable[[], Any] | None):
        """Forward then backward; returns (t0, t1, t2) marks of ``clock`` (None: untimed)."""
        torch = self.torch
        t0 = clock() if clock else None
        out = self.forward(kind, carry)
        t1 = clock() if clock else None
        if kind == "lm_head":
            target, grad = out[0], None
        else:
            target = out[0]
            grad = torch.ones_like(target) if target.requires_grad else None
        if target.requires_grad:
            torch.autograd.backward(target, grad)
        t2 = clock() if clock else None
        return t0, t1, t2

    def forward(self, kind: str, carry):
        """The layer's forward on ``carry``, recomputed at the runner's granularity."""
        mod = self.module(kind)
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast):
            return run_layer(mod, carry, self.granularity)

    def time(self, kind: str, carry, *, warmup: int, repeats: int) -> dict[str, float]:
        """Forward and backward seconds: median and minimum of the wall clock (CUDA events on a GPU), and on a
        CPU the median and minimum process CPU time (``cpu``, ``cpu_min``: unaffected by other jobs taking the
        cores away)."""
        torch = self.torch
        for _ in range(warmup):
            self._forward_backward(kind, carry, None)
        self._sync()
        fwd, bwd, fwd_cpu, bwd_cpu = [], [], [], []

        def both_clocks():
            return _time.perf_counter(), _time.process_time()

        for _ in range(repeats):
            if self.is_cuda:
                events = []

                def clock(events=events):
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                    events.append(ev)
                    return ev

                self._forward_backward(kind, carry, clock)
                self._sync()
                fwd.append(events[0].elapsed_time(events[1]) / 1e3)
                bwd.append(events[1].elapsed_time(events[2]) / 1e3)
            else:
                t0, t1, t2 = self._forward_backward(kind, carry, both_clocks)
                fwd.append(t1[0] - t0[0])
                bwd.append(t2[0] - t1[0])
                fwd_cpu.append(t1[1] - t0[1])
                bwd_cpu.append(t2[1] - t1[1])
        out = {"fwd_median_s": statistics.median(fwd), "bwd_median_s": statistics.median(bwd),
               "fwd_min_s": min(fwd), "bwd_min_s": min(bwd)}
        if fwd_cpu:
            out.update(fwd_cpu_s=statistics.median(fwd_cpu), bwd_cpu_s=statistics.median(bwd_cpu),
                       fwd_cpu_min_s=min(fwd_cpu), bwd_cpu_min_s=min(bwd_cpu))
        return out

    def saved_bytes(self, kind: str, carry) -> int:
        """Bytes of the distinct storages one forward keeps for the backward, parameters excluded: what
        autograd saves (granularity ``none``); the layer's input and the outputs of the operators selective
        recompute caches (``selective``, :func:`omnibal.train.recompute.is_saved_op`); the input (``full``)."""
        if self.granularity != "none":
            return self._checkpoint_kept_bytes(kind, carry)
        torch = self.torch
        mod = self.module(kind)
        param_ptrs = {p.untyped_storage().data_ptr() for p in mod.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in param_ptrs and ptr not in seen:
                seen[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.forward(kind, carry)
        del out
        return int(sum(seen.values()))

    def _checkpoint_kept_bytes(self, kind: str, carry) -> int:
        """A checkpointed layer keeps its input; a selective one also the outputs of the cached operators,
        recorded while the forward runs (unique storages)."""
        held = {carry[0].untyped_storage().data_ptr(): carry[0].untyped_storage().nbytes()}
        if self.granularity == "selective":
            mod = self.module(kind)
            param_ptrs = {p.untyped_storage().data_ptr() for p in mod.parameters()}
            with self.torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast), \
                    _CachedOutputs(held, param_ptrs):
                mod(*carry)
        return int(sum(held.values()))

    def peak_bytes(self, kind: str, carry) -> int | None:
        """GPU only: peak allocated bytes during forward + backward above the level before it."""
        if not self.is_cuda:
            return None
        torch = self.torch
        self._sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._forward_backward(kind, carry, None)
        self._sync()
        return int(torch.cuda.max_memory_allocated(self.device) - base)

    def retained_bytes(self, kind: str, carry) -> int | None:
        """GPU only: bytes the forward leaves allocated until the backward, its output excluded (what a
        pipeline stage holds per micro-batch in flight for this layer; the layer's input, which the caller
        owns, is not counted here even when it is saved)."""
        if not self.is_cuda:
            return None
        torch = self.torch
        self._sync()
        base = torch.cuda.memory_allocated(self.device)
        out = self.forward(kind, carry)
        self._sync()
        held = torch.cuda.memory_allocated(self.device) - base
        first = out[0]
        outputs = first.untyped_storage().nbytes() if first.untyped_storage().data_ptr() != \
            carry[0].untyped_storage().data_ptr() else 0
        del out, first
        return int(held - outputs)


class _CachedOutputs(TorchDispatchMode):
    """Records into ``held`` (data pointer -> bytes) the output storages of the operators selective recompute
    caches, parameters excluded."""

    def __init__(self, held: dict[int, int], param_ptrs: set[int]) -> None:
        super().__init__()
        self.held, self.param_ptrs = held, param_ptrs
        self.alive: list = []
        """The recorded outputs, kept alive as the checkpoint's cache keeps them (a freed storage's address
        could otherwise be reused by a later output and counted once for two)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_saved_op(func):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in self.param_ptrs:
                        self.held.setdefault(storage.data_ptr(), storage.nbytes())
                        self.alive.append(t)
        return out
