"""Ahead-of-time compilation of a run's step plan for a TPU target, and its memory
report (`--compile_only`)."""
