"""Context parallelism: the sequence split over the cp group, and causal attention computed across it.

Load balancing. With a causal mask the last tokens attend to the most keys, so contiguous slices would
give the last cp rank most of the work. The sequence is cut into 2 x cp chunks and rank i holds chunks i
and 2cp-1-i (Megatron's layout): every rank then does the same work. Tokens, labels, loss mask and
position ids are all split this way (`get_batch_on_this_cp_rank`); the model sees only the local
positions, so RoPE and learned positions need nothing else. Everything outside attention is per token.

Ring attention (--cp-comm-type p2p). Each rank keeps its queries; the key/value blocks travel around the
cp ring, one hop a step, the next block's isend/irecv running while the current block is computed. A
block gives a partial output normalised over its own keys and the log-sum-exp (LSE) of its scores; the
partials are merged with the online-softmax rule. In backward K/V go around the ring again, with the
accumulated dK/dV of each block travelling one hop behind them, so that after cp steps every block's
gradient is back with its owner. For rank i and the block of rank j the causal mask is exact with three
cases and never an explicit mask:
  j == i   both local chunks against both: causal (the local concatenation is in sequence order)
  j <  i   both query chunks see all of chunk j and none of chunk 2cp-1-j: the first kv half, no mask
  j >  i   only query chunk 2cp-1-i sees chunks j and 2cp-1-j, all of them: second q half, no mask

All-gather (--cp-comm-type allgather, as in Llama 3's training). K and V of the whole sequence are
gathered on every rank (small with GQA); each local query chunk attends to the prefix it may see
(earlier chunks unmasked, its own chunk causal). Backward gathers K/V again and reduce-scatters their
gradients to the owners. Simpler than the ring and as fast at small cp, but each rank briefly holds the
sequence's K/V.

All-to-all (--cp-comm-type a2a, DeepSpeed-Ulysses). An all-to-all turns the sequence split into a head split:
each rank sends head group j of its chunks to rank j and receives the whole sequence for its own nh/cp heads,
attends causally over it, and a second all-to-all sends each rank's tokens back with all their heads. Its traffic
per rank falls with cp (each all-to-all moves (cp-1)/cp of the local q, k, v or output) where the ring's stays
at the whole K/V; it needs the heads divisible by cp. K/V heads that do not divide are repeated to one per query
head first (their gradients are summed back by autograd).

All-to-all within groups, ring across them (--cp-comm-type a2a+p2p, --hierarchical-context-parallel-sizes A B,
cp = A x B). Cp ranks gA..gA+A-1 form a2a group g; their chunks gA..gA+A-1 and 2cp-A-gA..2cp-1-gA are
exactly chunks g and 2B-1-g of the sequence cut in 2B. So the all-to-all above, within the a2a group, leaves
each rank with the load-balanced share of ring rank g for cp B, for nh/A heads, and ring attention runs over
the B ranks that hold the same heads (the p2p group). The all-to-all stays within A adjacent ranks (a node's
fast links, when A fits in one); only the ring crosses between groups.

Documents (--reset-attention-mask). A token attends only to earlier tokens of its own document. Document ids
are nondecreasing along the sequence and a block's query and key rows are in sequence order, so within a block
each document that both hold is one rectangle of query rows by key rows (a causal square on a diagonal block)
and nothing else is visible: a block is a list of such spans, each run through the same block kernel, with no
mask. A block that no document spans is skipped; its K/V still travel on. Every device's kernel serves as it is;
the price is one kernel call per (sample, document) that a block holds, planned on the host from the ids.

Block kernels are fused attention kernels that return the LSE and take it back in backward: flash-attn's
with --attention-backend flash, else torch's own SDPA ops: on CPU its flash-attention kernel, on CUDA its
flash-attention op (bf16/fp16) or memory-efficient op (fp32). None of them creates a [b, h, sq, sk] score
tensor: scores exist only tile by tile inside the kernel. The running output, LSE and gradient accumulators
are fp32 whatever the activation dtype; activations saved for backward are those of the local s/cp tokens.
Attention dropout is not supported here (config validation says so).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState

try:  # optional CUDA kernels that return the log-sum-exp
    from flash_attn.flash_attn_interface import _flash_attn_backward, flash_attn_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = _flash_attn_backward = None

_KV_TAG, _DKV_TAG = 11, 12  # distinct from the pipeline's tags; K/V and dK/dV may be in flight together


# ---------------------------------------------------------------------------------------------------
# The batch split


def load_balanced_indices(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions held by `cp_rank`: chunks cp_rank and 2cp-1-cp_rank of 2cp equal chunks, in that order."""
    chunk = seq_length // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))


def get_batch_on_this_cp_rank(batch: dict[str, torch.Tensor], pstate: ParallelState) -> dict[str, torch.Tensor]:
    """This cp rank's share of a micro-batch every rank of the cp group has read.

    Every tensor has the sequence as its last dimension (tokens, labels, loss_mask [b, s]; position_ids
    [s] or [b, s]): [..., s] -> [..., s/cp]. position_ids become the rank's true positions, not a plain arange.
    document_ids [b, s] stay whole: a rank's attention needs the documents of every rank's keys.
    """
    if pstate.cp_size == 1:
        return batch
    seq_length = batch["tokens"].shape[-1]
    index = load_balanced_indices(seq_length, pstate.cp_size, pstate.cp_rank)
    return {key: value if key == "document_ids" else value.index_select(-1, index.to(value.device))
            for key, value in batch.items()}


# ---------------------------------------------------------------------------------------------------
# Block kernels: q [b, sq, nh, d], k/v [b, sk, ng, d] -> out [b, sq, nh, d] normalised over this block's
# keys and lse [b, nh, sq] (fp32). `causal` is only asked of square blocks, where top-left and
# bottom-right alignment agree. The backward takes the merged output and LSE of all blocks: with them a
# block's gradients are exactly its share of the full attention's gradients (as in flash-attention).


class CpuFlashKernel:
    """torch's CPU flash-attention kernel, which returns the LSE and takes it back in backward."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(t.transpose(1, 2) for t in (q, k, v)), 0.0, causal, scale=scale)  # [b, n, s, d] layout
        return out.transpose(1, 2), lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse.contiguous(), 0.0, causal, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)


class FlashAttnKernel:
    """flash-attn 2 (>= 2.6) on CUDA: its public forward returns the LSE, its backward op accepts one."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                             lse.contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
                             window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                             deterministic=False)
        return dq, dk, dv


class CudaFlashKernel:
    """torch's CUDA flash-attention op (SDPA's flash backend), bf16/fp16 only; it takes grouped K/V heads as they are.

    Unlike SDPA it does not pad the head dimension: head_dim must be a multiple of 8, at most 256. The
    backward's cumulative sequence lengths (varlen only) and RNG state (dropout only) are None: unused here.
    """

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), 0.0, causal, scale=scale)[:2]  # [b, n, s, d] layout
        return out.transpose(1, 2), lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse.contiguous(), None, None, q.shape[1],
            k.shape[1], 0.0, causal, None, None, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)


class CudaEfficientKernel:
    """torch's CUDA memory-efficient attention op (SDPA's efficient backend), used for fp32, which flash
    does not take.

    It has no grouped-query attention: K/V heads are repeated for their query heads and their gradients
    summed back per group. Its LSE rows are padded to a multiple of 32; the forward returns the true rows
    and the backward pads them again. The RNG state (dropout only) is None: unused here.
    """

    @staticmethod
    def _repeat_heads(t, num_heads: int):
        return t.repeat_interleave(num_heads // t.shape[2], dim=2)  # [b, s, ng, d] -> [b, s, nh, d]

    @staticmethod
    def _sum_heads(grad, num_groups: int):
        return grad.unflatten(1, (num_groups, -1)).sum(2).transpose(1, 2)  # [b, nh, s, d] -> [b, s, ng, d]

    @classmethod
    def forward(cls, q, k, v, causal: bool, scale: float):
        k, v = cls._repeat_heads(k, q.shape[2]), cls._repeat_heads(v, q.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), None, True, 0.0, causal, scale=scale)[:2]
        return out.transpose(1, 2), lse[..., :q.shape[1]]

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal: bool, scale: float):
        ng = k.shape[2]
        k, v = cls._repeat_heads(k, q.shape[2]), cls._repeat_heads(v, q.shape[2])
        padded_lse = F.pad(lse, (0, -lse.shape[-1] % 32))
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
            out.transpose(1, 2), padded_lse, None, None, 0.0, [True, True, True, False], causal, scale=scale)
        return dq.transpose(1, 2), cls._sum_heads(dk, ng), cls._sum_heads(dv, ng)


def choose_block_kernel(backend: str, device: torch.device, dtype: torch.dtype):
    """flash-attn's kernel when it is the attention backend, else torch's op for the device and dtype."""
    if backend == "flash":
        return FlashAttnKernel
    if device.type == "cpu":
        return CpuFlashKernel
    # CUDA's ops; another accelerator (or the fake one of tests/test_device_placement.py) takes them too
    return CudaFlashKernel if dtype in (torch.bfloat16, torch.float16) else CudaEfficientKernel


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online softmax: fold a block's output and LSE into the running fp32 ones, in place (views allowed).
    Running rows that start as out 0, lse -inf take the block's values exactly."""
    new_lse = torch.logaddexp(lse, block_lse)
    rows = lambda x: x.transpose(1, 2).unsqueeze(-1)  # noqa: E731 - [b, nh, sq] -> [b, sq, nh, 1]
    out.mul_(rows(lse - new_lse).exp()).add_(block_out.float() * rows(block_lse - new_lse).exp())
    lse.copy_(new_lse)


def _empty_output(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running fp32 output [b, sq, nh, d] and LSE [b, nh, sq] before any block: 0 and -inf."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


# ---------------------------------------------------------------------------------------------------
# Blocks and their document spans

Span = tuple[slice, slice, slice]  # (samples, query rows, key rows) within a block
_WHOLE_BLOCK: list[Span] = [(slice(None), slice(None), slice(None))]


class _Block(NamedTuple):
    """Local query rows against rows of the K/V at hand, causal or not, computed span by span."""

    rows: slice
    kv_rows: slice
    causal: bool
    spans: list[Span]


def _document_rows(ids: torch.Tensor) -> dict[int, slice]:
    """{document: its rows} for one sample's nondecreasing document ids [n]."""
    documents, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return {doc: slice(end - count, end) for doc, count, end in zip(documents.tolist(), counts.tolist(), ends)}


def document_spans(q_ids: torch.Tensor, k_ids: torch.Tensor) -> list[Span]:
    """The spans of a block whose queries and keys belong to documents q_ids [b, sq] and k_ids [b, sk] (each
    nondecreasing): for each sample, each document both hold, with its query rows and key rows. Empty when no
    query may see any key of the block."""
    spans = []
    for sample, (q, k) in enumerate(zip(q_ids, k_ids)):
        key_rows = _document_rows(k)
        spans += [(slice(sample, sample + 1), rows, key_rows[doc])
                  for doc, rows in _document_rows(q).items() if doc in key_rows]
    return spans


def _spans(document_ids: torch.Tensor | None, q_positions, kv_positions) -> list[Span]:
    """The block's spans given the sequence positions of its query and key rows: the whole block without
    documents."""
    if document_ids is None:
        return _WHOLE_BLOCK
    return document_spans(document_ids[:, q_positions], document_ids[:, kv_positions])


def _block_forward(kernel, q, k, v, out, lse, causal: bool, scale: float, spans: list[Span]) -> None:
    """Fold the attention of the block's queries q over k/v into its rows of the running out and lse."""
    for samples, rows, cols in spans:
        _merge(out[samples, rows], lse[samples, :, rows],
               *kernel.forward(q[samples, rows], k[samples, cols], v[samples, cols], causal, scale))


def _block_backward(kernel, dout, q, k, v, out, lse, grads, causal: bool, scale: float, spans: list[Span]) -> None:
    """Add the block's gradients into `grads` = (dq, dk, dv), fp32 views of the block's query and K/V rows;
    out and lse are those of the whole attention (merged over all blocks)."""
    for samples, rows, cols in spans:
        block_grads = kernel.backward(dout[samples, rows], q[samples, rows], k[samples, cols], v[samples, cols],
                                      out[samples, rows], lse[samples, :, rows], causal, scale)
        for total, grad, index in zip(grads, block_grads, (rows, cols, cols)):
            total[samples, index] += grad


# ---------------------------------------------------------------------------------------------------
# Ring attention


class _Ring:
    """This rank's neighbours in the cp ring, and one hop of a tensor around it.

    Plain isend/irecv, even ranks sending first and odd ranks receiving first (Megatron's order), so that
    a backend that serialises a pair's operations (NCCL) pairs every send with its receive;
    batch_isend_irecv is avoided because it can hang on gloo.
    """

    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensor: torch.Tensor, tag: int):
        """Start sending `tensor` to the next rank and receiving the previous rank's; wait() the works."""
        received = torch.empty_like(tensor)
        ops = [(mappings.isend, tensor, self.next), (mappings.irecv, received, self.prev)]
        if self.rank % 2:
            ops.reverse()
        return received, [op(t, peer, self.group, tag) for op, t, peer in ops]


def _wait(works) -> None:
    for work in works:
        work.wait()


def _ring_blocks(rank: int, cp: int, local_length: int, document_ids: torch.Tensor | None) -> list[_Block]:
    """Rank `rank`'s block at each ring step, by the three cases of the module docstring; `document_ids` [b, s]
    of the whole sequence, or None."""
    half, whole = local_length // 2, slice(None)
    seq_length = local_length * cp
    local = load_balanced_indices(seq_length, cp, rank)
    blocks = []
    for step in range(cp):
        source = (rank - step) % cp
        if step == 0:
            rows, kv_rows, causal = whole, whole, True
        elif source < rank:
            rows, kv_rows, causal = whole, slice(0, half), False
        else:
            rows, kv_rows, causal = slice(half, None), whole, False
        kv_positions = load_balanced_indices(seq_length, cp, source)[kv_rows]
        blocks.append(_Block(rows, kv_rows, causal, _spans(document_ids, local[rows], kv_positions)))
    return blocks


class RingAttention(torch.autograd.Function):
    """Causal attention of the local query chunks over the whole sequence, K/V passed around the cp ring."""

    @staticmethod
    def forward(ctx, q, k, v, group, kernel, document_ids=None):
        """q [b, s/cp, nh, d], k/v [b, s/cp, ng, d] (chunks i and 2cp-1-i) -> [b, s/cp, nh, d]."""
        ring = _Ring(group)
        scale = q.shape[-1] ** -0.5
        blocks = _ring_blocks(ring.rank, ring.size, q.shape[1], document_ids)
        kv = torch.stack((k, v))  # [2, b, s/cp, ng, d]: one message a hop
        out, lse = _empty_output(q)
        for step, block in enumerate(blocks):
            if step + 1 < ring.size:
                next_kv, works = ring.shift(kv, _KV_TAG)  # overlapped with this block's compute
            rows, kv_rows = block.rows, block.kv_rows
            _block_forward(kernel, q[:, rows], kv[0, :, kv_rows], kv[1, :, kv_rows], out[:, rows], lse[..., rows],
                           block.causal, scale, block.spans)
            if step + 1 < ring.size:
                _wait(works)
                kv = next_kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel, ctx.blocks = group, kernel, blocks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, kernel = _Ring(ctx.group), ctx.kernel
        scale = q.shape[-1] ** -0.5
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        earlier, dkv_works = None, []  # the dK/dV received from the previous rank, and its transfer
        for step, block in enumerate(ctx.blocks):
            if step + 1 < ring.size:
                next_kv, kv_works = ring.shift(kv, _KV_TAG)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # this rank's share for the block
            rows, kv_rows = block.rows, block.kv_rows
            _block_backward(kernel, dout[:, rows], q[:, rows], kv[0, :, kv_rows], kv[1, :, kv_rows], out[:, rows],
                            lse[..., rows], (dq[:, rows], dkv[0, :, kv_rows], dkv[1, :, kv_rows]), block.causal,
                            scale, block.spans)
            if earlier is not None:  # the block's gradient so far, from the ranks that held it before
                _wait(dkv_works)
                dkv += earlier
            earlier, dkv_works = ring.shift(dkv, _DKV_TAG)
            if step + 1 < ring.size:
                _wait(kv_works)
                kv = next_kv
        _wait(dkv_works)  # after cp hops, this rank's own block's gradient is home
        dk, dv = earlier.to(k.dtype).unbind(0)
        return dq.to(q.dtype), dk, dv, None, None, None


# ---------------------------------------------------------------------------------------------------
# All-gather attention


def chunks_to_sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """[cp * s/cp, ...] gathered in rank order (each rank's chunks r, 2cp-1-r) -> [s, ...] in sequence order."""
    by_rank = gathered.view(cp, 2, -1, *gathered.shape[1:])
    return torch.cat((by_rank[:, 0], by_rank[:, 1].flip(0))).flatten(0, 1)


def _chunks_to_rank_order(sequence: torch.Tensor, cp: int) -> torch.Tensor:
    """Inverse of `chunks_to_sequence_order`."""
    chunks = sequence.view(2 * cp, -1, *sequence.shape[1:])
    return torch.stack((chunks[:cp], chunks[cp:].flip(0)), dim=1).flatten(0, 2)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group, cp: int) -> torch.Tensor:
    """k/v [b, s/cp, ng, d] -> the whole sequence's [2, b, s, ng, d], in sequence order."""
    local = torch.stack((k, v)).permute(2, 0, 1, 3, 4)  # [s/cp, 2, b, ng, d]: sequence first to gather
    return chunks_to_sequence_order(mappings.all_gather_dim0(local, group), cp).permute(1, 2, 0, 3, 4)


def _allgather_blocks(rank: int, cp: int, local_length: int, document_ids: torch.Tensor | None) -> list[_Block]:
    """For each local query chunk, its block against its own chunk (causal), then against the earlier chunks,
    with K/V rows in sequence order; `document_ids` [b, s] of the whole sequence, or None."""
    chunk, blocks = local_length // 2, []
    for half, c in enumerate((rank, 2 * cp - 1 - rank)):
        rows, own = slice(half * chunk, (half + 1) * chunk), slice(c * chunk, (c + 1) * chunk)
        blocks.append(_Block(rows, own, True, _spans(document_ids, own, own)))
        if c > 0:
            earlier = slice(0, c * chunk)
            blocks.append(_Block(rows, earlier, False, _spans(document_ids, own, earlier)))
    return blocks


class AllGatherAttention(torch.autograd.Function):
    """Causal attention of the local query chunks against the gathered K/V of the whole sequence."""

    @staticmethod
    def forward(ctx, q, k, v, group, kernel, document_ids=None):
        """q [b, s/cp, nh, d], k/v [b, s/cp, ng, d] (chunks i and 2cp-1-i) -> [b, s/cp, nh, d]."""
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = q.shape[-1] ** -0.5
        blocks = _allgather_blocks(rank, cp, q.shape[1], document_ids)
        kv = _gather_kv(k, v, group, cp)
        out, lse = _empty_output(q)
        for rows, kv_rows, causal, spans in blocks:
            _block_forward(kernel, q[:, rows], kv[0, :, kv_rows], kv[1, :, kv_rows], out[:, rows], lse[..., rows],
                           causal, scale, spans)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel, ctx.blocks = group, kernel, blocks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, kernel = ctx.group, ctx.kernel
        cp = dist.get_world_size(group)
        scale = q.shape[-1] ** -0.5
        kv = _gather_kv(k, v, group, cp)  # gathered again rather than kept: memory stays ~ s/cp
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # [2, b, s, ng, d]
        for rows, kv_rows, causal, spans in ctx.blocks:
            _block_backward(kernel, dout[:, rows], q[:, rows], kv[0, :, kv_rows], kv[1, :, kv_rows], out[:, rows],
                            lse[..., rows], (dq[:, rows], dkv[0, :, kv_rows], dkv[1, :, kv_rows]), causal, scale,
                            spans)
        by_rank = _chunks_to_rank_order(dkv.permute(2, 0, 1, 3, 4), cp)  # [s, 2, b, ng, d], rank order
        dk, dv = mappings.reduce_scatter_dim0(by_rank, group).permute(1, 2, 0, 3, 4).to(k.dtype).unbind(0)
        return dq.to(q.dtype), dk, dv, None, None, None


# ---------------------------------------------------------------------------------------------------
# All-to-all (Ulysses) attention


def sequence_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, s/cp, n, d] of this rank's chunks -> [b, s, n/cp, d] in sequence order: head group j goes to rank j."""
    b, local, n, d = x.shape
    by_head_group = x.reshape(b, local, cp, n // cp, d).permute(2, 1, 0, 3, 4).flatten(0, 1)  # [cp*s/cp, b, n/cp, d]
    received = mappings.all_to_all(by_head_group.contiguous(), group, [local] * cp, [local] * cp)  # rank order
    return chunks_to_sequence_order(received, cp).permute(1, 0, 2, 3)


def heads_to_sequence(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Inverse of `sequence_to_heads`: [b, s, n/cp, d] -> [b, s/cp, n, d] of this rank's chunks."""
    b, seq_length, heads, d = x.shape
    local = seq_length // cp
    by_rank = _chunks_to_rank_order(x.permute(1, 0, 2, 3), cp)  # [cp*s/cp, b, n/cp, d]
    received = mappings.all_to_all(by_rank.contiguous(), group, [local] * cp, [local] * cp)
    return received.view(cp, local, b, heads, d).permute(2, 1, 0, 3, 4).reshape(b, local, cp * heads, d)


class _CausalAttention(torch.autograd.Function):
    """Causal attention of a whole sequence [b, s, nh, d] over k/v [b, s, ng, d] by the block kernel, within
    documents when `document_ids` [b, s] are given: the local step of all-to-all attention."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, document_ids=None):
        scale = q.shape[-1] ** -0.5
        spans = _spans(document_ids, slice(None), slice(None))
        out, lse = _empty_output(q)
        _block_forward(kernel, q, k, v, out, lse, True, scale, spans)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.spans = kernel, spans
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
        _block_backward(ctx.kernel, dout, q, k, v, out, lse, grads, True, q.shape[-1] ** -0.5, ctx.spans)
        return *(g.to(t.dtype) for g, t in zip(grads, (q, k, v))), None, None


def all_to_all_attention(q, k, v, group, kernel, document_ids=None, ring_group=None) -> torch.Tensor:
    """q [b, s/cp, nh, d], k/v [b, s/cp, ng, d] (chunks i and 2cp-1-i) -> [b, s/cp, nh, d], heads split over
    `group` for the attention itself; with a `ring_group` (a2a+p2p) the attention of those heads goes around
    it. Either group may be None (size 1)."""
    a2a = 1 if group is None else dist.get_world_size(group)
    if k.shape[2] % a2a:  # too few K/V heads to split: one per query head
        k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
    q, k, v = (sequence_to_heads(t, group, a2a) for t in (q, k, v))  # [b, s*A/cp, nh/A, d]
    if ring_group is None:
        out = _CausalAttention.apply(q, k, v, kernel, document_ids)
    else:
        out = RingAttention.apply(q, k, v, ring_group, kernel, document_ids)
    return heads_to_sequence(out, group, a2a)


@torch.compiler.disable  # host-side planning, p2p and data-dependent ops: eager under --torch-compile
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, comm_type: str,
                               backend: str, document_ids: torch.Tensor | None = None,
                               hierarchical_groups: tuple | None = None) -> torch.Tensor:
    """q [s/cp, b, nh, d], k/v [s/cp, b, ng, d] of this rank's chunks -> [s/cp, b, nh * d], causal over the
    whole sequence of the cp group; within documents only when `document_ids` [b, s] (host, whole sequence)
    are given. a2a+p2p uses the cp group's (a2a, p2p) subgroups, `hierarchical_groups`, instead of `group`."""
    s, b = q.shape[:2]
    kernel = choose_block_kernel(backend, q.device, q.dtype)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    if comm_type == "a2a":
        out = all_to_all_attention(q, k, v, group, kernel, document_ids)
    elif comm_type == "a2a+p2p":
        a2a_group, p2p_group = hierarchical_groups
        out = all_to_all_attention(q, k, v, a2a_group, kernel, document_ids, ring_group=p2p_group)
    else:
        attention = RingAttention if comm_type == "p2p" else AllGatherAttention
        out = attention.apply(q, k, v, group, kernel, document_ids)
    return out.transpose(0, 1).reshape(s, b, -1)  # [b, s/cp, nh, d] -> [s/cp, b, nh*d]
