"""`iterserve` console script: a thin dispatcher over lazily imported subcommands.

A subcommand is a function `run(argv: list[str]) -> int | None` that parses its own
arguments (argparse) and returns an exit code. Nothing is imported until the subcommand is
chosen, so `iterserve --help` is instant and one broken subcommand cannot break the others.

Adding a subcommand (two ways, pick one):

1. Add a line to `SUBCOMMANDS` below: name -> (module path, function name, one-line help).
       "bench": ("iterserve.loadtests.bench", "main", "run the static-vs-continuous benchmark"),
2. Or, without touching this file, declare an entry point in pyproject.toml:
       [project.entry-points."iterserve.commands"]
       bench = "iterserve.loadtests.bench:main"
   (its help line is the function's docstring's first line).

Nested commands (`iterserve dashboards push`) are the subcommand's own business: register
"dashboards" and parse `push` inside it. Flags of an existing subcommand (`serve --simulate`)
belong to that subcommand's parser (`deploy/cli_serve.py`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from importlib import metadata

ENTRY_POINT_GROUP = "iterserve.commands"

SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("iterserve.deploy.cli_serve", "run",
              "serve a model behind the OpenAI-compatible API on Ray Serve"),
    "make-model": ("iterserve.deploy.cli", "make_model",
                   "write a tiny random-weight checkpoint: iterserve make-model DIR --seed N"),
    "export-tokenizer": ("iterserve.deploy.cli_export", "run",
                         "write the served model's tokenizer as an HF folder: DIR [--model]"),
    "dashboards": ("iterserve.dashboards.cli", "main",
                   "Grafana dashboards: `generate` the JSON, `push` it with grafana-client"),
}

Runner = Callable[[list[str]], "int | None"]


def make_model(argv: list[str]) -> int:
    """Write a tiny random-weight checkpoint (iterserve.replica.make_model)."""
    from iterserve.replica.make_model import main as make_model_main

    make_model_main(argv)
    return 0


def _entry_points() -> dict[str, metadata.EntryPoint]:
    try:
        found = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # pragma: no cover - Python < 3.10 API
        found = metadata.entry_points().get(ENTRY_POINT_GROUP, [])  # type: ignore[attr-defined]
    return {ep.name: ep for ep in found}


def resolve(name: str) -> Runner | None:
    """The subcommand's function, imported now; None if no such subcommand."""
    if name in SUBCOMMANDS:
        module_path, function_name, _ = SUBCOMMANDS[name]
        return getattr(importlib.import_module(module_path), function_name)
    entry = _entry_points().get(name)
    return entry.load() if entry is not None else None


def _entry_help(entry: metadata.EntryPoint) -> str:
    """The first line of the entry point's docstring (imported for `--help` only)."""
    try:
        doc = entry.load().__doc__ or ""
    except ImportError as error:
        return f"(unavailable: {error})"
    return doc.strip().splitlines()[0] if doc.strip() else f"(from {entry.value})"


def usage() -> str:
    lines = ["usage: iterserve <command> [options]", "", "commands:"]
    commands = {name: help_ for name, (_, _, help_) in SUBCOMMANDS.items()}
    for name, entry in _entry_points().items():
        commands.setdefault(name, _entry_help(entry))
    width = max(len(n) for n in commands) + 2
    lines += [f"  {name.ljust(width)}{help_}" for name, help_ in sorted(commands.items())]
    lines += ["", "Run `iterserve <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        from iterserve import __version__

        print(f"iterserve {__version__}")
        return 0
    runner = resolve(args[0])
    if runner is None:
        print(f"iterserve: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    code = runner(args[1:])
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
