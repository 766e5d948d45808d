"""Every default a user can see, in one place: the CLI's flags, serve, the benchmarks and the docs
read them here, so ``--help`` of every command shows the same value for the same flag.

Two groups:

* sglang 0.5.23's own DeepSeek-V4 defaults, which ``stagecache pools`` and the sglang reader
  reproduce (page size, SWA share of the full tokens, request slots, host ratio);
* stagecache's own (the demo run, ports, the runtime's page space).

docs/defaults.md is rendered from this module (``python -m stagecache.runtime.defaults``) and a
test keeps the two equal.
"""

from __future__ import annotations

# -- the model and its PP layout -------------------------------------------------------------------
#: The model every command takes when ``--model`` is not given: a small DeepSeek-V4-shaped preset
#: that runs on CPU in seconds (``deepseek-v4-flash`` is the real one).
MODEL = "tiny-v4"
#: Pipeline-parallel stages: the product is about PP, so every command starts with four.
PP_SIZE = 4
#: Tensor-parallel ranks per stage (MLA-style KV is replicated across them).
TP_SIZE = 1
#: Tokens per KV page; also what sglang 0.5.23 runs DeepSeek-V4 with on CUDA (it overrides
#: ``--page-size``), so a default plan and sglang's agree.
PAGE_SIZE = 256

# -- sglang 0.5.23's sizing of a DeepSeek-V4 stage ------------------------------------------------
#: ``--max-total-tokens`` of ``stagecache pools`` without a memory budget.
MAX_TOTAL_TOKENS = 262_144
#: ``--swa-full-tokens-ratio`` sglang sets for DeepSeek-V4.
SWA_FULL_TOKENS_RATIO = 0.1
#: ``--max-running-requests`` sglang sets for DeepSeek-V4 (``apply_deepseek_v4_defaults``).
MAX_RUNNING_REQUESTS = 256
#: ``--hicache-ratio``: host pages = device pages x ratio, per budget (sglang's default).
HICACHE_RATIO = 2.0

# -- linear-attention / Mamba hybrids ---------------------------------------------------------------
#: ``--mamba-full-memory-ratio``: Mamba state bytes / KV bytes of a memory budget (sglang's fallback).
MAMBA_FULL_MEMORY_RATIO = 0.9
#: Mamba state slots per running request where neither a memory budget nor
#: ``--max-mamba-cache-size`` gives sglang's count (a stagecache default: sglang sizes the slots from
#: the GPU's free memory; 5 is sglang's slots-per-request ratio on CUDA, 3 plus the extra buffer's 2).
MAMBA_SLOTS_PER_REQUEST = 5

# -- the host (HiCache) tier -----------------------------------------------------------------------
#: When device pages are backed up to the host: sglang's ``--hicache-write-policy`` values, in its order.
WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
#: The write policy of ``serve`` and ``bench hicache``: every new page is mirrored on the host.
WRITE_POLICY = "write_through"
#: Host pool memory layouts, as sglang's ``--hicache-mem-layout``.
HOST_LAYOUTS = ("layer_first", "page_first")
#: The host layout: one tensor per buffer, like the device side.
HOST_LAYOUT = "layer_first"

# -- L3: the storage tier behind the host tier ----------------------------------------------------
#: L3 backends: the embedded file store, Mooncake Store (a cluster), or none.
L3_BACKENDS = ("none", "file", "mooncake")
#: ``serve``'s L3: the embedded file store, in the run directory unless ``--l3-dir`` names one.
L3_BACKEND = "file"
#: ``bench hicache``'s L3: none unless asked for, so its figures compare device + host as before.
BENCH_L3_BACKEND = "none"
#: Bytes of L3 for the whole deployment (every stage keeps the same number of pages), in GiB.
L3_SIZE_GB = 1.0

# -- serve: the demo run ----------------------------------------------------------------------------
#: Device token pages per stage.
DEVICE_PAGES = 64
#: Requests of the generated multi-turn chat trace: at ``RATE`` they arrive over 80 s, so a
#: browser opened on the printed URL sees the charts live for more than a minute
#: (``--requests`` shortens the run).
REQUESTS = 960
#: Request arrivals per second at stage 0: slow enough to watch the dashboard live.
RATE = 12.0
#: Requests per pipeline micro-batch (also the request slots of the per-request pools).
MICRO_BATCH = 4
#: Seconds every stage gets to start and report.
STARTUP_TIMEOUT_S = 120.0
#: torch.distributed's timeout for init, collectives and point-to-point calls (seconds).
DIST_TIMEOUT_S = 60.0
#: A stage beats this often (seconds) ...
HEARTBEAT_INTERVAL_S = 1.0
#: ... and one whose last beat is older than this is down (/readyz 503, ``stagecache_stage_up`` 0).
HEARTBEAT_TIMEOUT_S = 5.0

# -- listeners ----------------------------------------------------------------------------------------
#: Address of the dashboard: loopback only.
HOST = "127.0.0.1"
#: Address of the stages' data plane: loopback only (the rendezvous is a file in the run dir).
DIST_HOST = "127.0.0.1"
#: Dashboard port of ``serve`` and ``dashboard``.
DASHBOARD_PORT = 8000
#: The one dashboard port of a live sglang deployment (``STAGECACHE_SGLANG_DASHBOARD_PORT``).
SGLANG_DASHBOARD_PORT = 9100
#: Seconds every PP rank of a live sglang deployment waits for the others at the record exchange
#: (``STAGECACHE_SGLANG_EXCHANGE_TIMEOUT_S``); the error names the ranks that did not come.
SGLANG_EXCHANGE_TIMEOUT_S = 60.0
#: A PP rank other than 0 pushes its live numbers to rank 0's endpoint this often (seconds) ...
SGLANG_PUSH_INTERVAL_S = 1.0
#: ... and rank 0 marks a rank whose last push is older than this down (/readyz 503 naming it;
#: ``STAGECACHE_SGLANG_PUSH_TIMEOUT_S``).
SGLANG_PUSH_TIMEOUT_S = 5.0


def render() -> str:
    """docs/defaults.md's table: every default of this module with its comment (a test keeps the
    committed file equal to this)."""
    import ast
    import inspect
    import sys

    module = sys.modules[__name__]
    tree = ast.parse(inspect.getsource(module))
    lines = inspect.getsource(module).splitlines()
    rows = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            notes = []
            k = node.lineno - 2
            while k >= 0 and lines[k].startswith("#:"):
                notes.insert(0, lines[k][2:].strip())
                k -= 1
            rows.append(f"| `{name}` | `{getattr(module, name)!r}` | {' '.join(notes)} |")
    return "\n".join(["| default | value | what it is |", "| --- | --- | --- |", *rows]) + "\n"


if __name__ == "__main__":
    print("# Defaults\n\nEvery default a command shows, from `runtime/defaults.py` (regenerate: "
          "`python -m stagecache.runtime.defaults > docs/defaults.md`).\n")
    print(render(), end="")
