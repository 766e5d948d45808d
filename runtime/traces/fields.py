"""Field checks shared by both trace formats (``traces.py`` tokens lines, ``mooncake.py`` lines).

A trace line is user input, so every field is checked before anything is sized
by it, and every failure is a ``ValueError`` worded one way for both formats:
``field 'KEY' = VALUE: accepted: WHAT`` (the reader prefixes ``FILE:LINE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def checked_keys(obj: Any, keys: Sequence[str]) -> dict[str, Any]:
    """``obj`` when it is a JSON object with no key outside ``keys``."""
    if not isinstance(obj, dict):
        raise ValueError(f"a line is {type(obj).__name__}: accepted: a JSON object")
    unknown = sorted(set(obj) - set(keys))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}: accepted: "
                         f"{', '.join(keys)}")
    return obj


def require(obj: dict[str, Any], *keys: str) -> None:
    """Every key of ``keys`` is present (the first missing one is named)."""
    for key in keys:
        if key not in obj:
            raise ValueError(f"missing required field {key!r}")


def int_field(obj: dict[str, Any], key: str, low: int, high: int) -> int:
    """``obj[key]`` when it is an integer (not a bool) in ``[low, high]``."""
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ValueError(f"field {key!r} = {v!r}: accepted: an integer in [{low}, {high}]")
    return v


def time_field(obj: dict[str, Any], key: str, high: float, accepted: str) -> float:
    """An optional time stamp (default 0): a number (not a bool) in ``[0, high)``."""
    v = obj.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < high:
        raise ValueError(f"field {key!r} = {v!r}: accepted: {accepted}")
    return float(v)


def id_array(v: list[Any], key: str, limit: int, accepted: str, dtype: Any,
             elementwise: bool = False) -> np.ndarray:
    """A JSON list of ids in ``[0, limit)`` as one ``dtype`` array.

    Checked as a whole with numpy; the Python loop runs only to name the first
    bad element, or when ``elementwise`` (the line holds a JSON ``true`` or
    ``false``, which numpy would read as 1 or 0).
    """
    try:
        arr = np.asarray(v) if v else np.empty(0, np.int64)
    except (ValueError, OverflowError):
        arr = None
    ok = not elementwise and arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu"
    if ok and len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= limit):
        ok = False
    if not ok:
        for i, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < limit:
                raise ValueError(f"field '{key}[{i}]' = {x!r}: accepted: {accepted}")
    return arr.astype(dtype, copy=False)
