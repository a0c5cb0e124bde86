"""context_parallel routes every attention reached inside the block: torch's modules
(nn.MultiheadAttention, nn.TransformerEncoderLayer / DecoderLayer, their eval fast paths),
torch.utils.checkpoint's recomputes in both modes and torch.compile'd functions, each against
the same computation on the whole sequence in float64 under the project's rule (float32 torch as
the naive run); and it refuses what it cannot compute, naming it, before anything changes.
Ranks are threads (ctxpar.run_threads)."""
import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ctxpar.torch as cpt
from ctxpar import layout as cl
from ctxpar.torch import context_parallel
from conftest import check_close
from test_torch import run_ranks

T, E, HEADS = 32, 64, 4  # head dim 16, the library's smallest
causal = nn.Transformer.generate_square_subsequent_mask


def whole(module, inputs, dout, call, dtype):
    """call(module, *inputs) on the whole sequence in dtype: out, input grads, param grads."""
    m = copy.deepcopy(module).to(dtype)
    xs = [x.detach().to(dtype, copy=True).requires_grad_(dout is not None) for x in inputs]
    with torch.set_grad_enabled(dout is not None):
        out = call(m, *xs)
        if dout is not None:
            out.backward(dout.to(dtype))
    return out.detach(), [x.grad for x in xs], {n: p.grad for n, p in m.named_parameters()}


def in_block(module, inputs, dout, call, ranks=2):
    """The same inside context_parallel (inputs sharded along dim 1, a module copy per rank):
    out and input grads whole, param grads summed over the ranks (what an allreduce gives)."""
    def rank(comm):
        m = copy.deepcopy(module)
        xs = [x.clone().requires_grad_(dout is not None) for x in inputs]
        with context_parallel(comm, buffers=xs, buffer_seq_dims=[1] * len(xs)):
            with torch.set_grad_enabled(dout is not None):
                out = call(m, *xs)
                if dout is not None:
                    out.backward(cl.shard(dout, comm, seq_dim=1))
            out = cl.unshard(out.detach().contiguous(), comm, seq_dim=1)
        return out, [x.grad for x in xs], {n: p.grad for n, p in m.named_parameters()}

    per_rank = run_ranks(ranks, rank)
    params = {n: sum(r[2][n] for r in per_rank) for n in per_rank[0][2]} if dout is not None else {}
    return per_rank[0][0], per_rank[0][1], params


def check_against_whole(module, inputs, call, backward=True):
    torch.manual_seed(3)
    dout = torch.randn(inputs[0].shape) if backward else None
    ours = in_block(module, inputs, dout, call)
    ref, naive = (whole(module, inputs, dout, call, dt) for dt in (torch.float64, torch.float32))
    check_close("out", ours[0], ref[0], naive[0])
    if backward:
        for i, (g, r, n) in enumerate(zip(ours[1], ref[1], naive[1])):
            check_close(f"grad of input {i}", g, r, n)
        for name in ref[2]:
            check_close(f"grad of {name}", ours[2][name], ref[2][name], naive[2][name])


def model(kind):
    torch.manual_seed(1)
    if kind == "mha":
        return nn.MultiheadAttention(E, HEADS, batch_first=True)
    layer = nn.TransformerEncoderLayer if kind == "encoder" else nn.TransformerDecoderLayer
    return layer(E, HEADS, dim_feedforward=64, dropout=0.0, batch_first=True)


def sequences(n=1):
    torch.manual_seed(2)
    return [torch.randn(2, T, E) for _ in range(n)]


MODULE_CALLS = {
    "mha": (1, lambda m, x: m(x, x, x, need_weights=False)[0]),
    "encoder": (1, lambda m, x: m(x, src_mask=causal(x.shape[1]), is_causal=True)),
    # causal self-attention, then cross-attention to the (sharded, same length) memory
    "decoder": (2, lambda m, x, mem: m(x, mem, tgt_mask=causal(x.shape[1]), tgt_is_causal=True)),
}


@pytest.mark.parametrize("kind", list(MODULE_CALLS))
def test_torch_modules_attend_to_the_whole_sequence(kind):
    # Their SDPA runs inside F.multi_head_attention_forward, which the mode's handler called
    # with the mode popped: the shard's own attention (MHA off by 0.25, in_proj grad by 3.1).
    count, call = MODULE_CALLS[kind]
    check_against_whole(model(kind), sequences(count), call)


@pytest.mark.parametrize("kind", list(MODULE_CALLS))
def test_eval_fast_path_conditions_are_routed_too(kind):
    # eval + no_grad + batch_first is where the modules take torch._native_multi_head_attention
    # / torch._transformer_encoder_layer_fwd outside a block.
    count, call = MODULE_CALLS[kind]
    check_against_whole(model(kind).eval(), sequences(count), call, backward=False)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recomputes_through_the_route(reentrant):
    # Backward recomputes the checkpointed layer where no mode is active: before, the
    # recompute ran torch's SDPA on the shard (dq off by ~1.7, no error).
    layer = model("encoder")

    def call(m, x):
        return checkpoint(m, x, causal(x.shape[1]), None, True, use_reentrant=reentrant)

    check_against_whole(layer, sequences(), call)


def test_a_checkpoint_whose_recompute_cannot_be_found_is_refused(monkeypatch):
    # A torch whose checkpoint keeps its recompute function where ctxpar does not look: the
    # block refuses rather than let backward attend to the shard.
    monkeypatch.setattr(cpt, "_recompute_owner", lambda frame: None)
    layer = model("encoder")

    def rank(comm):
        x = sequences()[0]
        with context_parallel(comm, buffers=[x], buffer_seq_dims=[1]):
            with pytest.raises(RuntimeError, match="torch.utils.checkpoint inside ctxpar's "
                                                   "context_parallel: this torch"):
                checkpoint(layer, x, use_reentrant=False)
        return True

    assert all(run_ranks(2, rank))


def test_a_checkpoint_begun_before_the_block_keeps_its_own_recompute():
    # The block opens inside a checkpointed function: the SDPA before the block is torch's on
    # the whole tensor, and its recompute must stay so (the block reroutes only checkpoints
    # begun inside it).
    torch.manual_seed(4)
    x0 = torch.randn(1, HEADS, T, 16)

    def rank(comm):
        def body(x):
            y = F.scaled_dot_product_attention(x, x, x, is_causal=True)  # no block: torch's
            buf = torch.randn(1, HEADS, T, 16)
            with context_parallel(comm, buffers=[buf], buffer_seq_dims=[2]):
                F.scaled_dot_product_attention(buf, buf, buf)  # routed: marks checkpoints
            return y

        x = x0.clone().requires_grad_()
        checkpoint(body, x, use_reentrant=True).sum().backward()
        return x.grad

    x64 = x0.double().requires_grad_()
    F.scaled_dot_product_attention(x64, x64, x64, is_causal=True).sum().backward()
    x32 = x0.clone().requires_grad_()
    F.scaled_dot_product_attention(x32, x32, x32, is_causal=True).sum().backward()
    for grad in run_ranks(2, rank):
        check_close("dx", grad, x64.grad, x32.grad)


def test_a_compiled_function_in_the_block_is_routed_and_stays_compiled():
    # Dynamo traced into the route (an internal AssertionError); now the routed SDPA is a
    # graph break, run eagerly, and the rest of the function is still compiled.
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q.sin(), k, v, is_causal=True).cos()

    compiled = torch.compile(attend, backend=backend)
    torch.manual_seed(5)
    bhtd = [torch.randn(2, HEADS, T, 16) for _ in range(3)]
    dout = torch.randn(2, HEADS, T, 16)

    def rank(comm):
        bufs = [x.clone().requires_grad_() for x in bhtd]
        with context_parallel(comm, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            out = compiled(*bufs)
            out.backward(cl.shard(dout, comm, seq_dim=2))
            out = cl.unshard(out.detach(), comm, seq_dim=2)
        return [out] + [b.grad for b in bufs]

    def reference(dtype):
        xs = [x.to(dtype, copy=True).requires_grad_() for x in bhtd]
        out = attend(*xs)
        out.backward(dout.to(dtype))
        return [out.detach()] + [x.grad for x in xs]

    ref, naive = reference(torch.float64), reference(torch.float32)
    for name, o, r, n in zip(["out", "dq", "dk", "dv"], run_ranks(2, rank)[0], ref, naive):
        check_close(name, o, r, n)
    assert graphs, "nothing of the function was compiled"

    def attend_whole(q):
        return F.scaled_dot_product_attention(q, q, q).cos()

    def rank_fullgraph(comm):
        buf = bhtd[0].clone()
        with context_parallel(comm, buffers=[buf], buffer_seq_dims=[2]):
            with pytest.raises(Exception, match="context_parallel runs "
                                                "scaled_dot_product_attention eagerly"):
                torch.compile(attend_whole, backend=backend, fullgraph=True)(buf)
        return True

    assert all(run_ranks(2, rank_fullgraph))


def test_torch_ops_aten_sdpa_is_routed_and_fused_kernels_are_refused():
    torch.manual_seed(6)
    bhtd = [torch.randn(1, HEADS, T, 16) for _ in range(3)]

    def rank(comm):
        bufs = [x.clone() for x in bhtd]
        with context_parallel(comm, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            out = torch.ops.aten.scaled_dot_product_attention.default(*bufs, is_causal=True)
            out = cl.unshard(out, comm, seq_dim=2)
            with pytest.raises(RuntimeError, match="aten::_scaled_dot_product_flash_attention_"
                                                   "for_cpu: inside ctxpar's context_parallel"):
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*bufs)
            with pytest.raises(RuntimeError, match="_native_multi_head_attention: inside"):
                w = torch.zeros(3 * E, E)
                torch._native_multi_head_attention(*[x.reshape(1, -1, E) for x in bufs], E,
                                                   HEADS, w, w[:, 0], w[:E], w[:E, 0])
        return out

    x64 = [x.double() for x in bhtd]
    ref = F.scaled_dot_product_attention(*x64, is_causal=True)
    naive = F.scaled_dot_product_attention(*bhtd, is_causal=True)
    for out in run_ranks(2, rank):
        check_close("out", out, ref, naive)


def test_flex_attention_in_the_block_is_refused_not_run_on_the_shard():
    # torch.nn.attention.flex_attention reached the mode as a function of its own and ran
    # torch's kernel on this rank's shard: attention within the shard only, no error.
    from torch.nn.attention.flex_attention import flex_attention
    torch.manual_seed(7)
    bhtd = [torch.randn(1, HEADS, T, 16) for _ in range(3)]

    def rank(comm):
        bufs = [x.clone() for x in bhtd]
        with context_parallel(comm, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            with pytest.raises(RuntimeError, match="flex_attention inside ctxpar's "
                                                   "context_parallel would attend to this rank"):
                flex_attention(*bufs)
        return True

    assert all(run_ranks(2, rank))


MHA_REFUSALS = [
    ("need_weights=True", {}, lambda m, x: m(x, x, x)),  # nn.MultiheadAttention's default
    ("key_padding_mask", {},
     lambda m, x: m(x, x, x, need_weights=False,
                    key_padding_mask=torch.zeros(x.shape[:2], dtype=torch.bool))),
    ("attn_mask: not supported by nn.MultiheadAttention", {},
     lambda m, x: m(x, x, x, need_weights=False, attn_mask=causal(x.shape[1]))),
    ("bias_k", {"add_bias_kv": True}, lambda m, x: m(x, x, x, need_weights=False)),
    ("add_zero_attn=True", {"add_zero_attn": True}, lambda m, x: m(x, x, x, need_weights=False)),
    ("static_k", {},  # the functional form's keys given outright: [B * H, S, D]
     lambda m, x: F.multi_head_attention_forward(
         *[x.transpose(0, 1)] * 3, E, HEADS, m.in_proj_weight, m.in_proj_bias, None, None,
         False, 0.0, m.out_proj.weight, m.out_proj.bias, need_weights=False,
         static_k=torch.zeros(2 * HEADS, x.shape[1], E // HEADS))),
]


@pytest.mark.parametrize("what, options, call", MHA_REFUSALS,
                         ids=["need_weights", "key_padding_mask", "attn_mask", "add_bias_kv",
                              "add_zero_attn", "static_k"])
def test_multihead_attention_options_that_cp_cannot_compute_are_refused(what, options, call):
    # need_weights=True computes the weights on the shard without SDPA: it ran, local only.
    m = nn.MultiheadAttention(E, HEADS, batch_first=True, **options)

    def rank(comm):
        x = sequences()[0]
        with pytest.raises(ValueError, match=what.replace("(", r"\(")) as info:
            with context_parallel(comm, buffers=[x], buffer_seq_dims=[1]):
                call(m, x)
        assert x.shape == (2, T, E)  # restored
        return str(info.value)

    assert "nn.MultiheadAttention inside ctxpar's context_parallel" in run_ranks(2, rank)[0]


def test_multihead_attention_on_a_torch_without_redispatch_is_refused(monkeypatch):
    monkeypatch.setattr(cpt, "_REDISPATCH", None)
    m = model("mha")

    def rank(comm):
        x = sequences()[0]
        with pytest.raises(RuntimeError, match="cannot route the attention inside it"):
            with context_parallel(comm, buffers=[x], buffer_seq_dims=[1]):
                m(x, x, x, need_weights=False)
        return True

    assert all(run_ranks(2, rank))


@pytest.mark.parametrize("dim, held", [(3, "head dim D"), (1, "heads H"), (-1, "head dim D")],
                         ids=["D", "heads", "D_from_the_end"])
def test_buffer_seq_dims_naming_head_dim_or_heads_is_refused(dim, held):
    # [B, H, T, D] with T = 32, D = 16, H = 16: any of them could be cut; SDPA reads T.
    x0 = torch.randn(1, 16, T, 16)

    def rank(comm):
        q = x0.clone()
        with pytest.raises(ValueError) as info:
            with context_parallel(comm, buffers=[q], buffer_seq_dims=[dim]):
                F.scaled_dot_product_attention(q, q, q)
        assert torch.equal(q, x0)
        return str(info.value)

    for message in run_ranks(2, rank):
        assert message.startswith(f"buffer_seq_dims[0] = {dim % 4}: buffers[0] (shape "
                                  f"(1, 16, 32, 16) before the block) was cut along dim "
                                  f"{dim % 4}, which scaled_dot_product_attention's query "
                                  f"holds as its {held}")
        assert message.endswith("pass buffer_seq_dims[0] = 2, the dim of its tokens")


def test_a_transposed_view_of_a_buffer_cut_along_its_tokens_is_routed():
    # [B, T, H, D] buffers cut along T (dim 1), given to SDPA as [B, H, T, D] views.
    torch.manual_seed(7)
    bthd = [torch.randn(1, T, HEADS, 16) for _ in range(3)]

    def rank(comm):
        bufs = [x.clone() for x in bthd]
        with context_parallel(comm, buffers=bufs, buffer_seq_dims=[1, 1, 1]):
            out = F.scaled_dot_product_attention(*[b.transpose(1, 2) for b in bufs])
            return cl.unshard(out, comm, seq_dim=2)

    x64 = [x.double().transpose(1, 2) for x in bthd]
    ref = F.scaled_dot_product_attention(*x64)
    naive = F.scaled_dot_product_attention(*[x.transpose(1, 2) for x in bthd])
    check_close("out", run_ranks(2, rank)[0], ref, naive)


def test_nested_blocks_on_one_buffer_and_repeated_buffers_are_refused():
    # The inner block sharded the outer block's shard (off by 3.0).
    x0 = torch.randn(1, HEADS, T, 16)

    def rank(comm):
        x, other = x0.clone(), x0[:, :, :T // 2].clone()  # other: as long as x's shard
        with context_parallel(comm, buffers=[x], buffer_seq_dims=[2]):
            shard = x.clone()
            with pytest.raises(ValueError, match=r"buffers\[1\]: already sharded by a "
                                                 "context_parallel block that has not ended"):
                with context_parallel(comm, buffers=[other, x], buffer_seq_dims=[2, 2]):
                    pass
            assert torch.equal(x, shard) and torch.equal(other, x0[:, :, :T // 2])  # unchanged
        with pytest.raises(ValueError, match=r"buffers\[1\]: the same tensor as buffers\[0\]"):
            with context_parallel(comm, buffers=[x, x], buffer_seq_dims=[2, 2]):
                pass
        assert torch.equal(x, x0)
        return True

    assert all(run_ranks(2, rank))


def test_ranks_as_threads_sharing_one_buffer_are_refused():
    shared = torch.randn(1, HEADS, T, 16)
    inside = threading.Barrier(2)

    def rank(comm):
        if comm.rank == 0:
            with context_parallel(comm, buffers=[shared], buffer_seq_dims=[2]):
                inside.wait(30)  # rank 1 tries while rank 0 holds it
                inside.wait(30)
            return "entered"
        inside.wait(30)
        try:
            with context_parallel(comm, buffers=[shared], buffer_seq_dims=[2]):
                pass
        except ValueError as e:
            return str(e)
        finally:
            inside.wait(30)

    entered, refused = run_ranks(2, rank)
    assert entered == "entered" and "ranks that run as threads need a tensor each" in refused


def test_enable_gqa_false_with_fewer_kv_heads_is_refused_as_torch_refuses():
    torch.manual_seed(8)
    q0, k0 = torch.randn(1, 4, T, 16), torch.randn(1, 2, T, 16)
    with pytest.raises(RuntimeError):  # torch's own, outside any block
        F.scaled_dot_product_attention(q0, k0, k0)

    def rank(comm):
        q, k = q0.clone(), k0.clone()
        with context_parallel(comm, buffers=[q, k], buffer_seq_dims=[2, 2]):
            with pytest.raises(ValueError, match="enable_gqa=False but query has 4 heads and "
                                                 "key 2"):
                F.scaled_dot_product_attention(q, k, k, is_causal=True)
            out = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
            return cl.unshard(out, comm, seq_dim=2)

    ref = F.scaled_dot_product_attention(q0.double(), k0.double(), k0.double(), is_causal=True,
                                         enable_gqa=True)
    naive = F.scaled_dot_product_attention(q0, k0, k0, is_causal=True, enable_gqa=True)
    check_close("out", run_ranks(2, rank)[0], ref, naive)


def test_buffers_the_block_cannot_swap_are_refused_before_anything_changes():
    x0 = torch.randn(1, HEADS, T, 16)

    def rank(comm):
        messages = []
        leaf = x0.clone().requires_grad_()
        made = leaf * 2  # not a leaf: its graph cannot follow a data swap
        kept = x0.clone().requires_grad_()
        kept.grad = torch.ones_like(kept)  # whole-sequence grad, but the buffer stays a shard
        stranger = x0.clone()
        for bufs, keep in (([made], None), ([kept], [kept]), ([leaf], [stranger])):
            with pytest.raises(ValueError) as info:
                with context_parallel(comm, buffers=bufs, buffer_seq_dims=[2] * len(bufs),
                                      no_restore_buffers=keep):
                    pass
            messages.append(str(info.value))
        assert made.shape == kept.shape == leaf.shape == (1, HEADS, T, 16)
        assert kept.grad.shape == kept.shape and leaf.grad is None
        return messages

    for made, kept, stranger in run_ranks(2, rank):
        assert made.startswith("buffers[0]: not a leaf tensor (made by MulBackward0)")
        assert kept.startswith("no_restore_buffers[0]: buffers[0] has a .grad of shape "
                               "(1, 4, 32, 16) from before the block")
        assert stranger.startswith("no_restore_buffers[0]: not one of buffers")


def test_sdpa_on_tensors_that_are_not_4d_names_the_argument():
    def rank(comm):
        x = torch.randn(2, T, 16)
        with pytest.raises(ValueError, match=r"query: scaled_dot_product_attention inside "
                                             r"ctxpar's context_parallel takes 4-D \[B, H, T, D\] "
                                             r"tensors, got shape \(2, 16, 16\)"):
            with context_parallel(comm, buffers=[x], buffer_seq_dims=[1]):
                F.scaled_dot_product_attention(x, x, x)
        return True

    assert all(run_ranks(2, rank))
