"""One PP rank of sglang 0.5.23's own KV cache (DeepSeek V4, or any other family) on a CPU machine.

sglang sizes and builds a rank's pools in ``ModelRunner`` and its HiCache stack in
``Scheduler.__init__``.  This module runs those same steps on CPU, with sglang's own objects
(``published``, ``build_stage``, ``build_family_pools``), so the benchmark (``bench sglang-hooks``)
and the tests can drive sglang's real match / insert / backup / load paths without a GPU:
``on_cpu`` swaps in CPU versions of the CUDA-only pieces HiCache calls (pinning host pages,
``sgl_kernel``'s direct copy ops), so that with ``hicache_io_backend="direct"`` sglang's controller
and host pools move real bytes between real tensors, and ``AckLedger`` consumes the acks with
sglang's own ``writing_check`` / ``loading_check`` (which feed sglang's counters).

``device="meta"`` gives real shapes and ``nbytes`` without allocating (full-size pools in
milliseconds); ``device="cpu"`` allocates, for transfers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt import runtime_context
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.utils import get_pp_indices
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.mem_cache.pool_host import common as host_common
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
from sglang.srt.runtime_context import get_schedule
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from ...errors import ConfigError
from ...model.config_file import preset_text

FLASH = "deepseek-v4-flash"
#: The compressed pools a page backup moves by the full-KV token indices (SWA and the state pools
#: follow indices of their own).
COMPRESSED_POOLS = ("deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c128")


def model_dir(parent: Path, preset: str = FLASH) -> Path:
    """A model folder sglang resolves offline: the preset's real ``config.json`` alone."""
    folder = parent / preset
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(preset_text(preset))
    return folder


@contextlib.contextmanager
def published(folder: Path, **server_args: Any) -> Iterator[tuple[ServerArgs, ModelConfig]]:
    """A resolved ``ServerArgs`` for ``folder`` published for the block (HiCache on, CPU)."""
    previous = runtime_context._CONTEXT._server_args
    sa = ServerArgs(model_path=str(folder), device="cpu", enable_hierarchical_cache=True, **server_args)
    sa.resolve_once()
    runtime_context._CONTEXT.set_server_args(sa)
    try:
        yield sa, ModelConfig.from_server_args(sa)
    finally:
        if previous is not None:
            runtime_context._CONTEXT.set_server_args(previous)


class _PPGroup:
    """Read by ``DSV4PoolConfigurator`` for one log line under PP."""

    rank_in_group = 0


@dataclass
class Stage:
    """One PP rank's pools as sglang builds them."""

    rank: int
    config: Any  # MemoryPoolConfig after finalize_with_max_running_requests
    kvcache: Any  # DeepSeekV4TokenToKVPool
    allocator: Any
    req_to_token_pool: Any
    configurator: Any  # DSV4PoolConfigurator


def kv_cache_configurator(sa: ServerArgs, mc: ModelConfig, rank: int, pp_size: int, pp_group: Any,
                          device: str = "meta") -> Any:
    """sglang's ``KVCacheConfigurator`` for one PP rank, as ``ModelRunner`` builds it."""
    start, end = get_pp_indices(mc.num_hidden_layers, rank, pp_size)
    return KVCacheConfigurator(
        device=device, gpu_id=0, attn_dp_size=1, pp_size=pp_size, pp_group=pp_group, model=None,
        model_config=mc, server_args=sa, kv_cache_dtype=torch.float8_e4m3fn, kv_cache_dtype_str="fp8_e4m3",
        model_dtype=torch.bfloat16, page_size=get_schedule().page_size, sliding_window_size=mc.window_size,
        spec_algorithm=SpeculativeAlgorithm.from_string(None), is_draft_worker=False,
        post_capture_kv_active=False, spec_aux_config=None, is_hybrid_swa=mc.is_hybrid_swa,
        is_hybrid_swa_compress=True, use_mla_backend=False,
        layer_info=ModelLayerInfo(start_layer=start, end_layer=end, num_effective_layers=end - start),
        forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None,
    )


def size_pools(kvc: Any, budget_bytes: int | None = None) -> tuple[Any, Any]:
    """sglang's pool sizing for one rank's ``KVCacheConfigurator`` (``ModelRunner``'s steps, in
    order): its pool configurator and the ``MemoryPoolConfig`` sized from ``--max-total-tokens``
    (or ``budget_bytes``) and finalized with the max running requests."""
    configurator = create_memory_pool_configurator(kvc)
    page = get_schedule().page_size
    if budget_bytes is None:
        config = configurator.calculate_pool_sizes_from_max_tokens(get_schedule().max_total_tokens, page)
    else:
        config = configurator.calculate_pool_sizes(budget_bytes, page)
    config.max_running_requests = kvc.resolve_max_num_reqs(config.max_total_num_tokens)
    return configurator, configurator.finalize_with_max_running_requests(config)


def build_stage(sa: ServerArgs, mc: ModelConfig, rank: int, pp_size: int, device: str = "meta",
                budget_bytes: int | None = None) -> Stage:
    """sglang's sizing and pool construction for one rank (``ModelRunner``'s steps, in order)."""
    kvc = kv_cache_configurator(sa, mc, rank, pp_size, _PPGroup(), device)
    configurator, config = size_pools(kvc, budget_bytes)
    pools = kvc._init_pools(sizes=kvc._derive_pool_sizes(config=config), req_to_token_pool=None,
                            token_to_kv_pool_allocator=None)
    return Stage(rank, config, pools.token_to_kv_pool, pools.token_to_kv_pool_allocator,
                 pools.req_to_token_pool, configurator)


def cache_params(stage: Stage) -> CacheInitParams:
    """What ``build_deepseek_v4_hicache_stack`` reads of the scheduler's cache parameters."""
    return CacheInitParams(disable=False, req_to_token_pool=stage.req_to_token_pool,
                           token_to_kv_pool_allocator=stage.allocator, page_size=get_schedule().page_size)


def transfer_kv_direct(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_direct`` (a CUDA build's op): per layer, copy rows
    ``src[src_indices]`` to ``dst[dst_indices]`` (the kernel copies whole pages of ``page_size``
    rows where the indices run on; row by row is the same bytes)."""
    if page_size < 1:
        raise ConfigError(f"transfer_kv_direct: page_size must be positive, got {page_size}")
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, dst_indices.to(dst.device), src.index_select(0, src_indices.to(src.device)))


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: list[torch.Tensor], dst_ptrs: list[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       page_size: int) -> None:
    """``sgl_kernel``'s backup into a ``page_first_direct`` host pool: device rows of every layer
    (``src_ptrs``: the K layers, then the V layers) into host tensors shaped ``(pages, layers,
    page_size, ...)`` (``dst_ptrs``: K, V), at the host token indices ``dst_indices``."""
    layers = len(src_ptrs) // max(1, len(dst_ptrs))
    pages, offsets = dst_indices // page_size, dst_indices % page_size
    for j, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[j * layers + layer]
            dst[pages, layer, offsets] = src.index_select(0, src_indices.to(src.device)).to(dst.dtype)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: list[torch.Tensor], dst_ptrs: list[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int,
                                       page_size: int) -> None:
    """``sgl_kernel``'s load of one layer from a ``page_first_direct`` host pool into device rows."""
    pages, offsets = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst.index_copy_(0, dst_indices.to(dst.device), src[pages, layer_id, offsets].to(dst.device))


_DIRECT = {"transfer_kv_direct": transfer_kv_direct}
#: the ops of host pools that also copy page-first (MHA and Mamba: a Mamba hybrid's layout)
_PAGE_FIRST = {**_DIRECT, "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
               "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf}
#: The host pool modules that bind sglang's copy ops at import (CUDA builds only), and the
#: CPU stand-ins ``on_cpu`` gives each: DeepSeek V4's pools, MHA / MLA pools and DSA's indexer (SWA hybrids, DSA,
#: dense models, a Mamba hybrid's attention) and the Mamba state pool.
COPY_OPS = {f"sglang.srt.mem_cache.{module}": ops for module, ops in (
    ("memory_pool_host", _DIRECT), ("pool_host.mha", _PAGE_FIRST), ("pool_host.mla", _DIRECT),
    ("pool_host.dsa", _DIRECT), ("pool_host.mamba", _PAGE_FIRST))}


@contextlib.contextmanager
def copy_ops(ops: dict[str, dict[str, Any]]) -> Iterator[None]:
    """``ops`` (module -> name -> function) set on sglang's host pool modules for the block."""
    import importlib

    missing = object()
    saved = []
    for module_name, names in ops.items():
        module = importlib.import_module(module_name)
        for name, fn in names.items():
            saved.append((module, name, getattr(module, name, missing)))
            setattr(module, name, fn)
    try:
        yield
    finally:
        for module, name, old in reversed(saved):
            if old is missing:
                delattr(module, name)
            else:
                setattr(module, name, old)


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """HiCache's CUDA-only calls replaced for the block (see the module docstring)."""
    saved = host_common._cuda_host_register
    host_common._cuda_host_register = lambda *a, **k: None
    try:
        with copy_ops(COPY_OPS):
            yield
    finally:
        host_common._cuda_host_register = saved


class AckLedger:
    """The part of a ``UnifiedRadixCache`` that sglang's ``writing_check`` / ``loading_check``
    read when they consume the controller's acks: the controller, sglang's metrics collector
    (``RadixCacheMetricsCollector``, or ``None``) and the radix tree's lock bookkeeping, which
    has nothing to unlock here because no tree node owns these transfers."""

    buffer_pipeline = None
    enable_storage = False
    _log_write_ack_metrics = UnifiedRadixCache._log_write_ack_metrics

    def __init__(self, controller: Any, metrics_collector: Any = None):
        self.cache_controller = controller
        self.metrics_collector = metrics_collector
        self.ongoing_load_back: dict[int, tuple[None, None, None]] = {}
        self.tree_core = self

    # the tree's lock bookkeeping sglang calls per ack: no tree node owns these transfers
    _finish_write_through_ack = finish_load_back = dec_lock_ref = dec_host_lock_ref = staticmethod(
        lambda *a, **k: None)

    def drain(self) -> None:
        """Every queued ack through sglang's own completion checks (counters included)."""
        ctl = self.cache_controller
        UnifiedRadixCache.writing_check(self, finish_count=len(ctl.ack_write_queue))
        for ack in ctl.ack_load_queue:
            self.ongoing_load_back.update(dict.fromkeys(ack.node_ids, (None, None, None)))
        UnifiedRadixCache.loading_check(self, finish_count=len(ctl.ack_load_queue))


def round_trip(group: Any, controller: Any, src: torch.Tensor, dst: torch.Tensor, node: int = 0,
               pools: tuple[str, ...] = COMPRESSED_POOLS,
               states: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
               ) -> tuple[torch.Tensor, dict[Any, torch.Tensor]]:
    """sglang's controller backs up device rows ``src`` of the full KV and of ``pools`` (the host
    pools that move with it: DeepSeek V4's compressed pools, DSA's indexer) to host (``write`` /
    ``start_writing``) and loads them back into rows ``dst`` (``load`` / ``start_loading``); the
    acks stay queued.  ``states``: pools that move by indices of their own (a Mamba hybrid's state:
    pool name -> (device slots backed up, device slots loaded into)).  Returns the host slots it
    took: the full-KV ones and one per pool, for the caller to keep or free."""
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    states = states or {}
    names = [e.name for e in group.entries if e.name.value in pools]
    by_name = {e.name.value: e.name for e in group.entries}
    host = controller.write(src, node_id=node, flush=False,
                            extra_pools=[PoolTransfer(name=n, device_indices=src.clone()) for n in names]
                            + [PoolTransfer(name=by_name[n], device_indices=a.clone()) for n, (a, _) in states.items()])
    if host is None:
        raise ConfigError(f"sglang's host pools have no room for {len(src)} tokens")
    hosts = {t.name: t.host_indices for t in controller.write_queue[-1].pool_transfers or ()}
    controller.start_writing()
    into = {by_name[n]: b for n, (_, b) in states.items()}
    loaded = controller.load(host, node_id=node + 1, device_indices=dst, extra_pools=[
        PoolTransfer(name=n, host_indices=h, device_indices=into.get(n, dst).clone()) for n, h in hosts.items()])
    if loaded is None:
        raise ConfigError(f"sglang's controller could not load {len(dst)} tokens back")
    controller.start_loading()
    return host, hosts


class _AnyLoad(dict):
    """``ongoing_load_back`` for acks no tree node owns: every id pops as "no node, no locks"."""

    def pop(self, key: Any, *default: Any) -> Any:
        return super().pop(key, (None, None, None))


class StepLedger(AckLedger):
    """What sglang's per-step ``UnifiedRadixCache.check_hicache_events`` reads of a radix cache,
    for one PP rank: the controller, the rank's place in the PP group (``pp_group``: sglang's PP
    CPU group, over which ``_pp_sync`` hands PP rank 0's ready-ack counts down, #27285) and no
    storage, linker or buffer pipeline.  ``step()`` runs sglang's own ``check_hicache_events``:
    ``flush_pending_backups``, ``_sync_hicache_ready_counts`` and ``writing_check`` /
    ``loading_check`` with the agreed counts -- through the class, so hooks sglang's
    ``HookRegistry`` applied there run too."""

    linker = None
    host_memory_mode = "cache"
    enable_storage_metrics = False
    storage_metrics_collector = None
    attn_cp_group = None
    attn_tp_group = None
    tp_group = None
    tp_world_size = 1
    write_back_duplicate_reclaim_digest = 0  # read through ``tree_core`` (this object)

    _drain_async_work = UnifiedRadixCache._drain_async_work
    flush_pending_backups = UnifiedRadixCache.flush_pending_backups
    _sync_hicache_ready_counts = UnifiedRadixCache._sync_hicache_ready_counts
    _count_ready_acks = UnifiedRadixCache._count_ready_acks
    _all_reduce = UnifiedRadixCache._all_reduce
    _all_reduce_attn_groups = UnifiedRadixCache._all_reduce_attn_groups
    _pp_sync = UnifiedRadixCache._pp_sync

    def __init__(self, controller: Any, pp_rank: int = 0, pp_size: int = 1, pp_group: Any = None,
                 metrics_collector: Any = None):
        super().__init__(controller, metrics_collector)
        self.pp_rank, self.pp_size, self.pp_group = pp_rank, pp_size, pp_group
        self.work_list: list[Any] = []
        self.ongoing_load_back = _AnyLoad()

    def writing_check(self, *a: Any, **k: Any) -> None:
        return UnifiedRadixCache.writing_check(self, *a, **k)

    def loading_check(self, *a: Any, **k: Any) -> None:
        return UnifiedRadixCache.loading_check(self, *a, **k)

    def step(self) -> None:
        """One scheduler step's HiCache event check, as sglang's scheduler runs it."""
        UnifiedRadixCache.check_hicache_events(self)


# -- every other family: one rank's pools and HiCache stack ---------------------------------------
@dataclass(frozen=True)
class FamilyModel:
    """One family's model for CPU runs (the bench, the live tests): its preset and the server
    arguments sglang needs for it on CPU (page size, Mamba slots, a host layout it copies with)."""

    family: str
    preset: str
    server: dict[str, Any]


#: The model of each family the bench and the live tests build (DeepSeek V4: ``FLASH``).
FAMILY_MODELS = {
    "linear_hybrid": FamilyModel("linear_hybrid", "qwen3.5-0.8b", {
        "page_size": 256, "max_mamba_cache_size": 10, "hicache_mem_layout": "page_first_direct"}),
    "dsa": FamilyModel("dsa", "deepseek-v3.2", {"page_size": 64, "hicache_mem_layout": "layer_first"}),
    "swa_hybrid": FamilyModel("swa_hybrid", "gpt-oss-20b", {"page_size": 16, "hicache_mem_layout": "layer_first"}),
    "mha": FamilyModel("mha", "llama-3.1-8b", {"page_size": 16, "hicache_mem_layout": "layer_first"}),
}


@contextlib.contextmanager
def gpu_gates() -> Iterator[None]:
    """sglang's GPU-only questions answered as on an H100 for the block: the Mamba extra-buffer
    platform gate (pages > 1 token for a Mamba hybrid) and ``torch.cuda.get_device_capability``
    (which DSA's defaults read: 9.0 keeps its KV cache in BF16)."""
    from sglang.srt.arg_groups import mamba_hook

    saved = mamba_hook._platform_supports_mamba_cache_extra_buffer, torch.cuda.get_device_capability
    mamba_hook._platform_supports_mamba_cache_extra_buffer = lambda: True
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    try:
        yield
    finally:
        mamba_hook._platform_supports_mamba_cache_extra_buffer, torch.cuda.get_device_capability = saved


def sliding_window(mc: ModelConfig) -> int | None:
    """The window ``ModelRunner`` hands the pool configurator: the model class's rule (gpt-oss and
    Gemma 4 say ``sliding_window - 1``), else the config's."""
    from sglang.srt.model_executor.model_runner_components.load_model_utils import (
        resolve_sliding_window_size,
    )

    arch = mc.hf_config.architectures[0]
    if arch.startswith(("GptOss", "Gemma4")):
        from sglang.srt.models.gpt_oss import get_attention_sliding_window_size

        window = get_attention_sliding_window_size(mc.hf_text_config)
        return resolve_sliding_window_size(SimpleNamespace(get_attention_sliding_window_size=lambda: window), mc)
    return resolve_sliding_window_size(object(), mc)


def family_configurator(sa: ServerArgs, mc: ModelConfig, rank: int, pp_size: int, pp_group: Any,
                        device: str = "cpu", swa_layers: list[int] | None = None) -> Any:
    """sglang's ``KVCacheConfigurator`` for one PP rank of any family but DeepSeek V4, as
    ``ModelRunner`` builds it (the rank's layer range and, for an SWA hybrid, its sliding / full
    lists; ``swa_layers`` replaces the sliding list, as a faulty build would)."""
    from sglang.srt.model_executor.model_runner_components.layer_setup import (
        _resolve_local_hybrid_swa_layer_ids,
    )

    start, end = get_pp_indices(mc.num_hidden_layers, rank, pp_size)
    swa, full = [], []
    if mc.is_hybrid_swa:
        swa, full = _resolve_local_hybrid_swa_layer_ids(model_config=mc, owned_layers=range(start, end))
        swa = list(swa) if swa_layers is None else list(swa_layers)
    info = ModelLayerInfo(start_layer=start, end_layer=end, num_effective_layers=end - start,
                          swa_attention_layer_ids=swa, full_attention_layer_ids=full)
    return KVCacheConfigurator(
        device=device, gpu_id=0, attn_dp_size=1, pp_size=pp_size, pp_group=pp_group, model=None,
        model_config=mc, server_args=sa, kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="auto",
        model_dtype=torch.bfloat16, page_size=get_schedule().page_size,
        sliding_window_size=sliding_window(mc) if mc.is_hybrid_swa else None,
        spec_algorithm=SpeculativeAlgorithm.from_string(None), is_draft_worker=False,
        post_capture_kv_active=False, spec_aux_config=None, is_hybrid_swa=mc.is_hybrid_swa,
        is_hybrid_swa_compress=mc.is_hybrid_swa_compress, use_mla_backend=mc.attention_arch.name == "MLA",
        layer_info=info, forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None,
        memory_pool_config=None,
    )


def family_stack(pools: Any, sa: ServerArgs) -> Any:
    """The HiCache stack sglang's assembler builds for the pools: its own strategy for the pool
    (``_select_strategy``) and that strategy's ``build`` -- what the stagecache plugin hooks.
    Returns the ``StackBuildResult``."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    kv = pools.token_to_kv_pool
    components = {ComponentType.FULL}
    if hasattr(kv, "full_attention_layer_id_mapping"):
        components.add(ComponentType.MAMBA)
    elif hasattr(kv, "swa_kv_pool"):
        components.add(ComponentType.SWA)
    params = CacheInitParams(disable=False, req_to_token_pool=pools.req_to_token_pool,
                             token_to_kv_pool_allocator=pools.token_to_kv_pool_allocator,
                             page_size=get_schedule().page_size)
    strategy = hpa._select_strategy(kv, components)
    return strategy.build(cache=None, kvcache=kv, params=params, server_args=sa, load_cache_event=None)


def build_family_pools(sa: ServerArgs, mc: ModelConfig, device: str = "cpu") -> Any:
    """One PP-1 stage of any family but DeepSeek V4: sglang's sizing from ``--max-total-tokens``
    and ``_init_pools`` (``KVCacheConfigResult``-like: ``token_to_kv_pool``, ``req_to_token_pool``,
    ``token_to_kv_pool_allocator``)."""
    kvc = family_configurator(sa, mc, 0, 1, _PPGroup(), device)
    _, config = size_pools(kvc)
    return kvc._init_pools(sizes=kvc._derive_pool_sizes(config=config), req_to_token_pool=None,
                           token_to_kv_pool_allocator=None)
