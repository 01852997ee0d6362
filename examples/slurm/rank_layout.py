"""Print where each rank of a multi-node run sits: node, GPU, and its (tp, cp, dp, pp) coordinates.

    python examples/slurm/rank_layout.py --nnodes 2 --nproc-per-node 8 --tp 4 --pp 2

torchrun numbers the ranks node by node (node 0 holds ranks 0-7), and megatron_lite orders them tp-cp-dp-pp,
TP fastest (megatron_lite/parallel/state.py), so a tensor-parallel group sits on adjacent ranks of one node
(NVLink) while data- and pipeline-parallel groups cross nodes. The table comes from the same pure functions
the training run uses to build its groups.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_lite.parallel.state import Layout, group_ranks, rank_coordinates  # noqa: E402


def layout_lines(nnodes: int, nproc_per_node: int, tp: int = 1, cp: int = 1, pp: int = 1) -> list[str]:
    """The table, one line per rank, then the members of each group of more than one rank."""
    layout = Layout.from_world(nnodes * nproc_per_node, tp=tp, cp=cp, pp=pp)
    lines = [f"{nnodes} nodes x {nproc_per_node} GPUs: TP{layout.tp} x CP{layout.cp} x DP{layout.dp} x "
             f"PP{layout.pp} (rank order tp-cp-dp-pp, TP fastest)",
             "rank  node  gpu   tp  cp  dp  pp"]
    for rank in range(layout.world_size):
        c = rank_coordinates(rank, layout)
        node, gpu = divmod(rank, nproc_per_node)
        lines.append(f"{rank:4d}  {node:4d}  {gpu:3d}  {c.tp:3d} {c.cp:3d} {c.dp:3d} {c.pp:3d}")
    for kind in ("tp", "cp", "dp", "pp"):
        groups = group_ranks(layout, kind)
        if len(groups[0]) == 1:
            continue
        nodes_spanned = max(len({rank // nproc_per_node for rank in group}) for group in groups)
        where = "each within one node" if nodes_spanned == 1 else f"each across {nodes_spanned} nodes"
        lines.append(f"{kind} groups ({where}): " + " ".join(str(group).replace(" ", "") for group in groups))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nnodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1, help="--tensor-model-parallel-size")
    parser.add_argument("--cp", type=int, default=1, help="--context-parallel-size")
    parser.add_argument("--pp", type=int, default=1, help="--pipeline-model-parallel-size")
    args = parser.parse_args(argv)
    try:
        lines = layout_lines(args.nnodes, args.nproc_per_node, args.tp, args.cp, args.pp)
    except ValueError as error:
        parser.error(str(error))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
