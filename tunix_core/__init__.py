"""Mesh-level pieces of the DPO trainer: model, data, training loop."""
