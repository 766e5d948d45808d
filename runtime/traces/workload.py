"""The generated multi-turn chat workload: token requests and a seeded generator.

Why multi-turn chat: it is the workload a hierarchical prefix cache exists for.
Sessions share a few system prompts, every turn re-sends the session's whole
history (previous prompt + assistant answer) plus a new user message, and users
think between turns -- long enough for other sessions to push the idle history
out of device memory, short enough that it is worth keeping on host.

Each session's tokens are one array (system prompt, user 1, assistant 1, user
2, ...); a request is two *views* into it (``input_ids`` = the history so far
plus the new user message, ``output_ids`` = the assistant answer), so a 10k
request trace costs one copy of each session's tokens, not one per turn.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError

TOKEN_LIMIT = 2**31
_CHUNK = 1024


@dataclass(frozen=True, eq=False)
class Request:
    """One chat turn: prompt ids and the answer ids the simulated forward pass produces."""

    session: str
    turn: int
    input_ids: np.ndarray  # int32, 1-D (usually a view into the session's token array)
    output_ids: np.ndarray
    arrival: float = 0.0
    line: int | None = None  # trace line number, for messages

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    def tokens(self) -> np.ndarray:
        """Prompt + answer: what the cache holds for this request once it finished."""
        return np.concatenate([self.input_ids, self.output_ids])

    def to_json(self) -> dict[str, Any]:
        return {"session": self.session, "turn": self.turn,
                "input_ids": self.input_ids.tolist(), "output_len": self.output_len,
                "output_ids": self.output_ids.tolist(), "arrival": round(self.arrival, 6)}


# -- deterministic synthetic token streams ---------------------------------------------------
def _stable_seed(*parts: object) -> int:
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def synthetic_tokens(key: Sequence[object], length: int, vocab: int) -> np.ndarray:
    """The first ``length`` ids of the stream named ``key``: a prefix never depends on ``length``."""
    base = _stable_seed(*key)
    chunks = []
    for c in range(-(-length // _CHUNK)):
        rng = np.random.default_rng([base & 0xFFFFFFFF, base >> 32, c])
        chunks.append(rng.integers(0, vocab, _CHUNK, dtype=np.int32))
    out = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int32)
    return out[:length]


# -- the generator -------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkloadConfig:
    """Sizes of a generated chat trace.  Lengths are tokens, ``(low, high)`` inclusive."""

    seed: int = 0
    requests: int = 1000
    system_prompts: int = 4
    system_prompt_len: tuple[int, int] = (512, 2048)
    turns: tuple[int, int] = (2, 10)
    user_len: tuple[int, int] = (32, 512)
    assistant_len: tuple[int, int] = (32, 512)
    think_time_s: float = 30.0  # mean gap between a session's turns (exponential)
    session_gap_s: float = 1.5  # mean gap between session starts (exponential)
    vocab: int = 32000

    def __post_init__(self) -> None:
        if self.requests <= 0:
            raise ConfigError(f"workload: requests must be > 0, got {self.requests}")
        if self.system_prompts <= 0:
            raise ConfigError(f"workload: system_prompts must be > 0, got {self.system_prompts}")
        for name in ("system_prompt_len", "turns", "user_len", "assistant_len"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi or (name in ("turns", "user_len") and lo < 1):
                raise ConfigError(f"workload: {name} must be 0 < low <= high, got ({lo}, {hi})")
        if self.think_time_s < 0 or self.session_gap_s < 0:
            raise ConfigError("workload: think_time_s and session_gap_s must be >= 0")
        if not 1 < self.vocab <= TOKEN_LIMIT:
            raise ConfigError(f"workload: vocab must be in (1, 2**31], got {self.vocab}")


def _session(rng: np.random.Generator, cfg: WorkloadConfig, prompts: list[np.ndarray],
             sid: int, start: float) -> list[Request]:
    def draw(bounds: tuple[int, int]) -> int:
        return int(rng.integers(bounds[0], bounds[1] + 1))

    turns = draw(cfg.turns)
    parts = [prompts[int(rng.integers(0, len(prompts)))]]
    cuts = []  # (input end, output end) per turn
    pos = len(parts[0])
    for _ in range(turns):
        user, answer = draw(cfg.user_len), draw(cfg.assistant_len)
        parts.append(rng.integers(0, cfg.vocab, user + answer, dtype=np.int32))
        cuts.append((pos + user, pos + user + answer))
        pos += user + answer
    stream = np.concatenate(parts)
    name = f"s{sid}"
    out, t = [], start
    for turn, (i_end, o_end) in enumerate(cuts):
        out.append(Request(name, turn, stream[:i_end], stream[i_end:o_end], t))
        t += float(rng.exponential(cfg.think_time_s)) if cfg.think_time_s else 0.0
    return out


def generate(cfg: WorkloadConfig) -> list[Request]:
    """A deterministic trace of exactly ``cfg.requests`` requests, in arrival order.

    Sessions are generated until every request arriving before the last one
    kept is present (later sessions start later), so truncating to
    ``cfg.requests`` never drops a turn from the middle of the timeline.
    """
    rng = np.random.default_rng(cfg.seed)
    prompts = [rng.integers(0, cfg.vocab, int(rng.integers(cfg.system_prompt_len[0],
                                                            cfg.system_prompt_len[1] + 1)),
                            dtype=np.int32)
               for _ in range(cfg.system_prompts)]
    reqs: list[Request] = []
    start, sid = 0.0, 0
    cutoff = math.inf
    while True:
        if len(reqs) >= cfg.requests:
            arrivals = sorted(r.arrival for r in reqs)
            cutoff = arrivals[cfg.requests - 1]
            if start > cutoff:
                break
        reqs.extend(_session(rng, cfg, prompts, sid, start))
        sid += 1
        start += float(rng.exponential(cfg.session_gap_s)) if cfg.session_gap_s else 0.0
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival, i))
    return [reqs[i] for i in order[:cfg.requests]]
