"""The hub of ``serve --nnodes`` (runtime/serve/nodes.py) without namespaces: who it refuses,
what a frame may not be, and the several-hosts flags' bad input (exit 2, one line)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from netns import wait


def test_a_second_node_with_other_options_or_rank_is_refused(tmp_path):
    """The hub refuses a node whose options differ (another run) before a frame is read."""
    from stagecache.runtime.serve.nodes import Hub, HubRefused, NodeLink, connect

    secret = os.urandom(32)
    hub = Hub("127.0.0.1", 0, secret, "run-a", lambda msg: {"startup": None})
    port = hub._listener.getsockname()[1]
    try:
        with pytest.raises(HubRefused):
            connect(("127.0.0.1", port), secret, "run-b")  # another run's options
        with pytest.raises((HubRefused, ConnectionError)):
            connect(("127.0.0.1", port), os.urandom(32), "run-a")  # no secret
        replies: list = []
        first = NodeLink(("127.0.0.1", port), secret, "run-a", 1, dict, replies.append).start()
        wait(lambda: replies, 5, "node 1's first reply")
        dup: list = []
        second = NodeLink(("127.0.0.1", port), secret, "run-a", 1, dict, dup.append).start()
        time.sleep(2)
        assert not dup and second.failures > 0  # node rank 1 is taken
        first.stop()
        second.stop()
    finally:
        hub.close()


def test_hub_frames_cannot_be_altered_replayed_or_reflected():
    from stagecache.runtime.serve.nodes import Channel, HubRefused

    def pair():
        a, b = socket.socketpair()
        a.settimeout(2)
        b.settimeout(2)
        return Channel(a, b"k" * 32, is_hub=False), Channel(b, b"k" * 32, is_hub=True), a, b

    node, hub, a, b = pair()
    node.send({"op": "num_keys"})
    assert hub.recv() == {"op": "num_keys"}
    # captured bytes of the next frame, sent twice: the copy is refused (sequence number)
    node.send({"op": "get", "key": "x"})
    frame = b.recv(1 << 16)
    a2, b2 = socket.socketpair()
    b2.settimeout(2)
    fresh = Channel(b2, b"k" * 32, is_hub=True)
    fresh._got = hub._got  # the hub as it stood
    a2.sendall(frame + frame)
    assert fresh.recv() == {"op": "get", "key": "x"}
    with pytest.raises(HubRefused):
        fresh.recv()
    # one byte altered
    node2, hub2, a3, _ = pair()
    node2.send({"op": "set", "key": "x", "value": "00"})
    data = bytearray(hub2.sock.recv(1 << 16))
    data[-3] ^= 1
    c, d = socket.socketpair()
    d.settimeout(2)
    c.sendall(bytes(data))
    with pytest.raises(HubRefused):
        Channel(d, b"k" * 32, is_hub=True).recv()
    # the hub's own frame sent back to it (reflection): another direction, refused
    node3, hub3, e, f = pair()
    hub3.send({"ok": True})
    reflected = e.recv(1 << 16)
    g, h = socket.socketpair()
    h.settimeout(2)
    g.sendall(reflected)
    with pytest.raises(HubRefused):
        Channel(h, b"k" * 32, is_hub=True).recv()
    for s in (a, b, a2, b2, a3, c, d, e, f, g, h):
        s.close()


@pytest.mark.parametrize("extra, expected", [
    (["--nnodes", "3"], "--pp-size 4 over --nnodes 3: expected a pp size that divides evenly over the nodes"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "--secret-file", "S"],
     "--node-rank 2: expected 0..1 for --nnodes 2"),
    (["--nnodes", "2", "--secret-file", "S"], "--nnodes needs --master-addr"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1"], "--nnodes needs --secret-file"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1", "--secret-file", "OPEN"], "has mode 644; expected 600"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1", "--secret-file", "SHORT"], "holds 3 bytes; expected 16 to 4096"),
    (["--node-rank", "1"], "--node-rank 1 without --nnodes"),
])
def test_bad_several_hosts_flags_are_one_line_exit_2(tmp_path, extra, expected):
    (tmp_path / "S").write_bytes(os.urandom(32))
    (tmp_path / "S").chmod(0o600)
    (tmp_path / "OPEN").write_bytes(os.urandom(32))
    (tmp_path / "OPEN").chmod(0o644)
    (tmp_path / "SHORT").write_bytes(b"abc")
    (tmp_path / "SHORT").chmod(0o600)
    proc = subprocess.run([sys.executable, "-m", "stagecache.runtime", "serve", "--pp-size", "4", *extra],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
