"""A real Prometheus scrapes a real ``stagecache serve`` with the shipped config and rules.

The Prometheus config is generated from docker/prometheus.yml by parsing it: same
job, labels, intervals and rule file (docker/alerts.yml), only the target address
is rewritten from the compose service name to this test's 127.0.0.1 ports. Two
targets sit in that job: ``stagecache serve --model tiny-v4 --pp-size 4`` (healthy,
a bounded trace) and ``stagecache dashboard --from-check ... --fault global-swa``
(the original PP + HiCache bug, so the mapping alerts have something to fire on).
Every process is started in its own session and killed by the fixture; every wait
is bounded.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
JOB = "stagecache"
PP = 4
LAYERS_PER_STAGE = 3  # tiny-v4: 12 layers over 4 stages
READY_S = 60.0  # bound on every "wait until" below

pytestmark = pytest.mark.skipif(
    not os.access(PROMETHEUS, os.X_OK),
    reason=f"no Prometheus server binary at {PROMETHEUS} (Debian package `prometheus`, "
    "installed by tests/setup.d/10-system-packages.sh)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_config(targets: list[str]) -> dict[str, Any]:
    """docker/prometheus.yml with the stagecache job pointed at ``targets``, rules by absolute path."""
    cfg = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    jobs = [j for j in cfg["scrape_configs"] if j["job_name"] == JOB]
    assert len(jobs) == 1, f"docker/prometheus.yml must have exactly one {JOB!r} job"
    (static,) = jobs[0]["static_configs"]
    static["targets"] = targets
    cfg["rule_files"] = [str(DOCKER / f) for f in cfg["rule_files"]]
    return cfg


class EarlyExit(AssertionError):
    """A process of the stack exited while the test still needed it."""

    def __init__(self, proc: Proc):
        self.proc = proc
        super().__init__(f"{proc.name} exited early with {proc.popen.returncode}:\n{proc.tail()}")

    @property
    def port_clash(self) -> bool:
        """Lost a free-port race (the port was taken between choosing and binding it)."""
        return bool(re.search(r"address already in use|cannot listen on", self.proc.tail().lower()))


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise EarlyExit(self)

    stopped: bool = False

    def stop(self) -> None:
        """SIGTERM, bounded wait, then SIGKILL to the process group (stage children included)."""
        if self.stopped:  # never signal a group id twice: it may belong to someone else by now
            return
        self.stopped = True
        pgid = self.popen.pid  # start_new_session: the group is ours alone
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def start(name: str, argv: list[str], logdir: Path, procs: list[Proc]) -> Proc:
    log = logdir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, cwd=logdir)
    proc = Proc(name, popen, log)
    procs.append(proc)
    return proc


def wait_for(what: str, probe: Callable[[], Any], procs: list[Proc], timeout: float = READY_S) -> Any:
    """Poll ``probe`` until it returns something truthy; fail with the processes' logs."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        for p in procs:
            p.check_alive()
        try:
            last = probe()
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.name}:\n{p.tail()}" for p in procs)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})\n{logs}")


@dataclass
class Stack:
    prom: str  # base URL of Prometheus
    serve: str  # instance label of stagecache serve
    faulty: str  # instance label of the global-swa preflight dashboard
    procs: list[Proc]
    client: httpx.Client

    def api(self, path: str, **params: str) -> Any:
        r = self.client.get(f"{self.prom}/api/v1/{path}", params=params)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def wait_query(self, what: str, expr: str, ok: Callable[[list[dict[str, Any]]], bool]) -> list:
        return wait_for(what, lambda: (lambda r: r if ok(r) else None)(self.query(expr)), self.procs)


def launch(tmp: Path, procs: list[Proc], client: httpx.Client) -> Stack:
    """Start serve, the faulty preflight dashboard and Prometheus; wait for a full scrape."""
    serve_port, faulty_port, prom_port = free_port(), free_port(), free_port()
    serve_addr, faulty_addr = f"127.0.0.1:{serve_port}", f"127.0.0.1:{faulty_port}"
    exe = [sys.executable, "-m", "stagecache.runtime"]
    tmp.mkdir()
    # A bounded trace; the parent keeps /metrics up (bounded too) after it is served.
    start("serve", [*exe, "serve", "--model", "tiny-v4", "--pp-size", str(PP), "--requests", "64",
                    "--host", "127.0.0.1", "--port", str(serve_port), "--run-dir", str(tmp / "run"),
                    "--hold-seconds", "240"], tmp, procs)
    start("faulty-dashboard", [*exe, "dashboard", "--from-check", "--model", "tiny-v4",
                               "--pp-size", str(PP), "--fault", "global-swa",
                               "--port", str(faulty_port)], tmp, procs)
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config([serve_addr, faulty_addr])))
    start("prometheus", [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                         f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
          tmp, procs)
    st = Stack(f"http://127.0.0.1:{prom_port}", serve_addr, faulty_addr, procs, client)
    wait_for("Prometheus /-/ready", lambda: client.get(f"{st.prom}/-/ready").status_code == 200, procs)

    def targets_up() -> bool:
        active = st.api("targets", state="active")["activeTargets"]
        return {t["labels"]["instance"] for t in active if t["health"] == "up"} == {serve_addr,
                                                                                      faulty_addr}

    wait_for("both stagecache targets to be scraped (health up)", targets_up, procs)
    # /metrics answers before every stage has reported; wait for a scrape with all stages.
    st.wait_query("a scrape with every stage of both targets",
                  "count by (instance) (stagecache_stage_local_layers)",
                  lambda r: {x["metric"]["instance"]: x["value"][1] for x in r}
                  == {serve_addr: str(PP), faulty_addr: str(PP)})
    return st


def stop_all(procs: list[Proc]) -> None:
    for p in reversed(procs):
        p.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prometheus")
    client = httpx.Client(timeout=5.0)
    procs: list[Proc] = []
    try:
        for attempt in (1, 2):  # a second try only when a free port was stolen meanwhile
            procs = []
            try:
                st = launch(tmp / f"attempt{attempt}", procs, client)
                break
            except EarlyExit as exc:
                stop_all(procs)
                if attempt == 2 or not exc.port_clash:
                    raise
        yield st
    finally:
        stop_all(procs)
        client.close()


def by_stage(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"]["pp_rank"]: float(r["value"][1]) for r in result}


def test_the_docker_job_scrapes_both_targets(stack: Stack) -> None:
    active = stack.api("targets", state="active")["activeTargets"]
    assert {t["labels"]["instance"] for t in active} == {stack.serve, stack.faulty}
    static_labels = yaml.safe_load((DOCKER / "prometheus.yml").read_text())["scrape_configs"][0][
        "static_configs"][0].get("labels", {})
    for t in active:
        assert t["health"] == "up", t
        assert t["labels"]["job"] == JOB
        assert t["scrapeUrl"].endswith("/metrics")
        for k, v in static_labels.items():  # the config's own labels survive the rewrite
            assert t["labels"][k] == v


def test_local_layers_of_every_stage(stack: Stack) -> None:
    result = stack.query(f'stagecache_stage_local_layers{{job="{JOB}",instance="{stack.serve}"}}')
    assert by_stage(result) == {str(k): float(LAYERS_PER_STAGE) for k in range(PP)}


def test_host_hit_ratio_of_every_stage(stack: Stack) -> None:
    """From the counters, per stage: host hits / lookups is a real fraction; the recording rule
    has one series per stage (NaN when nothing was looked up in its window, as rate() gives)."""
    sel = f'job="{JOB}",instance="{stack.serve}"'
    result = stack.wait_query(
        "looked-up tokens with host hits on every stage",
        f'sum by (pp_rank) (stagecache_prefix_hit_tokens_total{{{sel},tier="host"}})'
        f' / sum by (pp_rank) (stagecache_prefix_lookup_tokens_total{{{sel}}})',
        lambda r: len(r) == PP and all(0 < float(x["value"][1]) < 1 for x in r))
    assert set(by_stage(result)) == {str(k) for k in range(PP)}
    rule = stack.wait_query("the 5-minute host hit ratio rule", f"stagecache:prefix_host_hit_ratio:rate5m{{{sel}}}",
                            lambda r: len(r) == PP)
    assert all(v != v or 0.0 <= v <= 1.0 for v in by_stage(rule).values())  # NaN or a fraction


def test_info_metrics_and_model_name(stack: Stack) -> None:
    (model,) = stack.query(f'stagecache_model_info{{instance="{stack.serve}"}}')
    assert model["metric"]["model_name"] == "tiny-v4" and model["metric"]["pp_size"] == str(PP)
    assert stack.query(f'stagecache_build_info{{instance="{stack.serve}"}}')[0]["metric"]["version"]
    names = {r["metric"]["model_name"] for r in stack.query(
        f'stagecache_requests_total{{instance="{stack.serve}"}}')}
    assert names == {"tiny-v4"}


def test_page_spaces_are_counted_once(stack: Stack) -> None:
    """Per stage: one device and one host page space, whatever pools share them."""
    result = stack.query(f'count by (pp_rank) (stagecache_page_space_capacity_pages{{instance="{stack.serve}"}})')
    assert by_stage(result) == {str(k): 2.0 for k in range(PP)}


def test_serve_stages_pass_validation(stack: Stack) -> None:
    ok = by_stage(stack.query(f'stagecache_stage_mapping_ok{{instance="{stack.serve}"}}'))
    assert ok == {str(k): 1.0 for k in range(PP)}
    swa = by_stage(stack.query(f'stagecache_stage_buffers{{instance="{stack.serve}",pool="swa"}}'))
    assert swa == {str(k): float(LAYERS_PER_STAGE) for k in range(PP)}


def test_serve_tokens_flow_into_prometheus(stack: Stack) -> None:
    """The trace really runs: looked-up tokens by tier grow while Prometheus watches."""
    result = stack.wait_query(
        "looked-up tokens on every stage",
        f'sum by (pp_rank) (stagecache_prefix_lookup_tokens_total{{instance="{stack.serve}"}})',
        lambda r: len(r) == PP and all(float(x["value"][1]) > 0 for x in r))
    assert {r["metric"]["pp_rank"] for r in result} == {str(k) for k in range(PP)}


def test_every_dashboard_query_evaluates_to_data(stack: Stack) -> None:
    from docker_files import dashboard, dashboard_exprs

    values = stack.api("label/pp_rank/values", **{"match[]": "stagecache_stage_local_layers"})
    assert set(values) >= {str(k) for k in range(PP)}, values  # what the `pp_rank` variable lists
    pending = {where: expr.replace("$__rate_interval", "30s").replace("$pp_rank", ".*")
               for where, expr in dashboard_exprs(dashboard()).items()
               if not where.startswith("variable")}
    # rate() needs two scrapes and recording rules one evaluation: one bounded wait for all.
    deadline = time.monotonic() + READY_S
    while pending and time.monotonic() < deadline:
        for where, promql in list(pending.items()):
            if stack.query(promql):  # a PromQL error fails inside query()
                del pending[where]
        if pending:
            for p in stack.procs:
                p.check_alive()
            time.sleep(1.0)
    assert not pending, f"dashboard queries without data after {READY_S:.0f} s: {pending}"


def test_rules_load_and_evaluate_without_errors(stack: Stack) -> None:
    def evaluated() -> list[dict[str, Any]] | None:
        rules = [r for g in stack.api("rules")["groups"] for r in g["rules"]]
        done = all(not r["lastEvaluation"].startswith("0001-") for r in rules)
        return rules if rules and done else None

    rules = wait_for("every rule to be evaluated once", evaluated, stack.procs)
    expected = {r.get("alert") or r["record"] for g in yaml.safe_load(
        (DOCKER / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    assert {r["name"] for r in rules} == expected
    for r in rules:
        assert r["health"] == "ok", (r["name"], r.get("lastError"))


def test_mapping_alerts_fire_for_the_faulty_stack_only(stack: Stack) -> None:
    def firing(name: str) -> list[dict[str, str]]:
        return [a["labels"] for a in stack.api("alerts")["alerts"]
                if a["labels"]["alertname"] == name and a["state"] == "firing"]

    mapping = wait_for("StagecacheMappingError on all 4 faulty stages",
                       lambda: (lambda f: f if len(f) == PP else None)(firing("StagecacheMappingError")),
                       stack.procs)
    assert {a["instance"] for a in mapping} == {stack.faulty}
    assert {a["pp_rank"] for a in mapping} == {str(k) for k in range(PP)}
    assert {a["severity"] for a in mapping} == {"critical"}
    buffers = wait_for("StagecacheBufferCountMismatch", lambda: firing("StagecacheBufferCountMismatch"),
                       stack.procs)
    assert {(a["instance"], a["pool"]) for a in buffers} == {(stack.faulty, "swa")}
    assert {a["pp_rank"] for a in buffers} == {str(k) for k in range(PP)}


def test_serve_exposition_passes_promtool_lint(stack: Stack) -> None:
    body = stack.client.get(f"http://{stack.serve}/metrics").text
    assert "stagecache_stage_local_layers" in body
    res = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_image_healthcheck_probes_serve(stack: Stack) -> None:
    """docker/Dockerfile's HEALTHCHECK command, run as-is against serve (and a dead port)."""
    dockerfile = pytest.importorskip("dockerfile", reason="pip install dockerfile (test extra)")
    (hc,) = [c for c in dockerfile.parse_file(str(DOCKER / "Dockerfile")) if c.cmd == "HEALTHCHECK"]
    assert hc.value[0] == "CMD" and "127.0.0.1:8000" in " ".join(hc.value)

    def probe(addr: str) -> int:
        argv = [a.replace("127.0.0.1:8000", addr) for a in hc.value[1:]]
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        return subprocess.run(argv, capture_output=True, timeout=30).returncode

    assert probe(stack.serve) == 0
    assert probe(f"127.0.0.1:{free_port()}") != 0
