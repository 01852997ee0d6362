"""Activation bytes one rank holds at its peak in a training step: saved tensors per micro-batch, times the
micro-batches the pipeline schedule keeps in flight, plus the largest transient of the step.

What each layer saves for backward is read off the code (and checked against a CPU allocation tracker by
benchmarks/plan_accuracy.py), per token of the rank's micro-batch, with e the bytes of an activation (2 in
bf16/fp16, 4 in fp32) and tp-local widths:

  each norm (input and pre-MLP)  its input in fp32 and its normalized fp32 intermediate (RMSNorm: 4h + 4h,
                                 plus a 4-byte rstd; LayerNorm: e h input and 8 bytes of mean and rstd)
  QKV and fc1 inputs             e h each (the whole sequence under sequence parallelism: the linear saves
                                 the all-gathered input)
  QKV output                     e (nh + 2 ng) d / tp, kept alive by the value heads attention saves
  rotated q and k (RoPE)         e (nh + ng) d / tp; without RoPE the query copy e nh d / tp
  attention output               e nh d / tp (also the output projection's input) and a 4-byte
                                 log-sum-exp per head
  output gate (Qwen3-Next)       its rows in the QKV output, e nh d / tp more; sigmoid(gate) and the gated
                                 output, 2 e nh d / tp
  materialised attention         a layer with a window, or any with sinks (window_and_sinks.py), instead of
                                 the QKV output, rotated q and k, and log-sum-exp: an fp32 copy of q, k and v
                                 repeated to the query heads in fp32 over the sequence's s keys, the fp32
                                 probabilities over s keys (and the sink), 4 nh (s + 1) / tp, and the bool
                                 mask, s x s per micro-batch (per sequence with documents); under context
                                 parallelism the rank's s/cp queries over the gathered s keys, as p2p,
                                 allgather and a2a+p2p save them (a2a keeps k and v of nh / cp heads instead)
  MLP                            fc1 output e c ffn / tp (c = 2 for SwiGLU), the activation's output
                                 e ffn / tp, and SwiGLU's product e ffn / tp
  MoE layer's MLP                the router's fp32 input, logits and scores (4 E) and top-k probabilities
                                 and indices on the rank's own tokens; for k copies of each token of the
                                 expert region, the routed experts' input e h, fc1 output, activation and
                                 product (ffn / etp wide; ETP: --expert-tensor-parallel-size), their output
                                 and its probability-weighted copy e 2h, the probability and three int64
                                 indices; the region is the ETP group's tokens (s/tp each, gathered) where its
                                 ranks hold different ones, else the rank's s; a shared expert's input (a
                                 tensor of its own under sequence parallelism or bf16/fp16), fc1 output,
                                 activation and product on s tokens, ffn / tp wide, and its gate's output

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

Multi-latent attention (model/attention/mla.py) saves instead of QKV's tensors, with nh local heads: its input e h; per
latent (query, with --q-lora-rank, and key/value) the norm's (as the norms above) and the up-projection's input
e r (in fp32 the key/value norm's input is a view that keeps the whole down-projection output); the query and
the key of e nh (qk_head_dim + qk_pos_emb_head_dim) each; the up-projection's
output e nh (qk_head_dim + v_head_dim), which the value heads keep alive (with padded heads, the padded value
e nh max(dims) instead); the attention output e nh v_head_dim and the log-sum-exp. These are the tensors fused
kernels save; the CPU's SDPA math path (different query-key and value head sizes) also saves the [s, s]
probabilities, so tests/test_mla.py checks the formula against the tensors autograd saves with the core attention
recomputed (selective), which saves only its inputs; the kernels' own saves are not checked.

A Gated DeltaNet layer (model/linear_attention/gated_delta_net.py) saves instead of the attention's, with its rank's
key and value heads (c = 2 dk nk + dv nv convolution channels): its input projection's input e h; the convolution's
input, its kernel - 1 shifted copies and its output, 5 e c; what the L2 norms of q and k read (in fp32 the
convolution's SiLU output, 4 c; else its fp32 copies of q and k) and their 4-byte rsqrt per head; beta, the decay
and softplus's input and output, 4 x 4 bytes per value head; the delta rule's inputs, which are all it keeps (it
recomputes its chunks in backward): q and k repeated to the value heads in fp32, and v, e dv nv; the output side's
fp32 rule output, its contiguous copy, the normalized output, z and SiLU(z) (5 x 4 dv nv), the norm's rsqrt, and the
output projection's input e dv nv (gated_delta_net_bytes; tests/test_hybrid_models.py checks it against autograd).
The ZB-H1 weight-pass bytes count such a layer as softmax attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config.layer_specs import (
    ATTENTION,
    DENSE,
    GATED_DELTA_NET,
    LATENT_ATTENTION,
    MOE,
    LayerSpec,
    layer_spec,
    layer_specs,
)
from megatron_lite.config.layer_split import model_chunk_plans
from megatron_lite.config.sections import Config
from megatron_lite.data.tokenizers import padded_vocab_size
from megatron_lite.planning.bucket_tables import chunk_table
from megatron_lite.planning.param_shapes import chunk_layer_specs, expert_tensor_parallel_size
from megatron_lite.planning.shared_cache import per_config
from megatron_lite.planning.state_memory import FP32, group_sizes, param_bytes, zero_stage_of

INDEX = 8  # int64 token ids and labels


@dataclass
class ActivationBytes:
    """Activation bytes of one rank of a pipeline stage."""

    per_microbatch: int  # saved by one micro-batch through all of this stage's layers (and the loss, last stage)
    in_flight: float  # micro-batches (of the whole stage) the schedule holds at once
    transient: int  # on top at the peak: logits beside the loss, or a recomputed unit and backward's gradients;
    # under zb-h1 also what the waiting W passes hold
    peak: int


def _tokens(config: Config) -> tuple[int, int]:
    """Tokens of one micro-batch on one rank: (all local tokens, tokens of the residual stream)."""
    m, p, b = config.model, config.parallel, config.training.micro_batch_size
    tokens = m.seq_length // p.context_parallel_size * b
    return tokens, tokens // p.tensor_model_parallel_size if p.sequence_parallel else tokens


def _norm_bytes(config: Config, e: int) -> int:
    h = config.model.hidden_size
    return 8 * h + FP32 if config.model.normalization == "RMSNorm" else e * h + 2 * FP32


def latent_attention_bytes(config: Config) -> int:
    """Bytes per token multi-latent attention saves beyond its input (module docstring)."""
    m, p = config.model, config.parallel
    e, nh = param_bytes(config), m.num_attention_heads // p.tensor_model_parallel_size
    q_dim = m.qk_head_dim + m.qk_pos_emb_head_dim
    ranks = [m.kv_lora_rank] + ([m.q_lora_rank] if m.q_lora_rank is not None else [])
    norm = (lambda r: 2 * FP32 * r + FP32) if m.normalization == "RMSNorm" else (lambda r: e * r + 2 * FP32)
    latents = sum((norm(r) if m.qk_layernorm else 0) + e * r for r in ranks)
    if m.qk_layernorm and e == FP32:  # the key/value latent's norm input is a view of the down-projection's output
        latents += FP32 * m.qk_pos_emb_head_dim
    padded = q_dim != m.v_head_dim and (p.context_parallel_size > 1 or m.attention_backend == "flash")
    values = max(q_dim, m.v_head_dim) if padded else m.qk_head_dim + m.v_head_dim
    return latents + e * nh * (2 * q_dim + values + m.v_head_dim)


def expert_region_tokens(config: Config) -> int:
    """Tokens of one micro-batch that a rank's routed experts serve (model/moe/layer.py's expert region): the ETP
    group's, all-gathered when its ranks hold different tokens (sequence parallelism, or ETP ranks that are not the
    rank's TP peers under folding), else the rank's own. With ETP = TP that is every local token."""
    p = config.parallel
    tokens, stream = _tokens(config)
    etp = expert_tensor_parallel_size(config)
    return stream * etp if p.sequence_parallel or etp != p.tensor_model_parallel_size else tokens


def gated_delta_net_bytes(config: Config) -> int:
    """Bytes per token a Gated DeltaNet layer saves beyond its input projection's input (module docstring), with
    its tensor-parallel rank's heads (context parallelism trades tokens for heads: the product is the same);
    recomputed (selective), its core keeps only its input and output."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    e = param_bytes(config)
    key_heads, value_heads = m.linear_num_key_heads // tp, m.linear_num_value_heads // tp
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    if m.recompute_granularity == "selective":  # the core's input (the projections' output) and its gated output
        return e * (2 * key_heads * dk + 2 * value_heads * dv + 2 * value_heads) + e * value_heads * dv
    channels = key_heads * 2 * dk + value_heads * dv
    convolution = 5 * e * channels  # its input and the kernel - 1 shifted copies, and its output (SiLU's input)
    query_keys = FP32 * channels if e == FP32 else 2 * FP32 * key_heads * dk  # what the L2 norms read
    query_keys += 2 * FP32 * key_heads  # their rsqrt
    decays = 4 * FP32 * value_heads  # beta, g, softplus's input and output
    rule_inputs = 2 * FP32 * value_heads * dk + e * value_heads * dv  # q and k repeated to the value heads, v
    output = 5 * FP32 * value_heads * dv + FP32 * value_heads + e * value_heads * dv
    return convolution + query_keys + decays + rule_inputs + output


_DENSE_SOFTMAX = LayerSpec(ATTENTION, DENSE)


def softmax_attention_bytes(config: Config, materialised: bool) -> int:
    """Bytes one micro-batch saves in softmax attention beyond the QKV projection's input (module docstring): by a
    fused kernel, or `materialised` by window_and_sinks.py's attention (a layer with a window, or any with sinks).
    Recomputed (selective), either core keeps only its inputs and output."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    e = param_bytes(config)
    tokens = _tokens(config)[0]
    d, nh, ng = m.head_dim, m.num_attention_heads // tp, m.num_query_groups // tp
    gate = e * 2 * nh * d if m.attention_output_gate else 0  # sigmoid(gate) and the gated output
    if not materialised or m.recompute_granularity == "selective":
        lse = 0 if m.recompute_granularity == "selective" else FP32 * nh
        query_rows = nh * (2 if m.attention_output_gate else 1)
        per_token = e * (query_rows + 2 * ng) * d  # QKV output
        per_token += e * (nh + ng) * d if m.rotary_position_embeddings else e * nh * d
        return tokens * (per_token + e * nh * d + lse + gate)
    keys = m.seq_length  # every query's row of scores spans the whole sequence (gathered under CP)
    batch = config.training.micro_batch_size
    sinks = m.softmax_type != "vanilla"
    per_token = FP32 * nh * d + FP32 * nh * (keys + sinks) + e * nh * d + gate  # fp32 q, probabilities, output
    key_values = 2 * FP32 * nh * d * batch * keys  # fp32 k and v, repeated to the query heads
    mask = tokens // batch * keys * (batch if config.data.reset_attention_mask else 1)  # bool, shared by the rows
    return tokens * per_token + key_values + mask


def layer_bytes(config: Config, spec: LayerSpec = _DENSE_SOFTMAX) -> int:
    """Bytes one micro-batch saves in one transformer layer of `spec` without recomputation: its mixer's input,
    its mixer's and MLP's bytes by the tables MIXER_BYTES and MLP_BYTES, and its two norms."""
    e = param_bytes(config)
    tokens, stream = _tokens(config)
    return (tokens * e * config.model.hidden_size + MIXER_BYTES[spec.mixer](config, spec)
            + MLP_BYTES[spec.mlp](config) + stream * 2 * _norm_bytes(config, e))


def _softmax_attention(config: Config, spec: LayerSpec) -> int:
    """By a fused kernel, or by window_and_sinks.py's materialised scores (a window, or sinks)."""
    return softmax_attention_bytes(config, config.model.softmax_type != "vanilla" or spec.window is not None)


def _latent_attention(config: Config, spec: LayerSpec) -> int:
    m, tokens = config.model, _tokens(config)[0]
    heads = m.num_attention_heads // config.parallel.tensor_model_parallel_size
    lse = 0 if m.recompute_granularity == "selective" else FP32 * heads  # the kernel's log-sum-exp
    return tokens * (latent_attention_bytes(config) + lse)


def _gated_delta_net(config: Config, spec: LayerSpec) -> int:
    return _tokens(config)[0] * gated_delta_net_bytes(config)


def _dense_mlp(config: Config) -> int:
    """fc1's input and output (2 ffn wide gated), the activation's output and the product."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    widths = 4 if m.gated_linear_unit else 2
    return _tokens(config)[0] * param_bytes(config) * (m.hidden_size + m.ffn_hidden_size // tp * widths)


def layer_keys(config: Config) -> list[LayerSpec]:
    """What decides each decoder layer's saved bytes: its spec."""
    return layer_specs(config.model)


def moe_mlp_bytes(config: Config) -> int:
    """Bytes one micro-batch saves in an MoE layer's MLP (module docstring), for softmax routing with a balancing
    loss (other router settings save other [tokens, E] fp32 tensors)."""
    m, p = config.model, config.parallel
    e, h, k = param_bytes(config), m.hidden_size, m.moe_router_topk
    tokens, stream = _tokens(config)
    widths = 4 if m.gated_linear_unit else 2
    router = FP32 * (h + 2 * m.num_experts + 1) + k * (FP32 + INDEX)  # this rank's tokens (s/tp under SP)
    experts = e * (3 * h + widths * (m.moe_ffn_hidden_size // expert_tensor_parallel_size(config)) + 1) + 3 * INDEX
    total = stream * router + expert_region_tokens(config) * k * experts
    shared = m.moe_shared_expert_intermediate_size
    if shared:  # on every local token: its input (the router's fp32 one without SP, in fp32), fc1 and activation
        own_input = p.sequence_parallel or e != FP32
        gate = e * (h + 1) if m.moe_shared_expert_gate else 0  # its output and the gate's sigmoid
        total += tokens * (e * (h * own_input + widths * (shared // p.tensor_model_parallel_size)) + gate)
    return total


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
    tokens, stream = _tokens(config)
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp
    saved = stream * _norm_bytes(config, e) + tokens * (e * m.hidden_size + FP32 * vocab + INDEX + 1 + 3 * FP32)
    return saved, tokens * e * vocab


def mtp_bytes(config: Config) -> int:
    """Bytes one micro-batch saves in the multi-token prediction modules (model/mtp.py), 0 without them: per depth
    the shifted token ids and labels, its two input norms, the projection's input e 2h (the whole sequence under
    sequence parallelism), a transformer layer of the last decoder layer's kind (never recomputed), and a head as
    the main one's."""
    m = config.model
    if not m.mtp_num_layers:
        return 0
    e = param_bytes(config)
    tokens, stream = _tokens(config)
    per_depth = (2 * tokens * INDEX + 2 * stream * _norm_bytes(config, e) + tokens * e * 2 * m.hidden_size
                 + layer_bytes(config, layer_spec(m, m.num_layers))
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
    tokens, stream = _tokens(config)
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
    tokens, _ = _tokens(config)
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
    tokens, stream = _tokens(config)
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
    tokens, stream = _tokens(config)
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
        moe = spec.mlp == MOE
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


# Bytes one micro-batch saves in each kind of token mixer and MLP (config/layer_specs.py)
MIXER_BYTES = {ATTENTION: _softmax_attention, LATENT_ATTENTION: _latent_attention, GATED_DELTA_NET: _gated_delta_net}
MLP_BYTES = {DENSE: _dense_mlp, MOE: moe_mlp_bytes}
