"""Deterministic KV bytes for a simulated forward pass, and the check that reads them back.

A cache bug (a page freed while still in the tree, a host page reloaded into the wrong node, a
pool indexed by the wrong layer) shows up as *wrong bytes* long before it shows up as a crash.
So every int64 word the simulated forward pass writes is ``base[pool] XOR seed(page key, global
layer, pool)``: two requests sharing a prefix produce identical pages (what makes a hit
*correct*), and any other prefix, page, layer or pool makes every word differ
(docs/hicache.md, "KV writer").  One XOR to write and one XOR and compare to check: cheap
enough for every request of a 10k-request replay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_M64 = (1 << 64) - 1


def page_hashes(tokens: Sequence[int] | np.ndarray, page_size: int, salt: int = 0) -> np.ndarray:
    """Chained 64-bit hash per page of ``tokens`` (a trailing partial page included).

    ``h[i]`` depends on every token of pages ``0..i`` and on the page's length,
    so it identifies "this page, after this exact prefix".
    """
    arr = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64))
    n = -(-len(arr) // page_size)
    out = np.empty(n, dtype=np.uint64)
    prev = salt.to_bytes(8, "little", signed=False)
    for i in range(n):
        chunk = arr[i * page_size:(i + 1) * page_size]
        prev = hashlib.blake2b(prev + chunk.tobytes(), digest_size=8).digest()
        out[i] = int.from_bytes(prev, "little")
    return out


def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class Mismatch:
    """One page of one buffer whose bytes are not what was written for it."""

    stage: int
    pool: str
    global_layer: int
    page_index: int  # token page of the request (0 = first page of the prompt)
    page_id: int  # page id in the verified pools (device or host)
    wrong_bytes: int
    where: str  # "device" or "host"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __str__(self) -> str:
        return (f"stage {self.stage} {self.where} {self.pool} layer {self.global_layer}: token page "
                f"{self.page_index} (page id {self.page_id}) has {self.wrong_bytes} wrong bytes")


class _PoolPlan:
    """Per pool kind: its layers (global ids), word count and the two expansion tables."""

    def __init__(self, pool: str, pool_idx: int, gids: list[int], page_bytes: int, seed: int,
                 device: torch.device):
        self.pool = pool
        self.gids = gids
        self.page_bytes = page_bytes
        self.words = -(-page_bytes // 8)
        self.aligned = page_bytes % 8 == 0
        g = torch.Generator().manual_seed((seed * 1_000_003 + pool_idx * 7919 + 17) & _M64 >> 1)
        lo, hi = -(2**63), 2**63 - 1
        self.base = torch.randint(lo, hi, (self.words,), generator=g, dtype=torch.int64).to(device)
        layer_ids = np.array(gids, dtype=np.uint64)
        self.layer_consts = _splitmix(layer_ids * np.uint64(0x100000001B3) + np.uint64(pool_idx + 1))


class KvWriter:
    """Writes and verifies the deterministic KV bytes of one stage's pools."""

    def __init__(self, pools: Any, seed: int = 0):
        self.pools = pools
        self.stage_map = pools.stage_map
        self.stage = pools.stage_map.stage
        self.page_size = pools.page_size
        self.seed = seed
        self.device = torch.device(getattr(pools, "device", "cpu"))
        self.plans: list[_PoolPlan] = []
        for idx, kind in enumerate(self.stage_map.kinds):
            gids = [e.global_id for e in self.stage_map.pool_layers(kind.name)]
            if not gids or not kind.host_cached or not kind.paged:  # per-request state: not addressed by page
                continue
            self.plans.append(_PoolPlan(kind.name, idx, gids, pools.page_bytes(kind.name), seed, self.device))

    def hashes(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        return page_hashes(tokens, self.page_size, self.seed)

    def expected(self, plan: _PoolPlan, hashes: np.ndarray, device: torch.device) -> torch.Tensor:
        """(layers, pages, words) int64: the content of these pages in every buffer of ``plan``."""
        seeds = _splitmix(hashes[None, :].astype(np.uint64) ^ plan.layer_consts[:, None])
        s = torch.from_numpy(seeds.view(np.int64)).to(device)
        return plan.base.to(device) ^ s[:, :, None]

    @staticmethod
    def _view(buf: torch.Tensor, plan: _PoolPlan) -> torch.Tensor:
        return buf.view(torch.int64) if plan.aligned else buf

    def write(self, hashes: np.ndarray, pages: Sequence[int], target: Any | None = None) -> int:
        """Fill ``pages`` (one id per hash) in every buffer of every pool; returns bytes written.

        ``target``: the pools to write (default: this stage's device pools; the ``HostPools``
        to write host pages, as a recompute of pages L3 could not give back does).
        """
        if len(hashes) != len(pages):
            raise ValueError(f"write: {len(hashes)} page hashes for {len(pages)} pages")
        if not len(pages):
            return 0
        target = self.pools if target is None else target
        dev = self.device if target is self.pools else torch.device("cpu")
        hashes = np.asarray(hashes, dtype=np.uint64)
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=dev)
        written = 0
        for plan in self.plans:
            if target is not self.pools and plan.pool not in target.kinds:
                continue
            data = self.expected(plan, hashes, dev)
            if not plan.aligned:
                data = data.view(torch.uint8)[..., :plan.page_bytes]
            for layer, gid in enumerate(plan.gids):
                buf = self._view(target.get_raw_buffer(plan.pool, gid), plan)
                buf[idx] = data[layer]
                written += len(pages) * plan.page_bytes
        return written

    def verify(self, hashes: np.ndarray, pages: Sequence[int], target: Any | None = None,
               page_offset: int = 0, where: str | None = None) -> list[Mismatch]:
        """Pages whose bytes differ from what ``write`` put there, in any pool or layer.

        ``target`` is the pools object to read (default: this stage's device
        pools; pass the ``HostPools`` to check the host copies).  ``page_offset``
        is the token page index of ``hashes[0]``, only used in the report.
        """
        if len(hashes) != len(pages):
            raise ValueError(f"verify: {len(hashes)} page hashes for {len(pages)} pages")
        if not len(pages):
            return []
        target = self.pools if target is None else target
        where = where or ("device" if target is self.pools else "host")
        tdev = torch.device(getattr(target, "device", "cpu")) if where == "device" else torch.device("cpu")
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=tdev)
        found: list[Mismatch] = []
        for plan in self.plans:
            want = self.expected(plan, hashes, tdev)
            if not plan.aligned:
                want = want.view(torch.uint8)[..., :plan.page_bytes]
            for layer, gid in enumerate(plan.gids):
                got = self._view(target.get_raw_buffer(plan.pool, gid), plan).index_select(0, idx)
                if torch.equal(got, want[layer]):
                    continue
                counts = (got.view(torch.uint8) != want[layer].view(torch.uint8)).sum(dim=1)
                for p in counts.nonzero().flatten().tolist():
                    found.append(Mismatch(self.stage, plan.pool, gid, page_offset + p,
                                          int(pages[p]), int(counts[p]), where))
        return found
