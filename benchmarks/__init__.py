"""Benchmarks of the workflow against the tools users would otherwise pick; run with `make bench`."""
