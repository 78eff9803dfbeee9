"""API-key authentication and per-tenant model authorization.

The config stores only ``sha256:<hex>`` hashes of keys. A presented key is hashed and
compared with every stored hash using ``hmac.compare_digest``, without stopping at the
first match, so the time taken does not depend on which (or whether a) key matched.

Stateless after construction: safe to share between threads and coroutines.
"""
from __future__ import annotations

import hmac
import logging
from typing import Optional, Sequence, TypeVar

from llmserve.gateway.config.gateway_config import GatewayConfig, TenantConfig, hash_api_key
from llmserve.gateway.errors import AuthenticationError, PermissionDeniedError

logger = logging.getLogger(__name__)


def parse_bearer(authorization_header: Optional[str]) -> Optional[str]:
    """The key from an ``Authorization: Bearer KEY`` header, or None when there is none.

    Raises AuthenticationError when the header is present but not of the Bearer form.
    """
    if authorization_header is None or not authorization_header.strip():
        return None
    scheme, _, credentials = authorization_header.strip().partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        raise AuthenticationError(
            "Malformed Authorization header; expected 'Authorization: Bearer <API key>'",
            code="invalid_authorization_header",
        )
    return credentials.strip()


class Authenticator:
    """Maps an Authorization header to the tenant that owns the key.

    In open mode (``config.auth_required`` is False) every request, with or without a
    header, belongs to the single open tenant.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._entries: list[tuple[bytes, TenantConfig]] = [
            (key_hash.encode("ascii"), tenant)
            for tenant in config.tenants.values()
            for key_hash in tenant.key_hashes
        ]
        self._open_tenant: Optional[TenantConfig] = None
        if not config.auth_required:
            self._open_tenant = next(iter(config.tenants.values()))

    def authenticate(self, authorization_header: Optional[str]) -> TenantConfig:
        """The tenant for this header.

        Raises:
            AuthenticationError (401): no header, not a Bearer header, or an unknown key.
        """
        if self._open_tenant is not None:
            return self._open_tenant
        key = parse_bearer(authorization_header)
        if key is None:
            raise AuthenticationError(
                "Missing API key; send 'Authorization: Bearer <API key>'", code="missing_api_key"
            )
        found = match_key_hash(key, self._entries)
        if found is None:
            logger.info("rejected an unknown API key")
            raise AuthenticationError("Incorrect API key provided", code="invalid_api_key")
        return found

    @staticmethod
    def check_model(tenant: TenantConfig, model: str) -> None:
        """Raise PermissionDeniedError (403) unless ``tenant`` may use ``model``."""
        if not tenant.allows_model(model):
            raise PermissionDeniedError(f"Tenant {tenant.name!r} is not allowed to use model {model!r}")

    def may_use_fallback(self, tenant: TenantConfig, model: str) -> Optional[str]:
        """The fallback model ``tenant`` may be served by when ``model`` is overloaded, or None.

        Requires ``allow_fallback`` on the tenant, a fallback route for the model, and
        that the tenant is allowed to use the fallback model too.
        """
        if not tenant.allow_fallback:
            return None
        fallback = self._config.fallback_for(model)
        if fallback is None or not tenant.allows_model(fallback):
            return None
        return fallback


T = TypeVar("T")


def match_key_hash(key: str, entries: Sequence[tuple[bytes, T]]) -> Optional[T]:
    """The value stored with ``key``'s hash among ``(hash bytes, value)`` entries, or None;
    every entry is compared (no early exit), so the time does not depend on the match."""
    presented = hash_api_key(key).encode("ascii")
    found = None
    for stored, value in entries:
        if hmac.compare_digest(stored, presented):
            found = value
    return found
