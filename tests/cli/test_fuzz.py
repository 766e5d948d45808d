"""Property-based: every command's flags, the config loader and the trace loader, fed generated values.

Whatever the value (huge, negative, NaN, Unicode, empty, a NUL byte, deeply nested JSON, a FIFO),
the CLI answers with exit 0, 1 or 2 -- 2 with exactly one line -- never a traceback, each case
within 2 s of CPU.  The CLI runs in-process (``main(argv)``); the work a command would start once its
flags are accepted (stage processes, a benchmark's loops, a server) is replaced by a sentinel that
ends the case, so the fuzzer checks the validation, and that it comes before any work.  Examples
are derandomized: CI runs the same few hundred every time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from stagecache.runtime.cli.main import build_parser, main
from stagecache.runtime.errors import ConfigError

#: CPU seconds of this process per case (wall time would count whatever else the machine runs)
CASE_LIMIT_S = 2.0
FUZZ = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class _WorkWouldStart(BaseException):  # noqa: N818 - a sentinel, not an error
    """Raised where a command's real work begins: its flags were all accepted."""


def _stop(*_args, **_kw):
    raise _WorkWouldStart


def _import_everything() -> None:
    """Every module of the package (sglang's integration aside): a first import is not the
    validation's time, and on a busy machine it can take seconds."""
    import importlib
    import pkgutil

    for pkg in ("stagecache.runtime", "stagecache.exporters", "stagecache.dashboard"):
        mod = importlib.import_module(pkg)
        for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
            if not info.name.startswith("stagecache.runtime.integrations.sglang") \
                    and not info.name.endswith("__main__"):
                importlib.import_module(info.name)


@pytest.fixture(scope="module")
def no_work():
    """Every place a command hands over to real work ends the case instead."""
    from stagecache.dashboard import server
    from stagecache.runtime.bench import (
        advise,
        check,
        hicache,
        http_load,
        l3,
        transfer,
        transfer_split,
    )
    from stagecache.runtime.cli import serve
    from stagecache.runtime.sizing import curves

    mp = pytest.MonkeyPatch()
    # advise and bench advise: the trace is read (or generated) and checked, the curves are work
    for module, name in ((serve, "serve"), (check, "run_bench"), (hicache, "run_bench"),
                         (transfer, "run_bench"), (transfer_split, "run_bench"),
                         (http_load, "run_bench"), (server, "make_server"), (l3, "run_bench"),
                         (advise, "timed_curve"), (curves, "page_views")):
        mp.setattr(module, name, _stop)
    main(["check", "--model", "tiny-v4"])
    _import_everything()  # a command's lazy imports are done before any case is timed
    yield
    mp.undo()


def _flags() -> dict[tuple[str, ...], list[str]]:
    """Every (sub)command path and its option strings, read from the real parser."""
    out: dict[tuple[str, ...], list[str]] = {}

    def walk(parser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if action.choices and isinstance(action.choices, dict):  # subparsers
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
        opts = [o for a in parser._actions for o in a.option_strings
                if o.startswith("--") and o not in ("--help", "--version")]
        if path and opts:
            out[path] = opts

    walk(build_parser(), ())
    return {k: v for k, v in out.items() if k != ("bench",)}


COMMANDS = _flags()
HOSTS = ["127.0.0.1", "::1", "[::1]", "localhost", "0.0.0.0", "", "192.0.2.7"]
URLS = ["http://127.0.0.1:1/", "ftp://127.0.0.1/", "http://127.0.0.1:99999/", "", "http://[::1",
        "http://127.0.0.1:x/"]
EDGE = ["", " ", "0", "-0", "1", "-1", "2", "7", "nan", "-nan", "inf", "-inf", "1e308", "1e-320",
        "4.0", "0x10", "1_000", "\u0661\u0662", "\u00b2", "\uff11", "9" * 5000, "1" * 40,
        str(2**63), str(2**64), "-" + "9" * 30, "\x00", "a\x00b", "\u202e1", "tiny-v4",
        "deepseek-v4-flash", "global-swa", "global-swa@1", "global-swa@-1", "cpu", "cuda", "cuda:7",
        "bogus", "11,11,11,10", "1,x", ",", "\U0001f600" * 3, "x" * 300]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    """Paths a file flag may get: missing, a directory, a FIFO, garbage, a name too long, ..."""
    d = tmp_path_factory.mktemp("fuzz-files")
    (d / "garbage.json").write_bytes(b"\xff\xfe{")
    (d / "deep.json").write_text("[" * 5000 + "]" * 5000)
    (d / "list.json").write_text("[1, 2, 3]")
    (d / "trace.jsonl").write_text('{"session": "a", "turn": 0, "input_len": 300, "output_len": 8}\n')
    os.mkfifo(d / "fifo.json")
    (d / "dir").mkdir()
    return [str(d / n) for n in ("garbage.json", "deep.json", "list.json", "trace.jsonl", "fifo.json",
                                 "dir", "missing.json", "gen.json")] + \
        [str(d / ("a" * 300)), str(d / "none" / "x.json"), "/proc/self/mem", "/dev/zero"]


def json_values(max_leaves: int = 30):
    leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                     st.sampled_from([10**18, 4.0, 128, 0, -4, 2**63]))
    return st.recursive(leaf, lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)),
        max_leaves=max_leaves)


def _config(draw_value) -> str:
    base = json.loads((Path(__file__).resolve().parents[2] / "runtime" / "model" / "presets" /
                       "tiny-v4.json").read_text())
    key, value = draw_value
    return json.dumps({**base, key: value}, allow_nan=True)


CONFIG_KEYS = ["num_hidden_layers", "compress_ratios", "sliding_window", "head_dim",
               "qk_rope_head_dim", "index_head_dim", "num_nextn_predict_layers"]


@st.composite
def argv_cases(draw, paths: list[str]):
    command = draw(st.sampled_from(sorted(COMMANDS)))
    flags = draw(st.lists(st.sampled_from(COMMANDS[command]), min_size=0, max_size=4))
    argv = list(command)
    for flag in flags:
        if flag in ("--host", "--dist-host"):
            value = draw(st.sampled_from(HOSTS))
        elif flag == "--url":
            value = draw(st.sampled_from(URLS))
        elif flag in ("--model", "--trace", "--from-json", "--render", "--into", "--out",
                      "--save-trace", "--run-dir"):
            value = draw(st.sampled_from([*paths, *EDGE[:4], "tiny-v4"]))
        else:
            value = draw(st.one_of(st.sampled_from(EDGE), st.integers(-10, 10**6).map(str),
                                   st.floats().map(repr), st.text(max_size=12)))
        argv += [flag, value]
    if command == ("serve",):  # flag validation only; a bad value must not start stages
        argv += ["--no-dashboard", "--exit-after-run"]
    return argv


def _run(argv: list[str]) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    t0 = time.process_time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except _WorkWouldStart:
            code = 0
    return code, out.getvalue(), err.getvalue(), time.process_time() - t0


@FUZZ
@given(data=st.data())
def test_every_flag_of_every_command_is_accepted_or_refused_in_one_line(data, files, no_work):
    gen = Path(files[7])
    gen.write_text(_config(data.draw(st.tuples(st.sampled_from(CONFIG_KEYS), json_values()))))
    argv = data.draw(argv_cases(files))
    code, out, err, seconds = _run(argv)
    event(f"{' '.join(argv[:2])}: exit {code}")
    assert "Traceback" not in out + err, (argv, err)
    assert code in (0, 1, 2), (argv, code, err)
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and len(lines[0]) > 20, (argv, err)
    assert seconds < CASE_LIMIT_S, (argv, seconds)


@FUZZ
@given(key=st.sampled_from(CONFIG_KEYS), value=json_values(),
       raw=st.one_of(st.none(), st.text(max_size=200),
                     st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
                     st.integers(1, 5000).map(lambda n: '"\\' * n)))
def test_the_config_loader_returns_a_spec_or_one_config_error(key, value, raw, tmp_path_factory):
    from stagecache.runtime.model.families import load_spec

    path = tmp_path_factory.getbasetemp() / "fuzz-config.json"
    path.write_text(raw if raw is not None else _config((key, value)))
    t0 = time.process_time()
    try:
        spec = load_spec(str(path))
        assert spec.num_layers > 0 and spec.sliding_window > 0
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
    assert time.process_time() - t0 < CASE_LIMIT_S


@FUZZ
@given(lines=st.lists(st.one_of(json_values(12).map(lambda v: json.dumps(v, allow_nan=True)),
                                st.text(max_size=80),
                                st.fixed_dictionaries({"session": st.text(max_size=4), "turn": json_values(3),
                                                       "input_len": json_values(3),
                                                       "output_len": json_values(3)}).map(json.dumps)),
                      min_size=0, max_size=12),
       fmt=st.sampled_from(["auto", "tokens", "mooncake"]))
def test_the_trace_loader_returns_requests_or_one_config_error(lines, fmt, tmp_path_factory):
    from stagecache.runtime.traces.readers import load_requests

    path = tmp_path_factory.getbasetemp() / "fuzz-trace.jsonl"
    path.write_text("\n".join(lines) + "\n", errors="surrogatepass")
    t0 = time.process_time()
    try:
        trace = load_requests(str(path), fmt=fmt)
        assert trace.requests
    except ConfigError as exc:
        assert str(exc).strip()
    assert time.process_time() - t0 < CASE_LIMIT_S
