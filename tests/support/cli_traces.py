"""Trace files and ``--json`` runs for the CLI tests (advise, advise --policies, the family commands)."""

from __future__ import annotations

import json
from pathlib import Path

from mooncake_sample import write_sample
from stagecache.runtime.cli.main import main
from stagecache.runtime.traces.readers import WorkloadConfig, generate, write_trace


def mooncake_file(folder: Path) -> Path:
    """``folder/mooncake.jsonl``: the 400-request Mooncake sample, seed 4."""
    path = folder / "mooncake.jsonl"
    write_sample(path, 400, seed=4)
    return path


def tokens_file(folder: Path, requests: int, seed: int) -> Path:
    """``folder/tokens.jsonl``: a generated tokens trace (5 s think time)."""
    path = folder / "tokens.jsonl"
    write_trace(path, generate(WorkloadConfig(seed=seed, requests=requests, think_time_s=5.0)))
    return path


def run_json(capsys, *argv: str) -> dict:
    """``stagecache ARGV --json``: exit 0, its output parsed."""
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)
