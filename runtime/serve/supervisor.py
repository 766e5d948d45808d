"""``serve``'s supervisor: start one process per PP stage, watch them, stop them (always).

Process model::

    serve (parent)                      stage processes (one per PP stage)
    ├─ dashboard + /metrics (thread)    rank k: dist init (gloo | nccl), own pools + host stack,
    │   reads RunDirSource(run_dir)     gather inventory -> rank 0 -> startup.json, request loop,
    ├─ supervisor loop (0.2 s)          activations k -> k+1, live numbers -> stage-<k>.json
    └─ progress bar, summary

The parent never imports a stage's pools: it only reads the run directory.  It
owns shutdown: Ctrl-C / SIGTERM, a stage that exits non-zero, or a startup that
does not come within ``--startup-timeout`` all end in the same ``stop()``
(SIGTERM, a grace period, SIGKILL, join), so no stage outlives it; stages also
get SIGKILL from the kernel if the parent itself dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError
from ..live import run_dir as rd
from ..live.liveness import assess
from ..live.numbers import Phase, RunInfo, StageLive
from ..live.run_dir import RunDirSource
from ..validation.report import StartupReport
from .options import ServeOptions, StageConfig
from .rendezvous import new_store_path

log = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 0.2
STOP_GRACE_S = 3.0
PEER_LOST_GRACE_S = 1.5
REMOTE_GRACE_S = 3.0  # several hosts: how long a lost peer may wait for the other node's report

#: Imported once by the forkserver that forks the stage processes.
STAGE_PRELOAD = (
    "numpy", "torch", "torch.distributed", "stagecache.runtime.serve.stage_worker",
    "stagecache.runtime.serve.stage_cache", "stagecache.runtime.serve.stage_l3",
    "stagecache.runtime.serve.pipeline",
    "stagecache.runtime.cache.hicache", "stagecache.runtime.transfer.controller",
    "stagecache.runtime.memory.host_pools", "stagecache.runtime.memory.pools",
    "stagecache.runtime.cache.kv_writer", "stagecache.runtime.traces.readers",
)
#: Also imported there when the stages run on CUDA: the Triton kernel (a CPU run never launches it).
CUDA_PRELOAD = ("stagecache.runtime.transfer.triton_copy",)


class Observer(Protocol):
    """What the supervisor reports to while it runs (the CLI's progress bar)."""

    def startup(self, report: StartupReport) -> None: ...

    def update(self, stages: dict[int, StageLive]) -> None: ...


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


class Supervisor:
    """Starts the stages, watches them and the run directory, and stops them (always).

    Its state (phase, failure) changes only through its own methods: ``supervise`` (starting ->
    serving / refused -> done), ``fail`` and ``interrupt``.
    """

    def __init__(self, opts: ServeOptions, run_dir: str, *, source: RunDirSource | None = None,
                 url: str | None = None, guard: Callable[[], str | None] | None = None,
                 log: Callable[[str], None] = log.info):
        self.opts = opts
        self.run_dir = run_dir
        self.log = log
        self.source = source if source is not None else RunDirSource(run_dir)
        self.procs: list[StageProc] = []
        self.phase = Phase.STARTING
        self.failure: str | None = None
        self.failed_stage: int | None = None
        self.failed_at: float | None = None
        self.finished_at: float | None = None  # when every stage finished the trace
        self.stale: set[int] = set()  # stages whose heartbeat the supervisor saw go stale
        self.incomplete_said: set[int] = set()  # stages whose incomplete transfer was logged
        self.started_at = time.time()
        self.url = url  # the dashboard's, for run.json
        self.exit_codes: dict[int, int | None] = {}
        #: stages of other nodes (several hosts): their pids and exit codes as the hub last heard
        self.remote_pids: dict[int, int | None] = {}
        self.remote_exit_codes: dict[int, int | None] = {}
        #: Why the run dir can no longer be trusted (``RunDirLock.replaced``); None: it can.
        self.guard: Callable[[], str | None] = guard or (lambda: None)
        self._write_failing = False

    # -- run.json / snapshot.json ------------------------------------------------------------------
    def run_info(self) -> RunInfo:
        return RunInfo(
            phase=self.phase, failure=self.failure, failed_stage=self.failed_stage,
            failed_at=self.failed_at, finished_at=self.finished_at, pp_size=self.opts.pp_size, model=self.opts.plan.spec.name,
            device=self.opts.device, url=self.url, parent_pid=os.getpid(),
            pids={**self.remote_pids, **{p.rank: p.pid for p in self.procs}},
            exit_codes={**self.remote_exit_codes, **{p.rank: p.exitcode for p in self.procs}},
            heartbeat_timeout_s=self.opts.heartbeat_timeout, started_at=self.started_at,
            max_disagreements=self.opts.max_disagreements,
            time=time.time(),
        )

    def write_run_file(self) -> bool:
        """Rewrite run.json and snapshot.json; False when the write failed.

        A failed write (disk full, a read-only file system) must not stop the run or the
        dashboard: it is logged (once until a write works again), counted
        (``stagecache_run_file_write_failures_total``) and retried on the next tick.
        """
        try:
            rd.write_text_atomic(Path(self.run_dir) / rd.RUN_FILE, self.run_info().model_dump_json())
            rd.write_json_atomic(Path(self.run_dir) / rd.SNAPSHOT_FILE, self.source.snapshot())
        except OSError as exc:
            self.source.write_failures += 1
            if not self._write_failing:
                log.warning("cannot write %s in %s: %s; retrying (the run and the dashboard go on)",
                            rd.RUN_FILE, self.run_dir, exc.strerror or exc)
            self._write_failing = True
            return False
        if self._write_failing:
            log.warning("%s written again after %d failed write(s)", rd.RUN_FILE,
                        self.source.write_failures)
        self._write_failing = False
        return True

    def fail(self, why: str, stage: int | None) -> None:
        """Record the failure once: what, which stage, when (kept in run.json until exit)."""
        self.phase = Phase.FAILED
        self.failure = why
        self.failed_stage = stage
        self.failed_at = time.time()

    def interrupt(self, signal_name: str) -> bool:
        """Ctrl-C or SIGTERM: stop every stage and record why.  A run startup validation already
        refused stays refused (that is its outcome); True when it was."""
        refused = self.phase == Phase.REFUSED
        self.phase = Phase.REFUSED if refused else Phase.INTERRUPTED
        self.failure = f"interrupted by {signal_name}"
        self.stop()
        self.write_run_file()
        return refused

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
            cuda = CUDA_PRELOAD if self.opts.device == "cuda" else ()
            ctx.set_forkserver_preload([*STAGE_PRELOAD, *cuda])
        secret = secrets.token_bytes(32)  # seals the startup exchange (exchange.py)
        if self.opts.nnodes > 1:  # every node's stages share it: derived from --secret-file
            from .nodes import derive

            secret = derive(self.opts.node_secret, "exchange")
        store = new_store_path(self.run_dir)  # the rendezvous, private to the run dir
        for rank in self.opts.local_ranks:
            cfg = StageConfig(rank, self.opts, self.run_dir, os.getpid(), secret, store)
            proc = ctx.Process(target=stage_main, args=(cfg,), name=f"stagecache-stage-{rank}", daemon=False)
            proc.start()
            self.procs.append(StageProc(rank, proc))
        pids = ", ".join(f"stage {p.rank}: pid {p.pid}" for p in self.procs)
        backend = "nccl" if self.opts.device == "cuda" else "gloo"
        self.log(f"started {len(self.procs)} stage processes ({backend}, {self.opts.device}, "
                 f"activations [tokens, {self.opts.hidden_size}] float32): {pids}")
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

    def _dead_stage(self, first_seen: dict[int, float]) -> tuple[str, int | None] | None:
        """Why the run must stop and which stage, naming the stage that failed, not the peers.

        A stage that exits on its own (code 1, or a signal) is the cause.  Stages that
        exit with ``EXIT_PEER_LOST`` only noticed; after a short grace, if some stage is
        still alive while its neighbours gave up on it, that live stage is the one that
        stopped responding (stuck, or SIGSTOPped) and is named instead.
        """
        from .stage_worker import EXIT_OK, EXIT_PEER_LOST

        now = time.monotonic()
        for k, code in sorted(self.remote_exit_codes.items()):  # a stage of another node
            if code is not None and code != EXIT_OK and code != EXIT_PEER_LOST:
                return f"stage {k} (pid {self.remote_pids.get(k)}, another node) {_exited(code)}", k
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
            first = min(real, key=lambda p: (first_seen[p.rank], p.rank))
            return self.failure_message(first), first.rank
        # several hosts: the stage that died may be another node's, heard at its next report
        grace = PEER_LOST_GRACE_S + (REMOTE_GRACE_S if self.opts.nnodes > 1 else 0.0)
        if now - min(first_seen[p.rank] for p in failed) < grace and (
                self.opts.nnodes > 1 or not all(p.exitcode is not None for p in self.procs)):
            return None
        stuck = [p for p in self.procs if p.exitcode is None]
        if stuck:
            gave_up = ", ".join(str(p.rank) for p in failed)
            names = " and ".join(f"stage {p.rank} (pid {p.pid})" for p in stuck)
            return (f"{names} stopped responding: stage(s) {gave_up} lost contact with it "
                    f"(torch.distributed timeout {self.opts.dist_timeout:g} s)"), stuck[0].rank
        first = min(failed, key=lambda p: (first_seen[p.rank], p.rank))
        return self.failure_message(first), first.rank

    def failure_message(self, p: StageProc) -> str:
        msg = f"stage {p.rank} (pid {p.pid}) {_exited(p.exitcode)}"
        last = self.source.stages().get(p.rank)
        return msg + f": {last.error}" if last is not None and last.error else msg

    def _watch_heartbeats(self, stages: dict[int, StageLive]) -> None:
        """Say when a live stage stops beating (SIGSTOP, wedged) and when it beats again.

        Readiness and ``stagecache_stage_up`` already follow from the same verdict;
        this puts the transition on the console while the run goes on (its peers
        time out after ``--dist-timeout`` and the run then fails naming it).
        """
        if self.phase not in (Phase.STARTING, Phase.SERVING):
            return
        verdict = assess(self.run_info(), None, stages, time.time())
        for h in verdict.stages:
            stale = h.exit_code is None and h.state in ("stale", "unreachable")
            if stale and h.stage not in self.stale:
                self.stale.add(h.stage)
                why = "(stopped or stuck?)" if h.state == "stale" else "(another host: link or host down?)"
                self.log(f"stage {h.stage} (pid {h.pid}): {h.reason}; not ready {why}")
            elif not stale and h.stage in self.stale and h.up:
                self.stale.discard(h.stage)
                self.log(f"stage {h.stage} (pid {h.pid}): heartbeat again")

    def _watch_transfers(self, stages: dict[int, StageLive]) -> None:
        """Say, once per stage, when its first incomplete HiCache transfer is reported (the same
        line as /readyz): its host pages lack a pool kind and will load back wrong."""
        for k, live in stages.items():
            line = live.transfer_check.line()
            if line and k not in self.incomplete_said:
                self.incomplete_said.add(k)
                self.log(f"not ready: {line}")

    def _step(self, first_seen: dict[int, float], deadline: float,
              progress: Observer) -> bool:
        """One supervisor tick; True when the run is over (done, refused or failed)."""
        replaced = self.guard()
        if replaced is not None:
            self.fail(f"{replaced}; stopped, its files cannot be trusted", None)
            return True
        report = self.source.startup()
        if self.phase == Phase.STARTING and report is not None:
            self.phase = Phase.SERVING if report.ok else Phase.REFUSED
            self.write_run_file()
            progress.startup(report)
        stages = self.source.stages()
        progress.update(stages)
        self._watch_heartbeats(stages)
        self._watch_transfers(stages)
        dead = self._dead_stage(first_seen)
        if dead is not None:
            self.fail(*dead)
            return True
        if self.opts.nnodes > 1 and any(p.exitcode not in (None, 0) for p in self.procs):
            return False  # a lost peer: wait for the other node's report to name the stage (_dead_stage)
        if all(p.exitcode is not None for p in self.procs):
            if self.phase == Phase.STARTING:
                self.fail("every stage exited before startup validation was reported", None)
            elif self.phase == Phase.SERVING:
                self.phase = Phase.DONE
                self.finished_at = time.time()
            return True
        if self.phase == Phase.STARTING and time.monotonic() > deadline:
            waiting = [str(k) for k in range(self.opts.pp_size)
                       if k not in stages or stages[k].phase == Phase.STARTING]
            self.fail(f"startup did not complete within {self.opts.startup_timeout:g} s "
                      f"(stages still starting: {', '.join(waiting) or 'none'})", None)
            return True
        return False

    # -- the supervisor loop ----------------------------------------------------------------------
    def supervise(self, progress: Observer) -> Phase:
        """Run until the trace is served ('done'), startup refused ('refused') or a stage failed."""
        first_seen: dict[int, float] = {}
        deadline = time.monotonic() + self.opts.startup_timeout
        last_write = 0.0
        while not self._step(first_seen, deadline, progress):
            if time.monotonic() - last_write > 0.5:
                self.write_run_file()
                last_write = time.monotonic()
            time.sleep(SUPERVISE_INTERVAL_S)
        if self.phase != Phase.FAILED:
            for p in self.procs:
                p.process.join(5.0)
        self.stop()
        final = self.source.stages()
        self._watch_transfers(final)  # a stage's last report (a failed one publishes on its way out)
        progress.update(final)
        self.write_run_file()
        return self.phase


def _exited(code: int | None) -> str:
    how = f" (was killed by {signal.Signals(-code).name})" if code is not None and code < 0 else ""
    return f"exited with code {code}{how}"


def summarize(opts: ServeOptions, sup: Supervisor, wall: float) -> dict[str, Any]:
    """The final summary: per-stage numbers plus pipeline figures (the ``--json`` document)."""
    from .pipeline import ideal_bubble_fraction

    stages = sup.source.stages()
    report = sup.source.startup()
    rows = []
    for k in sorted(stages):
        s = stages[k]
        row = s.model_dump(mode="json", include=SUMMARY_FIELDS)
        row.update(exit_code=sup.exit_codes.get(k), layers=[s.start_layer, s.end_layer],
                   bubble_fraction=s.bubble_fraction,
                   disagreements=dict(s.agreement.disagreements),
                   compared_requests=s.agreement.compared_requests,
                   miss_tokens=s.insight.miss_tokens)
        rows.append(row)
    steps = max((r["steps"] for r in rows), default=0)
    return {
        "ok": sup.phase == Phase.DONE,
        "phase": sup.phase.value,
        "exit_code": 0 if sup.phase == Phase.DONE else 1,
        "failure": sup.failure,
        "model": opts.plan.spec.name,
        "pp_size": opts.pp_size,
        "tp_size": opts.plan.tp_size,
        "device": opts.device,
        "page_size": opts.page_size,
        "device_pages": opts.plan.stage(0).device_pages,
        "hicache_ratio": opts.plan.sizing.hicache_ratio,
        "faults": opts.plan.fault_names,
        "micro_batch_requests": opts.micro_batch,
        "micro_batches": steps,
        "ideal_bubble_fraction": ideal_bubble_fraction(opts.pp_size, steps),
        "wall_seconds": wall,
        "url": sup.url,
        "run_dir": sup.run_dir,
        "startup_ok": bool(report and report.ok),
        "startup_errors": [e.to_dict() for e in report.all_errors] if report else [],
        "stages": rows,
    }


#: ``StageLive`` fields a summary row keeps (the full model is in snapshot.json).
SUMMARY_FIELDS = {
    "stage", "pid", "phase", "local_layers", "requests", "steps", "cache_tokens", "host_hit_ratio",
    "evictions", "transfer_bytes", "transfer_count", "bandwidth_bytes_per_second",
    "stage_seconds", "bubble_seconds", "idle_seconds", "activation_bytes_sent",
    "kv_verified_pages", "error", "l3", "transfer_check",
}

