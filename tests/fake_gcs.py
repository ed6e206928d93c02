"""An in-memory Google Cloud Storage server speaking the part of the JSON API that TensorStore's gcs
driver (orbax checkpoints) and gcsfs (etils.epath) use, with real object generations and
preconditions: TensorStore's OCDBT manifests rely on `ifGenerationMatch` writes and generation
headers, which a store that ignores them corrupts.

Served on localhost by a thread; `STORAGE_EMULATOR_HOST` (gcsfs) and `TENSORSTORE_GCS_HTTP_URL`
(TensorStore) point the clients at it (tests/conftest.py, fixture `fake_gcs`).
"""

from __future__ import annotations

import base64
import dataclasses
import email.parser
import email.policy
import hashlib
import http.server
import itertools
import json
import re
import sys
import threading
import urllib.parse


@dataclasses.dataclass
class _Object:
  data: bytes
  generation: int
  content_type: str = "application/octet-stream"


class Store:
  def __init__(self, buckets=("lra-test",)):
    self.buckets = {b: {} for b in buckets}
    self.lock = threading.Lock()
    self.generations = itertools.count(1_000_001)
    self.uploads: dict[str, tuple[str, str, dict, bytearray]] = {}
    # Object names whose writes fail with 503, as a store that keeps failing: e.g. re.compile("checkpoints/4/").
    self.failing: re.Pattern | None = None
    self.refused = 0  # writes failed so far by `failing`
    # 503: retried by the clients (a store that keeps failing); 403 is not (a write refused outright, as
    # a full disk refuses one)
    self.failing_status = 503

  def resource(self, bucket: str, name: str, obj: _Object) -> dict:
    return {
      "kind": "storage#object",
      "bucket": bucket,
      "name": name,
      "id": f"{bucket}/{name}/{obj.generation}",
      "size": str(len(obj.data)),
      "generation": str(obj.generation),
      "metageneration": "1",
      "contentType": obj.content_type,
      "timeCreated": "2026-01-01T00:00:00.000Z",
      "updated": "2026-01-01T00:00:00.000Z",
      "storageClass": "STANDARD",
      "md5Hash": base64.b64encode(hashlib.md5(obj.data).digest()).decode(),
    }


def _precondition(query: dict, obj: _Object | None) -> bool:
  """Whether ifGenerationMatch / ifGenerationNotMatch hold (generation 0 = the object does not exist)."""
  current = obj.generation if obj is not None else 0
  if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != current:
    return False
  if "ifGenerationNotMatch" in query and int(query["ifGenerationNotMatch"]) == current:
    return False
  return True


class Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  store: Store

  def log_message(self, *args):  # quiet
    pass

  # ---------------------------------------------------------------------------------------- plumbing
  def _body(self) -> bytes:
    n = int(self.headers.get("Content-Length") or 0)
    return self.rfile.read(n) if n else b""

  def _send(
    self, status: int, body: bytes = b"", headers: dict | None = None, content_type: str = "application/json"
  ) -> None:
    self.send_response(status)
    for k, v in (headers or {}).items():
      self.send_header(k, v)
    if body or status not in (204, 304):
      self.send_header("Content-Type", content_type)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    if body and self.command != "HEAD":
      self.wfile.write(body)

  def _json(self, status: int, payload: dict) -> None:
    self._send(status, json.dumps(payload).encode())

  def _error(self, status: int, message: str) -> None:
    self._json(status, {"error": {"code": status, "message": message}})

  def _route(self):
    url = urllib.parse.urlsplit(self.path)
    query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
    return url.path, query

  # ---------------------------------------------------------------------------------------- verbs
  def do_GET(self):
    path, query = self._route()
    self._body()
    if m := re.fullmatch(r"(?:/download)?/storage/v1/b/([^/]+)/o/(.+)", path):
      bucket, name = m.group(1), urllib.parse.unquote(m.group(2))
      return self._get_object(bucket, name, query)
    if m := re.fullmatch(r"/storage/v1/b/([^/]+)/o", path):
      return self._list(m.group(1), query)
    if m := re.fullmatch(r"/storage/v1/b/([^/]+)", path):
      if m.group(1) not in self.store.buckets:
        return self._error(404, "no such bucket")
      return self._json(
        200,
        {"kind": "storage#bucket", "name": m.group(1), "id": m.group(1), "location": "US", "storageClass": "STANDARD"},
      )
    self._error(501, f"GET {path} is not implemented")

  do_HEAD = do_GET

  def _get_object(self, bucket: str, name: str, query: dict) -> None:
    with self.store.lock:
      obj = self.store.buckets.get(bucket, {}).get(name)
    if obj is None:
      return self._error(404, f"{name} not found")
    if not _precondition(query, obj):
      status = 304 if "ifGenerationNotMatch" in query and "ifGenerationMatch" not in query else 412
      return self._send(status, b"" if status == 304 else b"{}", {"x-goog-generation": str(obj.generation)})
    headers = {
      "x-goog-generation": str(obj.generation),
      "x-goog-metageneration": "1",
      "x-goog-stored-content-length": str(len(obj.data)),
      "ETag": f'"{obj.generation}"',
    }
    if query.get("alt") != "media":
      return self._send(200, json.dumps(self.store.resource(bucket, name, obj)).encode(), headers)
    data, status = obj.data, 200
    if rng := self.headers.get("Range"):
      m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
      size = len(data)
      if m.group(1):
        start = int(m.group(1))
        end = min(int(m.group(2)) + 1 if m.group(2) else size, size)
      else:  # the last N bytes
        start, end = max(size - int(m.group(2)), 0), size
      if start >= size and size:
        return self._error(416, "range not satisfiable")
      headers["Content-Range"] = f"bytes {start}-{max(end - 1, start)}/{size}"
      data, status = data[start:end], 206
    self._send(status, data, headers, content_type=obj.content_type)

  def _list(self, bucket: str, query: dict) -> None:
    prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
    start, end = query.get("startOffset", ""), query.get("endOffset", "")
    token = query.get("pageToken", "")
    limit = int(query.get("maxResults") or 1000)
    with self.store.lock:
      names = sorted(self.store.buckets.get(bucket, {}).items())
    items, prefixes = [], []
    for name, obj in names:
      if not name.startswith(prefix) or (start and name < start) or (end and name >= end) or name <= token:
        continue
      rest = name[len(prefix) :]
      if delimiter and delimiter in rest:
        p = prefix + rest[: rest.index(delimiter) + len(delimiter)]
        if p not in prefixes:
          prefixes.append(p)
        continue
      items.append(self.store.resource(bucket, name, obj))
    page, more = items[:limit], len(items) > limit
    payload = {"kind": "storage#objects", "items": page, "prefixes": prefixes}
    if more:
      payload["nextPageToken"] = page[-1]["name"]
    self._json(200, payload)

  def do_POST(self):
    path, query = self._route()
    body = self._body()
    if path.startswith("/upload/storage/v1/b/") and query.get("upload_id") in self.store.uploads:
      return self._upload_chunk(query["upload_id"], body)
    if m := re.fullmatch(r"/upload/storage/v1/b/([^/]+)/o", path):
      return self._upload(m.group(1), query, body)
    if m := re.fullmatch(r"/storage/v1/b/([^/]+)/o/(.+)/(?:rewriteTo|copyTo)/b/([^/]+)/o/(.+)", path):
      return self._copy(
        m.group(1), urllib.parse.unquote(m.group(2)), m.group(3), urllib.parse.unquote(m.group(4)), query
      )
    if path == "/batch/storage/v1":
      return self._batch(body)
    self._error(501, f"POST {path} is not implemented")

  def do_PUT(self):
    path, query = self._route()
    body = self._body()
    if path.startswith("/upload/storage/v1/b/") and query.get("upload_id") in self.store.uploads:
      return self._upload_chunk(query["upload_id"], body)
    self._error(501, f"PUT {path} is not implemented")

  def _upload_chunk(self, upload_id: str, body: bytes) -> None:
    """A piece of a resumable upload; Content-Range "bytes a-b/TOTAL" (or none) ends it, ".../*" does not."""
    bucket, name, meta, data = self.store.uploads[upload_id]
    data.extend(body)
    total = re.search(r"/(\d+|\*)\s*$", self.headers.get("Content-Range") or "")
    if total is None or total.group(1) != "*":
      del self.store.uploads[upload_id]
      return self._store(bucket, name, bytes(data), meta.get("contentType"), {})
    self._send(308, b"", {"Range": f"bytes=0-{len(data) - 1}"} if data else {})

  def do_DELETE(self):
    path, query = self._route()
    self._body()
    if m := re.fullmatch(r"/storage/v1/b/([^/]+)/o/(.+)", path):
      status = self._delete(m.group(1), urllib.parse.unquote(m.group(2)), query)
      return self._send(status) if status == 204 else self._error(status, "delete failed")
    self._error(501, f"DELETE {path} is not implemented")

  # ---------------------------------------------------------------------------------------- operations
  def _store(self, bucket: str, name: str, data: bytes, content_type: str | None, query: dict) -> None:
    if self.store.failing is not None and self.store.failing.search(name):
      self.store.refused += 1
      return self._error(self.store.failing_status, "write refused (injected)")
    with self.store.lock:
      objects = self.store.buckets.get(bucket)
      if objects is None:
        return self._error(404, "no such bucket")
      if not _precondition(query, objects.get(name)):
        return self._error(412, "precondition failed")
      obj = _Object(data, next(self.store.generations), content_type or "application/octet-stream")
      objects[name] = obj
      resource = self.store.resource(bucket, name, obj)
    self._json(200, resource)

  def _upload(self, bucket: str, query: dict, body: bytes) -> None:
    kind = query.get("uploadType", "media")
    if kind == "media":
      return self._store(bucket, query["name"], body, self.headers.get("Content-Type"), query)
    if kind == "multipart":
      message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + self.headers["Content-Type"].encode() + b"\r\n\r\n" + body
      )
      parts = list(message.iter_parts())
      meta = json.loads(parts[0].get_content())
      data = parts[1].get_payload(decode=True)
      return self._store(bucket, meta.get("name") or query["name"], data, meta.get("contentType"), query)
    if kind == "resumable":
      meta = json.loads(body or b"{}")
      upload_id = f"u{next(self.store.generations)}"
      self.store.uploads[upload_id] = (bucket, meta.get("name") or query.get("name"), meta, bytearray())
      host = self.headers.get("Host")
      location = f"http://{host}/upload/storage/v1/b/{bucket}/o?uploadType=resumable&upload_id={upload_id}"
      return self._send(200, b"", {"Location": location})
    self._error(501, f"uploadType {kind} is not implemented")

  def _copy(self, src_bucket: str, src: str, dst_bucket: str, dst: str, query: dict) -> None:
    with self.store.lock:
      obj = self.store.buckets.get(src_bucket, {}).get(src)
    if obj is None:
      return self._error(404, f"{src} not found")
    with self.store.lock:
      new = _Object(obj.data, next(self.store.generations), obj.content_type)
      self.store.buckets[dst_bucket][dst] = new
      resource = self.store.resource(dst_bucket, dst, new)
    size = str(len(obj.data))
    self._json(
      200,
      {
        "kind": "storage#rewriteResponse",
        "totalBytesRewritten": size,
        "objectSize": size,
        "done": True,
        "resource": resource,
      },
    )

  def _delete(self, bucket: str, name: str, query: dict) -> int:
    with self.store.lock:
      objects = self.store.buckets.get(bucket, {})
      if name not in objects:
        return 404
      if not _precondition(query, objects[name]):
        return 412
      del objects[name]
    return 204

  def _batch(self, body: bytes) -> None:
    """multipart/mixed of embedded requests (gcsfs deletes many objects this way): only DELETEs."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
      b"Content-Type: " + self.headers["Content-Type"].encode() + b"\r\n\r\n" + body
    )
    boundary = "batch_response"
    out = []
    for part in message.iter_parts():
      request_line = part.get_payload(decode=True).decode().splitlines()[0]
      method, url = request_line.split()[:2]
      target = urllib.parse.urlsplit(url)
      m = re.fullmatch(r"/storage/v1/b/([^/]+)/o/(.+)", target.path)
      status = self._delete(m.group(1), urllib.parse.unquote(m.group(2)), {}) if method == "DELETE" and m else 501
      reason = {204: "No Content", 404: "Not Found"}.get(status, "Error")
      content_id = part.get("Content-ID", "")
      out.append(
        f"--{boundary}\r\nContent-Type: application/http\r\nContent-ID: response-{content_id.strip('<>')}"
        f"\r\n\r\nHTTP/1.1 {status} {reason}\r\nContent-Length: 0\r\n\r\n"
      )
    payload = ("".join(out) + f"--{boundary}--\r\n").encode()
    self._send(200, payload, content_type=f"multipart/mixed; boundary={boundary}")


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def handle_error(self, request, client_address):
    if not isinstance(sys.exception(), ConnectionError):  # a client killed mid-request (a test's SIGKILL)
      super().handle_error(request, client_address)


class FakeGCS:
  """`with FakeGCS() as url:` serves the store on localhost until the block ends."""

  def __init__(self, buckets=("lra-test",)):
    self.store = Store(buckets)
    handler = type("BoundHandler", (Handler,), {"store": self.store})
    self.server = _Server(("localhost", 0), handler)
    self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

  @property
  def url(self) -> str:
    return f"http://localhost:{self.server.server_address[1]}"

  def __enter__(self) -> str:
    self.thread.start()
    return self.url

  def __exit__(self, *exc) -> None:
    self.server.shutdown()
    self.server.server_close()
