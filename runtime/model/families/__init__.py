"""The model families stagecache knows: one module each, tried in order on a ``config.json``.

Adding a family is adding its module here (and its preset and its sglang comparison test:
docs/architecture.md).  Nothing else lists families: the CLI's ``--fault`` names, the report's
layer entries and the config dispatch all come from ``FAMILIES``.
"""

from __future__ import annotations

from typing import Any, Union

from ...errors import ConfigError
from ..config_file import load_config
from ..family import Family, FaultKind
from ..spec import ModelSpec, shown
from . import deepseek_v4, dsa, mha, mla, swa_hybrid

#: Every family, in the order a config is matched against them.
FAMILIES: tuple[Family, ...] = (deepseek_v4.FAMILY, dsa.FAMILY, swa_hybrid.FAMILY, mla.FAMILY, mha.FAMILY)
#: The default family of a report or record that names none (those written before families).
DEFAULT_FAMILY = deepseek_v4.FAMILY.name

#: A layer entry of any family (what a report or record carries).
AnyLayerEntry = Union[tuple(f.entry for f in FAMILIES)]  # type: ignore[valid-type]  # noqa: UP007


def family_named(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ConfigError(f"unknown model family {name!r}; families are {', '.join(f.name for f in FAMILIES)}")


def family_of(cfg: dict[str, Any], name: str) -> Family:
    """The family a parsed config.json belongs to (one line listing them when none matches)."""
    if isinstance(cfg, dict):
        for f in FAMILIES:
            if f.matches(cfg):
                return f
    arch = cfg.get("architectures") if isinstance(cfg, dict) else None
    known = ", ".join(a for f in FAMILIES for a in f.architectures)
    raise ConfigError(f"model config {name!r}: not a model of a family stagecache knows "
                      f"(architectures {shown(arch)}); expected one of: {known}")


def spec_from_config(cfg: dict[str, Any], name: str = "custom") -> ModelSpec:
    """Validate a parsed config.json with its family's rules and build its spec."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"model config {name!r}: expected a JSON object, got {type(cfg).__name__}")
    return family_of(cfg, name).spec_from_config(cfg, name)


def load_spec(model: str) -> ModelSpec:
    """A preset name, a path to a config.json, or a Hugging Face repo id whose config.json is in
    the local cache (``model.hf_cache``)."""
    cfg, name = load_config(model)
    return spec_from_config(cfg, name=name)


def all_fault_kinds() -> dict[str, FaultKind]:
    """Every family's faults by name (the CLI accepts any; the plan checks the model's)."""
    return {k.name: k for f in FAMILIES for k in f.faults}
