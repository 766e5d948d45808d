"""Real sglang PP ranks on CPU: N processes with sglang's own distributed state over gloo.

Each rank is a process forked from the test process (sglang is imported once, there), which

1. publishes a resolved ``ServerArgs(pp_size=N, device="cpu")`` with its ``SpawnRanks``;
2. runs sglang's ``init_distributed_environment(backend="gloo")`` and
   ``initialize_model_parallel(backend="gloo")`` (``SGLANG_NCCL_SO_PATH`` points at a missing
   file so pynccl stays off);
3. runs sglang's own ``load_plugins()`` -- the stagecache entry point registers its hooks,
   sglang applies them;
4. sizes its pool from a byte budget with sglang's ``KVCacheConfigurator.config_from_budget``
   (whose ``_apply_token_constraints`` MIN-reduces the capacity over the ranks), builds it with
   ``_init_pools`` and calls the real ``build_deepseek_v4_hicache_stack`` (the record exchange
   runs inside, as in ``Scheduler.__init__``), with sglang's real ``HybridCacheController``
   (``on_cpu``: no page pinning, copies in torch, ``hicache_io_backend="direct"``);
5. runs the case's ``after(rank, ctx)`` and puts its JSON result on a queue.

Every wait is bounded; a rank that hangs is killed when the launch times out.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import queue
import random
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sglang_real import cache_params, kv_cache_configurator, on_cpu

FLASH_BUDGET = 48 << 20  # bytes of KV per rank: a few thousand tokens of flash, cheap on CPU


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port below the kernel's ephemeral range.  A port the kernel hands out for port 0
    can be handed out again before the test binds it, and N ranks of gloo open many ephemeral
    connections: the deployment's port would then be taken (uvicorn exits 3, seen once in pp 8)."""
    high = _ephemeral_floor() - 1
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(max(1024, high - 12_000), high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {high + 1} after 200 tries")


@dataclass
class Launch:
    """One deployment of ``pp`` ranks and what each rank's process returned."""

    pp: int
    results: dict[int, Any] = field(default_factory=dict)
    exit_codes: dict[int, int | None] = field(default_factory=dict)


def _build(rank: int, pp: int, budget: int) -> tuple[Any, Any]:
    """sglang's sizing from a budget (with the PP MIN) and pool construction, then the stack."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import get_pp_group
    from sglang.srt.distributed.utils import get_pp_indices
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_server_args

    sa = get_server_args()
    mc = ModelConfig.from_server_args(sa)
    start, end = get_pp_indices(mc.num_hidden_layers, rank, pp)
    kvc = kv_cache_configurator(sa, mc, rank, pp, get_pp_group(), device="cpu")
    config = kvc.config_from_budget(budget)  # -> _apply_token_constraints: MIN over the ranks
    config.max_running_requests = kvc.resolve_max_num_reqs(config.max_total_num_tokens)
    config = create_memory_pool_configurator(kvc).finalize_with_max_running_requests(config)
    pools = kvc._init_pools(sizes=kvc._derive_pool_sizes(config=config), req_to_token_pool=None,
                            token_to_kv_pool_allocator=None)

    if os.environ.get("STAGECACHE_TEST_FAULT") == "missing-c4-state":  # the seed's fault
        kv = pools.token_to_kv_pool
        kv.compress_state_pools[max(g for g in range(start, end) if kv.compression_ratios[g] == 4)] = None

    class _Stage:
        kvcache = pools.token_to_kv_pool
        allocator = pools.token_to_kv_pool_allocator
        req_to_token_pool = pools.req_to_token_pool

    if not sa.enable_hierarchical_cache:
        return pools, None
    if os.environ.get("STAGECACHE_TEST_SKIP_BUILD") == "1":  # a rank that never reaches the stack build
        raise TimeoutError("this rank skipped the stack build")
    return pools, hpa.build_deepseek_v4_hicache_stack(
        params=cache_params(_Stage), kvcache=_Stage.kvcache, load_cache_event=None, storage_backend=None)


#: What sglang keeps of the host's RAM out of its HiCache pools here (its own: 10 GiB).  These
#: ranks' host pools are tens of MB; on a shared 23 GiB test machine whose other jobs left less
#: than 10 GiB available, sglang refused them (``Not enough host memory for V4 paged pool swa.
#: Requesting 0.02 GB but only have -0.02 GB free``) and a case failed for the machine's sake.
TEST_HOST_RESERVE_BYTES = 1 << 30


def _small_host_reserve() -> None:
    try:
        from sglang.srt.mem_cache.pool_host import base
    except ImportError:  # a release without it
        return
    if hasattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES"):
        base.HICACHE_HOST_MEMORY_RESERVE_BYTES = TEST_HOST_RESERVE_BYTES


def _rank_main(rank: int, pp: int, dist_port: int, folder: str, env: dict[str, str], server: dict[str, Any],
               budget: int, after: Callable[[int, dict[str, Any]], Any] | None, out: Any, done: Any,
               build: Callable[[int, int, int], tuple[Any, Any]] = _build) -> None:
    os.environ.update(env)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank can be asked where it is
    result: dict[str, Any] = {"rank": rank}
    try:
        from sglang.srt.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )
        from sglang.srt.plugins import load_plugins
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import ServerArgs

        torch.set_num_threads(1)
        if os.environ.get("STAGECACHE_TEST_PAGE_SIZE"):  # a rank started with another --page-size
            server = {**server, "page_size": int(os.environ["STAGECACHE_TEST_PAGE_SIZE"])}
        if os.environ.get("STAGECACHE_TEST_HICACHE_RATIO"):  # a rank whose host pool is another size
            server = {**server, "hicache_ratio": float(os.environ["STAGECACHE_TEST_HICACHE_RATIO"])}
        sa = ServerArgs(model_path=folder, tp_size=1, pp_size=pp, device="cpu", **server)
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank))
        init_distributed_environment(world_size=pp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{dist_port}",
                                     local_rank=rank, backend="gloo",
                                     timeout=int(os.environ.get("STAGECACHE_TEST_GLOO_TIMEOUT_S", "60")))
        initialize_model_parallel(backend="gloo")
        load_plugins()  # sglang's own: the stagecache entry point registers, sglang applies
        cpu = on_cpu()
        cpu.__enter__()  # for the rank's whole life, which ends in os._exit (keep the reference)
        _small_host_reserve()
        from stagecache.runtime.integrations.sglang import deployment

        ctx: dict[str, Any] = {"deployment": deployment._PLUGIN}
        try:
            ctx["pools"], ctx["stack"] = build(rank, pp, budget)
            result["built"] = True
        except Exception as exc:  # the case decides whether this is expected
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["error_at"] = traceback.format_exc()[-3000:]
        if after is not None:
            result.update(after(rank, ctx) or {})
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        result["crash"] = traceback.format_exc()[-3000:]
    out.put(json.dumps(result, default=str))
    out.close()
    out.join_thread()  # the queue's feeder thread must flush before os._exit
    if rank != 0:  # keep serving/pushing until rank 0 is done looking
        end = time.monotonic() + 60
        while not done.value and time.monotonic() < end:
            time.sleep(0.05)
    else:
        done.value = 1
    os._exit(0)


#: What every rank imports after its fork -- sglang's server-args resolution hooks and what
#: they pull in, the modules its model-parallel set-up imports lazily, and the plugin's dashboard
#: and exporters -- imported once in the test process instead (``_warm``), so that each fork
#: inherits them (the families suite took 79 CPU seconds with the imports in every rank, 55 with
#: them here).  Only module imports: no sglang state is set.  A module a release lacks is passed.
WARM_MODULES = (
    "sglang.srt.model_loader", "sglang.srt.layers.sampler", "sglang.srt.layers.logits_processor",
    "sglang.srt.layers.layer_boundary", "sglang.srt.model_executor.model_runner_components.load_model_utils",
    "sglang.srt.models.gpt_oss", "sglang.kernels.ops.attention.fla.chunk_delta_h",
    *(f"sglang.srt.distributed.device_communicators.{m}" for m in (
        "custom_all_reduce", "pymscclpp", "torch_symm_mem", "shm_broadcast", "xpu_communicator",
        "hpu_communicator", "pcie_ipc_ar")),
    "sglang.srt.kernel_plugins.nvidia.binding", "sglang.srt.layers.attention.qsa.config",
    *(f"sglang.srt.mem_cache.{m}" for m in ("pool_host.dsa", "ple_state_pool", "mamba_checkpoint_pool")),
    *(f"transformers.models.{m}" for m in ("deepseek_v32.configuration_deepseek_v32",
                                           "qwen3_5.configuration_qwen3_5")),
    "stagecache.runtime.integrations.sglang.deployment", "stagecache.dashboard.server",
    "stagecache.exporters.metrics", "pydantic.v1", "httpx", "httpcore", "uvicorn.loops.asyncio",
    "uvicorn.lifespan.on", "uvicorn.protocols.websockets.auto")


def _warm() -> None:
    """Import WARM_MODULES and sglang's resolution hooks (every module of ``arg_groups``) here."""
    import importlib
    import pkgutil

    import sglang.srt.arg_groups as arg_groups

    for info in pkgutil.iter_modules(arg_groups.__path__, arg_groups.__name__ + "."):
        importlib.import_module(info.name)
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:  # a release without it: the ranks import what they need
            pass


def launch(tmp: Path, pp: int, *, env: dict[int, dict[str, str]] | None = None,
           common_env: dict[str, str] | None = None, server: dict[str, Any] | None = None,
           budget: int = FLASH_BUDGET, after: Callable[[int, dict[str, Any]], Any] | None = None,
           timeout: float = 150.0, preset: str | None = None,
           build: Callable[[int, int, int], tuple[Any, Any]] | None = None) -> Launch:
    """Run ``pp`` real sglang ranks (see the module docstring); each rank's result by rank.

    ``preset``/``build``: another model (a preset's config.json) and its pools' build (default:
    DeepSeek-V4-Flash and ``_build``; tests/support/sglang_family_ranks.py builds the others).

    A rank that dies without reporting (killed by the case) has no result; its exit code says how.
    """
    from sglang_real import model_dir

    folder = model_dir(tmp) if preset is None else model_dir(tmp, preset)
    _warm()
    ctx = mp.get_context("fork")
    # a flag, not an Event: Event.set() blocks forever once a waiter was SIGKILLed (case d)
    out, done = ctx.Queue(), ctx.RawValue("b", 0)
    port = free_port()
    base = {"SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2", "STAGECACHE_SGLANG": "1",
            **(common_env or {})}
    srv = {"enable_hierarchical_cache": True, "max_running_requests": 4, "hicache_io_backend": "direct",
           "hicache_mem_layout": "layer_first", **(server or {})}
    procs = {r: ctx.Process(target=_rank_main, daemon=True, args=(
        r, pp, port, str(folder), {**base, **(env or {}).get(r, {})}, srv, budget, after, out, done,
        build or _build))
        for r in range(pp)}
    for p in procs.values():
        p.start()
    run = Launch(pp)
    deadline = time.monotonic() + timeout
    try:
        while len(run.results) < pp and time.monotonic() < deadline:
            try:
                item = json.loads(out.get(timeout=0.5))
            except queue.Empty:
                if all(p.exitcode is not None for p in procs.values()):
                    break
                continue
            run.results[item["rank"]] = item
    finally:
        done.value = 1
        for p in procs.values():
            p.join(max(0.1, min(20.0, deadline - time.monotonic())))
            if p.exitcode is None:
                p.kill()
                p.join(5)
        run.exit_codes = {r: p.exitcode for r, p in procs.items()}
    return run
