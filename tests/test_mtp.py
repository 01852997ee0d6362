"""Multi-token prediction: the loss is DeepSeek-V3's, weighted as Megatron weighs it, and parallel = serial."""

import copy

import pytest
import torch
import torch.nn.functional as F

import pretrain_gpt
from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel.state import ParallelState
from megatron_lite.pipeline import schedules
from megatron_lite.training.loop import padded_vocab_for
from tests.harness import run_on_ranks
from tests.helpers import TINY_2_LAYERS, join_shards, parameter_records, pretrain_keeping_chunks
from tests.test_deepseek_v3 import PLANNED
from tests.tolerances import assert_close_relative

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

LLAMA = {**TINY_2_LAYERS, "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3, "train_iters": 4,
         "global_batch_size": 4, "micro_batch_size": 2}
# tied embeddings and learned positions: the last pipeline stage's copies of both tables are tied to the first's
GPT2 = {**{k: v for k, v in LLAMA.items() if k != "num_query_groups"}, "model_preset": "gpt2-124m",
        "hidden_dropout": 0.0, "attention_dropout": 0.0}


# multi-latent attention and a dense layer before MoE layers, as DeepSeek-V3, whose MTP layer is an MoE layer as the
# last decoder layer is; the vocabulary padded to 128 rows at TP1 and TP2
DEEPSEEK = {**PLANNED, "mtp_num_layers": 1, "train_iters": 2, "make_vocab_size_divisible_by": 64}


# ---------------------------------------------------------------------------------------------------
# The loss against the paper's definition, written out position by position


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def paper_losses(model: GPTModel, tokens: torch.Tensor, mask: torch.Tensor):
    """(main summed loss, [(S_k, N_k)] per depth) from DeepSeek-V3's section 2.2 for samples `tokens` [b, s + 1]:
    h^k_i = TRM_k(M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]) at every i with i + k < s, followed by the
    module's final norm; depth k predicts t_{i+k+1} with the shared head, where loss mask position i + k is set."""
    config = model.config
    b, s = tokens.shape[0], tokens.shape[1] - 1
    inputs = tokens[:, :-1]
    positions = torch.arange(s)
    rotary = model.rotary(positions)
    h = model.decoder(model.embedding(inputs, positions), rotary)  # [s, b, h], after the final norm
    table = model.embedding.word_embeddings.weight
    head = (model.output_layer.weight if model.output_layer.weight is not None else table)[:config.vocab_size]
    main = (F.cross_entropy((h @ head.t()).flatten(0, 1), tokens[:, 1:].t().flatten(),
                            reduction="none").view(s, b).t() * mask).sum()
    depths = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        n = s - k  # positions with a target
        embedded = table[tokens[:, k:k + n]].transpose(0, 1)  # Emb(t_{i+k}) [n, b, h]
        joined = torch.cat((rms_norm(embedded, layer.enorm.weight, config.norm_epsilon),
                            rms_norm(h[:n], layer.hnorm.weight, config.norm_epsilon)), dim=-1)
        full = torch.zeros(s, b, config.hidden_size)  # positions >= n see none of the others (causal)
        full[:n] = joined @ layer.eh_proj.weight.t()
        h = rms_norm(layer.transformer_layer(full, rotary), layer.final_layernorm.weight, config.norm_epsilon)
        ce = F.cross_entropy((h[:n] @ head.t()).flatten(0, 1), tokens[:, k + 1:].t().flatten(),
                             reduction="none").view(n, b).t()
        depths.append(((ce * mask[:, k:]).sum(), mask[:, k:].sum()))
    return main, depths


def one_process_model(values: dict) -> tuple:
    config = make_config({**values, "hidden_dropout": 0.0, "attention_dropout": 0.0}, 1)
    model = GPTModel(config.model, ParallelState.single(), padded_vocab=padded_vocab_for(config),
                     seed=config.training.seed)
    return config, model


def samples(config, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.model.vocab_size, (n, config.model.seq_length + 1), generator=generator)
    mask = (torch.rand(n, config.model.seq_length, generator=generator) > 0.3).float()  # a loss mask with holes
    return tokens, mask


def test_mtp_losses_equal_the_papers_definition_on_one_process():
    config, model = one_process_model(LLAMA)
    tokens, mask = samples(config, 2)
    model.train()
    model(tokens[:, :-1], torch.arange(config.model.seq_length), labels=tokens[:, 1:], loss_mask=mask)
    with torch.no_grad():
        _, reference = paper_losses(model, tokens, mask)
    assert model.mtp.totals.shape == (2, 2)
    for k, (loss_sum, count) in enumerate(reference):
        assert_close_relative(model.mtp.totals[k, 0].float(), loss_sum, msg=f"S_{k + 1}")
        assert model.mtp.totals[k, 1] == count  # N_k: the mask's positions from k on


def schedule_gradients(model, config, tokens, mask, microbatches: int) -> dict[str, torch.Tensor]:
    """Gradients of one schedule call over `microbatches` micro-batches of one sample each."""
    batches = iter([{"tokens": tokens[i:i + 1, :-1], "labels": tokens[i:i + 1, 1:], "loss_mask": mask[i:i + 1],
                     "position_ids": torch.arange(config.model.seq_length)} for i in range(microbatches)])
    model.zero_grad()
    schedules.forward_backward_no_pipelining(pretrain_gpt.forward_step, batches, model, microbatches,
                                             pstate=model.pstate, config=config)
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("per_token", [False, True])
def test_the_backward_weights_the_mtp_loss_as_megatron(per_token):
    """Per micro-batch: d/dw of 1/m sum_mb (S / N + f / D sum_k S_k / N_k); per token: of sum_mb (S + f / D
    sum_k S_k N / N_k), which finalize_model_grads then divides by the global count (Megatron's process_mtp_loss)."""
    config, model = one_process_model({**LLAMA, "calculate_per_token_loss": per_token})
    tokens, mask = samples(config, 3)
    model.train()
    actual = schedule_gradients(model, config, tokens, mask, 3)
    reference_model = copy.deepcopy(model)
    factor, depths = config.model.mtp_loss_scaling_factor, config.model.mtp_num_layers
    total = 0.0
    for i in range(3):
        main, per_depth = paper_losses(reference_model, tokens[i:i + 1], mask[i:i + 1])
        tokens_i = mask[i].sum()
        mtp = factor / depths * sum(loss_sum / count for loss_sum, count in per_depth)
        total = total + (main + tokens_i * mtp if per_token else (main / tokens_i + mtp) / 3)
    reference_model.zero_grad()
    total.backward()
    for name, param in reference_model.named_parameters():
        assert_close_relative(actual[name], param.grad, msg=name)
    assert actual["mtp.layers.1.eh_proj.weight"].abs().sum() > 0


def test_mtp_stays_out_of_evaluation_and_generation():
    config, model = one_process_model(LLAMA)
    tokens, _ = samples(config, 1)
    positions = torch.arange(config.model.seq_length)
    model.eval()
    logits = model(tokens[:, :-1], positions)
    model(tokens[:, :-1], positions, labels=tokens[:, 1:])
    assert model.mtp.totals is None  # no MTP forward ran
    dense = {k: v for k, v in LLAMA.items() if not k.startswith("mtp_")}
    without = GPTModel(make_config({**dense, "hidden_dropout": 0.0, "attention_dropout": 0.0}, 1).model,
                       ParallelState.single(), padded_vocab=padded_vocab_for(config), seed=config.training.seed).eval()
    torch.testing.assert_close(logits, without(tokens[:, :-1], positions), rtol=0, atol=0)


@pytest.mark.parametrize("values, expected", [
    ({"mtp_num_layers": 0}, r"mtp-num-layers \(0\) must be at least 1"),
    ({"mtp_loss_scaling_factor": -0.1}, r"mtp-loss-scaling-factor \(-0.1\) must not be negative"),
])
def test_bad_mtp_flags_are_one_line(values, expected):
    with pytest.raises(ConfigError, match=expected):
        make_config({**LLAMA, **values}, 1)


# ---------------------------------------------------------------------------------------------------
# Parallel = serial, on the 2-rank world


LAYOUTS = {
    "tp2_sp": (LLAMA, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2_untied": (LLAMA, {"pipeline_model_parallel_size": 2}),
    "pp2_tied_learned_positions": (GPT2, {"pipeline_model_parallel_size": 2}),
    "pp2_vp2": ({**LLAMA, "num_layers": 4}, {"pipeline_model_parallel_size": 2,
                                             "num_virtual_stages_per_pipeline_rank": 2}),
    "mla_moe_tp2": (DEEPSEEK, {"tensor_model_parallel_size": 2}),
    "mla_moe_ep2": (DEEPSEEK, {"expert_model_parallel_size": 2}),
    "cp2_p2p_eod_masked": ({**LLAMA, "eod_mask_loss": True}, {"context_parallel_size": 2}),
    "cp2_a2a_per_token": ({**LLAMA, "calculate_per_token_loss": True}, {"context_parallel_size": 2,
                                                                        "cp_comm_type": "a2a"}),
    "dp2_zero1_per_token_eod_masked": ({**LLAMA, "calculate_per_token_loss": True, "eod_mask_loss": True},
                                       {"data_parallel_sharding_strategy": "optim"}),
}


def run_record(values: dict, world_size: int) -> tuple:
    """Per step (lm loss, mtp loss, grad norm), and the final weights' records."""
    history, chunks = pretrain_keeping_chunks(values, world_size)
    steps = [(h["lm_loss"], h["mtp_loss"], h["grad_norm"]) for h in history]
    stages = [(chunk.pre_process, chunk.post_process, chunk.mtp is not None) for chunk in chunks]
    return steps, parameter_records(chunks, lambda p: p), stages


def train_mtp_layouts() -> dict:
    return {name: run_record({**base, **layout}, 2) for name, (base, layout) in LAYOUTS.items()}


def test_mtp_trains_as_one_process_under_tp2_sp_cp2_pp2_vp2_and_dp2_zero1():
    references = {name: run_record(base, 1) for name, (base, _) in LAYOUTS.items()}
    per_rank = run_on_ranks(2, train_mtp_layouts)
    for name, (ref_steps, ref_weights, _) in references.items():
        for rank, (steps, _, _) in enumerate(r[name] for r in per_rank):
            assert len(steps) == len(ref_steps) == LAYOUTS[name][0]["train_iters"]
            for step, (got, want) in enumerate(zip(steps, ref_steps)):
                assert got == pytest.approx(want, rel=1e-5), (name, rank, step)
        weights = join_shards([r[name][1] for r in per_rank])
        reference = join_shards([ref_weights])
        assert {n for n, _ in weights} == {n for n, _ in reference}
        for (param, _replica), tensor in weights.items():
            assert_close_relative(tensor, reference[(param, (0, 0, 0))], rel=1e-5, msg=f"{name} {param}",
                                  floor=1e-5)
    for name in ("pp2_untied", "pp2_tied_learned_positions"):  # the modules on the last stage only
        assert [r[name][2] for r in per_rank] == [[(True, False, False)], [(False, True, True)]]
    assert [r["pp2_vp2"][2] for r in per_rank] == [[(True, False, False), (False, False, False)],
                                                  [(False, False, False), (False, True, True)]]
    assert any(n.startswith("mtp.layers.1.") for n, _ in join_shards([references["tp2_sp"][1]]))
    assert "mtp.layers.0.transformer_layer.mlp.experts.3.linear_fc2.weight" in {
        n for n, _ in join_shards([references["mla_moe_ep2"][1]])}


# ---------------------------------------------------------------------------------------------------
# Checkpoints


def resume_at_pp2(values: dict) -> list:
    history, _ = pretrain_keeping_chunks({**values, "pipeline_model_parallel_size": 2}, 2)
    return [(h["lm_loss"], h["mtp_loss"]) for h in history]


def test_an_mtp_checkpoint_resumes_as_the_uninterrupted_run_also_at_pp2(tmp_path):
    save = str(tmp_path / "run")
    straight, _ = pretrain_keeping_chunks({**LLAMA, "save": save, "save_interval": 2}, 1)
    straight = [(h["lm_loss"], h["mtp_loss"]) for h in straight]
    resumed, _ = pretrain_keeping_chunks({**LLAMA, "load": save, "ckpt_step": 2}, 1)
    assert [(h["lm_loss"], h["mtp_loss"]) for h in resumed] == straight[2:]  # bitwise on one process
    from megatron_lite.checkpoint.checkpointing import read_checkpoint_tensors

    stored = read_checkpoint_tensors(f"{save}/iter_0000002")
    assert "mtp.layers.1.eh_proj.weight" in stored and "mtp.layers.0.transformer_layer.mlp.linear_fc1.weight" in stored
    at_pp2 = run_on_ranks(2, resume_at_pp2, {**LLAMA, "load": save, "ckpt_step": 2})
    for steps in at_pp2:
        assert len(steps) == 2
        for got, want in zip(steps, straight[2:]):
            assert got == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# The planner


@pytest.mark.parametrize("values", [LLAMA, GPT2, DEEPSEEK],
                         ids=["llama_untied", "gpt2_tied_learned_positions", "mla_dense_first_moe"])
@pytest.mark.parametrize("pp", [1, 2])
def test_the_planner_counts_the_parameters_each_stage_builds(values, pp):
    from megatron_lite.config.layer_split import model_chunk_plans
    from megatron_lite.planning.state_memory import chunk_params

    config = make_config({**values, "pipeline_model_parallel_size": pp}, pp)
    for pp_rank in range(pp):
        (plan,) = model_chunk_plans(config, pp_rank)
        model = pretrain_gpt.model_provider(config, ParallelState.single(), plan, torch.device("cpu"))
        planned = chunk_params(config, plan)
        assert [shape.numel for shape in planned] == [p.numel() for p in model.parameters()], pp_rank
        shared = {id(p) for p in model.shared_embedding_parameters()}
        assert [shape.isolated for shape in planned] == [id(p) in shared for p in model.parameters()], pp_rank


def test_model_flops_count_the_mtp_depths_as_torch_counts_them():
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.model.flops import training_flops_per_token

    config, model = one_process_model({**LLAMA, "make_vocab_size_divisible_by": 1})
    m = config.model
    tokens, mask = samples(config, 2)
    with FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], torch.arange(m.seq_length), labels=tokens[:, 1:], loss_mask=mask).sum().backward()
    counted = counter.get_total_flops() / tokens[:, :-1].numel()
    layers = m.num_layers + m.mtp_num_layers  # every one computes QK^T and PV over the whole sequence
    attention_square = 3 * layers * 4 * m.seq_length * m.num_attention_heads * m.head_dim
    attention_kernel_counted = any("attention" in str(op) for op in counter.get_flop_counts()["Global"])
    expected = counted if attention_kernel_counted else counted + attention_square
    assert training_flops_per_token(m) == pytest.approx(expected, rel=1e-12)
