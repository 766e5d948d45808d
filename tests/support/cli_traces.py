"""Trace files and ``--json`` runs for the CLI tests (advise, advise --policies, the family commands)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
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


def trace_fixtures(folder: str, requests: int) -> tuple[Any, Any]:
    """A test module's ``mooncake`` and ``tokens`` fixtures (module scope): the Mooncake sample and a
    ``requests``-request tokens trace (seed 2), each in a new folder named after ``folder``."""

    @pytest.fixture(scope="module")
    def mooncake(tmp_path_factory):
        return mooncake_file(tmp_path_factory.mktemp(folder))

    @pytest.fixture(scope="module")
    def tokens(tmp_path_factory):
        return tokens_file(tmp_path_factory.mktemp(folder), requests=requests, seed=2)

    return mooncake, tokens


def advise_json(capsys, *argv: str) -> dict:
    """``stagecache advise ARGV --json``."""
    return run_json(capsys, "advise", *argv)


def run_json(capsys, *argv: str) -> dict:
    """``stagecache ARGV --json``: exit 0, its output parsed."""
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)
