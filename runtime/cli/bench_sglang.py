"""``stagecache bench sglang-hooks``: flags of the sglang hook-cost benchmark (runtime/bench/sglang_hooks.py)."""

from __future__ import annotations

import argparse
import json

from ..bench.sglang_hooks import FAMILIES  # sglang itself loads only when the bench runs
from ..errors import ConfigError
from .common import int_range


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sglang-hooks", help="what the sglang deployment hooks cost sglang's own match/insert/backup/load "
        "work (needs sglang; JSON with the ratio)")
    p.add_argument("--sessions", type=int_range(1, 4096), default=32, help="chat sessions (default 32)")
    p.add_argument("--turns", type=int_range(1, 256), default=8, help="turns per session (default 8)")
    p.add_argument("--rounds", type=int_range(1, 1000), default=7, help="timed rounds per arm (default 7)")
    p.add_argument("--family", choices=(*FAMILIES, "all"), default="all",
                   help="the family whose stage is measured: deepseek_v4 (DeepSeek-V4-Flash), linear_hybrid "
                        "(qwen3.5-0.8b), dsa (deepseek-v3.2), swa_hybrid (gpt-oss-20b), or all (default)")
    p.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"stagecache bench sglang-hooks needs sglang: pip install '.[sglang]' in a "
                          f"stagecache checkout (import failed: {exc})") from None
    from ..bench.sglang_hooks import run_families

    families = FAMILIES if args.family == "all" else (args.family,)
    report = run_families(families, args.sessions, args.turns, args.rounds)
    print(json.dumps(report, indent=2))
    return 0 if report["meets_target"] else 1
