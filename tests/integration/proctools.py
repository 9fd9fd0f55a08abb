"""What is left of a server after it stopped: the live processes of its session.

A server started with `start_new_session=True` leads a session whose id is its pid, and the
Ray processes it starts (GCS, raylet, workers, agents) stay in that session even when they
outlive it, so an empty session means that nothing of the server is left.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path


def session_processes(sid: int) -> list[str]:
    """The live processes of session `sid`, as "pid command" lines (zombies left out)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue  # it ended while we looked
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            found.append(f"{entry.name} {cmdline[:80]}")
    return found


def wait_until_gone(sid: int, timeout_s: float = 30.0) -> list[str]:
    """The session's processes once they are all gone or `timeout_s` has passed (Ray's own
    processes end a moment after the driver)."""
    deadline = time.monotonic() + timeout_s
    while session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return session_processes(sid)


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(2)
        return probe.connect_ex(("127.0.0.1", port)) == 0
