"""`stagecache advise` as a user runs it: the report against the curves and the plan, the same
capacity ledger as `stagecache pools`, the tables, the standalone plot, and bad input."""

from __future__ import annotations

import json

import pytest
from cli_traces import advise_json, trace_fixtures
from stagecache.runtime.cli.main import main
from stagecache.runtime.model.families.deepseek_v4 import FAMILY
from stagecache.runtime.plan.inputs import resolve_plan
from stagecache.runtime.plan.plan import Sizing
from stagecache.runtime.sizing.advice import TARGETS, hicache_ratio_for
from stagecache.runtime.sizing.curves import page_views, trace_curves
from stagecache.runtime.traces.readers import load_requests

HICACHE_SIZE_REFUSED = FAMILY.host_size_refusal()


mooncake, tokens = trace_fixtures("advise", requests=150)


def test_report_is_the_curves_priced_by_the_plan(mooncake, capsys):
    rep = advise_json(capsys, "--trace", str(mooncake), "--model", "deepseek-v4-flash",
                      "--pp-size", "4", "--max-total-tokens", "16384")
    curves = trace_curves(page_views(load_requests(mooncake).requests, 512))
    plan = resolve_plan("deepseek-v4-flash", 4, 1, None, 512, None,
                        Sizing.sglang(max_total_tokens=16384))
    assert rep["trace"]["format"] == "mooncake" and rep["trace"]["page_size"] == 512
    assert rep["ceiling_hit_rate"] == curves.total.ceiling_tokens / curves.input_tokens
    conf = rep["configured"]
    assert conf["device_pages"] == 16384 // 512 == plan.stage(0).device_pages
    assert conf["host_pages"] == 2 * conf["device_pages"]
    assert conf["hit_rate"] == curves.total.rate(conf["host_pages"])
    assert [t["share"] for t in rep["targets"]] == list(TARGETS)
    for t in rep["targets"]:
        host, dev = t["host"]["pages"], t["device"]["pages"]
        assert host == curves.total.pages_for(t["share"]) and dev == curves.device.pages_for(t["share"])
        ratio = t["host"]["hicache_ratio"]
        if ratio is None:  # the configured device tier alone reaches it
            assert curves.device.at(conf["device_pages"]) >= t["share"] * curves.device.ceiling_tokens
        else:
            assert ratio == hicache_ratio_for(host, conf["device_pages"]) > 1
            assert int(conf["device_pages"] * ratio) >= host > int(conf["device_pages"] * (ratio - 0.01))
        assert t["device"]["max_total_tokens"] == dev * 512
    assert [t["host"]["hicache_ratio"] is None for t in rep["targets"]] == [True, False, False, False]
    per_page = [s.token_page_bytes for s in plan.stages]
    assert len(set(per_page)) > 1  # stages differ: that is the point of pricing per stage
    for s, b in zip(rep["stages"], per_page, strict=True):
        assert s["token_page_bytes"] == b
        assert [x["host_bytes"] for x in s["targets"]] == [t["host"]["pages"] * b for t in rep["targets"]]
        assert s["configured"]["host_bytes"] == conf["host_pages"] * b
    assert {b["pages"] for b in rep["belady"]} == {t["host"]["pages"] for t in rep["targets"]} | {
        conf["host_pages"]}
    assert all(b["hit_rate"] >= b["lru_hit_rate"] for b in rep["belady"])
    assert any(HICACHE_SIZE_REFUSED in n for n in rep["notes"])
    assert rep["deployment"] is None and all(s["capacity"] is None for s in rep["stages"])
    assert len(rep["curve"]["pages"]) == len(rep["curve"]["hit_rate"]) > 100


def test_ledger_is_the_one_pools_prints(tokens, capsys):
    """Same flags, same ledger: at sglang's 256-token page both commands read one plan."""
    budget = ["--mem-budget-gb", "3", "2.5", "3", "2"]
    rep = advise_json(capsys, "--trace", str(tokens), "--model", "deepseek-v4-flash",
                      "--pp-size", "4", *budget)
    assert main(["pools", "--model", "deepseek-v4-flash", "--pp-size", "4", *budget, "--json"]) == 0
    pools = json.loads(capsys.readouterr().out)
    assert rep["deployment"] == pools["deployment"] and rep["deployment"]["stranded_bytes"] > 0
    assert [s["capacity"] for s in rep["stages"]] == [s["capacity"] for s in pools["stages"]]
    assert rep["configured"]["max_total_tokens"] == pools["deployment"]["tokens"]
    assert main(["advise", "--trace", str(tokens), "--model", "deepseek-v4-flash",
                 "--pp-size", "4", *budget]) == 0
    out = capsys.readouterr().out
    assert "capacity: the deployment holds" in out and "stranded" in out


def test_tables_and_standalone_plot(tokens, tmp_path, capsys):
    plot = tmp_path / "advise.html"
    assert main(["advise", "--trace", str(tokens), "--page-size", "128", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    for needle in ("infinite-cache hit rate", "--hicache-ratio", "--max-total-tokens", "knee",
                   "configured", "host 90%", "device 99%", "does not support a host size in bytes"):
        assert needle in out, needle
    html = plot.read_text()
    assert html.lstrip().lower().startswith("<!doctype html>") and "Plotly.newPlot" in html and len(html) > 1_000_000
    assert "device + host hit rate vs host GiB per stage" in html


@pytest.mark.parametrize("lines, message", [
    ("", "is empty: no requests to size a cache by"),
    ("\n\n", "is empty: no requests to size a cache by"),
    ('{"session": "a", "turn": 0, "input_len": 100, "output_len": 10}\n'
     '{"session": "a", "turn": 1, "input_len": 200, "output_len": 10}\n',
     "shorter than one page: no prompt spans more than one page of 256 tokens (the longest has 200)"),
    ('{"input_length": 1000, "output_length": 1, "hash_ids": [1, 2]}\n'
     '{"input_length": 1000, "output_length": 1, "hash_ids": [3, 2]}\n',
     "hash_ids[1] = 2 follows id 3 here but followed id 1 earlier"),
])
def test_bad_traces_are_one_line_exit_2(tmp_path, capsys, lines, message):
    path = tmp_path / "t.jsonl"
    path.write_text(lines)
    assert main(["advise", "--trace", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, message", [
    (["--mem-budget-gb", "0.001"], "memory budget 1073741 B holds no full page"),
    (["--mem-budget-gb", "1", "0.0001", "1", "1"], "stage 1: memory budget 107374 B holds no full page"),
    (["--mem-budget-gb", "1", "1"], "--mem-budget-gb has 2 values; expected one for every stage"),
    (["--hicache-size-gb", "10"], HICACHE_SIZE_REFUSED),
    # --page-size for DeepSeek-V4 is sglang's own 256 whatever is asked: tests/cli/test_advise_page_size.py
    (["--trace", "{missing}/t.jsonl"], "trace '{missing}/t.jsonl': cannot read"),
    (["--plot", "{missing}/a.html"], "--plot {missing}/a.html: cannot write it"),
])
def test_bad_flags_are_one_line_exit_2(tokens, tmp_path, capsys, argv, message):
    missing = str(tmp_path / "no-such-dir")
    argv = [a.format(missing=missing) for a in argv]
    message = message.format(missing=missing)
    assert main(["advise", "--trace", str(tokens), "--no-belady", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err


def test_mooncake_page_is_the_block(mooncake, capsys):
    assert main(["advise", "--trace", str(mooncake), "--page-size", "256"]) == 2
    assert "in Mooncake format one block is one page" in capsys.readouterr().err
    rep = advise_json(capsys, "--trace", str(mooncake), "--block-tokens", "512", "--no-belady")
    assert rep["plan"]["page_size"] == 512 and rep["belady"] == []


def test_docs_examples_run(tmp_path):
    """Every command of docs/advise.md's bash blocks runs as written (exit 0); commands anywhere
    else in the page sit in blocks marked as not run."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "advise.md").read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", doc, flags=re.S)
    run = [line for lang, body in blocks if lang == "bash" for line in body.splitlines()
           if line.startswith("stagecache ")]
    assert len(run) == 5
    assert "Not run by the tests" in doc
    for line in run:
        cmd = line.replace("stagecache ", f"{sys.executable} -m stagecache.runtime ", 1)
        r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, (line, r.stderr[-2000:])
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["max_abs_diff_pp"] == {"device": 0.0, "total": 0.0}
    assert json.loads((tmp_path / "advise.json").read_text())["plan"]["model"] == "deepseek-v4-flash"
    assert (tmp_path / "advise.html").stat().st_size > 1_000_000
    pol = json.loads((tmp_path / "policies.json").read_text())["policies"]
    assert [p["name"] for p in pol["policies"]] == ["lru", "lfu", "slru", "priority", "tlru"]


def test_progress_reports_every_phase_and_the_bar_draws_them(tokens):
    import io

    from rich.console import Console
    from stagecache.runtime.cli.advise import ProgressBar, advise
    from stagecache.runtime.cli.main import build_parser

    heard: list[tuple[str, int, int]] = []
    args = build_parser().parse_args(["advise", "--trace", str(tokens), "--page-size", "128"])
    advise(args, lambda phase, done, total: heard.append((phase, done, total)))
    phases = list(dict.fromkeys(p for p, _, _ in heard))
    assert phases == ["reading the trace", "page keys", "stack distances", "Belady"]
    last = {p: (d, t) for p, d, t in heard}
    assert all(d == t > 0 for d, t in last.values()), last  # every phase ends complete
    for terminal, drawn in ((True, True), (False, False)):
        out = io.StringIO()
        with ProgressBar(Console(file=out, force_terminal=terminal, width=100)) as bar:
            bar("stack distances", 3, 10)
        assert ("stack distances" in out.getvalue()) is drawn
