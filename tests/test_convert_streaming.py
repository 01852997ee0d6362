"""Streamed conversion (tools/convert_checkpoint.py over megatron_lite/hf/): a layer at a time, giving the same
tensors as converting everything in memory, round trips that are tensor-identical, files in the formats the
loaders read, and memory bounded by a layer.

The reference conversion here is written from the HF tensors and the family's name table alone (its rules and
transforms), not from the streaming code. Memory is measured by a ledger of the tensor storages alive at once
(weak references: a storage leaves the ledger when its memory is freed), counting what the readers hand out
and what the writers are handed, rather than by RSS, so the bound holds on a loaded machine too."""

import os
import pickle
import random
import warnings
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from megatron_lite.checkpoint import directory
from megatron_lite.checkpoint.checkpointing import read_checkpoint_tensors
from megatron_lite.checkpoint.planner import ShardedSavePlanner, state_dict_of
from megatron_lite.checkpoint.sharded import ShardedTensor
from megatron_lite.config.layer_specs import layer_specs
from megatron_lite.hf import families, safetensors_files, weights
from megatron_lite.hf.checkpoint import ModelCheckpoint, config_from_metadata, resolve_checkpoint
from megatron_lite.hf.checkpoint_parts import PartsWriter
from megatron_lite.hf.safetensors_files import HFWeights, ShardedWriter, shard_plan
from megatron_lite.hf.safetensors_format import StreamedFile
from tests.helpers import convert, hf_config, perturb_biases_and_norms

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FAMILIES = ["llama", "llama_tied", "gpt2", "mixtral", "qwen2_moe", "deepseek_v3"]
DEPTH = 6  # layers of the models here: deep enough that the whole model is well above two layers


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (HF directory, converted directory)}: small random models of DEPTH layers, converted once."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("streaming")
    dirs = {}
    for index, family in enumerate(FAMILIES):
        config = hf_config(family)
        values = {k: v for k, v in config.to_dict().items() if not k.endswith("layer_types")}  # sized by the depth
        config = type(config).from_dict({**values, ("n_layer" if family == "gpt2" else "num_hidden_layers"): DEPTH})
        torch.manual_seed(index)
        model = AutoModelForCausalLM.from_config(config)
        perturb_biases_and_norms(model)
        hf_dir, mlite_dir = str(root / family / "hf"), str(root / family / "mlite")
        model.save_pretrained(hf_dir)
        convert("--direction", "hf-to-mlite", "--load-dir", hf_dir, "--save-dir", mlite_dir)
        dirs[family] = (hf_dir, mlite_dir)
    return dirs


def model_config(mlite_dir: str):
    return config_from_metadata(directory.read_metadata(resolve_checkpoint(mlite_dir))).model


def model_type(mlite_dir: str) -> str:
    return directory.read_metadata(resolve_checkpoint(mlite_dir))["hf"]["model_type"]


def reference_conversion(family: str, hf: dict[str, torch.Tensor], m) -> dict[str, torch.Tensor]:
    """Our tensors made from HF's by the name table, everything in memory: each rule of the head, of every layer
    (an MoE or a dense layer's, for each expert) and of the tail, joined by its transform."""
    table = families.FAMILIES[family].name_table(m)
    expanded = [(rule, {}) for rule in table.head]
    for layer, spec in enumerate(layer_specs(m)):
        for rule in table.layer(spec):
            experts = range(m.num_experts) if "{expert}" in rule.ours else [None]
            expanded += [(rule, {"layer": layer, "expert": expert}) for expert in experts]
    expanded += [(rule, {}) for rule in table.tail]
    return {rule.ours.format(**values): rule.transform.join([hf[name.format(**values)] for name in rule.theirs], m)
            for rule, values in expanded}


def assert_same_tensors(found: dict, expected: dict, where: str = "") -> None:
    assert sorted(found) == sorted(expected), where
    for name, tensor in expected.items():
        assert found[name].dtype == tensor.dtype and torch.equal(found[name], tensor), f"{where}: {name}"


def hf_tensors(folder: str) -> dict[str, torch.Tensor]:
    return {name: tensor for file in sorted(os.listdir(folder)) if file.endswith(".safetensors")
            for name, tensor in load_file(os.path.join(folder, file)).items()}


# -------------------------------------------------------------------------------------------------------
# The same tensors as an all-in-memory conversion, and round trips


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_import_equals_the_name_table_conversion(models, family):
    hf_dir, mlite_dir = models[family]
    expected = reference_conversion(model_type(mlite_dir), hf_tensors(hf_dir), model_config(mlite_dir))
    converted = read_checkpoint_tensors(resolve_checkpoint(mlite_dir))  # the training checkpoint reader
    assert_same_tensors(converted, expected, family)
    files = sorted(name for name in os.listdir(resolve_checkpoint(mlite_dir)) if name.endswith(".distcp"))
    assert files == sorted(f"__{part}_0.distcp" for part in range(len(files))) and len(files) > DEPTH


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_sharded_files_is_tensor_identical(models, family, tmp_path, capsys):
    """HF -> ours -> HF in small shards -> ours -> HF: every step gives back the same tensors."""
    hf_dir, mlite_dir = models[family]
    convert("--direction", "mlite-to-hf", "--load-dir", mlite_dir, "--save-dir", str(tmp_path / "sharded"),
            "--max-shard-size", "20KB")
    err = capsys.readouterr().err
    assert "converting to" in err and "layer" in err and "writing safetensors" in err
    index = safetensors_files._weight_map(str(tmp_path / "sharded" / safetensors_files.INDEX_NAME))
    assert len(set(index.values())) > DEPTH
    assert_same_tensors(hf_tensors(str(tmp_path / "sharded")), hf_tensors(hf_dir), family)
    convert("--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "sharded"),
            "--save-dir", str(tmp_path / "again"))
    assert_same_tensors(read_checkpoint_tensors(resolve_checkpoint(str(tmp_path / "again"))),
                        read_checkpoint_tensors(resolve_checkpoint(mlite_dir)), family)
    convert("--direction", "mlite-to-hf", "--load-dir", str(tmp_path / "again"), "--save-dir", str(tmp_path / "back"))
    assert sorted(os.listdir(tmp_path / "back")) == sorted(os.listdir(hf_dir))
    assert_same_tensors(load_file(tmp_path / "back/model.safetensors"), hf_tensors(hf_dir), family)


# -------------------------------------------------------------------------------------------------------
# File formats: safetensors as save_file writes it, DCP as one save writes it

MIXED = {"b.bias": (7,), "a.weight": (5, 3), "scalar": (), "empty": (0, 4), "zeta.flag": (3,), "mask": (2, 2),
         "émbed": (4, 2)}


def mixed_tensors() -> dict[str, torch.Tensor]:
    dtypes = [torch.bfloat16, torch.float32, torch.int64, torch.float16, torch.bool, torch.float8_e4m3fn, torch.int8]
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator).to(dtype) if dtype.is_floating_point
            else torch.randint(0, 2, shape, generator=generator).to(dtype)
            for (name, shape), dtype in zip(MIXED.items(), dtypes)}


def test_streamed_file_equals_save_file_byte_for_byte(tmp_path):
    tensors = mixed_tensors()
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    streamed = StreamedFile(str(tmp_path / "streamed.safetensors"),
                            {name: t.to("meta") for name, t in tensors.items()}, {"format": "pt"})
    names = list(tensors)
    random.Random(0).shuffle(names)  # tensors arrive in any order
    for name in names:
        assert not streamed.complete
        streamed.write(name, tensors[name])
    assert streamed.complete
    streamed.close()
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_sharded_writer_writes_save_files_shards_as_they_fill(tmp_path):
    generator = torch.Generator().manual_seed(1)
    tensors = {f"layers.{i}.{kind}": torch.randn(rows, 16, generator=generator)
               for i in range(5) for kind, rows in (("a", 8), ("b", 24))}
    done = []
    with ShardedWriter(str(tmp_path), {n: t.to("meta") for n, t in tensors.items()}, 2000, done.append) as writer:
        for count, (name, tensor) in enumerate(tensors.items()):
            writer.write(name, tensor)
            assert len(done) >= (count - 1) // 2  # a shard (two tensors of 2 KB) is closed once its last is in
    shards = shard_plan(tensors, 2000)
    assert done == writer.files[:-1] and len(done) == len(shards) > 2
    assert writer.files[-1] == "model.safetensors.index.json"
    for file, shard in zip(done, shards):
        save_file({n: tensors[n] for n in shard}, tmp_path / "reference.safetensors", metadata={"format": "pt"})
        assert (tmp_path / file).read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert safetensors_files._weight_map(str(tmp_path / writer.files[-1])) == \
        {n: file for file, shard in zip(done, shards) for n in shard}


def test_checkpoint_written_in_parts_has_the_index_of_one_save(tmp_path):
    tensors = mixed_tensors()
    pieces = [ShardedTensor.whole(name, tensor) for name, tensor in tensors.items()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state_dict_of(pieces), planner=ShardedSavePlanner(pieces),
                 storage_writer=dcp.FileSystemWriter(str(tmp_path / "one")), no_dist=True)
    writer = PartsWriter(str(tmp_path / "parts"))
    names = list(tensors)
    for part in (names[:2], names[2:3], names[3:]):
        writer.save({name: tensors[name] for name in part})
    writer.close()
    with pytest.raises(ValueError, match="'scalar' is in two parts"):
        writer.save({"scalar": tensors["scalar"]})
    one, parts = (pickle.loads((tmp_path / folder / ".metadata").read_bytes()) for folder in ("one", "parts"))
    assert parts.state_dict_metadata == one.state_dict_metadata
    assert {info.relative_path for info in parts.storage_data.values()} == {"__0_0.distcp", "__1_0.distcp",
                                                                          "__2_0.distcp"}
    assert_same_tensors(read_checkpoint_tensors(str(tmp_path / "parts")), tensors)


def test_hf_weights_reads_into_memory_of_its_own_and_maps_no_file(models):
    hf_dir, _ = models["llama"]
    hf = HFWeights(hf_dir)
    read = {name: hf[name] for name in hf}
    assert_same_tensors(read, load_file(os.path.join(hf_dir, "model.safetensors")))
    with open("/proc/self/maps") as f:
        assert "model.safetensors" not in f.read()
    first = next(iter(read))
    assert hf[first].data_ptr() != read[first].data_ptr()


# -------------------------------------------------------------------------------------------------------
# Memory: bounded by a layer


class Ledger:
    """The bytes of the tracked tensor storages that are alive, and the most that ever were at once."""

    def __init__(self):
        self.alive: dict[int, int] = {}
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()  # one Python object per storage while it lives
        if id(storage) not in self.alive:
            self.alive[id(storage)] = storage.nbytes()
            weakref.finalize(storage, self.alive.pop, id(storage), None)
        self.peak = max(self.peak, sum(self.alive.values()))
        return tensor


def layer_bound(hf: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Twice the largest unit (a layer's tensors together, or a tensor outside the layers), and all the bytes."""
    units = {}
    for name, tensor in hf.items():
        parts = name.split(".")
        key = ".".join(parts[:3]) if parts[1] in ("layers", "h") else name
        units[key] = units.get(key, 0) + tensor.numel() * tensor.element_size()
    return 2 * max(units.values()), sum(units.values())


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_import_holds_at_most_two_layers_of_tensors(models, family, tmp_path, monkeypatch):
    """What HFWeights reads and what the checkpoint writer is given stay under twice the largest layer (or
    vocabulary table), while the whole model is well above it."""
    hf_dir, _ = models[family]
    bound, total = layer_bound(hf_tensors(hf_dir))
    assert total > 1.5 * bound
    ledger = Ledger()
    read, save = HFWeights.__getitem__, PartsWriter.save
    monkeypatch.setattr(HFWeights, "__getitem__", lambda self, name: ledger.track(read(self, name)))
    monkeypatch.setattr(PartsWriter, "save",
                        lambda self, part: save(self, {n: ledger.track(t) for n, t in part.items()}))
    convert("--direction", "hf-to-mlite", "--load-dir", hf_dir, "--save-dir", str(tmp_path / "mlite"))
    assert 0 < ledger.peak <= bound, (ledger.peak, bound, total)

    everything = Ledger()  # the same instrument sees a conversion that holds everything
    monkeypatch.setattr(HFWeights, "__getitem__", lambda self, name: everything.track(read(self, name)))
    hf = HFWeights(hf_dir)
    hf.names = weights.normalize_hf_names(family, [n for n in hf.names if weights.is_weight(n)])
    converted = weights.to_megatron(family, hf, model_config(str(tmp_path / "mlite")))
    assert everything.peak > bound and len(converted) > DEPTH


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_export_holds_at_most_two_layers_of_tensors(models, family, tmp_path, monkeypatch):
    """What the checkpoint reader hands out and what the safetensors writer is given stay under twice the
    largest layer, with the whole model in one file and in many."""
    hf_dir, mlite_dir = models[family]
    bound, total = layer_bound(hf_tensors(hf_dir))
    read, write = ModelCheckpoint.read, ShardedWriter.write
    for shard_size in ("5GB", "20KB"):
        ledger = Ledger()
        monkeypatch.setattr(ModelCheckpoint, "read", lambda self, names, ledger=ledger:
                            {n: ledger.track(t) for n, t in read(self, names).items()})
        monkeypatch.setattr(ShardedWriter, "write",
                            lambda self, name, t, ledger=ledger: write(self, name, ledger.track(t)))
        convert("--direction", "mlite-to-hf", "--load-dir", mlite_dir, "--save-dir", str(tmp_path / shard_size),
                "--max-shard-size", shard_size)
        assert 0 < ledger.peak <= bound < total, (shard_size, ledger.peak, bound, total)
    assert_same_tensors(hf_tensors(str(tmp_path / "5GB")), hf_tensors(hf_dir))
