import dataclasses

import numpy as np
import pytest

from omnibal.cost.analytic import (
    analytic_cost_table,
    forward_flops,
    layer_work,
    total_flops_per_sample,
    zero_sharded_bytes,
)
from omnibal.cost.hardware import get_hardware
from omnibal.cost.params import llm_embed_params
from omnibal.cost.presets import PUBLISHED_PARAMS, get_model_preset, preset_names
from omnibal.cost.table import microbatch_features
from omnibal.errors import InputError

A100 = get_hardware("a100-80g")


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_flops_agree_with_6n_rule_plus_attention(name):
    """Training FLOPs of one sample (3 tiles, 1000 LLM tokens, one causal segment), counted as 3x the
    analytic forward, against the rule 6 N D + attention, where N is the PUBLISHED parameter count of each
    part that does GEMMs on those tokens (vision: all of it, on tiles x tokens_per_tile ViT tokens; LLM: all
    but the input-embedding table, on the LLM tokens; projector: our count, on tiles x llm_tokens_per_tile)
    and attention is PaLM's 12 L D T per token for the ViT (full, T = tokens per tile) and half of it for the
    causal LLM (6 L D T, T = 1000)."""
    spec = get_model_preset(name)
    tiles, tokens = 3, 1000
    analytic = float(total_flops_per_sample(spec, tiles, tokens))
    pub = PUBLISHED_PARAMS[name]
    v, llm = spec.vision, spec.llm
    n_vision = pub.get("vision", 0.30e9 * v.num_layers / 24)  # CLIP-L: 23 of its 24 blocks run
    n_llm = pub["llm"] - llm_embed_params(llm)
    n_proj = pub["total"] - pub.get("vision", n_vision) - pub["llm"]
    vit_tokens = tiles * v.tokens_per_tile
    rule = 6 * (n_vision * vit_tokens + n_proj * tiles * spec.llm_tokens_per_tile + n_llm * tokens)
    rule += 12 * v.num_layers * v.hidden * v.tokens_per_tile * vit_tokens + 6 * llm.num_layers * llm.hidden * tokens**2
    assert analytic == pytest.approx(rule, rel=0.04), (analytic / rule)


def test_attention_terms_scale_as_documented():
    spec = get_model_preset("internvl-chat-1.5")
    one_seg = forward_flops(spec, 0, 2000, 2000**2)
    two_seg = forward_flops(spec, 0, 2000, 2 * 1000**2)
    # Splitting a 2000-token segment into two halves saves half of the causal attention FLOPs.
    attention_2000 = 2 * spec.llm.hidden * spec.llm.num_layers * 2000**2
    assert one_seg - two_seg == pytest.approx(attention_2000 / 2)
    per_tile = forward_flops(spec, 1, 0, 0) - forward_flops(spec, 0, 0, 0)
    assert forward_flops(spec, 5, 0, 0) - forward_flops(spec, 0, 0, 0) == pytest.approx(5 * per_tile)


def test_table_shapes_and_positive_costs():
    for name in preset_names():
        spec = get_model_preset(name)
        table = analytic_cost_table(spec, A100)
        assert table.names == tuple(layer.name for layer in spec.layers())
        feats = microbatch_features(np.array([4, 12]), np.array([1500, 4000]), np.array([1500**2, 4 * 1000**2]))
        fwd = table.evaluate("fwd_time", feats)
        assert fwd.shape == (2, spec.num_layers) and (fwd > 0).all()
        assert (fwd[1] >= fwd[0]).all()
        assert (table.evaluate("bwd_time", feats) > fwd).all()
        assert (table.ckpt_bytes <= table.act_bytes + 1e-9).all()
        assert table.tp_comm_time is None


def test_activation_bytes_follow_korthikanti():
    # A vision block with M = 4H, t = 1, bf16 keeps 32 H bytes per token (34 s b h without dropout masks),
    # plus fp32 norm statistics and the log-sum-exp of each head; InternViT-300M's layer scale keeps both
    # branch outputs (2 x 2H bytes more).
    spec = get_model_preset("internvl2-8b")
    assert spec.vision.layer_scale and not spec.vision.qk_norm
    work = layer_work(spec)
    kinds = [layer.kind for layer in spec.layers()]
    v = spec.vision
    block = work.act_bytes[kinds.index("vision_block")]
    assert block[1] == pytest.approx(v.tokens_per_tile * (32 * v.hidden + 4 * v.hidden + 16 + 4 * v.num_heads))
    assert work.ckpt_bytes[kinds.index("vision_block")][1] == v.tokens_per_tile * v.hidden * 2
    llm_block = work.act_bytes[kinds.index("llm_block")]
    assert llm_block[2] > 0 and llm_block[1] == 0 and llm_block[3] == 0


def test_tensor_parallel_split_and_errors():
    spec = get_model_preset("internvl-chat-1.5")
    with pytest.raises(InputError) as exc:
        analytic_cost_table(spec, A100, tp_size=2)  # InternViT-6B has 25 heads
    assert exc.value.field == "vision.num_heads"
    t1 = analytic_cost_table(spec, A100)
    t2 = analytic_cost_table(spec, A100, tp_size=2, tp_vision=False)
    kinds = np.array(t1.kinds)
    llm = kinds == "llm_block"
    w1, w2 = layer_work(spec), layer_work(spec, tp_size=2, tp_vision=False)
    assert np.allclose(w2.matmul_flops[llm], w1.matmul_flops[llm] / 2)
    vision = kinds == "vision_block"
    assert np.allclose(w2.matmul_flops[vision], w1.matmul_flops[vision])  # replicated encoder
    assert np.allclose(t2.param_bytes[llm], t1.param_bytes[llm] / 2)
    assert t2.tp_comm_time is not None and (t2.tp_comm_time[llm, 2] > 0).all()
    assert (t2.tp_comm_time[vision] == 0).all()
    with pytest.raises(InputError) as exc:
        analytic_cost_table(get_model_preset("llava-1.5-13b"), A100, tp_size=3)
    assert exc.value.field.startswith(("llm.", "vision."))
    with pytest.raises(InputError) as exc:
        analytic_cost_table(spec, A100, tp_size=0)
    assert exc.value.field == "tp_size"


def test_tp_comm_uses_inter_node_link_beyond_a_node():
    spec = get_model_preset("llava-1.5-7b")
    small = dataclasses.replace(A100, gpus_per_node=2)
    feats = microbatch_features(8, 4000, 4 * 1000**2)
    inside = analytic_cost_table(spec, A100, tp_size=4).evaluate("tp_comm_time", feats).sum()
    across = analytic_cost_table(spec, small, tp_size=4).evaluate("tp_comm_time", feats).sum()
    assert across > 5 * inside  # 25 GB/s InfiniBand vs 300 GB/s NVLink


def test_frozen_vision_has_no_backward_or_optimizer_state():
    spec = dataclasses.replace(get_model_preset("llava-1.5-7b"), freeze_vision=True)
    table = analytic_cost_table(spec, A100)
    vision = np.isin(table.kinds, ["vision_embed", "vision_block"])
    assert (table.bwd_time[vision] == 0).all() and (table.act_bytes[vision] == 0).all()
    assert (table.grad_bytes[vision] == 0).all() and (table.optim_bytes[vision] == 0).all()
    assert (table.param_bytes[vision] > 0).all() and (table.bwd_time[~vision].sum(axis=1) > 0).all()


def test_mixed_precision_bytes_and_zero_sharding():
    spec = get_model_preset("internvl2-8b")
    table = analytic_cost_table(spec, A100)
    assert np.allclose(table.optim_bytes, 6 * table.param_bytes)  # 12 B vs 2 B per parameter
    assert np.allclose(table.grad_bytes, table.param_bytes)
    p, g, o = zero_sharded_bytes(table, dp_size=8, zero_stage=1)
    assert np.allclose(o, table.optim_bytes / 8) and np.allclose(g, table.grad_bytes)
    p3, g3, o3 = zero_sharded_bytes(table, dp_size=8, zero_stage=3)
    assert np.allclose(p3, table.param_bytes / 8)
    with pytest.raises(InputError):
        zero_sharded_bytes(table, dp_size=0)
    fp32 = analytic_cost_table(spec, A100, dtype="fp32")
    assert np.allclose(fp32.param_bytes, 2 * table.param_bytes)
    with pytest.raises(InputError):
        analytic_cost_table(spec, A100, dtype="int8")


def test_efficiency_factors_drive_time():
    spec = get_model_preset("internvl-chat-1.5")
    feats = microbatch_features(12, 4000, 4 * 1000**2)
    base = analytic_cost_table(spec, A100).evaluate("fwd_time", feats).sum()
    slow = analytic_cost_table(spec, A100.with_efficiency(matmul=A100.eff_matmul / 2)).evaluate("fwd_time", feats).sum()
    assert 1.7 * base < slow < 2.0 * base  # GEMMs dominate a 26B model
