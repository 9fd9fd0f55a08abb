"""iterserve.dashboards."""
