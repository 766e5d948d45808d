"""A healthy real sglang 0.5.23 server's pools validate; the docs/sglang.md examples run.

Runs in ``.venv-sglang``.  The pools are sglang's own, sized and built by its
configurator from a resolved ``ServerArgs`` for the real flash config (44
``compress_ratios`` for 43 layers), see tests/support/sglang_real.py.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")

from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang_real import (  # noqa: E402
    build_stage,
    cache_params,
    hooks_applied,
    model_dir,
    on_cpu,
    partition_env,
    published,
    sglang_restored,
)
from stagecache.runtime.errors import StageMappingInvalid  # noqa: E402
from stagecache.runtime.integrations import sglang as integ  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"
LAYOUTS = [(1, None), (2, None), (4, None), (8, None), (4, (11, 11, 11, 10)), (2, (22, 21))]


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory):
    logging.getLogger("sglang").setLevel(logging.WARNING)
    return model_dir(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize(("pp", "partition"), LAYOUTS,
                         ids=[f"pp{pp}-" + (",".join(map(str, part)) if part else "even") for pp, part in LAYOUTS])
def test_healthy_server_pools_have_no_error_and_no_gap(flash_dir, pp, partition):
    with partition_env(partition), published(flash_dir, pp_size=pp, max_total_tokens=262_144) as (sa, mc):
        pools = [build_stage(sa, mc, rank, pp).kvcache for rank in range(pp)]
        assert {len(kv.compression_ratios) for kv in pools} == {44}
        report = integ.inspect_pools(pools, pp_size=pp, model_name="deepseek-v4-flash")
        assert report.ok and report.all_errors == [], [str(e) for e in report.all_errors]
        assert report.num_layers == 43 and [s.end for s in report.stages][-1] == 43
        for rank, kv in enumerate(pools):  # one rank at a time, as each scheduler process sees it
            alone = integ.inspect_pool(kv, pp_size=pp)
            assert alone.ok and alone.num_layers == 43 and alone.stages[0].stage == rank


def test_strict_hooks_accept_a_healthy_server_with_an_explicit_partition(flash_dir):
    """Each rank a deployment of size 1 (``STAGECACHE_SGLANG_PER_RANK=1``), its hooks applied by
    sglang's ``HookRegistry``, SGLANG_PP_LAYER_PARTITION=11,11,11,10: every rank's real stack
    builds (the served deployment's exchange: test_sglang_live_deployment.py)."""
    original = hpa.build_deepseek_v4_hicache_stack
    with partition_env((11, 11, 11, 10)), \
            published(flash_dir, pp_size=4, max_total_tokens=16_384, max_running_requests=4) as (sa, mc), \
            on_cpu():
        for rank in range(4):  # one scheduler process each: one deployment each
            with hooks_applied(integ.Deployment(integ.DeploymentOptions(per_rank=True, port=None))) as dep:
                assert hpa.build_deepseek_v4_hicache_stack is original  # armed with the pools
                stage = build_stage(sa, mc, rank, 4, device="cpu")
                assert hpa.build_deepseek_v4_hicache_stack is not original
                with get_parallel().override(pp_rank=rank):
                    group, controller = hpa.build_deepseek_v4_hicache_stack(
                        params=cache_params(stage), kvcache=stage.kvcache, load_cache_event=None,
                        storage_backend=None)
                assert isinstance(controller, hpa.HybridCacheController) and len(group.entries) == 7
                startup = dep.source.startup()
                assert startup.ok and startup.num_layers == 43 and startup.pp_size == 4
                assert [(s.start, s.end) for s in startup.stages] == [[(0, 11), (11, 22), (22, 33), (33, 43)][rank]]
                assert startup.cross_errors == ()
                assert dep.source.stages()[rank].pool_bytes["c4_indexer_state"].device > 0
    assert hpa.build_deepseek_v4_hicache_stack is original


def test_seed_fault_on_a_real_server_pool_is_refused_with_the_exact_message(flash_dir):
    with published(flash_dir, pp_size=4, max_total_tokens=262_144) as (sa, mc):
        kv = build_stage(sa, mc, 2, 4).kvcache
        kv.swa_kv_pool = kv._make_kv_pool(  # the SWA pool sized by the model's global layer count
            size=kv.swa_size, page_size=kv.swa_page_size, dtype=kv.swa_kv_pool.dtype, layer_num=43,
            device="meta", enable_memory_saver=False, global_page_size=kv.swa_page_size)
        report = integ.inspect_pool(kv, pp_size=4)
        with pytest.raises(ValueError, match="^DeepSeek V4 SWA KV pool must be PP-stage-local: "
                                             "got 43 buffers for 11 local layers$"):
            hpa.build_deepseek_v4_hicache_stack(params=cache_params(build_stage(sa, mc, 2, 4)), kvcache=kv,
                                                load_cache_event=None, storage_backend=None)
    assert [e.message for e in report.all_errors] == [
        "DeepSeek V4 SWA KV pool must be PP-stage-local: got 43 buffers for 11 local layers"]


# -- docs/sglang.md: every Python example runs against a real pool --------------------------------
def doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def _example_pool(sa, mc):
    """The docs' example: stage 2 of flash pp4 whose last C4 compress state is None."""
    kv = build_stage(sa, mc, 2, 4, device="cpu").kvcache
    last_c4 = max(g for g in range(kv.start_layer, kv.end_layer) if kv.compression_ratios[g] == 4)
    kv.compress_state_pools[last_c4] = None
    return kv


def test_docs_examples_run(flash_dir):
    python, text = doc_blocks("python"), doc_blocks("text")
    assert len(python) == 2 and len(text) == 2
    with published(flash_dir, pp_size=4, max_total_tokens=16_384, max_running_requests=4) as (sa, mc), \
            on_cpu():
        kvcache = _example_pool(sa, mc)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(python[0], {"kvcache": kvcache})  # noqa: S102 - the doc's own code
        shown = [line.rstrip() for line in text[0].strip("\n").splitlines()]
        assert [line.rstrip() for line in out.getvalue().strip("\n").splitlines()] == shown  # the doc's output

        def engine_builds_its_hicache_stack():
            stage = build_stage(sa, mc, 2, 4, device="cpu")
            hpa.build_deepseek_v4_hicache_stack(params=cache_params(stage), kvcache=kvcache,
                                                load_cache_event=None, storage_backend=None)

        with sglang_restored(), get_parallel().override(pp_rank=2), \
                pytest.raises(StageMappingInvalid) as exc:
            exec(python[1], {"engine_builds_its_hicache_stack": engine_builds_its_hicache_stack})  # noqa: S102
        assert str(exc.value) == textwrap.dedent(text[1]).strip().split("StageMappingInvalid: ", 1)[1]


@pytest.mark.parametrize("odd", [1, 3])
def test_a_stage_record_with_another_page_size_is_a_fingerprint_error_naming_it(flash_dir, odd):
    """The exchange's whole-deployment check on the records of four real pools, one of them
    recorded with 512-token pages: that stage, and only it, is named with both values."""
    from stagecache.runtime.validation.deployment import deployment_report

    with published(flash_dir, pp_size=4, max_total_tokens=262_144) as (sa, mc):
        records = [integ.read_pool(build_stage(sa, mc, rank, 4).kvcache, rank, 43, "deepseek-v4-flash",
                                   page_size=512 if rank == odd else 256).record(pp_size=4)
                   for rank in range(4)]
    report = deployment_report(records, tp_size=1, page_size=records[0].fingerprint.page_size)
    assert not report.ok and report.page_size == 256
    named = {e.stage for e in report.all_errors}
    assert named == {odd}, [str(e) for e in report.all_errors]
    text = " ".join(str(e) for e in report.all_errors)
    assert f"stage {odd} runs another deployment than the other stages" in text, text
    assert "page_size: 512 != 256" in text, text


def test_bench_sglang_hooks_drives_sglangs_own_controller_and_counts_every_transfer():
    """``bench sglang-hooks`` at a tiny size: sglang's controller really backs up and loads a page
    per request, and the hooked arms count every one (the speed figures are the bench's)."""
    from stagecache.runtime.bench.sglang_hooks import run_bench

    report = run_bench(sessions=2, turns=2, rounds=1)
    requests = report["requests_per_round"]
    assert requests == 4
    hooked_rounds = 2 * (1 + 1)  # with and without copies: a warm-up round and one timed round each
    page = report["page_bytes_moved"]
    assert page > 0 and page % 256 == 0
    assert report["counted_transfer_bytes"] == {"d2h": hooked_rounds * requests * page,
                                                "h2d": hooked_rounds * requests * page}
    tokens = report["counted_tokens"]  # turn 1 misses its page, turn 2 hits turn 1's on device
    assert tokens["device"] == hooked_rounds * 2 * 256 and tokens["miss"] == hooked_rounds * (2 * 256 + 2 * 256)
    for arm in ("with_copies", "without_copies"):
        assert len(report[arm]["plain_seconds"]) == len(report[arm]["hooked_seconds"]) == 1
    assert report["meets_target"] == (report["without_copies"]["hooks_alone_ratio"] < 0.01)
    # the hooked arm's last round recorded what a rank pushes for agreement, and every ack was complete
    assert report["agreement_records_last_round"] == {"requests": 4, "steps": 4, "incomplete_transfers": 0}
