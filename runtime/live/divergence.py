"""Do the PP ranks of a live deployment still agree?  Rank 0's bounded compare of every rank's records.

sglang's PP ranks each run their own radix cache and HiCache controller over the same requests;
if they decide differently the pipeline computes on different prefixes and, at worst, a rank
consumes an ack another rank never queued and the server dies (sglang #22607).  sglang's
``pp_sync`` (#27285) and the MIN all-reduce of L3 prefetch lengths (#27010) make the ranks *act*
alike; neither *shows* that they were about to differ.  So every rank reports compact records
(``RankBatch``: per request its first prefix match and L3 prefix, per scheduler step the acks
pending and consumed), and rank 0 compares each key once every rank's record arrived, within a
bounded window (keys that fall out are counted ``unmatched``, never compared late).  Nothing here
waits: a rank's scheduler only appends to a bounded list, sent with the push it makes anyway.

The second check is complete backups: a backup or load that moves fewer pool kinds, or other
bytes, than the plan says (sglang #38031 backed up pages without their indexer buffers and
produced wrong output silently) is flagged with the pool kinds and the page.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from ..typed import Strict

#: What every rank reports per request (the first prefix match) and per L3 probe.
REQUEST_QUANTITIES = ("device_prefix_len", "host_hit_length")
PREFETCH_QUANTITIES = ("l3_prefetch_tokens",)
#: What every rank reports per scheduler step.
STEP_QUANTITIES = ("write_pending", "load_pending", "write_acks", "load_acks")
QUANTITIES = REQUEST_QUANTITIES + PREFETCH_QUANTITIES + STEP_QUANTITIES
#: One line per quantity: what it means (docs, the metric's help, the dashboard).
QUANTITY_MEANINGS = {
    "device_prefix_len": "tokens of the request's first prefix match found on the device",
    "host_hit_length": "tokens of the request's first prefix match found on the host tier",
    "l3_prefetch_tokens": "tokens of the request's prefix the rank's own L3 holds (what it feeds "
                          "into sglang's MIN all-reduce)",
    "write_pending": "backup acks queued and not yet consumed at the step's start",
    "load_pending": "load acks queued and not yet consumed at the step's start",
    "write_acks": "backup acks the step consumed (writing_check)",
    "load_acks": "load acks the step consumed (loading_check)",
}

#: Keys rank 0 holds while waiting for every rank's record (per group: requests, probes, steps).
WINDOW = 4096
#: The most records of each group one push may carry, and a rank keeps unsent.
MAX_BATCH = 4096
#: Longest request id kept (longer ones are cut; ids only need to match across ranks).
MAX_RID = 128
#: Divergences and incomplete backups kept for the dashboard and the probes.
RECENT = 50


class Divergence(Strict):
    """One key on which some ranks reported another value than the others."""

    time: float = Field(description="unix time rank 0 compared the records")
    request: str | None = Field(None, description="the request id (request quantities)")
    step: int | None = Field(None, description="the scheduler step, counted from 1 (step quantities)")
    quantity: str
    ranks: list[int] = Field(description="the ranks whose value is not the majority's")
    agreed: int = Field(description="the value most ranks reported (a tie: the larger)")
    values: list[int] = Field(description="every rank's value, by PP rank")

    def text(self) -> str:
        """The one line that names it: key, quantity, ranks, values."""
        where = f"request {self.request}" if self.request is not None else f"step {self.step}"
        odd = ", ".join(f"rank {r} = {self.values[r]}" for r in self.ranks)
        return (f"{where}: {self.quantity} differs across PP ranks: {odd}; the other ranks = "
                f"{self.agreed} (values by rank: {self.values})")


class IncompleteBackup(Strict):
    """A backup or load that did not move every pool kind the stage mirrors, in the plan's bytes."""

    time: float
    stage: int
    direction: str = Field(description="d2h (backup) or h2d (load)")
    page: int = Field(description="the first host page of the transfer")
    pages: int = Field(description="pages the transfer moved")
    missing: list[str] = Field(description="pool kinds the stage mirrors that the transfer lacks")
    expected_bytes: int
    got_bytes: int

    def text(self) -> str:
        kinds = ", ".join(self.missing) if self.missing else "none missing"
        return (f"stage {self.stage}: {'backup' if self.direction == 'd2h' else 'load'} of host page "
                f"{self.page} ({self.pages} page(s)) lacks pool kind(s) {kinds}: {self.got_bytes} bytes "
                f"moved, the stage's plan says {self.expected_bytes}")


class DivergenceLive(Strict):
    """The deployment's agreement as rank 0 knows it (the dashboard, /readyz, /metrics)."""

    pp_size: int
    compared: dict[str, int] = Field(default_factory=dict, description="quantity -> keys compared")
    divergent: dict[str, int] = Field(default_factory=dict, description="quantity -> keys that differed")
    per_rank: dict[int, dict[str, int]] = Field(
        default_factory=dict, description="rank -> quantity -> divergences it was off the majority in")
    first: Divergence | None = Field(None, description="the first divergence since start-up")
    recent: list[Divergence] = Field(default_factory=list, description="the latest, oldest first")
    unmatched: int = Field(0, description="keys dropped from the window before every rank reported")
    waiting: dict[int, int] = Field(default_factory=dict,
                                    description="rank -> keys in the window still waiting for its record")
    dropped: int = Field(0, description="records ranks dropped unsent (their size limits)")
    incomplete: dict[str, int] = Field(default_factory=dict,
                                       description="pool kind -> transfers that lacked it")
    first_incomplete: IncompleteBackup | None = None
    recent_incomplete: list[IncompleteBackup] = Field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.divergent.values())


def agreed_value(values: Sequence[int]) -> int:
    """The value most ranks reported; a tie goes to the larger."""
    counts = Counter(values)
    return max(counts, key=lambda v: (counts[v], v))


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not -(1 << 62) < x < 1 << 62:
        raise ValueError(f"expected an integer, got {x!r}")
    return x


def _rows(raw: Any, name: str, width: int, keyed: bool) -> list[tuple[Any, ...]]:
    """``raw`` as rows of ``width`` items (a str key first when ``keyed``), bounded and typed."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_BATCH:
        raise ValueError(f"{name}: expected a list of at most {MAX_BATCH} records")
    out = []
    for row in raw:
        if not isinstance(row, list) or len(row) != width:
            raise ValueError(f"{name}: expected records of {width} items, got {row!r:.80}")
        head = row[0]
        if keyed:
            if not isinstance(head, str):
                raise ValueError(f"{name}: a request id must be a string, got {head!r:.80}")
            head = head[:MAX_RID]
        else:
            head = _int(head)
        out.append((head, *(_int(v) for v in row[1:])))
    return out


class RankBatch(Strict):
    """One rank's records since its last push (what rides on the push, validated by rank 0)."""

    requests: list[tuple[str, int, int]] = Field(default_factory=list,
                                                 description="(rid, device_prefix_len, host_hit_length)")
    prefetch: list[tuple[str, int]] = Field(default_factory=list, description="(rid, l3_prefetch_tokens)")
    steps: list[tuple[int, int, int, int, int]] = Field(
        default_factory=list, description="(step, write_pending, load_pending, write_acks, load_acks)")
    backups: list[IncompleteBackup] = Field(default_factory=list)
    dropped: int = 0

    @classmethod
    def parse(cls, raw: Any) -> RankBatch:
        """A pushed batch, checked item by item in linear time; ``ValueError`` names what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError("the agreement records must be a JSON object")
        unknown = set(raw) - {"requests", "prefetch", "steps", "backups", "dropped"}
        if unknown:
            raise ValueError(f"unknown agreement fields {sorted(unknown)}")
        backups = raw.get("backups") or []
        if not isinstance(backups, list) or len(backups) > RECENT:
            raise ValueError(f"backups: expected a list of at most {RECENT}")
        return cls(requests=_rows(raw.get("requests"), "requests", 3, True),
                   prefetch=_rows(raw.get("prefetch"), "prefetch", 2, True),
                   steps=_rows(raw.get("steps"), "steps", 5, False),
                   backups=[IncompleteBackup.model_validate(b) for b in backups],
                   dropped=_int(raw.get("dropped", 0)))

    def wire(self) -> dict[str, Any]:
        """JSON for the push (lists, not objects: a batch of 4096 requests stays small)."""
        return {"requests": [list(r) for r in self.requests], "prefetch": [list(p) for p in self.prefetch],
                "steps": [list(s) for s in self.steps], "backups": [b.model_dump() for b in self.backups],
                "dropped": self.dropped}


class _Group:
    """Keys of one record group waiting for every rank, oldest first, bounded."""

    def __init__(self, quantities: tuple[str, ...], pp_size: int, window: int):
        self.quantities = quantities
        self.pp_size = pp_size
        self.window = window
        self.waiting: OrderedDict[Any, list[tuple[int, ...] | None]] = OrderedDict()
        self.done: OrderedDict[Any, None] = OrderedDict()  # compared keys (a late duplicate is ignored)

    def add(self, rank: int, key: Any, values: tuple[int, ...]) -> list[tuple[int, ...]] | None:
        """Store one rank's values of ``key``; every rank's, once the last one arrived."""
        if key in self.done:
            return None
        slot = self.waiting.get(key)
        if slot is None:
            slot = self.waiting[key] = [None] * self.pp_size
        if slot[rank] is None:
            slot[rank] = values
        if any(v is None for v in slot):
            return None
        del self.waiting[key]
        self.done[key] = None
        if len(self.done) > self.window:
            self.done.popitem(last=False)
        return slot  # type: ignore[return-value]

    def trim(self) -> int:
        """Forget the oldest keys beyond the window; how many."""
        n = 0
        while len(self.waiting) > self.window:
            self.waiting.popitem(last=False)
            n += 1
        return n


class DivergenceTracker:
    """Rank 0's compare (thread-safe: pushes arrive on the endpoint's threads)."""

    def __init__(self, pp_size: int, window: int = WINDOW):
        self.pp_size = pp_size
        self._lock = threading.Lock()
        self._groups = {"requests": _Group(REQUEST_QUANTITIES, pp_size, window),
                        "prefetch": _Group(PREFETCH_QUANTITIES, pp_size, window),
                        "steps": _Group(STEP_QUANTITIES, pp_size, window)}
        self._live = DivergenceLive(pp_size=pp_size, compared=dict.fromkeys(QUANTITIES, 0),
                                    divergent=dict.fromkeys(QUANTITIES, 0))
        self._recent: deque[Divergence] = deque(maxlen=RECENT)
        self._recent_incomplete: deque[IncompleteBackup] = deque(maxlen=RECENT)

    def add(self, rank: int, batch: RankBatch, now: float | None = None) -> list[Divergence]:
        """One rank's records; the divergences found now (linear in the batch and the ranks)."""
        if not 0 <= rank < self.pp_size:
            raise ValueError(f"PP rank {rank} is not in 0..{self.pp_size - 1}")
        now = time.time() if now is None else now
        found: list[Divergence] = []
        with self._lock:
            live = self._live
            live.dropped += batch.dropped
            for group, rows in (("requests", batch.requests), ("prefetch", batch.prefetch),
                                ("steps", batch.steps)):
                g = self._groups[group]
                for row in rows:
                    every = g.add(rank, row[0], tuple(row[1:]))
                    if every is not None:
                        found += self._compare(g.quantities, row[0], group, every, now)
                live.unmatched += g.trim()
            for b in batch.backups:
                for kind in b.missing or ["bytes"]:
                    live.incomplete[kind] = live.incomplete.get(kind, 0) + 1
                if live.first_incomplete is None:
                    live.first_incomplete = b
                self._recent_incomplete.append(b)
        return found

    def _compare(self, quantities: tuple[str, ...], key: Any, group: str,
                 every: list[tuple[int, ...]], now: float) -> list[Divergence]:
        live = self._live
        found = []
        for j, q in enumerate(quantities):
            values = [v[j] for v in every]
            live.compared[q] += 1
            first = values[0]
            if all(v == first for v in values):
                continue
            agreed = agreed_value(values)
            ranks = [r for r, v in enumerate(values) if v != agreed]
            d = Divergence(time=now, quantity=q, ranks=ranks, agreed=agreed, values=values,
                           request=key if group != "steps" else None, step=key if group == "steps" else None)
            live.divergent[q] += 1
            for r in ranks:
                per = live.per_rank.setdefault(r, {})
                per[q] = per.get(q, 0) + 1
            if live.first is None:
                live.first = d
            self._recent.append(d)
            found.append(d)
        return found

    def live(self) -> DivergenceLive:
        """A copy of the numbers now."""
        with self._lock:
            waiting: dict[int, int] = {}
            for g in self._groups.values():
                for slot in g.waiting.values():
                    for rank, v in enumerate(slot):
                        if v is None:
                            waiting[rank] = waiting.get(rank, 0) + 1
            return self._live.model_copy(deep=True, update={
                "recent": list(self._recent), "recent_incomplete": list(self._recent_incomplete),
                "waiting": waiting})


def incomplete_line(count: int, first: IncompleteBackup) -> str:
    """The one line that names incomplete transfers (``/readyz``, the dashboard, the log): how
    many, and the first with its stage, pool kinds and page -- on the sglang endpoint and in
    ``serve`` alike."""
    return f"{count} incomplete HiCache transfer(s); first: {first.text()}"


def readiness_lines(d: DivergenceLive | None) -> list[str]:
    """What /readyz says about agreement: the first divergence and the first incomplete backup
    (a warning, or -- when the operator made agreement strict -- why the deployment is not ready)."""
    if d is None:
        return []
    out = []
    if d.first is not None:
        out.append(f"PP ranks diverged {d.total} time(s); first at {d.first.text()}")
    if d.first_incomplete is not None:
        out.append(incomplete_line(sum(d.incomplete.values()), d.first_incomplete))
    return out
