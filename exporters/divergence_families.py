"""Families of the PP ranks' live agreement (``live.divergence``), exposed by the sglang endpoint.

Their input is the endpoint's ``DivergenceLive`` (``SglangSource.divergence()``): one series set per
deployment, no stage labels -- a divergence is between ranks, and the ranks it names are on
/readyz, the dashboard and in the log.  Absent where the source compares nothing (``serve`` has its
own per-request agreement, ``stagecache_stage_disagreements_total``).
"""

from __future__ import annotations

from stagecache.runtime.live.divergence import QUANTITIES, QUANTITY_MEANINGS

from .family import Family, Samples, one, per

DIVERGENCE_LABELS: dict[str, str] = {
    "quantity": "what the PP ranks compared (docs/sglang.md, agreement): "
                + "; ".join(f"`{q}`: {m}" for q, m in QUANTITY_MEANINGS.items()),
}
DIVERGENCE_LABEL_VALUES: dict[str, tuple[str, ...]] = {"quantity": QUANTITIES}


def _incomplete(counts: dict[str, int]) -> Samples:
    return [((kind,), n) for kind, n in sorted(counts.items())]


DIVERGENCE_FAMILIES: tuple[Family, ...] = (
    Family("stagecache_pp_divergence_total", "counter",
           "Requests or scheduler steps on which the PP ranks reported different values, by quantity "
           "(rank 0 compares every rank's records; the first one is named on /readyz)", ("quantity",),
           per(QUANTITIES, lambda d, q: d.divergent.get(q, 0))),
    Family("stagecache_pp_agreement_total", "counter",
           "Requests or scheduler steps on which every PP rank reported the same value, by quantity",
           ("quantity",), per(QUANTITIES, lambda d, q: d.compared.get(q, 0) - d.divergent.get(q, 0))),
    Family("stagecache_pp_unmatched_total", "counter",
           "Requests or steps dropped from rank 0's compare window before every rank reported them",
           samples=one(lambda d: d.unmatched)),
    Family("stagecache_pp_dropped_records_total", "counter",
           "Agreement records ranks dropped unsent because their per-push size limit was reached",
           samples=one(lambda d: d.dropped)),
)

#: Incomplete HiCache transfers of the whole deployment, by pool kind: from the PP ranks' compare
#: on the sglang endpoint (``DivergenceLive.incomplete``), from every stage's own check in ``serve``
#: (``StageLive.transfer_check``).  Input: pool kind -> transfers.  The stage and page are named on
#: /readyz, the dashboard and in the log.
INCOMPLETE_FAMILIES: tuple[Family, ...] = (
    Family("stagecache_hicache_incomplete_transfers_total", "counter",
           "HiCache backups and loads of pages that lacked a pool kind the stage mirrors, or moved "
           "other bytes than the stage's plan says, by the pool kind missing (`bytes`: none missing, "
           "the bytes differ)", ("pool",), _incomplete),
)
