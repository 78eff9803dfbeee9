"""PNG plots of benchmark results (matplotlib's Agg canvas, no pyplot global state).

Every function takes the JSON-ready results (see :mod:`llmserve.bench.report`), so plots
can be redrawn from a saved ``results.json``:

* :func:`plot_latency_cdfs`: empirical CDFs of TTFT, TPOT, ITL and E2E, one line per run;
* :func:`plot_ttft_vs_input_len`: TTFT against the prompt's token count, one colour per run;
* :func:`plot_throughput_vs_concurrency`: output tokens/s against requests in flight, as
  observed in time windows of each run (``timeline``), plus, for a sweep, the curve of
  each point's mean in-flight count against its overall throughput;
* :func:`plot_sweep`: throughput and TTFT/TPOT percentiles against the swept parameter.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn: `llmserve serve` never loads it
    from matplotlib.figure import Figure

_CDF_PANELS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2e"))


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _values_ms(requests: Sequence[dict], key: str) -> list[float]:
    out: list[float] = []
    for r in requests:
        if not r["success"]:
            continue
        v = r.get(key)
        if isinstance(v, list):
            out.extend(x * 1000.0 for x in v)
        elif v is not None:
            out.append(v * 1000.0)
    return sorted(out)



def _finish_axes(ax, title: str, xlabel: str, ylabel: str) -> None:
    """Title and axis labels, a light grid, and a legend when anything was labelled."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)

def plot_latency_cdfs(runs: Sequence[dict], path: Path) -> Path:
    """2x2 empirical CDFs; ``runs`` are results' run entries (label + requests)."""
    fig = _new_figure(11, 8)
    for i, (title, key) in enumerate(_CDF_PANELS):
        ax = fig.add_subplot(2, 2, i + 1)
        for run in runs:
            xs = _values_ms(run["requests"], key)
            if xs:
                ys = [(j + 1) / len(xs) for j in range(len(xs))]
                ax.step(xs, ys, where="post", label=run["label"])
        ax.set_ylim(0, 1.02)
        _finish_axes(ax, f"{title} CDF", "ms", "fraction of samples")
    return _save(fig, path)


def plot_ttft_vs_input_len(runs: Sequence[dict], path: Path) -> Path:
    fig = _new_figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    for run in runs:
        ok = [r for r in run["requests"] if r["success"] and r.get("ttft") is not None]
        ax.scatter([r["input_len"] for r in ok], [r["ttft"] * 1000.0 for r in ok], s=10,
                   alpha=0.6, label=run["label"])
    _finish_axes(ax, "TTFT vs input length", "input tokens (client tokenizer)", "TTFT (ms)")
    return _save(fig, path)


def plot_throughput_vs_concurrency(runs: Sequence[dict], path: Path) -> Path:
    fig = _new_figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    for run in runs:
        pts = run.get("timeline") or []
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, alpha=0.5,
                   label=f"{run['label']} (windows)")
    if len(runs) > 1:
        xs = [run["metrics"].get("mean_in_flight") or 0.0 for run in runs]
        ys = [run["metrics"]["output_token_throughput"] for run in runs]
        ax.plot(xs, ys, "k-o", label="per run (mean in flight)")
    _finish_axes(ax, "Throughput vs concurrency", "requests in flight", "output tokens/s")
    return _save(fig, path)


def plot_sweep(results: dict, path: Path) -> Path:
    """Throughput and latency percentiles against the swept parameter (categorical x)."""
    runs = results["runs"]
    labels = [str(v) for v in results["sweep"]["values"]]
    xs = list(range(len(runs)))
    fig = _new_figure(12, 4.5)
    ax1 = fig.add_subplot(1, 3, 1)
    ax1.plot(xs, [r["metrics"]["output_token_throughput"] for r in runs], "o-",
             label="output tok/s")
    ax1.plot(xs, [r["metrics"]["total_token_throughput"] for r in runs], "s--",
             label="total tok/s")
    ax1.set_ylabel("tokens/s")
    ax1.set_title("Throughput")
    for i, (title, key) in enumerate((("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))):
        ax = fig.add_subplot(1, 3, i + 2)
        for q, style in (("p50", "o-"), ("p90", "^-"), ("p99", "s--")):
            ax.plot(xs, [r["metrics"][key][q] if r["metrics"][key][q] is not None
                         else float("nan") for r in runs], style, label=q)
        ax.set_ylabel("ms")
        ax.set_title(title)
    for ax in fig.axes:
        ax.set_xticks(xs)
        ax.set_xticklabels(labels)
        ax.set_xlabel(results["sweep"]["param"])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def write_all_plots(results: dict, out_dir: Path) -> list[str]:
    """Draw every applicable plot into ``out_dir``; returns the file names."""
    runs = results["runs"]
    files = [plot_latency_cdfs(runs, out_dir / "latency_cdf.png"),
             plot_ttft_vs_input_len(runs, out_dir / "ttft_vs_input_len.png"),
             plot_throughput_vs_concurrency(runs, out_dir / "throughput_vs_concurrency.png")]
    if results.get("sweep"):
        files.append(plot_sweep(results, out_dir / "sweep.png"))
    return [p.name for p in files]
