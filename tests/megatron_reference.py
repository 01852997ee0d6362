"""Megatron-Core itself, on CPU with gloo, as the reference for the Megatron-LM checkpoint tests.

    torchrun --nproc-per-node 4 tests/megatron_reference.py reference OUT                     (save, logits, step)
    torchrun --nproc-per-node 2 tests/megatron_reference.py logits OUT KIND=ITERATION_DIR...   (TP2)

`reference` saves at TP2 x PP2, then computes the saved models' logits and takes the Adam steps at TP2 (over
DP2: both replicas see the same tokens, so their averaged gradient is each one's): one launch for all that the
tests read of Megatron-Core's own checkpoints.

`save` builds Megatron-Core GPTModels with the local (non-Transformer-Engine) spec from a seed, a dense
Llama-style one (GQA, SwiGLU, RMSNorm, RoPE, untied) and an MoE one (a dense first layer, then routed and
shared experts), and saves them as Megatron-LM does (megatron/training/checkpointing.py: the args Namespace,
iteration, scheduler state and sharded model in one state dict): the dense model in both formats
(`OUT/dense_dist` torch_dist through `dist_checkpointing.save`, `OUT/dense_torch` as per-rank
`mp_rank_TT_PPP/model_optim_rng.pt`), the MoE one as torch_dist (`OUT/moe_dist`). `logits` loads each named
torch_dist iteration (KIND dense or moe: the model to build) at TP2 with `dist_checkpointing.load`
(Megatron-Core's own resharding) and writes the logits of fixed tokens to `OUT/logits.pt`. `step` trains
the dense model with Megatron-Core's DDP and Adam and saves its optimizer state (see `step`), in `OUT/step`.
The CUDA calls Megatron-Core makes on this path (stream synchronisation, the device of a flag tensor, the
model-parallel RNG tracker) are patched to no-ops, and the router's Transformer Engine GEMM, which
megatron-core leaves undefined without Transformer Engine, to None.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

LAYERS, HIDDEN, FFN, HEADS, GROUPS, VOCAB, SEQ = 4, 64, 128, 4, 2, 256, 16
MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
       "moe_shared_expert_intermediate_size": 64, "moe_layer_freq": [0, 1, 1, 1],
       "moe_token_dispatcher_type": "allgather"}
ITERATION, GLOBAL_BATCH = 30, 8


def token_ids(seed: int = 11, length: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


# `step`: Adam's constants (Megatron-LM's flags of megatron_args), and the two steps' tokens and rates.
ADAM = {"weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8}
FIRST_STEP, SECOND_STEP = (21, 1e-3), (22, 2e-3)


def megatron_args(tp: int, pp: int, moe: bool, iteration: int = ITERATION) -> argparse.Namespace:
    """The flags Megatron-LM's parser (megatron/training/arguments.py) records for such a run, by its names."""
    values = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, kv_channels=HIDDEN // HEADS, max_position_embeddings=SEQ,
        seq_length=SEQ, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, position_embedding_type="rope",
        rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False, untie_embeddings_and_output_weights=True,
        add_bias_linear=False, add_qkv_bias=False, apply_layernorm_1p=False, qk_layernorm=False,
        padded_vocab_size=VOCAB, vocab_size=None, make_vocab_size_divisible_by=128, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64,
        v_head_dim=128, multi_latent_attention=False, num_experts=None, lr=3e-4, min_lr=3e-5,
        lr_decay_style="cosine", lr_warmup_iters=10, lr_decay_iters=100, train_iters=100, lr_warmup_init=0.0,
        global_batch_size=GLOBAL_BATCH, micro_batch_size=2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, clip_grad=0.0, bf16=False, fp16=False, seed=1234, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, expert_model_parallel_size=1, consumed_train_samples=iteration * GLOBAL_BATCH,
        params_dtype=torch.float32, tokenizer_type="GPT2BPETokenizer", data_path=["1.0", "corpus_text_document"],
        split="969,30,1", ckpt_format="torch_dist", use_distributed_optimizer=True, sequence_parallel=False,
        tensorboard_queue_size=1000, num_workers=2, log_interval=10, save_interval=30, eval_interval=50,
        eval_iters=5, optimizer="adam", transformer_impl="local")
    if moe:
        values.update(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64,
                      moe_layer_freq=[0, 1, 1, 1], moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                      moe_router_load_balancing_type="aux_loss", moe_router_score_function="softmax",
                      moe_router_pre_softmax=False, moe_grouped_gemm=False)
    return argparse.Namespace(**values)


class _TorchOnCpu:
    """The torch module, with tensors a module asks to create on 'cuda' created on the CPU."""

    def __getattr__(self, name: str):
        attribute = getattr(torch, name)
        if name in ("tensor", "zeros", "ones", "empty"):
            return lambda *args, device=None, **kwargs: attribute(
                *args, device="cpu" if device == "cuda" else device, **kwargs)
        return attribute


def _patch_for_cpu() -> None:
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.utils
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # left undefined when Transformer Engine is absent; None is its own fallback
    for module in (optimizer, clip_grads, megatron.core.utils):  # their flag tensors are made on 'cuda'
        module.torch = _TorchOnCpu()

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def build_model(tp: int, pp: int, moe: bool, parallel_output: bool = False):
    """The GPTModel; with `parallel_output` its logits stay split over TP, as its loss (given labels) needs."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, **(MOE if moe else {}))
    spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=False) if moe
            else get_gpt_layer_local_spec(normalization="RMSNorm"))
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(), parallel_output=parallel_output,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope")


def _state(tp: int, pp: int, moe: bool, iteration: int = ITERATION) -> dict:
    return {"args": megatron_args(tp, pp, moe, iteration), "checkpoint_version": 3.0, "iteration": iteration,
            "opt_param_scheduler": {"max_lr": 3e-4, "lr_warmup_steps": 10 * GLOBAL_BATCH,
                                    "num_steps": iteration * GLOBAL_BATCH, "lr_decay_style": "cosine",
                                    "lr_decay_steps": 100 * GLOBAL_BATCH, "min_lr": 3e-5}}


def _commit(root: str, iteration: int = ITERATION) -> str:
    """The iteration directory Megatron-LM writes into, and its tracker file."""
    path = os.path.join(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return path


def save(out: str) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    tp, pp = 2, 2
    for moe in (False, True):
        torch.manual_seed(7 + moe)
        model = build_model(tp, pp, moe)
        with torch.no_grad():  # the local spec starts norms at one: random, so a misplaced norm shows
            for name, param in model.named_parameters():
                if "layernorm" in name or "layer_norm" in name:
                    param.uniform_(0.5, 1.5)
        name = "moe_dist" if moe else "dense_dist"
        dist_checkpointing.save({**_state(tp, pp, moe), "model": model.sharded_state_dict()},
                                _commit(os.path.join(out, name)))
        if not moe:
            rank = (f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}_"
                    f"{parallel_state.get_pipeline_model_parallel_rank():03d}")
            path = os.path.join(_commit(os.path.join(out, "dense_torch")), rank)
            os.makedirs(path, exist_ok=True)
            torch.save({**_state(tp, pp, moe), "model": model.state_dict_for_save_checkpoint()},
                       os.path.join(path, "model_optim_rng.pt"))
        dist.barrier()


def logits(out: str, checkpoints: list[str]) -> None:
    from megatron.core import dist_checkpointing

    found = {}
    ids = token_ids()
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    for kind_and_path in checkpoints:
        kind, path = kind_and_path.split("=", 1)
        model = build_model(2, 1, moe=kind == "moe")
        request = {"model": model.sharded_state_dict()}
        model.load_state_dict(dist_checkpointing.load(request, path)["model"])
        model.eval()
        with torch.no_grad():
            found[path] = model(ids, torch.arange(SEQ)[None].expand(2, -1), mask)
    if dist.get_rank() == 0:
        torch.save(found, os.path.join(out, "logits.pt"))


def _train_step(ddp, optimizer, seed: int, lr: float) -> None:
    """One step of Adam on tokens(seed): the mean next-token loss, lr set in every parameter group."""
    tokens = token_ids(seed, SEQ + 1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = ddp(tokens[:, :-1], torch.arange(SEQ)[None].expand(2, -1), mask, labels=tokens[:, 1:])
    losses.mean().backward()
    ddp.finish_grad_sync()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()


def step(out: str, dense: str) -> None:
    """Load the dense torch_dist checkpoint `dense` into a model with Megatron-Core's DDP and Adam (not the
    distributed optimizer), take FIRST_STEP, save model and optimizer as Megatron-LM does (`OUT/dense_optim`,
    iteration ITERATION + 1), take SECOND_STEP and write the logits of token_ids() to `OUT/step_logits.pt`."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = build_model(2, 1, moe=False, parallel_output=True)
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, dense)["model"])
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=FIRST_STEP[1], clip_grad=0.0,
                                                       weight_decay=ADAM["weight_decay"],
                                                       adam_beta1=ADAM["adam_beta1"], adam_beta2=ADAM["adam_beta2"],
                                                       adam_eps=ADAM["adam_eps"]), [ddp])
    _train_step(ddp, optimizer, *FIRST_STEP)
    state = {**_state(2, 1, False, ITERATION + 1), "model": model.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    dist_checkpointing.save(state, _commit(os.path.join(out, "dense_optim"), ITERATION + 1))
    _train_step(ddp, optimizer, *SECOND_STEP)
    model.eval()
    with torch.no_grad():
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
        logits_after = model(token_ids(), torch.arange(SEQ)[None].expand(2, -1), mask, runtime_gather_output=True)
    if dist.get_rank() == 0:
        torch.save(logits_after, os.path.join(out, "step_logits.pt"))


def main() -> None:
    dist.init_process_group("gloo")
    _patch_for_cpu()
    from megatron.core import parallel_state

    mode, out = sys.argv[1], sys.argv[2]
    if mode == "reference":
        parallel_state.initialize_model_parallel(2, 2)
        save(out)
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(2, 1)
        saved = {kind: os.path.join(out, f"{kind}_dist", f"iter_{ITERATION:07d}") for kind in ("dense", "moe")}
        logits(out, [f"{kind}={path}" for kind, path in saved.items()])
        os.makedirs(os.path.join(out, "step"), exist_ok=True)
        step(os.path.join(out, "step"), saved["dense"])
    else:
        parallel_state.initialize_model_parallel(2, 1)
        logits(out, sys.argv[3:])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
