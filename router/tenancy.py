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
salt is an HMAC-SHA256 (cut to 16 bytes), under a key derived from the
cluster secret, over the length-prefixed tenant and salt: two different
pairs never give the same input, so domains cannot collide, and a salt seen
on the wire (push headers, Ray calls) cannot be tested against guessed API
keys or salt strings without the secret. Routers that share a configured
``cluster_secret`` derive the same salts, so they (and the workers' caches
they share) agree on every domain; a router with a generated secret has
salts of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from typing import Literal

from engine.hashing import length_prefixed
from net.security import ClusterSecurity

from .auth import bearer_token, key_digest

CacheDomain = Literal["shared", "per_api_key"]
MAX_CACHE_SALT_CHARS = 256
SALT_BYTES = 16
_KEY_LABEL = b"tandem-salt-v1"  # the salt key: HMAC(cluster secret, this label)


def salt_key(security: ClusterSecurity) -> bytes:
    """The key domain salts are derived under, from the cluster secret."""
    return hmac.new(security.secret, _KEY_LABEL, hashlib.sha256).digest()


def derive_salt(key: bytes, tenant: bytes, client_salt: str | None) -> bytes:
    """The block-hash salt of the domain (tenant, client_salt) under ``key``
    (``salt_key``); empty for the default domain (no tenant, no salt)."""
    salt = (client_salt or "").encode()
    if not tenant and not salt:
        return b""
    mac = hmac.new(key, length_prefixed(tenant) + length_prefixed(salt), hashlib.sha256)
    return mac.digest()[:SALT_BYTES]


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
class Tenant:
    """A request's tenant and the key its domain's salt is derived under."""

    key: bytes = field(repr=False)
    id: bytes = b""
    """Empty (no tenant), or the digest of the request's API key."""

    def salt(self, client_salt: str | None) -> bytes:
        """The block-hash salt of the domain (this tenant, ``client_salt``)."""
        return derive_salt(self.key, self.id, client_salt)


@dataclass(frozen=True)
class CacheDomains:
    """How the router picks a request's tenant (``security.cache_domain``), and the
    key salts are derived under (random unless built from a ClusterSecurity)."""

    mode: CacheDomain = "shared"
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    @classmethod
    def of(cls, mode: CacheDomain, security: ClusterSecurity) -> CacheDomains:
        """The domains of a router whose cluster secret is ``security``'s."""
        return cls(mode, salt_key(security))

    def tenant(self, authorization: str | None) -> Tenant:
        """The tenant of a request sent with this ``authorization`` header value:
        none when shared, else its key's digest."""
        if self.mode == "shared":
            return Tenant(self.key)
        key = bearer_token(authorization)
        return Tenant(self.key, key_digest(key) if key else b"")
