"""Appending to an object on Cloud Storage, which cannot append, exactly once.

The bytes go up as a part object and the server composes the object and the part into
the object (what the object already holds is not sent again; readers see the old or the
new object). A compose whose reply is lost may have gone through: a blind retry, ours or
the client's own, would append the bytes twice. Here every try first reads the object's
size, and the compose only applies to the generation read (`ifGenerationMatch`), so
however often a try repeats, the bytes land once.
"""

from tunix_core.storage import paths


def append_bytes(path: str, data: bytes, size: int) -> None:
  """Appends `data` to the existing object `path` (`gs://...`), which holds `size` bytes
  (the caller's record), through the part `{path}.part`, deleted afterwards. Called
  again, or tried again, after a compose that went through, it appends nothing more: an
  object of `size + len(data)` bytes already holds the append. An object of any other
  size (another writer) is a `StorageError`."""
  if not paths.is_remote(path):
    raise ValueError(f"append_bytes appends to objects only, not to the local path {path}")
  import fsspec  # pylint: disable=g-import-not-at-top  (gcsfs, as under epath)
  fs, name = fsspec.core.url_to_fs(path)
  bucket, key, _ = fs.split_path(name)
  request = {"kind": "storage#composeRequest", "destination": {"name": key, "bucket": bucket},
             "sourceObjects": [{"name": key}, {"name": key + ".part"}]}

  def held() -> dict:
    fs.invalidate_cache(name)  # gcsfs caches listings: the object changed under them
    return fs.info(name)

  def compose() -> None:
    info = held()
    if info["size"] == size + len(data):
      return  # an earlier try went through; its reply was lost
    if info["size"] != size:
      raise paths.StorageError(f"appending to {path} failed: it holds {info['size']:,} "
                               f"bytes, not the {size:,} this run wrote")
    try:
      fs.call("POST", "b/{}/o/{}/compose", bucket, key, json=request,
              ifGenerationMatch=info["generation"],
              headers={"Content-Type": "application/json"})
    except FileExistsError:  # 412: no longer that generation, as gcsfs resent a compose
      if held()["size"] != size + len(data):  # that went through (its reply lost)
        raise

  paths.call("writing", path + ".part", lambda: fs.pipe_file(name + ".part", data),
             writes=True)
  paths.call("appending to", path, compose, writes=True)
  paths.call("deleting", path + ".part", lambda: fs.rm_file(name + ".part"))
