"""``bench transfer``'s resource check: the largest case must fit the host's RAM before any pool exists.

Each case builds a device pool and a host mirror of ``pages + slack`` token pages
(``transfer._Pages``) and, for the ceiling, a device and a host buffer of the moved bytes, all
alive while the case is timed (its techniques are sampled in interleaved rounds), one case at a
time; on the CPU the device side lives in RAM too.  The
check prices them from the case's plan (no memory) and
refuses with the flag that made the case (``--mix-pages`` or ``--kind-mib``)
and the largest value of it that fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..memory.host_tier import fmt_bytes, largest_fitting, ram_budget, read_meminfo
from .transfer_report import MIB


def case_slack(pages: int) -> int:
    """Spare pages around a case's moved pages (scattered ids need room)."""
    return max(8, pages // 4)


def _page_bytes(case: Any, page_size: int) -> int:
    return case.stage_plan(1).token_page_bytes


def check_cases_ram(cases: Sequence[Any], page_size: int, device_in_ram: bool) -> None:
    """ConfigError (one line, a flag and a value that fits) when a case cannot fit in RAM."""
    mem = read_meminfo()
    if mem is None or not cases:
        return
    budget = ram_budget(mem)
    copies = 2 if device_in_ram else 1  # the host side, and the device side when it is in RAM

    def need(case: Any, pages: int) -> int:  # pools of pages + slack, ceiling buffers of pages
        return (2 * pages + case_slack(pages)) * _page_bytes(case, page_size) * copies

    for case in sorted(cases, key=lambda c: -c.pages):
        n = need(case, case.pages)
        if n <= budget:
            continue
        fit = largest_fitting(lambda p, c=case: need(c, p) <= budget, 1, case.pages - 1)
        if case.kinds is None:
            hint = f"lower --mix-pages to {fit}" if fit else "no page count fits"
        else:
            per_page = _page_bytes(case, page_size)
            mib = (fit or 0) * per_page / MIB
            hint = f"lower --kind-mib to {mib:.1f}" if fit else "no size fits"
        raise ConfigError(f"bench transfer case {case.name}: {case.pages} pages need {fmt_bytes(n)} of "
                          f"RAM, only {fmt_bytes(budget)} available ({fmt_bytes(mem.available)} less "
                          f"the {fmt_bytes(mem.reserve())} reserve); {hint}")
