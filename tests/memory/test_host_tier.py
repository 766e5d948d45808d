"""Host-tier sanity: the statuses, the RAM rule before allocation (with values that fit), pinned
memory refused, the live re-check of MemAvailable, and the /readyz verdict."""

from __future__ import annotations

import re
import time

import pytest
import torch
from live_helpers import blank_live
from plans import pools as make_pools
from plans import report, run_plan
from stagecache.runtime.cli.main import build_parser
from stagecache.runtime.cli.serve import options_from_args
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.live.liveness import assess
from stagecache.runtime.live.numbers import HostTierLive, StageLive
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.memory.host_tier import (
    EXCEEDS_RAM,
    OK,
    PIN_REFUSED,
    SMALLER_THAN_DEVICE,
    MemInfo,
    RamWatch,
    fit_advice,
    host_tier_check,
    read_meminfo,
)
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.serve.heartbeat import StageFile
from stagecache.runtime.serve.host_tier_live import StageHostTier
from stagecache.runtime.serve.options import check_host_memory
from stagecache.runtime.transfer.controller import TransferController

TINY = load_spec("tiny-v4")
S1 = build_layout(TINY, 4).stages[1]
GIB = 1 << 30
DEV = {"swa": 64, "c4": 64}


def test_statuses_hold_one_by_one_and_together():
    mem = MemInfo(available=8 * GIB, total=16 * GIB)  # reserve: 0.8 GiB
    ok = host_tier_check("stage 0 host tier", DEV, {"swa": 128, "c4": 128}, 0, mem)
    assert ok.statuses == (OK,) and ok.ready and not ok.warnings
    small = host_tier_check("stage 0 host tier", DEV, {"swa": 48, "c4": 48}, 0, mem,
                            write_policy="write_through")
    assert small.statuses == (SMALLER_THAN_DEVICE,) and small.ready
    assert "48 host pages for 64 device pages" in small.reasons[0]
    assert "16 device pages can never be mirrored" in small.reasons[0]
    assert "--hicache-ratio" in small.reasons[0]
    pinned = host_tier_check("s", DEV, DEV, 0, mem, pin_error="cudaHostAlloc failed")
    assert pinned.statuses == (PIN_REFUSED,) and pinned.ready and "cudaHostAlloc" in pinned.warnings[0]
    # the RAM rule: MemAvailable - bytes still to allocate >= reserve
    room = mem.available - mem.reserve()  # 7.2 GiB
    assert host_tier_check("s", DEV, DEV, room, mem).statuses == (OK,)
    over = host_tier_check("s", DEV, DEV, room + 1, mem)
    assert over.statuses == (EXCEEDS_RAM,) and not over.ready and over.errors == over.reasons
    short = MemInfo(available=GIB // 2, total=16 * GIB)  # resident tier, host short
    both = host_tier_check("s", DEV, {"swa": 8, "c4": 8}, 0, short, pin_error="x")
    assert both.statuses == (SMALLER_THAN_DEVICE, PIN_REFUSED, EXCEEDS_RAM) and not both.ready
    assert len(both.warnings) == 2 and "below the 819.2 MiB reserve" in both.errors[0]


def test_meminfo_is_read_from_the_kernel_file_and_rechecked_after_the_interval(tmp_path):
    real = read_meminfo()
    assert real is not None and 0 < real.available <= real.total
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       16777216 kB\nMemFree: 1 kB\nMemAvailable:    8388608 kB\n")
    now = [0.0]
    watch = RamWatch(interval=2.0, path=str(f), clock=lambda: now[0])
    assert watch.read() == MemInfo(available=8 * GIB, total=16 * GIB)
    f.write_text("MemTotal:       16777216 kB\nMemAvailable:     102400 kB\n")
    now[0] = 1.9
    assert watch.read().available == 8 * GIB  # cached: one file read per interval at most
    now[0] = 2.0
    assert watch.read().available == 100 << 20
    f.write_text("garbage")
    now[0] = 5.0
    assert watch.read() is None


def test_a_running_stage_turns_exceeds_ram_when_the_host_runs_short(tmp_path):
    pools = make_pools(TINY, S1, 128, 8)
    host = HostPools(pools)
    tier = StageHostTier(pools, host, "write_through")
    f = tmp_path / "meminfo"
    f.write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    now = [0.0]
    tier.watch = RamWatch(path=str(f), clock=lambda: now[0])
    live = tier.live()
    assert live.status == ["ok"] and live.ready and live.host_pages == 16 and live.device_pages == 8
    assert live.host_bytes == sum(host.pool_bytes().values()) and live.reserve_bytes == int(0.05 * 16 * GIB)
    f.write_text("MemTotal: 16777216 kB\nMemAvailable: 409600 kB\n")  # 400 MiB < the 819 MiB reserve
    now[0] = 10.0
    live = tier.live()
    assert live.status == [EXCEEDS_RAM] and not live.ready
    assert live.reasons[0].startswith("stage 1 host tier: host RAM short: 400.0 MiB available")


def test_the_heartbeat_refreshes_the_host_tier_while_the_stage_waits(tmp_path):
    sf = StageFile(tmp_path / "stage-0.json")
    sf.publish(StageLive(stage=0))
    sf.refresh = lambda: {"host_tier": HostTierLive(status=["exceeds_ram"], reasons=["r"], ready=False)}
    sf.beat()
    on_disk = StageLive.model_validate_json((tmp_path / "stage-0.json").read_text())
    assert on_disk.host_tier.status == ["exceeds_ram"] and not on_disk.host_tier.ready
    sf.refresh = lambda: 1 / 0  # a failing refresh never stops the beat
    sf.beat()
    assert StageLive.model_validate_json((tmp_path / "stage-0.json").read_text()).heartbeat_at


def test_pinned_memory_refused_falls_back_or_refuses_by_the_rule():
    if torch.cuda.is_available():
        pytest.skip("pinned memory is not refused on a CUDA host")
    pools = make_pools(TINY, S1, 128, 4)
    # explicitly asked for, no fallback: one line naming the stage
    with pytest.raises(ConfigError, match="stage 1 host pools: pin_memory=True needs CUDA"):
        HostPools(pools, pin_memory=True)
    # with the fallback (the default rule when pinning is only the default): torch's own refusal,
    # recorded, and a working pageable tier
    host = HostPools(pools, pin_memory=True, pin_fallback=True)
    assert not host.pinned and "pin_memory=True requires" in host.pin_error
    assert all(b is not None for b in host.buffers["swa"]) and not host.buffers["swa"][0].is_pinned()
    ctrl = TransferController(pools, host)
    d, h = pools.allocator.alloc(2), host.allocator.alloc(2)
    pools.buffers["swa"][0][d[0]].fill_(7)
    ctrl.backup(d, h).synchronize()
    assert int(host.buffers["swa"][0][h[0]].sum()) == 7 * pools.page_bytes("swa")
    tier = StageHostTier(pools, host, "write_through").live()
    assert tier.status == [PIN_REFUSED] and tier.ready and tier.pin_error == host.pin_error


def _plan(pages, ratio):
    return run_plan("tiny-v4", 4, pages=pages, hicache_ratio=ratio)


def _need_for():
    def need(pages, ratio):
        return check_host_memory(_plan(pages, ratio), "cuda", mem=MemInfo(available=1 << 62, total=1 << 62))
    return need


def test_the_suggested_values_fit_and_the_next_step_does_not():
    mem = MemInfo(available=2 * GIB, total=4 * GIB)  # 1.8 GiB may be allocated
    with pytest.raises(ConfigError) as e:  # device on GPUs: the host pools alone are in RAM
        check_host_memory(_plan(4000, 2.0), "cuda", min_device_pages=10, mem=mem)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the 4 stages' host pools together need")
    ratio = float(re.search(r"--hicache-ratio to ([\d.]+)", msg).group(1))
    pages = int(re.search(r"--device-pages to (\d+)", msg).group(1))
    assert 0 < ratio < 2.0 and 10 <= pages < 4000
    check_host_memory(_plan(4000, ratio), "cuda", mem=mem)  # fits
    check_host_memory(_plan(pages, 2.0), "cuda", mem=mem)
    with pytest.raises(ConfigError):
        check_host_memory(_plan(4000, round(ratio + 0.01, 2)), "cuda", mem=mem)
    with pytest.raises(ConfigError):
        check_host_memory(_plan(pages + 1, 2.0), "cuda", mem=mem)
    # the device pages never go below what the trace needs: then only the ratio is offered
    budget = 2 * GIB - int(0.05 * 4 * GIB)
    advice = fit_advice(_need_for(), budget, 4000, 2.0, min_pages=pages + 1)
    assert "--device-pages" not in advice and "--hicache-ratio to" in advice
    # on CPU the device pools count too: fewer pages fit
    with pytest.raises(ConfigError, match="device \\+ host pools together") as e:
        check_host_memory(_plan(4000, 2.0), "cpu", mem=mem)
    assert int(re.search(r"--device-pages to (\d+)", str(e.value)).group(1)) < pages
    # --max-total-tokens users get tokens (whole pages of 256)
    with pytest.raises(ConfigError) as e:
        check_host_memory(_plan(4000, 2.0), "cuda", pages_flag="--max-total-tokens", mem=mem)
    assert int(re.search(r"--max-total-tokens to (\d+)", str(e.value)).group(1)) == pages * 256


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_ten_terabytes_of_host_pages_is_refused_before_anything_is_allocated():
    """No pool exists when the error comes: RSS does not move, and the answer takes milliseconds."""
    ok = build_parser().parse_args(["serve", "--requests", "40"])
    options_from_args(ok)  # warm: imports and the generated trace
    args = build_parser().parse_args(["serve", "--requests", "40", "--hicache-ratio", "250000"])
    before, t0 = _rss(), time.perf_counter()
    with pytest.raises(ConfigError) as e:
        options_from_args(args)
    elapsed, grown = time.perf_counter() - t0, _rss() - before
    msg = str(e.value)
    assert re.search(r"need (9|10)\.\d TiB of RAM", msg), msg
    assert "lower --hicache-ratio to " in msg and "\n" not in msg
    assert elapsed < 1.0, elapsed
    assert grown < 16 << 20, grown  # 10 TiB asked for, nothing allocated
    ratio = re.search(r"--hicache-ratio to ([\d.]+)", msg).group(1)
    fits = build_parser().parse_args(["serve", "--requests", "40", "--hicache-ratio", ratio])
    try:
        assert options_from_args(fits).plan.sizing.hicache_ratio == float(ratio)
    except ConfigError as again:  # the host's free RAM moved between the two checks: still a fit error
        assert "of RAM" in str(again)


def _stage(k: int, status: list[str], reasons: list[str], ready: bool) -> StageLive:
    d = blank_live(k)
    d.update(phase="serving", time=time.time(), heartbeat_at=time.time(),
             host_tier={"status": status, "reasons": reasons, "ready": ready})
    return StageLive.model_validate(d)


def test_readyz_fails_on_exceeds_ram_and_warns_on_the_others():
    run = {"phase": "serving", "pp_size": 3}
    from stagecache.runtime.live.numbers import RunInfo

    stages = {0: _stage(0, ["ok"], ["stage 0 host tier: ok"], True),
              1: _stage(1, ["smaller_than_device", "pin_refused"], ["stage 1 a", "stage 1 b"], True),
              2: _stage(2, ["ok"], ["stage 2 host tier: ok"], True)}
    ok = report("tiny-v4", 3)
    v = assess(RunInfo(**run), ok, stages, time.time())
    assert v.ready and v.warnings == ["stage 1 a", "stage 1 b"] and v.reasons == []
    assert [h.host_tier for h in v.stages] == [["ok"], ["smaller_than_device", "pin_refused"], ["ok"]]
    stages[2] = _stage(2, ["exceeds_ram"], ["stage 2 host tier: host RAM short"], False)
    v = assess(RunInfo(**run), ok, stages, time.time())
    assert not v.ready and v.reasons == ["stage 2 host tier: host RAM short"]


def test_a_node_of_several_hosts_counts_only_its_own_stages():
    """serve --nnodes: each host's RAM holds its own stages' pools, not every stage's."""
    mem = MemInfo(available=1 << 62, total=1 << 62)
    plan = _plan(4000, 2.0)
    everything = check_host_memory(plan, "cuda", mem=mem)
    half = check_host_memory(plan, "cuda", mem=mem, stages=range(2, 4))
    assert 0 < half < everything
    with pytest.raises(ConfigError) as e:
        check_host_memory(plan, "cuda", mem=MemInfo(available=half // 2, total=half), stages=range(2, 4))
    assert str(e.value).startswith("this node's 2 stages' host pools together need")
