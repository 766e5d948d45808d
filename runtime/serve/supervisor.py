"""``stagecache serve``'s parent process: launch one process per stage, supervise, serve the dashboard.

Process model::

    serve (parent)                      stage processes (spawn, one per PP stage)
    ├─ dashboard + /metrics (thread)    rank k: dist init (gloo | nccl), own pools + host stack,
    │   reads RunDirSource(run_dir)     gather inventory -> rank 0 -> startup.json, request loop,
    ├─ supervisor loop (0.2 s)          activations k -> k+1, live numbers -> stage-<k>.json
    └─ progress bar, summary

The parent never imports a stage's pools: it validates the input (bad input =
``ConfigError`` = exit 2 before anything starts), binds the dashboard port,
spawns the stages, then only reads the run directory.  It owns shutdown:
Ctrl-C / SIGTERM, a stage that exits non-zero, or a startup that does not come
within ``--startup-timeout`` all end in the same ``_stop_stages`` (SIGTERM, a
grace period, SIGKILL, join), so no stage outlives it; stages also get SIGKILL
from the kernel if the parent itself dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import run_dir as rd

SUPERVISE_INTERVAL_S = 0.2
STOP_GRACE_S = 3.0
PEER_LOST_GRACE_S = 1.5
DEFAULT_HIDDEN = 256
CPU_HIDDEN_CAP = 512

#: Imported once by the forkserver that forks the stage processes.
STAGE_PRELOAD = (
    "numpy", "torch", "torch.distributed", "stagecache.runtime.serve.stage_worker",
    "stagecache.runtime.serve.stage_cache", "stagecache.runtime.serve.pipeline", "stagecache.runtime.cache.hicache",
    "stagecache.runtime.transfer.controller", "stagecache.runtime.memory.host_pools", "stagecache.runtime.memory.pools",
    "stagecache.runtime.cache.kv_writer", "stagecache.runtime.cache.traces", "stagecache.exporters.snapshot",
)


class _Stop(Exception):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@dataclass(frozen=True)
class ServeOptions:
    model: str
    pp_size: int
    tp_size: int
    pp_partition: tuple[int, ...] | None
    page_size: int
    faults: tuple[str, ...]
    device_pages: int
    hicache_ratio: float
    hicache_write_policy: str
    hicache_layout: str
    trace: str | None
    requests: int
    seed: int
    micro_batch: int
    in_flight: int | None
    rate: float
    hidden_size: int
    device: str  # resolved: "cpu" | "cuda"
    host: str
    port: int
    dashboard: bool
    run_dir: str | None
    exit_on_error: bool
    hold_seconds: float | None  # None = until interrupted
    exit_after_run: bool
    startup_timeout: float
    dist_timeout: float
    json: bool
    model_name: str = ""


def model_hidden_size(model: str) -> int | None:
    """``hidden_size`` of a preset or config.json (the spec does not keep it: the KV cache needs none)."""
    from ..model.spec import PRESETS

    try:
        if model in PRESETS:
            text = resources.files("stagecache.runtime.model").joinpath("presets", PRESETS[model]).read_text()
        else:
            path = Path(model)
            text = (path / "config.json" if path.is_dir() else path).read_text()
        value = json.loads(text).get("hidden_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _may_have_gpu() -> bool:
    return bool(os.environ.get("CUDA_VISIBLE_DEVICES")) or any(
        os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia")
    )


def resolve_device(choice: str, pp_size: int) -> str:
    """auto: CUDA (one GPU per stage, nccl) when there are >= pp_size GPUs, else CPU (gloo)."""
    if choice == "cpu":
        return "cpu"
    if choice == "auto" and not _may_have_gpu():
        return "cpu"  # skip importing torch in the parent just to count zero GPUs
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda":
        if gpus < pp_size:
            raise ConfigError(
                f"--device cuda needs one GPU per stage: --pp-size {pp_size}, but {gpus} GPU(s) visible"
            )
        return "cuda"
    return "cuda" if gpus >= pp_size else "cpu"


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """Validate every flag once, in the parent, so a bad value is exit 2 before any process starts."""
    from ..cli.common import layout_from_args
    from ..cli.serve import DEFAULT_DEVICE_PAGES, DEFAULT_REQUESTS
    from ..memory.sizing import pages_for_tokens

    la = layout_from_args(args)  # spec, partition, page size, faults: ConfigError on bad input
    if args.max_total_tokens is not None:
        device_pages = pages_for_tokens(args.max_total_tokens, la.page_size)
    else:
        device_pages = args.device_pages or DEFAULT_DEVICE_PAGES
    if args.trace is not None and not Path(args.trace).is_file():
        raise ConfigError(f"--trace {args.trace!r}: no such file")
    from .stage_cache import build_trace, check_trace_fits

    requests = args.requests or (0 if args.trace else DEFAULT_REQUESTS)
    trace = build_trace(args.trace, requests, args.seed)  # TraceError (exit 2) lists bad lines
    check_trace_fits(trace, la.page_size, device_pages, args.micro_batch)
    if args.rate > 0 and args.micro_batch / args.rate > args.dist_timeout / 2:
        gap = args.micro_batch / args.rate
        raise ConfigError(
            f"--rate {args.rate:g} with --micro-batch {args.micro_batch} leaves {gap:g} s between "
            f"micro-batches, too close to --dist-timeout {args.dist_timeout:g} s (later stages wait "
            "in recv that long); raise --dist-timeout or --rate"
        )
    device = resolve_device(args.device, args.pp_size)
    check_host_memory(la, device_pages, args.hicache_ratio, device)
    partition = tuple(s.local_layers for s in la.layout.stages) if args.pp_partition else None
    hidden = args.hidden_size or model_hidden_size(args.model) or DEFAULT_HIDDEN
    if not args.hidden_size and device == "cpu":
        hidden = min(hidden, CPU_HIDDEN_CAP)  # a 4096-wide stand-in compute would dominate on CPU
    return ServeOptions(
        model=args.model,
        model_name=la.spec.name,
        pp_size=args.pp_size,
        tp_size=args.tp_size,
        pp_partition=partition,
        page_size=la.page_size,
        faults=tuple(args.fault),
        device_pages=device_pages,
        hicache_ratio=args.hicache_ratio,
        hicache_write_policy=args.hicache_write_policy,
        hicache_layout=args.hicache_layout,
        trace=args.trace,
        requests=len(trace),
        seed=args.seed,
        micro_batch=args.micro_batch,
        in_flight=args.in_flight,
        rate=args.rate,
        hidden_size=hidden,
        device=device,
        host=args.host,
        port=args.port,
        dashboard=not args.no_dashboard,
        run_dir=args.run_dir,
        exit_on_error=args.exit_on_error,
        hold_seconds=0.0 if args.exit_after_run else args.hold_seconds,
        exit_after_run=args.exit_after_run,
        startup_timeout=args.startup_timeout,
        dist_timeout=args.dist_timeout,
        json=args.json,
    )


def check_host_memory(la: Any, device_pages: int, hicache_ratio: float, device: str) -> None:
    """All stages share this host's RAM: their pools together must fit (a per-stage check cannot see it).

    Host (HiCache) pools always live in RAM; device pools too when running on CPU.
    Counts include ``--fault`` plans, since a faulty build really allocates its buggy pools.
    """
    from ..memory.pools import _fmt_bytes, host_available_bytes, stage_plan
    from ..memory.sizing import budget_bytes, host_pages_for, runtime_budget
    from ..model.pool_kinds import kind_table
    from ..validation.faults import apply_layout_faults

    avail = host_available_bytes()
    if avail is None:
        return
    host_pages = host_pages_for(device_pages, hicache_ratio)
    table = kind_table(la.spec, la.page_size)
    budget = runtime_budget(la.page_size, device_pages, swa_ratio=1.0)  # the runtime's page space
    faulty = apply_layout_faults(la.layout, la.faults)
    need = 0
    for stage_map in faulty.stages:
        plan = stage_plan(stage_map, la.spec.compress_ratios, la.faults, la.layout.pp_size)
        counts = {pool: len(slots) for pool, slots in plan.items()}
        need += budget_bytes(table, counts, budget, hicache_ratio, host=True)
        need += budget_bytes(table, counts, budget) if device == "cpu" else 0
    if need > avail:
        where = "device + host pools" if device == "cpu" else "host pools"
        raise ConfigError(
            f"the {len(faulty.stages)} stages' {where} need {_fmt_bytes(need)} of RAM together "
            f"({device_pages} device pages, {host_pages} host pages per stage), only "
            f"{_fmt_bytes(avail)} available; lower --device-pages/--max-total-tokens or --hicache-ratio"
        )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_dashboard_socket(host: str, port: int) -> socket.socket:
    """Bind the dashboard port *before* starting stages, so "port in use" is a clean exit 2."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot bind the dashboard to {host}:{port}: {exc.strerror or exc}; "
            "pass --port N (0 = any free port) or --no-dashboard"
        ) from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


class Dashboard:
    """The dashboard app (with /metrics) on a pre-bound socket, in a daemon thread of the parent."""

    def __init__(self, source: Any, sock: socket.socket, title: str):
        from stagecache.dashboard.app import make_server

        host, port = sock.getsockname()[:2]
        self.sock = sock
        self.url = f"http://{host}:{port}/"
        self.server = make_server(source, host, port, title=title)
        self.thread = threading.Thread(target=self._run, name="dashboard", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as exc:  # noqa: BLE001 - reported by the supervisor
            self.error = exc

    def start(self, timeout: float = 10.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass
class StageProc:
    rank: int
    process: Any  # multiprocessing.Process

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode


class Console:
    """Human output: stdout normally, stderr under --json (stdout is then only the JSON summary)."""

    def __init__(self, json_mode: bool):
        from rich.console import Console as RichConsole

        self.json_mode = json_mode
        self.rich = RichConsole(file=sys.stderr if json_mode else sys.stdout, highlight=False,
                                width=None if (sys.stderr if json_mode else sys.stdout).isatty() else 160)

    def print(self, *args: Any, **kw: Any) -> None:
        self.rich.print(*args, **kw)
        self.rich.file.flush()


def _stage_config(opts: ServeOptions, rank: int, run_dir: str, master_port: int) -> Any:
    from .stage_worker import StageConfig

    return StageConfig(
        rank=rank, pp_size=opts.pp_size, model=opts.model, tp_size=opts.tp_size,
        pp_partition=opts.pp_partition, page_size=opts.page_size, device_pages=opts.device_pages,
        hicache_ratio=opts.hicache_ratio, hicache_write_policy=opts.hicache_write_policy,
        hicache_layout=opts.hicache_layout, faults=opts.faults, run_dir=run_dir,
        master_port=master_port, backend="nccl" if opts.device == "cuda" else "gloo",
        device=opts.device, trace=opts.trace, requests=opts.requests, seed=opts.seed,
        micro_batch_requests=opts.micro_batch, hidden_size=opts.hidden_size, rate=opts.rate,
        in_flight=opts.in_flight or opts.pp_size,
        dist_timeout_s=opts.dist_timeout, parent_pid=os.getpid(),
    )


class Supervisor:
    """Starts the stages, watches them and the run directory, and stops them (always)."""

    def __init__(self, opts: ServeOptions, run_dir: str, console: Console):
        from stagecache.exporters.run_source import RunDirSource

        self.opts = opts
        self.run_dir = run_dir
        self.console = console
        self.source = RunDirSource(run_dir)
        self.procs: list[StageProc] = []
        self.phase = "starting"
        self.failure: str | None = None
        self.started_at = time.time()
        self.url: str | None = None
        self.exit_codes: dict[int, int | None] = {}

    # -- run.json / snapshot.json ------------------------------------------------------------------
    def write_run_file(self) -> None:
        data = {
            "phase": self.phase,
            "failure": self.failure,
            "pp_size": self.opts.pp_size,
            "model": self.opts.model_name,
            "device": self.opts.device,
            "url": self.url,
            "parent_pid": os.getpid(),
            "pids": {str(p.rank): p.pid for p in self.procs},
            "exit_codes": {str(p.rank): p.exitcode for p in self.procs},
            "started_at": self.started_at,
            "time": time.time(),
        }
        rd.write_json_atomic(Path(self.run_dir) / rd.RUN_FILE, data)
        rd.write_json_atomic(Path(self.run_dir) / rd.SNAPSHOT_FILE, self.source.snapshot())

    # -- processes ------------------------------------------------------------------------------
    def start(self) -> None:
        import multiprocessing as mp

        from .stage_worker import stage_main

        # forkserver + preload: torch is imported once, in a clean single-threaded server, and
        # every stage is forked from it -- starting 4 stages costs one torch import, not four,
        # and no stage inherits this process's threads (dashboard, progress).
        method = os.environ.get("STAGECACHE_START_METHOD", "forkserver")
        if method not in ("forkserver", "spawn"):
            raise ConfigError(f"STAGECACHE_START_METHOD={method!r}: use forkserver (default) or spawn")
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(list(STAGE_PRELOAD))
        master_port = free_port()
        for rank in range(self.opts.pp_size):
            cfg = _stage_config(self.opts, rank, self.run_dir, master_port)
            proc = ctx.Process(target=stage_main, args=(cfg,), name=f"stagecache-stage-{rank}", daemon=False)
            proc.start()
            self.procs.append(StageProc(rank, proc))
        pids = ", ".join(f"stage {p.rank}: pid {p.pid}" for p in self.procs)
        backend = "nccl" if self.opts.device == "cuda" else "gloo"
        self.console.print(f"started {len(self.procs)} stage processes ({backend}, {self.opts.device}, "
                           f"activations [tokens, {self.opts.hidden_size}] float32): {pids}", markup=False)
        self.write_run_file()

    def stop(self) -> None:
        """SIGTERM every live stage, wait ``STOP_GRACE_S``, SIGKILL the rest, reap all."""
        alive = [p for p in self.procs if p.process.is_alive()]
        for p in alive:
            with contextlib.suppress(OSError):
                p.process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for p in alive:
            p.process.join(max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.process.is_alive():
                with contextlib.suppress(OSError):
                    p.process.kill()
                p.process.join(2.0)
        for p in self.procs:
            self.exit_codes[p.rank] = p.exitcode

    def _dead_stage(self, first_seen: dict[int, float]) -> str | None:
        """Why the run must stop, naming the stage that failed rather than the peers that noticed.

        A stage that exits on its own (code 1, or a signal) is the cause.  Stages that
        exit with ``EXIT_PEER_LOST`` only noticed; after a short grace, if some stage is
        still alive while its neighbours gave up on it, that live stage is the one that
        stopped responding (stuck, or SIGSTOPped) and is named instead.
        """
        from .stage_worker import EXIT_OK, EXIT_PEER_LOST

        now = time.monotonic()
        failed = []
        for p in self.procs:
            code = p.exitcode
            if code is None or code == EXIT_OK:
                continue
            first_seen.setdefault(p.rank, now)
            failed.append(p)
        if not failed:
            return None
        real = [p for p in failed if p.exitcode != EXIT_PEER_LOST]
        if real:
            return self.failure_message(min(real, key=lambda p: (first_seen[p.rank], p.rank)))
        if now - min(first_seen[p.rank] for p in failed) < PEER_LOST_GRACE_S and not all(
            p.exitcode is not None for p in self.procs
        ):
            return None
        stuck = [p for p in self.procs if p.exitcode is None]
        if stuck:
            gave_up = ", ".join(str(p.rank) for p in failed)
            names = " and ".join(f"stage {p.rank} (pid {p.pid})" for p in stuck)
            return (f"{names} stopped responding: stage(s) {gave_up} lost contact with it "
                    f"(torch.distributed timeout {self.opts.dist_timeout:g} s)")
        return self.failure_message(min(failed, key=lambda p: (first_seen[p.rank], p.rank)))

    def failure_message(self, p: StageProc) -> str:
        code = p.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else ""
        msg = f"stage {p.rank} (pid {p.pid}) exited with code {code}" + (f" ({how})" if how else "")
        own = self.source.stages().get(p.rank, {}).get("error")
        if own:
            msg += f": {own}"
        return msg

    # -- the supervisor loop ----------------------------------------------------------------------
    def supervise(self, progress: Any) -> str:
        """Run until the trace is served ('done'), startup refused ('refused') or a stage failed."""
        first_seen: dict[int, float] = {}
        startup_deadline = time.monotonic() + self.opts.startup_timeout
        last_write = 0.0
        while True:
            report = self.source.startup()
            if self.phase == "starting" and report is not None:
                self.phase = "serving" if report.get("ok") else "refused"
                self.write_run_file()
                progress.startup(report)
            stages = self.source.stages()
            progress.update(stages)
            why = self._dead_stage(first_seen)
            if why is not None:
                self.phase = "failed"
                self.failure = why
                break
            if all(p.exitcode is not None for p in self.procs):
                if self.phase == "starting":
                    self.phase = "failed"
                    self.failure = "every stage exited before startup validation was reported"
                elif self.phase == "serving":
                    self.phase = "done"
                break
            if self.phase == "starting" and time.monotonic() > startup_deadline:
                waiting = [str(k) for k in range(self.opts.pp_size)
                           if stages.get(k, {}).get("phase", "starting") == "starting"]
                self.phase = "failed"
                self.failure = (f"startup did not complete within {self.opts.startup_timeout:g} s "
                                f"(stages still starting: {', '.join(waiting) or 'none'})")
                break
            if time.monotonic() - last_write > 0.5:
                self.write_run_file()
                last_write = time.monotonic()
            time.sleep(SUPERVISE_INTERVAL_S)
        if self.phase in ("failed",):
            self.stop()
        else:
            for p in self.procs:
                p.process.join(5.0)
            self.stop()
        progress.update(self.source.stages())
        self.write_run_file()
        return self.phase


class Progress:
    """A rich progress bar over the requests the last stage finished (= left the pipeline)."""

    def __init__(self, opts: ServeOptions, console: Console):
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self.opts = opts
        self.console = console
        self.bar = RichProgress(
            TextColumn("[bold]trace[/bold]"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
            console=console.rich, transient=False, auto_refresh=console.rich.is_terminal,
        )
        self.task = None
        self.report_printed = False

    def __enter__(self) -> Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.stop()

    def startup(self, report: dict[str, Any]) -> None:
        print_startup(self.console, report)
        if report.get("ok") and self.task is None:
            self.task = self.bar.add_task("trace", total=None, info="")

    def update(self, stages: dict[int, dict[str, Any]]) -> None:
        if self.task is None or not stages:
            return
        last = stages.get(self.opts.pp_size - 1, {})
        total = max((s.get("total_requests", 0) for s in stages.values()), default=0) or None
        tok = last.get("cache_tokens", {})
        looked = sum(tok.get(t, 0) for t in ("device", "host", "miss"))
        hit = (tok.get("device", 0) + tok.get("host", 0)) / looked if looked else 0.0
        info = f"hit {hit:.0%}  host-hit {last.get('host_hit_ratio', 0.0):.0%}"
        self.bar.update(self.task, total=total, completed=last.get("requests", 0), info=info)
        if not self.console.rich.is_terminal:
            return
        self.bar.refresh()


def print_startup(console: Console, report: dict[str, Any]) -> None:
    """One line when every stage validated; otherwise every error with stage/pool/expected/got."""
    stages = report.get("stages", [])
    if report.get("ok"):
        layers = ", ".join(f"{s['stage']}:[{s['start_layer']},{s['end_layer']})" for s in stages)
        console.print(f"[green]startup ok[/green]: {len(stages)} stages validated ({layers})")
        return
    errors = [e for s in stages for e in s.get("errors", [])] + list(report.get("errors", []))
    console.print(f"[red]startup validation FAILED: {len(errors)} mapping error(s); not serving traffic[/red]")
    for e in errors:
        where = "cross-stage" if e.get("stage") is None else f"stage {e['stage']}"
        console.print(f"  [{where}] pool={e.get('pool')} expected={e.get('expected')!r} "
                      f"got={e.get('got')!r}: {e.get('message')}", markup=False)


def summarize(opts: ServeOptions, sup: Supervisor, wall: float) -> dict[str, Any]:
    """The final summary: per-stage numbers plus pipeline figures (the ``--json`` document)."""
    from .pipeline import ideal_bubble_fraction

    stages = sup.source.stages()
    report = sup.source.startup()
    rows = []
    for k in sorted(stages):
        s = stages[k]
        busy, bubble = s.get("stage_seconds", 0.0), s.get("bubble_seconds", 0.0)
        tok = s.get("cache_tokens", {})
        rows.append({
            "stage": k, "pid": s.get("pid"), "phase": s.get("phase"),
            "exit_code": sup.exit_codes.get(k),
            "layers": [s.get("start_layer"), s.get("end_layer")],
            "local_layers": s.get("local_layers"),
            "requests": s.get("requests", 0), "steps": s.get("steps", 0),
            "cache_tokens": tok, "host_hit_ratio": s.get("host_hit_ratio", 0.0),
            "evictions": s.get("evictions", {}),
            "transfer_bytes": s.get("transfer_bytes", {}),
            "transfer_count": s.get("transfer_count", {}),
            "bandwidth_bytes_per_second": s.get("bandwidth_bytes_per_second", {}),
            "stage_seconds": busy, "bubble_seconds": bubble, "idle_seconds": s.get("idle_seconds", 0.0),
            "bubble_fraction": bubble / (busy + bubble) if busy + bubble > 0 else 0.0,
            "activation_bytes_sent": s.get("activation_bytes_sent", 0),
            "kv_verified_pages": s.get("kv_verified_pages", 0),
            "error": s.get("error"),
        })
    steps = max((r["steps"] for r in rows), default=0)
    code = exit_code_for(sup.phase, opts)
    return {
        "ok": sup.phase == "done",
        "phase": sup.phase,
        "exit_code": code,
        "failure": sup.failure,
        "model": opts.model_name,
        "pp_size": opts.pp_size,
        "tp_size": opts.tp_size,
        "device": opts.device,
        "page_size": opts.page_size,
        "device_pages": opts.device_pages,
        "hicache_ratio": opts.hicache_ratio,
        "faults": list(opts.faults),
        "micro_batch_requests": opts.micro_batch,
        "micro_batches": steps,
        "ideal_bubble_fraction": ideal_bubble_fraction(opts.pp_size, steps),
        "wall_seconds": wall,
        "url": sup.url,
        "run_dir": sup.run_dir,
        "startup_ok": bool(report and report.get("ok")),
        "startup_errors": ([e for s in report.get("stages", []) for e in s.get("errors", [])]
                           + list(report.get("errors", []))) if report else [],
        "stages": rows,
    }


def exit_code_for(phase: str, opts: ServeOptions) -> int:
    return 0 if phase == "done" else 1


def _si(n: float) -> str:
    """Compact count/byte figure for an 80-column table: 163840 -> 164k, 87954944 -> 88M."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.0f}{unit}" if abs(n) >= 10 * div else f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    """Per-stage table that fits 80 columns (the full numbers are in --json / snapshot.json)."""
    from rich import box
    from rich.table import Table

    if not summary["stages"] or summary["phase"] == "refused":
        return
    table = Table(title=f"{summary['model']} pp={summary['pp_size']}: {summary['phase']} "
                        f"in {summary['wall_seconds']:.1f} s, {summary['micro_batches']} micro-batches",
                  box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False)
    for col in ("stage", "layers", "req", "tokens d/h/m", "host hit", "B d2h/h2d",
                "s busy/bub/idle", "bubble"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in summary["stages"]:
        tok, tb = r["cache_tokens"], r["transfer_bytes"]
        layers = r["layers"]
        table.add_row(
            str(r["stage"]), f"[{layers[0]},{layers[1]})" if None not in layers else "?",
            str(r["requests"]),
            "/".join(_si(tok.get(t, 0)) for t in ("device", "host", "miss")),
            f"{r['host_hit_ratio']:.1%}",
            f"{_si(tb.get('d2h', 0))}/{_si(tb.get('h2d', 0))}",
            f"{r['stage_seconds']:.1f}/{r['bubble_seconds']:.1f}/{r['idle_seconds']:.1f}",
            f"{r['bubble_fraction']:.0%}",
        )
    console.print(table)
    if summary["micro_batches"]:
        console.print(f"tokens: device hit / host hit / miss; bubble = bub / (busy + bub); ideal for "
                      f"pp={summary['pp_size']}, m={summary['micro_batches']}: "
                      f"{summary['ideal_bubble_fraction']:.0%}")
    if summary["phase"] == "done" and summary["pp_size"] > 1:
        verified = sum(r["kv_verified_pages"] for r in summary["stages"])
        console.print("cache decisions identical on every stage (checked per micro-batch); "
                      f"{verified} host-loaded pages verified byte for byte")


def _install_signal_handlers() -> dict[int, Any]:
    """SIGINT/SIGTERM raise ``_Stop`` once; repeats (a second Ctrl-C, ``timeout`` forwarding the
    signal) are ignored so the cleanup that the first one started is never interrupted."""
    fired = []

    def handler(signum: int, frame: Any) -> None:
        if fired:
            return
        fired.append(signum)
        raise _Stop(signum)

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        old[sig] = signal.signal(sig, handler)
    return old


def _hold(console: Console, opts: ServeOptions, dash: Dashboard | None, phase: str) -> None:
    """Keep the dashboard up after the run: ``--hold-seconds`` or until Ctrl-C/SIGTERM."""
    if dash is None or opts.exit_after_run or opts.hold_seconds == 0:
        return
    if phase == "refused" and opts.exit_on_error:
        return
    what = "the errors" if phase == "refused" else "the final numbers"
    if opts.hold_seconds is None:
        console.print(f"dashboard still serving {what} at {dash.url} -- Ctrl-C to exit")
        while True:
            time.sleep(0.5)
    else:
        console.print(f"dashboard serving {what} at {dash.url} for {opts.hold_seconds:g} s")
        time.sleep(opts.hold_seconds)


def serve(opts: ServeOptions) -> int:
    """Run ``stagecache serve``; returns the process exit code."""
    from rich.markup import escape

    console = Console(opts.json)
    own_run_dir = opts.run_dir is None
    run_dir = tempfile.mkdtemp(prefix="stagecache-serve-") if own_run_dir else opts.run_dir
    if not own_run_dir:
        os.makedirs(run_dir, exist_ok=True)
        for stale in [*Path(run_dir).glob("stage-*.json"), Path(run_dir) / rd.STARTUP_FILE]:
            stale.unlink(missing_ok=True)
    sup = Supervisor(opts, run_dir, console)
    dash: Dashboard | None = None
    old_handlers = _install_signal_handlers()
    t0 = time.perf_counter()
    code = 1
    summary: dict[str, Any] | None = None
    try:
        if opts.dashboard:
            sock = bind_dashboard_socket(opts.host, opts.port)
            dash = Dashboard(sup.source, sock, title=f"stagecache {opts.model_name} pp={opts.pp_size}")
            sup.url = dash.url
            dash.start()
            if not dash.server.started:
                raise ConfigError(f"the dashboard did not start on {dash.url}: "
                                  f"{dash.error or 'no answer within 10 s'}")
            console.print(f"dashboard: {dash.url}  (metrics: {dash.url}metrics, "
                          f"startup probe: {dash.url}startupz)")
        console.print(f"run dir: {run_dir}", markup=False)
        try:
            sup.start()
            with Progress(opts, console) as progress:
                phase = sup.supervise(progress)
        except _Stop as stop:
            refused = sup.phase == "refused"  # validation already failed: that stays the outcome
            sup.phase = "refused" if refused else "interrupted"
            sup.failure = f"interrupted by {stop}"
            sup.stop()
            sup.write_run_file()
            console.print(f"[yellow]{escape(sup.failure)}: stopped all stage processes[/yellow]")
            code = 1 if refused else 130 if stop.signum == signal.SIGINT else 143
            summary = summarize(opts, sup, time.perf_counter() - t0)
            summary["exit_code"] = code
            return code
        wall = time.perf_counter() - t0
        summary = summarize(opts, sup, wall)
        code = summary["exit_code"]
        if phase == "failed":
            console.print(f"[red]run stopped: {escape(sup.failure or '')}[/red]")
            print_summary(console, summary)
            return code
        print_summary(console, summary)
        if phase == "refused" and opts.exit_on_error:
            console.print("[red]exiting: --exit-on-error[/red]")
            return code
        try:
            _hold(console, opts, dash, phase)
        except _Stop:
            pass
        return code
    except _Stop as stop:  # interrupted before the stages started
        sup.stop()
        return 130 if stop.signum == signal.SIGINT else 143
    finally:
        sup.stop()
        if dash is not None:
            dash.stop()
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        if opts.json and summary is not None:
            summary["exit_code"] = code
            print(json.dumps(summary, indent=2, default=str), flush=True)
        if own_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
