"""A model's spec: the ``config.json`` fields that decide its KV-cache layout, read by its family.

Every model family (``model/families``) reads a Hugging Face ``config.json`` into a frozen
``ModelSpec`` subclass of its own.  What every consumer needs of *any* spec is here: its name,
its layer count, its family, the cache kind of each layer, and its fields as a dict (which the
config hash covers).  Fields are validated where a family reads them (``ConfigFields``), so
later code can trust a spec: a wrong value is a ``ConfigError`` naming the file, the field, the
index and the value.  Reading the file itself (bounded, presets, Hub repo ids) is
``model/config_file.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from .family import Family

#: Upper bounds of the sizes a config may give (far above any real model; a value past one is a
#: typo or an attack, and would overflow a later size computation or allocation).
MAX_LAYERS = 4096
MAX_DIM = 1 << 16
MAX_HEADS = 1 << 12
MAX_SLIDING_WINDOW = 1 << 20
MAX_MTP_LAYERS = 64
#: sglang's ``--kv-cache-dtype`` values stagecache models (``auto``: the model's dtype).
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3")


@dataclass(frozen=True)
class ModelSpec:
    """What the KV cache needs to know about a model; each family subclasses it with its fields."""

    name: str
    num_layers: int

    @property
    def family(self) -> Family:
        """The family that read this spec (and sizes, numbers and validates its pools): the
        ``FAMILY`` of the spec's module, as each family is one module of ``model/families``."""
        return sys.modules[type(self).__module__].FAMILY  # type: ignore[no-any-return]

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The cache kind of every layer, by global layer id (names of ``family.layer_kinds``); by
        default every layer has the family's first kind, as in a one-kind family (MHA, MLA)."""
        return (self.family.layer_kinds[0].name,) * self.num_layers

    def to_dict(self) -> dict[str, Any]:
        """The spec's fields as plain JSON (tuples as lists), in declaration order: what ``pools
        --json`` shows and the config hash covers.  A family whose JSON names differ overrides it."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @property
    def pp_refused(self) -> str | None:
        """Why sglang 0.5.23 does not split this model over PP stages (None: it does)."""
        return None

    def tp_refused(self, tp_size: int) -> str | None:
        """Why stagecache's bytes for this model would be wrong at ``tp_size`` TP ranks (None: the
        KV cache is the same on every TP rank, as MLA's and DeepSeek V4's are)."""
        return None


def shown(value: Any) -> str:
    """A value as an error shows it: ``repr``, cut to 60 characters."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else \
        f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 60 else text[:57] + "..."


class ConfigFields:
    """Typed, bounded reads of one parsed ``config.json``; every failure names the field."""

    def __init__(self, cfg: Any, name: str):
        self.source = f"model config {name!r}"
        if not isinstance(cfg, dict):
            raise ConfigError(f"{self.source}: expected a JSON object, got {type(cfg).__name__}")
        self.cfg = cfg

    def error(self, text: str) -> ConfigError:
        return ConfigError(f"{self.source}: {text}")

    def positive_int(self, key: str, high: int, default: int | None = None) -> int:
        """A required (or defaulted) integer in ``[1, high]``."""
        if key not in self.cfg:
            if default is not None:
                return default
            raise self.error(f"missing required field {key!r}")
        value = self.cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= high:
            raise self.error(f"field {key!r} must be a positive integer <= {high}, got {shown(value)}")
        return value

    def int_in(self, key: str, low: int, high: int, default: int) -> int:
        """An optional integer in ``[low, high]``."""
        value = self.cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.error(f"{key!r} must be an integer >= {low} and <= {high}, got {shown(value)}")
        return value

    def nonempty_list(self, key: str) -> list[Any]:
        values = self.cfg.get(key)
        if not isinstance(values, list) or not values:
            raise self.error(f"{key!r} must be a non-empty list, got {shown(values)}")
        return values

    def kinds(self, key: str, values: Sequence[Any], table: Mapping[str, str]) -> list[str]:
        """Each entry of ``values`` (the list or pattern under ``key``) as the layer kind ``table``
        gives it: the one rule every family's layer-type field follows."""
        for i, v in enumerate(values):
            if not isinstance(v, str) or v not in table:
                raise self.error(f"{key}[{i}] = {shown(v)} is not supported (supported: {', '.join(table)})")
        return [table[v] for v in values]

    def check_ints(self, key: str, values: list[Any], allowed: tuple[int, ...]) -> list[int]:
        """Every entry of ``values`` (the list under ``key``) is an integer from ``allowed``."""
        for i, v in enumerate(values):
            # type(v) is int: True and 4.0 compare equal to 1 and 4 but are not list entries
            if type(v) is not int or v not in allowed:
                raise self.error(f"{key}[{i}] = {shown(v)} is not supported "
                                 f"(supported: the integers {', '.join(map(str, allowed))})")
        return values
