"""The one interface of a page mover: what the transfer controller asks of the CPU and device copies.

A mover copies the same token pages of every buffer of a selection between a stage's device
pools and their host mirror: ``CpuMover`` (``cpu.py``), the checked reference, or
``DeviceMover`` (``device.py``), tested byte for byte against it; the controller picks one
(``controller.make_mover``; docs/transfer.md tables the paths).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from ..memory.host_pools import HostPools
from ..memory.pools import StagePools
from .pages import PageIds
from .selection import Selection


@dataclass
class Queued:
    """What a mover queued.  ``start``/``end``: the CUDA events that time the copy (None: the copy
    is done on return); ``layer_events``: per step of a layer-by-layer move, the event ending it;
    ``entry``: the ring entry whose own events time it (a one-call move), else None."""

    start: Any = None
    end: Any = None
    layer_events: list[Any] = field(default_factory=list)
    entry: int | None = None

    @property
    def done(self) -> bool:
        return self.end is None


class PageMover(ABC):
    """Copies checked pages of a selection; see the module docstring for the implementations."""

    #: ``cpu``, ``triton`` or ``torch`` (``TransferResult.path``, the stats and the metrics).
    path: str = ""
    #: True when ``move`` returns before the copy ran (its events time it).
    asynchronous: bool = False

    def __init__(self, dp: StagePools, hp: HostPools):
        self.dp, self.hp = dp, hp

    @abstractmethod
    def move(self, steps: list[Selection], ids: PageIds, d2h: bool, per_layer: bool = False) -> Queued:
        """Copy (or queue) the pages of every step's buffers, steps in order."""

    def check_and_move(self, sel: Selection, dev: object, host: object, d2h: bool) -> Queued | None:
        """The common move checked and queued in one call, where a mover has such a path (None:
        not taken; the controller then checks the ids, names what is wrong, and calls ``move``)."""
        return None

    # -- timing bookkeeping of asynchronous moves (no-ops for synchronous ones) ----------------
    def elapsed_ms(self, start: Any, end: Any) -> float:
        raise NotImplementedError  # pragma: no cover - only asynchronous movers queue events

    def recycle(self, start: Any, end: Any) -> None:  # noqa: B027 - a no-op unless asynchronous
        """The events of a finished move may be used again."""

    def own(self, entry: int, transfer: Any) -> None:  # noqa: B027 - a no-op unless asynchronous
        """``transfer`` is timed by ring entry ``entry``'s events until it is finished."""
