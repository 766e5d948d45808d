"""``stagecache serve``: one process per PP stage over torch.distributed, with the dashboard and /metrics.

The flags are validated here once (``options_from_args``: every bad value is
exit 2 before any process starts); ``run`` then composes the pieces that live
in their own layers: the ``Supervisor`` (stage processes), the dashboard server
and the console output.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import defaults
from ..bounded_io import path_kind
from ..errors import ConfigError
from ..live.numbers import Phase
from ..live.run_dir import RunDirSource
from ..net import exposure_warning
from ..serve.nodes import MASTER_PORT, local_ranks
from ..serve.options import (
    CPU_HIDDEN_CAP,
    DEFAULT_HIDDEN,
    MAX_HIDDEN,
    MAX_REQUESTS,
    ServeOptions,
    check_host_memory,
    model_hidden_size,
    resolve_device,
)
from ..serve.rendezvous import resolve_dist_host
from ..serve.run_root import RunDirLock, check_run_dir_flag, new_temp_run_dir, prepare_user_run_dir
from .common import (
    add_host_tier_args,
    add_layout_args,
    add_listen_args,
    float_range,
    int_range,
    nonneg_float,
    nonneg_int,
    nonneg_seconds,
    plan_from_args,
    port_number,
    positive_int,
    seconds,
)
from .l3_args import add_l3_args, l3_options

if TYPE_CHECKING:  # the dashboard (FastAPI) and the supervisor load only when serve runs
    from stagecache.dashboard.server import DashboardThread

    from ..serve.supervisor import Supervisor
    from ..storage.master import MooncakeMaster
    from .serve_console import Console


#: The shortest ``--dist-timeout``: below it the stages cannot even connect, and torch reports
#: that with a C++ backtrace instead of an error line.
MIN_DIST_TIMEOUT_S = 1.0


class _Stop(Exception):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _install_signal_handlers(fired: list[int]) -> dict[int, Any]:
    """SIGINT/SIGTERM raise ``_Stop`` once; repeats (a second Ctrl-C, ``timeout`` forwarding the
    signal) are ignored so the cleanup that the first one started is never interrupted.

    ``fired`` gets the signal: a library that catches the ``_Stop`` raised inside it and raises
    its own error instead (pydantic's JSON serializer does) is still read as the stop.
    """

    def handler(signum: int, frame: Any) -> None:
        if fired:
            return
        fired.append(signum)
        raise _Stop(signum)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run a PP-staged cache over a request trace, one process per stage, with the dashboard",
        description=(
            "Start one process per PP stage (torch.distributed: gloo on CPU, nccl with one GPU per "
            "stage), validate every stage's real pools at startup, replay a request trace through the "
            "pipeline and serve the dashboard + /metrics. Exit 0: trace served; 1: startup validation "
            "failed or a stage died; 2: bad input; 3: internal error (the traceback's log file is "
            "named); 130/143: interrupted. docs/serve.md lists every code."
        ),
    )
    add_layout_args(p)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--device-pages", type=positive_int, default=None,
                      help=f"device token pages per stage (default {defaults.DEVICE_PAGES})")
    size.add_argument("--max-total-tokens", type=positive_int, default=None,
                      help="device capacity in tokens per stage (rounded up to whole pages)")
    add_host_tier_args(p)
    add_l3_args(p, defaults.L3_BACKEND)
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="JSONL request trace (default: a generated multi-turn chat trace)")
    p.add_argument("--trace-format", choices=("auto", "tokens", "mooncake"), default="auto",
                   help="--trace's format: auto (default: told from the first line), tokens "
                   "(session + input_ids) or mooncake (timestamp, input_length, hash_ids)")
    p.add_argument("--requests", type=int_range(1, MAX_REQUESTS), default=None,
                   help=f"requests to generate, or to take from --trace (default {defaults.REQUESTS} "
                   "generated; all of --trace)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the generated trace (default 0)")
    p.add_argument("--micro-batch", type=int_range(1, MAX_REQUESTS), default=defaults.MICRO_BATCH,
                   help="requests per pipeline micro-batch (default %(default)s)")
    p.add_argument("--in-flight", type=int_range(1, 1024), default=None,
                   help="micro-batches inside the pipeline at once (default: pp-size)")
    p.add_argument("--rate", type=nonneg_float, default=defaults.RATE,
                   help=f"request arrivals per second at stage 0 (default {defaults.RATE:g}, so the "
                   "dashboard can be watched live; 0 = as fast as possible)")
    p.add_argument("--hidden-size", type=int_range(1, MAX_HIDDEN), default=None,
                   help="activation width sent between stages (default: the model's hidden_size, "
                   f"at most {CPU_HIDDEN_CAP} on CPU)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): one GPU per stage with nccl if there are >= pp-size GPUs, "
                   "else CPU with gloo")
    add_listen_args(p)
    p.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard / metrics server")
    p.add_argument("--dist-host", default=defaults.DIST_HOST, metavar="ADDR",
                   help="address the stages' gloo/nccl data plane binds (default %(default)s; any "
                   "other address is warned about; the rendezvous is a file in the private run dir)")
    nodes = p.add_argument_group("several hosts", "every host runs the same command except --node-rank "
                                 "and --dist-host (torchrun's flags); docs/serve.md#several-hosts")
    nodes.add_argument("--nnodes", type=positive_int, default=1, metavar="N",
                       help="hosts the stages are spread over, --pp-size / N stages each (default 1)")
    nodes.add_argument("--node-rank", type=nonneg_int, default=0, metavar="R",
                       help="this host's place: node 0 runs stages 0..pp/N-1, the hub and the dashboard")
    nodes.add_argument("--master-addr", default=None, metavar="ADDR",
                       help="node 0's address (or name) the hub listens on and the other nodes reach")
    nodes.add_argument("--master-port", type=port_number, default=MASTER_PORT, metavar="P",
                       help="the hub's port on node 0 (default %(default)s)")
    nodes.add_argument("--secret-file", default=None, metavar="FILE",
                       help="the deployment's secret (16-4096 random bytes, your file, mode 600, the same "
                       "file on every node; never sent over the network)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="one more Host name the dashboard answers to (the name other hosts or "
                   "Prometheus reach it by); repeatable")
    p.add_argument("--run-dir", default=None,
                   help="directory for the stages' snapshot files (default: a temporary one, removed at exit)")
    p.add_argument("--heartbeat-timeout", type=float_range(2 * defaults.HEARTBEAT_INTERVAL_S, 3600.0),
                   default=defaults.HEARTBEAT_TIMEOUT_S, metavar="S",
                   help="a stage whose last heartbeat is older is not ready (/readyz 503, "
                   "stagecache_stage_up 0); default %(default)g s")
    p.add_argument("--max-disagreements", type=nonneg_int, default=0, metavar="N",
                   help="more per-request stage disagreements than N (every stage and kind: "
                   "matched prefix, loaded, backed up, completion) make the run not ready "
                   "(/readyz 503); the run goes on and the dashboard lists them (default 0)")
    p.add_argument("--exit-on-error", action="store_true",
                   help="exit 1 as soon as startup validation fails or a stage fails (default: keep "
                   "the dashboard and /metrics up, showing the failure, until Ctrl-C)")
    hold = p.add_mutually_exclusive_group()
    hold.add_argument("--hold-seconds", type=nonneg_seconds, default=None,
                      help="after the run, keep serving the dashboard this long, then exit "
                      "(default: until Ctrl-C)")
    hold.add_argument("--exit-after-run", action="store_true",
                      help="exit as soon as the trace is served (no dashboard hold)")
    p.add_argument("--startup-timeout", type=seconds, default=defaults.STARTUP_TIMEOUT_S,
                   help="seconds for every stage to start and report (default %(default)g)")
    p.add_argument("--dist-timeout", type=float_range(MIN_DIST_TIMEOUT_S, 86400.0),
                   default=defaults.DIST_TIMEOUT_S, metavar="S",
                   help="torch.distributed timeout for init, collectives and p2p (default %(default)g s, "
                   f"at least {MIN_DIST_TIMEOUT_S:g}: connecting the stages takes about that long)")
    p.add_argument("--json", action="store_true",
                   help="print a machine-readable final summary on stdout (progress goes to stderr)")
    p.set_defaults(func=run)


#: What a --trace path that is not a regular file is, by ``path_kind``.
TRACE_PROBLEMS = {"dir": " is a directory", None: ": no such file",
                  "other": " is not a regular file (a FIFO, device or socket is never read)"}


def _check_paths(args: argparse.Namespace) -> None:
    """File and directory flags: exit 2 naming the flag before anything is read or started."""
    if args.trace is not None:
        problem = TRACE_PROBLEMS.get(path_kind(args.trace, f"--trace {args.trace!r}"))
        if problem:
            raise ConfigError(f"--trace {args.trace!r}{problem}; expected a JSONL trace file")
    if args.run_dir is not None:  # used by its real path from here on
        args.run_dir = str(check_run_dir_flag(args.run_dir))


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """Validate every flag once, in the parent, so a bad value is exit 2 before any process starts."""
    from ..plan.plan import Sizing
    from ..plan.sizing import pages_for_tokens
    from ..serve.stage_cache import build_trace, check_trace_fits, trace_device_pages

    _check_paths(args)
    if args.max_total_tokens is not None:
        device_pages = pages_for_tokens(args.max_total_tokens, args.page_size)
    else:
        device_pages = args.device_pages or defaults.DEVICE_PAGES
    # the run's one plan: spec, partition, page size, sizes and faults (ConfigError on bad input)
    plan = plan_from_args(args, Sizing.runtime(device_pages, request_slots=args.micro_batch,
                                               hicache_ratio=args.hicache_ratio))
    dist_host, dist_interface = resolve_dist_host(args.dist_host)
    nodes = nodes_from_args(args)
    requests = args.requests or (0 if args.trace else defaults.REQUESTS)
    trace = build_trace(args.trace, requests, args.seed, args.trace_format)  # TraceError (exit 2) lists bad lines
    check_trace_fits(trace, plan.page_size, device_pages, args.micro_batch)
    if args.rate > 0 and args.micro_batch / args.rate > args.dist_timeout / 2:
        gap = args.micro_batch / args.rate
        raise ConfigError(
            f"--rate {args.rate:g} with --micro-batch {args.micro_batch} leaves {gap:g} s between "
            f"micro-batches, too close to --dist-timeout {args.dist_timeout:g} s (later stages wait "
            "in recv that long); raise --dist-timeout or --rate"
        )
    device = resolve_device(args.device, args.pp_size)
    check_host_memory(plan, device, min_device_pages=trace_device_pages(trace, plan.page_size, args.micro_batch),
                      pages_flag="--device-pages" if args.max_total_tokens is None else "--max-total-tokens",
                      stages=local_ranks(args.pp_size, args.nnodes, args.node_rank) if nodes else None)
    hidden = args.hidden_size or model_hidden_size(args.model) or DEFAULT_HIDDEN
    if not args.hidden_size and device == "cpu":
        hidden = min(hidden, CPU_HIDDEN_CAP)  # a 4096-wide stand-in compute would dominate on CPU
    return ServeOptions(
        plan=plan, hicache_write_policy=args.write_policy, hicache_layout=args.hicache_layout,
        trace=args.trace, requests=len(trace), seed=args.seed, micro_batch=args.micro_batch,
        in_flight=args.in_flight, rate=args.rate, hidden_size=hidden, device=device,
        host=args.host, port=args.port, dashboard=not args.no_dashboard, run_dir=args.run_dir,
        exit_on_error=args.exit_on_error,
        hold_seconds=0.0 if args.exit_after_run else args.hold_seconds,
        exit_after_run=args.exit_after_run, startup_timeout=args.startup_timeout,
        dist_timeout=args.dist_timeout, json=args.json, dist_host=dist_host,
        dist_interface=dist_interface, heartbeat_timeout=args.heartbeat_timeout,
        max_disagreements=args.max_disagreements, l3=l3_options(args), trace_format=args.trace_format,
        allow_hosts=tuple(args.allow_host), **nodes,
    )


#: Flags that differ from node to node; every other flag must be the same on every node.
NODE_LOCAL_FLAGS = frozenset({"node_rank", "dist_host", "host", "port", "no_dashboard", "run_dir", "json",
                              "allow_host", "secret_file", "func", "hold_seconds", "exit_after_run",
                              "exit_on_error", "command"})


def nodes_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """--nnodes and its flags, checked (exit 2 naming the flag); {} on one host."""
    import hashlib
    import json

    from ..serve.nodes import read_secret

    if args.nnodes == 1:
        if args.node_rank != 0:
            raise ConfigError(f"--node-rank {args.node_rank} without --nnodes; expected --node-rank 0 on one host")
        return {}
    if args.pp_size % args.nnodes:
        raise ConfigError(f"--pp-size {args.pp_size} over --nnodes {args.nnodes}: expected a pp size that "
                          "divides evenly over the nodes")
    if args.node_rank >= args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank}: expected 0..{args.nnodes - 1} for --nnodes {args.nnodes}")
    if not args.master_addr:
        raise ConfigError("--nnodes needs --master-addr: node 0's address, the same on every node")
    if not args.secret_file:
        raise ConfigError("--nnodes needs --secret-file: the deployment's secret, the same file on every node")
    secret = read_secret(args.secret_file)
    shared = {k: v for k, v in sorted(vars(args).items()) if k not in NODE_LOCAL_FLAGS}
    fingerprint = hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()
    return {"nnodes": args.nnodes, "node_rank": args.node_rank, "master_addr": args.master_addr,
            "master_port": args.master_port, "node_secret": secret, "run_fingerprint": fingerprint}


def exposure_warnings(opts: ServeOptions) -> list[str]:
    """Loud warnings for every listener that is not loopback-only."""
    out = [exposure_warning("--dist-host", opts.dist_host,
                            "the stages' gloo/nccl data plane")]
    if opts.dashboard:
        out.append(exposure_warning("--host", opts.host, "the dashboard, its JSON API and /metrics"))
    return [w for w in out if w]


def _hold(console: Console, opts: ServeOptions, dash: DashboardThread | None, phase: Phase) -> None:
    """Keep the dashboard up after the run: ``--hold-seconds`` or until Ctrl-C/SIGTERM."""
    if dash is None or opts.exit_after_run or opts.hold_seconds == 0:
        return
    if phase in (Phase.REFUSED, Phase.FAILED) and opts.exit_on_error:
        return
    what = {Phase.REFUSED: "the errors", Phase.FAILED: "the failure"}.get(phase, "the final numbers")
    if opts.hold_seconds is None:
        console.print(f"dashboard still serving {what} at {dash.url} -- Ctrl-C to exit")
        while True:
            time.sleep(0.5)
    else:
        console.print(f"dashboard serving {what} at {dash.url} for {opts.hold_seconds:g} s")
        time.sleep(opts.hold_seconds)


def run(args: argparse.Namespace) -> int:
    return serve(options_from_args(args))


@dataclass
class _Run:
    """One ``serve`` invocation's moving parts, torn down together in ``_close``."""

    opts: ServeOptions
    console: Console
    run_dir: str
    own_run_dir: bool
    lock: RunDirLock
    source: RunDirSource
    sup: Supervisor | None = None
    t0: float = field(default_factory=time.perf_counter)
    dash: DashboardThread | None = None
    master: MooncakeMaster | None = None  # the local mooncake_master serve started
    summary: dict[str, Any] | None = None
    code: int = 1
    detach: Any = None  # several hosts: stops the hub or the node link


def _prepare_run_dir(opts: ServeOptions, console: Console) -> tuple[str, bool, RunDirLock]:
    """A fresh locked temporary run dir (stale ones of killed runs removed first), or the user's."""
    if opts.run_dir is None:
        path, lock, removed = new_temp_run_dir()
        if removed:
            console.print(f"removed {len(removed)} run dir(s) left by killed runs: "
                          + ", ".join(str(r) for r in removed), markup=False)
        return str(path), True, lock
    return opts.run_dir, False, prepare_user_run_dir(Path(opts.run_dir))


def _start_dashboard(r: _Run) -> None:
    from stagecache.dashboard.server import DashboardThread, bind_dashboard_socket

    opts = r.opts
    sock = bind_dashboard_socket(opts.host, opts.port)
    r.dash = DashboardThread(r.source, sock, title=f"stagecache {opts.plan.spec.name} pp={opts.pp_size}",
                             extra_hosts=opts.allow_hosts)
    r.dash.start()
    if not r.dash.server.started:
        raise ConfigError(f"the dashboard did not start on {r.dash.url}: "
                          f"{r.dash.error or 'no answer within 10 s'}")
    r.console.print(f"dashboard: {r.dash.url}  (metrics: {r.dash.url}metrics, probes: "
                    f"{r.dash.url}healthz, {r.dash.url}readyz, {r.dash.url}startupz)")


def _interrupted(r: _Run, stop: _Stop) -> int:
    from rich.markup import escape

    from ..serve.supervisor import summarize

    refused = r.sup.interrupt(str(stop))  # a refused run stays refused: that is its outcome
    r.console.print(f"[yellow]{escape(r.sup.failure)}: stopped all stage processes[/yellow]")
    r.summary = summarize(r.opts, r.sup, time.perf_counter() - r.t0)
    return 1 if refused else 130 if stop.signum == signal.SIGINT else 143


def _finished(r: _Run, phase: Phase) -> int:
    """Print the outcome, then hold the dashboard up if asked to; the exit code of the run."""
    from rich.markup import escape

    from ..serve.supervisor import summarize
    from .serve_console import print_summary

    r.summary = summarize(r.opts, r.sup, time.perf_counter() - r.t0)
    code = r.summary["exit_code"]
    if phase == Phase.FAILED:
        r.console.print(f"[red]run stopped: {escape(r.sup.failure or '')}[/red]")
    print_summary(r.console, r.summary)
    if phase in (Phase.REFUSED, Phase.FAILED) and r.opts.exit_on_error:
        r.console.print("[red]exiting: --exit-on-error[/red]")
        return code
    try:
        _hold(r.console, r.opts, r.dash, phase)
    except _Stop as stop:
        # Interrupted while holding: the shell's code for the signal, unless the run itself failed
        # (that code must not be hidden by the Ctrl-C that closed the dashboard).
        if code == 0:
            return 130 if stop.signum == signal.SIGINT else 143
    return code


def _start_master(r: _Run) -> None:
    """``--l3 mooncake`` without a master address: start one on loopback for this run."""
    import dataclasses

    from ..storage.base import StoreUnavailable
    from ..storage.master import MooncakeMaster

    r.master = MooncakeMaster(log_path=os.path.join(r.run_dir, "mooncake_master.log"))
    try:
        address = r.master.start()
    except StoreUnavailable as exc:
        raise ConfigError(f"--l3 mooncake: {exc}") from None
    r.opts = dataclasses.replace(r.opts, l3=dataclasses.replace(r.opts.l3, mooncake_master=address))
    r.console.print(f"L3: mooncake_master pid {r.master.pid} on {address}", markup=False)


def _close(r: _Run, old_handlers: dict[int, Any]) -> None:
    if r.sup is not None:
        r.sup.stop()
    if r.detach is not None:
        r.detach()
    if r.master is not None:
        r.master.stop()
    if r.dash is not None:
        r.dash.stop()
    for sig, handler in old_handlers.items():
        signal.signal(sig, handler)
    if r.opts.json and r.summary is not None:
        r.summary["exit_code"] = r.code
        print(json.dumps(r.summary, indent=2, default=str), flush=True)
    replaced = r.lock.replaced()
    r.lock.release()
    if r.own_run_dir and replaced is None:  # never remove what another directory holds
        shutil.rmtree(r.run_dir, ignore_errors=True)


def serve(opts: ServeOptions) -> int:
    """Run ``stagecache serve``; returns the process exit code."""
    from ..serve.supervisor import Supervisor
    from .serve_console import Console, Progress

    console = Console(opts.json)
    run_dir, own, lock = _prepare_run_dir(opts, console)
    r = _Run(opts, console, run_dir, own, lock, RunDirSource(run_dir))
    fired: list[int] = []
    old_handlers = _install_signal_handlers(fired)
    try:
        if opts.dashboard:
            _start_dashboard(r)
        for warning in exposure_warnings(opts):  # once the addresses are known to work
            print(warning, file=sys.stderr, flush=True)
        console.print(f"run dir: {run_dir}", markup=False)
        if opts.l3.backend == "mooncake" and not opts.l3.mooncake_master:
            _start_master(r)
        sup = r.sup = Supervisor(r.opts, run_dir, source=r.source, url=r.dash.url if r.dash else None,
                                 guard=lock.replaced, log=lambda text: console.print(text, markup=False))
        try:
            if opts.nnodes > 1:  # node 0: the hub; the others: the link to it (nodes.py)
                from ..serve.nodes import attach

                r.detach = attach(sup, opts, run_dir)
            sup.start()
            with Progress(opts, console) as progress:
                phase = sup.supervise(progress)
        except Exception as exc:
            r.code = _interrupted(r, _stop_of(exc, fired))
            return r.code
        r.code = _finished(r, phase)
        return r.code
    except Exception as exc:  # interrupted before the stages started
        r.code = 130 if _stop_of(exc, fired).signum == signal.SIGINT else 143
        return r.code
    finally:
        _close(r, old_handlers)


def _stop_of(exc: Exception, fired: list[int]) -> _Stop:
    """The ``_Stop`` an exception stands for, or the exception itself when no signal came."""
    if isinstance(exc, _Stop):
        return exc
    if fired:
        return _Stop(fired[0])
    raise exc
