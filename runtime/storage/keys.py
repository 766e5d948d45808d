"""The one L3 key scheme: deployment, TP rank, stage, pool kind, page.

sglang 0.5.23 keys an L3 page by a chained hash of its token ids, which names neither the model
nor the stage; but each PP stage stores *different layers* under the same token prefix, so a key
without the stage lets one stage read another's bytes, and one without the layout lets a cache
written under one partition be read back under another.  Here a key is::

    sc1.<fingerprint digest>.t<tp rank>.p<pp rank>.L<start>-<end>.<pool kind>.<page key, 16 hex>

made of ``[A-Za-z0-9_-]`` fields split by dots, so it parses back unambiguously and is a safe
file name (docs/l3.md, "Keys").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..plan.plan import RunPlan

SCHEME = "sc1"
#: The store-wide manifest: which deployment (fingerprint) the store's keys belong to.
MANIFEST_KEY = f"{SCHEME}.manifest"
#: What a key may contain (a file name, a Mooncake key): checked on every key built or read.
KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")
_DIGEST_RE = re.compile(r"^[0-9a-f]{8,64}$")


@dataclass(frozen=True)
class KeySpace:
    """The keys one stage (of one TP rank of one deployment) reads and writes."""

    digest: str  # the deployment's fingerprint digest
    tp_rank: int
    pp_rank: int
    start: int  # the stage's global layer range [start, end)
    end: int

    def __post_init__(self) -> None:
        if not _DIGEST_RE.match(self.digest):
            raise ValueError(f"fingerprint digest {self.digest!r}: expected 8-64 hex digits")
        if self.tp_rank < 0 or self.pp_rank < 0 or not 0 <= self.start <= self.end:
            raise ValueError(f"key space: bad rank or layer range in {self}")

    @property
    def prefix(self) -> str:
        return f"{SCHEME}.{self.digest}.t{self.tp_rank}.p{self.pp_rank}.L{self.start}-{self.end}"

    def key(self, kind: str, page_key: int) -> str:
        return f"{self.prefix}.{kind}.{page_key & 0xFFFFFFFFFFFFFFFF:016x}"

    def keys(self, kind: str, page_keys: Iterable[int]) -> list[str]:
        head = f"{self.prefix}.{kind}."
        return [f"{head}{k & 0xFFFFFFFFFFFFFFFF:016x}" for k in page_keys]

    @property
    def probe_key(self) -> str:
        """Written and read back at startup: proves the stage can use the store."""
        return f"{self.prefix}.probe"

    @property
    def manifest_key(self) -> str:
        """The stage's own manifest: its fingerprint and layer range."""
        return f"{self.prefix}.manifest"

    def owns(self, key: str) -> bool:
        return key.startswith(self.prefix + ".")

    def describe(self) -> str:
        return (f"stage {self.pp_rank} (layers [{self.start}, {self.end}), tp rank {self.tp_rank}, "
                f"deployment {self.digest})")


def key_space(plan: RunPlan, stage: int, tp_rank: int = 0) -> KeySpace:
    """Stage ``stage``'s key space in ``plan``: the deployment's digest and the stage's layers."""
    m = plan.stage(stage).layer_map
    return KeySpace(plan.fingerprint.digest, tp_rank, stage, m.start, m.end)


def check_key(key: str) -> str:
    """``key`` if it is a valid L3 key (a safe file name), else ``ValueError``."""
    if not KEY_RE.match(key) or ".." in key:
        raise ValueError(f"L3 key {key[:80]!r}: expected 1-255 characters of [A-Za-z0-9_.-], "
                         "not starting with '.' or '-', without '..'")
    return key
