"""Link probes of ``bench transfer --probes``: how close *any* copy of scattered pages gets to
the contiguous ceiling, measured on the same pages as stagecache and the peers.

A row's ``vs_ceiling`` alone cannot say whether a shortfall is stagecache's or the link's: a
copy engine moves one contiguous block at full rate, while scattered pages are moved by the
SMs or by one copy-engine operation each.  So three probes time the same pages: two
hand-written CUDA kernels built from different load paths, and the copy engines' own API for
many scattered copies:

* ``probe_cuda_vector`` -- one warp per 8 KiB chunk, 16-byte streaming loads and stores,
  eight in flight per lane (the widest plain load/store path);
* ``probe_tma_bulk``    -- 1-D TMA bulk copies (``cp.async.bulk``, Hopper and later) through
  a four-stage shared-memory ring per block: the copy hardware inside each SM, not the load
  path of the threads;
* ``probe_ce_batch``    -- every (buffer, page) copy of the move in one
  ``cudaMemcpyBatchAsync`` (CUDA 12.8+): the copy engines, handed the whole batch at once
  rather than one ``cudaMemcpyAsync`` per page as the per-page loop peer does.

If none beats stagecache's fraction of the ceiling at a grid point, the shortfall there is
the link's for this access pattern.  They are probes, not peers: no engine ships them, and
they do not enter ``best_peer``.  The kernels need CUDA and NVRTC (through torch); when those
are missing, ``unavailable`` says why and the report carries no probe times.  The batch probe
runs where the CUDA runtime has the batch call.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from ..transfer import cudart
from .transfer_peers import Technique


@dataclass(frozen=True)
class Probe:
    """One probe kernel: its launch shape and what it is (the report's ``techniques`` note)."""

    note: str
    blocks_per_sm: int  # the bulk kernel's blocks hold 32 KiB of shared memory each
    threads: int  # per block


#: The probe kernels of ``SOURCE``, by kernel name (= the technique's key in a report).
PROBES = {
    "probe_cuda_vector": Probe("CUDA probe: one warp per 8 KiB chunk, 16-byte streaming loads/stores, "
                               "8 in flight per lane", 16, 128),
    "probe_tma_bulk": Probe("CUDA probe: 1-D TMA bulk copies (cp.async.bulk) through a 4-stage "
                            "shared-memory ring", 6, 32),
}
#: The copy-engine probe (``ce_batch``): not a kernel, so not in ``PROBES``.
CE_BATCH = "probe_ce_batch"
CE_BATCH_NOTE = "copy-engine probe: every (buffer, page) copy of a move in one cudaMemcpyBatchAsync"
#: Every probe's key in a report row.
KEYS = (*PROBES, CE_BATCH)
#: Bytes of one probe work item: a page is cut into chunks of at most this much.
CHUNK = 8192

SOURCE = r"""
#define CH 8192
#define STAGES 4
#define UNROLL 8
typedef unsigned long long u64;

/* one warp per chunk: 16-byte streaming loads, UNROLL in flight per lane, then the stores */
extern "C" __global__ void probe_cuda_vector(const u64* __restrict__ src, const u64* __restrict__ dst,
                                             const unsigned* __restrict__ bytes, int chunks)
{
    const int lane = threadIdx.x & 31;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int c = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; c < chunks; c += warps) {
        const uint4* s = (const uint4*)src[c];
        uint4* d = (uint4*)dst[c];
        const int vecs = bytes[c] >> 4;
        int v = lane;
        for (; v + 32 * (UNROLL - 1) < vecs; v += 32 * UNROLL) {
            uint4 r[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) r[u] = __ldcs(s + v + 32 * u);
#pragma unroll
            for (int u = 0; u < UNROLL; u++) __stcs(d + v + 32 * u, r[u]);
        }
        for (; v < vecs; v += 32) __stcs(d + v, __ldcs(s + v));
    }
}

__device__ __forceinline__ void bulk_load(unsigned buf, unsigned bar, u64 src, unsigned n)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(n) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(buf), "l"(src), "r"(n), "r"(bar) : "memory");
}

/* one thread per block drives a ring of STAGES shared buffers: bulk load chunk j into a
   buffer, wait for its bytes, bulk store it, reuse the buffer for chunk j + STAGES */
extern "C" __global__ void probe_tma_bulk(const u64* __restrict__ src, const u64* __restrict__ dst,
                                          const unsigned* __restrict__ bytes, int chunks)
{
    __shared__ __align__(128) unsigned char ring[STAGES][CH];
    __shared__ __align__(8) u64 bars[STAGES];
    if (threadIdx.x != 0) return;
    unsigned buf[STAGES], bar[STAGES];
    for (int s = 0; s < STAGES; s++) {
        buf[s] = (unsigned)__cvta_generic_to_shared(&ring[s][0]);
        bar[s] = (unsigned)__cvta_generic_to_shared(&bars[s]);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar[s]) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const int step = gridDim.x;
    for (int s = 0; s < STAGES; s++) {
        int c = blockIdx.x + s * step;
        if (c < chunks) bulk_load(buf[s], bar[s], src[c], bytes[c]);
    }
    for (int j = 0;; j++) {
        int c = blockIdx.x + j * step;
        if (c >= chunks) break;
        int s = j % STAGES;
        asm volatile("{\n .reg .pred p;\n W_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                     " @!p bra W_%=;\n}" :: "r"(bar[s]), "r"((unsigned)((j / STAGES) & 1)) : "memory");
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(dst[c]), "r"(buf[s]), "r"(bytes[c]) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        int next = c + STAGES * step;
        if (next < chunks) {
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            bulk_load(buf[s], bar[s], src[next], bytes[next]);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""

_BUILT: dict[str, Any] = {}


def unavailable(device: Any) -> str | None:
    """Why the probes cannot run on ``device`` (None: they can)."""
    import torch

    if getattr(device, "type", str(device)) != "cuda":
        return "the probes are CUDA kernels: they need a CUDA device"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no NVRTC kernel compiler (torch.cuda._compile_kernel)"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "the TMA bulk probe needs compute capability 9.0 or newer"
    return None


def _kernels() -> dict[str, Any]:
    """Both probe kernels, compiled once per process."""
    import torch

    if not _BUILT:
        for name in PROBES:
            _BUILT[name] = torch.cuda._compile_kernel(SOURCE, name)
    return _BUILT


def page_addresses(buffers: list[tuple[Any, Any]], dev_ids: list[int], host_ids: list[int]
                   ) -> list[tuple[int, int, int]]:
    """(device address, host address, bytes) of every moved page of every buffer, buffer by
    buffer (``(device buffer, host buffer)`` pairs of ``[pages, page bytes]`` uint8 tensors)."""
    return [(d.data_ptr() + a * d.stride(0), h.data_ptr() + b * h.stride(0), int(d.shape[1]))
            for d, h in buffers for a, b in zip(dev_ids, host_ids, strict=True)]


def chunk_table(buffers: list[tuple[Any, Any]], dev_ids: list[int], host_ids: list[int]
                ) -> tuple[list[int], list[int], list[int]] | None:
    """(device addresses, host addresses, bytes) of every chunk of every moved page of every
    buffer (``page_addresses`` cut into ``CHUNK``s); None when an address or a page size is not
    a multiple of 16 bytes (what both kernels need)."""
    for d, h in buffers:
        if d.shape[1] % 16 or d.data_ptr() % 16 or h.data_ptr() % 16 or d.stride(0) % 16 or h.stride(0) % 16:
            return None
    dev_addr: list[int] = []
    host_addr: list[int] = []
    sizes: list[int] = []
    for da, ha, page in page_addresses(buffers, dev_ids, host_ids):
        for off in range(0, page, CHUNK):
            dev_addr.append(da + off)
            host_addr.append(ha + off)
            sizes.append(min(CHUNK, page - off))
    return dev_addr, host_addr, sizes


def probes(buffers: list[tuple[Any, Any]], dev_ids: list[int], host_ids: list[int]) -> list[Technique]:
    """One ``Technique`` per probe over the same pages, or none (see ``unavailable``)."""
    if not buffers or unavailable(buffers[0][0].device) is not None:
        return []
    batch = ce_batch(buffers, dev_ids, host_ids)
    return _kernel_probes(buffers, dev_ids, host_ids) + ([batch] if batch is not None else [])


def _kernel_probes(buffers: list[tuple[Any, Any]], dev_ids: list[int], host_ids: list[int]) -> list[Technique]:
    import torch

    table = chunk_table(buffers, dev_ids, host_ids)
    if table is None:
        return []
    device = buffers[0][0].device
    dev_t, host_t = (torch.tensor(v, dtype=torch.int64, device=device) for v in table[:2])
    sizes = torch.tensor(table[2], dtype=torch.int32, device=device)
    chunks = len(table[2])
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = []
    for name, kernel in _kernels().items():
        probe = PROBES[name]
        grid = (min(chunks, sms * probe.blocks_per_sm), 1, 1)
        block = (probe.threads, 1, 1)

        def run(d2h: bool, kernel: Any = kernel, grid: tuple[int, int, int] = grid,
                block: tuple[int, int, int] = block) -> None:
            src, dst = (dev_t, host_t) if d2h else (host_t, dev_t)
            kernel(grid=grid, block=block, args=[src, dst, sizes, chunks])

        out.append(Technique(name, run, probe.note))
    return out


class _Location(ctypes.Structure):
    """``cudaMemLocation``: where a batch's sources or destinations live (a hint)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CopyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes``: source access order, location hints, flags."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_hint", _Location), ("dst_hint", _Location),
                ("flags", ctypes.c_uint)]


_ACCESS_ORDER_STREAM, _DEVICE, _HOST = 1, 1, 2  # cudaMemcpySrcAccessOrderStream, cudaMemLocationType*


def _batch_call() -> tuple[Any, bool] | None:
    """The runtime's ``cudaMemcpyBatchAsync`` and whether it takes a failure-index argument
    (12.8-12.9 do, 13.0 dropped it); None where the runtime has no batch call."""
    rt = cudart.runtime()
    fn = getattr(rt.lib, "cudaMemcpyBatchAsync", None) if rt is not None and rt.version >= 12080 else None
    if fn is None:
        return None
    vp, size = ctypes.c_void_p, ctypes.c_size_t
    with_fail_index = rt.version < 13000
    fn.argtypes = [vp, vp, vp, size, vp, vp, size] + ([vp] if with_fail_index else []) + [vp]
    fn.restype = ctypes.c_int
    return fn, with_fail_index


def ce_batch(buffers: list[tuple[Any, Any]], dev_ids: list[int], host_ids: list[int]) -> Technique | None:
    """Every (buffer, page) copy in one ``cudaMemcpyBatchAsync`` on a side stream ordered after
    and before the caller's (the call refuses the legacy default stream); None without the call."""
    import numpy as np
    import torch

    call = _batch_call()
    if call is None:
        return None
    fn, with_fail_index = call
    dev_a, host_a, size_a = np.array(page_addresses(buffers, dev_ids, host_ids), dtype=np.uint64).T.copy()
    attrs = {d2h: _CopyAttributes(_ACCESS_ORDER_STREAM, _Location(_DEVICE if d2h else _HOST, 0),
                                  _Location(_HOST if d2h else _DEVICE, 0), 0) for d2h in (True, False)}
    first = np.zeros(1, dtype=np.uint64)  # one attribute set, from the first copy on
    fail = ctypes.c_size_t()
    device = buffers[0][0].device
    side = torch.cuda.Stream(device)

    def run(d2h: bool) -> None:
        dst, src = (host_a, dev_a) if d2h else (dev_a, host_a)
        caller = torch.cuda.current_stream(device)
        side.wait_stream(caller)
        args = [dst.ctypes.data, src.ctypes.data, size_a.ctypes.data, len(size_a), ctypes.addressof(attrs[d2h]),
                first.ctypes.data, 1] + ([ctypes.addressof(fail)] if with_fail_index else []) + [side.cuda_stream]
        bad = fn(*args)
        if bad:
            raise RuntimeError(f"cudaMemcpyBatchAsync of {len(size_a)} copies failed: CUDA error {bad}")
        caller.wait_stream(side)

    return Technique(CE_BATCH, run, CE_BATCH_NOTE)
