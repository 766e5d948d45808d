"""Would an sglang 0.5.23 L3 backend keep a PP deployment's stages and models apart?

sglang keys an L3 page by a chained hash of its token ids -- no rank, no model -- and each
backend adds a suffix or prefix of its own.  For a DeepSeek-V4-style (MLA) model only the TP0
rank of every PP stage writes, and every stage stores *its own layers* under the same token
prefix: a backend whose key lacks the PP rank lets one stage read another's bytes.  A key that
lacks the model, the KV dtype or the host layout lets a cache written by one deployment be read
back by another.

``facts(backend)`` answers per property.  Where the backend's module imports (``file``; and
``mooncake`` with the Mooncake wheel and a reachable or locally started master), the answer is
*computed*: sglang's own key builder is called with two stages' (or two deployments')
``HiCacheStorageConfig`` that differ in one property, and the keys are compared.  Otherwise
the answer comes from ``TABLE``, read from the 0.5.23 source (each row names where).  A property
that ``HiCacheStorageConfig`` cannot even express (the KV dtype) cannot be in a key it builds.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from typing import Any

PROPERTIES = ("pp_rank", "model", "dtype", "layout")


@dataclass(frozen=True)
class KeyFacts:
    """Which properties a backend's L3 keys carry (True: two values give two keys)."""

    backend: str
    pp_rank: bool
    model: bool
    dtype: bool
    layout: bool
    source: str  # where in sglang's source the key is built
    how: str = "table"  # table, or sglang: computed by calling sglang's own key functions
    note: str = ""

    def missing(self) -> list[str]:
        return [p for p in PROPERTIES if not getattr(self, p)]

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "missing": self.missing()}


_S = "sglang/srt/mem_cache/"
#: Read from sglang 0.5.23's source (the rank-suffix key scheme, the one its backends use).
TABLE: dict[str, KeyFacts] = {f.backend: f for f in (
    KeyFacts("file", True, True, False, False, _S + "hicache_storage.py HiCacheFile.__init__",
             note="'_{model}_{pp_size}_{pp_rank}' suffix under PP; a TODO there asks for dtype and layout"),
    KeyFacts("mooncake", True, True, False, False,
             _S + "storage/mooncake_store/mooncake_store.py MooncakeStore.__init__, _tag_keys",
             note="model prefix (config_prefix); MLA suffix '_{pp_rank}' under PP"),
    KeyFacts("nixl", False, True, False, False, _S + "storage/nixl/hicache_nixl.py HiCacheNixl.__init__",
             note="'_{model}' for MLA: every stage's TP0 rank writes the same key"),
    KeyFacts("hf3fs", False, False, False, False,
             _S + "storage/hf3fs/storage_hf3fs.py HiCacheHF3FS (rank forced to 0 for MLA)",
             note="keys are the page hashes in a per-rank metadata space; MLA uses rank 0 on every stage"),
    KeyFacts("eic", False, True, False, True, _S + "storage/eic/eic_storage.py EICStorage.__init__",
             note="prefix '{model}_mla_att_{host layout}@sglang': no PP rank"),
    KeyFacts("simm", True, True, False, False, _S + "storage/simm/hicache_simm.py HiCacheSiMM.__init__",
             note="MLA suffix '_{pp_rank}' under PP"),
    KeyFacts("seaweedfs", True, True, False, False,
             _S + "storage/seaweedfs/seaweedfs_store.py key_scope",
             note="'pp{rank}of{size}' path part"),
    KeyFacts("tensorcast", True, True, True, True,
             _S + "storage/tensorcast_store/tensorcast_store.py (rank_suffix, layout_id)",
             note="the only backend with dtype and layout in its keys"),
)}
BACKENDS = tuple(TABLE)


# -- computed by calling sglang ------------------------------------------------------------------
#: The storage config every variation starts from (a DeepSeek-V4 MLA stage of pp 2).
BASE_CONFIG: dict[str, Any] = dict(
    tp_rank=0, tp_size=1, pp_rank=0, pp_size=2, attn_cp_rank=0, attn_cp_size=1, is_mla_model=True,
    enable_storage_metrics=False, is_page_first_layout=False, model_name="deepseek-ai/DeepSeek-V4-Flash")


def _config(**over: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(**{**BASE_CONFIG, **over})


#: One-property variations: (property, config A overrides, config B overrides).
VARIATIONS = (("pp_rank", {"pp_rank": 0}, {"pp_rank": 1}),
              ("model", {"model_name": "org/model-a"}, {"model_name": "org/model-b"}),
              ("layout", {"is_page_first_layout": False}, {"is_page_first_layout": True}))


def _file_key(cfg_over: dict[str, Any]) -> str:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    with tempfile.TemporaryDirectory(prefix="stagecache-sglang-keys-") as tmp:
        store = HiCacheFile(_config(**cfg_over, extra_config={"file_storage_path": tmp}), file_path=tmp)
        return store._get_suffixed_key("0123abcd")


def _mooncake_key(cfg_over: dict[str, Any], master: str) -> str:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    extra = {"master_server_address": master, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
             "local_hostname": "127.0.0.1", "global_segment_size": 256 << 20, "check_server": False}
    store = MooncakeStore(_config(**cfg_over, extra_config=extra), None)
    try:
        # the key builder looks the pool up by name only; a DeepSeek-V4 side pool is one object
        store.registered_pools[PoolName.DEEPSEEK_V4_C4] = object()
        keys, _ = store._get_hybrid_page_component_keys(
            store._tag_keys(["0123abcd"]), PoolTransfer(name=PoolName.DEEPSEEK_V4_C4))
        return keys[0]
    finally:
        store.close()


def _computed(backend: str, key_of: Any) -> KeyFacts:
    """The row with each property found by building two keys that differ only in it.  A config is
    built once however many variations name it (a Mooncake store takes about 2 s to close)."""
    row, keys = TABLE[backend], {}

    def key(over: dict[str, Any]) -> str:
        config = tuple(sorted((k, v) for k, v in over.items() if BASE_CONFIG.get(k) != v))
        if config not in keys:
            keys[config] = key_of(dict(config))
        return keys[config]

    found = {prop: key(a) != key(b) for prop, a, b in VARIATIONS}
    return dataclasses.replace(row, how="sglang", dtype=False, note=(
        f"{row.note}; computed with sglang's own key builder (HiCacheStorageConfig has no dtype "
        "field: no key it builds can carry the dtype)"), **found)


def facts(backend: str, mooncake_master: str | None = None) -> tuple[KeyFacts, str | None]:
    """The backend's key facts, computed where possible; and why the table was used instead."""
    if backend not in TABLE:
        raise KeyError(backend)
    try:
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    except ImportError as exc:
        return TABLE[backend], f"sglang not importable here ({exc.name or exc})"
    if backend == "file":
        return _computed("file", _file_key), None
    if backend == "mooncake":
        return _mooncake_facts(mooncake_master)
    return TABLE[backend], f"sglang's {backend} backend needs its own service or library to build keys"


def _mooncake_facts(master: str | None) -> tuple[KeyFacts, str | None]:
    try:
        import mooncake.store  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a wheel that cannot load is a reason, not a crash
        return TABLE["mooncake"], f"the Mooncake wheel does not load here ({type(exc).__name__})"
    from ..storage.base import StoreUnavailable
    from ..storage.master import MooncakeMaster

    local = None if master else MooncakeMaster()
    try:
        address = master or local.start()
        return _computed("mooncake", lambda over: _mooncake_key(over, address)), None
    except (StoreUnavailable, RuntimeError) as exc:
        return TABLE["mooncake"], f"no Mooncake master to build keys with ({exc})"
    finally:
        if local is not None:
            local.stop()


def verdict(f: KeyFacts, pp_size: int) -> tuple[str, str]:
    """(level, one line): ``error`` when stages would collide under PP, ``warning`` for a key
    that lacks the model, dtype or layout, ``ok`` otherwise."""
    missing = f.missing()
    if pp_size > 1 and not f.pp_rank:
        return "error", (f"sglang --hicache-storage-backend {f.backend}: its keys do not carry the PP "
                         f"rank, so the {pp_size} stages of an MLA model write the same keys for the same "
                         f"prefix and read each other's layers ({f.source})")
    if missing:
        return "warning", (f"sglang --hicache-storage-backend {f.backend}: its keys do not carry "
                           f"{', '.join(missing)}: a store shared with another deployment can hand back "
                           "bytes of another layout")
    return "ok", f"sglang --hicache-storage-backend {f.backend}: keys separate PP ranks, model, dtype and layout"
