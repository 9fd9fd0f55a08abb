"""The lint step's dead-code check: library code that nothing outside the tests uses fails it.

Runs vulture over what ships (the library rooms and loadtests' tools) and the studies, and
reports the functions, classes, methods, properties and imports of the shipped code that
none of them uses. The tests are not read: code only a test calls is dead (a readable oracle
belongs with the tests, tests/router_oracle.py for example). Variables and attributes are
not reported: dataclass, pydantic and protocol fields are declarations that frameworks read.

    .venv/bin/python scripts/deadcode.py        # prints what is unused; exit 1 if anything
"""

from __future__ import annotations

import sys
from pathlib import Path

import vulture

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ["replica", "kernels", "deploy", "autoscale", "dashboards", "loadtests"]
STUDIES = "loadtests/studies"  # read as users of the library, not reported themselves
REPORTED = {"function", "class", "method", "property", "import", "unreachable_code"}
# Decorators that register a function with a framework, which then calls it by itself.
FRAMEWORK_DECORATORS = ["@router.*", "@app.*", "@field_validator", "@model_validator",
                        "@model_serializer", "@field_serializer", "@events.*", "@task",
                        "@*.setter"]
# Whole files whose definitions are found by another program, not imported.
FOUND_BY_NAME = {
    "loadtests/locustfile.py": "Locust loads the file and finds its users and shapes",
    "kernels/reference.py": "the kernels' oracle: tests/kernels hold each kernel to it, and "
                            "replica/ops.py takes its functions by name for the CPU path",
}
# Names that stay although nothing here calls them, and why (keep it short).
ALLOWED = {
    "forward": "torch calls nn.Module.forward through __call__",
    "__getattr__": "replica/__init__.py's lazy attributes (PEP 562)",
    "KVAwareRouter": "named by the Serve configs and the KubeRay manifest",
    "choose_replicas": "Ray Serve's RequestRouter calls it",
    "on_request_routed": "Ray Serve's RequestRouter calls it",
    "on_request_completed": "Ray Serve's RequestRouter calls it",
    "check_health": "Ray Serve calls it on every replica",
    "end_streams": "the drain calls it on every replica by name (deploy/shutdown.py)",
    "record_autoscaling_stats": "Ray Serve calls it for the custom autoscaling policy",
    "make_model": "the `iterserve make-model` subcommand, named in deploy/cli.py's table",
    "check_invariants": "the block manager's invariant; the engine tests check it every step",
    "bos_token_id": "the tokenizer's HF-compatible API (parity tests against transformers)",
    "all_special_ids": "the tokenizer's HF-compatible API (parity tests against transformers)",
    "write_trace": "the README's way to export a workload as a trace file",
    "LocalEngineClient": "the ingress on an in-process engine, without Ray (deploy/__init__)",
    "anonymous_blocks": "SimFreeBlockPool's state, read where its reuse order is checked",
}


def unused(root: Path = ROOT) -> list[str]:
    finder = vulture.Vulture(ignore_decorators=FRAMEWORK_DECORATORS,
                             ignore_names=list(ALLOWED))
    finder.scavenge([str(root / room) for room in SHIPPED if (root / room).is_dir()])
    found = []
    for item in finder.get_unused_code(min_confidence=0):
        path = Path(item.filename).resolve().relative_to(root).as_posix()
        if item.typ not in REPORTED or path.startswith(STUDIES) or path in FOUND_BY_NAME:
            continue
        found.append(f"{path}:{item.first_lineno}: unused {item.typ} {item.name!r}")
    return sorted(found)


def main() -> int:
    found = unused()
    for line in found:
        print(line)
    if found:
        print(f"dead code: {len(found)} unused (delete it, or add it to ALLOWED in "
              f"scripts/deadcode.py with the reason it stays)", file=sys.stderr)
        return 1
    print(f"dead code: none ({len(ALLOWED)} names allowed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
