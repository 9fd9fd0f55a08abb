"""Triton kernels for the engine's hot paths, each beside a typed launcher.

`iterserve.kernels.ops` holds the Triton launchers and `iterserve.kernels.reference` the plain-torch
equivalents under the same names, so the engine can swap one module for the other.
"""
