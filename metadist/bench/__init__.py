"""Benchmarks: committed commands that print their figures (run with python -m metadist.bench.<name>)."""
