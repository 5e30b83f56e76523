"""Refusing what a foreign web page could make a browser send: the Host, Origin and content-type rules.

A page on any site can make its visitor's browser POST to ``http://127.0.0.1:8000`` without a CORS preflight
when the body is ``text/plain``, a form or multipart — the request runs even though the page cannot read the
answer. With DNS rebinding (a name of the attacker's that first resolves to their server, then to 127.0.0.1) the
page is even same-origin with the server and reads the answers. Three checks close this:

- **Host** must be a name this server answers to: an IP address literal (rebinding needs a name), ``localhost``
  or ``*.localhost`` (browsers resolve those themselves), the ``--host`` it is bound to, this machine's own host
  name when bound to a wildcard address, or a name given with ``--allowed-host`` (``.example.com`` also allows its
  subdomains; ``*`` turns the check off, e.g. behind a proxy that checks it).
- **Origin**, when a request carries one, must be allowed with ``--cors-origin`` (``*`` allows any) or be the
  server's own (the same ``host:port`` as the Host header).
- A POST to an API route must be ``content-type: application/json``: a browser cannot send that cross-site
  without a preflight, which the CORS layer answers only for allowed origins.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from .errors import APIError

JSON_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
               "/v1/messages/count_tokens")
WILDCARD_BINDS = ("0.0.0.0", "::", "[::]", "")


def split_host(header: str) -> str:
    """The host name or address of a Host header, without port or brackets, lower-case."""
    text = header.strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text[1:]
    name, sep, port = text.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        text = name
    return text.rstrip(".")


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class CrossSitePolicy:
    """The three checks, built once from the server's settings."""

    def __init__(self, bound_host: str, allowed_hosts: Iterable[str], cors_origins: Iterable[str]):
        allowed_hosts = tuple(allowed_hosts)
        self.any_host = "*" in allowed_hosts
        names = {split_host(h) for h in allowed_hosts if h != "*"}
        bound = split_host(bound_host)
        if bound in {split_host(w) for w in WILDCARD_BINDS}:
            names.add(socket.gethostname().lower())
        elif not is_ip_literal(bound):
            names.add(bound)
        self.exact = {n for n in names if not n.startswith(".")}
        self.suffixes = tuple(n for n in names if n.startswith("."))
        self.origins = {o.rstrip("/").lower() for o in cors_origins}
        self.any_origin = "*" in self.origins

    def host_allowed(self, name: str) -> bool:
        if self.any_host or is_ip_literal(name) or name == "localhost" or name.endswith(".localhost"):
            return True
        return name in self.exact or any(name.endswith(s) or name == s[1:] for s in self.suffixes)

    def check(self, method: str, path: str, headers: Mapping[str, str]) -> None:
        """Raise the refusal (403 for Host and Origin, 415 for the content type) of a request, if any."""
        host = headers.get("host")
        if host is not None and not self.host_allowed(split_host(host)):
            raise APIError(403, f"Host '{host}' is not a name this server answers to (a defence against DNS "
                                f"rebinding); start coli serve with --allowed-host {split_host(host)} to allow it",
                           param="host", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, host):
            raise APIError(403, f"Origin '{origin}' is not allowed to use this server; start coli serve with "
                                f"--cors-origin {origin} to let pages from it in", param="origin",
                           code="origin_not_allowed")
        if method == "POST" and path.rstrip("/") in JSON_ROUTES:
            given = headers.get("content-type", "")
            if given.split(";", 1)[0].strip().lower() != "application/json":
                shown = f"content-type '{given}'" if given else "a missing content-type"
                raise APIError(415, f"{shown} is not accepted: send the body as JSON with "
                                    f"'content-type: application/json'", param="content-type",
                               code="unsupported_media_type")

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        normal = origin.strip().rstrip("/").lower()
        if self.any_origin or normal in self.origins:
            return True
        # a page served by this very server (scheme://host:port equal to the Host it reached us by)
        parts = urlsplit(normal)
        return host is not None and parts.scheme in ("http", "https") and parts.netloc == host.strip().lower()
