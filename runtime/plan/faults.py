"""Known-bad ways to build a stage, reproduced on purpose so the checks can be seen to work.

``--fault global-swa`` is the bug stagecache exists for: the SWA pool sized by
the model's global layer count on every stage.  The others are mistakes of the
same family.  Each fault is a pure transform: of the stage layer maps
(``apply_layout_faults``: overlap, gap, compress ids) or of a stage's buffers
(``faulty_buffers``: pools sized globally, a None state).  ``plan.apply_faults``
composes them into a plan -> plan function, so ``check``, ``pools`` and ``serve``
(which allocates the faulty pools for real) all read one faulted plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..model.layer_map import ModelLayout, StageLayerMap, build_stage_map
from ..model.pool_kinds import KINDS

FAULTS: dict[str, str] = {
    "global-swa": "SWA KV pool sized by the model's global layer count (the original PP+HiCache bug)",
    "missing-c4-state": "a later stage's C4 compress-state pool holds None "
    "('state_pools must not contain None')",
    "global-c4": "C4 KV/state/indexer pools sized by the model's global ratio-4 layer count",
    "global-compress-ids": "compress ids counted over the whole model instead of inside the stage",
    "duplicate-compress-id": "two C128 layers of a stage share one compress id",
    "overlap": "stage 1 starts one layer early, so two stages own the same layer",
    "gap": "stage 1 starts one layer late, so a layer belongs to no stage",
    "radix-skew": "one stage's prefix cache (stage 1 unless @STAGE) loses the deepest page of "
    "every 4th request it caches, so its radix tree drifts from the other stages' "
    "(stage agreement: stagecache_stage_disagreements_total; serve only)",
    # host-tier faults: only `serve` acts on them (the stage's host tier, not its layer map)
    "pin-refused": "the stage asks for pinned host memory where it is refused (on a host without "
    "CUDA, torch's own refusal): its host tier falls back to pageable memory (serve only)",
    "host-ram-short": "after its first micro-batch the stage keeps all of the host's RAM in "
    "reserve, as when the host runs short during the run (serve only)",
}
#: Faults of the host tier, acted on by a serving stage.  ``radix-skew`` acts on a serving
#: stage's prefix cache (``serve.stage_cache``); every other fault shapes the pools.
HOST_TIER_FAULTS: frozenset[str] = frozenset({"pin-refused", "host-ram-short"})


@dataclass(frozen=True)
class Fault:
    name: str
    stage: int | None = None  # None: the stages the fault applies to by default

    def hits(self, stage: int, pp_size: int) -> bool:
        if self.stage is not None:
            return stage == self.stage
        if self.name == "missing-c4-state":  # the crash hit later stages
            return stage >= 1 or pp_size == 1
        if self.name == "radix-skew":  # one stage drifts: all of them would drift alike
            return stage == 1
        return True


def parse_faults(values: Iterable[str] | None, pp_size: int) -> tuple[Fault, ...]:
    """``["global-swa", "missing-c4-state@2"]`` -> Faults; unknown names are ConfigError."""
    faults = []
    for raw in values or ():
        name, _, stage_text = raw.partition("@")
        if name not in FAULTS:
            raise ConfigError(f"unknown --fault {name!r}; known faults: {', '.join(FAULTS)}")
        stage = None
        if stage_text:
            try:
                stage = int(stage_text)
            except ValueError:
                raise ConfigError(f"--fault {raw!r}: stage after '@' must be an integer") from None
            if not 0 <= stage < pp_size:
                raise ConfigError(f"--fault {raw!r}: stage {stage} out of range for pp_size {pp_size}")
        if name in ("overlap", "gap", "radix-skew") and pp_size < 2:
            raise ConfigError(f"--fault {name} needs --pp-size >= 2")
        faults.append(Fault(name, stage))
    return tuple(faults)


def apply_layout_faults(layout: ModelLayout, faults: Sequence[Fault]) -> ModelLayout:
    """Return the layout the faulty code would have computed (slices and compress ids)."""
    names = {f.name for f in faults}
    if not names & {"overlap", "gap", "global-compress-ids", "duplicate-compress-id"}:
        return layout
    spec = layout.spec
    stages = list(layout.stages)
    for f in faults:
        if f.name in ("overlap", "gap"):
            target = f.stage if f.stage not in (None, 0) else 1
            s = stages[target]
            start = s.start - 1 if f.name == "overlap" else min(s.start + 1, s.end)
            stages[target] = build_stage_map(spec, s.stage, start, s.end)
    for i, s in enumerate(stages):
        for f in faults:
            if not f.hits(s.stage, layout.pp_size):
                continue
            if f.name == "global-compress-ids":
                s = _global_compress_ids(spec.compress_ratios, s)
            elif f.name == "duplicate-compress-id":
                s = _duplicate_c128_id(s)
        stages[i] = s
    return dataclasses.replace(layout, stages=tuple(stages))


def _global_compress_ids(ratios: Sequence[int], s: StageLayerMap) -> StageLayerMap:
    layers = []
    for e in s.layers:
        if e.compress_ratio in (4, 128):
            gid = sum(1 for r in ratios[: e.global_id] if r == e.compress_ratio)
            e = dataclasses.replace(
                e, compress_layer_id=gid, c4_state_id=gid if e.compress_ratio == 4 else None
            )
        layers.append(e)
    return dataclasses.replace(s, layers=tuple(layers))


def _duplicate_c128_id(s: StageLayerMap) -> StageLayerMap:
    c128 = [e.local for e in s.layers if e.compress_ratio == 128]
    if len(c128) < 2:
        return s
    layers = list(s.layers)
    layers[c128[1]] = dataclasses.replace(layers[c128[1]], compress_layer_id=layers[c128[0]].compress_layer_id)
    return dataclasses.replace(s, layers=tuple(layers))


def faulty_buffers(
    stage_map: StageLayerMap, ratios: Sequence[int], faults: Sequence[Fault] = (), pp_size: int = 1
) -> dict[str, tuple[bool, ...]]:
    """Per pool, the buffers a constructor allocates (True) or leaves None (False).

    Without a fault hitting the stage this is one present buffer per owning layer.
    """
    mine = {f.name for f in faults if f.hits(stage_map.stage, pp_size)}
    buffers: dict[str, tuple[bool, ...]] = {}
    for pool, k in KINDS.items():
        count = len(stage_map.pool_layers(pool))
        if pool == "swa" and "global-swa" in mine:
            count = len(ratios)
        if k.owner_ratio == 4 and "global-c4" in mine:
            count = sum(1 for r in ratios if r == 4)
        present = [True] * count
        if pool == "c4_state" and "missing-c4-state" in mine and present:
            present[-1] = False
        buffers[pool] = tuple(present)
    return buffers


def fault_names(faults: Sequence[Fault]) -> list[str]:
    """The faults as typed on the command line (``NAME`` or ``NAME@STAGE``)."""
    return [f.name if f.stage is None else f"{f.name}@{f.stage}" for f in faults]
