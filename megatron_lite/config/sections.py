"""Run configuration: one dataclass per section (model, parallel, optimizer, data, training, checkpoint,
logging), each field one Megatron-LM flag (dashes become underscores) with its docstring as the flag's help.

arguments.py fills a Config from the command line and YAML and validates it (validation.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_lite.config.attention_variants import AttentionVariantsConfig
from megatron_lite.config.fault_tolerance import FaultToleranceConfig
from megatron_lite.config.kinds import SECTIONS
from megatron_lite.config.moe import MoEConfig
from megatron_lite.config.sft import SFTConfig
from megatron_lite.data.samplers import rampup_global_batch_size


@dataclass
class ModelConfig(AttentionVariantsConfig, MoEConfig, *SECTIONS):
    num_layers: int = 2
    """transformer layers of the decoder"""
    hybrid_layer_pattern: str | None = None
    """the stack in Megatron's symbols, e.g. G-G-|G-*-/*- (config/hybrid_layer_pattern.py); sets --num-layers"""
    hidden_size: int = 128
    """width of the residual stream"""
    ffn_hidden_size: int | None = None
    """inner width of the MLP (per half with --swiglu); default: 4 x hidden-size"""
    num_attention_heads: int = 4
    """query heads of each attention layer"""
    group_query_attention: bool = False
    """share each key/value head among several query heads (--num-query-groups)"""
    num_query_groups: int | None = None
    """key/value heads, with --group-query-attention; default: num-attention-heads (plain multi-head attention)"""
    seq_length: int = 128
    """tokens per training sample"""
    max_position_embeddings: int | None = None
    """positions the model supports (rows of the learned position table); default: seq-length"""
    normalization: str = "LayerNorm"
    """the norm before attention, before the MLP and at the end (GPT-2: LayerNorm, Llama: RMSNorm)"""
    norm_epsilon: float = 1e-5
    """epsilon added to the variance inside every norm"""
    swiglu: bool = False
    """SwiGLU MLP (silu(x W_gate) * x W_up) instead of GELU (Llama)"""
    openai_gelu: bool = False
    """GPT-2's tanh approximation of GELU instead of the exact erf form"""
    squared_relu: bool = False
    """the MLP's activation relu(x)^2 instead of GELU (Nemotron-H, Nemotron 3; exclusive with --swiglu)"""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute: a learned table added to the embeddings (GPT-2); rope: rotary embeddings of queries and keys
    (Llama); yarn: rotary embeddings with YaRN's scaling (--rotary-scaling-factor and the --yarn-* flags; gpt-oss);
    none: no position information but what the layers infer (Nemotron-H, whose Mamba-2 layers are causal)"""
    rotary_base: float = 10000.0
    """base of RoPE's frequencies (Llama 3: 500000)"""
    kv_channels: int | None = None
    """the dimension of each attention head (Qwen3: 128 at hidden size 1024 with 16 heads); default: hidden-size /
    num-attention-heads"""
    qk_layernorm: bool = False
    """normalize each query and key head over its head dimension, before RoPE, with a norm of the --normalization kind
    (Qwen3)"""
    add_qkv_bias: bool = False
    """a bias on the QKV projection only, also with --disable-bias-linear (Qwen2)"""
    use_rope_scaling: bool = False
    """Llama 3.1's RoPE scaling: rotary frequencies with wavelengths above original-max-position-embeddings /
    low-freq-factor are divided by --rope-scaling-factor, those below original-max-position-embeddings /
    high-freq-factor kept, those between interpolated"""
    rope_scaling_factor: float = 8.0
    """with --use-rope-scaling: how much the low frequencies are slowed (Llama 3.1: 8, 3.2: 32)"""
    rope_scaling_low_freq_factor: float = 1.0
    """with --use-rope-scaling: see there"""
    rope_scaling_high_freq_factor: float = 4.0
    """with --use-rope-scaling: see there"""
    rope_scaling_original_max_position_embeddings: int = 8192
    """with --use-rope-scaling: the context length of pretraining before the scaling"""
    # Multi-latent attention (DeepSeek-V2/V3, model/attention/mla.py) and its YaRN RoPE (model/attention/yarn.py)
    multi_latent_attention: bool = False
    """multi-latent attention: queries and keys/values through low-rank latents, a RoPE key shared by all heads"""
    q_lora_rank: int | None = None
    """with --multi-latent-attention: rank of the query latent; unset: queries projected directly"""
    kv_lora_rank: int = 32
    """with --multi-latent-attention: rank of the key/value latent"""
    qk_head_dim: int = 128
    """with --multi-latent-attention: query/key dimensions per head without position embedding"""
    qk_pos_emb_head_dim: int = 64
    """with --multi-latent-attention: query/key dimensions per head that RoPE rotates"""
    v_head_dim: int = 128
    """with --multi-latent-attention: value dimensions per head"""
    rotary_scaling_factor: float = 1.0
    """with YaRN: YaRN's context stretch (DeepSeek-V3: 40); 1: plain RoPE"""
    mscale: float = 1.0
    """with YaRN: YaRN's mscale of the rotated query/key dimensions"""
    mscale_all_dim: float = 0.0
    """with YaRN: YaRN's mscale of all dimensions, which also scales the softmax"""
    yarn_original_max_position_embeddings: int = 4096
    """with YaRN: the context length before YaRN's stretch"""
    yarn_beta_fast: float = 32.0
    """with YaRN: YaRN keeps frequencies turning more often than this over the original context"""
    yarn_beta_slow: float = 1.0
    """with YaRN: YaRN stretches frequencies turning less often than this over it"""
    untie_embeddings_and_output_weights: bool = False
    """an output layer of its own instead of the transposed input embedding table (Llama 3 8B; GPT-2 and Llama 3.2 1B
    tie them)"""
    disable_bias_linear: bool = False
    """no biases in the linear layers (Llama)"""
    hidden_dropout: float = 0.1
    """dropout on the residual stream after attention and after the MLP"""
    attention_dropout: float = 0.1
    """dropout on the attention probabilities (0 with context parallelism)"""
    init_method_std: float = 0.02
    """standard deviation of the normal initial weights (output projections are divided by sqrt(2 x num-layers))"""
    vocab_size: int | None = None
    """vocabulary of --mock-data; with a corpus, the tokenizer's"""
    make_vocab_size_divisible_by: int = 128
    """the embedding and output tables are padded to a multiple of this times tensor-model-parallel-size rows"""
    model_preset: str | None = None
    """a named model shape (presets.py) that fills the model flags; explicit flags override it"""
    # FP8 GEMMs in the transformer layers' linears (model/fp8.py)
    fp8_format: str | None = None
    """FP8 GEMMs (forward, dgrad, wgrad) in every column- and row-parallel linear of the transformer layers: e4m3
    quantizes everything to e4m3, hybrid the output gradients to e5m2 and the rest to e4m3; unset: no FP8. The
    embedding, output layer, norms, attention core, router and MoE experts stay in the activation dtype"""
    fp8_recipe: str = "tensorwise"
    """with --fp8-format: how scales are taken, from the operands' current values: tensorwise one per tensor
    (Transformer Engine's current scaling), rowwise one per row along each GEMM's contraction (torchao's);
    Megatron's delayed, mxfp8, blockwise and custom are not built (Megatron's default is delayed)"""
    fp8_margin: int = 0
    """with --fp8-format: scales are 2^margin below the one that maps an operand's amax to the format's largest
    value"""
    first_last_layers_bf16: bool = False
    """with --fp8-format: keep the first --num-layers-at-start-in-bf16 and the last --num-layers-at-end-in-bf16
    layers of the model out of FP8 (in the activation dtype)"""
    num_layers_at_start_in_bf16: int = 1
    """with --first-last-layers-bf16: layers at the start of the model kept out of FP8"""
    num_layers_at_end_in_bf16: int = 1
    """with --first-last-layers-bf16: layers at the end of the model kept out of FP8"""
    # Multi-token prediction (model/mtp.py)
    mtp_num_layers: int | None = None
    """multi-token prediction depths after the last layer (DeepSeek-V3): depth k predicts token i + k + 1; unset: off"""
    mtp_loss_scaling_factor: float = 0.1
    """with --mtp-num-layers: the mean of the depths' cross-entropies, times this, is added to the training loss"""
    # Execution choices that change no numbers
    recompute_granularity: str | None = None
    """activation recomputation: full recomputes whole layers in backward (see --recompute-method), selective only the
    core attention"""
    recompute_method: str | None = None
    """with --recompute-granularity full: uniform checkpoints every layer, in groups of --recompute-num-layers
    consecutive layers whose inputs alone are kept; block checkpoints only the first --recompute-num-layers layers of
    each model chunk (pipeline stage, or virtual stage when interleaved); unset: the first --recompute-num-layers
    layers of each chunk, every layer without it"""
    recompute_num_layers: int | None = None
    """layers per recomputed group (uniform), or recomputed layers per model chunk (block)"""
    attention_backend: str = "auto"
    """auto and sdpa: torch's scaled_dot_product_attention (fused kernels on CUDA); flash: the flash-attn package"""
    torch_compile: bool = False
    """compile each transformer layer with torch.compile (inductor), eager elsewhere; losses equal eager's (tested on
    CPU, fp32). Off by default: on 2 CPU threads a training step measured 1.02-1.04x eager
    (benchmarks/results/train_step.jsonl), not worth a compile of tens of seconds; on a GPU neither run nor measured
    yet"""

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def gated_linear_unit(self) -> bool:
        """Whether fc1 makes [gate; up] halves: --swiglu, or --quick-geglu."""
        return self.swiglu or self.quick_geglu

    @property
    def rotary_position_embeddings(self) -> bool:
        """Whether queries and keys are rotated: --position-embedding-type rope, or yarn (RoPE with YaRN's scaling)."""
        return self.position_embedding_type in ("rope", "yarn")

    @property
    def rotary_dims(self) -> int:
        """The leading dimensions of each head that RoPE rotates (--rotary-percent of the head dimension)."""
        return round(self.head_dim * self.rotary_percent)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """ranks each layer's weights and heads are split over (Megatron's tensor parallelism)"""
    sequence_parallel: bool = False
    """with tensor parallelism: split the norms' and dropouts' activations along the sequence too (reduce-scatter and
    all-gather instead of all-reduce)"""
    context_parallel_size: int = 1
    """ranks the sequence of each sample is split over (attention spans all of them)"""
    pipeline_model_parallel_size: int = 1
    """pipeline stages the layers are split over"""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """layers per model chunk of the interleaved 1F1B schedule (each stage holds several chunks)"""
    num_virtual_stages_per_pipeline_rank: int | None = None
    """model chunks per pipeline rank for the interleaved schedule, each stage's layers split evenly among them; unlike
    --num-layers-per-virtual-pipeline-stage it allows --decoder-first/last-pipeline-num-layers"""
    decoder_first_pipeline_num_layers: int | None = None
    """layers of the first pipeline stage, when it should hold fewer or more than the others (it also holds the
    embedding)"""
    decoder_last_pipeline_num_layers: int | None = None
    """layers of the last pipeline stage (it also holds the output layer and the loss)"""
    pipeline_schedule: str = "1f1b"
    """with pipeline-model-parallel-size > 1: 1f1b (one forward one backward; interleaved when virtual stages are set)
    holds at most P - p micro-batches' activations on stage p; gpipe runs all forwards, then all backwards, holding
    all of them; same bubble (P - 1) / m. zb-h1 (zero bubble, Qi et al. 2023) splits each backward into the input
    gradient, sent back at once, and the weight gradients, delayed into the idle time: about a third of the bubble,
    at most P micro-batches held on any stage"""
    cp_comm_type: str = "p2p"
    """context-parallel attention: p2p (ring of K/V), allgather (all K/V gathered), a2a (Ulysses: all-to-all from a
    sequence split to a head split and back; heads must divide by context-parallel-size), a2a+p2p (a2a within groups
    of cp ranks, p2p across them: see --hierarchical-context-parallel-sizes)"""
    hierarchical_context_parallel_sizes: list[int] | None = None
    """with --cp-comm-type a2a+p2p: A x B = context-parallel-size; each A adjacent cp ranks exchange heads by all-to-all
    (heads must divide by A), and K/V go around a ring of the B groups"""
    expert_model_parallel_size: int = 1
    """ranks the experts of each MoE layer are split over"""
    expert_tensor_parallel_size: int | None = None
    """ranks each routed expert's weights are split over (MoE parallel folding: the experts regroup a stage's
    tensor x context x data-parallel ranks as expert-tensor x expert-model x expert-data parallel); default:
    tensor-model-parallel-size"""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer: optimizer state and the step sharded over data-parallel ranks (ZeRO-1,
    --data-parallel-sharding-strategy optim, unless that flag asks for more)"""
    overlap_grad_reduce: bool = False
    """reduce each gradient bucket as soon as its gradients are complete in the last micro-batch's backward"""
    overlap_param_gather: bool = False
    """with a sharded optimizer: all-gather updated parameters asynchronously, each module waiting for its own in
    forward (ZeRO-3: prefetch the next layer)"""
    ddp_bucket_size: int = 40_000_000
    """elements per gradient bucket (one collective each)"""
    data_parallel_sharding_strategy: str = "no_shard"
    """what a data-parallel rank keeps (optim/zero_stage.py): no_shard, optim (ZeRO-1: optimizer state), optim_grads
    (ZeRO-2: and gradients), optim_grads_params (ZeRO-3: and parameters)"""
    num_distributed_optimizer_instances: int = 1
    """with a sharded strategy: shard within N groups of data-parallel x context-parallel / N consecutive ranks
    (one node, say) and all-reduce the gradient shards between the groups once per step (Megatron's partial
    distributed optimizer, FSDP's hybrid sharding): less memory saved, the slow links carry only the all-reduce"""
    data_parallel_size: int = 1
    """derived from the world size, never a flag"""


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    """peak learning rate"""
    min_lr: float = 0.0
    """learning rate at the end of the decay"""
    lr_warmup_iters: int = 0
    """iterations to warm the learning rate up over, linearly from --lr-warmup-init to --lr"""
    lr_warmup_samples: int = 0
    """samples to warm up over, with --train-samples"""
    lr_warmup_fraction: float | None = None
    """warm up over this fraction of --lr-decay-iters/--lr-decay-samples, instead of
    --lr-warmup-iters/--lr-warmup-samples"""
    lr_warmup_init: float = 0.0
    """the learning rate warmup starts from (that of the first step)"""
    lr_decay_style: str = "cosine"
    """after warmup: constant --lr; linear or cosine down to --min-lr over --lr-decay-iters; WSD (warmup-stable-decay):
    --lr, then down to --min-lr in the last --lr-wsd-decay-iters of --lr-decay-iters by --lr-wsd-decay-style"""
    lr_decay_iters: int | None = None
    """iterations to decay the learning rate over, --min-lr after them; default: --train-iters"""
    lr_decay_samples: int | None = None
    """samples to decay over, with --train-samples; default: --train-samples"""
    lr_wsd_decay_style: str = "exponential"
    """the shape of WSD's decay phase over the fraction t of it done: linear 1-t, cosine (1+cos(pi t))/2, exponential
    2*0.5^t-1, minus_sqrt 1-sqrt(t)"""
    lr_wsd_decay_iters: int | None = None
    """iterations of WSD's decay phase, the last of --lr-decay-iters (WSD needs it)"""
    lr_wsd_decay_samples: int | None = None
    """samples of WSD's decay phase, with --train-samples"""
    weight_decay: float = 0.01
    """decoupled weight decay (AdamW) of the weights; biases and norms have none"""
    weight_decay_incr_style: str = "constant"
    """weight decay over the run: constant --weight-decay, or linear or cosine from --start-weight-decay to
    --end-weight-decay"""
    start_weight_decay: float | None = None
    """weight decay of the first step with --weight-decay-incr-style linear or cosine"""
    end_weight_decay: float | None = None
    """weight decay of the last step with --weight-decay-incr-style linear or cosine"""
    adam_beta1: float = 0.9
    """Adam's first-moment decay"""
    adam_beta2: float = 0.95
    """Adam's second-moment decay"""
    adam_eps: float = 1e-8
    """Adam's epsilon"""
    clip_grad: float = 1.0
    """clip the global gradient norm to this (0: no clipping)"""
    bf16: bool = False
    """bf16 weights and activations, fp32 gradients and master weights"""
    fp16: bool = False
    """fp16 weights and activations with loss scaling, fp32 gradients and master weights"""
    loss_scale: float | None = None
    """a fixed fp16 loss scale; unset: dynamic"""
    initial_loss_scale: float = 2.0**32
    """the dynamic fp16 loss scale to start from"""
    min_loss_scale: float = 1.0
    """the dynamic fp16 loss scale never goes below this"""
    loss_scale_window: int = 1000
    """steps without overflow before the dynamic loss scale doubles"""
    hysteresis: int = 2
    """overflows before the dynamic loss scale halves"""
    check_for_nan_in_loss_and_grad: bool = True
    """stop before applying a step whose loss or gradient norm is not finite"""
    optimizer_cpu_offload: bool = False
    """hold the fp32 master weights and Adam moments in host memory (pinned on CUDA) and step them there with
    torch's CPU AdamW; gradients go device to host and updated weights back each step; composes with the
    distributed optimizer"""
    optimizer_offload_fraction: float = 1.0
    """with --optimizer-cpu-offload: the share of this rank's optimizer state held and stepped on the host, in
    [0, 1] (whole parameters or distributed-optimizer shards, the leading ones nearest this share)"""
    optimizer: str = "adam"
    """adam (AdamW), or muon: Newton-Schulz-orthogonalised momentum for hidden matrices, AdamW for the rest"""
    muon_momentum: float = 0.9
    """Muon's momentum (an exponential moving average of the gradients)"""
    muon_nesterov: bool = False
    """Muon steps along the Nesterov look-ahead of its momentum"""
    muon_scale_mode: str = "spectral"
    """Muon's update scale of an [out, in] matrix: spectral, unit_rms_norm or shape_scaling (optim/muon.py)"""
    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations per Muon step"""
    muon_coefficient_type: str = "quintic"
    """Newton-Schulz coefficients: simple (Jordan's 3.4445, -4.7750, 2.0315), quintic, polar_express, aol"""
    muon_tp_mode: str = "duplicated"
    """a TP-split matrix orthogonalised whole (duplicated: gathered; distributed) or per shard (blockwise)"""
    muon_extra_scale_factor: float = 1.0
    """a further factor on Muon's update (0.2 with spectral matches AdamW's update RMS, as in Moonlight)"""
    muon_scalar_optimizer: str = "adam"
    """the optimizer of the parameters Muon does not step (embeddings, output layer, router, norms, biases)"""
    muon_no_split_qkv: bool = False
    """orthogonalise the fused QKV weight as one matrix, not its query, key and value parts apart"""


@dataclass
class DataConfig(SFTConfig):
    data_path: list[str] = field(default_factory=list)
    """[WEIGHT] PREFIX ... of .bin/.idx corpora (tools/preprocess_data.py), blended by weight and split by --split"""
    data_args_path: str | None = None
    """a file holding what --data-path would take (WEIGHT PREFIX pairs or prefixes, split on any whitespace), for blends
    of hundreds of prefixes; instead of --data-path"""
    split: str = "969,30,1"
    """train,valid,test shares of each --data-path prefix's documents; does not apply to
    --train-data-path/--valid-data-path/--test-data-path; default: 969,30,1"""
    # Separate corpora per split instead of --data-path and --split
    train_data_path: list[str] = field(default_factory=list)
    """[WEIGHT] PREFIX ... of an independent train corpus, read whole (instead of --data-path)"""
    valid_data_path: list[str] = field(default_factory=list)
    """[WEIGHT] PREFIX ... of an independent validation corpus, read whole; none: no evaluation"""
    test_data_path: list[str] = field(default_factory=list)
    """[WEIGHT] PREFIX ... of an independent test corpus, read whole"""
    mmap_bin_files: bool = True
    """memory-map the .bin files; --no-mmap-bin-files reads each sample with file reads instead (for file systems where
    mapping is slow or refused); samples are the same"""
    mock_data: bool = False
    """train on random tokens instead of a corpus"""
    tokenizer_type: str = "NullTokenizer"
    """the tokenizer of the corpus (its end-of-document token separates documents)"""
    tokenizer_model: str | None = None
    """the tokenizer's file or directory (SentencePiece .model, Hugging Face tokenizer.json directory)"""
    num_workers: int | None = None
    """data loader processes per rank; default: 2 on a GPU, 0 on the CPU"""
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    """the key (column) holding each document's text when --data-path names raw text (JSON lines, Parquet, saved
    datasets), which is tokenized and packed while training; default: text"""
    skip_bad_records: int = 0
    """raw text: skip up to this many records that are malformed or hold no text (each named in the log) instead of
    stopping at the first"""
    raw_text_chunk_mib: float = 4.0
    """raw text: a plain JSON-lines file is read in byte ranges of this many MiB, the units the loader workers take
    and the bounded buffer its documents are shuffled in (Parquet: a row group; saved datasets: 1024 rows; .gz/.zst
    files: the whole file); changing it changes the sample order"""
    data_cache_path: str | None = None
    """where the datasets' sample indices are cached; default: cache/ beside each corpus"""
    # Documents packed into a sequence, split at the tokenizer's end-of-document (EOD) token
    reset_position_ids: bool = False
    """position ids restart at 0 after each end-of-document (EOD) token"""
    reset_attention_mask: bool = False
    """a token attends only to the tokens of its own document (the EOD token ends its document): SDPA with a mask on the
    CPU, FlexAttention on CUDA, document spans of the blocks under context parallelism; needs --attention-dropout 0"""
    eod_mask_loss: bool = False
    """no loss at positions whose input token is an EOD (the prediction across documents)"""


@dataclass
class TrainingConfig(FaultToleranceConfig):
    micro_batch_size: int = 1
    """samples per forward and backward on one rank"""
    global_batch_size: int | None = None
    """samples per optimizer step over all data-parallel ranks (gradient accumulation makes up the rest); default:
    micro-batch-size x data-parallel size"""
    rampup_batch_size: list[int] | None = None
    """the global batch starts at START and grows by INCREMENT in equal steps over SAMPLES consumed samples up to
    --global-batch-size; the micro-batches per step follow (needs --train-samples)"""
    train_iters: int | None = None
    """iterations to train, or give --train-samples; default: 100"""
    train_samples: int | None = None
    """samples to train, instead of --train-iters: as many iterations as whole global batches fit; the -samples schedule
    flags go with it"""
    eval_interval: int = 1000
    """iterations between evaluations on the validation split"""
    eval_iters: int = 10
    """global batches of each evaluation"""
    eval_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks (names, or YAML task files) scored at each evaluation beside the validation
    loss, the accuracies logged in every sink (needs lm-eval: pip install -e ".[eval]", and a tokenizer)"""
    eval_task_limit: int | None = None
    """documents of each --eval-tasks task scored at each evaluation (the first ones); default: all"""
    calculate_per_token_loss: bool = False
    """train on the mean loss over all unmasked tokens of the global batch; default (Megatron's): each
    micro-batch's mean over its unmasked tokens, averaged over the micro-batches and data-parallel ranks. The two
    differ only when a loss mask (--eod-mask-loss) leaves micro-batches with different token counts; the
    logged lm loss is the token mean in both"""
    seed: int = 1234
    """seed of weights, data order and dropout"""
    device: str = "auto"
    """auto: CUDA when available, else the CPU"""
    exit_signal_handler: bool = False
    """on SIGTERM, save a checkpoint at the end of the step and exit 0"""
    exit_interval: int | None = None
    """save and exit after this many iterations"""
    exit_duration_in_mins: float | None = None
    """save and exit once this many minutes have passed"""
    distributed_timeout_minutes: float = 10.0
    """a collective that waits longer ends the run with an error"""
    hang_timeout_seconds: float | None = None
    """when a rank makes no progress (no step, no collective entered or left) this long, every rank that can
    reports where it is and the job exits; default: three times the longest iteration seen, at least 60 s and at
    most half of --distributed-timeout-minutes; 0: never"""
    rerun_mode: str = "validate_results"
    """validate_results: an iteration whose loss or gradient norm is suspicious (not finite, or with
    --check-for-spiky-loss / --check-for-large-grads at least 10x the largest of the first 100) is run again on
    the same data before its step: the same result is the data's (recorded, training goes on), another one a
    fault of the machine (the ranks are named and the run stops with exit status 17); disabled: only record and
    warn; report_stats: run every iteration twice and log the largest relative difference"""
    check_for_spiky_loss: bool = False
    """treat a loss of at least 10x the largest of the first 100 as suspicious (see --rerun-mode)"""
    check_for_large_grads: bool = False
    """treat a gradient norm of at least 10x the largest of the first 100 as suspicious (see --rerun-mode)"""
    result_rejected_tracker_filename: str | None = None
    """file that rank 0 appends a line to for each suspicious result and what its rerun showed (Megatron's
    format)"""


@dataclass
class CheckpointConfig:
    save: str | None = None
    """directory to save checkpoints to"""
    load: str | None = None
    """directory to load the newest complete checkpoint from"""
    save_interval: int | None = None
    """iterations between checkpoints (and one at the end)"""
    async_save: bool = False
    """write checkpoints in a background thread while training goes on"""
    no_load_optim: bool = False
    """load the weights only, not the optimizer state"""
    no_load_rng: bool = False
    """do not restore the random generators' states"""
    finetune: bool = False
    """load weights only and start from iteration 0 (no optimizer, random state or data position)"""
    keep_last_n: int | None = None
    """keep only the newest N checkpoints"""
    ckpt_step: int | None = None
    """load this iteration of --load instead of the newest complete one"""


@dataclass
class LoggingConfig:
    log_interval: int = 1
    """iterations between log lines"""
    wandb_project: str | None = None
    """log to this Weights & Biases project; default: $WANDB_PROJECT"""
    wandb_exp_name: str | None = None
    """the W&B run's name"""
    wandb_save_dir: str | None = None
    """the W&B run's local files; default: $WANDB_DIR, else ./wandb"""
    tensorboard_dir: str | None = None
    """write TensorBoard scalars here (needs the tensorboard extra)"""
    tensorboard_log_interval: int = 1
    """iterations between TensorBoard writes"""
    log_timers_to_tensorboard: bool = False
    """also the phase times (time_*_ms, iteration_time_s) to TensorBoard"""
    log_memory_to_tensorboard: bool = False
    """also the peak memory (memory_gib) to TensorBoard"""
    metrics_jsonl: str | None = None
    """append every logged iteration's metrics to this JSON-lines file"""
    peak_tflops: float | None = None
    """the device's peak TFLOP/s for MFU; default: read from the GPU's name"""
    log_straggler: bool = False
    """at each log interval, the min, median and max over the ranks of each phase's time and the slowest ranks
    with their hosts (one small gather per interval)"""
    straggler_minmax_count: int = 1
    """how many of the slowest ranks --log-straggler names"""
    debug: bool = False
    """print tracebacks with errors (also MEGATRON_LITE_DEBUG=1)"""
    profile: bool = False
    """write a torch profiler trace (CPU, and CUDA on a GPU; Chrome/Perfetto JSON) of the steps from
    --profile-step-start to --profile-step-end on each of --profile-ranks"""
    use_pytorch_profiler: bool = False
    """accepted as in Megatron command lines: --profile always uses the torch profiler here"""
    profile_step_start: int = 10
    """the first profiled step, counted from 0 as the iterations done before it (N: the step logged as iteration N+1)"""
    profile_step_end: int = 12
    """the step profiling stops before (not profiled)"""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """the global ranks to profile; default: 0"""
    profile_dir: str | None = None
    """where --profile writes rank<R>.pt.trace.json; default: --tensorboard-dir when set (as in Megatron), else
    ./profile"""
    record_memory_history: bool = False
    """CUDA only: record the caching allocator's history on each of --profile-ranks and dump it to
    --memory-snapshot-path at every log interval and on out-of-memory (open it at pytorch.org/memory_viz)"""
    memory_snapshot_path: str = "snapshot.pickle"
    """where --record-memory-history dumps: BASE_RANK.EXT at log intervals, BASE_oom_rank_RANK.EXT on
    out-of-memory"""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def virtual_pipeline_stages(self) -> int | None:
        """Model chunks per pipeline rank under the interleaved schedule (Megatron's
        virtual_pipeline_model_parallel_size), from either virtual-stage flag; None without interleaving."""
        m, p = self.model, self.parallel
        if p.num_virtual_stages_per_pipeline_rank is not None:
            return p.num_virtual_stages_per_pipeline_rank if p.num_virtual_stages_per_pipeline_rank > 1 else None
        if p.num_layers_per_virtual_pipeline_stage is not None:
            return m.num_layers // (p.pipeline_model_parallel_size * p.num_layers_per_virtual_pipeline_stage)
        return None

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per data-parallel rank in a batch of --global-batch-size (after any ramp-up)."""
        p, t = self.parallel, self.training
        return t.global_batch_size // (t.micro_batch_size * p.data_parallel_size)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the step that begins after `consumed_samples` (grows under --rampup-batch-size)."""
        t = self.training
        if t.rampup_batch_size is None:
            return t.global_batch_size
        return rampup_global_batch_size(consumed_samples, *t.rampup_batch_size, t.global_batch_size)

    def num_microbatches_at(self, consumed_samples: int) -> int:
        """Micro-batches per data-parallel rank in the step that begins after `consumed_samples`."""
        return self.global_batch_size_at(consumed_samples) // (self.training.micro_batch_size *
                                                               self.parallel.data_parallel_size)
