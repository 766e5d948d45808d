"""A metric family and the helpers that build its samples (the tables: ``families.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Samples = Iterable[tuple[tuple[Any, ...], Any]]


@dataclass(frozen=True)
class Family:
    """One metric family: exposed ``name`` (counters end in ``_total``, info in ``_info``).

    ``labels`` are the family's own label names (after ``STAGE_LABELS`` for
    per-stage tables); ``samples(input)`` yields ``(label values, value)``:
    a number, ``(buckets, sum)`` for a histogram, ``{state: bool}`` for a
    state set, and 1 for an info family (its labels are the information).
    """

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    samples: Callable[[Any], Samples] = field(default=lambda _: (), compare=False, repr=False)


def one(fn: Callable[[Any], Any]) -> Callable[[Any], Samples]:
    """A family with one series per input (no labels of its own)."""
    return lambda x: [((), fn(x))]


def per(values: Iterable[str], fn: Callable[[Any, str], Any]) -> Callable[[Any], Samples]:
    """One series per label value."""
    values = tuple(values)
    return lambda x: [((v,), fn(x, v)) for v in values]


def cumulative_buckets(le: list[float], counts: list[int], total: int) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` buckets; only +Inf when none were reported."""
    buckets: list[tuple[str, float]] = []
    if counts and len(counts) == len(le) + 1:
        buckets = [(repr(float(b)), c) for b, c in zip(le, counts[:-1], strict=True)]
        total = counts[-1]
    buckets.append(("+Inf", total))
    return buckets
