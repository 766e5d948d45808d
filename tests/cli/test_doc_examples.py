"""Docs that cannot drift: every shell example in README.md and docs/*.md that runs ``stagecache``
is run here, on CPU, and must exit with the code its page states.

What counts: fenced blocks marked ``bash``, ``sh``, ``shell`` or ``console`` (in ``console`` only
the ``$ `` lines are commands); a line (with its ``\\`` continuations) runs ``stagecache`` when the
command ``stagecache`` (or ``python -m stagecache``) starts it or follows ``&&``/``;``.  Such a line
is run from the ``stagecache`` word on, with ``python -m stagecache`` (the same command, no PATH
needed), in a temporary directory shared by the lines of its block (a file one line writes,
the next reads).

The exit code a page states: ``; echo $?   # 1``, or in a ``console`` block the line ``echo $?``
printed; ``(exit N)`` in a line's comment; otherwise 0.  A line or block marked ``# not run``
(with the reason) is not run; every other line must be.

Small sizes: ``serve`` gets ``--requests 8 --rate 0 --port 0`` and, unless the line says how
to end, ``--exit-after-run``; ``dashboard`` (which serves until Ctrl-C) gets ``--port 0``, is
asked for its page and then sent SIGINT, and must exit 130 as the docs say.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = ("bash", "sh", "shell", "console")
#: Pages whose examples a test of their own runs (and checks the files they write).
RUN_ELSEWHERE = {"docs/advise.md": ("tests/cli/test_advise.py", "def test_docs_examples_run")}
#: ``stagecache`` as the command of a line: at its start or after ``&&``, ``;`` (env assignments
#: before it allowed), as the script or as ``python -m stagecache``.
COMMAND = re.compile(r"(?:^|&&|;)\s*(?:[A-Z_]+=\S*\s+)*(?:\S*python3?\s+-m\s+)?(stagecache(?:\.\S+)?)\s")
SERVE_SMALL = ["--requests", "8", "--rate", "0", "--port", "0"]


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    command: str  # from the stagecache word on, comment and `; echo $?` removed
    exit_code: int


def _logical_lines(body: str, console: bool) -> list[tuple[int, str, list[str]]]:
    """(offset, command line with continuations joined, the output lines after it)."""
    out: list[tuple[int, str, list[str]]] = []
    lines = body.splitlines()
    k = 0
    while k < len(lines):
        start, text = k, lines[k]
        if console and not text.startswith("$ "):
            if out:
                out[-1][2].append(text)
            k += 1
            continue
        text = text[2:] if console else text
        while text.rstrip().endswith("\\") and k + 1 < len(lines):
            k += 1
            text = text.rstrip()[:-1] + " " + lines[k].strip()
        out.append((start, text, []))
        k += 1
    return out


def _exit_code(text: str, output: list[str]) -> int:
    comment = text.split("#", 1)[1] if "#" in text else ""
    if "echo $?" in text:
        stated = [ln.strip() for ln in output if ln.strip()]
        if stated and stated[-1].isdigit():
            return int(stated[-1])
        if re.fullmatch(r"\s*\d+\s*", comment):
            return int(comment)
    found = re.search(r"\(exit (\d+)", comment)
    return int(found.group(1)) if found else 0


def collect() -> tuple[list[tuple[str, int, list[Example]]], list[str]]:
    """Blocks (page, line, examples) to run, and the lines marked not run."""
    blocks, not_run, seen = [], [], set()
    for page in PAGES:
        rel = str(page.relative_to(ROOT))
        text = page.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
            lang, body = m.group(1), m.group(2)
            if lang not in SHELLS:
                continue
            first = text[: m.start()].count("\n") + 2
            examples = []
            whole_block_marked = body.lstrip().startswith("# not run")
            for offset, line, output in _logical_lines(body, lang == "console"):
                found = COMMAND.search(line + " ")
                if not found:
                    continue
                if whole_block_marked or "# not run" in line:
                    why = body.lstrip().splitlines()[0] if whole_block_marked else ""
                    not_run.append(f"{rel}:{first + offset}: {line.strip()}"
                                   + (f"  [{why}]*" if re.search(r"# not run[^:]*:\s*\w", why) else ""))
                    continue
                command = line[found.start(1):].split(" #", 1)[0].replace("; echo $?", "").strip()
                examples.append(Example(rel, first + offset, command, _exit_code(line, output)))
            if len(examples) == 1 and examples[0].command in seen:
                continue  # the same command, already run for another page
            seen.update(e.command for e in examples)
            if examples and rel not in RUN_ELSEWHERE:
                blocks.append((rel, first, examples))
    return blocks, not_run


BLOCKS, NOT_RUN = collect()


def _argv(example: Example) -> list[str]:
    words = shlex.split(example.command)
    assert words[0] in ("stagecache", "stagecache.runtime"), example
    argv = [sys.executable, "-m", "stagecache", *words[1:]]
    if words[1] == "serve":
        ends = {"--exit-after-run", "--hold-seconds", "--exit-on-error"} & set(words)
        argv += SERVE_SMALL + ([] if ends else ["--exit-after-run"])
    if words[1] == "dashboard":
        argv += ["--port", "0"]
    return argv


def _run(example: Example, cwd: Path) -> tuple[int, str]:
    """Run one example; a dashboard is asked for its page, then stopped with Ctrl-C."""
    argv = _argv(example)
    redirect = None
    if ">" in argv:  # `... --json > check.json`
        k = argv.index(">")
        argv, redirect = argv[:k], cwd / argv[k + 1]
    env = {**os.environ, "STAGECACHE_LOG": "warning"}
    out = open(redirect, "w") if redirect else subprocess.PIPE  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.PIPE,
                                text=True)
        if argv[3] == "dashboard":
            line = proc.stdout.readline()
            url = re.search(r"(http://\S+/)", line)
            assert url, (example, line, proc.stderr.read() if proc.poll() is not None else "")
            assert httpx.get(url.group(1), timeout=30).status_code == 200
            proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=240)
        return proc.returncode, (stdout or "") + stderr
    finally:
        if redirect:
            out.close()


def test_every_stagecache_example_is_found_and_the_unrun_ones_say_so():
    pages = {page for page, _, _ in BLOCKS}
    assert {"README.md", "docs/serve.md", "docs/check.md", "docs/dashboard.md"} <= pages, pages
    assert sum(len(ex) for _, _, ex in BLOCKS) >= 10
    for page, (test_file, marker) in RUN_ELSEWHERE.items():
        assert marker in (ROOT / test_file).read_text(), (page, test_file)
    # each unrun line gives its reason after the mark, or its block's first line does
    for line in NOT_RUN:
        assert re.search(r"# not run( by the doc test)?\s*[:(]\s*\w", line) or line.endswith("*"), line


@pytest.mark.parametrize("page, line, examples", BLOCKS,
                         ids=[f"{page}:{line}" for page, line, _ in BLOCKS])
def test_the_example_exits_as_its_page_says(page, line, examples, tmp_path):
    for example in examples:
        t0 = time.monotonic()
        code, output = _run(example, tmp_path)
        assert code == example.exit_code, (
            f"{example.page}:{example.line}: `{example.command}` exited {code}, the page says "
            f"{example.exit_code}; output:\n{output[-3000:]}")
        assert "Traceback" not in output, output[-3000:]
        assert time.monotonic() - t0 < 120, example


#: A repository path a page names (globs allowed: ``tests/cache/test_hicache_*.py``).
REPO_PATH = re.compile(r"(?<![\w./-])((?:runtime|exporters|dashboard|tests|docker|scripts|docs|entry)"
                       r"/[\w./*-]*[\w*])")
#: A dotted module a page names (``stagecache.runtime.live.liveness``, maybe ``...:attr``).
MODULE = re.compile(r"(?<![\w.])(stagecache\.(?:runtime|exporters|dashboard)(?:\.\w+)*)")


def _module_exists(dotted: str) -> bool:
    """``dotted`` is a module, or a module's attribute (``...metrics.METRIC_NAMES``); below a
    package that cannot be imported here (the sglang integration without sglang) its file counts."""
    import importlib.util

    parts = dotted.split(".")
    for k in (len(parts), len(parts) - 1):
        name = ".".join(parts[:k])
        try:
            if importlib.util.find_spec(name) is not None:
                return k == len(parts) or hasattr(importlib.import_module(name), parts[-1])
        except ModuleNotFoundError:  # a module's attribute, not a submodule
            continue
        except ImportError:
            where = ROOT / parts[1] / "/".join(parts[2:k])
            return where.with_suffix(".py").exists() or where.is_dir()
    return False


def test_every_path_and_module_a_page_names_exists():
    missing = []
    for page in [*PAGES, ROOT / "CHANGELOG.md"]:
        text = page.read_text()
        for path in set(REPO_PATH.findall(text)):
            if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                missing.append(f"{page.name}: {path}")
        for module in set(MODULE.findall(text)):
            if not _module_exists(module):
                missing.append(f"{page.name}: {module}")
    assert missing == []


#: A test file a page or a source names: ``test_<name>.py`` alone or with its folder (``tests/<dir>/test_<name>.py``).
TEST_FILE = re.compile(r"(?<![\w/.-])((?:tests/(?:[\w-]+/)*)?test_\w+\.py)\b")


def test_every_test_file_a_page_or_a_test_names_exists():
    """A page, a test or the code that says "see test_<name>.py" for a behaviour names a file that is
    there: with its folder, that path; alone, a test file of that name in some folder of tests/."""
    tests = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    assert "test_doc_examples.py" in tests  # the pattern below is looked for where it can be found
    sources = [*PAGES, ROOT / "CHANGELOG.md", ROOT / "tests" / "run.sh", *(ROOT / "tests").rglob("*.py"),
               *(ROOT / "tests" / "setup.d").glob("*.sh"),
               *(p for d in ("runtime", "dashboard", "exporters") for p in (ROOT / d).rglob("*.py"))]
    missing = []
    for source in sources:
        for name in sorted(set(TEST_FILE.findall(source.read_text(errors="replace")))):
            if not ((ROOT / name).is_file() if "/" in name else name in tests):
                missing.append(f"{source.relative_to(ROOT)}: {name}")
    assert missing == []
