"""deploy/configs/*.yaml and deploy/kuberay/rayservice.yaml validate (no Ray processes).

Each file is checked against Ray Serve 2.60's own config schema (ServeDeploySchema), its
application args against AppArgs (the engine settings included), and its deployment names
against the deployments build_app creates. `serve run deploy/configs/local-cpu.yaml` itself
runs in tests/integration/test_serve_config.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from iterserve.deploy.app import AppArgs, build_app

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIGS = sorted((DEPLOY / "configs").glob("*.yaml"))


def _check(config: dict) -> ServeDeploySchema:
    schema = ServeDeploySchema.model_validate(config)
    for app in schema.applications:
        assert app.import_path == "iterserve.deploy.app:build_app"
        args = AppArgs.model_validate(app.args or {})
        args.engine_config()
        assert build_app(args) is not None  # binds the deployments; starts nothing
        names = {d.name for d in app.deployments}
        assert names <= {"OpenAIIngress", "LLMReplica"}, names
    return schema


def test_expected_configs_exist():
    assert {p.name for p in CONFIGS} >= {"local-cpu.yaml", "single-node-multi-gpu.yaml",
                                         "multi-node.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_serve_config_validates(path):
    _check(yaml.safe_load(path.read_text()))


def test_local_cpu_needs_no_gpu():
    schema = _check(yaml.safe_load((DEPLOY / "configs" / "local-cpu.yaml").read_text()))
    for deployment in schema.applications[0].deployments:
        options = deployment.ray_actor_options
        assert options is not None and not options.num_gpus


def test_kuberay_rayservice_embeds_a_valid_serve_config():
    manifest = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService" and manifest["apiVersion"] == "ray.io/v1"
    spec = manifest["spec"]
    assert spec["rayClusterConfig"]["rayVersion"] == "2.60.0"
    _check(yaml.safe_load(spec["serveConfigV2"]))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_no_config_drains_shorter_than_the_longest_generation(path):
    """A deployment's graceful_shutdown_timeout_s in a config overrides the app's derived
    drain: one below drain_timeout_for(max_model_len) would cut long streams on redeploy."""
    from iterserve.deploy.llm_replica import drain_timeout_for

    for app in ServeDeploySchema.model_validate(yaml.safe_load(path.read_text())).applications:
        engine = AppArgs.model_validate(app.args or {}).engine_config()
        need = drain_timeout_for(engine.scheduler.max_model_len or 0)
        for deployment in app.deployments:
            given = deployment.model_dump(exclude_unset=True).get("graceful_shutdown_timeout_s")
            assert given is None or given >= need, (path.name, deployment.name, given, need)
