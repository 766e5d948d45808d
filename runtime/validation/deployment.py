"""A deployment's records -> its startup report: the checks ``stagecache check`` runs, on any path.

``check`` (records from the plan), ``serve`` (records from the stage processes' real pools) and a
live sglang deployment (records the ranks exchanged) all end here, so the same input gives the
same verdict and the same messages everywhere: every stage's buffers against its local layers
per pool kind (``checks.validate_stage``), the tiling of ``[0, L)``, and -- what only a real
deployment can get wrong -- stages of another deployment (fingerprints, engine versions), token
capacities that disagree, a stage sized without a bound, and a rank that reports another stage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from ..errors import MappingError
from ..model.family import is_unbounded
from ..plan.plan import RunPlan
from .checks import validate_host, validate_stage, validate_tiling
from .record import StageRecord, stage_record
from .report import StageReport, StartupReport


def _majority(values: list[str], first: str) -> str:
    """The most common value; rank 0's on a tie (a 2-rank split has no majority to trust)."""
    counts = Counter(values)
    top = max(counts.values())
    return first if counts[first] == top else next(v for v in values if counts[v] == top)


def fingerprint_errors(records: Sequence[StageRecord]) -> dict[int, list[MappingError]]:
    """Per stage, how its fingerprint (and engine version) differs from the deployment's."""
    out: dict[int, list[MappingError]] = {}
    fps = [r.fingerprint for r in records]
    if all(fp is not None for fp in fps):
        agreed = _majority([f.digest for f in fps], fps[0].digest)
        want = next(f for f in fps if f.digest == agreed)
        for rec, fp in zip(records, fps, strict=True):
            if fp.digest != agreed:
                out.setdefault(rec.stage, []).append(MappingError(
                    rec.stage, "fingerprint", want.digest, fp.digest,
                    f"stage {rec.stage} runs another deployment than the other stages "
                    f"({'; '.join(fp.differences(want))})"))
    engines = [r.engine for r in records]
    engine = _majority(engines, engines[0])
    for rec in records:
        if rec.engine != engine:
            out.setdefault(rec.stage, []).append(MappingError(
                rec.stage, "fingerprint", engine, rec.engine,
                f"stage {rec.stage} runs {rec.engine}, the others {engine}"))
    return out


def _sized_tokens(rec: StageRecord) -> int:
    """The full tokens the stage's pools were built for (its record's, or its capacity's)."""
    return max(rec.pool_tokens, rec.capacity.tokens if rec.capacity is not None else 0)


def unbounded_errors(records: Sequence[StageRecord]) -> dict[int, list[MappingError]]:
    """One error per stage whose token-sized pools were built for a count no memory bounds: a stage
    whose pools cost 0 bytes per token (a Mamba-hybrid stage without an attention layer) that took
    its own figure (sglang's ``int64`` max) instead of the MIN over the PP ranks."""
    bounded = [t for r in records if (t := _sized_tokens(r)) and not is_unbounded(t)]
    out: dict[int, list[MappingError]] = {}
    for rec in records:
        tokens = _sized_tokens(rec)
        if not is_unbounded(tokens):
            continue
        m = rec.layer_map
        paged = [k for k in m.kinds if k.paged]
        empty = [k for k in paged if not m.pool_layers(k.name)]
        kind = (empty or paged)[0]
        why = (f"no {kind.owners_text or kind.label} layer in [{m.start}, {m.end}): 0 B per token, nothing "
               "bounds it" if empty else "nothing bounds it")
        want = f"the MIN over the PP ranks ({min(bounded):,} tokens here)" if bounded else "the MIN over the PP ranks"
        out[rec.stage] = [MappingError(
            rec.stage, kind.name, f"<= {min(bounded)}" if bounded else "a bounded count", tokens,
            f"stage {rec.stage}: {kind.label} pool sized for {tokens:,} tokens, the stage's own figure "
            f"({why}) instead of {want}; no token allocator or HiCache host pool of that count can be "
            "allocated")]
    return out


def capacity_errors(records: Sequence[StageRecord]) -> dict[int, list[MappingError]]:
    """Every stage must end with the one deployment capacity, no larger than any stage alone (a
    stage sized without a bound is ``unbounded_errors``' alone: one line for it)."""
    caps = {r.stage: r.capacity for r in records
            if r.capacity is not None and not is_unbounded(_sized_tokens(r))}
    if not caps:
        return {}
    agreed = _majority([str(c.tokens) for c in caps.values()], str(next(iter(caps.values())).tokens))
    floor = min(c.tokens_alone for c in caps.values())
    out: dict[int, list[MappingError]] = {}
    for stage, cap in caps.items():
        if str(cap.tokens) != agreed:
            out.setdefault(stage, []).append(MappingError(
                stage, "capacity", int(agreed), cap.tokens,
                f"stage {stage} sized its pools for {cap.tokens} tokens, the deployment for {agreed}"))
        if cap.tokens > floor:
            out.setdefault(stage, []).append(MappingError(
                stage, "capacity", f"<= {floor}", cap.tokens,
                f"stage {stage}'s capacity {cap.tokens} exceeds the smallest stage's {floor} tokens"))
    return out


def stage_report(rec: StageRecord, extra: Sequence[MappingError] = ()) -> StageReport:
    """One stage's verdict: its record validated, its own findings and ``extra`` added."""
    m, inv = rec.layer_map, rec.pool_inventory()
    errors = (*validate_stage(m, inv), *validate_host(m, inv, rec.host_buffers), *rec.findings, *extra)
    return StageReport(
        stage=m.stage, start=m.start, end=m.end, layers=m.layers, kinds=m.kinds,
        buffers=inv.counts(m.pools), expected=m.expected_buffers(),
        pool_page_bytes=rec.pool_page_bytes, device_bytes=rec.device_bytes,
        host_buffers=rec.host_buffers, host_bytes=rec.host_bytes, errors=errors)


def deployment_report(records: Sequence[StageRecord], *, tp_size: int, page_size: int,
                      faults: Sequence[str] = (), pp_size: int | None = None,
                      cross: Sequence[MappingError] = (),
                      extra: Mapping[int, Sequence[MappingError]] | None = None) -> StartupReport:
    """Every stage, the tiling, fingerprints and capacity, over the deployment's records.

    With every stage's record (``pp_size`` records, the default), they are in rank order
    (``all_gather`` keeps group order): a record that claims another stage than its rank is an
    error of that rank's stage, and the stages must tile ``[0, L)``.  With only some stages'
    records (one rank's view of its own stage) those are validated, and a tiling error counts
    only where it names one of them: the other stages live elsewhere.  ``cross``: more
    cross-stage findings (a partition the engine computes otherwise); ``extra``: more findings
    per stage (what the engine itself will do wrong with it).
    """
    first = records[0]
    pp = len(records) if pp_size is None else pp_size
    whole = len(records) == pp
    found: dict[int, list[MappingError]] = {k: list(v) for k, v in (extra or {}).items()}
    for key, errs in (*fingerprint_errors(records).items(), *unbounded_errors(records).items(),
                      *capacity_errors(records).items()):
        found.setdefault(key, []).extend(errs)
    for rank, rec in enumerate(records):
        if whole and rec.stage != rank:
            found.setdefault(rec.stage, []).append(MappingError(
                rec.stage, "partition", rank, rec.stage, f"PP rank {rank} reports its pool as stage {rec.stage}"))
    ordered = records if whole else sorted(records, key=lambda r: r.stage)
    stages = tuple(stage_report(r, found.get(r.stage, ())) for r in ordered)
    tiling = validate_tiling([s.slice for s in stages], first.num_layers)
    if not whole:
        tiling = [e for e in tiling if e.stage is not None]
    return StartupReport(family=first.family, model=first.model, num_layers=first.num_layers,
                         pp_size=pp, tp_size=tp_size, page_size=page_size, faults=tuple(faults),
                         stages=stages, cross_errors=(*tiling, *cross))


def preflight(plan: RunPlan) -> StartupReport:
    """``check``: validate every stage of a plan against its planned pools (faults included), and
    name what sglang itself would do wrong with a stage (``Family.stage_problems``)."""
    family = plan.spec.family
    problems = {s.stage: [MappingError(s.stage, "partition", None, None, f"stage {s.stage}: {p}")
                          for p in family.stage_problems(s.layer_map, plan.page_size)] for s in plan.stages}
    return deployment_report([stage_record(s) for s in plan.stages], tp_size=plan.tp_size,
                             page_size=plan.page_size, faults=plan.fault_names, extra=problems)
