"""Request traces: two JSONL formats, detected from the first line, read as a stream.

``tokens`` (stagecache's own, one chat turn per line) and ``mooncake`` (``mooncake_trace.py``);
docs/hicache.md, "Traces", lists their fields.  The boundary is strict, because a trace is user
input: every line is checked against size limits *before* anything is sized by it, any unknown
key is an error, and a bad line is reported as ``FILE:LINE: field = value: accepted: ...``
(by default the run fails before replay; ``skip_bad`` leaves them out).  Token ids are checked
as one numpy array, not one Python comparison per token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..bounded_io import open_regular
from ..errors import ConfigError
from .fields import checked_keys, id_array, int_field, require, time_field
from .mooncake_trace import (
    DEFAULT_BLOCK_TOKENS,
    MOONCAKE_KEYS,
    BlockRequest,
    PrefixCheck,
    parse_mooncake,
)
from .workload import TOKEN_LIMIT, Request, WorkloadConfig, generate, synthetic_tokens

__all__ = ["FORMATS", "MAX_LINE_BYTES", "MAX_REQUEST_TOKENS", "BlockRequest", "Request", "Trace",
           "TraceError", "TraceLineError", "WorkloadConfig", "detect_format", "generate",
           "load_requests", "load_trace", "parse_trace", "write_trace"]

FORMATS = ("tokens", "mooncake")
TRACE_KEYS = ("session", "turn", "input_ids", "input_len", "output_len", "output_ids", "arrival")
#: A line longer than this is refused unread (a 2M-token prompt as JSON ids is ~16 MB).
MAX_LINE_BYTES = 32 * 2**20
#: Prompt or answer length of one request, tokens (input_len 1e9 is refused, not allocated).
MAX_REQUEST_TOKENS = 2**21
#: Bad lines kept for the report (the count is always exact).
MAX_REPORTED = 100


@dataclass(frozen=True)
class TraceLineError:
    line: int
    message: str
    path: str = "<trace>"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


class TraceError(ConfigError):
    """A trace file that cannot be replayed as written (the bad lines listed, one line of text)."""

    def __init__(self, path: str, errors: Sequence[TraceLineError], total: int | None = None):
        self.path = path
        self.errors = list(errors)
        total = len(self.errors) if total is None else total
        shown = "; ".join(str(e) for e in self.errors[:5])
        more = f" (and {total - 5} more)" if total > 5 else ""
        super().__init__(f"trace {path}: {total} malformed line(s), nothing replayed: {shown}{more}")


@dataclass(frozen=True)
class Trace:
    path: str
    requests: tuple[Any, ...]  # Request (tokens format) or BlockRequest (mooncake)
    errors: tuple[TraceLineError, ...]  # lines skipped (skip_bad=True only; the first MAX_REPORTED)
    format: str = "tokens"
    lines_read: int = 0
    bad_lines: int = 0


# -- the tokens format ------------------------------------------------------------------------
def _ids_field(obj: dict, key: str, has_bool: bool) -> np.ndarray:
    """A token id list as int32, at most ``MAX_REQUEST_TOKENS`` ids, each in ``[0, 2**31)``."""
    v = obj[key]
    if not isinstance(v, list):
        raise ValueError(f"field {key!r} = {type(v).__name__}: accepted: a list of token ids")
    if len(v) > MAX_REQUEST_TOKENS:
        raise ValueError(f"field {key!r} has {len(v)} ids: accepted: at most {MAX_REQUEST_TOKENS}")
    return id_array(v, key, TOKEN_LIMIT, "a token id in [0, 2**31)", np.int32, has_bool)


class _Streams:
    """Synthesised per-session streams, grown on demand and shared by a session's turns."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self._cache: dict[str, np.ndarray] = {}

    def get(self, session: str, length: int) -> np.ndarray:
        have = self._cache.get(session)
        if have is None or len(have) < length:
            grow = max(length, 2 * (len(have) if have is not None else 0))
            have = synthetic_tokens(("session", session), grow, self.vocab)
            self._cache[session] = have
        return have[:length]


def parse_line(obj: Any, streams: _Streams, line: int, has_bool: bool = True) -> Request:
    """One decoded tokens-format line -> Request; ValueError with the reason otherwise."""
    checked_keys(obj, TRACE_KEYS)
    require(obj, "session", "turn", "output_len")
    session = obj["session"]
    if isinstance(session, bool) or not isinstance(session, (str, int)) or session == "":
        raise ValueError(f"field 'session' = {session!r}: accepted: a non-empty string or an integer")
    session = str(session)
    turn = int_field(obj, "turn", 0, 2**31 - 1)
    out_len = int_field(obj, "output_len", 0, MAX_REQUEST_TOKENS)
    has_ids, has_len = "input_ids" in obj, "input_len" in obj
    if has_ids == has_len:
        raise ValueError("exactly one of 'input_ids' or 'input_len' is required")
    if has_ids:
        input_ids = _ids_field(obj, "input_ids", has_bool)
        if not len(input_ids):
            raise ValueError("field 'input_ids' = []: accepted: a non-empty list of token ids")
    else:
        n = int_field(obj, "input_len", 1, MAX_REQUEST_TOKENS)
        input_ids = streams.get(session, n + out_len)[:n]
    if "output_ids" in obj:
        output_ids = _ids_field(obj, "output_ids", has_bool)
        if len(output_ids) != out_len:
            raise ValueError(f"field 'output_ids' has {len(output_ids)} ids: accepted: exactly "
                             f"'output_len' = {out_len}")
    elif has_len:
        output_ids = streams.get(session, len(input_ids) + out_len)[len(input_ids):]
    else:
        output_ids = synthetic_tokens(("output", session, turn), out_len, streams.vocab)
    arrival = time_field(obj, "arrival", 1e12, "seconds, a number in [0, 1e12)")
    return Request(session, turn, input_ids, output_ids, arrival, line)


# -- format detection and the streaming reader ----------------------------------------------------
def detect_format(obj: Any) -> str | None:
    """The format a decoded first line belongs to, or None when it names neither's keys."""
    if not isinstance(obj, dict):
        return None
    if "hash_ids" in obj or ("input_length" in obj and "session" not in obj):
        return "mooncake"
    if {"session", "input_ids", "input_len"} & set(obj):
        return "tokens"
    return None


def _raw_lines(f: Any, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) from a binary file; ``None`` for a line longer than ``max_bytes``."""
    lineno = 0
    while True:
        raw = f.readline(max_bytes + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # skip the rest, never holding it whole
                raw = f.readline(1 << 20)
            yield lineno, None
            continue
        yield lineno, raw


class _Reader:
    """Parses decoded lines of one format; keeps the per-trace state (streams, prefixes, keys)."""

    def __init__(self, fmt: str, block_tokens: int, vocab: int):
        self.fmt = fmt
        self.block_tokens = block_tokens
        self.streams = _Streams(vocab)
        self.prefix = PrefixCheck()
        self.vocab = vocab
        self.seen: dict[tuple[str, int], int] = {}

    def parse(self, obj: Any, lineno: int, index: int, has_bool: bool) -> Any:
        if self.fmt == "mooncake":
            return parse_mooncake(obj, lineno, index, self.block_tokens, MAX_REQUEST_TOKENS,
                                  has_bool, self.prefix, self.vocab)
        req = parse_line(obj, self.streams, lineno, has_bool)
        first = self.seen.setdefault((req.session, req.turn), lineno)
        if first != lineno:
            raise ValueError(f"session {req.session!r} turn {req.turn} already given on line {first}")
        return req


def _decode(raw: bytes | None, max_bytes: int) -> tuple[Any, bool]:
    if raw is None:
        raise ValueError(f"line longer than {max_bytes} bytes: accepted: at most {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply: accepted: an object of numbers and lists") from None
    return obj, ("true" in text or "false" in text)


def parse_trace(lines: Iterable[str | bytes], path: str = "<trace>", skip_bad: bool = False,
                vocab: int = 32000, fmt: str = "auto", limit: int | None = None,
                block_tokens: int = DEFAULT_BLOCK_TOKENS, max_line_bytes: int = MAX_LINE_BYTES) -> Trace:
    """Parse lines (stopping after ``limit`` good requests); then fail (default) or skip-and-report."""
    if fmt not in ("auto", *FORMATS):
        raise ConfigError(f"--trace-format {fmt!r}: accepted: auto, {', '.join(FORMATS)}")
    reader: _Reader | None = None if fmt == "auto" else _Reader(fmt, block_tokens, vocab)
    good: list[Any] = []
    errors: list[TraceLineError] = []
    bad = read = 0
    for lineno, raw in _numbered(lines, max_line_bytes):
        read = lineno
        if raw is not None and not raw.strip():
            continue
        try:
            obj, has_bool = _decode(raw, max_line_bytes)
            if reader is None:
                reader = _Reader(_detected(obj, path, lineno), block_tokens, vocab)
            good.append(reader.parse(obj, lineno, len(good), has_bool))
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            bad += 1
            if len(errors) < MAX_REPORTED:
                errors.append(TraceLineError(lineno, str(exc), path))
            continue
        if limit is not None and len(good) >= limit:
            break
    if bad and not skip_bad:
        raise TraceError(path, errors, bad)
    if not good:
        raise TraceError(path, errors or [TraceLineError(0, "the trace has no requests", path)],
                         max(bad, 1))
    return Trace(path, tuple(good), tuple(errors), reader.fmt if reader else "tokens", read, bad)


def _detected(obj: Any, path: str, lineno: int) -> str:
    fmt = detect_format(obj)
    if fmt is None:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ConfigError(
            f"trace {path}:{lineno}: cannot tell the format from the first line ({keys}): "
            f"tokens lines have 'session' and 'input_ids'/'input_len', mooncake lines have "
            f"{', '.join(MOONCAKE_KEYS)}; name one with --trace-format")
    return fmt


def _numbered(lines: Iterable[str | bytes], max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    if hasattr(lines, "readline") and "b" in getattr(lines, "mode", ""):
        yield from _raw_lines(lines, max_bytes)
        return
    for lineno, text in enumerate(lines, start=1):
        raw = text.encode("utf-8") if isinstance(text, str) else text
        yield lineno, (None if len(raw) > max_bytes else raw)


def load_requests(path: str | os.PathLike[str], fmt: str = "auto", limit: int | None = None,
                  skip_bad: bool = False, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                  vocab: int = 32000) -> Trace:
    """Read a trace file of either format, streaming, stopping after ``limit`` good requests."""
    try:  # a regular file only: a FIFO would block the read forever
        with open_regular(path, f"trace {str(path)!r}", "a JSONL trace file") as f:
            return parse_trace(f, str(path), skip_bad, vocab, fmt, limit, block_tokens)
    except OSError as exc:
        raise ConfigError(f"cannot read trace {str(path)!r}: {exc.strerror or exc}") from None


def load_trace(path: str | os.PathLike[str], skip_bad: bool = False, vocab: int = 32000) -> Trace:
    """The whole trace, format detected (kept for callers of the tokens-only loader)."""
    return load_requests(path, skip_bad=skip_bad, vocab=vocab)


def write_trace(path: str | os.PathLike[str], requests: Iterable[Any]) -> int:
    """Write requests as JSONL, each in its own format (tokens: explicit ids); returns lines."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
            n += 1
    return n

