"""DPO trainer: `python trainer.py --flagfile=configs/quickstart.flags`.

A thin entry point: the run flags (one per `TrainConfig` field) and `main` live in
`tunix_core.cli.train`; the flags of the job itself are defined here.
"""

from absl import app
from absl import flags

from tunix_core.cli.train import config_from_flags  # noqa: F401 - the tests' way in
from tunix_core.cli.train import define_run_flags
from tunix_core.cli.train import main
from tunix_core.cli.train import parse_flags

define_run_flags()
# Multi-process (JAX's multi-controller runtime). On a TPU pod none is needed: each host
# joins the job from the TPU environment.
flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator "
                    "(with --num_processes and --process_id): for CPU hosts and tests, "
                    "over gloo. Without it a multi-host TPU job joins on its own "
                    "(docs/training.md: the rule that decides).")
flags.DEFINE_integer("num_processes", None, "Number of processes in the job.")
flags.DEFINE_integer("process_id", None, "This process's index, 0 .. num_processes-1.")
flags.DEFINE_float("coordinator_timeout", 45.0, "Seconds a multi-host job may take to join "
                   "(all hosts started, the coordinator reached) before the run ends with "
                   "status 1; raise it where hosts start far apart.")
# Terminal.
flags.DEFINE_bool("library_logging", False, "Show the INFO logging of JAX, Orbax and other "
                  "libraries on stderr (for debugging); by default at most a few of their "
                  "warnings and errors appear. All of it also goes to "
                  "{output_dir}/trainer.log.")

if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
