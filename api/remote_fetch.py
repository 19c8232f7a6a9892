"""A remote ``ref_audio`` URL fetched without letting a client reach inside the server's network.

With ``api.allow_remote_ref_audio`` the server fetches URLs its clients name, so a client could
name ``http://127.0.0.1:6379/``, ``http://169.254.169.254/`` or a host inside the server's private
network, directly or through a redirect, and learn from the errors what answers there.
:func:`fetch_remote` therefore, for the URL and after every redirect (at most
``MAX_REDIRECTS``):

- resolves the host itself and refuses unless every address it resolves to is public
  (``public_address``: not loopback, private, link-local, shared, reserved, multicast or
  unspecified; an IPv4 address mapped into IPv6 judged as IPv4);
- connects to the address it checked (the ``Host`` header and TLS server name stay the URL's), so
  a second DNS answer cannot send it elsewhere;
- runs all of it, redirects and body included, within one deadline (``api.remote_ref_timeout_s``),
  and stops reading at ``max_bytes``.

Every failure to reach or read a URL is the same :class:`RemoteFetchError` message, whatever the
cause (refused address, unknown host, closed port, timeout, broken TLS): errors do not tell what
is there. A public server's own HTTP status is reported.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

MAX_REDIRECTS = 5
AddressCheck = Callable[[ipaddress.IPv4Address | ipaddress.IPv6Address], bool]


class RemoteFetchError(Exception):
    """The URL could not be fetched (one message for every cause: see the module docstring)."""


class RemoteStatusError(Exception):
    """A public server answered with an HTTP status other than 200 (``status``)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class RemoteTooLarge(Exception):
    """The body passed ``max_bytes`` (``size``: what was read)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


def public_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a server may connect to ``address`` for a client: a globally routed unicast one."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


async def fetch_remote(url: str, *, max_bytes: int, timeout_s: float,
                       address_allowed: AddressCheck = public_address) -> bytes:
    """The body of ``url`` (see the module docstring). Raises ``RemoteFetchError``,
    ``RemoteStatusError`` or ``RemoteTooLarge``."""
    try:
        async with asyncio.timeout(timeout_s):
            async with httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                         timeout=httpx.Timeout(timeout_s)) as client:
                for _ in range(MAX_REDIRECTS + 1):
                    got = await _get(client, url, max_bytes, address_allowed)
                    if isinstance(got, bytes):
                        return got
                    url = got  # a redirect: checked like the first
                raise RemoteFetchError()  # too many redirects
    except (RemoteStatusError, RemoteTooLarge):
        raise
    except (TimeoutError, OSError, ValueError, UnicodeError, httpx.HTTPError, RemoteFetchError):
        raise RemoteFetchError() from None


async def _get(client: httpx.AsyncClient, url: str, max_bytes: int,
               address_allowed: AddressCheck) -> bytes | str:
    """One hop: the body, or the URL a redirect names."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteFetchError()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = await _checked_address(parts.hostname, port, address_allowed)
    literal = f"[{address}]" if address.version == 6 else str(address)
    netloc = f"{literal}:{port}"
    target = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    host_header = parts.netloc.rpartition("@")[2]  # no credentials in it
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    async with client.stream("GET", target, headers={"Host": host_header}, extensions=extensions) as response:
        if response.status_code in (301, 302, 303, 307, 308) and "location" in response.headers:
            return urljoin(url, response.headers["location"])
        if response.status_code != 200:
            raise RemoteStatusError(response.status_code)
        body = bytearray()
        async for piece in response.aiter_bytes():
            body += piece
            if len(body) > max_bytes:
                raise RemoteTooLarge(len(body))
        return bytes(body)


async def _checked_address(host: str, port: int, address_allowed: AddressCheck):
    """The first address ``host`` resolves to, when every one of them is allowed."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses or not all(address_allowed(a) for a in addresses):
        raise RemoteFetchError()
    return addresses[0]
