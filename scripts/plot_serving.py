"""Draw goodput against request rate, one line per configuration, from a
``benchmarks/serving.py`` results JSON (``benchmarks/results/serving_<gpu>.json``).

Why a chart: whether a KV tier pays under load is read off where each configuration's goodput
stops following the offered rate; the table beside it has the numbers. One panel per run of
the file (or the ``--run`` labels); each panel names its workload, the GPU and the vLLM
release its results were measured on, so a chart is never read without them.

matplotlib is an optional dependency (``pip install 'kvtier[plots]'``); without it the script
exits with status 2 and says so (``plot_results.py``'s helpers and message).

Run: ``python scripts/plot_serving.py FILE [--run LABEL ...] [--out SVG]``; the default SVG is
``docs/img/serving_goodput_<gpu>.svg``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plot_results import MISSING_MATPLOTLIB, OUT, _pyplot, _save  # noqa: E402

CONFIG_ORDER = ("none", "native", "kvtier_cpu", "kvtier_disk")
MARKERS = {"none": "s", "native": "^", "kvtier_cpu": "o", "kvtier_disk": "D"}


def goodput_series(run: dict) -> tuple[str, dict[str, list[tuple[float, float]]]]:
    """The run's first TTFT SLO (ms, as the report writes it) and, per configuration in
    ``CONFIG_ORDER`` first, [(rate, goodput requests/s at that SLO)] sorted by rate."""
    configs = run["configs"]
    if not configs:
        raise ValueError("the run has no configuration measured")
    slo = f"{next(iter(configs.values()))['setup']['slos_ms'][0]:g}"
    names = [c for c in CONFIG_ORDER if c in configs] + [c for c in configs
                                                         if c not in CONFIG_ORDER]
    out = {}
    for name in names:
        points = [(float(rate), float(r["goodput"][slo]["rps"]))
                  for rate, r in configs[name]["rates"].items()]
        if points:
            out[name] = sorted(points)
    return slo, out


def panel_title(label: str, run: dict, device: str) -> str:
    """The run's label, workload, GPU and vLLM release(s) (results written before the
    workload and release were recorded say so)."""
    setups = [c["setup"] for c in run["configs"].values()]
    w = setups[0].get("workload", {})
    gpu = setups[0].get("gpu", device)
    versions = sorted({str(s.get("vllm", "?")) for s in setups})
    return (f"{label}\nworkload {w.get('name', 'synthetic')}, {gpu}, "
            f"vLLM {'/'.join(versions)}")


def draw(plt, data: dict, labels: list[str], path: Path) -> None:
    fig, axes = plt.subplots(1, len(labels), figsize=(6 * len(labels), 4.6), squeeze=False)
    for ax, label in zip(axes[0], labels):
        run = data["runs"][label]
        slo, series = goodput_series(run)
        rates = sorted({p[0] for points in series.values() for p in points})
        ax.plot(rates, rates, ":", color="grey", label="offered rate")
        for name, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points],
                    marker=MARKERS.get(name, "x"), label=name)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.set_xlabel("offered rate, requests/s (Poisson)")
        ax.set_ylabel(f"goodput, requests/s with TTFT <= {slo} ms")
        ax.set_title(panel_title(label, run, data["device"]), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Goodput vs rate behind vllm serve (benchmarks/serving.py)", fontsize=11)
    _save(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="serving.py results JSON")
    ap.add_argument("--run", action="append",
                    help="a run label of the file (repeatable; default: every run)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the SVG file (default: docs/img/serving_goodput_<gpu>.svg)")
    args = ap.parse_args(argv)
    plt = _pyplot()
    if plt is None:
        print(MISSING_MATPLOTLIB.replace("plot_results", "plot_serving"), file=sys.stderr)
        return 2
    try:
        data = json.loads(args.results.read_text())
        labels = args.run or [k for k, run in data["runs"].items() if run["configs"]]
        for label in labels:
            goodput_series(data["runs"][label])
    except (OSError, ValueError, KeyError) as exc:
        print(f"plot_serving: cannot read the results: {exc!r}", file=sys.stderr)
        return 2
    if not labels:
        print("plot_serving: the file holds no measured run", file=sys.stderr)
        return 2
    out = args.out or OUT / f"serving_goodput_{data['device'].replace(' ', '-')}.svg"
    out.parent.mkdir(parents=True, exist_ok=True)
    draw(plt, data, labels, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
