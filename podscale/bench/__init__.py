"""Benchmarks: each measures on this machine and prints the command that reproduces it."""
