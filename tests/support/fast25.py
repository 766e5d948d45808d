"""The public Mooncake FAST'25 synthetic trace (tests/data/README.md), checked and unpacked."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

GZ = Path(__file__).resolve().parents[1] / "data" / "mooncake_fast25_synthetic_trace.jsonl.gz"
MD5 = "cf1d3a0f649d43500616e04eb8126260"
REQUESTS = 3993
BLOCK_TOKENS = 512


def fast25_text() -> bytes:
    """The trace's bytes, refused unless they are the published file's."""
    data = gzip.decompress(GZ.read_bytes())
    got = hashlib.md5(data).hexdigest()  # noqa: S324 - a checksum, not security
    if got != MD5:
        raise AssertionError(f"{GZ}: md5 {got}, expected {MD5} (the published file)")
    return data


def fast25_path(folder: Path) -> Path:
    """The trace unpacked into ``folder`` (a test's tmp_path): what a user passes to --trace."""
    path = folder / "synthetic_trace.jsonl"
    path.write_bytes(fast25_text())
    return path


def fast25_views(folder: Path):
    """Its page views at one block per page."""
    from stagecache.runtime.sizing.curves import page_views
    from stagecache.runtime.traces.readers import load_requests

    trace = load_requests(fast25_path(folder), fmt="mooncake", block_tokens=BLOCK_TOKENS)
    return page_views(trace.requests, BLOCK_TOKENS)
