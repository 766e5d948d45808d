"""A Hugging Face repo id as ``--model``: the config.json of the local HF cache, laid out the way
huggingface_hub lays it out (a blob, a snapshot symlink, ``refs/main``), or one line, exit 2."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
from stagecache.runtime.cli.main import main
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.hf_cache import cached_config, hub_cache, is_repo_id

REPO = "deepseek-ai/DeepSeek-V4-Flash"
MAIN = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"


def _preset(name: str) -> dict:
    text = resources.files("stagecache.runtime.model").joinpath("presets", f"{name}.json").read_text()
    return json.loads(text)


def put_snapshot(hub: Path, commit: str, cfg: dict, main: bool) -> Path:
    """One snapshot as huggingface_hub writes it: the file is a blob, the snapshot links to it."""
    repo = hub / f"models--{REPO.replace('/', '--')}"
    blob = repo / "blobs" / f"blob-{commit}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_text(json.dumps(cfg))
    link = repo / "snapshots" / commit / "config.json"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(Path("../../blobs") / blob.name)
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(MAIN)
    return link


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_repo_ids_are_told_from_paths_and_presets():
    assert is_repo_id(REPO) and is_repo_id("Qwen/Qwen3-8B")
    for not_id in ("tiny-v4", "config.json", "a/b/config.json", "org/model.json", "../x", "a/b/c", "/abs"):
        assert not is_repo_id(not_id), not_id


def test_the_cache_is_found_where_huggingface_hub_looks(clean_env, tmp_path):
    assert hub_cache() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    clean_env.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache() == tmp_path / "hf" / "hub"
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache() == tmp_path / "hub"


def test_a_cached_repo_id_loads_the_main_snapshots_config(clean_env, tmp_path):
    clean_env.setenv("HF_HOME", str(tmp_path / "hf"))
    hub = tmp_path / "hf" / "hub"
    tiny = _preset("tiny-v4")
    put_snapshot(hub, OLD, tiny, main=False)  # an older snapshot: a different model
    link = put_snapshot(hub, MAIN, _preset("deepseek-v4-flash"), main=True)
    assert cached_config(REPO) == link
    spec = load_spec(REPO)
    assert spec.num_layers == 43 and spec.name == str(link)
    assert main(["check", "--model", REPO, "--pp-size", "4"]) == 0


def test_without_refs_main_the_newest_snapshot_is_read(clean_env, tmp_path):
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    link = put_snapshot(tmp_path / "hub", OLD, _preset("tiny-v4"), main=False)
    assert cached_config(REPO) == link and load_spec(REPO).num_layers == 12


def test_a_repo_id_not_in_the_cache_is_one_line_exit_2(clean_env, tmp_path, capsys):
    clean_env.setenv("HF_HOME", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="pass the file instead: --model path/to/config.json"):
        load_spec(REPO)
    assert main(["check", "--model", REPO]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert REPO in err and str(tmp_path / "empty" / "hub") in err and "HF_HUB_CACHE" in err
