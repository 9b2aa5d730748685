from __future__ import annotations

import pytest
import torch

from omnibal.train.model import VLM
from train_helpers import grads, pack, rel_err, tiny_dataset, tiny_spec

torch.set_num_threads(1)


def test_module_names_are_the_spec_chain():
    spec = tiny_spec(vision_layers=3, llm_layers=2)
    model = VLM(spec)
    assert [layer.name for layer, _ in model.chain()] == [layer.name for layer in spec.layers()]
    names = {n for n, _ in model.named_modules()}
    assert {"vision.embed", "vision.blocks.2", "projector", "llm.embed", "llm.blocks.1", "llm.head"} <= names


def test_init_is_deterministic_in_seed():
    spec = tiny_spec()
    a, b, c = VLM(spec, seed=3), VLM(spec, seed=3), VLM(spec, seed=4)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.ndim >= 2:
            assert not torch.equal(pa, pc), n


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss, count = model.loss(batch)
    loss.backward()
    return loss.detach(), int(count), grads(model)


def test_packed_samples_do_not_see_each_other():
    """Loss and gradients of a pack equal the sums over its samples run alone (varlen isolation, image
    slots filled from the right tiles, labels shifted inside each sample)."""
    spec = tiny_spec()
    ds = tiny_dataset(spec, tiles=[1, 0, 2], tokens=[9, 7, 12])
    model = VLM(spec, seed=1).double()
    samples = [ds[i] for i in range(3)]
    for s in samples:
        s["pixel_values"] = s["pixel_values"].double()
    together = _loss_and_grads(model, pack(spec, samples))
    alone = [_loss_and_grads(model, pack(spec, [s])) for s in samples]
    assert together[1] == sum(a[1] for a in alone) > 0
    assert abs(float(together[0]) - sum(float(a[0]) for a in alone)) < 1e-9 * abs(float(together[0]))
    for name, g in together[2].items():
        total = sum(a[2][name] for a in alone)
        assert torch.allclose(g, total, rtol=1e-9, atol=1e-12), name


@pytest.mark.parametrize("mode", ["pad_to_longest"])
def test_layouts_and_attention_impls_agree(mode):
    spec = tiny_spec()
    ds = tiny_dataset(spec, tiles=[2, 1], tokens=[14, 9])
    samples = [ds[0], ds[1]]
    ref_model = VLM(spec, seed=2, attn_impl="varlen")
    ref = _loss_and_grads(ref_model, pack(spec, samples))
    for impl, tail, layout in [("mask", False, "pack"), ("varlen", True, "pack"), ("mask", True, mode),
                               ("varlen", False, mode)]:
        model = VLM(spec, seed=2, attn_impl=impl, compute_tail=tail)
        got = _loss_and_grads(model, pack(spec, samples, mode=layout))
        assert got[1] == ref[1]
        assert rel_err(got[0], ref[0]) < 1e-5, (impl, tail, layout)
        for name, g in got[2].items():
            assert rel_err(g, ref[2][name]) < 1e-4 or g.norm() < 1e-9, (impl, tail, layout, name)


def test_text_only_pack_gives_zero_vision_gradients_and_frozen_vision_gets_none():
    spec = tiny_spec()
    ds = tiny_dataset(spec, tiles=[0, 0], tokens=[6, 8])
    model = VLM(spec)
    model.loss(pack(spec, [ds[0], ds[1]]))[0].backward()
    for name, p in model.vision.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name
    frozen = VLM(tiny_spec(freeze_vision=True))
    frozen.loss(pack(spec, [ds[0]]))[0].backward()
    assert all(p.grad is None for p in frozen.vision.parameters())
    assert all(p.grad is not None for p in frozen.llm.parameters())


def test_loss_is_a_sum_over_targets():
    spec = tiny_spec()
    ds = tiny_dataset(spec, tiles=[1], tokens=[20], target_fraction=0.5)
    batch = pack(spec, [ds[0]])
    with torch.no_grad():
        loss, count = VLM(spec).loss(batch)
    assert int(count) == batch.num_targets == 8  # 16 text tokens, half of them answer
    # an untrained model predicts ~uniformly: each target costs about log(vocab)
    assert abs(float(loss) / int(count) - torch.log(torch.tensor(64.0)).item()) < 0.3


@pytest.mark.gpu
def test_cuda_matches_cpu_and_bf16_runs():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    spec = tiny_spec()
    ds = tiny_dataset(spec, tiles=[2, 1], tokens=[14, 9])
    batch = pack(spec, [ds[0], ds[1]])
    cpu_loss, _ = VLM(spec, seed=3, attn_impl="varlen").loss(batch)
    gpu = VLM(spec, seed=3, attn_impl="varlen").cuda()
    gpu_loss, _ = gpu.loss(batch.to("cuda"))
    assert rel_err(gpu_loss.detach().cpu(), cpu_loss.detach()) < 1e-4
    half = VLM(spec, seed=3).cuda().to(torch.bfloat16)  # attn_impl auto: flash-attn varlen when installed
    loss, count = half.loss(batch.to("cuda"))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all() and int(count) == batch.num_targets
    assert rel_err(loss.detach().cpu(), cpu_loss.detach()) < 5e-2


@pytest.mark.gpu
def test_flash_varlen_attention_matches_per_segment_sdpa_on_cuda():
    """The varlen kernel the GPU trainer uses (flash-attn, else torch's own) gives the per-segment SDPA result,
    grouped-query heads included, forward and backward."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from omnibal.train.layers import flash_varlen_available, packed_causal_attention

    if not flash_varlen_available(torch.device("cuda")):
        pytest.skip("no flash varlen kernel (flash-attn or torch >= 2.10)")
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 300, 17, 1000]
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).cuda()
    n = sum(lengths)
    q0, k0, v0 = (torch.randn(h, n, 64, generator=gen).cuda().to(torch.bfloat16) for h in (8, 2, 2))
    outs, grads = [], []
    for impl in ("flash", "varlen"):
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        out = packed_causal_attention(q, k, v, seg, impl)
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append([t.grad.float() for t in (q, k, v)])
    assert rel_err(outs[0], outs[1]) < 2e-2
    for a, b in zip(*grads):
        assert rel_err(a, b) < 5e-2
