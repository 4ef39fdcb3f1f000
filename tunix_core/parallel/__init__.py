"""Parallelism: meshes, the bucketed reduce-scatter / all-gather (`collectives`), the
sharded optimizer (`zero`), FSDP, tensor parallelism, and the parameter layouts they
make, behind one protocol (`layout`)."""
