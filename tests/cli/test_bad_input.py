"""Every bad input is exit 2 with ONE line naming the flag or file, the value and what is accepted.

The real CLI, in child processes (several at once) forked from one interpreter that imported
stagecache and torch once (tests/support/cli_zygote.py: a real process per case, its own exit
status, stdout and stderr, without a hundred interpreter start-ups): every numeric flag of every command with NaN, infinity,
negative or out-of-range values, bad fault specs, unusable files (missing,
directory, not UTF-8, too large, too deep, not JSON), bad traces and bad bind
addresses.  Also: a mapping error is 1, an internal error is 3 naming its log
file, and a reader that closes stdout early is a quiet exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_zygote import Zygote
from stagecache.runtime.model import spec as spec_module

CLI = [sys.executable, "-m", "stagecache.runtime"]
#: Appended before a serve case's own flags (argparse keeps the last value), so a bad value that
#: slipped through would run briefly and exit 0 instead of holding the dashboard.
SERVE_TAIL = ["--no-dashboard", "--exit-after-run", "--rate", "0", "--requests", "8"]

FLOAT_BAD = "expected a finite number"


def S(*argv: str) -> list[str]:  # noqa: N802 - reads like the command line it builds
    return ["serve", *SERVE_TAIL, *argv]


CASES = [
    # -- serve: every numeric flag ---------------------------------------------------------------
    ("serve-rate-nan", S("--rate", "nan"), "argument --rate: expected a finite number >= 0, got 'nan'"),
    ("serve-rate-inf", S("--rate", "inf"), "argument --rate: " + FLOAT_BAD),
    ("serve-rate-neg", S("--rate", "-1"), "argument --rate: " + FLOAT_BAD),
    ("serve-hicache-inf", S("--hicache-ratio", "inf"), "argument --hicache-ratio: expected a finite number > 0"),
    ("serve-hicache-nan", S("--hicache-ratio", "nan"), "argument --hicache-ratio: " + FLOAT_BAD),
    ("serve-hicache-zero", S("--hicache-ratio", "0"), "argument --hicache-ratio: " + FLOAT_BAD),
    ("serve-seed-neg", S("--seed", "-1"), "argument --seed: expected an integer >= 0, got -1"),
    ("serve-hold-nan", S("--hold-seconds", "nan"), "argument --hold-seconds: " + FLOAT_BAD),
    ("serve-hold-neg", S("--hold-seconds", "-5"), "argument --hold-seconds: " + FLOAT_BAD),
    ("serve-dist-timeout-inf", S("--dist-timeout", "inf"), "argument --dist-timeout: " + FLOAT_BAD),
    ("serve-dist-timeout-zero", S("--dist-timeout", "0"), "argument --dist-timeout: " + FLOAT_BAD),
    ("serve-startup-timeout-nan", S("--startup-timeout", "nan"), "argument --startup-timeout: " + FLOAT_BAD),
    ("serve-heartbeat-timeout-low", S("--heartbeat-timeout", "1"), "argument --heartbeat-timeout: " + FLOAT_BAD),
    ("serve-requests-zero", S("--requests", "0"), "argument --requests: expected a positive integer"),
    ("serve-requests-huge", S("--requests", "1000000"), "argument --requests: expected a positive integer <= 100000"),
    ("serve-micro-batch-neg", S("--micro-batch", "-2"), "argument --micro-batch: expected a positive integer"),
    ("serve-in-flight-zero", S("--in-flight", "0"), "argument --in-flight: expected a positive integer"),
    ("serve-hidden-float", S("--hidden-size", "1e6"), "argument --hidden-size: expected a positive integer"),
    ("serve-device-pages-frac", S("--device-pages", "1.5"), "argument --device-pages: expected a positive integer"),
    ("serve-max-tokens-neg", S("--max-total-tokens", "-1"), "argument --max-total-tokens: expected a positive integer"),
    ("serve-port-high", S("--port", "70000"), "argument --port: expected an integer >= 0 <= 65535, got 70000"),
    ("serve-port-neg", S("--port", "-1"), "argument --port: expected an integer >= 0"),
    ("serve-pp-zero", S("--pp-size", "0"), "argument --pp-size: expected a positive integer"),
    ("serve-tp-nan", S("--tp-size", "nan"), "argument --tp-size: expected a positive integer"),
    ("serve-page-inf", S("--page-size", "inf"), "argument --page-size: expected a positive integer"),
    # -- faults, bind addresses, run dir -------------------------------------------------------
    ("fault-no-stage", S("--fault", "global-swa@"), "argument --fault: 'global-swa@': expected a stage number"),
    ("fault-stage-word", S("--fault", "global-swa@x"), "expected a stage number (integer >= 0) after '@', got 'x'"),
    ("fault-stage-range", S("--fault", "global-swa@9"), "--fault 'global-swa@9': stage 9 out of range"),
    ("fault-unknown", S("--fault", "bogus"), "unknown --fault 'bogus'; known faults:"),
    ("run-dir-is-file", S("--run-dir", "{file}"), "--run-dir '{file}' is not a directory"),
    ("dist-host-foreign", S("--dist-host", "192.0.2.77"), "--dist-host '192.0.2.77': cannot bind 192.0.2.77"),
    ("dist-host-unknown", S("--dist-host", "no-such-host.invalid"), "--dist-host 'no-such-host.invalid': cannot resolve"),
    ("host-unknown", ["serve", "--exit-after-run", "--rate", "0", "--requests", "8", "--port", "0",
                      "--host", "no-such-host.invalid"], "cannot bind the dashboard to no-such-host.invalid:0"),
    ("dist-host-wildcard", S("--dist-host", "0.0.0.0"), "--dist-host '0.0.0.0' is the wildcard address"),
    # -- model config files ----------------------------------------------------------------------
    ("model-missing", S("--model", "{dir}/none.json"), "model config '{dir}/none.json': cannot read: No such file"),
    ("model-not-utf8", S("--model", "{latin1}"), "model config '{latin1}' is not UTF-8 text"),
    ("model-huge", S("--model", "{huge}"), "model config '{huge}' is larger than 1048576 bytes"),
    ("model-deep", S("--model", "{deep}"), "model config '{deep}' nests 100000 levels deep; expected at most 32"),
    ("model-empty-dir", S("--model", "{emptydir}"), "model config '{emptydir}/config.json': cannot read"),
    ("model-config-is-dir", S("--model", "{cfgdir}"), "model config '{cfgdir}/config.json': cannot read: Is a directory"),
    ("model-not-json", S("--model", "{notjson}"), "model config '{notjson}' is not valid JSON"),
    ("model-list", S("--model", "{listjson}"), "expected a JSON object, got list"),
    ("model-missing-field", S("--model", "{nofield}"), "not a model of a family stagecache knows"),
    ("model-missing-layers", S("--model", "{nolayers}"), "missing required field 'num_hidden_layers'"),
    # -- traces ------------------------------------------------------------------------------------------
    ("trace-missing", S("--trace", "{dir}/none.jsonl"), "--trace '{dir}/none.jsonl': no such file"),
    ("trace-dir", S("--trace", "{dir}"), "--trace '{dir}' is a directory"),
    ("trace-not-utf8", S("--trace", "{latin1}"), "{latin1}:1: not UTF-8 text"),
    ("trace-bad-line", S("--trace", "{badline}"), "{badline}:2: invalid JSON"),
    ("trace-line-too-long", S("--trace", "{longline}"), "longest 7813 pages) needs up to 7813 device pages"),
    ("trace-deep-line", S("--trace", "{deepline}"), "{deepline}:1: JSON nested too deeply"),
    ("trace-input-len-1e9", S("--trace", "{biglen}"), "field 'input_len' = 1000000000: accepted: an integer in"),
    ("trace-file-huge", S("--trace", "{hugetrace}"), "{hugetrace}:1: line longer than 33554432 bytes"),
    # -- pools ------------------------------------------------------------------------------------------
    ("pools-budget-inf", ["pools", "--model", "tiny-v4", "--mem-budget-gb", "inf"], "argument --mem-budget-gb: " + FLOAT_BAD),
    ("pools-budget-nan", ["pools", "--model", "tiny-v4", "--mem-budget-gb", "nan"], "argument --mem-budget-gb: " + FLOAT_BAD),
    ("pools-host-neg", ["pools", "--model", "tiny-v4", "--hicache-size-gb", "-1"], "argument --hicache-size-gb: " + FLOAT_BAD),
    ("pools-tokens-zero", ["pools", "--model", "tiny-v4", "--max-total-tokens", "0"], "argument --max-total-tokens: expected a positive integer"),
    # -- bench --------------------------------------------------------------------------------------------
    ("transfer-mib-neg", ["bench", "transfer", "--kind-mib", "-1"], "argument --kind-mib: " + FLOAT_BAD),
    ("transfer-mib-nan", ["bench", "transfer", "--kind-mib", "nan"], "argument --kind-mib: " + FLOAT_BAD),
    ("transfer-pages-zero", ["bench", "transfer", "--mix-pages", "0"], "argument --mix-pages: expected a positive integer"),
    ("transfer-budget-inf", ["bench", "transfer", "--budget", "inf"], "argument --budget: " + FLOAT_BAD),
    ("transfer-kind-unknown", ["bench", "transfer", "--kind", "c128_state"], "argument --kind: invalid choice"),
    ("transfer-seed-neg", ["bench", "transfer", "--seed", "-3"], "argument --seed: expected an integer >= 0"),
    ("check-layers-neg", ["bench", "check", "--layers", "-1"], "argument --layers: expected a positive integer"),
    ("check-max-pp-zero", ["bench", "check", "--max-pp", "0"], "argument --max-pp: expected a positive integer"),
    ("check-repeat-nan", ["bench", "check", "--repeat", "nan"], "argument --repeat: expected a positive integer"),
    ("hicache-think-neg", ["bench", "hicache", "--think-time", "-1"], "argument --think-time: " + FLOAT_BAD),
    ("hicache-gap-inf", ["bench", "hicache", "--session-gap", "inf"], "argument --session-gap: " + FLOAT_BAD),
    ("hicache-stage-neg", ["bench", "hicache", "--stage", "-1"], "argument --stage: expected an integer >= 0"),
    ("hicache-threads-zero", ["bench", "hicache", "--threads", "0"], "argument --threads: expected a positive integer"),
    ("hicache-check-neg", ["bench", "hicache", "--check-every", "-2"], "argument --check-every: expected an integer >= 0"),
    ("hicache-ratio-nan", ["bench", "hicache", "--hicache-ratio", "nan"], "argument --hicache-ratio: " + FLOAT_BAD),
    ("http-clients-zero", ["bench", "http", "--clients", "0"], "argument --clients: expected a positive integer"),
    ("http-out-nowhere", ["bench", "http", "--out", "{dir}/none/out.json"], "argument --out: '{dir}/none/out.json': '{dir}/none' is not a directory"),
    ("http-requests-neg", ["bench", "http", "--requests", "-5"], "argument --requests: expected a positive integer"),
    # -- dashboard and check ---------------------------------------------------------------------------
    ("dash-json-missing", ["dashboard", "--from-json", "{dir}/none.json"], "--from-json {dir}/none.json: cannot read"),
    ("dash-json-not-utf8", ["dashboard", "--from-json", "{latin1}"], "--from-json {latin1} is not UTF-8 text"),
    ("dash-json-huge", ["dashboard", "--from-json", "{hugereport}"], "--from-json {hugereport} is larger than"),
    ("dash-port-high", ["dashboard", "--from-check", "--model", "tiny-v4", "--port", "99999"], "argument --port: expected an integer >= 0 <= 65535"),
    ("check-partition-word", ["check", "--model", "tiny-v4", "--pp-size", "2", "--pp-partition", "1,x"], "--pp-partition"),
    ("check-model-deep", ["check", "--model", "{deep}"], "nests 100000 levels deep"),
    ("check-pp-neg", ["check", "--model", "tiny-v4", "--pp-size", "-1"], "argument --pp-size: expected a positive integer"),
    # -- resource checks before any pool is allocated: real flags, values that fit -----------------
    ("serve-host-10tb", S("--hicache-ratio", "250000"), "lower --hicache-ratio to "),
    ("bench-hicache-ram", ["bench", "hicache", "--requests", "8", "--device-pages", "4000000000"],
     "lower --device-pages to "),
    ("bench-transfer-ram", ["bench", "transfer", "--device", "cpu", "--mix-pages", "100000000",
                            "--kind-mib"], "lower --mix-pages to "),
]


def _case_id(case) -> str:
    return case.values[0] if hasattr(case, "values") else case[0]


def _make_files(d: Path) -> dict[str, str]:
    """Every bad file the table names, made once."""
    files = {"dir": str(d)}

    def put(name: str, data: bytes | str) -> None:
        path = d / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        files[name.split(".")[0]] = str(path)

    put("file.txt", "not a directory")
    put("latin1.json", '{"name": "caf\xe9"}'.encode("latin-1"))
    put("deep.json", "[" * 100_000 + "]" * 100_000)
    put("notjson.json", "{not json")
    put("listjson.json", "[1, 2]")
    put("nofield.json", '{"head_dim": 512}')
    put("nolayers.json", '{"architectures": ["DeepseekV4ForCausalLM"], "head_dim": 512}')
    put("badline.jsonl", '{"session": "a", "turn": 0, "input_len": 300, "output_len": 8}\nnot json\n')
    put("longline.jsonl", '{"session": "a", "turn": 0, "output_len": 1, "input_ids": ['
        + ",".join(["7"] * 2_000_000) + "]}\n")
    put("deepline.jsonl", "[" * 100_000 + "]" * 100_000 + "\n")
    put("biglen.jsonl", '{"session": "a", "turn": 0, "input_len": 1000000000, "output_len": 1}\n')
    for name, size in (("huge.json", 50 << 20), ("hugetrace.jsonl", 3 << 30), ("hugereport.json", 20 << 20)):
        with open(d / name, "wb") as f:
            f.truncate(size)  # sparse: instant, and never read whole by a bounded loader
        files[name.split(".")[0]] = str(d / name)
    tiny = json.loads((Path(spec_module.__file__).parent / "presets" / "tiny-v4.json").read_text())
    put("ratiofloat.json", json.dumps({**tiny, "compress_ratios": [
        float(r) if r == 4 else r for r in tiny["compress_ratios"]]}))
    put("swa.json", json.dumps({**tiny, "sliding_window": 10**18}))
    put("bigint.json", '{"head_dim": ' + "1" * 5000 + "}")
    put("adversarial.json", '"\\' * (1 << 19))  # 1 MiB of escaped quotes: quadratic for a regex
    os.mkfifo(d / "fifo.json")
    files["fifo"] = str(d / "fifo.json")
    (d / "emptydir").mkdir()
    files["emptydir"] = str(d / "emptydir")
    (d / "cfgdir" / "config.json").mkdir(parents=True)
    files["cfgdir"] = str(d / "cfgdir")
    return files


def _fill(text: str, files: dict[str, str]) -> str:
    return text.format(**files)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run every case that may run, three at a time; {case id: CompletedProcess}."""
    files = _make_files(tmp_path_factory.mktemp("bad-input"))
    runnable = [c for c in CASES if not (hasattr(c, "marks") and any(
        m.kwargs.get("run") is False for m in c.marks))]

    zygote = Zygote()

    def run(case) -> tuple[str, subprocess.CompletedProcess | str]:
        cid, argv, _ = case.values if hasattr(case, "values") else case
        try:
            return cid, zygote.run([_fill(a, files) for a in argv], timeout=90)
        except subprocess.TimeoutExpired:
            return cid, "timed out after 90 s"

    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            out = dict(pool.map(run, runnable))
    finally:
        zygote.close()
    out["_files"] = files
    return out


@pytest.mark.parametrize("cid, argv, needle", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_exits_2_with_one_line(cid, argv, needle, results):
    r = results[cid]
    assert not isinstance(r, str), f"{cid}: {r}"
    text = r.stdout + r.stderr
    assert "Traceback" not in text, text
    assert r.returncode == 2, f"exit {r.returncode}:\n{text}"
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert _fill(needle, results["_files"]) in lines[0]


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40


def test_a_mapping_error_exits_1():
    r = subprocess.run([*CLI, "check", "--model", "tiny-v4", "--pp-size", "4", "--fault", "global-swa"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "mapping error" in r.stdout and "Traceback" not in r.stderr


def test_an_internal_error_exits_3_naming_the_log_with_the_traceback(tmp_path):
    code = ("import sys; import stagecache.runtime.cli.check as c\n"
            "def boom(args): raise RuntimeError('planted bug')\n"
            "c.run = boom\n"
            "from stagecache.runtime.cli.main import main\n"
            "sys.exit(main(['check', '--model', 'tiny-v4']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "STAGECACHE_LOG_DIR": str(tmp_path)})
    assert r.returncode == 3, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("stagecache check: internal error: RuntimeError: planted bug (traceback in ")
    [log] = list(tmp_path.iterdir())
    assert str(log) in line and "Traceback" in log.read_text() and "planted bug" in log.read_text()


def test_a_reader_closing_stdout_early_is_a_quiet_exit():
    """`stagecache pools --json | head -c 0`: the reader is gone before the first write."""
    proc = subprocess.Popen([*CLI, "pools", "--model", "deepseek-v4-flash", "--pp-size", "4", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    code = proc.wait(60)
    assert err == "" and code == 128 + signal.SIGPIPE


def test_a_config_under_a_directory_without_permission_is_one_line(tmp_path):
    """As another user (uid 65534): the parent exists but cannot be searched."""
    from attacker import as_nobody
    from stagecache.runtime.errors import ConfigError
    from stagecache.runtime.model.config_file import load_config

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    (locked / "config.json").write_text("{}")
    tmp_path.chmod(0o755)

    def refused() -> None:
        with pytest.raises(ConfigError, match=rf"model config '{locked}/config.json': cannot look at "
                           "it: Permission denied"):
            load_config(str(locked / "config.json"))

    as_nobody(refused)


#: Hardening cases, run in-process (``main(argv)``: no interpreter start per case, so the table
#: costs a second): numbers written oddly, files that are not files, work that must not start.
IN_PROCESS = [
    ("int-5000-digits", ["check", "--model", "tiny-v4", "--pp-size", "1" * 5000],
     "argument --pp-size: expected a positive integer <= 4096, got '" + "1" * 40 + "'... (5000 characters)"),
    ("int-unicode-digits", ["check", "--model", "tiny-v4", "--pp-size", "\u0661\u0662"],
     "argument --pp-size: expected a positive integer <= 4096, got '\u0661\u0662'"),
    ("int-underscore", ["pools", "--model", "tiny-v4", "--max-total-tokens", "1_000"],
     "argument --max-total-tokens: expected a positive integer, got '1_000'"),
    ("float-underscore", ["pools", "--model", "tiny-v4", "--mem-budget-gb", "1_0"], "argument --mem-budget-gb: " + FLOAT_BAD),
    ("fault-superscript-stage", ["check", "--model", "tiny-v4", "--fault", "global-swa@\u00b2"],
     "expected a stage number (integer >= 0) after '@', got '\u00b2'"),
    ("model-ratio-float", ["check", "--model", "{ratiofloat}"], "compress_ratios[2] = 4.0 is not supported"),
    ("model-swa-1e18", ["check", "--model", "{swa}"],
     "field 'sliding_window' must be a positive integer <= 1048576, got 1000000000000000000"),
    ("model-int-5000-digits", ["check", "--model", "{bigint}"], "Exceeds the limit (4300 digits)"),
    ("model-adversarial-1mib", ["check", "--model", "{adversarial}"], "is not valid JSON"),
    ("model-fifo", ["check", "--model", "{fifo}"], "model config '{fifo}' is not a regular file"),
    ("model-name-too-long", ["check", "--model", "{dir}/" + "a" * 300 + ".json"], "File name too long"),
    ("serve-trace-fifo", S("--trace", "{fifo}"), "--trace '{fifo}' is not a regular file"),
    ("hicache-trace-fifo", ["bench", "hicache", "--trace", "{fifo}"], "trace '{fifo}' is not a regular file"),
    ("dash-json-fifo", ["dashboard", "--from-json", "{fifo}"], "--from-json {fifo} is not a regular file"),
    ("serve-dist-timeout-tiny", S("--dist-timeout", "0.001"),
     "argument --dist-timeout: expected a finite number >= 1 and <= 86400, got '0.001'"),
    ("transfer-device-bogus", ["bench", "transfer", "--device", "bogus"],
     "argument --device: expected cpu, cuda or cuda:N, got 'bogus'"),
    ("transfer-out-nowhere", ["bench", "transfer", "--device", "cpu", "--out", "{dir}/none/out.json"],
     "argument --out: '{dir}/none/out.json': '{dir}/none' is not a directory"),
    ("hicache-save-trace-dir", ["bench", "hicache", "--save-trace", "{dir}"], "argument --save-trace: '{dir}' is a directory"),
    ("hicache-requests-1e9", ["bench", "hicache", "--requests", "1000000000"],
     "argument --requests: expected a positive integer <= 100000, got 1000000000"),
    ("http-closed-port", ["bench", "http", "--url", "http://127.0.0.1:1/"],
     "--url 'http://127.0.0.1:1/': cannot reach /healthz (Connection refused)"),
    ("http-port-out-of-range", ["bench", "http", "--url", "http://127.0.0.1:99999/"], "Port out of range"),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    return _make_files(tmp_path_factory.mktemp("bad-input-in-process"))


@pytest.mark.parametrize("cid, argv, needle", IN_PROCESS, ids=[c[0] for c in IN_PROCESS])
def test_hardening_inputs_exit_2_with_one_line(cid, argv, needle, bad_files, capsys):
    from stagecache.runtime.cli.main import main

    code = main([_fill(a, bad_files) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert code == 2, f"exit {code}:\n{out}{err}"
    [line] = [ln for ln in err.splitlines() if ln.strip()]
    assert _fill(needle, bad_files) in line
