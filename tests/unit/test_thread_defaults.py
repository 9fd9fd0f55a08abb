"""CPU thread defaults: LLM() takes every core, a Serve replica every core but one."""

from __future__ import annotations

import os

from iterserve.deploy.llm_replica import replica_engine_kwargs
from iterserve.replica.config import offline_cpu_threads, replica_cpu_threads


def test_offline_takes_every_core_and_a_replica_leaves_one() -> None:
    cores = os.cpu_count() or 1
    assert offline_cpu_threads() == cores
    assert replica_cpu_threads() == max(1, cores - 1)


def test_replica_default_yields_to_an_explicit_setting() -> None:
    assert replica_engine_kwargs(None) == {"cpu_threads": replica_cpu_threads()}
    assert replica_engine_kwargs({"cpu_threads": 3, "max_num_seqs": 4}) == {
        "cpu_threads": 3, "max_num_seqs": 4}


def test_the_serve_app_gives_its_replicas_the_replica_default() -> None:
    from iterserve.deploy.settings import AppArgs

    assert AppArgs.model_validate({}).engine_config().cpu_threads == replica_cpu_threads()
    assert AppArgs.model_validate({"cpu_threads": "3"}).engine_config().cpu_threads == 3
