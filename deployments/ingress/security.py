"""API key check and image-URL policy of the ingress (README "Limits, errors and security").

* `ApiKeyAuth`: an optional bearer key (`AppArgs.api_key`, else the `VISION_API_KEY` environment variable of
  the ingress replica), compared in constant time; 401 with `WWW-Authenticate: Bearer` without it.
* `UrlFetcher`: image URLs are fetched only from hosts on `AppArgs.url_allowlist` (empty by default: no
  URL is ever fetched, so the service cannot be made to reach internal addresses), with the schemes of
  `url_schemes`, no redirects, no credentials in the URL, no proxy from the environment, a time limit for
  the whole fetch and the encoded-image byte limit enforced while reading.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
from urllib.parse import urlsplit

from deployments.app_args import api_key_problem
from deployments.config import API_KEY_ENV, AppArgs
from deployments.errors import ErrorCode, RequestError
from deployments.ingress.inputs import image_too_large
from encoder.errors import ConfigError

# ------------------------------------------------------------------------------------------ API key

OPEN = "open"  # the identity of every caller of a service without an API key


class ApiKeyAuth:
    """Checks `Authorization: Bearer <key>` when a key is configured; a no-op otherwise."""

    def __init__(self, key: str | None):
        if key and (why := api_key_problem(key)):  # the environment's key; the argument was checked already
            raise ConfigError(f"{API_KEY_ENV}: {why}")
        self._key = key.encode() if key else None
        self._identity = "key:" + hashlib.sha256(self._key).hexdigest()[:32] if self._key else OPEN

    @classmethod
    def from_args(cls, args: AppArgs, environ=os.environ) -> ApiKeyAuth:
        return cls(args.api_key or environ.get(API_KEY_ENV) or None)

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def check(self, authorization: str | None) -> str:
        """Raise RequestError 401 unless `authorization` (the header's value) carries the key; the caller's identity
        (`identity`): what scopes its own cache keys (`deployments.ingress.cache`)."""
        if self._key is None:
            return OPEN
        if not authorization:
            raise RequestError(
                "missing API key: send the header 'Authorization: Bearer <key>'", ErrorCode.MISSING_API_KEY, None
            )
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise RequestError(
                "malformed Authorization header: expected 'Bearer <key>'", ErrorCode.INVALID_API_KEY, None
            )
        # Constant time in the key's length; the token's own length is the caller's to know.
        if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self._key):
            raise RequestError("incorrect API key", ErrorCode.INVALID_API_KEY, None)
        return self._identity

    @property
    def identity(self) -> str:
        """Who a request that passed `check` is: "open" without a key, else "key:" and a digest of the key (never
        the key itself). One key per service today: its holders are one tenant."""
        return self._identity


# ------------------------------------------------------------------------------------------ image URLs

MAX_URL_CHARS = 8192  # longer image URLs are refused (400) before they are parsed
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # never valid in a URL (httpx refuses them; RFC 3986 has none)


def host_allowed(host: str, port: int | None, allowlist: tuple[str, ...]) -> bool:
    """Whether `host` (lower case, no trailing dot) and `port` match an entry: 'host', 'host:port' or
    '*.domain' (subdomains of domain only)."""
    for entry in allowlist:
        name, _, entry_port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        if entry_port and (not entry_port.isdigit() or port != int(entry_port)):
            continue
        if name.startswith("*."):
            if host.endswith(name[1:]) and len(host) > len(name) - 1:
                return True
        elif host == name:
            return True
    return False


class UrlFetcher:
    """Fetches allowlisted image URLs (see the module docstring); `enabled` is False with an empty allowlist."""

    def __init__(
        self,
        allowlist: tuple[str, ...],
        schemes: tuple[str, ...] = ("https",),
        timeout_s: float = 10.0,
        max_bytes: int = 20 * 2**20,
    ):
        self.allowlist, self.schemes, self.timeout_s, self.max_bytes = allowlist, schemes, timeout_s, max_bytes
        # one connection pool for the replica's life, created on the first fetch; it is never closed: the
        # ingress replica's process ends with it
        self._client = None

    @classmethod
    def from_args(cls, args: AppArgs) -> UrlFetcher:
        return cls(args.url_allowlist, args.url_schemes, args.url_fetch_timeout_s, args.max_image_bytes)

    @property
    def enabled(self) -> bool:
        return bool(self.allowlist)

    def check(self, url: str) -> str:
        """The URL if policy allows fetching it, else RequestError 400 naming why not."""
        if not self.enabled:
            scheme = url.split(":", 1)[0].lower()
            raise RequestError(
                f"{scheme} image URLs are not fetched by this service; send a data URL or base64 image",
                ErrorCode.INVALID_IMAGE_URL,
            )
        if len(url) > MAX_URL_CHARS:
            raise RequestError(
                f"image URL is {len(url)} characters, over the limit of {MAX_URL_CHARS}", ErrorCode.INVALID_IMAGE_URL
            )
        if control := _CONTROL.search(url):
            raise RequestError(
                f"malformed image URL: control character U+{ord(control.group()):04X} at position {control.start()}",
                ErrorCode.INVALID_IMAGE_URL,
            )
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise RequestError(f"malformed image URL: {e}", ErrorCode.INVALID_IMAGE_URL) from None
        scheme = parts.scheme.lower()
        if scheme not in self.schemes:
            raise RequestError(
                f"{scheme} image URLs are not fetched (allowed schemes: {', '.join(self.schemes)})",
                ErrorCode.URL_NOT_ALLOWED,
            )
        if parts.username is not None or parts.password is not None:
            raise RequestError("image URLs with credentials are not fetched", ErrorCode.URL_NOT_ALLOWED)
        host = (parts.hostname or "").rstrip(".")
        if not host or not host_allowed(host, port, self.allowlist):
            raise RequestError(f"image URL host {host!r} is not on the allowlist", ErrorCode.URL_NOT_ALLOWED)
        return url

    async def fetch(self, url: str) -> tuple[bytes, str | None]:
        """(body, media type) of an allowed URL; RequestError 400 (fetch failed), 413 (too large)."""
        import httpx

        self.check(url)
        if self._client is None:
            self._client = httpx.AsyncClient(
                trust_env=False,  # never a proxy or netrc from the environment
                follow_redirects=False,
                timeout=httpx.Timeout(self.timeout_s),
                limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            )
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._client.stream("GET", url, headers={"Accept": "image/*"}) as r:
                    if r.status_code != 200:
                        raise RequestError(
                            f"fetching the image URL answered HTTP {r.status_code}", ErrorCode.IMAGE_FETCH_FAILED
                        )
                    declared = r.headers.get("content-length")
                    if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                        raise image_too_large(int(declared), self.max_bytes)
                    chunks, total = [], 0
                    async for chunk in r.aiter_bytes():
                        total += len(chunk)
                        if total > self.max_bytes:
                            raise image_too_large(total, self.max_bytes, "image (at the URL)")
                        chunks.append(chunk)
                    media = (r.headers.get("content-type") or "").split(";", 1)[0].strip().lower() or None
        except TimeoutError:
            raise RequestError(
                f"fetching the image URL took longer than {self.timeout_s:g}s", ErrorCode.IMAGE_FETCH_FAILED
            ) from None
        except (httpx.InvalidURL, UnicodeError) as e:  # what `check` lets through and httpx cannot send
            raise RequestError(f"malformed image URL: {type(e).__name__}", ErrorCode.INVALID_IMAGE_URL) from None
        except httpx.HTTPError as e:
            raise RequestError(
                f"fetching the image URL failed: {type(e).__name__}", ErrorCode.IMAGE_FETCH_FAILED
            ) from None
        return b"".join(chunks), media
