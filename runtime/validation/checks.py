"""Startup validation: pure functions that return *every* mapping error.

Nothing here raises on a bad stage; callers decide (``check`` prints and exits
1, ``serve`` refuses to start serving and shows the errors on the dashboard, the
sglang hook refuses the stack build in strict mode).  The inventory checked is a
plan's (``StagePlan.inventory``: what a constructor will build) or real pools'.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import MappingError
from ..model.layer_map import StageLayerMap
from ..model.partition import StageSlice
from ..model.pool_kinds import KINDS, POOLS
from ..plan.inventory import PoolInventory


def _count_message(pool: str, got: int, expected: int) -> str:
    if pool == "swa":
        return f"DeepSeek V4 SWA KV pool must be PP-stage-local: got {got} buffers for {expected} local layers"
    ratio = KINDS[pool].owner_ratio
    return (
        f"{KINDS[pool].label} pool must hold one buffer per local ratio-{ratio} layer: "
        f"got {got} buffers for {expected} local ratio-{ratio} layers"
    )


def validate_stage(stage_map: StageLayerMap, inventory: PoolInventory) -> list[MappingError]:
    """All errors of one stage: buffer counts, None slots, layer ids and compress ids."""
    s = stage_map.stage
    errors: list[MappingError] = []
    expected = stage_map.expected_buffers()

    for pool in POOLS:
        want = expected[pool]
        slots = inventory.buffers.get(pool)
        if slots is None:
            if want:
                errors.append(MappingError(
                    s, pool, want, None,
                    f"{KINDS[pool].label} pool is missing: {want} local layers need it",
                ))
            continue
        if len(slots) != want:
            errors.append(MappingError(s, pool, want, len(slots), _count_message(pool, len(slots), want)))
        empty = [i for i, present in enumerate(slots) if not present]
        if empty:
            name = f"deepseek_v4_{pool} state_pools" if pool.endswith("_state") else f"{KINDS[pool].label} pool"
            errors.append(MappingError(
                s, pool, "no None buffers", f"None at {empty}",
                f"{name} must not contain None: buffer(s) {empty} are None",
            ))

    for e in stage_map.layers:
        if e.global_id != stage_map.start + e.local:
            errors.append(MappingError(
                s, "layer_map", stage_map.start + e.local, e.global_id,
                f"local layer {e.local} must map to global layer start+local="
                f"{stage_map.start + e.local}, got {e.global_id}",
            ))
        if e.compress_ratio == 0 and (e.compress_layer_id is not None or e.c4_state_id is not None):
            errors.append(MappingError(
                s, "layer_map", None, e.compress_layer_id,
                f"global layer {e.global_id} has ratio 0 but a compress id",
            ))

    # Each id map once, checked against the first pool kind indexed by it (c4, c128, c4_state):
    # the kinds sharing a map would only repeat the same error.
    checked: set[tuple[int | None, str]] = set()
    for k in KINDS.values():
        if k.owner_ratio is not None and (k.owner_ratio, k.id_attr) not in checked:
            checked.add((k.owner_ratio, k.id_attr))
            errors += _check_ids(stage_map, k.name, inventory)
    return errors


def _check_ids(stage_map: StageLayerMap, pool: str, inventory: PoolInventory) -> list[MappingError]:
    """Ids of one pool must be unique and inside the pool's buffer range."""
    s = stage_map.stage
    ratio, attr = KINDS[pool].owner_ratio, KINDS[pool].id_attr
    layers = stage_map.pool_layers(pool)
    size = len(inventory.buffers.get(pool, ()))
    errors: list[MappingError] = []
    seen: dict[int, int] = {}
    for e in layers:
        cid = getattr(e, attr)
        if cid is None:
            errors.append(MappingError(
                s, pool, "an id", None, f"global layer {e.global_id} (ratio {ratio}) has no {attr}",
            ))
            continue
        if not 0 <= cid < size:
            errors.append(MappingError(
                s, pool, f"0..{size - 1}" if size else "no ids (empty pool)", cid,
                f"global layer {e.global_id}: {attr} {cid} is out of range for the stage's "
                f"{size} {KINDS[pool].label} buffers",
            ))
        if cid in seen:
            errors.append(MappingError(
                s, pool, "unique ids", cid,
                f"global layers {seen[cid]} and {e.global_id} share {attr} {cid}",
            ))
        else:
            seen[cid] = e.global_id
    return errors


def validate_tiling(slices: Sequence[StageSlice], num_layers: int) -> list[MappingError]:
    """Stage slices must tile ``[0, num_layers)``: no gap, overlap, empty stage or overflow."""
    errors: list[MappingError] = []
    expected_next = 0
    for sl in sorted(slices, key=lambda x: (x.start, x.stage)):
        if sl.end <= sl.start:
            errors.append(MappingError(
                sl.stage, "partition", "at least 1 layer", sl.end - sl.start,
                f"stage {sl.stage} is empty: [{sl.start}, {sl.end})",
            ))
        if sl.start < 0 or sl.end > num_layers:
            errors.append(MappingError(
                sl.stage, "partition", f"[0, {num_layers})", [sl.start, sl.end],
                f"stage {sl.stage} range [{sl.start}, {sl.end}) is outside the model's "
                f"{num_layers} layers",
            ))
        if sl.start > expected_next:
            errors.append(MappingError(
                None, "partition", expected_next, sl.start,
                f"gap: layers [{expected_next}, {sl.start}) belong to no stage "
                f"(stage {sl.stage} starts at {sl.start})",
            ))
        elif sl.start < expected_next:
            errors.append(MappingError(
                None, "partition", expected_next, sl.start,
                f"overlap: layers [{sl.start}, {min(expected_next, sl.end)}) are owned twice "
                f"(stage {sl.stage} starts at {sl.start})",
            ))
        expected_next = max(expected_next, sl.end)
    if expected_next < num_layers:
        errors.append(MappingError(
            None, "partition", num_layers, expected_next,
            f"gap: layers [{expected_next}, {num_layers}) belong to no stage",
        ))
    return errors
