"""Flags shared by every command: argparse value types and the model-layout flags.

Every numeric flag of every command goes through one of the types here, so NaN,
infinity, negatives and out-of-range values are refused the same way
everywhere: argparse prints one line naming the flag, the value and what is
accepted (``argument --rate: expected a finite number >= 0, got 'nan'``) and
exits 2, before any work starts.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from .. import defaults
from ..bounded_io import check_output_path
from ..errors import ConfigError
from ..model.config_file import PRESETS
from ..model.spec import KV_CACHE_DTYPES
from ..plan.faults import FAULTS
from ..plan.inputs import resolve_plan
from ..plan.plan import RunPlan, Sizing

if TYPE_CHECKING:  # rich loads only when a command prints
    from rich.console import Console

#: Largest value an integer flag takes unless it says otherwise (fits int64 everywhere).
INT_MAX = 2**63 - 1
#: What a number flag is written as: ASCII digits only.  ``int()`` and ``float()`` also take
#: Unicode digits ('٣') and '_' separators, which no user means on a command line.
_ASCII_INT = re.compile(r"[+-]?[0-9]{1,40}")
_ASCII_FLOAT = re.compile(r"[+-]?(?:[0-9]{1,400}(?:\.[0-9]{0,400})?|\.[0-9]{1,400})(?:[eE][+-]?[0-9]{1,6})?"
                          r"|[+-]?(?:inf|infinity|nan)", re.IGNORECASE)


#: Columns of output that is not a terminal (a pipe, a file, a CI log): so wide that no line is
#: ever broken, so the URL line can be clicked and copied and a table row stays one grep-able line.
UNWRAPPED_WIDTH = 10_000


def output_console(file: TextIO | None = None, stderr: bool = False, highlight: bool = True) -> Console:
    """The rich console of a command's human output: on a terminal, its width (rich reads it);
    anywhere else, never hard-wrapped (rich would otherwise break every line at 80 columns)."""
    from rich.console import Console

    stream = file or (sys.stderr if stderr else sys.stdout)
    terminal = stream.isatty() if hasattr(stream, "isatty") else False
    if terminal:
        return Console(file=file, stderr=stderr, highlight=highlight)
    return Console(file=file, stderr=stderr, highlight=highlight, width=UNWRAPPED_WIDTH,
                   soft_wrap=True)


def shown(text: str, limit: int = 40) -> str:
    """A user's value as an error line shows it: ``repr``, cut to ``limit`` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def int_range(low: int, high: int = INT_MAX) -> Callable[[str], int]:
    """argparse type: an integer in ``[low, high]``, written in ASCII digits."""
    accepted = "a positive integer" if low == 1 else f"an integer >= {low}"
    if high != INT_MAX:
        accepted += f" <= {high}"

    def parse(text: str) -> int:
        if not _ASCII_INT.fullmatch(text.strip()):  # also bounds the length: no 4,300-digit int()
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {shown(text)}")
        value = int(text.strip())
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {value}")
        return value

    parse.__name__ = f"int[{low},{high}]"
    return parse


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def float_range(low: float, high: float = math.inf, *, low_open: bool = False) -> Callable[[str], float]:
    """argparse type: a finite number in ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    op = ">" if low_open else ">="
    accepted = f"a finite number {op} {_num(low)}" + (f" and <= {_num(high)}" if high != math.inf else "")

    def parse(text: str) -> float:
        if not _ASCII_FLOAT.fullmatch(text.strip()):
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {shown(text)}")
        value = float(text)
        in_range = (value > low if low_open else value >= low) and value <= high
        if not math.isfinite(value) or not in_range:
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {shown(text)}")
        return value

    parse.__name__ = f"float[{low},{high}]"
    return parse


positive_int = int_range(1)
nonneg_int = int_range(0)
positive_float = float_range(0.0, low_open=True)
nonneg_float = float_range(0.0)
port_number = int_range(0, 65535)
#: Seconds for timeouts and holds: finite, at most a day (timedelta and sleeps stay sane).
seconds = float_range(0.0, 86400.0, low_open=True)
nonneg_seconds = float_range(0.0, 86400.0)


def fault_spec(text: str) -> str:
    """argparse type for ``--fault NAME[@STAGE]``: a known name; after '@', a stage number."""
    name, at, stage = text.partition("@")
    if name not in FAULTS:
        raise argparse.ArgumentTypeError(
            f"unknown --fault {shown(name)}; known faults: {', '.join(FAULTS)} (as NAME or NAME@STAGE)")
    if at and (not _ASCII_INT.fullmatch(stage) or stage[0] in "+-"):
        raise argparse.ArgumentTypeError(
            f"{shown(text)}: expected a stage number (integer >= 0) after '@', got {shown(stage)}")
    return text


def device_name(text: str) -> str:
    """argparse type of a bench's ``--device``: ``cpu``, ``cuda`` or ``cuda:N``."""
    if not re.fullmatch(r"cpu|cuda(?::[0-9]{1,3})?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {shown(text)}")
    return text


def bench_device(text: str | None) -> str:
    """A bench's ``--device`` (default: cuda when there is one); exit 2 for a CUDA device this
    machine does not have, before any work starts."""
    import torch

    device = text or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {device}: no CUDA device is available here")
        if int(device.partition(":")[2] or 0) >= count:
            raise ConfigError(f"--device {device}: this machine has {count} CUDA device(s), "
                              f"cuda:0..cuda:{count - 1}")
    return device


def output_file(flag: str) -> Callable[[str], str]:
    """argparse type of a file a command writes (``--out``): checked before any work starts."""

    def parse(text: str) -> str:
        try:
            return check_output_path(text, flag)
        except ConfigError as exc:  # argparse names the flag itself
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag} ")) from None

    parse.__name__ = "output file"
    return parse


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """The plan's flags, with the defaults of ``runtime.defaults`` (the same in every command)."""
    p.add_argument("--model", default=defaults.MODEL,
                   help=f"preset ({', '.join(PRESETS)}), path to a Hugging Face config.json, or a Hub "
                   "repo id (ORG/NAME) whose config.json is in the local Hugging Face cache "
                   "(default %(default)s)")
    p.add_argument("--pp-size", type=int_range(1, 4096), default=defaults.PP_SIZE,
                   help="number of pipeline-parallel stages (default %(default)s)")
    p.add_argument("--tp-size", type=int_range(1, 4096), default=defaults.TP_SIZE,
                   help="tensor-parallel ranks per stage; KV is replicated across them (default %(default)s)")
    p.add_argument("--pp-partition", default=None,
                   help="layers of each stage, e.g. 11,11,11,10, as sglang's SGLANG_PP_LAYER_PARTITION "
                   "(default: split evenly)")
    p.add_argument("--page-size", type=int_range(1, 2**20), default=defaults.PAGE_SIZE,
                   help="tokens per page (default %(default)s)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what sglang stores the KV cache as, as its --kv-cache-dtype (default auto: the "
                   "model's dtype; DeepSeek-V4 has its own FP8 layout and takes auto only)")
    p.add_argument("--fault", action="append", default=[], metavar="NAME[@STAGE]", type=fault_spec,
                   help="build the stages the way a known bug did, on every stage or only @STAGE "
                   "(repeatable): " + ", ".join(FAULTS))


def add_layout_command(sub: argparse._SubParsersAction, name: str, help: str,
                       description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand that works on one planned layout: its parser, the layout flags first."""
    p = sub.add_parser(name, help=help, description=description)
    add_layout_args(p)
    return p


def add_trace_args(p: argparse.ArgumentParser, trace_help: str, *, required: bool) -> None:
    """The flags of a command that reads a prefix-cache trace (either format). A Mooncake trace
    fixes the page (one block), so --page-size defaults to None and resolves per format later."""
    from ..traces.mooncake_trace import DEFAULT_BLOCK_TOKENS

    p.set_defaults(page_size=None, default_page_size=defaults.PAGE_SIZE)
    next(a for a in p._actions if a.dest == "page_size").help = (
        f"tokens per page (default {defaults.PAGE_SIZE}; a Mooncake trace: one block, --block-tokens)")
    p.add_argument("--trace", required=required, default=None, metavar="FILE", help=trace_help)
    p.add_argument("--trace-format", choices=("auto", "tokens", "mooncake"), default="auto",
                   help="format of --trace (default: detected from the first line)")
    p.add_argument("--block-tokens", type=positive_int, default=DEFAULT_BLOCK_TOKENS,
                   help=f"tokens per Mooncake hash id; one block = one page (default {DEFAULT_BLOCK_TOKENS})")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed trace lines (reported) instead of refusing the whole file")


def add_host_tier_args(p: argparse.ArgumentParser) -> None:
    """The HiCache host tier's flags as sglang names them (``serve`` and ``bench hicache``)."""
    p.add_argument("--hicache-ratio", type=positive_float, default=defaults.HICACHE_RATIO,
                   help="host pages per device page (default %(default)s, as sglang)")
    p.add_argument("--hicache-write-policy", "--write-policy", dest="write_policy",
                   choices=defaults.WRITE_POLICIES, default=defaults.WRITE_POLICY,
                   help="when device pages are backed up to host (default %(default)s)")
    p.add_argument("--hicache-layout", choices=defaults.HOST_LAYOUTS, default=defaults.HOST_LAYOUT,
                   help="host pool memory layout (default %(default)s)")


def add_listen_args(p: argparse.ArgumentParser) -> None:
    """The dashboard's address and port, as ``dashboard`` and ``serve`` take them."""
    p.add_argument("--host", default=defaults.HOST,
                   help="dashboard bind address (default %(default)s: this machine only; any other "
                   "address is warned about: the dashboard has no authentication)")
    p.add_argument("--port", type=port_number, default=defaults.DASHBOARD_PORT,
                   help="dashboard port (default %(default)s; 0 = any free port, the URL is printed)")


def add_bench_trace_args(p: argparse.ArgumentParser, requests_default: int) -> None:
    """The trace flags of a benchmark that reads a trace or generates one (bench advise, policies)."""
    from ..traces.mooncake_trace import DEFAULT_BLOCK_TOKENS

    p.add_argument("--trace", default=None, metavar="FILE",
                   help="JSONL trace, tokens or Mooncake format (default: generated)")
    p.add_argument("--trace-format", choices=("auto", "tokens", "mooncake"), default="auto",
                   help="format of --trace (default: detected from the first line)")
    p.add_argument("--page-size", type=positive_int, default=defaults.PAGE_SIZE,
                   help="tokens per page of a tokens trace (default %(default)s; Mooncake: one block)")
    p.add_argument("--block-tokens", type=positive_int, default=DEFAULT_BLOCK_TOKENS,
                   help=f"tokens per Mooncake hash id (default {DEFAULT_BLOCK_TOKENS})")
    p.add_argument("--requests", type=int_range(1, 10_000_000), default=requests_default,
                   help="requests of the generated trace (default %(default)s)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the generated trace (default 0)")
    p.add_argument("--save-trace", default=None, metavar="FILE",
                   help="also write the generated trace here (Mooncake format)")


def print_json_result(res: object, out: str | None) -> None:
    """Print a benchmark's JSON result, and also write it to ``out`` when given."""
    import json

    text = json.dumps(res, indent=2)
    if out:
        try:
            with open(out, "w") as f:
                f.write(text + "\n")
        except OSError as exc:
            raise ConfigError(f"--out {out}: cannot write it: {exc.strerror or exc}") from None
    print(text)


def plan_from_args(args: argparse.Namespace, sizing: Sizing | None = None,
                   page_size: int | None = None) -> RunPlan:
    """The run's plan from the flags of ``add_layout_args`` (and a sizing): built once, here."""
    return resolve_plan(args.model, args.pp_size, args.tp_size, args.pp_partition,
                        args.page_size if page_size is None else page_size, args.fault, sizing,
                        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))

