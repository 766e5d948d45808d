"""Per-stage layer maps: the one place global layer ids become stage-local indices.

Every consumer -- pools, host pools, transfer controller, exporters, dashboard --
reads the ``StageLayerMap`` built here instead of recomputing ids.  The classic
PP + HiCache bug was exactly two places disagreeing about this mapping (a pool
sized by the global layer count, indexed with local ids by the host stack).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..errors import ConfigError, LayerNotOwnedError
from .partition import StageSlice, partition_layers
from .pool_kinds import KINDS, POOLS, kind
from .spec import ModelSpec


@dataclass(frozen=True)
class LayerEntry:
    """One layer of a stage: its ids in every numbering that matters."""

    local: int
    global_id: int
    compress_ratio: int
    compress_layer_id: int | None  # index in this stage's pool of that ratio; None for ratio 0
    c4_state_id: int | None  # index among this stage's ratio-4 layers; None otherwise

    def to_dict(self) -> dict[str, Any]:
        return {
            "local": self.local,
            "global": self.global_id,
            "compress_ratio": self.compress_ratio,
            "compress_layer_id": self.compress_layer_id,
            "c4_state_id": self.c4_state_id,
        }


@dataclass(frozen=True)
class StageLayerMap:
    """The layers a PP stage owns, built once per stage and shared by every consumer."""

    stage: int
    start: int
    end: int
    layers: tuple[LayerEntry, ...]

    @property
    def local_layers(self) -> int:
        return len(self.layers)

    @property
    def slice(self) -> StageSlice:
        return StageSlice(self.stage, self.start, self.end)

    def owns(self, global_layer_id: int) -> bool:
        return self.start <= global_layer_id < self.end

    # -- maps (local -> index in a pool) ---------------------------------------------------
    @cached_property
    def _pool_maps(self) -> dict[str, dict[int, int]]:
        return {k.name: {e.local: k.index_of(e) for e in self.layers if k.owns(e.compress_ratio)}
                for k in KINDS.values()}

    def pool_map(self, pool: str) -> dict[int, int]:
        """local layer id -> buffer index in ``pool``, for the layers that have one (``swa``:
        every layer, local id -> local id; ``c4``/``c128``: the stage's layers of that ratio)."""
        return self._pool_maps[kind(pool).name]

    def pool_layers(self, pool: str) -> tuple[LayerEntry, ...]:
        """The layers of this stage that hold a buffer in ``pool``, in local order."""
        k = kind(pool)
        return tuple(e for e in self.layers if k.owns(e.compress_ratio))

    def expected_buffers(self) -> dict[str, int]:
        """How many buffers each pool of this stage must hold: its local layers of that kind."""
        return {pool: len(self.pool_layers(pool)) for pool in POOLS}

    # -- translation global -> local ------------------------------------------------------
    def local_id(self, global_layer_id: int) -> int:
        """Global layer id -> local id; a clear error for a layer this stage does not own."""
        if not isinstance(global_layer_id, int) or not self.owns(global_layer_id):
            raise LayerNotOwnedError(
                f"stage {self.stage} owns global layers [{self.start}, {self.end}); "
                f"layer {global_layer_id!r} is not one of them"
            )
        return global_layer_id - self.start

    def pool_index(self, pool: str, global_layer_id: int) -> int:
        """Global layer id -> index into ``pool``'s buffer list (the one translation point)."""
        local = self.local_id(global_layer_id)
        index = self.pool_map(pool).get(local)
        if index is None:
            ratio = self.layers[local].compress_ratio
            raise LayerNotOwnedError(
                f"stage {self.stage}: global layer {global_layer_id} has compress ratio {ratio} "
                f"and no {KINDS[pool].label} buffer"
            )
        return index

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "start_layer": self.start,
            "end_layer": self.end,
            "local_layers": self.local_layers,
            "layers": [e.to_dict() for e in self.layers],
        }


def build_stage_map(spec: ModelSpec, stage: int, start: int, end: int) -> StageLayerMap:
    """Build a stage's map: compress ids count only *this stage's* layers of each ratio."""
    if not 0 <= start <= end <= spec.num_layers:
        raise ConfigError(
            f"stage {stage}: layer range [{start}, {end}) is outside the model's "
            f"{spec.num_layers} layers"
        )
    counters = {4: 0, 128: 0}
    entries = []
    for local, global_id in enumerate(range(start, end)):
        ratio = spec.compress_ratios[global_id]
        compress_id = c4_state_id = None
        if ratio in counters:
            compress_id = counters[ratio]
            counters[ratio] += 1
            if ratio == 4:
                c4_state_id = compress_id
        entries.append(LayerEntry(local, global_id, ratio, compress_id, c4_state_id))
    return StageLayerMap(stage, start, end, tuple(entries))


@dataclass(frozen=True)
class ModelLayout:
    """The whole PP layout: spec, TP size and every stage's map, computed once."""

    spec: ModelSpec
    tp_size: int
    stages: tuple[StageLayerMap, ...]  # one per PP rank, in rank order

    @property
    def pp_size(self) -> int:
        """One stage map per PP rank, so the PP size is never a second, separate number."""
        return len(self.stages)

    @property
    def slices(self) -> tuple[StageSlice, ...]:
        return tuple(s.slice for s in self.stages)


def build_layout(
    spec: ModelSpec, pp_size: int, tp_size: int = 1, partition: Sequence[int] | None = None
) -> ModelLayout:
    """Partition the model with sglang's rules and build every stage's map."""
    if tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1, got {tp_size}")
    slices = partition_layers(spec.num_layers, pp_size, partition)
    stages = tuple(build_stage_map(spec, s.stage, s.start, s.end) for s in slices)
    return ModelLayout(spec, tp_size, stages)
