"""Recovery time of the trainer: killed, restarted by the same command, first step done.

    python benchmarks/restart.py --out r.jsonl -- python trainer.py --flagfile=... [flags]

1. Runs the command and kills it (SIGKILL: nothing flushed, as a preemption without
   notice would leave it) once it logs the step before `--kill_at` (`--log_every=1`).
2. Runs the same command again (it resumes from the newest checkpoint) and times, from
   the process's start by this script's clock, the first metrics row of the resumed
   run, which the loop writes once that step is done (`--log_every=1`); the restart is
   then stopped.
3. With `--uncached`, once more with `--compilation_cache_dir=` added (the cache off).

Each restart appends one JSON line to `--out`: the seconds to the first resumed step,
and the trainer's own line saying whether the step came from the compilation cache.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time


def run(command: list[str], env: dict, stop: str | None) -> tuple[float | None, list[str]]:
  """Runs `command`, echoing its output with the seconds since it started; stops it at
  the first line matching `stop`. Returns (seconds to that line, the lines)."""
  start = time.perf_counter()
  proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1)
  seen, lines = None, []
  for line in proc.stdout:
    at = time.perf_counter() - start
    lines.append(line.rstrip())
    print(f"{at:7.1f} s | {line.rstrip()}", flush=True)
    if stop and seen is None and re.search(stop, line):
      seen = at
      proc.kill()
      break
  proc.wait()
  return seen, lines


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--kill_at", type=int, default=120, help="the step the first run dies at")
  p.add_argument("--resume_at", type=int, default=101,
                 help="the first step the restart runs (the newest checkpoint + 1)")
  p.add_argument("--uncached", action="store_true", help="also restart with the cache off")
  p.add_argument("--out", default="restart.jsonl")
  p.add_argument("command", nargs=argparse.REMAINDER)
  a = p.parse_args()
  command = a.command[1:] if a.command[:1] == ["--"] else a.command
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  run(command, env, rf"^step {a.kill_at - 1}/")
  for cached in (True, False) if a.uncached else (True,):
    extra = [] if cached else ["--compilation_cache_dir="]
    seconds, lines = run(command + extra, env, rf"^step {a.resume_at}/")
    said = [l for l in lines if l.startswith(f"step {a.resume_at}: ")]
    row = dict(command=" ".join(command + extra), cache=cached,
               start_to_first_step_s=seconds, step_line=said[-1] if said else None)
    with open(a.out, "a", encoding="utf-8") as f:
      f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
