"""Only the run's stages can take part in its rendezvous and startup exchange.

Threat: another local user on the host.  The rendezvous is a file in the 0700 run dir, so a
foreign uid cannot open it (nor list the dir); nothing listens for it.  Whatever a foreign
process sends to the stages' data-plane listeners is never unpickled: the startup exchange
is JSON sealed with the run's secret, and a message that fails the seal is refused unread.
"""

from __future__ import annotations

import errno
import os
import pickle
import socket
import time

import pytest
from attacker import as_nobody, shared_tmp
from serve_helpers import (
    listening_sockets,
    process_tree,
    read_json,
    stage_pids,
    start,
    stop,
    wait_for,
)
from stagecache.runtime.serve.exchange import ExchangeRefused, seal, unseal

PACED = ["--model", "tiny-v4", "--pp-size", "2", "--device-pages", "24", "--micro-batch", "2",
         "--rate", "20", "--requests", "400", "--no-dashboard", "--exit-after-run"]
SECRET = bytes(range(32))


class _Planted:
    """Unpickling this runs ``os.system``: a stage that unpickled it would leave the marker."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_sealed_message_round_trips_and_a_forged_one_is_refused_unread(tmp_path):
    assert unseal(SECRET, seal(SECRET, {"stage": 1, "ok": True}), "stage 1") == {"stage": 1, "ok": True}
    marker = tmp_path / "pwned"
    forged = os.urandom(32) + pickle.dumps(_Planted(str(marker)))
    with pytest.raises(ExchangeRefused, match="from stage 1 failed the run's authentication"):
        unseal(SECRET, forged, "stage 1")
    with pytest.raises(ExchangeRefused):  # right payload, sealed with another secret
        unseal(SECRET, seal(b"x" * 32, {"stage": 1}), "stage 1")
    assert not marker.exists()


def _serving(run_dir, k):
    return lambda: (read_json(run_dir / f"stage-{k}.json") or {}).get("phase") == "serving"


def test_a_foreign_user_can_neither_open_the_rendezvous_nor_make_a_stage_unpickle(tmp_path):
    with shared_tmp() as shared:
        run_dir, out, marker = shared / "run", tmp_path / "out.txt", shared / "pwned"
        proc = start([*PACED, "--run-dir", str(run_dir)], out)
        try:
            for k in range(2):
                wait_for(_serving(run_dir, k), 90, f"stage {k} to serve", proc, out)
            stages = stage_pids(run_dir)
            ports = sorted({port for pid, _, _, port in listening_sockets(process_tree(proc.pid))
                            if pid in stages})
            store = next(run_dir.glob("rendezvous-*.store"), None)

            def attack() -> None:
                for path, opener in ((run_dir, os.listdir),
                                     (store or run_dir / "rendezvous.store", open)):
                    try:
                        opener(path)
                    except PermissionError:
                        continue
                    raise AssertionError(f"uid 65534 could open {path}")
                payload = pickle.dumps(_Planted(str(marker)))
                for port in ports:  # the data plane: whatever listens, it gets a pickle
                    try:
                        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                            s.sendall(payload * 4)
                            time.sleep(0.2)
                    except OSError as exc:
                        assert exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.EPIPE)

            as_nobody(attack)
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                stop(proc)
        assert not marker.exists(), "a stage unpickled what a foreign process sent"
        assert ports, "no stage listener found: the test attacked nothing"
        text = out.read_text()
        assert "Traceback" not in text
        print(f"serve exit code after the attack: {code}; stage listeners attacked: {ports}")
        assert code in (0, 1), text  # served, or stopped cleanly naming the stage that failed
