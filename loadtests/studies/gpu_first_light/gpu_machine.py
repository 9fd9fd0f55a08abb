"""The software of the GPU machine the project can borrow, and what iterserve brings to it.

Read from the device tool's notes (KINDS.md, its package list of 2026-11-17 and a session's
`pip list` of 2026-11): one H100 (sometimes an H200), Python 3.12, torch 2.11.0+cu130,
triton 3.6.0; no ray, pydantic, fastapi, gguf or xgrammar. Nothing can be fetched there: a
missing package travels as a wheel, and the wheels together with the working tree must fit
in 64 MiB. The rehearsal (rehearse.py) builds a venv of these versions on CPU, and the CI
check tests/kernels/test_gpu_machine_triton.py runs the kernel tests under its triton.
"""

from __future__ import annotations

PYTHON = "3.12"
# Versions seen there (pip list); torch's CUDA build is stood in for by the CPU build of the
# version this machine has on disk (TORCH_STAND_IN).
VERSIONS = {
    "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "tokenizers": "0.23.2",
    "safetensors": "0.8.0", "numpy": "2.5.2", "huggingface-hub": "1.33.0",
    "accelerate": "1.15.0",
}  # fmt: skip
TORCH_STAND_IN = "2.13.0+cpu"
# Of iterserve's dependencies (pyproject.toml), those the machine has, any version.
PRESENT = (
    "jinja2", "pyyaml", "httpx", "aiohttp", "prometheus-client", "matplotlib", "tqdm",
    "pytest", "hypothesis", "pytest-timeout", "typing-extensions", "packaging", "psutil",
)  # fmt: skip
# Of iterserve's dependencies, those it lacks: each stage that needs one runs only where its
# wheel was brought, and says so in the report otherwise.
MISSING = (
    "ray", "pydantic", "fastapi", "uvicorn", "gguf", "xgrammar", "grafana-client", "locust",
    "jsonschema", "openai",
)  # fmt: skip
# What the first light brings (pip names, pinned): xgrammar for the structured-output stage
# and its requirements the machine lacks. typing-extensions too: pydantic 2.14 needs
# >= 4.16 and the machine's version is unknown. Ray Serve stays behind: ray's own wheel is
# 79 MB (ray-2.60.0-cp312, manylinux2014), over the 64 MiB limit by itself.
BROUGHT = (
    "xgrammar==0.2.9", "apache-tvm-ffi==0.1.15.post2", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "annotated-types==0.8.0", "typing-inspection==0.4.5", "typing-extensions==4.16.0",
)  # fmt: skip
RAY_WHEEL_MB = 79.3
CARRY_LIMIT_BYTES = 64 * 2**20  # the working tree, carried paths included
