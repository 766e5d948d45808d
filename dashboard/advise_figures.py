"""The advise figure: hit rate against memory per stage, from an advise report.

Left: device + host hit rate against each stage's *host* GiB (the HiCache
question, ``--hicache-ratio``); right: the device tier alone against each
stage's *device* GiB (``--max-total-tokens``).  One line per stage: every stage
needs the same pages for a hit rate, but a page costs each stage its own
bytes, so the lines are the same curve stretched by each stage's bytes per page.
Marked on every stage's line: the configured size (a star), the 90, 95 and 99 %
points (labelled), the knee (an open circle) and, on the left, Belady's offline
optimum at the same host pages (diamonds).  The dashed line is the infinite cache.

The same figure is the dashboard's ``/advise`` page and ``stagecache advise --plot``'s page.
"""

from __future__ import annotations

from html import escape
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .advise_models import AdviseReport

GIB = float(1 << 30)
#: Shares of the ceiling labelled on each line.
LABELLED = (0.9, 0.95, 0.99)
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _pct(x: float) -> float:
    return round(100.0 * x, 3)


def _marks(report: AdviseReport, tier: str, per_gib: float, colour: str, name: str,
           first: bool) -> list[go.Scatter]:
    """One stage's marked points on one panel: labelled shares, knee, configured size."""
    labelled = [t for t in report.targets if any(abs(t.share - s) < 1e-9 for s in LABELLED)]
    points = [getattr(t, tier) for t in labelled]
    knee = getattr(report.knee, tier)
    conf = report.configured
    conf_pages = conf.host_pages if tier == "host" else conf.device_pages
    conf_rate = conf.hit_rate if tier == "host" else conf.device_hit_rate
    common = dict(legendgroup=name, showlegend=False, hoverinfo="text")
    return [
        go.Scatter(x=[p.pages * per_gib for p in points], y=[_pct(p.hit_rate) for p in points],
                   mode="markers+text", text=[f"{t.share * 100:g}%" for t in labelled],
                   textposition="top left", textfont=dict(size=10, color=colour),
                   marker=dict(color=colour, size=8),
                   hovertext=[f"{name}: {t.share * 100:g}% of the ceiling at {p.pages:,} pages = "
                              f"{p.pages * per_gib:.3g} GiB" for t, p in zip(labelled, points,
                                                                              strict=True)],
                   **common),
        go.Scatter(x=[knee.pages * per_gib], y=[_pct(knee.hit_rate)], mode="markers",
                   marker=dict(color=colour, size=11, symbol="circle-open"),
                   hovertext=[f"{name}: knee at {knee.pages:,} pages = {knee.pages * per_gib:.3g} GiB"],
                   **common),
        go.Scatter(x=[conf_pages * per_gib], y=[_pct(conf_rate)], mode="markers",
                   marker=dict(color=colour, size=14, symbol="star", line=dict(color="#222", width=1)),
                   name="configured size", legendgroup="configured", legendrank=2000,
                   showlegend=first and tier == "host",
                   hoverinfo="text",
                   hovertext=[f"{name}: configured {conf_pages:,} {tier} pages = "
                              f"{conf_pages * per_gib:.3g} GiB, {_pct(conf_rate):.3g}% hit"]),
    ]


def _stage_traces(report: AdviseReport, index: int, tier: str) -> list[go.Scatter]:
    s = report.stages[index]
    per_gib = s.token_page_bytes / GIB
    colour = COLOURS[index % len(COLOURS)]
    name = f"stage {s.stage} ({s.token_page_bytes / 1024:,.0f} KiB/page)"
    rates = report.curve.hit_rate if tier == "host" else report.curve.device_hit_rate
    line = go.Scatter(x=[p * per_gib for p in report.curve.pages], y=[_pct(r) for r in rates],
                      mode="lines", name=name, legendgroup=name, showlegend=tier == "host",
                      legendrank=1000 + index,
                      line=dict(color=colour, width=2),
                      hovertemplate=f"{name}<br>%{{x:.3g}} GiB: %{{y:.2f}}%<extra></extra>")
    out = [line, *_marks(report, tier, per_gib, colour, name, index == 0)]
    if tier == "host" and report.belady:
        out.append(go.Scatter(
            x=[b.pages * per_gib for b in report.belady], y=[_pct(b.hit_rate) for b in report.belady],
            mode="markers", marker=dict(color=colour, size=8, symbol="diamond-open"),
            name="Belady (offline optimum)", legendgroup="belady", showlegend=index == 0,
            legendrank=2001,
            hoverinfo="text", hovertext=[f"{name}: Belady {_pct(b.hit_rate):.3g}% vs LRU "
                                         f"{_pct(b.lru_hit_rate):.3g}% at {b.pages:,} pages"
                                         for b in report.belady]))
    return out


def advise_figure(report: AdviseReport) -> go.Figure:
    """The two panels (see the module docstring); ``meta`` names what is marked, for tests."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08, subplot_titles=(
        "device + host hit rate vs host GiB per stage (--hicache-ratio)",
        "device tier alone vs device GiB per stage (--max-total-tokens)"))
    for col, tier in ((1, "host"), (2, "device")):
        for i in range(len(report.stages)):
            for trace in _stage_traces(report, i, tier):
                fig.add_trace(trace, row=1, col=col)
        fig.add_hline(y=_pct(report.ceiling_hit_rate), line=dict(dash="dash", color="#888"),
                      row=1, col=col)
    t = report.trace
    fig.update_layout(
        title=dict(text=f"{escape(report.plan.model)} pp={report.plan.pp_size} · trace "
                        f"{escape(t.source)}: {t.requests:,} requests, pages of {t.page_size} tokens; "
                        f"infinite cache {_pct(report.ceiling_hit_rate):.3g}%", font=dict(size=14)),
        height=520, margin=dict(l=50, r=20, t=80, b=50), hovermode="closest",
        legend=dict(orientation="h", y=-0.15),
        meta={"stages": [s.stage for s in report.stages], "labelled": list(LABELLED),
              "configured": {"host_pages": report.configured.host_pages,
                             "device_pages": report.configured.device_pages}},
    )
    fig.update_xaxes(title_text="host GiB per stage", row=1, col=1)
    fig.update_xaxes(title_text="device GiB per stage", row=1, col=2)
    fig.update_yaxes(title_text="hit rate (% of prompt tokens)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=2)
    return fig


POLICY_SYMBOLS = ("circle", "square", "triangle-up", "x", "cross", "pentagon", "star-triangle-up")


def policy_figure(report: AdviseReport) -> go.Figure | None:
    """sglang's eviction policies (``advise --policies``): per tier, each policy's hit rate at the
    marked sizes (pages, log axis), the LRU curve's value there and Belady's bound; ``None``
    for a report without policies.  Pages, not bytes: every stage needs the same pages (the
    tables give each stage's bytes)."""
    pol = report.policies
    if pol is None:
        return None
    titles = tuple(("device tier alone (--max-total-tokens)" if t.tier == "device"
                    else "device + host, host pages (--hicache-ratio)") for t in pol.tiers)
    fig = make_subplots(rows=1, cols=len(pol.tiers), horizontal_spacing=0.08, subplot_titles=titles)
    for col, tier in enumerate(pol.tiers, start=1):
        sizes = sorted(tier.sizes, key=lambda r: r.pages)
        xs = [r.pages for r in sizes]
        for i, p in enumerate(pol.policies):
            fig.add_trace(go.Scatter(
                x=xs, y=[_pct(r.hit_rate.get(p.label, 0.0)) for r in sizes], mode="lines+markers",
                name=escape(p.label), legendgroup=p.label, showlegend=col == 1,
                line=dict(color=COLOURS[i % len(COLOURS)]),
                marker=dict(symbol=POLICY_SYMBOLS[i % len(POLICY_SYMBOLS)], size=8),
                hovertemplate=f"{escape(p.label)}<br>%{{x:,}} pages: %{{y:.2f}}%<extra></extra>"),
                row=1, col=col)
        bel = [r for r in sizes if r.belady_hit_rate is not None]
        fig.add_trace(go.Scatter(
            x=[r.pages for r in bel], y=[_pct(r.belady_hit_rate or 0.0) for r in bel], mode="markers",
            name="Belady (offline optimum)", legendgroup="belady", showlegend=col == 1,
            marker=dict(symbol="diamond-open", size=11, color="#222"),
            hovertemplate="Belady<br>%{x:,} pages: %{y:.2f}%<extra></extra>"), row=1, col=col)
        fig.add_trace(go.Scatter(
            x=xs, y=[_pct(r.lru_curve_hit_rate) for r in sizes], mode="markers",
            name="LRU curve (one pass)", legendgroup="curve", showlegend=col == 1,
            marker=dict(symbol="line-ew-open", size=14, color="#888"),
            hovertemplate="LRU curve<br>%{x:,} pages: %{y:.2f}%<extra></extra>"), row=1, col=col)
        fig.add_hline(y=_pct(tier.ceiling_hit_rate), line=dict(dash="dash", color="#888"), row=1, col=col)
        fig.update_xaxes(type="log", title_text="pages (log)", row=1, col=col)
        fig.update_yaxes(rangemode="tozero", row=1, col=col)
    fig.update_yaxes(title_text="hit rate (% of prompt tokens)", row=1, col=1)
    fig.update_layout(
        title=dict(text=f"sglang radix eviction policies at the marked sizes (order: {escape(pol.source)})",
                   font=dict(size=14)),
        height=460, margin=dict(l=50, r=20, t=80, b=50), hovermode="closest",
        legend=dict(orientation="h", y=-0.2),
        meta={"policies": [p.label for p in pol.policies], "tiers": [t.tier for t in pol.tiers]})
    return fig


def policy_figure_json(report: AdviseReport) -> dict[str, Any] | None:
    """The policy figure as plain JSON, or ``None`` (``/api/advise``'s ``policy_figure``)."""
    from .figures import to_json_dict

    fig = policy_figure(report)
    return to_json_dict(fig) if fig is not None else None


def figure_json(report: AdviseReport) -> dict[str, Any]:
    """The figure as plain JSON (``/api/advise``, the page)."""
    from .figures import to_json_dict

    return to_json_dict(advise_figure(report))
