"""Benchmark harnesses. They print numbers; docs/BENCHMARKS.md records them with the command."""
