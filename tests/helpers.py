"""Helpers shared by the test modules: training runs that return what the tests compare, and comparisons.

Runs go to spawned ranks by reference (tests/harness.py), so every function a rank runs lives at module
level here.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import re

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_split import model_chunk_plans
from megatron_lite.model.gpt import gather_vocab_logits
from megatron_lite.model.sharding import FlatShard, unshard
from megatron_lite.optim.data_parallel import DistributedDataParallel
from megatron_lite.optim.finalize_grads import finalize_model_grads
from megatron_lite.parallel import mappings
from megatron_lite.parallel.p2p import TRACE_ENV
from megatron_lite.parallel.state import ParallelState
from megatron_lite.pipeline.microbatch import ScheduleStats
from megatron_lite.training.loop import (
    build_data_iterator,
    build_datasets,
    build_model,
    get_schedule,
    initialize,
    pretrain,
    reduce_loss,
    setup_model_and_optimizer,
    train_step,
)
from tests.tolerances import assert_close_relative

# ---------------------------------------------------------------------------------------------------
# Training runs through pretrain()

# Steps of an equivalence run: a warm-up step, then three with Adam's state, which exercise every path of a step.
EQUIVALENCE_ITERS = 4

TINY_8_LAYERS = {
    "model_preset": "llama-tiny", "mock_data": True, "num_layers": 8, "hidden_size": 64, "ffn_hidden_size": 128,
    "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 256, "seq_length": 32,
    "max_position_embeddings": 32, "micro_batch_size": 2, "global_batch_size": 8, "train_iters": EQUIVALENCE_ITERS,
    "lr": 3e-3, "lr_warmup_iters": 1, "eval_interval": 1000, "log_interval": 1000,
}


def losses_and_norms(values: dict, world_size: int) -> list[tuple[float, float]]:
    """(loss, grad norm) of every step of pretrain()."""
    config = make_config(values, world_size)
    history = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    return [(h["lm_loss"], h["grad_norm"]) for h in history]


def pretrain_keeping_chunks(values: dict, world_size: int) -> tuple[list[dict], list]:
    """pretrain() with pretrain_gpt's model provider: its metrics and the model chunks it built, so the caller
    can read their weights afterwards. The chunks live only as long as the caller's reference: kept at module
    level, the last run's model would keep its process groups (three gloo threads each) alive in the test
    world for the rest of the session."""
    chunks = []

    def provider(config, pstate, plan, device):
        chunk = pretrain_gpt.model_provider(config, pstate, plan, device)
        chunks.append(chunk)
        return chunk

    history = pretrain(make_config(values, world_size), provider, pretrain_gpt.forward_step)
    return history, chunks


def parameter_records(chunks, tensor_of) -> list[tuple]:
    """(global name, replica, split rank, spec, tensor) for every parameter of this rank's model chunks.

    A replica is the (dp, cp, pp) position holding a copy: data-parallel replicas and the last stage's copy
    of tied embeddings are each compared with the reference on their own.
    """
    records = []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        pstate = module.pstate
        replica = (pstate.dp_rank, pstate.cp_rank, pstate.pp_rank)
        for name, param in module.named_global_parameters():
            split_rank = pstate.tensor_split.of(param.spec)[0]  # experts: their expert-tensor-parallel rank
            records.append((name, replica, split_rank, param.spec, tensor_of(param).detach().clone()))
    return records


def train_and_collect(values: dict, world_size: int):
    """Train with training.pretrain; per-step losses, final weights and the last step's gradients."""
    history, chunks = pretrain_keeping_chunks(values, world_size)
    return ([h["lm_loss"] for h in history], parameter_records(chunks, lambda p: p),
            parameter_records(chunks, lambda p: p.main_grad))


def join_shards(records_of_all_ranks: list[list[tuple]]) -> dict[tuple, object]:
    """{(name, replica): global tensor} from every rank's records, TP shards joined in TP-rank order. A tensor
    replicated over the TP (or expert-TP) ranks must be the same on each of them."""
    pieces: dict[tuple, dict] = {}
    for records in records_of_all_ranks:
        for name, replica, tp_rank, spec, tensor in records:
            pieces.setdefault((name, replica), {})[tp_rank] = (spec, tensor)
    joined = {}
    for key, by_rank in pieces.items():
        spec = by_rank[0][0]
        if spec.tp_dim is None:
            for rank, (_, copy) in by_rank.items():
                assert_close_relative(copy, by_rank[0][1], rel=1e-6, msg=f"{key[0]}: split rank {rank}'s copy")
        joined[key] = unshard([by_rank[r][1] for r in sorted(by_rank)], spec)
    return joined


def assert_tensors_match(parallel: dict[tuple, object], reference: dict[tuple, object], rel: float = 1e-5,
                         floor: float = 0.0):
    """Every parallel copy of every parameter equals the single-device tensor element by element, to `rel`
    of the tensor's largest element and at least an absolute `floor`; every reference parameter is present
    somewhere in the parallel run."""
    seen = set()
    for (name, _replica), tensor in parallel.items():
        assert_close_relative(tensor, reference[(name, (0, 0, 0))], rel=rel, msg=name, floor=floor)
        seen.add(name)
    assert seen == {name for name, _ in reference}


def assert_run_matches(parallel_results: list, reference_result, rel: float = 1e-5, tensor_rel: float = 1e-5):
    """Losses of every rank (each reports the global loss) equal the reference at every step to `rel`;
    final weights and last-step gradients equal the reference ones to `tensor_rel`.

    Weights get an absolute floor of `tensor_rel` (they are O(0.01-1) numbers): a parameter whose gradient
    is zero in exact arithmetic, such as GPT-2's key bias (softmax ignores a shift shared by all keys), is
    moved by Adam on rounding noise alone, by ~1e-6 per step, differently in every layout."""
    ref_losses, ref_weights, ref_grads = reference_result
    for losses, _, _ in parallel_results:
        assert len(losses) == len(ref_losses)
        for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
            assert abs(loss - ref) <= rel * abs(ref), f"step {step}: loss {loss} vs {ref}"
    assert_tensors_match(join_shards([r[1] for r in parallel_results]), join_shards([ref_weights]), tensor_rel,
                         floor=tensor_rel)
    assert_tensors_match(join_shards([r[2] for r in parallel_results]), join_shards([ref_grads]), tensor_rel)


def assert_layouts_match(per_rank: list, layouts, expected, serial_losses_and_norms: list) -> None:
    """Each rank's (runs by layout name, ZeRO-3 run's losses and norms): every layout's run matches the single-device
    run `expected` (assert_run_matches, tensors to 1e-4); the ZeRO-3 run's (loss, grad norm) of every step, whose
    parameters live sharded, equal the serial ones."""
    for name in layouts:
        assert_run_matches([runs[name] for runs, _ in per_rank], expected, rel=1e-5, tensor_rel=1e-4)
    for _, zero3 in per_rank:
        for (loss, norm), (ref_loss, ref_norm) in zip(zero3, serial_losses_and_norms, strict=True):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and abs(norm - ref_norm) <= 1e-5 * abs(ref_norm)


def train_losses(values: dict, world_size: int) -> list[float]:
    """lm loss of every step of pretrain() (with pretrain_gpt's model and step)."""
    history = pretrain(make_config(values, world_size), pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    return [h["lm_loss"] for h in history]


def assert_resumes_bitwise_and_reshards(values: dict, root, layout: dict) -> None:
    """Saved after 2 of the run's steps: resumed in the same layout (one process) the losses are the uninterrupted
    run's bit for bit; saved in `layout` on 2 ranks and resumed on one, to float rounding."""
    from tests.harness import run_on_ranks

    uninterrupted = train_losses(values, 1)
    assert train_losses({**values, "save": str(root / "one"), "exit_interval": 2}, 1) == uninterrupted[:2]
    assert train_losses({**values, "load": str(root / "one")}, 1) == uninterrupted[2:]
    saved = run_on_ranks(2, train_losses, {**values, **layout, "save": str(root / "two"), "exit_interval": 2}, 2)
    assert saved[0] == pytest.approx(uninterrupted[:2], rel=1e-5)
    assert train_losses({**values, "load": str(root / "two")}, 1) == pytest.approx(uninterrupted[2:], rel=1e-5)


_REFERENCES: dict = {}


def reference(values: dict):
    """The single-device run of `values`, computed once per test session."""
    key = repr(sorted(values.items()))  # values may hold lists (--data-path)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_and_collect(values, 1)
    return _REFERENCES[key]


TINY_2_LAYERS = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 64,
                 "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 256,
                 "seq_length": 32, "max_position_embeddings": 32, "micro_batch_size": 1, "global_batch_size": 8,
                 "train_iters": 10, "lr": 3e-3, "lr_warmup_iters": 1, "clip_grad": 0.3, "eval_interval": 1000,
                 "log_interval": 1000}


def build_run(values: dict, world_size: int):
    """(config, parallel state, device, model chunks, optimizer) built as training.pretrain builds them."""
    config = make_config(values, world_size)
    pstate, device = initialize(config)
    return config, pstate, device, *setup_model_and_optimizer(config, pstate, pretrain_gpt.model_provider, device)


def train_steps(values: dict, world_size: int):
    """Train --train-iters steps with the real training step: (model chunks, optimizer, per-step records)."""
    config, pstate, device, model, optimizer = build_run(values, world_size)
    iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
    history = [train_step(pretrain_gpt.forward_step, iterator, model, optimizer, config, pstate, i, device)
               for i in range(config.training.train_iters)]
    return model, optimizer, history


def gathered_weights(model) -> dict[str, torch.Tensor]:
    """Every weight of this rank's chunks, whole (ZeRO-3 gathers them), by global name."""
    weights = {}
    for chunk in model:
        with chunk.gathered_parameters():
            weights.update({name: p.detach().clone() for name, p in chunk.module.named_global_parameters()})
    return weights


def train_with_state(values: dict, world_size: int) -> dict:
    """Train with the real training step; per-step metrics, final local weights and optimizer state."""
    model, optimizer, history = train_steps(values, world_size)
    pstate = model[0].pstate
    state = {key: (value.data.clone(), value.flat_range, value.spec) if isinstance(value, FlatShard) else value
             for key, value in optimizer.sharded_state_dict().items()}
    return {"losses": [h["lm_loss"] for h in history], "norms": [h["grad_norm"] for h in history],
            "weights": gathered_weights(model), "state": state, "tp": (pstate.tp_rank, pstate.tp_size)}


# ---------------------------------------------------------------------------------------------------
# Tensor parallelism: one forward and backward of a whole model on a fixed batch

def saved_bytes(module, x: torch.Tensor, positions, skip: set) -> int:
    """Bytes of the distinct storages autograd saves in one forward of `module(x, positions)`, but those whose
    storage pointers are in `skip` (the input, the parameters)."""
    saved = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in skip:
            saved[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x, positions)
    return sum(saved.values())


def saved_bytes_per_token(module, hidden_size: int, dtype: torch.dtype) -> float:
    """What `module` saves per token of a [s, 1, hidden] input: two sequence lengths cancel what does not grow with
    it; the input and the parameters are left out."""
    measured = []
    for seq in (128, 256):
        x = torch.randn(seq, 1, hidden_size, dtype=dtype, requires_grad=True)
        skip = {t.untyped_storage().data_ptr() for t in (x, *module.parameters())}
        measured.append(saved_bytes(module, x, None, skip))
    return (measured[1] - measured[0]) / 128


def gather_pieces(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every TP rank's tensor, in TP-rank order (the tensors have equal shapes)."""
    return list(mappings.all_gather_dim0(tensor.detach().unsqueeze(0), group).unbind(0))


VOCAB, BATCH = 100, 4  # vocabulary padded to 104 / 112 / 128 rows at TP 1 / 2 / 4
SMALL = {"num_layers": 2, "hidden_size": 64, "seq_length": 32, "max_position_embeddings": 32, "vocab_size": VOCAB,
         "make_vocab_size_divisible_by": 8, "mock_data": True, "hidden_dropout": 0.0, "attention_dropout": 0.0}


def batch() -> torch.Tensor:
    """[BATCH, seq + 1] tokens, the same in every process."""
    return torch.randint(0, VOCAB, (BATCH, SMALL["seq_length"] + 1), generator=torch.Generator().manual_seed(0))


def forward_backward(values: dict, pstate: ParallelState, world_size: int) -> dict:
    """This data-parallel rank's logits; the gathered initial weights and global-batch-mean gradients."""
    config = make_config(values, world_size)
    plan = model_chunk_plans(config, pstate.pp_rank)[0]
    model = DistributedDataParallel(pretrain_gpt.model_provider(config, pstate, plan, torch.device("cpu")), pstate)
    rows = BATCH // pstate.dp_size
    tokens = batch()[pstate.dp_rank * rows:(pstate.dp_rank + 1) * rows]
    inputs, labels, positions = tokens[:, :-1], tokens[:, 1:], torch.arange(SMALL["seq_length"])
    model(inputs, positions, labels=labels).sum().backward()  # per-token losses [b, s]
    finalize_model_grads([model], pstate, torch.tensor(float(labels.numel())))
    with torch.no_grad():
        logits = gather_vocab_logits(model(inputs, positions), pstate, VOCAB)  # [b, s, vocab]
    result = {"logits": logits, "weights": {}, "grads": {}, "padded_grads": {}}
    tp_group = pstate.group("tp")
    for name, param in model.module.named_global_parameters():
        weight = unshard(gather_pieces(param, tp_group), param.spec)
        grad = unshard(gather_pieces(param.main_grad, tp_group), param.spec)
        valid = param.spec.valid_rows
        result["weights"][name] = weight[:valid]
        result["grads"][name] = grad[:valid]
        if valid is not None:
            result["padded_grads"][name] = grad[valid:]
    return result


@contextlib.contextmanager
def _environment(name: str, value: str):
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def one_step(values: dict, world_size: int, trace: bool = False) -> dict:
    """A forward-only pass over one global batch, then one training step's gradients, with schedule stats."""
    config = make_config(values, world_size)
    pstate, device = initialize(config)
    model = build_model(config, pstate, pretrain_gpt.model_provider, device)
    train_ds, _, _ = build_datasets(config)
    schedule = get_schedule(config)
    stats, stderr = ScheduleStats(), io.StringIO()
    with contextlib.redirect_stderr(stderr), _environment(TRACE_ENV, "1" if trace else "0"):
        with torch.no_grad():
            reports, _ = schedule(pretrain_gpt.forward_step, build_data_iterator(train_ds, config, pstate, 0),
                                  model, config.num_microbatches, pstate=pstate, config=config, forward_only=True)
        eval_loss = float(reduce_loss(reports, pstate, device))
        reports, tokens = schedule(pretrain_gpt.forward_step, build_data_iterator(train_ds, config, pstate, 0),
                                   model, config.num_microbatches, pstate=pstate, config=config, stats=stats)
    finalize_model_grads(model, pstate, tokens)
    return {"eval_loss": eval_loss, "loss": float(reduce_loss(reports, pstate, device)),
            "stage": pstate.pp_rank,
            "grads": parameter_records(model, lambda p: p.main_grad), "peak_live": stats.peak_live,
            "peak_held": stats.peak_held,
            "forwards": sum(kind == "F" for kind, *_ in stats.events), "trace": stderr.getvalue()}


_OP = re.compile(r"rank (\d+) (?:->|<-) rank (\d+) (send|recv) (activation|gradient) microbatch (\d+) chunk (\d+)")


def assert_sends_pair_with_receives(results: list[dict], pp: int, v: int, m: int):
    """Each send (rank, peer, micro-batch, chunk) of an evaluation and a training pass is received by that peer
    for the same micro-batch, by the chunk that follows in the ring (the last stage's chunk c feeds the first
    stage's chunk c + 1)."""
    sends, receives = collections.Counter(), collections.Counter()
    for r in results:
        for rank, peer, kind, what, mb, chunk in _OP.findall(r["trace"]):
            rank, peer, mb, chunk = int(rank), int(peer), int(mb), int(chunk)
            if kind == "recv":
                receives[(peer, rank, what, mb, chunk)] += 1
            elif what == "activation":  # with PP alone a global rank is its stage
                sends[(rank, peer, what, mb, chunk + (peer == 0))] += 1
            else:
                sends[(rank, peer, what, mb, chunk - (rank == 0))] += 1
        assert len(re.findall(r"stage \d+ busy .* peak live micro-batches", r["trace"])) == 2
    assert sends == receives
    per_pass = m * (pp * v - 1)  # hand-overs between consecutive virtual stages
    assert sum(n for key, n in sends.items() if key[2] == "activation") == 2 * per_pass  # evaluation + training
    assert sum(n for key, n in sends.items() if key[2] == "gradient") == per_pass


# ---------------------------------------------------------------------------------------------------
# Hugging Face models of every supported family, small and random, converted once per test session

HF_VOCAB = 300
HF_FAMILIES = ["llama", "llama_tied", "llama_rope_scaling", "qwen2", "qwen3", "gpt2", "mixtral", "qwen3_moe",
               "qwen2_moe", "deepseek_v3", "deepseek_v3_no_q_latent", "nemotron_h", "nemotron_h_moe",
               "nemotron_h_latent", "mamba2"]
# Scaled wavelengths from those below 64 / 4 (kept) through the band to 64 (interpolated) and above (divided)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# YaRN stretching a 16-token context by 4, with unequal mscales so that both of its scales count
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}


def hf_config(family: str):
    """A small random configuration of `family`. transformers is imported here, not at the top: the spawned
    ranks import this module for `_tp2_pp2` and need none of it."""
    import transformers

    common = {"vocab_size": HF_VOCAB, "bos_token_id": 0, "eos_token_id": HF_VOCAB - 1}
    llama = {"hidden_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 64, **common}
    deepseek = {**llama, "num_hidden_layers": 4, "first_k_dense_replace": 2, "intermediate_size": 96,
                "moe_intermediate_size": 32, "num_attention_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4, "n_shared_experts": 1,
                "num_experts_per_tok": 2, "routed_scaling_factor": 2.5, "tie_word_embeddings": False}
    nemotron = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 96, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2,
                "ssm_state_size": 16, "max_position_embeddings": 64, **common}
    return {
        "llama": lambda: transformers.LlamaConfig(intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                                  rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                                  **llama),
        "llama_tied": lambda: transformers.LlamaConfig(intermediate_size=128, num_attention_heads=8,
                                                       num_key_value_heads=2, tie_word_embeddings=True, **llama),
        "llama_rope_scaling": lambda: transformers.LlamaConfig(intermediate_size=96, num_attention_heads=4,
                                                               num_key_value_heads=2, rope_parameters=LLAMA3_ROPE,
                                                               tie_word_embeddings=False, **llama),
        "qwen2": lambda: transformers.Qwen2Config(intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                                  tie_word_embeddings=True, **llama),
        "qwen3": lambda: transformers.Qwen3Config(intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=32, tie_word_embeddings=False, **llama),
        "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                                embd_pdrop=0.0, attn_pdrop=0.0, **common),
        "mixtral": lambda: transformers.MixtralConfig(intermediate_size=64, num_attention_heads=4,
                                                      num_key_value_heads=2, num_local_experts=4,
                                                      num_experts_per_tok=2, **llama),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(  # softmax, top-k renormalized
            intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False, **llama),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(  # softmax over all experts, a gated shared expert
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
            tie_word_embeddings=False, **llama),
        # multi-latent attention (192/128-like head dims in small), 2 dense then 2 MoE layers, sigmoid routing
        # over 2 groups with a shared expert; with a query latent and YaRN, and without either
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **deepseek, q_lora_rank=24, rope_parameters=DEEPSEEK_YARN, n_group=2, topk_group=1),
        "deepseek_v3_no_q_latent": lambda: transformers.DeepseekV3Config(
            **deepseek, q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, n_group=1,
            topk_group=1),
        # Nemotron-H's form: Mamba-2 mixers with and without an MLP after them, attention, squared-ReLU MLPs;
        # Nemotron 3's: sigmoid-routed squared-ReLU experts over 2 groups and a shared expert
        "nemotron_h": lambda: transformers.NemotronHConfig(**nemotron, hybrid_override_pattern="M-M*-M-"),
        "nemotron_h_moe": lambda: transformers.NemotronHConfig(
            **nemotron, hybrid_override_pattern="MEM*EME", n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
            routed_scaling_factor=2.5),
        # Nemotron 3 Super's: the routed experts in a latent of 24 (the router and the shared expert at 64)
        "nemotron_h_latent": lambda: transformers.NemotronHConfig(
            **nemotron, hybrid_override_pattern="M*E", n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=24,
            routed_scaling_factor=2.5),
        # four Mamba-2 blocks alone, the residual stream in fp32 (transformers' default) and tied tables
        "mamba2": lambda: transformers.Mamba2Config(
            hidden_size=64, num_heads=8, head_dim=16, n_groups=2, state_size=16, num_hidden_layers=4, expand=2,
            tie_word_embeddings=True, vocab_size=HF_VOCAB, bos_token_id=0, eos_token_id=HF_VOCAB - 1, pad_token_id=0),
    }[family]()


def word_level_tokenizer():
    """A tokenizer.json whose token i is "w<i>" (the last one the end of text), so prompts are readable."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(HF_VOCAB - 1)} | {"</s>": HF_VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def convert(*argv: str) -> None:
    from tools import convert_checkpoint

    convert_checkpoint.main(list(argv))


def hf_models(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """{family: (HF directory, converted megatron_lite directory)}, built once per test session (the llama
    directory also carries a tokenizer)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.getbasetemp() / "hf_models"
    dirs = {family: (str(root / family / "hf"), str(root / family / "mlite")) for family in HF_FAMILIES}
    if not (root / "done").exists():
        for index, (family, (hf_dir, mlite_dir)) in enumerate(dirs.items()):
            torch.manual_seed(index)
            model = AutoModelForCausalLM.from_config(hf_config(family))
            if family.startswith(("qwen", "deepseek", "nemotron", "mamba")):
                perturb_biases_and_norms(model)
            model.save_pretrained(hf_dir)
            if family == "llama":
                word_level_tokenizer().save(os.path.join(hf_dir, "tokenizer.json"))
            convert("--direction", "hf-to-mlite", "--load-dir", hf_dir, "--save-dir", mlite_dir)
        (root / "done").touch()
    return dirs


def random_hf_checkpoint(config, root, seed: int, perturb: tuple[str, ...] = (),
                         scale: float = 1.0) -> tuple[str, str]:
    """A random transformers model of `config` (biases and norms perturbed, and the parameters whose names end
    with one of `perturb` moved by `scale` x N(0, 1)), saved to root/hf and converted to root/mlite: the two
    directories."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    perturb_biases_and_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if perturb and name.endswith(perturb):
                param.add_(scale * torch.randn_like(param))
    model.save_pretrained(root / "hf")
    convert("--direction", "hf-to-mlite", "--load-dir", str(root / "hf"), "--save-dir", str(root / "mlite"))
    return str(root / "hf"), str(root / "mlite")


@torch.no_grad()
def perturb_biases_and_norms(model) -> None:
    """transformers initializes biases to zero, norm weights and Mamba-2's D and dt_bias to one, its A_log to
    log(1 .. heads) and Nemotron-H's router to zero: make them random, so that they count."""
    for name, param in model.named_parameters():
        if name.endswith(("bias", "norm.weight", ".A_log", ".D", "dt_bias")):
            param.add_(0.1 * torch.randn_like(param))
        elif name.endswith("mixer.gate.weight"):
            param.normal_(std=0.1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's expert bias, a buffer
            buffer.add_(0.1 * torch.randn_like(buffer))
