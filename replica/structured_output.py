"""Constrained decoding with xgrammar: compile off the engine thread, mask, advance.

    GrammarCompilerPool   compiles StructuredSpecs on a small thread pool, cached by spec
    GrammarState          one request's matcher plus its next-token bitmask ([1, V/32] int32)
    apply_grammar_bitmasks  the sampler's hook: one batched bitmask apply per step

Life of a constrained request (vLLM v1's design): the engine holds it until its grammar
future resolves (counted as waiting), then gives each child its own matcher. The bitmask is
filled right after each accepted token, so the sampler only applies it; a matcher that
rejects the sampled token or allows nothing next is a dead end, reported on the constraint.
Preemption keeps the matcher: the recomputed prompt and output are the tokens it accepted.

Why xgrammar and not llguidance. Checked against xgrammar 0.2.9 (this project's venv) and
llguidance 1.7.6 with xgrammar 0.2.8 (the vLLM 0.32 CPU build on the dev box), on SmolLM2's
49k vocabulary, one valid document of structured_workload's moderately complex schema, CPU,
under the heavy-run lock on 2 shared cores (loadtests/studies/structured_outputs/: its
structured_backends.py):
- The bitmask apply, paid every step. `xgr.apply_token_bitmask_inplace` takes `indices`: one
  call masks just the constrained rows of a mixed batch, in C++ for CPU tensors and with a
  Triton kernel for CUDA ones (0.02 ms for 32 of 64 rows; first call 1 ms).
  `llguidance.torch.apply_token_bitmask_inplace` wants one mask row per logits row and is a
  `torch.compile` function: 0.24 ms for 64 rows, after a 2.5 s compile on first use, which
  would land on the engine thread.
- The per-token mask fill on the engine thread: p50 2 us (xgrammar) vs 14 us (llguidance).
- What vLLM users send: vLLM's "auto" backend tries xgrammar first and falls back to
  guidance only for what xgrammar rejects (vllm/sampling_params.py), so guided_* requests
  written for vLLM are xgrammar's inputs (its EBNF; llguidance converts GBNF to Lark).
- The compiled form is text: `Grammar.from_json_schema` gives EBNF that `json_grammar`
  patches (0.2.9's string character class) before compiling, with `any_whitespace=False`.
llguidance is better at compile time: 0.86 ms to build a matcher for that schema (lazily),
where xgrammar 0.2.9 takes 7 ms (0.2.8: 301 ms) and 2.7 ms p50 / 12.7 ms p99 over 101
assorted schemas; here compiles run off the engine thread and are cached, so they never
stall the batch (only the request that waits for its grammar). vLLM sends llguidance
the schemas xgrammar rejects; here those are a 400.
Figures: loadtests/studies/structured_outputs/structured_backends.py, BENCHMARKS.md "Structured outputs".
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass

import torch
import xgrammar as xgr

from iterserve.replica.structured_spec import StructuredSpec
from iterserve.replica.tokenizer import Tokenizer

COMPILE_THREADS = 2
# xgrammar (0.2.9) writes the characters of a length-bounded JSON string as [^"\\\r\n], which
# admits raw control characters that JSON forbids (a small model does emit \x12); its
# unbounded strings use the right class. The compiled EBNF is patched to the right class.
LOOSE_STRING_CHARS = '[^\\"\\\\\\r\\n]'
STRICT_STRING_CHARS = '[^\\0-\\x1f\\"\\\\]'


def tokenizer_info(tokenizer: Tokenizer, logits_width: int,
                   stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary. Ids past the tokenizer's vocab (the padded rows of
    the embedding) have no text, so every bitmask disallows them."""
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
    width = max(logits_width, tokenizer.vocab_size)
    encoded = [""] * min(tokenizer.vocab_size, width)
    for token, token_id in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if token_id < len(encoded):
            encoded[token_id] = token
    return xgr.TokenizerInfo(encoded, xgr.VocabType(metadata["vocab_type"]), vocab_size=width,
                             stop_token_ids=stop_token_ids,
                             add_prefix_space=bool(metadata["add_prefix_space"]))


@dataclass(frozen=True)
class CompileStats:
    num_requests: int
    num_cache_hits: int
    compile_times_s: tuple[float, ...]

    @property
    def hit_rate(self) -> float:
        return self.num_cache_hits / self.num_requests if self.num_requests else 0.0


def json_grammar(schema: str, strict_mode: bool) -> str:
    """The schema's EBNF: no free whitespace (a small model would pad JSON with newlines),
    and no raw control characters in strings."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode)
    return str(grammar).replace(LOOSE_STRING_CHARS, STRICT_STRING_CHARS)


class GrammarCompilerPool:
    """Compiles specs on COMPILE_THREADS threads; a second request for a spec shares the
    first one's future, so the cache also deduplicates compiles in flight."""

    def __init__(self, info: xgr.TokenizerInfo, cache_size: int = 512) -> None:
        self.info = info
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.executor = concurrent.futures.ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self.cache: dict[StructuredSpec, concurrent.futures.Future] = {}
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._num_requests = 0
        self._num_hits = 0
        self._compile_times: list[float] = []

    def compile(self, spec: StructuredSpec) -> concurrent.futures.Future:
        with self._lock:
            self._num_requests += 1
            future = self.cache.get(spec)
            if future is not None and not (future.done() and future.exception()):
                self._num_hits += 1
                return future
            if len(self.cache) >= self.cache_size:
                self.cache.pop(next(iter(self.cache)))  # oldest first
            future = self.executor.submit(self._compile_timed, spec)
            self.cache[spec] = future
            return future

    def _compile_timed(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        compiled = self._compile(spec)
        with self._lock:
            self._compile_times.append(time.perf_counter() - start)
        return compiled

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json_object":
                return self.compiler.compile_grammar(json_grammar('{"type": "object"}', False))
            if spec.kind == "json_schema":
                return self.compiler.compile_grammar(json_grammar(spec.text, True))
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.text)
            if spec.kind == "choice":
                return self.compiler.compile_grammar(spec.as_ebnf())
            return self.compiler.compile_grammar(spec.text)
        except RuntimeError as error:
            raise ValueError(f"invalid {spec.kind}: {str(error).strip().splitlines()[-1]}") from error

    def stats(self) -> CompileStats:
        with self._lock:
            return CompileStats(self._num_requests, self._num_hits, tuple(self._compile_times))

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's matcher and the bitmask of tokens it allows next."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.stop_token_ids = stop_token_ids
        self.bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)  # [1, W]
        self.dead_end = not self._fill()

    def accept(self, token_id: int) -> str | None:
        """Advance with the sampled token; an error message on a dead end, else None."""
        if self.matcher.is_terminated():
            return None  # the stop token was accepted; the engine finishes the request
        if not self.matcher.accept_token(token_id):
            return f"structured output dead end: the grammar rejected token {token_id}"
        if not self.matcher.is_terminated() and not self._fill():
            return "structured output dead end: the grammar allows no next token"
        return None

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def _fill(self) -> bool:
        """Refill the bitmask; False when it allows no token at all."""
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        return bool(self.bitmask.any())

    def reallow_stop(self, row: torch.Tensor) -> bool:  # row: [V]
        """When the grammar is complete, let its stop tokens through again (min_tokens must
        not push a finished grammar into a dead end). True if it did."""
        if not self.matcher.is_completed() or not self.stop_token_ids:
            return False
        row[[t for t in self.stop_token_ids if t < row.shape[0]]] = 0.0
        return True


def apply_grammar_bitmasks(logits: torch.Tensor, rows: list[int],
                           states: list[GrammarState]) -> None:
    """logits: [S, V]; rows[k] is masked by states[k]'s bitmask, in one kernel call."""
    width = states[0].bitmask.shape[1]
    bitmask = torch.full((logits.shape[0], width), -1, dtype=torch.int32)  # -1: all allowed
    bitmask[rows] = torch.cat([s.bitmask for s in states])
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
