"""The balancer at fixed caps (any caps ISF packs at), its pads against the buffer, and the structure of
``omnibal.data.balance`` (acyclic imports, short functions)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balance_helpers import assert_exactly_once, real_stats, two_profile_mixture
from omnibal.data.balance import DEFAULT_COST, BalanceConfig, balance
from omnibal.data.balance.cost import to_grid
from omnibal.data.balance.exchange import Packs, Targets, repair_tiles
from omnibal.data.balance.floor import pad_floor
from omnibal.data.balance.isf import isf_pack
from omnibal.data.balance.packer import _deal
from omnibal.data.metrics import schedule_metrics
from omnibal.errors import InputError
from omnibal.stats.synthetic import synthetic_internvl_mixture
from omnibal.stats.table import SampleStats

FIXED_CAPS = [(9, 4096), (12, 4096), (12, 4800), (16, 4352)]
BALANCE_DIR = Path(__file__).resolve().parents[1] / "src" / "omnibal" / "data" / "balance"


def _assert_under_caps(sched, stats) -> None:
    own = set(sched.meta.get("own_packs", []))
    f = sched.features(stats, padding="varlen")
    for step, rank, micro in zip(*np.nonzero((f[..., 1] > sched.caps.tiles) | (f[..., 2] > sched.caps.tokens))):
        rows = sched.microbatch(step, rank, micro).tolist()
        assert len(rows) == 1 and rows[0] in own, f"micro-batch {(step, rank, micro)} over the caps: {rows}"


@pytest.mark.parametrize("caps", FIXED_CAPS)
@pytest.mark.parametrize("which", ["ai2d", "chartqa", "merged"])
def test_fixed_caps_pack_on_real_stats_where_isf_does(shared_stats_dir, which, caps):
    stats = real_stats(str(shared_stats_dir), which)
    config = dict(max_tiles=caps[0], max_tokens=caps[1])
    isf = balance(stats, dp_size=32, config=BalanceConfig(method="isf", isf_iterations=10, **config))
    ours = balance(stats, dp_size=32, config=BalanceConfig(**config))
    assert_exactly_once(isf)
    assert_exactly_once(ours)
    _assert_under_caps(ours, stats)
    assert (ours.caps.tiles, ours.caps.tokens) == caps
    mine, theirs = schedule_metrics(ours, stats), schedule_metrics(isf, stats)
    assert mine["llm_max_mean_ranks"] <= theirs["llm_max_mean_ranks"] + 1e-3
    assert mine["num_steps"] <= theirs["num_steps"] + 1  # no more micro-batches than ISF needs (+ one step)


@pytest.mark.parametrize("caps", FIXED_CAPS)
def test_fixed_caps_on_the_synthetic_default_with_own_packs(caps):
    stats = synthetic_internvl_mixture(6000, seed=1)  # up to 13 tiles: over 9 and 12, run alone
    sched = balance(stats, dp_size=8, config=BalanceConfig(max_tiles=caps[0], max_tokens=caps[1],
                                                          oversize="own_pack"))
    assert_exactly_once(sched)
    _assert_under_caps(sched, stats)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(20, 400), seed=st.integers(0, 10_000), dp=st.integers(1, 4), m=st.integers(1, 2),
       max_v=st.integers(1, 13), text=st.integers(30, 3000), cap_v=st.integers(1, 40), cap_t=st.integers(64, 9000))
def test_any_caps_isf_packs_ours_packs(n, seed, dp, m, max_v, text, cap_v, cap_t):
    """Whenever every sample fits the caps alone and ISF's packs could fill whole steps without an empty
    micro-batch, ours packs too: every sample once, every micro-batch under the caps."""
    rng = np.random.default_rng(seed)
    tiles = rng.integers(0, max_v + 1, n)
    tokens = tiles * 256 + rng.integers(1, text + 1, n)
    keep = (tiles <= cap_v) & (tokens <= cap_t)
    if keep.sum() < dp * m:
        return
    stats = SampleStats.from_arrays(tiles=tiles[keep], tokens=tokens[keep], source="random")
    _, offsets = isf_pack(stats.tiles, stats.tokens, max_tiles=cap_v, max_tokens=cap_t, threshold=128,
                          iterations=10, rng=np.random.default_rng(seed))
    per_step = dp * m
    if len(offsets) - 1 > len(stats) // per_step * per_step:
        return  # ISF would need empty micro-batches (or more than one sample's worth of slots): out of scope
    sched = balance(stats, dp_size=dp, num_microbatches=m, seed=seed,
                    config=BalanceConfig(max_tiles=cap_v, max_tokens=cap_t))
    assert_exactly_once(sched)
    _assert_under_caps(sched, stats)


CHARTQA_DP8 = pytest.mark.xfail(reason="issue 35: chartqa at DP 8: at the counts where its 5-tile samples fill "
                                 "20-tile packs, packs holding its few 1- and 3-tile samples (3x the text) go over "
                                 "Q_t; the tail adds 13 steps: tile pad 0.027, token 0.004 (compute 0.016; was "
                                 "0.003 / 0.029, before that 0.009 / 0.015)", strict=False)


@pytest.mark.parametrize(("which", "dp_size"), [("ai2d", 8), ("ai2d", 32),
                                               pytest.param("chartqa", 8, marks=CHARTQA_DP8), ("chartqa", 32),
                                               ("merged", 8), ("merged", 32)])
def test_pad_of_the_derived_buffer_on_real_stats(shared_stats_dir, which, dp_size):
    stats = real_stats(str(shared_stats_dir), which)
    m = schedule_metrics(balance(stats, dp_size=dp_size), stats)
    assert m["buffer_pad_tiles"] <= 0.02 and m["buffer_pad_tokens"] <= 0.02, (m["buffer_pad_tiles"],
                                                                               m["buffer_pad_tokens"])
    assert m["coverage_ok"] and m["microbatches_over_caps"] == 0


@pytest.mark.parametrize("dp_size", [8, 32, 128])
def test_pad_on_a_mixture_of_a_three_tile_and_a_five_tile_subset(dp_size):
    stats = two_profile_mixture(30_000)
    sched = balance(stats, dp_size=dp_size)
    m = schedule_metrics(sched, stats)
    assert m["buffer_pad_tiles"] <= 0.02 and m["buffer_pad_tokens"] <= 0.02, (m["buffer_pad_tiles"],
                                                                               m["buffer_pad_tokens"])
    assert m["vision_max_mean_ranks"] <= 1.01 and m["llm_max_mean_ranks"] <= 1.01
    assert_exactly_once(sched)


def test_token_buffer_comes_from_the_body_on_the_synthetic_default():
    """The synthetic default has a tail of long one-tile samples; once it set Q_t (a 21-24% token pad)."""
    stats = synthetic_internvl_mixture(20_000, seed=0)
    for dp in (8, 32):
        m = schedule_metrics(balance(stats, dp_size=dp), stats)
        assert m["buffer_pad_tokens"] <= 0.03, (dp, m["buffer_pad_tokens"])
        assert m["buffer_pad_tiles"] <= 0.05, (dp, m["buffer_pad_tiles"])
        assert m["coverage_ok"] and m["microbatches_over_caps"] == 0


@pytest.mark.parametrize("dp_size", [8, 32])
def test_text_heavy_packs_do_not_cost_steps_on_the_synthetic_default(dp_size):
    """Its 1-tile samples of up to 4,000 tokens leave room for 1-2 tiles in their packs: with 1-D tile targets
    the repair filled those packs with tiles, the tail added steps, and the pads were 0.017-0.020 / 0.024-0.026
    (issue 17 item 6: <= 0.02 both)."""
    stats = synthetic_internvl_mixture(30_730, seed=0)
    # one draw (epoch 0), the same on every machine since issue 37; other epochs' derived Q_t moves between
    # 4272 and 4288 with the tail rule's growth (token pad 0.018-0.021 at DP 32, before and after that issue)
    sched = balance(stats, dp_size=dp_size)
    m = schedule_metrics(sched, stats)
    assert m["buffer_pad_tiles"] <= 0.016 and m["buffer_pad_tokens"] <= 0.02, (m["buffer_pad_tiles"],
                                                                                m["buffer_pad_tokens"])
    assert m["coverage_ok"] and m["microbatches_over_caps"] == 0
    assert_exactly_once(sched)


@pytest.mark.parametrize(("dp_size", "micro"), [(128, 1), (32, 4)])
def test_cap_search_skips_tight_tile_caps_the_text_cannot_leave(dp_size, micro):
    """128 micro-batches a step: 48 steps at Q_v 12 leave 306 spare tiles, fewer than the text-heavy samples'
    packs lose, but the tight-Q_v trial skipped that check; the packer then added a 49th step at Q_t 4312
    (pads 0.024 / 0.037, LLM worst step 1.17). 49 steps at Q_t 4272 (the largest sample) is the best the
    window allows: 0.0245 / 0.0278."""
    stats = synthetic_internvl_mixture(30_730, seed=0)
    sched = balance(stats, dp_size=dp_size, num_microbatches=micro)
    m = schedule_metrics(sched, stats)
    assert (m["num_steps"], sched.caps.tiles, sched.caps.tokens) == (49, 12, 4272)
    assert m["buffer_pad_tiles"] <= 0.025 and m["buffer_pad_tokens"] <= 0.028, (m["buffer_pad_tiles"],
                                                                                 m["buffer_pad_tokens"])
    assert m["llm_max_mean_ranks_worst"] <= 1.08
    assert m["coverage_ok"] and m["microbatches_over_caps"] == 0
    # and no packing does better: at 48 steps Q_t must rise to ~4,400 before the text fits (token pad 0.036)
    floor = pad_floor(stats.tiles, stats.tokens, slots_per_step=dp_size * micro)
    assert floor.tiles < 0.005 and floor.tokens < 0.002  # each alone: far lower
    assert floor.num_steps == 49
    assert floor.larger == pytest.approx(1 - stats.tokens.sum() / (49 * 128 * 4272))
    assert max(m["buffer_pad_tiles"], m["buffer_pad_tokens"]) == pytest.approx(floor.larger, abs=1e-9)


def test_a_runner_up_that_can_pad_less_is_packed_too():
    """The synthetic default at DP 32: the search ranks 194 steps first (193 needs Q_t 4344 as room for the
    text), and 194 needs no tail rule; but 193 steps can pad less (its least score, at Q_t 4272, is 0.010
    under 194's packed one), so it is packed too, and the squeeze brings its buffer to 4272-4280: a compute pad
    within 0.002 of the floor (194 steps: 0.016)."""
    stats = synthetic_internvl_mixture(30_730, seed=0)
    sched = balance(stats, dp_size=32)
    m = schedule_metrics(sched, stats)
    floor = pad_floor(stats.tiles, stats.tokens, slots_per_step=32, cost=DEFAULT_COST)
    assert (m["num_steps"], sched.caps.tiles) == (193, 12) and sched.caps.tokens <= 4288
    assert m["buffer_pad_compute"] <= max(0.01, floor.compute + 0.002), (m["buffer_pad_compute"], floor.compute)
    assert_exactly_once(sched)


def test_the_tile_repair_mends_hundreds_of_packs_one_tile_over():
    """The two-profile mixture (1, 3 and 5 tiles) at 104 steps of 8 x 8: an 18-tile pack needs an even sample
    count, and the deal leaves half the packs odd; after the pairing passes ~600 packs are one tile over, which
    the targeted repair (one partner per off pack and round) mends in tens of rounds, not 4. Once the tail
    rule added two steps of 64 packs for them (compute pad 0.014); the schedule now keeps 104 steps."""
    stats = two_profile_mixture(30_000)
    v, t = stats.tiles.astype(np.float64), stats.tokens.astype(np.float64)
    lc = to_grid(DEFAULT_COST.grid_costs(stats.tiles, stats.tokens)[1])
    p, qv, qt = 104 * 64, 18, 5328
    for seed in range(2):
        rng = np.random.default_rng(seed)
        packs = Packs(_deal(v, t, lc, p, qv, qt, rng), v, t, lc)
        repair_tiles(packs, Targets.of(v, t, lc, p, qv, qt, 0.01), rng)
        assert (packs.pv > qv).sum() == 0 and (packs.pt > qt).sum() == 0
        assert np.array_equal(np.sort(packs.slots[packs.slots < packs.n]), np.arange(len(v)))  # each sample once
    m = schedule_metrics(sched := balance(stats, dp_size=8, num_microbatches=8), stats)
    assert m["num_steps"] == 104 and m["buffer_pad_compute"] <= 0.01
    assert_exactly_once(sched)


@pytest.mark.parametrize("tolerance", [0.05, 0.15, 0.3])
def test_mean_samples_per_microbatch_stays_within_the_tolerance(shared_stats_dir, tolerance):
    stats = real_stats(str(shared_stats_dir), "merged")
    for dp in (8, 32):
        m = schedule_metrics(balance(stats, dp_size=dp, config=BalanceConfig(samples_tolerance=tolerance)), stats)
        assert 4.5 * (1 - tolerance) - 1e-9 <= m["samples_per_microbatch_mean"] <= 4.5 * (1 + tolerance) + 1e-9


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan"), "0.2"])
def test_samples_tolerance_is_checked(bad):
    with pytest.raises(InputError) as err:
        BalanceConfig(samples_tolerance=bad)
    assert err.value.field == "samples_tolerance"


def test_pad_floor_of_a_long_sample_and_the_pads_above_it():
    """One 4,000-token sample among 500-token ones: the token buffer holds it, and a pack of at most
    4.5 x 1.15 samples (2,588 tokens) leaves >= 35% of it empty; a wider tolerance lowers the bound."""
    rng = np.random.default_rng(0)
    n = 4000
    tiles = rng.choice([1, 3], n)
    tokens = np.full(n, 500)
    tokens[7] = 4000
    stats = SampleStats.from_arrays(tiles=tiles, tokens=tokens, source="one-long")
    floor = pad_floor(stats.tiles, stats.tokens, slots_per_step=8)
    packs = floor.num_steps * 8
    assert floor.samples_per_microbatch == pytest.approx(n / packs)
    assert 4.5 * 0.85 <= floor.samples_per_microbatch <= 4.5 * 1.15
    assert floor.tokens == pytest.approx(1 - tokens.sum() / (packs * 4000))
    assert floor.tokens > 0.35
    assert floor.larger == floor.tokens  # the token bound decides here
    m = schedule_metrics(balance(stats, dp_size=8), stats)
    assert m["buffer_pad_tokens"] >= floor.tokens - 1e-9
    wide = pad_floor(stats.tiles, stats.tokens, slots_per_step=8, samples_tolerance=0.6)
    assert wide.tokens < floor.tokens - 0.1
    m = schedule_metrics(balance(stats, dp_size=8, config=BalanceConfig(samples_tolerance=0.6)), stats)
    assert wide.tokens - 1e-9 <= m["buffer_pad_tokens"] < floor.tokens


def test_pad_floor_counts_the_big_samples_a_pack_can_hold():
    """All five-tile samples at 4.1 a pack: the mean pack is 20.5 tiles, but 21 and 22-tile packs hold at
    most four of them (more than 4 x P samples are bigger than 22/5): the cap is at least 25."""
    stats = SampleStats.from_arrays(tiles=np.full(4100, 5), tokens=np.full(4100, 1400), source="fives")
    floor = pad_floor(stats.tiles, stats.tokens, slots_per_step=100, samples_tolerance=0.0, target_samples=4.1)
    assert floor.num_steps == 10
    assert floor.tiles == pytest.approx(1 - 4100 * 5 / (1000 * 25))


def test_pad_floor_counts_the_room_the_dominant_size_leaves(shared_stats_dir):
    """chartqa (16,628 five-tile, 1,096 three-tile, 14 four-tile, 579 one-tile samples) at 33 steps of 128:
    V/P = 20.6, but a 21- or 22-tile cap leaves a pack of four five-tile samples room for ones only; the
    packs are 4 x 4,224 - 16,628 = 268 five-tile samples short of four each, and each one short makes room
    for at most two threes or fours (1,110 exist): at least 23 tiles. Over the window the best is 2.8%
    (35 steps at 20 tiles, or 28 at 25), and the packer measures exactly that."""
    stats = real_stats(str(shared_stats_dir), "chartqa")
    floor = pad_floor(stats.tiles, stats.tokens, slots_per_step=128)
    total = float(stats.tiles.sum())
    assert floor.tiles == pytest.approx(1 - total / (35 * 128 * 20))  # = 1 - V / (28 x 128 x 25)
    assert floor.tiles > 0.028
    m = schedule_metrics(balance(stats, dp_size=128), stats)
    assert m["buffer_pad_tiles"] == pytest.approx(floor.tiles, abs=1e-9)
    assert pad_floor(stats.tiles, stats.tokens, slots_per_step=128, samples_tolerance=0.4).tiles < 0.015


@pytest.mark.parametrize("which", ["ai2d", "chartqa", "merged"])
def test_measured_pads_are_not_below_the_floor(shared_stats_dir, which):
    stats = real_stats(str(shared_stats_dir), which)
    for dp in (8, 32, 128):
        sched = balance(stats, dp_size=dp)
        m = schedule_metrics(sched, stats)
        floor = pad_floor(stats.tiles, stats.tokens, slots_per_step=dp)
        assert m["buffer_pad_tiles"] >= floor.tiles - 1e-9 and m["buffer_pad_tokens"] >= floor.tokens - 1e-9
        assert max(m["buffer_pad_tiles"], m["buffer_pad_tokens"]) >= floor.larger - 1e-9
        if (which, dp) != ("chartqa", 128):  # the one case whose floor is 0.028 (test above)
            assert floor.larger <= 0.02


def _balance_imports() -> dict[str, set[str]]:
    """Module -> the modules of omnibal.data.balance it imports (anywhere in the file, functions too)."""
    package = "omnibal.data.balance"
    graph = {}
    for path in BALANCE_DIR.glob("*.py"):
        name = package if path.stem == "__init__" else f"{package}.{path.stem}"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
                edges.add(node.module)
                edges |= {f"{node.module}.{a.name}" for a in node.names
                          if (BALANCE_DIR / f"{a.name}.py").exists() and node.module == package}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.startswith(package)}
        graph[name] = edges - {name}
    return graph


def test_balance_module_imports_are_acyclic():
    graph = _balance_imports()
    state: dict[str, int] = {}

    def visit(module, trail):
        if state.get(module) == 1:
            pytest.fail("import cycle: " + " -> ".join(trail + [module]))
        if state.get(module) == 2:
            return
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            visit(dep, trail + [module])
        state[module] = 2

    for module in sorted(graph):
        visit(module, [])
    inner = {m for m, deps in graph.items() if "omnibal.data.balance" in deps and m != "omnibal.data.balance"}
    assert not inner, f"modules importing their own package: {inner}"


def test_balance_functions_are_short():
    long = []
    for path in BALANCE_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_tail_phase_is_deterministic_and_reshuffles_per_epoch():
    """Caps that need the tail phase (new steps of packs): the same schedule for the same inputs."""
    rng = np.random.default_rng(3)
    tiles = rng.choice([1, 3, 5], 3000, p=[0.1, 0.1, 0.8])
    stats = SampleStats.from_arrays(tiles=tiles, tokens=tiles * 256 + rng.integers(50, 400, 3000), source="r")
    config = BalanceConfig(max_tiles=12, max_tokens=4096)
    a = balance(stats, dp_size=4, num_microbatches=2, seed=5, epoch=1, config=config)
    b = balance(stats, dp_size=4, num_microbatches=2, seed=5, epoch=1, config=config)
    c = balance(stats, dp_size=4, num_microbatches=2, seed=5, epoch=2, config=config)
    assert a.meta["exchange_passes"][2] > 0  # the tail phase ran
    assert a.equals(b) and a.to_json() == b.to_json()
    assert not a.equals(c)
    for sched in (a, c):
        assert_exactly_once(sched)
        _assert_under_caps(sched, stats)
