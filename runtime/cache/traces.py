"""Multi-turn chat traces: a seeded generator and a JSONL format to replay your own.

Why multi-turn chat: it is the workload a hierarchical prefix cache exists for.
Sessions share a few system prompts, every turn re-sends the session's whole
history (previous prompt + assistant answer) plus a new user message, and users
think between turns -- long enough for other sessions to push the idle history
out of device memory, short enough that it is worth keeping on host.

Each session's tokens are one array (system prompt, user 1, assistant 1, user
2, ...); a request is two *views* into it (``input_ids`` = the history so far
plus the new user message, ``output_ids`` = the assistant answer), so a 10k
request trace costs one copy of each session's tokens, not one per turn.

JSONL trace format (one request per line, replayed in file order)::

    {"session": "s1", "turn": 0, "input_ids": [1, 2, 3], "output_len": 16}
    {"session": "s1", "turn": 1, "input_len": 900, "output_len": 64}

* ``session`` (string or integer), ``turn`` (integer >= 0), ``output_len`` (>= 0);
* exactly one of ``input_ids`` (non-empty list of token ids in ``[0, 2**31)``) or
  ``input_len`` (> 0): the ids are then synthesised from the session name, the
  same stream for every turn of a session, so turn ``t+1`` with a longer
  ``input_len`` shares turn ``t``'s prompt *and* answer as a prefix;
* optional ``output_ids`` (length ``output_len``; default: synthesised -- the
  session stream's continuation for ``input_len`` lines, a per-turn stream for
  ``input_ids`` lines) and ``arrival`` (seconds, informational);
* blank lines are ignored; any other key is an error (catches typos).

Malformed lines: by default *fail before replay* -- the whole file is parsed
first and ``TraceError`` lists every bad line with its number, so nothing is
replayed from a half-valid file.  With ``skip_bad=True`` bad lines are left
out, reported in ``Trace.errors``, and the good lines are exactly what they
would be in a file without the bad ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError

TOKEN_LIMIT = 2**31
TRACE_KEYS = ("session", "turn", "input_ids", "input_len", "output_len", "output_ids", "arrival")
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


# -- JSONL traces ----------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceLineError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


class TraceError(ConfigError):
    """A trace file that cannot be replayed as written (every bad line listed)."""

    def __init__(self, path: str, errors: Sequence[TraceLineError]):
        self.path = path
        self.errors = list(errors)
        shown = "; ".join(str(e) for e in self.errors[:5])
        more = f" (and {len(self.errors) - 5} more)" if len(self.errors) > 5 else ""
        super().__init__(f"trace {path}: {len(self.errors)} malformed line(s), nothing replayed: "
                         f"{shown}{more}")


@dataclass(frozen=True)
class Trace:
    path: str
    requests: tuple[Request, ...]
    errors: tuple[TraceLineError, ...]  # lines skipped (skip_bad=True only)


def _int_field(obj: dict, key: str, minimum: int) -> int:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _ids_field(obj: dict, key: str) -> np.ndarray:
    v = obj[key]
    if not isinstance(v, list):
        raise ValueError(f"{key!r} must be a list of token ids, got {type(v).__name__}")
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < TOKEN_LIMIT:
            raise ValueError(f"{key}[{i}] = {t!r} is not a token id in [0, 2**31)")
    return np.asarray(v, dtype=np.int32)


class _Streams:
    """Synthesised per-session streams, grown on demand and shared by a session's turns."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self._cache: dict[str, np.ndarray] = {}

    def get(self, session: str, length: int) -> np.ndarray:
        have = self._cache.get(session)
        if have is None or len(have) < length:
            have = synthetic_tokens(("session", session), max(length, 2 * (len(have) if have is not None else 0)), self.vocab)
            self._cache[session] = have
        return have[:length]


def parse_line(obj: Any, streams: _Streams, line: int) -> Request:
    """One decoded JSON line -> Request; ValueError with the reason otherwise."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(TRACE_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(TRACE_KEYS)}")
    for key in ("session", "turn", "output_len"):
        if key not in obj:
            raise ValueError(f"missing required key {key!r}")
    session = obj["session"]
    if isinstance(session, bool) or not isinstance(session, (str, int)) or session == "":
        raise ValueError(f"'session' must be a non-empty string or an integer, got {session!r}")
    session = str(session)
    turn = _int_field(obj, "turn", 0)
    out_len = _int_field(obj, "output_len", 0)
    has_ids, has_len = "input_ids" in obj, "input_len" in obj
    if has_ids == has_len:
        raise ValueError("exactly one of 'input_ids' or 'input_len' is required")
    if has_ids:
        input_ids = _ids_field(obj, "input_ids")
        if not len(input_ids):
            raise ValueError("'input_ids' must not be empty")
    else:
        n = _int_field(obj, "input_len", 1)
        input_ids = streams.get(session, n + out_len)[:n]
    if "output_ids" in obj:
        output_ids = _ids_field(obj, "output_ids")
        if len(output_ids) != out_len:
            raise ValueError(f"'output_ids' has {len(output_ids)} ids but 'output_len' is {out_len}")
    elif has_len:
        output_ids = streams.get(session, len(input_ids) + out_len)[len(input_ids):]
    else:
        output_ids = synthetic_tokens(("output", session, turn), out_len, streams.vocab)
    arrival = obj.get("arrival", 0.0)
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not arrival >= 0:
        raise ValueError(f"'arrival' must be a number >= 0, got {arrival!r}")
    return Request(session, turn, input_ids, output_ids, float(arrival), line)


def parse_trace(lines: Iterable[str], path: str = "<trace>", skip_bad: bool = False,
                vocab: int = 32000) -> Trace:
    """Parse every line first; then fail (default) or skip-and-report the bad ones."""
    streams = _Streams(vocab)
    good: list[Request] = []
    errors: list[TraceLineError] = []
    seen: dict[tuple[str, int], int] = {}
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            errors.append(TraceLineError(lineno, f"invalid JSON: {exc.msg} at column {exc.colno}"))
            continue
        try:
            req = parse_line(obj, streams, lineno)
        except ValueError as exc:
            errors.append(TraceLineError(lineno, str(exc)))
            continue
        key = (req.session, req.turn)
        if key in seen:
            errors.append(TraceLineError(
                lineno, f"session {req.session!r} turn {req.turn} already given on line {seen[key]}"))
            continue
        seen[key] = lineno
        good.append(req)
    if errors and not skip_bad:
        raise TraceError(path, errors)
    if not good:
        raise TraceError(path, errors or [TraceLineError(0, "the trace has no requests")])
    return Trace(path, tuple(good), tuple(errors))


def load_trace(path: str | os.PathLike[str], skip_bad: bool = False, vocab: int = 32000) -> Trace:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_trace(f, str(path), skip_bad, vocab)
    except OSError as exc:
        raise ConfigError(f"cannot read trace {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"trace {str(path)!r} is not UTF-8 text: {exc.reason}") from None


def write_trace(path: str | os.PathLike[str], requests: Iterable[Request]) -> int:
    """Write requests as JSONL (explicit ids, so the file replays exactly); returns lines."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
            n += 1
    return n
