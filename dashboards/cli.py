"""`iterserve dashboards <push|generate>`: the nested commands of the dashboards room."""

from __future__ import annotations

import sys

USAGE = """usage: iterserve dashboards <command> [options]

commands:
  push       upload the folder, datasource and dashboard to Grafana (grafana-client)
  generate   rewrite iterserve.json, provisioning/ and the Prometheus configs (--check: drift)
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "push":
        from iterserve.dashboards.push import main as push_main

        return push_main(rest)
    if command == "generate":
        from iterserve.dashboards.grafana import main as generate_main

        return generate_main(rest)
    print(f"iterserve dashboards: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
