"""Resource checks that run before any pool is allocated: all of a host's stages, against its RAM.

A stage process can only check its own pools; the stages of one host share its
RAM, so ``serve`` (and ``bench hicache``, which builds one stage after another)
check the sum here first, from the run's plan alone: nothing is allocated, and the
error names the flags the user typed with values that fit (``host_tier.fit_advice``).  The rule is ``host_tier``'s:
``MemAvailable - bytes to allocate >= reserve``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError
from ..plan.plan import RunPlan, Sizing, StagePlan
from .host_tier import MemInfo, NeedFn, fit_advice, fmt_bytes, ram_budget, read_meminfo


def stages_ram_need(plan: RunPlan, device_in_ram: bool, stages: Sequence[int] | None = None) -> NeedFn:
    """Bytes of RAM the plan's stages (all, or ``stages``) take for (device pages, hicache ratio).

    Host (HiCache) pools always live in RAM; device pools too when they are on the CPU.
    The plan is re-sized for every candidate (same layer maps and buffers).
    """
    ranks = range(plan.pp_size) if stages is None else stages

    def need(pages: int, ratio: float) -> int:
        sizing = Sizing.runtime(pages, request_slots=plan.sizing.request_slots, hicache_ratio=ratio)
        resized = plan.resized(sizing)
        return sum(_ram_bytes(resized.stage(i), device_in_ram) for i in ranks)

    return need


def _ram_bytes(stage: StagePlan, device_in_ram: bool) -> int:
    return stage.host_bytes + (stage.device_bytes if device_in_ram else 0)


def check_ram(need: NeedFn, pages: int, ratio: float, what: str, *, min_pages: int = 1,
              pages_flag: str = "--device-pages", pages_scale: int = 1,
              mem: MemInfo | None = None) -> int:
    """Refuse (ConfigError, one line) when ``need(pages, ratio)`` does not fit this host's RAM.

    ``what`` names the pools in the message (``"the 4 stages' host pools"``); the advice
    names ``--hicache-ratio`` and ``pages_flag`` with the largest values that fit (pages
    not below ``min_pages``, what the trace needs).  Returns the bytes needed.
    """
    mem = mem if mem is not None else read_meminfo()
    need_bytes = need(pages, ratio)
    if mem is None or need_bytes <= ram_budget(mem):
        return need_bytes
    budget = ram_budget(mem)
    hint = fit_advice(need, budget, pages, ratio, min_pages, pages_flag, pages_scale)
    raise ConfigError(
        f"{what} need {fmt_bytes(need_bytes)} of RAM, only {fmt_bytes(budget)} available "
        f"({fmt_bytes(mem.available)} less the {fmt_bytes(mem.reserve())} reserve); {hint}"
    )
