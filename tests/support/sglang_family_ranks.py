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

``FAMILIES`` gives each family's preset, ``ServerArgs`` and budget (the runtime's
``cpu_stage.FAMILY_MODELS``); ``gates`` answers the two questions sglang asks a GPU while its
arguments resolve (set in the test process before the ranks fork, so every rank inherits them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from stagecache.runtime.integrations.sglang.cpu_stage import (
    FAMILY_MODELS,
    family_configurator,
    family_stack,
)
from stagecache.runtime.integrations.sglang.cpu_stage import gpu_gates as gates  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class FamilyCase:
    """One family's model for the live tests: preset, server arguments, KV budget per rank, and
    its seeded fault."""

    family: str
    preset: str
    fault: str
    server: dict[str, Any]
    budget: int = 16 << 20


_FAULTS = {"linear_hybrid": "unsplit-mamba", "dsa": "global-dsa", "swa_hybrid": "global-swa-subpool"}
FAMILIES = {name: FamilyCase(name, m.preset, _FAULTS[name], m.server) for name, m in FAMILY_MODELS.items()
            if name in _FAULTS}
#: A dense model (one MHA pool: the assembler's ``_PlainKvStrategy``), healthy only.
DENSE = FamilyCase("mha", FAMILY_MODELS["mha"].preset, "", FAMILY_MODELS["mha"].server)


def _inject(fault: str | None) -> None:
    """The bug's pool build, in this rank's process only (sglang's configurator is slotted: its
    class is patched, in the rank's own forked process)."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo

    if fault == "unsplit-mamba":  # every Mamba layer of the model, on every stage (#21448)
        KVCacheConfigurator._get_mamba_layer_ids_for_req_pool = \
            lambda self: list(self.mambaish_config.mamba2_cache_params.layers)
    elif fault == "global-dsa":  # the DSA pool over the whole model's layers
        build = KVCacheConfigurator._build_dsa_kv_pool

        def whole_model(self: Any, **kw: Any) -> Any:
            saved, n = self.layer_info, self.model_config.num_hidden_layers
            self.layer_info = ModelLayerInfo(start_layer=0, end_layer=n, num_effective_layers=n)
            try:
                return build(self, **kw)
            finally:
                self.layer_info = saved

        KVCacheConfigurator._build_dsa_kv_pool = whole_model


def build_family(rank: int, pp: int, budget: int) -> tuple[Any, Any]:
    """The rank's pools sized from ``budget`` (MIN over the ranks) and its HiCache stack, built by
    the assembler's own strategy (hooked by the plugin: the record exchange runs inside)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import get_pp_group
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_server_args

    sa = get_server_args()
    mc = ModelConfig.from_server_args(sa)
    fault = os.environ.get("STAGECACHE_TEST_FAULT")
    swa = list(mc.swa_attention_layer_ids) if fault == "global-swa-subpool" else None  # the whole model's list
    _inject(fault)
    kvc = family_configurator(sa, mc, rank, pp, get_pp_group(), "cpu", swa_layers=swa)
    config = kvc.config_from_budget(budget)  # -> _apply_token_constraints: MIN over the ranks
    config.max_running_requests = kvc.resolve_max_num_reqs(config.max_total_num_tokens)
    config = create_memory_pool_configurator(kvc).finalize_with_max_running_requests(config)
    pools = kvc._init_pools(sizes=kvc._derive_pool_sizes(config=config), req_to_token_pool=None,
                            token_to_kv_pool_allocator=None)
    if not sa.enable_hierarchical_cache:
        return pools, None
    result = family_stack(pools, sa)
    return pools, (result.host_pool_group, result.cache_controller)
