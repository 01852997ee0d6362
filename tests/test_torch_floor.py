"""Every torch.distributed name the package uses exists in the torch that pyproject states as its floor.

The suite runs on the newest torch, and GPU images ship older ones (torch 2.11 on the H200 here): a
collective that only the newest torch has passes every CPU test and fails on the first GPU run. The floor
is the oldest torch the whole suite has passed on (`TORCH=2.11.0 bash scripts/run_tests.sh`, README). The
names are found by reading the source, so code paths no test reaches are checked too.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [*sorted((ROOT / "megatron_lite").rglob("*.py")), ROOT / "pretrain_gpt.py"]

FLOOR = "2.11"
# torch.distributed's public names in torch 2.11.0: the __all__ of torch/distributed/distributed_c10d.py plus
# what torch/distributed/__init__.py defines or imports (not its submodules), read from the 2.11.0 wheel.
FLOOR_NAMES = frozenset([
    "AllToAllOptions", "AllreduceCoalescedOptions", "AllreduceOptions", "Backend", "BackendConfig", "BarrierOptions",
    "BroadcastOptions", "BuiltinCommHookType", "DebugLevel", "DeviceMesh", "DistBackendError", "DistError",
    "DistNetworkError", "DistStoreError", "FileStore", "GatherOptions", "GradBucket", "GroupMember", "GroupName",
    "HashStore", "Logger", "P2POp", "PrefixStore", "ProcessGroup", "ProcessGroupGloo", "ProcessGroupNCCL",
    "QueueEmptyError", "RankType", "ReduceOp", "ReduceOptions", "ReduceScatterOptions", "Reducer", "ScatterOptions",
    "Store", "TCPStore", "Work", "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object",
    "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
    "breakpoint", "broadcast", "broadcast_object_list", "default_pg_timeout", "destroy_process_group", "gather",
    "gather_object", "get_backend", "get_backend_config", "get_debug_level", "get_default_backend_for_device",
    "get_global_rank", "get_group_rank", "get_node_local_rank", "get_pg_count", "get_process_group_ranks", "get_rank",
    "get_world_size", "group", "init_device_mesh", "init_process_group", "irecv", "is_available",
    "is_backend_available", "is_gloo_available", "is_initialized", "is_mpi_available", "is_nccl_available",
    "is_torchelastic_launched", "is_ucc_available", "is_xccl_available", "isend", "monitored_barrier", "new_group",
    "new_subgroups", "new_subgroups_by_enumeration", "recv", "recv_object_list", "reduce", "reduce_op",
    "reduce_scatter", "reduce_scatter_tensor", "register_rendezvous_handler", "rendezvous", "scatter",
    "scatter_object_list", "send", "send_object_list", "set_debug_level", "set_debug_level_from_env", "shrink_group",
    "split_group", "supports_complex", "timedelta"
])


def _is_torch_distributed(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "distributed"
            and isinstance(node.value, ast.Name) and node.value.id == "torch")


def _aliases(tree: ast.Module) -> set[str]:
    """Local names bound to the torch.distributed module (`import torch.distributed as dist`)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return aliases


def distributed_names_used(path: Path) -> dict[str, int]:
    """torch.distributed names `path` reads (`dist.X`, `torch.distributed.X`, `from torch.distributed
    import X`; submodules such as torch.distributed.checkpoint are not torch.distributed's own names),
    each with the first line it is read on."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = _aliases(tree)
    used: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute) and (
                _is_torch_distributed(node.value) or (isinstance(node.value, ast.Name) and node.value.id in aliases)):
            names = [node.attr]
        else:
            continue
        for name in names:
            used[name] = min(used.get(name, node.lineno), node.lineno)
    return used


def test_package_uses_only_torch_distributed_names_of_the_floor_version():
    used = {}
    for path in SOURCES:
        for name, line in distributed_names_used(path).items():
            used.setdefault(name, f"{path.relative_to(ROOT)}:{line}")
    assert {"all_reduce", "broadcast", "isend", "get_world_size"} <= set(used)  # the scan sees the package's calls
    missing = {name: where for name, where in sorted(used.items()) if name not in FLOOR_NAMES}
    assert not missing, f"torch.distributed names that torch {FLOOR} lacks (first use): {missing}"


def test_pyproject_states_the_checked_floor():
    requirement = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert requirement is not None and requirement.group(1) == FLOOR


TENSOR_COMMUNICATION = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                        "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
                        "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv", "reduce",
                        "gather", "scatter"}


def test_tensors_are_communicated_through_mappings_only():
    """parallel/mappings.py is the one place the package sends tensors, so wrapping it counts every transfer."""
    outside = {f"{path.relative_to(ROOT)}:{line} {name}" for path in SOURCES if path.name != "mappings.py"
               for name, line in distributed_names_used(path).items() if name in TENSOR_COMMUNICATION}
    assert not outside, f"tensor collectives called outside parallel/mappings.py: {sorted(outside)}"
    assert TENSOR_COMMUNICATION & set(distributed_names_used(ROOT / "megatron_lite/parallel/mappings.py"))
