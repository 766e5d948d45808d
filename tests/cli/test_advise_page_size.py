"""`stagecache advise` sizes with the page size sglang really runs the model family with
(``Family.sglang_page_size``: DSA 64 tokens, DeepSeek-V4 256), as `stagecache pools` does, and says
so in the same one-line note when that overrides ``--page-size``."""

from __future__ import annotations

import pytest
from cli_traces import mooncake_file, run_json, tokens_file
from stagecache.runtime.sizing.curves import page_views, trace_curves
from stagecache.runtime.traces.readers import load_requests


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return tokens_file(tmp_path_factory.mktemp("advise-page"), requests=150, seed=2)


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    return mooncake_file(tmp_path_factory.mktemp("advise-page"))


def _override_notes(report: dict) -> list[str]:
    return [n for n in report["notes"] if "it overrides --page-size" in n or "its block of" in n]


@pytest.mark.parametrize(("model", "asked", "real"), [("deepseek-v3.2", 256, 64), ("glm-5.2", 128, 64),
                                                      ("deepseek-v4-flash", 64, 256), ("tiny-v4", 100, 256),
                                                      ("llama-3.1-8b", 64, 64), ("qwen3.5-0.8b", 128, 128)])
def test_advise_sizes_with_the_familys_page_and_notes_it_as_pools_does(tokens, capsys, model, asked, real):
    flags = ["--model", model, "--pp-size", "2", "--page-size", str(asked)]
    rep = run_json(capsys, "advise", "--trace", str(tokens), "--no-belady", *flags)
    pools = run_json(capsys, "pools", *flags)
    assert rep["plan"]["page_size"] == rep["trace"]["page_size"] == pools["page_size"] == real
    notes = _override_notes(rep)
    assert notes == _override_notes(pools)  # the same line as pools prints
    assert notes == ([] if asked == real else
                     [next(n for n in pools["notes"] if f"with page_size {real} (it overrides --page-size {asked})" in n)])
    # the curves are those of the real page: the trace's pages keyed at 64 (DSA) tokens, not the flag's
    curves = trace_curves(page_views(load_requests(tokens).requests, real))
    assert rep["full_pages"]["host"] == curves.total.full_pages
    assert rep["ceiling_hit_rate"] == curves.total.ceiling_tokens / curves.input_tokens


def test_a_mooncake_trace_keeps_its_block_as_the_page_and_says_what_sglang_uses(mooncake, capsys):
    rep = run_json(capsys, "advise", "--trace", str(mooncake), "--no-belady", "--model", "deepseek-v3.2",
                   "--pp-size", "2")
    assert rep["plan"]["page_size"] == rep["trace"]["page_size"] == 512
    [note] = _override_notes(rep)
    assert "page_size 64" in note and "its block of 512 tokens" in note
