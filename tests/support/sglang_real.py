"""sglang 0.5.23's own DeepSeek-V4 pools on CPU for the live tests, and what the tests read of them.

The building (``published``, ``build_stage``, ``cache_params``, ``on_cpu``) is the runtime's
``stagecache.runtime.integrations.sglang.cpu_stage``, which the ``bench sglang-hooks``
benchmark uses too; this module adds the tests' views: each pool kind's tensors and page
bytes as sglang's objects give them, sglang's host page counts, the partition variable.
``on_cpu`` runs the HiCache assembler to the end on a CPU machine, with sglang's real
``HybridCacheController``: pinning host pages is a no-op there and copies run in torch.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
from sglang.srt.runtime_context import get_schedule
from stagecache.runtime.integrations.sglang.cpu_stage import (  # noqa: F401 - the tests import these from here
    AckLedger,
    Stage,
    build_stage,
    cache_params,
    kv_cache_configurator,
    model_dir,
    on_cpu,
    published,
    round_trip,
)

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


def host_pages(stage: Stage) -> tuple[int, int, int]:
    """sglang's ``(full, swa, c128)`` host pages for the stage (its own function)."""
    kv = stage.kvcache
    return hpa._deepseek_v4_num_host_pages(params=cache_params(stage), kvcache=kv,
                                           page_size=get_schedule().page_size, swa_page_size=kv.swa_page_size)


@contextmanager
def sglang_restored():
    """Undo, on exit, every hook sglang's ``HookRegistry`` applied to the deployment's targets
    meanwhile: sglang has no way to unapply hooks, and the tests after this one must see sglang's
    functions as they ship."""
    import pkgutil
    import sys

    from sglang.srt.plugins.hook_registry import HookRegistry
    from stagecache.runtime.integrations.sglang.deployment import TARGETS

    def owner_and_raw(target: str) -> tuple[Any, str, Any]:
        path, attr = target.rsplit(".", 1)
        owner = pkgutil.resolve_name(path)
        return owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)

    originals = {t: owner_and_raw(t) for t in TARGETS.values()}
    try:
        yield
    finally:
        for target, (owner, attr, raw) in originals.items():
            wrapped = owner_and_raw(target)[2]
            setattr(owner, attr, raw)
            for module in list(sys.modules.values()):  # the ``from X import f`` copies sglang patched
                names = [n for n, v in getattr(module, "__dict__", {}).items() if v is wrapped]
                for name in names:
                    setattr(module, name, raw)
        HookRegistry.reset()


@contextmanager
def hooks_applied(deployment: Any):
    """``deployment``'s hooks registered and applied by sglang's own ``HookRegistry`` (what
    ``load_plugins`` does in a server), undone on exit (``sglang_restored``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    with sglang_restored():
        deployment.register()
        HookRegistry.apply_hooks()
        try:
            yield deployment
        finally:
            deployment.close()
