"""A served PP rank's scheduler-side cache traffic, on sglang's own objects, for the agreement tests.

Every rank of a launch (``sglang_ranks.launch``) runs the same request stream through
``Traffic.run``, one scheduler step at a time:

* per request, a prefix match through sglang's (hooked) ``UnifiedRadixCache.match_prefix``: the
  match result is this driver's -- the request's pages found in the rank's device set (an LRU of
  ``DEVICE_PAGES``) and then in its host tier, which is sglang's real host pool group of the rank:
  a page is on the host while the host indices sglang's controller gave its backup are held, and
  when sglang's pool has no room the driver frees the least recently used pages there, as the
  radix tree's host eviction does;
* the host pages of a match loaded back by sglang's real ``HybridCacheController`` (``load`` /
  ``start_loading``) and each new page backed up (``write`` / ``start_writing``), each moving the
  full-KV rows with the stage's C4, indexer and C128 pools (sglang's ``PoolTransfer`` by the same
  indices, as its radix tree's backups do);
* per step, sglang's own ``check_hicache_events`` (``cpu_stage.StepLedger``): ``_pp_sync`` hands
  PP rank 0's ready-ack counts down the real PP group (gloo), every rank consumes them;
* per request that probes L3, sglang's ``_sync_prefetch_hit_query`` with the length this rank's L3
  holds (the previous turns' tokens), MIN-reduced over a real gloo group of every rank (#27010).

Injections (environment of one rank): ``STAGECACHE_TEST_DELAY_LOAD_AT=s`` submits that step's
loads (``start_loading``) after the step's event check -- the ack one step late;
``STAGECACHE_TEST_SHORT_L3=rid`` makes this rank's L3 hold one page less of ``rid``.  A smaller
host pool is a server argument (``STAGECACHE_TEST_HICACHE_RATIO``).  Backups without the indexer
pool (sglang #38031) are the product's own fault, ``STAGECACHE_FAULT=backup-without-indexer[@STAGE]``:
the plugin drops the pool from the writes this driver queues.  A rank whose traffic
fails writes ``STAGECACHE_TEST_STOP_FILE``, and the others stop at their next step instead of
waiting on it in sglang's PP sync.
The page copies themselves are skipped (``no_copies``): agreement is about which transfers each
rank makes and consumes, and the bytes are the acks' own.
"""

from __future__ import annotations

import os
from array import array
from collections import OrderedDict
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
from stagecache.runtime.bench.sglang_hooks import no_copies

PAGE = 256
DEVICE_PAGES = 6
#: device rows every transfer reads or writes (inside the rank's pool)
ROWS = torch.arange(PAGE, 2 * PAGE)


def requests(n: int, sessions: int = 12, turns: int = 8) -> list[tuple[str, int, int]]:
    """``(rid, session, turn)``: sessions interleaved, each turn one page longer; sessions start over
    (new ids) after ``turns``."""
    out = []
    round_ = 0
    while len(out) < n:
        for turn in range(1, turns + 1):
            for s in range(sessions):
                out.append((f"s{round_}.{s}-t{turn}", round_ * 1000 + s, turn))
        round_ += 1
    return out[:n]


def _tell_the_others(stop: str, rank: int, step: int) -> None:
    """Write ``step`` (the one this rank failed in: every rank finishes it) to the stop file, whole
    or not at all.  The first rank to fail names the step: the ranks that then give up waiting on
    it (gloo's timeout, at about the same moment) leave the file as it is."""
    tmp = f"{stop}.{rank}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
    try:
        os.link(tmp, stop)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


class _Stopped(Exception):
    """Another rank failed: this one stops before a PP sync that rank would never join."""


class Traffic:
    """One rank's driver (see the module docstring)."""

    def __init__(self, rank: int, pp_size: int, stack: tuple[Any, Any]):
        from sglang.srt.distributed.parallel_state import get_pp_group
        from stagecache.runtime.integrations.sglang.cpu_stage import StepLedger

        self.rank = rank
        self.group, self.ctl = stack
        self.ledger = StepLedger(self.ctl, pp_rank=rank, pp_size=pp_size, pp_group=get_pp_group().cpu_group)
        # sglang's prefetch hit sync groups are built when storage attaches: one real gloo group here,
        # with the rank's gloo timeout (a rank that failed leaves the others waiting in its MIN
        # all-reduce: they give up as they do in the PP group's sync, not after gloo's default)
        wait = timedelta(seconds=int(os.environ.get("STAGECACHE_TEST_GLOO_TIMEOUT_S", "60")))
        self.ctl.prefetch_hits_sync_groups = [torch.distributed.new_group(backend="gloo", timeout=wait)]
        self.names = [e.name for e in self.group.entries
                      if e.name.value in ("deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c128")]
        self.device: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.host: OrderedDict[tuple[int, int], tuple[torch.Tensor, dict[Any, torch.Tensor]]] = OrderedDict()
        self.delay_at = int(os.environ.get("STAGECACHE_TEST_DELAY_LOAD_AT", "0"))
        self.short_l3 = os.environ.get("STAGECACHE_TEST_SHORT_L3")
        self.matches: list[tuple[str, int, int]] = []
        self.prefetch: list[tuple[str, int, int]] = []  # rid, this rank's L3 length, sglang's MIN
        self.node = 0
        self.step_no = 0

    # -- one request ------------------------------------------------------------------------
    def _match(self, rid: str, session: int, turn: int) -> tuple[int, list[tuple[int, int]]]:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        pages = [(session, p) for p in range(turn)]
        device = 0
        while device < turn and pages[device] in self.device:
            device += 1
        host = device
        while host < turn and pages[host] in self.host:
            host += 1
        result = MatchResult(device_prefix_len=device * PAGE, last_device_node=None, last_host_node=None,
                             best_match_node=None, host_hit_length=(host - device) * PAGE)
        cache = SimpleNamespace(session=SimpleNamespace(try_match_prefix=lambda params: result))
        key = RadixKey(array("l", range(session * 100_000, session * 100_000 + turn * PAGE)))
        UnifiedRadixCache.match_prefix(cache, MatchPrefixParams(key=key, req=SimpleNamespace(rid=rid)))
        self.matches.append((rid, device * PAGE, (host - device) * PAGE))
        return device, pages[device:host]

    def _extra(self, host: dict[Any, torch.Tensor] | None = None) -> list[Any]:
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        if host is None:
            return [PoolTransfer(name=n, device_indices=ROWS.clone()) for n in self.names]
        return [PoolTransfer(name=n, host_indices=host[n], device_indices=ROWS.clone())
                for n in self.names if n in host]

    def _backup(self, page: tuple[int, int]) -> None:
        while True:
            host = self.ctl.write(ROWS, node_id=self.node, flush=False, extra_pools=self._extra())
            if host is not None:
                break
            if not self.host:
                raise RuntimeError(f"rank {self.rank}: the host pool holds no page")
            _, (idx, extra) = self.host.popitem(last=False)  # least recently used
            self.group.free(idx)
            for name, e in extra.items():
                self.group.free(e, pool=name)
        self.node += 1
        extra = {t.name: t.host_indices for t in self.ctl.write_queue[-1].pool_transfers}
        self.host[page] = (host, extra)

    def _load(self, page: tuple[int, int]) -> None:
        idx, extra = self.host[page]
        self.host.move_to_end(page)
        loaded = self.ctl.load(idx, node_id=self.node, device_indices=ROWS.clone(), extra_pools=self._extra(extra))
        self.node += 1
        if loaded is None:
            raise RuntimeError(f"rank {self.rank}: sglang could not load page {page}")

    def _probe_l3(self, rid: str, turn: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation

        held = (turn - 1) * PAGE - (PAGE if rid == self.short_l3 else 0)
        op = PrefetchOperation(CacheRequestHandle(rid, 0), list(range(turn * PAGE)))
        agreed = self.ctl._sync_prefetch_hit_query(op, held)
        self.prefetch.append((rid, held, agreed))

    def _stopped(self, ahead: int = 0) -> bool:
        """Another rank failed in a step before the one this rank is in (``ahead``: about to start):
        that rank sent its PP sync of the step it failed in, but will send none after it."""
        stop = os.environ.get("STAGECACHE_TEST_STOP_FILE")
        try:
            with open(stop) as f:  # type: ignore[arg-type]
                failed = int(f.read().strip())
        except (TypeError, OSError, ValueError):  # none, or not written through yet
            return False
        return failed < self.step_no + ahead

    # -- one step -----------------------------------------------------------------------------
    def step(self, batch: list[tuple[str, int, int]]) -> None:
        self.step_no += 1
        for rid, session, turn in batch:
            device, from_host = self._match(rid, session, turn)
            for page in from_host:
                self._load(page)
            for p in range(device + len(from_host), turn):
                self._backup((session, p))
            for p in range(turn):
                self.device[(session, p)] = None
                self.device.move_to_end((session, p))
            while len(self.device) > DEVICE_PAGES:
                self.device.popitem(last=False)
            if turn > 1 and turn % 4 == 0:
                self._probe_l3(rid, turn)
        self.ctl.start_writing()
        if self._stopped():  # checked last: a rank that failed in an earlier step has written it
            raise _Stopped   # by now, and its PP sync would never come
        late = self.step_no == self.delay_at
        if not late:
            self.ctl.start_loading()
        try:
            self.ledger.step()
        finally:
            if late:
                self.ctl.start_loading()

    def run(self, n: int, per_step: int = 4) -> dict[str, Any]:
        """``n`` requests, ``per_step`` per scheduler step; what this rank saw, and the error that
        stopped it (a rank told to consume an ack it never queued: sglang's IndexError; the ranks
        waiting on it: gloo's timeout)."""
        stream = requests(n)
        error = None
        stop = os.environ.get("STAGECACHE_TEST_STOP_FILE")  # a rank that failed tells the others
        with no_copies():
            try:
                for i in range(0, n, per_step):
                    if self._stopped(ahead=1):
                        break  # the pipeline cannot go on without the failed rank
                    self.step(stream[i:i + per_step])
            except _Stopped:
                pass
            except Exception as exc:  # the case decides whether this is expected
                error = f"{type(exc).__name__}: {exc}"[:300]
                if stop:
                    _tell_the_others(stop, self.rank, self.step_no)
        return {"steps": self.step_no, "matches": self.matches, "prefetch": self.prefetch,
                "host_tokens": int(self.group.logical_size), "error": error}
