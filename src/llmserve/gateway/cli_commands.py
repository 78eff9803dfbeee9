"""The gateway's admin commands, ready to plug into the ``llmserve`` argparse CLI.

    llmserve keys hash [KEY]            print "sha256:<hex>" for the config (KEY from stdin if omitted)
    llmserve keys generate              print a new random key and its hash
    llmserve billing export [--config FILE | --database FILE] [--since T] [--until T] [--tenant NAME]
                            [--release ID] [--by-release]
                                        print usage records (or per-release totals) as CSV

Wiring (in llmserve.cli)::

    subparsers = parser.add_subparsers(dest="command")
    add_admin_commands(subparsers)
    args = parser.parse_args()
    return args.func(args)      # each command sets ``func``; returns an exit status
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import IO, Any, Optional

from llmserve.gateway.billing.ledger import BillingLedger, csv_safe, parse_since
from llmserve.gateway.config.gateway_config import GatewayConfig, generate_api_key, hash_api_key


def add_admin_commands(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the ``keys`` and ``billing`` command groups on an argparse subparsers object."""
    keys = subparsers.add_parser("keys", help="API key helpers for the gateway config")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    hash_cmd = keys_sub.add_parser("hash", help='print the "sha256:<hex>" form of an API key')
    hash_cmd.add_argument("key", nargs="?", help="the key; omit (or '-') to read it from stdin")
    hash_cmd.set_defaults(func=run_keys_hash)
    gen_cmd = keys_sub.add_parser("generate", help="print a new random API key and its hash")
    gen_cmd.set_defaults(func=run_keys_generate)

    billing = subparsers.add_parser("billing", help="billing ledger tools")
    billing_sub = billing.add_subparsers(dest="billing_command", required=True)
    export = billing_sub.add_parser("export", help="print usage records as CSV")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="gateway config file (its `database` is used)")
    source.add_argument("--database", help="the SQLite ledger file")
    export.add_argument("--since", help="ISO-8601 date or datetime (UTC if no offset); finished_at >= since")
    export.add_argument("--until", help="ISO-8601 date or datetime; finished_at < until")
    export.add_argument("--tenant", help="only this tenant's records")
    export.add_argument("--release", help="only the records of this release id")
    export.add_argument("--by-release", action="store_true",
                        help="one summary row per release instead of the records")
    export.set_defaults(func=run_billing_export)


def run_keys_hash(args: argparse.Namespace, out: IO[str] = sys.stdout, stdin: IO[str] = sys.stdin) -> int:
    """``llmserve keys hash [KEY]``: print the key's hash (reads one line from stdin without KEY)."""
    key = args.key if args.key not in (None, "-") else stdin.readline().rstrip("\r\n")
    if not key:
        sys.stderr.write("error: empty API key\n")
        return 2
    out.write(hash_api_key(key) + "\n")
    return 0


def run_keys_generate(args: argparse.Namespace, out: Optional[IO[str]] = None) -> int:
    """``llmserve keys generate``: print ``key: ...`` and ``hash: ...`` lines."""
    out = out if out is not None else sys.stdout   # read at call time (tests capture it)
    key = generate_api_key()
    out.write(f"key:  {key}\nhash: {hash_api_key(key)}\n")
    return 0


def run_billing_export(args: argparse.Namespace, out: Optional[IO[str]] = None) -> int:
    """``llmserve billing export``: CSV of the ledger's records; exit status 2 on bad input."""
    out = out if out is not None else sys.stdout   # read at call time (tests capture it)
    database: Optional[str] = args.database
    try:
        if args.config:
            database = GatewayConfig.load(args.config).database
            if database is None:
                raise ValueError(f"{args.config}: no `database` configured")
        if database is None or not Path(database).is_file():
            raise ValueError(f"{database}: no such ledger database")
        since, until = parse_since(args.since), parse_since(args.until)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    ledger = BillingLedger(database)
    try:
        if getattr(args, "by_release", False):
            export_release_summary(ledger, out, since=since, until=until, tenant=args.tenant,
                                   release=getattr(args, "release", None))
        else:
            ledger.export_csv(out, since=since, until=until, tenant=args.tenant,
                              release=getattr(args, "release", None))
    finally:
        ledger.close()
    return 0


#: Columns of ``billing export --by-release``.
RELEASE_SUMMARY_COLUMNS = ("release_id", "release_fingerprint", "requests", "prompt_tokens",
                           "cached_tokens", "completion_tokens", "total_tokens")


def export_release_summary(ledger: BillingLedger, out: IO[str], **filters: Any) -> int:
    """One CSV row per (release id, fingerprint) of the matching records (an empty
    release id: requests that named a served model directly); returns the row count."""
    totals: dict[tuple[str, str], list[int]] = {}
    for rec in ledger.records(**filters):
        row = totals.setdefault((rec.release_id or "", rec.release_fingerprint or ""),
                                [0, 0, 0, 0])
        row[0] += 1
        row[1] += rec.prompt_tokens
        row[2] += rec.cached_tokens
        row[3] += rec.completion_tokens
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(RELEASE_SUMMARY_COLUMNS)
    for (rid, fp), (n, prompt, cached, completion) in sorted(totals.items()):
        writer.writerow([csv_safe(rid), fp, n, prompt, cached, completion, prompt + completion])
    return len(totals)
