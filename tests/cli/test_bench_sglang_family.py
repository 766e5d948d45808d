"""``stagecache bench sglang-hooks --family``: the families the flag takes are the bench's, and a
wrong one is refused in one line (exit 2) before anything imports sglang."""

from __future__ import annotations

from stagecache.runtime.bench import sglang_hooks
from stagecache.runtime.cli import bench_sglang
from stagecache.runtime.cli.main import main


def test_the_flag_takes_every_family_the_bench_runs():
    assert bench_sglang.FAMILIES == sglang_hooks.FAMILIES
    assert sglang_hooks.FAMILIES[0] == "deepseek_v4"


def test_an_unknown_family_is_refused_in_one_line(capsys):
    assert main(["bench", "sglang-hooks", "--family", "llama"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--family: invalid choice: 'llama'" in err and "swa_hybrid" in err, err
