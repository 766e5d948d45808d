"""``serve`` over several hosts: node 0's hub, the other nodes' link to it, and the stages' rendezvous.

With ``--nnodes N`` every host runs the same ``stagecache serve`` command except ``--node-rank``
and ``--dist-host`` (torchrun's flags).  Node 0 runs the **hub** on ``--master-addr:--master-port``:

* the stages' rendezvous: a key-value store (``HubStore``, a Python ``torch.distributed.Store``)
  replacing the one-host ``FileStore`` in the private run dir, which another host cannot open;
* where the other nodes report: every ``REPORT_INTERVAL_S`` a node sends its stages' live
  numbers and exit codes; the hub writes them into node 0's run directory, moved onto node 0's
  clock (``live.remote``), and answers with the startup report and the run's phase.

Nobody but the deployment may talk to the hub.  The operator's secret file (``--secret-file``,
owned by the user, mode 600) is never sent: each connection starts with a two-way HMAC
challenge-response over both sides' random nonces and the run's fingerprint (the options every
node must share), so a peer without the secret, or one started with other options, is refused
before a frame is read.  Every frame after that is JSON with an HMAC-SHA256 over its direction,
its sequence number and its bytes under a key of that connection: a frame replayed, reordered,
reflected or altered is refused and the connection closed.  Nothing is unpickled; every socket
has a timeout; at most ``MAX_CONNECTIONS`` are served at once; a frame is at most ``MAX_FRAME``
bytes; a second node claiming a node rank that is connected is refused.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError, StageCacheError

log = logging.getLogger(__name__)

MASTER_PORT = 29400
MAX_FRAME = 4 << 20
MAX_CONNECTIONS = 64
IO_TIMEOUT_S = 10.0
HANDSHAKE_TIMEOUT_S = 5.0
REPORT_INTERVAL_S = 0.5
STALE_NODE_S = 3 * REPORT_INTERVAL_S  # a node connection silent this long may be replaced
NONCE = 32
MAC = hashlib.sha256().digest_size
MAX_SECRET_BYTES = 4096


class HubRefused(StageCacheError):
    """A peer that is not this run's (no secret, other options) or a frame that fails its MAC."""


# -- the secret ------------------------------------------------------------------------------------
def read_secret(path: str) -> bytes:
    """``--secret-file``: a regular file of yours that nobody else can read, 16..4096 bytes."""
    what = f"--secret-file {path!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"{what}: {exc.strerror or exc}; expected a file of 16 to {MAX_SECRET_BYTES} "
                          "random bytes, mode 600, the same on every node") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} is not a regular file; expected a file of random bytes, mode 600")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{what} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); "
                              "expected your own file, mode 600")
        if st.st_mode & 0o077:
            raise ConfigError(f"{what} has mode {stat.S_IMODE(st.st_mode):o}; expected 600 (others must not "
                              "read the deployment's secret): chmod 600 it")
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if not 16 <= len(data) <= MAX_SECRET_BYTES:
        raise ConfigError(f"{what} holds {len(data)} bytes; expected 16 to {MAX_SECRET_BYTES} random bytes "
                          "(e.g. head -c 32 /dev/urandom > FILE)")
    return data


def derive(secret: bytes, purpose: str) -> bytes:
    """A key for one purpose (the hub's handshake, the stages' startup exchange) from the secret."""
    return hmac.new(secret, b"stagecache/" + purpose.encode(), hashlib.sha256).digest()


# -- one authenticated connection --------------------------------------------------------------------
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


class Channel:
    """JSON frames with a MAC over (direction, sequence number, bytes) under a per-connection key."""

    def __init__(self, sock: socket.socket, key: bytes, is_hub: bool):
        self.sock = sock
        self._key = key
        self._out, self._in = (b"H", b"N") if is_hub else (b"N", b"H")
        self._sent = 0
        self._got = 0

    def send(self, obj: Any) -> None:
        payload = json.dumps(obj, separators=(",", ":")).encode()
        if len(payload) > MAX_FRAME:
            raise HubRefused(f"a frame of {len(payload)} bytes; at most {MAX_FRAME}")
        self._sent += 1
        mac = hmac.new(self._key, self._out + struct.pack(">Q", self._sent) + payload, hashlib.sha256).digest()
        self.sock.sendall(struct.pack(">I", len(payload)) + mac + payload)

    def recv(self, idle: bool = False) -> Any:
        """The next frame.  ``idle``: wait for it to start as long as it takes (the hub, on a
        stage's store connection), then the rest must arrive within ``IO_TIMEOUT_S``; otherwise
        the socket's own timeout bounds every read."""
        if idle:
            self.sock.settimeout(None)
        (n,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        if n > MAX_FRAME:
            raise HubRefused(f"a frame of {n} bytes announced; at most {MAX_FRAME}")
        if idle:
            self.sock.settimeout(IO_TIMEOUT_S)
        mac = _recv_exact(self.sock, MAC)
        payload = _recv_exact(self.sock, n)
        self._got += 1
        want = hmac.new(self._key, self._in + struct.pack(">Q", self._got) + payload, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, want):
            raise HubRefused("a frame failed its MAC (altered, replayed or not from this run); closed")
        return json.loads(payload)


def _proof(key: bytes, role: bytes, a: bytes, b: bytes, fingerprint: str) -> bytes:
    return hmac.new(key, role + a + b + fingerprint.encode(), hashlib.sha256).digest()


def connect(address: tuple[str, int], secret: bytes, fingerprint: str,
            timeout: float = HANDSHAKE_TIMEOUT_S) -> Channel:
    """A node's authenticated channel to the hub (``HubRefused``: the hub did not prove the secret)."""
    key = derive(secret, "hub")
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.settimeout(timeout)
        hub_nonce = _recv_exact(sock, NONCE)
        mine = secrets.token_bytes(NONCE)
        sock.sendall(mine + _proof(key, b"node", hub_nonce, mine, fingerprint))
        try:
            answer = _recv_exact(sock, MAC)
        except ConnectionError:
            raise HubRefused(f"the hub at {address[0]}:{address[1]} refused this node: another secret, or "
                             "another run's options (every node must run the same command but for "
                             "--node-rank and --dist-host)") from None
        if not hmac.compare_digest(answer, _proof(key, b"hub", mine, hub_nonce, fingerprint)):
            raise HubRefused("the hub did not prove the deployment's secret; not this run's hub")
        sock.settimeout(IO_TIMEOUT_S)
        return Channel(sock, _proof(key, b"session", hub_nonce, mine, fingerprint), is_hub=False)
    except BaseException:
        sock.close()
        raise


def _accept(sock: socket.socket, secret: bytes, fingerprint: str) -> Channel:
    key = derive(secret, "hub")
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    nonce = secrets.token_bytes(NONCE)
    sock.sendall(nonce)
    theirs = _recv_exact(sock, NONCE)
    proof = _recv_exact(sock, MAC)
    if not hmac.compare_digest(proof, _proof(key, b"node", nonce, theirs, fingerprint)):
        raise HubRefused("a peer without the deployment's secret, or with another run's options")
    sock.sendall(_proof(key, b"hub", theirs, nonce, fingerprint))
    sock.settimeout(None)  # a store wait blocks as long as the stage asks; reads are bounded below
    return Channel(sock, _proof(key, b"session", nonce, theirs, fingerprint), is_hub=True)


# -- the hub (node 0) --------------------------------------------------------------------------------
class Hub:
    """Node 0's listener: the stages' store and the nodes' reports (one thread per connection)."""

    def __init__(self, host: str, port: int, secret: bytes, fingerprint: str,
                 on_report: Callable[[dict[str, Any]], dict[str, Any]]):
        self._secret, self._fp, self._on_report = secret, fingerprint, on_report
        self._kv: dict[str, bytes] = {}
        self._cv = threading.Condition()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        #: node rank -> (its connection, when it last reported: monotonic)
        self._nodes: dict[int, tuple[socket.socket, float]] = {}
        self._nodes_lock = threading.Lock()
        self.refused = 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            raise ConfigError(f"--master-addr {host} --master-port {port}: cannot listen ({exc.strerror or exc}); "
                              "expected an address of this host (node 0) and a free port") from None
        self._listener.listen(MAX_CONNECTIONS)
        self._closed = False
        threading.Thread(target=self._serve, name="stagecache-hub", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # at most MAX_CONNECTIONS
                continue
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn: socket.socket) -> None:
        node: int | None = None
        try:
            try:
                ch = _accept(conn, self._secret, self._fp)
            except (HubRefused, OSError, ConnectionError) as exc:
                self.refused += 1
                log.warning("hub: refused a connection: %s", exc)
                return
            while True:
                msg = ch.recv(idle=True)  # a stage's store connection idles for its life
                if not isinstance(msg, dict):
                    raise HubRefused("a frame that is not a JSON object")
                if msg.get("op") == "report":
                    if node is None:
                        node = self._claim(msg.get("node"), conn)
                    with self._nodes_lock:
                        self._nodes[node] = (conn, time.monotonic())
                    ch.send(self._on_report(msg))
                else:
                    ch.send(self._store_op(msg))
        except (HubRefused, OSError, ConnectionError, ValueError, TypeError, KeyError) as exc:
            log.debug("hub: connection closed: %s", exc)
        finally:
            if node is not None:
                with self._nodes_lock:
                    if self._nodes.get(node, (None,))[0] is conn:
                        del self._nodes[node]
            conn.close()
            self._slots.release()

    def _claim(self, node: Any, conn: socket.socket) -> int:
        """Node rank ``node`` for this connection.  While another connection of that rank reports
        (within ``STALE_NODE_S``) the newcomer is refused (two nodes with one --node-rank); a
        silent one is a connection a cut link left behind: it is closed and replaced."""
        if not isinstance(node, int) or node < 1:
            raise HubRefused(f"a report from node {node!r}")
        with self._nodes_lock:
            old = self._nodes.get(node)
            if old is not None and time.monotonic() - old[1] < STALE_NODE_S:
                raise HubRefused(f"node rank {node} is already connected and reporting (two nodes "
                                 f"started with --node-rank {node}?)")
            if old is not None:
                with contextlib.suppress(OSError):
                    old[0].shutdown(socket.SHUT_RDWR)
            self._nodes[node] = (conn, time.monotonic())
        return node

    def _store_op(self, msg: dict[str, Any]) -> dict[str, Any]:
        op, key = msg.get("op"), str(msg.get("key", ""))[:1024]
        timeout = min(float(msg.get("timeout", 60.0)), 3600.0)
        with self._cv:
            if op == "set":
                self._kv[key] = bytes.fromhex(str(msg.get("value", "")))
                self._cv.notify_all()
                return {"ok": True}
            if op in ("get", "wait"):
                keys = [str(k)[:1024] for k in msg.get("keys", [key])][:256]
                if not self._cv.wait_for(lambda: all(k in self._kv for k in keys), timeout):
                    return {"ok": False, "error": f"timed out after {timeout:g} s waiting for {keys}"}
                return {"ok": True, "value": self._kv[key].hex() if op == "get" else None}
            if op == "add":
                value = int(self._kv.get(key, b"0")) + int(msg.get("amount", 0))
                self._kv[key] = str(value).encode()
                self._cv.notify_all()
                return {"ok": True, "value": value}
            if op == "check":
                return {"ok": True, "value": all(str(k) in self._kv for k in msg.get("keys", []))}
            if op == "compare_set":
                cur, expected = self._kv.get(key), bytes.fromhex(str(msg.get("expected", "")))
                if (cur is None and not expected) or cur == expected:
                    cur = self._kv[key] = bytes.fromhex(str(msg.get("value", "")))
                    self._cv.notify_all()
                return {"ok": True, "value": cur.hex() if cur is not None else ""}
            if op == "delete":
                return {"ok": True, "value": self._kv.pop(key, None) is not None}
            if op == "num_keys":
                return {"ok": True, "value": len(self._kv)}
        return {"ok": False, "error": f"unknown op {op!r}"}


def _hex(value: Any) -> str:
    return (value.encode() if isinstance(value, str) else bytes(value)).hex()


# -- a stage's rendezvous through the hub ---------------------------------------------------------------
def hub_store(address: tuple[str, int], secret: bytes, fingerprint: str, timeout_s: float) -> Any:
    """A ``torch.distributed.Store`` whose keys live in node 0's hub (one connection per stage)."""
    import torch.distributed as dist

    class HubStore(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self._timeout = timeout_s
            self._lock = threading.Lock()
            deadline = time.monotonic() + timeout_s
            while True:  # node 0 may start a little later than this node
                try:
                    self._ch = connect(address, secret, fingerprint)
                    break
                except (OSError, ConnectionError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)

        def _call(self, **msg: Any) -> Any:
            with self._lock:
                self._ch.sock.settimeout(self._timeout + IO_TIMEOUT_S)
                self._ch.send({**msg, "timeout": self._timeout})
                reply = self._ch.recv()
            if not reply.get("ok"):
                raise RuntimeError(f"stagecache hub store: {reply.get('error')}")
            return reply.get("value")

        def set(self, key: str, value: Any) -> None:
            self._call(op="set", key=key, value=_hex(value))

        def get(self, key: str) -> bytes:
            return bytes.fromhex(self._call(op="get", key=key))

        def add(self, key: str, amount: int) -> int:
            return int(self._call(op="add", key=key, amount=int(amount)))

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            self._call(op="wait", keys=list(keys))

        def check(self, keys: list[str]) -> bool:
            return bool(self._call(op="check", keys=list(keys)))

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            return bytes.fromhex(self._call(op="compare_set", key=key, expected=_hex(expected), value=_hex(desired)))

        def delete_key(self, key: str) -> bool:
            return bool(self._call(op="delete", key=key))

        def num_keys(self) -> int:
            return int(self._call(op="num_keys"))

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self._timeout = timeout.total_seconds()

    return HubStore()


# -- a node's link (node > 0) -------------------------------------------------------------------------
class NodeLink:
    """Node ``node``'s reporter: its stages' numbers and exit codes to the hub every
    ``REPORT_INTERVAL_S``; ``on_reply`` gets the hub's answer (startup report, run phase).
    Reconnects after a cut link; never raises out of its thread."""

    def __init__(self, address: tuple[str, int], secret: bytes, fingerprint: str, node: int,
                 report: Callable[[], dict[str, Any]], on_reply: Callable[[dict[str, Any]], None]):
        self._address, self._secret, self._fp, self._node = address, secret, fingerprint, node
        self._report, self._on_reply = report, on_reply
        self._stop = threading.Event()
        self.failures = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="stagecache-node-link", daemon=True)

    def start(self) -> NodeLink:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reporting, after one last report: the hub hears this node's exit codes (a stage
        killed here is then named crashed on node 0, not unreachable)."""
        self._stop.set()
        self._thread.join(IO_TIMEOUT_S)

    def _run(self) -> None:
        ch: Channel | None = None
        last = False
        while not last:
            last = self._stop.wait(REPORT_INTERVAL_S)  # when stopping: one more report, the last
            try:
                if ch is None:  # short: a SYN lost on a cut link is retried at the next tick
                    ch = connect(self._address, self._secret, self._fp, timeout=1.5)
                    ch.sock.settimeout(2.0)
                ch.send({"op": "report", "node": self._node, "sent_at": time.time(), **self._report()})
                self._on_reply(ch.recv())
            except (HubRefused, OSError, ConnectionError, ValueError) as exc:
                self.failures += 1
                self.last_error = str(exc)
                if isinstance(exc, HubRefused):
                    log.error("node %d: the hub refused this node: %s", self._node, exc)
                elif self.failures in (1, 10) or self.failures % 100 == 0:
                    log.warning("node %d: report to the hub failed (%d so far): %s", self._node, self.failures, exc)
                if ch is not None:
                    with contextlib.suppress(OSError):
                        ch.sock.close()
                ch = None
        if ch is not None:
            with contextlib.suppress(OSError):
                ch.sock.close()


def local_ranks(pp_size: int, nnodes: int, node_rank: int) -> range:
    """The stages node ``node_rank`` runs: an equal contiguous share (``--pp-size`` % ``--nnodes`` == 0)."""
    per = pp_size // nnodes
    return range(node_rank * per, (node_rank + 1) * per)


# -- wiring a node's supervisor ---------------------------------------------------------------------------
def attach(sup: Any, opts: Any, run_dir: str) -> Callable[[], None]:
    """Node 0: start the hub (the other nodes' stages land in this run dir, on this host's clock);
    node > 0: start the link to it (the startup report comes back into this run dir).  Returns
    the function that stops it."""
    from ..live import run_dir as rd
    from ..live.numbers import StageLive
    from ..live.remote import ClockOffsets, on_receiver_clock

    if opts.node_rank == 0:
        offsets = ClockOffsets()

        def on_report(msg: dict[str, Any]) -> dict[str, Any]:
            now = time.time()
            sent_at = float(msg.get("sent_at") or now)
            node = msg.get("node")
            for key, raw in (msg.get("stages") or {}).items():
                k = int(key)
                if k in opts.local_ranks or not 0 <= k < opts.pp_size or raw is None:
                    continue
                live = StageLive.model_validate(raw)
                beat = live.heartbeat_at
                live = on_receiver_clock(live, sent_at, now, host=f"node {node}",
                                         offset=offsets.offset(str(node), sent_at, now))
                if beat:  # the stage's own heartbeat, on this clock: a stopped stage still ages
                    live.heartbeat_at = min(now, beat + live.clock_offset_s)
                rd.write_json_atomic(rd.stage_file(run_dir, k), live.model_dump(mode="json"))
            before = dict(sup.remote_exit_codes)
            for key, code in (msg.get("exit_codes") or {}).items():
                sup.remote_exit_codes[int(key)] = code if isinstance(code, int) else None
            if sup.remote_exit_codes != before:  # also after node 0's own loop ended
                sup.write_run_file()
            for key, pid in (msg.get("pids") or {}).items():
                sup.remote_pids[int(key)] = pid if isinstance(pid, int) else None
            report = sup.source.startup()
            return {"startup": report.to_dict() if report is not None else None,
                    "phase": sup.phase.value, "failure": sup.failure}

        hub = Hub(opts.master_addr, opts.master_port, opts.node_secret, opts.run_fingerprint, on_report)
        return hub.close

    def report() -> dict[str, Any]:
        stages = {str(k): rd.read_json(rd.stage_file(run_dir, k)) for k in opts.local_ranks}
        return {"stages": stages, "exit_codes": {str(p.rank): p.exitcode for p in sup.procs},
                "pids": {str(p.rank): p.pid for p in sup.procs}}

    def on_reply(reply: dict[str, Any]) -> None:
        startup = reply.get("startup")
        if startup is not None and not (Path(run_dir) / rd.STARTUP_FILE).exists():
            rd.write_json_atomic(Path(run_dir) / rd.STARTUP_FILE, startup)  # as rank 0 wrote it

    link = NodeLink(opts.hub_address, opts.node_secret, opts.run_fingerprint, opts.node_rank,
                    report, on_reply).start()
    return link.stop
