"""deploy/schemas.py and deploy/protocol.py: request validation and response shapes (no Ray)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from iterserve.deploy.errors import OpenAIHTTPError, from_validation_error
from iterserve.deploy.protocol import (
    ModelInfo,
    TokenText,
    UsageCounter,
    chat_logprobs,
    check_prompt,
    completion_logprobs,
    echoed_logprobs,
    prompt_logprobs_body,
    resolve_max_tokens,
    sampling_params,
)
from iterserve.deploy.schemas import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    random_id,
)
from iterserve.deploy.schemas_chat import (
    ChatCompletionChunk,
)
from iterserve.deploy.schemas_tokens import DetokenizeRequest, TokenizeRequest
from iterserve.replica.outputs import RequestOutput, TokenLogprobs

INFO = ModelInfo(model_name="m", model_path=None, max_model_len=100, max_logprobs=5,
                 vocab_size=1000)


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_forms(prompt):
    assert CompletionRequest(prompt=prompt).prompt == prompt


@pytest.mark.parametrize("body", [
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": "x", "n": 0},
    {"prompt": "x", "n": MAX_N + 1},
    {"prompt": "x", "temperature": -0.1},
    {"prompt": "x", "temperature": 2.5},
    {"prompt": "x", "top_p": 0},
    {"prompt": "x", "logprobs": 21},
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "stop": ["ok", ""]},
    {"prompt": "x", "stop": ["s"] * 9},
    {"prompt": "x", "best_of": 2},
    {"prompt": "x", "suffix": "tail"},
    {"prompt": "x", "stream_options": {"include_usage": True}},
    {"prompt": "x", "presence_penalty": 3},
    {"prompt": "x", "stop_token_ids": [-1]},
    {"prompt": "x", "prompt_logprobs": -1},
    {"prompt": "x", "prompt_logprobs": 21},
    {"prompt": {"not": "a prompt"}},
])
def test_completion_rejects(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


def test_unknown_fields_are_ignored_and_defaults_are_openai():
    req = CompletionRequest.model_validate({"prompt": "x", "frobnicate": 1})
    assert req.max_tokens == 16 and req.n == 1 and req.temperature is None
    assert req.stop_list() == [] and not req.include_usage
    streaming = CompletionRequest(prompt="x", stream=True,
                                  stream_options={"include_usage": True})
    assert streaming.include_usage


def test_chat_request_rules():
    ok = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_tokens=5, max_completion_tokens=7)
    assert ok.messages[0].text() == "ab" and ok.effective_max_tokens() == 7
    for body in (
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 1},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(body)


def test_tokenize_needs_exactly_one_input():
    assert TokenizeRequest(prompt="x").prompt == "x"
    with pytest.raises(ValidationError):
        TokenizeRequest()
    with pytest.raises(ValidationError):
        TokenizeRequest(prompt="x", messages=[{"role": "user", "content": "y"}])
    with pytest.raises(ValidationError):
        DetokenizeRequest(tokens=[1, -2])


def test_validation_error_becomes_openai_400_with_param():
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": "x", "n": 99})
    error = from_validation_error(caught.value)
    assert error.status_code == 400 and error.param == "n"
    body = ErrorResponse.model_validate(error.body())
    assert body.error.type == "invalid_request_error" and "n:" in body.error.message


def test_context_length_checks():
    check_prompt([1] * 99, INFO)
    for ids in ([], [1] * 100, [1, 1000]):
        with pytest.raises(OpenAIHTTPError) as caught:
            check_prompt(ids, INFO)
        assert caught.value.status_code == 400
    assert resolve_max_tokens(None, 60, INFO) == 40
    assert resolve_max_tokens(40, 60, INFO) == 40
    with pytest.raises(OpenAIHTTPError, match="maximum context length is 100"):
        resolve_max_tokens(41, 60, INFO)


def test_sampling_params_mapping():
    req = CompletionRequest(prompt="x", max_tokens=7, temperature=0, stop="END", seed=3,
                            top_k=5, logprobs=2, n=2, stop_token_ids=[9], ignore_eos=True)
    params = sampling_params(req, 10, INFO)
    assert params.max_tokens == 7 and params.temperature == 0 and params.stop == ("END",)
    assert params.seed == 3 and params.top_k == 5 and params.logprobs == 2 and params.n == 2
    assert params.stop_token_ids == (9,) and params.ignore_eos
    with pytest.raises(OpenAIHTTPError, match="at most 5"):
        sampling_params(CompletionRequest(prompt="x", logprobs=6), 10, INFO)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True)
    chat_params = sampling_params(chat, 10, INFO)
    assert chat_params.logprobs == 0 and chat_params.max_tokens == 90  # default: the rest
    assert chat_params.temperature == 1.0 and chat_params.top_p == 1.0


def _out(index, ids, text, finished=False, reason=None, lps=None):
    return RequestOutput(request_id="r", index=index, new_token_ids=ids, new_text=text,
                         finished=finished, finish_reason=reason, num_prompt_tokens=4,
                         num_output_tokens=len(ids), logprobs=lps)


def test_usage_counts_prompt_once_and_sums_choices():
    usage = UsageCounter()
    usage.add(0, 0, _out(0, [1, 2], "ab"))
    usage.add(0, 1, _out(1, [3], "c"))
    usage.add(1, 2, _out(0, [4, 5, 6], "def"))
    info = usage.usage()
    assert (info.prompt_tokens, info.completion_tokens, info.total_tokens) == (8, 6, 14)


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def test_logprob_shapes():
    items = [TokenLogprobs(token_id=1, logprob=-0.5, top=[(1, -0.5), (2, -1.0)]),
             TokenLogprobs(token_id=3, logprob=float("-inf"), top=[])]
    text = TokenText(_Tok())
    completion = completion_logprobs([1, 3], items, text, start_offset=10)
    assert completion.tokens == ["<1>", "<3>"] and completion.text_offset == [10, 13]
    assert completion.token_logprobs == [-0.5, -9999.0]  # JSON has no -inf
    # vLLM's dict: the token itself, then the top-k
    assert completion.top_logprobs == [{"<1>": -0.5, "<2>": -1.0}, {"<3>": -9999.0}]
    chat = chat_logprobs(items, text, num_top=1)
    assert chat.content[0].token == "<1>" and len(chat.content[0].top_logprobs) == 1
    assert chat.content[0].bytes == list(b"<1>")


def test_response_ids_and_shapes():
    assert random_id("cmpl").startswith("cmpl-") and random_id("cmpl") != random_id("cmpl")
    body = CompletionResponse(id="cmpl-1", created=1, model="m", choices=[],
                              usage={"prompt_tokens": 1, "completion_tokens": 2,
                                     "total_tokens": 3}).model_dump()
    assert body["object"] == "text_completion"
    chunk = ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[])
    assert chunk.model_dump()["object"] == "chat.completion.chunk"


def test_echo_logprobs_and_max_tokens_zero_rules():
    assert CompletionRequest(prompt="x", echo=True, logprobs=1).echo
    scoring = CompletionRequest(prompt="x", echo=True, logprobs=1, max_tokens=0)
    params = sampling_params(scoring, 4, INFO)
    # vLLM: echo scores the prompt with the same k; the engine samples one token, dropped.
    assert params.prompt_logprobs == 1 and params.max_tokens == 1
    with pytest.raises(ValidationError, match="max_tokens 0 is only allowed with echo"):
        CompletionRequest(prompt="x", max_tokens=0)
    explicit = CompletionRequest(prompt="x", echo=True, logprobs=1, prompt_logprobs=3)
    assert sampling_params(explicit, 4, INFO).prompt_logprobs == 3
    assert sampling_params(CompletionRequest(prompt="x", logprobs=2), 4, INFO
                           ).prompt_logprobs is None
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], prompt_logprobs=2)
    assert sampling_params(chat, 4, INFO).prompt_logprobs == 2
    with pytest.raises(OpenAIHTTPError) as error:  # above the engine's max_logprobs (5)
        sampling_params(CompletionRequest(prompt="x", prompt_logprobs=6), 4, INFO)
    assert error.value.status_code == 400


def test_prompt_logprobs_body_is_vllm_shaped():
    scored = [None, TokenLogprobs(token_id=7, logprob=-2.0, top=[(3, -0.1), (7, -2.0)], rank=2)]
    body = prompt_logprobs_body(scored, TokenText(_Tok()))
    assert body[0] is None
    assert list(body[1]) == [7, 3]  # the prompt token first, then the top-k
    assert body[1][7].model_dump() == {"logprob": -2.0, "rank": 2, "decoded_token": "<7>"}
    assert body[1][3].rank == 1
    echoed = completion_logprobs([5, 7], echoed_logprobs([5, 7], scored), TokenText(_Tok()), 0)
    assert echoed.token_logprobs == [None, -2.0] and echoed.top_logprobs[0] is None
    assert echoed.tokens == ["<5>", "<7>"] and echoed.text_offset == [0, 3]


def test_usage_reports_cached_prompt_tokens_once_per_prompt():
    usage = UsageCounter()
    for prompt, index, cached in ((0, 0, 32), (0, 1, 48), (1, 0, 16)):
        out = _out(index, [1], "a")
        out.num_cached_tokens = cached
        usage.add(prompt, prompt * 2 + index, out)
    assert usage.usage().prompt_tokens_details.cached_tokens == 48  # 32 + 16: first choices
    scoring = UsageCounter(scoring_only=True)
    scoring.add(0, 0, _out(0, [1], "a"))
    assert scoring.usage().completion_tokens == 0
