"""A model family: everything stagecache knows about one kind of hybrid KV cache, in one object.

A family says, from a Hugging Face ``config.json``, which cache kind each layer has
(``spec_from_config`` -> ``ModelSpec.layer_kinds``), which pool kinds a stage builds and how
each is sized (``pool_kinds``, ``kind_table``) and indexed (``id_spaces``, ``entry``), the
sglang budget floor of its SWA pools, its own known-bad builds (``faults``), and the words
and legend an operator sees.  Everything else -- the plan, validation, memory, transfers,
exporters, dashboard -- is generic over families and asks the family through the spec
(``spec.family``).  Each family is one module of ``model/families`` (docs/architecture.md:
adding a family).

Faults are data here too (``FaultKind``): pure transforms of a layout, a stage's layer map,
or its buffer list, built from the few helpers below, so a family states its bugs in a line
each and the plan (``plan/faults.py``) applies them to every family alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from ..errors import ConfigError
from .layer_map import IdSpace, LayerEntry, ModelLayout, StageLayerMap
from .pool_kinds import KindTable, PoolKind
from .spec import ModelSpec

if TYPE_CHECKING:
    from ..plan.plan import Sizing


@dataclass(frozen=True)
class LayerKind:
    """A kind of layer of a family (its cache kind): its name and how the legend shows it."""

    name: str
    text: str  # legend and messages: "ratio 4", "Mamba"


# -- faults ---------------------------------------------------------------------------------------


#: sglang's token capacity of a stage whose pools cost 0 bytes per token (a Mamba-hybrid stage
#: without an attention layer): ``int64`` max, which only the PP ranks' MIN all-reduce bounds.
UNBOUNDED_TOKENS = (1 << 63) - 1


def is_unbounded(tokens: int) -> bool:
    """A token count no memory bounds (``UNBOUNDED_TOKENS``, floored to pages or not)."""
    return tokens >= 1 << 62


def every_stage(stage: int, pp_size: int) -> bool:
    return True


def later_stages(stage: int, pp_size: int) -> bool:
    """Stages after the first (the only stage of a pp 1 run): where start-up crashes hit."""
    return stage >= 1 or pp_size == 1


def stage_one(stage: int, pp_size: int) -> bool:
    return stage == 1


@dataclass(frozen=True)
class FaultKind:
    """A known-bad way to build a stage, as pure transforms (each optional):

    * ``layout``: the whole layout (another stage's range), given the fault's explicit stage;
    * ``layer_map``: one hit stage's layer map (its ids);
    * ``count``: the buffers a hit stage's constructor makes for one pool kind;
    * ``present``: which of those buffers hold a tensor (``False``: left None);
    * ``tokens``: the full tokens a hit stage sizes its pools by, given the deployment's (the
      MIN over stages) and the page size -- a stage that sizes itself alone.

    ``refused``: why the fault cannot hit a layout (None: it can), given the layout and the
    fault's explicit stage; ``check`` says so in one line (exit 2) rather than pass a fault that
    changed nothing.

    Every callable is a module-level function or a ``partial`` of one, so a plan holding its
    faults pickles to the stage processes.  ``scope="serve"``: only a serving stage acts on it
    (its prefix cache or host tier), the plan's pools are left as they are.
    """

    name: str
    help: str
    stages: Callable[[int, int], bool] = every_stage
    min_pp: int = 1
    scope: Literal["pools", "serve"] = "pools"
    layout: Callable[[ModelLayout, int | None], ModelLayout] | None = None
    layer_map: Callable[[ModelSpec, StageLayerMap], StageLayerMap] | None = None
    count: Callable[[ModelSpec, StageLayerMap, PoolKind, int], int] | None = None
    present: Callable[[PoolKind, list[bool]], list[bool]] | None = None
    #: pool kinds a hit stage leaves out of its HiCache host set (sglang #38031)
    host_left_out: frozenset[str] = frozenset()
    #: pool kinds a hit stage's HiCache backups leave out while its host set holds them (sglang
    #: #38031's pages): start-up validation cannot see it, the live transfer check flags it
    backup_left_out: frozenset[str] = frozenset()
    tokens: Callable[[ModelSpec, StageLayerMap, int, int], int] | None = None
    refused: Callable[[ModelLayout, int | None], str | None] | None = None


#: The one fault name and help of a stage whose backups skip its indexer kinds (each family that
#: has an indexer names its kinds: ``backup_without_indexer``).
BACKUP_WITHOUT_INDEXER = "backup-without-indexer"


def backup_without_indexer(*kinds: str) -> FaultKind:
    """The stage's HiCache backups leave ``kinds`` (the family's indexer kinds) out while its host
    set mirrors them: pages come back without their index keys (sglang #38031).  Live only: a
    serving stage (``serve``, the sglang plugin's ``STAGECACHE_FAULT``) acts on it."""
    return FaultKind(BACKUP_WITHOUT_INDEXER, "the stage's HiCache backups leave the indexer kind(s) out "
                     "while its host set holds them (sglang #38031's pages); start-up validation passes, "
                     "the live transfer check flags the first incomplete page (live only: serve and the "
                     "sglang plugin's STAGECACHE_FAULT)", scope="serve", backup_left_out=frozenset(kinds))


@dataclass(frozen=True)
class StageBudget:
    """How sglang turns one stage's memory budget into units of each pool budget.

    ``units``: budget name (``full``, ``swa``, ...) -> pages (rows, slots) the stage's budget
    fits alone; ``full`` is what the PP ranks MIN-all-reduce.  ``charged_bytes``: bytes sglang
    charges the stage per budget beyond its own pools."""

    units: Mapping[str, int]
    charged_bytes: Mapping[str, int] = field(default_factory=dict)
    note: str = ""


def _sized_globally(pools: frozenset[str], spec: ModelSpec, stage_map: StageLayerMap, kind: PoolKind,
                    count: int) -> int:
    if kind.name not in pools:
        return count
    return sum(1 for k in spec.layer_kinds if kind.owns(k))


def sized_globally(*pools: str) -> Callable[..., int]:
    """``pools`` get one buffer per layer of their kind in the *whole model* (the PP bug)."""
    return partial(_sized_globally, frozenset(pools))


def _last_none(pools: frozenset[str], kind: PoolKind, present: list[bool]) -> list[bool]:
    if kind.name in pools and present:
        present[-1] = False
    return present


def last_buffer_none(*pools: str) -> Callable[..., list[bool]]:
    """The last buffer of ``pools`` is left None."""
    return partial(_last_none, frozenset(pools))


def _global_ids(spaces: tuple[IdSpace, ...], spec: ModelSpec, stage_map: StageLayerMap) -> StageLayerMap:
    kinds = spec.layer_kinds
    layers = []
    for e in stage_map.layers:
        update: dict[str, Any] = {}
        for space in spaces:
            if e.kind in space.owners:
                counted = {e.kind} if space.per_kind else space.owners
                update[space.name] = sum(1 for k in kinds[: e.global_id] if k in counted)
        layers.append(e.model_copy(update=update) if update else e)
    return stage_map.with_layers(stage_map.start, stage_map.end, layers)


def ids_counted_globally(*spaces: IdSpace) -> Callable[..., StageLayerMap]:
    """The ids of ``spaces`` count the layers of the whole model instead of the stage's."""
    return partial(_global_ids, tuple(spaces))


def _duplicate(kind: str, space: str, spec: ModelSpec, stage_map: StageLayerMap) -> StageLayerMap:
    owned = [e.local for e in stage_map.layers if e.kind == kind]
    if len(owned) < 2:
        return stage_map
    layers = list(stage_map.layers)
    first = layers[owned[0]].id_in(space)
    layers[owned[1]] = layers[owned[1]].model_copy(update={space: first})
    return stage_map.with_layers(stage_map.start, stage_map.end, layers)


def duplicate_id(kind: str, space: str) -> Callable[..., StageLayerMap]:
    """The second ``kind`` layer of a stage takes the first one's id in ``space``."""
    return partial(_duplicate, kind, space)


# -- the family --------------------------------------------------------------------------------


class Family:
    """One model family (see the module docstring); each module of ``model/families`` makes one.

    Class attributes are the family's data; the methods its rules.
    """

    name: str  # "deepseek_v4": the ``family`` field of reports and records
    label: str  # "DeepSeek V4"
    architectures: tuple[str, ...]  # the config.json ``architectures`` it reads
    entry: type[LayerEntry]  # its layer entries
    layer_kinds: tuple[LayerKind, ...]  # legend order
    legend_title: str = "attention"  # the layer map's colour bar title
    id_spaces: tuple[IdSpace, ...] = ()  # numberings besides the local id
    pool_kinds: tuple[PoolKind, ...]  # display order
    kv_dtype: str = "bf16"  # what sglang stores its KV as (part of a deployment's fingerprint)
    faults: tuple[FaultKind, ...] = ()
    #: why sglang refuses a host size in bytes (``--hicache-size``) for the family, where it does
    host_size_reason: str | None = None
    #: sglang's default SWA tokens / full tokens (``--swa-full-tokens-ratio``) for the family
    swa_full_tokens_ratio: float = 1.0

    def matches(self, cfg: dict[str, Any]) -> bool:
        """Whether ``cfg`` (a parsed config.json) is a model of this family: by default, any of
        its ``architectures`` is one of the family's."""
        return any(a in self.architectures for a in cfg.get("architectures") or ())

    def first_architecture_listed(self, cfg: dict[str, Any]) -> bool:
        """sglang's rule for MHA, MLA and DSA: the config's *first* architecture is the family's."""
        arch = cfg.get("architectures") or ()
        return isinstance(arch, list) and bool(arch) and arch[0] in self.architectures

    def spec_from_config(self, cfg: dict[str, Any], name: str) -> ModelSpec:
        """Validate a parsed config.json and build this family's spec."""
        raise NotImplementedError

    def kind_table(self, spec: ModelSpec, page_size: int) -> KindTable:
        """Every pool kind sized for ``spec`` at ``page_size`` (the page size is checked here)."""
        raise NotImplementedError

    @staticmethod
    def positive_page_size(page_size: object) -> int:
        """Any positive page size (a family with a stricter rule checks it after this)."""
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ConfigError(f"--page-size must be a positive integer, got {page_size!r}")
        return page_size

    def with_kv_cache_dtype(self, spec: ModelSpec, dtype: str) -> ModelSpec:
        """``spec`` with sglang's ``--kv-cache-dtype``; ``auto`` keeps the family's dtype, and a
        family that models no other refuses the rest in one line."""
        if dtype == "auto":
            return spec
        raise ConfigError(f"--kv-cache-dtype {dtype}: not modelled for {self.label} models "
                          f"(their KV cache is {self.kv_dtype}); use auto")

    def sglang_page_size(self, requested: int) -> int:
        """The page size sglang 0.5.23 really uses for this family when asked for ``requested``
        (``pools`` and the plan take it, with a one-line note when it overrides ``--page-size``)."""
        return requested

    def stage_problems(self, stage_map: StageLayerMap, page_size: int = 1) -> list[str]:
        """What sglang 0.5.23 itself does wrong with this (legal) stage, one line each -- an
        assertion it hits, a host pool it cannot allocate -- so ``check`` names it before any
        server starts.  None by default."""
        return []

    def refuses_pp(self, spec: ModelSpec) -> str | None:
        """One line when sglang 0.5.23 does not split this model over PP stages (None: it does)."""
        return spec.pp_refused

    def stage_budget(self, table: KindTable, counts: Mapping[str, int], budget_bytes: int,
                     sizing: Sizing) -> StageBudget | None:
        """How sglang sizes one stage with ``counts`` buffers per pool kind from
        ``budget_bytes``; None: the DeepSeek V4 rule (``plan.sizing``)."""
        return None

    def stage_units(self, counts: Mapping[str, int], full_tokens: int, page_size: int) -> Mapping[str, int] | None:
        """Units per budget of one stage where sglang sizes that stage unlike the others, given
        the deployment's (MIN-reduced) token count; None: the deployment's budget."""
        return None

    def swa_floor_tokens(self, spec: ModelSpec) -> int:
        """Tokens an SWA pool must hold beyond one page to admit one request (sglang's
        ``validate_swa_pool_size``): the sliding window, 0 for a family without SWA pools."""
        return 0

    def host_size_refusal(self) -> str:
        """The one line ``--hicache-size`` gets: stagecache sizes host pools by ratio only, and
        says why where sglang itself refuses a byte size (``host_size_reason``)."""
        why = self.host_size_reason or f"not modelled for {self.label} models"
        return f"--hicache-size: {why}; size the host pools with --hicache-ratio"

    def fault_kind(self, name: str) -> FaultKind | None:
        return next((f for f in self.faults if f.name == name), None)
