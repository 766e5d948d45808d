"""Shared test helper: read a Prometheus exposition text the way a scraper does."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def series_by_name(text: str) -> dict[str, list]:
    """Every sample of an exposition text, grouped by sample name (``_total``, ``_sum``... included)."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def sample_value(smp: dict[str, list], name: str, **labels: str) -> float:
    """The value of the one sample of ``name`` whose labels include ``labels`` (fails unless exactly one)."""
    hits = [s.value for s in smp.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]
