"""Tenants: the keys file (and today's plain one), keys compared as digests answering their
tenant, sub-tenants by header or `user`, and each tenant's prefix cache kept apart.

The HTTP tests run the real `create_app` over the real AsyncLLMEngine with the tiny model in
this process (no stand-in): `usage.prompt_tokens_details.cached_tokens` is the engine's own
count of prompt tokens its block manager found cached.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from iterserve.deploy.auth import ApiKeyChecker, load_api_keys
from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.server import IngressSettings, create_app
from iterserve.deploy.tenant_file import parse_keys_file
from iterserve.deploy.tenant_requests import TenantRequest
from iterserve.deploy.tenants import DEFAULT, Caller, TenantConfig
from iterserve.replica import AsyncLLMEngine, EngineConfig
from iterserve.replica.block_keys import cache_namespace
from iterserve.replica.request import TenantShare

KEYS_FILE = """\
# tenants
tenant acme weight=2 priority=1 tokens_per_minute=60000 ttft_slo_ms=800 sub_tenant_from=user \
sub_tenants=alice,bob
tenant beta sub_tenant_from=header unknown_sub_tenant=parent
tenant docs-a cache_share=docs
tenant docs-b cache_share=docs
sk-acme acme   # acme's key
sk-beta beta
sk-docs-a docs-a
sk-docs-b docs-b
sk-plain
sk-with#hash
"""
PROMPT = list(range(10, 10 + 40))  # two full blocks of 16 a later request can hit


def test_a_keys_file_gives_each_key_its_tenant_and_each_tenant_its_settings() -> None:
    parsed = parse_keys_file(KEYS_FILE)
    tenants = {k.get_secret_value(): t for k, t in parsed.keys}
    assert tenants == {"sk-acme": "acme", "sk-beta": "beta", "sk-docs-a": "docs-a",
                       "sk-docs-b": "docs-b", "sk-plain": "default", "sk-with#hash": "default"}
    acme = {t.name: t for t in parsed.tenants}["acme"]
    assert (acme.weight, acme.priority, acme.ttft_slo_ms) == (2.0, 1, 800.0)
    assert acme.quota.tokens_per_minute == 60000 and acme.quota.max_concurrent_requests is None
    assert acme.sub_tenants == ("alice", "bob") and acme.sub_tenant_from == "user"
    assert "sk-" not in repr(parsed)


def test_the_engine_gets_the_tenants_weight_slo_and_at_best_its_band() -> None:
    acme = {t.name: t for t in parse_keys_file(KEYS_FILE).tenants}["acme"]
    request = TenantRequest(Caller(acme), b"", prompt_tokens=4)
    assert request.share == TenantShare("acme", 2.0, 800.0)
    assert (request.band(0), request.band(-5), request.band(3)) == (1, 1, 3)
    assert TenantRequest(Caller(DEFAULT), b"", prompt_tokens=4).band(-5) == -5


def test_a_plain_keys_file_parses_as_before() -> None:
    parsed = parse_keys_file("# comment\nkey-one\n\n  key-two  \n")
    assert [(k.get_secret_value(), t) for k, t in parsed.keys] == [
        ("key-one", "default"), ("key-two", "default")]
    assert parsed.tenants == (DEFAULT,)


@pytest.mark.parametrize("text,line,words", [
    ("k1\ntenant\n", 2, "needs a name"),
    ("tenant a tokens_per_minute=lots\n", 1, "tokens_per_minute='lots'"),
    ("tenant a tokens_per_minute=0\n", 1, "tokens_per_minute must be >= 1"),
    ("tenant a colour=blue\n", 1, "unknown tenant setting 'colour'"),
    ("tenant a weight\n", 1, "not key=value"),
    ("tenant a\ntenant a\n", 2, "already defined on line 1"),
    ("k1 nobody\n", 1, "no `tenant` line defines"),
    ("k1\nk1\n", 2, "already listed on line 1"),
    ("k1 a b\n", 1, "at most its tenant"),
    ("tenant bad/name\n", 1, "letters, digits"),
    ("tenant a sub_tenant_from=cookie\n", 1, "sub_tenant_from must be"),
])
def test_a_malformed_keys_file_names_its_line(text: str, line: int, words: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_keys_file(text, "keys.txt")
    assert str(error.value).startswith(f"keys.txt:{line}: ") and words in str(error.value)


def test_keys_from_flags_join_the_file_and_may_not_change_a_keys_tenant(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("tenant acme\nsk-acme acme\n")
    keys = load_api_keys(["sk-cli"], str(path), env={})
    assert {k.get_secret_value(): t for k, t in keys.keys} == {"sk-acme": "acme",
                                                                "sk-cli": "default"}
    with pytest.raises(ValueError, match="for tenant 'acme'"):
        load_api_keys(["sk-acme"], str(path), env={})


def test_the_checker_answers_the_keys_tenant_by_digest() -> None:
    checker = ApiKeyChecker([(SecretStr("k1"), "acme"), SecretStr("k2")])
    assert checker.tenant_of("Bearer k1") == "acme"
    assert checker.tenant_of("bearer k2") == "default"
    assert checker.tenant_of("Bearer k3") is None and checker.tenant_of(None) is None
    assert ApiKeyChecker([]).tenant_of(None) == "default"


def test_cache_namespaces_by_tenant_group_and_salt() -> None:
    acme, beta = TenantConfig("acme"), TenantConfig("beta")
    shared = TenantConfig("c", cache_share="docs")
    assert Caller(DEFAULT).cache_namespace(True, None) == b""  # a plain key list: as before
    assert Caller(acme).cache_namespace(True, None) == cache_namespace(salt="acme")
    assert Caller(acme).cache_namespace(True, None) != Caller(beta).cache_namespace(True, None)
    assert Caller(acme).cache_namespace(False, None) == b""
    assert Caller(shared).cache_namespace(True, None) == cache_namespace(salt="docs")
    assert Caller(acme).cache_namespace(True, "s") == cache_namespace(salt="acme/s")
    assert Caller(DEFAULT).cache_namespace(True, "s") == cache_namespace(salt="/s")


# ------------------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig.from_kwargs(model="iterserve-tiny", device="cpu", max_model_len=128,
                                      num_gpu_blocks_override=64, max_num_seqs=4)
    engine = AsyncLLMEngine(config)
    yield engine
    engine.shutdown()


def client_for(engine: AsyncLLMEngine, isolation: bool = True) -> TestClient:
    parsed = parse_keys_file(KEYS_FILE)
    settings = IngressSettings(api_keys=parsed.keys, tenants=parsed.tenants,
                               tenant_cache_isolation=isolation)
    return TestClient(create_app(LocalEngineClient(engine), settings))


def cached(http: TestClient, key: str, prompt: list[int], **extra: object) -> int:
    response = http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"prompt": prompt, "max_tokens": 1, **extra})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_second_tenants_identical_prompt_finds_nothing_cached(engine) -> None:
    prompt = [p + 1000 for p in PROMPT]
    with client_for(engine) as http:
        assert cached(http, "sk-acme", prompt) == 0
        assert cached(http, "sk-acme", prompt) == 32  # its own: a hit
        assert cached(http, "sk-beta", prompt) == 0  # another tenant's: none
        assert cached(http, "sk-plain", prompt) == 0  # nor the shared namespace's
        assert cached(http, "sk-beta", prompt) == 32


def test_a_cache_share_grant_hits_across_its_tenants(engine) -> None:
    prompt = [p + 2000 for p in PROMPT]
    with client_for(engine) as http:
        assert cached(http, "sk-docs-a", prompt) == 0
        assert cached(http, "sk-docs-b", prompt) == 32  # same group: shared
        assert cached(http, "sk-acme", prompt) == 0  # outside it: not


def test_without_isolation_tenants_share_and_cache_salt_still_separates(engine) -> None:
    prompt = [p + 3000 for p in PROMPT]
    with client_for(engine, isolation=False) as http:
        assert cached(http, "sk-acme", prompt) == 0
        assert cached(http, "sk-beta", prompt) == 32
        assert cached(http, "sk-beta", prompt, cache_salt="mine") == 0
        assert cached(http, "sk-acme", prompt, cache_salt="mine") == 32


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_cache_salt_must_be_a_non_empty_string(engine, salt: object) -> None:
    with client_for(engine) as http:
        response = http.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-plain"},
                             json={"messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 1, "cache_salt": salt})
    assert response.status_code == 400
    assert "cache_salt" in response.json()["error"]["message"]


def test_sub_tenants_by_user_field_and_header(engine) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 1}
    with client_for(engine) as http:
        acme = {"Authorization": "Bearer sk-acme"}
        assert http.post("/v1/completions", headers=acme,
                         json={**body, "user": "alice"}).status_code == 200
        unknown = http.post("/v1/completions", headers=acme, json={**body, "user": "mallory"})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "user"
        assert "mallory" in unknown.json()["error"]["message"]
        beta = {"Authorization": "Bearer sk-beta", "X-Iterserve-Sub-Tenant": "anyone"}
        assert http.post("/v1/completions", headers=beta, json=body).status_code == 200
        # A tenant that does not allow sub-tenants ignores both.
        plain = {"Authorization": "Bearer sk-plain", "X-Iterserve-Sub-Tenant": "x"}
        assert http.post("/v1/completions", headers=plain,
                         json={**body, "user": "x"}).status_code == 200


def test_sub_tenant_rules() -> None:
    acme = TenantConfig("acme", sub_tenant_from="user", sub_tenants=("alice",))
    assert Caller(acme).naming(None, "alice") == Caller(acme, "alice")
    assert Caller(acme).naming("alice", None).sub_tenant is None  # the header is not its source
    with pytest.raises(ValueError, match="unknown sub-tenant"):
        Caller(acme).naming(None, "eve")
    lenient = TenantConfig("b", sub_tenant_from="header", unknown_sub_tenant="parent")
    assert Caller(lenient).naming("bad name!", None).sub_tenant is None


def test_iterserve_serve_stops_on_a_malformed_keys_file_and_passes_the_isolation_flag(
        tmp_path) -> None:
    from iterserve.deploy.cli_serve import app_args_from, build_parser

    bad = tmp_path / "keys"
    bad.write_text("tenant acme\nsk-1 acme\nsk-2 nobody\n")
    with pytest.raises(ValueError, match=r"keys:3: the key names tenant 'nobody'"):
        app_args_from(build_parser().parse_args(["--api-key-file", str(bad)]))
    good = tmp_path / "good"
    good.write_text("tenant acme\nsk-1 acme\n")
    args = app_args_from(build_parser().parse_args(
        ["--api-key-file", str(good), "--api-key", "sk-cli", "--no-tenant-cache-isolation"]))
    assert args["tenant_cache_isolation"] is False
    # Only the flag's key travels as a secret; the file's keys (with their tenants) are read
    # by each ingress from the file.
    assert [k.get_secret_value() for k in args["api_keys"]] == ["sk-cli"]


def test_the_tenant_and_its_weight_reach_the_fair_engines_counters() -> None:
    """acme (weight 2) is charged its served tokens halved; a plain key is the default tenant,
    which arriving after acme left the queue starts from acme's counter (VTC's lift)."""
    config = EngineConfig.from_kwargs(model="iterserve-tiny", device="cpu", max_model_len=128,
                                      num_gpu_blocks_override=64, max_num_seqs=4,
                                      scheduler_policy="fair")
    engine = AsyncLLMEngine(config)
    try:
        with client_for(engine) as http:
            for key in ("sk-acme", "sk-plain"):
                response = http.post("/v1/completions",
                                     headers={"Authorization": f"Bearer {key}"},
                                     json={"prompt": PROMPT, "max_tokens": 3,
                                           "ignore_eos": True})
                assert response.status_code == 200, response.text
        counters = engine.engine.scheduler.counters
        served = len(PROMPT) + 2 * 3  # prompt, and a generated token at twice the cost
        assert counters.counter("acme") == served / 2
        assert counters.counter(DEFAULT.name) == served / 2 + served
    finally:
        engine.shutdown()
