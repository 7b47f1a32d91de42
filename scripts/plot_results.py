"""Draw the charts in docs/img/ from the results JSON committed under benchmarks/results/.

Charts are only ever drawn from committed measurements, so a chart in the docs can be checked
against (and regenerated from) the numbers beside it:

- ``ttft_vs_prompt.svg``: time to first token against prompt length in real vLLM on the GPU, for
  recompute, vLLM's native ``OffloadingConnector`` and a kvtier CPU hit
  (``vllm_e2e_*.json``: the runs named in ``TTFT_PANELS``);
- ``hit_rate_vs_capacity.svg``: block hit rate against tier capacity per placement policy, with
  Belady's offline optimum (``kvtier bench --compare --json`` output, one panel per file).

matplotlib is an optional dependency (``pip install 'kvtier[plots]'``); without it the script
exits with status 2 and says so.

Run: ``python scripts/plot_results.py [--e2e FILE] [--compare FILE ...] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
E2E = RESULTS / "vllm_e2e_NVIDIA-H100-80GB-HBM3.json"
COMPARE = (RESULTS / "compare_mooncake.json", RESULTS / "compare_docs_seed1.json")
OUT = ROOT / "docs" / "img"

TTFT_PANELS = (
    ("First turn: the stored prompt again", "session_18", ("d8h100", "n8h100")),
    ("Next turn: the stored prompt + 128 new tokens", "session_18", ("t8h100",)),
)
"""(title, session, runs): each panel merges the lengths of its runs (all on one card)."""

SERIES = (
    ("recompute", "kvtier_recompute", "recompute (no hit)"),
    ("native", "native_cpu", "vLLM OffloadingConnector, CPU hit"),
    ("kvtier", "kvtier_cpu", "kvtier, CPU hit"),
)
"""(name, field in ``ttft_ms[length]``, legend). Recompute is the paired one: the same prompt
in the same engine with kvtier told to stay out, present in every run."""

POLICIES = ("lru", "arc", "lru+reuse_gate", "belady")
POLICY_LABELS = {"lru+reuse_gate": "lru+reuse_gate (recommended)", "belady": "Belady (offline optimum)"}

MISSING_MATPLOTLIB = ("plot_results: matplotlib is not installed; install it with "
                      "pip install 'kvtier[plots]' (or pip install matplotlib)")


@dataclass(frozen=True)
class TtftPanel:
    title: str
    gpu: str
    vllm: str
    shape: str
    series: dict[str, list[tuple[int, float]]]  # name -> [(prompt tokens, median ms)]


def ttft_panels(e2e: dict) -> list[TtftPanel]:
    """The TTFT series of every panel, from a ``vllm_e2e`` results file."""
    panels = []
    for title, session, run_names in TTFT_PANELS:
        block = e2e[session]
        runs = [block["runs"][name] for name in run_names]
        gpus = {run["gpu"] for run in runs}
        shapes = {run["result"]["model"] for run in runs}
        if len(gpus) != 1 or len(shapes) != 1:
            raise ValueError(f"{session} {run_names}: one panel must be one card and one model "
                             f"shape, got {sorted(gpus)} / {sorted(shapes)}")
        series: dict[str, list[tuple[int, float]]] = {name: [] for name, _, _ in SERIES}
        for run in runs:
            for length, row in run["result"]["ttft_ms"].items():
                for name, field_name, _ in SERIES:
                    if field_name in row:
                        series[name].append((int(length), float(row[field_name])))
        panels.append(TtftPanel(title, gpus.pop(), str(block.get("vllm", e2e.get("vllm"))),
                                shapes.pop(), {k: sorted(v) for k, v in series.items()}))
    return panels


def hit_rates(compare: dict) -> dict[str, list[tuple[int, float]]]:
    """Policy -> [(capacity in blocks, block hit rate in %)], from ``kvtier bench --compare
    --json``."""
    out: dict[str, list[tuple[int, float]]] = {p: [] for p in POLICIES}
    for row in compare["rows"]:
        if row["policy"] in out:
            out[row["policy"]].append((int(row["capacity"]), 100.0 * float(row["hit_rate"])))
    return {p: sorted(v) for p, v in out.items() if v}


def _trace_label(compare: dict) -> str:
    return f"{Path(str(compare['trace'])).name} ({compare['requests']:,} requests)"


def _pyplot():
    """matplotlib's pyplot set up for reproducible SVG, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    # fixed ids and no date: the same JSON gives the same SVG, so a regenerated chart diffs clean
    matplotlib.rcParams["svg.hashsalt"] = "kvtier"
    import matplotlib.pyplot as plt

    return plt


def _count(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else f"{n:,}"


def _ticks(ax, values: list[int]) -> None:
    """Tick the measured x values themselves, written as numbers (not powers of 2)."""
    ticks = sorted(set(values))
    ax.set_xticks(ticks, [_count(v) for v in ticks])
    ax.minorticks_off()


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})


def draw_ttft(plt, panels: list[TtftPanel], path: Path) -> None:
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.4), squeeze=False)
    markers = {"recompute": "s", "native": "^", "kvtier": "o"}
    for ax, panel in zip(axes[0], panels):
        for name, _, legend in SERIES:
            points = panel.series[name]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker=markers[name],
                        label=legend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _ticks(ax, [p[0] for points in panel.series.values() for p in points])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("time to first token, ms (median; lower is better)")
        ax.set_title(panel.title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    first = panels[0]
    fig.suptitle(f"Real vLLM {first.vllm} on {first.gpu}, {first.shape.upper()} shape, bf16",
                 fontsize=11)
    _save(fig, path)
    plt.close(fig)


def draw_hit_rates(plt, files: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, len(files), figsize=(6 * len(files), 4.4), squeeze=False)
    for ax, compare in zip(axes[0], files):
        for policy, points in hit_rates(compare).items():
            style = "--" if policy == "belady" else "-"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o",
                    markersize=3, label=POLICY_LABELS.get(policy, policy))
        ax.set_xscale("log", base=2)
        _ticks(ax, [int(row["capacity"]) for row in compare["rows"]])
        ax.set_xlabel("CPU tier capacity, blocks of 512 tokens")
        ax.set_ylabel("block hit rate, %")
        ax.set_title(_trace_label(compare), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Hit rate vs capacity per placement policy (kvtier bench --compare)",
                 fontsize=11)
    _save(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--e2e", type=Path, default=E2E, help="vllm_e2e results JSON")
    ap.add_argument("--compare", type=Path, action="append",
                    help="kvtier bench --compare --json output (repeatable)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder for the SVG files")
    args = ap.parse_args(argv)
    plt = _pyplot()
    if plt is None:
        print(MISSING_MATPLOTLIB, file=sys.stderr)
        return 2
    try:
        e2e = json.loads(args.e2e.read_text())
        compares = [json.loads(p.read_text()) for p in (args.compare or COMPARE)]
        panels = ttft_panels(e2e)
    except (OSError, ValueError, KeyError) as exc:
        print(f"plot_results: cannot read the results: {exc!r}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    draw_ttft(plt, panels, args.out / "ttft_vs_prompt.svg")
    draw_hit_rates(plt, compares, args.out / "hit_rate_vs_capacity.svg")
    print(f"wrote {args.out / 'ttft_vs_prompt.svg'} and {args.out / 'hit_rate_vs_capacity.svg'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
