"""``stagecache bench l3``: each L3 backend against the plain I/O beneath it, same run, same bytes.

* **file**: the store's batch calls against one plain sequential ``write`` / ``readinto`` of the
  same bytes into one file on the same disk; cold reads come from the disk in both (fsynced and
  dropped from the page cache first, untimed), warm reads from the page cache;
* **mooncake**: the store's calls against direct calls of the same client on the same registered
  buffers (a real ``mooncake_master`` on 127.0.0.1, started and stopped here).

The techniques run interleaved, ``rounds`` times with fresh keys and files, the median round
counting; every read is checked byte for byte.  docs/l3.md ("Speed") describes the figures.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..storage.file import FileStore, private_dir
from ..storage.segments import SEGMENT_SUFFIX

TARGETS = {"file": 0.8, "mooncake": 0.9}


def _pages(n: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (n, nbytes), generator=g, dtype=torch.uint8)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _settle() -> None:
    """Write back whatever is dirty before a timed write (untimed), so that neither technique
    pays for the other's writeback: each starts from the same state of the page cache."""
    os.sync()


def _drop_cache(paths: list[Path]) -> None:
    """Flush and forget the files' pages, so the next read comes from the disk (untimed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _row(name: str, base: list[float], store: list[float], nbytes: int) -> dict[str, Any]:
    """Medians, their ratio, and every round's figures (a shared machine's noise, shown as is)."""
    b, s = _gbps(nbytes, statistics.median(base)), _gbps(nbytes, statistics.median(store))
    paired = [bt / st for bt, st in zip(base, store, strict=True) if st > 0]
    return {"operation": name, "baseline_gbps": round(b, 3), "store_gbps": round(s, 3),
            "ratio": round(s / b, 3) if b else None,
            "round_ratio_median": round(statistics.median(paired), 3) if paired else None,
            "rounds_baseline_gbps": [round(_gbps(nbytes, t), 3) for t in base],
            "rounds_store_gbps": [round(_gbps(nbytes, t), 3) for t in store]}


def _plain_round(root: Path, src: torch.Tensor, dst: torch.Tensor) -> dict[str, float]:
    path = root / f"plain-{os.urandom(4).hex()}.bin"
    views = [memoryview(p.numpy()) for p in src]

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for v in views:
                os.write(fd, v)
        finally:
            os.close(fd)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            for p in dst:
                f.readinto(memoryview(p.numpy()))

    _settle()
    out = {"write": _timed(write)}
    _drop_cache([path])
    out["read_cold"] = _timed(read)
    out["read_warm"] = _timed(read)
    path.unlink()
    return out


def _store_round(root: Path, src: torch.Tensor, dst: torch.Tensor) -> dict[str, float]:
    store = FileStore(root / f"store-{os.urandom(4).hex()}")
    keys = [f"sc1.0123456789abcdef.t0.p0.L0-1.swa.{i:016x}" for i in range(len(src))]
    _settle()
    out = {"write": _timed(lambda: store.batch_set_from(keys, [[p] for p in src]))}
    store.close()  # the written segment is sealed, as after a batch that filled it
    _drop_cache(sorted(store.root.glob("*" + SEGMENT_SUFFIX)))
    for name in ("read_cold", "read_warm"):
        dst.zero_()
        out[name] = _timed(lambda: store.batch_get_into(keys, [[p] for p in dst]))
        if not torch.equal(dst, src):
            raise RuntimeError("bench l3: the file store read back other bytes than it wrote")
    store.reset()
    store.root.rmdir()
    return out


def bench_file(pages: int, page_bytes: int, rounds: int, directory: str | None) -> dict[str, Any]:
    src, dst = _pages(pages, page_bytes), torch.zeros(pages, page_bytes, dtype=torch.uint8)
    with tempfile.TemporaryDirectory(dir=directory, prefix="stagecache-bench-l3-") as tmp:
        root = private_dir(Path(tmp))
        _plain_round(root, src, dst)  # warm-up, untimed: the first touches of the buffers and
        _store_round(root, src, dst)  # of the page cache's free pages cost either one alone
        plain, store = [], []
        for r in range(rounds):  # which goes first alternates: neither always follows the other
            for run in ((_plain_round, _store_round) if r % 2 == 0 else (_store_round, _plain_round)):
                (plain if run is _plain_round else store).append(run(root, src, dst))
        nbytes = pages * page_bytes
        ops = ("write", "read_cold", "read_warm")
        rows = [_row(op, [r[op] for r in plain], [r[op] for r in store], nbytes) for op in ops]
        return {"backend": "file", "directory": str(Path(tmp).parent), "pages": pages,
                "page_bytes": page_bytes, "rounds": rounds, "rows": rows,
                "target": TARGETS["file"], "target_rows": ["write", "read_cold"],
                "meets_target": all(r["ratio"] >= TARGETS["file"] for r in rows
                                    if r["operation"] in ("write", "read_cold"))}


def _mooncake_rounds(store: Any, src: torch.Tensor, dst: torch.Tensor, rounds: int) -> dict[str, list]:
    client = store.client
    ptrs = [p.data_ptr() for p in src]
    dptrs = [p.data_ptr() for p in dst]
    sizes = [int(p.numel()) for p in src]
    times: dict[str, list] = {"direct_write": [], "store_write": [], "direct_read": [], "store_read": []}
    for r in range(rounds):
        dk = [f"direct.{r}.{i}" for i in range(len(src))]
        sk = [f"sc1.0123456789abcdef.t0.p0.L0-1.swa.{r:08x}{i:08x}" for i in range(len(src))]
        times["direct_write"].append(_timed(lambda dk=dk: client.batch_put_from(dk, ptrs, sizes)))
        times["store_write"].append(_timed(lambda sk=sk: store.batch_set_from(sk, [[p] for p in src])))
        for kind, read in (("direct_read", lambda dk=dk: client.batch_get_into(dk, dptrs, sizes)),
                           ("store_read", lambda sk=sk: store.batch_get_into(sk, [[p] for p in dst]))):
            dst.zero_()
            times[kind].append(_timed(read))
            if not torch.equal(dst, src):
                raise RuntimeError(f"bench l3: mooncake {kind} read back other bytes than were written")
        client.remove_by_regex(rf"^(direct\.{r}\.|sc1\.)", True)
    return times


def bench_mooncake(pages: int, page_bytes: int, rounds: int) -> dict[str, Any]:
    from ..storage.master import MooncakeMaster
    from ..storage.mooncake import MIN_SEGMENT_BYTES, MooncakeStore

    src, dst = _pages(pages, page_bytes), torch.zeros(pages, page_bytes, dtype=torch.uint8)
    with MooncakeMaster() as master, MooncakeStore(
            master.address, max(3 * pages * page_bytes, MIN_SEGMENT_BYTES)) as store:
        store.register([src, dst])
        _mooncake_rounds(store, src, dst, 1)  # warm-up: first touches of the segment
        t = _mooncake_rounds(store, src, dst, rounds)
    nbytes = pages * page_bytes
    rows = [_row("write", t["direct_write"], t["store_write"], nbytes),
            _row("read", t["direct_read"], t["store_read"], nbytes)]
    return {"backend": "mooncake", "transport": "tcp, 127.0.0.1, one client", "pages": pages,
            "page_bytes": page_bytes, "rounds": rounds, "rows": rows, "target": TARGETS["mooncake"],
            "target_rows": ["write", "read"],
            "meets_target": all(r["ratio"] >= TARGETS["mooncake"] for r in rows)}


def run_bench(backends: list[str], pages: int, page_mib: float, rounds: int,
              directory: str | None) -> dict[str, Any]:
    page_bytes = int(page_mib * (1 << 20))
    results = [bench_file(pages, page_bytes, rounds, directory) if b == "file"
               else bench_mooncake(pages, page_bytes, rounds) for b in backends]
    return {"page_bytes": page_bytes, "pages": pages, "results": results,
            "meets_targets": all(r["meets_target"] for r in results)}
