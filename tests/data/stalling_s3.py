"""A minimal S3 endpoint over a local folder: HEAD, ranged GET and ListObjectsV2, answered
at once, except that a ranged read of a Parquet shard that does not reach the file's end (a
row group, not the footer) is never answered."""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LISTING = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws'
           '.com/doc/2006-03-01/"><Name>{bucket}</Name><Prefix>{prefix}</Prefix><KeyCount>{n}'
           '</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{items}'
           '</ListBucketResult>')
ITEM = ('<Contents><Key>{key}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>'
        '<ETag>"0"</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass></Contents>')


class StallingS3:
    """Serves ``root`` as bucket ``bucket``; ``stalled`` is set once a row-group read waits."""

    def __init__(self, root: Path, bucket: str = "bucket") -> None:
        self.root, self.bucket = root, bucket
        self.stalled = threading.Event()
        self.closing = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _file(self) -> Path | None:
                parts = unquote(urlsplit(self.path).path).lstrip("/").split("/", 1)
                if len(parts) < 2 or parts[0] != owner.bucket or not parts[1]:
                    return None
                path = owner.root / parts[1]
                return path if path.is_file() else None

            def _send(self, code: int, body: bytes, extra: dict[str, str] | None = None,
                      head: bool = False) -> None:
                self.send_response(code)
                for k, v in {"Content-Length": str(len(body)), "ETag": '"0"',
                             "Last-Modified": "Thu, 01 Jan 2026 00:00:00 GMT",
                             **(extra or {})}.items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                path = self._file()
                if path is None:
                    self._send(404, b"", head=True)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(path.stat().st_size))
                self.send_header("ETag", '"0"')
                self.send_header("Last-Modified", "Thu, 01 Jan 2026 00:00:00 GMT")
                self.end_headers()

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                if "list-type" in query:
                    prefix = query.get("prefix", [""])[0]
                    items = [f for f in sorted(owner.root.rglob("*")) if f.is_file()
                             and str(f.relative_to(owner.root)).startswith(prefix)]
                    body = LISTING.format(bucket=owner.bucket, prefix=prefix, n=len(items),
                                          items="".join(ITEM.format(
                                              key=f.relative_to(owner.root),
                                              size=f.stat().st_size) for f in items))
                    self._send(200, body.encode(), {"Content-Type": "application/xml"})
                    return
                path = self._file()
                if path is None:
                    self._send(404, b"<Error><Code>NoSuchKey</Code></Error>",
                               {"Content-Type": "application/xml"})
                    return
                data = path.read_bytes()
                match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if match is None:
                    self._send(200, data)
                    return
                lo = int(match[1])
                hi = min(int(match[2]) if match[2] else len(data) - 1, len(data) - 1)
                if path.suffix == ".parquet" and hi < len(data) - 1:
                    owner.stalled.set()
                    owner.closing.wait()  # a row group: never answered
                    return
                self._send(206, data[lo:hi + 1],
                           {"Content-Range": f"bytes {lo}-{hi}/{len(data)}"})

        return Handler
