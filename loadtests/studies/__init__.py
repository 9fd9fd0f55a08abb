"""The studies: each question iterserve was measured against, in a folder of its own.

A study's folder holds its README (the question, the command, what was found), its code,
and its results beside it (`results/`). Nothing in the library or in the shipped tools
imports a study (tests/unit/test_layering.py); studies may use each other's results and
the shared Ray harness (`ray_harness.py`). Not installed with the wheel: run them from a
checkout (`pip install -e .`). The index is loadtests/studies/README.md.
"""

from __future__ import annotations

from pathlib import Path

STUDIES = Path(__file__).resolve().parent


def results_of(study: str) -> Path:
    """Where a study keeps its results (the default --out of its commands)."""
    return STUDIES / study / "results"
