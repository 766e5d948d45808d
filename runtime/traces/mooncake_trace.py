"""Mooncake's block-hash trace format: one request per line, its prompt named by block ids.

``hash_ids[i]`` names the ``i``-th block of ``block_tokens`` prompt tokens *after its whole
prefix*, so an id is already what the cache keys a page by and a replay needs no token ids: one
block is one cache page (docs/hicache.md, "Mooncake format").  Prefix-awareness is checked while
reading (``PrefixCheck``): an id that follows a different id than it did on an earlier line
would attach one block to two prefixes, so it is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .fields import checked_keys, id_array, int_field, require, time_field
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


def _ids(v: Any, expected: int, input_len: int, block_tokens: int, has_bool: bool) -> np.ndarray:
    """``hash_ids`` as int64: a list of exactly one id per block, each in ``[0, 2**63)``."""
    if not isinstance(v, list):
        raise ValueError(f"field 'hash_ids' = {type(v).__name__}: accepted: a list of integers")
    if len(v) != expected:
        raise ValueError(
            f"field 'hash_ids' has {len(v)} ids for input_length {input_len}: accepted: exactly "
            f"ceil({input_len} / {block_tokens}) = {expected} (one per block; is --block-tokens right?)")
    return id_array(v, "hash_ids", ID_LIMIT, "an integer in [0, 2**63)", np.int64, has_bool)


def parse_mooncake(obj: Any, line: int, index: int, block_tokens: int, max_tokens: int,
                   has_bool: bool, prefix: PrefixCheck, vocab: int = 32000) -> BlockRequest:
    """One decoded line -> ``BlockRequest``; ``ValueError`` naming field, value and what is accepted.

    Lengths are checked before anything is sized by them, so ``input_length``
    1e9 costs nothing.  ``has_bool``: the raw line contains a JSON ``true`` or
    ``false``, so the id list gets the element-wise check (numpy reads ``true`` as 1).
    """
    checked_keys(obj, MOONCAKE_KEYS)
    require(obj, "input_length", "output_length", "hash_ids")
    input_len = int_field(obj, "input_length", 1, max_tokens)
    output_len = int_field(obj, "output_length", 0, max_tokens)
    ids = _ids(obj["hash_ids"], -(-input_len // block_tokens), input_len, block_tokens, has_bool)
    ts = time_field(obj, "timestamp", 1e15, "milliseconds, a number in [0, 1e15)")
    as_list = ids.tolist()
    why = prefix.conflict(as_list)
    if why:
        raise ValueError(why)
    prefix.record(as_list)
    return BlockRequest(ids, input_len, output_len, block_tokens, ts / 1000.0, line, index,
                        vocab)
