"""lm-eval (the real client, a test-only dependency) against a live `iterserve serve`.

lm-eval's `local-completions` model in its default tokenized mode: it tokenizes on its side
with an HF tokenizer folder written by `iterserve export-tokenizer`, sends token ids with
`echo: true, logprobs: 1, max_tokens: 1` for log-likelihoods and plain completions for
`generate_until`. Two tasks are defined here from local JSONL (no downloads): a 24-question
multiple-choice set and a short-answer generation set. The log-likelihood lm-eval reports for
every (context, continuation) must equal HF transformers' sum of the continuation's token
log-probabilities over the same token ids, within 1e-3, in fp32.

Starts a server (embedded Ray): run under the heavy-test lock.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1200)]

SERVED_NAME = "lm-eval-model"
MODEL: str | None = None  # the built-in model

# (question, choices, index of the answer)
MULTIPLE_CHOICE: list[tuple[str, list[str], int]] = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What is the capital of Japan?", ["Beijing", "Seoul", "Tokyo", "Bangkok"], 2),
    ("What is the capital of Italy?", ["Rome", "Vienna", "Athens", "Lisbon"], 0),
    ("What is the capital of Germany?", ["Munich", "Berlin", "Hamburg", "Zurich"], 1),
    ("What is the capital of Spain?", ["Barcelona", "Seville", "Madrid", "Porto"], 2),
    ("What is the capital of the United Kingdom?", ["Dublin", "Edinburgh", "London",
                                                    "Cardiff"], 2),
    ("What color is the sky on a clear day?", ["green", "blue", "red", "purple"], 1),
    ("What color is grass?", ["green", "blue", "orange", "white"], 0),
    ("How many legs does a spider have?", ["six", "four", "eight", "ten"], 2),
    ("How many days are in a week?", ["five", "seven", "ten", "twelve"], 1),
    ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
    ("What is 10 times 10?", ["20", "100", "1000", "110"], 1),
    ("Which animal says 'meow'?", ["dog", "cow", "cat", "duck"], 2),
    ("Which animal barks?", ["dog", "cat", "fish", "snake"], 0),
    ("What do bees make?", ["milk", "honey", "silk", "wool"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], 1),
    ("What gas do humans need to breathe?", ["oxygen", "helium", "neon", "argon"], 0),
    ("Which is the largest ocean?", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    ("Who wrote 'Romeo and Juliet'?", ["Charles Dickens", "William Shakespeare",
                                       "Jane Austen", "Mark Twain"], 1),
    ("What is the opposite of hot?", ["warm", "cold", "wet", "loud"], 1),
    ("How many months are in a year?", ["ten", "eleven", "twelve", "thirteen"], 2),
    ("Which fruit is yellow and curved?", ["apple", "banana", "grape", "cherry"], 1),
    ("What is the boiling point of water in Celsius?", ["50 degrees", "100 degrees",
                                                        "0 degrees", "200 degrees"], 1),
]
GENERATION: list[tuple[str, str]] = [
    ("What is the capital of France?", "Paris"),
    ("What is 3 + 4?", "7"),
    ("What color is a banana?", "yellow"),
    ("How many legs does a cat have?", "4"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the largest planet in the solar system?", "Jupiter"),
]

MC_TASK = """
task: iterserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """
task: iterserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "Question:"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "(\\\\S[^.\\\\n]*)"
        group_select: 0
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


def write_tasks(folder: Path) -> None:
    mc = folder / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                          for q, c, a in MULTIPLE_CHOICE))
    gen = folder / "gen.jsonl"
    gen.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                           for q, a in GENERATION))
    (folder / "iterserve_mc.yaml").write_text(MC_TASK.format(data=mc))
    (folder / "iterserve_gen.yaml").write_text(GEN_TASK.format(data=gen))


def hf_model(model_path: str) -> Any:
    """The served checkpoint in HF transformers, fp32 (a GGUF file is dequantized by HF)."""
    path = Path(model_path)
    if path.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_loglikelihood(model: Any, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [len, V]
    positions = range(len(context), len(context) + len(continuation))
    return sum(float(logprobs[p - 1, ids[0, p]]) for p in positions)


@pytest.fixture(scope="module")
def server(integration: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    port = integration.free_port()
    argv = [sys.executable, "-m", "iterserve.deploy.cli", "serve", "--port", str(port),
            "--ray-num-cpus", "2", "--num-gpus-per-replica", "0", "--device", "cpu",
            "--dtype", "float32", "--max-model-len", "1024", "--served-model-name", SERVED_NAME]
    if MODEL is not None:
        argv += ["--model", MODEL]
    base_url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("lm-eval-server") / "iterserve.log"
    with integration.server_process(argv, base_url, log, timeout_s=300):
        import httpx

        card = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]
        yield base_url, card["metadata"]["model"]


def test_lm_eval_local_completions_matches_hf(server: tuple[str, str], tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from iterserve.deploy import cli

    base_url, model_path = server
    tokenizer_dir = tmp_path / "tokenizer"
    argv = ["export-tokenizer", str(tokenizer_dir)] + (["--model", MODEL] if MODEL else [])
    assert cli.main(argv) == 0
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    write_tasks(tasks_dir)
    lm = LocalCompletionsAPI(base_url=f"{base_url}/v1/completions", model=SERVED_NAME,
                             tokenizer=str(tokenizer_dir), tokenizer_backend="huggingface",
                             max_retries=1, max_length=1024, timeout=120)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["iterserve_mc", "iterserve_gen"],
        task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    accuracy = results["results"]["iterserve_mc"]["acc,none"]
    exact = results["results"]["iterserve_gen"]["exact_match,strip"]
    with capsys.disabled():
        print(f"\nlm-eval on {model_path}: multiple choice acc {accuracy:.3f} "
              f"({len(MULTIPLE_CHOICE)} questions), generation exact match {exact:.3f} "
              f"({len(GENERATION)} questions)")
    mc_samples = results["samples"]["iterserve_mc"]
    assert len(mc_samples) == len(MULTIPLE_CHOICE)
    gen_samples = results["samples"]["iterserve_gen"]
    assert len(gen_samples) == len(GENERATION)
    assert all(isinstance(s["resps"][0][0], str) for s in gen_samples)
    reference = hf_model(model_path)
    checked, worst = 0, 0.0
    for sample in mc_samples:
        for (context, continuation), resps in zip(sample["arguments"], sample["resps"],
                                                  strict=True):
            reported, _ = resps[0]
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            expected = hf_loglikelihood(reference, context_ids, continuation_ids)
            assert reported == pytest.approx(expected, abs=1e-3), (context, continuation)
            checked += 1
            worst = max(worst, abs(reported - expected))
    assert checked == sum(len(c) for _, c, _ in MULTIPLE_CHOICE)
    with capsys.disabled():
        print(f"{checked} log-likelihoods vs HF transformers: max |difference| {worst:.2e}")
