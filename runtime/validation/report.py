"""The startup report: every stage's map, buffers, bytes, host mirror and errors, plus cross-stage
errors.  One typed model, built once (``deployment.deployment_report``) and read as it is by
``check``, ``serve``, the sglang integration, the exporters and the dashboard (its API's
``response_model``); its JSON is ``stagecache check --json``.

A stage's report *is* its layer map (the same fields, flat in the JSON) plus what each of its
pool kinds holds against what its layers need.  Parsing one back from JSON (a saved ``check
--json``, a run directory's ``startup.json``) takes the model family from the report's
``family`` field (DeepSeek V4 where a report written before families names none).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import ConfigError, MappingError
from ..model.families import DEFAULT_FAMILY, AnyLayerEntry, family_named
from ..model.layer_map import StageLayerMap


def _stage_ok(stage: Any) -> bool:
    if isinstance(stage, dict):
        return bool(stage.get("ok", not stage.get("errors")))
    return bool(getattr(stage, "ok", False))  # not a stage: the model validation names it


def _with_ok(data: Any) -> Any:
    """``ok`` follows from the errors where the data does not say it (built, not parsed)."""
    if isinstance(data, dict) and "ok" not in data:
        errors = data.get("errors", data.get("cross_errors"))
        data = {**data, "ok": not errors and all(_stage_ok(s) for s in data.get("stages", ()))}
    return data


#: The per-pool-kind fields of a stage's report (JSON names), which ``shown_pools`` trims.
_POOL_FIELDS = ("buffers", "expected_buffers", "pool_page_bytes", "device_bytes", "host_buffers", "host_bytes")


def _field(stage: Any, name: str) -> dict[str, Any]:
    if isinstance(stage, dict):
        value = stage.get(name, stage.get("expected") if name == "expected_buffers" else None)
        return value if isinstance(value, dict) else {}
    return getattr(stage, "expected" if name == "expected_buffers" else name, None) or {}


def _error_pools(stage: Any) -> set[str]:
    errors = stage.get("errors") if isinstance(stage, dict) else getattr(stage, "errors", ())
    if not isinstance(errors, list | tuple):
        return set()
    return {str(e.get("pool", "")) if isinstance(e, dict) else str(getattr(e, "pool", "")) for e in errors}


def shown_pools(stages: Any) -> set[str]:
    """The pool kinds a report shows: each kind some stage holds a buffer of, needs one for, or
    has an error about.  A kind of the family that no layer of the model uses (gpt-oss's plain-MHA
    ``kv`` beside its SWA and full sub-pools) would be an empty 0/0 row on every stage of ``check``,
    the dashboard and the metrics; a kind one stage has and another lacks (a Nemotron-H stage
    without attention) stays, 0/0 where it is empty.  Malformed stages add nothing (the model's
    validation names them)."""
    shown: set[str] = set()
    for s in stages:
        shown |= {p for p, n in _field(s, "buffers").items() if n}
        shown |= {p for p, n in _field(s, "expected_buffers").items() if n}
        shown |= _error_pools(s)
    return shown


def _trimmed(stage: Any, shown: set[str]) -> Any:
    """A stage (report or its JSON) with only the ``shown`` pool kinds in its per-pool fields."""
    if isinstance(stage, dict):
        return {**stage, **{f: {p: v for p, v in stage[f].items() if p in shown}
                            for f in (*_POOL_FIELDS, "expected") if isinstance(stage.get(f), dict)}}
    if not isinstance(stage, StageReport):
        return stage
    update = {("expected" if f == "expected_buffers" else f): {p: v for p, v in _field(stage, f).items() if p in shown}
              for f in _POOL_FIELDS}
    return stage.model_copy(update=update)


class StageReport(StageLayerMap):
    """One stage at startup: its layer map, its pools against its layers, and every error."""

    layers: tuple[AnyLayerEntry, ...] = Field(  # type: ignore[assignment]
        description="every layer of the stage, in local order, with its family's fields")
    buffers: dict[str, int] = Field(description="per pool kind, the buffers the pool holds (None ones "
                                    "included)")
    expected: dict[str, int] = Field(alias="expected_buffers",
                                     description="per pool kind, the buffers its local layers need")
    pool_page_bytes: dict[str, int] = Field(
        default_factory=dict, description="per pool kind, one page (a request slot) over every present "
        "buffer: planned by check, measured on the real tensors by serve and the sglang plugin")
    device_bytes: dict[str, int] = Field(default_factory=dict,
                                         description="per pool kind, the device bytes of its buffers")
    host_buffers: dict[str, int] = Field(
        default_factory=dict, description="per pool kind, the buffers the host (HiCache) mirror holds")
    host_bytes: dict[str, int] = Field(default_factory=dict,
                                       description="per pool kind, the host mirror's bytes")
    ok: bool = Field(description="no error names this stage")
    errors: tuple[MappingError, ...]

    @model_validator(mode="before")
    @classmethod
    def _ok(cls, data: Any) -> Any:
        return _with_ok(data)


class StartupReport(BaseModel):
    """The whole deployment at startup (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    ok: bool = Field(description="every stage validated and no cross-stage error")
    family: str = Field(DEFAULT_FAMILY, description="the model family (deepseek_v4, ...)")
    model: str
    num_layers: int
    pp_size: int
    tp_size: int
    page_size: int
    faults: tuple[str, ...] = Field((), description="the faults planted (--fault)")
    stages: tuple[StageReport, ...]
    cross_errors: tuple[MappingError, ...] = Field(
        alias="errors", description="cross-stage errors (partition tiling, deployment mismatches)")

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, data: Any) -> Any:
        """Each stage's pool kinds come from the family (they are not in the JSON); every stage
        keeps the pool kinds the report shows (``shown_pools``), built or parsed alike."""
        if isinstance(data, dict) and any(isinstance(s, dict) for s in data.get("stages", ())):
            kinds = family_named(data.get("family", DEFAULT_FAMILY)).pool_kinds
            data = {**data, "stages": [{**s, "kinds": kinds} if isinstance(s, dict) else s
                                       for s in data["stages"]]}
        if isinstance(data, dict) and isinstance(data.get("stages"), list | tuple) and data["stages"]:
            shown = shown_pools(data["stages"])
            data = {**data, "stages": [_trimmed(s, shown) for s in data["stages"]]}
        return _with_ok(data)

    @property
    def all_errors(self) -> list[MappingError]:
        return [e for s in self.stages for e in s.errors] + list(self.cross_errors)

    def stage(self, stage: int) -> StageReport | None:
        return next((s for s in self.stages if s.stage == stage), None)

    def to_dict(self) -> dict[str, Any]:
        """``stagecache check --json``."""
        return self.model_dump(mode="json", by_alias=True)

    @classmethod
    def parse(cls, raw: Any, where: str) -> StartupReport:
        """A saved report (``check --json``) read back; one ``ConfigError`` line naming the first
        wrong fields otherwise."""
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
                for err in exc.errors()[:5])
            more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
            raise ConfigError(f"{where}: not a startup report: {problems}{more} (expected "
                              "`stagecache check --json` output)") from None
        except ConfigError as exc:  # an unknown family
            raise ConfigError(f"{where}: {exc}") from None
