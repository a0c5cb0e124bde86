"""torch.compile around ctxpar's attention: a small attention model compiled whole (fullgraph,
one graph) under the eager, aot_eager and inductor backends, forward and backward on 2 ranks,
against the fp64 model on the whole sequence (the project's rule, fp32 naive attention the
naive run); the ops' registration (torch.library.opcheck); and the one named graph break left
(document_ids, arrays a graph would keep as constants)."""
import copy

import pytest
import torch
import torch._inductor.config
from torch._dynamo.testing import CompileCounterWithBackend

import ctxpar
from ctxpar import layout as cl
from ctxpar.torch import cp_attention
from conftest import check_close

B, T, H, D = 1, 16, 2, 16
C = H * D


class TinyAttention(torch.nn.Module):
    """qkv projection, causal attention (`attend`), output projection."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(C, 3 * C)
        self.out = torch.nn.Linear(C, C)

    def forward(self, x, attend):
        q, k, v = self.qkv(x).unflatten(-1, (3, H, D)).unbind(2)
        return self.out(attend(q, k, v).flatten(-2)).tanh()


def plain_causal(q, k, v):
    """Attention on the whole sequence, written out ([B, T, H, D]), the reference's."""
    s = torch.einsum("bihd,bjhd->bhij", q, k) * D ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)


def inputs():
    torch.manual_seed(5)
    model = TinyAttention()
    return model, torch.randn(B, T, C), torch.randn(B, T, C)


def whole(model, x, g, dtype):
    """The whole sequence in one process, plain attention in `dtype`: (y, grads)."""
    m = copy.deepcopy(model).to(dtype)
    x = x.to(dtype).requires_grad_()
    y = m(x, plain_causal)
    (y * g.to(dtype)).sum().backward()
    return [y.detach()] + [p.grad for p in m.parameters()] + [x.grad]


def on_ranks(model, x, g, backend, ranks=2, compiled=None):
    """Each rank runs the model on its shard, compiled with `backend` (None: eagerly) on the
    ranks in `compiled` (default all): the whole y, the parameter gradients summed over ranks,
    x's gradient, and the graphs each rank compiled."""
    per_rank = [None] * ranks

    def rank(comm):
        m = copy.deepcopy(model)
        xs, gs = (cl.shard(t, comm, seq_dim=1) for t in (x, g))
        xs = xs.detach().requires_grad_()

        def step(x):
            return m(x, lambda q, k, v: cp_attention(q, k, v, comm, causal=True))

        use = backend is not None and (compiled is None or comm.rank in compiled)
        counter = CompileCounterWithBackend(backend) if use else None
        fn = torch.compile(step, backend=counter, fullgraph=True) if use else step
        y = fn(xs)
        (y * gs).sum().backward()
        per_rank[comm.rank] = ([y.detach()] + [p.grad for p in m.parameters()] + [xs.grad],
                               counter.frame_count if counter else 0)

    ctxpar.run_threads(ranks, rank, 300)
    y = cl.unshard_all([r[0][0] for r in per_rank], seq_dim=1)
    params = [sum(r[0][i] for r in per_rank) for i in range(1, 5)]
    dx = cl.unshard_all([r[0][5] for r in per_rank], seq_dim=1)
    return [y] + params + [dx], [r[1] for r in per_rank]


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_model_is_one_graph_and_matches_fp64(backend):
    # Before the ops, cp_attention was torch.compiler.disable'd: fullgraph=True raised at it
    # (and without fullgraph the function was two graphs around an eager attention).
    model, x, g = inputs()
    ref, naive = whole(model, x, g, torch.float64), whole(model, x, g, torch.float32)
    # Inductor compiles on rank 0 only (its C++ kernels take seconds; rank 1's eager attention
    # is the same collective op, so the two meet as they must).
    # One compile thread: a pool of worker processes (each importing torch) doubled the first
    # compile's 25 s on the 2-core CI machine.
    only = [0] if backend == "inductor" else None
    with torch._inductor.config.patch(compile_threads=1):
        compiled, graphs = on_ranks(model, x, g, backend, compiled=only)
    eager, _ = on_ranks(model, x, g, None)
    assert graphs == ([1, 0] if only else [1, 1])
    names = ["y", "dqkv.weight", "dqkv.bias", "dout.weight", "dout.bias", "dx"]
    for name, c, e, r, n in zip(names, compiled, eager, ref, naive):
        check_close(f"{backend} {name}", c, r, n)
        check_close(f"eager {name}", e, r, n)


def test_ops_pass_opcheck():
    """The fake implementations, schema and autograd registration of ctxpar::cp_attention
    (torch.library.opcheck runs the op eagerly and under fake tensors and compares)."""
    from ctxpar._torch_ops import _compiled_route
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))

    def rank(comm):
        route = _compiled_route(comm, "ring", "zigzag", "causal", 0, 0, 1, None, "exact")
        torch.library.opcheck(torch.ops.ctxpar.cp_attention.default, (q, k, v, route))

    ctxpar.run_threads(1, rank)


def test_a_route_is_made_once_and_a_stale_one_is_refused():
    """The same communicator and options give the same handle (a retrace makes the same graph);
    a number that is no handle is refused, naming cp_attention."""
    from ctxpar._torch_ops import _compiled_route

    def rank(comm):
        a = _compiled_route(comm, "ring", "zigzag", "causal", 0, 0, 1, None, "exact")
        assert a == _compiled_route(comm, "ring", "zigzag", "causal", 0, 0, 1, None, "exact")
        assert a != _compiled_route(comm, "allgather", "zigzag", "causal", 0, 0, 1, None,
                                    "exact")
        q = torch.zeros(1, 4, 1, 16)
        with pytest.raises(ValueError, match="cp_attention"):
            torch.ops.ctxpar.cp_attention(q, q, q, -1)

    ctxpar.run_threads(1, rank)


def test_a_bad_option_under_compile_is_named():
    """The options are checked while Dynamo traces: a bad one stops the compile with
    cp_attention's own message (Dynamo wraps the ValueError in its RuntimeError), before any
    communication."""
    def rank(comm):
        x = torch.zeros(1, 8, 2, 16)
        for option, needle in [({"strategy": "rng"}, "strategy: expected one of"),
                               ({"layout": "zz"}, "layout: expected one of"),
                               ({"threads": 0}, "threads")]:
            fn = torch.compile(lambda x: cp_attention(x, x, x, comm, **option), backend="eager")
            with pytest.raises((ValueError, RuntimeError), match=needle):
                fn(x)

    ctxpar.run_threads(1, rank)
