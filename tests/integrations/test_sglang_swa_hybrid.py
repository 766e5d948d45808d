"""SWA hybrids: ``stagecache pools --json`` / ``check --json`` == what sglang 0.5.23 builds, field by field.

Runs in ``.venv-sglang``.  For the gpt-oss-20b preset (its published config.json) sglang's own
``KVCacheConfigurator`` + ``HybridSWAPoolConfigurator`` size each PP rank and ``_init_pools``
builds its ``SWAKVPool``; the assembler's ``build_hybrid_swa_stack`` builds the HiCache host pools
on CPU.  Every figure on sglang's side is read from its objects: buffer lists, tensor shapes and
``nbytes``, the pool's ``layers_mapping``, the host pools' pages and bytes, the transfer maps and
bound, the configurator's token budgets and its assertions.
"""

from __future__ import annotations

import json
import logging

import pytest

sglang = pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")
if sglang.__version__ != "0.5.23":  # the release these pools are modelled on (0.5.22 splits K and V)
    pytest.skip(f"SWA-hybrid pools are modelled on sglang 0.5.23, this is {sglang.__version__}",
                allow_module_level=True)

from sglang.srt.runtime_context import get_schedule  # noqa: E402
from sglang_real import on_cpu, partition_env  # noqa: E402
from sglang_swa import (  # noqa: E402
    ROOT,  # noqa: E402
    host_stack,
    max_tokens_alone,
    model_folder,
    published,
    rank_pools,
    sliding_window,
    sub_pools,
)
from stagecache.runtime.cli.main import main  # noqa: E402

MODEL = "gpt-oss-20b"
TOKENS = 65_536
LAYOUTS = [(1, None), (2, None), (3, None), (4, None), (2, (9, 15)), (4, (5, 7, 7, 5)), (4, (8, 5, 6, 5))]
IDS = [f"pp{pp}-" + (",".join(map(str, part)) if part else "even") for pp, part in LAYOUTS]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    logging.getLogger("sglang").setLevel(logging.ERROR)
    return model_folder(tmp_path_factory.mktemp("models"), MODEL)


def cli_json(capsys, command: str, pp: int, partition, page: int, *extra: str, model: str = MODEL) -> dict:
    argv = [command, "--model", model, "--pp-size", str(pp), "--page-size", str(page), "--json", *extra]
    if partition:
        argv += ["--pp-partition", ",".join(map(str, partition))]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    return json.loads(out)


def assert_device_pools(ours: dict, rank) -> None:
    """Per kind: buffers (K and V), bytes per token and page, tensor rows, device bytes, and K/V as
    halves of one allocation exactly when their shapes match."""
    kv, page = rank.kvcache, get_schedule().page_size
    assert (ours["start_layer"], ours["end_layer"]) == (rank.start, rank.end)
    rows = {r["pool"]: r for r in ours["pools"]}
    pools = sub_pools(kv)
    total = 0
    for kind, pool in pools.items():
        r = rows[kind]
        assert len(pool.k_buffer) == len(pool.v_buffer) == r["buffers"] == r["present"], kind
        token = pool.k_buffer[0][0].nbytes + pool.v_buffer[0][0].nbytes if pool.k_buffer else r["row_bytes"]
        got = {"row_bytes": token, "page_bytes": token * page, "device_pages": pool.size // page,
               "tensor_rows": {t.shape[0] for t in pool.k_buffer} | {t.shape[0] for t in pool.v_buffer},
               "device_bytes": sum(t.nbytes for t in (*pool.k_buffer, *pool.v_buffer))}
        want = {"row_bytes": r["row_bytes"], "page_bytes": r["page_bytes"], "device_pages": r["device_pages"],
                "tensor_rows": {r["tensor_rows"]} if r["buffers"] else set(), "device_bytes": r["device_bytes"]}
        assert got == want, (ours["stage"], kind)
        for k, v in zip(pool.k_buffer, pool.v_buffer, strict=True):
            fused = k._base is not None and k._base is v._base
            assert fused == (k.shape == v.shape), kind
        total += got["device_bytes"]
    assert {p for p, r in rows.items() if r["buffers"]} <= set(pools)
    assert ours["device_bytes"] == total


def assert_layer_map(checked: dict, rank) -> None:
    """Every layer: its kind and sub-pool index are sglang's ``layers_mapping``; the id HiCache
    signals (the assembler's transfer map key) and the id the pool waits on (``layer_id -
    start_layer``) are both ours."""
    kv = rank.kvcache
    mapping = getattr(kv, "layers_mapping", None)
    for e in checked["layers"]:
        g = e["global"]
        if mapping is not None:
            index, is_swa = mapping[g]
            assert (e["layer_kind"], e["sub_pool_id"]) == ("swa" if is_swa else "full", index), g
        else:
            assert (e["layer_kind"], e["sub_pool_id"]) == ("kv", g - kv.start_layer), g
        assert e["wait_id"] == g - kv.start_layer, g
    assert len(checked["layers"]) == rank.end - rank.start


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize(("pp", "partition"), LAYOUTS, ids=IDS)
def test_pools_and_check_equal_sglangs_swa_pools(capsys, folder, pp, partition, page):
    report = cli_json(capsys, "pools", pp, partition, page, "--max-total-tokens", str(TOKENS))
    checked = cli_json(capsys, "check", pp, partition, page)
    assert checked["ok"] and report["page_size"] == page
    with partition_env(partition), published(folder, pp_size=pp, page_size=page, max_total_tokens=TOKENS) as (sa, mc):
        assert mc.num_hidden_layers == 24 and sliding_window(mc) == 127  # the real config, sglang's window
        assert get_schedule().swa_full_tokens_ratio == report["sizing"]["swa_full_tokens_ratio"] == 0.8
        for ours, mine in zip(report["stages"], checked["stages"], strict=True):
            rank = rank_pools(sa, mc, ours["stage"], pp)
            assert (ours["full_tokens"], ours["swa_tokens"]) == (
                rank.config.full_max_total_num_tokens, rank.config.swa_max_total_num_tokens)
            assert_device_pools(ours, rank)
            assert_layer_map(mine, rank)


@pytest.mark.parametrize(("pp", "partition", "page"), [(1, None, 16), (2, None, 16), (4, (5, 7, 7, 5), 1),
                                                       (4, (8, 5, 6, 5), 16)])
def test_host_pools_and_transfer_ids_are_sglangs_hicache_stack(capsys, folder, pp, partition, page):
    """sglang's assembler on real CPU pools: host pools per kind (layers, pages, bytes), the
    transfer maps (global ids with holes below the stage) and the bound."""
    tokens = 1024
    report = cli_json(capsys, "pools", pp, partition, page, "--max-total-tokens", str(tokens))
    checked = cli_json(capsys, "check", pp, partition, page)
    with partition_env(partition), published(folder, pp_size=pp, page_size=page, max_total_tokens=tokens) as (sa, mc), \
            on_cpu():
        for ours, mine in zip(report["stages"], checked["stages"], strict=True):
            rank = rank_pools(sa, mc, ours["stage"], pp, device="cpu")
            assert_device_pools(ours, rank)
            hosts, maps, bound = host_stack(rank)
            rows = {r["pool"]: r for r in ours["pools"]}
            assert {k for k, r in rows.items() if r["buffers"]} == set(hosts)
            for kind, hp in hosts.items():
                r = rows[kind]
                assert (hp.layer_num, hp.page_num, hp.size_per_token * page) == (
                    r["buffers"], r["host_pages"], r["buffers"] * r["page_bytes"]), kind
                assert hp.kv_buffer.nbytes == r["host_bytes"], kind
            assert sum(hp.kv_buffer.nbytes for hp in hosts.values()) == ours["host_bytes"]
            # transfer ids: the assembler's map keys are ours, global (holes below the stage start)
            for kind, mapping in maps.items():
                layers = [e for e in mine["layers"] if e["layer_kind"] == kind]
                assert mapping == {e["transfer_id"]: e["sub_pool_id"] for e in layers}, kind
                assert all(e["transfer_id"] == e["wait_id"] == e["global"] for e in layers)
            assert bound == ours["end_layer"] == max(e["transfer_id"] for e in mine["layers"]) + 1


def test_mem_budget_gives_sglangs_tokens_each_stage_alone_then_the_minimum(capsys, folder):
    budgets = (2, 1.5, 1.75, 1)
    report = cli_json(capsys, "pools", 4, (5, 7, 7, 5), 16, "--mem-budget-gb", *map(str, budgets))
    with partition_env((5, 7, 7, 5)), published(folder, pp_size=4, page_size=16) as (sa, mc):
        alone = [max_tokens_alone(sa, mc, r, 4, int(b * (1 << 30))) for r, b in enumerate(budgets)]
        assert [s["capacity"]["tokens_alone"] for s in report["stages"]] == alone
        assert {s["full_tokens"] for s in report["stages"]} == {min(alone)}
        assert len(set(alone)) > 1
        with published(folder, pp_size=4, page_size=16, max_total_tokens=min(alone)) as (sa2, mc2):
            for ours in report["stages"]:
                assert_device_pools(ours, rank_pools(sa2, mc2, ours["stage"], 4))


def test_swa_pool_below_the_window_is_refused_like_sglang(capsys, folder):
    tokens = 160  # 0.8 x 160 = 128 SWA tokens < window 127 + page 16
    assert main(["pools", "--model", MODEL, "--page-size", "16", "--max-total-tokens", str(tokens)]) == 2
    assert "cannot hold even one request" in capsys.readouterr().err
    with published(folder, page_size=16, max_total_tokens=tokens) as (sa, mc), \
            pytest.raises(ValueError, match="cannot hold even one request"):
        rank_pools(sa, mc, 0, 1)


def test_a_stage_without_a_sliding_layer_fails_in_sglang_and_check_says_so(capsys, folder):
    partition = (1, 1, 22)  # stage 1 owns layer 1 alone: full attention
    code = main(["check", "--model", MODEL, "--pp-size", "3", "--pp-partition", "1,1,22", "--page-size", "1"])
    out = capsys.readouterr().out
    assert code == 1 and "stage 1: no sliding-window layer in [1, 2)" in out
    report = cli_json(capsys, "pools", 3, partition, 1)
    assert [p["stage"] for p in report["stage_problems"]] == [1]
    suggested = report["suggested_partition"]
    with partition_env(partition), published(folder, pp_size=3, page_size=1, max_total_tokens=TOKENS) as (sa, mc), \
            pytest.raises(AssertionError, match="Hybrid SWA model must have at least one SWA layer"):
        rank_pools(sa, mc, 1, 3)
    with partition_env(suggested), published(folder, pp_size=3, page_size=1, max_total_tokens=TOKENS) as (sa, mc):
        for r in range(3):
            rank_pools(sa, mc, r, 3)  # sglang builds every stage of the suggested partition
    assert cli_json(capsys, "check", 3, suggested, 1)["ok"]


def test_a_stage_of_sliding_layers_only_fails_at_pages_above_one(capsys, folder):
    partition = (1, 23)  # stage 0 owns layer 0 alone: sliding window
    code = main(["check", "--model", MODEL, "--pp-size", "2", "--pp-partition", "1,23", "--page-size", "16"])
    assert code == 1 and "PureSWATokenToKVPoolAllocator asserts page_size == 1" in capsys.readouterr().out
    with partition_env(partition), published(folder, pp_size=2, page_size=16, max_total_tokens=TOKENS) as (sa, mc), \
            pytest.raises(AssertionError):
        rank_pools(sa, mc, 0, 2)
    # at page 1 sglang builds it, its SWA sub-pool taking the whole token budget (no ratio)
    report = cli_json(capsys, "pools", 2, partition, 1, "--max-total-tokens", str(TOKENS))
    assert cli_json(capsys, "check", 2, partition, 1)["ok"]
    with partition_env(partition), published(folder, pp_size=2, page_size=1, max_total_tokens=TOKENS) as (sa, mc):
        for ours in report["stages"]:
            rank = rank_pools(sa, mc, ours["stage"], 2)
            assert_device_pools(ours, rank)
        assert rank_pools(sa, mc, 0, 2).config.swa_max_total_num_tokens == TOKENS


@pytest.mark.parametrize("fault", ["global-swa-subpool", "global-full-subpool"])
def test_a_sub_pool_sized_globally_is_what_sglang_builds_from_the_global_list(capsys, folder, fault):
    """sglang's pool built with the model's whole sliding (or full) layer list: its buffers and
    bytes are the faulted plan's, and check refuses it naming stage and pool."""
    report = cli_json(capsys, "pools", 2, None, 16, "--max-total-tokens", str(TOKENS), "--fault", fault)
    code = main(["check", "--model", MODEL, "--pp-size", "2", "--page-size", "16", "--fault", fault, "--json"])
    checked = json.loads(capsys.readouterr().out)
    kind = "swa" if fault.startswith("global-swa") else "full"
    assert code == 1 and {(e["stage"], e["pool"]) for s in checked["stages"] for e in s["errors"]} == {(0, kind), (1, kind)}
    with published(folder, pp_size=2, page_size=16, max_total_tokens=TOKENS) as (sa, mc):
        for ours in report["stages"]:
            start, end = ours["start_layer"], ours["end_layer"]
            swa = [i for i in mc.swa_attention_layer_ids if start <= i < end]
            full = [i for i in mc.full_attention_layer_ids if start <= i < end]
            lists = (mc.swa_attention_layer_ids, full) if kind == "swa" else (swa, mc.full_attention_layer_ids)
            rank = rank_pools(sa, mc, ours["stage"], 2, layer_lists=lists)
            assert_device_pools(ours, rank)
            assert len(sub_pools(rank.kvcache)[kind].k_buffer) == 12


DATA = ROOT / "tests" / "data" / "swa_hybrid"
#: One test config per other architecture (shaped after the published ones): MiMo-V2 reads
#: ``hybrid_layer_pattern`` and its own SWA shape, Gemma 4 a nested ``text_config`` with the full
#: shape as ``global_head_dim`` / ``num_global_key_value_heads``, Step-3.5 ``layer_types`` (and
#: runs as one MHA pool under HiCache).
OTHERS = ("mimo-v2-flash", "gemma-4", "step-3.5-flash")


@pytest.mark.parametrize("name", OTHERS)
@pytest.mark.parametrize(("pp", "partition"), [(1, None), (2, None), (4, "uneven")], ids=["pp1", "pp2", "pp4-uneven"])
def test_other_architectures_equal_sglangs_pools(capsys, tmp_path, name, pp, partition):
    from stagecache.runtime.model.families import load_spec

    config = json.loads((DATA / f"{name}.json").read_text())
    folder = model_folder(tmp_path, name, config)
    path = str(folder / "config.json")
    layers = load_spec(path).num_layers
    if partition == "uneven":
        q = layers // 4
        partition = (q - 1, q + 1, q, layers - 3 * q)
    report = cli_json(capsys, "pools", pp, partition, 16, "--max-total-tokens", "8192", model=path)
    checked = cli_json(capsys, "check", pp, partition, 16, model=path)
    assert checked["ok"]
    spec = load_spec(path)
    with partition_env(partition), published(folder, pp_size=pp, page_size=16, max_total_tokens=8192) as (sa, mc):
        if mc.is_hybrid_swa:  # the layer lists are sglang's
            assert [i for i, k in enumerate(spec.layer_kinds) if k == "swa"] == mc.swa_attention_layer_ids
            assert [i for i, k in enumerate(spec.layer_kinds) if k == "full"] == mc.full_attention_layer_ids
            assert spec.family.swa_floor_tokens(spec) == sliding_window(mc)
        else:
            assert set(spec.layer_kinds) == {"kv"} and name == "step-3.5-flash"
        for ours, mine in zip(report["stages"], checked["stages"], strict=True):
            rank = rank_pools(sa, mc, ours["stage"], pp)
            assert ours["full_tokens"] == rank.config.max_total_num_tokens
            assert_device_pools(ours, rank)
            assert_layer_map(mine, rank)
