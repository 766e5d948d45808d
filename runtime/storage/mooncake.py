"""The cluster L3 backend: Mooncake Store (``mooncake-transfer-engine-non-cuda``), TCP on loopback.

Each stage process is one Mooncake client: it joins a master (``master.py`` starts a local one),
contributes a memory segment of ``segment_bytes`` to the store, and registers its host-pool
tensors so pages move zero-copy (``batch_put_from`` / ``batch_get_into``, their multi-buffer
forms for ``layer_first`` pages, one segment per layer buffer).  Facts this module relies on,
measured with the 0.3.13.post1 wheel (shared/README.md):

* return codes: -704 not found, -706 leased, -200 no space, -600 bad parameters, -800 transfer
  failed, -900 master call failed; reads return the bytes read.  ``get()`` returns ``b''`` for a
  missing key *and* a failed transfer, so it is never used: reads go through ``get_into``;
* ``MC_TCP_BIND_ADDRESS`` must name the loopback address or the client advertises the host's
  external interface; ``setup`` retries for ~90 s without a master unless
  ``MC_STORE_CLIENT_SETUP_RETRIES`` is lowered (this module sets 1: ~4 s);
* with the master gone, the first call fails at once (-900) but later ones block ~4 s each
  while the client retries; a restarted master is joined again within ~2 s and holds no keys.

So the first -900 marks the store *down*: no page call touches the client until a background
thread's probe (``batch_is_exist``, every ``probe_interval`` s) answers again, then the store is
*up* and ``on_up`` callbacks run (a stage re-writes its probe and manifest there).  While down,
reads and writes are skipped and counted; the stage serves from its device and host tiers.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

import torch

from .base import L3Store, Outcome, Segments, StoreUnavailable, segments_bytes
from .keys import SCHEME, check_key

log = logging.getLogger(__name__)

NOT_FOUND, LEASED, NO_SPACE, BAD_PARAMETERS, TRANSFER_FAILED, MASTER_FAILED = (
    -704, -706, -200, -600, -800, -900)
#: Mooncake return code -> what it means, for error lines.
CODES = {NOT_FOUND: "not found", LEASED: "key leased by a reader", NO_SPACE: "no space in the store",
         BAD_PARAMETERS: "bad parameters (size or buffer)", TRANSFER_FAILED: "transfer failed",
         MASTER_FAILED: "master unreachable"}
LOCAL_BUFFER_BYTES = 16 << 20
#: The smallest segment Mooncake's client accepts ("Total size must be at least 16777216").
MIN_SEGMENT_BYTES = 16 << 20
SMALL_BYTES = 1 << 20  # the registered buffer small objects (manifest, probe) are read into
DEFAULT_PROBE_INTERVAL_S = 1.0


def describe(code: int) -> str:
    return f"{code} ({CODES.get(code, 'error')})"


#: How to add the Mooncake backend to an install without it.
MOONCAKE_EXTRA = ("pip install '.[l3]' in a stagecache checkout (mooncake-transfer-engine-non-cuda; "
                  "Debian package libibverbs1)")


def _import_store(flag: str = "--l3 mooncake") -> type:
    """Mooncake's store class; ``StoreUnavailable`` naming ``flag`` and ``MOONCAKE_EXTRA`` when the
    extra is not installed."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # read when the library loads: INFO logs every call
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise StoreUnavailable(f"{flag} needs the Mooncake wheel: {MOONCAKE_EXTRA} ({exc})") from None
    return MooncakeDistributedStore


class MooncakeStore(L3Store):
    """One Mooncake client (see the module docstring)."""

    backend = "mooncake"

    def __init__(self, master: str, segment_bytes: int, hostname: str = "127.0.0.1",
                 metadata: str = "P2PHANDSHAKE", probe_interval: float = DEFAULT_PROBE_INTERVAL_S,
                 health_key: str = f"{SCHEME}.health"):
        super().__init__()
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        cls = _import_store()
        self.master, self.probe_interval, self.health_key = master, probe_interval, health_key
        self.stats.capacity_bytes = segment_bytes
        self.client = cls()
        rc = self.client.setup(hostname, metadata, segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "", master)
        if rc:
            raise StoreUnavailable(f"mooncake: cannot join the master at {master}: setup returned "
                                   f"{describe(rc)}")
        self._small = torch.zeros(SMALL_BYTES, dtype=torch.uint8)
        self.register([self._small])
        self.on_up: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._probe: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- health ---------------------------------------------------------------------------------
    def _failed(self, code: int) -> Outcome:
        if code == MASTER_FAILED:
            self.mark_down(f"mooncake master {self.master} unreachable (code {MASTER_FAILED})")
        return Outcome.FAILED

    def mark_down(self, reason: str) -> None:
        with self._lock:
            was_up = self.stats.up
            super().mark_down(reason)
            if was_up:
                log.warning("L3 mooncake: %s; serving without L3 until it answers again", reason)
                self._probe = threading.Thread(target=self._watch, name="l3-mooncake-probe",
                                               daemon=True)
                self._probe.start()

    def _watch(self) -> None:
        """Probe the master until it answers; then the store is up again."""
        while not self._stop.wait(self.probe_interval):
            try:  # a write, not a lookup: the master answers before this client's segment is back
                answer = self.client.upsert(self.health_key, b"up")
            except Exception as exc:  # noqa: BLE001 - a binding error is one more failed probe
                log.debug("L3 mooncake probe: %s", exc)
                continue
            if answer == 0:
                with self._lock:
                    self.mark_up()
                log.warning("L3 mooncake: master %s answers again; L3 is back", self.master)
                for fn in list(self.on_up):
                    try:
                        fn()
                    except Exception as exc:  # noqa: BLE001 - a callback must not kill the probe
                        log.warning("L3 mooncake: after the master came back: %s", exc)
                return

    # -- the interface --------------------------------------------------------------------------
    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("mooncake: only contiguous CPU tensors can be registered")
            rc = self.client.register_buffer(t.data_ptr(), t.numel() * t.element_size())
            if rc:
                raise StoreUnavailable(f"mooncake: registering {t.numel() * t.element_size()} bytes "
                                       f"of host memory failed: {describe(rc)}")

    @staticmethod
    def _layout(views: Sequence[Segments]) -> tuple[bool, list, list]:
        multi = any(len(v) != 1 for v in views)
        if multi:
            return True, [[t.data_ptr() for t in v] for v in views], [[int(t.numel()) for t in v]
                                                                       for v in views]
        return False, [v[0].data_ptr() for v in views], [int(v[0].numel()) for v in views]

    def _get_into(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]:
        multi, ptrs, sizes = self._layout(views)
        codes = (self.client.batch_get_into_multi_buffers(list(keys), ptrs, sizes) if multi
                 else self.client.batch_get_into(list(keys), ptrs, sizes))
        out = []
        for code, segs in zip(codes, views, strict=True):
            if code == segments_bytes(segs):
                out.append(Outcome.OK)
            elif code == NOT_FOUND:
                out.append(Outcome.MISSING)
            elif code > 0:  # another size than the page: not this layout's object
                out.append(Outcome.CORRUPT)
            else:
                out.append(self._failed(code))
        return out

    def _set_from(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]:
        multi, ptrs, sizes = self._layout(views)
        codes = (self.client.batch_put_from_multi_buffers(list(keys), ptrs, sizes) if multi
                 else self.client.batch_put_from(list(keys), ptrs, sizes))
        return [Outcome.OK if c == 0 else Outcome.NO_SPACE if c == NO_SPACE else self._failed(c)
                for c in codes]

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        codes = self.client.batch_is_exist(list(keys))
        bad = [c for c in codes if c < 0]
        if bad:
            self.mark_down(f"mooncake master {self.master}: exists returned {bad[0]}")
        return [c == 1 for c in codes]

    def get(self, key: str) -> bytes | None:
        size = self.client.get_size(check_key(key))
        if size == NOT_FOUND:
            return None
        if size < 0 or size > SMALL_BYTES:
            if size == MASTER_FAILED:
                self._failed(size)
            raise StoreUnavailable(f"mooncake: size of {key} at {self.master}: {describe(size)}")
        code = self.client.get_into(key, self._small.data_ptr(), size)
        if code == NOT_FOUND:
            return None
        if code != size:
            raise StoreUnavailable(f"mooncake: reading {key} from {self.master}: {describe(code)}")
        return self._small[:size].numpy().tobytes()

    def set(self, key: str, data: bytes) -> Outcome:
        code = self.client.upsert(check_key(key), data)
        return Outcome.OK if code == 0 else Outcome.NO_SPACE if code == NO_SPACE else self._failed(code)

    def remove(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.client.remove(key, True)

    def reset(self) -> int:
        """Every stagecache key in the store (``sc1.*``, any deployment); other keys stay."""
        n = self.client.remove_by_regex(rf"^{SCHEME}\..*", True)
        if n < 0:
            raise StoreUnavailable(f"mooncake: removing the stagecache keys at {self.master}: "
                                   f"{describe(n)}")
        return n

    def close(self) -> None:
        self._stop.set()
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # noqa: BLE001 - best effort at exit
                log.debug("L3 mooncake close: %s", exc)
