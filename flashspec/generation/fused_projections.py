"""A layer's q/k/v and gate/up projections as one GEMM each in flashspec's compiled steps.

A decode step multiplies a few rows by each weight matrix, and cuBLAS runs such products
below the memory bandwidth, the more so the smaller the matrix: the key and value heads'
projections, and every matrix of a tensor-parallel rank's shards. vLLM and SGLang load q/k/v
and gate/up as one matrix each (``QKVParallelLinear``, ``MergedColumnParallelLinear``). Here
the model keeps its modules and parameters; `fuse` copies each group's weights into one
matrix and points the members' parameters at its row slices (no memory added: the model's
own tensors become views). Inside the compiled steps (`active`), each member computes the
whole group's product and keeps its columns; the members' products are then the same
nodes, which `MERGE` (an inductor pass) merges into one GEMM. Eager forwards (the prefill,
stock generate) run each member's own product, as before.

A tensor-parallel model's column-parallel members (weights sharded by rows) are fused over
their local shards: the local product of the replicated input is the member's output, as
transformers' ``ColwiseParallel`` computes it in inference.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

# Parent module name -> its members, in the order of their columns in the fused matrix: the
# attention's projections, and the gated MLPs (dense, and a mixture of experts' shared one:
# DeepSeek's and GLM's ``shared_experts``, Qwen2-MoE's ``shared_expert``).
GATE_UP = ("gate_proj", "up_proj")
GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": GATE_UP,
          "shared_experts": GATE_UP, "shared_expert": GATE_UP}

_active = False


@contextlib.contextmanager
def active():
    """Fused members compute the group's product while compiled code is traced inside."""
    global _active
    previous, _active = _active, True
    try:
        yield
    finally:
        _active = previous


class FusedMember(nn.Linear):
    """A member of a fused group: its module's class while fused (`fuse`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _active and torch.compiler.is_compiling():
            lo, hi = self.fused_columns
            return F.linear(x, self.fused_weight, self.fused_bias)[..., lo:hi]
        return self.own_forward(x)

    def own_forward(self, x: torch.Tensor) -> torch.Tensor:
        eager = self.__dict__.get("tensor_parallel_forward")
        return eager(x) if eager is not None else super().forward(x)

    def _apply(self, fn, recurse=True):
        # Moved or cast (``.to()``, ``.half()``...), its parameters get tensors of their own:
        # it leaves the group, which would otherwise keep the old matrix alive (an engine sees
        # new addresses and fuses the group again).
        result = nn.Module._apply(self, fn, recurse)
        weight = _local(self.weight)
        if weight.untyped_storage().data_ptr() != self.fused_weight.untyped_storage().data_ptr():
            _unfuse(self)
        return result


def fuse(decoder: nn.Module) -> int:
    """Fuse every group of `decoder` that can be (`_members`); idempotent. A group whose
    members' parameters are no longer views of its matrix (a parameter replaced, a state
    dict loaded with ``assign=True``, a deep copy) is fused again from the parameters.
    Returns how many groups are fused."""
    count = 0
    for parent in decoder.modules():
        for group_name, names in GROUPS.items():
            group = getattr(parent, group_name, None)
            members = _members(group, names)
            if members is None:
                continue
            if not _fused(members):
                for member in members:
                    if type(member) is FusedMember:
                        _unfuse(member)
                _fuse(members)
            count += 1
    return count


# Where flashspec's engine compiles a decoder's steps (`Engine.graphs_enabled`).
COMPILED_DEVICES = ("cuda",)


def fuse_where_compiled(decoder: nn.Module) -> None:
    """`fuse` a drafter's decoder if its steps will be compiled, before the drafter's graph
    key reads its parameters' addresses (which fusing changes)."""
    if next(decoder.parameters()).device.type in COMPILED_DEVICES:
        fuse(decoder)


def _members(group, names) -> list[nn.Linear] | None:
    """The group's members if they can be fused: plain (or already fused) `nn.Linear`s with
    no hooks, the same input width, dtype and device, biases on all or none, and either
    ordinary tensors or every one a row-sharded DTensor (transformers' column parallel)."""
    if not isinstance(group, nn.Module):
        return None
    members = [getattr(group, name, None) for name in names]
    if not all(type(m) in (nn.Linear, FusedMember) for m in members):
        return None
    if any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in members):
        return None
    weights = [_local(m.weight) for m in members]
    if any(type(w.data) is not torch.Tensor for w in weights):
        return None                      # quantized or other tensor subclasses
    if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
        return None
    if len({m.bias is None for m in members}) != 1:
        return None
    sharded = [_row_sharded(m.weight) for m in members]
    if any(sharded) and not all(sharded):
        return None
    # transformers' tensor-parallel forward (kept as `tensor_parallel_forward` once fused)
    # on sharded members, whose fused product is their local output; no other replaced one.
    tensor_parallel = ["forward" in vars(m) or "tensor_parallel_forward" in vars(m)
                       for m in members]
    if tensor_parallel != sharded:
        return None
    if all(sharded) and (members[0].bias is not None
                         and not all(_row_sharded(m.bias) for m in members)):
        return None
    return members


def _fused(members: list[nn.Linear]) -> bool:
    """Whether the members are one group whose parameters are exactly the views of its
    matrix that `_fuse` made."""
    if not all(type(m) is FusedMember for m in members):
        return False
    fused, fused_bias = members[0].fused_weight, members[0].fused_bias
    for member in members:
        if member.fused_weight is not fused or member.fused_bias is not fused_bias:
            return False
        start, end = member.fused_columns
        if not _is_rows(_local(member.weight), fused, start, end):
            return False
        if fused_bias is not None and not _is_rows(_local(member.bias), fused_bias, start, end):
            return False
    return True


def _is_rows(tensor: torch.Tensor, whole: torch.Tensor, start: int, end: int) -> bool:
    rows = whole[start:end]
    return (tensor.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            and tensor.storage_offset() == rows.storage_offset()
            and tensor.shape == rows.shape and tensor.stride() == rows.stride())


def _row_sharded(param) -> bool:
    from torch.distributed.tensor import DTensor, Shard
    return (isinstance(param, DTensor) and param.device_mesh.ndim == 1
            and tuple(param.placements) == (Shard(0),))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _fuse(members: list[nn.Linear]) -> None:
    weights = [_local(m.weight).detach() for m in members]
    fused = torch.cat(weights)
    biases = None if members[0].bias is None else [_local(m.bias).detach() for m in members]
    fused_bias = None if biases is None else torch.cat(biases)
    start = 0
    for member, weight in zip(members, weights):
        end = start + weight.shape[0]
        _point(member.weight, fused[start:end])
        if fused_bias is not None:
            _point(member.bias, fused_bias[start:end])
        if "forward" in vars(member):    # transformers' tensor-parallel forward
            member.tensor_parallel_forward = vars(member).pop("forward")
        member.__class__ = FusedMember
        member.fused_weight, member.fused_bias = fused, fused_bias
        member.fused_columns = (start, end)
        start = end


def _unfuse(member: FusedMember) -> None:
    for name in ("fused_weight", "fused_bias", "fused_columns"):
        vars(member).pop(name, None)
    eager = vars(member).pop("tensor_parallel_forward", None)
    if eager is not None:
        member.forward = eager
    member.__class__ = nn.Linear


def _point(param: torch.Tensor, rows: torch.Tensor) -> None:
    """Make `param` (its local shard, for a DTensor) the view `rows`, which holds its values."""
    if hasattr(param, "_local_tensor"):
        param._local_tensor = rows
    else:
        param.data = rows


def _merge_same_products(graph: torch.fx.Graph) -> None:
    aten = torch.ops.aten
    pure = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
            aten.permute.default, aten.mm.default, aten.addmm.default, aten.expand.default}
    seen = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in pure:
            continue
        key = (node.target, node.args, tuple(sorted(node.kwargs.items())))
        try:
            hash(key)
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
        else:
            seen[key] = node


class MergeSameProducts(CustomGraphPass):
    """Inductor post-grad pass: a matrix product (and the views and transposes feeding it)
    computed twice from the same nodes is computed once."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        _merge_same_products(graph)

    def uuid(self) -> bytes:
        return hashlib.sha256(inspect.getsource(_merge_same_products).encode()).digest()


MERGE = MergeSameProducts()
