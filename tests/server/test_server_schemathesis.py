"""The server keeps the promises of its own /openapi.json: schemathesis, with every check
(``--checks all``), against a real ``llmserve serve`` process on a tiny random model.

Schemathesis derives valid and invalid requests from the published schemas (examples, the
coverage phase's boundary values, random fuzzing, stateful sequences) and checks: no 5xx,
every response documented and conforming (JSON bodies, each SSE event of a stream, headers,
content types), invalid data refused, valid data accepted. One check is replaced
(tests/server/schemathesis_hooks.py): valid data may be refused only for the rules across
fields the request schemas describe, with their codes. Bounded (a fixed seed and example
count) so it runs in about a minute on two cores; the drift it found (issue 33) is fixed in
the server or the schema, not excused here.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.gateway_server_helpers import ROOT, tiny_model_server

pytest.importorskip("schemathesis")

EXAMPLES = int(os.environ.get("LLMSERVE_SCHEMATHESIS_EXAMPLES", "15"))   # per operation


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("schemathesis")
    server = tiny_model_server(root, max_model_len=128)   # short generations keep it fast
    yield server, root
    server.stop()


def test_the_server_keeps_the_promises_of_its_openapi_schema(served):
    server, root = served
    exe = shutil.which("schemathesis", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("the schemathesis command is not installed next to this interpreter")
    env = dict(os.environ, SCHEMATHESIS_HOOKS="tests.server.schemathesis_hooks",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NO_COLOR="1")
    cmd = [exe, "run", server.url("/openapi.json"), "--checks", "all",
           "--exclude-checks", "positive_data_acceptance",   # replaced by the hooks' check
           "--max-examples", str(EXAMPLES), "--seed", "7", "--workers", "1", "--no-shrink",
           "--request-timeout", "60", "--max-response-time", "300",   # no timing verdicts
           "--continue-on-failure", "--output-truncate", "false"]
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                            timeout=900)
    out = result.stdout + result.stderr
    (Path(root) / "schemathesis.txt").write_text(out, encoding="utf-8")
    assert result.returncode == 0, out[-12000:]
    assert "Tested: 7" in out and "generated" in out, out[-3000:]
    assert server.proc.poll() is None, "the server died during the run"
