"""Defaults once: every command's ``--help`` shows the same default for the same flag, taken from
``runtime/defaults.py``, and docs/defaults.md is that module rendered."""

from __future__ import annotations

import argparse
from pathlib import Path

from stagecache.runtime import defaults
from stagecache.runtime.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
#: A flag and the default every command that has it must show.
SHARED = {
    "--model": defaults.MODEL, "--pp-size": defaults.PP_SIZE, "--tp-size": defaults.TP_SIZE,
    "--page-size": defaults.PAGE_SIZE, "--hicache-ratio": defaults.HICACHE_RATIO,
    "--hicache-write-policy": defaults.WRITE_POLICY, "--hicache-layout": defaults.HOST_LAYOUT,
    "--device-pages": defaults.DEVICE_PAGES, "--host": defaults.HOST, "--port": defaults.DASHBOARD_PORT,
    "--dist-host": defaults.DIST_HOST,
}
#: Flags whose argparse default is None on purpose, with the default their help states.
STATED = {("serve", "--device-pages"), ("bench hicache", "--page-size"), ("advise", "--page-size")}


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                full = f"{prefix} {name}".strip()
                nested = _commands(sub, full)
                out.update(nested or {full: sub})
    return out


def test_every_command_shows_the_same_default_for_the_same_flag():
    seen = {}
    for command, parser in _commands(build_parser()).items():
        for action in parser._actions:
            for flag in action.option_strings:
                if flag in SHARED:
                    seen.setdefault(flag, []).append(command)
                    if (command, flag) in STATED:
                        assert str(SHARED[flag]) in action.help, (command, flag, action.help)
                    else:
                        assert action.default == SHARED[flag], (command, flag, action.default)
                        assert "%(default)" in action.help or str(SHARED[flag]) in action.help, (command, flag)
    assert set(seen) == set(SHARED)  # every shared flag is checked somewhere
    assert len(seen["--model"]) >= 6 and len(seen["--pp-size"]) >= 6


def test_help_prints_the_defaults_of_the_module(capsys):
    for command in (["check"], ["pools"], ["serve"], ["bench", "hicache"]):
        try:
            build_parser().parse_args([*command, "--help"])
        except SystemExit:
            pass
        text = " ".join(capsys.readouterr().out.split())
        assert f"(default {defaults.PP_SIZE})" in text and f"(default {defaults.MODEL})" in text, command


def test_the_defaults_page_is_the_module_rendered():
    page = (ROOT / "docs" / "defaults.md").read_text()
    assert defaults.render() in page
