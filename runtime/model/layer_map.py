"""Per-stage layer maps: the one place global layer ids become stage-local indices.

Every consumer -- pools, host pools, transfer controller, exporters, dashboard, the sglang
integration -- reads the ``StageLayerMap`` built here instead of recomputing ids.  The classic
PP + HiCache bug was exactly two places disagreeing about this mapping (a pool sized by the
global layer count, indexed with local ids by the host stack).

A layer's entry (``LayerEntry``) is typed by its model family: DeepSeek V4's carries its
compress ratio and compress ids, another family's its own kind and ids.  What every consumer
needs of an entry is its kind (``entry.kind``) and its id in a numbering (``entry.id_in``);
which numbering indexes which pool is the pool kind's ``id_space``.  The entries and maps are
pydantic models: the same objects are the plan's, the startup report's and the JSON that
crosses processes and ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, model_validator

from ..errors import ConfigError, LayerNotOwnedError
from .partition import StageSlice, partition_layers
from .pool_kinds import LOCAL, PoolKind
from .spec import ModelSpec


@dataclass(frozen=True)
class IdSpace:
    """A numbering of a stage's layers that indexes pool buffers: the stage's layers of the
    ``owners`` kinds count up from 0 in local order (``per_kind``: each owner kind on its own,
    as DeepSeek V4 numbers its C4 and C128 layers)."""

    name: str  # the entry field that holds the id
    owners: frozenset[str]
    per_kind: bool = False
    text: str = ""  # the id in a message ("compress id")


class LayerEntry(BaseModel):
    """One layer of a stage: its ids in every numbering that matters (a family adds its fields)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    local: int = Field(ge=0, description="the layer's index in its stage")
    global_id: int = Field(ge=0, alias="global", description="the layer's index in the model")

    #: the family's field that holds the layer's kind (an entry whose kind is derived overrides ``kind``)
    kind_field: ClassVar[str] = ""

    @property
    def kind(self) -> str:
        """The layer's cache kind (one of its family's ``layer_kinds``)."""
        return getattr(self, self.kind_field)

    def describe(self) -> str:
        """What the layer is, in a message ("compress ratio 4")."""
        return f"layer kind {self.kind}"

    def id_in(self, space: str) -> int | None:
        """The layer's id in numbering ``space`` (``LOCAL``: its local id)."""
        return self.local if space == LOCAL else getattr(self, space)

    def transfer_ids(self) -> tuple[int | None, int | None] | None:
        """(id HiCache signals the layer's transfer with, id the pool waits on); None: the family
        has no such ids (``validation.checks.validate_transfer_ids``, sglang #38866)."""
        return None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def problem(self) -> tuple[str, str] | None:
        """What is wrong with this layer on its own, as ``(pool, message)`` (a DSA layer that
        reuses a top-k no one hands it); None by default."""
        return None

    @classmethod
    def make(cls, local: int, global_id: int, kind: str, ids: dict[str, int | None]) -> LayerEntry:
        """The entry of a layer of ``kind`` with its ``ids`` (one per id space of the family)."""
        raise NotImplementedError


class StageLayerMap(BaseModel):
    """The layers a PP stage owns, built once per stage and shared by every consumer."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    stage: int = Field(ge=0)
    start: int = Field(alias="start_layer", description="first global layer of the stage")
    end: int = Field(alias="end_layer", description="one past the stage's last global layer")
    local_layers: int = Field(ge=0, description="layers the stage owns")
    layers: tuple[SerializeAsAny[LayerEntry], ...] = Field(
        description="every layer of the stage, in local order, with its family's fields")
    #: the family's pool kinds: which layers own a buffer in each, and by which id
    kinds: tuple[PoolKind, ...] = Field(exclude=True, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _count_layers(cls, data: Any) -> Any:
        if isinstance(data, dict) and "local_layers" not in data:
            data = {**data, "local_layers": len(data.get("layers", ()))}
        return data

    @property
    def slice(self) -> StageSlice:
        return StageSlice(self.stage, self.start, self.end)

    def owns(self, global_layer_id: int) -> bool:
        return self.start <= global_layer_id < self.end

    def kind(self, pool: str) -> PoolKind:
        """The pool kind named ``pool`` (a ConfigError listing the stage's kinds otherwise)."""
        for k in self.kinds:
            if k.name == pool:
                return k
        raise ConfigError(f"unknown pool {pool!r}; pools are {', '.join(self.pools)}")

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.kinds)

    # -- maps (local -> index in a pool) ---------------------------------------------------
    @cached_property
    def _pool_maps(self) -> dict[str, dict[int, int | None]]:
        return {k.name: {e.local: k.index_of(e) for e in self.layers if k.owns(e.kind)}
                for k in self.kinds}

    def pool_map(self, pool: str) -> dict[int, int | None]:
        """local layer id -> buffer index in ``pool``, for the layers that have one."""
        return self._pool_maps[self.kind(pool).name]

    def pool_layers(self, pool: str) -> tuple[LayerEntry, ...]:
        """The layers of this stage that hold a buffer in ``pool``, in local order."""
        k = self.kind(pool)
        return tuple(e for e in self.layers if k.owns(e.kind))

    def expected_buffers(self) -> dict[str, int]:
        """How many buffers each pool of this stage must hold: its local layers of that kind."""
        return {k.name: len(self._pool_maps[k.name]) for k in self.kinds}

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
            raise LayerNotOwnedError(
                f"stage {self.stage}: global layer {global_layer_id} has "
                f"{self.layers[local].describe()} and no {self.kind(pool).label} buffer"
            )
        return index

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, include=set(StageLayerMap.model_fields))

    def with_layers(self, start: int, end: int, layers: Sequence[LayerEntry]) -> StageLayerMap:
        """This stage with another range and entries (what a fault computes)."""
        return StageLayerMap(stage=self.stage, start=start, end=end, layers=tuple(layers),
                             kinds=self.kinds)


def number_layers(spec: ModelSpec, stage: int, start: int, end: int) -> StageLayerMap:
    """A stage's map: each id space counts only *this stage's* layers of its owner kinds."""
    if not 0 <= start <= end <= spec.num_layers:
        raise ConfigError(
            f"stage {stage}: layer range [{start}, {end}) is outside the model's "
            f"{spec.num_layers} layers"
        )
    family = spec.family
    kinds = spec.layer_kinds
    counters: dict[tuple[str, str | None], int] = {}
    entries = []
    for local, global_id in enumerate(range(start, end)):
        kind = kinds[global_id]
        ids: dict[str, int | None] = {}
        for space in family.id_spaces:
            if kind not in space.owners:
                ids[space.name] = None
                continue
            key = (space.name, kind if space.per_kind else None)
            ids[space.name] = counters.get(key, 0)
            counters[key] = ids[space.name] + 1
        entries.append(family.entry.make(local, global_id, kind, ids))
    return StageLayerMap(stage=stage, start=start, end=end, layers=tuple(entries),
                         kinds=family.pool_kinds)


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


def partition_without_problems(spec: ModelSpec, pp_size: int, tries: int = 4096,
                               page_size: int = 1) -> tuple[int, ...] | None:
    """A partition close to sglang's even split whose stages sglang builds without the family's
    ``stage_problems`` (None: none found within ``tries`` candidates): what ``pools`` suggests.

    Breadth-first from the even split, moving one stage boundary by one layer at a time, so the
    first partition found is one of the fewest moves away from what sglang does by default."""
    start = tuple(s.num_layers for s in partition_layers(spec.num_layers, pp_size))
    seen, queue = {start}, [start]
    for part in queue:
        if len(seen) > tries:
            return None
        if not any(spec.family.stage_problems(number_layers(spec, s.stage, s.start, s.end), page_size)
                   for s in partition_layers(spec.num_layers, pp_size, part)):
            return part
        for i in range(pp_size - 1):
            for step in (-1, 1):
                nxt = list(part)
                nxt[i] += step
                nxt[i + 1] -= step
                cand = tuple(nxt)
                if min(cand) >= 1 and cand not in seen:
                    seen.add(cand)
                    queue.append(cand)
    return None


def build_layout(
    spec: ModelSpec, pp_size: int, tp_size: int = 1, partition: Sequence[int] | None = None
) -> ModelLayout:
    """Partition the model with sglang's rules and build every stage's map."""
    if tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1, got {tp_size}")
    slices = partition_layers(spec.num_layers, pp_size, partition)
    stages = tuple(number_layers(spec, s.stage, s.start, s.end) for s in slices)
    return ModelLayout(spec, tp_size, stages)
