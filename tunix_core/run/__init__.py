"""The training run: the loop, its metrics and logs, evaluation, the reference
log-prob cache, the initial weights' source, preemption."""
