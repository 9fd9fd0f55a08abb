"""iterserve: continuous-batching LLM serving on Ray Serve."""

__version__ = "0.1.0"
