"""Resource checks that run before any pool is allocated: all of a host's stages, against its RAM.

A stage process can only check its own pools; the stages of one host share its
RAM, so ``serve`` (and ``bench hicache``, which builds one stage after another)
check the sum here first, from the pool-kind table and the sizing rules alone:
nothing is allocated, and the error names the flags the user typed with values
that fit (``host_tier.fit_advice``).  The rule is ``host_tier``'s:
``MemAvailable - bytes to allocate >= reserve``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import ConfigError
from ..model.pool_kinds import KindTable
from .host_tier import MemInfo, NeedFn, fit_advice, fmt_bytes, ram_budget, read_meminfo
from .sizing import budget_bytes, runtime_budget


def stages_ram_need(table: KindTable, stage_counts: Sequence[Mapping[str, int]], request_slots: int,
                    device_in_ram: bool) -> NeedFn:
    """Bytes of RAM the stages' pools take for (device pages, hicache ratio).

    Host (HiCache) pools always live in RAM; device pools too when they are on the CPU.
    The runtime's page space: SWA pages == full pages (``swa_ratio`` 1.0).
    """
    def need(pages: int, ratio: float) -> int:
        budget = runtime_budget(table.page_size, pages, 1.0, request_slots)
        total = 0
        for counts in stage_counts:
            total += budget_bytes(table, counts, budget, ratio, host=True)
            if device_in_ram:
                total += budget_bytes(table, counts, budget)
        return total

    return need


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
