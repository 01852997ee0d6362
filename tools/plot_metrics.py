"""Plot training curves from metrics JSONL files (pretrain_gpt.py --metrics-jsonl), one line per run.

    python tools/plot_metrics.py checkpoints/demo/metrics.jsonl --output curves.png
    python tools/plot_metrics.py runs/tp2.jsonl runs/pp2.jsonl --labels TP2 PP2 --output compare.png

Five panels against iteration: loss (training solid, validation dashed with dots), learning rate, gradient
norm, tokens/s and memory; below them a sixth, downstream scores (`--eval-tasks`: each task/metric a line
style), when a run logged any. Each run is labelled with its file name (without .jsonl) unless --labels names
them. A resumed run appends to its file; where an iteration appears twice, the later record wins, as it is
the one the resumed run trained. Needs matplotlib: pip install 'megatron-lite[plot]'.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.errors import DataError  # noqa: E402
from megatron_lite.files import is_a  # noqa: E402
from megatron_lite.tool_args import ToolParser, output_file, positive_float, positive_int  # noqa: E402

# (panel title, metrics drawn in it: the first solid, the second dashed), in reading order.
PANELS = (("loss", ("lm_loss", "valid_lm_loss")), ("learning rate", ("lr",)), ("grad norm", ("grad_norm",)),
          ("tokens/s", ("tokens_per_sec",)), ("memory (GiB)", ("memory_gib",)))

Series = dict[str, dict[int, float]]  # metric -> iteration -> value
DOWNSTREAM = "downstream/"  # the prefix of --eval-tasks scores (task/metric)
_LINE_STYLES = ("-", "--", ":", "-.")
_MAX_PIXELS = 2**16  # matplotlib's Agg renderer refuses pictures this wide or high


def read_metrics(path: str) -> Series:
    """Every numeric metric of a JSONL file by iteration. Lines that are not metrics records (a JSON object with
    an integer "iteration"; a run killed mid-write leaves a cut line) are skipped, with one warning per file. A
    file that is not UTF-8 text, or holds no record at all, is a DataError naming it."""
    series: Series = {}
    records, skipped = 0, []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if "\x00" in line:
                    raise UnicodeDecodeError("utf-8", raw, raw.index(0), raw.index(0) + 1, "a NUL byte")
            except UnicodeDecodeError:
                raise DataError(f"{path}:{number} is not UTF-8 text: not a metrics JSONL file (a binary "
                                f"file?)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped.append(f"line {number} is not JSON")
                continue
            if not isinstance(record, dict) or not is_a(record.get("iteration"), int):
                skipped.append(f"line {number} is not an object with an integer \"iteration\"")
                continue
            records += 1
            for key, value in record.items():
                if key != "iteration" and is_a(value, float):
                    series.setdefault(key, {})[record["iteration"]] = value
    if not records:
        raise DataError(f"{path} holds no metrics records (JSON objects with an integer \"iteration\", one a line, "
                        f"as --metrics-jsonl writes them)" + (f"; {skipped[0]}" if skipped else ""))
    if skipped:
        print(f"plot_metrics.py: warning: {path}: skipped {len(skipped)} line(s) that are not metrics records "
              f"(first: {skipped[0]})", file=sys.stderr)
    return series


def plot_runs(runs: dict[str, Series], output: str, width: float, height: float, dpi: int):
    """Write the panels of every run to `output` (PNG, SVG or PDF by its extension), `width` x `height`
    inches at `dpi`: a PNG is width*dpi x height*dpi pixels. Returns the figure."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    downstream = sorted({name for series in runs.values() for name in series if name.startswith(DOWNSTREAM)})
    grid = figure.add_gridspec(3 if downstream else 2, 3)
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
    if downstream:
        _draw_downstream(figure.add_subplot(grid[2, :]), runs, downstream, colours)
    figure.savefig(output, dpi=dpi)
    return figure


def _draw_downstream(ax, runs: dict[str, Series], names: list[str], colours: list[str]) -> None:
    """Every run's downstream scores: a colour per run, a line style per task/metric."""
    for (label, series), colour in zip(runs.items(), colours):
        for index, name in enumerate(names):
            points = sorted(series.get(name, {}).items())
            if points:
                ax.plot(*zip(*points), color=colour, linestyle=_LINE_STYLES[index % len(_LINE_STYLES)], marker="o",
                        label=f"{label} {name.removeprefix(DOWNSTREAM)}")
    ax.set_title("downstream")
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _draw(ax, series: Series, metrics: tuple[str, ...], label: str, colour: str) -> None:
    styles = ({"linestyle": "-"}, {"linestyle": "--", "marker": "o"})
    for metric, style in zip(metrics, styles):
        points = sorted(series.get(metric, {}).items())
        if points:
            suffix = " (validation)" if metric.startswith("valid_") else ""
            ax.plot(*zip(*points), color=colour, label=label + suffix, **style)


def build_parser() -> ToolParser:
    parser = ToolParser(prog="plot_metrics.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", metavar="RUN.jsonl", help="metrics files written by --metrics-jsonl")
    parser.add_argument("--output", required=True, type=output_file, help="the picture to write: .png, .svg or .pdf")
    parser.add_argument("--labels", nargs="+", help="one legend label per file (default: the file name)")
    parser.add_argument("--width", type=positive_float, default=12.0, help="inches (default: 12)")
    parser.add_argument("--height", type=positive_float, default=7.0, help="inches (default: 7)")
    parser.add_argument("--dpi", type=positive_int, default=100, help="pixels per inch (default: 100)")
    return parser


def _check_format(parser: ToolParser, output: str) -> None:
    """Refuse an --output whose extension matplotlib cannot write (before any file is read)."""
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    extension = os.path.splitext(output)[1].lower().lstrip(".")
    if extension not in formats:
        found = f"ends in '.{extension}', not an image format matplotlib writes" if extension else "has no extension"
        others = ", .".join(sorted(set(formats) - {"png", "svg", "pdf"}))
        parser.error(f"--output {output} {found}; end it with .png, .svg or .pdf (matplotlib also writes .{others})")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    labels = args.labels or [path.removesuffix(".jsonl") for path in args.metrics]
    if len(labels) != len(args.metrics):
        parser.error(f"--labels names {len(labels)} runs but {len(args.metrics)} files were given")
    if len(set(labels)) != len(labels):
        parser.error("two runs have the same label; name them with --labels")
    for side, inches in (("width", args.width), ("height", args.height)):
        if inches * args.dpi >= _MAX_PIXELS:
            parser.error(f"--{side} {inches:g} at --dpi {args.dpi} is {inches * args.dpi:.0f} pixels; matplotlib "
                         f"draws fewer than {_MAX_PIXELS} a side")
    if importlib.util.find_spec("matplotlib") is None:
        parser.exit(1, "plot_metrics.py: error: needs matplotlib: pip install 'megatron-lite[plot]'\n")
    _check_format(parser, args.output)
    try:
        runs = {label: read_metrics(path) for label, path in zip(labels, args.metrics)}
    except OSError as error:
        parser.exit(1, f"plot_metrics.py: error: cannot read {error.filename}: {error.strerror}\n")
    except DataError as error:
        parser.exit(1, f"plot_metrics.py: error: {error}\n")
    try:
        plot_runs(runs, args.output, args.width, args.height, args.dpi)
    except OSError as error:
        parser.exit(1, f"plot_metrics.py: error: cannot write {args.output}: {error.strerror}\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
