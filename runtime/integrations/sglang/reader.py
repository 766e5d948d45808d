"""Read a live sglang ``DeepSeekV4TokenToKVPool`` into stagecache's types and validate it.

The pool's ``start_layer``/``end_layer``, ``layer_mapping``, SWA / C4 / C128 /
indexer buffers and compress-state pools are read once (``read_pool``) into a
``StageLayerMap``, a ``PoolInventory`` and measured bytes, and become the stage's
``StageRecord`` (``PoolView.record``), checked by the same code as ``stagecache check``
(``validation.deployment``), so an operator sees every mapping error of a stage at
start-up instead of sglang's first ``ValueError``.

A real pool carries the model config's ``compress_ratios`` as is: DeepSeek-V4
lists one ratio per layer *plus* one placeholder per MTP layer (44 entries for
flash's 43 layers).  The model's layer count therefore comes from the caller,
from sglang's own model config in this process, or from the pools' layer ranges
(the candidate ``len(ratios) - 1`` or ``len(ratios)`` that sglang's
``get_pp_indices`` agrees with); it is never ``len(compression_ratios)`` blindly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sglang.srt.distributed.utils import get_pp_indices

from ...errors import ConfigError, MappingError
from ...model.families.deepseek_v4 import FAMILY, SUPPORTED_RATIOS, DeepSeekV4Layer, DeepSeekV4Spec
from ...model.layer_map import StageLayerMap, number_layers
from ...model.partition import parse_partition, partition_layers
from ...model.spec import ModelSpec
from ...plan.fingerprint import Fingerprint, config_hash
from ...plan.inventory import PoolInventory
from ...plan.plan import plan_stage
from ...validation.deployment import deployment_report
from ...validation.record import StageRecord, stage_record
from ...validation.report import StartupReport

#: The env var sglang's ``get_pp_indices`` reads for an explicit partition.
PARTITION_ENV = "SGLANG_PP_LAYER_PARTITION"


@dataclass(frozen=True)
class PoolView:
    """Everything stagecache reads from one live pool (``read_pool``, ``read_family_pool``), read once."""

    spec: ModelSpec  # DeepSeekV4Spec for a DeepSeekV4TokenToKVPool; the family's spec otherwise
    stage_map: StageLayerMap
    inventory: PoolInventory
    pool_bytes: dict[str, int]  # device bytes per stagecache pool kind
    findings: tuple[MappingError, ...]  # problems the generic validation cannot see
    page_size: int
    kv_dtype: str

    def record(self, *, pp_size: int, tp_size: int = 1, model_name: str = "sglang",
               capacity: tuple[int, int] | None = None, host_pages: dict[str, int] | None = None,
               pool_tokens: int = 0) -> StageRecord:
        """The stage's record, as every rank of the deployment exchanges it."""
        import sglang

        try:
            partition = tuple(end - start for start, end in sglang_partition(self.spec.num_layers, pp_size))
        except ValueError:  # an explicit partition get_pp_indices refuses: the tiling check names it
            partition = ()
        fp = Fingerprint(model_name, config_hash(self.spec), self.kv_dtype, self.page_size, pp_size,
                         tp_size, partition)
        plan = plan_stage(self.spec, self.stage_map, page_size=self.page_size,
                          buffers=dict(self.inventory.buffers))
        return stage_record(
            plan, inventory=self.inventory, device_bytes=self.pool_bytes, host_buffers={}, host_bytes={},
            findings=self.findings, engine=f"sglang {getattr(sglang, '__version__', 'unknown')}",
            capacity=capacity, host_pages=host_pages, pool_tokens=pool_tokens, fingerprint=fp,
            model=model_name)


# -- the model's layer count --------------------------------------------------------------------
def _pp_range(num_layers: int, rank: int, pp_size: int) -> tuple[int, int] | None:
    try:
        return tuple(get_pp_indices(num_layers, rank, pp_size))
    except ValueError:  # an explicit partition that does not sum to num_layers
        return None


def _sglang_num_layers() -> int | None:
    """``num_hidden_layers`` of the model config sglang built in this process, if it did."""
    try:
        from sglang.srt.runtime_context import get_server_args

        config = getattr(get_server_args(), "_model_config", None)
        return int(config.hf_config.num_hidden_layers) if config is not None else None
    except Exception:  # no published server args, or no model config on them
        return None


def model_num_layers(kvcaches: Sequence[Any], pp_size: int, num_layers: int | None = None) -> int:
    """The model's PP layer count for these pools (see the module docstring)."""
    if num_layers is None:
        num_layers = _sglang_num_layers()
    n_ratios = len(kvcaches[0].compression_ratios)
    ranges = {(int(kv.start_layer), int(kv.end_layer)) for kv in kvcaches}
    if num_layers is not None:
        if not max(e for _, e in ranges) <= num_layers <= n_ratios:
            raise ConfigError(
                f"sglang pool: {num_layers} model layers do not fit its {n_ratios} compression_ratios "
                f"and layer ranges {sorted(ranges)}"
            )
        return num_layers
    for n in (n_ratios - 1, n_ratios):  # the MTP placeholder first: DeepSeek-V4 configs carry one
        if n < max(e for _, e in ranges):
            continue
        sglang_ranges = {_pp_range(n, r, pp_size) for r in range(pp_size)}
        if ranges <= sglang_ranges:
            return n
    shown = ", ".join(f"[{a}, {b})" for a, b in sorted(ranges))
    raise ConfigError(
        f"pool with layers {shown} matches no rank of get_pp_indices for pp_size={pp_size} "
        f"(with {n_ratios - 1} or {n_ratios} model layers); pass num_layers=... or pp_rank=..."
    )


# -- one pool --------------------------------------------------------------------------------------
def spec_from_pool(kvcache: Any, num_layers: int, name: str = "sglang") -> DeepSeekV4Spec:
    """The model spec a pool was built for; ratios sglang has but stagecache lacks are ConfigError."""
    ratios = tuple(int(r) for r in kvcache.compression_ratios)
    for i, r in enumerate(ratios):
        if r not in SUPPORTED_RATIOS:
            raise ConfigError(
                f"sglang pool: compression_ratios[{i}] = {r} is not supported by stagecache "
                f"(supported: {', '.join(map(str, SUPPORTED_RATIOS))}); DeepSeek-V4.1 low ratios "
                "1/2 are not modelled"
            )
    return DeepSeekV4Spec(
        name=name,
        num_layers=num_layers,
        compress_ratios=ratios[:num_layers],
        sliding_window=int(kvcache.sliding_window),
        head_dim=int(kvcache.qk_nope_head_dim) + int(kvcache.qk_rope_head_dim),
        qk_rope_head_dim=int(kvcache.qk_rope_head_dim),
        index_head_dim=int(kvcache.indexer_head_dim),
        num_nextn_predict_layers=len(ratios) - num_layers,
    )


def stage_map_from_pool(kvcache: Any, stage: int, num_layers: int) -> tuple[StageLayerMap, list[MappingError]]:
    """The stage map the pool *really* uses (from its ``layer_mapping``), plus holes found.

    ``c4_state_id`` is the position among the stage's C4 layers -- what sglang's
    assembler uses (``_resolve_deepseek_v4_layer_mappings``: ``c4_state``).
    """
    start, end = int(kvcache.start_layer), int(kvcache.end_layer)
    ratios = list(kvcache.compression_ratios)
    mapping = list(kvcache.layer_mapping)
    errors: list[MappingError] = []
    entries = []
    c4_seen = 0
    for local, global_id in enumerate(range(start, end)):
        item = mapping[global_id] if global_id < len(mapping) else None
        ratio, cid = int(ratios[global_id]), None
        if item is None:
            errors.append(MappingError(
                stage, "layer_map", f"a layer_mapping item for global layer {global_id}", None,
                f"layer_mapping[{global_id}] is None although the stage owns layers [{start}, {end})",
            ))
        else:
            cid = int(item.compress_layer_id)
            if int(item.compress_ratio) != ratio:
                errors.append(MappingError(
                    stage, "layer_map", ratio, int(item.compress_ratio),
                    f"layer_mapping[{global_id}].compress_ratio disagrees with compression_ratios[{global_id}]",
                ))
        c4_state_id = c4_seen if ratio == 4 else None
        c4_seen += ratio == 4
        entries.append(DeepSeekV4Layer(local=local, global_id=global_id, compress_ratio=ratio,
                                       compress_layer_id=cid if ratio in (4, 128) else None,
                                       c4_state_id=c4_state_id))
    return StageLayerMap(stage=stage, start=start, end=end, layers=tuple(entries),
                         kinds=FAMILY.pool_kinds), errors


def _buffers(pool: Any, attr: str) -> list | None:
    bufs = getattr(pool, attr, None) if pool is not None else None
    return None if bufs is None else list(bufs)


def _nbytes(obj: Any) -> int:
    if obj is None:
        return 0
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    inner = getattr(obj, "kv_score_buffer", None)  # CompressStatePool -> KVAndScore
    return int(inner.kv_score.nbytes) if inner is not None else 0


def pool_buffers(kvcache: Any, stage_map: StageLayerMap) -> dict[str, list | None]:
    """Per stagecache pool kind, the pool's buffer list -- the lists the HiCache assembler reads.

    Compress states are the assembler's ``state_pools``: one entry per stage layer of
    that ratio, taken by global id from ``compress_state_pools`` /
    ``indexer_compress_state_pools`` (None where sglang has none).
    """
    if getattr(kvcache, "_unified_kv", False) or kvcache.swa_kv_pool is None:
        raise ConfigError(
            f"stage {stage_map.stage}: this DeepSeekV4TokenToKVPool keeps SWA in a unified or "
            "per-request window (no paged swa_kv_pool); stagecache inspects paged pools only"
        )
    indexer = getattr(kvcache, "c4_indexer_kv_pool", None)
    index_bufs = _buffers(indexer, "index_k_with_scale_buffer")
    if index_bufs is None and indexer is not None:
        index_bufs = _buffers(indexer, "index_k_payload_buffer")

    def states(attr: str, ratio: int) -> list:
        pool_states = list(getattr(kvcache, attr, None) or [])
        return [pool_states[e.global_id] if e.global_id < len(pool_states) else None
                for e in stage_map.layers if e.compress_ratio == ratio]

    return {
        "swa": _buffers(kvcache.swa_kv_pool, "kv_buffer"),
        "c4": _buffers(getattr(kvcache, "c4_kv_pool", None), "kv_buffer"),
        "c128": _buffers(getattr(kvcache, "c128_kv_pool", None), "kv_buffer"),
        "c4_state": states("compress_state_pools", 4),
        "c128_state": states("compress_state_pools", 128),
        "indexer": index_bufs,
        "c4_indexer_state": states("indexer_compress_state_pools", 4),
    }


def pp_rank_of(kvcache: Any, pp_size: int, num_layers: int) -> int | None:
    """The PP rank whose ``get_pp_indices`` range is the pool's ``[start_layer, end_layer)``."""
    want = (int(kvcache.start_layer), int(kvcache.end_layer))
    return next((r for r in range(pp_size) if _pp_range(num_layers, r, pp_size) == want), None)


def read_pool(kvcache: Any, pp_rank: int, num_layers: int, name: str = "sglang",
              page_size: int | None = None) -> PoolView:
    """Read one pool into stagecache's types; also diff its map against stagecache's own."""
    spec = spec_from_pool(kvcache, num_layers, name)
    stage_map, findings = stage_map_from_pool(kvcache, pp_rank, num_layers)
    buffers = pool_buffers(kvcache, stage_map)
    inventory = PoolInventory.from_buffers(pp_rank, buffers)
    nbytes = {pool: sum(_nbytes(b) for b in (buffers.get(pool) or ())) for pool in stage_map.pools}
    if 0 <= stage_map.start <= stage_map.end <= spec.num_layers:
        expected = number_layers(spec, pp_rank, stage_map.start, stage_map.end)
        findings += [
            MappingError(pp_rank, "layer_map", want.compress_layer_id, got.compress_layer_id,
                         f"global layer {got.global_id} (ratio {got.compress_ratio}): sglang's "
                         "compress_layer_id differs from the stage-local id stagecache computes")
            for got, want in zip(stage_map.layers, expected.layers, strict=True)
            if got.compress_layer_id != want.compress_layer_id
        ]
    page = int(page_size if page_size is not None else kvcache.page_size)
    return PoolView(spec, stage_map, inventory, nbytes, tuple(findings), page,
                    str(getattr(kvcache, "dtype", "unknown")))


# -- partition: sglang's get_pp_indices vs stagecache's partition_layers ---------------------------
def sglang_partition(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Every rank's ``(start, end)`` as sglang computes it (it reads ``SGLANG_PP_LAYER_PARTITION``)."""
    return [tuple(get_pp_indices(num_layers, rank, pp_size)) for rank in range(pp_size)]


def partition_findings(num_layers: int, pp_size: int) -> list[MappingError]:
    """Compare sglang's partition with stagecache's, under the same env partition."""
    text = os.environ.get(PARTITION_ENV)
    partition = parse_partition(text) if text is not None and pp_size > 1 else None
    try:
        ours = [(s.start, s.end) for s in partition_layers(num_layers, pp_size, partition)]
    except ConfigError as exc:
        return [MappingError(None, "partition", "a valid partition", text, str(exc))]
    try:
        theirs = sglang_partition(num_layers, pp_size)
    except ValueError as exc:
        return [MappingError(None, "partition", ours, None, f"sglang get_pp_indices failed: {exc}")]
    return [
        MappingError(rank, "partition", list(mine), list(sg),
                     f"stage {rank}: stagecache's partition_layers gives {list(mine)}, sglang's "
                     f"get_pp_indices gives {list(sg)}")
        for rank, (mine, sg) in enumerate(zip(ours, theirs, strict=True))
        if mine != sg
    ]


# -- reports ---------------------------------------------------------------------------------------
def _ranks(kvcaches: Sequence[Any], pp_size: int, num_layers: int) -> list[int]:
    ranks = []
    for kv in kvcaches:
        rank = pp_rank_of(kv, pp_size, num_layers)
        if rank is None:
            raise ConfigError(
                f"pool with layers [{kv.start_layer}, {kv.end_layer}) matches no rank of "
                f"get_pp_indices for pp_size={pp_size}; pass pp_rank explicitly"
            )
        ranks.append(rank)
    return ranks


def inspect_pools(
    kvcaches: Sequence[Any],
    *,
    pp_size: int,
    pp_ranks: Sequence[int] | None = None,
    tp_size: int = 1,
    page_size: int | None = None,
    model_name: str = "sglang",
    num_layers: int | None = None,
) -> StartupReport:
    """Validate live pools (one per PP rank given) and report like ``stagecache check``.

    With every stage present the stages must also tile ``[0, L)``; with some present only those
    are validated (``deployment_report``).  Either way sglang-vs-stagecache partition mismatches
    and pool holes the generic validation cannot see are added as findings.
    """
    if not kvcaches:
        raise ConfigError("inspect_pools: no pool given")
    n = model_num_layers(kvcaches, pp_size, num_layers)
    ranks = list(pp_ranks) if pp_ranks is not None else _ranks(kvcaches, pp_size, n)
    records = [read_pool(kv, rank, n, model_name, page_size).record(pp_size=pp_size, tp_size=tp_size,
                                                                     model_name=model_name)
               for kv, rank in zip(kvcaches, ranks, strict=True)]
    whole = sorted(ranks) == list(range(pp_size))
    if whole:
        records.sort(key=lambda r: r.stage)
    page = int(page_size if page_size is not None else kvcaches[0].page_size)
    return deployment_report(records, tp_size=tp_size, page_size=page, pp_size=pp_size,
                             cross=partition_findings(n, pp_size))


def inspect_pool(kvcache: Any, *, pp_size: int, pp_rank: int | None = None, **kw: Any) -> StartupReport:
    """One rank's pool: ``inspect_pools([kvcache], ...)``."""
    return inspect_pools([kvcache], pp_size=pp_size, pp_ranks=None if pp_rank is None else [pp_rank], **kw)


# -- the other families: SWA hybrid, Mamba hybrid, DSA, dense MLA / MHA ----------------------------
#: stagecache's family of each sglang pool class the reader reads, most specific first (a
#: ``DSATokenToKVPool`` is an ``MLATokenToKVPool``; a ``DeepSeekV4TokenToKVPool`` is read by
#: ``read_pool``).
POOL_FAMILIES = (
    ("sglang.srt.mem_cache.deepseek_v4_memory_pool", "DeepSeekV4TokenToKVPool", "deepseek_v4"),
    ("sglang.srt.mem_cache.memory_pool", "HybridLinearKVPool", "linear_hybrid"),
    ("sglang.srt.mem_cache.swa_memory_pool", "SWAKVPool", "swa_hybrid"),
    ("sglang.srt.mem_cache.memory_pool", "DSATokenToKVPool", "dsa"),
    ("sglang.srt.mem_cache.memory_pool", "MLATokenToKVPool", "mla"),
    ("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool", "mha"),
)


def pool_family(kvcache: Any) -> str | None:
    """stagecache's family name for a live sglang pool (None: a pool stagecache does not read,
    such as MiniMax's sparse pool)."""
    import importlib

    for module, cls, family in POOL_FAMILIES:
        pool_cls = getattr(importlib.import_module(module), cls, None)
        if pool_cls is not None and isinstance(kvcache, pool_cls):
            return family
    return None


def sglang_model_spec(name: str = "sglang", model_path: str | None = None) -> ModelSpec:
    """The model's spec from the config.json sglang serves (``--model-path``: a folder, or a
    Hugging Face repo id in the local cache), read by stagecache's own family rules -- the same
    spec ``stagecache check --model`` builds for it."""
    from ...model.config_file import load_config
    from ...model.families import spec_from_config

    if model_path is None:
        from sglang.srt.runtime_context import get_server_args

        model_path = str(get_server_args().model_path)
    cfg, _ = load_config(model_path)
    return spec_from_config(cfg, name)


def _flags(buffers: Any) -> list[bool]:
    return [b is not None for b in (buffers or ())]


def _kv_bytes(pool: Any) -> int:
    """K + V (or the MLA latent) bytes of one sglang KV pool."""
    if pool is None:
        return 0
    return sum(_nbytes(t) for attr in ("k_buffer", "v_buffer", "kv_buffer") for t in (getattr(pool, attr, None) or ()))


def _mamba_state(req_pool: Any) -> tuple[list[bool], int]:
    """One flag per layer of the Mamba pool's state tensors (conv + SSM), and their bytes."""
    mamba = getattr(req_pool, "mamba_pool", None) if req_pool is not None else None
    cache = getattr(mamba, "mamba_cache", None)
    if cache is None:
        return [], 0
    temporal = cache.temporal
    conv = list(cache.conv) if isinstance(cache.conv, (list, tuple)) else [cache.conv]
    return [True] * int(temporal.shape[0]), int(temporal.nbytes) + sum(int(c.nbytes) for c in conv)


def _family_buffers(family: str, kvcache: Any, req_pool: Any) -> tuple[dict[str, list[bool]], dict[str, int]]:
    """Per stagecache pool kind: one flag per buffer the live pool holds, and its device bytes."""
    if family == "swa_hybrid" and hasattr(kvcache, "swa_kv_pool"):
        swa, full = kvcache.swa_kv_pool, kvcache.full_kv_pool
        return ({"swa": _flags(swa.k_buffer), "full": _flags(full.k_buffer)},
                {"swa": _kv_bytes(swa), "full": _kv_bytes(full)})
    if family == "linear_hybrid":
        full = kvcache.full_kv_pool
        flags, state_bytes = _mamba_state(req_pool)
        attention = getattr(full, "k_buffer", None)
        if attention is None:  # an MLA attention pool (Kimi-Linear)
            attention = getattr(full, "kv_buffer", None)
        return {"attention": _flags(attention), "mamba": flags}, {"attention": _kv_bytes(full), "mamba": state_bytes}
    if family == "dsa":
        index = list(getattr(getattr(kvcache, "index_key_cache", None), "buffer", None) or ())
        # a layer that shares its top-k keeps a 0-row placeholder: no index keys of its own
        owned = [True for t in index if t is not None and int(t.shape[0]) > 0]
        return ({"kv": _flags(kvcache.kv_buffer), "indexer": owned},
                {"kv": _kv_bytes(kvcache), "indexer": sum(_nbytes(t) for t in index)})
    buffers = getattr(kvcache, "kv_buffer", None) if family == "mla" else getattr(kvcache, "k_buffer", None)
    return {"kv": _flags(buffers)}, {"kv": _kv_bytes(kvcache)}


def _live_ids(family: str, kvcache: Any, req_pool: Any, stage_map: StageLayerMap
              ) -> tuple[StageLayerMap, list[MappingError]]:
    """The stage map with the ids the live pool really indexes by (where sglang keeps a map), and
    the layers whose kind the pool disagrees with."""
    stage, errors, layers = stage_map.stage, [], []
    if family == "swa_hybrid" and hasattr(kvcache, "layers_mapping"):
        mapping, base = dict(kvcache.layers_mapping), int(getattr(kvcache, "start_layer", 0) or 0)
        for e in stage_map.layers:
            live = mapping.get(e.global_id)
            if live is None:
                errors.append(MappingError(stage, e.kind, "a layers_mapping entry", None,
                                           f"SWAKVPool.layers_mapping has no entry for global layer {e.global_id}"))
                layers.append(e)
                continue
            index, is_swa = int(live[0]), bool(live[1])
            if is_swa != (e.kind == "swa"):
                errors.append(MappingError(stage, e.kind, e.kind, "swa" if is_swa else "full",
                                           f"global layer {e.global_id}: sglang's pool holds it as "
                                           f"{'sliding-window' if is_swa else 'full attention'}, the model config "
                                           f"says {e.describe()}"))
            tid = e.global_id - base
            layers.append(e.model_copy(update={"sub_pool_id": index, "transfer_id": tid, "wait_id": tid}))
    elif family == "linear_hybrid":
        attention = dict(getattr(kvcache, "full_attention_layer_id_mapping", {}) or {})
        mamba = dict(getattr(req_pool, "mamba_map", {}) or {}) if req_pool is not None else {}
        for e in stage_map.layers:
            update: dict[str, Any] = {}
            if e.attention_id is not None and e.global_id in attention:
                update["attention_id"] = int(attention[e.global_id])
            if e.mamba_id is not None and e.global_id in mamba:
                update["mamba_id"] = int(mamba[e.global_id])
            for name, live in (("attention", attention), ("mamba", mamba)):
                if getattr(e, f"{name}_id") is not None and e.global_id not in live:
                    errors.append(MappingError(stage, name, f"global layer {e.global_id}", None,
                                               f"sglang's {name} pool has no entry for global layer {e.global_id}, "
                                               f"which the model config gives a {name} state"))
            layers.append(e.model_copy(update=update) if update else e)
    else:
        return stage_map, []
    return stage_map.with_layers(stage_map.start, stage_map.end, layers), errors


def read_family_pool(kvcache: Any, pp_rank: int, pp_size: int, *, req_pool: Any = None,
                     spec: ModelSpec | None = None, name: str = "sglang", page_size: int | None = None
                     ) -> PoolView:
    """Read one rank's live pool of any family but DeepSeek V4 (``read_pool``) into the same
    ``PoolView`` -- and so the same ``StageRecord`` and report -- as the offline plan.

    The family module names the layer kinds and id spaces, from the model's config.json
    (``sglang_model_spec``); the stage's range is sglang's ``get_pp_indices`` on this rank; the
    pool gives what it really holds (buffers per pool kind, their bytes) and the ids it really
    indexes by: SWA sub-pool indices from ``SWAKVPool.layers_mapping`` and HiCache transfer ids
    in its global space (``start_layer`` 0, ids below the stage are holes); Mamba hybrids'
    attention / Mamba indices from ``full_attention_layer_id_mapping`` / ``mamba_map``, transfer
    ids stage-local.  ``req_pool``: the ``HybridReqToTokenPool`` that owns a Mamba pool."""
    family = pool_family(kvcache)
    if family is None or family == "deepseek_v4":
        raise ConfigError(f"stage {pp_rank}: sglang pool {type(kvcache).__name__} is not read by read_family_pool")
    spec = spec if spec is not None else sglang_model_spec(name)
    if spec.family.name != family and not (family == "mha" and spec.family.name == "swa_hybrid"):
        raise ConfigError(f"stage {pp_rank}: sglang built a {type(kvcache).__name__} ({family}) for a model "
                          f"stagecache reads as {spec.family.label} ({spec.family.name})")
    start, end = (int(x) for x in get_pp_indices(spec.num_layers, pp_rank, pp_size))
    expected = number_layers(spec, pp_rank, start, end)
    stage_map, findings = _live_ids(family, kvcache, req_pool, expected)
    flags, nbytes = _family_buffers(family, kvcache, req_pool)
    inventory = PoolInventory(pp_rank, {k: tuple(v) for k, v in flags.items()})
    page = int(page_size if page_size is not None else getattr(kvcache, "page_size", 1))
    dtype = getattr(kvcache, "dtype", None)
    if dtype is None and hasattr(kvcache, "full_kv_pool"):
        dtype = getattr(kvcache.full_kv_pool, "dtype", None)
    return PoolView(spec, stage_map, inventory, {k: nbytes.get(k, 0) for k in stage_map.pools if k in flags},
                    tuple(findings), page, str(dtype or "unknown"))
