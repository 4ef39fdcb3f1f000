"""The training step: the run config, the step plan (every static choice of the step),
the optimizer, the DPO objective, the jitted `shard_map` step functions, health checks
and model FLOPs."""
