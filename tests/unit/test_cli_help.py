"""Every user-facing flag of every command says in a line what it does (`--help`).

Each command module (the `iterserve` subcommands, the shipped tools, the studies, the
dashboards and kernels tools) is run with its parser's parse_args replaced by a capture, so
no command does any work; then every argument of every parser it built (subcommands
included) must carry a help text. The Locust file's own flags are read from its source.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ["replica", "kernels", "deploy", "autoscale", "dashboards", "loadtests"]


class _Parsed(Exception):
    """Raised in place of parsing: the command has built its parser."""


def command_modules() -> list[str]:
    found = []
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            text = path.read_text()
            if "ArgumentParser(" in text and ("def main(" in text or "def run(" in text):
                parts = path.relative_to(ROOT).with_suffix("").parts
                found.append("iterserve." + ".".join(parts))
    return found


def flags_without_help(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += flags_without_help(sub, f"{prefix} {name}")
            continue
        if not action.help:
            missing.append(f"{prefix}: {'/'.join(action.option_strings) or action.dest}")
    return missing


@pytest.mark.parametrize("module_name", command_modules())
def test_every_flag_has_help(module_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parsers: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        parsers.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    module = importlib.import_module(module_name)
    entry = getattr(module, "main", None) or module.run
    with pytest.raises(_Parsed):
        entry([]) if inspect.signature(entry).parameters else entry()
    missing = [m for p in parsers for m in flags_without_help(p, module_name)]
    assert not missing, "flags without help:\n" + "\n".join(missing)
    for parser in parsers:
        assert parser.format_help()  # help texts render (a stray % would raise here)


def test_the_locust_flags_have_help() -> None:
    """Read from the source: importing locust monkey-patches this process (gevent)."""
    tree = ast.parse((ROOT / "loadtests/locustfile.py").read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"]
    assert len(calls) > 10
    missing = [ast.literal_eval(call.args[0]) for call in calls
               if not any(k.arg == "help" for k in call.keywords)]
    assert not missing, f"locust flags without help: {missing}"


def test_the_check_sees_a_flag_without_help() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--said", help="a flag with help")
    parser.add_argument("--unsaid")
    sub = parser.add_subparsers().add_parser("nested")
    sub.add_argument("--deep")
    assert flags_without_help(parser, "p") == ["p: --unsaid", "p nested: --deep"]
