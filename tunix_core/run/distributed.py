"""Which multi-process job a trainer process joins, by one written rule.

1. The flags `--coordinator_address`, `--num_processes` and `--process_id` (all three):
   that job (CPU hosts and tests join over gloo).
2. Else a worker list in the environment (`TPU_PROCESS_ADDRESSES`, else
   `TPU_WORKER_HOSTNAMES`) with more than one entry, or a multi-slice job
   (`MEGASCALE_COORDINATOR_ADDRESS`): a multi-host job. On a host with TPU chips JAX
   reads the job from the environment; elsewhere (no TPU runtime to ask) the coordinator
   is the first worker at port 8476 and this process is `TPU_WORKER_ID` (default 0).
3. Else, on a host with TPU chips, the GCE metadata server, asked for the slice's
   workers with a short timeout (2 s, twice): more than one worker is a multi-host job,
   which JAX joins from the metadata.
4. Else one process; a TPU environment that named one worker, or a metadata server that
   did not answer, is said in one notice line.

A multi-host job whose coordinator cannot be reached within `timeout` seconds ends the
process with one line naming the flags that set the job by hand (status 1). JAX's own
failure there is an abort (a fatal log and a stack dump), so the deadline is ours, kept
by a thread: the join blocks in C++ with the GIL released.
"""

import glob
import os
import sys
import threading
import typing
import urllib.error
import urllib.request

import jax

from tunix_kernels import aot_tpu

from tunix_core.training.config import ConfigError

COORDINATOR_PORT = 8476  # the port JAX's TPU cluster detection uses
_METADATA = ("http://169.254.169.254/computeMetadata/v1/instance/attributes/"
             "worker-network-endpoints")  # by address: no DNS lookup that could hang
_WORKER_LISTS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")  # JAX's order
HAND_FLAGS = "--coordinator_address, --num_processes and --process_id"


class Job(typing.NamedTuple):
  """How to join: `kwargs` of `jax.distributed.initialize` (None: one process, no
  join; {}: JAX detects the job itself) and what to tell the user."""
  kwargs: dict | None
  how: str
  notice: str | None = None


def has_tpu_chips() -> bool:
  """TPU device files on this host (without starting a backend): VFIO devices only with
  libtpu installed (a GPU passed through is VFIO too)."""
  return bool(glob.glob("/dev/accel*")
              or (glob.glob("/dev/vfio/[0-9]*") and aot_tpu.has_libtpu()))


def _workers(environ) -> tuple[str, list[str]] | None:
  for name in _WORKER_LISTS:
    if environ.get(name):
      return name, [w.strip() for w in environ[name].split(",") if w.strip()]
  return None


def ask_metadata(timeout: float = 2.0, tries: int = 2, url: str = _METADATA) -> int | None:
  """Workers of this TPU slice per the GCE metadata server (never through a proxy);
  None when it does not answer within `timeout` seconds, `tries` times, or has no
  worker list."""
  opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
  request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
  for _ in range(tries):
    try:
      with opener.open(request, timeout=timeout) as response:
        return len([w for w in response.read().decode().split(",") if w.strip()])
    except urllib.error.HTTPError:
      return None  # it answered: no worker list on this machine
    except (OSError, ValueError):
      continue
  return None


def plan(coordinator_address, num_processes, process_id, environ=os.environ,
         tpu_host=None, metadata=ask_metadata) -> Job:
  """The job this process joins (module docstring's rule); ConfigError on half-given
  flags."""
  given = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in given):
    if any(v is None for v in given):
      raise ConfigError(f"{HAND_FLAGS} go together")
    return Job(dict(coordinator_address=coordinator_address, num_processes=num_processes,
                    process_id=process_id), f"the flags' job at {coordinator_address}")
  tpu_host = has_tpu_chips() if tpu_host is None else tpu_host
  listed = _workers(environ)
  if tpu_host and (environ.get("MEGASCALE_COORDINATOR_ADDRESS")
                   or (listed and len(listed[1]) > 1)):
    return Job({}, "the TPU job of this host's environment")
  if listed and len(listed[1]) > 1:
    name, hosts = listed
    index = environ.get("TPU_WORKER_ID", "0")
    if not index.isdigit() or int(index) >= len(hosts):
      raise ConfigError(f"TPU_WORKER_ID={index!r} is not a worker index of the "
                        f"{len(hosts)} in {name}")
    # Entries may carry the TPU runtime's own port; the coordinator listens on JAX's.
    address = f"{hosts[0].split(':')[0]}:{COORDINATOR_PORT}"
    return Job(dict(coordinator_address=address, num_processes=len(hosts),
                    process_id=int(index)), f"the {len(hosts)} workers of {name}")
  if listed:
    return Job(None, "one process", f"{listed[0]} names one worker: one process")
  if tpu_host:
    workers = metadata()
    if workers is None:
      return Job(None, "one process", "no TPU job in the environment and none from the "
                 "GCE metadata server: one process")
    if workers > 1:
      return Job({}, f"the {workers}-worker TPU slice of the metadata server")
    return Job(None, "one process", "the metadata server names one TPU worker: one process")
  return Job(None, "one process")


def join(job: Job, timeout: float, log=print, terminal=None) -> None:
  """Joins `job` (nothing for one process); a join that is not done within `timeout`
  seconds ends the process with one line and status 1."""
  if job.notice:
    log(f"distributed: {job.notice}")
  if job.kwargs is None:
    return
  if job.kwargs:  # a job set by hand or from a worker list: CPU hosts join over gloo
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

  by_hand = ("check them" if job.how.startswith("the flags'") else
             f"set the job by hand with {HAND_FLAGS}")

  def give_up():
    out = terminal or sys.stderr
    out.write(f"trainer.py: error: could not join {job.how} within {timeout:g} s (its "
              f"coordinator unreachable or a process missing); {by_hand}, or raise "
              "--coordinator_timeout\n")
    out.flush()
    os._exit(1)  # pylint: disable=protected-access

  deadline = threading.Timer(timeout, give_up)
  deadline.daemon = True
  deadline.start()
  try:
    # JAX's own deadline comes later: its failure is an abort, ours is one line.
    jax.distributed.initialize(**job.kwargs, initialization_timeout=int(timeout) + 60)
  finally:
    deadline.cancel()


def start_backend() -> threading.Thread:
  """Starts JAX's backend on a daemon thread, so that opening the chips (libtpu pins its
  host buffers: seconds on a TPU host) overlaps the rest of the start-up (data, weights,
  the plan); the first `jax.devices()` then waits for it under JAX's own lock. Call it
  after `join` (a job is joined before any backend starts). A backend that fails to
  start does so as it would at that first call: JAX's own fallback and messages."""
  def open_():
    try:
      jax.devices()
    except Exception:  # noqa: BLE001 - raised again by the start-up's own first call
      pass
  thread = threading.Thread(target=open_, name="open-backend", daemon=True)
  thread.start()
  return thread
