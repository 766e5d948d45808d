"""Before a stage serves from L3: the store must be this deployment's, and the stage's keys its own.

Two objects make the check (keys in ``keys.py``):

* the **manifest** (one per store): the deployment's fingerprint.  A store that holds another
  deployment's manifest -- another model, dtype, page size, partition, PP or TP size -- is
  refused, naming both fingerprints and how they differ, unless ``--l3-reset`` clears it first;
* the **probe** (one per stage): the stage writes its identity under its own key space; after
  every stage has written (a barrier), each reads its probe back.  Another stage's identity there
  means two stages write the same keys: refused, naming both.

Both are written and read back through the store's own calls, so a stage that cannot use the
store at all finds out here, not on its first request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .base import L3Store, Outcome, StoreUnavailable
from .keys import MANIFEST_KEY, KeySpace


@dataclass(frozen=True)
class Identity:
    """What a stage's probe says: whose it is (``run``: one serve run or process)."""

    run: str
    pp_rank: int
    tp_rank: int
    start: int
    end: int

    @classmethod
    def of(cls, space: KeySpace, run: str) -> Identity:
        return cls(run, space.pp_rank, space.tp_rank, space.start, space.end)

    def describe(self) -> str:
        return f"stage {self.pp_rank} (layers [{self.start}, {self.end}), tp rank {self.tp_rank}, run {self.run})"


def _manifest(fingerprint: dict) -> bytes:
    return json.dumps({"fingerprint": fingerprint}, sort_keys=True).encode()


def _describe_fp(fp: dict) -> str:
    part = ",".join(str(x) for x in fp.get("partition", []))
    return (f"{fp.get('model', '?')} digest {fp.get('digest', '?')} (kv dtype {fp.get('kv_dtype')}, page "
            f"size {fp.get('page_size')}, partition {part}, pp {fp.get('pp_size')}, tp {fp.get('tp_size')})")


def check_manifest(store: L3Store, fingerprint: dict, where: str) -> str | None:
    """Write the manifest if the store has none; an error line when it holds another deployment's."""
    try:
        raw = store.get(MANIFEST_KEY)
        if raw is None:
            if store.set(MANIFEST_KEY, _manifest(fingerprint)) is not Outcome.OK:
                return f"L3 {where}: cannot write the manifest"
            raw = store.get(MANIFEST_KEY)
    except StoreUnavailable as exc:
        return f"L3 {where}: {exc}"
    try:
        theirs = json.loads(raw or b"{}").get("fingerprint", {})
    except ValueError:
        theirs = {}
    if theirs.get("digest") == fingerprint["digest"]:
        return None
    diff = [f"{k}: {theirs.get(k)!r} != {v!r}" for k, v in fingerprint.items()
            if k not in ("digest", "model") and theirs.get(k) != v]
    return (f"L3 {where} holds another deployment's data: {_describe_fp(theirs)}; this run is "
            f"{_describe_fp(fingerprint)} (differs in {'; '.join(diff) or 'the digest'}); start with "
            "--l3-reset to clear it, or give this deployment its own store")


def write_probe(store: L3Store, space: KeySpace, run: str) -> str | None:
    ident = Identity.of(space, run)
    try:
        ok = store.set(space.probe_key, json.dumps(ident.__dict__, sort_keys=True).encode())
        ok2 = store.set(space.manifest_key, json.dumps({"stage": ident.__dict__,
                                                        "digest": space.digest}).encode())
    except StoreUnavailable as exc:
        return f"L3 {space.describe()}: cannot write its probe: {exc}"
    if ok is not Outcome.OK or ok2 is not Outcome.OK:
        return f"L3 {space.describe()}: cannot write its probe ({ok.name.lower()})"
    return None


def check_probe(store: L3Store, space: KeySpace, run: str) -> str | None:
    """Read the stage's probe back: its own identity, or an error naming the stage that overwrote it."""
    mine = Identity.of(space, run)
    try:
        raw = store.get(space.probe_key)
    except StoreUnavailable as exc:
        return f"L3 {space.describe()}: cannot read its probe back: {exc}"
    if raw is None:
        return f"L3 {space.describe()}: its probe was written but reads back missing"
    try:
        got = Identity(**json.loads(raw))
    except (ValueError, TypeError):
        return f"L3 {space.describe()}: its probe reads back corrupt"
    if got != mine:
        return (f"L3 key spaces overlap: {mine.describe()} and {got.describe()} write the same keys "
                f"({space.prefix}.*); each stage needs its own key space")
    return None
