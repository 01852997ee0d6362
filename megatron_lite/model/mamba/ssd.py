"""Mamba-2's selective state-space scan (Dao and Gu, "Transformers are SSMs", ICML 2024), chunked and step by step.

Per head, a state h [p, n] (head dim p, state dim n) decays by a scalar and takes each token's input:

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t

with dt_t > 0 the token's step (softplus of its projection plus a bias, clamped to the layer's limits, by the
caller), A < 0 per head, B_t and C_t [n] shared by the heads of a group, x_t [p]. Step by step (`ssd_recurrent`)
that is one [p, n] update per token: generation's form, and the tests' reference. The chunked form (`ssd_chunked`,
state space duality) computes the same outputs a chunk of L tokens at a time with matrix products: inside a chunk
y = (C B^T . decay mask) (dt x), a masked attention whose mask holds the decays between the two positions; the
chunk's contribution to the state, and the state entering each chunk (a recurrence over the chunks alone), give
the rest.

Documents packed into one sequence (--reset-attention-mask) restart the state: `resets` marks each token that
starts a document. The chunked form multiplies every decay it uses by whether the two positions are in the same
document (a product of masks, never a -inf in a difference), so an earlier document reaches no later one.

Inputs are [b, s, heads, ..] and B, C [b, s, groups, n]; the computation is fp32 whatever their dtype; the output
has x's dtype and the final state is fp32 [b, heads, p, n].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 128  # Megatron-Core's and the Nemotron-H checkpoints' chunk size


def _to_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, s, groups, n] -> [b, s, heads, n]: each group's B or C to each of its heads."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def _segment_ids(resets: torch.Tensor | None, b: int, s: int, device) -> torch.Tensor:
    """[b, s] the document of each token (0 for the one the sequence starts in)."""
    if resets is None:
        return torch.zeros(b, s, dtype=torch.long, device=device)
    return resets.long().cumsum(1)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None = None, *, resets: torch.Tensor | None = None,
                initial_state: torch.Tensor | None = None,
                chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """y [b, s, heads, p] and the final state [b, heads, p, n].

    x [b, s, heads, p]; dt [b, s, heads] (> 0, after softplus and limits); A [heads] (< 0); B, C [b, s, groups, n];
    D [heads] or None; `resets` [b, s] bool, True at each token that starts a document; `initial_state` the state
    before the first token."""
    b, s, heads, p = x.shape
    out_dtype = x.dtype
    L = chunk_size
    pad = (-s) % L
    xf, dtf = x.float(), dt.float()
    Bf, Cf = _to_heads(B.float(), heads), _to_heads(C.float(), heads)
    segments = _segment_ids(resets, b, s, x.device)
    if pad:
        xf, Bf, Cf = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xf, Bf, Cf))
        dtf = F.pad(dtf, (0, 0, 0, pad))
        segments = torch.cat([segments, segments[:, -1:].expand(b, pad)], dim=1)  # dt 0: writes nothing, decays
        # nothing, so the state at the padded end is the last token's
    c = (s + pad) // L
    n = Bf.shape[-1]
    xs = (xf * dtf.unsqueeze(-1)).view(b, c, L, heads, p)  # dt x: the input each token writes
    Bc, Cc = Bf.view(b, c, L, heads, n), Cf.view(b, c, L, heads, n)
    a = (dtf * A.float()).view(b, c, L, heads).permute(0, 3, 1, 2)  # [b, heads, c, L] log decay of each token
    a_cum = a.cumsum(-1)  # from the chunk's start to each token, inclusive
    seg = segments.view(b, c, L)

    # inside each chunk: y_l += sum_{s <= l} (C_l . B_s) exp(a_cum_l - a_cum_s) [same document] dt_s x_s
    same = seg.unsqueeze(-1) == seg.unsqueeze(-2)  # [b, c, l, s]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp((a_cum.unsqueeze(-1) - a_cum.unsqueeze(-2)).masked_fill(~causal, 0.0))  # [b, h, c, l, s]
    decay = decay * (causal & same).unsqueeze(1)
    scores = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc) * decay
    y = torch.einsum("bhcls,bcshp->bclhp", scores, xs)

    # each chunk's contribution to the state at its end: tokens of the chunk's last document, decayed to the end
    last = seg[:, :, -1:]
    to_end = torch.exp(a_cum[..., -1:] - a_cum) * (seg == last).unsqueeze(1)  # [b, h, c, L]
    written = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bc, to_end, xs)

    # the state entering each chunk: the previous chunk's end state, decayed through it unless a document started
    state = (torch.zeros(b, heads, p, n, device=x.device) if initial_state is None else initial_state.float())
    chunk_decay = torch.exp(a_cum[..., -1])  # [b, h, c]
    starts_inside = seg[:, :, -1] != torch.cat([torch.zeros_like(seg[:, :1, 0]), seg[:, :-1, -1]], dim=1)
    entering = []
    for chunk in range(c):
        entering.append(state)
        kept = chunk_decay[:, :, chunk] * ~starts_inside[:, chunk].unsqueeze(1)  # [b, h]
        state = state * kept[..., None, None] + written[:, chunk]
    entering = torch.stack(entering, dim=1)  # [b, c, h, p, n]

    # the entering state read by each token of its chunk: decayed from the chunk's start, if no document started
    before = torch.cat([torch.zeros_like(seg[:, :1, :1]), seg[:, :-1, -1:]], dim=1)  # the token before each chunk
    from_start = torch.exp(a_cum) * (seg == before).unsqueeze(1)  # [b, h, c, L]
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, entering, from_start)

    y = y.reshape(b, c * L, heads, p)[:, :s]
    if D is not None:
        y = y + xf[:, :s] * D.float().view(1, 1, heads, 1)
    return y.to(out_dtype), state


def ssd_recurrent(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor | None = None, *, resets: torch.Tensor | None = None,
                  initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `ssd_chunked`, one token at a time (the recurrence itself)."""
    b, s, heads, p = x.shape
    Bf, Cf = _to_heads(B.float(), heads), _to_heads(C.float(), heads)
    state = (torch.zeros(b, heads, p, Bf.shape[-1], device=x.device) if initial_state is None
             else initial_state.float())
    outputs = []
    for t in range(s):
        keep = torch.exp(dt[:, t].float() * A.float())  # [b, heads]
        if resets is not None:
            keep = keep * ~resets[:, t].unsqueeze(1)
        write = (dt[:, t].float().unsqueeze(-1) * x[:, t].float()).unsqueeze(-1) * Bf[:, t].unsqueeze(-2)
        state = state * keep[..., None, None] + write
        y = torch.einsum("bhpn,bhn->bhp", state, Cf[:, t])
        if D is not None:
            y = y + x[:, t].float() * D.float().view(1, heads, 1)
        outputs.append(y)
    return torch.stack(outputs, dim=1).to(x.dtype), state
