"""Mooncake's block-hash trace format: one request per line, its prompt named by block ids.

The public FAST'25 traces (kvcache-ai/Mooncake, ``FAST25-release/traces``) are
JSONL lines like::

    {"timestamp": 3052, "input_length": 7234, "output_length": 794, "hash_ids": [0, 28, 29]}

``hash_ids[i]`` names the ``i``-th block of ``block_tokens`` (512) prompt tokens
*after its whole prefix*: two requests that share an id share every block up
to it.  So an id is already what the cache keys a page by (a chained page
hash), and a replay needs no token ids at all: in this format one block is
one cache page.  The last id covers the partial last block, so a request has
exactly ``ceil(input_length / block_tokens)`` ids.

Prefix-awareness is checked while reading (``PrefixCheck``): an id that
follows a different id than it did on an earlier line is an error, because
the cache would otherwise attach one block to two different prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .workload import synthetic_tokens

MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
DEFAULT_BLOCK_TOKENS = 512
#: Ids are stored as int64: the largest id a line may carry, plus one.
ID_LIMIT = 2**63


@dataclass(frozen=True, eq=False)
class BlockRequest:
    """One Mooncake request: its prompt's block ids, lengths and arrival time."""

    hash_ids: np.ndarray  # int64, one per block of the prompt (the last one may be partial)
    input_len: int
    output_len: int
    block_tokens: int
    arrival: float = 0.0  # seconds since the trace's first request (timestamp / 1000)
    line: int | None = None
    index: int = 0  # position in the trace
    vocab: int = 32000

    # -- the token view (serve at another page size, the payload writer's activations) ----------
    @property
    def session(self) -> str:
        """Mooncake lines carry no session; requests are told apart by their position."""
        return "mooncake"

    @property
    def turn(self) -> int:
        return self.index

    def tokens(self) -> np.ndarray:
        """Prompt + answer as token ids, synthesised per block id (equal ids -> equal tokens).

        Only built on demand (the cache keys pages by the ids themselves); used
        when the page size differs from the block size, or to embed computed tokens.
        """
        blocks = [synthetic_tokens(("block", int(i)), self.block_tokens, self.vocab)
                  for i in self.hash_ids.tolist()]
        prompt = np.concatenate(blocks)[:self.input_len] if blocks else np.empty(0, np.int32)
        answer = synthetic_tokens(("answer", self.index), self.output_len, self.vocab)
        return np.concatenate([prompt, answer])

    @property
    def input_ids(self) -> np.ndarray:
        return self.tokens()[:self.input_len]

    @property
    def output_ids(self) -> np.ndarray:
        return synthetic_tokens(("answer", self.index), self.output_len, self.vocab)

    def to_json(self) -> dict[str, Any]:
        return {"timestamp": round(self.arrival * 1000), "input_length": self.input_len,
                "output_length": self.output_len, "hash_ids": self.hash_ids.tolist()}


class PrefixCheck:
    """Remembers the id each id followed, to refuse a trace whose ids are not prefix-aware."""

    def __init__(self) -> None:
        self._parent: dict[int, int] = {}

    def conflict(self, ids: list[int]) -> str | None:
        """Why ``ids`` disagree with earlier lines (nothing is recorded then), or None."""
        parent = self._parent
        prev = -1
        for i, k in enumerate(ids):
            seen = parent.get(k, prev)
            if seen != prev:
                before = "the start of the prompt" if seen == -1 else f"id {seen}"
                here = "the start of the prompt" if prev == -1 else f"id {prev}"
                return (f"hash_ids[{i}] = {k} follows {here} here but followed {before} earlier; "
                        "accepted: ids that name a whole prefix (equal id => equal prefix)")
            prev = k
        return None

    def record(self, ids: list[int]) -> None:
        prev = -1
        for k in ids:
            self._parent[k] = prev
            prev = k


def _count(obj: dict, key: str, low: int, high: int, required: bool = True) -> int:
    if key not in obj:
        if required:
            raise ValueError(f"missing required field {key!r}")
        return low
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ValueError(f"field {key!r} = {v!r}: accepted: an integer in [{low}, {high}]")
    return v


def _ids(v: Any, expected: int, input_len: int, block_tokens: int) -> np.ndarray:
    """``hash_ids`` as int64, checked as a whole (numpy), the slow path only to name the culprit."""
    if not isinstance(v, list):
        raise ValueError(f"field 'hash_ids' = {type(v).__name__}: accepted: a list of integers")
    if len(v) != expected:
        raise ValueError(
            f"field 'hash_ids' has {len(v)} ids for input_length {input_len}: accepted: exactly "
            f"ceil({input_len} / {block_tokens}) = {expected} (one per block; is --block-tokens right?)")
    try:
        arr = np.asarray(v)
    except (ValueError, OverflowError):
        arr = None
    ok = arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu"
    if ok and len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= ID_LIMIT):
        ok = False
    if not ok:
        for i, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < ID_LIMIT:
                raise ValueError(f"field 'hash_ids[{i}]' = {x!r}: accepted: an integer in [0, 2**63)")
    return arr.astype(np.int64, copy=False)


def parse_mooncake(obj: Any, line: int, index: int, block_tokens: int, max_tokens: int,
                   has_bool: bool, prefix: PrefixCheck, vocab: int = 32000) -> BlockRequest:
    """One decoded line -> ``BlockRequest``; ``ValueError`` naming field, value and what is accepted.

    Lengths are checked before anything is sized by them, so ``input_length``
    1e9 costs nothing.  ``has_bool``: the raw line contains a JSON ``true`` or
    ``false``, so the id list gets the element-wise check (numpy reads ``true`` as 1).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"a line is {type(obj).__name__}: accepted: a JSON object")
    unknown = sorted(set(obj) - set(MOONCAKE_KEYS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}: accepted: "
                         f"{', '.join(MOONCAKE_KEYS)}")
    input_len = _count(obj, "input_length", 1, max_tokens)
    output_len = _count(obj, "output_length", 0, max_tokens)
    if "hash_ids" not in obj:
        raise ValueError("missing required field 'hash_ids'")
    raw = obj["hash_ids"]
    expected = -(-input_len // block_tokens)
    if has_bool and isinstance(raw, list):
        for i, x in enumerate(raw):
            if isinstance(x, bool):
                raise ValueError(f"field 'hash_ids[{i}]' = {x!r}: accepted: an integer in [0, 2**63)")
    ids = _ids(raw, expected, input_len, block_tokens)
    ts = obj.get("timestamp", 0)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < 1e15:
        raise ValueError(f"field 'timestamp' = {ts!r}: accepted: milliseconds, a number in [0, 1e15)")
    as_list = ids.tolist()
    why = prefix.conflict(as_list)
    if why:
        raise ValueError(why)
    prefix.record(as_list)
    return BlockRequest(ids, input_len, output_len, block_tokens, float(ts) / 1000.0, line, index,
                        vocab)
