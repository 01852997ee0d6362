"""tools/plot_metrics.py draws the curves of several metrics JSONL files into one picture of the asked size."""

import json
import struct
import sys

import pytest

from tools import plot_metrics


def _write_run(path, losses: list[float], valid: dict[int, float]) -> None:
    with open(path, "w") as f:
        for iteration, loss in enumerate(losses, 1):
            f.write(json.dumps({"iteration": iteration, "lm_loss": loss, "lr": 1e-3 * iteration, "grad_norm": 1.0,
                                "tokens_per_sec": 1000.0, "memory_gib": 0.5, "tokens_per_expert": [1, 2]}) + "\n")
            if iteration in valid:
                f.write(json.dumps({"iteration": iteration, "valid_lm_loss": valid[iteration]}) + "\n")


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])  # the IHDR chunk's width and height


def test_two_runs_render_to_a_png_of_the_asked_size(tmp_path, capsys):
    _write_run(tmp_path / "a.jsonl", [7.0, 6.0, 5.5, 5.0], {2: 6.2, 4: 5.3})
    _write_run(tmp_path / "b.jsonl", [7.1, 6.5, 6.0], {2: 6.6})
    output = tmp_path / "curves.png"
    assert plot_metrics.main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--labels", "A", "B",
                              "--output", str(output), "--width", "6", "--height", "4", "--dpi", "50"]) == 0
    assert _png_size(output) == (300, 200)
    assert f"wrote {output}" in capsys.readouterr().out


def test_downstream_scores_get_a_panel_of_their_own(tmp_path):
    path = tmp_path / "run.jsonl"
    _write_run(path, [7.0, 6.0, 5.5, 5.0], {2: 6.2, 4: 5.3})
    with open(path, "a") as f:
        for iteration, acc in ((2, 0.25), (4, 0.5)):
            f.write(json.dumps({"iteration": iteration, "downstream/cloze/acc": acc,
                                "downstream/cloze/acc_norm": acc / 2}) + "\n")
    figure = plot_metrics.plot_runs({"run": plot_metrics.read_metrics(str(path))}, str(tmp_path / "c.png"), 6, 6, 50)
    panel = figure.axes[-1]
    assert len(figure.axes) == 6 and panel.get_title() == "downstream"
    assert [tuple(line.get_ydata()) for line in panel.lines] == [(0.25, 0.5), (0.125, 0.25)]
    plain = tmp_path / "plain.jsonl"
    _write_run(plain, [7.0, 6.0], {})
    assert len(plot_metrics.plot_runs({"run": plot_metrics.read_metrics(str(plain))}, str(tmp_path / "p.png"), 6, 4,
                                      50).axes) == 5


def test_a_resumed_run_counts_the_later_record_of_an_iteration(tmp_path):
    path = tmp_path / "run.jsonl"
    _write_run(path, [7.0, 6.0, 5.5], {})
    with open(path, "a") as f:
        f.write('{"iteration": 3, "lm_lo')  # killed mid-write
        f.write("\n" + json.dumps({"iteration": 3, "lm_loss": 5.4}) + "\n")  # the resumed run trains 3 again
    series = plot_metrics.read_metrics(str(path))
    assert series["lm_loss"] == {1: 7.0, 2: 6.0, 3: 5.4}
    assert "tokens_per_expert" not in series


def test_without_matplotlib_the_error_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_:
        plot_metrics.main([str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "c.png")])
    assert exit_.value.code == 1
    assert "pip install 'megatron-lite[plot]'" in capsys.readouterr().err
