"""The performance peers of ``bench compare``: cache lookup, command lines, skip reasons.

Nothing is built or installed here: fake ``llama-server`` and vLLM ``python`` executables
(scripts that record their arguments and run the fake OpenAI server) stand in for the
real ones, placed where ``make bench-peers`` would put them.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path

import pytest

from llmserve.bench import peers
from llmserve.bench.cli import main
from llmserve.bench.compare import builtin_server_specs
from llmserve.bench.peers import (
    PeerSettings,
    PeerUnavailable,
    find_llama_server,
    find_vllm_python,
    llama_server_command,
    peer_settings_for,
    vllm_command,
    vllm_env,
)
from tools.peers.build_llama_server import cmake_configure_args
from tools.peers.setup_vllm import READY_MARKER, register_vllm_dist

FAKE_SERVER = str(Path(__file__).with_name("bench_fake_server.py"))

_FAKE_EXECUTABLE = """#!{python}
import json, os, runpy, sys
argv = sys.argv[1:]
with open({record!r}, "w") as handle:
    json.dump({{"argv": argv, "env": {{k: v for k, v in os.environ.items()
                                       if k.startswith("VLLM_")}}}}, handle)
sys.argv = [{fake!r}, "--port", argv[argv.index("--port") + 1]]
runpy.run_path({fake!r}, run_name="__main__")
"""


def write_fake_executable(path: Path, record: Path) -> Path:
    """An executable that records argv (and VLLM_* env) in ``record``, then serves fakes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_FAKE_EXECUTABLE.format(python=sys.executable, record=str(record),
                                            fake=FAKE_SERVER))
    path.chmod(0o755)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty peer cache, with no peer named by environment variables."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(root))
    monkeypatch.delenv(peers.LLAMA_SERVER_ENV, raising=False)
    monkeypatch.delenv(peers.VLLM_PYTHON_ENV, raising=False)
    return root


def test_cpu_hash_depends_on_flags_not_their_order(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: sse avx2 fma avx\nprocessor\t: 1\n"
                    "flags\t\t: sse avx2 fma avx\n")
    assert peers.cpu_flags(str(info)) == ["avx", "avx2", "fma", "sse"]
    assert peers.cpu_flags(str(tmp_path / "missing")) == []
    base = peers.cpu_hash(["avx2", "fma"], "x86_64")
    assert base == peers.cpu_hash(["fma", "avx2", "fma"], "x86_64") and len(base) == 12
    assert base != peers.cpu_hash(["avx2", "fma", "avx512f"], "x86_64")
    assert base != peers.cpu_hash(["avx2", "fma"], "aarch64")


def test_cache_root_and_build_root(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert peers.cache_root() == tmp_path / "xdg" / "llmserve"
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert peers.cache_root() == tmp_path / "c"
    assert peers.llama_cpp_build_root(hash_="abc") == tmp_path / "c" / "llama.cpp" / (
        f"{peers.LLAMA_CPP_VERSION}-abc")
    assert peers.vllm_venv_dir() == tmp_path / "c" / "vllm-venv"


def test_find_llama_server_explicit_env_cache_and_missing(cache, tmp_path, monkeypatch):
    with pytest.raises(PeerUnavailable, match="make bench-peers-llama"):
        find_llama_server()
    built = write_fake_executable(peers.llama_cpp_build_root() / "bin" / "llama-server",
                                  tmp_path / "rec.json")
    assert find_llama_server() == built
    other = write_fake_executable(tmp_path / "elsewhere" / "llama-server", tmp_path / "r.json")
    monkeypatch.setenv(peers.LLAMA_SERVER_ENV, str(other))
    assert find_llama_server() == other
    plain = tmp_path / "not-executable"
    plain.write_text("")
    with pytest.raises(PeerUnavailable, match="not an executable"):
        find_llama_server(str(plain))


def test_find_vllm_python_needs_the_ready_marker(cache, tmp_path):
    python = write_fake_executable(peers.vllm_venv_dir() / "bin" / "python", tmp_path / "r")
    with pytest.raises(PeerUnavailable, match="make bench-peers-vllm"):
        find_vllm_python()
    (peers.vllm_venv_dir() / READY_MARKER).write_text("{}")
    assert find_vllm_python() == python
    assert find_vllm_python(str(python)) == python


def test_peer_settings_from_sweep_and_lengths():
    s = peer_settings_for([1, 8], num_prompts=16, longest_request=200)
    assert (s.parallel, s.context_per_seq) == (8, 1024)
    assert peer_settings_for([None], 16, 100).parallel == 16       # all at once
    assert peer_settings_for([64], 10, 100).parallel == 10          # never more than requests
    assert peer_settings_for([None], 10_000, 100).parallel == peers.MAX_PARALLEL
    assert peer_settings_for([1], 4, 1500).context_per_seq == 1792  # 1500 + 64, up to 256s
    with pytest.raises(ValueError):
        PeerSettings(parallel=0)


def test_llama_server_command_sizes_slots_and_context():
    s = PeerSettings(parallel=8, context_per_seq=1024, threads=3,
                     extra_llama_server_args=("--foo", "1"))
    cmd = llama_server_command("/x/llama-server", "/m.gguf", s)
    assert cmd[:3] == ["/x/llama-server", "-m", "/m.gguf"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {"--host": "{host}", "--port": "{port}", "-np": "8", "-c": "8192",
                     "-t": "3", "-tb": "3", "--foo": "1"}


def test_vllm_command_and_env():
    s = PeerSettings(parallel=4, context_per_seq=2048, threads=1)
    cmd = vllm_command("/v/bin/python", "/models/m", s, served_name="m")
    assert cmd[:5] == ["/v/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", "/models/m"]
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert flags == {"--dtype": "bfloat16", "--host": "{host}",
                     "--port": "{port}", "--max-num-seqs": "4", "--max-model-len": "2048",
                     "--served-model-name": "m"}
    env = vllm_env(s)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(sorted(os.sched_getaffinity(0))[0])


def test_vllm_env_preloads_the_venvs_intel_openmp(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "TCMALLOC_PATHS", ())
    monkeypatch.setenv("LD_PRELOAD", "/lib/other.so")
    assert "LD_PRELOAD" not in vllm_env(PeerSettings(threads=1), tmp_path)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_env(PeerSettings(threads=1), tmp_path)
    assert env["LD_PRELOAD"] == f"{tmp_path}/lib/libiomp5.so:/lib/other.so"


def test_builtin_specs_skip_missing_peers_with_the_reason(cache, tmp_path, caplog):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="cannot run llama-server: .*make bench-peers-llama"):
        builtin_server_specs(str(gguf), ["llama-server"])
    with pytest.raises(ValueError, match="cannot run vllm: .*make bench-peers-vllm"):
        builtin_server_specs(str(gguf), ["vllm"])
    with pytest.raises(ValueError, match="unknown server"):
        builtin_server_specs(str(gguf), ["llama-cpp"])
    caplog.set_level("INFO")
    names = [s.name for s in builtin_server_specs(str(gguf), "auto")]
    assert "llama-server" not in names and "vllm" not in names and "llmserve" in names
    assert "skipping llama-server" in caplog.text and "skipping vllm" in caplog.text
    write_fake_executable(peers.llama_cpp_build_root() / "bin" / "llama-server", tmp_path / "r")
    with pytest.raises(ValueError, match="needs a GGUF file"):
        builtin_server_specs(str(tmp_path), ["llama-server"])
    (spec,) = builtin_server_specs(str(gguf), ["llama-server"], PeerSettings(parallel=2))
    assert spec.command[spec.command.index("-np") + 1] == "2"
    assert spec.ready_paths == ("/health",)


def test_vllm_spec_serves_an_hf_folder_as_it_is(cache, tmp_path):
    python = write_fake_executable(peers.vllm_venv_dir() / "bin" / "python", tmp_path / "r")
    (peers.vllm_venv_dir() / READY_MARKER).write_text("{}")
    folder = tmp_path / "hf"
    folder.mkdir()
    (spec,) = builtin_server_specs(str(folder), ["vllm"], PeerSettings(parallel=3))
    assert spec.command[0] == str(python)
    assert spec.command[spec.command.index("serve") + 1] == str(folder)
    assert spec.env["VLLM_TARGET_DEVICE"] == "cpu"


def test_exported_model_dir_changes_with_the_file(tmp_path):
    gguf = tmp_path / "SmolLM.Q4.gguf"
    gguf.write_bytes(b"GGUF1")
    first = peers.exported_model_dir(str(gguf), root=tmp_path)
    assert first.parent == tmp_path / "hf-export"
    assert first.name.startswith("SmolLM.Q4-") and first.name.endswith("-bfloat16")
    gguf.write_bytes(b"GGUF22")
    assert peers.exported_model_dir(str(gguf), root=tmp_path) != first


def test_cmake_args_native_and_portable(tmp_path):
    native = cmake_configure_args(tmp_path / "src", tmp_path / "b", "native", "Ninja")
    assert native[:7] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "b"),
                          "-G", "Ninja"]
    assert "-DGGML_NATIVE=ON" in native and "-DBUILD_SHARED_LIBS=OFF" in native
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in native     # never downloads the web UI
    portable = cmake_configure_args(tmp_path, tmp_path, "portable")
    assert "-DGGML_NATIVE=OFF" in portable and "-DGGML_AVX2=ON" in portable
    assert "-DGGML_AVX512=OFF" in portable and "-DGGML_AMX_INT8=OFF" in portable
    assert "-G" not in portable
    with pytest.raises(ValueError):
        cmake_configure_args(tmp_path, tmp_path, "fast")


def test_register_vllm_dist_makes_the_version_findable(tmp_path):
    register_vllm_dist(tmp_path, "0.32.0")
    (dist,) = list(importlib.metadata.distributions(path=[str(tmp_path)]))
    assert (dist.metadata["Name"], dist.version) == ("vllm", "0.32.0")


def test_compare_runs_llama_server_from_the_cache(cache, tmp_path, bpe_tokenizer_path):
    record = tmp_path / "argv.json"
    write_fake_executable(peers.llama_cpp_build_root() / "bin" / "llama-server", record)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "out"
    rc = main(["bench", "compare", "--model", str(gguf), "--servers", "llama-server",
               "--num-prompts", "4", "--input-len", "10", "--output-len", "5",
               "--sweep", "concurrency=1,3", "--peer-threads", "2",
               "--tokenizer", bpe_tokenizer_path, "--ready-timeout", "30",
               "--output-dir", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    argv = json.loads(record.read_text())["argv"]
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert argv[:2] == ["-m", str(gguf)]
    assert (flags["-np"], flags["-c"], flags["-t"]) == ("3", "3072", "2")
    doc = json.loads((out / "compare.json").read_text())
    assert [s["name"] for s in doc["servers"]] == ["llama-server"]
    assert doc["servers"][0]["status"] == "ok"


def test_compare_runs_vllm_with_its_env(cache, tmp_path, bpe_tokenizer_path):
    record = tmp_path / "argv.json"
    write_fake_executable(peers.vllm_venv_dir() / "bin" / "python", record)
    (peers.vllm_venv_dir() / READY_MARKER).write_text("{}")
    folder = tmp_path / "hf"
    folder.mkdir()
    rc = main(["bench", "compare", "--model", str(folder), "--servers", "vllm",
               "--num-prompts", "3", "--input-len", "10", "--output-len", "4",
               "--tokenizer", bpe_tokenizer_path, "--ready-timeout", "30",
               "--output-dir", str(tmp_path / "out"), "--no-progress", "--no-plots"])
    assert rc == 0
    seen = json.loads(record.read_text())
    assert seen["argv"][:4] == ["-m", "vllm.entrypoints.cli.main", "serve", str(folder)]
    assert seen["argv"][seen["argv"].index("--max-num-seqs") + 1] == "3"
    assert seen["env"]["VLLM_TARGET_DEVICE"] == "cpu"


def test_compare_names_the_missing_peer(cache, tmp_path, bpe_tokenizer_path, caplog):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    rc = main(["bench", "compare", "--model", str(gguf), "--servers", "llmserve,llama-server",
               "--num-prompts", "2", "--tokenizer", bpe_tokenizer_path,
               "--output-dir", str(tmp_path / "out"), "--no-progress"])
    assert rc == 2
    assert "cannot run llama-server" in caplog.text


def test_build_falls_back_to_portable_when_native_fails_its_smoke_test(tmp_path, monkeypatch):
    from tools.peers import build_llama_server as b

    def fake_build_variant(source, root, variant, jobs):
        bin_dir = root / f"build-{variant}" / "bin"
        bin_dir.mkdir(parents=True)
        for target in b.TARGETS:
            (bin_dir / target).write_text(variant)
        return bin_dir

    monkeypatch.setattr(b, "check_tools", lambda: None)
    monkeypatch.setattr(b, "fetch_source", lambda: tmp_path / "src")
    monkeypatch.setattr(b, "build_variant", fake_build_variant)
    monkeypatch.setattr(b, "smoke_test", lambda binary, gguf, log: (
        "exited with code 132" if "native" in str(binary) else None))
    root = tmp_path / "root"
    installed = b.build("m.gguf", root=root)
    assert installed == root / "bin" / "llama-server" and installed.read_text() == "portable"
    info = json.loads((root / "build_info.json").read_text())
    assert info["variant"] == "portable" and "-DGGML_AVX2=ON" in info["cmake_args"]
    assert info["failures"] == ["native: smoke test failed: exited with code 132"]
    assert b.build("m.gguf", root=root) == installed          # found, not rebuilt
    monkeypatch.setattr(b, "smoke_test", lambda binary, gguf, log: "HTTP 500")
    with pytest.raises(b.BuildError, match="no llama-server variant works"):
        b.build("m.gguf", root=tmp_path / "other")


def test_busy_cpu_warning_suggests_fewer_peer_threads():
    assert peers.busy_cpu_warning(cores=2, load=0.3) is None
    assert peers.busy_cpu_warning(cores=16, load=3.0) is None
    warning = peers.busy_cpu_warning(cores=2, load=1.2)
    assert "--peer-threads 1" in warning and "1.2 on 2 cores" in warning
    assert "--peer-threads 12" in peers.busy_cpu_warning(cores=16, load=4.0)


_SMOKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
TOKENS = int(sys.argv[2])
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def _reply(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._reply({"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(sys.argv[3], "w") as out:
            json.dump(body, out)
        self._reply({"usage": {"completion_tokens": TOKENS}})
HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.mark.parametrize("tokens, problem", [(8, None), (7, "asked for 8 tokens, got 7")])
def test_peer_smoke_completion_checks_the_token_count(tmp_path, tokens, problem):
    from llmserve.bench.compare import ServerSpec, smoke_completion

    script, seen = tmp_path / "server.py", tmp_path / "body.json"
    script.write_text(_SMOKE_SERVER)
    spec = ServerSpec("smoke", [sys.executable, str(script), "{port}", str(tokens), str(seen)],
                      ready_paths=("/health",), ready_timeout_s=30)
    assert smoke_completion(spec, tmp_path / "smoke.log", 30, model="m") == problem
    body = json.loads(seen.read_text())
    assert body["model"] == "m" and body["max_tokens"] == 8 and body["temperature"] == 0


def test_find_llama_quantize_and_the_shape_tool_without_it(cache, tmp_path, monkeypatch, caplog):
    """``llama-quantize`` is found where the build puts it (or named); the shape-model tool
    exits 2 with the reason when it is missing, and refuses an unknown model by name."""
    from tools.peers import make_shape_gguf

    monkeypatch.delenv("LLMSERVE_LLAMA_QUANTIZE", raising=False)
    with pytest.raises(PeerUnavailable, match="llama-quantize is not built"):
        peers.find_llama_quantize()
    assert make_shape_gguf.main(["--out", str(tmp_path / "out")]) == 2
    assert "llama-quantize is not built" in caplog.text
    built = write_fake_executable(peers.llama_cpp_build_root() / "bin" / "llama-quantize",
                                  tmp_path / "rec.json")
    assert peers.find_llama_quantize() == built
    with pytest.raises(SystemExit) as exit_info:
        make_shape_gguf.main(["--model", "qwen2.5-0.5b,gpt-9", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert set(make_shape_gguf.SHAPE_CONFIGS) == {"qwen2.5-0.5b", "llama-3.2-1b", "qwen3-1.7b"}
