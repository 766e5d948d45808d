"""What a stage holds, per pool kind: one flag per buffer (False where the buffer is None).

Two sources produce it: a plan (what a constructor *will* allocate, faults included) and real
pools (what their tensors are); validation compares either with the layer map.  It lives below
both memory and validation so that neither has to import the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolInventory:
    """Per pool, one flag per buffer (False = the buffer is None); a pool absent from
    ``buffers`` was never built."""

    stage: int
    buffers: Mapping[str, tuple[bool, ...]]

    @classmethod
    def from_buffers(cls, stage: int, buffers: Mapping[str, Sequence[object] | None]) -> PoolInventory:
        """The inventory of real buffer lists (tensors, or sglang's pool objects)."""
        present = {pool: tuple(b is not None for b in bufs) for pool, bufs in buffers.items()
                   if bufs is not None}
        return cls(stage, present)

    def counts(self, pools: Sequence[str]) -> dict[str, int]:
        """Buffers per pool kind of ``pools``, None ones included (0 where never built)."""
        return {pool: len(self.buffers.get(pool, ())) for pool in pools}
