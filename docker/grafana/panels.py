"""Helpers of the Grafana dashboard generator (``make_dashboard.py``): panels as plain dicts.

Every query uses the provisioned datasource uid and the ``pp_rank`` variable (sglang's
label for the stage).  Panel ids are handed out in the order panels are built.
"""

from __future__ import annotations

DS = {"type": "prometheus", "uid": "stagecache-prometheus"}
S = '{pp_rank=~"$pp_rank"}'
HOST = '{tier="host",pp_rank=~"$pp_rank"}'
_id = [0]


def nid():
    _id[0] += 1
    return _id[0]


def tgt(expr, legend="", ref="A", instant=False, fmt="time_series"):
    t = {"datasource": DS, "refId": ref, "expr": expr, "legendFormat": legend or "__auto",
         "range": not instant, "instant": instant, "format": fmt}
    return t


def panel(kind, title, desc, grid, targets, unit=None, extra_defaults=None, options=None,
          custom=None, transformations=None):
    defaults = {"color": {"mode": "palette-classic"}, "mappings": [],
                "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]}}
    if unit:
        defaults["unit"] = unit
    if custom:
        defaults["custom"] = custom
    defaults.update(extra_defaults or {})
    p = {"id": nid(), "type": kind, "title": title, "description": desc, "datasource": DS,
         "gridPos": dict(zip("xywh", grid, strict=True)), "targets": targets,
         "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options or {}}
    if transformations:
        p["transformations"] = transformations
    return p


def row(title, y):
    return {"id": nid(), "type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}}


TS_CUSTOM = {"drawStyle": "line", "lineWidth": 2, "fillOpacity": 10, "showPoints": "never",
             "spanNulls": False, "axisSoftMin": 0}
TS_OPTS = {"legend": {"displayMode": "table", "placement": "right", "showLegend": True,
                      "calcs": ["lastNotNull"]},
           "tooltip": {"mode": "multi", "sort": "desc"}}
STAT_OPTS = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
             "colorMode": "background", "graphMode": "none", "justifyMode": "auto",
             "orientation": "auto", "textMode": "value_and_name", "wideLayout": True}
#: Stacked series (added to TS_CUSTOM).
STACK = {"stacking": {"mode": "normal", "group": "A"}}
RED_GREEN = {"mode": "absolute", "steps": [{"color": "red", "value": None}, {"color": "green", "value": 1}]}
GREEN_RED = {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}]}

RI = "[$__rate_interval]"


def ts(title, desc, grid, targets, unit=None, custom=None, **kw):
    """A time series panel: lines as ``TS_CUSTOM`` with ``custom``'s changes, the table legend."""
    return panel("timeseries", title, desc, grid, targets, unit=unit, custom={**TS_CUSTOM, **(custom or {})},
                 options=TS_OPTS, **kw)


def bars(display):
    """A horizontal bar gauge's options (``display``: basic or gradient) of each series' last value."""
    return {"orientation": "horizontal", "displayMode": display, "showUnfilled": True,
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}


def rate(metric, by="pp_rank", sel=S):
    """sum by (...) of rate() of a counter, over Grafana's rate interval."""
    return f"sum by ({by}) (rate({metric}{sel}{RI}))"


def merged_table(title, desc, grid, columns, keys, hide=()):
    """A table of instant queries merged on their labels: ``columns`` = (expr, column name) each,
    ``keys`` = the label columns shown first, ``hide`` = labels hidden besides the usual ones."""
    refs = [chr(ord("A") + i) for i in range(len(columns))]
    exclude = dict.fromkeys(("Time", "job", "instance", "deployment", "__name__", "tp_rank", *hide), True)
    index = {k: i for i, k in enumerate((*keys, *(f"Value #{r}" for r in refs)))}
    return panel(
        "table", title, desc, grid,
        [tgt(expr, "", ref, instant=True, fmt="table") for (expr, _), ref in zip(columns, refs, strict=True)],
        extra_defaults={"custom": {"align": "auto", "cellOptions": {"type": "auto"}}},
        options={"showHeader": True, "sortBy": [{"displayName": "pp_rank", "desc": False}]},
        transformations=[
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": exclude, "indexByName": index,
                "renameByName": {f"Value #{r}": name for (_, name), r in zip(columns, refs, strict=True)}}},
        ])

