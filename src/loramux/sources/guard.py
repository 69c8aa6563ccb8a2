"""The private-network guard of URL downloads: what a remote load may connect to.

With ``SourceOptions(allow_private_networks=False)`` (what the server uses for runtime loads), a download
goes through :class:`GuardedTransport`. Its network backend resolves each host name itself, checks *every*
address the name has with :func:`refusal`, and only then connects, to one of the addresses it checked. A
name that answers a public address to the check and a private one a moment later (DNS rebinding) therefore
cannot steer the connection, and every redirect, which opens its own connection, is checked again. TLS is
still about the host name: httpcore sends it as SNI and verifies the certificate against it.

Proxies from the environment are not used here: a proxy would resolve the name itself, out of reach of the
check. ``http`` builds the transport; this module needs nothing of the package but ``errors``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore
import httpx

from ..errors import DownloadRefused

#: httpcore's exceptions as httpx raises them, most specific first (the download code handles httpx's).
_EXCEPTIONS: tuple[tuple[type[Exception], type[Exception]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout), (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout), (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException), (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError), (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError), (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError), (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol), (httpcore.ProtocolError, httpx.ProtocolError),
)


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # well-known prefix: the IPv4 address is the low 32 bits
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")  # local-use prefix: translates to local networks


def refusal(address: str) -> str | None:
    """Why a remote load may not connect to the IP ``address``, or None for a public address.

    The kinds: ``loopback``, ``link-local`` (169.254.0.0/16 with the cloud metadata services, fe80::/10),
    ``private`` (10/8, 172.16/12, 192.168/16, fc00::/7), ``multicast``, ``unspecified`` (0.0.0.0, ::) and
    ``not public`` for every other range that is not globally routable (100.64/10, documentation and
    reserved ranges). An IPv4 address inside IPv6 (``::ffff:a.b.c.d``, 6to4, Teredo, NAT64) is judged as
    that IPv4 address.
    """
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if inner is None and ip in _NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is None and ip in _LOCAL_NAT64:
            return "private"
        ip = inner or ip
    for kind in ("unspecified", "loopback", "link_local", "multicast", "private"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if ip.is_global else "not public"


def checked_addresses(host: str, port: int, label: str) -> list[str]:
    """Every address of ``host``; raises :class:`DownloadRefused` (``label`` the source) if any is refused."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:  # a failed lookup is a connection error: retried like one
        raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from exc
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        kind = refusal(address)
        if kind is not None:
            shown = host if host == address else f"{host} resolves to {address}"
            raise DownloadRefused(label, f"{shown} ({kind} address): remote loads may not reach private "
                                         "networks (allow_private_networks=False)", reason="private_network",
                                  hint="use a public host, or allow private networks (the server's "
                                       "--allow-private-networks) if this host is meant to be reachable")
    if not addresses:
        raise httpcore.ConnectError(f"cannot resolve {host}: no address")
    return addresses


class _CheckedBackend(httpcore.NetworkBackend):
    """httpcore's sync backend, connecting only to addresses that passed the check."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        last: Exception | None = None
        for address in checked_addresses(host, port, self.label):
            try:
                return self.inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as exc:  # try the next checked address, as create_connection would
                last = exc
        assert last is not None
        raise last

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("unix sockets are not used by guarded downloads")

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


@contextlib.contextmanager
def _mapped() -> Iterator[None]:
    try:
        yield
    except tuple(core for core, _ in _EXCEPTIONS) as exc:
        mapped = next(m for core, m in _EXCEPTIONS if isinstance(exc, core))
        raise mapped(str(exc)) from exc


class _Body(httpx.SyncByteStream):
    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[bytes]:
        with _mapped():
            yield from self.stream

    def close(self) -> None:
        if hasattr(self.stream, "close"):
            self.stream.close()


class GuardedTransport(httpx.BaseTransport):
    """An httpx transport whose connections go only to checked public addresses (see the module doc).

    ``label`` names the source in refusals (redacted: no password, no query).
    """

    def __init__(self, label: str) -> None:
        self.pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(),
                                            network_backend=_CheckedBackend(label))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port,
                           target=request.url.raw_path)
        core = httpcore.Request(method=request.method, url=url, headers=request.headers.raw,
                                content=request.stream, extensions=request.extensions)
        with _mapped():
            resp = self.pool.handle_request(core)
        return httpx.Response(status_code=resp.status, headers=resp.headers, stream=_Body(resp.stream),
                              extensions=resp.extensions)

    def close(self) -> None:
        self.pool.close()


__all__ = ["GuardedTransport", "checked_addresses", "refusal"]
