"""The per-request JSON summary line."""
from __future__ import annotations

import json
import logging

from llmserve.gateway.billing.request_log import SUMMARY_FIELDS, format_request_summary, log_request_summary


def test_known_fields_in_fixed_order_then_extras_sorted(caplog):
    logger = logging.getLogger("llmserve.test.requests")
    with caplog.at_level(logging.INFO, logger=logger.name):
        line = log_request_summary(
            logger, zeta=1, completion_tokens=7, tenant="acme", alpha="x", request_id="req-1",
            status=200, finish_reason="stop", queue_time_s=0.0123456789, ttft_s=float("nan"), model="default",
        )
    assert caplog.records[-1].getMessage() == line and "\n" not in line
    parsed = json.loads(line)
    assert list(parsed) == ["event", "request_id", "tenant", "model", "status", "finish_reason",
                            "queue_time_s", "ttft_s", "completion_tokens", "alpha", "zeta"]
    assert parsed["event"] == "request" and parsed["queue_time_s"] == 0.012346 and parsed["ttft_s"] is None


def test_same_fields_in_any_order_give_the_same_line():
    fields = {name: i for i, name in enumerate(SUMMARY_FIELDS)}
    forward = format_request_summary(**fields)
    backward = format_request_summary(**dict(reversed(list(fields.items()))))
    assert forward == backward
    assert list(json.loads(forward))[1:] == list(SUMMARY_FIELDS)
