"""Startup validation: pure functions that return *every* mapping error.

Nothing here raises on a bad stage; callers decide (``check`` prints and exits
1, ``serve`` refuses to start serving and shows the errors on the dashboard, the
sglang hook refuses the stack build in strict mode).  The inventory checked is a
plan's (``StagePlan.inventory``: what a constructor will build) or real pools'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import MappingError
from ..model.layer_map import StageLayerMap
from ..model.partition import StageSlice
from ..model.pool_kinds import LOCAL, PoolKind
from ..plan.inventory import PoolInventory


def validate_stage(stage_map: StageLayerMap, inventory: PoolInventory) -> list[MappingError]:
    """All errors of one stage: buffer counts, None slots, layer ids and pool ids."""
    errors = _pool_errors(stage_map, inventory)
    s = stage_map.stage
    numbered = {k.id_space for k in stage_map.kinds if k.id_space != LOCAL}
    for e in stage_map.layers:
        if e.global_id != stage_map.start + e.local:
            errors.append(MappingError(
                s, "layer_map", stage_map.start + e.local, e.global_id,
                f"local layer {e.local} must map to global layer start+local="
                f"{stage_map.start + e.local}, got {e.global_id}",
            ))
        stray = [sp for sp in sorted(numbered) if e.id_in(sp) is not None
                 and not any(k.owns(e.kind) for k in stage_map.kinds if k.id_space == sp)]
        if stray:
            errors.append(MappingError(
                s, "layer_map", None, e.id_in(stray[0]),
                f"global layer {e.global_id} has {e.describe()} but an id in {', '.join(stray)}",
            ))
        problem = e.problem()
        if problem is not None:
            errors.append(MappingError(s, problem[0], None, e.global_id, problem[1]))
    # Each numbering once per owner set, checked against the first pool kind indexed by it (DeepSeek
    # V4: c4, c128, c4_state): the kinds sharing a numbering would only repeat the same error.
    checked: set[tuple[frozenset[str] | None, str]] = set()
    for k in stage_map.kinds:
        if k.id_space != LOCAL and (k.owners, k.id_space) not in checked:
            checked.add((k.owners, k.id_space))
            errors += _check_ids(stage_map, k, inventory)
    return errors + validate_transfer_ids(stage_map)


def validate_transfer_ids(stage_map: StageLayerMap) -> list[MappingError]:
    """One error per pool kind whose layers' HiCache transfers signal completion with an id the
    pool does not wait on (sglang #38866: the two in different id spaces); nothing for a family
    without transfer ids (``LayerEntry.transfer_ids``)."""
    errors: list[MappingError] = []
    for k in stage_map.kinds:
        if not k.host_cached:
            continue
        wrong = [(e, ids) for e in stage_map.pool_layers(k.name)
                 if (ids := e.transfer_ids()) is not None and ids[0] != ids[1]]
        if wrong:
            e, (signalled, awaited) = wrong[0]
            errors.append(MappingError(
                stage_map.stage, k.name, awaited, signalled,
                f"{k.label}: HiCache signals global layer {e.global_id}'s transfer as id {signalled} "
                f"but the pool waits on id {awaited} ({len(wrong)} of the stage's "
                f"{len(stage_map.pool_layers(k.name))} layers)"))
    return errors


def _pool_errors(stage_map: StageLayerMap, inventory: PoolInventory) -> list[MappingError]:
    """Per pool kind: missing, a wrong buffer count, None buffers."""
    s = stage_map.stage
    errors: list[MappingError] = []
    for k, want in zip(stage_map.kinds, stage_map.expected_buffers().values(), strict=True):
        slots = inventory.buffers.get(k.name)
        if slots is None:
            if want:
                errors.append(MappingError(
                    s, k.name, want, None, f"{k.label} pool is missing: {want} local layers need it",
                ))
            continue
        if len(slots) != want:
            layers = ""
            if k.name_layers:
                ids = [e.global_id for e in stage_map.pool_layers(k.name)]
                layers = f"its layers {_ranges(ids)}" if ids else "no layer of the stage"
            errors.append(MappingError(s, k.name, want, len(slots), k.wrong_count(len(slots), want, layers)))
        empty = [i for i, present in enumerate(slots) if not present]
        if empty:
            errors.append(MappingError(s, k.name, "no None buffers", f"None at {empty}", k.holds_none(empty)))
    return errors


def _ranges(ids: Sequence[int]) -> str:
    """Global layer ids as a short list: ``1, 3, 5`` (at most 8 shown)."""
    shown = ", ".join(map(str, ids[:8]))
    return shown + (f", ... ({len(ids)} layers)" if len(ids) > 8 else "")


def _check_ids(stage_map: StageLayerMap, kind: PoolKind, inventory: PoolInventory) -> list[MappingError]:
    """Ids of one pool must be unique and inside the pool's buffer range."""
    s = stage_map.stage
    attr = kind.id_space
    size = len(inventory.buffers.get(kind.name, ()))
    errors: list[MappingError] = []
    seen: dict[int, int] = {}
    for e in stage_map.pool_layers(kind.name):
        cid = e.id_in(attr)
        if cid is None:
            errors.append(MappingError(
                s, kind.name, "an id", None, f"global layer {e.global_id} ({e.describe()}) has no {attr}",
            ))
            continue
        if not 0 <= cid < size:
            errors.append(MappingError(
                s, kind.name, f"0..{size - 1}" if size else "no ids (empty pool)", cid,
                f"global layer {e.global_id}: {attr} {cid} is out of range for the stage's "
                f"{size} {kind.label} buffers",
            ))
        if cid in seen:
            errors.append(MappingError(
                s, kind.name, "unique ids", cid,
                f"global layers {seen[cid]} and {e.global_id} share {attr} {cid}",
            ))
        else:
            seen[cid] = e.global_id
    return errors


def validate_host(stage_map: StageLayerMap, inventory: PoolInventory,
                  host_buffers: Mapping[str, int]) -> list[MappingError]:
    """Per host-cached kind, the HiCache host set must hold one buffer per present device buffer
    (sglang #38031: the DSA indexer left out, so a load-back leaves it stale); one error per pool.
    A kind ``host_buffers`` does not name is not known (a live pool that reports no host side)."""
    errors: list[MappingError] = []
    for k in stage_map.kinds:
        if not k.host_cached or k.name not in host_buffers:
            continue
        device = sum(inventory.buffers.get(k.name, ()))
        got = host_buffers[k.name]
        if device and got != device:
            layers = [e.global_id for e in stage_map.pool_layers(k.name)]
            shown = ", ".join(map(str, layers[:6])) + (", ..." if len(layers) > 6 else "")
            errors.append(MappingError(
                stage_map.stage, k.name, device, got,
                f"stage {stage_map.stage}: {k.label} pool is missing from the HiCache host set: "
                f"{got} host buffers for {device} device buffers (layers {shown}); a load-back "
                "leaves those layers' device pages stale",
            ))
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
