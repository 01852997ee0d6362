"""The MoE layer on one process against a plain-PyTorch reference written here: routing (Mixtral, pre-softmax,
sigmoid with a scaling factor or an expert bias, group-limited), experts (SwiGLU and GELU), shared experts
(with Qwen2-MoE's gate), the aux loss (per micro-batch or per sequence, or none) and z-loss values and their
gradients, capacity drops; the expert-bias update; global expert names; one-line configuration errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pretrain_gpt
from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.model.gpt import GPTModel
from megatron_lite.model.loss_scaling import LossScaling, scaled_loss
from megatron_lite.model.moe import experts as moe_experts
from megatron_lite.model.moe.layer import (
    MoELayer,
    moe_metrics,
    update_expert_biases,
)
from megatron_lite.model.moe.router import capacity_keep_mask, expert_capacity
from megatron_lite.model.sharding import initialize_parameters
from megatron_lite.parallel.state import Layout, ParallelState, TensorSplit
from megatron_lite.pipeline import schedules
from megatron_lite.training.host_reads import counted_device_reads
from megatron_lite.training.loop import (
    build_data_iterator,
    build_datasets,
    build_model,
    initialize,
    train_step,
)
from tests.helpers import build_run
from tests.tolerances import assert_close_relative

BASE = {"model_preset": "mixtral-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
        "moe_ffn_hidden_size": 48, "num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
        "moe_z_loss_coeff": 0.001, "seq_length": 8, "max_position_embeddings": 8}


def _layer(values: dict) -> MoELayer:
    config = make_config({**BASE, **values})
    layer = MoELayer(config.model, ParallelState.single(), 0, sequence_parallel=False,
                     token_dispatcher=config.model.moe_token_dispatcher_type)
    initialize_parameters(layer.named_parameters(), 7, 0.2, 2, TensorSplit())
    return layer


def _naive_keep(probs, indices, num_experts, capacity):
    """Each expert keeps its `capacity` most probable tokens, the earlier token first on ties."""
    keep, probs = torch.zeros_like(indices, dtype=torch.bool), probs.detach()
    for expert in range(num_experts):
        queue = sorted((-float(probs[t, j]), t, j) for t in range(indices.shape[0])
                        for j in range(indices.shape[1]) if indices[t, j] == expert)
        for _, t, j in queue[:capacity]:
            keep[t, j] = True
    return keep


def _route(router, logits):
    """(probabilities [T, k], experts [T, k]) as the router's options say, one token at a time."""
    c, bias = router.choice, router.expert_bias
    probs, indices = [], []
    for row in logits:
        if c.score_function == "sigmoid":
            scores = torch.sigmoid(row)
            selection = scores.detach() + (bias if bias is not None else 0)
        else:
            scores = torch.softmax(row, -1) if c.pre_softmax else row
            selection = scores.detach()
        candidates = list(range(row.numel()))
        if c.num_groups:
            size = row.numel() // c.num_groups
            groups = [list(range(g * size, (g + 1) * size)) for g in range(c.num_groups)]
            strength = [sum(sorted((float(selection[e]) for e in group), reverse=True)[:c.topk // c.group_topk])
                        for group in groups]
            best = sorted(range(c.num_groups), key=lambda g: -strength[g])[:c.group_topk]
            candidates = [e for g in best for e in groups[g]]
        chosen = sorted(candidates, key=lambda e: -float(selection[e]))[:c.topk]
        if c.score_function == "sigmoid":  # the chosen scores normalized, unless there is one (Megatron's rule)
            p = scores[chosen] / scores[chosen].sum() if c.topk > 1 else scores[chosen]
        elif c.pre_softmax:
            p = scores[chosen]
        else:
            p = torch.softmax(row[chosen], -1)
        probs.append(p * (c.scaling_factor or 1.0))
        indices.append(torch.tensor(chosen))
    return torch.stack(probs), torch.stack(indices)


def _switch_loss(counts, scores, topk, coeff):
    """coeff * E * sum_i f_i P_i over the tokens of `scores` [n, E] with their expert counts [E]."""
    n, num_experts = scores.shape
    return coeff * num_experts * ((counts / (n * topk)) * scores.mean(0)).sum()


def _reference(layer: MoELayer, x: torch.Tensor, capacity_factor=None, batch=2):
    """Plain PyTorch: (output [T, h], aux loss, z-loss, keep mask) from the layer's weights; row t of x
    is position t // batch of sequence t % batch."""
    m = layer.router
    logits = x @ m.weight.t()
    num_tokens, num_experts, topk = logits.shape[0], logits.shape[1], m.choice.topk
    probs, indices = _route(m, logits)
    keep = torch.ones_like(indices, dtype=torch.bool)
    if capacity_factor is not None:
        keep = _naive_keep(probs, indices, num_experts, expert_capacity(num_tokens, num_experts, topk, capacity_factor))
    swiglu = layer.experts[0].config.swiglu

    def mlp(module, row):
        hidden = row @ module.linear_fc1.weight.t()
        if swiglu:
            gate, up = hidden.chunk(2)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden)
        return hidden @ module.linear_fc2.weight.t()

    out = torch.zeros_like(x)
    for t in range(num_tokens):
        for j in range(topk):
            if keep[t, j]:
                out[t] = out[t] + probs[t, j] * mlp(layer.experts[int(indices[t, j])], x[t])
        shared = layer.shared_experts
        if shared is not None:
            gate = torch.sigmoid(x[t] @ shared.gate_weight[0]) if shared.gate_weight is not None else 1.0
            out[t] = out[t] + gate * mlp(shared, x[t])
    if m.choice.score_function == "sigmoid":
        scores = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)
    else:
        scores = torch.softmax(logits, -1)
    counts = torch.stack([(indices == e).sum() for e in range(num_experts)]).float()
    if m.load_balancing_type == "aux_loss":
        aux = _switch_loss(counts, scores, topk, m.aux_loss_coeff)
    elif m.load_balancing_type == "seq_aux_loss":
        per_sequence = []
        for sequence in range(batch):
            rows = torch.arange(sequence, num_tokens, batch)
            seq_counts = torch.stack([(indices[rows] == e).sum() for e in range(num_experts)]).float()
            per_sequence.append(_switch_loss(seq_counts, scores[rows], topk, m.aux_loss_coeff))
        aux = torch.stack(per_sequence).mean()
    else:
        aux = torch.zeros(())
    z = m.z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    return out, aux, z, keep


SIGMOID = {"moe_router_score_function": "sigmoid"}
ROUTER_AND_SHARED_EXPERT_VARIANTS = [
    {**SIGMOID, "moe_router_topk_scaling_factor": 2.5},
    {**SIGMOID, "moe_router_topk": 1},
    {**SIGMOID, "moe_router_enable_expert_bias": True},
    {**SIGMOID, "moe_router_load_balancing_type": "seq_aux_loss"},
    {"moe_router_load_balancing_type": "seq_aux_loss", "moe_router_pre_softmax": True},
    {"moe_router_load_balancing_type": "none"},
    {"num_experts": 8, "moe_router_topk": 4, "moe_router_num_groups": 4, "moe_router_group_topk": 2},
    {**SIGMOID, "num_experts": 8, "moe_router_num_groups": 2, "moe_router_group_topk": 1,
     "moe_router_enable_expert_bias": True},
    {"moe_shared_expert_intermediate_size": 40},
    {"moe_shared_expert_intermediate_size": 24, "moe_shared_expert_gate": True, "swiglu": False},
]


@pytest.mark.parametrize("variant", [{}, {"swiglu": False, "moe_router_pre_softmax": True},
                                     {"moe_expert_capacity_factor": 0.5},
                                     {"moe_token_dispatcher_type": "allgather", "moe_expert_capacity_factor": 0.75},
                                     *ROUTER_AND_SHARED_EXPERT_VARIANTS])
def test_moe_layer_and_its_losses_match_a_direct_computation(variant):
    """Output, logged aux/z-loss and the gradients of mean(loss) + aux + z equal the reference's."""
    torch.manual_seed(0)
    layer = _layer(variant)
    if layer.router.expert_bias is not None:  # a bias large enough to change choices
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, layer.num_experts))
    s, b, h = 8, 2, BASE["hidden_size"]
    x = torch.randn(s, b, h, requires_grad=True)
    upstream = torch.randn(s, b, h)  # d(per-token loss sum)/d(output), standing in for the layers above

    (layer(x) * upstream).sum().backward()  # the training loss is a sum over the T = s b tokens
    grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()

    tokens = x.reshape(-1, h)
    out, aux, z, keep = _reference(layer, tokens, variant.get("moe_expert_capacity_factor"), batch=b)
    ((out * upstream.reshape(-1, h)).sum() / (s * b) + aux + z).backward()  # mean loss + aux + z
    expected = [x.grad] + [torch.zeros_like(p) if p.grad is None else p.grad for p in layer.parameters()]  # unused
    for (name, _), got, want in zip([("x", None), *layer.named_parameters()], grads, expected, strict=True):
        assert_close_relative(got / (s * b), want, rel=1e-5, msg=name)

    with torch.no_grad():
        assert_close_relative(layer(x).reshape(-1, h), out, rel=1e-5)
    metrics = moe_metrics([layer], ParallelState.single(), make_config({**BASE, "num_layers": 1, **variant}).model,
                          sequence_parallel=False)
    assert metrics["moe_aux_loss_layer_0"] == pytest.approx(aux.item(), rel=1e-5)
    assert metrics["moe_z_loss_layer_0"] == pytest.approx(z.item(), rel=1e-5)
    assert metrics["moe_dropped_tokens_layer_0"] == int((~keep).sum())
    topk = variant.get("moe_router_topk", BASE["moe_router_topk"])
    assert sum(metrics["moe_tokens_per_expert_layer_0"]) == s * b * topk
    if "moe_expert_capacity_factor" in variant:
        assert 0 < metrics["moe_dropped_tokens_layer_0"] < s * b * topk
    assert layer.statistics is None  # read and reset; the no-grad forward above recorded nothing


def test_expert_bias_moves_towards_balance_and_only_changes_selection():
    """After an iteration each bias moves by the update rate against its expert's load (sign(mean - load));
    the bias decides the experts but the probabilities stay the unbiased sigmoid scores."""
    torch.manual_seed(0)
    values = {**SIGMOID, "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.01}
    layer = _layer(values)
    x = torch.randn(8, 2, BASE["hidden_size"])
    logits = x.reshape(-1, BASE["hidden_size"]) @ layer.router.weight.detach().t()
    _, indices = _route(layer.router, logits)  # the routing of this iteration: zero bias
    layer(x).sum().backward()
    update_expert_biases([layer], ParallelState.single(), make_config({**BASE, "num_layers": 1, **values}).model)
    load = torch.stack([(indices == e).sum() for e in range(layer.num_experts)]).float()
    assert torch.equal(layer.router.expert_bias, 0.01 * torch.sign(load.mean() - load))
    assert layer.load_since_bias_update is None
    favoured = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 wins every token's first place
    layer.router.expert_bias.copy_(favoured)
    probs, indices, _ = layer.router(x)
    assert (indices == 3).any(-1).all()
    scores = torch.sigmoid(logits).gather(1, indices)
    assert_close_relative(probs, scores / scores.sum(-1, keepdim=True), rel=1e-6)


def test_moe_loss_gradients_follow_the_fp16_loss_scale():
    """The schedule multiplies the language-model loss by the loss scale; the MoE losses' gradients too."""
    torch.manual_seed(0)
    layer = _layer({})
    x, upstream = torch.randn(8, 2, BASE["hidden_size"]), torch.randn(8, 2, BASE["hidden_size"])
    (layer(x) * upstream).sum().backward()
    unscaled = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    with scaled_loss(LossScaling(loss_scale=1024.0)):  # as the schedule runs each forward
        output = layer(x)
    ((output * upstream).sum() * 1024.0).backward()
    for got, want in zip([p.grad for p in layer.parameters()], unscaled, strict=True):
        assert_close_relative(got / 1024.0, want, rel=1e-5)


@pytest.mark.parametrize("schedule", [schedules.forward_backward_no_pipelining,
                                      schedules.forward_backward_pipelining_without_interleaving])
def test_the_schedules_scale_the_moe_losses_with_the_language_model_loss(schedule):
    """A schedule run with loss scale 256 gives router and expert gradients 256 times those of loss scale 1,
    with balancing losses weighted enough to count in them (1F1B on one stage runs the pipelines' micro-batch
    runner)."""
    config = make_config({**BASE, "moe_aux_loss_coeff": 1.0, "moe_z_loss_coeff": 0.1, "micro_batch_size": 2,
                          "global_batch_size": 4})
    pstate, device = initialize(config)
    model = build_model(config, pstate, pretrain_gpt.model_provider, device)
    iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
    batches = [next(iterator) for _ in range(config.num_microbatches)]

    def moe_grads(loss_scale: float) -> dict:
        for chunk in model:
            chunk.zero_grad_buffer()
        schedule(pretrain_gpt.forward_step, iter(batches), model, config.num_microbatches, pstate=pstate,
                             config=config, loss_scale=loss_scale)
        return {name: p.main_grad.clone() for chunk in model for name, p in chunk.module.named_global_parameters()
                if ".mlp." in name}

    plain, scaled = moe_grads(1.0), moe_grads(256.0)
    for name, grad in plain.items():
        assert_close_relative(scaled[name] / 256.0, grad, rel=1e-5, msg=name)


@pytest.mark.parametrize("kernel", ["grouped_mm", "padded_bmm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [0, 0, 0, 0]])
def test_experts_linear_equals_one_matmul_per_expert(kernel, dtype, counts):
    """Rows sorted by expert (an expert with none, or no rows at all) times each expert's weight, forward and
    backward."""
    if kernel == "grouped_mm" and not moe_experts.grouped_mm_runs("cpu", dtype):
        pytest.skip("this torch has no torch._grouped_mm on the CPU")
    torch.manual_seed(0)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 32, dtype=dtype, requires_grad=True)
    weights = [torch.randn(24, 32, dtype=dtype, requires_grad=True) for _ in range(4)]
    if kernel == "grouped_mm" and x.shape[0]:
        assert moe_experts.grouped_mm_applies(x, weights[0])
    out = moe_experts.experts_linear(x, weights, counts, grouped_mm=None if kernel == "grouped_mm" else False)
    out.sum().backward()  # a broadcast gradient
    got = [out.detach(), x.grad.clone(), *(w.grad.clone() for w in weights)]
    x.grad = None
    for w in weights:
        w.grad = None
    expected = torch.cat([rows @ w.t() for rows, w in zip(x.split(counts.tolist()), weights)])
    (expected.sum() + sum(w.sum() * 0 for w in weights)).backward()
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in zip(got, [expected.detach(), x.grad, *(w.grad for w in weights)], strict=True):
        assert_close_relative(a.float(), b.float(), rel=rel)


def test_the_padded_fallback_reads_the_longest_group_once_per_pass():
    """Where the grouped kernel cannot run, the products pad by the longest group, a value read from the
    device: once in forward, and once in backward, whose input and weight gradients share the padded
    gradient rows."""
    counts = torch.tensor([5, 0, 9, 2])
    x = torch.randn(16, 32, requires_grad=True)
    weights = [torch.randn(24, 32, requires_grad=True) for _ in range(4)]
    forward, backward = [], []
    with counted_device_reads(forward):
        out = moe_experts.experts_linear(x, weights, counts, grouped_mm=False)
    with counted_device_reads(backward):
        out.sum().backward()
    assert (len(forward), len(backward)) == (1, 1)


def test_grouped_mm_does_not_apply_without_rows():
    x, weight = torch.zeros(0, 32), torch.zeros(24, 32)
    assert not moe_experts.grouped_mm_applies(x, weight)


def test_the_experts_keep_no_stacked_copy_of_their_weights_for_backward():
    """What autograd saves for the experts' backward is the input rows and the experts' own parameters: no
    [E, out, in] stack (a copy of every local expert's weights per layer per micro-batch in flight)."""
    config = make_config({**BASE, "moe_ffn_hidden_size": 32}).model
    experts = moe_experts.GroupedExperts(config, 1, 4)
    for expert in experts:
        for param in expert.parameters():
            torch.nn.init.normal_(param)
    storages = {p.untyped_storage().data_ptr() for p in experts.parameters()}
    saved = []
    counts = torch.tensor([3, 0, 4, 1])
    x = torch.randn(8, config.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        experts(x, counts).sum().backward()
    stacked = [t for t in saved if t.dim() == 3 and t.untyped_storage().data_ptr() not in storages]
    assert saved and not stacked, [tuple(t.shape) for t in stacked]


@pytest.mark.parametrize("variant", [{}, {**SIGMOID, "moe_router_enable_expert_bias": True,
                                          "moe_router_load_balancing_type": "seq_aux_loss",
                                          "moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True}])
def test_dropless_moe_training_step_reads_nothing_from_the_device_beyond_the_step_s_one_read(variant):
    """Routing, permutation, grouped expert GEMMs, combine, balancing losses and the expert-bias update keep
    their counts on the device: a step reads the loss and gradient norm once, as a dense model's does."""
    if not moe_experts.grouped_mm_runs("cpu", torch.float32):
        pytest.skip("this torch has no torch._grouped_mm on the CPU: the padded fallback reads each group size")
    config, pstate, device, model, optimizer = build_run(
        {**BASE, **variant, "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 2}, 1)
    iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
    batches = [next(iterator) for _ in range(config.num_microbatches)]
    counts: list[str] = []
    with counted_device_reads(counts, [state["step"] for adam in optimizer.adams for state in adam.state.values()]):
        train_step(pretrain_gpt.forward_step, iter(batches), model, optimizer, config, pstate, 0, device)
    assert counts == ["tolist"], counts


def test_capacity_keeps_the_most_probable_tokens_and_breaks_ties_by_position():
    probs = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.5, 0.5], [0.6, 0.4]])
    indices = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    # Capacity ceil(4 * 2 / 2 * 0.5) = 2: expert 0 keeps token 1 (0.9) and token 0 (0.5, before token 2);
    # expert 1 keeps token 3 (0.6) and token 0 (0.5, before token 2).
    keep = capacity_keep_mask(probs, indices, num_experts=2, capacity_factor=0.5)
    assert keep.tolist() == [[True, True], [True, False], [False, False], [True, False]]
    torch.manual_seed(1)
    probs, indices = torch.rand(64, 2), torch.rand(64, 6).argsort(-1)[:, :2]
    assert torch.equal(capacity_keep_mask(probs, indices, 6, 1.0), _naive_keep(probs, indices, 6, 22))


def test_local_experts_carry_global_names_and_single_device_weights():
    """Local expert j of EP rank r is decoder.layers.<l>.mlp.experts.<r E/ep + j> with the weights that
    expert has on one device; every other MoE layer with --moe-layer-freq 2."""
    config = make_config({**BASE, "num_layers": 4, "moe_layer_freq": 2})
    single = GPTModel(config.model, ParallelState.single(), padded_vocab=1024, seed=3)
    reference = dict(single.named_global_parameters())
    assert {n for n in reference if ".mlp.router." in n} == {f"decoder.layers.{n}.mlp.router.weight" for n in (0, 2)}
    ep_rank_1 = ParallelState.without_groups(Layout(dp=2, ep=2), 1)  # building and naming need no collective
    shard = GPTModel(config.model, ep_rank_1, padded_vocab=1024, seed=3)
    names = dict(shard.named_global_parameters())
    experts = sorted({n.split(".linear")[0] for n in names if ".experts." in n})
    assert experts == [f"decoder.layers.{layer}.mlp.experts.{e}" for layer in (0, 2) for e in (2, 3)]
    for name, param in names.items():
        assert param.spec.expert == (".experts." in name)
        assert torch.equal(param, reference[name]), name


@pytest.mark.parametrize(("values", "world_size", "message"), [
    ({"num_experts": 6, "expert_model_parallel_size": 4}, 4,
     "num-experts (6) must be divisible by expert-model-parallel-size (4)"),
    ({"moe_router_topk": 5}, 1, "moe-router-topk (5) must not exceed num-experts (4)"),
    ({"expert_model_parallel_size": 4, "tensor_model_parallel_size": 2}, 4,
     "expert-tensor-parallel-size x expert-model-parallel-size (2 x 4 = 8) must divide tensor x context x "
     "data-parallel size (2 x 1 x 2 = 4)"),
    ({"disable_bias_linear": False, "moe_shared_expert_intermediate_size": 32}, 1,
     "the shared expert has no biases: pass --disable-bias-linear with --moe-shared-expert-intermediate-size"),
    ({"moe_expert_capacity_factor": 0.0}, 1, "moe-expert-capacity-factor (0.0) must be positive"),
    ({"moe_ffn_hidden_size": 50, "tensor_model_parallel_size": 4}, 4,
     "moe-ffn-hidden-size (50) must be divisible by expert-tensor-parallel-size (4)"),
    ({**SIGMOID, "moe_router_pre_softmax": True}, 1,
     "--moe-router-pre-softmax acts only with --moe-router-score-function softmax"),
    ({"moe_router_enable_expert_bias": True}, 1, "--moe-router-enable-expert-bias acts only with "
                                                 "--moe-router-score-function sigmoid"),
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, 1,
     "moe-router-num-groups (3) must divide num-experts (4)"),
    ({"moe_router_num_groups": 2, "moe_router_group_topk": 2, "moe_router_topk": 3}, 1,
     "moe-router-group-topk (2) must divide moe-router-topk (3)"),
    ({"moe_router_num_groups": 2}, 1, "--moe-router-num-groups and --moe-router-group-topk go together"),
    ({"moe_shared_expert_intermediate_size": 30, "tensor_model_parallel_size": 4}, 4,
     "moe-shared-expert-intermediate-size (30) must be divisible by tensor-model-parallel-size (4)"),
    ({"moe_shared_expert_gate": True}, 1,
     "--moe-shared-expert-gate acts only with --moe-shared-expert-intermediate-size"),
])
def test_bad_moe_configuration_is_one_line_error(values, world_size, message):
    with pytest.raises(ConfigError) as error:
        make_config({**BASE, **values}, world_size)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dtype, capability, fused", [(torch.bfloat16, (9, 0), True), (torch.bfloat16, (10, 0), True),
                                                      (torch.bfloat16, (8, 0), False), (torch.float32, (9, 0), False),
                                                      (torch.float16, (9, 0), False)])
def test_cuda_experts_take_grouped_mm_only_where_its_fused_kernel_runs(dtype, capability, fused):
    """torch's CUDA _grouped_mm falls back to a host read of the offsets and a loop over groups except for bf16
    on compute capability 9.0+; there the padded bmm runs instead."""
    assert moe_experts.cuda_kernel_is_fused(dtype, capability) is fused
