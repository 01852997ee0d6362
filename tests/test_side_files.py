"""Every side file the package reads, garbled or of the wrong shape, is one line naming the file and what is wrong:
--data-args-path, --config, the checkpoint tracker, metadata.json and DCP index, tokenizer files, Hugging Face
config.json / index / generation_config.json / weights, the W&B run id; a damaged index cache is rebuilt."""

import json
import os

import numpy as np
import pytest

from megatron_lite.checkpoint import checksums, directory
from megatron_lite.checkpoint.planner import CheckpointError, SafeFileSystemReader
from megatron_lite.config.arguments import ConfigError, parse_config
from megatron_lite.config.sections import Config
from megatron_lite.data.builder import read_data_args
from megatron_lite.data.index_cache import load_or_build
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.errors import DataError, UserError
from megatron_lite.files import read_json_object
from megatron_lite.hf.configs import ConversionError
from megatron_lite.hf.families import model_values_from_hf
from megatron_lite.hf.safetensors_files import HFWeights, generation_token_ids, read_hf_config
from megatron_lite.training.logging import WANDB_RUN_ID_FILE, wandb_run_id
from tests.test_data_tokenizers import _hf_tokenizer_json

BINARY = bytes(range(256)) * 4  # not UTF-8 from byte 128 on, and a NUL at byte 0
GARBAGE = {  # what a side file holds -> what the error says about it
    "binary": (BINARY, r"a binary file, not text"),
    "latin-1": ("caf\xe9 = 1\n".encode("latin-1"), r"not UTF-8 text \(byte 3 is b'\\xe9'\)"),
    "empty": (b"", r"empty, where JSON was expected"),
    "cut short": (b'{"iteration": 2, "consumed_sa',
                  r"not valid JSON \(line 1 column 18: Unterminated string\); the file ends early"),
    "a list": (b"[1, 2]", r"holds a list, not a JSON object"),
    "a number": (b"7", r"holds an integer, not a JSON object"),
}


def one_line(error: pytest.ExceptionInfo, path) -> str:
    message = str(error.value)
    assert str(path) in message and "\n" not in message, message
    return message


@pytest.mark.parametrize("case", list(GARBAGE))
def test_a_garbled_json_file_is_one_line_naming_it(tmp_path, case):
    content, expected = GARBAGE[case]
    (tmp_path / "side.json").write_bytes(content)
    with pytest.raises(DataError, match=expected) as error:
        read_json_object(str(tmp_path / "side.json"), DataError)
    one_line(error, tmp_path / "side.json")


def test_a_directory_or_a_missing_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "side.json").mkdir()
    with pytest.raises(DataError, match=r"side.json: cannot read it \(Is a directory\)"):
        read_json_object(str(tmp_path / "side.json"), DataError)
    with pytest.raises(DataError, match=r"gone.json: cannot read it \(No such file or directory\)"):
        read_json_object(str(tmp_path / "gone.json"), DataError)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its permissions")
def test_an_unreadable_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "side.json"
    path.write_text("{}")
    path.chmod(0)
    with pytest.raises(DataError, match=r"side.json: cannot read it \(Permission denied\)"):
        read_json_object(str(path), DataError)


# ---------------------------------------------------------------------------------------------------------
# Run inputs: --data-args-path, --config


def test_a_binary_data_args_file_is_a_data_error(tmp_path):
    (tmp_path / "blend.txt").write_bytes(BINARY)
    with pytest.raises(DataError, match=r"--data-args-path .*blend.txt: a binary file, not text") as error:
        read_data_args(str(tmp_path / "blend.txt"))
    one_line(error, tmp_path / "blend.txt")
    (tmp_path / "latin.txt").write_bytes("0.5 donn\xe9es 0.5 b".encode("latin-1"))
    with pytest.raises(DataError, match=r"--data-args-path .*latin.txt: not UTF-8 text"):
        read_data_args(str(tmp_path / "latin.txt"))


def test_a_binary_data_args_file_stops_every_rank_with_one_line(tmp_path):
    from tests.test_cli_errors import fails_on_every_rank_with_one_line

    (tmp_path / "blend.txt").write_bytes(BINARY)
    fails_on_every_rank_with_one_line(
        ["--model-preset", "llama-tiny", "--train-iters", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size",
         "128", "--data-args-path", str(tmp_path / "blend.txt")],
        f"--data-args-path {tmp_path / 'blend.txt'}: a binary file, not text (a NUL byte at byte 0)")


@pytest.mark.parametrize("content, expected", [
    (BINARY, r"--config .*run.yaml: a binary file, not text"),
    ("lr: 3e-4\nname: caf\xe9\n".encode("latin-1"), r"--config .*run.yaml: not UTF-8 text"),
    (b"- lr\n- 3e-4\n", r"--config .*run.yaml must hold a mapping of flag names to values"),
])
def test_a_garbled_yaml_config_is_a_config_error(tmp_path, content, expected):
    (tmp_path / "run.yaml").write_bytes(content)
    with pytest.raises(ConfigError, match=expected) as error:
        parse_config(["--config", str(tmp_path / "run.yaml")])
    one_line(error, tmp_path / "run.yaml")


# ---------------------------------------------------------------------------------------------------------
# Checkpoint files


METADATA = {"format": 1, "iteration": 1, "consumed_samples": 4, "optimizer": {}, "rng_layout": "tp1",
            "config": {"model": {}}, "files": {".metadata": {"bytes": 3, "crc32": "00000000"}}}


def fake_checkpoints(root, iterations=(1, 2), metadata=None) -> None:
    """Iteration directories that count as complete (metadata.json and a DCP index), with the tracker."""
    for iteration in iterations:
        path = directory.checkpoint_path(str(root), iteration)
        os.makedirs(path)
        with open(os.path.join(path, directory.METADATA_FILE), "w") as f:
            json.dump({**METADATA, "iteration": iteration} if metadata is None else metadata, f)
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(b"DCP")
    with open(os.path.join(str(root), directory.TRACKER_FILE), "w") as f:
        f.write(f"{iterations[-1]}\n")


@pytest.mark.parametrize("content, expected", [
    (b"iteration two\n", r"holds 'iteration two', not an iteration number"),
    (BINARY, r"a binary file, not text"),
    (b"", r"holds '', not an iteration number"),
])
def test_a_garbled_tracker_names_itself_and_the_newest_complete_iteration(tmp_path, content, expected):
    fake_checkpoints(tmp_path)
    (tmp_path / directory.TRACKER_FILE).write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"{directory.TRACKER_FILE}: {expected}.*the newest complete one is "
                                              r"iteration 2: pass --ckpt-step 2") as error:
        directory.iteration_to_load(str(tmp_path))
    one_line(error, tmp_path / directory.TRACKER_FILE)
    assert directory.iteration_to_load(str(tmp_path), ckpt_step=1) == 1  # the way out it offers


@pytest.mark.parametrize("saved, expected", [
    ([METADATA], r"holds a list, not a JSON object"),
    ({**METADATA, "consumed_samples": "4"}, r"'consumed_samples' is a string \"4\", expected an integer"),
    ({key: value for key, value in METADATA.items() if key != "rng_layout"}, r"has no 'rng_layout'"),
    ({**METADATA, "files": {".metadata": 3}}, r"the record of .metadata under 'files' is not an object"),
    ({**METADATA, "files": {".metadata": {"bytes": 3}}}, r"the record of .metadata under 'files' has no 'crc32'"),
    ({**METADATA, "config": {"model": [1]}}, r"config section 'model' is not an object"),
    ({**METADATA, "config": {"model": {"num_layers": "2"}}}, r"config.model.num_layers is \"2\", expected int"),
    ({**METADATA, "config": {"data": {"data_path": "a"}}}, r"config.data.data_path is \"a\", expected list\[str\]"),
    ({**METADATA, "config": {"model": {"ffn_hidden_size": 1.5}}},
     r"config.model.ffn_hidden_size is 1.5, expected int \| None"),
])
def test_metadata_json_of_the_wrong_shape_names_the_file_and_the_previous_checkpoint(tmp_path, saved, expected):
    fake_checkpoints(tmp_path)
    path = directory.checkpoint_path(str(tmp_path), 2)
    with open(os.path.join(path, directory.METADATA_FILE), "w") as f:
        json.dump(saved, f)
    with pytest.raises(CheckpointError, match=rf"metadata.json:? {expected}; pass --ckpt-step 1 to load the "
                                              r"previous complete checkpoint") as error:
        directory.read_metadata(path)
    one_line(error, os.path.join(path, directory.METADATA_FILE))
    assert directory.read_metadata(directory.checkpoint_path(str(tmp_path), 1))["iteration"] == 1


def test_a_run_loading_a_metadata_json_that_is_not_an_object_stops_with_one_line(tmp_path):
    from tests.test_checkpoint_integrity import train

    root = str(tmp_path)
    train({"save": root, "save_interval": 1})
    path = os.path.join(directory.checkpoint_path(root, 2), directory.METADATA_FILE)
    with open(path, "w") as f:
        f.write('["iteration", 2]')
    with pytest.raises(CheckpointError, match=r"metadata.json: holds a list, not a JSON object; pass --ckpt-step 1"):
        train({"load": root, "train_iters": 3})


@pytest.mark.parametrize("content", [BINARY, b"\x80\x04\x95", b""])
def test_a_garbled_dcp_index_is_a_checkpoint_error(tmp_path, content):
    (tmp_path / ".metadata").write_bytes(content)
    with pytest.raises(CheckpointError, match=r"\.metadata is not a readable DCP index .*the checkpoint is damaged"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()


# ---------------------------------------------------------------------------------------------------------
# Tokenizer files


def test_a_cut_short_tokenizer_config_beside_a_valid_tokenizer_json_is_named(tmp_path):
    _hf_tokenizer_json(tmp_path / "tokenizer.json", ["<|endoftext|>", "<|pad|>"])
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>", "pad_tok')
    with pytest.raises(DataError, match=r"tokenizer_config.json: not valid JSON .*the file ends early") as error:
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    one_line(error, tmp_path / "tokenizer_config.json")


@pytest.mark.parametrize("config, expected", [
    (["<|endoftext|>"], r"holds a list, not a JSON object"),
    ({"eos_token": 50256}, r"'eos_token' is 50256; give the token's text, or an object with its text as \"content\""),
    ({"pad_token": {"id": 3}}, r"'pad_token' is \{\"id\": 3\}; give the token's text"),
])
def test_a_tokenizer_config_of_the_wrong_shape_is_named(tmp_path, config, expected):
    _hf_tokenizer_json(tmp_path / "tokenizer.json", ["<|endoftext|>"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=expected) as error:
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    one_line(error, tmp_path / "tokenizer_config.json")


@pytest.mark.parametrize("content, expected", [
    (b'{"version": "1.0", "model": {"type": "BPE", "vocab"', r"tokenizer.json is not a Hugging Face tokenizer.json"),
    (b"[]", r"tokenizer.json is not a Hugging Face tokenizer.json"),
    (BINARY, r"tokenizer.json is not a Hugging Face tokenizer.json .*if it is a sentencepiece .model"),
])
def test_a_garbled_tokenizer_json_is_named(tmp_path, content, expected):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(DataError, match=expected) as error:
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tokenizer.json"))
    one_line(error, tmp_path / "tokenizer.json")


def test_a_directory_where_a_tokenizer_or_dataset_file_belongs_is_named(tmp_path):
    (tmp_path / "tokenizer.model").mkdir()
    with pytest.raises(DataError, match=r"tokenizer model .*tokenizer.model: cannot read it \(Is a directory\)"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "tokenizer.model"))
    (tmp_path / "tokenizer.json").mkdir()
    with pytest.raises(DataError, match=r"tokenizer .*tokenizer.json: cannot read it \(Is a directory\)"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    (tmp_path / "corpus.idx").mkdir()
    (tmp_path / "corpus.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"corpus.idx is a directory, not a file"):
        IndexedDataset(str(tmp_path / "corpus"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its permissions")
def test_an_unreadable_checkpoint_file_is_named_as_damage(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"weights")
    (tmp_path / "__0_0.distcp").chmod(0)
    records = {"__0_0.distcp": {"bytes": 7, "crc32": "00000000"}}
    assert checksums.damaged_file(str(tmp_path), records, ["__0_0.distcp"]) == \
        "__0_0.distcp cannot be read (Permission denied)"


# ---------------------------------------------------------------------------------------------------------
# Hugging Face model directories


HF_FILES = [  # (file, the reader of its folder, content, what the error says)
    ("config.json", read_hf_config, BINARY, r"config.json: a binary file, not text"),
    ("config.json", read_hf_config, b'{"model_type": "llama", "hidden_size": 6',
     r"config.json: not valid JSON .*the file ends early"),
    ("config.json", read_hf_config, b'["llama"]', r"config.json: holds a list, not a JSON object"),
    ("model.safetensors.index.json", HFWeights, b'{"weight_map": ["model-1.safetensors"]}',
     r"'weight_map' should be an object mapping each tensor name"),
    ("model.safetensors.index.json", HFWeights, b'{"metadata": {}, "weight_map": {"a": 1}}',
     r"'weight_map' should be an object mapping each tensor name"),
    ("model.safetensors.index.json", HFWeights, b'{"weight_map": {"a": "model-1.safe',
     r"not valid JSON .*the file ends early"),
    ("model.safetensors", HFWeights, BINARY, r"weights file .*model.safetensors is not a safetensors file"),
    ("generation_config.json", generation_token_ids, b'{"bos_token_id": 1, "eos_token_id": [2, 3',
     r"not valid JSON .*the file ends early"),
    ("generation_config.json", generation_token_ids, b'{"eos_token_id": "</s>"}',
     r"'eos_token_id' is \"</s>\"; a token id is an integer"),
    ("generation_config.json", generation_token_ids, b"[1, 2]", r"holds a list, not a JSON object"),
]


@pytest.mark.parametrize("name, reader, content, expected", HF_FILES)
def test_a_garbled_file_of_an_hf_model_directory_is_a_conversion_error(tmp_path, name, reader, content, expected):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConversionError, match=expected) as error:
        reader(str(tmp_path))
    one_line(error, tmp_path / name)


def test_generation_config_token_ids_may_be_lists_or_null(tmp_path):
    valid = {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": None}
    (tmp_path / "generation_config.json").write_text(json.dumps(valid))
    assert generation_token_ids(str(tmp_path)) == valid


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "max_position_embeddings": 64, "vocab_size": 100}


@pytest.mark.parametrize("change, expected", [
    ({"hidden_size": "64"}, r"config.json: 'hidden_size' is \"64\", expected an integer"),
    ({"num_hidden_layers": 2.5}, r"config.json: 'num_hidden_layers' is 2.5, expected an integer"),
    ({"rms_norm_eps": "small"}, r"config.json: 'rms_norm_eps' is \"small\", expected a number"),
    ({"rope_scaling": ["llama3"]}, r"config.json: 'rope_scaling' is \[\"llama3\"\], expected an object"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "8"}}, r"config.json's rope_scaling: 'factor' is \"8\""),
])
def test_an_hf_config_value_of_the_wrong_type_is_named(change, expected):
    assert model_values_from_hf(LLAMA)["hidden_size"] == 64
    with pytest.raises(ConversionError, match=expected):
        model_values_from_hf({**LLAMA, **change})


# ---------------------------------------------------------------------------------------------------------
# The dataset index cache and the W&B run id


def _cached(cache_dir: str, builds: list) -> dict:
    def build():
        builds.append(1)
        return {"index": np.arange(10, dtype=np.int64), "sizes": np.full(3, 7, dtype=np.int32)}

    return load_or_build(cache_dir, {"class": "Test", "seed": 1}, build)


@pytest.mark.parametrize("damage", ["binary marker", "cut-short marker", "marker of the wrong shape",
                                    "truncated array"])
def test_a_damaged_index_cache_is_rebuilt_with_a_warning(tmp_path, capsys, damage):
    builds = []
    first = {name: np.array(array) for name, array in _cached(str(tmp_path), builds).items()}
    [marker] = [path for path in tmp_path.iterdir() if path.name.endswith("-description.json")]
    if damage == "binary marker":
        marker.write_bytes(BINARY)
    elif damage == "cut-short marker":
        marker.write_text(marker.read_text()[:30])
    elif damage == "marker of the wrong shape":
        marker.write_text('{"arrays": "index"}')
    else:
        [array] = [path for path in tmp_path.iterdir() if path.name.endswith("-index.npy")]
        array.write_bytes(array.read_bytes()[:100])
    again = _cached(str(tmp_path), builds)
    assert len(builds) == 2 and all(np.array_equal(again[name], first[name]) for name in first)
    assert f"the dataset index cache {marker} (or an array it lists) is damaged; rebuilding it" in \
        capsys.readouterr().err
    _cached(str(tmp_path), builds)
    assert len(builds) == 2  # the rebuilt cache is read, not built a third time


@pytest.mark.parametrize("content, expected", [
    (BINARY, r"a binary file, not text"),
    (b"my run\n", r"holds 'my run', not a W&B run id; remove it to start a new W&B run"),
])
def test_a_garbled_wandb_run_id_file_is_named(tmp_path, monkeypatch, content, expected):
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    config = Config()
    config.checkpoint.load = str(tmp_path)
    (tmp_path / WANDB_RUN_ID_FILE).write_bytes(content)
    with pytest.raises(UserError, match=expected) as error:
        wandb_run_id(config)
    one_line(error, tmp_path / WANDB_RUN_ID_FILE)
    (tmp_path / WANDB_RUN_ID_FILE).write_text("3kd9x2ab\n")
    assert wandb_run_id(config) == "3kd9x2ab"
