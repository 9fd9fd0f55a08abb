"""iterserve.loadtests."""
