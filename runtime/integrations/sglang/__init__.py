"""stagecache for a live sglang pool of any family it models: inspect, validate, export.

sglang builds one KV pool per PP rank and hands it to the HiCache assembler; the PP + HiCache bug
stagecache exists for lived exactly between those two: the pool and the host stack disagreed
about how many layers a stage owns.  ``reader`` reads a real pool into stagecache's types and
validates it like ``stagecache check``; ``deployment`` makes a served PP deployment one
instrument (the ``sglang_plugin`` entry point: hooks, record exchange, one endpoint, sglang's
own numbers).

Tested against sglang 0.5.22 and 0.5.23 (``SGLANG_TESTED_VERSIONS``; ``pip install '.[sglang]'``
in a checkout); see docs/sglang.md.
"""

from __future__ import annotations

try:  # the integration is optional; the core package never imports sglang
    import sglang.srt.distributed.utils  # noqa: F401
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in the no-sglang environment
    raise ImportError(
        "stagecache.runtime.integrations.sglang needs sglang: pip install '.[sglang]' in a "
        "stagecache checkout "
        f"(import failed: {exc})"
    ) from exc

from . import deployment
from .deployment import (
    PLUGIN_ENV,
    SGLANG_TESTED_VERSIONS,
    Deployment,
    DeploymentOptions,
    sglang_plugin,
)
from .rank_source import SglangSource
from .reader import (
    PARTITION_ENV,
    PoolView,
    inspect_pool,
    inspect_pools,
    model_num_layers,
    partition_findings,
    pool_family,
    read_family_pool,
    read_pool,
    sglang_partition,
)

__all__ = [
    "PARTITION_ENV", "PLUGIN_ENV", "SGLANG_TESTED_VERSIONS", "Deployment", "DeploymentOptions", "PoolView",
    "SglangSource", "deployment", "inspect_pool", "inspect_pools", "model_num_layers",
    "partition_findings", "pool_family", "read_family_pool", "read_pool", "sglang_partition", "sglang_plugin",
]
