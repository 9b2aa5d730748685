from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.train.model import VLM
from omnibal.train.stage import apply_checkpointing, build_stage, example_carry, split_model
from train_helpers import grads, pack, rel_err, tiny_dataset, tiny_spec

torch.set_num_threads(1)

SPEC = tiny_spec(vision_layers=3, llm_layers=3)  # chain: 0 v.embed, 1-3 v.blocks, 4 projector, 5 llm.embed,
NUM_LAYERS = SPEC.num_layers                       # 6-8 llm.blocks, 9 llm.head


def _batch():
    ds = tiny_dataset(SPEC, tiles=[2, 0, 1], tokens=[13, 6, 10])
    return pack(SPEC, [ds[0], ds[1], ds[2]], num_tiles=5, num_tokens=40)


def _run_stages(stages, batch):
    carry = batch.carry()
    for stage in stages:
        carry = stage(*carry)
    return carry


@pytest.mark.parametrize("bounds", [
    [0, 2, NUM_LAYERS],                  # cut inside the vision encoder
    [0, 5, NUM_LAYERS],                  # right after the projector
    [0, 1, 4, 6, 8, NUM_LAYERS],         # after the patch embedding, before the projector, inside the LLM
    [0, 9, NUM_LAYERS],                  # the head alone
])
def test_split_equals_whole_model(bounds):
    batch = _batch()
    ref_model = VLM(SPEC, seed=5)
    loss, count = ref_model.loss(batch)
    loss.backward()
    ref = grads(ref_model)

    model = VLM(SPEC, seed=5)
    stages = split_model(model, bounds)
    got_loss, got_count = _run_stages(stages, batch)
    got_loss.backward()
    assert torch.equal(got_count, count)
    assert rel_err(got_loss.detach(), loss.detach()) <= 1e-5
    got = {}
    for stage in stages:
        got.update(grads(stage))
    assert got.keys() == ref.keys()  # stage parameter names are the model's names
    for name, g in got.items():
        assert rel_err(g, ref[name]) <= 1e-5, name


def test_carry_shapes_match_example_carry_at_every_boundary():
    batch = _batch()
    model = VLM(SPEC)
    carry = batch.carry()
    for start, (_, module) in enumerate(model.chain()):
        example = example_carry(model, start, num_tiles=5, num_tokens=40)
        assert [t.shape for t in carry] == [t.shape for t in example], start
        assert [t.dtype for t in carry] == [t.dtype for t in example], start
        assert example[0].requires_grad == (start > 0)
        carry = module(*carry)
    end = example_carry(model, NUM_LAYERS, num_tiles=5, num_tokens=40)
    assert [t.shape for t in carry] == [t.shape for t in end] and [t.dtype for t in carry] == [t.dtype for t in end]


def test_checkpointing_recomputes_exactly_the_named_layers_and_keeps_gradients():
    batch = _batch()
    ref_model = VLM(SPEC, seed=6)
    ref_model.loss(batch)[0].backward()
    ref = grads(ref_model)
    model = VLM(SPEC, seed=6)
    stage = build_stage(model, 0, NUM_LAYERS)
    names = ["vision.blocks.1", "projector", "llm.blocks.0", "llm.blocks.2"]
    apply_checkpointing(stage, names)
    calls: dict[str, int] = {}
    for layer, module in model.chain():
        module.register_forward_pre_hook(lambda m, a, name=layer.name: calls.__setitem__(name, calls.get(name, 0) + 1))
    stage(*batch.carry())[0].backward()
    assert {n for n, c in calls.items() if c == 2} == set(names)
    assert all(c in (1, 2) for c in calls.values())
    for name, g in grads(stage).items():
        assert rel_err(g, ref[name]) <= 1e-5, name
    with pytest.raises(InputError, match="llm.blocks.7"):
        apply_checkpointing(stage, ["llm.blocks.7"])


def test_bad_ranges_and_tied_embeddings_are_refused():
    model = VLM(SPEC)
    for start, end in [(3, 3), (-1, 2), (0, NUM_LAYERS + 1)]:
        with pytest.raises(InputError, match="stage range"):
            build_stage(model, start, end)
    tied = VLM(tiny_spec(vision_layers=3, llm_layers=3, tie=True))
    with pytest.raises(InputError, match="tied"):
        build_stage(tied, 0, 7)
    assert build_stage(tied, 5, NUM_LAYERS).is_last


def test_stage_materialised_from_meta_device_has_the_models_weights():
    from omnibal.train.layers import init_parameters

    whole = VLM(SPEC, seed=9)
    with torch.device("meta"):
        lazy = VLM(SPEC, seed=9, init=False)
    stage = build_stage(lazy, 4, 8).to_empty(device="cpu")
    init_parameters(stage, 9)
    ref = dict(whole.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, ref[name]), name


_REF: dict = {}


def _reference():
    if not _REF:
        batch = _batch()
        model = VLM(SPEC, seed=5)
        loss, count = model.loss(batch)
        loss.backward()
        _REF.update(batch=batch, loss=loss.detach(), count=count, grads=grads(model))
    return _REF


@settings(max_examples=12, deadline=None)
@given(st.sets(st.integers(1, NUM_LAYERS - 1), min_size=1, max_size=4), st.data())
def test_any_split_with_any_recompute_equals_the_whole_model(cuts, data):
    ref = _reference()
    bounds = [0, *sorted(cuts), NUM_LAYERS]
    model = VLM(SPEC, seed=5)
    stages = split_model(model, bounds)
    for stage in stages:
        chosen = data.draw(st.sets(st.sampled_from(stage.layer_names)))
        apply_checkpointing(stage, chosen)
    loss, count = _run_stages(stages, ref["batch"])
    loss.backward()
    assert torch.equal(count, ref["count"]) and rel_err(loss.detach(), ref["loss"]) <= 1e-5
    for stage in stages:
        for name, g in grads(stage).items():
            assert rel_err(g, ref["grads"][name]) <= 1e-5, (bounds, name)
