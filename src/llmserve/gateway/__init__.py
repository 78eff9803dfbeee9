"""The multi-tenant gateway's building blocks (no torch, no engine, no HTTP framework).

Subpackages:

    config/      the gateway config file: tenants, key hashes, limits, queue, routes, caches
    admission/   admission before the engine: queue and timeouts, rate limits, KV pressure
    billing/     idempotency store, usage records, billing ledger, per-request log line
    caches/      prompt bundles (pinned KV) and the response cache, with their metrics
    releases/    versioned releases per public model: split, canary health, shadow, gates

Modules:

    hook              TenantGateway: the gateway in the server's request path
    auth              API keys -> tenant, and which models a tenant may use
    admin             extra endpoints: prompt bundles and cache operations
    build             build_gateway: a TenantGateway from a config file
    errors            GatewayError and its subclasses, answered as OpenAI-style HTTP errors
    routing           which served model takes an admitted request, and what it reserves
    cli_commands      the ``llmserve keys`` and ``llmserve billing export`` commands
    process_identity  who owns an idempotency lease, across process restarts
    sqlite_db         the SQLite helper shared by the ledger and the idempotency store

See docs/GATEWAY.md.
"""
from llmserve.gateway.admission.controller import (
    AdmissionController,
    QueueTicket,
    kv_tokens_needed,
    parse_request_timeout,
)
from llmserve.gateway.admission.kv import KVAdmission
from llmserve.gateway.admission.ratelimit import Reservation, TenantRateLimiter
from llmserve.gateway.auth import Authenticator
from llmserve.gateway.billing.idempotency import (
    BeginOutcome,
    BeginResult,
    IdempotencyStore,
    hash_request_body,
)
from llmserve.gateway.billing.ledger import BillingLedger, UsageRecord, parse_since
from llmserve.gateway.billing.request_log import log_request_summary
from llmserve.gateway.config.gateway_config import (
    GatewayConfig,
    ModelRoute,
    QueueConfig,
    TenantConfig,
    generate_api_key,
    hash_api_key,
)
from llmserve.gateway.errors import (
    AuthenticationError,
    ContextLengthExceeded,
    GatewayError,
    IdempotencyConflict,
    IdempotencyMismatch,
    InvalidRequest,
    KVCachePressureError,
    OverloadedError,
    PermissionDeniedError,
    QueueTimeoutError,
    RateLimitError,
)

__all__ = [
    "AdmissionController", "QueueTicket", "kv_tokens_needed", "parse_request_timeout", "Authenticator", "GatewayConfig",
    "ModelRoute", "QueueConfig", "TenantConfig", "generate_api_key", "hash_api_key",
    "AuthenticationError", "ContextLengthExceeded", "GatewayError", "IdempotencyConflict",
    "IdempotencyMismatch", "InvalidRequest", "KVCachePressureError", "KVAdmission", "OverloadedError", "PermissionDeniedError",
    "QueueTimeoutError", "RateLimitError", "BeginOutcome", "BeginResult", "IdempotencyStore",
    "hash_request_body", "BillingLedger", "UsageRecord", "parse_since",
    "Reservation", "TenantRateLimiter", "log_request_summary",
]
