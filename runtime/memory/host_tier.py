"""Host-tier sanity: is a stage's host (HiCache) tier sized sanely for its device tier and this host?

Three statuses (``smaller_than_device``, ``pin_refused``: warnings; ``exceeds_ram``: not ready)
and one RAM rule before and after allocation, ``MemAvailable - bytes not yet allocated >=
reserve``: before allocation it refuses the configuration naming values that fit, once the tiers
are resident it catches a host running short (the OOM killer is next).  docs/pools.md,
"Host-tier sanity", has the table.  Everything here is pure except reading ``/proc/meminfo``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import ConfigError

#: Share of ``MemTotal`` the host tiers must leave available (page cache, the stage
#: processes themselves, everything else on the host).
RAM_RESERVE_FRACTION = 0.05
#: How often a stage re-reads ``/proc/meminfo`` while it runs (one small file read).
RAM_CHECK_INTERVAL_S = 2.0

OK = "ok"
SMALLER_THAN_DEVICE = "smaller_than_device"
EXCEEDS_RAM = "exceeds_ram"
PIN_REFUSED = "pin_refused"
#: Every status, in the order they are reported.
HOST_TIER_STATUSES: tuple[str, ...] = (OK, SMALLER_THAN_DEVICE, PIN_REFUSED, EXCEEDS_RAM)
#: Statuses that make the run not ready (/readyz 503); the others are warnings in its detail.
NOT_READY_STATUSES: frozenset[str] = frozenset({EXCEEDS_RAM})


@dataclass(frozen=True)
class MemInfo:
    """The two ``/proc/meminfo`` figures the checks use, in bytes."""

    available: int
    total: int

    def reserve(self, fraction: float = RAM_RESERVE_FRACTION) -> int:
        return int(self.total * fraction)


def read_meminfo(path: str = "/proc/meminfo") -> MemInfo | None:
    """``MemAvailable`` and ``MemTotal`` (None where the file or a field is missing)."""
    found: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(found) < 2:
        return None
    return MemInfo(available=found["MemAvailable"], total=found["MemTotal"])


def fmt_bytes(n: float) -> str:
    """Binary units, one decimal (messages)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def ram_shortfall(pending_bytes: int, mem: MemInfo | None,
                  reserve_fraction: float = RAM_RESERVE_FRACTION) -> int:
    """Bytes by which ``pending_bytes`` (not yet allocated) overrun the RAM left above the reserve."""
    if mem is None:
        return 0
    return max(0, pending_bytes + mem.reserve(reserve_fraction) - mem.available)


def ram_budget(mem: MemInfo, reserve_fraction: float = RAM_RESERVE_FRACTION) -> int:
    """Bytes that may still be allocated on this host: available minus the reserve."""
    return max(0, mem.available - mem.reserve(reserve_fraction))


@dataclass(frozen=True)
class HostTierCheck:
    """A stage's host-tier verdict: the statuses that hold and one line of reason for each."""

    statuses: tuple[str, ...]
    reasons: tuple[str, ...]

    @property
    def ready(self) -> bool:
        return not set(self.statuses) & NOT_READY_STATUSES

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(r for s, r in zip(self.statuses, self.reasons, strict=True)
                     if s != OK and s not in NOT_READY_STATUSES)

    @property
    def errors(self) -> tuple[str, ...]:
        return tuple(r for s, r in zip(self.statuses, self.reasons, strict=True)
                     if s in NOT_READY_STATUSES)


def _smaller(where: str, device_pages: Mapping[str, int], host_pages: Mapping[str, int],
             write_policy: str | None) -> str | None:
    short = sorted((k, device_pages[k], host_pages[k]) for k in host_pages
                   if host_pages[k] < device_pages.get(k, 0))
    if not short:
        return None
    kind, dev, host = short[0]
    kinds = ", ".join(k for k, _, _ in short)
    why = (f"under {write_policy} {dev - host} device pages can never be mirrored"
           if write_policy == "write_through" else "the host tier adds less than the device tier holds")
    return (f"{where}: host tier smaller than the device tier: {host} host pages for {dev} device "
            f"pages ({kinds}); {why}; raise --hicache-ratio to at least 1")


def host_tier_check(where: str, device_pages: Mapping[str, int], host_pages: Mapping[str, int],
                    pending_bytes: int, mem: MemInfo | None, pin_error: str | None = None,
                    write_policy: str | None = None,
                    reserve_fraction: float = RAM_RESERVE_FRACTION) -> HostTierCheck:
    """The verdict for one stage (``where`` names it in the reasons).

    ``device_pages``/``host_pages``: pages (of the kind's own budget) per host-cached kind;
    ``pending_bytes``: bytes of this host's pools not yet allocated (0 once they are);
    ``mem``: the host's meminfo now (None: unknown, the RAM rule is not applied).
    """
    statuses, reasons = [], []
    smaller = _smaller(where, device_pages, host_pages, write_policy)
    if smaller:
        statuses.append(SMALLER_THAN_DEVICE)
        reasons.append(smaller)
    if pin_error:
        statuses.append(PIN_REFUSED)
        reasons.append(f"{where}: pinned host memory refused ({pin_error}); the host tier uses "
                       "pageable memory, so transfers take the synchronous path")
    if mem is not None and ram_shortfall(pending_bytes, mem, reserve_fraction):
        statuses.append(EXCEEDS_RAM)
        reserve = (f"{fmt_bytes(mem.reserve(reserve_fraction))} reserve ({reserve_fraction:.0%} of "
                   f"{fmt_bytes(mem.total)} MemTotal)")
        if pending_bytes:
            why = f"the host tier needs {fmt_bytes(pending_bytes)} more and the {reserve} stays free"
        else:
            why = f"below the {reserve} with the host tier resident"
        reasons.append(f"{where}: host RAM short: {fmt_bytes(mem.available)} available, {why}")
    if not statuses:
        statuses.append(OK)
        reasons.append(f"{where}: ok")
    return HostTierCheck(tuple(statuses), tuple(reasons))


class RamWatch:
    """``/proc/meminfo`` re-read at most every ``interval`` seconds: cheap enough for every publish."""

    def __init__(self, interval: float = RAM_CHECK_INTERVAL_S, path: str = "/proc/meminfo",
                 reserve_fraction: float = RAM_RESERVE_FRACTION,
                 clock: Callable[[], float] = time.monotonic):
        self.interval, self.path, self.clock = interval, path, clock
        self.reserve_fraction = reserve_fraction
        self._last: tuple[float, MemInfo | None] | None = None
        #: unix time of the last read
        self.checked_at = 0.0

    def read(self) -> MemInfo | None:
        now = self.clock()
        last = self._last
        if last is None or now - last[0] >= self.interval:
            last = (now, read_meminfo(self.path))
            self._last = last
            self.checked_at = time.time()
        return last[1]


# -- what fits: the values an error suggests ------------------------------------------------------

#: bytes the host's pools need for (device pages, hicache ratio); ConfigError = not a valid size
NeedFn = Callable[[int, float], int]


def _fits(need: NeedFn, budget: int, pages: int, ratio: float) -> bool:
    try:
        return need(pages, ratio) <= budget
    except ConfigError:
        return False


def largest_fitting(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """Largest ``x`` in ``[lo, hi]`` with ``ok(x)`` (``ok`` monotone: true up to a point)."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def fitting_ratio(need: NeedFn, budget: int, pages: int, ratio: float) -> float | None:
    """Largest ``--hicache-ratio`` below ``ratio`` (in steps of 0.01) that fits, pages unchanged."""
    hi = int(round(ratio * 100)) - 1
    lo = max(1, -(-100 // max(1, pages)))  # a ratio under 1/pages gives no host page at all
    k = largest_fitting(lambda k: _fits(need, budget, pages, k / 100), lo, hi)
    return None if k is None else k / 100


def fitting_pages(need: NeedFn, budget: int, pages: int, ratio: float, min_pages: int = 1) -> int | None:
    """Largest device-page count below ``pages`` (and >= ``min_pages``) that fits, ratio unchanged."""
    lo = max(min_pages, math.ceil(1 / ratio) if ratio > 0 else min_pages)  # >= one host page
    return largest_fitting(lambda p: _fits(need, budget, p, ratio), lo, pages - 1)


def fit_advice(need: NeedFn, budget: int, pages: int, ratio: float, min_pages: int = 1,
               pages_flag: str = "--device-pages", pages_scale: int = 1,
               ratio_flag: str | None = "--hicache-ratio") -> str:
    """``lower --hicache-ratio to 1.5 or --device-pages to 48``: real flags, values that fit.

    ``pages_scale`` turns pages into the flag's unit (tokens per page for ``--max-total-tokens``).
    """
    options = []
    if ratio_flag:
        r = fitting_ratio(need, budget, pages, ratio)
        if r is not None:
            options.append(f"{ratio_flag} to {r:g}")
    p = fitting_pages(need, budget, pages, ratio, min_pages)
    if p is not None:
        options.append(f"{pages_flag} to {p * pages_scale}")
    if options:
        return "lower " + " or ".join(options)
    flags = f"{ratio_flag} and {pages_flag}" if ratio_flag else pages_flag
    return f"no smaller {flags} fits this host: free memory or use a larger host"
