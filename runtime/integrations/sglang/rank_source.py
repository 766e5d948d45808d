"""One sglang scheduler process's numbers: a ``SnapshotSource`` the deployment's hooks feed.

Each PP rank of a served deployment (``deployment.Deployment``) holds one ``SglangSource``.  The
hooks run on sglang's scheduler thread at every prefix match and every transfer submission, so
they only bump a few typed counters under a lock (``StageCounters``); the counters are folded
into the stage's ``StageLive`` when someone reads it (a push, a scrape, the dashboard).  Rank 0's
source holds every stage: the deployment's report, the others' pushed numbers
(``put_remote``), and ``run()``, which makes a rank that stopped pushing not ready.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...live.divergence import Divergence, DivergenceLive, DivergenceTracker, RankBatch
from ...live.numbers import Disagreement, PageSpace, Phase, RunInfo, StageAgreement, StageLive
from ...live.remote import Arrivals, gone
from ...validation.report import StartupReport

log = logging.getLogger(__name__)
#: After the first divergence, every n-th one is logged too (the counts are on /metrics).
LOG_EVERY = 100


@dataclass
class Moves:
    """Transfers of one direction so far: bytes, seconds, count."""

    bytes: int = 0
    seconds: float = 0.0
    count: int = 0


@dataclass
class StageCounters:
    """What the hooks bump for one stage (see the module docstring)."""

    d2h: Moves = field(default_factory=Moves)  # backups (``start_writing``)
    h2d: Moves = field(default_factory=Moves)  # loads (``start_loading``)
    device_tokens: int = 0  # of each request's first prefix match
    host_tokens: int = 0
    miss_tokens: int = 0
    updated_at: float = 0.0

    def fold_into(self, live: StageLive) -> StageLive:
        """``live`` with these counters in it (``live`` is the caller's copy)."""
        for d in ("d2h", "h2d"):
            moves: Moves = getattr(self, d)
            setattr(live.transfer_bytes, d, moves.bytes)
            setattr(live.transfer_seconds, d, moves.seconds)
            setattr(live.transfer_count, d, moves.count)
            setattr(live.bandwidth_bytes_per_second, d, moves.bytes / moves.seconds if moves.seconds > 0 else 0.0)
        tokens = live.cache_tokens
        tokens.device, tokens.host, tokens.miss = self.device_tokens, self.host_tokens, self.miss_tokens
        looked = tokens.looked_up
        live.host_hit_ratio = tokens.host / looked if looked > 0 else 0.0
        live.time = max(live.time, self.updated_at)
        return live


class SglangSource:
    """A ``SnapshotSource`` fed by one scheduler process's hooks (thread-safe)."""

    write_failures = None  # no serving parent writes files here

    def __init__(self, model_name: str = "sglang", push_timeout_s: float | None = None):
        self.model_name = model_name
        self.lock = threading.Lock()  # the hooks bump ``counters`` under it
        self._report: StartupReport | None = None
        self._live: dict[int, StageLive] = {}
        self._counters: dict[int, StageCounters] = {}
        #: the deployment's endpoint (rank 0): every stage must push within this many seconds
        self._push_timeout_s = push_timeout_s
        self._own: int | None = None  # the stage of this process, once the deployment is known
        #: called before the stages are read (the deployment refreshes its host use on demand)
        self.on_read: Callable[[], None] | None = None
        #: when each pushed stage's numbers last arrived (this process's monotonic clock)
        self.arrivals = Arrivals()
        #: the other ranks on this host: stage -> (pid, start ticks), watched for a crash
        self._peers: dict[int, tuple[int, int | None]] = {}
        #: rank 0's compare of the ranks' agreement records (``enable_agreement``)
        self._tracker: DivergenceTracker | None = None
        self._own_records: Callable[[], RankBatch] | None = None
        self._logged = 0
        self._incomplete_logged = 0  # incomplete transfers seen (the first and every 100th logged)
        #: a divergence makes the deployment not ready (else: a warning)
        self.strict_agreement = False

    # -- agreement (rank 0) ------------------------------------------------------------------
    def enable_agreement(self, pp_size: int, own: Callable[[], RankBatch], strict: bool = False) -> None:
        """Compare the ranks' records here; ``own`` drains this rank's (``RankAgreement.drain``)."""
        self._tracker = DivergenceTracker(pp_size)
        self._own_records = own
        self.strict_agreement = strict

    def put_agreement(self, stage: int, raw: object) -> None:
        """A pushed rank's records (``ValueError`` when malformed: the push is refused)."""
        if self._tracker is None:
            return
        batch = RankBatch.parse(raw)
        self._take_own()
        self._logged_divergences(self._tracker.add(stage, batch))
        self._logged_incomplete(batch)

    def _take_own(self) -> None:
        """This rank's own records, moved into the compare off sglang's scheduler thread."""
        if self._tracker is not None and self._own_records is not None:
            own = self._own_records()
            if own.requests or own.prefetch or own.steps or own.backups or own.dropped:
                rank = (self._own or 0) if self._tracker.pp_size > 1 else 0  # alone: index 0
                self._logged_divergences(self._tracker.add(rank, own))
                self._logged_incomplete(own)

    def _logged_divergences(self, found: list[Divergence]) -> None:
        for d in found:
            self._logged += 1
            if self._logged == 1 or self._logged % LOG_EVERY == 0:
                log.warning("stagecache: PP divergence #%d: %s", self._logged, d.text())

    def _logged_incomplete(self, batch: RankBatch) -> None:
        """Incomplete transfers in the log of rank 0, as divergences: the first, then every 100th."""
        for b in batch.backups:
            self._incomplete_logged += 1
            if self._incomplete_logged == 1 or self._incomplete_logged % LOG_EVERY == 0:
                log.warning("stagecache: incomplete HiCache transfer #%d: %s", self._incomplete_logged, b.text())

    def divergence(self) -> DivergenceLive | None:
        """The ranks' agreement now (None: this process compares nothing)."""
        if self._tracker is None:
            return None
        self._take_own()
        return self._tracker.live()

    # -- feeding ---------------------------------------------------------------------------
    def counters(self, stage: int) -> StageCounters:
        """The stage's counters (created on first use), for a hook to bump under ``lock``."""
        with self.lock:
            return self._counters.setdefault(stage, StageCounters())

    def publish(self, report: StartupReport, lives: dict[int, StageLive], own: int) -> None:
        """The deployment's report (every stage, or this rank's alone) and the stages' start-up
        numbers (layers, pool bytes, capacity, host pages)."""
        phase = Phase.SERVING if report.ok else Phase.REFUSED
        with self.lock:
            self._report, self._own = report, own
            for stage, live in lives.items():
                self._live[stage] = live.model_copy(update={"phase": phase})

    def put_remote(self, stage: int, live: StageLive) -> None:
        """Another rank's numbers, pushed to this (rank 0's) endpoint (already on this
        process's clock: ``remote.on_receiver_clock``)."""
        with self.lock:
            live.model_name = live.model_name or self.model_name
            self._live[stage] = live
        self.arrivals.arrived(stage)

    def watch_peers(self, peers: dict[int, tuple[int, int | None]]) -> None:
        """The ranks on this host (stage -> pid, start ticks) whose processes this rank watches."""
        with self.lock:
            self._peers = dict(peers)

    def gone_peers(self) -> dict[int, str]:
        """The watched ranks whose process is gone, and how (reported with this rank's numbers)."""
        with self.lock:
            peers = dict(self._peers)
        return {k: why for k, (pid, ticks) in peers.items() if (why := gone(pid, ticks)) is not None}

    def set_host_used(self, stage: int, used: int, total: int) -> None:
        """Host tokens in use of the full-KV host pool (sglang's ``logical_size - available_size()``;
        ``page_spaces["host"]`` counts tokens here, as sglang's ``hicache_host_used_tokens``)."""
        with self.lock:
            spaces = self._stage(stage).page_spaces
            if "host" not in spaces:
                spaces["host"] = PageSpace(tier="host", pools=["full"])
            spaces["host"].used, spaces["host"].total = used, total

    def snapshot(self, stage: int) -> StageLive:
        """A copy of one stage's numbers, stamped now (what a rank pushes)."""
        with self.lock:
            live = self._folded(stage)
        live.time = live.heartbeat_at = time.time()
        live.pid = os.getpid()
        live.gone = self.gone_peers()
        return live

    def _stage(self, stage: int) -> StageLive:
        """The stage's live numbers, created on first use (caller holds the lock)."""
        if stage not in self._live:
            self._live[stage] = StageLive(stage=stage, model_name=self.model_name)
        return self._live[stage]

    def _folded(self, stage: int) -> StageLive:
        """A copy of the stage's numbers with its counters in it (caller holds the lock)."""
        live = self._stage(stage).model_copy(deep=True)
        counters = self._counters.get(stage)
        return counters.fold_into(live) if counters is not None else live

    # -- SnapshotSource --------------------------------------------------------------------
    def startup(self) -> StartupReport | None:
        with self.lock:
            return self._report

    def stages(self) -> dict[int, StageLive]:
        if self.on_read is not None:
            self.on_read()
        now = time.time()
        agreement = self.divergence()
        with self.lock:
            out = {k: self._folded(k) for k in sorted(set(self._live) | set(self._counters))}
        if agreement is not None:
            for k, live in out.items():
                live.agreement = stage_agreement(agreement, k)
        if self._own is not None and self._own in out:  # this process answers: its stage is alive
            out[self._own].heartbeat_at = now
            out[self._own].pid = os.getpid()
            out[self._own].gone = self.gone_peers()
        for k, live in out.items():
            self.arrivals.stamp(k, live)
        return out

    def run(self) -> RunInfo | None:
        """The deployment as ``liveness.assess`` reads it: every stage must report (rank 0 only)."""
        with self.lock:
            report = self._report
            if self._push_timeout_s is None or self._own is None or report is None:
                return None
            return RunInfo(phase=Phase.SERVING if report.ok else Phase.REFUSED, pp_size=report.pp_size,
                           model=self.model_name, heartbeat_timeout_s=self._push_timeout_s,
                           started_at=0.0, time=time.time())


def stage_agreement(d: DivergenceLive, stage: int) -> StageAgreement:
    """A stage's part of the ranks' agreement, as the dashboard's stage-agreement panel reads it:
    the quantities it was off the majority in, the requests compared, the recent divergences."""
    recent = [Disagreement(time=x.time, micro_batch=x.step if x.step is not None else -1,
                           request=x.request if x.request is not None else f"step {x.step}",
                           kind=x.quantity, stages=x.ranks, agreed=x.agreed, values=x.values)
              for x in d.recent if stage in x.ranks]
    return StageAgreement(disagreements=dict(d.per_rank.get(stage, {})),
                          compared_requests=d.compared.get("device_prefix_len", 0), recent=recent)
