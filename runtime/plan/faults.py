"""Known-bad ways to build a stage, reproduced on purpose so the checks can be seen to work.

A model family declares its own faults (``model/families/*``: ``--fault global-swa`` is the bug
stagecache exists for, DeepSeek V4's SWA pool sized by the model's global layer count); the
faults here apply to every family: a partition that overlaps or leaves a gap, and the faults a
serving stage acts on (its prefix cache, its host tier).  Each fault is a pure transform
(``model.family.FaultKind``): of the layout, of a stage's layer map, or of a stage's buffers.
``plan.apply_faults`` composes them into a plan -> plan function, so ``check``, ``pools`` and
``serve`` (which allocates the faulty pools for real) all read one faulted plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from ..errors import ConfigError
from ..model.families import all_fault_kinds
from ..model.family import Family, FaultKind, stage_one
from ..model.layer_map import ModelLayout, StageLayerMap, number_layers
from ..model.spec import ModelSpec


def _shift_start(step: int, layout: ModelLayout, stage: int | None) -> ModelLayout:
    """Stage ``stage`` (1 unless given) starts ``step`` layers late (negative: early)."""
    target = stage if stage not in (None, 0) else 1
    s = layout.stages[target]
    start = s.start + step if step < 0 else min(s.start + step, s.end)
    stages = list(layout.stages)
    stages[target] = number_layers(layout.spec, s.stage, start, s.end)
    return dataclasses.replace(layout, stages=tuple(stages))


#: Faults of every family.
GENERIC_FAULTS: tuple[FaultKind, ...] = (
    FaultKind("overlap", "stage 1 starts one layer early, so two stages own the same layer",
              min_pp=2, layout=partial(_shift_start, -1)),
    FaultKind("gap", "stage 1 starts one layer late, so a layer belongs to no stage",
              min_pp=2, layout=partial(_shift_start, 1)),
    FaultKind("radix-skew", "one stage's prefix cache (stage 1 unless @STAGE) loses the deepest page "
              "of every 4th request it caches, so its radix tree drifts from the other stages' (stage "
              "agreement: stagecache_stage_disagreements_total; serve only)",
              stages=stage_one, min_pp=2, scope="serve"),
    # host-tier faults: only `serve` acts on them (the stage's host tier, not its layer map)
    FaultKind("pin-refused", "the stage asks for pinned host memory where it is refused (on a host "
              "without CUDA, torch's own refusal): its host tier falls back to pageable memory "
              "(serve only)", scope="serve"),
    FaultKind("host-ram-short", "after its first micro-batch the stage keeps all of the host's RAM in "
              "reserve, as when the host runs short during the run (serve only)", scope="serve"),
)

#: Every fault any family or every family knows, by name (the CLI's ``--fault`` names), with its
#: one line of help.
FAULTS: dict[str, str] = {k.name: k.help for k in (*all_fault_kinds().values(), *GENERIC_FAULTS)}
#: Faults of the host tier, acted on by a serving stage.  ``radix-skew`` acts on a serving
#: stage's prefix cache (``serve.stage_cache``); every other fault shapes the pools.
HOST_TIER_FAULTS: frozenset[str] = frozenset({"pin-refused", "host-ram-short"})


@dataclass(frozen=True)
class Fault:
    """One fault of a run: its kind and the stage it was aimed at (None: its default stages)."""

    kind: FaultKind
    stage: int | None = None

    @property
    def name(self) -> str:
        return self.kind.name

    def hits(self, stage: int, pp_size: int) -> bool:
        return stage == self.stage if self.stage is not None else self.kind.stages(stage, pp_size)


def fault_kind(name: str, family: Family | None = None) -> FaultKind:
    """The fault named ``name`` (of ``family`` or of every family); ConfigError otherwise."""
    for k in GENERIC_FAULTS:
        if k.name == name:
            return k
    if name not in FAULTS:
        raise ConfigError(f"unknown --fault {name!r}; known faults: {', '.join(FAULTS)}")
    own = family.fault_kind(name) if family is not None else all_fault_kinds()[name]
    if own is None:
        theirs = [k.name for k in (*family.faults, *GENERIC_FAULTS)]
        raise ConfigError(f"--fault {name} is not a fault of {family.label} models; theirs: "
                          f"{', '.join(theirs)}")
    return own


def parse_faults(values: Iterable[str] | None, pp_size: int,
                 family: Family | None = None) -> tuple[Fault, ...]:
    """``["global-swa", "missing-c4-state@2"]`` -> Faults; unknown names are ConfigError."""
    faults = []
    for raw in values or ():
        name, _, stage_text = raw.partition("@")
        kind = fault_kind(name, family)
        stage = None
        if stage_text:
            try:
                stage = int(stage_text)
            except ValueError:
                raise ConfigError(f"--fault {raw!r}: stage after '@' must be an integer") from None
            if not 0 <= stage < pp_size:
                raise ConfigError(f"--fault {raw!r}: stage {stage} out of range for pp_size {pp_size}")
        if pp_size < kind.min_pp:
            raise ConfigError(f"--fault {name} needs --pp-size >= {kind.min_pp}")
        faults.append(Fault(kind, stage))
    return tuple(faults)


def apply_layout_faults(layout: ModelLayout, faults: Sequence[Fault]) -> ModelLayout:
    """Return the layout the faulty code would have computed: stage ranges, then each hit
    stage's ids."""
    for f in faults:
        if f.kind.layout is not None:
            layout = f.kind.layout(layout, f.stage)
    for f in faults:
        if f.kind.refused is not None and (why := f.kind.refused(layout, f.stage)) is not None:
            raise ConfigError(f"--fault {fault_names([f])[0]}: {why}")
    stages = list(layout.stages)
    for i, s in enumerate(stages):
        for f in faults:
            if f.kind.layer_map is not None and f.hits(s.stage, layout.pp_size):
                s = f.kind.layer_map(layout.spec, s)
        stages[i] = s
    return dataclasses.replace(layout, stages=tuple(stages))


def faulty_buffers(stage_map: StageLayerMap, spec: ModelSpec, faults: Sequence[Fault] = (),
                   pp_size: int = 1) -> dict[str, tuple[bool, ...]]:
    """Per pool, the buffers a constructor allocates (True) or leaves None (False).

    Without a fault hitting the stage this is one present buffer per owning layer.  Counts
    are decided before presence, so faults compose whatever their order.
    """
    mine = [f.kind for f in faults if f.hits(stage_map.stage, pp_size)]
    buffers: dict[str, tuple[bool, ...]] = {}
    for k in stage_map.kinds:
        count = len(stage_map.pool_layers(k.name))
        for fk in mine:
            if fk.count is not None:
                count = fk.count(spec, stage_map, k, count)
        present = [True] * count
        for fk in mine:
            if fk.present is not None:
                present = fk.present(k, present)
        buffers[k.name] = tuple(present)
    return buffers


def backup_left_out(faults: Sequence[Fault], stage: int, pp_size: int) -> frozenset[str]:
    """Pool kinds stage ``stage``'s HiCache backups leave out (``--fault backup-without-indexer``
    hitting it); empty: every mirrored kind."""
    return frozenset().union(*(f.kind.backup_left_out for f in faults if f.hits(stage, pp_size)))


def fault_names(faults: Sequence[Fault]) -> list[str]:
    """The faults as typed on the command line (``NAME`` or ``NAME@STAGE``)."""
    return [f.name if f.stage is None else f"{f.name}@{f.stage}" for f in faults]
