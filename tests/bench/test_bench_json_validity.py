"""The json-validity workload: scoring, its requests, and bench compare against real servers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from llmserve.bench.cli import main
from llmserve.bench.json_validity import (
    VALIDITY_SCHEMAS,
    VERDICTS,
    answers,
    has_structural_whitespace,
    json_validity_workload,
    score_answer,
    validity_summary,
)
from llmserve.bench.metrics import RequestRecord
from llmserve.bench.runner import BenchOptions

pytest.importorskip("jsonschema")

FAKE_SERVER = str(Path(__file__).with_name("bench_fake_server.py"))
SCHEMAS = {name: schema for name, _, schema in VALIDITY_SCHEMAS}
PERSON = SCHEMAS["person"]
GOOD_PERSON = {"name": "Ada", "age": 36, "role": "engineer",
               "address": {"city": "London", "country": "UK"}, "hobbies": ["chess"]}


@pytest.mark.parametrize("text, finish, verdict", [
    (json.dumps(GOOD_PERSON), "stop", "valid"),
    (json.dumps(GOOD_PERSON, indent=2), "length", "valid"),   # complete, then hit the limit
    ('{"name": "Ada", "age": 3', "stop", "invalid_json"),
    ('{"name": "Ada", "age": 3', "length", "cut"),
    ("", None, "invalid_json"),
    (json.dumps({**GOOD_PERSON, "age": 121}), "stop", "schema_violation"),
    (json.dumps({**GOOD_PERSON, "role": "pilot"}), "stop", "schema_violation"),
    (json.dumps({**GOOD_PERSON, "hobbies": []}), "stop", "schema_violation"),
    (json.dumps({**GOOD_PERSON, "pet": "cat"}), "stop", "schema_violation"),
    (json.dumps({**GOOD_PERSON, "age": 121}), "length", "cut"),
    ('{"name": "Ada", "age": NaN}', "stop", "invalid_json"),    # not JSON, though Python reads it
])
def test_score_answer(text, finish, verdict):
    assert score_answer(text, finish, PERSON) == verdict


def test_every_schema_accepts_an_instance_and_refuses_a_broken_one():
    instances = {
        "person": GOOD_PERSON,
        "order": {"customer": "Bo", "items": [{"product": "tea", "quantity": 2, "price": 3.5}]},
        "review": {"product": "lamp", "rating": 4, "sentiment": "positive", "confidence": 0.9,
                   "recommend": True},
        "book": {"title": "Dune", "authors": ["Frank Herbert"]},
    }
    broken = {"person": {"name": "Ada"}, "order": {"customer": "Bo", "items": []},
              "review": {**instances["review"], "confidence": 1.5},
              "book": {"title": "Dune", "authors": ["F"], "genre": "cooking"}}
    assert set(instances) == set(SCHEMAS)
    for name, schema in SCHEMAS.items():
        assert score_answer(json.dumps(instances[name]), "stop", schema) == "valid"
        assert score_answer(json.dumps(broken[name]), "stop", schema) == "schema_violation"


def test_structural_whitespace_ignores_strings():
    assert has_structural_whitespace('{"a": 1}') and has_structural_whitespace('{\n"a":1}')
    assert not has_structural_whitespace('  {"a":"x y","b":["p q"]}\n')
    assert not has_structural_whitespace('{"a":"say \\" hi"}')
    assert has_structural_whitespace('{"a":"\\\\", "b":1}')


def test_workload_same_seeds_for_every_schema(bpe_tokenizer):
    specs = json_validity_workload(bpe_tokenizer, 3, 50, seed=7)
    assert len(specs) == 3 * len(VALIDITY_SCHEMAS)
    assert [s.meta["schema"] for s in specs[:len(SCHEMAS)]] == list(SCHEMAS)
    for s in specs:
        assert s.extra["seed"] == s.meta["seed"] and s.output_len == 50
        fmt = s.extra["response_format"]
        assert fmt["type"] == "json_schema"
        assert fmt["json_schema"]["schema"] == SCHEMAS[s.meta["schema"]]
        assert s.messages == [{"role": "user", "content": s.prompt}] and s.input_len > 0
    assert sorted({s.meta["seed"] for s in specs if s.meta["schema"] == "book"}) == [7, 8, 9]
    assert specs == json_validity_workload(bpe_tokenizer, 3, 50, seed=7)


def test_options_refuse_completions_or_ignore_eos():
    with pytest.raises(ValueError, match="chat endpoint"):
        BenchOptions("http://x", workload="json-validity", ignore_eos=False)
    with pytest.raises(ValueError, match="without ignore_eos"):
        BenchOptions("http://x", workload="json-validity", endpoint="chat")


def _record(rid: str, text: str = "", finish: str | None = "stop", error: str | None = None,
            tokens: int = 10) -> RequestRecord:
    """A finished request's record, its answer streamed in two pieces."""
    return RequestRecord(rid, 5, reply_text=[text[:3], text[3:]], finish_reason=finish,
                         success=error is None, error=error, end_time=0.5,
                         usage_completion_tokens=tokens, arrival_times=[0.1, 0.4])


def test_summary_counts_verdicts_errors_and_cuts(bpe_tokenizer):
    specs = [s for s in json_validity_workload(bpe_tokenizer, 2, 20)
             if s.meta["schema"] in ("person", "review")]
    good = json.dumps(GOOD_PERSON, indent=1)
    records = [_record("p0", good, tokens=30),
               _record("r0", '{"product": "x", "rating": 9', "length", tokens=20),
               _record("p1", "", None, error="400"),
               _record("r1", '{"product": "x"}', "stop", tokens=6)]
    scored = answers(specs, records)
    assert [a["verdict"] for a in scored] == ["valid", "cut", "error", "schema_violation"]
    assert scored[0]["text"] == good and scored[0]["with_whitespace"]
    summary = validity_summary(scored)
    assert list(summary["schemas"]) == ["person", "review"]
    person, review, overall = (summary["schemas"]["person"], summary["schemas"]["review"],
                               summary["overall"])
    assert (person["total"], person["valid"], person["valid_share"]) == (2, 1, 0.5)
    assert person["errors"] == {"400": 1} and person["mean_output_tokens"] == 30
    assert review["verdicts"] == {"valid": 0, "invalid_json": 0, "schema_violation": 1,
                                  "cut": 1, "error": 0}
    assert review["cut_at_max_tokens"] == 1 and review["finish_reasons"] == {"length": 1,
                                                                             "stop": 1}
    assert overall["total"] == 4 and overall["valid"] == 1 and overall["e2e_ms_p50"] == 500
    assert sum(overall["verdicts"].values()) == 4 and set(overall["verdicts"]) == set(VERDICTS)


def test_bench_serve_counts_server_errors(tmp_path, fake_server, bpe_tokenizer_path):
    """A server that refuses some requests (503) or answers non-JSON: counted, no crash."""
    out = tmp_path / "serve"
    with fake_server(fail_requests=frozenset({1, 2})) as srv:
        rc = main(["bench", "serve", "--base-url", srv.url, "--workload", "json-validity",
                   "--num-prompts", "2", "--output-len", "6", "--max-concurrency", "1",
                   "--seed", "4", "--tokenizer", bpe_tokenizer_path, "--output-dir", str(out),
                   "--no-progress", "--no-plots"])
        bodies = srv.server.config.app.state.bench["bodies"]
    assert rc == 0
    assert len(bodies) == 8 and all("messages" in b for b in bodies)        # chat endpoint
    assert all(b["temperature"] == 1.0 and "ignore_eos" not in b and "min_tokens" not in b
               for b in bodies)
    assert [b["seed"] for b in bodies] == [4] * 4 + [5] * 4
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    overall = run["metrics"]["validity"]["overall"]
    assert overall["errors"] == {"503": 2} and overall["verdicts"]["cut"] == 6
    assert overall["valid"] == 0 and overall["cut_at_max_tokens"] == 6
    assert [a["verdict"] for a in run["answers"][:3]] == ["error", "error", "cut"]
    assert "### JSON validity" in (out / "report.md").read_text()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tests.model.tiny_checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("jv") / "tiny"), arch="llama",
                                seed=3)


def test_compare_real_llmserve_and_a_fake_peer(tmp_path, tiny_model, capsys):
    """llmserve (a real process on a tiny random model) against a peer whose answers are
    not JSON: the grammar keeps every llmserve answer valid or cut, never invalid."""
    out = tmp_path / "cmp"
    rc = main(["bench", "compare", "--servers", "llmserve", "--model", tiny_model,
               "--extra-server", f"plain={sys.executable} {FAKE_SERVER} --port {{port}}",
               "--workload", "json-validity", "--num-prompts", "2", "--output-len", "24",
               "--ready-timeout", "120", "--output-dir", str(out), "--no-progress",
               "--no-plots"])
    assert rc == 0
    doc = json.loads((out / "compare.json").read_text())
    assert doc["workload"]["name"] == "json-validity" and doc["baseline"] == "llmserve"
    assert doc["settings"]["temperature"] == 1.0 and doc["settings"]["ignore_eos"] is False
    ours, plain = (s["runs"][0]["metrics"]["validity"] for s in doc["servers"])
    assert list(ours["schemas"]) == list(SCHEMAS)
    for summary in (ours, plain):
        assert summary["overall"]["total"] == 2 * len(SCHEMAS)
        assert all(g["total"] == 2 for g in summary["schemas"].values())
    verdicts = ours["overall"]["verdicts"]
    assert verdicts["valid"] + verdicts["cut"] == 2 * len(SCHEMAS), verdicts
    assert ours["overall"]["cut_at_max_tokens"] == ours["overall"]["finish_reasons"].get(
        "length", 0) >= verdicts["cut"]
    assert 0 < ours["overall"]["mean_output_tokens"] <= 24
    assert plain["overall"]["verdicts"]["cut"] == 2 * len(SCHEMAS)   # "tok tok ..." to the end
    ratios = doc["ratios"]["plain"][0]["validity"]
    assert set(ratios) == set(SCHEMAS) | {"overall"}
    assert ratios["overall"] == (0 if ours["overall"]["valid"] else None)
    md = (out / "compare.md").read_text()
    assert "### JSON validity" in md and "| Schema | llmserve valid | plain valid |" in md
    assert f"plain: ok, valid JSON 0/{2 * len(SCHEMAS)}" in capsys.readouterr().out
