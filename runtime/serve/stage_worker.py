"""One PP stage as one OS process: dist init, own pools + host stack, startup gather, request loop.

A stage builds *only its own* pools, from its own ``StagePlan`` (nothing global is allocated
anywhere: the point of stage-local pools), and sends the ``StageRecord`` of those real tensors to
rank 0 (sealed JSON, ``exchange``), which turns the records into the ``StartupReport`` (the checks
``check`` runs) and broadcasts the verdict: every stage then serves the trace or stops before
touching a request.  Live numbers go to ``stage-<k>.json`` in the run directory (``run_dir``).

Exit codes: 0 done (or startup refused, see ``startup.json``), 1 this stage failed, 4 a peer went
away -- so the parent can name the stage that really died rather than the neighbours that noticed.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

from ..crash_log import write_crash_log
from ..live import run_dir as rd
from ..live.numbers import Phase
from .heartbeat import Heartbeat, StageFile
from .options import StageConfig

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_PEER_LOST = 4

PUBLISH_INTERVAL_S = 0.25
#: ``PipelineClock`` totals a ``StageLive`` holds under the same names.
CLOCK_FIELDS = ("stage_seconds", "bubble_seconds", "idle_seconds", "activation_bytes_sent",
                "activation_bytes_received")


class PeerLost(RuntimeError):
    """A collective or point-to-point call failed because another stage went away."""


def _die_with_parent() -> None:
    """Linux: SIGKILL when the parent (the forkserver, which exits with serve) dies: no orphans."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _parent_alive(pid: int) -> bool:
    """The serve process still exists (stages are forked by a forkserver, so not getppid())."""
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stage_main(cfg: StageConfig) -> None:
    """Process entry point (``multiprocessing`` target); exits with one of the EXIT_* codes."""
    _die_with_parent()
    _log_to_stderr()
    # Ctrl-C goes to the whole process group; the parent coordinates shutdown (SIGTERM, then SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not _parent_alive(cfg.parent_pid):
        os._exit(EXIT_FAILED)  # parent already gone
    code = EXIT_OK
    worker = None
    try:
        worker = StageWorker(cfg)
        worker.run()
    except PeerLost as exc:
        code = EXIT_PEER_LOST
        _note_failure(cfg, worker, f"lost a peer: {exc}", code)
    except Exception as exc:  # report the failure in one line + the stage file, not a bare traceback
        code = EXIT_FAILED
        detail = f"{type(exc).__name__}: {exc}" + _crash_note(f"stage-{cfg.rank}", exc)
        _note_failure(cfg, worker, detail, code)
        log.error("stage %d: error: %s", cfg.rank, detail)
        if os.environ.get("STAGECACHE_DEBUG"):
            traceback.print_exc()
    finally:
        if worker is not None:
            worker.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip atexit work of torch/gloo that can hang with a dead peer


def _crash_note(what: str, exc: BaseException) -> str:
    """`` (traceback: FILE)``, or why there is none (a crash-log directory that is not private)."""
    from ..errors import ConfigError

    try:
        crash = write_crash_log(what, exc)
    except ConfigError as refused:
        return f" (traceback not written: {refused})"
    return f" (traceback: {crash})" if crash else ""


def _log_to_stderr() -> None:
    """A stage process says what went wrong on its stderr, which the serve parent shares."""
    logger = logging.getLogger("stagecache")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)


def _note_failure(cfg: StageConfig, worker: StageWorker | None, message: str, code: int) -> None:
    try:
        if worker is not None:
            worker.publish(phase=Phase.FAILED, error=message, force=True)
        else:
            from ..live.numbers import StageLive

            live = StageLive(stage=cfg.rank, time=time.time(), pid=os.getpid(), phase=Phase.FAILED,
                             error=message)
            rd.write_text_atomic(rd.stage_file(cfg.run_dir, cfg.rank), live.model_dump_json())
    except OSError:
        pass


def _is_peer_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset", "Timed out", "timed out",
                            "Socket Timeout", "Broken pipe", "connection refused", "NCCL")
    )


def _engine() -> str:
    """What built the pools, for the record: this stagecache (all stages of a run run one)."""
    from stagecache import runtime

    return f"stagecache {getattr(runtime, '__version__', '0')}"


class StageWorker:
    """The stage process's state; ``run()`` does startup, then the trace, then a clean shutdown."""

    def __init__(self, cfg: StageConfig):
        self.cfg = cfg
        self.rank = cfg.rank
        self.pid = os.getpid()
        self.phase = Phase.STARTING
        self.error: str | None = None
        self.t_start = time.time()
        self._last_publish = 0.0
        self.dist_ready = False
        self.stage_file = StageFile(rd.stage_file(cfg.run_dir, cfg.rank), refresh=self._beat_fields)
        self.heartbeat: Heartbeat | None = None
        self.plan = cfg.plan  # this stage's plan, built once by the parent
        self.stage_map = self.plan.layer_map
        self.cache: Any = None
        self.pipe: Any = None
        self.requests_done = 0
        self.steps_done = 0
        self.total_micro_batches = 0
        self.total_requests = 0
        self.publish(force=True)
        self.heartbeat = Heartbeat(self.stage_file).start()

    # -- lifecycle --------------------------------------------------------------------------------
    def run(self) -> None:
        import torch
        import torch.distributed as dist

        # one process per stage shares the host's cores: no oversubscription by intra-op threads
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.cfg.opts.pp_size))

        self._init_dist()
        from .stage_cache import StageCache
        from .stage_l3 import StageL3

        barrier = lambda: self._call(lambda: dist.barrier())  # noqa: E731
        if self.plan.sized_without_bound:
            # a stage sized for a count no memory bounds (--fault unbounded-stage) cannot build its
            # page-id space: it reports what its plan holds, and rank 0 refuses the run (the L3
            # startup's barriers kept in step with the other stages)
            l3_errors = StageL3(self.cfg, self.rank, None).startup(barrier)  # type: ignore[arg-type]
        else:
            self.cache = StageCache(self.cfg)
            l3_errors = self.cache.l3.startup(barrier)
        if not self._startup(l3_errors):
            self.phase = Phase.REFUSED
            self.publish(force=True)
            return
        self.phase = Phase.SERVING
        requests = self.cache.load_trace()
        self._serve(requests)
        self.phase = Phase.DONE
        self.publish(force=True)
        self._call(lambda: dist.barrier())

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.cache is not None:
            self.cache.l3.close()
        if self.dist_ready:
            try:
                import torch.distributed as dist

                if self.phase == Phase.DONE:
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass

    def _call(self, fn: Any) -> Any:
        """Run a torch.distributed call; a peer failure becomes ``PeerLost`` (exit code 4)."""
        try:
            return fn()
        except Exception as exc:
            if _is_peer_error(exc):
                raise PeerLost(str(exc).splitlines()[0][:300]) from None
            raise

    def _init_dist(self) -> None:
        """Rendezvous and data plane on ``--dist-host`` only (``rendezvous``: loopback by default)."""
        import torch
        import torch.distributed as dist

        from .rendezvous import data_plane_env, make_store

        cfg = self.cfg
        if cfg.opts.device == "cuda":
            torch.cuda.set_device(self.rank)
        os.environ.update(data_plane_env(cfg.opts.dist_interface))
        timeout = datetime.timedelta(seconds=cfg.opts.dist_timeout)
        if cfg.opts.nnodes > 1:  # several hosts: the keys live in node 0's hub (nodes.py)
            from .nodes import hub_store

            store = self._call(lambda: hub_store(cfg.opts.hub_address, cfg.opts.node_secret,
                                                 cfg.opts.run_fingerprint, cfg.opts.dist_timeout))
        else:
            store = self._call(lambda: make_store(cfg.store_path, cfg.opts.pp_size, cfg.opts.dist_timeout))
        self._call(lambda: dist.init_process_group(
            cfg.backend, store=store, rank=self.rank, world_size=cfg.opts.pp_size, timeout=timeout,
        ))
        self.dist_ready = True

    def _record(self, l3_errors: list[str]) -> Any:
        """This stage's record: what its real pools hold (and its L3 store's refusals)."""
        from ..errors import MappingError
        from ..validation.record import stage_record

        findings = [MappingError(self.rank, "l3", "a store of this deployment, own keys", "refused", str(e))
                    for e in l3_errors]
        if self.cache is None:  # never allocated (sized without a bound): what its plan holds
            plan = self.cfg.plan
            return stage_record(plan, host_buffers={p.pool: p.present for p in plan.pools if p.kind.paged},
                                findings=findings, engine=_engine())
        pools, host = self.cache.pools, self.cache.host
        return stage_record(self.cfg.plan, inventory=pools.inventory(),
                            pool_page_bytes=pools.pool_page_bytes(), device_bytes=pools.pool_bytes(),
                            # per-request state stays on the device in stagecache's own runtime
                            # (its host tier is page-addressed): no host set to judge for it
                            host_buffers={p: sum(m) for p, m in host.mirrored.items()
                                          if self.cfg.plan.pool(p).kind.paged},
                            findings=findings, engine=_engine())

    def _startup(self, l3_errors: list[str]) -> bool:
        """Gather every stage's record to rank 0, which turns them into the startup report
        (``validation.deployment``: the checks ``check`` runs) and publishes it; every stage then
        gets the verdict."""
        from ..validation.deployment import deployment_report
        from ..validation.record import StageRecord
        from .exchange import ExchangeRefused, all_gather_json, broadcast_json

        cfg = self.cfg
        mine = self._record(l3_errors).to_json()
        gathered = self._call(lambda: all_gather_json(mine, cfg.secret, cfg.opts.pp_size,
                                                      cfg.torch_device))
        ok = None
        if self.rank == 0:
            try:
                records = [StageRecord.model_validate(g) for g in gathered]
            except ValueError as exc:
                raise ExchangeRefused(f"a stage's record is not a record: {exc}") from None
            plan = cfg.opts.plan
            report = deployment_report(records, tp_size=plan.tp_size, page_size=plan.page_size,
                                       faults=plan.fault_names)
            rd.write_json_atomic(os.path.join(cfg.run_dir, rd.STARTUP_FILE), report.to_dict())
            ok = report.ok
        return broadcast_json(ok, cfg.secret, self.rank, 0, cfg.torch_device) is True

    # -- the request loop ----------------------------------------------------------------------
    def _serve(self, requests: list[Any]) -> None:
        from .pipeline import StagePipe, split_micro_batches

        cfg = self.cfg
        mbs = split_micro_batches(requests, cfg.opts.micro_batch)
        self.total_micro_batches = len(mbs)
        self.total_requests = len(requests)
        self.pipe = StagePipe(self.rank, cfg.opts.pp_size, cfg.opts.hidden_size, cfg.torch_device,
                              window=cfg.in_flight, agreement=self.cache.agreement)
        t0 = time.perf_counter()
        self.publish(force=True)
        for mb in mbs:
            idle = self._pace(t0, mb) if cfg.opts.rate > 0 and self.rank == 0 else 0.0
            self._check_parent()
            self._call(lambda mb=mb, idle=idle: self.pipe.step(mb, self.cache.work, idle))
            self.steps_done += 1
            self.requests_done += len(mb.requests)
            self.publish()
        self._call(self.pipe.drain)
        self._final_verdicts()

    def _final_verdicts(self) -> None:
        """Rank 0's verdicts on the last micro-batches came with credits after its last send:
        one broadcast hands them to every stage (the stage agreement, ``agreement.py``)."""
        from .exchange import ExchangeRefused, broadcast_json

        agreement = self.cache.agreement
        if self.cfg.opts.pp_size < 2:
            return
        mine = agreement.owed() if self.rank == 0 else None
        owed = self._call(lambda: broadcast_json(mine, self.cfg.secret, self.rank, 0,
                                                 self.cfg.torch_device))
        if not isinstance(owed, list) or not all(type(w) is int for w in owed):
            raise ExchangeRefused("stage 0's final verdicts are not a list of integers")
        agreement.take_verdicts(owed, forward=False)

    def _pace(self, t0: float, mb: Any) -> float:
        """Open-loop arrivals: micro-batch i may start once its last request has arrived."""
        due = t0 + (self.requests_done + len(mb.requests)) / self.cfg.opts.rate
        wait = due - time.perf_counter()
        if wait <= 0:
            return 0.0
        time.sleep(wait)
        return wait

    def _check_parent(self) -> None:
        if not _parent_alive(self.cfg.parent_pid):
            raise PeerLost("the serve parent process is gone")

    # -- live numbers ----------------------------------------------------------------------------
    def live(self) -> Any:
        """This stage's ``StageLive`` now."""
        from ..live.numbers import StageLive

        fields: dict[str, Any] = self.cache.live_fields() if self.cache is not None else {}
        if self.pipe is not None:
            clock = self.pipe.clock
            fields.update({f: getattr(clock, f) for f in CLOCK_FIELDS}, timeline=clock.timeline())
        return StageLive(
            stage=self.rank, model_name=self.cfg.opts.plan.spec.name, time=time.time(), pid=self.pid,
            phase=self.phase, error=self.error, started_at=self.t_start, start_layer=self.stage_map.start,
            end_layer=self.stage_map.end, local_layers=self.stage_map.local_layers, steps=self.steps_done,
            requests=self.requests_done, total_steps=self.total_micro_batches,
            total_requests=self.total_requests, **fields,
        )

    def _beat_fields(self) -> dict[str, Any]:
        """What a heartbeat re-checks while the stage waits: its host tier's verdict."""
        return {"host_tier": self.cache.host_tier.live()} if self.cache is not None else {}

    def publish(self, phase: Phase | None = None, error: str | None = None, force: bool = False) -> None:
        """Rewrite ``stage-<k>.json`` (atomically), at most every ``PUBLISH_INTERVAL_S`` unless forced."""
        if phase is not None:
            self.phase = phase
        if error is not None:
            self.error = error
        now = time.monotonic()
        if not force and now - self._last_publish < PUBLISH_INTERVAL_S:
            return
        self._last_publish = now
        self.stage_file.publish(self.live())
