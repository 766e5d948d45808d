"""Live numbers from every PP rank to rank 0's one endpoint: an authenticated HTTP push.

Why a push and not a collective: after start-up sglang's event loop owns the PP CPU group
(it exchanges objects point to point there), so a background thread must not use it; a
push needs no group, crosses hosts like any HTTP call, and a rank that stops pushing is
exactly the signal ``/readyz`` needs.

Every push is ``serve.exchange.seal`` of ``{"stage", "seq", "live"}`` under the deployment's push
secret; docs/sglang.md lists what rank 0 refuses.  Push times are moved onto rank 0's clock at
receipt (``live.remote.on_receiver_clock``, by the least offset of the rank's recent pushes), so
clock skew between hosts cannot make a silent rank look alive.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response

from ...errors import StageCacheError
from ...live.numbers import StageLive
from ...live.remote import ClockOffsets, on_receiver_clock
from ...serve.exchange import seal, unseal

log = logging.getLogger(__name__)

#: The push route on rank 0's dashboard.
PUSH_PATH = "/api/sglang/push"
#: The largest push rank 0 reads (a StageLive is a few KB).
MAX_PUSH_BYTES = 1 << 20
#: Refusals of a push for what it holds (malformed, MAC, too large): its records are not sent again.
REFUSED_AS_IS = frozenset({400, 403, 413})
#: Seconds one push may take before it is abandoned (the next one follows anyway).
PUSH_HTTP_TIMEOUT_S = 2.0


class PushRefused(StageCacheError):
    """A push rank 0 does not take (the HTTP status says why)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class PushReceiver:
    """Rank 0's side: verifies pushes and hands the numbers to ``store(stage, live)``."""

    def __init__(self, secret: bytes, pp_size: int, store: Callable[[int, StageLive], None],
                 on_agreement: Callable[[int, Any], None] | None = None):
        self._secret = secret
        #: the push's ``agreement`` records, to rank 0's compare (``ValueError``: refused, 400)
        self._on_agreement = on_agreement
        self._pp_size = pp_size
        self._store = store
        self._seq: dict[int, int] = {}
        self._offsets = ClockOffsets()
        self._lock = threading.Lock()

    def take(self, body: bytes, now: float, host: str | None = None) -> int:
        """Verify one push body and store it; the stage it came from.  ``PushRefused`` else."""
        if len(body) > MAX_PUSH_BYTES:
            raise PushRefused(413, f"push of {len(body)} bytes; at most {MAX_PUSH_BYTES} are taken")
        try:
            msg = unseal(self._secret, body, "a push")
        except StageCacheError as exc:
            raise PushRefused(403, str(exc)) from None
        if not isinstance(msg, dict):
            raise PushRefused(400, "a push must be a JSON object")
        stage, seq = msg.get("stage"), msg.get("seq")
        if not isinstance(stage, int) or not 0 < stage < self._pp_size or not isinstance(seq, int):
            raise PushRefused(400, f"push names stage {stage!r} (1..{self._pp_size - 1}) seq {seq!r}")
        try:
            live = StageLive.model_validate(msg.get("live"))
        except ValueError as exc:
            raise PushRefused(400, f"stage {stage}'s push is not a StageLive: {exc}") from None
        with self._lock:
            if seq <= self._seq.get(stage, -1):
                raise PushRefused(409, f"stage {stage}: push {seq} is not newer than {self._seq[stage]}")
            self._seq[stage] = seq
        live.stage = stage
        sent_at = live.time or now
        offset = self._offsets.offset(stage, sent_at, now)
        self._store(stage, on_receiver_clock(live, sent_at, now, host, offset))
        if self._on_agreement is not None and msg.get("agreement") is not None:
            try:
                self._on_agreement(stage, msg["agreement"])
            except ValueError as exc:
                raise PushRefused(400, f"stage {stage}'s agreement records: {exc}") from None
        return stage

    def add_route(self, app: Any) -> None:
        """``POST PUSH_PATH`` on rank 0's FastAPI app."""
        @app.post(PUSH_PATH, include_in_schema=False)
        async def push(request: Request) -> Response:
            declared = request.headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > MAX_PUSH_BYTES):
                return Response("push too large\n", status_code=413, media_type="text/plain")
            body = b""
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_PUSH_BYTES:
                    return Response("push too large\n", status_code=413, media_type="text/plain")
            try:
                self.take(body, time.time(), request.client.host if request.client else None)
            except PushRefused as exc:
                return Response(f"{exc}\n", status_code=exc.status, media_type="text/plain")
            return Response(status_code=204)


class Pusher:
    """A rank's side: a daemon thread that pushes ``snapshot()`` to rank 0 every ``interval_s``."""

    def __init__(self, url: str, secret: bytes, stage: int, snapshot: Callable[[], StageLive],
                 interval_s: float, extra: Callable[[], dict[str, Any]] | None = None,
                 sent: Callable[[], None] | None = None):
        self.url = url.rstrip("/") + PUSH_PATH
        self._secret = secret
        self._stage = stage
        self._snapshot = snapshot
        self._interval = interval_s
        #: what else rides on each push (the rank's agreement records), under ``agreement``
        self._extra = extra
        self._sent = sent  # rank 0 took a push: what ``extra`` gave it need not be sent again
        self._push_lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stagecache-push:{stage}", daemon=True)
        self.failures = 0
        self.last_error: str | None = None

    def start(self) -> Pusher:
        self._thread.start()
        return self

    def push_once(self) -> None:
        """One push; raises ``OSError``/``urllib.error.URLError`` when rank 0 does not take it."""
        with self._push_lock:  # the thread, or a last push from the scheduler thread: in order
            self._seq += 1
            msg = {"stage": self._stage, "seq": self._seq, "live": self._snapshot().model_dump(mode="json")}
            if self._extra is not None:
                msg["agreement"] = self._extra()
            body = seal(self._secret, msg)
            req = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/octet-stream"})
            try:
                with urllib.request.urlopen(req, timeout=PUSH_HTTP_TIMEOUT_S) as resp:  # noqa: S310 (http only)
                    resp.read()
            except urllib.error.HTTPError as exc:
                if exc.code in REFUSED_AS_IS and self._sent is not None:
                    self._sent()  # sending it again would be refused again
                raise  # anything else (a busy endpoint's 408/429/503, a late 409): sent again
            if self._sent is not None:
                self._sent()

    def _run(self) -> None:
        # rank 0 starts its endpoint once the exchange is over, as the others start pushing
        while not self._stop.wait(self._interval):
            try:
                self.push_once()
            except (OSError, urllib.error.URLError) as exc:
                self.failures += 1
                self.last_error = str(exc)
                if self.failures in (1, 10) or self.failures % 100 == 0:
                    log.warning("stage %d: push to %s failed (%d so far): %s", self._stage, self.url,
                                self.failures, exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PUSH_HTTP_TIMEOUT_S + 1)
