"""The layers of the reference VLM. Every chain layer maps the carry to the next carry.

A chain layer's ``forward(activation, token_meta, sizes)`` returns ``(activation', token_meta, sizes)``
(the LM head returns ``(loss_sum, num_targets)``), so a pipeline stage is just its layers in a row and any
cut point works. ``token_meta`` and ``sizes`` are the collator's (:mod:`omnibal.data.collate`).

The buffer tail (tile slots >= active tiles, token slots >= active tokens) is passed through untouched:
shapes stay fixed, compute follows the real content. Set ``compute_tail=True`` on the model to process
the whole buffer instead (a fixed-length trainer's cost).
"""

from __future__ import annotations

import functools
import hashlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from omnibal.cost.spec import ModelSpec
from omnibal.data.collate import (
    IGNORE_INDEX,
    META_IMAGE_INDEX,
    META_INPUT_IDS,
    META_LABELS,
    META_POSITION_IDS,
    META_SEGMENT_IDS,
    SIZE_TILES,
    SIZE_TOKENS,
)

try:  # optional: varlen attention kernel on CUDA
    from flash_attn import flash_attn_varlen_func  # type: ignore
except Exception:  # pragma: no cover - not installed on CPU machines
    flash_attn_varlen_func = None


@functools.cache
def torch_varlen_attn():
    """torch's own flash-attention varlen kernel (CUDA; torch >= 2.10), or None. Imported on first use: the
    module pulls in ``torch._dynamo``, seconds of import time in every rank process that never calls it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # pragma: no cover - older torch
        return None
    return varlen_attn


LAYER_SCALE_INIT = 0.1
"""Initial value of InternViT's per-channel layer scales (``ls1``, ``ls2``)."""


class Options:
    """Run-time switches shared by all layers of one model (mutable on purpose: set once after build)."""

    def __init__(self, *, attn_impl: str = "auto", compute_tail: bool = False) -> None:
        if attn_impl not in ("auto", "varlen", "mask", "flash"):
            raise ValueError(f"attn_impl must be auto, varlen, mask or flash, got {attn_impl!r}")
        self.attn_impl = attn_impl
        self.compute_tail = compute_tail
        self.sequence_parallel = None
        """Set from outside by :mod:`omnibal.train.sp` (None: no sequence parallelism): an object whose
        ``attention(q, k, v, segment_ids, impl)`` takes this rank's token shard of the heads and returns the
        attention output of that shard, exchanging with the other ranks of its group (model code itself
        never talks to torch.distributed)."""


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation ``x * sigmoid(1.702 x)``."""
    return x * torch.sigmoid(1.702 * x)


def active_count(sizes: torch.Tensor, which: int, limit: int, opts: Options) -> int:
    return limit if opts.compute_tail else int(sizes[0, which])


# --------------------------------------------------------------------------------------------- vision
class VisionEmbed(nn.Module):
    """Patch embedding (conv) + class token + learned position embedding, per tile.
    Carry in: pixel_values [1, Q_v, 3, S, S]; out: [1, Q_v, T_v, Dv]."""

    def __init__(self, spec: ModelSpec, opts: Options) -> None:
        super().__init__()
        v = spec.vision
        self.opts = opts
        self.patch = nn.Conv2d(3, v.hidden, kernel_size=v.patch_size, stride=v.patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, v.hidden)) if v.class_token else None
        self.pos = nn.Parameter(torch.zeros(1, v.tokens_per_tile, v.hidden))

    def forward(self, pixels, token_meta, sizes):
        q_v = pixels.shape[1]
        n = active_count(sizes, SIZE_TILES, q_v, self.opts)
        x = self.patch(pixels[0, :max(n, 1)].to(self.patch.weight.dtype)).flatten(2).transpose(1, 2)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos
        if n == 0:  # no image in this micro-batch: keep gradients defined (zeros), as InternVL's dummy tile
            x = x * 0
        out = x.new_zeros(1, q_v, x.shape[1], x.shape[2])
        out = torch.cat([x.unsqueeze(0), out[:, x.shape[0]:]], dim=1)
        return out, token_meta, sizes


class VisionBlock(nn.Module):
    """Pre-norm ViT block (attention within each tile, GELU MLP). Carry [1, Q_v, T_v, Dv] -> same.

    With ``spec.vision.qk_norm`` q and k pass an RMSNorm over the full width before attention, and with
    ``layer_scale`` each branch output is scaled per channel before its residual add (``ls1``, ``ls2``,
    initialised to 0.1), as in InternViT-6B; ``mlp_act`` ``quick_gelu`` is CLIP's activation."""

    def __init__(self, spec: ModelSpec, opts: Options) -> None:
        super().__init__()
        v = spec.vision
        self.opts = opts
        self.num_heads = v.num_heads
        self.norm1 = nn.LayerNorm(v.hidden)
        self.qkv = nn.Linear(v.hidden, 3 * v.hidden)
        self.q_norm = nn.RMSNorm(v.hidden, eps=1e-6) if v.qk_norm else None
        self.k_norm = nn.RMSNorm(v.hidden, eps=1e-6) if v.qk_norm else None
        self.proj = nn.Linear(v.hidden, v.hidden)
        self.norm2 = nn.LayerNorm(v.hidden)
        self.fc1 = nn.Linear(v.hidden, v.mlp_hidden)
        self.fc2 = nn.Linear(v.mlp_hidden, v.hidden)
        self.act = quick_gelu if v.mlp_act == "quick_gelu" else F.gelu
        self.ls1 = nn.Parameter(torch.full((v.hidden,), LAYER_SCALE_INIT)) if v.layer_scale else None
        self.ls2 = nn.Parameter(torch.full((v.hidden,), LAYER_SCALE_INIT)) if v.layer_scale else None

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (y.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2) for y in (q, k, v))
        a = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        x = x + (a * self.ls1 if self.ls1 is not None else a)
        m = self.fc2(self.act(self.fc1(self.norm2(x))))
        return x + (m * self.ls2 if self.ls2 is not None else m)

    def forward(self, x, token_meta, sizes):
        n = active_count(sizes, SIZE_TILES, x.shape[1], self.opts)
        y = self._block(x[0, :max(n, 1)])
        if n == 0:
            y = y * 0
        return torch.cat([y.unsqueeze(0), x[:, y.shape[0]:]], dim=1), token_meta, sizes


class Projector(nn.Module):
    """Drop the class token, pixel-shuffle the patch grid by ``downsample_ratio`` (channels x 1/r^2),
    LayerNorm (if ``spec.projector_norm``), Linear, GELU, Linear into the LLM width.
    Carry [1, Q_v, T_v, Dv] -> [1, Q_v, tpt, D]."""

    def __init__(self, spec: ModelSpec, opts: Options) -> None:
        super().__init__()
        self.opts = opts
        self.class_token = spec.vision.class_token
        self.side = spec.vision.patches_per_side
        self.factor = int(round(1 / spec.downsample_ratio))
        self.norm = nn.LayerNorm(spec.projector_in) if spec.projector_norm else nn.Identity()
        self.fc1 = nn.Linear(spec.projector_in, spec.llm.hidden)
        self.fc2 = nn.Linear(spec.llm.hidden, spec.llm.hidden)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[n, side*side, C] -> [n, (side/f)^2, C*f^2]: each f x f block of patches becomes one token."""
        n, _, c = x.shape
        s, f = self.side, self.factor
        x = x.view(n, s // f, f, s // f, f, c).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(n, (s // f) ** 2, f * f * c)

    def forward(self, x, token_meta, sizes):
        q_v = x.shape[1]
        n = active_count(sizes, SIZE_TILES, q_v, self.opts)
        h = x[0, :max(n, 1)]
        if self.class_token:
            h = h[:, 1:]
        h = self.fc2(F.gelu(self.fc1(self.norm(self.pixel_shuffle(h)))))
        if n == 0:
            h = h * 0
        out = torch.cat([h.unsqueeze(0), h.new_zeros(1, q_v - h.shape[0], h.shape[1], h.shape[2])], dim=1)
        return out, token_meta, sizes


# ------------------------------------------------------------------------------------------------ LLM
class LLMEmbed(nn.Module):
    """Token embedding; image features fill the image slots (``META_IMAGE_INDEX``).
    Carry [1, Q_v, tpt, D] -> [1, Q_t, D]."""

    def __init__(self, spec: ModelSpec, opts: Options) -> None:
        super().__init__()
        self.opts = opts
        self.tokens = nn.Embedding(spec.llm.padded_vocab(), spec.llm.hidden)  # rows >= vocab_size: never read

    def forward(self, features, token_meta, sizes):
        h = self.tokens(token_meta[0, META_INPUT_IDS])
        slot = token_meta[0, META_IMAGE_INDEX]
        flat = features.reshape(-1, features.shape[-1]).to(h.dtype)
        img = flat[slot.clamp(min=0)]
        h = torch.where((slot >= 0).unsqueeze(-1), img, h)
        return h.unsqueeze(0), token_meta, sizes


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    freqs = position_ids.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def segment_lengths(segment_ids: torch.Tensor) -> list[int]:
    """Lengths of the runs of equal segment ids (segments are contiguous by construction)."""
    return torch.unique_consecutive(segment_ids, return_counts=True)[1].tolist()


def flash_varlen_available(device: torch.device) -> bool:
    """Whether a flash-attention varlen kernel runs on ``device``: the flash-attn package or torch's own."""
    return device.type == "cuda" and (flash_attn_varlen_func is not None or torch_varlen_attn() is not None)


def _half_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype a flash kernel runs ``t`` in: its own, or autocast's on its device (elementwise ops
    such as rotary embeddings leave q and k in fp32 under autocast); None: neither."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.dtype
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return None


def flash_varlen_kernel() -> str:
    """Which varlen kernel ``attn_impl="flash"`` calls: ``flash_attn`` (the package, preferred), ``torch``
    (``torch.nn.attention.varlen``) or ``none``."""
    if flash_attn_varlen_func is not None:
        return "flash_attn"
    return "torch" if torch_varlen_attn() is not None else "none"


def _flash_varlen(q, k, v, segment_ids: torch.Tensor) -> torch.Tensor:
    """Causal varlen attention of [n, H, hd] q and [n, Hkv, hd] k/v by a flash kernel (see
    :func:`flash_varlen_kernel`); grouped-query heads are expanded for a kernel that cannot share them."""
    lengths = torch.unique_consecutive(segment_ids, return_counts=True)[1]
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    max_len = int(lengths.max())
    half = _half_dtype(q)
    q, k, v = (t.to(half) for t in (q, k, v))
    if flash_attn_varlen_func is not None:
        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)
    varlen_attn = torch_varlen_attn()
    if varlen_attn is None:
        raise RuntimeError("attn_impl='flash' needs a CUDA device and the flash-attn package or torch >= 2.10")
    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # torch < 2.12: k and v are kept at the query's head count for the backward (more memory)
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def packed_causal_attention(q, k, v, segment_ids: torch.Tensor, impl: str) -> torch.Tensor:
    """Causal attention that stays inside each segment. q [H, n, hd], k/v [Hkv, n, hd] -> [H, n, hd].

    ``varlen``: one SDPA call per segment (cost sum len^2, like flash-attn varlen); ``mask``: one SDPA call
    with a block-diagonal causal mask (cost n^2); ``flash``: one flash-attention varlen kernel call (CUDA:
    the flash-attn package, else torch's own). ``auto``: ``flash`` where it runs, else ``varlen``.
    """
    h, n, hd = q.shape
    if impl == "auto":
        impl = "flash" if flash_varlen_available(q.device) and _half_dtype(q) is not None else "varlen"
    if impl == "flash":
        return _flash_varlen(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), segment_ids).transpose(0, 1)
    if k.shape[0] != h:
        k = k.repeat_interleave(h // k.shape[0], dim=0)
        v = v.repeat_interleave(h // v.shape[0], dim=0)
    # 4-D inputs: the CPU flash kernel only takes [batch, heads, seq, dim] (3-D falls back to the math
    # path, slower forward+backward)
    q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if impl == "mask":
        idx = torch.arange(n, device=q.device)
        mask = (segment_ids[:, None] == segment_ids[None, :]) & (idx[None, :] <= idx[:, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[0]
    outs, start = [], 0
    for length in segment_lengths(segment_ids):
        sl = slice(start, start + length)
        outs.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True))
        start += length
    return torch.cat(outs, dim=2)[0]


class LLMBlock(nn.Module):
    """Decoder block: RMSNorm, GQA attention with RoPE (per-sample positions, causal inside each packed
    sample), RMSNorm, SwiGLU MLP. Carry [1, Q_t, D] -> same."""

    def __init__(self, spec: ModelSpec, opts: Options, *, rope_theta: float = 10000.0) -> None:
        super().__init__()
        c = spec.llm
        self.opts = opts
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.rope_theta = rope_theta
        self.norm1 = nn.RMSNorm(c.hidden, eps=1e-6)
        self.q = nn.Linear(c.hidden, c.num_heads * c.head_dim, bias=False)
        self.k = nn.Linear(c.hidden, c.num_kv_heads * c.head_dim, bias=False)
        self.v = nn.Linear(c.hidden, c.num_kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.num_heads * c.head_dim, c.hidden, bias=False)
        self.norm2 = nn.RMSNorm(c.hidden, eps=1e-6)
        self.gate = nn.Linear(c.hidden, c.mlp_hidden, bias=False)
        self.up = nn.Linear(c.hidden, c.mlp_hidden, bias=False)
        self.down = nn.Linear(c.mlp_hidden, c.hidden, bias=False)

    def forward(self, x, token_meta, sizes):
        n = active_count(sizes, SIZE_TOKENS, x.shape[1], self.opts)
        h = x[0, :n]
        hd = self.head_dim
        a = self.norm1(h)
        q = self.q(a).view(n, self.num_heads, hd).transpose(0, 1)
        k = self.k(a).view(n, self.num_kv_heads, hd).transpose(0, 1)
        v = self.v(a).view(n, self.num_kv_heads, hd).transpose(0, 1)
        cos, sin = rope_cos_sin(token_meta[0, META_POSITION_IDS, :n], hd, self.rope_theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        segments = token_meta[0, META_SEGMENT_IDS, :n]
        sp = self.opts.sequence_parallel
        att = (packed_causal_attention(q, k, v, segments, self.opts.attn_impl) if sp is None
               else sp.attention(q, k, v, segments, self.opts.attn_impl))
        h = h + self.o(att.transpose(0, 1).reshape(n, self.num_heads * hd))
        m = self.norm2(h)
        h = h + self.down(F.silu(self.gate(m)) * self.up(m))
        return torch.cat([h.unsqueeze(0), x[:, n:]], dim=1), token_meta, sizes


class LMHead(nn.Module):
    """Final RMSNorm + LM head (over the padded vocabulary, :meth:`LLMSpec.padded_vocab`; the pad columns are
    dropped before the loss) + token cross-entropy summed over the targets (``META_LABELS`` != -100).
    Carry [1, Q_t, D] -> ``(loss_sum [1] (float32, or float64 for a float64 model), num_targets [1] int64)``."""

    def __init__(self, spec: ModelSpec, opts: Options) -> None:
        super().__init__()
        self.opts = opts
        self.norm = nn.RMSNorm(spec.llm.hidden, eps=1e-6)
        self.vocab_size = spec.llm.vocab_size
        self.out = nn.Linear(spec.llm.hidden, spec.llm.padded_vocab(), bias=False)  # padded: aligned products

    def forward(self, x, token_meta, sizes):
        n = active_count(sizes, SIZE_TOKENS, x.shape[1], self.opts)
        logits = self.out(self.norm(x[0, :n]))[:, :self.vocab_size]
        if logits.dtype in (torch.float16, torch.bfloat16):  # the loss is always summed in at least fp32
            logits = logits.float()
        labels = token_meta[0, META_LABELS, :n]
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss.reshape(1), (labels != IGNORE_INDEX).sum().reshape(1)


def init_parameters(module: nn.Module, seed: int) -> None:
    """Deterministic init: each parameter draws from its own generator seeded by (seed, full name), so a
    stage built from a slice of the model (with the model's parameter names, on any rank, or materialised
    from the meta device) gets exactly the whole model's weights. Matrices N(0, 0.02), norms 1, biases 0."""
    with torch.no_grad():
        for mod_name, mod in module.named_modules():
            for leaf, p in mod.named_parameters(recurse=False):
                name = f"{mod_name}.{leaf}" if mod_name else leaf
                if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) and leaf == "weight":
                    p.fill_(1.0)
                elif leaf in ("ls1", "ls2"):
                    p.fill_(LAYER_SCALE_INIT)
                elif leaf == "bias":
                    p.zero_()
                else:
                    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
                    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(p.dtype))
