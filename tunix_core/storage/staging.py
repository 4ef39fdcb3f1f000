"""Local stand-ins for paths that may be remote: a directory or a file written locally
and put in place whole (`staged_dir`, `staged_file`, `Staged` for repeated uploads), and
a remote directory read through a local copy (`local_copy`). For libraries that write
or read only local files (TensorBoard, tokenizers, `numpy.save`); every copy goes
through `storage.paths`, with its retries and one-line errors."""

import contextlib
import os
import shutil
import tempfile

from tunix_core.storage import paths


class Staged:
  """A local directory standing in for `path`: `path` itself when local; for a remote
  `path` a temporary directory, whose files `upload` copies there (each file whole, as
  often as asked) and `close` uploads a last time, then removes."""

  def __init__(self, path: str, prefix: str = "tunix-stage-"):
    self.path = path
    self.local = tempfile.mkdtemp(prefix=prefix) if paths.is_remote(path) else path
    paths.makedirs(self.local)

  def upload(self) -> None:
    if self.local != self.path:
      paths.copy_tree(self.local, self.path)

  def close(self, upload: bool = True) -> None:
    if upload:
      self.upload()
    if self.local != self.path:
      shutil.rmtree(self.local, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(path: str):
  """A local directory to write `path`'s files in (`Staged`): uploaded on a clean exit;
  a temporary one is removed either way."""
  staged = Staged(path)
  try:
    yield staged.local
  except BaseException:
    staged.close(upload=False)
    raise
  staged.close()


@contextlib.contextmanager
def staged_file(path: str, before_upload=lambda: None):
  """A local file name to write `path`'s bytes to, put in place whole on a clean exit:
  renamed over a local `path`, uploaded to a remote one (after `before_upload()`);
  removed either way."""
  stage = tempfile.mkdtemp(prefix="tunix-stage-") if paths.is_remote(path) else None
  local = os.path.join(stage, "staged") if stage else path
  tmp = f"{local}.{os.getpid()}.tmp"
  try:
    paths.makedirs(os.path.dirname(local) or ".")
    yield tmp
    os.replace(tmp, local)
    if stage:
      before_upload()
      paths.copy_file(local, path)  # an object appears whole
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
    if stage:
      shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def local_copy(path: str):
  """A local directory holding `path`'s files: `path` itself when local; a remote
  `path` is downloaded into a temporary directory, removed on exit."""
  if not paths.is_remote(path):
    yield path
    return
  with tempfile.TemporaryDirectory(prefix="tunix-fetch-") as local:
    paths.copy_tree(path, local)
    yield local
