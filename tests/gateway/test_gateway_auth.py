"""Authentication (401), model authorization (403) and the error objects' wire form."""
from __future__ import annotations

import pytest

from llmserve.gateway.auth import Authenticator
from llmserve.gateway.config.gateway_config import GatewayConfig, hash_api_key
from llmserve.gateway.errors import (
    AuthenticationError,
    ContextLengthExceeded,
    GatewayError,
    IdempotencyConflict,
    IdempotencyMismatch,
    OverloadedError,
    PermissionDeniedError,
    RateLimitError,
    retry_after_seconds,
)


@pytest.fixture
def config() -> GatewayConfig:
    return GatewayConfig.from_dict({
        "models": {"big": {"fallback": "small"}, "tiny": {"fallback": "big"}},
        "tenants": {
            "acme": {"keys": [hash_api_key("acme-1"), hash_api_key("acme-2")],
                     "models": ["big", "small"], "allow_fallback": True},
            "beta": {"keys": [hash_api_key("beta-1")], "models": ["big", "tiny"], "allow_fallback": True},
            "gamma": {"keys": [hash_api_key("gamma-1")], "models": ["*"]},
        },
    })


def test_each_key_maps_to_its_tenant(config):
    auth = Authenticator(config)
    assert auth.authenticate("Bearer acme-1").name == "acme"
    assert auth.authenticate("Bearer acme-2").name == "acme"
    assert auth.authenticate("bearer   beta-1  ").name == "beta"


@pytest.mark.parametrize("header, code", [
    (None, "missing_api_key"),
    ("", "missing_api_key"),
    ("Bearer wrong", "invalid_api_key"),
    ("Bearer " + hash_api_key("acme-1"), "invalid_api_key"),  # the hash itself is not a key
    ("Basic YWNtZTox", "invalid_authorization_header"),
    ("Bearer", "invalid_authorization_header"),
    ("acme-1", "invalid_authorization_header"),
])
def test_bad_credentials_are_401(config, header, code):
    with pytest.raises(AuthenticationError) as info:
        Authenticator(config).authenticate(header)
    err = info.value
    assert err.status == 401 and err.code == code
    assert err.headers()["WWW-Authenticate"] == "Bearer"
    assert "Retry-After" not in err.headers()
    assert err.to_openai_dict()["error"]["type"] == "authentication_error"


def test_model_not_allowed_is_403(config):
    auth = Authenticator(config)
    acme = auth.authenticate("Bearer acme-1")
    auth.check_model(acme, "big")
    with pytest.raises(PermissionDeniedError) as info:
        auth.check_model(acme, "tiny")
    assert info.value.status == 403
    assert info.value.to_openai_dict() == {"error": {
        "message": "Tenant 'acme' is not allowed to use model 'tiny'",
        "type": "permission_error", "param": "model", "code": "model_not_allowed"}}


def test_fallback_needs_tenant_opt_in_and_permission_for_the_fallback(config):
    auth = Authenticator(config)
    acme, beta, gamma = (config.tenants[n] for n in ("acme", "beta", "gamma"))
    assert auth.may_use_fallback(acme, "big") == "small"
    assert auth.may_use_fallback(beta, "big") is None       # may not use "small"
    assert auth.may_use_fallback(beta, "tiny") == "big"
    assert auth.may_use_fallback(gamma, "big") is None      # allow_fallback is false
    assert auth.may_use_fallback(acme, "small") is None     # no route


def test_open_mode_accepts_any_or_no_header():
    auth = Authenticator(GatewayConfig.open_default())
    assert auth.authenticate(None).name == "default"
    assert auth.authenticate("Bearer whatever").name == "default"
    auth.check_model(auth.authenticate(None), "any-model")


@pytest.mark.parametrize("seconds, header", [(0.0, "1"), (0.2, "1"), (1.0, "1"), (1.01, "2"), (29.5, "30")])
def test_retry_after_is_whole_seconds_rounded_up_at_least_one(seconds, header):
    assert retry_after_seconds(seconds) == int(header)
    assert RateLimitError("slow down", seconds).headers() == {"Retry-After": header}
    assert OverloadedError("busy", seconds).headers()["Retry-After"] == header


def test_error_statuses_and_codes():
    cases = [
        (RateLimitError("x", 3), 429, "rate_limit_exceeded"),
        (OverloadedError("x", 3), 503, "server_overloaded"),
        (IdempotencyConflict(), 409, "idempotency_key_in_use"),
        (IdempotencyMismatch(), 422, "idempotency_key_reused"),
        (ContextLengthExceeded("too long"), 400, "context_length_exceeded"),
    ]
    for err, status, code in cases:
        assert isinstance(err, GatewayError)
        assert (err.status, err.code) == (status, code)
        body = err.to_openai_dict()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["code"] == code
    plain = GatewayError(418, "teapot", "teapot_error", headers={"X-Extra": "1"})
    assert plain.headers() == {"X-Extra": "1"} and plain.to_openai_dict()["error"]["code"] is None
