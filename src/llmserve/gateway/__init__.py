"""The multi-tenant gateway's building blocks (no torch, no engine, no HTTP framework).

config (tenants, keys, limits), auth (API keys -> tenant), errors (HTTP errors with
OpenAI bodies), ratelimit (per-tenant token buckets), admission (400/503 before the
engine), kv_admission (503 under KV-cache pressure), idempotency (Idempotency-Key
store), ledger (billing records), request_log (one JSON line per request). See
docs/GATEWAY.md.
"""
from llmserve.gateway.admission import AdmissionController, QueueTicket, kv_tokens_needed, parse_request_timeout
from llmserve.gateway.auth import Authenticator
from llmserve.gateway.config import (
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
from llmserve.gateway.idempotency import BeginOutcome, BeginResult, IdempotencyStore, StoredResponse, hash_request_body
from llmserve.gateway.kv_admission import KVAdmission
from llmserve.gateway.ledger import BillingLedger, UsageRecord, parse_since
from llmserve.gateway.ratelimit import Reservation, TenantRateLimiter
from llmserve.gateway.request_log import log_request_summary

__all__ = [
    "AdmissionController", "QueueTicket", "kv_tokens_needed", "parse_request_timeout", "Authenticator", "GatewayConfig",
    "ModelRoute", "QueueConfig", "TenantConfig", "generate_api_key", "hash_api_key",
    "AuthenticationError", "ContextLengthExceeded", "GatewayError", "IdempotencyConflict",
    "IdempotencyMismatch", "InvalidRequest", "KVCachePressureError", "KVAdmission", "OverloadedError", "PermissionDeniedError",
    "QueueTimeoutError", "RateLimitError", "BeginOutcome", "BeginResult", "IdempotencyStore",
    "StoredResponse", "hash_request_body", "BillingLedger", "UsageRecord", "parse_since",
    "Reservation", "TenantRateLimiter", "log_request_summary",
]
