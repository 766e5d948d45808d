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
from dataclasses import asdict, dataclass
from typing import Any

from ..model.spec import ModelSpec

#: The KV dtype of every pool stagecache models: sglang 0.5.23's V4 FP8 layout (FP8 nope,
#: BF16 rope, UE8M0 scales) and FP8 indexer keys.
KV_DTYPE = "fp8_v4"


def config_hash(spec: ModelSpec) -> str:
    """16 hex digits over the spec's layout fields (its name left out)."""
    fields = {k: v for k, v in spec.to_dict().items() if k != "name"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Fingerprint:
    """The fields a deployment's stages must share (see the module docstring)."""

    model: str
    config_hash: str
    kv_dtype: str
    page_size: int
    pp_size: int
    tp_size: int
    partition: tuple[int, ...]  # layers per stage, in stage order (explicit or sglang's even split)

    @property
    def digest(self) -> str:
        """16 hex digits over every field but the display name: equal digests, one deployment."""
        fields = asdict(self)
        fields.pop("model")
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    def differences(self, other: Fingerprint) -> list[str]:
        """``field: mine != theirs`` for every field (but the name) that differs."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if k != "model" and mine[k] != theirs[k]]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "partition": list(self.partition), "digest": self.digest}
