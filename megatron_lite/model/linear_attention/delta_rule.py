"""The gated delta rule (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", ICLR 2025) in chunked form.

Per head, a state S [dk, dv] is decayed, corrected toward each new value and read by each query:

    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t

Step by step that is one [dk, dv] update per token. The chunked form computes the same thing a chunk of C
tokens at a time with matrix products: inside a chunk the corrections delta solve a unit lower-triangular
system (the UT transform of DeltaNet's WY representation),

    (I + A) Delta = beta V - beta exp(G) K S_0,   A_ij = beta_i exp(G_i - G_j) k_i . k_j  (j < i),

where G is the cumulative log decay from the chunk's start and S_0 the state entering it; the chunk's outputs
and its outgoing state follow from Delta, and only the state crosses from chunk to chunk.

Documents packed into one sequence (--reset-attention-mask) restart the state: `resets` marks each token that
starts a document. Inside a chunk a token sees only the tokens of its own document (pairs across a start are
masked), reads the entering state only if no document started since the chunk's start, and the outgoing state
keeps only the chunk's last document.

Inputs are [b, s, h, d] (q and k with as many heads as v), computed in fp32 whatever their dtype; the output
has v's dtype and the final state is fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           *, scale: float, resets: torch.Tensor | None = None,
                           initial_state: torch.Tensor | None = None,
                           chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """o [b, s, h, dv] and the final state [b, h, dk, dv] of the gated delta rule.

    q, k [b, s, h, dk]; v [b, s, h, dv]; g (log decay, <= 0) and beta (write strength in [0, 1]) [b, s, h];
    `scale` multiplies the queries; `resets` [b, s] bool is True at each token that starts a document."""
    batch, length, heads, key_dim = k.shape
    value_dim, dtype = v.shape[-1], v.dtype
    pad = (-length) % chunk_size  # padded tokens come last and write nothing (beta = 0)
    chunks = (length + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [b, s, h, ...] -> [b, h, n, C, ...] in fp32
        x = F.pad(x.float().transpose(1, 2), (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.reshape(batch, heads, chunks, chunk_size, *x.shape[3:])

    q, k, v, g, beta = chunked(q) * scale, chunked(k), chunked(v), chunked(g), chunked(beta)
    if resets is None:
        segment = torch.zeros(batch, 1, chunks, chunk_size, dtype=torch.long, device=k.device)
    else:  # segment 0 is the part of a chunk that continues the entering state
        segment = F.pad(resets.long(), (0, pad)).reshape(batch, 1, chunks, chunk_size).cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
    visible = (segment.unsqueeze(-1) == segment.unsqueeze(-2)) & causal  # [b, 1, n, C, C]
    continues = (segment == 0).float()  # reads the entering state
    in_last_document = (segment == segment[..., -1:]).float()  # written into the outgoing state

    log_decay = g.cumsum(-1)  # G: [b, h, n, C]
    pair_decay = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(~visible, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    strictly_lower = (k_beta @ k.transpose(-1, -2) * pair_decay).tril(-1)
    system = strictly_lower + torch.eye(chunk_size, device=k.device)
    values = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(system, k_beta * (log_decay.exp() * continues).unsqueeze(-1),
                                               upper=False, unitriangular=True)
    scores = q @ k.transpose(-1, -2) * pair_decay  # within the chunk, the diagonal included
    state_queries = q * (log_decay.exp() * continues).unsqueeze(-1)
    chunk_end = log_decay[..., -1:]
    end_keys = k * ((chunk_end - log_decay).exp() * in_last_document).unsqueeze(-1)
    state_decay = (chunk_end.exp() * continues[..., -1:]).unsqueeze(-1)  # [b, h, n, 1, 1]

    state = (torch.zeros(batch, heads, key_dim, value_dim, device=k.device) if initial_state is None
             else initial_state.float())
    outputs = []
    for chunk in range(chunks):  # only the state crosses chunks
        delta = values[:, :, chunk] - state_keys[:, :, chunk] @ state
        outputs.append(state_queries[:, :, chunk] @ state + scores[:, :, chunk] @ delta)
        state = state * state_decay[:, :, chunk] + end_keys[:, :, chunk].transpose(-1, -2) @ delta
    out = torch.stack(outputs, dim=2).reshape(batch, heads, chunks * chunk_size, value_dim)[:, :, :length]
    return out.transpose(1, 2).to(dtype), state
