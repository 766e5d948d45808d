"""One real sglang 0.5.23 PP rank as a process of its own (``python sglang_rank_proc.py ...``).

The two-host tests start each rank inside a host's network namespace (``ip netns exec``),
where a forked child of the test process cannot go, and with libfaketime preloaded on host B.
The rank does what ``sglang_ranks._rank_main`` does -- sglang's distributed state over gloo
(rendezvous at ``--master``), ``ServerArgs(pp_size=N, device="cpu")``, sglang's own
``load_plugins()``, the real flash pool sized from a byte budget and the real
``build_deepseek_v4_hicache_stack`` (the record exchange runs inside) -- then prints one JSON
line (``{"rank", "built", "pid", "url"}``) and stays up until SIGTERM.  With ``--traffic`` it
matches a new request through sglang's hooked ``UnifiedRadixCache.match_prefix`` every 0.5 s,
so the deployment's counters grow while the test cuts links.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback


def _traffic(stop: threading.Event) -> None:
    from array import array
    from types import SimpleNamespace

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    result = MatchResult(device_prefix_len=256, last_device_node=None, last_host_node=None,
                         best_match_node=None, host_hit_length=256)
    cache = SimpleNamespace(session=SimpleNamespace(try_match_prefix=lambda params: result))
    n = 0
    while not stop.wait(0.5):
        n += 1
        params = MatchPrefixParams(key=RadixKey(array("l", range(1024))), req=SimpleNamespace(rid=f"r{n}"))
        UnifiedRadixCache.match_prefix(cache, params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--master", required=True, help="HOST:PORT of the torch.distributed rendezvous")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--budget", type=int, default=48 << 20)
    ap.add_argument("--traffic", action="store_true")
    args = ap.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    out: dict = {"rank": args.rank, "pid": os.getpid()}
    try:
        import torch
        from sglang.srt.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )
        from sglang.srt.plugins import load_plugins
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import ServerArgs
        from sglang_ranks import _build
        from sglang_real import on_cpu

        torch.set_num_threads(1)
        sa = ServerArgs(model_path=args.model_dir, tp_size=1, pp_size=args.pp, device="cpu",
                        enable_hierarchical_cache=True, max_running_requests=4, hicache_io_backend="direct",
                        hicache_mem_layout="layer_first")
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=args.rank))
        init_distributed_environment(world_size=args.pp, rank=args.rank, distributed_init_method=f"tcp://{args.master}",
                                     local_rank=args.rank, backend="gloo", timeout=60)
        initialize_model_parallel(backend="gloo")
        load_plugins()
        cpu = on_cpu()
        cpu.__enter__()  # for the rank's whole life
        from stagecache.runtime.integrations.sglang import deployment

        dep = deployment._PLUGIN
        _build(args.rank, args.pp, args.budget)
        out.update(built=True, url=dep.url if dep else None,
                   pushes_to=dep.pusher.url if dep and dep.pusher else None)
    except BaseException:  # noqa: BLE001 - reported on stdout, the test fails on it
        out["crash"] = traceback.format_exc()[-3000:]
    print(json.dumps(out), flush=True)
    if "crash" in out:
        os._exit(1)
    if args.traffic:
        threading.Thread(target=_traffic, args=(stop,), daemon=True).start()
    while not stop.wait(0.5):
        pass
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
