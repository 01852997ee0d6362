"""Activation bytes one rank holds at its peak in a training step: saved tensors per micro-batch, times the
micro-batches the pipeline schedule keeps in flight, plus the largest transient of the step.

What each layer saves for backward is read off the code (and checked against a CPU allocation tracker by
benchmarks/plan_accuracy.py), per token of the rank's micro-batch, with e the bytes of an activation (2 in
bf16/fp16, 4 in fp32) and tp-local widths:

  each norm (input and pre-MLP)  its input in fp32 and its normalized fp32 intermediate (RMSNorm: 4h + 4h,
                                 plus a 4-byte rstd; LayerNorm: e h input and 8 bytes of mean and rstd)
  each token mixer and MLP       what its kind's module says (model/kinds/: softmax attention with windows,
                                 sinks and an output gate; multi-latent attention; Gated DeltaNet; the dense
                                 MLP; the MoE layer), summed over the layer specs
  the layer's input              e h (the mixer's first linear saves it; the whole sequence under sequence
                                 parallelism, where the linear saves the all-gathered input)

Norms see s/tp tokens under sequence parallelism; everything else s (the local s/cp with context parallelism).
Each chunk keeps its RoPE cos and sin tables. The last stage adds the final norm, the output layer's input e
h, the loss's fp32 softmax 4 v / tp and per-token loss values; while the loss is computed the e v / tp logits
coexist with it. Full recomputation keeps only each recomputed unit's input (e h on s/tp tokens) and rebuilds
one unit's activations in backward (in fp32 the first norm's input is that unit input itself); selective
recomputation drops the attention's log-sum-exp (the other tensors it would free are saved by the
neighbouring layers anyway). A stage other than the first keeps its received input (bf16/fp16: beside the
first norm's fp32 copy), one other than the last its output, until the micro-batch's backward.

In flight: no pipelining 1 micro-batch; 1F1B min(P - p, m) on stage p; GPipe m; interleaved 1F1B min(2 (P - p - 1)
+ (v - 1) P + 1, m v) chunk micro-batches of L / (P v) layers each (schedules.py's warm-up counts plus the one in
its steady state); ZB-H1 min(P, m) on every stage: a micro-batch's graph, with everything it saved, lives until
its weight-gradient pass (pipeline/split_backward.py), and up to P micro-batches wait for theirs (the schedule's
bound, tests/test_pipeline_schedule_choice.py). A waiting W pass also holds the gradients B recorded for it, which
1F1B frees as its backward goes (weight_pass_bytes): up to p + 1 of them on stage p, the last stage's with its
logits' gradient. The loss's tensors are live for one micro-batch at a time (GPipe: m; ZB-H1: also through that
micro-batch's B, beside its logits' gradient, as B keeps the graph for W until it returns). The peak is the larger
of the forward's (everything held, plus the logits beside the loss) and the backward's, measured inside the MLP
backward of the stage's last layer: the loss's tensors of the micro-batch being backpropagated freed (not under
ZB-H1); a recomputed unit rebuilt; the residual stream's gradient, the MLP's gradients less the activation they
free (_backward_gradients); on a single stage with tied embeddings the output layer's weight gradient, which waits
for the embedding's. ZeRO-2/3 add their temporary buffers (_zero_buffers): a bucket's fp32 gradients while it
fills, and under ZeRO-3 the gathered parameters of the chunk's own unit and of the layer in use. FP8
(--fp8-format) adds the quantization buffers of its widest GEMM to both peaks (fp8_gemm_bytes); tensorwise FP8
saves a linear's input in 1 byte where e is counted above, so its saved bytes are an upper bound. The last stage
adds the multi-token prediction modules' saved tensors (mtp_bytes) to its head's.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config.layer_specs import ATTENTION, DENSE, LayerSpec, depth_layer_specs, layer_specs
from megatron_lite.config.layer_split import model_chunk_plans
from megatron_lite.config.sections import Config
from megatron_lite.data.tokenizers import padded_vocab_size
from megatron_lite.model.kinds import MIXERS, MLPS
from megatron_lite.model.kinds.activation_terms import (
    FP32,
    INDEX,
    expert_region_tokens,
    expert_tensor_parallel_size,
    micro_batch_tokens,
    norm_bytes,
    param_bytes,
)
from megatron_lite.planning.bucket_tables import chunk_table
from megatron_lite.planning.param_shapes import chunk_layer_specs
from megatron_lite.planning.shared_cache import per_config
from megatron_lite.planning.state_memory import group_sizes, zero_stage_of


@dataclass
class ActivationBytes:
    """Activation bytes of one rank of a pipeline stage."""

    per_microbatch: int  # saved by one micro-batch through all of this stage's layers (and the loss, last stage)
    in_flight: float  # micro-batches (of the whole stage) the schedule holds at once
    transient: int  # on top at the peak: logits beside the loss, or a recomputed unit and backward's gradients;
    # under zb-h1 also what the waiting W passes hold
    peak: int


_DENSE_SOFTMAX = LayerSpec(ATTENTION, DENSE)


def layer_bytes(config: Config, spec: LayerSpec = _DENSE_SOFTMAX) -> int:
    """Bytes one micro-batch saves in one transformer layer of `spec` without recomputation: its mixer's input,
    its mixer's and MLP's bytes by their kinds (model/kinds/), and its norms (one where the mixer is alone)."""
    e = param_bytes(config)
    tokens, stream = micro_batch_tokens(config)
    mlp = MLPS[spec.mlp]
    return (tokens * e * config.model.hidden_size + MIXERS[spec.mixer].saved_bytes(config, spec)
            + mlp.saved_bytes(config, spec) + stream * (1 + mlp.normed) * norm_bytes(config, e))


def layer_keys(config: Config) -> list[LayerSpec]:
    """What decides each decoder layer's saved bytes: its spec."""
    return layer_specs(config.model)


def _recomputed_layers(config: Config, chunk_num_layers: int) -> list[bool]:
    """Which layers of a chunk full recomputation covers (transformer.full_recompute_units)."""
    m = config.model
    if m.recompute_granularity != "full":
        return [False] * chunk_num_layers
    if m.recompute_method == "uniform":
        return [True] * chunk_num_layers
    covered = m.recompute_num_layers if m.recompute_num_layers is not None else chunk_num_layers
    return [index < covered for index in range(chunk_num_layers)]


def _unit_inputs(config: Config, chunk_num_layers: int) -> int:
    """Checkpointed units of a chunk: uniform groups of --recompute-num-layers, else one per recomputed layer."""
    m = config.model
    recomputed = sum(_recomputed_layers(config, chunk_num_layers))
    if m.recompute_method == "uniform":
        return -(-chunk_num_layers // m.recompute_num_layers)
    return recomputed


def head_bytes(config: Config) -> tuple[int, int]:
    """(saved, transient) bytes of the final norm, output layer and loss for one micro-batch."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    e = param_bytes(config)
    tokens, stream = micro_batch_tokens(config)
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp
    saved = stream * norm_bytes(config, e) + tokens * (e * m.hidden_size + FP32 * vocab + INDEX + 1 + 3 * FP32)
    return saved, tokens * e * vocab


def mtp_bytes(config: Config) -> int:
    """Bytes one micro-batch saves in the multi-token prediction modules (model/mtp.py), 0 without them: per depth
    the shifted token ids and labels, its two input norms, the projection's input e 2h (the whole sequence under
    sequence parallelism), its transformer layers (never recomputed; config/layer_specs.py depth_layer_specs), and a
    head as the main one's."""
    m = config.model
    if not m.mtp_num_layers:
        return 0
    e = param_bytes(config)
    tokens, stream = micro_batch_tokens(config)
    per_depth = (2 * tokens * INDEX + 2 * stream * norm_bytes(config, e) + tokens * e * 2 * m.hidden_size
                 + sum(layer_bytes(config, spec) for spec in depth_layer_specs(m))
                 + head_bytes(config)[0])
    return m.mtp_num_layers * per_depth


def _tied_weight_gradient(config: Config, chunks) -> int:
    """A stage that holds both the embedding and the output layer with tied weights (one pipeline stage) uses
    the table twice; autograd sums the two gradients before accumulating the parameter's, so the output
    layer's [v/tp, h] gradient, made at the start of a backward, waits until the embedding's at its end."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    if m.untie_embeddings_and_output_weights or not (chunks[0].pre_process and chunks[-1].post_process):
        return 0
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp
    return vocab * m.hidden_size * param_bytes(config)


def _zero_buffers(config: Config, chunks) -> tuple[int, int]:
    """(forward, backward) bytes of ZeRO-2/3's temporary buffers at the two peaks, for the chunk where they are
    largest. ZeRO-2/3 sum a bucket's gradients in an fp32 buffer of the whole bucket from its first gradient
    until its reduce-scatter: at the backward peak the bucket of the layer being backpropagated (taken as the
    largest dense bucket) and every expert bucket (reduced only at the end of the backward). ZeRO-3 gathers
    each unit's parameters around its use: the chunk's own unit (embedding, final norm, output layer) for its
    whole forward and, since the embedding's gradient comes last, its whole backward, plus one layer (two with
    --overlap-param-gather, which prefetches the next) in the backward."""
    p = config.parallel
    stage = zero_stage_of(config)
    if not stage.shards_grads:
        return 0, 0
    weight = param_bytes(config)
    forward = backward = 0
    for chunk in chunks:
        grads, own, layers = chunk_table(config, chunk).zero_buffers(group_sizes(config),
                                                                     2 if p.overlap_param_gather else 1)
        gathered_forward = gathered_backward = 0
        if stage.shards_params:
            gathered_forward, gathered_backward = weight * own, weight * (own + layers)
        forward = max(forward, gathered_forward)
        backward = max(backward, FP32 * grads + gathered_backward)
    return forward, backward


@dataclass(frozen=True)
class _LayoutTerms:
    """What every stage of a layout shares: the bytes each kind of layer saves, the head's (saved, transient)
    and multi-token prediction's bytes, backward's gradients and FP8's buffers."""

    layers: dict[LayerSpec, int]  # by layer_keys' key
    head: tuple[int, int]
    mtp: int
    backward_gradients: int
    fp8: int

    @classmethod
    def of(cls, config: Config) -> _LayoutTerms:
        return cls({key: layer_bytes(config, key) for key in set(layer_keys(config))}, head_bytes(config),
                   mtp_bytes(config), _backward_gradients(config), fp8_gemm_bytes(config))


def stage_activation_bytes(config: Config, pp_rank: int, schedule: str) -> ActivationBytes:
    """Peak activation bytes of a rank of pipeline stage `pp_rank` under `schedule`
    ("no_pipelining", "1f1b", "interleaved", "gpipe" or "zb-h1")."""
    p, m = config.parallel, config.model
    e = param_bytes(config)
    tokens, stream = micro_batch_tokens(config)
    pp, micro = p.pipeline_model_parallel_size, config.num_microbatches
    chunks = model_chunk_plans(config, pp_rank)
    chunk_saved, rebuild = [], 0
    terms = per_config(config, "activation terms", lambda: _LayoutTerms.of(config))
    pattern = layer_keys(config)
    for chunk in chunks:
        recomputed = _recomputed_layers(config, chunk.num_layers)
        layers = [terms.layers[pattern[number]]
                  for number in range(chunk.layer_offset, chunk.layer_offset + chunk.num_layers)]
        saved = sum(size for size, again in zip(layers, recomputed) if not again)
        saved += _unit_inputs(config, chunk.num_layers) * stream * e * m.hidden_size
        if m.rotary_position_embeddings:  # each chunk's cos and sin tables, [s/cp, 1, 1, d] fp32
            rotated = m.qk_pos_emb_head_dim if m.multi_latent_attention else m.rotary_dims
            saved += 2 * FP32 * (m.seq_length // p.context_parallel_size) * rotated
        if chunk.pre_process:
            saved += tokens * INDEX
        elif e != FP32:  # the received bf16/fp16 input, beside the fp32 copy the first norm saves
            saved += stream * e * m.hidden_size
        if not chunk.post_process:  # the output kept for the backward the next stage sends back
            saved += stream * e * m.hidden_size
        chunk_saved.append(saved)
        if any(recomputed):
            unit = m.recompute_num_layers if m.recompute_method == "uniform" else 1
            # In fp32 the first norm's input is the unit's input itself, already held.
            rebuild = max(rebuild, unit * max(layers) - (stream * e * m.hidden_size if e == FP32 else 0))
    head_saved, head_transient = terms.head if chunks[-1].post_process else (0, 0)
    head_saved += terms.mtp if chunks[-1].post_process else 0
    per_microbatch = sum(chunk_saved) + head_saved
    v = len(chunks)
    if schedule == "gpipe":
        in_flight, head_live = micro, micro
    elif schedule == "interleaved":
        in_flight = min(2 * (pp - pp_rank - 1) + (v - 1) * pp + 1, micro * v) / v
        head_live = 1
    elif schedule == "1f1b":
        in_flight, head_live = min(pp - pp_rank, micro), 1
    elif schedule == "zb-h1":
        in_flight, head_live = min(pp, micro), 1
    else:
        in_flight, head_live = 1, 1
    zero_forward, zero_backward = _zero_buffers(config, chunks)
    layers_held = in_flight * sum(chunk_saved)
    backward_transient = rebuild + terms.backward_gradients + _tied_weight_gradient(config, chunks) + zero_backward
    waiting, weight_pass, backward_heads = 0, 0, head_live - 1
    if schedule == "zb-h1":
        # Forwards and B run with one fewer W waiting than the most; that most is reached when a B ends, its
        # own W pass complete and the backward's transients gone.
        waiting, weight_pass = waiting_weight_passes(pp, pp_rank, micro) - 1, weight_pass_bytes(config, chunks[0])
        # B keeps the graph for W, so the loss's tensors (not W's) stay through B, until the schedule drops
        # the loss as B and the W that follows it end; the logits' gradient is made beside them.
        backward_heads = 1
    backward_transient += terms.fp8
    forward_peak = (layers_held + waiting * weight_pass + head_live * head_saved + head_transient + zero_forward
                    + terms.fp8)
    backward_peak = (layers_held + waiting * weight_pass + backward_heads * (head_saved + head_transient)
                     + max(backward_transient, weight_pass))
    peak = max(forward_peak, backward_peak)
    return ActivationBytes(per_microbatch, in_flight, round(peak - layers_held - head_live * head_saved), round(peak))


def fp8_gemm_bytes(config: Config) -> int:
    """The buffers of one FP8 linear's GEMMs at their largest (model/fp8.py), 0 without --fp8-format: for the
    widest operand (a token-by-feature input or gradient, or the weight) its magnitude (e bytes), its fp32 scaled
    copy and its FP8 values, beside the FP8 copies of the other operands (the gradient's transpose too)."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    if m.fp8_format is None:
        return 0
    tokens, _ = micro_batch_tokens(config)
    h, d, e = m.hidden_size, m.head_dim, param_bytes(config)
    # (in, out) features of QKV, the attention projection, fc1 and fc2 on one TP rank
    linears = [(h, (m.num_attention_heads + 2 * m.num_query_groups) * d // tp), (m.num_attention_heads * d // tp, h),
               (h, (2 if m.gated_linear_unit else 1) * m.ffn_hidden_size // tp), (m.ffn_hidden_size // tp, h)]
    largest = 0
    for k, n in linears:
        operands = [tokens * k, tokens * n, k * n]  # X, dY, W
        widest = max(operands)
        largest = max(largest, widest * (e + FP32) + sum(operands) + tokens * n)
    return largest


def _backward_gradients(config: Config) -> int:
    """What a layer's backward adds at its peak, in the MLP: the residual stream's gradient, held while the
    layer's branches are backpropagated, and the MLP's gradients less the activation they free. SwiGLU's
    product backward holds the gradients of the product, the gate's activation and the up projection (three
    ffn-wide tensors) once fc2's weight gradient has freed the product; a GeLU MLP the gradients of the
    activation's output and of fc1's output once the activation's output is freed."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    tokens, stream = micro_batch_tokens(config)
    widest = tokens * (m.ffn_hidden_size // tp)  # rows x ffn-wide columns: a dense MLP's, or the routed experts'
    if m.num_experts:
        experts = m.moe_router_topk * (m.moe_ffn_hidden_size // expert_tensor_parallel_size(config))
        widest = max(widest, expert_region_tokens(config) * experts)
    return param_bytes(config) * (stream * m.hidden_size + (2 if m.gated_linear_unit else 1) * widest)


def waiting_weight_passes(pp: int, pp_rank: int, micro: int) -> int:
    """The most micro-batches whose W pass waits at once on a ZB-H1 stage, reached as a B ends: the B of the
    first min(p, steady steps) micro-batches leave their W waiting and every later B is followed by the oldest
    W (schedules.forward_backward_pipelining_zero_bubble), so p + 1 when m >= P."""
    steady = micro - min(pp - pp_rank - 1, micro)
    return min(min(pp_rank, steady) + 1, micro)


def weight_pass_bytes(config: Config, chunk) -> int:
    """Bytes one micro-batch's waiting W pass holds beyond its graph (already counted in the micro-batch's saved
    bytes) on a ZB-H1 stage whose only chunk is `chunk`.

    B records, for W, the gradient arriving at every node where a weight enters the input path
    (pipeline/split_backward.py): each linear layer's output gradient [tokens, out/tp] in the activation dtype (the
    whole sequence under sequence parallelism, as the linear's input is all-gathered), and each norm's output
    gradient [s(/tp) b, h] (RMSNorm computes in fp32, so 4 bytes; LayerNorm in the activation dtype), the per-head q
    and k norms' (--qk-layernorm) on every local token. A row-parallel linear's bias is added after the reduction;
    under sequence parallelism its gradient is the [s/tp] slice, a tensor of its own, otherwise the linear's output
    gradient itself. The experts' GEMMs are a Python autograd.Function that computes its weight gradients in B: W
    holds those gradients, the size of the local experts' weights. 1F1B frees each of these as soon as the weight
    gradient is taken. A first stage has no input to differentiate: its W is the whole backward and holds the
    received output gradient.
    """
    m, p = config.model, config.parallel
    e, tp = param_bytes(config), p.tensor_model_parallel_size
    tokens, stream = micro_batch_tokens(config)
    h = m.hidden_size
    if chunk.pre_process:
        return stream * e * h
    norm = FP32 if m.normalization == "RMSNorm" else e
    d, nh, ng = m.head_dim, m.num_attention_heads // tp, m.num_query_groups // tp
    gated = 2 if m.gated_linear_unit else 1
    total = 0
    for spec in chunk_layer_specs(config, chunk):
        size = 2 * stream * norm * h  # input and pre-MLP norms
        if m.multi_latent_attention:  # the gradients of every projection's output
            q_width = nh * (m.qk_head_dim + m.qk_pos_emb_head_dim) + (m.q_lora_rank or 0)
            size += tokens * e * (q_width + m.kv_lora_rank + m.qk_pos_emb_head_dim
                                  + nh * (m.qk_head_dim + m.v_head_dim) + h)
        else:
            size += tokens * e * ((nh + 2 * ng) * d + h)  # QKV and output projection
        if m.qk_layernorm and not m.multi_latent_attention:
            size += tokens * norm * (nh + ng) * d
        moe = spec.routed_experts
        if moe:
            size += stream * FP32 * m.num_experts  # the router's GEMM runs in fp32
            expert_ffn = m.moe_ffn_hidden_size // expert_tensor_parallel_size(config)
            size += m.num_experts // p.expert_model_parallel_size * (gated + 1) * expert_ffn * h * e
            shared = m.moe_shared_expert_intermediate_size
            if shared:
                size += tokens * e * (gated * shared // tp + h + (1 if m.moe_shared_expert_gate else 0))
        else:
            size += tokens * e * (gated * m.ffn_hidden_size // tp + h)  # fc1 and fc2
        if not m.disable_bias_linear and p.sequence_parallel:
            size += (1 if moe else 2) * stream * e * h  # the output projection's and fc2's biases
        total += size
    if chunk.post_process:  # the final norm and the output layer, [tokens, v/tp]
        vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp
        total += stream * norm * h + tokens * e * vocab
    return total
