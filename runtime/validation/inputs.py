"""The run's layout inputs, resolved and validated once at the boundary.

Every entry point (CLI commands, benchmarks, ``serve``) names a model, a PP/TP
size, an optional explicit partition, a page size and optional faults.  This is
the one function that turns those raw values into checked objects, so a bad
value is the same ``ConfigError`` (exit 2) whichever command received it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..model.layer_map import ModelLayout, build_layout
from ..model.partition import parse_partition
from ..model.pool_kinds import check_page_size
from ..model.spec import ModelSpec, load_spec
from .faults import Fault, parse_faults


@dataclass(frozen=True)
class LayoutArgs:
    """A validated PP layout (with its model spec), the page size and the planted faults."""

    layout: ModelLayout
    page_size: int
    faults: tuple[Fault, ...]

    @property
    def spec(self) -> ModelSpec:
        """The layout's spec (kept once, in the layout)."""
        return self.layout.spec


def resolve_layout(
    model: str,
    pp_size: int,
    tp_size: int = 1,
    pp_partition: str | Sequence[int] | None = None,
    page_size: int = 256,
    faults: Iterable[str] | None = None,
) -> LayoutArgs:
    """Load the spec, check the page size, partition with sglang's rules, parse faults."""
    spec = load_spec(model)
    page = check_page_size(spec, page_size)
    layout = build_layout(spec, pp_size, tp_size, parse_partition(pp_partition))
    return LayoutArgs(layout, page, parse_faults(faults, pp_size))
