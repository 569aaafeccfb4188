"""Prefix-cache domains: which requests may share cached KV blocks.

A request's domain is the pair (tenant, the client's ``cache_salt``). The
tenant is empty in a ``shared`` deployment and the SHA-256 digest of the
request's API key under ``security.cache_domain: per_api_key`` (never the
key itself). The router turns the pair into ``GenerateInput.cache_salt``,
which goes into every block hash of the request: requests of different
domains never hit each other's blocks, so ``cached_tokens`` and the time to
first token tell nothing about another domain's prompts.

The default domain (no tenant, no salt) has the empty salt, so a deployment
that uses neither keeps the block hashes it always had. Every other domain's
salt is a BLAKE2b digest over the length-prefixed tenant and salt: two
different pairs never give the same input, so domains cannot collide. The
salt is deterministic, so every router of a deployment (and the workers'
caches they share) agree on it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from .auth import bearer_token

CacheDomain = Literal["shared", "per_api_key"]
MAX_CACHE_SALT_CHARS = 256
_PERSON = b"tandem-salt-v1"  # BLAKE2b personalization: these digests are only salts


def key_tenant(key: str | None) -> bytes:
    """The tenant of an API key: its SHA-256 digest; empty for no key."""
    return hashlib.sha256(key.encode()).digest() if key else b""


def derive_salt(tenant: bytes, client_salt: str | None) -> bytes:
    """The block-hash salt of the domain (tenant, client_salt); empty for the
    default domain (no tenant, no salt)."""
    salt = (client_salt or "").encode()
    if not tenant and not salt:
        return b""
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for part in (tenant, salt):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


def check_client_salt(value: str) -> None:
    """Raises ValueError naming ``cache_salt`` unless it is a non-empty string of
    at most MAX_CACHE_SALT_CHARS characters."""
    if not value:
        raise ValueError("cache_salt must be a non-empty string when given")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt has {len(value)} characters; the limit is {MAX_CACHE_SALT_CHARS}"
        )


@dataclass(frozen=True)
class CacheDomains:
    """How the router picks a request's tenant (``security.cache_domain``)."""

    mode: CacheDomain = "shared"

    def tenant(self, authorization: str | None) -> bytes:
        """The tenant of a request sent with this ``authorization`` header value:
        empty when shared, else its key's digest."""
        if self.mode == "shared":
            return b""
        return key_tenant(bearer_token(authorization))
