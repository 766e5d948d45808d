"""Per-stage layer maps: the one place global layer ids become stage-local indices.

Every consumer -- pools, host pools, transfer controller, exporters, dashboard --
reads the ``StageLayerMap`` built here instead of recomputing ids.  The classic
PP + HiCache bug was exactly two places disagreeing about this mapping (a pool
sized by the global layer count, indexed with local ids by the host stack).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..errors import ConfigError, LayerNotOwnedError
from .partition import StageSlice, partition_layers
from .spec import ModelSpec

#: Pool kinds of a DeepSeek-V4 stage, in display order.
POOLS: tuple[str, ...] = ("swa", "c4", "c128", "c4_state", "c128_state", "indexer")

#: Which layers carry a buffer in each pool: None = every layer, else a compress ratio.
POOL_RATIO: dict[str, int | None] = {
    "swa": None,
    "c4": 4,
    "c128": 128,
    "c4_state": 4,
    "c128_state": 128,
    "indexer": 4,
}

POOL_LABELS: dict[str, str] = {
    "swa": "SWA KV",
    "c4": "C4 KV",
    "c128": "C128 KV",
    "c4_state": "C4 compress-state",
    "c128_state": "C128 compress-state",
    "indexer": "C4 indexer",
}


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
    model_num_layers: int = field(default=0, compare=False)

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
    def swa_map(self) -> dict[int, int]:
        """SWA is per layer: local id -> local id (stage-local by construction)."""
        return {e.local: e.local for e in self.layers}

    @cached_property
    def c4_map(self) -> dict[int, int]:
        return {e.local: e.compress_layer_id for e in self.layers if e.compress_ratio == 4}

    @cached_property
    def c128_map(self) -> dict[int, int]:
        return {e.local: e.compress_layer_id for e in self.layers if e.compress_ratio == 128}

    @cached_property
    def c4_state_map(self) -> dict[int, int]:
        return {e.local: e.c4_state_id for e in self.layers if e.compress_ratio == 4}

    def pool_map(self, pool: str) -> dict[int, int]:
        """local layer id -> buffer index in ``pool``, for the layers that have one."""
        if pool == "swa":
            return self.swa_map
        if pool in ("c4", "indexer"):
            return self.c4_map
        if pool == "c4_state":
            return self.c4_state_map
        if pool in ("c128", "c128_state"):
            return self.c128_map
        raise ConfigError(f"unknown pool {pool!r}; pools are {', '.join(POOLS)}")

    def pool_layers(self, pool: str) -> tuple[LayerEntry, ...]:
        """The layers of this stage that hold a buffer in ``pool``, in local order."""
        if pool not in POOL_RATIO:
            raise ConfigError(f"unknown pool {pool!r}; pools are {', '.join(POOLS)}")
        ratio = POOL_RATIO[pool]
        return tuple(e for e in self.layers if ratio is None or e.compress_ratio == ratio)

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

    def entry(self, global_layer_id: int) -> LayerEntry:
        return self.layers[self.local_id(global_layer_id)]

    def pool_index(self, pool: str, global_layer_id: int) -> int:
        """Global layer id -> index into ``pool``'s buffer list (the one translation point)."""
        local = self.local_id(global_layer_id)
        index = self.pool_map(pool).get(local)
        if index is None:
            ratio = self.layers[local].compress_ratio
            raise LayerNotOwnedError(
                f"stage {self.stage}: global layer {global_layer_id} has compress ratio {ratio} "
                f"and no {POOL_LABELS[pool]} buffer"
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
    return StageLayerMap(stage, start, end, tuple(entries), model_num_layers=spec.num_layers)


@dataclass(frozen=True)
class ModelLayout:
    """The whole PP layout: spec, sizes and every stage's map, computed once."""

    spec: ModelSpec
    pp_size: int
    tp_size: int
    stages: tuple[StageLayerMap, ...]

    @property
    def slices(self) -> tuple[StageSlice, ...]:
        return tuple(s.slice for s in self.stages)

    def stage_of(self, global_layer_id: int) -> StageLayerMap:
        for s in self.stages:
            if s.owns(global_layer_id):
                return s
        raise LayerNotOwnedError(f"no stage owns global layer {global_layer_id!r}")


def build_layout(
    spec: ModelSpec, pp_size: int, tp_size: int = 1, partition: Sequence[int] | None = None
) -> ModelLayout:
    """Partition the model with sglang's rules and build every stage's map."""
    if tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1, got {tp_size}")
    slices = partition_layers(spec.num_layers, pp_size, partition)
    stages = tuple(build_stage_map(spec, s.stage, s.start, s.end) for s in slices)
    return ModelLayout(spec, pp_size, tp_size, stages)
