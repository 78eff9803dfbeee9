"""``llmserve release ...``: operate the releases of a running server (admin key).

    llmserve release status   [--url URL]                         the split, releases, health
    llmserve release promote  MODEL [--release ID] [--reason T]   make a release stable
    llmserve release rollback MODEL [--to ID] [--reason T]        canary share -> 0
    llmserve release split    MODEL [--canary ID] [--share X] [--shadow ID] [--shadow-share X]
    llmserve release audit    [--model MODEL] [--limit N]         who changed which split when
    llmserve release check    CANDIDATE --against STABLE --config FILE   the gates (see
                              :mod:`llmserve.gateway.releases.gate`)

The admin key comes from ``--admin-key`` or ``LLMSERVE_ADMIN_KEY``; the server from
``--url`` (default ``http://127.0.0.1:8000``). Answers are printed as JSON; an error
answer prints its message and exits 1 (2 for bad arguments). See docs/RELEASES.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO, Any, Optional

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


def add_release_commands(subparsers: Any) -> None:
    """Register the ``release`` command group on an argparse subparsers object."""
    release = subparsers.add_parser("release", help="versioned releases: promote, roll back, "
                                    "split traffic, audit, check gates")
    sub = release.add_subparsers(dest="release_command", required=True)

    def server_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", default=DEFAULT_URL, help="the running server's base URL")
        p.add_argument("--admin-key", default=None,
                       help="admin key (default: $LLMSERVE_ADMIN_KEY)")
        p.set_defaults(func=run_release_admin)

    status = sub.add_parser("status", help="every public model's split, releases and health")
    server_args(status)
    promote = sub.add_parser("promote", help="make a release (default: the canary) stable")
    server_args(promote)
    promote.add_argument("model")
    promote.add_argument("--release", default=None)
    promote.add_argument("--reason", default=None)
    rollback = sub.add_parser("rollback", help="set the canary's share to 0 (or --to a stable)")
    server_args(rollback)
    rollback.add_argument("model")
    rollback.add_argument("--to", default=None, help="also make this release the stable one")
    rollback.add_argument("--reason", default=None)
    split = sub.add_parser("split", help="set the canary / shadow release and shares")
    server_args(split)
    split.add_argument("model")
    split.add_argument("--canary", default=None)
    split.add_argument("--share", dest="canary_share", type=float, default=None)
    split.add_argument("--shadow", default=None)
    split.add_argument("--shadow-share", type=float, default=None)
    split.add_argument("--reason", default=None)
    audit = sub.add_parser("audit", help="the audit log of split changes")
    server_args(audit)
    audit.add_argument("--model", default=None)
    audit.add_argument("--limit", type=int, default=100)

    check = sub.add_parser("check", help="performance and quality gates of a candidate "
                           "release against the stable one (exit 1 on fail)")
    check.add_argument("candidate", help="the candidate release id")
    check.add_argument("--against", required=True, help="the stable release id")
    check.add_argument("--config", required=True, help="gateway config (releases, gates)")
    check.add_argument("--url", default=DEFAULT_URL, help="the running server serving both")
    check.add_argument("--api-key", default=None, help="a tenant key allowed to use both "
                       "releases' targets (default: $LLMSERVE_API_KEY)")
    check.add_argument("--num-prompts", type=int, default=16)
    check.add_argument("--input-len", type=int, default=64)
    check.add_argument("--output-len", type=int, default=16)
    check.add_argument("--concurrency", type=int, default=4)
    check.add_argument("--tokenizer", default=None, help="tokenizer for the workload "
                       "(default: the default model's)")
    check.add_argument("--eval-model", default=None, help="model files for the offline "
                       "quality gate (llmserve eval; default model when only --eval-config)")
    check.add_argument("--eval-config", default=None, help="the candidate's eval preset "
                       "(e.g. int8); runs the offline quality gate")
    check.add_argument("--eval-reference", default="fp32", help="the stable's eval preset")
    check.add_argument("--eval-tokens", type=int, default=64,
                       help="tokens of the eval text scored offline")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(func=run_release_check)


def _request(args: argparse.Namespace) -> tuple[str, str, Optional[dict[str, Any]]]:
    """(method, path, body) of an admin command."""
    cmd = args.release_command
    if cmd == "status":
        return "GET", "/admin/releases", None
    if cmd == "audit":
        query = f"?limit={args.limit}" + (f"&model={args.model}" if args.model else "")
        return "GET", "/admin/releases/audit" + query, None
    fields = {"promote": ("release", "reason"), "rollback": ("to", "reason"),
              "split": ("canary", "canary_share", "shadow", "shadow_share", "reason")}[cmd]
    body = {k: getattr(args, k) for k in fields if getattr(args, k) is not None}
    return "POST", f"/admin/releases/{args.model}/{cmd}", body


def run_release_admin(args: argparse.Namespace, out: Optional[IO[str]] = None) -> int:
    """Run one admin command against the server; 0 on success, 1 on an error answer."""
    out = out if out is not None else sys.stdout   # read at call time (tests capture it)
    key = args.admin_key or os.environ.get("LLMSERVE_ADMIN_KEY")
    if not key:
        sys.stderr.write("error: give --admin-key or set LLMSERVE_ADMIN_KEY\n")
        return 2
    method, path, body = _request(args)
    try:
        resp = httpx.request(method, args.url.rstrip("/") + path, json=body, timeout=30,
                             headers={"Authorization": f"Bearer {key}"}, trust_env=False)
    except httpx.HTTPError as e:
        sys.stderr.write(f"error: cannot reach {args.url}: {e}\n")
        return 1
    try:
        payload = resp.json()
    except ValueError:
        payload = {"error": {"message": resp.text}}
    if resp.status_code >= 400:
        message = (payload.get("error") or {}).get("message") if isinstance(payload, dict) \
            else None
        sys.stderr.write(f"error: HTTP {resp.status_code}: {message or resp.text}\n")
        return 1
    out.write(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return 0


def run_release_check(args: argparse.Namespace, out: Optional[IO[str]] = None) -> int:
    """``llmserve release check``: see :mod:`llmserve.gateway.releases.gate`."""
    out = out if out is not None else sys.stdout   # read at call time (tests capture it)
    from llmserve.gateway.releases.gate import run_check_command

    return run_check_command(args, out)
