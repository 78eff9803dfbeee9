"""The gateway's admin commands (keys hash / generate, billing export) through argparse."""
from __future__ import annotations

import argparse
import csv
import io

from llmserve.gateway.billing.ledger import BillingLedger, UsageRecord, parse_since
from llmserve.gateway.cli_commands import add_admin_commands
from llmserve.gateway.config.gateway_config import GatewayConfig, hash_api_key


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmserve")
    add_admin_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_keys_hash_from_argument_and_stdin():
    args = parse("keys", "hash", "sk-123")
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    assert out.getvalue() == hash_api_key("sk-123") + "\n"
    args = parse("keys", "hash")
    out = io.StringIO()
    assert args.func(args, out=out, stdin=io.StringIO("sk-123\n")) == 0
    assert out.getvalue() == hash_api_key("sk-123") + "\n"


def test_keys_generate_prints_a_key_that_matches_its_hash():
    args = parse("keys", "generate")
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    lines = dict(line.split(":", 1) for line in out.getvalue().splitlines())
    assert hash_api_key(lines["key"].strip()) == lines["hash"].strip()


def test_billing_export_via_config(tmp_path, capsys):
    config_path = tmp_path / "gateway.yaml"
    config_path.write_text(f"database: usage.db\ntenants: {{a: {{keys: ['{hash_api_key('k')}']}}}}\n")
    db = GatewayConfig.load(config_path).database
    ledger = BillingLedger(db)
    for i, day in enumerate(["2024-04-30", "2024-05-01", "2024-05-02"]):
        t = parse_since(day) + 5
        ledger.record(UsageRecord(tenant="a", request_id=f"r{i}", model="m", fingerprint="f",
                                  prompt_tokens=3, cached_tokens=0, completion_tokens=i,
                                  finish_reason="stop", status=200, created_at=t - 1, finished_at=t))
    ledger.close()
    args = parse("billing", "export", "--config", str(config_path), "--since", "2024-05-01")
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    assert [r["request_id"] for r in csv.DictReader(io.StringIO(out.getvalue()))] == ["r1", "r2"]
    args = parse("billing", "export", "--database", db, "--since", "2024-05-01", "--until", "2024-05-02")
    out = io.StringIO()
    args.func(args, out=out)
    assert [r["request_id"] for r in csv.DictReader(io.StringIO(out.getvalue()))] == ["r1"]
    bad = parse("billing", "export", "--database", db, "--since", "last week")
    assert bad.func(bad, out=io.StringIO()) == 2
    missing = parse("billing", "export", "--database", str(tmp_path / "nope.db"))
    assert missing.func(missing, out=io.StringIO()) == 2
    assert "no such ledger" in capsys.readouterr().err
