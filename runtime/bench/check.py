"""``stagecache bench check``: how long the startup check takes per configuration.

The check runs at every server start, so it must stay cheap: the target is
well under 50 ms per (model, pp_size) after import.  The baseline is the cost
of just building the layer maps in the same run, so the ratio shows what the
validation itself adds.
"""

from __future__ import annotations

import statistics
import time

from ..model.families import load_spec, spec_from_config
from ..model.layer_map import build_layout
from ..plan.faults import parse_faults
from ..plan.plan import build_plan
from ..validation.deployment import preflight


def synthetic_spec(num_layers: int):
    """A DeepSeek-V4-shaped model of any depth: [0, 0] then alternating 4/128 (like Flash)."""
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(num_layers - 2)] + [0]
    cfg = {
        "num_hidden_layers": num_layers, "compress_ratios": ratios, "sliding_window": 128,
        "head_dim": 512, "qk_rope_head_dim": 64, "index_head_dim": 128, "num_nextn_predict_layers": 1,
    }
    return spec_from_config(cfg, name=f"synthetic-{num_layers}")


def _time(fn, repeat: int) -> dict[str, float]:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(samples), "max_ms": max(samples)}


def run_bench(model: str, layers: int | None, max_pp: int, repeat: int, fault: list[str]) -> dict:
    spec = synthetic_spec(layers) if layers else load_spec(model)
    rows = []
    for pp in range(1, max_pp + 1):
        faults = parse_faults(fault, pp, spec.family)
        layout_only = _time(lambda pp=pp: build_layout(spec, pp), repeat)
        full = _time(lambda pp=pp, faults=faults: preflight(build_plan(spec, pp, faults=faults)), repeat)
        rows.append({
            "pp_size": pp,
            "check_median_ms": round(full["median_ms"], 4),
            "check_max_ms": round(full["max_ms"], 4),
            "layout_only_median_ms": round(layout_only["median_ms"], 4),
            "ratio_check_vs_layout_only": round(full["median_ms"] / layout_only["median_ms"], 2),
            "under_50ms": full["max_ms"] < 50.0,
        })
    return {"bench": "check", "model": spec.name, "num_layers": spec.num_layers,
            "repeat": repeat, "results": rows}
