"""Every option of every ``polyaccel-moe`` subcommand says what it does in ``--help`` (``presets
-v`` said nothing), and the documented exit statuses are listed there."""

from __future__ import annotations

import argparse

from polyaccel.moe.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help_text():
    for name, sub in _subparsers(build_parser()).items():
        silent = [a.option_strings or [a.dest] for a in sub._actions if not a.help]
        assert not silent, f"polyaccel-moe {name}: no help for {silent}"


def test_the_exit_statuses_are_in_the_help():
    text = build_parser().format_help()
    for status in ("0 done", "1 another error", "2 configuration", "3 a non-finite", "4 training ran", "130:", "143:",
                   "129:", "141:"):
        assert status in text
