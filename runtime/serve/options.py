"""``serve``'s options: validated once in the parent, then handed to every stage unchanged.

``ServeOptions`` is built by the CLI from the flags (every check happens there,
before any process starts) and travels inside each stage's ``StageConfig``; no
field is copied from one to the other, so a new option needs one field here.
The run's ``RunPlan`` travels inside it: a stage allocates exactly its ``StagePlan``
and never recomputes a layout, a buffer count or a size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import defaults
from ..errors import ConfigError
from ..memory.host_tier import MemInfo
from ..plan.plan import RunPlan, StagePlan
from ..storage.options import L3Options
from .nodes import local_ranks

#: Upper bounds of flags whose size is otherwise only limited by memory (each stage holds the trace).
MAX_REQUESTS = 100_000
MAX_HIDDEN = 65_536
#: Activation width when the model's config has none, and its cap on CPU (a 4096-wide stand-in
#: compute would dominate a CPU run).
DEFAULT_HIDDEN = 256
CPU_HIDDEN_CAP = 512


@dataclass(frozen=True)
class ServeOptions:
    """Every ``serve`` option, validated once in the parent and handed to each stage as is."""

    plan: RunPlan
    hicache_write_policy: str
    hicache_layout: str
    trace: str | None
    requests: int
    seed: int
    micro_batch: int
    in_flight: int | None
    rate: float
    hidden_size: int
    device: str  # resolved: "cpu" | "cuda"
    host: str
    port: int
    dashboard: bool
    run_dir: str | None
    exit_on_error: bool
    hold_seconds: float | None  # None = until interrupted
    exit_after_run: bool
    startup_timeout: float
    dist_timeout: float
    json: bool
    dist_host: str = defaults.DIST_HOST  # resolved IP literal the rendezvous and data plane bind
    dist_interface: str = "lo"  # the interface carrying dist_host (gloo/nccl SOCKET_IFNAME)
    heartbeat_timeout: float = defaults.HEARTBEAT_TIMEOUT_S  # an older heartbeat: not ready / not up
    max_disagreements: int = 0  # more stage disagreements than this: not ready (agreement.py)
    l3: L3Options = L3Options()  # the storage tier behind the host tier (storage/options.py)
    trace_format: str = "auto"  # --trace's format: auto (detected from line 1), tokens, mooncake
    # several hosts (nodes.py): torchrun's flags; one host keeps the defaults and is unchanged
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 29400
    node_secret: bytes = b""  # --secret-file's bytes (never sent: keys are derived from it)
    run_fingerprint: str = ""  # the options every node must share (refused by the hub otherwise)
    allow_hosts: tuple[str, ...] = ()  # --allow-host: more Host names the dashboard answers

    @property
    def local_ranks(self) -> range:
        """The stages this node runs (all of them on one host)."""
        return local_ranks(self.plan.pp_size, self.nnodes, self.node_rank)

    @property
    def hub_address(self) -> tuple[str, int]:
        return self.master_addr, self.master_port

    # -- what the plan holds, read from it (never a second copy) --------------------------------
    @property
    def pp_size(self) -> int:
        return self.plan.pp_size

    @property
    def page_size(self) -> int:
        return self.plan.page_size


@dataclass(frozen=True)
class StageConfig:
    """What one stage process gets (picklable: the start method sends it to the child)."""

    rank: int
    opts: ServeOptions
    run_dir: str
    parent_pid: int = 0
    #: The run's secret: seals the stages' startup messages (``exchange``); never on a socket.
    secret: bytes = b""
    #: The rendezvous (a torch FileStore) inside the private run dir (``rendezvous``).
    store_path: str = ""

    @property
    def backend(self) -> str:
        return "nccl" if self.opts.device == "cuda" else "gloo"

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.rank}" if self.opts.device == "cuda" else "cpu"

    @property
    def in_flight(self) -> int:
        """Micro-batches inside the pipeline at once (default: one per stage)."""
        return self.opts.in_flight or self.opts.pp_size

    @property
    def plan(self) -> StagePlan:
        """This stage's plan: what its process allocates."""
        return self.opts.plan.stage(self.rank)


def model_hidden_size(model: str) -> int | None:
    """``hidden_size`` of a preset or config.json (the spec does not keep it: the KV cache needs none)."""
    from ..model.config_file import load_config

    try:
        value = load_config(model)[0].get("hidden_size")
    except (ConfigError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _may_have_gpu() -> bool:
    return bool(os.environ.get("CUDA_VISIBLE_DEVICES")) or any(
        os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia")
    )


def resolve_device(choice: str, pp_size: int) -> str:
    """auto: CUDA (one GPU per stage, nccl) when there are >= pp_size GPUs, else CPU (gloo)."""
    if choice == "cpu":
        return "cpu"
    if choice == "auto" and not _may_have_gpu():
        return "cpu"  # skip importing torch in the parent just to count zero GPUs
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda":
        if gpus < pp_size:
            raise ConfigError(
                f"--device cuda needs one GPU per stage: --pp-size {pp_size}, but {gpus} GPU(s) visible"
            )
        return "cuda"
    return "cuda" if gpus >= pp_size else "cpu"


def check_host_memory(plan: RunPlan, device: str, min_device_pages: int = 1,
                      pages_flag: str = "--device-pages", mem: MemInfo | None = None,
                      stages: range | None = None) -> int:
    """All stages share this host's RAM: their pools together must fit (a per-stage check cannot see it).

    Runs before any process starts or any pool exists, on the plan (faults included: a faulty
    build really allocates its buggy pools).  Host (HiCache) pools always live in RAM; device
    pools too when running on CPU.  The error names ``--hicache-ratio`` and the size flag the
    user gave (``pages_flag``: ``--device-pages`` or ``--max-total-tokens``) with the largest
    values that fit, never fewer device pages than the trace needs (``min_device_pages``).
    ``mem``: a ``MemInfo`` to check against (default: this host's /proc/meminfo now).
    ``stages``: the stages this host runs (several hosts: this node's share); default all.
    Returns the bytes needed.
    """
    from ..memory.ram_check import check_ram, stages_ram_need

    need = stages_ram_need(plan, device_in_ram=device == "cpu", stages=stages)
    where = "device + host pools" if device == "cpu" else "host pools"
    scale = plan.page_size if pages_flag == "--max-total-tokens" else 1
    pages = min(s.device_pages for s in plan.stages)  # the deployment's: a faulted stage may size itself alone
    return check_ram(need, pages, plan.sizing.hicache_ratio,
                     f"the {plan.pp_size} stages' {where} together" if stages is None or len(stages) == plan.pp_size
                     else f"this node's {len(stages)} stages' {where} together", min_pages=min_device_pages,
                     pages_flag=pages_flag, pages_scale=scale, mem=mem)
