"""Reading a user's file at the boundary: bounded, strict UTF-8, one-line errors.

Every file stagecache reads whole (a model ``config.json``, a saved report) goes
through ``read_bounded_text``: it never reads more than ``limit + 1`` bytes (a
huge file or an endless stream costs nothing), and every failure is one
``ConfigError`` that names the file, what went wrong and what was expected.
Traces are streamed line by line instead (``traces/readers.py``), from the same
``open_regular``: a FIFO, a device or a socket is refused before a byte is read
(opening a FIFO for reading would wait for a writer forever), and so is a path
that cannot be looked at (name too long, a parent without permission).

``check_output_path`` does the same for files a command will write (``--out``):
checked before any work starts, so a benchmark never runs for minutes only to
find it cannot save its result.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

from .errors import ConfigError


def open_regular(path: str | os.PathLike[str], what: str, expected: str) -> BinaryIO:
    """``path`` opened for binary reading, refused (``ConfigError``) unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read: {exc.strerror or exc}; expected {expected}") from None
    except ValueError as exc:  # a NUL byte in the path
        raise ConfigError(f"{what}: cannot read: {exc}; expected {expected}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{what}: cannot read: Is a directory; expected {expected}")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} is not a regular file (a FIFO, device or socket is never "
                              f"read); expected {expected}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded_text(path: str | os.PathLike[str], limit: int, what: str, expected: str) -> str:
    """The text of ``path`` (at most ``limit`` bytes, UTF-8); ``what`` names it in errors."""
    try:
        with open_regular(path, what, expected) as f:
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


def read_bounded_json(path: str | os.PathLike[str], limit: int, what: str, expected: str) -> object:
    """The JSON value in ``path`` (read as ``read_bounded_text``); any defect is one ConfigError
    line naming ``what`` and ``expected``: saved reports come back from users' disks."""
    text = read_bounded_text(path, limit, what, expected)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what}: not JSON (line {exc.lineno}: {exc.msg}); expected {expected}") from None
    except RecursionError:
        raise ConfigError(f"{what}: JSON nested too deeply; expected {expected}") from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise ConfigError(f"{what}: {str(exc).split(';')[0]}; expected {expected}") from None


def path_kind(path: str | os.PathLike[str], what: str) -> str | None:
    """'dir', 'file', 'other' or None (no such path); a path that cannot be looked at (name too
    long, a parent without permission) is a ``ConfigError`` instead of a traceback."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ConfigError(f"{what}: cannot look at it: {getattr(exc, 'strerror', None) or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    return "file" if stat.S_ISREG(st.st_mode) else "other"


def check_output_path(value: str, flag: str) -> str:
    """A file ``flag`` will write: not a directory, in an existing directory we can write."""
    expected = "expected a file path in an existing, writable directory"
    if not value.strip():
        raise ConfigError(f"{flag} is empty; {expected}")
    kind = path_kind(value, f"{flag} {value!r}")
    if kind == "dir":
        raise ConfigError(f"{flag} {value!r} is a directory; {expected}")
    if kind == "other":
        raise ConfigError(f"{flag} {value!r} is not a regular file; {expected}")
    parent = Path(value).parent
    if path_kind(parent, f"{flag} {value!r}") != "dir":
        raise ConfigError(f"{flag} {value!r}: {str(parent)!r} is not a directory; {expected}")
    if not os.access(parent, os.W_OK | os.X_OK) or (kind == "file" and not os.access(value, os.W_OK)):
        raise ConfigError(f"{flag} {value!r}: cannot write there (permission denied); {expected}")
    return value
