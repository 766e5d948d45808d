"""``stagecache serve``: one process per PP stage over torch.distributed, with the dashboard and /metrics.

Only argument parsing lives here (cheap to import for ``stagecache --help``);
the launcher and supervisor are ``runtime/serve.py``.
"""

from __future__ import annotations

import argparse

from .common import add_layout_args, positive_float, positive_int

DEFAULT_MODEL = "tiny-v4"
DEFAULT_REQUESTS = 240
DEFAULT_DEVICE_PAGES = 64
DEFAULT_RATE = 20.0
DEFAULT_MICRO_BATCH = 4
WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535 (0 = any free port), got {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run a PP-staged cache over a request trace, one process per stage, with the dashboard",
        description=(
            "Start one process per PP stage (torch.distributed: gloo on CPU, nccl with one GPU per "
            "stage), validate every stage's real pools at startup, replay a request trace through the "
            "pipeline and serve the dashboard + /metrics. Exit 0: trace served; 1: startup validation "
            "failed (with --exit-on-error or --exit-after-run) or a stage died; 2: bad input; "
            "130/143: interrupted."
        ),
    )
    add_layout_args(p, default_model=DEFAULT_MODEL)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--device-pages", type=positive_int, default=None,
                      help=f"device token pages per stage (default {DEFAULT_DEVICE_PAGES})")
    size.add_argument("--max-total-tokens", type=positive_int, default=None,
                      help="device capacity in tokens per stage (rounded up to whole pages)")
    p.add_argument("--hicache-ratio", type=positive_float, default=2.0,
                   help="host pages per device page (default 2.0, as sglang)")
    p.add_argument("--hicache-write-policy", choices=WRITE_POLICIES, default="write_through",
                   help="when device pages are backed up to host (default write_through)")
    p.add_argument("--hicache-layout", choices=("layer_first", "page_first"), default="layer_first",
                   help="host pool memory layout (default layer_first)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="JSONL request trace (default: a generated multi-turn chat trace)")
    p.add_argument("--requests", type=positive_int, default=None,
                   help=f"requests to generate, or to take from --trace (default {DEFAULT_REQUESTS} "
                   "generated; all of --trace)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated trace (default 0)")
    p.add_argument("--micro-batch", type=positive_int, default=DEFAULT_MICRO_BATCH,
                   help=f"requests per pipeline micro-batch (default {DEFAULT_MICRO_BATCH})")
    p.add_argument("--in-flight", type=positive_int, default=None,
                   help="micro-batches inside the pipeline at once (default: pp-size)")
    p.add_argument("--rate", type=_nonneg_float, default=DEFAULT_RATE,
                   help=f"request arrivals per second at stage 0 (default {DEFAULT_RATE:g}, so the "
                   "dashboard can be watched live; 0 = as fast as possible)")
    p.add_argument("--hidden-size", type=positive_int, default=None,
                   help="activation width sent between stages (default: the model's hidden_size, "
                   "at most 512 on CPU)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): one GPU per stage with nccl if there are >= pp-size GPUs, "
                   "else CPU with gloo")
    p.add_argument("--host", default="127.0.0.1", help="dashboard bind address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000,
                   help="dashboard port (default 8000; 0 = any free port)")
    p.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard / metrics server")
    p.add_argument("--run-dir", default=None,
                   help="directory for the stages' snapshot files (default: a temporary one, removed at exit)")
    p.add_argument("--exit-on-error", action="store_true",
                   help="exit 1 as soon as startup validation fails (default: keep the dashboard up)")
    hold = p.add_mutually_exclusive_group()
    hold.add_argument("--hold-seconds", type=_nonneg_float, default=None,
                      help="after the run, keep serving the dashboard this long, then exit "
                      "(default: until Ctrl-C)")
    hold.add_argument("--exit-after-run", action="store_true",
                      help="exit as soon as the trace is served (no dashboard hold)")
    p.add_argument("--startup-timeout", type=positive_float, default=120.0,
                   help="seconds for every stage to start and report (default 120)")
    p.add_argument("--dist-timeout", type=positive_float, default=60.0,
                   help="torch.distributed timeout for init, collectives and p2p (default 60 s)")
    p.add_argument("--json", action="store_true",
                   help="print a machine-readable final summary on stdout (progress goes to stderr)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..serve.supervisor import options_from_args, serve

    return serve(options_from_args(args))
