"""``stagecache bench transfer``: stagecache's page moves against the peer techniques, same run, same pages.

The grid (both directions, scattered device and host pages):

* ``stage-mix:N`` -- N token pages of every host-cached pool of one stage (default
  flash pp4 stage 1), byte sizes read from the pools themselves;
* ``KIND:M MiB``  -- one pool kind alone over ``--layers`` layer buffers, M MiB per move.

Per grid point and direction every technique (``transfer_peers``: the contiguous
ceiling, the per-page loop, the warp-per-item kernel; and stagecache) is first
checked byte-exact on poisoned destinations, then timed: the median wall time
from the call to the device being idle again, same clock for all, sampled in
interleaved rounds (``Clock`` below); with ``--probes`` two hand-written CUDA
kernels and a copy-engine batch time the link itself on the same pages
(``transfer_probes``).  stagecache's
per-call overhead (host time from the call until its work is queued, and until
the call returns, taken with the device idle) is reported on its own.  Progress
goes to stderr.
"""

from __future__ import annotations

import functools
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..memory.host_pools import HostPools
from ..memory.host_tier import fmt_bytes, largest_fitting, ram_budget, read_meminfo
from ..memory.pools import StagePools
from ..model.families import spec_from_config
from ..model.families.deepseek_v4 import KINDS
from ..model.spec import ModelSpec
from ..plan.plan import RunPlan, Sizing, StagePlan, build_plan, select_kinds
from ..transfer import native
from ..transfer.controller import TransferController
from ..transfer.device import LaunchShape
from ..transfer.selection import buffer_pair
from ..transfer.stats import gbps
from . import transfer_peers as peers
from . import transfer_probes as probes
from .transfer_report import MIB, PEERS, environment, summary

MIX_PAGES = (1, 4, 16, 64, 256)
#: stagecache's per-call host times in a row (``Clock.issue_us``), microseconds.
OVERHEAD_KEYS = ("issue_us", "issue_cold_us", "call_us", "call_cold_us")
KIND_MIB = (4, 64, 256)


def mix_pages(cuda: bool) -> list[int]:
    """Default stage-mix sizes; on CPU without the 256-page point (1.3 GB per move: minutes, GBs of RAM)."""
    return list(MIX_PAGES if cuda else MIX_PAGES[:-1])


def kind_mib(cuda: bool) -> list[float]:
    """Default one-kind sizes; on CPU without 256 MiB (for the same reason)."""
    return list(KIND_MIB if cuda else KIND_MIB[:-1])
#: Engine variants ``--sweep`` times on every grid point (stagecache only).
SWEEP = (LaunchShape(), LaunchShape(lane_words=2), LaunchShape(fine_chunk_bytes=1024),
         LaunchShape(num_warps=2, programs_per_sm=32), LaunchShape(chunk_bytes=16384),
         LaunchShape(chunk_bytes=4096))


@dataclass(frozen=True)
class Case:
    """One grid point: a stage (or a one-kind model) and how many token pages move."""

    name: str
    plan: RunPlan  # the model's plan (its sizing is replaced per case: ``stage_plan``)
    stage: int
    kinds: tuple[str, ...] | None  # None = every pool kind of the stage
    pages: int

    def stage_plan(self, pages: int, host_pages: int | None = None) -> StagePlan:
        """The case's stage sized to ``pages`` device pages (and as many host pages, or ``host_pages``)."""
        sized = self.plan.resized(Sizing.runtime(pages, host_pages=host_pages or pages)).stage(self.stage)
        return select_kinds(sized, self.kinds) if self.kinds is not None else sized


@dataclass(frozen=True)
class Settings:
    """What to run and how long to sample (from the CLI flags)."""

    device: str
    page_size: int
    layout: str
    seed: int
    min_reps: int
    max_reps: int
    budget_s: float
    sweep: bool = False
    shape: LaunchShape = LaunchShape()
    probes: bool = False  # also time the link probes (``transfer_probes``; CUDA)


def launch_shape(chunk_bytes: int | None, programs_per_sm: int | None, num_warps: int | None,
                 lane_words: int | None = None, fine_chunk_bytes: int | None = None) -> LaunchShape:
    """The device mover's default launch shape, with the flags given on the command line."""
    given = {"chunk_bytes": chunk_bytes, "programs_per_sm": programs_per_sm, "num_warps": num_warps,
             "lane_words": lane_words, "fine_chunk_bytes": fine_chunk_bytes}
    return LaunchShape(**{k: v for k, v in given.items() if v is not None})


#: Progress of the bench, on stderr (the CLI shows the bench's INFO lines).
log = logging.getLogger(__name__)


# -- the clock: wall time from a call until the device is idle again, sampled in interleaved rounds.
# A shared host's PCIe and memory rates drift by a few percent over seconds, more than the techniques
# differ at 256 MiB: in rounds (every technique once per round) a slow spell falls on all alike.  The
# order within a round is shuffled (seeded): in a fixed cycle, on a CPU, the technique that follows
# another one moving the same pages finds them in cache.

@dataclass(frozen=True)
class Sampling:
    """How long to sample: at least ``min_reps`` calls and ``budget_s`` seconds per technique, at
    most ``max_reps`` calls; a technique whose first 3 calls took 4x the budget stops there."""

    min_reps: int
    max_reps: int
    budget_s: float

    def done(self, samples: list[float]) -> bool:
        n, spent = len(samples), sum(samples)
        if n >= self.max_reps:
            return True
        if n >= min(3, self.min_reps) and spent >= 4 * self.budget_s:
            return True
        return n >= self.min_reps and spent >= self.budget_s


class Clock:
    """Wall-time medians of calls, each bracketed by device syncs."""

    def __init__(self, cuda: bool, sampling: Sampling):
        import torch

        self.sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        self.sampling = sampling

    def once(self, fn: Callable[[], Any]) -> float:
        """Seconds from the call to the device idle, the device idle before it."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def median_ms(self, fn: Callable[[], Any]) -> float:
        """Median milliseconds of ``fn`` alone."""
        return self.interleaved_ms({"fn": fn})["fn"]

    def interleaved_ms(self, fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
        """Median milliseconds of each of ``fns``, sampled in rounds of one call each (in an order
        shuffled per round) until each one's sampling is done."""
        samples: dict[str, list[float]] = {k: [] for k in fns}
        order = random.Random(len(fns))
        while True:
            live = [k for k in fns if not self.sampling.done(samples[k])]
            if not live:
                break
            order.shuffle(live)
            for k in live:
                samples[k].append(self.once(fns[k]))
        return {k: statistics.median(v) * 1e3 for k, v in samples.items()}

    def issue_us(self, fn: Callable[[], Any], move_ms: float, keys: tuple[str, ...]) -> dict[str, float]:
        """Median host times of a call, in bursts of two after the device went idle: from the
        call to its copy queued on the stream (``issue``: the call's ``TransferResult.queued``)
        and to the call's return (``call``: bookkeeping after the launch included).

        cold = the first call of a burst (the host thread just woke from waiting on the
        device); warm = the second, queued right behind the first, as in a steady stream
        of moves.  Neither waits for the device (the id ring has free slots).  ``keys`` name
        (warm issue, cold issue, warm call, cold call).
        """
        rows: list[tuple[float, float, float, float]] = []
        for _ in range(max(3, min(200, int(500 / max(move_ms, 1e-3))))):
            self.sync()
            t0 = time.perf_counter()
            first = fn()
            t1 = time.perf_counter()
            second = fn()
            t2 = time.perf_counter()
            rows.append((second.queued - t1, first.queued - t0, t2 - t1, t1 - t0))
        self.sync()
        return {k: round(statistics.median(r[i] for r in rows) * 1e6, 2) for i, k in enumerate(keys)}


# -- the RAM check: the largest case must fit the host's RAM before any pool exists ---------------
def case_slack(pages: int) -> int:
    """Spare pages around a case's moved pages (scattered ids need room)."""
    return max(8, pages // 4)


def check_cases_ram(cases: Sequence[Case], device_in_ram: bool) -> None:
    """ConfigError (one line, a flag and a value that fits) when a case cannot fit in RAM."""
    mem = read_meminfo()
    if mem is None or not cases:
        return
    budget = ram_budget(mem)
    copies = 2 if device_in_ram else 1  # the host side, and the device side when it is in RAM

    def need(case: Case, pages: int) -> int:  # pools of pages + slack, ceiling buffers of pages
        return (2 * pages + case_slack(pages)) * case.stage_plan(1).token_page_bytes * copies

    for case in sorted(cases, key=lambda c: -c.pages):
        n = need(case, case.pages)
        if n <= budget:
            continue
        fit = largest_fitting(lambda p, c=case: need(c, p) <= budget, 1, case.pages - 1)
        if case.kinds is None:
            hint = f"lower --mix-pages to {fit}" if fit else "no page count fits"
        else:
            mib = (fit or 0) * case.stage_plan(1).token_page_bytes / MIB
            hint = f"lower --kind-mib to {mib:.1f}" if fit else "no size fits"
        raise ConfigError(f"bench transfer case {case.name}: {case.pages} pages need {fmt_bytes(n)} of "
                          f"RAM, only {fmt_bytes(budget)} available ({fmt_bytes(mem.available)} less "
                          f"the {fmt_bytes(mem.reserve())} reserve); {hint}")


def single_kind_spec(base: ModelSpec, pool: str, layers: int) -> ModelSpec:
    """A model of ``layers`` layers that all carry a buffer of ``pool`` (same row sizes as ``base``)."""
    ratio = KINDS[pool].owner_ratio or 0
    cfg = {
        "num_hidden_layers": layers, "compress_ratios": [ratio] * layers,
        "sliding_window": base.sliding_window, "head_dim": base.head_dim,
        "qk_rope_head_dim": base.qk_rope_head_dim, "index_head_dim": base.index_head_dim,
    }
    return spec_from_config(cfg, name=f"{base.name}/{pool}x{layers}")


def grid(base: ModelSpec, pp: int, stage: int, page_size: int, layers: int, mix_pages: list[int],
         kind_mib: list[float], kinds: list[str] | None) -> list[Case]:
    """The cases to run: the stage mix at each page count, then each host-cached kind at each size."""
    plan = build_plan(base, pp, page_size=page_size)
    cases = [Case(f"stage-mix:{n}", plan, stage, None, n) for n in mix_pages]
    if not kind_mib:
        return cases
    cached = [p.pool for p in plan.stage(stage).pools if p.host_pages and p.present]
    for pool in [k for k in cached if kinds is None or k in kinds]:
        one = build_plan(single_kind_spec(base, pool, layers), 1, page_size=page_size)
        pb = one.stage(0).pool(pool).page_bytes
        for mib in kind_mib:
            n = max(1, -(-int(mib * MIB) // (layers * pb)))
            cases.append(Case(f"{pool}:{mib:g}MiB", one, 0, (pool,), n))
    return cases


class _Pages:
    """The case's pools, controller, scattered page ids and byte-exact checks."""

    def __init__(self, case: Case, s: Settings, shape: LaunchShape | None = None):
        import torch

        self.cuda = s.device.startswith("cuda")
        slack = case_slack(case.pages)
        self.dp = StagePools(case.stage_plan(case.pages + slack), device=s.device)
        self.hp = HostPools(self.dp, layout=s.layout, pin_memory=self.cuda)
        self.dp.allocator.alloc(self.dp.num_pages)
        self.hp.allocator.alloc(self.hp.num_pages)
        self.controller = TransferController(self.dp, self.hp, shape=shape or s.shape)
        self.plan = self.controller.selection()
        rng = random.Random(s.seed)
        self.dev_ids = torch.tensor(rng.sample(range(self.dp.num_pages), case.pages))
        self.host_ids = torch.tensor(rng.sample(range(self.hp.num_pages), case.pages))
        self.nbytes = self.plan.nbytes(case.pages)
        self.buffers = [(*buffer_pair(b, self.dp, self.hp), b) for b in self.plan.buffers]
        self._dev_idx = self.dev_ids.to(self.dp.device)
        for k, (d, _, _) in enumerate(self.buffers):
            rows = _pattern(case.pages, d.shape[1], k, d.device)
            if self.cuda:
                d.index_copy_(0, self._dev_idx, rows)
            else:  # numpy: torch's uint8 row indexing on CPU runs at ~1 GB/s
                d.numpy()[self.dev_ids.numpy()] = rows.numpy()

    def poison(self, d2h: bool) -> None:
        hid, did = self.host_ids.numpy(), self.dev_ids.numpy()
        for d, h, _ in self.buffers:
            if d2h:
                h.numpy()[hid] = 0x5A
            elif self.cuda:
                d.index_fill_(0, self._dev_idx, 0xA5)
            else:
                d.numpy()[did] = 0xA5

    def exact(self) -> bool:
        """Every moved page equal on both sides (after a poisoned destination was written)."""
        hid, did = self.host_ids.numpy(), self.dev_ids.numpy()

        def dev_rows(d: Any) -> np.ndarray:
            return d.index_select(0, self._dev_idx).cpu().numpy() if self.cuda else d.numpy()[did]

        return all(np.array_equal(dev_rows(d), h.numpy()[hid]) for d, h, _ in self.buffers)

    def stagecache(self) -> peers.Technique:
        c, dev, host = self.controller, self.dev_ids, self.host_ids

        def run(d2h: bool) -> Any:
            return c.backup(dev, host) if d2h else c.load(host, dev)

        return peers.Technique("stagecache", run, f"TransferController ({c.path} mover), ids checked")

    def page_loop(self) -> peers.Technique:
        pairs = [(d[a], h[b], ref.page_bytes) for d, h, ref in self.buffers
                 for a, b in zip(self.dev_ids.tolist(), self.host_ids.tolist(), strict=True)]
        return peers.page_loop(pairs, self.cuda)

    def warp_kernel(self) -> peers.Technique | None:
        if not self.cuda:
            return None
        groups: dict[str, tuple[list[Any], list[Any], int]] = {}
        for d, h, ref in self.buffers:
            groups.setdefault(ref.pool, ([], [], ref.page_bytes))
            groups[ref.pool][0].append(d)
            groups[ref.pool][1].append(h)
        return peers.warp_kernel(list(groups.values()), self.dev_ids, self.host_ids)


def _pattern(pages: int, page_bytes: int, salt: int, device: Any) -> Any:
    """Distinct bytes for every (buffer, page, word): a multiplicative hash of the position."""
    import torch

    words = -(-pages * page_bytes // 8)
    x = (torch.arange(words, dtype=torch.int64, device=device) + (salt << 40)) * -7046029254386353131
    return (x ^ (x >> 29)).view(torch.uint8)[:pages * page_bytes].view(pages, page_bytes)


def _ceiling(nbytes: int, cuda: bool, device: str) -> tuple[peers.Technique, Callable[[bool], Any], Callable[[], bool]]:
    """The contiguous copy of the case's bytes, its poison and its byte-exact check."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(_pattern(1, nbytes, 99, device).view(-1))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)

    def poison(d2h: bool) -> Any:
        return host.fill_(0x5A) if d2h else dev.fill_(0xA5)

    return peers.ceiling(dev, host), poison, lambda: torch.equal(dev.cpu(), host)


def _measure(clock: Clock, techs: list[peers.Technique],
             checks: dict[str, tuple[Callable[[bool], Any], Callable[[], bool]]]) -> dict[str, Any]:
    """Per technique and direction: the byte-exact check (poison, one move, compare), then the
    median times, every technique sampled in the same interleaved rounds (``Clock``)."""
    out: dict[str, Any] = {t.key: {} for t in techs}
    for d2h, direction in ((True, "d2h"), (False, "h2d")):
        exact = {}
        for t in techs:
            poison, check = checks[t.key]
            poison(d2h)
            t.run(d2h)
            clock.sync()
            exact[t.key] = check()
        times = clock.interleaved_ms({t.key: functools.partial(t.run, d2h) for t in techs})
        for t in techs:
            out[t.key][direction] = {"ms": times[t.key], "exact": exact[t.key]}
    return out


def run_case(case: Case, s: Settings) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows (one per direction) of one grid point, and stagecache's per-call overhead there."""
    cuda = s.device.startswith("cuda")
    clock = Clock(cuda, Sampling(s.min_reps, s.max_reps, s.budget_s))
    pages = _Pages(case, s)
    ceiling, poison, exact = _ceiling(pages.nbytes, cuda, s.device)
    techs = [ceiling, pages.stagecache(), pages.page_loop(), pages.warp_kernel()]
    if s.probes:
        techs += probes.probes([(d, h) for d, h, _ in pages.buffers], pages.dev_ids.tolist(), pages.host_ids.tolist())
    techs = [t for t in techs if t is not None]
    checks = {t.key: (pages.poison, pages.exact) for t in techs} | {"ceiling": (poison, exact)}
    results = _measure(clock, techs, checks)
    notes = {t.key: t.note for t in techs if t.key != "ceiling"}
    del ceiling, poison, exact, techs, checks
    stage = pages.stagecache()
    if cuda:
        overhead = {d: clock.issue_us(lambda d2h=(d == "d2h"): stage.run(d2h), results["stagecache"][d]["ms"],
                                      OVERHEAD_KEYS) for d in ("d2h", "h2d")}
    else:  # synchronous mover: the call is the whole move
        overhead = {d: dict.fromkeys(OVERHEAD_KEYS, round(results["stagecache"][d]["ms"] * 1e3, 2))
                    for d in ("d2h", "h2d")}
    dma = {d: _dma_ms(stage, d == "d2h") for d in ("d2h", "h2d")}
    pages.controller.synchronize()
    sweep = _sweep(case, s, clock) if s.sweep else []
    rows = [_row(case, pages, direction, results) for direction in ("d2h", "h2d")]
    for row in rows:
        row.update(overhead[row["direction"]])
        row["stagecache_dma_ms"] = dma[row["direction"]]
        if sweep:
            row["sweep"] = [dict(v, ms=v["ms"][row["direction"]]) for v in sweep]
    return rows, notes


def _dma_ms(stage: peers.Technique, d2h: bool, calls: int = 15) -> float:
    """Median copy time of stagecache's own transfers (start to end on the stream, what its stats
    record): the part of its wall time that is the copy, the rest being host work around it."""
    return round(statistics.median(stage.run(d2h).synchronize().seconds for _ in range(calls)) * 1e3, 4)


def _row(case: Case, pages: _Pages, direction: str, results: dict[str, Any]) -> dict[str, Any]:
    ms = {k: round(results[k][direction]["ms"], 4) if k in results else None
          for k in ("ceiling", "stagecache", *PEERS)}
    peer_ms = {k: ms[k] for k in PEERS if ms[k] is not None}
    best = min(peer_ms, key=peer_ms.__getitem__) if peer_ms else None
    probe_ms = {k: round(v[direction]["ms"], 4) for k, v in results.items() if k in probes.KEYS}
    return {
        "case": case.name, "direction": direction, "bytes": pages.nbytes, "pages": case.pages,
        "buffers": len(pages.plan.buffers), "path": pages.controller.path, "ms": ms,
        "gbps": {k: round(gbps(pages.nbytes, v / 1e3), 2) for k, v in ms.items() if v},
        "vs_ceiling": {k: round(ms["ceiling"] / v, 3) for k, v in ms.items() if v and k != "ceiling"},
        "best_peer": best,
        "stagecache_vs_best_peer": round(peer_ms[best] / ms["stagecache"], 3) if best else None,
        "bit_exact": {k: results[k][direction]["exact"] for k in results},
    } | ({"probes": {k: {"ms": v, "vs_ceiling": round(ms["ceiling"] / v, 3)} for k, v in probe_ms.items()}}
         if probe_ms else {})


def _sweep(case: Case, s: Settings, clock: Clock) -> list[dict[str, Any]]:
    out = []
    for shape in SWEEP:
        pages = _Pages(case, s, shape)
        stage = pages.stagecache()
        ms = {d: round(clock.median_ms(functools.partial(stage.run, d == "d2h")), 4) for d in ("d2h", "h2d")}
        out.append({"options": shape.__dict__, "ms": ms})
        del pages, stage
    return out


def run_bench(cases: list[Case], s: Settings, model: str) -> dict[str, Any]:
    """Every case, with progress on stderr; the report (JSON-ready)."""
    import torch

    check_cases_ram(cases, not s.device.startswith("cuda"))
    report = environment(s.device) | {"bench": "transfer", "model": model, "page_size": s.page_size,
                                      "layout": s.layout, "engine": s.shape.__dict__,
                                      "native": native.module() is not None, "rows": []}
    t0 = time.perf_counter()
    for i, case in enumerate(cases, 1):
        log.info("[bench transfer] %d/%d %s (%d pages) ... [%.0f s]", i, len(cases), case.name, case.pages,
                 time.perf_counter() - t0)
        rows, notes = run_case(case, s)
        report["rows"] += rows
        report["techniques"] = report.get("techniques", {}) | notes
        for r in rows:
            log.info("[bench transfer]   %s ms %s  vs best peer %s  issue %s us", r["direction"],
                     " ".join(f"{k}={v}" for k, v in r["ms"].items()), r["stagecache_vs_best_peer"], r["issue_us"])
        if s.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["summary"] = summary(report)
    return report
