"""iterserve.autoscale."""
