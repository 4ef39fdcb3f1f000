"""Content digests of files that change whenever any byte does, without reading a large
checkpoint again at every start.

- On object storage the store's own checksums of the object's bytes (GCS keeps a CRC32C
  and, for objects uploaded whole, an MD5 of every object): nothing is read. Never its
  ETag or generation, which change when the same bytes are uploaded again (a copied or
  re-uploaded model) or only the metadata changes.
- A local file's SHA-256 is computed once and cached per machine
  (`$XDG_CACHE_HOME/tunix_core/file_digests.json`, by default under `~/.cache`), keyed by
  its real path, size, modification and change times and inode: a file rewritten in
  place (same size, other bytes) changes its times, so it is hashed again.
"""

import hashlib
import json
import os

from tunix_core.storage import paths

CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                     "tunix_core", "file_digests.json")
_CHUNK = 16 << 20
# Checksums of an object's bytes that an object store reports in its metadata (fsspec
# `info` keys).
_STORE_SUMS = ("crc32c", "md5Hash", "md5")
# What digests of earlier versions joined (ETags too): only to recognise the fingerprints
# that checkpoints saved then hold.
_LEGACY_SUMS = _STORE_SUMS + ("ETag", "etag")


def _object_info(path: str) -> dict:
  import fsspec  # pylint: disable=g-import-not-at-top  (with the gcs extra, as gs:// is)
  fs, key = fsspec.core.url_to_fs(path)
  return fs.info(key)


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with paths.open_read(path) as f:
    for chunk in iter(lambda: f.read(_CHUNK), b""):
      h.update(chunk)
  return "sha256:" + h.hexdigest()


def _load(cache: str) -> dict:
  try:
    with open(cache, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def content_digest(path: str, cache: str | None = None, legacy: bool = False) -> str:
  """A string that changes whenever any byte of the file at `path` does (module
  docstring): the object store's checksums, or a local file's SHA-256 cached in `cache`
  (default `CACHE`). `legacy`: an object's digest as earlier versions computed it, its ETag
  included (a local file's never changed)."""
  cache = cache or CACHE
  if paths.is_remote(path):
    info = paths.call("reading the metadata of", path, lambda: _object_info(path))
    sums = [f"{k}={info[k]}" for k in (_LEGACY_SUMS if legacy else _STORE_SUMS)
            if info.get(k)]
    return "store:" + ",".join(sums) if sums else _sha256(path)
  real, st = os.path.realpath(path), os.stat(path)
  stamp = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
  table = _load(cache)
  if table.get(real, [None])[0] == stamp:
    return table[real][1]
  digest = _sha256(path)
  table[real] = [stamp, digest]
  try:  # a read-only home: hashed again next time
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    tmp = f"{cache}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(table, f)
    os.replace(tmp, cache)
  except OSError:
    pass
  return digest
