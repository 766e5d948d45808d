"""Shared test helper: a stage's live numbers before any traffic, as the JSON dict a stage writes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stagecache.runtime.live.numbers import StageLive


def blank_live(stage: int, pools: Iterable[str] = ()) -> dict[str, Any]:
    """``StageLive(stage)`` as a plain dict, with zeroed page spaces and pool bytes for ``pools``."""
    pools = list(pools)
    return StageLive(
        stage=stage,
        page_spaces={"device": {"tier": "device", "used": 0, "total": 0, "pools": pools}} if pools else {},
        pool_bytes={p: {"device": 0, "host": 0} for p in pools},
    ).model_dump()
