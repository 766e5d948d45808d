"""Grafana panels of the cache insight: stage agreement, miss reasons, tier lifetimes.

Used by ``make_dashboard.py``.  The request ids and per-stage values of recent
disagreements are not Prometheus series; the stagecache dashboard lists them
(its ``#stage-agreement`` panel), and these panels count them.
"""

from __future__ import annotations

from panels import GREEN_RED, RI, STACK, STAT_OPTS, S, panel, rate, row, tgt, ts

STACKED = {"fillOpacity": 60, **STACK}


def _quantiles(metric: str) -> list[dict]:
    """p50 and p90 per stage and tier of a sampled histogram, over Grafana's rate interval."""
    return [tgt(f"histogram_quantile({q}, sum by (le, pp_rank, tier) (rate({metric}_bucket{S}{RI})))",
                f"stage {{{{pp_rank}}}} {{{{tier}}}} p{int(q * 100)}", ref)
            for q, ref in ((0.5, "A"), (0.9, "B"))]


def _agreement(y: int) -> list[dict]:
    return [
        panel("stat", "Stage disagreements per stage and kind",
              "stagecache_stage_disagreements_total: requests on which a stage reported another "
              "matched prefix, load, backup or completion than most stages (rank 0 compares every "
              "stage's per-request record). Any is wrong KV; above serve --max-disagreements /readyz "
              "answers 503. The requests, stages and values are on the stagecache dashboard.",
              (0, y, 8, 6),
              [tgt(f"sum by (pp_rank, kind) (stagecache_stage_disagreements_total{S})",
                   "stage {{pp_rank}} {{kind}}")],
              extra_defaults={"color": {"mode": "thresholds"}, "thresholds": GREEN_RED},
              options={**STAT_OPTS, "textMode": "value_and_name"}),
        ts("Stage disagreements/s by stage and kind",
              "rate of stagecache_stage_disagreements_total; a healthy run is flat at zero, and the "
              "StagecacheStageDisagreement alert fires on any increase.",
              (8, y, 16, 6), [tgt(rate("stagecache_stage_disagreements_total", "pp_rank, kind"),
                                  "stage {{pp_rank}} {{kind}}")],
              unit="reqps"),
    ]


def _miss_reasons(y: int) -> list[dict]:
    out = []
    for x, tier, title, desc in (
            (0, "device", "Why tokens missed the device tier (tokens/s by reason)",
             "rate of stagecache_prefix_miss_tokens_total{tier=\"device\"} by reason: every prompt "
             "token not found on the device has exactly one reason; evicted_from_device is what "
             "the host tier gave back."),
            (12, "host", "Why tokens were computed (found in no tier, tokens/s by reason)",
             "rate of stagecache_prefix_miss_tokens_total{tier=\"host\"} by reason: never_seen, "
             "evicted_from_host, dropped, writeback_pending, partial_page_tail, "
             "stage_disagreement; per stage the reasons sum to its misses.")):
        sel = f'{{tier="{tier}",pp_rank=~"$pp_rank"}}'
        out.append(ts(title, desc, (x, y, 12, 9),
                         [tgt(rate("stagecache_prefix_miss_tokens_total", "pp_rank, reason", sel),
                              "stage {{pp_rank}} {{reason}}")],
                         unit="short", custom=STACKED))
    return out


def _lifetimes(y: int) -> list[dict]:
    return [ts(title, desc, (x, y, 8, 8), _quantiles(metric), unit="s")
            for x, metric, title, desc in (
                (0, "stagecache_cache_entry_lifetime_seconds", "Entry lifetime by tier (p50, p90)",
                 "Seconds a page stayed in a tier, insert (or load, backup) to eviction, sampled."),
                (8, "stagecache_cache_entry_idle_seconds", "Idle before eviction by tier (p50, p90)",
                 "Seconds between a page's last use and its eviction: short means the tier "
                 "evicts pages that are still in use (too small a tier)."),
                (16, "stagecache_cache_entry_reuse_gap_seconds", "Reuse gap by tier (p50, p90)",
                 "Seconds between a page's previous use and a hit on it: how long a tier must "
                 "keep pages for them to be hit."))]


def insight_panels(y: int) -> list[dict]:
    """The band of rows from ``y``: agreement (6 high), miss reasons (9), lifetimes (8)."""
    return ([row("Stage agreement, miss reasons and tier lifetimes", y)] + _agreement(y + 1)
            + _miss_reasons(y + 7) + _lifetimes(y + 16))
