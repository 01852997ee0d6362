"""Plot training curves from metrics JSONL files (pretrain_gpt.py --metrics-jsonl), one line per run.

    python tools/plot_metrics.py checkpoints/demo/metrics.jsonl --output curves.png
    python tools/plot_metrics.py runs/tp2.jsonl runs/pp2.jsonl --labels TP2 PP2 --output compare.png

Five panels against iteration: loss (training solid, validation dashed with dots), learning rate, gradient
norm, tokens/s and memory. Each run is labelled with its file name (without .jsonl) unless --labels names
them. A resumed run appends to its file; where an iteration appears twice, the later record wins, as it is
the one the resumed run trained. Needs matplotlib: pip install 'megatron-lite[plot]'.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

# (panel title, metrics drawn in it: the first solid, the second dashed), in reading order.
PANELS = (("loss", ("lm_loss", "valid_lm_loss")), ("learning rate", ("lr",)), ("grad norm", ("grad_norm",)),
          ("tokens/s", ("tokens_per_sec",)), ("memory (GiB)", ("memory_gib",)))

Series = dict[str, dict[int, float]]  # metric -> iteration -> value


def read_metrics(path: str) -> Series:
    """Every numeric metric of a JSONL file by iteration. A line that is not JSON (a run killed mid-write
    leaves one) is skipped with a warning."""
    series: Series = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                print(f"plot_metrics.py: warning: {path}:{number} is not JSON; skipped", file=sys.stderr)
                continue
            iteration = record.get("iteration")
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    series.setdefault(key, {})[iteration] = value
    return series


def plot_runs(runs: dict[str, Series], output: str, width: float, height: float, dpi: int) -> None:
    """Write the panels of every run to `output` (PNG, SVG or PDF by its extension), `width` x `height`
    inches at `dpi`: a PNG is width*dpi x height*dpi pixels."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    grid = figure.add_gridspec(2, 3)
    axes = [figure.add_subplot(grid[0, :2]), figure.add_subplot(grid[0, 2]),
            *(figure.add_subplot(grid[1, column]) for column in range(3))]
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (title, metrics) in zip(axes, PANELS):
        for (label, series), colour in zip(runs.items(), colours):
            _draw(ax, series, metrics, label, colour)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "not in the metrics", ha="center", va="center", transform=ax.transAxes)
    axes[0].legend()
    figure.savefig(output, dpi=dpi)


def _draw(ax, series: Series, metrics: tuple[str, ...], label: str, colour: str) -> None:
    styles = ({"linestyle": "-"}, {"linestyle": "--", "marker": "o"})
    for metric, style in zip(metrics, styles):
        points = sorted(series.get(metric, {}).items())
        if points:
            suffix = " (validation)" if metric.startswith("valid_") else ""
            ax.plot(*zip(*points), color=colour, label=label + suffix, **style)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", metavar="RUN.jsonl", help="metrics files written by --metrics-jsonl")
    parser.add_argument("--output", required=True, help="the picture to write: .png, .svg or .pdf")
    parser.add_argument("--labels", nargs="+", help="one legend label per file (default: the file name)")
    parser.add_argument("--width", type=float, default=12.0, help="inches (default: 12)")
    parser.add_argument("--height", type=float, default=7.0, help="inches (default: 7)")
    parser.add_argument("--dpi", type=int, default=100, help="pixels per inch (default: 100)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    labels = args.labels or [path.removesuffix(".jsonl") for path in args.metrics]
    if len(labels) != len(args.metrics):
        parser.error(f"--labels names {len(labels)} runs but {len(args.metrics)} files were given")
    if len(set(labels)) != len(labels):
        parser.error("two runs have the same label; name them with --labels")
    if importlib.util.find_spec("matplotlib") is None:
        parser.exit(1, "plot_metrics.py: error: needs matplotlib: pip install 'megatron-lite[plot]'\n")
    try:
        runs = {label: read_metrics(path) for label, path in zip(labels, args.metrics)}
    except OSError as error:
        parser.exit(1, f"plot_metrics.py: error: cannot read {error.filename}: {error.strerror}\n")
    plot_runs(runs, args.output, args.width, args.height, args.dpi)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
