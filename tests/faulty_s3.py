"""An S3 endpoint that fails on purpose: a small HTTP proxy in front of a moto server that
answers chosen uploads with S3's throttling reply. Used by the fault tests and by
``benchmarks/fault_matrix.py``."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultyS3Proxy:
    """An HTTP proxy in front of a moto S3 server that answers chosen PUT/POST requests with
    ``503 SlowDown`` (S3's throttling reply) instead of forwarding them.

    ``rule(method, path, nth)`` -> True to inject the fault; ``nth`` counts matching-method
    requests from 1.
    """

    def __init__(self, upstream_port: int, rule):
        self.rule, self.count, self.injected = rule, 0, 0
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self):
                body = self._body()
                if self.command in ("PUT", "POST"):
                    with lock:
                        proxy.count += 1
                        fail = proxy.rule(self.command, self.path, proxy.count)
                        proxy.injected += fail
                    if fail:
                        reply = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown"
                                 b"</Code><Message>Please reduce your request rate.</Message>"
                                 b"</Error>")
                        self.send_response(503)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(reply)))
                        self.end_headers()
                        self.wfile.write(reply)
                        return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "content-length", "expect")}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                # a HEAD reply carries the object's length, not its (empty) body's
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
