"""Build sglang 0.5.23's own DeepSeek-V4 pools on CPU, the way a server does (for the live tests).

A resolved ``ServerArgs`` for a local folder holding the real flash ``config.json``
(44 ``compress_ratios``: 43 layers + the MTP placeholder) is published through
sglang's ``RuntimeContext``; sglang's ``ModelConfig``, ``KVCacheConfigurator``,
``DSV4PoolConfigurator`` and ``_init_pools`` then size and build the request pool,
the ``DeepSeekV4TokenToKVPool`` and its allocator exactly as ``ModelRunner`` does.
``device="meta"`` gives real shapes and ``nbytes`` without allocating, so full-size
pools are measured in milliseconds.

Two stand-ins, both for CUDA-only pieces, and only where a test runs the HiCache
assembler to the end (``cpu_hicache``): ``cudaHostRegister`` (pinning host pages)
becomes a no-op, and ``HybridCacheController`` (CUDA streams) a recorder.  The
``pp_group`` handed to ``KVCacheConfigurator`` is read only for a log line under PP.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sglang.srt import runtime_context
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.utils import get_pp_indices
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.mem_cache.pool_host import common as host_common
from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
from sglang.srt.runtime_context import get_schedule
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "runtime" / "model" / "presets"
PARTITION_ENV = "SGLANG_PP_LAYER_PARTITION"

#: sglang's HiCache pool names -> stagecache's pool kinds.
SGLANG_POOL_NAMES = {
    "swa": "swa", "deepseek_v4_c4": "c4", "deepseek_v4_c4_indexer": "indexer",
    "deepseek_v4_c128": "c128", "deepseek_v4_c4_state": "c4_state",
    "deepseek_v4_c4_indexer_state": "c4_indexer_state",
}


def raw_ratios(preset: str) -> list[int]:
    """The preset's ``compress_ratios`` as the config has them (MTP placeholder included)."""
    return json.loads((PRESETS / f"{preset}.json").read_text())["compress_ratios"]


def model_dir(tmp: Path, preset: str = "deepseek-v4-flash") -> Path:
    """A model folder sglang can resolve offline: just the real ``config.json``."""
    folder = tmp / preset
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text((PRESETS / f"{preset}.json").read_text())
    return folder


@contextmanager
def partition_env(partition):
    old = os.environ.get(PARTITION_ENV)
    if partition is None:
        os.environ.pop(PARTITION_ENV, None)
    else:
        os.environ[PARTITION_ENV] = ",".join(map(str, partition))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(PARTITION_ENV, None)
        else:
            os.environ[PARTITION_ENV] = old


@contextmanager
def published(folder: Path, **server_args: Any):
    """A resolved ``ServerArgs`` for ``folder``, published for the block, then the previous one back."""
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


def build_stage(sa: ServerArgs, mc: ModelConfig, rank: int, pp_size: int, device: str = "meta",
                budget_bytes: int | None = None) -> Stage:
    """sglang's sizing and pool construction for one rank (``ModelRunner``'s steps, in order)."""
    kvc = kv_cache_configurator(sa, mc, rank, pp_size, _PPGroup(), device)
    configurator = create_memory_pool_configurator(kvc)
    page = get_schedule().page_size
    if budget_bytes is None:
        config = configurator.calculate_pool_sizes_from_max_tokens(get_schedule().max_total_tokens, page)
    else:
        config = configurator.calculate_pool_sizes(budget_bytes, page)
    config.max_running_requests = kvc.resolve_max_num_reqs(config.max_total_num_tokens)
    config = configurator.finalize_with_max_running_requests(config)
    pools = kvc._init_pools(sizes=kvc._derive_pool_sizes(config=config), req_to_token_pool=None,
                            token_to_kv_pool_allocator=None)
    return Stage(rank, config, pools.token_to_kv_pool, pools.token_to_kv_pool_allocator,
                 pools.req_to_token_pool, configurator)


def kind_tensors(kv: Any) -> dict[str, list[torch.Tensor]]:
    """Per stagecache pool kind, the tensors sglang's pool holds for the stage."""
    def states(attr: str, ratio: int) -> list[torch.Tensor]:
        pools = getattr(kv, attr)[kv.start_layer:kv.end_layer]
        return [p.kv_score_buffer.kv_score for p in pools if p is not None and p.ratio == ratio]

    return {
        "swa": list(kv.swa_kv_pool.kv_buffer),
        "c4": list(kv.c4_kv_pool.kv_buffer),
        "c128": list(kv.c128_kv_pool.kv_buffer),
        "c4_state": states("compress_state_pools", 4),
        "c128_state": states("compress_state_pools", 128),
        "indexer": list(kv.c4_indexer_kv_pool.index_k_with_scale_buffer),
        "c4_indexer_state": states("indexer_compress_state_pools", 4),
    }


def kind_page_bytes(kv: Any) -> dict[str, int]:
    """Bytes of one page (a request slot for C128 state) per kind, as sglang's objects give them."""
    def state_page(attr: str, ratio: int) -> int:
        pool = next(p for p in getattr(kv, attr)[kv.start_layer:kv.end_layer] if p is not None and p.ratio == ratio)
        return pool.ring_size * pool.kv_score_buffer.kv_score[0].nbytes  # DeepSeekV4StateHostPool's rule

    return {
        "swa": kv.swa_kv_pool.bytes_per_page_padded,
        "c4": kv.c4_kv_pool.bytes_per_page_padded,
        "c128": kv.c128_kv_pool.bytes_per_page_padded,
        "c4_state": state_page("compress_state_pools", 4),
        "c128_state": state_page("compress_state_pools", 128),
        "indexer": kv.c4_indexer_kv_pool.index_k_with_scale_buffer[0][0].nbytes,
        "c4_indexer_state": state_page("indexer_compress_state_pools", 4),
    }


def cache_params(stage: Stage) -> CacheInitParams:
    return CacheInitParams(disable=False, req_to_token_pool=stage.req_to_token_pool,
                           token_to_kv_pool_allocator=stage.allocator, page_size=get_schedule().page_size)


def host_pages(stage: Stage) -> tuple[int, int, int]:
    """sglang's ``(full, swa, c128)`` host pages for the stage (its own function)."""
    kv = stage.kvcache
    return hpa._deepseek_v4_num_host_pages(params=cache_params(stage), kvcache=kv,
                                           page_size=get_schedule().page_size, swa_page_size=kv.swa_page_size)


class RecordingController:
    """Stands in for ``HybridCacheController`` (CUDA streams) and keeps what it was given."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs
        self.ack_write_queue, self.ack_load_queue = [], []

    def start_writing(self) -> None:
        pass

    def start_loading(self) -> int:
        return 0


@contextmanager
def cpu_hicache(monkeypatch):
    """Let ``build_deepseek_v4_hicache_stack`` run to the end on a CPU machine (see module docstring)."""
    with monkeypatch.context() as m:
        m.setattr(host_common, "_cuda_host_register", lambda *a, **k: None)
        m.setattr(hpa, "HybridCacheController", RecordingController)
        yield
