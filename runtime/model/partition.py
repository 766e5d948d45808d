"""Pipeline-parallel layer partition, with exactly sglang's rules.

sglang's ``get_pp_indices``: an even split of ``num_layers // pp_size`` layers
per stage, and the *last* ``num_layers % pp_size`` stages take one extra layer.
An explicit partition (sglang's ``SGLANG_PP_LAYER_PARTITION``, our
``--pp-partition``) overrides it and must have ``pp_size`` entries summing to
the layer count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class StageSlice:
    """The half-open range of global layers ``[start, end)`` that one PP stage owns."""

    stage: int
    start: int
    end: int

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def parse_partition(text: str | Sequence[int] | None) -> tuple[int, ...] | None:
    """``"11,11,11,10"`` -> ``(11, 11, 11, 10)``; None stays None."""
    if text is None:
        return None
    if isinstance(text, str):
        parts = [p.strip() for p in text.split(",")]
        # ASCII digits only (int() also takes '٣' and '1_0'), at most 6 each: no 4,300-digit int()
        if not all(p.isascii() and p.isdigit() and len(p) <= 6 for p in parts):
            shown = repr(text) if len(text) <= 60 else repr(text[:60]) + f"... ({len(text)} characters)"
            raise ConfigError(
                f"invalid --pp-partition {shown}: expected comma-separated integers like 11,11,11,10"
            )
        values = tuple(int(p) for p in parts)
    else:
        values = tuple(int(v) for v in text)
    return values


def pp_indices(
    num_layers: int, pp_rank: int, pp_size: int, partition: Sequence[int] | None = None
) -> tuple[int, int]:
    """``(start, end)`` of stage ``pp_rank``, as sglang's ``get_pp_indices`` computes it."""
    _check_sizes(num_layers, pp_size)
    if not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pp_rank {pp_rank} out of range for pp_size {pp_size}")
    if partition is not None:
        check_partition(partition, num_layers, pp_size)
        start = sum(partition[:pp_rank])
        return start, start + partition[pp_rank]
    base, remainder = divmod(num_layers, pp_size)
    plain = pp_size - remainder  # stages without the extra layer come first
    if pp_rank >= plain:
        start = pp_rank * (base + 1) - plain
        return start, start + base + 1
    return pp_rank * base, pp_rank * base + base


def check_partition(partition: Sequence[int], num_layers: int, pp_size: int) -> None:
    """An explicit partition must have pp_size positive entries summing to num_layers."""
    text = ",".join(map(str, partition))
    if len(partition) != pp_size:
        raise ConfigError(
            f"--pp-partition {text} has {len(partition)} entries, expected pp_size={pp_size}"
        )
    if any(p <= 0 for p in partition):
        raise ConfigError(f"--pp-partition {text}: every stage needs at least one layer")
    if sum(partition) != num_layers:
        raise ConfigError(
            f"--pp-partition {text} sums to {sum(partition)}, expected num_layers={num_layers}"
        )


def partition_layers(
    num_layers: int, pp_size: int, partition: Sequence[int] | None = None
) -> tuple[StageSlice, ...]:
    """Every stage's slice, in stage order."""
    _check_sizes(num_layers, pp_size)
    return tuple(
        StageSlice(rank, *pp_indices(num_layers, rank, pp_size, partition))
        for rank in range(pp_size)
    )


def _check_sizes(num_layers: int, pp_size: int) -> None:
    if pp_size < 1:
        raise ConfigError(f"--pp-size must be >= 1, got {pp_size}")
    if pp_size > num_layers:
        raise ConfigError(
            f"--pp-size {pp_size} is larger than the model's {num_layers} layers: "
            "some stage would own no layer"
        )
