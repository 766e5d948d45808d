"""Families of a stage's cache insight and of the stages' agreement (``families.LIVE_FAMILIES``).

Miss reasons and sampled tier lifetimes come from ``cache/insight.py``; the
per-request comparison of the stages' cache decisions from ``serve/agreement.py``.
"""

from __future__ import annotations

from collections.abc import Callable

from stagecache.runtime.cache.insight import INSIGHT_TIERS, MISS_REASONS, SampledHistogram
from stagecache.runtime.live.numbers import DECISION_NAMES, DECISIONS, StageLive

from .family import Family, Samples, cumulative_buckets, one, per

INSIGHT_LABELS: dict[str, str] = {
    "kind": "stage-disagreement kind: " + "; ".join(f"`{k}`: {v}" for k, v in DECISIONS.items()),
    "reason": "why prompt tokens missed a tier (docs/hicache.md, miss reasons): "
              + ", ".join(f"`{r}`" for r in MISS_REASONS),
}
INSIGHT_LABEL_VALUES: dict[str, tuple[str, ...]] = {"kind": DECISION_NAMES, "reason": MISS_REASONS}


def _sampled(name: str) -> Callable[[StageLive, str], tuple[list[tuple[str, float]], float]]:
    """A tier's sampled histogram ``name`` as cumulative buckets; only +Inf when none kept."""
    def samples(s: StageLive, tier: str) -> tuple[list[tuple[str, float]], float]:
        h: SampledHistogram = getattr(getattr(s.insight, tier), name)
        return cumulative_buckets(h.le, h.counts, 0), h.sum
    return samples


def _miss_reasons(s: StageLive) -> Samples:
    return [((t, r), s.insight.miss_tokens.get(t, {}).get(r, 0)) for t in INSIGHT_TIERS for r in MISS_REASONS]


_SAMPLED = " Sampled: the entries of every n-th lookup are watched (serve: every lookup)."

CACHE_INSIGHT_FAMILIES: tuple[Family, ...] = (
    Family("stagecache_stage_disagreements_total", "counter",
           "Requests on which this stage reported another value than the one most stages agreed on "
           "(rank 0 compares every stage's per-request record), by kind", ("kind",),
           per(DECISION_NAMES, lambda s, k: s.agreement.disagreements.get(k, 0))),
    Family("stagecache_stage_compared_requests_total", "counter",
           "Requests whose stage-agreement verdict this stage has applied",
           samples=one(lambda s: s.agreement.compared_requests)),
    Family("stagecache_prefix_miss_tokens_total", "counter",
           "Prompt tokens a tier did not have, by reason (device: not on the device; host: found "
           "nowhere, i.e. computed); per tier the reasons sum to its misses", ("tier", "reason"),
           _miss_reasons),
    Family("stagecache_cache_entry_lifetime_seconds", "histogram",
           "Seconds a page stayed in a tier, insert (or load, backup) to eviction." + _SAMPLED,
           ("tier",), per(INSIGHT_TIERS, _sampled("lifetime"))),
    Family("stagecache_cache_entry_idle_seconds", "histogram",
           "Seconds between a page's last use and its eviction from a tier." + _SAMPLED,
           ("tier",), per(INSIGHT_TIERS, _sampled("idle"))),
    Family("stagecache_cache_entry_reuse_gap_seconds", "histogram",
           "Seconds between a page's previous use (hit or insert) and a hit on it in a tier."
           + _SAMPLED, ("tier",), per(INSIGHT_TIERS, _sampled("reuse_gap"))),
    Family("stagecache_cache_seen_keys", "gauge",
           "Keys of evicted pages the stage remembers, to tell an evicted page from a never-seen "
           "one (miss reasons; bounded)", samples=one(lambda s: s.insight.seen_keys)),
)
