"""sglang 0.5.23's own pools of the one-pool families (DSA, dense MLA, MHA) on CPU, for the live tests.

``published`` (the runtime's ``cpu_stage``) resolves a real ``ServerArgs`` for a preset's real
``config.json``; ``build_family_stage`` then runs ``ModelRunner``'s sizing and pool steps for
one PP rank with sglang's ``KVCacheConfigurator`` and ``DefaultPoolConfigurator``, and
``host_stack`` runs the HiCache assembler's own strategy (``_DsaStrategy`` /
``_PlainKvStrategy``) on the result.  Two things a CPU machine lacks are supplied, nothing else:

* sglang's DSA defaults ask ``torch.cuda.get_device_capability()``; ``on_h100`` answers 9.0
  (an H100), under which sglang 0.5.23 keeps DSA's KV cache in BF16;
* the MHA pool asks torch for the device module of its tensors' device; on ``meta`` tensors
  ``meta_device_module`` supplies the CPU one.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sglang.srt.distributed.utils import get_pp_indices
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
from sglang.srt.runtime_context import get_schedule
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from stagecache.runtime.cli.main import main
from stagecache.runtime.integrations.sglang.cpu_stage import (
    _PPGroup,
    cache_params,
    model_dir,
    size_pools,
)

#: ``--kv-cache-dtype`` -> the torch dtype ``ModelRunner`` gives the pools (the presets are BF16).
KV_DTYPES = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "fp8_e4m3": torch.float8_e4m3fn}


def layout_ids(layouts: list[tuple[str, int, tuple[int, ...] | None]]) -> list[str]:
    """Test ids of ``(model, pp, partition)`` layouts: ``model-ppN-`` and the partition or ``even``."""
    return [f"{m}-pp{pp}-" + (",".join(map(str, p)) if p else "even") for m, pp, p in layouts]


def model_dirs(root: Path, *models: str) -> dict[str, Path]:
    """The presets' model folders sglang resolves offline, sglang's logging at WARNING."""
    logging.getLogger("sglang").setLevel(logging.WARNING)
    return {m: model_dir(root, m) for m in models}


def pools_json(capsys, model: str, pp: int, partition, page: int, *extra: str) -> dict:
    """``stagecache pools --json`` for one layout, parsed."""
    argv = ["pools", "--model", model, "--pp-size", str(pp), "--page-size", str(page), "--json", *extra]
    if partition:
        argv += ["--pp-partition", ",".join(map(str, partition))]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@contextlib.contextmanager
def on_h100() -> Iterator[None]:
    """``torch.cuda.get_device_capability`` answers 9.0 for the block (what sglang's DSA defaults read)."""
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


@contextlib.contextmanager
def meta_device_module() -> Iterator[None]:
    """``torch.get_device_module("meta")`` gives the CPU module for the block."""
    saved = torch.get_device_module

    def module(device: Any = None) -> Any:
        if str(device) == "meta" or getattr(device, "type", None) == "meta":
            return torch.cpu
        return saved(device)

    torch.get_device_module = module
    try:
        yield
    finally:
        torch.get_device_module = saved


@dataclass
class FamilyStage:
    """One PP rank's pools as sglang builds them."""

    rank: int
    start: int
    end: int
    config: Any  # MemoryPoolConfig
    kvcache: Any  # DSATokenToKVPool / MLATokenToKVPool / MHATokenToKVPool
    allocator: Any
    req_to_token_pool: Any
    configurator: Any


def build_family_stage(sa: Any, mc: Any, rank: int, pp_size: int, device: str = "meta",
                       budget_bytes: int | None = None) -> FamilyStage:
    """sglang's sizing and pool construction for one rank (``ModelRunner``'s steps, in order)."""
    start, end = get_pp_indices(mc.num_hidden_layers, rank, pp_size)
    page = get_schedule().page_size
    dtype = KV_DTYPES[sa.kv_cache_dtype]
    kvc = KVCacheConfigurator(
        device=device, gpu_id=0, attn_dp_size=1, pp_size=pp_size, pp_group=_PPGroup(), model=None,
        model_config=mc, server_args=sa, kv_cache_dtype=dtype, kv_cache_dtype_str=sa.kv_cache_dtype,
        model_dtype=torch.bfloat16, page_size=page, sliding_window_size=None,
        spec_algorithm=SpeculativeAlgorithm.from_string(None), is_draft_worker=False,
        post_capture_kv_active=False, spec_aux_config=None, is_hybrid_swa=False, is_hybrid_swa_compress=False,
        use_mla_backend=mc.attention_arch.name == "MLA",
        layer_info=ModelLayerInfo(start_layer=start, end_layer=end, num_effective_layers=end - start),
        forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None,
    )
    configurator, config = size_pools(kvc, budget_bytes)
    with meta_device_module():
        pools = kvc._init_pools(sizes=kvc._derive_pool_sizes(config=config), req_to_token_pool=None,
                                token_to_kv_pool_allocator=None)
    return FamilyStage(rank, start, end, config, pools.token_to_kv_pool, pools.token_to_kv_pool_allocator,
                       pools.req_to_token_pool, configurator)


def host_stack(stage: FamilyStage) -> Any:
    """The host pool group sglang's HiCache assembler builds for the stage (its own strategy)."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
    from sglang.srt.runtime_context import get_server_args

    kv = stage.kvcache
    params = cache_params(stage)
    strategy = next(s for s in hpa._STRATEGIES if s.matches(kv, {hpa.ComponentType.FULL}))
    result = strategy.build(cache=None, kvcache=kv, params=params, server_args=get_server_args(),
                            load_cache_event=None)
    return strategy, result
