"""ctxpar.hf: random-init Llama and Qwen2 (transformers, no downloads) trained for a few steps
with attn_implementation="ctxpar" on 2 and 4 ranks (threads), losses and gradients against the
same model on the whole sequence in one process: the fp64 reference ("eager", packed documents
found by transformers from the per-document position_ids) under the project's tolerance rule,
with fp32 "eager" as the naive run. Plus the refusals (padding masks, forgotten position_ids,
no CP context)."""
import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import ctxpar  # noqa: E402
from ctxpar import hf  # noqa: E402
from ctxpar.torch import context_parallel  # noqa: E402
from conftest import check_close  # noqa: E402

B, T, VOCAB, STEPS, LR = 2, 32, 128, 3, 0.5
hf.register()


def config(family):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  attention_dropout=0.0)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen2Config(**common)


def models(family, seed=0):
    """The random-init model (fp32), built once on the main thread (the seed is global)."""
    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen2ForCausalLM
    return cls(config(family))


def with_attention(model, impl, dtype, checkpointing=None):
    m = copy.deepcopy(model).to(dtype)
    m.set_attn_implementation(impl)
    if checkpointing is not None:
        m.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": checkpointing})
    m.train()
    return m


def batches(documents):
    """STEPS batches: input_ids [B, T]; document_ids [T] when packed (3 documents)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        b = {"input_ids": torch.randint(VOCAB, (B, T), generator=gen)}
        if documents:
            b["document_ids"] = torch.tensor([0] * 5 + [1] * 17 + [2] * 10)
        out.append(b)
    return out


def flat_grads(model):
    return torch.cat([p.grad.detach().double().reshape(-1) for p in model.parameters()])


def whole_inputs(b):
    """The whole sequence's model inputs for batch b, built here independently of ctxpar.hf:
    per-document position_ids, shift_labels (each document's last token -100) and
    num_items_in_batch."""
    ids = b["input_ids"]
    shift = torch.full_like(ids, -100)
    shift[:, :-1] = ids[:, 1:]
    pos = torch.arange(T)
    if "document_ids" in b:
        d = b["document_ids"]
        last = torch.cat([d[1:] != d[:-1], torch.tensor([True])])
        shift[:, last] = -100
        starts = [i for i in range(T) if i == 0 or d[i] != d[i - 1]]
        pos = torch.cat([torch.arange(e - s) for s, e in zip(starts, starts[1:] + [T])])
    return dict(input_ids=ids.clone(), position_ids=pos[None].expand(B, T).clone(),
                labels=shift, shift_labels=shift, num_items_in_batch=int((shift != -100).sum()))


def train_whole(model, data):
    """One process, whole sequence: the loss transformers computes from shift_labels and
    num_items_in_batch, per step (loss, gradients)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trace = []
    for b in data:
        out = model(**whole_inputs(b), use_cache=False)
        opt.zero_grad()
        out.loss.backward()
        trace.append((out.loss.detach().double(), flat_grads(model)))
        opt.step()
    return trace


def loss_of_shard_batch(model, b, comm, layout):
    """attn_implementation="ctxpar": this rank's loss, backward done."""
    loss = model(**hf.shard_batch(b, comm, layout=layout), use_cache=False).loss
    loss.backward()
    return loss


def loss_in_block(model, b, comm, layout, ones_mask=True):
    """transformers' own "sdpa" inside ctxpar.torch.context_parallel: the block shards the
    whole inputs in place. ones_mask: pass an all-ones attention_mask (transformers then builds
    no mask); without it transformers reads the shard's position ids as packed sequences and
    builds a 4-D mask the block reads back (the documents of b passed to the block)."""
    x = whole_inputs(b)
    x["labels"] = x["shift_labels"] = x["shift_labels"].clone()
    if ones_mask:
        x["attention_mask"] = torch.ones_like(x["input_ids"])
    names = [n for n in ("input_ids", "position_ids", "labels", "attention_mask") if n in x]
    with context_parallel(comm, buffers=[x[n] for n in names], buffer_seq_dims=[1] * len(names),
                          layout=layout, document_ids=b.get("document_ids")):
        loss = model(**x, use_cache=False).loss
        loss.backward()
    return loss


def loss_in_block_without_mask(model, b, comm, layout):
    return loss_in_block(model, b, comm, layout, ones_mask=False)


def train_cp(model, data, ranks, layout="zigzag", step=loss_of_shard_batch):
    """The same steps on `ranks` threads (step: this rank's loss and backward): rank 0's trace
    (every rank holds the same after the reductions)."""
    replicas = [copy.deepcopy(model) for _ in range(ranks)]
    traces = [None] * ranks

    def rank(comm):
        m = replicas[comm.rank]
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        trace = []
        for b in data:
            opt.zero_grad()
            loss = step(m, b, comm, layout)
            hf.all_reduce_gradients(m, comm)
            total = torch.tensor([loss.item()], dtype=torch.float64)
            comm.allreduce(total.numpy())
            trace.append((total[0], flat_grads(m)))
            opt.step()
        traces[comm.rank] = trace

    ctxpar.run_threads(ranks, rank)
    return traces[0]


def check_training(family, ranks, documents=False, checkpointing=None, layout="zigzag",
                   dtype=torch.float32, steps=STEPS, block=False, step=None):
    """ctxpar in `dtype` against fp64 "eager", with "eager" in `dtype` as the naive run.
    block: transformers' "sdpa" inside context_parallel instead of attn_implementation="ctxpar"."""
    base = models(family)
    data = batches(documents)[:steps]
    ref = train_whole(with_attention(base, "eager", torch.float64), data)
    naive = train_whole(with_attention(base, "eager", dtype), data)
    ours = train_cp(with_attention(base, "sdpa" if block else "ctxpar", dtype, checkpointing),
                    data, ranks, layout,
                    step or (loss_in_block if block else loss_of_shard_batch))
    for step, ((lo, go), (lr, gr), (ln, gn)) in enumerate(zip(ours, ref, naive)):
        check_close(f"{dtype} loss step {step}", lo, lr, ln)
        check_close(f"{dtype} gradients step {step}", go, gr, gn)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_training_matches_one_process(family, ranks):
    check_training(family, ranks)


@pytest.mark.parametrize("ranks, layout", [(2, "zigzag"), (4, "striped")])
def test_packed_documents(ranks, layout):
    check_training("llama", ranks, documents=True, layout=layout)


@pytest.mark.parametrize("ranks, block, step", [
    (2, False, None), (4, False, None), (2, True, None), (2, True, loss_in_block_without_mask)])
def test_packed_documents_in_the_balanced_layout(ranks, block, step):
    """layout="balanced" (its permutation of the packed documents is no fixed layout's:
    checked) through ctxpar.hf.shard_batch, and through transformers' sdpa inside
    context_parallel (with the 4-D mask transformers builds from the shard's position ids, read
    back at the balanced positions): loss and gradients equal to one process with the
    per-document mask, under the rule."""
    docs = batches(True)[0]["document_ids"]
    perm = ctxpar.layout.permutation(T, ranks, "balanced", mask="causal", document_ids=docs)[0]
    for fixed in ("contiguous", "zigzag", "striped"):
        assert not (perm == ctxpar.layout.permutation(T, ranks, fixed)[0]).all(), fixed
    check_training("llama", ranks, documents=True, layout="balanced", block=block, step=step,
                   steps=2)


def test_balanced_layout_refusals():
    """shard_batch / context with layout="balanced": refused without documents (saying what to
    pass), on ranks given different documents (naming document_ids: each would shard by its
    own layout), and for attention that is not causal (the layout balances causal work)."""
    ids = torch.randint(VOCAB, (1, T))
    docs = batches(True)[0]["document_ids"]
    errors = {}

    def rank(comm):
        with pytest.raises(ValueError, match="balances causal attention within packed") as none:
            hf.shard_batch({"input_ids": ids}, comm, layout="balanced")
        with pytest.raises(ValueError, match="balances causal attention within packed"):
            with hf.context(comm, layout="balanced"):
                pass
        mine = docs if comm.rank == 0 else torch.tensor([0] * 16 + [1] * 16)
        with pytest.raises(ValueError) as differ:
            hf.shard_batch({"input_ids": ids, "document_ids": mine}, comm, layout="balanced")
        local = hf.shard_batch({"input_ids": ids, "cu_seqlens": [0, 5, 22, 32]}, comm,
                               layout="balanced")
        module = torch.nn.Module()
        module.is_causal = False
        q = torch.zeros(1, 2, T // comm.size, 8)
        with pytest.raises(ValueError, match="is_causal=False"):
            hf.attention_forward(module, q, q, q, None, position_ids=local["position_ids"])
        errors[comm.rank] = (str(none.value), str(differ.value))

    ctxpar.run_threads(2, rank, timeout_s=60)
    assert errors[0][1] == errors[1][1]
    assert errors[0][1].startswith("ctxpar.hf.shard_batch: the ranks were called with different "
                                   "arguments: document_ids is"), errors[0][1]
    assert "document_ids" in errors[0][0] and "cu_seqlens" in errors[0][0], errors[0][0]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing(use_reentrant):
    check_training("qwen2", 2, documents=True, checkpointing=use_reentrant)


def test_shard_batch_shifts_before_sharding():
    """Token t is scored on label t + 1 of its own document (a -100 label, e.g. a prompt
    token, stays unscored); num_items counts every rank's."""
    ids = torch.arange(16)[None, :] + 100
    labels = ids.clone()
    labels[0, 9] = -100
    docs = torch.tensor([0] * 6 + [1] * 10)
    seen = {}

    def rank(comm):
        seen[comm.rank] = hf.shard_batch({"input_ids": ids, "labels": labels,
                                          "cu_seqlens": [0, 6, 16]}, comm)

    ctxpar.run_threads(2, rank)
    for r, local in seen.items():
        index = local["input_ids"][0] - 100
        expect = torch.where((index == 15) | (index == 5) | (index == 8), -100, index + 101)
        assert torch.equal(local["shift_labels"][0], expect)
        assert torch.equal(local["position_ids"][0], index - 6 * (docs[index] == 1))
        assert local["num_items_in_batch"] == 13


def test_padding_mask_refused():
    model = with_attention(models("llama"), "ctxpar", torch.float32)
    ids = torch.randint(VOCAB, (1, 8))
    pad = torch.ones(1, 8, dtype=torch.long)
    pad[0, 6:] = 0
    errors = {}

    def rank(comm):
        with pytest.raises(ValueError, match="attention_mask") as e:
            hf.shard_batch({"input_ids": ids, "attention_mask": pad}, comm)
        local = hf.shard_batch({"input_ids": ids}, comm)
        with pytest.raises(ValueError, match="attention_mask"):
            model(**local, attention_mask=pad[:, 4:], use_cache=False)
        model(**local, attention_mask=torch.ones(1, 4), use_cache=False)  # restates: fine
        errors[comm.rank] = str(e.value)

    ctxpar.run_threads(2, rank)
    assert "document_ids" in errors[0]


def test_forgotten_position_ids_refused():
    """Without the shard's position_ids transformers rotates by 0..Tl-1: refused, named."""
    model = with_attention(models("llama"), "ctxpar", torch.float32)
    ids = torch.randint(VOCAB, (1, 8))

    def rank(comm):
        local = hf.shard_batch({"input_ids": ids}, comm)
        del local["position_ids"]
        with pytest.raises(ValueError, match="position_ids"):
            model(**local, use_cache=False)

    ctxpar.run_threads(2, rank)


def test_no_context_refused():
    model = with_attention(models("llama"), "ctxpar", torch.float32)
    hf.clear_context()
    with pytest.raises(RuntimeError, match="shard_batch"):
        model(input_ids=torch.randint(VOCAB, (1, 8)))


def two_documents():
    """A ctxpar model, input_ids [1, 16] of two documents (6 and 10 tokens), their ids, and a
    dict for the ranks' results."""
    model = with_attention(models("llama"), "ctxpar", torch.float32)
    return model, torch.randint(VOCAB, (1, 16)), torch.tensor([0] * 6 + [1] * 10), {}


def test_four_d_mask_restating_causal_ignored_else_refused():
    """A 4-D mask of the shard that says only causal-within-documents (bool, or additive 0 /
    -inf) changes nothing; one that hides one more token is refused, named."""
    model, ids, docs, outs = two_documents()

    def rank(comm):
        local = hf.shard_batch({"input_ids": ids, "document_ids": docs}, comm)
        pos = torch.as_tensor(ctxpar.layout.positions(16, comm.size, comm.rank))
        restated = (pos[None, :] <= pos[:, None]) & (docs[pos][:, None] == docs[pos][None, :])
        plain = model(**local, use_cache=False).logits
        with_bool = model(**local, attention_mask=restated[None, None], use_cache=False).logits
        additive = torch.zeros(restated.shape).masked_fill(~restated, float("-inf"))
        with_add = model(**local, attention_mask=additive[None, None], use_cache=False).logits
        hidden = restated.clone()
        hidden[-1, -1] = False  # every token sees itself
        with pytest.raises(ValueError, match="attention_mask"):
            model(**local, attention_mask=hidden[None, None], use_cache=False)
        outs[comm.rank] = (plain, with_bool, with_add)

    ctxpar.run_threads(2, rank)
    for plain, with_bool, with_add in outs.values():
        assert torch.equal(plain, with_bool) and torch.equal(plain, with_add)


def test_all_reduce_gradients_sums_and_counts_missing_as_zeros():
    """Sums over the ranks, equal to the sum taken here; a parameter one rank never used (no
    .grad there) takes part as zeros, so the ranks reduce the same list."""
    grads = [torch.randn(3, 2, dtype=torch.float64) for _ in range(3)]
    results = {}

    def rank(comm):
        a = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
        b = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
        a.grad = grads[comm.rank].clone()
        if comm.rank != 1:  # rank 1's tokens did not reach b
            b.grad = grads[comm.rank].clone() * 2
        hf.all_reduce_gradients([a, b], comm)
        results[comm.rank] = (a.grad, b.grad)

    ctxpar.run_threads(3, rank, timeout_s=10)
    for a, b in results.values():
        assert torch.equal(a, grads[0] + grads[1] + grads[2])
        assert torch.equal(b, grads[0] * 2 + grads[2] * 2)


@pytest.mark.parametrize("batch, needle", [
    ({"input_ids": torch.zeros(1, 10, dtype=torch.long)}, "T % 4 == 0"),
    ({"input_ids": torch.zeros(16, dtype=torch.long)}, "input_ids: expected"),
    ({"input_ids": torch.zeros(1, 16, dtype=torch.long), "mask": 1}, "unknown keys"),
    ({"input_ids": torch.zeros(1, 16, dtype=torch.long), "labels": torch.zeros(1, 8)},
     "labels: expected"),
    ({"input_ids": torch.zeros(2, 16, dtype=torch.long),
      "document_ids": torch.tensor([[0] * 16, [0] * 8 + [1] * 8])}, "document_ids: rows"),
    ({"input_ids": torch.zeros(1, 16, dtype=torch.long),
      "document_ids": torch.tensor([1] * 8 + [0] * 8)}, "non-decreasing"),
    ({"input_ids": torch.zeros(1, 16, dtype=torch.long), "cu_seqlens": [0, 9, 9, 16]},
     "cu_seqlens"),
    ({"input_ids": torch.zeros(1, 16, dtype=torch.long), "cu_seqlens": [0, 16],
      "document_ids": torch.zeros(16)}, "not both"),
    ({"input_ids": torch.zeros(1, 16, dtype=torch.long), "position_ids": torch.arange(8)},
     "position_ids: expected"),
])
def test_shard_batch_refuses_naming_the_argument(batch, needle):
    def rank(comm):
        with pytest.raises((ValueError, TypeError), match=needle):
            hf.shard_batch(batch, comm)

    ctxpar.run_threads(2, rank)


@pytest.mark.parametrize("layout, first", [("zigzag", 6), ("balanced", 10)])
def test_context_block_equals_shard_batch(layout, first):
    """`with hf.context(comm, document_ids=...)` on shards made by hand gives shard_batch's
    logits, and the previous context is back after the block. Balanced: documents of 10 and 6
    tokens, whose balanced layout is no fixed layout's (checked)."""
    model, ids, _, outs = two_documents()
    docs = torch.tensor([0] * first + [1] * (16 - first))
    bal = dict(mask="causal", document_ids=docs)  # what the balanced layout balances
    if layout == "balanced":
        perm = ctxpar.layout.permutation(16, 2, layout, **bal)[0]
        assert all(not (perm == ctxpar.layout.permutation(16, 2, f)[0]).all()
                   for f in ("contiguous", "zigzag", "striped"))

    def rank(comm):
        local = hf.shard_batch({"input_ids": ids, "document_ids": docs}, comm, layout=layout)
        before = model(**local, use_cache=False).logits
        hf.clear_context()
        shard = ctxpar.layout.shard(ids, comm, layout, **bal)
        pos = ctxpar.layout.shard(torch.tensor(list(range(first)) + list(range(16 - first)))[None],
                                  comm, layout, **bal)
        with hf.context(comm, layout=layout, document_ids=docs, position_ids=pos):
            inside = model(input_ids=shard, position_ids=pos, use_cache=False).logits
        with pytest.raises(RuntimeError, match="shard_batch"):
            model(input_ids=shard, position_ids=pos, use_cache=False)
        outs[comm.rank] = (before, inside)

    ctxpar.run_threads(2, rank)
    for before, inside in outs.values():
        assert torch.equal(before, inside)


def test_bfloat16_model():
    """A bfloat16 model: loss and gradients within the rule's bound of one-process bfloat16
    "eager" (the naive run in the same precision)."""
    check_training("llama", 2, documents=True, dtype=torch.bfloat16, steps=2)


@pytest.mark.parametrize("use_reentrant", [None, True, False])
def test_sdpa_inside_context_parallel_block(use_reentrant):
    """transformers' own "sdpa" inside ctxpar.torch.context_parallel (no ctxpar.hf attention)
    trains equal to one process, with and without gradient checkpointing, given an all-ones
    attention_mask."""
    check_training("llama", 2, checkpointing=use_reentrant, block=True)


@pytest.mark.parametrize("documents, use_reentrant", [(False, None), (True, False)])
def test_sdpa_in_block_accepts_the_mask_transformers_builds(documents, use_reentrant):
    """No attention_mask and no cache (use_cache=False; gradient checkpointing): transformers
    reads the shard's position ids as packed sequences and builds a 4-D mask (kv heads
    repeated) on the ranks whose positions jump, none on the others. The block reads it back as
    causal attention (within the documents passed to it) and trains equal to one process.
    Before, the block refused every attn_mask."""
    check_training("llama", 2, documents=documents, checkpointing=use_reentrant, steps=1,
                   block=True, step=loss_in_block_without_mask)


def test_sdpa_block_refuses_a_mask_that_adds_documents_it_does_not_know():
    """Per-document position ids but no document_ids for the block: transformers' mask hides
    the documents' earlier tokens, which the block's causal attention shows; refused on each
    rank, naming a pair it hides and document_ids."""
    model = with_attention(models("llama"), "sdpa", torch.float32)
    x = whole_inputs(batches(True)[0])
    errors = {}

    def rank(comm):
        ids, pos = x["input_ids"].clone(), x["position_ids"].clone()
        with context_parallel(comm, buffers=[ids, pos], buffer_seq_dims=[1, 1]):
            with pytest.raises(ValueError, match="attn_mask: the mask hides key") as e:
                model(input_ids=ids, position_ids=pos, use_cache=False)
        errors[comm.rank] = str(e.value)

    ctxpar.run_threads(2, rank)
    assert all("document_ids" in e for e in errors.values())


def test_sdpa_block_names_the_pair_a_mask_adds():
    """A mask built here by transformers' rule from the zigzag shard's positions, read back
    as causal (the output equals is_causal=True's); one pair more hidden (or shown) is refused,
    naming its global positions."""
    Tl, P = 8, 2
    q, k, v = (torch.randn(1, 2, Tl * P, 16) for _ in range(3))
    seen = {}

    def rank(comm):
        pos = torch.as_tensor(ctxpar.layout.positions(Tl * P, P, comm.rank))
        jump = torch.cat([torch.tensor([True]), pos[1:] != pos[:-1] + 1]).cumsum(0)
        mask = (pos[None, :] <= pos[:, None]) & (jump[None, :] == jump[:, None])
        qs, ks, vs = (t.clone() for t in (q, k, v))  # the block shards them
        with context_parallel(comm, buffers=[qs, ks, vs], buffer_seq_dims=[2, 2, 2]):
            causal = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            masked = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[None, None])
            more = mask.clone()
            more[Tl - 1, Tl - 2] = False  # the last query no longer sees its predecessor
            with pytest.raises(ValueError) as e:
                F.scaled_dot_product_attention(qs, ks, vs, attn_mask=more[None, None])
        seen[comm.rank] = (torch.equal(causal, masked), str(e.value), pos)

    ctxpar.run_threads(2, rank)
    for same, message, pos in seen.values():
        assert same
        assert (f"hides key {int(pos[Tl - 2])} from query {int(pos[Tl - 1])} (global positions) "
                "that causal attention shows") in message, message
