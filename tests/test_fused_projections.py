"""Fused q/k/v and gate/up products (`flashspec.generation.fused_projections`): the model's
own parameters become views of one matrix per group, eager forwards are unchanged, and a
compiled layer computes one product per group (inductor's CPU backend here; on CUDA the
engine's steps: test_generate_gpu.py and the other GPU tests run with them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flashspec.generation import fused_projections
from flashspec.generation.fused_projections import MERGE, FusedMember, fuse

from _models import tiny_model

ATTENTION, MLP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def _groups(decoder):
    for layer in decoder.layers:
        yield [getattr(layer.self_attn, name) for name in ATTENTION]
        yield [getattr(layer.mlp, name) for name in MLP]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fusing_keeps_the_model_its_weights_and_its_outputs(arch):
    model = tiny_model(arch, wrap=False)
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    before = model(ids).logits
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    decoder = model.model
    assert fuse(decoder) == 2 * len(decoder.layers)
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    assert torch.equal(model(ids).logits, before)
    for members in _groups(decoder):
        fused = members[0].fused_weight
        assert all(type(m) is FusedMember and m.fused_weight is fused for m in members)
        start = 0
        for member in members:
            # A view of its rows of the one matrix: no second copy of the weights.
            assert member.weight.data_ptr() == fused[start:].data_ptr()
            assert member.fused_columns == (start, start + member.out_features)
            start += member.out_features
        assert start == fused.shape[0]
    addresses = [p.data_ptr() for p in model.parameters()]
    assert fuse(decoder) == 2 * len(decoder.layers)              # idempotent
    assert [p.data_ptr() for p in model.parameters()] == addresses


def test_groups_that_cannot_be_fused_are_left_alone():
    decoder = tiny_model("llama", wrap=False).model
    hooked, biased, other = decoder.layers[0].self_attn, decoder.layers[0].mlp, decoder.layers[1]
    hooked.k_proj.register_forward_hook(lambda module, args, output: None)
    biased.up_proj.bias = nn.Parameter(torch.zeros(biased.up_proj.out_features))
    other.self_attn.v_proj.weight.data = other.self_attn.v_proj.weight.data.double()
    assert fuse(decoder) == 2 * len(decoder.layers) - 3
    for members in (hooked.q_proj, hooked.k_proj, biased.gate_proj, other.self_attn.q_proj):
        assert type(members) is nn.Linear
    assert type(other.mlp.gate_proj) is FusedMember


def test_a_moved_or_cast_member_leaves_its_group():
    """``.to()`` that gives the parameters new tensors ends the fusion (the old matrix is not
    kept alive); one that keeps them keeps it."""
    model = tiny_model("llama", wrap=False)
    fuse(model.model)
    model.to("cpu")
    assert type(model.model.layers[0].self_attn.q_proj) is FusedMember
    model.to(torch.float64)
    assert not any(type(m) is FusedMember for m in model.modules())
    assert all(not hasattr(m, "fused_weight") for m in model.modules())


def test_a_compiled_layer_computes_one_product_per_group():
    """Seven products per layer (q, k, v, o, gate, up, down) become four inside `active`,
    seven outside it; one compilation of the layer class serves every layer, each with its
    own weights, and the output is the eager layer's (the engine's regional compilation)."""
    model = tiny_model("llama", wrap=False)
    layers = model.model.layers
    hidden = torch.randn(2, 3, model.config.hidden_size,
                         generator=torch.Generator().manual_seed(1))
    embeddings = model.model.rotary_emb(hidden, torch.arange(3)[None].expand(2, 3))
    with torch.no_grad():
        eager = [layer(hidden, position_embeddings=embeddings, attention_mask=None)
                 for layer in layers]
    fuse(model.model)
    counts = []

    class Counting(type(MERGE)):
        def __call__(self, graph):
            MERGE(graph)
            counts.append(sum(node.target is torch.ops.aten.mm.default for node in graph.nodes))

    torch._dynamo.reset()
    compiled = torch.compile(type(layers[0]).forward,
                             options={"post_grad_custom_pre_pass": Counting(),
                                      "fx_graph_cache": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(layers[0], hidden, position_embeddings=embeddings,
                                            attention_mask=None), eager[0])
        assert counts == [7]
        with fused_projections.active():
            for layer, want in zip(layers, eager):
                torch.testing.assert_close(compiled(layer, hidden, position_embeddings=embeddings,
                                                    attention_mask=None), want)
    assert counts == [7, 4]


def test_a_group_whose_parameters_were_replaced_is_fused_again():
    """A state dict loaded with ``assign=True`` (new tensors, not copies into the views) or a
    deep copy leaves members whose parameters are not views of their matrix: `fuse` fuses
    the group again from the parameters, so the compiled products read the new weights."""
    import copy

    model = tiny_model("llama", wrap=False)
    fuse(model.model)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    state["model.layers.0.self_attn.k_proj.weight"] *= 1.5
    model.load_state_dict(state, assign=True)
    attention = model.model.layers[0].self_attn
    stale = attention.q_proj.fused_weight
    fuse(model.model)
    assert attention.q_proj.fused_weight is not stale
    lo, hi = attention.k_proj.fused_columns
    assert torch.equal(attention.k_proj.fused_weight[lo:hi], state["model.layers.0.self_attn.k_proj.weight"])
    assert attention.k_proj.weight.data_ptr() == attention.k_proj.fused_weight[lo:].data_ptr()
    twin = copy.deepcopy(model)
    fuse(twin.model)
    member = twin.model.layers[1].mlp.up_proj
    lo, _ = member.fused_columns
    assert member.weight.data_ptr() == member.fused_weight[lo:].data_ptr()


def test_drafters_fuse_before_their_keys_read_the_parameters(monkeypatch, tmp_path):
    """Where steps compile (CUDA; here the CPU stands in), a drafter fuses its decoder before
    its graph key reads the parameters' addresses: after its runner fused the decoder (as a
    compiled runner does), the next call's drafter has the same key (else it would attach
    again, and capture every graph again)."""
    from flashspec.generation.drafters import AssistantDrafter
    from flashspec.generation.heads import output_head
    from flashspec.generation.mtp import Mtp

    import test_eagle3
    import test_mtp

    monkeypatch.setattr(fused_projections, "COMPILED_DEVICES", ("cpu",))
    draft = tiny_model("llama", "draft", wrap=False)
    first = AssistantDrafter(output_head(draft, "assistant_model")).key
    fuse(draft.model)
    assert AssistantDrafter(output_head(draft, "assistant_model")).key == first

    eagle3 = test_eagle3.head_for(test_eagle3.target())
    first = eagle3.key
    fuse(eagle3.model)
    assert eagle3.key == first
    assert type(eagle3.model.midlayer.self_attn.q_proj) is FusedMember

    test_mtp.write_checkpoint(tmp_path)
    glm = test_mtp.Glm4MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    glm._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{test_mtp.LAYERS}\..*"]
    drafter = Mtp(glm)
    fuse(drafter.decoder)
    assert Mtp(glm).key == drafter.key
    block = drafter.mtp.layers[0].mtp_block
    assert type(block.self_attn.q_proj) is FusedMember
    assert type(block.mlp.shared_experts.gate_proj) is FusedMember      # a MoE's shared MLP


def test_the_merge_keeps_different_products_apart():
    """The same product twice is computed once; a product by another matrix stays."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def products(x, a, b):
        return x @ a.t(), x @ a.t(), x @ b.t()

    inputs = (torch.randn(2, 3), torch.randn(4, 3), torch.randn(4, 3))
    traced = make_fx(products)(*inputs)
    assert sum(n.target is torch.ops.aten.mm.default for n in traced.graph.nodes) == 3
    MERGE(traced.graph)
    traced.recompile()
    assert sum(n.target is torch.ops.aten.mm.default for n in traced.graph.nodes) == 2
    for got, want in zip(traced(*inputs), products(*inputs)):
        torch.testing.assert_close(got, want)


def test_row_sharded_members_fuse_their_local_shards(tmp_path):
    """A tensor-parallel model's column-parallel members (weights sharded by rows, as
    transformers' ``ColwiseParallel`` shards them): their local shards become views of one
    local matrix, their own (tensor-parallel) forward runs eagerly, and the compiled product
    gives each its local columns. One rank of gloo."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        parent, attention = nn.Module(), nn.Module()
        parent.self_attn = attention
        torch.manual_seed(0)
        for name, rows in zip(ATTENTION, (8, 4, 4)):
            linear = nn.Linear(6, rows, bias=False)
            linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh,
                                                           [Shard(0)]), requires_grad=False)
            linear.forward = (lambda x, linear=linear:
                              nn.functional.linear(x, linear.weight.to_local()))
            setattr(attention, name, linear)
        x = torch.randn(3, 6)
        want = [getattr(attention, name)(x) for name in ATTENTION]
        assert fuse(parent) == 1
        q = attention.q_proj
        assert q.weight.to_local().data_ptr() == q.fused_weight.data_ptr()
        assert "forward" not in vars(q) and "tensor_parallel_forward" in vars(q)
        for name, expected in zip(ATTENTION, want):
            assert torch.equal(getattr(attention, name)(x), expected)
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: [getattr(attention, n)(x) for n in ATTENTION],
                                 options={"post_grad_custom_pre_pass": MERGE})
        with fused_projections.active():
            for got, expected in zip(compiled(x), want):
                torch.testing.assert_close(got, expected)
        # Sharded weights without transformers' forward (whose output is a DTensor, not the
        # local columns): left alone.
        for name in ATTENTION:
            del getattr(attention, name).tensor_parallel_forward
        fused_projections._unfuse(q)
        assert fuse(parent) == 0
    finally:
        dist.destroy_process_group()
