"""Linear-attention / Mamba hybrids: ``stagecache pools --json`` and ``check --json`` == what sglang
0.5.23 builds, per stage and pool, on its own objects (CPU).

Runs in ``.venv-sglang`` (tests/support/sglang_linear.py builds sglang's pools for a preset's real
``config.json``).  Per stage and pool kind: buffers, bytes per page (attention) or per request
slot (Mamba), tensor rows, device bytes; the HiCache host pools sglang's assembler builds (pages or
slots, bytes); the controller's transfer bound, each pool's layer mapper and the ids readers wait
on; and under a memory budget sglang's tokens per stage, Mamba slots, the bytes it charges for the
state and the MIN over stages.  Every non-MLA architecture's layer kinds and state shapes are
compared with sglang's own config classes.
"""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")

from sglang.srt.distributed.utils import get_pp_indices  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa  # noqa: E402
from sglang_linear import (  # noqa: E402
    GIB,
    budget_sizes,
    build_linear_stage,
    host_facts,
    host_stack,
    pool_facts,
    published_linear,
    transfer_facts,
)
from sglang_real import partition_env  # noqa: E402
from stagecache.runtime.cli.main import main  # noqa: E402

TOKENS = 8192
SLOTS = 5  # sglang needs one request: 5 slots per request at pp 1, 4 under PP (no overlap schedule); small, as Nemotron-H's slot is 4 MiB per Mamba layer and these tensors are allocated
LAYOUTS = [
    ("qwen3.5-0.8b", 1, None), ("qwen3.5-0.8b", 2, None), ("qwen3.5-0.8b", 4, None),
    ("qwen3.5-0.8b", 4, (5, 7, 6, 6)),
    ("nemotron-h-8b", 1, None), ("nemotron-h-8b", 2, None), ("nemotron-h-8b", 4, None),
    ("nemotron-h-8b", 4, (8, 14, 15, 15)),
]
#: Layouts whose stages all hold an attention layer: sglang builds their HiCache host KV pools.
#: (qwen3.5 3,7,7,7 and nemotron-h pp 8 have stages without one: ``test_stage_without_attention``.)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    logging.getLogger("sglang").setLevel(logging.ERROR)
    return tmp_path_factory.mktemp("models")


def run_json(capsys, command: str, model: str, pp: int, partition, *extra: str) -> tuple[int, dict]:
    argv = [command, "--model", model, "--pp-size", str(pp), "--page-size", "256", "--json", *extra]
    if partition:
        argv += ["--pp-partition", ",".join(map(str, partition))]
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def ours_ids(stage: dict) -> dict[str, dict[str, dict[int, int]]]:
    """From ``check --json``: per pool, signalled id -> buffer, and global layer -> awaited id."""
    out: dict[str, dict[str, dict[int, int]]] = {}
    for pool, field, kinds in (("attention", "attention_id", {"attention", "hybrid"}),
                               ("mamba", "mamba_id", {"mamba", "hybrid"})):
        layers = [e for e in stage["layers"] if e["layer_type"] in kinds]
        out[pool] = {"mapper": {e["transfer_id"]: e[field] for e in layers},
                     "waits": {e["global"]: e["local"] for e in layers}}
    return out


@pytest.mark.parametrize(("model", "pp", "partition"), LAYOUTS,
                         ids=[f"{m}-pp{pp}-" + (",".join(map(str, p)) if p else "even") for m, pp, p in LAYOUTS])
def test_pools_and_ids_equal_sglangs(capsys, models, model, pp, partition):
    extra = ("--max-total-tokens", str(TOKENS), "--max-mamba-cache-size", str(SLOTS), "--hicache-ratio", "1")
    code, report = run_json(capsys, "pools", model, pp, partition, *extra)
    assert code == 0
    check_code, checked = run_json(capsys, "check", model, pp, partition)
    assert check_code == 0, checked
    mismatches = []
    with partition_env(partition), published_linear(models, model, pp_size=pp, page_size=256,
                                                     max_total_tokens=TOKENS, max_mamba_cache_size=SLOTS,
                                                     max_running_requests=2, hicache_ratio=1.0) as (sa, mc):
        assert mc.num_hidden_layers == report["num_layers"]
        for ours, ids in zip(report["stages"], checked["stages"], strict=True):
            stage = build_linear_stage(sa, mc, ours["stage"], pp)
            kv = stage.kvcache
            assert (ours["start_layer"], ours["end_layer"]) == get_pp_indices(mc.num_hidden_layers, ours["stage"], pp)
            assert ours["start_layer"] == kv.start_layer == stage.req_pool.start_layer
            assert ours["full_tokens"] == stage.config.max_total_num_tokens
            assert ours["state_slots"] == stage.req_pool.mamba_pool.size
            stack = host_stack(stage, sa)
            device, host, transfer = pool_facts(stage), host_facts(stack), transfer_facts(stage, stack)
            rows = {r["pool"]: r for r in ours["pools"]}
            for pool in ("attention", "mamba"):
                r = rows[pool]
                want = {**device[pool], **host[pool]}
                got = {"buffers": r["buffers"], "device_bytes": r["device_bytes"],
                       "tensor_rows": {r["tensor_rows"]}, "page_bytes": r["page_bytes"] if r["buffers"] else None,
                       "device_pages": r["device_pages"], "host_pages": r["host_pages"],
                       "host_bytes": r["host_bytes"]}
                mismatches += [(ours["stage"], pool, k, got[k], want[k]) for k in want if got[k] != want[k]]
            assert ours["device_bytes"] == sum(device[p]["device_bytes"] for p in device)
            # HiCache ids: the controller's bound, each pool's mapper, what readers wait on
            mine = ours_ids(ids)
            cached = [e["local"] for e in ids["layers"] if e["layer_type"] != "none"]
            assert max(cached) + 1 == transfer["bound"] == transfer["events"]
            for pool in ("attention", "mamba"):
                if mine[pool]["mapper"] != transfer["mappers"][pool]:
                    mismatches.append((ours["stage"], pool, "mapper", mine[pool]["mapper"], transfer["mappers"][pool]))
                if mine[pool]["waits"] != transfer["waits"][pool]:
                    mismatches.append((ours["stage"], pool, "waits", mine[pool]["waits"], transfer["waits"][pool]))
    assert mismatches == []


BUDGETS = [("qwen3.5-0.8b", 4, None, 6), ("qwen3.5-0.8b", 4, (5, 7, 6, 6), 6), ("qwen3.5-0.8b", 2, None, 3),
           ("nemotron-h-8b", 4, None, 40), ("nemotron-h-8b", 8, None, 40)]


@pytest.mark.parametrize(("model", "pp", "partition", "gb"), BUDGETS,
                         ids=[f"{m}-pp{pp}-{gb}G" + ("-" + ",".join(map(str, p)) if p else "")
                              for m, pp, p, gb in BUDGETS])
def test_memory_budget_gives_sglangs_tokens_slots_and_charge(capsys, models, model, pp, partition, gb):
    """sglang charges each stage the state of the stage with the most Mamba layers; PP takes the MIN
    of the tokens.  Sized without allocating (full-size pools would be gigabytes)."""
    code, report = run_json(capsys, "pools", model, pp, partition, "--mem-budget-gb", str(gb))
    assert code == 0
    with partition_env(partition):
        sglang = []
        for rank in range(pp):
            with published_linear(models, model, pp_size=pp, page_size=256) as (sa, mc):
                sglang.append(budget_sizes(sa, mc, rank, pp, gb * GIB))
    tokens = min(s["tokens"] for s in sglang)
    for ours, theirs in zip(report["stages"], sglang, strict=True):
        cap = ours["capacity"]
        assert cap["tokens_alone"] == theirs["tokens"], ours["stage"]
        assert ours["full_tokens"] == cap["tokens"] == tokens
        assert ours["state_slots"] == theirs["slots"]
        assert abs(cap["state_charged_bytes"] - theirs["charged"]) <= 1  # sglang's float GiB arithmetic
        mamba = next(r for r in ours["pools"] if r["pool"] == "mamba")
        assert cap["state_bytes"] == mamba["device_bytes"] == mamba["buffers"] * (theirs["slots"] + 1) * \
            mamba["page_bytes"]
    if model == "qwen3.5-0.8b" and pp == 4 and partition is None:  # stages 1, 3: 4 Mamba layers, charged for 5
        stranded = [s["capacity"]["state_stranded_bytes"] for s in report["stages"]]
        assert stranded[0] == stranded[2] == 0 and stranded[1] == stranded[3] > 0
        assert report["deployment"]["state_stranded_bytes"] == sum(stranded)


@pytest.mark.parametrize(("model", "pp", "partition"), [("qwen3.5-0.8b", 4, (3, 7, 7, 7)), ("nemotron-h-8b", 8, None)])
def test_stage_without_attention(capsys, models, model, pp, partition):
    """sglang builds such a stage's device pools, but its HiCache host KV pool fails to allocate
    (0 bytes per token): ``check`` names the stage, ``pools`` suggests a partition or says none exists."""
    code, checked = run_json(capsys, "check", model, pp, partition)
    assert code == 1
    named = {s["stage"] for s in checked["stages"] for e in s["errors"] if "no attention layer" in e["message"]}
    _, report = run_json(capsys, "pools", model, pp, partition, "--max-total-tokens", str(TOKENS),
                         "--max-mamba-cache-size", "4", "--hicache-ratio", "2")
    failed = set()
    with partition_env(partition), published_linear(models, model, pp_size=pp, page_size=256,
                                                     max_total_tokens=TOKENS, max_mamba_cache_size=4,
                                                     max_running_requests=4, hicache_ratio=2.0) as (sa, mc):
        for rank in range(pp):
            stage = build_linear_stage(sa, mc, rank, pp)
            assert len(stage.kvcache.full_kv_pool.k_buffer) == report["stages"][rank]["pools"][0]["buffers"]
            try:
                host_stack(stage, sa)
            except OSError as exc:
                assert exc.errno == 22  # EINVAL: a 0-byte host allocation
                failed.add(rank)
    assert named == failed and failed
    assert report["suggested_partition"] == ([6, 6, 6, 6] if model == "qwen3.5-0.8b" else None)


def _sglang_config(arch_cfg: dict):
    from sglang.srt.configs import (
        falcon_h1,
        granitemoehybrid,
        lfm2,
        nemotron_h,
        qwen3_5,
        qwen3_next,
    )

    arch = arch_cfg["architectures"][0]
    cls = {"Qwen3_5ForConditionalGeneration": qwen3_5.Qwen3_5Config, "Qwen3NextForCausalLM": qwen3_next.Qwen3NextConfig,
           "NemotronHForCausalLM": nemotron_h.NemotronHConfig,
           "GraniteMoeHybridForCausalLM": granitemoehybrid.GraniteMoeHybridConfig,
           "FalconH1ForCausalLM": falcon_h1.FalconH1Config, "Lfm2ForCausalLM": lfm2.Lfm2Config}[arch]
    return cls(**{k: v for k, v in arch_cfg.items() if k != "architectures"}, architectures=[arch])


ARCH_CONFIGS = {
    "qwen3-next": {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 12, "full_attention_interval": 3,
                   "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048, "num_attention_heads": 16,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4},
    "nemotron-h": {"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M-M*-EM*M",
                   "num_key_value_heads": 8, "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128,
                   "n_groups": 4, "conv_kernel": 4, "hidden_size": 2048},
    "granite": {"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 12, "hidden_size": 1536,
                "num_attention_heads": 12, "num_key_value_heads": 4, "mamba_n_heads": 48, "mamba_d_head": 64,
                "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2},
    "granite-types": {"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 4, "hidden_size": 1536,
                      "num_attention_heads": 12, "num_key_value_heads": 4, "mamba_n_heads": 48, "mamba_d_head": 64,
                      "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
                      "layer_types": ["mamba", "attention", "linear_attention", "full_attention"]},
    "falcon-h1": {"architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": 6, "hidden_size": 1024,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "mamba_d_ssm": 1536,
                  "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
                  "mamba_d_conv": 4},
    "lfm2": {"architectures": ["Lfm2ForCausalLM"], "num_hidden_layers": 6, "hidden_size": 1024,
             "num_attention_heads": 16, "num_key_value_heads": 8, "conv_L_cache": 3,
             "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]},
}


@pytest.mark.parametrize("name", sorted(ARCH_CONFIGS))
def test_layer_kinds_and_state_shapes_equal_sglangs_config_classes(name):
    from stagecache.runtime.model.families import spec_from_config

    cfg = ARCH_CONFIGS[name]
    spec = spec_from_config(dict(cfg), name)
    theirs = _sglang_config(cfg)
    params = theirs.mamba2_cache_params
    full = set(theirs.full_attention_layer_ids)
    mamba = set(params.layers)
    assert {i for i, k in enumerate(spec.layer_kinds) if k in ("attention", "hybrid")} == full
    assert {i for i, k in enumerate(spec.layer_kinds) if k in ("mamba", "hybrid")} == mamba
    assert [tuple(spec.conv_shape)] == [tuple(c) for c in params.shape.conv]
    assert tuple(spec.temporal_shape) == tuple(params.shape.temporal)
    assert spec.state_slot_bytes * len(mamba) == params.mamba_cache_per_req


# -- the family's faults, built with sglang's own classes as each bug built them ---------------------

@pytest.mark.parametrize("fault", ["global-attention", "unsplit-mamba"])
def test_count_faults_equal_sglangs_pools_built_the_buggy_way(capsys, models, monkeypatch, fault):
    """``global-attention``: the attention pool built over the whole model's attention layers;
    ``unsplit-mamba`` (#21448): the Mamba pool over every Mamba layer of the model.  sglang's own
    configurator builds them with its stage filter widened to the whole model."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo

    pp = 2
    if fault == "unsplit-mamba":
        monkeypatch.setattr(KVCacheConfigurator, "_get_mamba_layer_ids_for_req_pool",
                            lambda self: list(self.mambaish_config.mamba2_cache_params.layers))
    else:
        build = KVCacheConfigurator._build_hybrid_linear_kv_pool

        def whole_model(self, **kw):
            saved = self.layer_info
            n = self.model_config.num_hidden_layers
            self.layer_info = ModelLayerInfo(start_layer=0, end_layer=n, num_effective_layers=n)
            try:
                return build(self, **kw)
            finally:
                self.layer_info = saved

        monkeypatch.setattr(KVCacheConfigurator, "_build_hybrid_linear_kv_pool", whole_model)
    _, report = run_json(capsys, "pools", "qwen3.5-0.8b", pp, None, "--max-total-tokens", str(TOKENS),
                         "--max-mamba-cache-size", str(SLOTS), "--fault", fault)
    with published_linear(models, "qwen3.5-0.8b", pp_size=pp, page_size=256, max_total_tokens=TOKENS,
                          max_mamba_cache_size=SLOTS, max_running_requests=2) as (sa, mc):
        for ours in report["stages"]:
            device = pool_facts(build_linear_stage(sa, mc, ours["stage"], pp))
            for r in ours["pools"]:
                assert (r["buffers"], r["device_bytes"]) == (device[r["pool"]]["buffers"],
                                                             device[r["pool"]]["device_bytes"]), (ours["stage"], r["pool"])
    code, checked = run_json(capsys, "check", "qwen3.5-0.8b", pp, None, "--fault", fault)
    assert code == 1 and all(not s["ok"] for s in checked["stages"])


@pytest.mark.parametrize(("fault", "model", "pp"), [("mamba-len-bound", "nemotron-h-8b", 1),
                                                    ("mamba-transfer-ids", "qwen3.5-0.8b", 2)])
def test_transfer_id_faults_equal_sglangs_mappers_built_the_buggy_way(capsys, models, fault, model, pp):
    """#37870: sglang's layer mapper with the bound ``len(keys)``; #38866: the Mamba mapping left in
    global ids.  What sglang's ``_make_layer_mapper`` then signals is what ``check --fault`` reports."""
    code, checked = run_json(capsys, "check", model, pp, None, "--fault", fault)
    assert code == 1
    with published_linear(models, model, pp_size=pp, page_size=256, max_total_tokens=TOKENS,
                          max_mamba_cache_size=SLOTS, max_running_requests=2, hicache_ratio=1.0) as (sa, mc):
        for ours in checked["stages"]:
            stage = build_linear_stage(sa, mc, ours["stage"], pp)
            kv, req = stage.kvcache, stage.req_pool
            full = {g - kv.start_layer: i for g, i in kv.full_attention_layer_id_mapping.items()}
            if fault == "mamba-len-bound":
                mamba = {g - req.start_layer: i for g, i in req.mamba_map.items()}
                bound = len(full.keys() | mamba.keys())  # the bug: len(keys), not max + 1
            else:
                mamba = dict(req.mamba_map) if ours["stage"] >= 1 else \
                    {g - req.start_layer: i for g, i in req.mamba_map.items()}  # later stages: not rebased
                bound = max(full.keys() | mamba.keys()) + 1
            signalled = {pool: {i: m(i) for i in range(bound) if m(i) is not None}
                         for pool, m in (("attention", hpa._make_layer_mapper(full, bound)),
                                         ("mamba", hpa._make_layer_mapper(mamba, bound)))}
            mine = ours_ids(ours)
            for pool in ("attention", "mamba"):
                sent = {k: v for k, v in mine[pool]["mapper"].items() if k is not None and k < bound}
                assert sent == signalled[pool], (ours["stage"], pool)
            named = {e["pool"] for e in ours["errors"]}
            wrong = {pool for pool in ("attention", "mamba")
                     if set(signalled[pool]) != set(mine[pool]["waits"].values())}
            assert named == wrong


@pytest.mark.parametrize(("model", "pp", "partition", "gb"), [("qwen3.5-0.8b", 4, (3, 7, 7, 7), 6),
                                                              ("nemotron-h-8b", 8, None, 40)])
def test_unbounded_stage_is_sglangs_own_figure_and_its_allocator_cannot_be_built(capsys, models, model, pp,
                                                                                  partition, gb):
    """A stage without an attention layer: sglang's own token figure for it (its configurator, 0 bytes
    per token) is what ``pools --fault unbounded-stage`` sizes it by, and sglang's own pools built
    from that figure -- the bug -- fail at its token allocator; from the MIN over ranks they build."""
    import re

    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_schedule
    from sglang_linear import configurator

    slots = 4
    code, report = run_json(capsys, "pools", model, pp, partition, "--mem-budget-gb", str(gb),
                            "--max-mamba-cache-size", str(slots), "--fault", "unbounded-stage")
    assert code == 0
    check_code, checked = run_json(capsys, "check", model, pp, partition, "--fault", "unbounded-stage")
    named = {e["stage"] for s in checked["stages"] for e in s["errors"] if e["pool"] == "attention"}
    assert check_code == 1
    with partition_env(partition):
        theirs = []
        for rank in range(pp):
            with published_linear(models, model, pp_size=pp, page_size=256, max_mamba_cache_size=slots) as (sa, mc):
                theirs.append(budget_sizes(sa, mc, rank, pp, gb * GIB)["tokens"])
        deployment = min(theirs)
        bare = {rank for rank, t in enumerate(theirs) if t >= 1 << 62}
        assert bare and named == bare
        for ours, own in zip(report["stages"], theirs, strict=True):
            assert ours["full_tokens"] == (own if ours["stage"] in bare else deployment), ours["stage"]
        rank = min(bare)
        pages = next(p for p in report["stages"][rank]["pools"] if p["pool"] == "attention")["device_pages"]
        with published_linear(models, model, pp_size=pp, page_size=256, max_mamba_cache_size=slots,
                              max_running_requests=2) as (sa, mc):
            for tokens in (theirs[rank], deployment):
                kvc = configurator(sa, mc, rank, pp)
                conf = create_memory_pool_configurator(kvc)
                config = conf.calculate_pool_sizes_from_max_tokens(tokens, get_schedule().page_size)
                config.max_running_requests = kvc.resolve_max_num_reqs(config.max_total_num_tokens)
                sizes = kvc._derive_pool_sizes(config=conf.finalize_with_max_running_requests(config))
                if tokens == deployment:
                    pools = kvc._init_pools(sizes=sizes, req_to_token_pool=None, token_to_kv_pool_allocator=None)
                    assert pools.token_to_kv_pool.size == deployment
                    continue
                with pytest.raises(RuntimeError, match="can't allocate memory") as failed:
                    kvc._init_pools(sizes=sizes, req_to_token_pool=None, token_to_kv_pool_allocator=None)
                tried = int(re.search(r"allocate (\d+) bytes", str(failed.value)).group(1))
                assert tried >= pages * 8  # one int64 page id per page of the unbounded count
