"""The watchdog's deadlines in-process (its exit recorded instead of taken): work that
waits on another process has no deadline of its own, a storage call in flight still
has one, and a long copy restarts its call's clock block by block."""

import time

from tunix_core.run import exit_status
from tunix_core.run import watchdog as watchdog_lib
from tunix_core.storage import paths


def test_open_ended_work_has_no_deadline_but_its_storage_calls_do(monkeypatch, capfd):
  exits = []
  monkeypatch.setattr(watchdog_lib.os, "_exit", exits.append)
  with watchdog_lib.Watchdog(0.2, poll=0.02) as dog:
    dog.beat("waiting for the token store", open_ended=True)
    time.sleep(0.5)  # 2.5x the timeout
    assert not exits
    paths.call("reading", "/nowhere/file", lambda: time.sleep(0.4))  # stuck past 0.2 s
    assert exits[:1] == [exit_status.WATCHDOG]
    dog.beat("train step 3")
    exits.clear()
    time.sleep(0.5)
    assert exits[:1] == [exit_status.WATCHDOG]  # bounded work: the deadline again
  err = capfd.readouterr().err
  assert ("the storage call reading /nowhere/file (during waiting for the token store) "
          "has not finished after") in err
  assert "train step 3 has not finished after" in err


def test_a_copy_restarts_its_calls_clock_at_every_block(tmp_path, monkeypatch):
  (tmp_path / "src").write_bytes(b"x" * (2 * (16 << 20) + 5))  # 3 blocks of 16 MiB
  clocks, moved = [], paths._moved  # pylint: disable=protected-access

  def record():
    clocks.append(paths.in_flight())
    moved()

  monkeypatch.setattr(paths, "_moved", record)
  paths.copy_file(str(tmp_path / "src"), str(tmp_path / "dst"))
  assert (tmp_path / "dst").read_bytes() == (tmp_path / "src").read_bytes()
  assert len(clocks) == 3 and all(c[0][0].startswith("copying to") for c in clocks)
