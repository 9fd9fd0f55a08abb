"""The host KV tier over HTTP: returning-turn TTFT on multi-turn chat and RAG, side by side.

    python -m iterserve.loadtests.studies.kv_tiers.kv_tiers_http --model builtin \\
        --out loadtests/studies/kv_tiers/results/http_builtin.json

Three `iterserve serve` deployments (Ray Serve, one replica each, the real HTTP path) run at
once and every request goes to all three in turn, the order rotating request by request, so
that noise from other processes hits all alike:

  off   the device KV alone (`--num-gpu-blocks-override` D), prefix caching on;
  host  the same device KV plus a host tier holding the working set (`--kv-offloading-size`);
  big   no tier, the device KV enlarged by the tier's bytes (D + H blocks).

The official `openai` client sends token-id prompts to /v1/completions, streamed with usage;
TTFT is the time to the first streamed chunk, seen from the client. Two workloads, each with a
working set about `--working-set` times the device KV, new prompts every round:

  chat  C conversations, a first turn of `--first-tokens`, then returning turns each adding
        `--answer-tokens` and `--new-tokens`, round-robin: every returning turn carries its
        whole history (>= 2k tokens) as a cacheable prefix. The answer tokens appended are
        stand-ins drawn like the prompt (the completions API returns text, not ids), so each
        turn's answer block is computed again, alike in every deployment.
  rag   a shared system prompt, then one of N documents of `--doc-tokens` (Zipf popularity,
        `--zipf`), then a fresh question: a document's later visits can reuse its prefix.

Only returning turns (chat) and later visits of a document (rag) are timed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from openai import OpenAI

from iterserve.loadtests.servers import serve_mode
from iterserve.loadtests.studies.kv_tiers.kv_tiers_bench import BLOCK, ChatWorkload, engine_for
from iterserve.replica.host_kv_tier import GIB
from iterserve.replica.make_model import default_model_path
from iterserve.replica.model_source import builtin_model_path

CONFIGS = ("off", "host", "big")
# Three Ray clusters on one machine each see the whole node's memory as theirs: past 95 % of
# it (the other two clusters' use counted) Ray's memory monitor kills its own replicas and
# controller. The kernel's OOM killer still guards the machine.
RAY_ENV = {"RAY_memory_monitor_refresh_ms": "0"}


@dataclass(frozen=True)
class TimedRequest:
    prompt: list[int]
    max_tokens: int
    timed: bool  # a returning turn, or a document's later visit


@dataclass
class Measured:
    ttfts_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)


def chat_requests(workload: ChatWorkload, seed: int) -> list[TimedRequest]:
    """Every turn of every conversation, round-robin over the conversations."""
    rng = random.Random(seed)
    histories = [[rng.randrange(10, 4000) for _ in range(workload.first_tokens)]
                 for _ in range(workload.conversations)]
    requests = []
    for turn in range(workload.turns + 1):
        for i, history in enumerate(histories):
            requests.append(TimedRequest(history, workload.answer_tokens, timed=turn > 0))
            answer = [rng.randrange(10, 4000) for _ in range(workload.answer_tokens)]
            new = [rng.randrange(10, 4000) for _ in range(workload.new_tokens)]
            histories[i] = history + answer + new
    return requests


@dataclass(frozen=True)
class RagWorkload:
    documents: int
    doc_tokens: int
    system_tokens: int
    question_tokens: int
    answer_tokens: int
    requests: int
    zipf: float

    def blocks_per_document(self) -> int:
        return -(-(self.system_tokens + self.doc_tokens) // BLOCK)


def rag_requests(workload: RagWorkload, seed: int) -> list[TimedRequest]:
    """System prompt + one document (Zipf over a shuffled order) + a fresh question."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 4000) for _ in range(workload.system_tokens)]
    documents = [[rng.randrange(10, 4000) for _ in range(workload.doc_tokens)]
                 for _ in range(workload.documents)]
    weights = [1.0 / (rank + 1) ** workload.zipf for rank in range(workload.documents)]
    seen: set[int] = set()
    requests = []
    for _ in range(workload.requests):
        doc = rng.choices(range(workload.documents), weights)[0]
        question = [rng.randrange(10, 4000) for _ in range(workload.question_tokens)]
        requests.append(TimedRequest(system + documents[doc] + question,
                                     workload.answer_tokens, timed=doc in seen))
        seen.add(doc)
    return requests


def send(client: OpenAI, model: str, request: TimedRequest) -> tuple[float, int]:
    """(TTFT in seconds seen from the client, cached prompt tokens from usage)."""
    start = time.perf_counter()
    ttft, cached = math.nan, -1
    stream = client.completions.create(model=model, prompt=request.prompt, stream=True,
                                       max_tokens=request.max_tokens, temperature=0.0,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if math.isnan(ttft) and chunk.choices:
            ttft = time.perf_counter() - start
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return ttft, cached


def run_round(clients: dict[str, tuple[OpenAI, str]], requests: list[TimedRequest]
              ) -> dict[str, Measured]:
    """Each request to every deployment, the order rotating request by request."""
    measured = {name: Measured() for name in clients}
    names = list(clients)
    for index, request in enumerate(requests):
        for name in names[index % len(names):] + names[:index % len(names)]:
            client, model = clients[name]
            ttft, cached = send(client, model, request)
            if request.timed:
                measured[name].ttfts_s.append(ttft)
                measured[name].cached_tokens.append(cached)
    return measured


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(workload: str, rounds: list[dict[str, Measured]]) -> dict[str, object]:
    """Per-round and pooled figures, printed and returned."""
    pooled = {name: [t for r in rounds for t in r[name].ttfts_s] for name in CONFIGS}
    p50 = {name: [percentile(r[name].ttfts_s, 0.5) for r in rounds] for name in CONFIGS}
    print(f"\n{workload}: timed requests per deployment {len(pooled['off'])} "
          f"({len(rounds)} rounds)")
    for name in CONFIGS:
        cached = [c for r in rounds for c in r[name].cached_tokens]
        print(f"  {name:>4}: TTFT p50 {percentile(pooled[name], 0.5) * 1e3:8.1f} ms  "
              f"p90 {percentile(pooled[name], 0.9) * 1e3:8.1f} ms  "
              f"per-round p50 {' / '.join(f'{v * 1e3:.0f}' for v in p50[name])} ms  "
              f"cached {statistics.mean(cached):6.0f} tokens/request")
    ratios = {"off/host": [a / b for a, b in zip(p50["off"], p50["host"], strict=True)],
              "host/big": [a / b for a, b in zip(p50["host"], p50["big"], strict=True)]}
    for label, values in ratios.items():
        print(f"  {label} p50 per round: {', '.join(f'{v:.2f}' for v in values)}  "
              f"(median {statistics.median(values):.2f}x)")
    return {"pooled_ttft_s": pooled, "p50_per_round_s": p50, "ratios_per_round": ratios,
            "rounds": [{n: asdict(m) for n, m in r.items()} for r in rounds]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin", help="builtin, tiny, or a path")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, new prompts each")
    parser.add_argument("--workload", choices=("chat", "rag", "both"), default="both",
                        help="which workload(s) to run")
    parser.add_argument("--working-set", type=float, default=4.0,
                        help="working set over the device KV")
    parser.add_argument("--conversations", type=int, default=6, help="chats in the working set")
    parser.add_argument("--first-tokens", type=int, default=2048, help="a chat's first prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="user tokens a turn adds")
    parser.add_argument("--answer-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--turns", type=int, default=3, help="returning turns a conversation")
    parser.add_argument("--documents", type=int, default=9, help="RAG documents")
    parser.add_argument("--doc-tokens", type=int, default=1536, help="tokens per document")
    parser.add_argument("--rag-requests", type=int, default=40, help="RAG requests a round")
    parser.add_argument("--zipf", type=float, default=0.6, help="document popularity exponent")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    model = {"tiny": str(default_model_path()), "builtin": str(builtin_model_path())}.get(
        args.model, args.model)
    chat = ChatWorkload(args.conversations, args.first_tokens, args.new_tokens,
                        args.answer_tokens, args.turns)
    rag = RagWorkload(args.documents, args.doc_tokens, 64, 64, args.answer_tokens,
                      args.rag_requests, args.zipf)
    working_set = max(chat.conversations * chat.final_blocks(),
                      rag.documents * rag.blocks_per_document())
    device = max(math.ceil(working_set / args.working_set), chat.final_blocks() + 1,
                 rag.blocks_per_document() + 8)
    host = working_set
    bytes_per_block = engine_for(model, 1, num_gpu_blocks_override=16).runner.kv_bytes_per_block
    host_gib = host * bytes_per_block / GIB
    common = ["--model", model, "--block-size", str(BLOCK), "--num-replicas", "1"]
    serve_args = {"off": [*common, "--num-gpu-blocks-override", str(device)],
                  "host": [*common, "--num-gpu-blocks-override", str(device),
                           "--kv-offloading-size", f"{host_gib:.6f}"],
                  "big": [*common, "--num-gpu-blocks-override", str(device + host)]}
    print(f"model {model}; device KV {device} blocks, host tier {host} blocks "
          f"({host_gib:.3f} GiB), working set {working_set} blocks")
    log_dir = Path(tempfile.mkdtemp(prefix="kv-tiers-http-"))  # each server's log
    print(f"server logs in {log_dir}")
    figures: dict[str, object] = {}
    with ExitStack() as stack:
        clients = {}
        for name in CONFIGS:
            url, card = stack.enter_context(serve_mode("continuous", serve_args[name],
                                                       log_dir / name, None, RAY_ENV))
            clients[name] = (OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600),
                             card["id"])
        workloads = {"chat": lambda seed: chat_requests(chat, seed),
                     "rag": lambda seed: rag_requests(rag, seed)}
        for name, make in workloads.items():
            if args.workload not in (name, "both"):
                continue
            rounds = []
            for round_index in range(args.rounds):
                rounds.append(run_round(clients, make(1000 * round_index + len(name))))
                print(f"{name} round {round_index}: "
                      + ", ".join(f"{n} p50 {percentile(m.ttfts_s, 0.5) * 1e3:.0f} ms"
                                  for n, m in rounds[-1].items()), flush=True)
            figures[name] = report(name, rounds)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "device_blocks": device, "host_blocks": host,
                                        "bytes_per_block": bytes_per_block, **figures},
                                       indent=1))


if __name__ == "__main__":
    main()
