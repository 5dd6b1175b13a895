"""The network address a request comes from, for the limits that must hold however many sessions one client
opens (a session, and an identity, cost nothing to make; an address does).

Behind a proxy (a Hugging Face Space has one) every request comes from the proxy, and the client's address is in
``X-Forwarded-For``: each proxy appends the address it was reached from, so with ``proxy_hops`` trusted proxies in
front of the app the client is the ``proxy_hops``-th entry from the right; entries further left were written by the
client and are not believed. Entries at the right end that are private or loopback addresses are proxies inside
the host's own network and are passed over first, so a host that adds an internal hop the operator did not count
still yields the client (never the one internal address every visitor would share). With ``proxy_hops`` 0 the
header is ignored. IPv6 addresses count by their /64 network, which one client usually holds whole. Addresses
are kept in memory only, never written or shown.
"""

from __future__ import annotations

import ipaddress


def client_address(request, proxy_hops: int = 0) -> str | None:
    """The address ``request`` (a ``gr.Request``) came from, or None when it does not say."""
    if request is None:
        return None
    host = getattr(getattr(request, "client", None), "host", None)
    if proxy_hops > 0:
        entries = _forwarded_for(getattr(request, "headers", None))
        while entries and _internal(entries[-1]):
            entries.pop()
        if len(entries) >= proxy_hops:
            host = entries[-proxy_hops]
    return _normalized(host) if isinstance(host, str) and host else None


def _forwarded_for(headers) -> list[str]:
    if headers is None:
        return []
    getlist = getattr(headers, "getlist", None)
    if callable(getlist):
        values = getlist("x-forwarded-for")
    else:
        value = next((v for k, v in dict(headers).items() if str(k).lower() == "x-forwarded-for"), None)
        values = [value] if value else []
    return [part.strip() for value in values for part in str(value).split(",") if part.strip()]


def _normalized(host: str) -> str:
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host
    if ip.version == 4:
        return str(ip)
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


def _internal(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return ip.is_private or ip.is_loopback or ip.is_link_local
