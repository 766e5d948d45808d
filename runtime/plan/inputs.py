"""The run's raw inputs -- model, PP/TP sizes, partition, page size, sizing, faults -- resolved
into one checked plan at the boundary.

Every entry point (CLI commands, benchmarks, ``serve``) names the same few inputs; this is the
one function that turns them into a ``RunPlan``, so a bad value is the same ``ConfigError``
(exit 2) whichever command received it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .. import defaults
from ..model.families import load_spec
from ..model.partition import parse_partition
from .faults import parse_faults
from .plan import RunPlan, Sizing, build_plan


def resolve_plan(
    model: str,
    pp_size: int = defaults.PP_SIZE,
    tp_size: int = defaults.TP_SIZE,
    pp_partition: str | Sequence[int] | None = None,
    page_size: int = defaults.PAGE_SIZE,
    faults: Iterable[str] | None = None,
    sizing: Sizing | None = None,
    kv_cache_dtype: str = "auto",
) -> RunPlan:
    """Load the spec, partition with sglang's rules, size the pools, apply the faults."""
    spec = load_spec(model)
    spec = spec.family.with_kv_cache_dtype(spec, kv_cache_dtype)
    return build_plan(spec, pp_size, tp_size=tp_size, partition=parse_partition(pp_partition),
                      page_size=page_size, sizing=sizing, faults=parse_faults(faults, pp_size, spec.family))
