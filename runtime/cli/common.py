"""Flags shared by every command that needs a model layout, parsed and validated once."""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..model.spec import PRESETS
from ..validation.faults import FAULTS
from ..validation.inputs import LayoutArgs, resolve_layout

DEFAULT_PAGE_SIZE = 256


def positive_int(text: str) -> int:
    """argparse type: a clear one-line message instead of a traceback."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type for a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def add_layout_args(p: argparse.ArgumentParser, default_model: str | None = None) -> None:
    p.add_argument(
        "--model",
        required=default_model is None,
        default=default_model,
        help=f"preset ({', '.join(PRESETS)}) or path to a Hugging Face config.json",
    )
    p.add_argument("--pp-size", type=positive_int, default=1 if default_model is None else 4,
                   help="pipeline-parallel stages")
    p.add_argument("--tp-size", type=positive_int, default=1,
                   help="tensor-parallel ranks per stage (KV is replicated across TP)")
    p.add_argument("--pp-partition", default=None,
                   help="explicit layers per stage, e.g. 11,11,11,10 (sglang's SGLANG_PP_LAYER_PARTITION)")
    p.add_argument("--page-size", type=positive_int, default=DEFAULT_PAGE_SIZE,
                   help=f"tokens per page (default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--fault", action="append", default=[], metavar="NAME[@STAGE]",
                   help="build the stages the way a known bug did: " + ", ".join(FAULTS))


def layout_from_args(args: argparse.Namespace) -> LayoutArgs:
    """The layout flags of ``add_layout_args`` as validated objects."""
    return resolve_layout(args.model, args.pp_size, args.tp_size, args.pp_partition,
                          args.page_size, args.fault)


__all__ = ["ConfigError", "LayoutArgs", "add_layout_args", "layout_from_args", "positive_float", "positive_int"]
