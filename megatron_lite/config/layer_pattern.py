"""Which transformer layers are MoE layers and which mix tokens by linear attention: --moe-layer-freq and
--linear-attention-freq in Megatron's three forms, read without eval.

Megatron's --moe-layer-freq is an integer N (layers 0, N, 2N, .. are MoE layers, the others dense), the same
integer as a string, or a Python list expression of 0s and 1s, one per layer ("([0]*3+[1]*58)": three dense
layers, then 58 MoE layers, DeepSeek-V3's stack). --linear-attention-freq takes the same forms, an integer N
meaning N - 1 linear-attention layers then one softmax-attention layer, repeated (Qwen3-Next: 4), a list 1 for
a linear-attention layer and 0 for softmax attention. Megatron evaluates the expression with eval after a
character filter; here it is parsed into a syntax tree of which only integer literals, lists of them, + and *
are evaluated, so no other code can run. --window-attn-skip-freq reads as --linear-attention-freq does (1 for a
windowed layer). These per-layer lists are read into each layer's spec once (config/layer_specs.py), which the
model builder, the planner, the FLOP count and the Hugging Face conversion ask.
"""

from __future__ import annotations

import ast
import functools

from megatron_lite.config.sections import ModelConfig

_LONGEST_EXPRESSION = 10_000  # characters; a pattern is one entry per layer, written with * for repeats
_LONGEST_PATTERN = 100_000  # layers


class LayerPatternError(ValueError):
    """A layer pattern cannot be read; the message says what to write instead."""


def _evaluate(node: ast.AST):
    """An integer or list of integers from a tree of int literals, lists, + and *; anything else refused."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_evaluate(item) for item in node.elts]
        if not all(isinstance(item, int) for item in items):
            raise LayerPatternError("list items must be 0 or 1")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add) and type(left) is type(right):
            if isinstance(left, list) and len(left) + len(right) > _LONGEST_PATTERN:
                raise LayerPatternError("the pattern would hold more layers than any model has")
            return left + right
        if isinstance(node.op, ast.Mult) and type(left) is type(right) is int:
            return left * right
        if isinstance(node.op, ast.Mult) and {type(left), type(right)} == {list, int}:
            items, count = (left, right) if isinstance(left, list) else (right, left)
            if len(items) * count > _LONGEST_PATTERN:
                raise LayerPatternError(f"the pattern would hold {len(items) * count} layers, more than any model has")
            return items * count
        raise LayerPatternError("only list + list, list * count and integer + and * are allowed")
    raise LayerPatternError(f"{type(node).__name__} is not allowed; write an integer or a list expression such as "
                            f"([0]*3+[1]*5)")


def _read_pattern(value, num_layers: int) -> int | list[int]:
    """A pattern flag (int, numeric string, list expression string, or list of 0/1) -> its integer, or its list
    of one 0 or 1 per layer. Raises LayerPatternError with what to change."""
    if isinstance(value, str):
        if len(value) > _LONGEST_EXPRESSION:
            raise LayerPatternError(f"the expression is longer than {_LONGEST_EXPRESSION} characters")
        try:
            tree = ast.parse(value.strip(), mode="eval").body
        except SyntaxError:
            raise LayerPatternError(f"{value!r} is neither an integer nor a list expression such as "
                                    f"([0]*3+[1]*5)") from None
        value = _evaluate(tree)
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise LayerPatternError(f"{value!r} is neither an integer nor a list of 0s and 1s")
    if isinstance(value, int):
        if value < 1:
            raise LayerPatternError(f"the frequency ({value}) must be at least 1")
        return value
    if any(isinstance(item, bool) or item not in (0, 1) for item in value):
        raise LayerPatternError(f"the pattern may hold only 0 and 1, got {sorted(set(value))}")
    if len(value) != num_layers:
        raise LayerPatternError(f"the pattern has {len(value)} entries for {num_layers} layers; give one per layer")
    return value


def parse_moe_layer_freq(value, num_layers: int) -> list[bool]:
    """--moe-layer-freq -> one bool per layer, True for an MoE layer (every N-th from the first, or 1 in a list)."""
    value = _read_pattern(value, num_layers)
    if isinstance(value, int):
        return [layer % value == 0 for layer in range(num_layers)]
    return [item == 1 for item in value]


def parse_interleaved_freq(value, num_layers: int) -> list[bool]:
    """--linear-attention-freq or --window-attn-skip-freq -> one bool per layer, True for a layer of the flag's kind
    (linear attention, a window): N - 1 of them before each N-th layer, which is not, or 1 in a list."""
    value = _read_pattern(value, num_layers)
    if isinstance(value, int):
        return [(layer + 1) % value != 0 for layer in range(num_layers)]
    return [item == 1 for item in value]


def layer_list_expression(flags: list[bool]) -> str:
    """The list expression of a per-layer pattern flag: "[1,1,1,0,...]", 1 where `flags` is true."""
    return "[" + ",".join(str(int(flag)) for flag in flags) + "]"


def moe_layer_pattern(config: ModelConfig) -> list[bool]:
    """One bool per layer of the decoder, True where the layer's MLP is an MoE layer (all False without
    --num-experts)."""
    if not config.num_experts:
        return [False] * config.num_layers
    return _pattern(config.moe_layer_freq, config.num_layers, parse_moe_layer_freq)


def _pattern(freq, num_layers: int, parse) -> list[bool]:
    """`parse(freq, num_layers)`, an integer or expression read once (the planner asks once per layer and
    layout)."""
    if isinstance(freq, list):
        return parse(freq, num_layers)
    return list(_parsed(freq, num_layers, parse))


@functools.lru_cache(maxsize=64)
def _parsed(freq: int | str, num_layers: int, parse) -> tuple[bool, ...]:
    return tuple(parse(freq, num_layers))


def linear_attention_pattern(config: ModelConfig) -> list[bool]:
    """One bool per layer of the decoder, True where the layer mixes tokens by linear attention
    (--experimental-attention-variant) instead of softmax attention; all False without the variant."""
    if config.experimental_attention_variant is None:
        return [False] * config.num_layers
    return _pattern(config.linear_attention_freq, config.num_layers, parse_interleaved_freq)


def window_attention_pattern(config: ModelConfig) -> list[bool]:
    """One bool per layer of the decoder, True where its softmax attention has --window-size's sliding window:
    the layers --window-attn-skip-freq leaves windowed (the same forms as --linear-attention-freq), every layer
    without it; all False without a window."""
    if config.window_size is None:
        return [False] * config.num_layers
    if config.window_attn_skip_freq is None:
        return [True] * config.num_layers
    return _pattern(config.window_attn_skip_freq, config.num_layers, parse_interleaved_freq)


def layer_pattern_problems(config: ModelConfig) -> list[str]:
    """One line for each of --moe-layer-freq, --linear-attention-freq and --window-attn-skip-freq that cannot be read
    for this model."""
    problems = []
    for flag, active, value, parse in (
            ("--moe-layer-freq", config.num_experts, config.moe_layer_freq, parse_moe_layer_freq),
            ("--linear-attention-freq", config.experimental_attention_variant, config.linear_attention_freq,
             parse_interleaved_freq),
            ("--window-attn-skip-freq", config.window_attn_skip_freq is not None, config.window_attn_skip_freq,
             parse_interleaved_freq)):
        try:
            if active:
                parse(value, config.num_layers)
        except LayerPatternError as error:
            problems.append(f"{flag} {value!r}: {error}")
    return problems
