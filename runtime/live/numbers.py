"""A stage's live numbers: one typed model from the stage process to every reader.

The stage worker fills a ``StageLive`` and writes it to the run directory as
JSON; the parent parses the same model back (``run_dir.RunDirSource``); the
Prometheus collector reads its attributes; the dashboard API returns it as its
``response_model``; ``serve --json`` and ``snapshot.json`` dump it.  Because
every consumer holds this one type, a renamed or missing field is a
validation error at the boundary, not a silently empty chart.

Every field has a zero default, so a stage that has served nothing yet (or a
stage file written by an older process) still parses.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from ..cache.insight import CacheInsightLive, SampledHistogram
from ..cache.stats import CacheLive
from ..transfer.stats import TransferLive
from ..typed import Strict
from .divergence import IncompleteBackup, incomplete_line

#: The decisions every stage must take alike for each request, each with its one meaning: a stage
#: whose value differs from the agreed one disagrees (``serve.agreement``).
DECISIONS: dict[str, str] = {
    "matched_prefix": "the stages matched prefixes of different lengths (device + host pages)",
    "loaded": "the stages loaded different numbers of pages from host (h2d)",
    "backed_up": "the stages backed up different numbers of pages to host (d2h) while serving it",
    "completion": "the stages ended the request differently (completed or not, pages newly cached)",
}
DECISION_NAMES = tuple(DECISIONS)


class Phase(str, Enum):
    """Where a stage, or the whole run (``RunInfo``), is: one vocabulary for every reader."""

    STARTING = "starting"
    SERVING = "serving"
    REFUSED = "refused"  # startup validation refused the stages' pools
    DONE = "done"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # the run only: Ctrl-C or SIGTERM

    def __str__(self) -> str:
        return self.value


#: The phases a stage reports (``StageLive.phase``); ``interrupted`` is the run's only.
STAGE_PHASES: tuple[Phase, ...] = tuple(p for p in Phase if p is not Phase.INTERRUPTED)


class PageSpace(Strict):
    """One page-id space: a page id names one token page in *every* pool listed.

    The pools of a stage share their page ids (``memory/pools.py``), so a page
    count belongs to the space, never to a pool: summing per-pool counts would
    count the same pages once per pool kind.
    """

    tier: str = Field("device", description="where the pages live: device or host")
    used: int = 0
    total: int = 0
    pools: list[str] = Field(default_factory=list, description="pool kinds drawing on this space")


#: How many recent pipeline events a stage keeps (``StageLive.timeline``).
TIMELINE_EVENTS = 240


class TimelineEvent(Strict):
    """One span of a stage's pipeline time: its own work, or a wait (a bubble) and on what."""

    kind: str = Field(description="compute, recv_wait, credit_wait, send_wait or idle")
    start: float = Field(description="unix time the span began")
    seconds: float
    micro_batch: int | None = None


class PoolBytes(Strict):
    """Bytes one pool kind occupies on the device and in its host mirror."""

    device: int = 0
    host: int = 0


# -- host-tier sanity and pool occupancy (issue 19: points 5 and 6) ---------------------------------


class HostTierLive(Strict):
    """The stage's host-tier verdict (``memory.host_tier``), re-checked while it runs.

    ``status`` lists every status that holds (``ok`` alone when none does); statuses in
    ``memory.host_tier.NOT_READY_STATUSES`` make ``/readyz`` answer not ready.
    """

    status: list[str] = Field(default_factory=list,
                              description="ok, smaller_than_device, pin_refused, exceeds_ram "
                              "(empty: not checked yet)")
    reasons: list[str] = Field(default_factory=list, description="one line per status")
    ready: bool = Field(True, description="false when a status makes the run not ready")
    pinned: bool = Field(False, description="host pages are pinned (page-locked) memory")
    pin_error: str | None = Field(None, description="why pinned memory was refused")
    device_pages: int = Field(0, description="pages of the device page-id space")
    host_pages: int = Field(0, description="pages of the host page-id space")
    host_bytes: int = Field(0, description="bytes of the stage's host tier")
    mem_available_bytes: int | None = Field(None, description="the host's MemAvailable at the check")
    mem_total_bytes: int | None = None
    reserve_bytes: int | None = Field(None, description="RAM the host tiers must leave available")
    checked_at: float = Field(0.0, description="unix time of the last /proc/meminfo read")


class PoolOccupancy(Strict):
    """One pool kind on one tier: units of its own space (pages, or request slots) and bytes.

    Units are not to be summed across pools (kinds of one page-id space share its pages);
    bytes are the kind's own and do sum.
    """

    pool: str
    tier: str = Field(description="device or host")
    unit: str = Field(description="page (paged kinds) or slot (per-request kinds)")
    used: int = 0
    capacity: int = 0
    peak: int = Field(0, description="the most units in use at once since the stage started")
    used_bytes: int = 0
    capacity_bytes: int = 0


# -- cache insight and stage agreement: why lookups missed, entry lifetimes, do stages agree ----


class Disagreement(Strict):
    """One request on which some stages reported another value than the others (rank 0)."""

    time: float = Field(description="unix time rank 0 compared the records")
    micro_batch: int
    request: str = Field(description="session/turn")
    kind: str = Field(description="matched_prefix, loaded, backed_up or completion")
    stages: list[int] = Field(description="the stages whose value is not the agreed one")
    agreed: int = Field(description="the value most stages reported")
    values: list[int] = Field(description="every stage's value, by stage")


class StageAgreement(Strict):
    """Do the stages agree, request by request (``serve/agreement.py``)."""

    disagreements: dict[str, int] = Field(
        default_factory=dict, description="kind -> requests on which this stage disagreed")
    compared_requests: int = Field(0, description="requests whose verdict this stage has applied")
    recent: list[Disagreement] = Field(
        default_factory=list, description="rank 0 only: the latest disagreements, oldest first")


class TransferCheckLive(Strict):
    """Every HiCache backup and load of a ``serve`` stage held against its plan (``plan.mirror``):
    each must move every pool kind the stage mirrors, in the plan's bytes per page."""

    kinds: list[str] = Field(default_factory=list, description="pool kinds every transfer must move "
                                                                "(the plan's mirror)")
    checked: int = Field(0, description="backups and loads checked")
    count: int = Field(0, description="of them incomplete")
    incomplete: dict[str, int] = Field(
        default_factory=dict, description="pool kind -> transfers that lacked it (`bytes`: none missing, "
                                          "the bytes differ)")
    first: IncompleteBackup | None = Field(None, description="the first incomplete transfer")
    recent: list[IncompleteBackup] = Field(default_factory=list, description="the latest, oldest first")

    def line(self) -> str | None:
        """What /readyz, the dashboard and the log say (None: every transfer was complete)."""
        if self.first is None:
            return None
        return incomplete_line(self.count, self.first)


class L3Directions(Strict):
    """One figure per L3 direction: prefetch = L3 to host, backup = host to L3."""

    prefetch: float = 0.0
    backup: float = 0.0


class L3Live(Strict):
    """The stage's L3 tier (``cache/storage_tier.py``): its backend's health and its traffic."""

    backend: str = Field("none", description="none, file or mooncake")
    up: bool = Field(True, description="false while the backend does not answer (Mooncake master gone)")
    down_reason: str | None = None
    downs: int = Field(0, description="times the backend went down")
    prefetched_tokens: int = Field(0, description="tokens read from L3 into the host tier")
    backuped_tokens: int = Field(0, description="tokens written to L3 (sglang's spelling)")
    backup_failed_pages: int = Field(0, description="pages a write refused (full, failed, down)")
    fallback_pages: int = Field(0, description="pages the head stage took from L3 that this stage "
                                "could not read and rewrote")
    bytes: L3Directions = Field(default_factory=L3Directions)
    seconds: L3Directions = Field(default_factory=L3Directions)
    objects: L3Directions = Field(default_factory=L3Directions, description="objects read / written")
    misses: int = Field(0, description="objects looked for and not found")
    skipped: int = Field(0, description="objects not tried while the backend was down")
    errors: dict[str, int] = Field(default_factory=dict, description="corrupt, failed, no_space")
    evictions: int = Field(0, description="objects the store dropped to make room")
    used_bytes: int = 0
    capacity_bytes: int = Field(0, description="0: bounded by the backend itself")
    prefetch_bandwidth: SampledHistogram = Field(
        default_factory=SampledHistogram, description="GB/s of each prefetch batch")
    backup_bandwidth: SampledHistogram = Field(
        default_factory=SampledHistogram, description="GB/s of each backup batch")


class CapacityLive(Strict):
    """The stage's token capacity against the deployment's (sglang takes the minimum over PP ranks).

    0 everywhere when the source does not know it (no memory-budget sizing seen).
    """

    tokens_alone: int = Field(0, description="full tokens the stage's own budget fits")
    tokens: int = Field(0, description="the deployment's token capacity: the minimum over stages")
    used_bytes: int = Field(0, description="device bytes of the stage's pools at that capacity")
    stranded_bytes: int = Field(0, description="device bytes the minimum leaves unused on the stage")


class StageLive(CacheLive, TransferLive):
    """Everything one PP stage reports while it runs (``stage-<k>.json``): its prefix-cache
    numbers (``CacheLive``, made by ``CacheStats.live()``) and transfer numbers
    (``TransferLive``, made by ``TransferStats.live()``) as those produce them, and the rest."""

    stage: int
    model_name: str = ""
    tp_rank: int = Field(0, description="tensor-parallel rank whose numbers these are (KV is replicated)")
    time: float = Field(0.0, description="unix time of this report")
    heartbeat_at: float | None = Field(
        None, description="unix time of the stage process's last heartbeat (None: never beat)")
    pid: int | None = None
    phase: Phase = Field(Phase.STARTING, description="starting, serving, refused, done or failed")
    error: str | None = Field(None, description="the stage's own last error, if it failed")
    started_at: float = 0.0
    start_layer: int | None = None
    end_layer: int | None = None
    local_layers: int | None = None
    steps: int = Field(0, description="micro-batches finished")
    requests: int = Field(0, description="requests finished")
    total_steps: int = 0
    total_requests: int = 0
    page_spaces: dict[str, PageSpace] = Field(default_factory=dict)
    pool_bytes: dict[str, PoolBytes] = Field(default_factory=dict)
    kv_verified_pages: int = 0
    computed_rows: int = 0
    stage_seconds: float = Field(0.0, description="seconds of the stage's own work")
    bubble_seconds: float = Field(0.0, description="seconds waiting on a pipeline peer")
    idle_seconds: float = Field(0.0, description="seconds waiting for requests to arrive")
    activation_bytes_sent: int = 0
    activation_bytes_received: int = 0
    timeline: list[TimelineEvent] = Field(
        default_factory=list, description=f"the last {TIMELINE_EVENTS} pipeline spans, oldest first")
    # host-tier sanity and pool occupancy
    host_tier: HostTierLive = Field(default_factory=HostTierLive)
    pool_occupancy: list[PoolOccupancy] = Field(
        default_factory=list, description="every pool kind the stage holds, per tier")
    # cache insight and stage agreement
    insight: CacheInsightLive = Field(default_factory=CacheInsightLive)
    agreement: StageAgreement = Field(default_factory=StageAgreement)
    # every HiCache backup and load against the stage's plan (serve; the sglang endpoint compares
    # its ranks' transfers in ``live.divergence``)
    transfer_check: TransferCheckLive = Field(default_factory=TransferCheckLive)
    # the storage tier behind the host tier
    l3: L3Live = Field(default_factory=L3Live)
    # what the deployment's minimum token capacity leaves stranded on this stage
    capacity: CapacityLive = Field(default_factory=CapacityLive)
    # a stage on another host: its numbers came over the network (several hosts)
    remote: bool = Field(False, description="the numbers came over the network from another host: "
                         "silence means unreachable, not stopped")
    host: str | None = Field(None, description="the host the stage runs on (several hosts)")
    clock_offset_s: float = Field(0.0, description="receiver's wall clock minus the sender's: the least "
                                  "of its recent receipts' (a delivery delay only adds to one); its "
                                  "times are shown moved onto the receiver's clock")
    gone: dict[int, str] = Field(default_factory=dict, description="stages on this stage's host "
                                 "whose process it saw gone (pid no longer alive), and how")

    @property
    def bubble_fraction(self) -> float:
        busy = self.stage_seconds + self.bubble_seconds
        return self.bubble_seconds / busy if busy > 0 else 0.0


class RunInfo(Strict):
    """The serving parent's view of the run (``run.json``): phase, processes, the failure.

    Written by the supervisor, read by the dashboard, the probes and the exporter
    (through ``RunDirSource.run()``), so "which stage failed, why, and when" is one
    typed record that survives the failed stage and stays until the parent exits.
    """

    phase: Phase = Field(Phase.STARTING,
                         description="starting, serving, done, refused, failed or interrupted")
    failure: str | None = Field(None, description="why the run stopped, naming the stage")
    failed_stage: int | None = Field(None, description="the stage the failure names, if one")
    failed_at: float | None = Field(None, description="unix time the failure was detected")
    finished_at: float | None = Field(None, description="unix time every stage had served the "
                                      "whole trace (phase done)")
    pp_size: int = 0
    model: str = ""
    device: str = ""
    url: str | None = None
    parent_pid: int | None = None
    pids: dict[int, int | None] = Field(default_factory=dict)
    exit_codes: dict[int, int | None] = Field(default_factory=dict)
    heartbeat_timeout_s: float = Field(5.0, description="a stage with an older heartbeat is down")
    max_disagreements: int | None = Field(
        None, description="more stage disagreements than this fail /readyz (--max-disagreements)")
    started_at: float = 0.0
    time: float = Field(0.0, description="unix time the parent last wrote this file")
