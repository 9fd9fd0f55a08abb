"""A study: see its README."""
