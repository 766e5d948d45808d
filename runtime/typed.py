"""The base of stagecache's typed numbers and records: an unknown field is an error, never dropped
silently, so a snapshot from another rank or another version says at once what it does not share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
