"""The trainer's exit statuses, each in one place (docs/training.md#exit-statuses).

An orchestrator restarts a run on any status but `ERROR` (fix the input first) and
`DONE`; `PREEMPTED` and `WATCHDOG` are the ones a restart resumes from cleanly."""

DONE = 0
ERROR = 1             # a bad flag, bad data, an unusable checkpoint, a failing reward
NONFINITE = 3         # a step was NaN/Inf under --on_nonfinite=stop
CHECKPOINT_WRITE = 4  # writing a checkpoint failed (disk full, permissions, ...)
WATCHDOG = 5          # work outlived --step_timeout (`run.watchdog` ends the process)
PREEMPTED = 42        # stopped by SIGTERM/SIGINT after its checkpoint committed
