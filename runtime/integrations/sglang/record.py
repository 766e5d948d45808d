"""One PP rank's stage record, and the whole-deployment validation every rank runs over all of them.

sglang never exchanges the stages' layer ranges: each rank runs ``get_pp_indices`` on its
own, so a rank started with another ``SGLANG_PP_LAYER_PARTITION`` or another config goes
unnoticed until outputs are wrong.  At the HiCache stack build every rank therefore turns
its live pool into a ``StageRecord`` (plain JSON: layer map, pool inventory, measured
bytes, token capacity, host pages, sglang version, fingerprint), the ranks exchange the
records (``exchange.py``), and every rank runs ``deployment_report`` over the same list --
the checks ``stagecache check`` runs (tiling ``[0, L)``, buffers vs local layers per stage
and pool kind) plus equal fingerprints and one token capacity.  Same input, same code:
every rank reaches the same verdict and, in strict mode, the same error message.

A record arrives from another process, so it is parsed with pydantic (bounded sizes,
typed fields) before any of it is used.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ...errors import ConfigError, MappingError
from ...model.layer_map import LayerEntry, StageLayerMap
from ...model.pool_kinds import POOLS
from ...plan.fingerprint import Fingerprint, config_hash
from ...plan.inventory import PoolInventory
from ...validation.checks import validate_stage, validate_tiling
from ...validation.report import StageReport, StartupReport
from .reader import read_pool, sglang_partition

#: Bumped when a field changes meaning: ranks of different stagecache versions refuse each other.
RECORD_VERSION = 1
#: Pool kinds whose size follows the token capacity (C128 state is one slot per request).
TOKEN_SIZED_POOLS = tuple(p for p in POOLS if p != "c128_state")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LayerRow(_Strict):
    local: int = Field(ge=0)
    global_id: int = Field(ge=0)
    compress_ratio: int
    compress_layer_id: int | None = None
    c4_state_id: int | None = None


class FindingRow(_Strict):
    stage: int | None
    pool: str = Field(max_length=64)
    expected: Any = None
    got: Any = None
    message: str = Field(max_length=4096)


class FingerprintRow(_Strict):
    model: str = Field(max_length=256)
    config_hash: str = Field(max_length=64)
    kv_dtype: str = Field(max_length=64)
    page_size: int
    pp_size: int
    tp_size: int
    partition: list[int] = Field(max_length=4096)

    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self.model, self.config_hash, self.kv_dtype, self.page_size, self.pp_size,
                           self.tp_size, tuple(self.partition))


class CapacityRow(_Strict):
    tokens_alone: int = Field(ge=0)
    tokens: int = Field(ge=0)


class StageRecord(_Strict):
    """What one rank tells every other rank about its stage (JSON over the PP CPU group)."""

    version: int = RECORD_VERSION
    stage: int = Field(ge=0)
    model: str = Field(max_length=256)
    num_layers: int = Field(ge=1)
    sglang_version: str = Field(max_length=64)
    start: int
    end: int
    layers: list[LayerRow] = Field(max_length=4096)
    inventory: dict[str, list[bool]]
    findings: list[FindingRow] = Field(default_factory=list, max_length=4096)
    pool_bytes: dict[str, int] = Field(default_factory=dict)
    pool_tokens: int = Field(0, ge=0, description="full tokens the stage's pool was built for")
    fingerprint: FingerprintRow
    capacity: CapacityRow | None = None
    host_pages: dict[str, int] = Field(default_factory=dict)
    push_url: str | None = Field(None, max_length=512, description="rank 0: where the others push")
    push_secret: str | None = Field(None, max_length=128, description="rank 0: the push MAC key, hex")

    def stage_map(self) -> StageLayerMap:
        return StageLayerMap(self.stage, self.start, self.end, tuple(
            LayerEntry(r.local, r.global_id, r.compress_ratio, r.compress_layer_id, r.c4_state_id)
            for r in self.layers))

    def pool_inventory(self) -> PoolInventory:
        return PoolInventory(self.stage, {p: tuple(v) for p, v in self.inventory.items()})


def stage_record(kvcache: Any, *, stage: int, pp_size: int, tp_size: int, num_layers: int,
                 model_name: str, page_size: int, capacity: tuple[int, int] | None = None,
                 host_pages: dict[str, int] | None = None) -> StageRecord:
    """The record of the pool this rank built (read once, by ``reader.read_pool``)."""
    import sglang

    view = read_pool(kvcache, stage, num_layers, model_name)
    try:
        partition = [end - start for start, end in sglang_partition(num_layers, pp_size)]
    except ValueError:  # an explicit partition get_pp_indices refuses: the tiling check names it
        partition = []
    fp = FingerprintRow(model=model_name, config_hash=config_hash(view.spec),
                        kv_dtype=str(getattr(kvcache, "dtype", "unknown")), page_size=int(page_size),
                        pp_size=pp_size, tp_size=tp_size, partition=partition)
    m = view.stage_map
    return StageRecord(
        stage=stage, model=model_name, num_layers=num_layers,
        sglang_version=str(getattr(sglang, "__version__", "unknown")), start=m.start, end=m.end,
        layers=[LayerRow(local=e.local, global_id=e.global_id, compress_ratio=e.compress_ratio,
                         compress_layer_id=e.compress_layer_id, c4_state_id=e.c4_state_id) for e in m.layers],
        inventory={p: list(v) for p, v in view.inventory.buffers.items()},
        findings=[FindingRow(**f.to_dict()) for f in view.findings],
        pool_bytes=dict(view.pool_bytes), pool_tokens=int(getattr(kvcache, "size", 0) or 0),
        fingerprint=fp,
        capacity=CapacityRow(tokens_alone=capacity[0], tokens=capacity[1]) if capacity else None,
        host_pages=dict(host_pages or {}),
    )


def parse_records(raw: list[Any], pp_size: int) -> list[StageRecord]:
    """Every rank's record, validated; a malformed one is a ``ConfigError`` naming its rank."""
    records = []
    for rank, item in enumerate(raw):
        try:
            rec = StageRecord.model_validate(item)
        except ValueError as exc:
            raise ConfigError(f"PP rank {rank}'s stage record is malformed: {exc}") from None
        if rec.version != RECORD_VERSION:
            raise ConfigError(f"PP rank {rank} sent stage record version {rec.version}, this rank "
                              f"reads {RECORD_VERSION}: run one stagecache version on every rank")
        records.append(rec)
    if len(records) != pp_size:
        raise ConfigError(f"expected {pp_size} stage records, got {len(records)}")
    return records


# -- whole-deployment validation -----------------------------------------------------------------
def _majority(values: list[str], first: str) -> str:
    """The most common value; rank 0's on a tie (a 2-rank split has no majority to trust)."""
    counts = Counter(values)
    top = max(counts.values())
    return first if counts[first] == top else next(v for v in values if counts[v] == top)


def fingerprint_errors(records: list[StageRecord]) -> dict[int, list[MappingError]]:
    """Per stage, how its fingerprint (and sglang version) differs from the deployment's."""
    fps = [r.fingerprint.fingerprint() for r in records]
    agreed = _majority([f.digest for f in fps], fps[0].digest)
    want = next(f for f in fps if f.digest == agreed)
    versions = [r.sglang_version for r in records]
    version = _majority(versions, versions[0])
    out: dict[int, list[MappingError]] = {}
    for rec, fp in zip(records, fps, strict=True):
        errs = []
        if fp.digest != agreed:
            diffs = "; ".join(fp.differences(want))
            errs.append(MappingError(rec.stage, "fingerprint", want.digest, fp.digest,
                                     f"stage {rec.stage} runs another deployment than the other "
                                     f"stages ({diffs})"))
        if rec.sglang_version != version:
            errs.append(MappingError(rec.stage, "fingerprint", version, rec.sglang_version,
                                     f"stage {rec.stage} runs sglang {rec.sglang_version}, the "
                                     f"others {version}"))
        if errs:
            out[rec.stage] = errs
    return out


def capacity_errors(records: list[StageRecord]) -> dict[int, list[MappingError]]:
    """Every stage must end with the one deployment capacity, no larger than any stage alone."""
    caps = {r.stage: r.capacity for r in records if r.capacity is not None}
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


def _stage_report(rec: StageRecord, extra: list[MappingError]) -> StageReport:
    stage_map, inv = rec.stage_map(), rec.pool_inventory()
    errors = list(validate_stage(stage_map, inv))
    errors += [MappingError(f.stage, f.pool, f.expected, f.got, f.message) for f in rec.findings]
    return StageReport(stage_map, inv.counts(), stage_map.expected_buffers(), tuple(errors + extra))


def deployment_report(records: list[StageRecord], tp_size: int = 1) -> StartupReport:
    """``stagecache check`` over the live deployment: every stage, the tiling, fingerprints, capacity.

    Ranks are PP ranks in order (``all_gather`` keeps group order); a record that claims
    another stage than its rank is an error of that rank's stage.
    """
    first = records[0]
    extra: dict[int, list[MappingError]] = {}
    for key, errs in (*fingerprint_errors(records).items(), *capacity_errors(records).items()):
        extra.setdefault(key, []).extend(errs)
    for rank, rec in enumerate(records):
        if rec.stage != rank:
            extra.setdefault(rec.stage, []).append(MappingError(
                rec.stage, "partition", rank, rec.stage,
                f"PP rank {rank} reports its pool as stage {rec.stage}"))
    stages = tuple(_stage_report(r, extra.get(r.stage, [])) for r in records)
    cross = validate_tiling([s.stage_map.slice for s in stages], first.num_layers)
    return StartupReport(model=first.model, num_layers=first.num_layers, pp_size=len(records),
                         tp_size=tp_size, page_size=first.fingerprint.page_size, stages=stages,
                         cross_errors=tuple(cross))


def stranded_bytes(rec: StageRecord) -> int:
    """Device bytes this stage could still use if it ran alone: its token-sized pools' bytes
    per deployment token (measured on the live tensors, which sglang sized for the deployment's
    capacity) times the tokens the minimum takes away."""
    cap = rec.capacity
    if cap is None or cap.tokens <= 0 or cap.tokens_alone <= cap.tokens:
        return 0
    per_token = sum(rec.pool_bytes.get(p, 0) for p in TOKEN_SIZED_POOLS) / cap.tokens
    return int(per_token * (cap.tokens_alone - cap.tokens))
