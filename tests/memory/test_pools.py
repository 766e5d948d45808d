"""StagePools / HostPools: allocated exactly as the stage plan says, faults included; lookups."""

from __future__ import annotations

import pytest
import torch
from plans import pools, run_plan, stage_plan
from stagecache.runtime.errors import ConfigError, LayerNotOwnedError
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.memory.pools import StagePools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.plan.plan import Sizing, build_plan
from stagecache.runtime.validation.checks import validate_stage

TINY = load_spec("tiny-v4")
LAYOUT = build_layout(TINY, 2)
S1 = LAYOUT.stages[1]


def test_pools_are_stage_local_and_lookup_uses_global_ids():
    p = pools(TINY, S1, 128, 4)
    assert validate_stage(p.stage_map, p.inventory()) == []
    assert len(p.buffers["swa"]) == S1.local_layers
    assert p.get_raw_buffer("swa", S1.start) is p.buffers["swa"][0]
    first_c4 = S1.pool_layers("c4")[0].global_id
    assert p.get_raw_buffer("c4", first_c4) is p.buffers["c4"][0]
    assert p.get_raw_buffer("c4", first_c4) is p.buffers["c4"][0]
    assert p.get_raw_buffer("c4_state", first_c4) is p.buffers["c4_state"][0]
    assert p.allocator.num_pages == 4 and p.allocator.name == "stage 1 device"
    inv = p.inventory()
    assert inv.stage == 1 and inv.counts(S1.pools)["swa"] == S1.local_layers


def test_every_tensor_is_the_plans_shape():
    plan = stage_plan(TINY, S1, 128, 4)
    p = StagePools(plan)
    for pp in plan.pools:
        assert len(p.buffers[pp.pool]) == len(pp.buffers)
        assert all(t.shape == (pp.units, pp.page_bytes) for t in p.buffers[pp.pool])
    assert sum(p.pool_bytes().values()) == plan.device_bytes
    assert p.pool_page_bytes() == plan.pool_page_bytes()


def test_wrong_layer_id_names_stage_and_range():
    p = pools(TINY, S1, 128, 2)
    with pytest.raises(LayerNotOwnedError, match=r"stage 1 owns global layers \[6, 12\); layer 2"):
        p.get_raw_buffer("swa", 2)
    with pytest.raises(ValueError, match="stage 1 owns"):  # the ValueError sglang raises for mapping errors
        p.get_raw_buffer("swa", 12)
    ratio4 = next(e.global_id for e in S1.layers if e.compress_ratio == 4)
    with pytest.raises(LayerNotOwnedError, match="compress ratio 4 and no C128 KV buffer"):
        p.get_raw_buffer("c128", ratio4)
    p0 = pools(TINY, LAYOUT.stages[0], 128, 2)
    with pytest.raises(LayerNotOwnedError, match="compress ratio 0 and no C4 KV buffer"):
        p0.get_raw_buffer("c4", 0)


def test_global_swa_fault_really_builds_global_sized_pool():
    plan = run_plan(TINY, 2, ["global-swa"], page_size=128, pages=2)
    p = StagePools(plan.stage(1))
    assert len(p.buffers["swa"]) == TINY.num_layers
    errors = validate_stage(p.stage_map, p.inventory())
    assert [e.pool for e in errors] == ["swa"]
    assert "SWA KV pool must be PP-stage-local: got 12 buffers for 6" in errors[0].message


def test_missing_c4_state_fault_has_a_real_none_and_the_host_mirrors_it():
    plan = run_plan(TINY, 2, ["missing-c4-state"], page_size=128, pages=2)
    p = StagePools(plan.stage(1))
    assert p.buffers["c4_state"][-1] is None
    h = HostPools(p)
    assert h.buffers["c4_state"][-1] is None
    assert "state_pools must not contain None" in validate_stage(p.stage_map, h.inventory())[0].message
    last_c4 = S1.pool_layers("c4_state")[-1].global_id
    with pytest.raises(LayerNotOwnedError, match="stage 1 device pools .* is None"):
        p.get_raw_buffer("c4_state", last_c4)


@pytest.mark.parametrize(("pages", "page_size", "match"), [
    (0, 128, "positive integer"), (-1, 128, "positive integer"), (2.5, 128, "positive integer"),
    (4, 0, "page-size"), (4, -128, "page-size"), (4, 96, "multiple of 128"),
])
def test_bad_sizes_fail_before_allocating(pages, page_size, match):
    with pytest.raises(ConfigError, match=match):
        pools(TINY, S1, page_size, pages)


def test_more_than_memory_allows_is_config_error():
    with pytest.raises(ConfigError, match=r"stage 1 device pools: .* needed, only .* free on cpu"):
        pools(TINY, S1, 128, 10**9)


def test_pools_are_allocated_from_a_runtime_plan_only():
    sglang_sized = build_plan(TINY, 2, page_size=128, sizing=Sizing.sglang(max_total_tokens=65536))
    with pytest.raises(ConfigError, match="sized the sglang way"):
        StagePools(sglang_sized.stage(1))


def test_host_sizes_and_layouts():
    assert HostPools(pools(TINY, S1, 128, 4)).num_pages == 8  # sglang's default ratio 2.0
    assert HostPools(pools(TINY, S1, 128, 4, hicache_ratio=1.5)).num_pages == 6
    p = pools(TINY, S1, 128, 4, host_pages=5)
    assert HostPools(p).num_pages == 5
    pf = HostPools(p, layout="page_first")
    t = pf.pool_tensors["swa"]
    assert t.shape == (5, S1.local_layers, p.page_bytes("swa"))
    assert pf.buffers["swa"][2].data_ptr() == t.data_ptr() + 2 * p.page_bytes("swa")
    assert pf.page_stride("swa") == S1.local_layers * p.page_bytes("swa")
    lf = HostPools(p)
    assert all(b.shape == (5, p.page_bytes("swa")) and b.is_contiguous() for b in lf.buffers["swa"])
    assert lf.pool_bytes() == pf.pool_bytes()
    assert sum(lf.pool_bytes().values()) == p.plan.host_bytes
    assert lf.allocator.name == "stage 1 host"
    assert lf.get_raw_buffer("swa", S1.start) is lf.buffers["swa"][0]
    assert not lf.pinned  # no CUDA here


def test_host_bad_sizes():
    with pytest.raises(ConfigError, match="host RAM available"):
        HostPools(pools(TINY, S1, 128, 4, host_pages=10**9))
    with pytest.raises(ConfigError, match="positive integer"):
        pools(TINY, S1, 128, 4, host_pages=0)
    p = pools(TINY, S1, 128, 4)
    with pytest.raises(ConfigError, match="layout"):
        HostPools(p, layout="sideways")
    with pytest.raises(ConfigError, match="hicache-ratio"):
        pools(TINY, S1, 128, 4, hicache_ratio=-1)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs CUDA"):
            HostPools(p, pin_memory=True)
