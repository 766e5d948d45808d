"""Is each stage up, and is the run ready?  One pure verdict for the probes and the exporter.

Kubernetes separates three questions, and so does ``serve``: liveness (``/healthz``: the serving
process answers), startup (``/startupz``: startup validation passed) and readiness (``/readyz``:
can the pipeline take work *now*).  Readiness needs every stage process alive, past starting, its
layer map valid and its heartbeat fresh; a host tier not in ``NOT_READY_STATUSES``; no more than
``--max-disagreements`` stage disagreements (stages that disagree compute on different prefixes);
and (``serve``) every HiCache transfer complete (one that lacked a pool kind loads back wrong).
What is wrong but leaves the run ready (other host-tier statuses, L3 down) is in ``warnings``.

A stage beats from a thread of its own (``heartbeat``), so a stage waiting in a collective still
beats while a stopped, killed or wedged one does not.  The verdict is computed from the run
directory and the clock -- nothing is stored -- so ``/readyz``, ``stagecache_stage_up`` and the
supervisor never disagree about a stage.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from pydantic import Field

from ..defaults import HEARTBEAT_TIMEOUT_S
from ..memory.host_tier import NOT_READY_STATUSES
from ..typed import Strict
from ..validation.report import StartupReport
from .divergence import readiness_lines
from .numbers import Phase, RunInfo, StageLive
from .source import SnapshotSource


def disagreeing(per_stage: Iterable[tuple[int, Mapping[str, int]]]) -> dict[int, dict[str, int]]:
    """Stage -> kind -> disagreements, only the non-zero counts of the stages that have any: what
    ``/readyz`` and the run's summary name."""
    odd = {stage: {k: n for k, n in counts.items() if n} for stage, counts in per_stage}
    return {stage: counts for stage, counts in odd.items() if counts}


class StageHealth(Strict):
    """One stage's liveness: up or not, and the reason when not."""

    stage: int
    up: bool
    state: str = Field("up", description="up; starting; stale (a local heartbeat stopped); "
                       "unreachable (numbers over the network stopped: the process may still run); "
                       "crashed (its exit code is known, or a stage on its host saw its process gone); "
                       "failed, done or refused (its own phase)")
    host: str | None = Field(None, description="the host the stage runs on, when known")
    remote: bool = Field(False, description="its numbers come over the network")
    pid: int | None = None
    phase: str = "unknown"
    exit_code: int | None = None
    heartbeat_at: float | None = Field(None, description="unix time of the last heartbeat")
    heartbeat_age_s: float | None = None
    error: str | None = Field(None, description="the stage's own last error")
    reason: str | None = Field(None, description="why the stage is not up")
    host_tier: list[str] = Field(default_factory=list,
                                 description="the stage's host-tier statuses (empty: not checked)")
    l3: str = Field("off", description="the stage's L3 backend: off, up or down (down leaves the "
                    "run ready: the stage serves from device and host)")
    l3_reason: str | None = Field(None, description="why L3 is down")


class Liveness(Strict):
    """The run's readiness, with the stages and the reasons (the ``/readyz`` body)."""

    ready: bool
    phase: str = Field(description="the run's phase, 'unknown' without a serving parent")
    startup_ok: bool | None = Field(description="startup validation (None: not reported yet)")
    heartbeat_timeout_s: float
    failure: str | None = None
    failed_stage: int | None = None
    failed_at: float | None = None
    finished_at: float | None = Field(None, description="unix time the run finished its trace")
    stages: list[StageHealth]
    reasons: list[str] = Field(description="why the run is not ready (empty when ready)")
    warnings: list[str] = Field(default_factory=list,
                                description="what is wrong but leaves the run ready (host tier)")
    time: float
    disagreements: int = Field(0, description="stage disagreements so far (every stage, kind)")
    max_disagreements: int | None = Field(
        None, description="more than this many is not ready (serve --max-disagreements)")


def last_beat(live: StageLive) -> float | None:
    """The newest sign of life: the heartbeat, or a report (sources without a heartbeat thread).

    A remote stage's sign of life is its numbers' arrival, on the receiver's clock
    (``remote.Arrivals``): its own ``time`` is another host's wall clock."""
    if live.remote:
        return live.heartbeat_at
    times = [t for t in (live.heartbeat_at, live.time) if t]
    return max(times) if times else None


def stage_health(stage: int, live: StageLive | None, exit_code: int | None, now: float,
                 timeout: float, starting_is_down: bool = False, seen_gone: str | None = None) -> StageHealth:
    """One stage's verdict: exited, failed, still starting, never beat, stale heartbeat, or up.

    ``starting_is_down``: a stage that says it is still starting is not up (``serve``'s
    stages say "serving" once they have the startup verdict; an sglang process has no
    such phase, so there it stays off).  ``seen_gone``: a stage on the same host saw its
    process gone (``remote.gone``), so silence is a crash, not a cut link.
    """
    beat = last_beat(live) if live is not None else None
    age = max(0.0, now - beat) if beat is not None else None
    base = {"stage": stage, "pid": live.pid if live else None,
            "phase": live.phase.value if live else "unknown", "exit_code": exit_code,
            "heartbeat_at": beat, "heartbeat_age_s": age, "error": live.error if live else None,
            "host_tier": list(live.host_tier.status) if live else [],
            "l3": _l3_state(live), "l3_reason": live.l3.down_reason if live else None,
            "host": live.host if live else None, "remote": bool(live and live.remote)}
    if exit_code is not None:
        return StageHealth(**base, up=False, state="crashed",
                           reason=f"process exited with code {exit_code}")
    if live is None:
        return StageHealth(**base, up=False, state="starting", reason="has not reported yet")
    if live.phase in (Phase.FAILED, Phase.DONE, Phase.REFUSED):
        why = f"failed: {live.error}" if live.phase == Phase.FAILED else f"phase {live.phase.value}"
        return StageHealth(**base, up=False, state=live.phase.value, reason=why)
    if seen_gone is not None:
        return StageHealth(**base, up=False, state="crashed", reason=f"crashed: {seen_gone}")
    if starting_is_down and live.phase == Phase.STARTING:
        return StageHealth(**base, up=False, state="starting", reason="still starting")
    if age is None:
        return StageHealth(**base, up=False, state="starting", reason="no heartbeat yet")
    if age > timeout:
        if live.remote:
            where = f" from {live.host}" if live.host else ""
            return StageHealth(**base, up=False, state="unreachable", reason=(
                f"unreachable: no numbers over the network{where} for {age:.1f} s (limit {timeout:g} s); "
                "the link or the host may be down, the process may still run"))
        return StageHealth(**base, up=False, state="stale",
                           reason=f"no heartbeat for {age:.1f} s (limit {timeout:g} s)")
    return StageHealth(**base, up=True)


def _l3_state(live: StageLive | None) -> str:
    if live is None or live.l3.backend == "none":
        return "off"
    return "up" if live.l3.up else "down"


def assess(run: RunInfo | None, startup: StartupReport | None,
           stages: Mapping[int, StageLive], now: float,
           heartbeat_timeout: float | None = None) -> Liveness:
    """The verdict for ``/readyz`` and ``stagecache_stage_up`` (pure: same inputs, same answer).

    Without ``run`` (a source with no serving parent: a preflight view, an sglang
    process) only the stages' own reports and heartbeats count.
    """
    timeout = heartbeat_timeout or (run.heartbeat_timeout_s if run else HEARTBEAT_TIMEOUT_S)
    ids = sorted(set(range(run.pp_size)) | set(stages)) if run and run.pp_size else sorted(stages)
    health = []
    seen = seen_gone(stages)
    for k in ids:
        code = run.exit_codes.get(k) if run else None
        health.append(stage_health(k, stages.get(k), code, now, timeout,
                                   starting_is_down=run is not None, seen_gone=seen.get(k)))
    ok = None if startup is None else startup.ok
    reasons = []
    if run is not None and run.phase == Phase.DONE:
        reasons.append(finished_reason(run))
    elif run is not None and run.phase != Phase.SERVING:
        reasons.append(f"run is {run.phase.value}" + (f": {run.failure}" if run.failure else ""))
    if ok is None:
        reasons.append("startup validation has not been reported yet")
    elif not ok:
        reasons.append("startup validation failed (see /startupz)")
    if not health:
        reasons.append("no stage reports live numbers")
    reasons += [f"stage {h.stage}: {h.reason}" for h in health if not h.up]
    tier_errors, warnings = host_tier_findings(stages, [h.stage for h in health if h.up])
    reasons += tier_errors
    warnings += [f"stage {h.stage}: L3 down ({h.l3_reason}); serving from device and host"
                 for h in health if h.l3 == "down"]
    limit = run.max_disagreements if run is not None else None
    total, why = agreement_verdict([stages.get(k) for k in ids], limit)
    if why:
        reasons.append(why)
    # incomplete transfers: not ready under a serving parent (its pages load back wrong), a
    # warning where only stages report (the sglang endpoint says it from ``divergence()``)
    for k in ids:
        live = stages.get(k)
        line = live.transfer_check.line() if live is not None else None
        if line:
            (reasons if run is not None else warnings).append(line)
    return Liveness(
        ready=not reasons, warnings=warnings, phase=run.phase.value if run else "unknown", startup_ok=ok,
        heartbeat_timeout_s=timeout, failure=run.failure if run else None,
        failed_stage=run.failed_stage if run else None, failed_at=run.failed_at if run else None,
        finished_at=run.finished_at if run else None, stages=health, reasons=reasons, time=now, disagreements=total, max_disagreements=limit,
    )


def seen_gone(stages: Mapping[int, StageLive]) -> dict[int, str]:
    """Stage -> who saw its process gone and how (``StageLive.gone`` of the stages on its host)."""
    out: dict[int, str] = {}
    for k, live in sorted(stages.items()):
        for other, how in live.gone.items():
            out.setdefault(other, f"{how} (seen by stage {k} on the same host)")
    return out


def utc_text(t: float) -> str:
    """``t`` (unix time) as the page and the probes show it: ``2026-12-04 10:31:07 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def finished_reason(run: RunInfo) -> str:
    """Why a finished run answers 503: the readiness probe asks "can it take work now?", and a
    run whose stages served their whole trace and exited cannot, though nothing went wrong."""
    when = f" at {utc_text(run.finished_at)}" if run.finished_at else ""
    return (f"run finished{when}: every stage served the whole trace and exited, so none takes "
            "work (not a failure; the dashboard shows the finished run until the command exits)")


def agreement_verdict(stages: list[StageLive | None], limit: int | None) -> tuple[int, str | None]:
    """Disagreements over every stage and kind, and why that is too many (None: it is not).

    Without a limit (a source with no serving parent) nothing fails readiness.
    """
    live = [s for s in stages if s is not None]
    total = sum(n for s in live for n in s.agreement.disagreements.values())
    if limit is None or total <= limit:
        return total, None
    per = disagreeing((s.stage, s.agreement.disagreements) for s in live)
    recent = [r for s in live for r in s.agreement.recent]
    last = max(recent, key=lambda r: r.time, default=None)
    latest = (f"; latest: request {last.request}, {last.kind}, stage(s) "
              f"{', '.join(map(str, last.stages))}" if last else "")
    return total, (f"stages disagree: {total} disagreement(s) > --max-disagreements {limit} "
                   f"(by stage and kind: {per}){latest}")


def host_tier_findings(stages: Mapping[int, StageLive], up: list[int]) -> tuple[list[str], list[str]]:
    """(not-ready reasons, warnings) from the host-tier verdicts of the stages that are up.

    A stage that is down already makes the run not ready; its last host-tier verdict
    would only repeat a stale reading.
    """
    errors: list[str] = []
    warnings: list[str] = []
    for k in up:
        live = stages.get(k)
        if live is None:
            continue
        tier = live.host_tier
        for status, reason in zip(tier.status, tier.reasons, strict=False):
            if status == "ok":
                continue
            (warnings if tier.ready or status not in NOT_READY_STATUSES else errors).append(reason)
    return errors, warnings


def liveness_of(source: SnapshotSource, now: float) -> Liveness:
    """``assess`` over a snapshot source, plus the PP ranks' agreement where the source compares
    them (the sglang endpoint: ``divergence()``): a warning, or -- ``strict_agreement`` -- a reason."""
    verdict = assess(source.run(), source.startup(), source.stages(), now)
    divergence = getattr(source, "divergence", None)
    lines = readiness_lines(divergence()) if callable(divergence) else []
    if lines and getattr(source, "strict_agreement", False):
        verdict.reasons += lines
        verdict.ready = False
    else:
        verdict.warnings += lines
    return verdict
