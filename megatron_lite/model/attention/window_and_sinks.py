"""Softmax attention with a sliding window (--window-size) and attention sinks (--softmax-type), gpt-oss's.

A window of (left, 0) lets a query at position p see the keys at positions p - left .. p (gpt-oss's
sliding_window of 128 is left 127); --window-attn-skip-freq chooses the layers that keep full attention. A sink
is one more logit per head in every softmax denominator, with no value: softmax over [scores, sink] with the sink's
column dropped, so a query may give less than all of its weight to the keys. --softmax-type learnable learns each
head's sink (gpt-oss's `sinks`); off-by-one fixes it at 0 (softmax_1, 1 + sum exp).

The scores are computed in fp32 and materialised ([b, heads, s, t]), with the mask of the window, causality and
the packed documents; no fused kernel is used yet, on any device. Under context parallelism
(window_context_parallel.py) the same function runs on a rank's queries against the keys they may see.
"""

from __future__ import annotations

import torch


def window_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None,
                          sinks: torch.Tensor | None, document_ids: torch.Tensor | None = None,
                          query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """q [s, b, nh, d], k/v [t, b, ng, d] -> [s, b, nh * d]. The keys are positions 0 .. t-1 and the queries those
    of `query_positions` [s] (None: the last s, as in generation with a KV cache). `window`: keys more than this
    many positions before the query are not seen (None: all earlier keys); `sinks` [nh]: each head's sink logit
    (None: none); `document_ids` [b, t] of the keys: a query sees only its own document."""
    s, b, heads, d = q.shape
    t, dtype = k.shape[0], q.dtype
    if query_positions is None:
        query_positions = torch.arange(t - s, t, device=q.device)
    query_positions = query_positions.to(q.device)[:, None]
    key_positions = torch.arange(t, device=q.device)[None, :]
    visible = key_positions <= query_positions
    if window is not None:
        visible = visible & (query_positions - key_positions <= window)
    visible = visible[None, None]  # [1, 1, s, t]
    if document_ids is not None:
        ids = document_ids.to(q.device)
        query_ids = ids[:, query_positions[:, 0]]
        visible = visible & (query_ids[:, None, :, None] == ids[:, None, None, :])
    groups = heads // k.shape[2]
    q, k, v = (x.permute(1, 2, 0, 3).float() for x in (q, k, v))  # [b, n, s or t, d]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2) * d ** -0.5).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.float()[None, :, None, None].expand(b, heads, s, 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = scores.softmax(dim=-1)[..., :t]
    out = (probs @ v).to(dtype)
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)
