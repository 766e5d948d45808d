"""Linear-attention / Mamba hybrids: a per-token attention KV cache on some layers, a per-request
recurrent state (conv + SSM) on the others.

sglang 0.5.23 gives these models two pools per PP stage, named ``attention`` (the plain or MLA
KV of ``HybridLinearKVPool`` over the stage's full-attention layers) and ``mamba`` (the
``MambaPool`` of ``HybridReqToTokenPool`` over its linear layers: per request *slot*, not per
token, plus sglang's padding slot).  Which layer is which comes from each architecture's own
config class, read the same way here (docs/families.md has the table); Qwen3-Next, Falcon-H1
and LFM2 are not split over PP (``Family.refuses_pp``).

Mamba budget (``stage_budget``): sglang charges every stage the state of the stage with the
*most* Mamba layers, so a stage with fewer strands the difference; the rest of the budget buys
attention tokens, and PP takes the MIN over stages (a stage without an attention layer would
otherwise size its empty pool without a bound).  Ids: each pool by the layer's position among
the stage's layers of its kind; HiCache signals by stage-local id (``transfer_ids``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from ...errors import ConfigError
from ..family import (
    UNBOUNDED_TOKENS,
    Family,
    FaultKind,
    LayerKind,
    StageBudget,
    later_stages,
    sized_globally,
)
from ..layer_map import IdSpace, LayerEntry, ModelLayout, StageLayerMap
from ..pool_kinds import KindTable, PoolKind, RequestState, TokenRows
from ..spec import MAX_DIM, MAX_HEADS, MAX_LAYERS, ConfigFields, ModelSpec, shown

if TYPE_CHECKING:
    from ...plan.plan import Sizing

#: Bytes per element: BF16 KV and conv state; the SSM state's dtype is the config's.
BF16 = 2
SSM_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The cache-less layer kinds (Nemotron-H's MLP and MoE layers).
ATTENTION, MAMBA, HYBRID, NONE = "attention", "mamba", "hybrid", "none"
#: sglang's mamba state slots per running request on CUDA (3, plus 2 for the extra buffer).
GIB = 1 << 30

StateKind = Literal["mamba2", "kda", "conv"]


@dataclass(frozen=True)
class LinearHybridSpec(ModelSpec):
    """What the caches of a linear-attention / Mamba hybrid need: each layer's kind, the attention
    row and the recurrent state's shape (sglang's ``Mamba2StateShape`` / ``KimiLinearStateShape``)."""

    architecture: str
    kinds: tuple[str, ...]  # one per layer: attention, mamba, hybrid, none
    attention_row_bytes: int  # one token of one attention layer (K + V, or the MLA latent)
    attention_layout: str  # "mha: 2 KV heads x (256 + 256)" / "mla: 512 + 64"
    conv_shape: tuple[int, int]  # one slot's conv state of one layer
    temporal_shape: tuple[int, int, int]  # one slot's SSM state of one layer
    ssm_dtype: str = "float32"
    state_kind: StateKind = "mamba2"
    pp_refusal: str | None = None

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return self.kinds

    @property
    def pp_refused(self) -> str | None:
        return self.pp_refusal

    @property
    def conv_bytes(self) -> int:
        return self.conv_shape[0] * self.conv_shape[1] * BF16

    @property
    def ssm_bytes(self) -> int:
        t = self.temporal_shape
        return t[0] * t[1] * t[2] * SSM_DTYPES[self.ssm_dtype]

    @property
    def state_slot_bytes(self) -> int:
        """One request slot of one Mamba layer: conv + SSM state."""
        return self.conv_bytes + self.ssm_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_layers": self.num_layers, "architecture": self.architecture,
                "layer_kinds": list(self.kinds), "attention_row_bytes": self.attention_row_bytes,
                "attention_layout": self.attention_layout, "conv_shape": list(self.conv_shape),
                "temporal_shape": list(self.temporal_shape), "ssm_dtype": self.ssm_dtype,
                "state_kind": self.state_kind}


class LinearHybridLayer(LayerEntry):
    """A layer of a linear hybrid: its kind, its ids in the stage's two pools, and the id HiCache
    signals its transfers with (``transfer_id``; readers wait on its local id)."""

    kind_field: ClassVar[str] = "layer_type"
    layer_type: Literal["attention", "mamba", "hybrid", "none"]
    attention_id: int | None = Field(description="index among the stage's attention layers; None otherwise")
    mamba_id: int | None = Field(description="index among the stage's Mamba layers; None otherwise")
    transfer_id: int | None = Field(
        description="the id HiCache signals this layer's transfers with (sglang: its stage-local id); "
                    "None: never signalled (no cache, or past the controller's bound)")

    def describe(self) -> str:
        return {"attention": "full attention", "mamba": "a Mamba / linear-attention state",
                "hybrid": "attention and a Mamba state", "none": "no cache (MLP / MoE)"}[self.layer_type]

    def transfer_ids(self) -> tuple[int | None, int | None] | None:
        if self.layer_type == NONE:
            return None
        return self.transfer_id, self.local

    @classmethod
    def make(cls, local: int, global_id: int, kind: str, ids: dict[str, int | None]) -> LinearHybridLayer:
        return cls.model_construct(local=local, global_id=global_id, layer_type=kind,
                                   attention_id=ids["attention_id"], mamba_id=ids["mamba_id"],
                                   transfer_id=None if kind == NONE else local)


ATTENTION_IDS = IdSpace("attention_id", frozenset({ATTENTION, HYBRID}), text="attention id")
MAMBA_IDS = IdSpace("mamba_id", frozenset({MAMBA, HYBRID}), text="Mamba id")

_POOL_KINDS = (
    PoolKind("attention", "attention KV", ATTENTION_IDS.owners, ATTENTION_IDS.name, "full", True,
             owners_text="attention", none_name="HybridLinearKVPool full_kv_pool"),
    PoolKind("mamba", "Mamba state", MAMBA_IDS.owners, MAMBA_IDS.name, "state", True,
             owners_text="Mamba", none_name="MambaPool"),
)
KINDS: dict[str, PoolKind] = {k.name: k for k in _POOL_KINDS}
POOLS: tuple[str, ...] = tuple(KINDS)


# -- config rules (sglang 0.5.23's config classes) -----------------------------------------------

QWEN35 = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5ForCausalLM",
          "Qwen3_5MoeForCausalLM")
QWEN3_NEXT = ("Qwen3NextForCausalLM",)
NEMOTRON_H = ("NemotronHForCausalLM",)
KIMI_LINEAR = ("KimiLinearForCausalLM",)
GRANITE = ("GraniteMoeHybridForCausalLM",)
FALCON_H1 = ("FalconH1ForCausalLM",)
LFM2 = ("Lfm2ForCausalLM",)
ARCHITECTURES = (*QWEN35, *QWEN3_NEXT, *NEMOTRON_H, *KIMI_LINEAR, *GRANITE, *FALCON_H1, *LFM2)
_NO_PP = "sglang 0.5.23 builds every layer of {arch} on one rank ({where}); run it with --pp-size 1"
PP_REFUSALS = {
    "Qwen3NextForCausalLM": _NO_PP.format(arch="Qwen3-Next", where="models/qwen3_next.py asserts one stage"),
    "FalconH1ForCausalLM": _NO_PP.format(arch="Falcon-H1", where="models/falcon_h1.py"),
    "Lfm2ForCausalLM": _NO_PP.format(arch="LFM2", where="models/lfm2.py"),
}
NEMOTRON_SYMBOLS = {"M": MAMBA, "*": ATTENTION, "-": NONE, "E": NONE}
GRANITE_TYPES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}
LFM2_TYPES = {"full_attention": ATTENTION, "conv": MAMBA, "short_conv": MAMBA}


def _arch(cfg: dict[str, Any]) -> str | None:
    for a in cfg.get("architectures") or ():
        if a in ARCHITECTURES:
            return a
    return None


def _ssm_dtype(f: ConfigFields, cfg: dict[str, Any]) -> str:
    value = cfg.get("mamba_ssm_dtype")
    if value is None:
        return "float32"
    if value not in SSM_DTYPES:  # sglang warns and keeps float32
        return "float32"
    return str(value)


def _layer_types(f: ConfigFields, layers: int, table: dict[str, str]) -> tuple[str, ...]:
    """``layer_types``: exactly one entry per layer, each a kind of ``table``."""
    types = f.cfg.get("layer_types")
    if not isinstance(types, list) or len(types) != layers:
        raise f.error(f"'layer_types' must list num_hidden_layers={layers} entries, got {shown(types)}")
    return tuple(f.kinds("layer_types", types, table))


def _mamba2(conv_dim: int, heads: int, head_dim: int, state: int, kernel: int
            ) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """``Mamba2StateShape.create`` at TP 1: conv ``(conv_dim, kernel - 1)``, SSM ``(heads, head_dim,
    state)``."""
    return (conv_dim, kernel - 1), (heads, head_dim, state)


def _state_fields(f: ConfigFields, heads: str, head_dim: str, groups: str, state: str, kernel: str
                  ) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """A Mamba2 state shape from the five required fields each architecture names its own way; the
    conv state is ``heads x head_dim + 2 x groups x state`` wide."""
    h, d = f.positive_int(heads, MAX_HEADS), f.positive_int(head_dim, MAX_DIM)
    g, s = f.positive_int(groups, MAX_HEADS), f.positive_int(state, MAX_DIM)
    return _mamba2(h * d + 2 * g * s, h, d, s, f.positive_int(kernel, 64))


def _mamba_fields(f: ConfigFields, inter: int, head_dim: Callable[[int], int]
                  ) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """The ``mamba_*`` fields GraniteMoeHybrid and Falcon-H1 share (with their configs' defaults) as
    sglang's state shape; ``head_dim`` of the head count is where the two differ."""
    heads = f.positive_int("mamba_n_heads", MAX_HEADS, 128)
    dim = head_dim(heads)
    state = f.positive_int("mamba_d_state", MAX_DIM, 256)
    groups = f.positive_int("mamba_n_groups", MAX_HEADS, 1)
    kernel = f.positive_int("mamba_d_conv", 64, 4)
    return _mamba2(inter + 2 * groups * state, heads, dim, state, kernel)


def _mha(f: ConfigFields, cfg: dict[str, Any], default_head_dim: int | None = None) -> tuple[int, str]:
    kv_heads = f.positive_int("num_key_value_heads", MAX_HEADS)
    if "head_dim" in cfg or default_head_dim is None:
        head_dim = f.positive_int("head_dim", MAX_DIM, default_head_dim)
    else:
        head_dim = default_head_dim
    return kv_heads * 2 * head_dim * BF16, f"mha: {kv_heads} KV heads x ({head_dim} + {head_dim})"


def _hidden_per_head(f: ConfigFields) -> int:
    hidden = f.positive_int("hidden_size", 1 << 20)
    heads = f.positive_int("num_attention_heads", MAX_HEADS)
    return hidden // heads


def _qwen(cfg: dict[str, Any], name: str, arch: str) -> LinearHybridSpec:
    text = cfg.get("text_config") if arch in QWEN35 else cfg
    if arch in QWEN35 and not isinstance(text, dict):
        raise ConfigError(f"model config {name!r}: {arch} keeps its fields in 'text_config', got "
                          f"{shown(text)}")
    f = ConfigFields(text, name)
    layers = f.positive_int("num_hidden_layers", MAX_LAYERS)
    interval = f.positive_int("full_attention_interval", MAX_LAYERS)
    kinds = tuple(ATTENTION if (i + 1) % interval == 0 else MAMBA for i in range(layers))
    row, layout = _mha(f, text)
    # GatedDeltaNet: the value heads are the state's heads, the key heads its groups
    conv, temporal = _state_fields(f, "linear_num_value_heads", "linear_value_head_dim", "linear_num_key_heads",
                                   "linear_key_head_dim", "linear_conv_kernel_dim")
    return LinearHybridSpec(name=name, num_layers=layers, architecture=arch, kinds=kinds,
                            attention_row_bytes=row, attention_layout=layout, conv_shape=conv,
                            temporal_shape=temporal, ssm_dtype=_ssm_dtype(f, text),
                            pp_refusal=PP_REFUSALS.get(arch))


def _nemotron(cfg: dict[str, Any], name: str, arch: str) -> LinearHybridSpec:
    f = ConfigFields(cfg, name)
    pattern = cfg.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not 0 < len(pattern) <= MAX_LAYERS:
        raise f.error(f"'hybrid_override_pattern' must be a non-empty string of at most {MAX_LAYERS} "
                      f"characters, got {shown(pattern)}")
    kinds = tuple(f.kinds("hybrid_override_pattern", pattern, NEMOTRON_SYMBOLS))
    row, layout = _mha(f, cfg, 128)  # NemotronHConfig: head_dim defaults to 128
    conv, temporal = _state_fields(f, "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                                   "conv_kernel")
    return LinearHybridSpec(name=name, num_layers=len(kinds), architecture=arch, kinds=kinds,
                            attention_row_bytes=row, attention_layout=layout, conv_shape=conv,
                            temporal_shape=temporal, ssm_dtype=_ssm_dtype(f, cfg))


def _kimi(cfg: dict[str, Any], name: str, arch: str) -> LinearHybridSpec:
    f = ConfigFields(cfg, name)
    layers = f.positive_int("num_hidden_layers", MAX_LAYERS)
    lin = cfg.get("linear_attn_config")
    if not isinstance(lin, dict):
        raise f.error(f"'linear_attn_config' must be an object, got {shown(lin)}")
    g = ConfigFields(lin, name)
    kda = lin.get("kda_layers")
    if not isinstance(kda, list):
        raise f.error(f"'linear_attn_config.kda_layers' must be a list, got {shown(kda)}")
    for i, v in enumerate(kda):  # linear time: a range check, not a membership test per entry
        if type(v) is not int or not 1 <= v <= layers:
            raise f.error(f"linear_attn_config.kda_layers[{i}] = {shown(v)} is not supported (supported: "
                          f"1-based layer numbers 1..{layers})")
    owned = set(kda)
    kinds = tuple(MAMBA if i + 1 in owned else ATTENTION for i in range(layers))
    rank = f.positive_int("kv_lora_rank", MAX_DIM)
    rope = f.positive_int("qk_rope_head_dim", MAX_DIM)
    heads = g.positive_int("num_heads", MAX_HEADS)
    head_dim = g.positive_int("head_dim", MAX_DIM)
    kernel = g.positive_int("short_conv_kernel_size", 64)
    proj = heads * head_dim
    # KimiLinearStateShape: conv (kernel - 1, q + k + v), SSM (heads, head_dim, head_dim)
    return LinearHybridSpec(name=name, num_layers=layers, architecture=arch, kinds=kinds,
                            attention_row_bytes=(rank + rope) * BF16, attention_layout=f"mla: {rank} + {rope}",
                            conv_shape=(kernel - 1, 3 * proj), temporal_shape=(heads, head_dim, head_dim),
                            state_kind="kda")


def _granite(cfg: dict[str, Any], name: str, arch: str) -> LinearHybridSpec:
    f = ConfigFields(cfg, name)
    layers = f.positive_int("num_hidden_layers", MAX_LAYERS)
    if cfg.get("layer_types") is None:
        kinds = tuple(ATTENTION if (i + 1) % 6 == 0 else MAMBA for i in range(layers))
    else:
        kinds = _layer_types(f, layers, GRANITE_TYPES)
    if MAMBA not in kinds:
        raise f.error("has no mamba layer: sglang 0.5.23 serves it as a plain attention model, not a hybrid")
    row, layout = _mha(f, cfg, _hidden_per_head(f))
    inter = f.positive_int("mamba_expand", 64, 2) * f.positive_int("hidden_size", 1 << 20)
    conv, temporal = _mamba_fields(f, inter, lambda heads: f.positive_int("mamba_d_head", MAX_DIM, inter // heads))
    return LinearHybridSpec(name=name, num_layers=layers, architecture=arch, kinds=kinds,
                            attention_row_bytes=row, attention_layout=layout, conv_shape=conv,
                            temporal_shape=temporal)


def _falcon(cfg: dict[str, Any], name: str, arch: str) -> LinearHybridSpec:
    f = ConfigFields(cfg, name)
    layers = f.positive_int("num_hidden_layers", MAX_LAYERS)
    row, layout = _mha(f, cfg, _hidden_per_head(f))
    hidden = f.positive_int("hidden_size", 1 << 20)
    d_ssm = cfg.get("mamba_d_ssm")
    inter = f.positive_int("mamba_d_ssm", 1 << 20) if d_ssm is not None else \
        f.positive_int("mamba_expand", 64, 2) * hidden
    conv, temporal = _mamba_fields(f, inter, lambda heads: inter // heads if cfg.get("mamba_d_head", "auto")
                                   == "auto" else f.positive_int("mamba_d_head", MAX_DIM))
    return LinearHybridSpec(name=name, num_layers=layers, architecture=arch, kinds=(HYBRID,) * layers,
                            attention_row_bytes=row, attention_layout=layout, conv_shape=conv,
                            temporal_shape=temporal, ssm_dtype=_ssm_dtype(f, cfg),
                            pp_refusal=PP_REFUSALS[arch])


def _lfm2(cfg: dict[str, Any], name: str, arch: str) -> LinearHybridSpec:
    f = ConfigFields(cfg, name)
    layers = f.positive_int("num_hidden_layers", MAX_LAYERS)
    kinds = _layer_types(f, layers, LFM2_TYPES)
    row, layout = _mha(f, cfg, _hidden_per_head(f))
    hidden = f.positive_int("hidden_size", 1 << 20)
    kernel = f.positive_int("conv_L_cache", 64)
    # conv-only state: Mamba2StateShape with n_groups 1, state 0 -> SSM (1, hidden, 0), no bytes
    return LinearHybridSpec(name=name, num_layers=layers, architecture=arch,
                            kinds=kinds, attention_row_bytes=row,
                            attention_layout=layout, conv_shape=(hidden, kernel - 1),
                            temporal_shape=(1, hidden, 0), ssm_dtype=_ssm_dtype(f, cfg), state_kind="conv",
                            pp_refusal=PP_REFUSALS[arch])


_READERS = {**dict.fromkeys((*QWEN35, *QWEN3_NEXT), _qwen), **dict.fromkeys(NEMOTRON_H, _nemotron),
            **dict.fromkeys(KIMI_LINEAR, _kimi), **dict.fromkeys(GRANITE, _granite),
            **dict.fromkeys(FALCON_H1, _falcon), **dict.fromkeys(LFM2, _lfm2)}


# -- faults -----------------------------------------------------------------------------------------

def _len_bound(spec: ModelSpec, stage_map: StageLayerMap) -> StageLayerMap:
    """#37870: the controller's transfer bound is ``len(keys)`` (the layers with a cache) instead of
    ``max(id) + 1``: a stage-local id at or past it is never signalled."""
    bound = sum(1 for e in stage_map.layers if e.kind != NONE)
    layers = [e.model_copy(update={"transfer_id": None}) if e.kind != NONE and e.local >= bound else e
              for e in stage_map.layers]
    return stage_map.with_layers(stage_map.start, stage_map.end, layers)


def _global_transfer_ids(kinds: frozenset[str], spec: ModelSpec, stage_map: StageLayerMap) -> StageLayerMap:
    """#38866: HiCache signals the Mamba layers of a later stage by their global id while the
    readers wait on the local one."""
    layers = [e.model_copy(update={"transfer_id": e.global_id}) if e.kind in kinds else e
              for e in stage_map.layers]
    return stage_map.with_layers(stage_map.start, stage_map.end, layers)


def _without_attention(stage_map: StageLayerMap) -> bool:
    return not any(KINDS["attention"].owns(e.kind) for e in stage_map.layers)


def _own_tokens(spec: ModelSpec, stage_map: StageLayerMap, tokens: int, page_size: int) -> int:
    """A stage without an attention layer sized by its own figure instead of the MIN over the PP
    ranks: 0 bytes per token fits sglang's ``int64`` max, so its token allocator, req-to-token
    sizing and HiCache host KV pool are built for that many tokens."""
    if _without_attention(stage_map):
        return UNBOUNDED_TOKENS // page_size * page_size
    return tokens


def _needs_stage_without_attention(layout: ModelLayout, stage: int | None) -> str | None:
    """``unbounded-stage`` changes only a stage without an attention layer: say so when none is hit."""
    bare = [s.stage for s in layout.stages if _without_attention(s)]
    if stage is not None and stage not in bare:
        s = layout.stages[stage]
        return (f"stage {stage} [{s.start}, {s.end}) holds an attention layer, so its own token figure "
                f"is bounded; stages without one: {', '.join(map(str, bare)) or 'none'}")
    if not bare:
        return ("every stage of this partition holds an attention layer, so none is sized without a "
                "bound; use a partition with a stage of Mamba layers only (nemotron-h-8b at --pp-size 8, "
                "or qwen3.5-0.8b --pp-size 4 --pp-partition 3,7,7,7)")
    return None


# -- the family -------------------------------------------------------------------------------------

class LinearHybrid(Family):
    name = "linear_hybrid"
    label = "Linear attention / Mamba hybrid"
    architectures = ARCHITECTURES
    entry = LinearHybridLayer
    layer_kinds = (LayerKind(ATTENTION, "full attention"), LayerKind(MAMBA, "Mamba / linear"),
                   LayerKind(HYBRID, "attention + Mamba"), LayerKind(NONE, "no cache (MLP/MoE)"))
    legend_title = "layer"
    id_spaces = (ATTENTION_IDS, MAMBA_IDS)
    pool_kinds = _POOL_KINDS
    host_size_reason = ("not modelled for linear-attention / Mamba hybrids (sglang splits a byte size "
                        "between the KV and Mamba host pools by their device bytes)")
    faults = (
        FaultKind("global-attention", "attention KV pool sized by the model's global attention layer "
                  "count", count=sized_globally("attention")),
        FaultKind("unsplit-mamba", "the Mamba pool holds every Mamba layer of the model on every stage "
                  "(sglang #21448)", count=sized_globally("mamba")),
        FaultKind("mamba-len-bound", "HiCache's transfer bound is the number of layers with a cache, not "
                  "the largest stage-local id + 1, so later ids are never signalled (sglang #37870)",
                  layer_map=_len_bound),
        FaultKind("mamba-transfer-ids", "a later stage's HiCache signals Mamba transfers by global layer "
                  "id while the readers wait on local ids (sglang #38866)", stages=later_stages,
                  layer_map=partial(_global_transfer_ids, frozenset({MAMBA, HYBRID}))),
        FaultKind("mamba-host-missing", "the Mamba state is left out of the HiCache host set: a load "
                  "brings back KV without its state", host_left_out=frozenset({"mamba"})),
        FaultKind("unbounded-stage", "a stage without an attention layer sizes its pools from its own "
                  "token figure (0 bytes per token: int64 max) instead of the MIN over the PP ranks",
                  tokens=_own_tokens, refused=_needs_stage_without_attention),
    )

    def spec_from_config(self, cfg: dict[str, Any], name: str) -> LinearHybridSpec:
        arch = _arch(cfg)
        if arch is None:
            raise ConfigError(f"model config {name!r}: not a linear-attention / Mamba hybrid")
        return _READERS[arch](cfg, name, arch)

    def kind_table(self, spec: LinearHybridSpec, page_size: int) -> KindTable:  # type: ignore[override]
        page_size = self.positive_page_size(page_size)
        kinds = {"attention": TokenRows(KINDS["attention"], spec.attention_row_bytes, page_size),
                 "mamba": RequestState(KINDS["mamba"], spec.state_slot_bytes, 1)}
        return KindTable(spec, page_size, kinds)

    def stage_problems(self, stage_map: StageLayerMap, page_size: int = 1) -> list[str]:
        if any(KINDS["attention"].owns(e.kind) for e in stage_map.layers):
            return []
        return ["holds no attention layer: sglang 0.5.23 builds its HiCache host KV pool with 0 bytes "
                "per token and the allocation fails (OSError: [Errno 22] Invalid argument); give every "
                "stage an attention layer (--pp-partition)"]

    def stage_budget(self, table: KindTable, counts: Mapping[str, int], budget_bytes: int,
                     sizing: Sizing) -> StageBudget | None:
        """sglang's ``_handle_max_mamba_cache`` then ``DefaultPoolConfigurator.calculate_pool_sizes``
        for one stage with ``budget_bytes`` of KV memory, in sglang's own float arithmetic."""
        spec: LinearHybridSpec = table.spec  # type: ignore[assignment]
        ranges = sizing.stage_ranges or ((0, spec.num_layers),)
        pp = len(ranges)
        mamba_layers = [i for i, k in enumerate(spec.kinds) if KINDS["mamba"].owns(k)]
        if pp > 1 and mamba_layers:
            most = max(sum(1 for i in mamba_layers if start <= i < end) for start, end in ranges)
        else:
            most = len(mamba_layers)
        per_req = spec.state_slot_bytes * len(mamba_layers)
        stage_per_req = int(per_req * (most / max(len(mamba_layers), 1)))
        rest = budget_bytes / GIB
        if sizing.max_mamba_cache_size is not None:
            slots = sizing.max_mamba_cache_size
        else:
            ratio = sizing.mamba_full_memory_ratio
            mamba_budget_bytes = rest * ratio / (1 + ratio) * GIB
            slots = int((mamba_budget_bytes - stage_per_req) // stage_per_req) if stage_per_req else 0
        if slots <= 0:
            raise ConfigError(f"memory budget {budget_bytes} B holds no Mamba state slot (sglang: 'Not "
                              f"enough GPU memory for hybrid (mamba/linear-attention) state cache'): one "
                              f"slot costs {stage_per_req} B")
        rest -= (slots + 1) * stage_per_req / GIB
        if rest <= 0:
            raise ConfigError(f"memory budget {budget_bytes} B: the Mamba state of {slots} slots leaves "
                              "nothing for attention KV")
        available = int(rest * GIB)
        cell = counts.get("attention", 0) * spec.attention_row_bytes
        page = table.page_size
        if cell:
            tokens = available // cell // page * page
        elif any(KINDS["attention"].owns(k) for k in spec.kinds) and pp > 1:
            tokens = UNBOUNDED_TOKENS  # no attention here: sized without a bound, the MIN bounds it
        else:
            tokens = sizing.max_total_tokens or 0
        tokens = tokens // page * page
        return StageBudget(units={"full": tokens // page, "state": slots},
                           charged_bytes={"state": (slots + 1) * stage_per_req},
                           note=f"Mamba state charged as {most} of {len(mamba_layers)} Mamba layers per stage")


FAMILY = LinearHybrid()
