"""A deployment's fingerprint: what every stage of one deployment must agree on.

Two PP ranks that disagree on any of these fields compute different layouts (a different
partition, page size or model) or read each other's bytes wrongly (a different KV dtype), so
ranks compare fingerprints at start-up and the L3 store puts one in every key.  The config
hash covers the fields that decide the KV layout (``ModelSpec`` without its display name), so
the same model read from two paths on two hosts hashes the same.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..model.spec import ModelSpec


def config_hash(spec: ModelSpec) -> str:
    """16 hex digits over the spec's layout fields (its name left out)."""
    fields = {k: v for k, v in spec.to_dict().items() if k != "name"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


class Fingerprint(BaseModel):
    """The fields a deployment's stages must share (see the module docstring); positional like the
    record it is, bounded like anything that may arrive from another rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(max_length=256)
    config_hash: str = Field(max_length=64)
    kv_dtype: str = Field(max_length=64)
    page_size: int
    pp_size: int
    tp_size: int
    #: layers per stage, in stage order (explicit or sglang's even split)
    partition: tuple[int, ...] = Field(max_length=4096)

    def __init__(self, model: str, config_hash: str, kv_dtype: str, page_size: int, pp_size: int,
                 tp_size: int, partition: tuple[int, ...]):
        super().__init__(model=model, config_hash=config_hash, kv_dtype=kv_dtype, page_size=page_size,
                         pp_size=pp_size, tp_size=tp_size, partition=partition)

    def _fields(self) -> dict[str, Any]:
        return {**self.model_dump(), "partition": list(self.partition)}

    @property
    def digest(self) -> str:
        """16 hex digits over every field but the display name: equal digests, one deployment."""
        fields = self._fields()
        fields.pop("model")
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    def differences(self, other: Fingerprint) -> list[str]:
        """``field: mine != theirs`` for every field (but the name) that differs."""
        mine, theirs = self.model_dump(), other.model_dump()
        return [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if k != "model" and mine[k] != theirs[k]]

    def to_dict(self) -> dict[str, Any]:
        return {**self._fields(), "digest": self.digest}
