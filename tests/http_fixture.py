"""A small real HTTP server on a loopback address for download tests.

It serves registered byte blobs with Range (206 + Content-Range), ETag / Last-Modified and conditional
requests, injects faults per path, and records every request (headers, status, body bytes sent). Given a TLS
context it speaks https and plain http on the same port (it looks at the first byte a client sends), so a
redirect from https to http can change the scheme and nothing else. `make_tls` writes a throwaway CA and a
server certificate for the loopback names with the `openssl` command line tool.
"""

from __future__ import annotations

import hashlib
import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HTML_PAGE = b"<!DOCTYPE html><html><head><title>Login</title></head><body>please sign in</body></html>\n"


@dataclass
class Blob:
    """What one path serves, and which faults it injects."""

    data: bytes
    etag: str | None = None  # None: derived from the data
    last_modified: str | None = "Mon, 01 Jan 2024 00:00:00 GMT"
    headers: dict[str, str] = field(default_factory=dict)  # extra response headers (e.g. X-Repo-Commit)
    status: int | None = None  # a fixed error status (e.g. 404)
    fail_times: int = 0  # answer 500 this many times, then serve normally
    slow: float = 0.0  # sleep this long after the headers, before the body
    html: bool = False  # serve an HTML page instead of the data
    truncate_at: int | None = None  # always stop the body at this file offset (Content-Length stays full)
    cut_once_at: int | None = None  # stop the body at this offset once, then serve normally
    chunk_delay: float = 0.0  # sleep between 16 KiB chunks
    redirect: str | None = None  # answer 302 to this URL (with `headers` on the 302)
    ranges: bool = True  # honour Range requests
    chunked: bool = False  # send the body with Transfer-Encoding: chunked and no Content-Length
    gate: threading.Event | None = None  # hold the body until this is set (or the server stops)

    def current_etag(self) -> str:
        return self.etag or '"' + hashlib.sha256(self.data).hexdigest()[:32] + '"'


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    status: int = 0
    sent: int = 0  # body bytes written
    scheme: str = "http"  # "https" when the request came over TLS
    done: bool = False  # the handler finished writing the body (or gave up on a client that left)

    def header(self, name: str) -> str | None:
        """A request header, looked up case-insensitively (huggingface_hub sends lower-case names)."""
        return next((v for k, v in self.headers.items() if k.lower() == name.lower()), None)


class _QuietServer(ThreadingHTTPServer):
    """Injected faults cut connections on purpose: the client hanging up is not news."""

    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def handle_error(self, request, client_address):  # noqa: ANN001
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError, OSError)):
            super().handle_error(request, client_address)

    def finish_request(self, request, client_address):  # noqa: ANN001
        """In the connection's own thread: a TLS ClientHello (first byte 0x16) gets TLS, anything else not."""
        if self.tls is None:
            return super().finish_request(request, client_address)
        request.settimeout(5.0)
        first = request.recv(1, socket.MSG_PEEK)
        request.settimeout(None)
        if first != b"\x16":
            return super().finish_request(request, client_address)
        with self.tls.wrap_socket(request, server_side=True) as tls_socket:
            return super().finish_request(tls_socket, client_address)


class Server:
    """A threaded HTTP server; ``url(path)`` gives the address of a path.

    ``host`` is the loopback address to bind (Linux routes all of 127.0.0.0/8 to loopback), ``port`` 0 picks
    a free one. With ``tls`` the same port also answers https (``url(path, scheme="https")``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        self.blobs: dict[str, Blob] = {}
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.host = host
        self.httpd = _QuietServer((host, port), _make_handler(self))
        self.httpd.daemon_threads = True
        self.httpd.tls = tls
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def url(self, path: str, *, host: str | None = None, scheme: str = "http") -> str:
        """The address of ``path``; ``host`` another name for this server (``localhost``)."""
        return f"{scheme}://{host or self.host}:{self.port}{path}"

    def add(self, path: str, data: bytes = b"", **faults: object) -> Blob:
        blob = Blob(data, **faults)  # type: ignore[arg-type]
        self.blobs[path] = blob
        return blob

    def for_path(self, path: str) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.path == path]

    def sent(self, path: str) -> int:
        return sum(r.sent for r in self.for_path(path))

    def stop(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _make_handler(server: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output quiet
            pass

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            record = Request(self.command, self.path.split("?")[0], dict(self.headers.items()),
                             scheme="https" if isinstance(self.connection, ssl.SSLSocket) else "http")
            with server.lock:
                server.requests.append(record)
            blob = server.blobs.get(record.path)
            if blob is None:
                return self._simple(record, 404, b"not found")
            if blob.status is not None:
                return self._simple(record, blob.status, b"error", blob.headers)
            if blob.fail_times > 0:
                blob.fail_times -= 1
                return self._simple(record, 500, b"server error")
            if blob.redirect is not None:
                return self._simple(record, 302, b"", {"Location": blob.redirect, **blob.headers})
            if blob.html:
                return self._simple(record, 200, HTML_PAGE, {"Content-Type": "text/html"})
            self._send_blob(record, blob, body)

        def _simple(self, record: Request, status: int, payload: bytes,
                    headers: dict[str, str] | None = None) -> None:
            record.status = status
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
                record.sent = len(payload)

        def _send_blob(self, record: Request, blob: Blob, body: bool) -> None:
            etag, data = blob.current_etag(), blob.data
            inm, ims = self.headers.get("If-None-Match"), self.headers.get("If-Modified-Since")
            if (inm and inm == etag) or (not inm and ims and ims == blob.last_modified):
                return self._simple(record, 304, b"", {"ETag": etag})
            start, status = 0, 200
            rng, if_range = self.headers.get("Range"), self.headers.get("If-Range")
            if rng and blob.ranges and (not if_range or if_range in (etag, blob.last_modified)):
                start, status = int(rng.split("=")[1].split("-")[0]), 206
            record.status = status
            self.send_response(status)
            if blob.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(len(data) - start))
            self.send_header("ETag", etag)
            if blob.last_modified:
                self.send_header("Last-Modified", blob.last_modified)
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            for k, v in blob.headers.items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self._write_body(record, blob, start)

        def _write_body(self, record: Request, blob: Blob, start: int) -> None:
            if blob.slow and server.stopping.wait(blob.slow):
                return
            while blob.gate is not None and not blob.gate.is_set():
                if server.stopping.wait(0.02):
                    return
            stop = len(blob.data)
            if blob.truncate_at is not None:
                stop = min(stop, max(start, blob.truncate_at))
            elif blob.cut_once_at is not None and start < blob.cut_once_at:
                stop, blob.cut_once_at = blob.cut_once_at, None
            pos = start
            try:
                while pos < stop:
                    piece = blob.data[pos:min(stop, pos + 16384)]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if blob.chunked else piece)
                    pos += len(piece)
                    record.sent += len(piece)
                    if blob.chunk_delay and server.stopping.wait(blob.chunk_delay):
                        break
                if blob.chunked and pos >= len(blob.data):
                    self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client went away (cancelled): nothing to do
                pass
            record.done = True
            if stop < len(blob.data):  # cut the connection short of the announced Content-Length
                self.wfile.flush()
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    return Handler


def make_tls(directory: Path) -> tuple[ssl.SSLContext, Path]:
    """A server TLS context for 127.0.0.1, 127.0.0.2 and localhost, and the CA file a client must trust.

    Two certificates, a CA and a server certificate it signs (a self-signed leaf is refused by strict
    verifiers), made with the ``openssl`` command line tool; a day of validity is plenty for a test run.
    """
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    ext = directory / "srv.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,IP:127.0.0.2,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                   "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                   "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=loramux test CA"],
                ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
                ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
                 "-days", "1", "-extfile", ext]):
        subprocess.run(["openssl", *map(str, cmd)], check=True, capture_output=True, timeout=60)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context, ca
