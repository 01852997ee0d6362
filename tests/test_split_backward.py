"""The backward split of zero-bubble schedules: B computes the stage's input gradient and no weight gradient at
all; W then computes every weight gradient once, each parameter's post-accumulate-grad hook firing exactly once;
together they equal one plain backward. Checked on the last pipeline stage of a dense Llama and of an MoE model
(norms, attention, SwiGLU, router and experts, output layer with the loss), and on a first stage (embedding),
whose B is empty. A weight used twice along the input path is a case B must compute (running its
group again would send gradient down the input path twice); it still accumulates once, in W. So must a node
whose backward computes all of its outputs at once (a Python autograd.Function taking an activation and a
weight, a torch.compile'd region): it runs once per micro-batch, in B, and its weight gradients accumulate
in W. A compiled layer frees its backward's buffers unless told not to, so zb-h1 refuses --torch-compile."""

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.config.layer_split import model_chunk_plans
from megatron_lite.parallel.state import Layout, ParallelState
from megatron_lite.pipeline.split_backward import backward_input
from megatron_lite.training.loop import padded_vocab_for
from tests.helpers import TINY_8_LAYERS
from tests.tolerances import assert_close_relative

SMALL = {**TINY_8_LAYERS, "num_layers": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0,
         "pipeline_model_parallel_size": 2}
MOE = {**SMALL, "model_preset": "mixtral-tiny", "hidden_size": 64, "ffn_hidden_size": 128,
       "moe_ffn_hidden_size": 64, "seq_length": 32, "max_position_embeddings": 32, "vocab_size": 256}


def stage(values: dict, pp_rank: int):
    """The model chunk of pipeline stage `pp_rank` and a loss-producing forward over one micro-batch."""
    config = make_config(values, 2)
    pstate = ParallelState.without_groups(Layout(pp=2), pp_rank)
    chunk = pretrain_gpt.model_provider(config, pstate, model_chunk_plans(config, pp_rank)[0], torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    seq, vocab = config.model.seq_length, config.model.vocab_size
    tokens = torch.randint(0, vocab, (2, seq), generator=generator)
    hidden = torch.randn(seq, 2, config.model.hidden_size, generator=generator)
    assert padded_vocab_for(config) >= vocab

    def forward():
        input_tensor = None if pp_rank == 0 else hidden.clone().requires_grad_()
        chunk.set_input_tensor(input_tensor)
        output = chunk(tokens, torch.arange(seq), labels=tokens if pp_rank == 1 else None)
        output = output.sum() if pp_rank == 1 else output  # per-token losses [b, s] summed
        return input_tensor, output

    return chunk, forward


@pytest.mark.parametrize(("values", "pp_rank"), [(SMALL, 1), (MOE, 1), (SMALL, 0)], ids=["dense", "moe", "first"])
def test_b_computes_no_weight_gradient_and_w_each_exactly_once(values, pp_rank):
    chunk, forward = stage(values, pp_rank)
    params = [p for p in chunk.parameters() if p.requires_grad]
    input_tensor, output = forward()
    output_grad = None if pp_rank == 1 else torch.randn_like(output)
    output.backward(output_grad)
    expected = [p.grad.clone() for p in params]
    expected_input = None if input_tensor is None else input_tensor.grad.clone()
    for p in params:
        p.grad = None

    computed, accumulated = [0] * len(params), [0] * len(params)
    for index, p in enumerate(params):
        p.register_hook(lambda grad, i=index: computed.__setitem__(i, computed[i] + 1))
        p.register_post_accumulate_grad_hook(lambda _, i=index: accumulated.__setitem__(i, accumulated[i] + 1))
    input_tensor, output = forward()
    input_grad, weight_pass = backward_input(output, output_grad, input_tensor, params)
    # The routed experts' grouped GEMM is one Python Function node, which computes every gradient when it runs:
    # their weight gradients come with B's and W hands them to autograd again only to accumulate them.
    held = [int(p.spec.expert) for p in params]
    assert computed == held and accumulated == [0] * len(params)
    if expected_input is None:
        assert input_grad is None
    else:
        assert_close_relative(input_grad, expected_input, msg="input gradient")
    weight_pass.run()
    assert computed == [1 + h for h in held] and accumulated == [1] * len(params)
    for p, grad in zip(params, expected):
        assert_close_relative(p.grad, grad)


def test_weight_used_twice_along_the_path_is_computed_in_b_and_accumulated_once_in_w():
    torch.manual_seed(0)
    shared, other = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    params = [*shared.parameters(), *other.parameters()]
    x0 = torch.randn(4, 8)

    def forward():
        x = x0.clone().requires_grad_()
        return x, other(torch.tanh(shared(torch.tanh(shared(x))))).sum()

    x, loss = forward()
    loss.backward()
    expected, expected_input = [p.grad.clone() for p in params], x.grad.clone()
    for p in params:
        p.grad = None
    accumulated = [0] * len(params)
    for index, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _, i=index: accumulated.__setitem__(i, accumulated[i] + 1))
    x, loss = forward()
    input_grad, weight_pass = backward_input(loss, None, x, params)
    assert accumulated == [0, 0, 0, 0] and all(p.grad is None for p in params)
    weight_pass.run()
    assert accumulated == [1, 1, 1, 1]
    assert_close_relative(input_grad, expected_input)
    for p, grad in zip(params, expected):
        assert_close_relative(p.grad, grad)


class _Matmul(torch.autograd.Function):
    """x @ w whose one backward computes dx and dw together, as Python Functions do."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


class _FunctionStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.before, self.weight, self.after = torch.nn.Linear(8, 8), torch.nn.Parameter(torch.randn(8, 8)), \
            torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.after(torch.tanh(_Matmul.apply(torch.tanh(self.before(x)), self.weight)))


class _CompiledStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.before, self.inner, self.after = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.compiled = torch.compile(lambda x: torch.tanh(self.inner(torch.tanh(x))), backend="aot_eager")

    def forward(self, x):
        return self.after(self.compiled(self.before(x)))


def _whole_backward_nodes(root) -> list:
    """The graph's nodes of _Matmul or of the compiled region: their backward computes all of their outputs."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack += [child for child, _ in node.next_functions]
    return [node for node in seen if type(node).__name__ in ("_MatmulBackward", "CompiledFunctionBackward")]


@pytest.mark.parametrize("make_stage", [_FunctionStage, _CompiledStage], ids=["autograd-function", "torch-compile"])
def test_node_computing_all_its_gradients_runs_once_across_b_and_w(make_stage):
    with torch._functorch.config.patch(donated_buffer=False):  # else a compiled backward refuses retain_graph
        check_runs_once_across_b_and_w(make_stage)


def check_runs_once_across_b_and_w(make_stage):
    torch.manual_seed(0)
    module = make_stage()
    params = list(module.parameters())
    x0 = torch.randn(4, 8)

    def forward():
        x = x0.clone().requires_grad_()
        return x, module(x).pow(2).sum()

    x, loss = forward()
    loss.backward()
    expected, expected_input = [p.grad.clone() for p in params], x.grad.clone()
    for p in params:
        p.grad = None

    accumulated, runs = [0] * len(params), [0]
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _, i=i: accumulated.__setitem__(i, accumulated[i] + 1))
    for _ in range(2):  # micro-batches
        accumulated[:], runs[0] = [0] * len(params), 0
        x, loss = forward()
        nodes = _whole_backward_nodes(loss.grad_fn)
        assert len(nodes) == 1
        nodes[0].register_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
        input_grad, weight_pass = backward_input(loss, None, x, params)
        assert runs == [1] and accumulated == [0] * len(params) and all(p.grad is None for p in params)
        assert_close_relative(input_grad, expected_input)
        weight_pass.run()
        assert runs == [1] and accumulated == [1] * len(params)
        for p, grad in zip(params, expected):
            assert_close_relative(p.grad, grad)
            p.grad = None


def test_zb_h1_with_torch_compile_is_a_one_line_error():
    with pytest.raises(ConfigError) as error:
        make_config({**SMALL, "pipeline_schedule": "zb-h1", "torch_compile": True}, 2)
    assert str(error.value) == ("--pipeline-schedule zb-h1 cannot be combined with --torch-compile: a compiled "
                                "layer's backward frees its buffers as it runs, and zb-h1 keeps the graph from B "
                                "to W; use 1f1b")
