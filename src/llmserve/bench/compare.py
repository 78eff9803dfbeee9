"""``bench compare``: start each server under test on loopback, run one workload on each.

Servers run one after another (never two at once, so they do not compete for the machine);
each gets the very same request list. Built-in servers (see :func:`builtin_server_specs`):

* ``llmserve``: ``python -m llmserve.cli serve --model M`` (the default model unless given);
* ``llmserve-no-prefix-cache``: the same with ``--no-prefix-caching``;
* ``llmserve-static``: the same with a static-batching flag, only when ``serve --help``
  shows one (``--static-batching``, or a ``--...batch...``/``--schedul...`` option whose
  choices include ``static``);
* ``llama-server``: llama.cpp's own server on the same GGUF file, one slot per concurrent
  request (:func:`llmserve.bench.peers.llama_server_command`), when it has been built;
* ``vllm``: vLLM's OpenAI server (CPU build, its own venv) on the model exported to a
  bfloat16 HF folder (:func:`llmserve.bench.peers.vllm_command`), when it has been set up.

Peers are sized by :class:`llmserve.bench.peers.PeerSettings`: slots for the sweep's largest
concurrency, context for its longest request. ``make bench-peers`` builds them.

Outputs in the output folder: one sub-folder per server with its ``results.json``,
``report.md`` and plots; its log ``<name>.log``; and ``compare.json`` / ``compare.md`` with
side-by-side tables and ratios against the first server that ran.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import httpx

from llmserve.bench import plots, report
from llmserve.bench.compare_report import comparison_document, render_comparison
from llmserve.bench.peers import (
    PeerSettings,
    PeerUnavailable,
    exported_model_dir,
    find_llama_server,
    find_vllm_python,
    llama_server_command,
    vllm_command,
    vllm_env,
)
from llmserve.bench.runner import BenchOptions, execute_runs, results_document, write_outputs
from llmserve.bench.workloads import RequestSpec

logger = logging.getLogger(__name__)

BUILTIN_SERVERS = ("llmserve", "llmserve-no-prefix-cache", "llmserve-static", "llama-server",
                   "vllm")


@dataclass
class ServerSpec:
    """How to launch one server. ``{port}`` and ``{host}`` in ``command`` are filled in."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: Optional[int] = None              # None: a free port is picked at start
    host: str = "127.0.0.1"
    ready_paths: tuple[str, ...] = ("/health", "/v1/models")
    ready_timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)


def server_spec_from_arg(item: str, flag: str = "--extra-server") -> ServerSpec:
    """A ``NAME=COMMAND`` argument as a ServerSpec (ValueError naming ``flag`` otherwise)."""
    name, sep, command = item.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise ValueError(f"{flag} needs NAME=COMMAND, got {item!r}")
    return ServerSpec(name.strip(), shlex.split(command))


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A launched server: ``start()`` then ``wait_ready()``, ``stop()`` (terminate, then kill)."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.port = spec.port or free_port(spec.host)
        self.url = f"http://{spec.host}:{self.port}"
        self.command = [c.format(port=self.port, host=spec.host) for c in spec.command]
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        logger.info("starting %s: %s", self.spec.name, " ".join(self.command))
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **self.spec.env})

    def wait_ready(self) -> float:
        """Poll the ready paths until one answers 200; returns seconds waited."""
        if self.proc is None:
            raise RuntimeError("start() the server first")
        t0 = time.monotonic()
        deadline = t0 + self.spec.ready_timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.spec.name} exited with code {self.proc.returncode}"
                                       f" before it was ready; log tail:\n{self.log_tail()}")
                for path in self.spec.ready_paths:
                    try:
                        if client.get(self.url + path).status_code == 200:
                            return time.monotonic() - t0
                    except httpx.HTTPError:
                        pass
                time.sleep(0.25)
        raise TimeoutError(f"{self.spec.name} not ready after {self.spec.ready_timeout_s:.0f} s;"
                           f" log tail:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM; killing it", self.spec.name)
                self.proc.kill()
                self.proc.wait(grace_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, num_bytes: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-num_bytes:].decode("utf-8", "replace")

    def __enter__(self) -> "ServerProcess":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def smoke_completion(spec: ServerSpec, log_path: Path, timeout_s: float,
                     model: Optional[str] = None) -> Optional[str]:
    """Start the server of ``spec`` (its output to ``log_path``), ask for 8 greedy tokens,
    and stop it; None if it answered with 8 tokens and is still running, else the problem.
    ``model``: the request's ``model`` field, for servers that check it."""
    body: dict = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True,
                  "temperature": 0}
    if model is not None:
        body["model"] = model
    proc = ServerProcess(spec, log_path)
    try:
        with proc:
            reply = httpx.post(proc.url + "/v1/completions", json=body, timeout=timeout_s,
                               trust_env=False)
            if reply.status_code != 200:
                return f"HTTP {reply.status_code}: {reply.text[:300]}"
            tokens = reply.json().get("usage", {}).get("completion_tokens")
            if tokens != 8:
                return f"asked for 8 tokens, got {tokens}"
            if proc.proc is not None and proc.proc.poll() is not None:
                return f"exited with code {proc.proc.returncode}"
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def detect_static_batching_args(help_text: str) -> Optional[list[str]]:
    """The serve flag(s) selecting static batching, read from ``serve --help``; None if none."""
    if re.search(r"--static-batching\b", help_text):
        return ["--static-batching"]
    for m in re.finditer(r"(--[a-z-]*(?:batch|schedul)[a-z-]*)\s+\{([^}]*)\}", help_text):
        if "static" in [c.strip() for c in m.group(2).split(",")]:
            return [m.group(1), "static"]
    return None


def _llmserve_serve_help() -> str:
    try:
        out = subprocess.run([sys.executable, "-m", "llmserve.cli", "serve", "--help"],
                             capture_output=True, text=True, timeout=120)
        return out.stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("could not run `llmserve serve --help`: %s", exc)
        return ""


def llmserve_spec(name: str, model: str, extra_args: Sequence[str] = ()) -> ServerSpec:
    return ServerSpec(name, [sys.executable, "-m", "llmserve.cli", "serve", "--host", "{host}",
                             "--port", "{port}", "--model", model, *extra_args])


def llama_server_spec(model: str, settings: PeerSettings) -> ServerSpec:
    """llama.cpp's ``llama-server`` on the GGUF ``model``.

    Raises:
        PeerUnavailable: no binary, or ``model`` is not a GGUF file.
    """
    if not model.endswith(".gguf"):
        raise PeerUnavailable(f"llama-server needs a GGUF file, and {model!r} is not one")
    binary = find_llama_server(settings.llama_server_bin)
    return ServerSpec("llama-server", llama_server_command(str(binary), model, settings),
                      ready_paths=("/health",))


def vllm_model_dir(model: str) -> str:
    """The HF folder vLLM serves: ``model`` itself, or its cached bfloat16 export if GGUF."""
    if not model.endswith(".gguf"):
        return model
    out = exported_model_dir(model, "bfloat16")
    if not (out / "config.json").is_file():
        from llmserve.model.loading.export_hf import export_hf

        logger.info("exporting %s to %s for vLLM", model, out)
        export_hf(model, str(out), "bfloat16")
    return str(out)


def vllm_spec(model: str, settings: PeerSettings) -> ServerSpec:
    """vLLM's OpenAI server (CPU) from its own venv on ``model`` as an HF folder.

    Raises:
        PeerUnavailable: the venv is not set up.
    """
    python = find_vllm_python(settings.vllm_python)
    return ServerSpec("vllm", vllm_command(str(python), vllm_model_dir(model), settings),
                      env=vllm_env(settings, python.parent.parent), ready_paths=("/health",))


def builtin_server_specs(model: str, names: Sequence[str] | str = "auto",
                         settings: Optional[PeerSettings] = None) -> list[ServerSpec]:
    """Specs of the built-in servers; ``"auto"``: llmserve plus every available peer.

    A peer named explicitly but unavailable raises ValueError with the reason; under
    ``auto`` it is skipped with that reason logged.
    """
    settings = settings or PeerSettings()
    auto = names == "auto"
    wanted = list(BUILTIN_SERVERS) if auto else list(names)
    unknown = sorted(set(wanted) - set(BUILTIN_SERVERS))
    if unknown:
        raise ValueError(f"unknown server(s) {unknown}; choose from {BUILTIN_SERVERS}")
    specs = []
    for name in wanted:
        try:
            if name == "llmserve":
                specs.append(llmserve_spec(name, model))
            elif name == "llmserve-no-prefix-cache":
                specs.append(llmserve_spec(name, model, ["--no-prefix-caching"]))
            elif name == "llmserve-static":
                flag = detect_static_batching_args(_llmserve_serve_help())
                if flag is None:
                    raise PeerUnavailable("`llmserve serve` has no static-batching option")
                specs.append(llmserve_spec(name, model, flag))
            elif name == "llama-server":
                specs.append(llama_server_spec(model, settings))
            elif name == "vllm":
                specs.append(vllm_spec(model, settings))
        except PeerUnavailable as exc:
            if not auto:
                raise ValueError(f"cannot run {name}: {exc}") from None
            logger.info("skipping %s: %s", name, exc)
    return specs


def run_compare(servers: Sequence[ServerSpec], options: BenchOptions,
                specs: Sequence[RequestSpec], tokenizer_name: str) -> dict:
    """Run ``specs`` against each server in turn; write and return the comparison."""
    if not servers:
        raise ValueError("no server to compare")
    out_dir = Path(options.output_dir)
    entries = []
    for server in servers:
        entry: dict = {"name": server.name, "status": "ok", "error": None}
        proc = ServerProcess(server, out_dir / f"{server.name}.log")
        entry["command"] = proc.command
        try:
            with proc:
                opts = dataclasses.replace(
                    options, base_url=proc.url, model=None, output_dir=out_dir / server.name,
                    extra_body={**options.extra_body, **server.extra_body})
                runs, model = asyncio.run(execute_runs(opts, specs))
                results = results_document(opts, specs, tokenizer_name, runs, model,
                                           tool="llmserve bench compare")
                write_outputs(results, out_dir / server.name, options.make_plots)
                entry.update(model=model, results_file=f"{server.name}/results.json",
                             results=results)
        except (RuntimeError, TimeoutError, OSError) as exc:
            logger.error("%s failed: %s", server.name, exc)
            entry.update(status="failed", error=str(exc))
        entries.append(entry)
    setup = results_document(options, specs, tokenizer_name, [], "-")
    return write_comparison(entries, setup["workload"], setup["settings"], out_dir,
                            options.make_plots)


def write_comparison(entries: list[dict], workload: dict, settings: dict, out_dir: Path,
                     make_plots: bool = True) -> dict:
    """compare.json, compare.md and overlay plots from per-server entries."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = comparison_document(entries, workload, settings)
    plot_files: list[str] = []
    ok = [e for e in entries if e["status"] == "ok"]
    if make_plots and ok:
        runs = [{**e["results"]["runs"][0], "label": e["name"]} for e in ok]
        plot_files = [plots.plot_latency_cdfs(runs, out_dir / "compare_latency_cdf.png").name,
                      plots.plot_ttft_vs_input_len(runs, out_dir / "compare_ttft_vs_input_len.png"
                                                   ).name]
    (out_dir / "compare.md").write_text(render_comparison(doc, plot_files), encoding="utf-8")
    doc["files"] = {"report": "compare.md", "plots": plot_files}
    report.write_json(out_dir / "compare.json", doc)
    return doc
