"""/api/advise and /advise against real uvicorn servers on 127.0.0.1, and `dashboard --advise`.

The report is the real output of `stagecache advise --json` on a Mooncake-format sample whose
file name carries HTML, so the page shows it escaped."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from mooncake_sample import write_sample
from plans import report
from serve_helpers import get_once_up
from stagecache.dashboard.advise_page import NO_REPORT, load_advise_report
from stagecache.dashboard.server import dashboard_in_thread
from stagecache.runtime.cli.main import main
from stagecache.runtime.live.source import StaticSource

HOSTILE = "<b>x&<script>.jsonl"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the advise JSON file, its dict): pp 4, tiny-v4, 32 device pages."""
    d = tmp_path_factory.mktemp("advise")
    trace = d / HOSTILE
    write_sample(trace, 300, seed=8)
    out = d / "advise.json"
    r = subprocess.run([sys.executable, "-m", "stagecache.runtime", "advise", "--trace", str(trace),
                        "--max-total-tokens", "16384", "--policies", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out.write_text(r.stdout)
    return out, json.loads(r.stdout)


@pytest.fixture(scope="module")
def clients(saved, tmp_path_factory):
    import socket
    from contextlib import ExitStack

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    with ExitStack() as stack:
        out = {}
        for name, advise in (("with", load_advise_report(saved[0])), ("without", None)):
            url = stack.enter_context(dashboard_in_thread(StaticSource(report("tiny-v4", 4)),
                                                          port=port(), advise=advise))
            assert url.startswith("http://127.0.0.1:")
            out[name] = stack.enter_context(httpx.Client(base_url=url, timeout=10))
        yield out


def test_api_advise_is_the_report_and_its_figure(clients, saved):
    r = clients["with"].get("/api/advise")
    assert r.status_code == 200
    body = r.json()
    rep = saved[1]
    for key in ("trace", "targets", "knee", "configured", "belady", "curve", "ceiling_hit_rate"):
        assert body["report"][key] == rep[key], key
    fig = body["figure"]
    meta = fig["layout"]["meta"]
    assert meta["stages"] == [0, 1, 2, 3] and meta["labelled"] == [0.9, 0.95, 0.99]
    assert meta["configured"] == {"host_pages": 64, "device_pages": 32}
    lines = [t for t in fig["data"] if t["mode"] == "lines"]
    assert len(lines) == 8  # one per stage and panel
    gib = 1 << 30
    for s, line in zip(rep["stages"], lines[:4], strict=True):
        assert line["x"][-1] == pytest.approx(rep["curve"]["pages"][-1] * s["token_page_bytes"] / gib)
        assert line["y"][-1] == pytest.approx(100 * rep["curve"]["hit_rate"][-1], abs=1e-3)
    labelled = [t for t in fig["data"] if t.get("text") == ["90%", "95%", "99%"]]
    assert len(labelled) == 8
    stars = [t for t in fig["data"] if t.get("marker", {}).get("symbol") == "star"]
    host_stars = stars[:4]  # the host panel is drawn first
    for s, star in zip(rep["stages"], host_stars, strict=True):
        assert star["x"] == [pytest.approx(64 * s["token_page_bytes"] / gib)]
        assert star["y"] == [pytest.approx(100 * rep["configured"]["hit_rate"], abs=1e-3)]
    assert "&lt;b&gt;x&amp;&lt;script&gt;" in fig["layout"]["title"]["text"]


def test_advise_page_draws_it_with_user_text_escaped(clients, saved):
    r = clients["with"].get("/advise")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert 'id="advise-figure"' in html and 'id="advise-figure-json"' in html
    assert "static/advise.js" in html and "vendor/plotly.min.js" in html
    assert HOSTILE not in html and "<script>.jsonl" not in html
    assert "&lt;b&gt;x&amp;&lt;script&gt;.jsonl" in html
    assert "--hicache-ratio" in html and html.count('<tr data-stage=') == 4
    assert clients["with"].get("/static/advise.js").status_code == 200
    assert "/advise" in clients["with"].get("/").text  # the stages page links it


def test_policies_figure_and_tables(clients, saved):
    """A report made with --policies: /api/advise carries the policy figure (one line per policy
    and tier, Belady's diamonds), /advise draws it and its tables."""
    pol = saved[1]["policies"]
    body = clients["with"].get("/api/advise").json()
    assert body["report"]["policies"]["tiers"] == pol["tiers"]
    fig = body["policy_figure"]
    labels = [p["label"] for p in pol["policies"]]
    assert fig["layout"]["meta"] == {"policies": labels, "tiers": ["device", "host"]}
    lines = [t for t in fig["data"] if t["mode"] == "lines+markers"]
    assert len(lines) == 2 * len(labels)
    for tier, first in zip(pol["tiers"], (lines[0], lines[len(labels)]), strict=True):
        sizes = sorted(tier["sizes"], key=lambda r: r["pages"])
        assert first["x"] == [r["pages"] for r in sizes]
        assert first["y"] == [pytest.approx(100 * r["hit_rate"]["lru"], abs=1e-3) for r in sizes]
    diamonds = [t for t in fig["data"] if t.get("marker", {}).get("symbol") == "diamond-open"]
    assert len(diamonds) == 2
    html = clients["with"].get("/advise").text
    assert 'id="advise-policy-figure"' in html and 'id="advise-policy-figure-json"' in html
    assert html.count('class="advise-policy-targets"') == 2
    assert "--radix-eviction-policy" in html and html.count('<tr data-policy-stage=') == 4
    without = clients["without"].get("/api/advise")
    assert without.status_code == 404


def test_without_a_report_both_say_how_to_get_one(clients):
    r = clients["without"].get("/api/advise")
    assert r.status_code == 404 and r.json() == {"detail": NO_REPORT}
    page = clients["without"].get("/advise")
    assert page.status_code == 404 and "--advise FILE" in page.text
    assert "/api/advise" in clients["without"].get("/openapi.json").json()["paths"]


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON (line 1"),
    (json.dumps({"trace": {}}), "not an advise report: trace.source: Field required"),
    ("[]", "not an advise report: the report: Input should be a valid dictionary"),
])
def test_dashboard_refuses_a_bad_advise_file(tmp_path, capsys, content, message):
    bad = tmp_path / "a.json"
    bad.write_text(content)
    assert main(["dashboard", "--from-check", "--model", "tiny-v4", "--advise", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err


def test_dashboard_refuses_a_report_of_another_pp_size(saved, capsys):
    assert main(["dashboard", "--from-check", "--model", "tiny-v4", "--pp-size", "2",
                 "--advise", str(saved[0])]) == 2
    assert "a report of pp=4, but the dashboard shows pp=2" in capsys.readouterr().err


def test_dashboard_process_serves_the_report(saved, free_port):
    proc = subprocess.Popen(
        [sys.executable, "-m", "stagecache.runtime", "dashboard", "--from-check", "--model", "tiny-v4",
         "--advise", str(saved[0]), "--port", str(free_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert f"advise: http://127.0.0.1:{free_port}/advise" in line, line
        r = get_once_up(proc, f"http://127.0.0.1:{free_port}/api/advise")
        assert r.status_code == 200 and r.json()["report"]["targets"] == saved[1]["targets"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
