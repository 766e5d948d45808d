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

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


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


class MappingError(BaseModel):
    """One validation finding: which stage (None: cross-stage), which pool, expected vs got.

    Positional like the record it is (``MappingError(stage, pool, expected, got, message)``),
    bounded like anything that may arrive from another rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: int | None = Field(description="the stage it concerns; None: cross-stage (partition tiling)")
    pool: str = Field(max_length=64, description="the pool kind, or layer_map, partition, fingerprint, ...")
    expected: Any = Field(description="what validation wanted (any JSON value)")
    got: Any = Field(description="what the stage really had (any JSON value)")
    message: str = Field(max_length=4096)

    def __init__(self, stage: int | None = None, pool: str = "", expected: Any = None, got: Any = None,
                 message: str = "", **kw: Any):
        if kw:  # keyword form (model_validate, JSON)
            super().__init__(**kw)
        else:
            super().__init__(stage=stage, pool=pool, expected=expected, got=got, message=message)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def __str__(self) -> str:
        where = "cross-stage" if self.stage is None else f"stage {self.stage}"
        return f"[{where}] {self.pool}: {self.message} (expected {self.expected!r}, got {self.got!r})"


class StageMappingInvalid(StageCacheError, ValueError):
    """Raised where a component must refuse an invalid stage (e.g. pool construction)."""

    def __init__(self, errors: list[MappingError]):
        self.errors = list(errors)
        lines = "\n  ".join(str(e) for e in self.errors)
        super().__init__(f"{len(self.errors)} mapping error(s):\n  {lines}")
