"""Reading a user's file at the boundary: bounded, strict UTF-8, one-line errors.

Every file stagecache reads whole (a model ``config.json``, a saved report) goes
through ``read_bounded_text``: it never reads more than ``limit + 1`` bytes (a
huge file or an endless stream costs nothing), and every failure is one
``ConfigError`` that names the file, what went wrong and what was expected.
Traces are streamed line by line instead (``cache/traces.py``).
"""

from __future__ import annotations

import os

from .errors import ConfigError


def read_bounded_text(path: str | os.PathLike[str], limit: int, what: str, expected: str) -> str:
    """The text of ``path`` (at most ``limit`` bytes, UTF-8); ``what`` names it in errors."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read: {exc.strerror or exc}; expected {expected}") from None
    if len(data) > limit:
        raise ConfigError(f"{what} is larger than {limit} bytes; expected {expected}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not UTF-8 text (byte {exc.start}: {exc.reason}); "
                          f"expected {expected}") from None
