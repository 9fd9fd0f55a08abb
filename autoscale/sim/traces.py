"""Replayable request traces for the cluster simulator: JSONL (ours, Mooncake) and CSV (Azure).

JSONL, one request per line (an optional first line {"format": "iterserve-trace",
"hash_block_size": N} sets the block size of hash_ids; default 16):

    {"arrival_time": 0.51, "input_tokens": 812, "output_tokens": 128,
     "session_id": "s3", "hash_ids": [0, 1, 2, 7]}

arrival_time is seconds from the start; session_id and hash_ids are optional. hash_ids name
the prompt's leading blocks of hash_block_size tokens, as the Mooncake traces do: two
requests whose hash_ids start alike share that prefix (and can hit each other's prefix
cache); the tokens after the named blocks are the request's own. Mooncake's own fields are
accepted too ("timestamp" in ms, "input_length", "output_length", "hash_ids"; pass
hash_block_size=512 for its traces). CSV with a header: Azure LLM inference traces
(TIMESTAMP, ContextTokens, GeneratedTokens; TIMESTAMP in seconds or ISO date-time), or our
names (arrival_time, input_tokens, output_tokens[, session_id]).

A chat's next turn holds the previous turn's prompt and answer. A row continues the
previous row of its session when its prompt is at least that row's prompt plus answer long
and its hash_ids start with the hash ids of that row's full blocks: its prompt is
then built as the previous prompt, the previous answer as the simulated replica generated it,
and its own new tokens, so that the replica's prefix cache finds the whole conversation as it
would with a real model (an answer's tokens are named by no hash id in the trace: it is the
engine that produced them).

`write_trace` exports any workload (a generator's or a trace's) with hash_ids computed
from its prompts' blocks, so a synthetic workload can be shared as a file; read back, it
simulates as the generator's own requests do.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from iterserve.autoscale.sim.prompts import SyntheticPrompt, unique_start
from iterserve.autoscale.sim.workload import WorkloadRequest

DEFAULT_HASH_BLOCK_SIZE = 16
FORMAT_TAG = "iterserve-trace"
HASH_TOKEN_BASE = 1 << 30  # token ids of hashed blocks: below the requests' own (2^31+)


def _field(row: dict[str, Any], *names: str) -> Any:  # noqa: ANN401
    for name in names:
        if name in row and row[name] not in (None, ""):
            return row[name]
    raise ValueError(f"trace row lacks {' / '.join(names)}: {row}")


def _session(value: Any) -> str | None:  # noqa: ANN401
    """A row's session id as text (0 is a session; an empty cell is none)."""
    return None if value is None or value == "" else str(value)


def _seconds(value: Any) -> tuple[float, bool]:  # noqa: ANN401
    """(seconds, whether it was a date-time: an absolute time to shift to the start)."""
    try:
        return float(value), False
    except ValueError:
        return datetime.fromisoformat(str(value).strip()).timestamp(), True


@dataclass(frozen=True)
class _Row:
    arrival: float
    input_tokens: int
    output_tokens: int
    session: str | None
    hash_ids: tuple[int, ...]

    def named_blocks(self, block: int) -> tuple[int, ...]:
        return self.hash_ids[: self.input_tokens // block]


def _continues(row: _Row, previous: _Row, block: int) -> bool:
    """Whether `row` is the next turn of `previous`'s conversation (same session)."""
    # the previous answer as replayed: at least one token (WorkloadRequest's max_tokens)
    if row.input_tokens < previous.input_tokens + max(1, previous.output_tokens):
        return False
    head = previous.named_blocks(block)
    return row.hash_ids[: len(head)] == head


def _turn_parents(rows: Sequence[_Row], block: int) -> list[int | None]:
    """For each row (in arrival order), the row whose conversation it continues, if any."""
    last_of_session: dict[str, int] = {}
    parents: list[int | None] = []
    for i, row in enumerate(rows):
        parent = None
        if row.session is not None:
            previous = last_of_session.get(row.session)
            if previous is not None and _continues(row, rows[previous], block):
                parent = previous
            last_of_session[row.session] = i
        parents.append(parent)
    return parents


def _hashed_head(hash_ids: Sequence[int], input_tokens: int, block: int) -> tuple[int, ...]:
    head: list[int] = []
    for hid in hash_ids[: min(len(hash_ids), input_tokens // block)]:
        start = HASH_TOKEN_BASE + int(hid) * block
        head.extend(range(start, start + block))
    return tuple(head)


def _requests(rows: Sequence[_Row], parents: Sequence[int | None], block: int
              ) -> list[WorkloadRequest]:
    continued = {p for p in parents if p is not None}
    out: list[WorkloadRequest] = []
    for i, (row, parent) in enumerate(zip(rows, parents, strict=True)):
        if parent is None:
            head = _hashed_head(row.hash_ids, row.input_tokens, block)
        else:
            previous = out[parent]
            head = (tuple(previous.prompt_token_ids)
                    + (previous.output_token_id,) * previous.max_tokens)
        # private: no other row's prompt holds request i's own ids, unless a next turn does
        prompt = SyntheticPrompt(head, unique_start(i), row.input_tokens - len(head),
                                 private=i not in continued)
        out.append(WorkloadRequest(f"trace-{i}", row.arrival, prompt, max(1, row.output_tokens),
                              row.session, output_token_id=1 + i % 30000))
    return out


def read_trace(path: str | Path, hash_block_size: int | None = None) -> list[WorkloadRequest]:
    """Requests of a JSONL or CSV trace. Arrival times are kept as written, except
    absolute ones (Mooncake's ms timestamps, Azure's date-times): those start at 0."""
    return read_trace_turns(path, hash_block_size)[0]


def read_trace_turns(path: str | Path, hash_block_size: int | None = None
                     ) -> tuple[list[WorkloadRequest], list[int | None]]:
    """`read_trace`'s requests and, for each, the index of the request whose prompt and
    answer it continues (a chat's previous turn), or None."""
    path = Path(path)
    rows: list[dict[str, Any]] = []
    block = hash_block_size or DEFAULT_HASH_BLOCK_SIZE
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_no}: not JSON: {error}") from None
            if row.get("format") == FORMAT_TAG:
                block = hash_block_size or int(row.get("hash_block_size", block))
                continue
            rows.append(row)
    parsed: list[_Row] = []
    absolute = False
    for row in rows:
        if "timestamp" in row and "arrival_time" not in row and "TIMESTAMP" not in row:
            arrival = float(row["timestamp"]) / 1000.0  # Mooncake: milliseconds
            absolute = True
        else:
            arrival, is_date = _seconds(_field(row, "arrival_time", "TIMESTAMP"))
            absolute = absolute or is_date
        parsed.append(_Row(arrival,
                           int(_field(row, "input_tokens", "input_length", "ContextTokens")),
                           int(_field(row, "output_tokens", "output_length",
                                      "GeneratedTokens")),
                           _session(row.get("session_id")),
                           tuple(int(h) for h in row.get("hash_ids") or ())))
    if not parsed:
        raise ValueError(f"{path}: no requests")
    t0 = min(p.arrival for p in parsed) if absolute else 0.0
    parsed.sort(key=lambda p: p.arrival)
    rows = [dataclasses.replace(p, arrival=p.arrival - t0) for p in parsed]
    parents = _turn_parents(rows, block)
    return _requests(rows, parents, block), parents


def speed_up(requests: Sequence[WorkloadRequest], speed: float) -> list[WorkloadRequest]:
    """The same requests arriving `speed` times faster (arrival times divided by it): a
    recorded trace replayed at a higher (speed > 1) or lower request rate, every request's
    prompt and length unchanged."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    return [dataclasses.replace(r, arrival_time=r.arrival_time / speed) for r in requests]


def trace_digest(path: str | Path) -> str:
    """sha256 of the trace file's bytes: results of an edited trace are not the old ones."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def trace_rows(requests: Sequence[WorkloadRequest], hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE
               ) -> list[dict[str, Any]]:
    """Trace rows of a workload: hash ids numbered by first appearance of each
    (previous block, block tokens) chain, as the Mooncake traces number theirs."""
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    rows = []
    for r in sorted(requests, key=lambda r: r.arrival_time):
        tokens = r.prompt_token_ids
        parent, hash_ids = -1, []
        for b in range(len(tokens) // hash_block_size):
            key = (parent, tuple(tokens[b * hash_block_size : (b + 1) * hash_block_size]))
            parent = ids.setdefault(key, len(ids))
            hash_ids.append(parent)
        row: dict[str, Any] = {"arrival_time": round(r.arrival_time, 6),
                               "input_tokens": len(tokens), "output_tokens": r.max_tokens}
        if r.session_id is not None:
            row["session_id"] = r.session_id
        row["hash_ids"] = hash_ids
        rows.append(row)
    return rows


def write_trace(requests: Sequence[WorkloadRequest], path: str | Path,
                hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE) -> None:
    lines = [json.dumps({"format": FORMAT_TAG, "hash_block_size": hash_block_size})]
    lines += [json.dumps(row) for row in trace_rows(requests, hash_block_size)]
    Path(path).write_text("\n".join(lines) + "\n")
