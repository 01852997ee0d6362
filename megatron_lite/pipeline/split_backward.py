"""A micro-batch's backward in two passes: B, the input gradient the previous stage waits for, and W, the
weight gradients, which a zero-bubble schedule runs later in time the pipeline would otherwise idle (Qi et
al. 2023, "Zero Bubble Pipeline Parallelism").

The split works on autograd's graph, so every layer with weights takes part without changes. From the
stage's output, a graph node is on the input path when the stage's input is reachable from it, and on a
weight path when a parameter is. The nodes where a weight path leaves the input path (a matmul of an
activation and a weight, a norm's scale) are the boundary. B differentiates the output with respect to the
input alone, keeping the graph, and records the gradient arriving at each boundary node; the engine then
computes only the input-side outputs of those nodes (dX = dY W). W runs the boundary nodes again from the
recorded gradients towards their parameters only: just their weight-side outputs (dW = dY^T X) and what
lies behind them. That saves work only where a node computes just the outputs asked of it, as autograd's
built-in nodes (mm, addmm, the native norms) do.

Boundary nodes are grouped so that each parameter is reached from one group, and a group's W is one
autograd call: a parameter's gradient accumulates once per micro-batch, so post-accumulate-grad hooks
(gradient buffers, --overlap-grad-reduce) see each gradient exactly once, in W. Two kinds of group are
instead held: their weight gradients are computed in B, kept, and accumulated in W. One whose nodes lie on
the input path behind one another (a weight used twice along the path), since running the group again
would send gradient down the input path a second time. And one with a node whose backward computes all of
its outputs whatever is asked of it, a Python torch.autograd.Function's (its ctx.needs_input_grad is fixed
in the forward) or a torch.compile'd region's, since running it again would repeat its whole backward. Such
a node (a Function computing dX and dW in one backward, a compiled layer) runs once, in B, so its weight
gradients are not delayed: on those layers B costs what the whole backward does. A compiled region takes
part only when compiled with torch._functorch.config.donated_buffer off: by default its backward frees
buffers as it runs and refuses a graph kept for W, which is why
zb-h1 with --torch-compile is refused (config/validation.py).

A stage with no input to differentiate (the first) has nothing to do in B, and its W is the whole
backward. The graph stays alive until W, so a micro-batch holds its activations until then; the schedule
bounds how many micro-batches wait for their W.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


class WeightGradientPass:
    """The W of one micro-batch: run() accumulates its weight gradients into the parameters' .grad.

    The calls reach disjoint parts of the graph (each group's boundary nodes and what lies behind them on the
    weight side), so each frees what its nodes saved as it runs, as a plain backward does. Kept, a first
    stage's graph (its W is the whole backward) outlives the W while anything still refers to the stage's
    output, with every activation it saved.
    """

    def __init__(self, calls: list[tuple[list, list, list]]):
        self.calls = calls  # (roots, their gradients, parameters): one autograd call each

    def run(self) -> None:
        for roots, grads, params in self.calls:
            torch.autograd.backward(roots, grads, inputs=params)
        self.calls = []  # dropping the roots frees the rest of the micro-batch's graph


def backward_input(output: torch.Tensor, output_grad: torch.Tensor | None, input_tensor: torch.Tensor | None,
                   params: list[torch.nn.Parameter]) -> tuple[torch.Tensor | None, WeightGradientPass]:
    """B: the gradient of `input_tensor` (None without one) and the W pass that completes the backward."""
    params = [p for p in params if p.requires_grad]
    if input_tensor is None:
        return None, WeightGradientPass([([output], [output_grad], params)])
    graph = _Graph(output.grad_fn, get_gradient_edge(input_tensor).node,
                   {get_gradient_edge(p).node: p for p in params})
    groups = graph.boundary_groups()
    hold = [graph.overlaps(group) or any(map(_computes_every_output, group[0])) for group in groups]
    held = [group for group, holds in zip(groups, hold) if holds]
    deferred = [group for group, holds in zip(groups, hold) if not holds]
    held_params = [p for group in held for p in group[1]]

    captured: dict[Node, tuple] = {}
    hooks = [node.register_prehook(lambda grads, node=node: captured.__setitem__(node, grads))
             for nodes, _ in deferred for node in nodes]
    try:
        grads = torch.autograd.grad([output], [input_tensor, *held_params],
                                    None if output_grad is None else [output_grad], retain_graph=True,
                                    allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()

    calls = []
    for nodes, group_params in deferred:
        roots = [(GradientEdge(node, index), grad) for node in nodes
                 for index, grad in enumerate(captured.get(node, ())) if grad is not None]
        if roots:
            calls.append(([edge for edge, _ in roots], [grad for _, grad in roots], group_params))
    held_grads = [(p, g) for p, g in zip(held_params, grads[1:]) if g is not None]
    if held_grads:
        calls.append(([p for p, _ in held_grads], [g for _, g in held_grads], [p for p, _ in held_grads]))
    return grads[0], WeightGradientPass(calls)


class _Graph:
    """The autograd graph behind one output: which nodes reach the input, which reach parameters."""

    def __init__(self, root: Node, input_node: Node, param_nodes: dict[Node, torch.nn.Parameter]):
        self.param_nodes = param_nodes
        self.order = _post_order(root)  # every node after the nodes it leads to
        self.to_input: dict[Node, bool] = {}
        self.to_weight: dict[Node, bool] = {}
        for node in self.order:
            children = _children(node)
            self.to_input[node] = node is input_node or any(self.to_input[c] for c in children)
            self.to_weight[node] = node in param_nodes or any(self.to_weight[c] for c in children)

    def weight_only(self, node: Node) -> bool:
        return self.to_weight[node] and not self.to_input[node]

    def boundary_groups(self) -> list[tuple[list[Node], list[torch.nn.Parameter]]]:
        """Boundary nodes grouped by the weight-side nodes they share, with the parameters each group reaches."""
        owner: dict[Node, int] = {}  # weight-side node -> index of the group that reaches it
        groups: list[tuple[list[Node], set[Node]]] = []
        for node in self.order:
            if not self.to_input[node]:
                continue
            weight_side = [c for c in _children(node) if self.weight_only(c)]
            if not weight_side:
                continue
            reached = self._weight_closure(weight_side)
            merged = sorted({owner[n] for n in reached if n in owner})
            nodes, closure = [node], set(reached)
            for index in merged:
                nodes += groups[index][0]
                closure |= groups[index][1]
                groups[index] = ([], set())
            groups.append((nodes, closure))
            for n in closure:
                owner[n] = len(groups) - 1
        return [(nodes, [self.param_nodes[n] for n in closure if n in self.param_nodes])
                for nodes, closure in groups if nodes]

    def overlaps(self, group: tuple[list[Node], list]) -> bool:
        """Whether one boundary node of the group is on the input path behind another."""
        nodes = set(group[0])
        if len(nodes) == 1:
            return False
        stack = [c for node in nodes for c in _children(node) if self.to_input[c]]
        seen = set()
        while stack:
            node = stack.pop()
            if node in nodes:
                return True
            if node not in seen:
                seen.add(node)
                stack += [c for c in _children(node) if self.to_input[c]]
        return False

    def _weight_closure(self, start: list[Node]) -> set[Node]:
        seen, stack = set(), list(start)
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                stack += [c for c in _children(node) if self.weight_only(c)]
        return seen


def _computes_every_output(node: Node) -> bool:
    """Whether the node's backward computes all of its input gradients even when only some are needed: a
    Python autograd.Function's or a torch.compile'd graph's (CompiledFunctionBackward), both BackwardCFunction."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _post_order(root: Node) -> list[Node]:
    """Every node reachable from `root`, each after all the nodes it leads to (iterative: graphs are deep)."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
        elif node not in seen:
            seen.add(node)
            stack.append((node, True))
            stack += [(child, False) for child in _children(node) if child not in seen]
    return order
