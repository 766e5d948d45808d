"""A stage's record: what one stage holds, as it tells the others -- built by one function.

Every path that validates stages goes through a ``StageRecord``: ``check`` makes one per stage
from the plan; each ``serve`` stage process makes its own from the pools it really allocated
and sends it to rank 0; each rank of a live sglang deployment makes its own from the pool sglang
built and the ranks exchange them.  ``deployment.deployment_report`` then turns the records
into the one ``StartupReport``, the same way on every path.

A record is plain JSON (layer map, pool inventory, measured bytes, host mirror, token
capacity, fingerprint, findings) and may arrive from another process or rank, so it is parsed
with pydantic (bounded sizes, typed fields) before any of it is used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import MappingError
from ..model.families import family_named
from ..model.layer_map import StageLayerMap
from ..plan.fingerprint import Fingerprint
from ..plan.inventory import PoolInventory
from ..plan.plan import StagePlan

#: Bumped when a field changes meaning: stages of different stagecache versions refuse each other.
RECORD_VERSION = 2


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CapacityRow(_Strict):
    """Full tokens the stage's budget fits alone, and the deployment's (sglang's MIN over ranks)."""

    tokens_alone: int = Field(ge=0)
    tokens: int = Field(ge=0)


class StageRecord(_Strict):
    """What one stage holds (see the module docstring)."""

    version: int = RECORD_VERSION
    family: str = Field(max_length=64)
    model: str = Field(max_length=256)
    num_layers: int = Field(ge=1)
    engine: str = Field("", max_length=64, description="what built the pools: 'sglang 0.5.23', ...")
    layer_map: StageLayerMap
    inventory: dict[str, list[bool]] = Field(description="per pool kind, one flag per buffer (False: None)")
    pool_page_bytes: dict[str, int] = Field(default_factory=dict)
    device_bytes: dict[str, int] = Field(default_factory=dict)
    host_buffers: dict[str, int] = Field(default_factory=dict)
    host_bytes: dict[str, int] = Field(default_factory=dict)
    host_pages: dict[str, int] = Field(default_factory=dict, description="host page counts by budget")
    pool_tokens: int = Field(0, ge=0, description="full tokens the stage's pool was built for")
    fingerprint: Fingerprint | None = None
    capacity: CapacityRow | None = None
    findings: tuple[MappingError, ...] = Field(
        (), max_length=4096, description="what the stage found itself (a live pool's holes, its L3 store)")

    @model_validator(mode="before")
    @classmethod
    def _parse_layer_map(cls, data: Any) -> Any:
        """The layer map's entries are typed by the record's family."""
        if isinstance(data, dict) and isinstance(data.get("layer_map"), dict):
            family = family_named(str(data.get("family", "")))
            raw = data["layer_map"]
            layers = [family.entry.model_validate(e) for e in raw.get("layers", ())[:4096]]
            data = {**data, "layer_map": StageLayerMap.model_validate(
                {**raw, "layers": layers, "kinds": family.pool_kinds})}
        return data

    @property
    def stage(self) -> int:
        return self.layer_map.stage

    def pool_inventory(self) -> PoolInventory:
        return PoolInventory(self.stage, {p: tuple(v) for p, v in self.inventory.items()})

    def to_json(self) -> dict[str, Any]:
        """The record as the JSON that crosses processes (what ``model_validate`` parses back)."""
        return self.model_dump(mode="json", by_alias=True)

    def stranded_bytes(self) -> int:
        """Device bytes this stage could still use if it ran alone: its token-sized pools' bytes per
        deployment token (sized for the deployment's capacity) times the tokens the minimum takes
        away."""
        cap = self.capacity
        if cap is None or cap.tokens <= 0 or cap.tokens_alone <= cap.tokens:
            return 0
        paged = [k.name for k in self.layer_map.kinds if k.paged]
        per_token = sum(self.device_bytes.get(p, 0) for p in paged) / cap.tokens
        return int(per_token * (cap.tokens_alone - cap.tokens))


def stage_record(plan: StagePlan, *, inventory: PoolInventory | None = None,
                 pool_page_bytes: Mapping[str, int] | None = None,
                 device_bytes: Mapping[str, int] | None = None,
                 host_buffers: Mapping[str, int] | None = None,
                 host_bytes: Mapping[str, int] | None = None,
                 findings: Sequence[MappingError] = (), engine: str = "",
                 capacity: tuple[int, int] | None = None, host_pages: Mapping[str, int] | None = None,
                 pool_tokens: int | None = None, fingerprint: Fingerprint | None = None,
                 model: str | None = None) -> StageRecord:
    """The record of a stage: what its plan says it holds, or -- where given -- what its live pools
    really hold (their inventory, measured bytes, host mirror; ``{}``: not known).  ``pool_tokens``
    defaults to the full tokens the plan sized the stage for."""
    inv = inventory if inventory is not None else plan.inventory()
    planned_host = {p.pool: p.present if p.host_pages and p.kind.host_cached else 0 for p in plan.pools}
    return StageRecord(
        family=plan.spec.family.name, model=model or plan.spec.name, num_layers=plan.spec.num_layers,
        engine=engine, layer_map=plan.layer_map,
        inventory={p: list(v) for p, v in inv.buffers.items()},
        pool_page_bytes=dict(pool_page_bytes if pool_page_bytes is not None else plan.pool_page_bytes()),
        device_bytes=dict(device_bytes if device_bytes is not None
                          else {p.pool: p.device_bytes for p in plan.pools}),
        host_buffers=dict(host_buffers if host_buffers is not None else planned_host),
        host_bytes=dict(host_bytes if host_bytes is not None else {p.pool: p.host_bytes for p in plan.pools}),
        host_pages=dict(host_pages or {}),
        pool_tokens=plan.budget.full_tokens if pool_tokens is None else pool_tokens,
        fingerprint=fingerprint if fingerprint is not None else plan.fingerprint,
        capacity=CapacityRow(tokens_alone=capacity[0], tokens=capacity[1]) if capacity else None,
        findings=tuple(findings),
    )
