"""The record exchange of a live sglang deployment: every PP rank's stage record to every PP rank.

It runs once, at the stack build in ``Scheduler.__init__``, over sglang's own PP CPU group
(``get_pp_group().cpu_group``: gloo, so it crosses hosts) -- the one moment every rank is
in the same place and sglang itself does collectives.  Nothing here runs later or from
another thread: sglang's event loop exchanges objects point to point on that group.

A ``monitored_barrier`` with our own timeout first (sglang's gloo default is 120 minutes), so a
rank that never arrives is named within seconds instead of the deployment hanging; then the
records as HMAC-prefixed JSON, never pickle (``serve.exchange.all_gather_json``).
"""

from __future__ import annotations

import logging
import re
from datetime import timedelta
from typing import Any

from ...errors import StageCacheError
from ...serve.exchange import all_gather_json

log = logging.getLogger(__name__)

#: MAC key of the record exchange: the records are integrity-checked JSON, and no code runs
#: from them (nothing is unpickled).
RECORD_KEY = b"stagecache-sglang-record-exchange-v2"


class ExchangeTimeout(StageCacheError):
    """Some PP ranks did not reach the record exchange in time (the message names them)."""


def _missing(text: str, ranks: list[int]) -> list[int]:
    """PP ranks (group order) among the world ranks torch's monitored_barrier error names."""
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    if not m:
        return []
    world = [int(x) for x in m.group(1).replace(" ", "").split(",") if x]
    return [ranks.index(w) for w in world if w in ranks]


def exchange_records(record: dict[str, Any], group: Any, timeout_s: float,
                     secret: bytes = RECORD_KEY) -> list[Any]:
    """Every PP rank's ``record``, in PP rank order, on every PP rank of ``group``.

    ``ExchangeTimeout`` names the ranks that did not arrive within ``timeout_s`` (rank 0
    learns which; the others learn that rank 0 gave up waiting).
    """
    import torch.distributed as dist

    ranks = list(dist.get_process_group_ranks(group))
    me = ranks.index(dist.get_rank())
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as exc:
        missing = _missing(str(exc), ranks)
        who = (f"PP rank(s) {', '.join(map(str, missing))} did not" if missing
               else "PP rank 0 gave up waiting: some PP rank did not")
        raise ExchangeTimeout(
            f"stagecache record exchange (PP rank {me}): {who} reach the HiCache stack build within "
            f"{timeout_s:g} s (STAGECACHE_SGLANG_EXCHANGE_TIMEOUT_S); the deployment cannot start"
        ) from None
    records = all_gather_json(record, secret, len(ranks), group=group)
    log.info("PP rank %d: record exchange done with %d ranks", me, len(ranks))
    return records
