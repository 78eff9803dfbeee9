"""Compiled graphs saved on disk (executor/graph_store.py) and what start-up promises.

A restart loads the decode and many-row graphs instead of tracing them, and gives the same
tokens; a file that cannot be loaded is compiled again; no request after start-up
compiles anything (the first long prefill used to trace its graphs again).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from llmserve import LLM, SamplingParams
from llmserve.model.executor.graph_store import GraphStore, model_signature, source_digest
from tests.model.tiny_checkpoints import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [list(range(300, 390)), [5, 6, 7, 8], [40, 41, 42]]   # one prefill of >= 64 rows

_RUN = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from llmserve import LLM, SamplingParams
    llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=64, max_num_seqs=4,
              enforce_eager=False)
    outs = llm.generate(json.loads(sys.argv[2]),
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    step = llm.engine.runner.compiled
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                      "saved": sorted(step._compiled.saved), "failed": step.failed}))
""")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("saved")), arch="llama",
                                num_heads=4, num_kv_heads=2, seed=5)


def _start(path: str, cache: str) -> tuple[dict, str]:
    env = dict(os.environ, LLMSERVE_COMPILE_CACHE=cache, TORCHINDUCTOR_CACHE_DIR=cache)
    proc = subprocess.run([sys.executable, "-c", _RUN, path, json.dumps(PROMPTS)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_a_restart_loads_the_saved_graphs_and_gives_the_same_tokens(tiny_path, tmp_path):
    """Two processes on one empty cache: the first compiles and saves the decode graphs
    (batch 1 and a dynamic batch) and the many-row functions, the second loads every one
    of them (no "compiled" line) and generates the same tokens."""
    cache = str(tmp_path / "cache")
    first, log1 = _start(tiny_path, cache)
    second, log2 = _start(tiny_path, cache)
    assert first["saved"] == second["saved"] == ["many", "one"]
    assert not first["failed"] and not second["failed"]
    assert "decode step: batch 1 compiled" in log1
    assert "decode step: batch 1 loaded" in log2 and "batches 2-4 loaded" in log2
    assert "compiled in" not in log2 and "compiling" not in log2
    files = os.listdir(os.path.join(cache, "llmserve-graphs"))
    assert {f.split("-")[0] for f in files} == {"decode", "rows"}
    assert second["tokens"] == first["tokens"]
    eager = LLM(tiny_path, dtype="float32", num_kv_blocks=64, max_num_seqs=4,
                enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY)] == first["tokens"]


def test_an_unreadable_saved_graph_is_compiled_again(tiny_path, tmp_path, monkeypatch,
                                                     caplog):
    """A truncated file (a crash while writing, a disk error) is a miss: a warning, a new
    compile, a rewritten file, and the right tokens."""
    monkeypatch.setenv("LLMSERVE_COMPILE_CACHE", str(tmp_path))
    kw = dict(dtype="float32", num_kv_blocks=64, max_num_seqs=4, enforce_eager=False)
    ref = [o.outputs[0].token_ids for o in LLM(tiny_path, **kw).generate(PROMPTS, GREEDY)]
    graphs = tmp_path / "llmserve-graphs"
    victims = sorted(graphs.glob("decode-*"))
    assert len(victims) == 2
    for path in victims:
        path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        llm = LLM(tiny_path, **kw)
    assert caplog.text.count("could not be loaded") == 2
    assert sorted(llm.engine.runner.compiled._compiled.saved) == ["many", "one"]
    assert all(p.stat().st_size > 1000 for p in victims)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref


@pytest.mark.parametrize("saved", ["1", "0"])
def test_no_request_compiles_anything_after_start_up(tiny_path, tmp_path, monkeypatch,
                                                     saved, caplog):
    """Every graph a request can need exists when the engine is ready: a prefill of 90
    rows (the many-row functions), decode batches of 1 to 4 and growing contexts add no
    graph and drop none (no warning), with saved graphs and with in-process ones."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("LLMSERVE_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("LLMSERVE_SAVED_GRAPHS", saved)
    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=64, max_num_seqs=4,
              enforce_eager=False)
    graphs = counters["stats"]["unique_graphs"]
    frames = counters["frames"]["total"]
    with caplog.at_level(logging.WARNING):
        llm.generate(PROMPTS + [list(range(500, 570))], GREEDY)
        llm.generate([[9, 10]], GREEDY)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert counters["stats"]["unique_graphs"] == graphs
    assert counters["frames"]["total"] == frames


def test_a_graph_file_is_named_by_what_the_graph_bakes_in(tiny_path, tmp_path):
    """The name changes with the model's structure and constants (not with its weight
    values), with the step's input shapes and with llmserve's source."""
    a = LLM(tiny_path, dtype="float32", num_kv_blocks=16, max_num_seqs=2, enforce_eager=True)
    model = a.engine.runner.model
    args = (torch.zeros(3, dtype=torch.long),)
    store = GraphStore(tmp_path, "decode", [model_signature(model)])
    name = store.path("many", args)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert GraphStore(tmp_path, "decode", [model_signature(model)]).path("many", args) == name
    assert store.path("many", (torch.zeros(4, dtype=torch.long),)) != name
    norm = model.norm
    norm.eps *= 2
    assert GraphStore(tmp_path, "decode", [model_signature(model)]).path("many", args) != name
    assert len(source_digest()) == 64


def test_a_graph_file_name_does_not_change_once_the_model_has_been_traced():
    """A module that holds an operator (the none tier's RMSNorm holds ``torch_rms_norm``)
    is named by the operator, not by its attributes: tracing fills the operator's dispatch
    cache, and the name once changed with it, so a later engine in the same process missed
    the graphs an earlier one had saved and compiled them again."""
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.op = torch.ops.aten.mul.Tensor
            self.fn = torch.nn.functional.silu

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fn(self.op(x, x))

    holder = Holder()
    before = model_signature(holder)
    assert "op=aten.mul.Tensor" in before and "fn=torch.nn.functional.silu" in before
    torch.compile(lambda x: holder(x), backend="aot_eager", fullgraph=True)(torch.randn(5))
    assert model_signature(holder) == before
    holder.op = torch.ops.aten.add.Tensor
    assert model_signature(holder) != before


def test_a_first_start_serves_eagerly_while_a_child_compiles(tiny_path, tmp_path,
                                                             monkeypatch):
    """``compile_in_background`` on an empty cache: the engine is ready at once with its
    compiled steps off, a child process compiles and saves every graph, and once it exits
    the idle engine loads them (a serving loop calls ``on_idle`` while no request runs; the
    next step would otherwise); tokens are the same before, during and after the switch
    (and the same as an engine that waited for its graphs)."""
    monkeypatch.setenv("LLMSERVE_COMPILE_CACHE", str(tmp_path))
    kw = dict(dtype="float32", num_kv_blocks=64, max_num_seqs=4, enforce_eager=False)
    llm = LLM(tiny_path, compile_in_background=True, **kw)
    runner = llm.engine.runner
    child = runner.pending_graphs
    assert child is not None and not runner.graphs_ready
    during = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    child.proc.join(timeout=300)
    assert child.proc.exitcode == 0
    if runner.pending_graphs is child:   # (unless the last step above found it done)
        assert not runner.graphs_ready
        llm.engine.on_idle()   # no step: the idle engine loads them
    assert runner.pending_graphs is None and runner.graphs_ready
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert sorted(runner.compiled._compiled.saved) == ["many", "one"]
    assert during == after
    waited = LLM(tiny_path, **kw)   # loads what the child saved
    assert [o.outputs[0].token_ids for o in waited.generate(PROMPTS, GREEDY)] == after
    assert LLM(tiny_path, compile_in_background=True, **kw).engine.runner.pending_graphs is None


def test_a_saved_graph_runs_on_another_pool_size_and_other_weights(tmp_path, monkeypatch,
                                                                   caplog):
    """A graph is saved by one engine (a 64-block pool, seed-5 weights) and loaded by
    another with a larger pool, contexts past block 64 and other weight values of the same
    shapes: the pool's size is a dynamic dimension and the weights are read at every call,
    so its tokens are the eager engine's."""
    monkeypatch.setenv("LLMSERVE_COMPILE_CACHE", str(tmp_path / "cache"))
    a = make_tiny_checkpoint(str(tmp_path / "a"), arch="llama", num_heads=4, num_kv_heads=2,
                             seed=5)
    b = make_tiny_checkpoint(str(tmp_path / "b"), arch="llama", num_heads=4, num_kv_heads=2,
                             seed=6)
    small = dict(dtype="float32", max_num_seqs=4, num_kv_blocks=64)
    LLM(a, enforce_eager=False, **small)   # compiles and saves
    big = dict(dtype="float32", max_num_seqs=4, num_kv_blocks=200)
    prompts = [list(range(100, 100 + 90 * k)) for k in (1, 2, 3)] + [[5, 6, 7]]
    with caplog.at_level(logging.INFO, logger="llmserve.model.executor.compile"):
        llm = LLM(b, enforce_eager=False, **big)
    assert "batch 1 loaded" in caplog.text and "batches 2-4 loaded" in caplog.text
    assert sorted(llm.engine.runner.compiled._compiled.saved) == ["many", "one"]
    ref = LLM(b, enforce_eager=True, **big).generate(prompts, GREEDY)
    got = llm.generate(prompts, GREEDY)
    assert llm.engine.kv.num_blocks == 200
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert not llm.engine.runner.compiled._compiled.eager and not llm.engine.runner.compiled.failed


def test_a_step_its_saved_graph_refuses_runs_eagerly_without_compiling(tiny_path, tmp_path,
                                                                       monkeypatch, caplog):
    """A saved graph whose guards refuse a step (shapes it was not traced for) does not
    send the step to an in-process compile: that step and later ones of the same graph
    run eagerly, with one warning, and give the eager tokens."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("LLMSERVE_COMPILE_CACHE", str(tmp_path))
    kw = dict(dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    llm = LLM(tiny_path, enforce_eager=False, **kw)
    graphs = llm.engine.runner.compiled._compiled

    def refusing(*args):
        raise RuntimeError("GuardManager check failed, reason: a test")

    graphs.saved["one"] = refusing
    frames = counters["frames"]["total"]
    with caplog.at_level(logging.WARNING):
        got = llm.generate([[5, 6, 7, 8]], GREEDY)
    ref = LLM(tiny_path, enforce_eager=True, **kw).generate([[5, 6, 7, 8]], GREEDY)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert caplog.text.count("did not fit its saved graph") == 1
    assert graphs.eager == {"one"} and "many" in graphs.saved
    assert counters["frames"]["total"] == frames
