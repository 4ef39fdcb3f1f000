"""Gives every test 8 simulated CPU devices; must run before JAX initialises a backend."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import chex  # noqa: E402  (after JAX_PLATFORMS, before any backend starts)

chex.set_n_cpu_devices(8)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)
