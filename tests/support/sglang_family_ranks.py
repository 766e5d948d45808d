"""One real sglang 0.5.23 PP rank of a non-DeepSeek-V4 family on CPU: its pools and HiCache stack.

``build_family`` is ``sglang_ranks.launch``'s ``build`` for the family tests: in each rank's
process it runs ``ModelRunner``'s steps for the model of the published ``ServerArgs`` --
``KVCacheConfigurator`` (the rank's layer range, and for an SWA hybrid its sliding / full lists),
``config_from_budget`` (whose ``_apply_token_constraints`` MIN-reduces the capacity over the ranks
through gloo), ``_init_pools`` -- then the HiCache assembler's own strategy for the pool
(``_select_strategy``, ``build``), which the stagecache plugin hooks.

``STAGECACHE_TEST_FAULT`` builds the rank's pools the way a known bug built them, with sglang's
own classes (the family's ``--fault`` of the same name):

* ``unsplit-mamba`` (sglang #21448): the Mamba pool over every Mamba layer of the model;
* ``global-swa-subpool``: the SWA sub-pool from the model's whole sliding-layer list;
* ``global-dsa``: the DSA pool built over the whole model's layers.

``FAMILIES`` gives each family's preset, ``ServerArgs`` and budget; ``gates`` answers the two
questions sglang asks a GPU while its arguments resolve (set in the test process before the ranks
fork, so every rank inherits them).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class FamilyCase:
    """One family's model for the live tests: preset, server arguments, KV budget per rank."""

    family: str
    preset: str
    fault: str
    server: dict[str, Any] = field(default_factory=dict)
    budget: int = 16 << 20


FAMILIES = {
    "linear_hybrid": FamilyCase("linear_hybrid", "qwen3.5-0.8b", "unsplit-mamba", {
        "page_size": 256, "max_mamba_cache_size": 4, "hicache_mem_layout": "page_first_direct"}),
    "dsa": FamilyCase("dsa", "deepseek-v3.2", "global-dsa", {"page_size": 64}),
    "swa_hybrid": FamilyCase("swa_hybrid", "gpt-oss-20b", "global-swa-subpool", {"page_size": 16}),
}


@contextlib.contextmanager
def gates() -> Iterator[None]:
    """sglang's GPU-only questions answered as on an H100 for the block: the Mamba extra-buffer
    platform gate (pages > 1 token) and ``torch.cuda.get_device_capability`` (DSA's defaults)."""
    from sglang.srt.arg_groups import mamba_hook

    saved = mamba_hook._platform_supports_mamba_cache_extra_buffer, torch.cuda.get_device_capability
    mamba_hook._platform_supports_mamba_cache_extra_buffer = lambda: True
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    try:
        yield
    finally:
        mamba_hook._platform_supports_mamba_cache_extra_buffer, torch.cuda.get_device_capability = saved


def _configurator(sa: Any, mc: Any, rank: int, pp: int, fault: str | None) -> Any:
    from sglang.srt.distributed.parallel_state import get_pp_group
    from sglang.srt.distributed.utils import get_pp_indices
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import (
        ModelLayerInfo,
        _resolve_local_hybrid_swa_layer_ids,
    )
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang_swa import sliding_window

    start, end = get_pp_indices(mc.num_hidden_layers, rank, pp)
    swa, full = ([], [])
    if mc.is_hybrid_swa:
        swa, full = _resolve_local_hybrid_swa_layer_ids(model_config=mc, owned_layers=range(start, end))
        if fault == "global-swa-subpool":  # the whole model's sliding list reaches the pool
            swa = list(mc.swa_attention_layer_ids)
    info = ModelLayerInfo(start_layer=start, end_layer=end, num_effective_layers=end - start,
                          swa_attention_layer_ids=swa, full_attention_layer_ids=full)
    return KVCacheConfigurator(
        device="cpu", gpu_id=0, attn_dp_size=1, pp_size=pp, pp_group=get_pp_group(), model=None,
        model_config=mc, server_args=sa, kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="auto",
        model_dtype=torch.bfloat16, page_size=get_schedule().page_size,
        sliding_window_size=sliding_window(mc) if mc.is_hybrid_swa else None,
        spec_algorithm=SpeculativeAlgorithm.from_string(None), is_draft_worker=False,
        post_capture_kv_active=False, spec_aux_config=None, is_hybrid_swa=mc.is_hybrid_swa,
        is_hybrid_swa_compress=mc.is_hybrid_swa_compress, use_mla_backend=mc.attention_arch.name == "MLA",
        layer_info=info, forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None,
        memory_pool_config=None,
    )


def _inject(kvc: Any, mc: Any, fault: str | None) -> None:
    """The bug's pool build, on this configurator only."""
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo

    if fault == "unsplit-mamba":
        kvc._get_mamba_layer_ids_for_req_pool = lambda: list(kvc.mambaish_config.mamba2_cache_params.layers)
    elif fault == "global-dsa":
        build = kvc._build_dsa_kv_pool

        def whole_model(**kw: Any) -> Any:
            saved, n = kvc.layer_info, mc.num_hidden_layers
            kvc.layer_info = ModelLayerInfo(start_layer=0, end_layer=n, num_effective_layers=n)
            try:
                return build(**kw)
            finally:
                kvc.layer_info = saved

        kvc._build_dsa_kv_pool = whole_model


def build_family(rank: int, pp: int, budget: int) -> tuple[Any, Any]:
    """The rank's pools sized from ``budget`` (MIN over the ranks) and its HiCache stack, built by
    the assembler's own strategy (hooked by the plugin: the record exchange runs inside)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_schedule, get_server_args

    sa = get_server_args()
    mc = ModelConfig.from_server_args(sa)
    fault = os.environ.get("STAGECACHE_TEST_FAULT")
    kvc = _configurator(sa, mc, rank, pp, fault)
    _inject(kvc, mc, fault)
    config = kvc.config_from_budget(budget)  # -> _apply_token_constraints: MIN over the ranks
    config.max_running_requests = kvc.resolve_max_num_reqs(config.max_total_num_tokens)
    config = create_memory_pool_configurator(kvc).finalize_with_max_running_requests(config)
    pools = kvc._init_pools(sizes=kvc._derive_pool_sizes(config=config), req_to_token_pool=None,
                            token_to_kv_pool_allocator=None)
    if not sa.enable_hierarchical_cache:
        return pools, None
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
    result = strategy.build(cache=None, kvcache=kv, params=params, server_args=sa, load_cache_event=None)
    return pools, (result.host_pool_group, result.cache_controller)
