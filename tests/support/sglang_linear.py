"""sglang 0.5.23's own pools of a linear-attention / Mamba hybrid on CPU, and what the tests read of them.

``published_linear`` resolves a real ``ServerArgs`` for a preset's ``config.json`` (HiCache on).
sglang gates its Mamba ``extra_buffer`` strategy (the one that allows pages > 1 token) to GPU
platforms; the platform check is answered True while the arguments resolve, as on CUDA.
``build_linear_stage`` runs ``ModelRunner``'s steps for one PP rank -- ``KVCacheConfigurator``,
the ``DefaultPoolConfigurator``, ``_init_pools`` -- and ``host_stack`` runs sglang's own
``_MambaStrategy.build`` (the HiCache assembler) on them, with ``on_cpu``'s two CPU stand-ins.
``budget_sizes`` is sglang's memory-budget sizing of one rank (``_handle_max_mamba_cache`` and
``calculate_pool_sizes``) without allocating anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sglang.srt.arg_groups import mamba_hook
from sglang.srt.distributed.utils import get_pp_indices
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
from sglang.srt.runtime_context import get_schedule
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from stagecache.runtime.integrations.sglang.cpu_stage import _PPGroup, model_dir, on_cpu, published

GIB = 1 << 30


@contextlib.contextmanager
def published_linear(parent: Path, preset: str, **server_args: Any) -> Iterator[tuple[Any, Any]]:
    """``published`` for a linear-hybrid preset, with sglang's CUDA-only platform gate answered True."""
    folder = model_dir(parent, preset)
    saved = mamba_hook._platform_supports_mamba_cache_extra_buffer
    mamba_hook._platform_supports_mamba_cache_extra_buffer = lambda: True
    try:
        with published(folder, hicache_io_backend="direct", hicache_mem_layout="page_first_direct",
                       **server_args) as (sa, mc):
            yield sa, mc
    finally:
        mamba_hook._platform_supports_mamba_cache_extra_buffer = saved


def configurator(sa: Any, mc: Any, rank: int, pp_size: int) -> KVCacheConfigurator:
    """sglang's ``KVCacheConfigurator`` for one PP rank of a BF16 linear hybrid."""
    start, end = get_pp_indices(mc.num_hidden_layers, rank, pp_size)
    return KVCacheConfigurator(
        device="cpu", gpu_id=0, attn_dp_size=1, pp_size=pp_size, pp_group=_PPGroup(), model=None,
        model_config=mc, server_args=sa, kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="auto",
        model_dtype=torch.bfloat16, page_size=get_schedule().page_size, sliding_window_size=None,
        spec_algorithm=SpeculativeAlgorithm.from_string(None), is_draft_worker=False,
        post_capture_kv_active=False, spec_aux_config=None, is_hybrid_swa=False,
        is_hybrid_swa_compress=False, use_mla_backend=False,
        layer_info=ModelLayerInfo(start_layer=start, end_layer=end, num_effective_layers=end - start),
        forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None,
    )


@dataclass
class LinearStage:
    """One PP rank's pools as sglang builds them."""

    rank: int
    kvcache: Any  # HybridLinearKVPool
    req_pool: Any  # HybridReqToTokenPool (owns the MambaPool)
    allocator: Any
    config: Any


def build_linear_stage(sa: Any, mc: Any, rank: int, pp_size: int) -> LinearStage:
    kvc = configurator(sa, mc, rank, pp_size)
    conf = create_memory_pool_configurator(kvc)
    page = get_schedule().page_size
    config = conf.calculate_pool_sizes_from_max_tokens(get_schedule().max_total_tokens, page)
    config.max_running_requests = kvc.resolve_max_num_reqs(config.max_total_num_tokens)
    config = conf.finalize_with_max_running_requests(config)
    pools = kvc._init_pools(sizes=kvc._derive_pool_sizes(config=config), req_to_token_pool=None,
                            token_to_kv_pool_allocator=None)
    return LinearStage(rank, pools.token_to_kv_pool, pools.req_to_token_pool, pools.token_to_kv_pool_allocator,
                       config)


def host_stack(stage: LinearStage, sa: Any) -> Any:
    """sglang's HiCache stack for the stage: ``_MambaStrategy.build`` (host pools + controller)."""
    params = CacheInitParams(disable=False, req_to_token_pool=stage.req_pool,
                             token_to_kv_pool_allocator=stage.allocator, page_size=get_schedule().page_size)
    with on_cpu():
        return hpa._MambaStrategy().build(cache=None, kvcache=stage.kvcache, params=params, server_args=sa,
                                          load_cache_event=None)


def pool_facts(stage: LinearStage) -> dict[str, dict[str, Any]]:
    """Per stagecache pool kind, what sglang's device objects hold."""
    full = stage.kvcache.full_kv_pool
    page = get_schedule().page_size
    attn = {"buffers": len(full.k_buffer),
            "device_bytes": sum(t.nbytes for t in (*full.k_buffer, *full.v_buffer)),
            "tensor_rows": {t.shape[0] for t in (*full.k_buffer, *full.v_buffer)},
            "page_bytes": (full.k_buffer[0][0].nbytes + full.v_buffer[0][0].nbytes) * page if full.k_buffer else None,
            "device_pages": full.size // page}
    cache = stage.req_pool.mamba_pool.mamba_cache
    n = cache.temporal.shape[0]
    mamba = {"buffers": n,
             "device_bytes": sum(t.nbytes for t in (*cache.conv, cache.temporal)),
             "tensor_rows": {cache.temporal.shape[1], *(c.shape[1] for c in cache.conv)},
             "page_bytes": sum(c[0, 0].nbytes for c in cache.conv) + cache.temporal[0, 0].nbytes if n else None,
             "device_pages": stage.req_pool.mamba_pool.size}
    return {"attention": attn, "mamba": mamba}


def host_facts(result: Any) -> dict[str, dict[str, int]]:
    """Per pool kind, sglang's host pool: units (pages, or slots) and bytes."""
    group = result.host_pool_group
    kv, mamba = group.get_pool(hpa.PoolName.KV), group.get_pool(hpa.PoolName.MAMBA)
    return {"attention": {"host_pages": kv.page_num, "host_bytes": kv.size * kv.size_per_token},
            "mamba": {"host_pages": mamba.size, "host_bytes": mamba.size * mamba.size_per_token}}


def transfer_facts(stage: LinearStage, result: Any) -> dict[str, Any]:
    """The controller's transfer bound, each pool's id -> buffer (its layer mapper over the bound),
    the events of its ``LayerDoneCounter``, and the id each layer's reader waits on."""
    ctl = result.cache_controller
    bound = ctl.transfer_layer_id_max
    names = {hpa.PoolName.KV: "attention", hpa.PoolName.MAMBA: "mamba"}
    mappers = {names[e.name]: {i: e.layer_mapper(i) for i in range(bound) if e.layer_mapper(i) is not None}
               for e in result.host_pool_group.entries}
    kv, req = stage.kvcache, stage.req_pool
    waits = {"attention": {g: g - kv.start_layer for g in kv.full_attention_layer_id_mapping},
             "mamba": {g: g - req.start_layer for g in req.mamba_map}}
    return {"bound": bound, "mappers": mappers, "waits": waits, "events": ctl.layer_done_counter.num_layers}


def budget_sizes(sa: Any, mc: Any, rank: int, pp_size: int, budget_bytes: int) -> dict[str, int]:
    """sglang's sizing of one rank under a KV memory budget, without allocating: the Mamba slots
    ``_handle_max_mamba_cache`` solves for (and the bytes it charges), then the tokens
    ``calculate_pool_sizes`` fits in what is left."""
    kvc = configurator(sa, mc, rank, pp_size)
    rest_gb = kvc._handle_max_mamba_cache(budget_bytes / GIB)
    conf = create_memory_pool_configurator(kvc)
    cfg = conf.calculate_pool_sizes(int(rest_gb * GIB), get_schedule().page_size)
    return {"slots": get_schedule().max_mamba_cache_size, "tokens": cfg.max_total_num_tokens,
            "charged": int(round((budget_bytes / GIB - rest_gb) * GIB))}
