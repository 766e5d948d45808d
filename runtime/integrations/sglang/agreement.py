"""A rank's side of live PP agreement: sglang's own match results, ack counts and L3 lengths, recorded.

The hooks (registered with sglang's ``HookRegistry`` by ``deployment.Deployment``) run on sglang's
scheduler thread, so each one appends a few integers to a bounded list under a lock and returns;
the records leave with the rank's next push (``Pusher``'s ``extra``) -- rank 0 takes its own
directly -- and rank 0 compares them (``live.divergence``).  docs/sglang.md ("PP agreement, live")
lists what is recorded and where sglang keeps it.  A step is recorded even when sglang raises in
it (a rank told to consume an ack it never queued), and then pushed at once, before the process goes.

Complete transfers (sglang #38031): ``check_ack`` compares each backup / load ack with the stage's
``TransferPlan``: every pool kind that moves with a full-KV page on this stage must be in the ack,
with the tokens moved times its bytes per token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...live.divergence import MAX_BATCH, MAX_RID, RECENT, IncompleteBackup, RankBatch
from ...plan.mirror import transfer_gap

#: Per family: sglang's host pool names that move with a full-KV page (by the same token indices),
#: and stagecache's pool kind for each.  Another family adds its row; the check reads only this.
PAGE_POOLS: dict[str, dict[str, str]] = {
    "deepseek_v4": {"deepseek_v4_c4": "c4", "deepseek_v4_c4_indexer": "indexer", "deepseek_v4_c128": "c128"},
    # DSA's index keys move with the MLA KV page (SWA and Mamba state move by indices of their own)
    "dsa": {"indexer": "indexer"},
}
#: sglang's name of the full-KV pool whose token count is a transfer's page count.
ANCHOR_POOL = "kv"
#: Per family: sglang's host pools of the kinds a planted ``STAGECACHE_FAULT`` may leave out of a
#: backup, beyond ``PAGE_POOLS`` (pools indexed by other indices, kinds split over two pools).
FAULT_POOLS: dict[str, dict[str, str]] = {
    "deepseek_v4": {"deepseek_v4_c4_indexer_state": "c4_indexer_state",
                    "deepseek_v4_c4_indexer_scale": "indexer"},
    "dsa": {"indexer": "indexer"},
}
#: The environment variable of the plugin's planted fault (``NAME[@STAGE]``).
FAULT_ENV = "STAGECACHE_FAULT"


def parse_live_fault(text: str | None) -> tuple[str, int | None] | None:
    """``STAGECACHE_FAULT``'s ``NAME[@STAGE]``: a fault a live sglang rank plants (one whose
    backups leave kinds out: ``backup-without-indexer``); ``ConfigError`` naming the variable
    otherwise.  Which family has it, and whether the stage exists, is known at the stack build."""
    from ...errors import ConfigError
    from ...plan.faults import FAULTS, fault_kind

    if not text:
        return None
    name, at, stage_text = text.strip().partition("@")
    planted = sorted({k for k in FAULTS if fault_kind(k).backup_left_out})
    if name not in planted:
        raise ConfigError(f"{FAULT_ENV}={text[:80]!r}: the sglang plugin plants {', '.join(planted)} "
                          "(the other faults build a layout: stagecache check --fault NAME)")
    if not at:
        return name, None
    if not (stage_text.isdigit() and len(stage_text) < 6):
        raise ConfigError(f"{FAULT_ENV}={text[:80]!r}: expected a stage number (integer >= 0) after '@', "
                          f"got {stage_text[:20]!r}")
    return name, int(stage_text)


@dataclass(frozen=True)
class TransferPlan:
    """What one page's backup or load must move on this stage: per sglang pool name, stagecache's
    kind and the host bytes per token (from the stage's host pools, read once at the stack build)."""

    page_size: int
    kinds: dict[str, str] = field(default_factory=dict)
    bytes_per_token: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, family: str, inventory: dict[str, list[bool]], host_pool_group: Any, page_size: int
           ) -> TransferPlan:
        """The stage's plan: the family's page pools the stage holds buffers of, with the bytes
        per token of sglang's host pools for them."""
        sizes = {}
        for entry in getattr(host_pool_group, "entries", ()):
            name = getattr(entry.name, "value", str(entry.name))
            size = getattr(entry.host_pool, "size_per_token", None)
            if isinstance(size, int) and size > 0:
                sizes[name] = size
        kinds = {name: kind for name, kind in PAGE_POOLS.get(family, {}).items()
                 if any(inventory.get(kind, ())) and name in sizes}
        return cls(page_size=page_size, kinds=kinds, bytes_per_token={n: sizes[n] for n in kinds} | (
            {ANCHOR_POOL: sizes[ANCHOR_POOL]} if ANCHOR_POOL in sizes else {}))

    def check(self, tokens_by_pool: dict[str, int] | None, num_bytes: int) -> tuple[list[str], int] | None:
        """(missing kinds, expected bytes) when a transfer of full-KV pages is incomplete; None when
        it is complete or moves no full-KV page (an SWA or state transfer).  The rule is
        ``plan.mirror.transfer_gap``'s (``stagecache serve`` checks its transfers by it too); the
        bytes are compared where every pool the ack moved has its bytes per token here."""
        moved = {name: n for name, n in (tokens_by_pool or {}).items() if n}
        tokens = moved.get(ANCHOR_POOL, 0)
        if not tokens or not self.kinds:
            return None
        per = self.bytes_per_token
        known = all(name in per for name in moved)
        gap = transfer_gap(per, moved, tokens, int(num_bytes) if known else None)
        if gap is None:
            return None
        missing, expected = gap
        return [self.kinds[name] for name in missing if name in self.kinds], expected


def _first_page(op: Any, page_size: int) -> int:
    """The host page of an operation's first host index (-1: none)."""
    idx = getattr(op, "host_indices", None)
    try:
        return int(idx[0]) // max(1, page_size)
    except (TypeError, IndexError, ValueError):
        return -1


class RankAgreement:
    """One rank's records (see the module docstring); thread-safe, bounded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[tuple[str, int, int]] = []
        self._prefetch: list[tuple[str, int]] = []
        self._steps: list[tuple[int, int, int, int, int]] = []
        self._backups: list[IncompleteBackup] = []
        self._dropped = 0
        self.step = 0
        self._consumed = [0, 0]  # write, load acks popped in the current step
        self.plan: TransferPlan | None = None
        self._inflight: RankBatch | None = None  # the pusher's thread only
        self.stage = 0
        #: called after a step in which sglang raised: push now, the process may be going
        self.on_fatal: Callable[[], None] | None = None
        #: ``STAGECACHE_FAULT`` (``parse_live_fault``) and, once armed, the sglang pools this
        #: rank's backups leave out
        self.fault: tuple[str, int | None] | None = None
        self.left_out: frozenset[str] = frozenset()

    # -- the planted fault ----------------------------------------------------------------------
    def arm_fault(self, family: str, pp_size: int) -> None:
        """At the stack build (the family and the deployment known): the sglang pools this rank's
        backups leave out under ``STAGECACHE_FAULT`` -- the fault's kinds (``FaultKind.
        backup_left_out``, the family's one fact) as this family's sglang pools."""
        if self.fault is None:
            return
        from ...errors import ConfigError
        from ...model.families import family_named
        from ...plan.faults import Fault, fault_kind

        name, stage = self.fault
        kind = fault_kind(name, family_named(family))
        if stage is not None and stage >= pp_size:
            raise ConfigError(f"{FAULT_ENV}={name}@{stage}: stage {stage} out of range for pp_size {pp_size}")
        if not Fault(kind, stage).hits(self.stage, pp_size):
            return
        pools = {**PAGE_POOLS.get(family, {}), **FAULT_POOLS.get(family, {})}
        self.left_out = frozenset(p for p, k in pools.items() if k in kind.backup_left_out)

    def leave_out(self, controller: Any) -> None:
        """Before sglang submits the queued backups (``start_writing``): drop the left-out pools'
        transfers from them, as sglang #38031's stack did -- the host set still holds the pools."""
        skip = self.left_out
        if not skip:
            return
        for op in getattr(controller, "write_queue", ()):
            transfers = op.pool_transfers
            if transfers:
                op.pool_transfers = [t for t in transfers if getattr(t.name, "value", t.name) not in skip] or None

    # -- recording (scheduler thread, prefetch thread) ----------------------------------------
    def _put(self, kind: str, row: Any, limit: int = MAX_BATCH) -> None:
        """Append ``row`` to the list of ``kind`` (at most ``limit`` rows), looked up under the lock:
        ``drain`` swaps the lists, and a row appended to the list it just handed out would be lost
        (a request's or a step's record missing on rank 0: 999 of 1,000 compared)."""
        with self._lock:
            rows = self.__dict__[kind]
            if len(rows) < limit:
                rows.append(row)
            else:
                self._dropped += 1

    def request(self, rid: str, device: int, host: int) -> None:
        """A request's first prefix match (the deployment's match hook calls this)."""
        self._put("_requests", (str(rid)[:MAX_RID], int(device), int(host)))

    def around_check_hicache_events(self, original: Callable[..., Any], cache: Any, *a: Any, **k: Any) -> Any:
        """One scheduler step: the acks pending at its start, the acks it consumed."""
        ctl = cache.cache_controller
        if ctl is None:
            return original(cache, *a, **k)
        self.step += 1
        pending = len(ctl.ack_write_queue), len(ctl.ack_load_queue)
        self._consumed = [0, 0]
        ok = False
        try:
            result = original(cache, *a, **k)
            ok = True
            return result
        finally:
            self._put("_steps", (self.step, *pending, *self._consumed))
            if not ok and self.on_fatal is not None:
                self.on_fatal()

    def around_writing_check(self, original: Callable[..., Any], cache: Any, *a: Any, **k: Any) -> Any:
        """Backup acks consumed (popped from ``ack_write_queue``)."""
        return self._consume(original, cache, 0, "ack_write_queue", a, k)

    def around_loading_check(self, original: Callable[..., Any], cache: Any, *a: Any, **k: Any) -> Any:
        """Load acks consumed (popped from ``ack_load_queue``)."""
        return self._consume(original, cache, 1, "ack_load_queue", a, k)

    def _consume(self, original: Callable[..., Any], cache: Any, which: int, queue: str,
                 a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        ctl = cache.cache_controller
        if ctl is None:
            return original(cache, *a, **k)
        q = getattr(ctl, queue)
        before = len(q)
        try:
            return original(cache, *a, **k)
        finally:
            self._consumed[which] += max(0, before - len(q))

    def around_prefetch_hit_query(self, original: Callable[..., Any], controller: Any, operation: Any,
                                  storage_hit_count: int, *a: Any, **k: Any) -> Any:
        """The L3 hit length of this rank's own store, before sglang's MIN over the ranks."""
        rid = getattr(operation, "request_id", None)
        if rid is not None:
            self._put("_prefetch", (str(rid)[:MAX_RID], int(storage_hit_count)))
        return original(controller, operation, storage_hit_count, *a, **k)

    # -- complete transfers -------------------------------------------------------------------
    def check_ack(self, ack: Any, direction: str, first_op: Any) -> None:
        """One queued ack against the stage's transfer plan (see the module docstring); ``first_op``:
        the first operation the submission merged, whose host indices name the page."""
        plan = self.plan
        if plan is None:
            return
        bad = plan.check(getattr(ack, "num_tokens_by_pool", None), int(ack.num_bytes))
        if bad is None:
            return
        missing, expected = bad
        tokens = (ack.num_tokens_by_pool or {}).get(ANCHOR_POOL, 0)
        finding = IncompleteBackup(time=time.time(), stage=self.stage, direction=direction,
                                   page=_first_page(first_op, plan.page_size),
                                   pages=-(-tokens // max(1, plan.page_size)), missing=missing,
                                   expected_bytes=expected, got_bytes=int(ack.num_bytes))
        self._put("_backups", finding, RECENT)

    # -- leaving the rank ---------------------------------------------------------------------
    def drain(self) -> RankBatch:
        """Everything recorded since the last drain (rank 0 takes its own this way)."""
        with self._lock:
            batch = RankBatch(requests=self._requests, prefetch=self._prefetch, steps=self._steps,
                              backups=self._backups, dropped=self._dropped)
            self._requests, self._prefetch, self._steps, self._backups = [], [], [], []
            self._dropped = 0
        return batch

    def take(self) -> dict[str, Any]:
        """What the next push carries: the records of a push that did not go through (rank 0 may or
        may not have them: it takes a record of a rank once), then the new ones, within
        ``MAX_BATCH`` per kind.  ``sent()`` once rank 0 took it."""
        new = self.drain()
        old = self._inflight
        if old is not None:
            room = {k: max(0, MAX_BATCH - len(getattr(old, k))) for k in ("requests", "prefetch", "steps")}
            dropped = sum(len(getattr(new, k)) - room[k] for k in room if len(getattr(new, k)) > room[k])
            new = RankBatch(requests=old.requests + new.requests[:room["requests"]],
                            prefetch=old.prefetch + new.prefetch[:room["prefetch"]],
                            steps=old.steps + new.steps[:room["steps"]],
                            backups=(old.backups + new.backups)[:RECENT],
                            dropped=old.dropped + new.dropped + dropped)
        self._inflight = new
        return new.wire()

    def sent(self) -> None:
        """Rank 0 took the last push."""
        self._inflight = None
