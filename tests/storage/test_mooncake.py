"""Mooncake Store through a real ``mooncake_master`` on 127.0.0.1 (started and stopped by pid)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from l3_support import mooncake_master, need_mooncake
from stagecache.runtime.storage.base import Outcome, StoreUnavailable
from stagecache.runtime.storage.master import MooncakeMaster, free_port, parse_address

KEY = "sc1.0123456789abcdef.t0.p0.L0-2.swa.0000000000000001"


def _store(address: str, **kw):
    from stagecache.runtime.storage.mooncake import MooncakeStore

    return MooncakeStore(address, 64 << 20, **kw)


def test_master_binds_loopback_and_stops_by_pid():
    with mooncake_master() as master:
        pid = master.pid
        assert master.address.startswith("127.0.0.1:") and master.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_missing_key_is_not_a_failed_transfer():
    with mooncake_master() as master, _store(master.address) as store:
        buf = torch.zeros(4096, dtype=torch.uint8)
        store.register([buf])
        assert store.batch_get_into([KEY], [[buf]]) == [Outcome.MISSING]
        assert store.stats.misses == 1 and store.stats.error_count == 0
        store.batch_set_from([KEY], [[buf[:100]]])
        # the object is there but of another size: not this page's bytes
        assert store.batch_get_into([KEY], [[buf]]) == [Outcome.CORRUPT]


def test_no_master_is_one_clear_error():
    need_mooncake()
    with pytest.raises(StoreUnavailable, match="cannot join the master at 127.0.0.1"):
        _store(f"127.0.0.1:{free_port()}")


def test_a_full_store_refuses_with_a_counted_error():
    with mooncake_master() as master, _store(master.address) as store:
        big = torch.zeros(80 << 20, dtype=torch.uint8)  # more than the 64 MiB segment
        store.register([big])
        assert store.batch_set_from([KEY], [[big]]) == [Outcome.NO_SPACE]
        assert store.stats.errors["no_space"] == 1


def test_master_killed_then_restarted_marks_the_store_down_then_up():
    with mooncake_master() as master:
        port = int(parse_address(master.address)[1])
        with _store(master.address, probe_interval=0.2) as store:
            page = torch.arange(4096, dtype=torch.int32).view(torch.uint8)[:4096].clone()
            store.register([page])
            assert store.batch_set_from([KEY], [[page]]) == [Outcome.OK]
            came_back = []
            store.on_up.append(lambda: came_back.append(True))
            master.stop()
            assert store.batch_get_into([KEY], [[page]]) == [Outcome.FAILED]
            assert store.health()[0] is False and "unreachable" in store.health()[1]
            t0 = time.monotonic()
            assert store.batch_set_from([KEY], [[page]]) == [Outcome.DOWN]  # not tried: no 4 s wait
            assert time.monotonic() - t0 < 0.5
            again = MooncakeMaster(rpc_port=port)
            again.start()
            try:
                deadline = time.monotonic() + 20
                # the probe thread marks the store up, then calls on_up: wait for both
                while not (store.health()[0] and came_back) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert store.health() == (True, None) and came_back == [True]
                # a restarted master holds no keys; writes work again
                assert store.batch_exists([KEY]) == 0
                assert store.batch_set_from([KEY], [[page]]) == [Outcome.OK]
                s = store.stats
                assert s.downs == 1 and s.errors["failed"] == 1 and s.skipped == 1
            finally:
                again.stop()
