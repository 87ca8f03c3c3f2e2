"""Benchmarks: programs that measure, never timed assertions."""
