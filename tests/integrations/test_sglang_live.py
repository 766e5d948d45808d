"""stagecache vs the REAL sglang (0.5.23): partition, layer maps, validation, start-up hook.

Runs inside ``.venv-sglang`` (built by tests/setup.d/50-sglang.sh; driven from the main
environment by tests/integrations/test_sglang_venv.py); skipped where sglang is not importable.

How the real pool is built on a CPU machine: ``DeepSeekV4TokenToKVPool.__init__`` reads
sglang's process-wide runtime context (``get_exec()``/``get_spec()``), which a server
publishes from its ``ServerArgs``.  The module fixture publishes a default, unresolved
``ServerArgs`` through sglang's own ``RuntimeContext.set_server_args`` for the small pools
built directly (``make_pool``); the real-server tests resolve a ``ServerArgs`` for the real
flash config and let sglang's configurator build the pools (tests/support/sglang_real.py).  Pools
carry the config's ``compress_ratios`` as sglang's ``ModelConfig`` does: 44 entries for
flash's 43 layers (the MTP placeholder), 13 for tiny's 12.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re

import pytest

sglang = pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")
torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402
from sglang.srt.distributed.utils import get_pp_indices  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheAck  # noqa: E402
from sglang.srt.mem_cache import deepseek_v4_memory_pool as dsv4  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa  # noqa: E402
from sglang_real import partition_env, raw_ratios  # noqa: E402
from stagecache.exporters.metrics import make_registry  # noqa: E402
from stagecache.runtime.errors import StageMappingInvalid  # noqa: E402
from stagecache.runtime.integrations import sglang as integ  # noqa: E402
from stagecache.runtime.live.source import SnapshotSource  # noqa: E402
from stagecache.runtime.model.families import load_spec  # noqa: E402
from stagecache.runtime.model.layer_map import build_layout  # noqa: E402
from stagecache.runtime.model.partition import partition_layers  # noqa: E402
from stagecache.runtime.plan.faults import parse_faults  # noqa: E402
from stagecache.runtime.plan.plan import build_plan  # noqa: E402
from stagecache.runtime.validation.deployment import preflight  # noqa: E402

PAGE = 256
FLASH = load_spec("deepseek-v4-flash")
TINY = load_spec("tiny-v4")
#: The configs' compress_ratios as sglang's pools carry them (MTP placeholder included).
RATIOS = {FLASH.name: raw_ratios("deepseek-v4-flash"), TINY.name: raw_ratios("tiny-v4")}
FLASH44 = RATIOS[FLASH.name]


@pytest.fixture(scope="module", autouse=True)
def published_context():
    """Publish a default ServerArgs (model-config resolution skipped) as a server would."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    post_init = ServerArgs.__post_init__
    ServerArgs.__post_init__ = lambda self: None
    try:
        server_args = ServerArgs(model_path="stagecache-test", device="cpu")
    finally:
        ServerArgs.__post_init__ = post_init
    runtime_context._CONTEXT.set_server_args(server_args)
    logging.getLogger("sglang").setLevel(logging.WARNING)
    yield


def make_pool(ratios, start: int, end: int) -> dsv4.DeepSeekV4TokenToKVPool:
    """A real sglang pool for layers [start, end) of a model with these ratios (tiny sizes)."""
    return dsv4.DeepSeekV4TokenToKVPool(
        max_num_reqs=2, swa_size=PAGE, c4_size=PAGE, c128_size=8,
        c4_state_pool_size=PAGE, c128_state_pool_size=8,
        page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32, c128_state_dtype=torch.float32,
        # sglang's V4 layout asserts 448 FP8 nope + 64 BF16 rope (584 B/token)
        qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
        layer_num=end - start, device="cpu", enable_memory_saver=False,
        compression_ratios=list(ratios), sliding_window=128,
        start_layer=start, end_layer=end,
    )


# -- partition: sglang's get_pp_indices == stagecache's partition_layers -----------------------
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_partition_matches_get_pp_indices(data):
    num_layers = data.draw(st.integers(1, 96), label="num_layers")
    pp_size = data.draw(st.integers(1, min(num_layers, 16)), label="pp_size")
    explicit = data.draw(st.booleans(), label="explicit")
    partition = None
    if explicit and pp_size > 1:
        cuts = sorted(data.draw(st.sets(st.integers(1, num_layers - 1), min_size=pp_size - 1,
                                        max_size=pp_size - 1), label="cuts"))
        bounds = [0, *cuts, num_layers]
        partition = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    with partition_env(partition):
        theirs = [get_pp_indices(num_layers, r, pp_size) for r in range(pp_size)]
        assert integ.partition_findings(num_layers, pp_size) == []
    ours = [(s.start, s.end) for s in partition_layers(num_layers, pp_size, partition)]
    assert ours == theirs


def test_partition_mismatch_is_a_finding():
    # sglang accepts an empty stage in SGLANG_PP_LAYER_PARTITION; stagecache refuses it.
    with partition_env([0, 12]):
        assert get_pp_indices(12, 0, 2) == (0, 0)
        (finding,) = integ.partition_findings(12, 2)
    assert finding.pool == "partition" and "at least one layer" in finding.message


# -- layer maps: the real pool and assembler == stagecache's maps ------------------------------
def _cases():
    for spec in (FLASH, TINY):
        for pp in (1, 2, 3, 4, 5, 8):
            yield spec, pp, None
    yield FLASH, 4, (11, 11, 11, 10)
    yield FLASH, 3, (20, 3, 20)
    yield TINY, 3, (1, 10, 1)


def _check_stage(spec_ratios, stage_map):
    pool = make_pool(spec_ratios, stage_map.start, stage_map.end)
    # _init_compressed_layer_mapping (run by the constructor): global id -> item
    for e in stage_map.layers:
        item = pool.layer_mapping[e.global_id]
        assert item.compress_ratio == e.compress_ratio
        if e.compress_ratio:
            assert item.compress_layer_id == e.compress_layer_id
    assert all(pool.layer_mapping[g] is None for g in range(len(spec_ratios))
               if not stage_map.owns(g))
    # the assembler's resolution: the maps the host stack is built with
    m = hpa._resolve_deepseek_v4_layer_mappings(pool)
    assert m.transfer_layer_id_max == stage_map.local_layers
    assert m.swa == stage_map.pool_map("swa")
    assert m.c4 == stage_map.pool_map("c4")
    assert m.c128 == stage_map.pool_map("c128")
    assert m.c4_state == stage_map.pool_map("c4_state")
    assert m.c4_state_global_layers == [e.global_id for e in stage_map.pool_layers("c4_state")]
    # the real buffers: one per local layer of each kind
    assert len(pool.swa_kv_pool.kv_buffer) == stage_map.expected_buffers()["swa"]
    for ratio, kv in ((4, pool.c4_kv_pool), (128, pool.c128_kv_pool)):
        # sglang keeps a (possibly empty) pool only for ratios the model has
        assert (kv is None) == (ratio not in spec_ratios)
        got = len(kv.kv_buffer) if kv is not None else 0
        assert got == stage_map.expected_buffers()[f"c{ratio}"]
    return pool


@pytest.mark.parametrize(("spec", "pp", "partition"), list(_cases()),
                         ids=lambda v: getattr(v, "name", str(v)))
def test_layer_maps_match_real_pool_and_assembler(spec, pp, partition):
    layout = build_layout(spec, pp, 1, partition)
    pools = []
    with partition_env(partition):
        for stage_map in layout.stages:
            assert get_pp_indices(spec.num_layers, stage_map.stage, pp) == (stage_map.start, stage_map.end)
            pools.append(_check_stage(RATIOS[spec.name], stage_map))
        report = integ.inspect_pools(pools, pp_size=pp, model_name=spec.name)
        for pool in pools:  # each rank on its own, as the start-up hook sees it
            alone = integ.inspect_pool(pool, pp_size=pp)
            assert alone.ok and alone.num_layers == spec.num_layers, [str(e) for e in alone.all_errors]
    assert report.ok, [str(e) for e in report.all_errors]
    assert report.num_layers == spec.num_layers and report.cross_errors == ()  # no false gap
    # the same per-stage report `stagecache check` computes for this layout
    want = preflight(build_plan(spec, pp, partition=partition, page_size=PAGE)).to_dict()

    def maps_and_errors(stages: list[dict]) -> list[dict]:  # bytes: sized by the plan, measured live
        sized = {"pool_page_bytes", "device_bytes", "host_buffers", "host_bytes"}
        return [{k: v for k, v in s.items() if k not in sized} for s in stages]

    assert maps_and_errors(report.to_dict()["stages"]) == maps_and_errors(want["stages"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ratios=st.lists(st.sampled_from((0, 4, 128)), min_size=2, max_size=24), data=st.data())
def test_random_models_match(ratios, data):
    pp = data.draw(st.integers(1, min(4, len(ratios))), label="pp")
    rank = data.draw(st.integers(0, pp - 1), label="rank")
    mtp = data.draw(st.booleans(), label="MTP placeholder in the config")
    spec = dataclasses.replace(TINY, num_layers=len(ratios), compress_ratios=tuple(ratios))
    stage_map = build_layout(spec, pp).stages[rank]
    pool = _check_stage(ratios + [0] * mtp, stage_map)
    report = integ.inspect_pool(pool, pp_size=pp, num_layers=len(ratios))
    assert report.ok, [str(e) for e in report.all_errors]
    assert report.stages[0].to_dict() == stage_map.to_dict()


# -- faults: the same errors as `stagecache check --fault ...` --------------------------------
def _global_swa(pool):
    """What the original bug did: the SWA pool sized by the model's global layer count."""
    pool.swa_kv_pool = pool._make_kv_pool(
        size=PAGE, page_size=PAGE, dtype=torch.float8_e4m3fn,
        layer_num=FLASH.num_layers, device="cpu",  # the model's global layer count on every stage
        enable_memory_saver=False, global_page_size=PAGE,
    )
    return pool


def _stage_errors(report, stage):
    return [e.message for s in report.stages if s.stage == stage for e in s.errors]


def test_global_swa_same_errors_as_check_and_as_sglang():
    layout = build_layout(FLASH, 4)
    s = layout.stages[2]
    pool = _global_swa(make_pool(FLASH44, s.start, s.end))
    report = integ.inspect_pool(pool, pp_size=4)
    want = preflight(build_plan(FLASH, 4, page_size=PAGE, faults=parse_faults(["global-swa"], 4)))
    assert not report.ok
    assert _stage_errors(report, 2) == _stage_errors(want, 2)
    assert _stage_errors(report, 2) == [
        "DeepSeek V4 SWA KV pool must be PP-stage-local: got 43 buffers for 11 local layers"
    ]
    # sglang's own HiCache build rejects the same pool with the same words
    with pytest.raises(ValueError, match="DeepSeek V4 SWA KV pool must be PP-stage-local: got 43 buffers for 11"):
        hpa.build_deepseek_v4_hicache_stack(
            params=_Params(), kvcache=pool, load_cache_event=None, storage_backend=None)


def test_missing_c4_state_same_error_as_check():
    layout = build_layout(FLASH, 4)
    s = layout.stages[1]
    pool = make_pool(FLASH44, s.start, s.end)
    last_c4 = s.pool_layers("c4_state")[-1].global_id
    pool.compress_state_pools[last_c4] = None
    report = integ.inspect_pool(pool, pp_size=4)
    want = preflight(build_plan(FLASH, 4, page_size=PAGE, faults=parse_faults(["missing-c4-state"], 4)))
    assert _stage_errors(report, 1) == _stage_errors(want, 1)
    assert "deepseek_v4_c4_state state_pools must not contain None" in _stage_errors(report, 1)[0]


def test_wrong_compress_id_and_pool_holes_are_reported():
    s = build_layout(TINY, 2).stages[1]
    pool = make_pool(RATIOS[TINY.name], s.start, s.end)
    c128 = s.pool_layers("c128")
    first, second = c128[0].global_id, c128[1].global_id
    pool.layer_mapping[second] = pool.layer_mapping[first]  # two C128 layers share an id
    pool.indexer_compress_state_pools[s.pool_layers("c4")[0].global_id] = None
    report = integ.inspect_pool(pool, pp_size=2)
    msgs = _stage_errors(report, 1)
    assert any("share compress_layer_id 0" in m for m in msgs), msgs
    assert any("c4_indexer_state state_pools must not contain None" in m for m in msgs), msgs
    assert any("differs from the stage-local id" in m for m in msgs), msgs


# -- start-up hook ---------------------------------------------------------------------------
class _Params:
    """The one CacheInitParams field build_deepseek_v4_hicache_stack reads before its SWA check."""

    page_size = PAGE
    mtp_draft_device_pools = ()


@contextlib.contextmanager
def as_rank(pp_rank: int, pp_size: int):
    """sglang's runtime context says this process is PP rank ``pp_rank`` of ``pp_size``."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(pp_rank=pp_rank, pp_size=pp_size, tp_rank=0, tp_size=1):
        yield


def build_stack(dep, kvcache):
    """sglang's stack build, through the deployment's hook (what ``HookRegistry`` applies)."""
    return dep.around_stack_build(hpa.build_deepseek_v4_hicache_stack, params=_Params(), kvcache=kvcache,
                                  load_cache_event=None, storage_backend=None)


def test_a_rank_alone_validates_its_stage_and_refuses_it_strictly():
    """``STAGECACHE_SGLANG_PER_RANK=1``: each rank a deployment of size 1, its own stage checked."""
    layout = build_layout(FLASH, 4)
    s = layout.stages[3]
    bad = _global_swa(make_pool(FLASH44, s.start, s.end))
    dep = integ.Deployment(integ.DeploymentOptions(per_rank=True, port=None))
    assert isinstance(dep.source, SnapshotSource) and dep.source.startup() is None
    with as_rank(3, 4), pytest.raises(StageMappingInvalid, match="stage 3.*PP-stage-local: got 43 buffers for 11"):
        build_stack(dep, bad)
    startup = dep.source.startup()
    assert startup.ok is False and [st.stage for st in startup.stages] == [3]
    assert startup.stages[0].buffers["swa"] == 43 and startup.cross_errors == ()  # no false gap
    live = dep.source.stages()[3]
    assert live.pool_bytes["swa"].device == sum(b.nbytes for b in bad.swa_kv_pool.kv_buffer)


def test_a_rank_not_strict_lets_sglang_refuse_with_its_own_words():
    s = build_layout(FLASH, 2).stages[0]
    bad = _global_swa(make_pool(FLASH44, s.start, s.end))
    dep = integ.Deployment(integ.DeploymentOptions(per_rank=True, port=None, strict=False))
    with as_rank(0, 2), pytest.raises(ValueError, match="DeepSeek V4 SWA KV pool must be PP-stage-local"):
        build_stack(dep, bad)  # the real sglang function runs and raises its own error
    assert dep.source.startup().ok is False


class _Controller:
    """Records HiCache acks the way sglang's start_writing/start_loading do (a stand-in for the
    counting alone: the real controller's copies are test_sglang_live_deployment's); the acks
    are sglang's HiCacheAck."""

    def __init__(self):
        self.ack_write_queue, self.ack_load_queue = [], []

    def start_writing(self):
        self.ack_write_queue.append(HiCacheAck(None, None, [1], num_tokens=256, num_bytes=4096))

    def start_loading(self):
        self.ack_load_queue.append(HiCacheAck(None, None, [1], num_tokens=512, num_bytes=8192))
        return 0


def _hooked(dep, ctl):
    """The controller's submissions as ``HookRegistry`` wraps them (AROUND) in a served rank."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    def wrap(method, hook):
        return lambda: _wrap_fn(method, hook, HookType.AROUND)(ctl)

    return (wrap(_Controller.start_writing, dep.around_start_writing),
            wrap(_Controller.start_loading, dep.around_start_loading))


def test_transfers_reach_the_prometheus_exporter():
    s = build_layout(TINY, 2).stages[1]
    pool = make_pool(RATIOS[TINY.name], s.start, s.end)
    dep = integ.Deployment(integ.DeploymentOptions(per_rank=True, port=None))
    with as_rank(1, 2):
        dep.join(pool, page_size=PAGE, host_pages={})
    ctl = _Controller()
    write, load = _hooked(dep, ctl)
    write()
    load()
    load()
    live = dep.source.stages()[1]
    assert live.transfer_bytes.model_dump() == {"d2h": 4096, "h2d": 16384}
    assert live.transfer_count.model_dump() == {"d2h": 1, "h2d": 2}
    assert live.transfer_seconds.h2d > 0
    ctl.start_writing()  # not through the hook: not counted
    assert dep.source.stages()[1].transfer_count.d2h == 1
    text = generate_latest(make_registry(dep.source)).decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = [x for f in text_string_to_metric_families(text) for x in f.samples]
    h2d = [x.value for x in samples if x.name == "stagecache_transfer_bytes_total"
           and x.labels["direction"] == "h2d" and x.labels["pp_rank"] == "1"]
    assert h2d == [16384.0]
    assert [x.value for x in samples if x.name == "stagecache_startup_ok"] == [1.0]


def test_a_rank_alone_serves_its_stage_on_port_plus_rank(free_port):
    import httpx

    s = build_layout(FLASH, 4).stages[2]
    bad = _global_swa(make_pool(FLASH44, s.start, s.end))
    dep = integ.Deployment(integ.DeploymentOptions(per_rank=True, port=free_port - 2))
    try:
        with as_rank(2, 4), pytest.raises(StageMappingInvalid):
            build_stack(dep, bad)
        assert dep.url == f"http://127.0.0.1:{free_port}"
        startup = httpx.get(f"{dep.url}/api/startup", timeout=10).json()
        assert startup["ok"] is False
        assert startup["stages"][0]["errors"][0]["message"].startswith(
            "DeepSeek V4 SWA KV pool must be PP-stage-local: got 43 buffers for 11")
        metrics = httpx.get(f"{dep.url}/metrics", timeout=10).text
        assert re.search(r"^stagecache_startup_ok\{[^}]*\} 0\.0$", metrics, re.M), metrics
    finally:
        dep.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{free_port}/healthz", timeout=2)


def test_a_rank_arms_the_hooks_its_server_and_pool_reach():
    """Beyond the load-time hooks: the prefix match always; with HiCache the stack build of the
    pool's family, the transfers, the per-step checks and the L3 prefetch query."""
    armed = integ.deployment.armed_hooks
    assert armed("deepseek_v4", hicache=False) == ("match",)
    steps = ("write", "load", "step", "write_check", "load_check", "prefetch", "prefetch_hybrid")
    assert armed("deepseek_v4", hicache=True) == ("match", "stack", *steps)
    assert armed("linear_hybrid", hicache=True) == ("match", "stack_mamba", *steps)
    assert [armed(f, True)[1] for f in ("swa_hybrid", "dsa", "mla", "mha")] == [
        "stack_swa", "stack_dsa", "stack_kv", "stack_kv"]
    assert armed(None, hicache=True) == ("match", *steps)  # a pool stagecache does not read
    assert set(integ.deployment.STACK_HOOK) == {f for _, _, f in integ.reader.POOL_FAMILIES}
    assert set(integ.deployment.HOOKS) == {*integ.deployment.AT_LOAD, "match", *steps,
                                           *integ.deployment.STACK_HOOK.values()}


def test_sglang_plugin_entry_point(monkeypatch):
    """sglang's own plugin loader finds the entry point; it is off unless STAGECACHE_SGLANG=1, and
    on it registers the load-time hooks with sglang's HookRegistry (which load_plugins then
    applies); each other hook registers with the kind it is, once armed."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    plugin, dist = load_plugins_by_group(GENERAL_PLUGINS_GROUP)["stagecache"]
    assert dist == "stagecache" and plugin is integ.sglang_plugin
    monkeypatch.delenv("STAGECACHE_SGLANG", raising=False)
    monkeypatch.setattr(integ.deployment, "_PLUGIN", None)
    assert plugin() is None and not any(t in HookRegistry._hooks for t in integ.deployment.TARGETS.values())

    monkeypatch.setenv("STAGECACHE_SGLANG", "1")
    monkeypatch.setenv("STAGECACHE_SGLANG_DASHBOARD_PORT", "9300")
    try:
        dep = plugin()
        assert plugin() is dep and dep.options.port == 9300 and dep.options.strict  # once per process
        targets = integ.deployment.TARGETS
        assert sorted(HookRegistry._hooks) == sorted(targets[n] for n in ("capacity", "pools"))
        dep.register(tuple(n for n in targets if n not in ("capacity", "pools")))  # every other
        kinds = {t: [h[0] for h in HookRegistry._hooks[t]] for t in targets.values()}
        for name in ("stack", "capacity", "pools", "write", "load", "step", "write_check", "load_check",
                     "prefetch", "prefetch_hybrid", "stack_mamba", "stack_swa", "stack_dsa", "stack_kv"):
            assert kinds[targets[name]] == [HookType.AROUND], name
        assert kinds[targets["match"]] == [HookType.AFTER]
        for target in integ.deployment.TARGETS.values():  # every target resolves in sglang 0.5.23
            import pkgutil

            mod, attr = target.rsplit(".", 1)
            assert callable(getattr(pkgutil.resolve_name(mod), attr)), target
    finally:
        HookRegistry.reset()  # registered only, never applied: nothing of sglang's was patched


def test_plugin_options_are_checked(monkeypatch):
    from stagecache.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"STAGECACHE_SGLANG_DASHBOARD_PORT must be a port \(0..65535\), got 'x'"):
        integ.DeploymentOptions.from_env({"STAGECACHE_SGLANG_DASHBOARD_PORT": "x"})
    with pytest.raises(ConfigError, match=r"STAGECACHE_SGLANG_PUSH_TIMEOUT_S must be in"):
        integ.DeploymentOptions.from_env({"STAGECACHE_SGLANG_PUSH_TIMEOUT_S": "-1"})
    opts = integ.DeploymentOptions.from_env({"STAGECACHE_SGLANG_PER_RANK": "1", "STAGECACHE_SGLANG_STRICT": "0"})
    assert opts.per_rank and not opts.strict and opts.port is None


def test_pool_of_another_partition_is_a_clear_config_error():
    from stagecache.runtime.errors import ConfigError

    pool = make_pool(FLASH44, 0, 10)  # rank 0 of pp 4, no rank of pp 3
    with pytest.raises(ConfigError, match=r"layers \[0, 10\) matches no rank of get_pp_indices for pp_size=3"):
        integ.inspect_pool(pool, pp_size=3)


def test_sync_transfers_still_records_without_cuda_events():
    dep = integ.Deployment(integ.DeploymentOptions(per_rank=True, port=None, sync_transfers=True))
    _, load = _hooked(dep, _Controller())
    load()
    live = dep.source.stages()[0]
    assert live.transfer_bytes.h2d == 8192 and live.transfer_seconds.h2d > 0


def test_push_endpoint_refuses_forged_replayed_and_oversized_pushes():
    """Rank 0's push route, over real HTTP: only MAC-verified, newer, bounded pushes are stored."""
    import httpx
    from stagecache.dashboard.server import dashboard_in_thread
    from stagecache.runtime.integrations.sglang.push import (
        MAX_PUSH_BYTES,
        PUSH_PATH,
        Pusher,
        PushReceiver,
    )
    from stagecache.runtime.live.numbers import StageLive
    from stagecache.runtime.serve.exchange import seal

    source = integ.SglangSource(push_timeout_s=5.0)
    secret = b"k" * 32
    receiver = PushReceiver(secret, 4, source.put_remote)
    with dashboard_in_thread(source, "127.0.0.1", _free_port(), configure=receiver.add_route) as url:
        pusher = Pusher(url, secret, 2, lambda: StageLive(stage=2, phase="serving"), 1.0)
        pusher.push_once()
        assert source.stages()[2].heartbeat_at is not None

        def post(body: bytes) -> int:
            return httpx.post(url + PUSH_PATH, content=body, timeout=5).status_code

        live = StageLive(stage=1).model_dump(mode="json")
        assert post(seal(b"x" * 32, {"stage": 1, "seq": 1, "live": live})) == 403  # wrong key
        sealed = seal(secret, {"stage": 1, "seq": 1, "live": live})
        assert post(sealed.replace(b'"seq":1', b'"seq":7')) == 403  # altered after sealing
        assert post(seal(secret, {"stage": 2, "seq": 1, "live": live})) == 409  # replayed seq
        assert post(seal(secret, {"stage": 0, "seq": 9, "live": live})) == 400  # rank 0 never pushes
        assert post(seal(secret, {"stage": 7, "seq": 9, "live": live})) == 400  # no such stage
        assert post(b"x" * (MAX_PUSH_BYTES + 1)) == 413
        assert 1 not in source.stages()


def test_agreement_records_ride_on_the_push_and_a_failed_push_sends_them_again():
    """A rank's agreement records over real HTTP to rank 0's compare: malformed ones are refused
    (400) without touching the compare, records of a push that did not get through go out with the
    next one, and rank 0 compares each key once."""
    import httpx
    from stagecache.dashboard.server import dashboard_in_thread
    from stagecache.runtime.integrations.sglang.agreement import RankAgreement
    from stagecache.runtime.integrations.sglang.push import PUSH_PATH, Pusher, PushReceiver
    from stagecache.runtime.live.numbers import StageLive
    from stagecache.runtime.serve.exchange import seal

    source = integ.SglangSource(push_timeout_s=5.0)
    own = RankAgreement()
    source.enable_agreement(2, own.drain)
    secret = b"k" * 32
    receiver = PushReceiver(secret, 2, source.put_remote, on_agreement=source.put_agreement)
    port = _free_port()
    rank1 = RankAgreement()
    pusher = Pusher(f"http://127.0.0.1:{port}", secret, 1, lambda: StageLive(stage=1), 1.0,
                    extra=rank1.take, sent=rank1.sent)
    own.request("r1", 512, 256)
    rank1.request("r1", 512, 0)
    with pytest.raises(OSError):  # rank 0 is not up yet: the records stay with the rank
        pusher.push_once()
    rank1.request("r2", 0, 0)
    own.request("r2", 0, 0)
    with dashboard_in_thread(source, "127.0.0.1", port, configure=receiver.add_route) as url:
        live = StageLive(stage=1).model_dump(mode="json")
        bad = seal(secret, {"stage": 1, "seq": 1, "live": live, "agreement": {"requests": [["r9", 1]]}})
        r = httpx.post(url + PUSH_PATH, content=bad, timeout=5)
        assert r.status_code == 400 and "agreement records" in r.text
        pusher._seq = 1
        pusher.push_once()  # r1 (sent again) and r2
        pusher.push_once()  # nothing new: compared once
        d = source.divergence()
        assert d.compared["host_hit_length"] == 2 and d.divergent["host_hit_length"] == 1
        assert (d.first.request, d.first.ranks, d.first.values) == ("r1", [1], [256, 0])
        stage1 = source.stages()[1].agreement
        assert stage1.disagreements == {"host_hit_length": 1} and stage1.recent[0].request == "r1"


def test_rank_0_logs_an_incomplete_transfer_with_its_stage_kind_and_page(caplog):
    from stagecache.runtime.integrations.sglang.agreement import RankAgreement
    from stagecache.runtime.live.divergence import IncompleteBackup, RankBatch

    source = integ.SglangSource(push_timeout_s=5.0)
    source.enable_agreement(2, RankAgreement().drain)
    bad = IncompleteBackup(time=0.0, stage=1, direction="d2h", page=7, pages=2, missing=["indexer"],
                           expected_bytes=300, got_bytes=200)
    with caplog.at_level(logging.WARNING, logger="stagecache"):
        source.put_agreement(1, RankBatch(backups=[bad, bad]).wire())
    lines = [r.getMessage() for r in caplog.records if "incomplete HiCache transfer" in r.getMessage()]
    assert lines == ["stagecache: incomplete HiCache transfer #1: stage 1: backup of host page 7 (2 page(s)) "
                     "lacks pool kind(s) indexer: 200 bytes moved, the stage's plan says 300"]
    assert source.divergence().incomplete == {"indexer": 2}


def test_the_plugins_fault_is_the_products_live_fault_and_bad_values_are_one_line():
    from stagecache.runtime.errors import ConfigError
    from stagecache.runtime.integrations.sglang.agreement import RankAgreement

    assert integ.DeploymentOptions.from_env({}).fault is None
    assert integ.DeploymentOptions.from_env({"STAGECACHE_FAULT": "backup-without-indexer@1"}).fault == (
        "backup-without-indexer", 1)
    for text, words in (("global-swa", "the sglang plugin plants backup-without-indexer"),
                        ("backup-without-indexer@", "expected a stage number"),
                        ("backup-without-indexer@x", "expected a stage number")):
        with pytest.raises(ConfigError, match=words):
            integ.DeploymentOptions.from_env({"STAGECACHE_FAULT": text})
    # armed at the stack build: the family's indexer kinds as its sglang pools, on the hit stage only
    hit, missed = RankAgreement(), RankAgreement()
    hit.fault = missed.fault = ("backup-without-indexer", 1)
    hit.stage, missed.stage = 1, 2
    hit.arm_fault("deepseek_v4", 4)
    missed.arm_fault("deepseek_v4", 4)
    assert hit.left_out == {"deepseek_v4_c4_indexer", "deepseek_v4_c4_indexer_state", "deepseek_v4_c4_indexer_scale"}
    assert missed.left_out == frozenset()
    with pytest.raises(ConfigError, match="stage 1 out of range for pp_size 1"):
        hit.arm_fault("deepseek_v4", 1)
    mha = RankAgreement()
    mha.fault = ("backup-without-indexer", None)
    with pytest.raises(ConfigError, match="is not a fault of MHA models"):
        mha.arm_fault("mha", 2)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_tested_releases_are_the_ones_the_suites_run_on():
    from sglang_env import PREVIOUS_VERSION

    assert set(integ.SGLANG_TESTED_VERSIONS) == {PREVIOUS_VERSION, "0.5.23"}
    assert sglang.__version__ in integ.SGLANG_TESTED_VERSIONS
    assert integ.deployment.changed_targets() == []  # this release: every target as the hooks expect


def plugin_off_line(monkeypatch, caplog) -> str:
    """Load the plugin as sglang would: it must register nothing and log the one "stays off" line,
    which is returned."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv("STAGECACHE_SGLANG", "1")
    monkeypatch.setattr(integ.deployment, "_PLUGIN", None)
    with caplog.at_level(logging.WARNING, logger="stagecache"):
        assert integ.sglang_plugin() is None
    assert not any(t in HookRegistry._hooks for t in integ.deployment.TARGETS.values())
    [line] = [r.getMessage() for r in caplog.records if "stays off" in r.getMessage()]
    return line


def test_a_release_whose_hooked_function_changed_leaves_the_plugin_off(monkeypatch, caplog):
    """One target renamed its parameter: the plugin logs one line naming it and registers nothing
    -- the server starts as if stagecache were not installed."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    monkeypatch.setattr(UnifiedRadixCache, "match_prefix", lambda self, request: None)
    line = plugin_off_line(monkeypatch, caplog)
    assert "UnifiedRadixCache.match_prefix takes (self, request), expected (self, params, ...)" in line
    assert "tested with (0.5.22, 0.5.23)" in line


def test_a_release_without_a_familys_stack_strategy_leaves_the_plugin_off(monkeypatch, caplog):
    """Every family's hook point is checked at load too: an assembler without ``_SwaStrategy`` (a
    release that renamed it) leaves the plugin off with one line naming the missing target."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa

    monkeypatch.delattr(hpa, "_SwaStrategy")
    line = plugin_off_line(monkeypatch, caplog)
    assert "hybrid_pool_assembler._SwaStrategy.build is missing (AttributeError)" in line, line
