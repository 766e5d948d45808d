"""sglang 0.5.23's own SWA-hybrid pools on CPU (``SWAKVPool`` or a plain ``MHATokenToKVPool``) for
one PP rank, built the way ``ModelRunner`` builds them, and its HiCache host stack.

``rank_pools`` sizes the rank with sglang's ``KVCacheConfigurator`` and its
``HybridSWAPoolConfigurator`` (or the default configurator for a plain MHA model) and builds the
pools with ``_init_pools``; ``layer_lists`` replaces the rank's sliding/full layer lists (what a
faulty build would hand the pool).  ``host_stack`` runs the assembler's own strategy for the pool
(``_SwaStrategy`` / ``_PlainKvStrategy``) on real CPU tensors.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.utils import get_pp_indices
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.model_executor.model_runner_components.layer_setup import (
    ModelLayerInfo,
    _resolve_local_hybrid_swa_layer_ids,
)
from sglang.srt.model_executor.model_runner_components.load_model_utils import (
    resolve_sliding_window_size,
)
from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
from sglang.srt.runtime_context import get_schedule
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from stagecache.runtime.integrations.sglang.cpu_stage import _PPGroup, published, size_pools  # noqa: F401 (re-exported)

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "runtime" / "model" / "presets"


def model_folder(parent: Path, name: str, config: dict[str, Any] | None = None) -> Path:
    """A folder sglang resolves offline: a preset's config.json (or ``config``) alone."""
    folder = parent / name
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config) if config is not None else (PRESETS / f"{name}.json").read_text()
    (folder / "config.json").write_text(text)
    return folder


class _Model:
    """What ``resolve_sliding_window_size`` reads of the model class: its window rule."""

    def __init__(self, window: int | None):
        self.window = window

    def get_attention_sliding_window_size(self) -> int | None:
        return self.window


def sliding_window(mc: ModelConfig) -> int | None:
    """The window sglang's pool configurator gets: the model class's rule (gpt-oss and Gemma 4:
    ``sliding_window - 1``), else the config's."""
    arch = mc.hf_config.architectures[0]
    if arch.startswith(("GptOss", "Gemma4")):
        from sglang.srt.models.gpt_oss import get_attention_sliding_window_size

        return resolve_sliding_window_size(_Model(get_attention_sliding_window_size(mc.hf_text_config)), mc)
    return resolve_sliding_window_size(object(), mc)


@dataclass
class Rank:
    """One PP rank's pools as sglang builds them."""

    rank: int
    start: int
    end: int
    config: Any
    kvcache: Any
    allocator: Any
    req_to_token_pool: Any


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """``torch.get_device_module("meta")`` answers torch.cpu for the block: sglang's MHA pool asks
    for its device's module (for CUDA streams), which a meta device has none of; shapes and
    ``nbytes`` of meta tensors are real and nothing is allocated."""
    real = torch.get_device_module

    def device_module(device: Any = None) -> Any:
        return torch.cpu if str(device) == "meta" else real(device)

    torch.get_device_module = device_module
    try:
        yield
    finally:
        torch.get_device_module = real


def rank_pools(sa: ServerArgs, mc: ModelConfig, rank: int, pp: int, *, device: str = "meta",
               budget_bytes: int | None = None,
               layer_lists: tuple[list[int], list[int]] | None = None) -> Rank:
    """sglang's sizing and pool construction for one rank (``ModelRunner``'s steps, in order)."""
    start, end = get_pp_indices(mc.num_hidden_layers, rank, pp)
    swa, full = _resolve_local_hybrid_swa_layer_ids(model_config=mc, owned_layers=range(start, end))
    if layer_lists is not None:
        swa, full = layer_lists
    info = ModelLayerInfo(start_layer=start, end_layer=end, num_effective_layers=end - start,
                          swa_attention_layer_ids=swa, full_attention_layer_ids=full)
    page = get_schedule().page_size
    kvc = KVCacheConfigurator(
        device=device, gpu_id=0, attn_dp_size=1, pp_size=pp, pp_group=_PPGroup(), model=None,
        model_config=mc, server_args=sa, kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="auto",
        model_dtype=torch.bfloat16, page_size=page, sliding_window_size=sliding_window(mc),
        spec_algorithm=SpeculativeAlgorithm.from_string(None), is_draft_worker=False,
        post_capture_kv_active=False, spec_aux_config=None, is_hybrid_swa=mc.is_hybrid_swa,
        is_hybrid_swa_compress=mc.is_hybrid_swa_compress, use_mla_backend=False, layer_info=info,
        forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None,
    )
    configurator, config = size_pools(kvc, budget_bytes)
    with meta_device():
        pools = kvc._init_pools(sizes=kvc._derive_pool_sizes(config=config), req_to_token_pool=None,
                                token_to_kv_pool_allocator=None)
    return Rank(rank, start, end, config, pools.token_to_kv_pool, pools.token_to_kv_pool_allocator,
                pools.req_to_token_pool)


def max_tokens_alone(sa: ServerArgs, mc: ModelConfig, rank: int, pp: int, budget_bytes: int) -> int:
    """The token count one rank's budget fits alone: what sglang MIN-all-reduces over PP ranks."""
    start, end = get_pp_indices(mc.num_hidden_layers, rank, pp)
    swa, full = _resolve_local_hybrid_swa_layer_ids(model_config=mc, owned_layers=range(start, end))
    info = ModelLayerInfo(start_layer=start, end_layer=end, num_effective_layers=end - start,
                          swa_attention_layer_ids=swa, full_attention_layer_ids=full)
    kvc = KVCacheConfigurator(
        device="meta", gpu_id=0, attn_dp_size=1, pp_size=pp, pp_group=_PPGroup(), model=None,
        model_config=mc, server_args=sa, kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="auto",
        model_dtype=torch.bfloat16, page_size=get_schedule().page_size, sliding_window_size=sliding_window(mc),
        spec_algorithm=SpeculativeAlgorithm.from_string(None), is_draft_worker=False,
        post_capture_kv_active=False, spec_aux_config=None, is_hybrid_swa=mc.is_hybrid_swa,
        is_hybrid_swa_compress=mc.is_hybrid_swa_compress, use_mla_backend=False, layer_info=info,
        forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None,
    )
    config = create_memory_pool_configurator(kvc).calculate_pool_sizes(budget_bytes, get_schedule().page_size)
    return config.max_total_num_tokens


def sub_pools(kv: Any) -> dict[str, Any]:
    """stagecache pool kind -> sglang's MHA pool holding it."""
    if hasattr(kv, "swa_kv_pool"):
        return {"swa": kv.swa_kv_pool, "full": kv.full_kv_pool}
    return {"kv": kv}


def cache_params(rank: Rank) -> CacheInitParams:
    return CacheInitParams(disable=False, req_to_token_pool=rank.req_to_token_pool,
                           token_to_kv_pool_allocator=rank.allocator, page_size=get_schedule().page_size)


def host_stack(rank: Rank) -> tuple[dict[str, Any], dict[str, dict[int, int]], int]:
    """The assembler's host pools per stagecache kind, their transfer-id -> pool-layer maps, and
    the transfer-id bound, from sglang's own strategy for the rank's pool."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv = rank.kvcache
    if hasattr(kv, "swa_kv_pool"):
        full_map, swa_map = hpa._swa_layer_mappings(kv)
        group, ctl = hpa.build_hybrid_swa_stack(
            params=cache_params(rank), full_kv_pool=kv.full_kv_pool, swa_kv_pool=kv.swa_kv_pool,
            full_layer_mapping=full_map, swa_layer_mapping=swa_map, load_cache_event=None,
            storage_backend=None, use_mla=False)
        pools = {"full": group.get_pool(PoolName.KV), "swa": group.get_pool(PoolName.SWA)}
        maps = {"full": full_map, "swa": swa_map}
    else:
        strategy = hpa._PlainKvStrategy()
        result = strategy.build(cache=None, kvcache=kv, params=cache_params(rank), server_args=None,
                                load_cache_event=None)
        group, ctl = result.host_pool_group, result.cache_controller
        pools = {"kv": group.get_pool(PoolName.KV)}
        maps = {"kv": {i: i for i in range(kv.layer_num)}}
    return pools, maps, ctl.transfer_layer_id_max if hasattr(ctl, "transfer_layer_id_max") else None
