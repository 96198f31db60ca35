"""Images sent with chat messages: decoded from data URLs, fetched from http(s) URLs, or read from files.

Fetching from URLs is off unless ``--allow-remote-images``: a client's URL makes the server connect somewhere, so
when it is on, only public addresses are reached (every address the name resolves to is checked, the connection goes
to the checked address so a second DNS answer cannot swap it, and each redirect is checked the same way), the body
stops at :data:`MAX_BYTES` and the whole fetch, redirects included, at :data:`FETCH_DEADLINE` seconds.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import os
import socket
import ssl
import time
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

from modules.errors import InvalidRequest

MAX_BYTES = 20 * 2**20
MAX_PIXELS = 4096 * 4096  # 16.8 M pixels (64 MiB as RGB); a 20 MiB PNG can otherwise decode to ~178 M pixels
NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))  # RFC 6052, RFC 8215
FETCH_DEADLINE = 15.0  # seconds for a whole remote fetch, every redirect and byte included
MAX_REDIRECTS = 3
REDIRECTS = (301, 302, 303, 307, 308)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# Test seam, not a setting: addresses let through although not public. Tests put exactly 127.0.0.1 here to have an
# "allowed" server on this machine; it stays empty in the server.
EXTRA_ALLOWED: frozenset[IPAddress] = frozenset()
TLS_VERIFY: ssl.SSLContext | bool = True  # test seam: tests trust their own certificate authority here


def _open(data: bytes, param: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_BYTES:
        raise InvalidRequest(f"the image is larger than {MAX_BYTES // 2**20} MiB", param=param)
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size  # read from the header: nothing is decoded yet
        if width * height > MAX_PIXELS:
            raise InvalidRequest(
                f"the image is {width}x{height} pixels; at most {MAX_PIXELS // 2**20} M pixels are accepted",
                param=param,
            )
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"not an image: {exc}", param=param) from exc
    return image.convert("RGB")


def load_image(source: str, param: str = "image", files_in: Path | None = None) -> Any:
    """A PIL image from a data URL, an http(s) URL (with ``--allow-remote-images`` only) or, given ``files_in``, a file there.

    File paths come only from textgen itself (pictures stored with chat messages); a path from a client or an
    uploaded history is refused, so nobody can make the server read its other files.
    """
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            raise InvalidRequest("image data URLs must be base64", param=param)
        try:
            return _open(base64.b64decode(payload, validate=True), param)
        except binascii.Error as exc:
            raise InvalidRequest(f"the image's base64 is invalid: {exc}", param=param) from exc
    if source.lower().startswith(("http://", "https://")):
        from modules import shared

        if not shared.settings.allow_remote_images:
            raise InvalidRequest(
                "this server does not fetch images from URLs (start it with --allow-remote-images to allow that); "
                "send the image inline as a data URL (data:image/png;base64,...)",
                param=param,
                code="remote_images_disabled",
            )
        return _open(fetch_image_bytes(source, param), param)
    if files_in is not None and in_folder(source, files_in):
        path = Path(source)
        if path.is_file():
            return _open(path.read_bytes(), param)
        raise InvalidRequest(f"the picture {path.name} is no longer stored", param=param)
    raise InvalidRequest("an image must be a data URL or an http(s) URL", param=param)


def is_public_address(address: IPAddress) -> bool:
    """True for an address on the public internet: not loopback, private, link-local, multicast, reserved or unspecified.

    IPv4 addresses inside IPv6 (``::ffff:127.0.0.1``, 6to4, Teredo) are judged as the IPv4 address they carry.
    """
    if isinstance(address, ipaddress.IPv6Address):
        inner = address.ipv4_mapped or address.sixtofour or (address.teredo[1] if address.teredo else None)
        if inner is None and any(address in net for net in NAT64):  # a NAT64 gateway reaches the IPv4 in its tail
            inner = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if inner is not None and not is_public_address(inner):
            return False
    return address.is_global and not (
        address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


def _allowed(address: IPAddress) -> bool:
    return address in EXTRA_ALLOWED or is_public_address(address)


def resolve_public(host: str, port: int, param: str) -> IPAddress:
    """The address to connect to for ``host``: every address it resolves to must be public, else InvalidRequest."""
    try:
        addresses = [ipaddress.ip_address(host.strip("[]").split("%")[0])]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise InvalidRequest(f"could not fetch the image: cannot resolve {host}: {exc}", param=param) from exc
        addresses = list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos))
    if not addresses:
        raise InvalidRequest(f"could not fetch the image: {host} has no address", param=param)
    refused = [a for a in addresses if not _allowed(a)]
    if refused:
        raise InvalidRequest(
            f"image URLs must point to public addresses; {host} is {refused[0]} (loopback, private, link-local "
            "and other local addresses are refused)",
            param=param,
            code="image_url_not_allowed",
        )
    return addresses[0]


def fetch_image_bytes(url: str, param: str = "image") -> bytes:
    """The body at ``url``, from public addresses only, following at most MAX_REDIRECTS redirects (each checked).

    Stops reading past MAX_BYTES and gives up FETCH_DEADLINE seconds after the start; errors are InvalidRequest.
    """
    import httpx

    deadline = time.monotonic() + FETCH_DEADLINE
    with httpx.Client(trust_env=False, follow_redirects=False, verify=TLS_VERIFY) as client:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                original = httpx.URL(url)
                host = original.raw_host.decode("ascii")  # IDNA-encoded; an IPv6 address without brackets
                if original.scheme not in ("http", "https") or not host:
                    raise ValueError("not an http(s) URL")
                port = original.port or (443 if original.scheme == "https" else 80)
                if not 0 < port < 65536:
                    raise ValueError(f"port {port} is out of range")
            except (httpx.InvalidURL, ValueError) as exc:
                raise InvalidRequest(f"could not fetch the image from {url[:200]!r}: {exc}", param=param) from exc
            address = resolve_public(host, port, param)
            target = original.copy_with(host=str(address), port=port)  # connect to the checked address
            host_header = (host if ":" not in host else f"[{host}]") + (f":{original.port}" if original.port else "")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            request = client.build_request(
                "GET",
                target,
                headers={"Host": host_header, "Accept": "image/*", "Accept-Encoding": "identity"},
                timeout=remaining,  # every phase (connect, each read) within what is left of the deadline
                extensions={"sni_hostname": host},  # TLS verifies the name, not the address
            )
            try:
                response = client.send(request, stream=True)
                try:
                    if response.status_code in REDIRECTS and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code >= 400:
                        raise InvalidRequest(
                            f"could not fetch the image: the server answered {response.status_code}", param=param
                        )
                    return _read_capped(response, deadline, param)
                finally:
                    response.close()
            except httpx.HTTPError as exc:
                if time.monotonic() >= deadline:
                    break
                raise InvalidRequest(f"could not fetch the image: {exc}", param=param) from exc
        else:
            raise InvalidRequest(f"could not fetch the image: more than {MAX_REDIRECTS} redirects", param=param)
    raise InvalidRequest(f"could not fetch the image within {FETCH_DEADLINE:g} s", param=param)


def _read_capped(response: Any, deadline: float, param: str) -> bytes:
    too_big = f"the image is larger than {MAX_BYTES // 2**20} MiB"
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BYTES:
        raise InvalidRequest(too_big, param=param)
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_raw():  # as the network delivers (a chunk size would wait to fill it)
        size += len(chunk)
        if size > MAX_BYTES:
            raise InvalidRequest(too_big, param=param)
        if time.monotonic() > deadline:
            raise InvalidRequest(f"could not fetch the image within {FETCH_DEADLINE:g} s", param=param)
        chunks.append(chunk)
    return b"".join(chunks)


def in_folder(source: str, folder: Path) -> bool:
    """True when the path ``source`` lies inside ``folder`` (lexically, after resolving ``..``)."""
    base = os.path.abspath(folder)
    target = os.path.abspath(source)
    return os.path.commonpath([base, target]) == base and target != base
