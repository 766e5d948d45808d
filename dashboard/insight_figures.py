"""Cache insight on the page: why prompt tokens missed, over time, and do the stages agree.

* ``miss_reasons_figure``: one stacked-area plot per stage (rows share the time
  axis) of the tokens/s that missed the device tier, by miss reason
  (``cache/insight.py``): the stack is the stage's device misses, and the
  ``evicted_from_device`` band is what the host tier gave back.  Each trace's
  ``meta`` names the stage and the ``StageRates`` key (``miss_reasons.<reason>``),
  so ``static/dashboard.js`` extends it from every poll like the other rate charts.
* ``agreement_view``: the stage-agreement panel (``serve/agreement.py``): the
  disagreements every stage counted, by kind, the requests compared, the
  ``/readyz`` threshold, and the recent disagreements rank 0 kept (the request,
  the stages involved and every stage's value).  ``static/insight.js`` refills it
  from each poll.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots
from stagecache.runtime.cache.insight import MISS_REASONS
from stagecache.runtime.live.divergence import QUANTITIES, DivergenceLive, readiness_lines
from stagecache.runtime.live.numbers import DECISION_NAMES

from .live_figures import NO_LIVE_TEXT
from .models import StageLive
from .rates import StageRates

#: One colour per miss reason, in every stage's stack (bottom first: ``MISS_REASONS``).
REASON_COLOURS: dict[str, str] = {
    "never_seen": "#7f7f7f", "evicted_from_device": "#2ca02c", "evicted_from_host": "#ff7f0e",
    "dropped": "#d62728", "writeback_pending": "#9467bd", "partial_page_tail": "#bcbd22",
    "stage_disagreement": "#e377c2",
}
#: Recent disagreements the panel lists (rank 0 keeps ``agreement.RECENT``).
SHOWN_DISAGREEMENTS = 20


def miss_reasons_figure(stage_ids: Sequence[int], history: Mapping[int, Sequence[StageRates]],
                        window_s: float, live: bool) -> go.Figure:
    """Per stage, tokens/s that missed the device tier, stacked by reason, over time."""
    rows = max(1, len(stage_ids))
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.04)
    for row, s in enumerate(stage_ids, start=1):
        series = history.get(s, ())
        xs = [r.time * 1000 for r in series]
        for reason in MISS_REASONS:
            ys = [None if r.miss_reasons is None else r.miss_reasons.get(reason) for r in series]
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="lines", name=reason, legendgroup=reason, showlegend=row == 1,
                stackgroup=f"stage {s}", line=dict(width=0.5, color=REASON_COLOURS[reason]),
                meta={"stage": s, "key": f"miss_reasons.{reason}"},
                hovertemplate=f"stage {s} · {reason}: %{{y:.3s}} tokens/s<extra></extra>"),
                row=row, col=1)
        fig.update_yaxes(title_text=f"stage {s}", rangemode="tozero", tickformat="~s", row=row, col=1)
    fig.update_xaxes(type="date")
    bottom = f"xaxis{rows}" if rows > 1 else "xaxis"  # the one axis with tick labels (shared axes)
    fig.update_layout(
        meta={"tick_axis": bottom},
        title=dict(text=f"why prompt tokens missed the device: tokens/s by reason (last {window_s:g} s)",
                   font=dict(size=14)),
        height=140 + 130 * rows, margin=dict(l=60, r=10, t=40, b=40),
        legend=dict(orientation="h", y=-0.08 if rows > 2 else -0.2))
    if not live:  # the empty state, as in live_figures (the script clears it)
        fig.layout[bottom].showticklabels = False
        fig.add_annotation(text=NO_LIVE_TEXT, showarrow=False, xref="paper", yref="paper",
                           x=0.5, y=0.5, font=dict(size=16, color="#777"))
    return fig


def agreement_view(stages: Sequence[StageLive], max_disagreements: int | None,
                   divergence: DivergenceLive | None = None) -> dict[str, Any]:
    """The stage-agreement panel: counts per stage and kind, and the recent disagreements.  Where
    the source compares live PP ranks (the sglang endpoint: ``divergence``) the kinds are the
    quantities the ranks report, and the first divergence and incomplete transfers are named."""
    kinds = QUANTITIES if divergence is not None else DECISION_NAMES
    per_stage = {s.stage: {k: s.agreement.disagreements.get(k, 0) for k in kinds} for s in stages}
    total = sum(sum(v.values()) for v in per_stage.values())
    recent = sorted((r for s in stages for r in s.agreement.recent), key=lambda r: r.time,
                    reverse=True)[:SHOWN_DISAGREEMENTS]
    return {
        "total": total, "kinds": kinds, "per_stage": per_stage,
        # the PP ranks' first divergence and incomplete transfers (sglang), each stage's
        # incomplete transfers (serve: ``StageLive.transfer_check``)
        "pp_lines": readiness_lines(divergence) + [line for s in stages if (line := s.transfer_check.line())],
        "compared": min((s.agreement.compared_requests for s in stages), default=0),
        "max_disagreements": max_disagreements,
        "over": max_disagreements is not None and total > max_disagreements,
        "recent": [r.model_dump() for r in recent],
    }
