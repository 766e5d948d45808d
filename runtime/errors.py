"""Error types shared by every layer of stagecache.

Two kinds of failure are kept apart on purpose:

* ``ConfigError`` -- the *input* is wrong (unknown preset, unreadable config,
  bad flag value).  The CLI turns it into exit code 2 and a one-line message.
* ``MappingError`` -- the input is fine but a stage's pools or layer map are
  wrong.  These are *data*, collected (never raised one by one) so an operator
  sees every problem of every stage at once.  ``StageMappingInvalid`` wraps a
  list of them when a component must refuse to go on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


class StageCacheError(Exception):
    """Base class of every error stagecache raises on purpose."""


class ConfigError(StageCacheError, ValueError):
    """Bad user input: the message is complete and fits on one line."""


class LayerNotOwnedError(StageCacheError, KeyError, ValueError):
    """A global layer id was used on a stage that does not own it (or has no buffer of that kind).

    A ``ValueError``, as sglang's own mapping errors are (``DeepSeek V4 SWA KV pool must be
    PP-stage-local``), so code that guards sglang's calls guards ours; and a ``KeyError`` for
    the lookup it is.
    """

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class MappingError:
    """One validation finding: which stage, which pool, expected vs got."""

    stage: int | None
    pool: str
    expected: Any
    got: Any
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = "cross-stage" if self.stage is None else f"stage {self.stage}"
        return f"[{where}] {self.pool}: {self.message} (expected {self.expected!r}, got {self.got!r})"


class StageMappingInvalid(StageCacheError, ValueError):
    """Raised where a component must refuse an invalid stage (e.g. pool construction)."""

    def __init__(self, errors: list[MappingError]):
        self.errors = list(errors)
        lines = "\n  ".join(str(e) for e in self.errors)
        super().__init__(f"{len(self.errors)} mapping error(s):\n  {lines}")
