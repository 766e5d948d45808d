"""Is one HiCache backup or load complete?  The rule both serving paths check every transfer by.

A page of a stage's device cache is only worth its host copy if the copy holds every pool kind
the stage mirrors: sglang #38031 backed pages up without their indexer buffers, and a page
loaded back then computed with stale index keys -- wrong output, no error.  Start-up validation
sees the host *set* (``--fault indexer-not-host-cached``); a host set that is right while the
transfers skip a kind (``--fault backup-without-indexer``) shows only in the transfers.  So
every transfer is held against the stage's plan:

* ``stagecache serve``: the plan's own pools (``mirror_bytes``: the paged kinds with host pages,
  bytes per token page); a transfer moves ``units`` pages;
* the sglang plugin: the kinds that move with a full-KV page, bytes per token of sglang's host
  pools; a transfer moves ``units`` tokens.

``transfer_gap`` is the one comparison: pure, linear in the kinds.
"""

from __future__ import annotations

from collections.abc import Mapping

from .plan import StagePlan


def mirror_bytes(stage: StagePlan) -> dict[str, int]:
    """Per pool kind the stage's host tier mirrors page by page: the bytes of one token page over
    its present buffers (what every backup and load of a page must move of it)."""
    return {p.pool: p.present * p.page_bytes for p in stage.pools
            if p.kind.paged and p.host_pages > 0 and p.present > 0}


def transfer_gap(plan: Mapping[str, int], moved: Mapping[str, int], units: int,
                 got_bytes: int | None) -> tuple[list[str], int] | None:
    """``(missing kinds, expected bytes)`` when a transfer of ``units`` (pages or tokens) lacks a
    kind of ``plan`` (kind -> bytes per unit), moved fewer or more units of one, or -- ``got_bytes``
    given -- moved other bytes than the plan's kinds make; None when it is complete.

    ``moved``: kind -> units the transfer moved of it (kinds outside the plan are ignored: the
    caller passes ``got_bytes=None`` when it cannot tell their bytes apart)."""
    if units <= 0 or not plan:
        return None
    missing = [kind for kind in plan if not moved.get(kind)]
    expected = units * sum(plan.values())
    if missing or any(moved[kind] != units for kind in plan) or (
            got_bytes is not None and got_bytes != expected):
        return missing, expected
    return None
