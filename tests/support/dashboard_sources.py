"""Snapshot sources that play what a real run looks like, for the dashboard's browser tests."""

from __future__ import annotations

import time

from live_helpers import blank_live
from plans import report
from stagecache.runtime.live.numbers import RunInfo, StageLive
from stagecache.runtime.model.families.deepseek_v4 import POOLS
from stagecache.runtime.validation.report import StartupReport

MODEL, PP = "deepseek-v4-flash", 4


def expected_report(faults: list[str]) -> StartupReport:
    return report(MODEL, PP, list(faults))


RATIO = (0.2, 0.35, 0.5, 0.65)  # each stage's own host-hit share (stages that truly differ)
TOTAL = 2400  # requests in the run: 4 a second, so it is still going 10 minutes in (a loaded machine)


class ScriptedRun:
    """A SnapshotSource playing one run; the test moves ``phase`` on.

    Counters grow with wall time while running (1000 lookups/s per stage, a
    per-stage host-hit share), so windowed rates are known exactly; every stage
    but the first waits for its activation before each micro-batch (bubbles).
    """

    def __init__(self) -> None:
        self.phase = "starting"
        self.device_used = 4  # device pages in use on every stage (the occupancy test moves it)
        self._report = expected_report([])
        self._t0 = 0.0
        self._elapsed = 0.0

    write_failures = None

    def run(self) -> RunInfo:
        parent = {"starting": "starting", "validating": "starting", "running": "serving",
                  "done": "done", "failed": "failed"}[self.phase]
        return RunInfo(phase=parent, failure="stage 2 (pid 4242) exited with code 1: boom"
                       if self.phase == "failed" else None)

    def startup(self):
        return None if self.phase in ("starting", "validating") else self._report

    def _clock(self) -> float:
        if self.phase == "running":
            self._t0 = self._t0 or time.time()
            self._elapsed = time.time() - self._t0
        return self._elapsed

    def stages(self):
        if self.phase == "starting":
            return {}
        e = self._clock()
        return {s: StageLive.model_validate(self._stage(s, e)) for s in range(PP)}

    def _stage(self, s: int, e: float) -> dict:
        d = blank_live(s, POOLS)
        if self.phase == "validating":
            return d
        lookups = int(1000 * e)
        d.update(time=time.time(), model_name=MODEL, requests=min(TOTAL, int(4 * e)), total_requests=TOTAL,
                 phase={"running": "serving", "failed": "failed" if s == 2 else "serving"}.get(self.phase, "done"),
                 error="boom" if self.phase == "failed" and s == 2 else None,
                 stage_seconds=0.06 * e, bubble_seconds=0.02 * s * e)
        d["cache_tokens"] = {"device": 0, "host": int(RATIO[s] * lookups), "miss": lookups - int(RATIO[s] * lookups)}
        d["transfer_bytes"] = {"d2h": int(1e6 * (s + 1) * e), "h2d": int(5e5 * e)}
        n = int(100 * e)  # transfers per direction: stage s waits (s + 1) ms per backup, 0.5 ms per load
        d["transfer_count"] = {"d2h": n, "h2d": n}
        d["transfer_seconds"] = {"d2h": 0.002 * n, "h2d": 0.001 * n}
        d["transfer_split"] = {"queue_seconds": {"d2h": 0.001 * (s + 1) * n, "h2d": 0.0005 * n}}
        d["timeline"] = [ev for i in range(max(0, int(10 * e) - 20), int(10 * e))
                         for ev in self._events(s, i)]
        d["host_tier"], d["pool_occupancy"] = host_tier(s), occupancy(s, self.device_used)
        d["insight"]["miss_tokens"] = miss_tokens(s, d["cache_tokens"])
        d["agreement"] = agreement(s, e, self._t0)
        return d

    def _events(self, s: int, i: int) -> list[dict]:
        start = self._t0 + 0.1 * i + 0.02 * s
        ev = [{"kind": "compute", "start": start, "seconds": 0.06, "micro_batch": i}]
        if s:
            ev.insert(0, {"kind": "recv_wait", "start": start - 0.02 * s, "seconds": 0.02 * s,
                          "micro_batch": i})
        return ev


class LateReportSource:
    """No report until ``ready`` is set: what ``serve`` looks like while its stages start."""

    def __init__(self) -> None:
        self.ready = False
        self._report = expected_report(["global-swa"])

    write_failures = None

    def startup(self):
        return self._report if self.ready else None

    def stages(self):
        return {}

    def run(self):
        return None


# -- host tier and pool occupancy --------------------------------------------------------------
#: stage -> its host-tier statuses: stage 1's host tier is smaller than its device tier, stage 3's
#: host has run short of RAM, the others are ok
HOST_TIER = {1: ["smaller_than_device"], 3: ["exceeds_ram"]}
DEVICE_PAGES, HOST_PAGES, SLOTS = 16, 32, 4


def host_tier(s: int) -> dict:
    status = HOST_TIER.get(s, ["ok"])
    return {"status": status, "reasons": [f"stage {s} host tier: {st} (scripted)" for st in status],
            "ready": status != ["exceeds_ram"], "pinned": s != 2,
            "mem_available_bytes": (512 << 20) if s == 3 else (8 << 30), "reserve_bytes": 1 << 30}


def occupancy(s: int, device_used: int) -> list[dict]:
    """Every pool kind on the device (c128_state in request slots), the host-cached kinds on the host."""
    from stagecache.runtime.model.families.deepseek_v4 import KINDS

    rows = []
    for pool, kind in KINDS.items():
        if kind.paged:
            rows.append({"pool": pool, "tier": "device", "unit": "page", "used": device_used,
                         "capacity": DEVICE_PAGES, "peak": device_used})
        else:
            rows.append({"pool": pool, "tier": "device", "unit": "slot", "used": 1, "capacity": SLOTS,
                         "peak": SLOTS})
        if kind.host_cached:
            rows.append({"pool": pool, "tier": "host", "unit": "page", "used": 8 * (s + 1),
                         "capacity": HOST_PAGES, "peak": 8 * (s + 1)})
    return rows


# -- cache insight and stage agreement -----------------------------------------------------------
#: stage 2 drifts: it disagrees on the matched prefix of every 4th request (one per second)
SKEWED_STAGE = 2


def miss_tokens(s: int, tokens: dict) -> dict:
    """Device-tier misses by reason: host hits were evicted from device, a quarter of the rest is
    the partial-page tail, the skewed stage books another quarter as stage_disagreement."""
    miss = tokens["miss"]
    tail = miss // 4
    skew = miss // 4 if s == SKEWED_STAGE else 0
    host = {"never_seen": miss - tail - skew, "partial_page_tail": tail, "stage_disagreement": skew}
    return {"host": host, "device": {**host, "evicted_from_device": tokens["host"]}}


def agreement(s: int, e: float, t0: float) -> dict:
    n = int(e)  # disagreements so far: one a second
    recent = [{"time": t0 + i, "micro_batch": 2 * i, "request": f"session-{i}/1", "kind": "matched_prefix",
               "stages": [SKEWED_STAGE], "agreed": 3, "values": [3, 3, 2, 3]} for i in range(n)]
    return {"disagreements": {"matched_prefix": n if s == SKEWED_STAGE else 0},
            "compared_requests": 4 * n, "recent": recent[-50:] if s == 0 else []}
