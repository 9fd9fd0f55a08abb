"""deploy/app.py, cli.py, cli_serve.py, auth.py and the load record: no Ray processes started."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from iterserve.autoscale.signals import ReplicaLoad
from iterserve.deploy import cli, cli_serve
from iterserve.deploy.app import AppArgs, build_app, coerce_engine_kwargs
from iterserve.deploy.auth import API_KEYS_ENV, ApiKeyChecker, load_api_keys
from iterserve.deploy.engine_info import flat_config
from iterserve.deploy.llm_replica import SHUTDOWN_SLACK_S, drain_timeout_for
from iterserve.replica.config import EngineConfig
from iterserve.replica.stats import EngineStats


def test_serve_run_style_string_args_are_coerced():
    args = AppArgs.model_validate({"max_num_seqs": "8", "enable_chunked_prefill": "false",
                                   "gpu_memory_utilization": "0.5", "max_waiting_requests": "none",
                                   "num_replicas": "2",
                                   "api_keys": "key-one,key-two"})
    kwargs = args.engine_kwargs
    assert kwargs["max_num_seqs"] == 8 and kwargs["enable_chunked_prefill"] is False
    assert kwargs["gpu_memory_utilization"] == 0.5 and kwargs["max_waiting_requests"] is None
    assert args.num_replicas == 2 and [k.get_secret_value() for k in args.api_keys] == [
        "key-one", "key-two"]
    assert "key-one" not in repr(args)  # secrets stay hidden


def test_trtllm_aliases_and_nested_engine_kwargs():
    args = AppArgs.model_validate({"engine_kwargs": {"max_batch_size": 4, "max_num_tokens": "64"},
                                   "tokens_per_block": "32"})
    config = args.engine_config()
    assert config.scheduler.max_num_seqs == 4 and config.scheduler.max_num_batched_tokens == 64
    assert config.cache.block_size == 32


@pytest.mark.parametrize("bad", [{"no_such_flag": 1}, {"max_num_seqs": "many"},
                                 {"enable_chunked_prefill": "maybe"}, {"num_replicas": 0},
                                 {"num_replicas": "lots"}, {"max_body_bytes": 10}])
def test_bad_app_args(bad):
    with pytest.raises((ValidationError, ValueError)):
        AppArgs.model_validate(bad)


def test_engine_config_errors_surface_at_build_time():
    with pytest.raises(ValueError, match="scheduler_policy"):
        build_app({"scheduler_policy": "random"})
    with pytest.raises(ValueError):
        coerce_engine_kwargs({"block_size": "x"})


def test_build_app_binds_ingress_over_replica():
    app = build_app({"max_num_seqs": 4, "num_replicas": 2, "api_keys": ["k"]})
    ingress = app._bound_deployment
    assert ingress.name == "OpenAIIngress"
    replica = ingress.init_args[0]
    assert replica._bound_deployment.name == "LLMReplica"
    assert replica._bound_deployment.num_replicas == 2
    engine = replica._bound_deployment.init_args[0]  # resolved once, on the driver
    assert isinstance(engine, EngineConfig)
    # resolved: every "auto" made concrete and every derived value filled
    assert engine.model is not None and engine.served_model_name is not None
    assert "auto" not in (engine.dtype, engine.device, engine.attention_backend,
                          engine.load_format)
    assert engine.async_scheduling is not None
    assert None not in (engine.scheduler.max_model_len, engine.scheduler.max_num_batched_tokens)
    assert engine.scheduler.max_num_seqs == 4
    assert (engine.device, engine.dtype, engine.attention_backend) == ("cpu", "float32", "torch")
    assert isinstance(ingress.init_kwargs["api_keys"][0], SecretStr)


def test_ingress_and_replicas_drain_for_the_longest_generation():
    """A redeploy that changes the args replaces the ingress as well; it must not cut at
    Serve's default 20 s a stream that the replicas' drain would let finish."""
    app = build_app({"max_model_len": 2048, "num_replicas": 1})
    ingress = app._bound_deployment
    replica = ingress.init_args[0]._bound_deployment
    drain = drain_timeout_for(2048) + SHUTDOWN_SLACK_S
    assert drain > 20.0
    assert replica._deployment_config.graceful_shutdown_timeout_s == drain
    assert ingress._deployment_config.graceful_shutdown_timeout_s == drain


def test_cli_engine_flags_and_aliases():
    parser = cli_serve.build_parser()
    args = parser.parse_args(["--max-batch-size", "8", "--max-num-tokens", "2048",
                              "--kv-cache-free-gpu-memory-fraction", "0.7",
                              "--no-enable-chunked-prefill", "--batching", "static",
                              "--scheduler-policy", "priority", "--max-model-len", "1024",
                              "--num-gpu-blocks-override", "99", "--dtype", "float32",
                              "--max-waiting-requests", "3", "--seed", "5", "--simulate"])
    kwargs = cli_serve.engine_kwargs_from(args)
    assert kwargs == {"max_num_seqs": 8, "max_num_batched_tokens": 2048,
                      "gpu_memory_utilization": 0.7, "enable_chunked_prefill": False,
                      "batching": "static", "scheduler_policy": "priority",
                      "max_model_len": 1024, "num_gpu_blocks_override": 99,
                      "dtype": "float32", "max_waiting_requests": 3, "seed": 5,
                      "runner": "simulated"}
    EngineConfig.from_kwargs(**kwargs)  # every flag is a real engine argument
    assert cli_serve.engine_kwargs_from(parser.parse_args([])) == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["--batching", "sometimes"])


def test_lora_modules_flag_takes_vllm_spaces_or_commas() -> None:
    parser = cli_serve.build_parser()
    for argv in (["--lora-modules", "sql=/a", "chat=/b c"], ["--lora-modules", "sql=/a,chat=/b c"]):
        kwargs = cli_serve.engine_kwargs_from(parser.parse_args(["--enable-lora", *argv]))
        config = EngineConfig.from_kwargs(runner="model", **kwargs)
        assert config.lora_module_paths == {"sql": "/a", "chat": "/b c"}


def test_cli_dispatch(capsys, monkeypatch):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "serve" in out and "make-model" in out
    assert cli.main(["no-such-command"]) == 2
    calls = []
    monkeypatch.setitem(cli.SUBCOMMANDS, "echo", ("iterserve.deploy.cli", "_test_echo", "x"))
    monkeypatch.setattr(cli, "_test_echo", lambda argv: calls.append(argv) or 3, raising=False)
    assert cli.main(["echo", "a", "--b"]) == 3 and calls == [["a", "--b"]]


def test_make_model_subcommand(tmp_path):
    assert cli.main(["make-model", str(tmp_path / "m"), "--seed", "1"]) == 0
    assert (tmp_path / "m" / "config.json").is_file()


def test_api_keys_sources(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\nfile-key\n\n")
    keys = load_api_keys(["cli-key", "cli-key"], str(key_file), env={API_KEYS_ENV: " a, ,b"})
    assert [(k.get_secret_value(), t) for k, t in keys.keys] == [
        ("file-key", "default"), ("cli-key", "default"), ("a", "default"), ("b", "default")]
    assert load_api_keys([], None, env={}).keys == ()
    with pytest.raises(ValueError):
        load_api_keys([], str(tmp_path / "missing"), env={})


def test_api_key_checker():
    checker = ApiKeyChecker([SecretStr("k1"), SecretStr("k2")])
    assert checker.tenant_of("Bearer k1") == checker.tenant_of("bearer k2") == "default"
    for refused in (None, "Bearer k3", "k1", "Basic k1"):
        assert checker.tenant_of(refused) is None
    assert "k1" not in repr(checker)
    assert ApiKeyChecker([]).tenant_of(None) is not None


def test_replica_load_round_trips_as_numbers():
    stats = EngineStats(timestamp=1.0, num_running=2, num_waiting=1, num_total_blocks=10,
                        num_free_blocks=4, kv_usage=0.6, num_preemptions=0,
                        num_out_of_blocks=0, last_step_tokens=3, step_token_rate=9.0,
                        max_waiting_requests=None)
    signals = ReplicaLoad.from_engine_stats(stats, draining=True).to_dict()
    assert all(isinstance(v, float) for v in signals.values())
    load = ReplicaLoad.from_dict(signals)
    assert load.kv_usage == 0.6 and load.num_waiting == 1 and load.num_running == 2
    assert load.max_waiting_requests is None and load.draining


def test_flat_config_lifts_groups():
    flat = flat_config(EngineConfig.from_kwargs(max_num_seqs=3, block_size=8))
    assert flat["max_num_seqs"] == 3 and flat["block_size"] == 8 and "cache" not in flat
