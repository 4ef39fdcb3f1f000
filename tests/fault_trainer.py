"""trainer.py with faults injected, for the tests that need a trainer process to hang, to
die or to say what it read: `python tests/fault_trainer.py [fault flags] [trainer flags]`.

The fault flags set `run.loop.Hooks`, which this script passes to every `loop.train`
call; trainer.py's own `main` then runs exactly as `python trainer.py` runs it.
- `--hang_at=NAME` blocks for good as the work named NAME starts (a watchdog beat, e.g.
  "train step 5"), as work that never finishes would;
- `--kill_at=NAME` kills the process there (SIGKILL: nothing flushed, a save in flight
  cut short), e.g. at "reference log-probs: batch 9/64 of data.jsonl";
- `--record_pairs_dir=D` appends to `D/process_<i>.jsonl` the pairs each step drew
  (`batch`) and those this process read of them (`pairs`).
"""

import functools
import json
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

import trainer  # pylint: disable=g-import-not-at-top,wrong-import-position
from tunix_core.run import loop  # pylint: disable=g-import-not-at-top,wrong-import-position

flags.DEFINE_string("hang_at", None, "Block for good as the work of this name starts.")
flags.DEFINE_string("kill_at", None, "SIGKILL this process as the work of this name starts.")
flags.DEFINE_string("record_pairs_dir", None, "Append each step's pairs to "
                    "DIR/process_<i>.jsonl.")
FLAGS = flags.FLAGS


def on_beat(what: str) -> None:
  if what == FLAGS.hang_at:
    threading.Event().wait()
  if what == FLAGS.kill_at:
    os.kill(os.getpid(), signal.SIGKILL)


def after_read(step: int, idx, pairs) -> None:
  if FLAGS.record_pairs_dir:
    path = os.path.join(FLAGS.record_pairs_dir, f"process_{jax.process_index()}.jsonl")
    with open(path, "a") as f:
      f.write(json.dumps({"step": step, "pairs": pairs.last_read.tolist(),
                          "batch": idx.tolist()}) + "\n")


def main(argv):
  loop.train = functools.partial(loop.train, hooks=loop.Hooks(on_beat, after_read))
  trainer.main(argv)


if __name__ == "__main__":
  app.run(main, flags_parser=trainer.parse_flags)
