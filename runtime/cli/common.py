"""Flags shared by every command that needs a model layout, parsed and validated once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..errors import ConfigError
from ..model.layer_map import ModelLayout, build_layout
from ..model.partition import parse_partition
from ..model.spec import PRESETS, ModelSpec, check_page_size, load_spec
from ..validation.faults import FAULTS, Fault, parse_faults

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


@dataclass(frozen=True)
class LayoutArgs:
    spec: ModelSpec
    layout: ModelLayout
    page_size: int
    faults: tuple[Fault, ...]


def layout_from_args(args: argparse.Namespace) -> LayoutArgs:
    spec = load_spec(args.model)
    page_size = check_page_size(spec, args.page_size)
    partition = parse_partition(args.pp_partition)
    layout = build_layout(spec, args.pp_size, args.tp_size, partition)
    faults = parse_faults(args.fault, args.pp_size)
    return LayoutArgs(spec, layout, page_size, faults)


__all__ = ["ConfigError", "LayoutArgs", "add_layout_args", "layout_from_args", "positive_int"]
