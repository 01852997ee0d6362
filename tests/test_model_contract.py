"""A model chunk is what model/contract.py says: GPTModel is one, and a module that lacks part of the contract
is refused when it is wrapped for data parallelism, with what it lacks named."""

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_split import model_chunk_plans
from megatron_lite.model.contract import check_model_chunk
from megatron_lite.optim.data_parallel import DistributedDataParallel
from megatron_lite.parallel.state import ParallelState

TINY = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64,
        "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 64, "seq_length": 16,
        "max_position_embeddings": 16}


def gpt_chunk() -> torch.nn.Module:
    config = make_config(TINY, 1)
    return pretrain_gpt.model_provider(config, ParallelState.single(), model_chunk_plans(config, 0)[0],
                                       torch.device("cpu"))


class PlainLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pstate = ParallelState.single()
        self.proj = torch.nn.Linear(4, 4)


class ContractWithoutSpecs(PlainLinear):
    def named_global_parameters(self):
        return self.named_parameters()

    def shared_embedding_parameters(self):
        return []

    def set_input_tensor(self, tensor):
        pass

    def sharding_units(self):
        return []

    def rng_trackers(self):
        return []

    def named_global_buffers(self):
        return []

    def training_hooks(self):
        return None


def test_gpt_model_is_a_model_chunk():
    chunk = gpt_chunk()
    check_model_chunk(chunk)
    assert chunk.sharding_units() == list(chunk.decoder.layers)
    wrapped = DistributedDataParallel(chunk, ParallelState.single())
    assert wrapped.rng_trackers() == chunk.rng_trackers() and len(chunk.rng_trackers()) == 1
    assert wrapped.pstate is chunk.pstate


def test_a_module_without_the_contract_is_refused_at_wrap_time():
    with pytest.raises(TypeError, match="PlainLinear is not a model chunk .* lacks named_global_parameters, "
                                        "shared_embedding_parameters, set_input_tensor, sharding_units, rng_trackers"):
        DistributedDataParallel(PlainLinear(), ParallelState.single())


def test_parameters_without_a_shard_spec_are_refused_by_name():
    with pytest.raises(TypeError, match=r"ContractWithoutSpecs: parameters without a ShardSpec .*: proj.weight, "
                                        r"proj.bias"):
        DistributedDataParallel(ContractWithoutSpecs(), ParallelState.single())


def test_building_a_model_leaves_the_default_generator_alone():
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    gpt_chunk()
    assert torch.equal(torch.rand(4), expected)
