"""Config file parsing, strict validation and key hashing."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from llmserve.gateway.config.gateway_config import GatewayConfig, QueueConfig, generate_api_key, hash_api_key
from llmserve.protocol import PRIORITY_CLASSES

ACME_KEY = "sk-acme-test-key"
ACME_HASH = "sha256:" + hashlib.sha256(ACME_KEY.encode()).hexdigest()

EXAMPLE_YAML = f"""
database: ./llmserve.db
queue: {{max_requests: 64, max_tokens: 65536, timeout_s: 30}}
request_timeout_s: 120
models:
  default: {{fallback: null}}
tenants:
  acme:
    keys: ["{ACME_HASH}"]   # `llmserve keys hash KEY` prints this form
    models: ["*"]
    priority: interactive
    requests_per_minute: 600
    tokens_per_minute: 200000
    allow_fallback: true
"""


def write(tmp_path: Path, text: str, name: str = "gateway.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_yaml(tmp_path: Path, text: str) -> GatewayConfig:
    return GatewayConfig.load(write(tmp_path, text))


def test_hash_api_key_is_prefixed_sha256_hex():
    assert hash_api_key("abc") == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    key = generate_api_key()
    assert key.startswith("sk-") and len(key) > 40 and key != generate_api_key()
    with pytest.raises(ValueError):
        hash_api_key("")


def test_issue_example_loads(tmp_path):
    config = load_yaml(tmp_path, EXAMPLE_YAML)
    assert config.auth_required
    assert config.database == str(tmp_path.resolve() / "llmserve.db")
    assert config.queue == QueueConfig(max_requests=64, max_tokens=65536, timeout_s=30.0)
    assert config.request_timeout_s == 120.0
    assert config.models["default"].fallback is None
    acme = config.tenants["acme"]
    assert acme.key_hashes == (hash_api_key(ACME_KEY),)
    assert acme.models == ("*",)
    assert acme.priority == "interactive" and acme.priority_rank == PRIORITY_CLASSES["interactive"]
    assert (acme.requests_per_minute, acme.tokens_per_minute) == (600, 200000)
    assert acme.allow_fallback is True
    assert acme.max_concurrent is None and acme.max_request_timeout_s is None
    assert acme.allows_model("default") and acme.allows_model("anything")


def test_toml_equivalent_gives_the_same_config(tmp_path):
    toml = f"""
database = "./llmserve.db"
request_timeout_s = 120
[queue]
max_requests = 64
max_tokens = 65536
timeout_s = 30
[models.default]
[tenants.acme]
keys = ["{ACME_HASH}"]
models = ["*"]
priority = "interactive"
requests_per_minute = 600
tokens_per_minute = 200000
allow_fallback = true
"""
    from_toml = GatewayConfig.load(write(tmp_path, toml, "gateway.toml"))
    from_yaml = load_yaml(tmp_path, EXAMPLE_YAML)
    assert from_toml == from_yaml


def test_all_optional_fields_and_fallback_routes(tmp_path):
    other = hash_api_key("other-key")
    config = load_yaml(tmp_path, f"""
database: /var/lib/llmserve/usage.db
idempotency_ttl_s: 600
models:
  big: {{fallback: small}}
  small: {{}}
tenants:
  acme:
    keys: ["{ACME_HASH.upper().replace('SHA256:', 'sha256:')}"]
    models: ["small", "big-*"]
    max_request_timeout_s: 10
    max_concurrent: 4
    shared_prefix: true
    cache_namespace: docs
  beta:
    keys: ["{other}"]
    shared_prefix: true
""")
    assert config.database == "/var/lib/llmserve/usage.db"
    assert config.idempotency_ttl_s == 600.0
    assert config.fallback_for("big") == "small" and config.fallback_for("small") is None
    acme, beta = config.tenants["acme"], config.tenants["beta"]
    assert acme.key_hashes == (ACME_HASH,)  # hex normalised to lower case
    assert acme.allows_model("big-v2") and acme.allows_model("small")
    assert not acme.allows_model("big") and not acme.allows_model("SMALL")
    assert acme.max_concurrent == 4
    assert acme.effective_timeout(120.0) == 10.0
    assert acme.effective_timeout(120.0, requested_s=3.0) == 3.0
    assert acme.effective_timeout(120.0, requested_s=60.0) == 10.0
    assert beta.priority == "default" and beta.allow_fallback is False
    assert acme.cache_salt == "shared:docs" and beta.cache_salt == "shared:public"


def test_tenants_get_distinct_private_cache_salts(tmp_path):
    config = load_yaml(tmp_path, f"""
tenants:
  a: {{keys: ["{hash_api_key('a')}"]}}
  b: {{keys: ["{hash_api_key('b')}"]}}
""")
    assert config.tenants["a"].cache_salt == "tenant:a"
    assert config.tenants["b"].cache_salt == "tenant:b"


def test_open_default_is_single_tenant_without_keys():
    config = GatewayConfig.open_default()
    assert not config.auth_required
    assert list(config.tenants) == ["default"]
    tenant = config.tenants["default"]
    assert tenant.key_hashes == () and tenant.allows_model("whatever")
    assert tenant.requests_per_minute is None and tenant.tokens_per_minute is None


@pytest.mark.parametrize("snippet, where", [
    ("bogus: 1\ntenants: {a: {keys: ['%(h)s']}}", "bogus: unknown key"),
    ("tenants: {acme: {keys: ['%(h)s'], color: red}}", "tenants.acme.color: unknown key"),
    ("tenants: {acme: {keys: ['sha256:abc']}}", "tenants.acme.keys[0]"),
    ("tenants: {acme: {keys: ['%(h)s', 'plain-key']}}", "tenants.acme.keys[1]"),
    ("tenants: {acme: {keys: '%(h)s'}}", "tenants.acme.keys: expected a list"),
    ("tenants: {acme: {keys: []}}", "tenants.acme.keys: required"),
    ("tenants: {acme: {models: ['*']}}", "tenants.acme.keys: required"),
    ("tenants: {acme: {keys: ['%(h)s'], requests_per_minute: '600'}}", "tenants.acme.requests_per_minute"),
    ("tenants: {acme: {keys: ['%(h)s'], tokens_per_minute: true}}", "tenants.acme.tokens_per_minute"),
    ("tenants: {acme: {keys: ['%(h)s'], tokens_per_minute: 0}}", "tenants.acme.tokens_per_minute: must be"),
    ("tenants: {acme: {keys: ['%(h)s'], allow_fallback: 'yes'}}", "tenants.acme.allow_fallback"),
    ("tenants: {acme: {keys: ['%(h)s'], priority: urgent}}", "tenants.acme.priority"),
    ("tenants: {acme: {keys: ['%(h)s'], models: []}}", "tenants.acme.models"),
    ("tenants: {acme: {keys: ['%(h)s'], models: [3]}}", "tenants.acme.models[0]"),
    ("tenants: {acme: {keys: ['%(h)s'], cache_namespace: x}}", "tenants.acme.cache_namespace"),
    ("tenants: {acme: {keys: ['%(h)s'], shared_prefix: true, cache_namespace: acme}}",
     "tenants.acme.cache_namespace"),
    ("tenants: {a: {keys: ['%(h)s']}, b: {keys: ['%(h)s']}}", "tenants.b.keys[0]: the same key"),
    ("tenants: {a: {keys: ['%(h)s', '%(h)s']}}", "tenants.a.keys[1]: duplicate"),
    ("tenants: {'bad name': {keys: ['%(h)s']}}", "tenants.bad name"),
    # a trailing newline once passed (re.match with "$"); names reach headers and labels
    ('tenants: {"acme\\n": {keys: [\'%(h)s\']}}', "tenants.acme\n"),
    ('models: {"m\\nX-Evil: 1": null}\ntenants: {a: {keys: [\'%(h)s\']}}', "is not a valid name"),
    ("models: {m: {fallback: 'a b'}}\ntenants: {a: {keys: ['%(h)s']}}", "models.m.fallback"),
    ("queue: {max_requests: 0}\ntenants: {a: {keys: ['%(h)s']}}", "queue.max_requests"),
    ("queue: {timeout_s: -1}\ntenants: {a: {keys: ['%(h)s']}}", "queue.timeout_s"),
    ("queue: {size: 3}\ntenants: {a: {keys: ['%(h)s']}}", "queue.size: unknown key"),
    ("queue: 5\ntenants: {a: {keys: ['%(h)s']}}", "queue: expected a mapping"),
    ("request_timeout_s: 0\ntenants: {a: {keys: ['%(h)s']}}", "request_timeout_s"),
    ("models: {m: {fallback: m}}\ntenants: {a: {keys: ['%(h)s']}}", "models.m.fallback"),
    ("models: {m: {fallback: n}, n: {fallback: m}}\ntenants: {a: {keys: ['%(h)s']}}", "models.m.fallback"),
    ("models: {m: {fallbak: n}}\ntenants: {a: {keys: ['%(h)s']}}", "models.m.fallbak: unknown key"),
    ("database: ./x.db", "tenants: required"),
    ("database: ':memory:'\ntenants: {a: {keys: ['%(h)s']}}", "database: must be a file path"),
    ("database: 5\ntenants: {a: {keys: ['%(h)s']}}", "database: expected a non-empty string"),
    ("tenants: {}", "tenants: at least one"),
    ("- just\n- a list", "config: expected a mapping"),
])
def test_invalid_configs_name_the_place(tmp_path, snippet, where):
    with pytest.raises(ValueError) as info:
        load_yaml(tmp_path, snippet % {"h": ACME_HASH})
    assert where in str(info.value)


def test_unparseable_files_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="YAML"):
        load_yaml(tmp_path, "tenants: [unclosed")
    with pytest.raises(ValueError, match="TOML"):
        GatewayConfig.load(write(tmp_path, "tenants = [", "g.toml"))
