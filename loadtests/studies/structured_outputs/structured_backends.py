"""xgrammar vs llguidance on one vocabulary and one schema: the figures behind the choice of
xgrammar (replica/structured_output.py's docstring). Standalone: it needs both libraries,
which the project's venv does not have (llguidance is not a dependency), so it imports
nothing from iterserve and reads its inputs from files.

    # in the project's venv: the built-in model's tokenizer and the benchmark's schema
    python -c "from iterserve.replica.model_source import resolve_model_path; \\
      from iterserve.replica.tokenizer import Tokenizer; \\
      open('/tmp/tok.json', 'w').write(Tokenizer.from_pretrained(resolve_model_path(None)).backend.to_str())"
    python -c "import json; \\
      from iterserve.loadtests.studies.structured_outputs.structured_workload import \\
        moderately_complex_schema as s; \\
      json.dump(s(), open('/tmp/schema.json', 'w'))"
    # in an environment with xgrammar, llguidance, torch and transformers (e.g. vLLM's)
    python loadtests/studies/structured_outputs/structured_backends.py --tokenizer-json \
        /tmp/tok.json --schema-json /tmp/schema.json

Per library: compile (median of 5), the per-token mask fill along one valid document, and
the batched bitmask apply on a [64, V] CPU logits tensor (its first call separately).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

DOCUMENT = {"order_id": 42, "customer": {"name": "Ada", "tier": "pro"},
            "items": [{"sku": "ABC-123", "quantity": 2, "price": 9.5}], "gift": False,
            "notes": None}  # valid for loadtests/structured_workload.moderately_complex_schema
BATCH = 64


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def spread_us(times: list[float]) -> str:
    return f"p50 {1e6 * statistics.median(times):.0f} us, max {1e6 * max(times):.0f} us"


def apply_ms(fn: Callable[[], Any]) -> str:
    first = timed(fn, 1)[0]
    return (f"first call {1e3 * first:.0f} ms, then p50 "
            f"{1e3 * statistics.median(timed(fn, 20)):.2f} ms")


def xgrammar_figures(tokenizer: Any, schema: str, vocab: int) -> list[str]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_s = timed(lambda: compiler.compile_json_schema(schema, any_whitespace=False), 5)
    compiled = compiler.compile_json_schema(schema, any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    fills = []
    # xgrammar's JSON without free whitespace uses ", " and ": " (json.dumps's default)
    for token in tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False):
        fills += timed(lambda: matcher.fill_next_token_bitmask(mask, 0), 1)
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar rejected token {token} of a valid document")
    logits = torch.randn(BATCH, vocab)
    bitmask = torch.full((BATCH, (vocab + 31) // 32), -1, dtype=torch.int32)
    rows = list(range(0, BATCH, 2))
    apply = apply_ms(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab,
                                                             indices=rows))
    return [f"xgrammar {importlib.metadata.version('xgrammar')}: compile (median of 5) "
            f"{1e3 * statistics.median(compile_s):.1f} ms; fill {spread_us(fills)}; apply "
            f"({len(rows)} of {BATCH} rows, indices) {apply}"]


def llguidance_figures(tokenizer: Any, schema: str, vocab: int) -> list[str]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def build() -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        return llguidance.LLMatcher(ll_tokenizer, grammar)

    compile_s = timed(build, 5)
    matcher = build()
    if matcher.is_error():
        raise RuntimeError(matcher.get_error())
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    fills = []
    # llguidance's JSON without flexible whitespace is compact: "," and ":"
    compact = json.dumps(DOCUMENT, separators=(",", ":"))
    for token in tokenizer.encode(compact, add_special_tokens=False):
        fills += timed(lambda: llguidance.torch.fill_next_token_bitmask(matcher, mask, 0), 1)
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance rejected token {token}: {matcher.get_error()}")
    logits = torch.randn(BATCH, vocab)
    bitmask = torch.full((BATCH, (vocab + 31) // 32), -1, dtype=torch.int32)
    apply = apply_ms(lambda: llguidance.torch.apply_token_bitmask_inplace(logits, bitmask))
    return [f"llguidance {importlib.metadata.version('llguidance')}: grammar + matcher (median "
            f"of 5) {1e3 * statistics.median(compile_s):.2f} ms; fill {spread_us(fills)}; apply "
            f"(all {BATCH} rows: it takes no indices) {apply}"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer-json", required=True,
                        help="an HF tokenizer.json (the served model's)")
    parser.add_argument("--schema-json", required=True, help="the JSON schema to compile and walk")
    args = parser.parse_args(argv)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer_json)
    with open(args.schema_json, encoding="utf-8") as file:
        schema = json.dumps(json.load(file))
    vocab = len(tokenizer)
    print(f"vocabulary {vocab}, torch {torch.__version__}")
    for line in xgrammar_figures(tokenizer, schema, vocab) + llguidance_figures(tokenizer, schema,
                                                                              vocab):
        print(line)


if __name__ == "__main__":
    main()
