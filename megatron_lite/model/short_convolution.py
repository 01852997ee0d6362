"""The causal depthwise convolution that Gated DeltaNet and Mamba-2 run over their projections before mixing
tokens, in training (documents kept apart) and in generation (continuing the tokens before)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_starts(ids: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> [b, s] bool, True at each token that starts a document after the first."""
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return starts


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """x [s, b, c] convolved along s with weight [c, 1, kernel] (a depthwise Conv1d's), each channel on its own,
    position t reading t - kernel + 1 .. t (weight[..., -1] on t itself); taps that reach into an earlier document
    (ids [b, s]) or before the sequence read zero."""
    kernel = weight.shape[-1]
    weight = weight.squeeze(1)
    out = x * weight[:, -1]
    for shift in range(1, kernel):
        earlier = F.pad(x[:-shift], (0, 0, 0, 0, shift, 0))  # earlier[t] = x[t - shift]
        if ids is not None:
            same = F.pad(ids[:, shift:] == ids[:, :-shift], (shift, 0)).t().unsqueeze(-1)  # [s, b, 1]
            earlier = earlier * same
        out = out + earlier * weight[:, kernel - 1 - shift]
    return out


def continued_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, recurrent_state) -> torch.Tensor:
    """The convolution of new tokens [s, b, c] after the earlier ones, whose last kernel - 1 inputs
    `recurrent_state.conv_inputs` holds (None: zeros before the first token); it then holds the new last inputs."""
    kernel = weight.shape[-1]
    earlier = recurrent_state.conv_inputs
    if earlier is None:
        earlier = x.new_zeros(kernel - 1, *x.shape[1:])
    inputs = torch.cat([earlier, x])
    recurrent_state.conv_inputs = inputs[inputs.shape[0] - (kernel - 1):]
    return causal_depthwise_conv(inputs, weight, None)[kernel - 1:]
