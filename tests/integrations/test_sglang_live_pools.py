"""``stagecache pools --json`` == what sglang 0.5.23 really allocates, field by field.

Runs in ``.venv-sglang`` (see tests/support/sglang_real.py for how sglang's own objects are
built on CPU from a real ``ServerArgs``/``ModelConfig`` and the real 44-entry flash
config).  Every figure on sglang's side is read from its objects: tensor shapes and
``nbytes``, the pool's own page bytes, its configurator's token budgets, the
assembler's host-page function and the host pools it builds.
"""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")

from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa  # noqa: E402
from sglang.srt.runtime_context import get_memory, get_schedule  # noqa: E402
from sglang_real import (  # noqa: E402
    SGLANG_POOL_NAMES,
    build_stage,
    cache_params,
    host_pages,
    kind_page_bytes,
    kind_tensors,
    model_dir,
    on_cpu,
    partition_env,
    published,
)
from stagecache.runtime.cli.main import main  # noqa: E402
from stagecache.runtime.model.families.deepseek_v4 import KINDS, POOLS  # noqa: E402

TOKENS = 262_144
LAYOUTS = [(1, None), (2, None), (4, None), (8, None),
           (2, (22, 21)), (4, (11, 11, 11, 10)), (8, (6, 6, 6, 5, 5, 5, 5, 5))]


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory):
    logging.getLogger("sglang").setLevel(logging.WARNING)
    return model_dir(tmp_path_factory.mktemp("models"))


def pools_json(capsys, pp: int, partition, page: int, *extra: str) -> dict:
    argv = ["pools", "--model", "deepseek-v4-flash", "--pp-size", str(pp), "--page-size", str(page), "--json",
            *extra]
    if partition:
        argv += ["--pp-partition", ",".join(map(str, partition))]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def units(stage, kind: str) -> int:
    """Pages (or request slots) sglang sizes ``kind`` by, from its allocator and pool."""
    kv, page = stage.kvcache, get_schedule().page_size
    return {"full": -(-stage.allocator.size_full // page), "swa": -(-kv.swa_size // kv.swa_page_size),
            "request": kv.num_req_slots}[KINDS[kind].budget]


def assert_stage_matches(ours: dict, stage) -> None:
    kv = stage.kvcache
    tensors, page_bytes = kind_tensors(kv), kind_page_bytes(kv)
    full_host, swa_host, c128_host = host_pages(stage)
    host = {"full": full_host, "swa": swa_host}
    assert (ours["start_layer"], ours["end_layer"]) == (kv.start_layer, kv.end_layer)
    assert (ours["full_tokens"], ours["swa_tokens"], ours["request_slots"]) == (
        stage.config.full_max_total_num_tokens, stage.config.swa_max_total_num_tokens, kv.num_req_slots)
    rows = {r["pool"]: r for r in ours["pools"]}
    assert set(rows) == set(POOLS)
    for kind in POOLS:
        r, ts = rows[kind], tensors[kind]
        got = {
            "buffers": len(ts), "page_bytes": page_bytes[kind], "device_pages": units(stage, kind),
            "tensor_rows": {t.shape[0] for t in ts}, "tensor_row_bytes": {t[0].nbytes for t in ts},
            "device_bytes": sum(t.nbytes for t in ts),
        }
        want = {**{k: r[k] for k in ("buffers", "page_bytes", "device_pages", "device_bytes")},
                "tensor_rows": {r["tensor_rows"]}, "tensor_row_bytes": {r["tensor_row_bytes"]}}
        assert got == want, (ours["stage"], kind)
        if kind == "c128":
            assert r["host_pages"] == c128_host
        elif r["host_cached"]:
            assert r["host_pages"] == host[KINDS[kind].budget], (ours["stage"], kind)
    every_tensor = [t for ts in tensors.values() for t in ts]
    assert ours["device_bytes"] == sum(t.nbytes for t in every_tensor)  # the stage total, to the byte


@pytest.mark.parametrize("page", [64, 256])
@pytest.mark.parametrize(("pp", "partition"), LAYOUTS,
                         ids=[f"pp{pp}-" + (",".join(map(str, part)) if part else "even") for pp, part in LAYOUTS])
def test_pools_json_equals_sglangs_pools(capsys, flash_dir, pp, partition, page):
    report = pools_json(capsys, pp, partition, page, "--max-total-tokens", str(TOKENS))
    with partition_env(partition), published(flash_dir, pp_size=pp, page_size=page, max_total_tokens=TOKENS) as (sa, mc):
        assert len(mc.compress_ratios) == 44 and mc.num_hidden_layers == 43  # the real config
        assert report["page_size"] == get_schedule().page_size == 256  # sglang overrides 64 too
        assert report["requested_page_size"] == page
        assert len(report["stages"]) == pp
        for ours in report["stages"]:
            assert_stage_matches(ours, build_stage(sa, mc, ours["stage"], pp))


def test_mem_budget_gives_sglangs_full_tokens(capsys, flash_dir):
    budget_gb = 12
    report = pools_json(capsys, 4, None, 256, "--mem-budget-gb", str(budget_gb))
    with published(flash_dir, pp_size=4) as (sa, mc):
        stages = [build_stage(sa, mc, r, 4, budget_bytes=budget_gb << 30) for r in range(4)]
    # sglang all-reduces the token capacity with MIN across PP ranks
    full = min(s.config.full_max_total_num_tokens for s in stages)
    assert {s["full_tokens"] for s in report["stages"]} == {full}
    assert any(s.config.full_max_total_num_tokens > full for s in stages)  # the ranks do differ


def test_host_pools_are_sglangs_hicache_stack(capsys, flash_dir):
    """Run the real assembler on small real CPU pools: which kinds it mirrors, and their bytes."""
    report = pools_json(capsys, 4, None, 256, "--max-total-tokens", "16384", "--max-running-requests", "4")
    with published(flash_dir, pp_size=4, max_total_tokens=16384, max_running_requests=4) as (sa, mc), \
            on_cpu():
        for ours in report["stages"]:
            stage = build_stage(sa, mc, ours["stage"], 4, device="cpu")
            assert_stage_matches(ours, stage)
            group, _ = hpa.build_deepseek_v4_hicache_stack(
                params=cache_params(stage), kvcache=stage.kvcache, load_cache_event=None, storage_backend=None)
            mirrored = {SGLANG_POOL_NAMES[str(e.name)]: e.host_pool for e in group.entries if str(e.name) != "kv"}
            rows = {r["pool"]: r for r in ours["pools"]}
            assert set(mirrored) == {p for p, r in rows.items() if r["host_cached"]}
            assert "c128_state" not in mirrored  # per-request, never mirrored
            for kind, hp in mirrored.items():
                item = getattr(hp, "item_bytes", None) or hp.state_page_bytes
                assert (hp.layer_num, hp.num_host_pages, item) == (
                    rows[kind]["buffers"], rows[kind]["host_pages"], rows[kind]["page_bytes"]), kind
                assert hp.kv_buffer.nbytes == rows[kind]["host_bytes"], kind
            assert sum(hp.kv_buffer.nbytes for hp in mirrored.values()) == ours["host_bytes"]


def test_host_size_in_bytes_is_refused_like_sglang(capsys, flash_dir):
    assert main(["pools", "--model", "deepseek-v4-flash", "--pp-size", "4", "--hicache-size-gb", "64"]) == 2
    ours = capsys.readouterr().err.strip()
    assert "does not support a host size in bytes" in ours and "--hicache-ratio" in ours
    with published(flash_dir, pp_size=4, max_total_tokens=TOKENS, hicache_size=64) as (sa, mc):
        assert get_memory().hicache_size == 64
        stage = build_stage(sa, mc, 0, 4)
        with pytest.raises(ValueError, match="DeepSeek V4 HiCache currently does not support --hicache-size; "
                                             "use --hicache-ratio instead"):
            host_pages(stage)
