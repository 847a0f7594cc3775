"""Whole programs under accel against eager: a convolutional network trained with an
optimizer, gradient clipping and a learning-rate schedule; DistributedDataParallel on one
and on two; a small Llama's training step and greedy generation; LSTM and GRU; programs
that raise in eager, which must raise the same error under accel; and programs around the
features of PyTorch that training code uses with its ops (autocast, hooks, double
backward, random numbers, attention, TorchScript, parametrizations, custom autograd
functions, checkpointing, inference mode, L-BFGS, ``torch.autograd.functional``,
``torch.func``'s transforms, distributions, pruning, a transformer's fast path, sparse
gradients, forward-mode AD, saved-tensor hooks, anomaly detection, a user's dispatch mode,
module conversion) and the blocks of torchvision's convolutional networks."""
import contextlib
import copy
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import accel
from devices import DEVICES  # tests/devices.py (pytest puts tests/ on sys.path)



class ConvNet(nn.Module):
    """Conv-BatchNorm blocks (convolutions without a bias: before a BatchNorm its gradient
    is zero in exact arithmetic, rounding noise that Adam's normalized step amplifies
    differently in any two summation orders), a pooled linear head."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.silu(self.b2(self.c2(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _train(model, ctx, device, steps=4):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 3, 16, 16, generator=g).to(device)
        y = torch.randint(0, 10, (8,), generator=g).to(device)
        with ctx():
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
        losses.append(loss.detach())
    return torch.stack(losses), list(model.parameters()), list(model.buffers())


@pytest.mark.parametrize("device", DEVICES)
def test_convnet_training_matches_eager(device):
    torch.manual_seed(0)
    base = ConvNet().to(device)
    le, pe, be = _train(copy.deepcopy(base), contextlib.nullcontext, device)
    la, pa, ba = _train(copy.deepcopy(base), accel.eager, device)
    torch.testing.assert_close(la, le)
    for a, e in zip(pa, pe):
        torch.testing.assert_close(a, e)
    for a, e in zip(ba, be):  # running statistics, and num_batches_tracked exactly
        torch.testing.assert_close(a, e, rtol=0 if e.dtype == torch.long else None,
                                   atol=0 if e.dtype == torch.long else None)


def _llama(device):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device)


def _architecture(name):
    """A transformers model of architecture ``name`` at 32 channels and 2 layers, with its
    kind of batch: ``"lm"`` (token ids, the ids as labels), ``"s2s"`` (labels of their own)."""
    t = pytest.importorskip("transformers")
    h = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             vocab_size=128, max_position_embeddings=64)
    cfg, cls, kind = {
        "bert": (t.BertConfig(**h), t.BertForMaskedLM, "lm"),
        "deberta_v2": (t.DebertaV2Config(**h), t.DebertaV2ForMaskedLM, "lm"),
        "gpt_neox": (t.GPTNeoXConfig(**h), t.GPTNeoXForCausalLM, "lm"),
        "bart": (t.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                              vocab_size=128, max_position_embeddings=64), t.BartForConditionalGeneration, "s2s"),
    }[name]
    cfg.attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg), kind


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["bert", "deberta_v2", "gpt_neox", "bart"])
def test_transformers_architectures_train_as_eager_in_float64(name, device):
    """An encoder (BERT; DeBERTa-v2's disentangled attention), a decoder with partial
    rotary embeddings (GPT-NeoX) and an encoder-decoder (BART): a training step, an SGD
    step, an eval forward, in float64, where rounding does not hide a wrong value (19
    architectures matched eager so on both devices; in float32 the comparison of deep
    models is rounding's: eager's own float32 run is as far from float64's)."""
    base, kind = _architecture(name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 12), generator=g).to(device)
    labels = torch.randint(0, 128, (2, 7), generator=g).to(device) if kind == "s2s" else ids

    def run(ctx):
        m = copy.deepcopy(base).to(device, torch.float64)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with ctx():
            torch.manual_seed(5)  # (dropout)
            out = m(input_ids=ids, labels=labels)
            out.loss.backward()
            grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
            opt.step()
            m.eval()
            with torch.no_grad():
                logits = m(input_ids=ids, **({"labels": labels} if kind == "s2s" else {})).logits
        return out.loss.detach(), out.logits.detach(), grads, logits

    torch.testing.assert_close(run(accel.eager), run(contextlib.nullcontext))


def _data_parallel(model, dev, wrap):
    """``model`` wrapped for data-parallel training on device ``dev``: DDP with a bucket a
    parameter or two, copying gradients into the buckets or viewing them there (buckets
    are all-reduced while the backward still computes the layers before them), or FSDP2's
    ``fully_shard`` on each linear layer and the whole (parameters all-gathered before
    use, gradients reduce-scattered in the backward)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if wrap == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    return DDP(model, device_ids=None if dev == "cpu" else [torch.device(dev).index or 0],
               bucket_cap_mb=0.01, gradient_as_bucket_view=wrap == "bucket-views")


def _train_data_parallel(model, ctx, dev, init, rank=0, world=1, wrap="bucket-copies", seed=2):
    """Three SGD steps of ``model`` wrapped by :func:`_data_parallel` (under ``ctx()``:
    DDP checks and broadcasts its parameters in C++ at construction), each step under
    ``ctx()``, as rank ``rank`` of a process group of ``world`` (gloo on the CPU, NCCL on
    GPUs) begun at ``init``, on data drawn from ``seed``. Returns the losses and the full
    parameters, on the CPU."""
    import torch.distributed as dist

    dist.init_process_group("gloo" if dev == "cpu" else "nccl", init_method=init, rank=rank,
                            world_size=world)
    wrapped = None
    try:
        with ctx():
            wrapped = _data_parallel(model, dev, wrap)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(3):
            x = torch.randn(16, 32, generator=g).to(dev)
            with ctx():
                loss = wrapped(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach())
        params = [getattr(p, "full_tensor", lambda p=p: p)().detach().cpu() for p in model.parameters()]
        return torch.stack(losses).cpu(), params
    finally:
        # the reducer first, while the group still holds the process group: where the
        # reducer's deallocation (the GIL held) ended the process group's life, it joined
        # a gloo thread that was freeing a finished work, which waited for the GIL (a
        # deadlock seen once in the full suite); destroy_process_group shuts it down with
        # the GIL released
        del wrapped
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize("device", DEVICES)
def test_ddp_training_matches_eager(device, tmp_path):
    """DistributedDataParallel (one rank) built and trained under accel, as eager."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4)).to(device)
    want = _train_data_parallel(copy.deepcopy(base), contextlib.nullcontext, device, f"file://{tmp_path}/e")
    got = _train_data_parallel(copy.deepcopy(base), accel.eager, device, f"file://{tmp_path}/a")
    torch.testing.assert_close(got, want)


def _two_ranks(rank, world, device, root, wrap):
    """One rank of ``test_data_parallel_training_on_two_ranks_matches_eager`` (a spawned
    process): :func:`_train_data_parallel` eagerly, then under accel, each in a process
    group of its own over the same data (this rank's shard); saves both runs' losses and
    parameters to ``root/rank{rank}.pt``."""
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64),
                         nn.SiLU(), nn.Linear(64, 4)).to(dev)
    runs = {name: _train_data_parallel(copy.deepcopy(base), ctx, dev, f"file://{root}/{name}", rank,
                                       world, wrap, seed=10 + rank)
            for name, ctx in (("eager", contextlib.nullcontext), ("accel", accel.eager))}
    torch.save(runs, f"{root}/rank{rank}.pt")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize("wrap", ["bucket-copies", "bucket-views", "fully_shard"])
@pytest.mark.parametrize("device", DEVICES)
def test_data_parallel_training_on_two_ranks_matches_eager(device, wrap, tmp_path):
    """DistributedDataParallel and FSDP2 over two processes (gloo on the CPU; NCCL, one GPU
    a rank, where there are two): collectives read and write gradients and parameters in
    the middle of the forward and backward, where a value an accel region still held
    unwritten would be communicated as garbage. Each rank's losses and parameters after
    three steps are its eager run's, and the ranks' parameters agree."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    torch.multiprocessing.spawn(_two_ranks, args=(2, device, str(tmp_path), wrap), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for runs in ranks:
        torch.testing.assert_close(runs["accel"], runs["eager"])
    torch.testing.assert_close(ranks[1]["accel"][1], ranks[0]["accel"][1])


@pytest.mark.parametrize("device", DEVICES)
def test_llama_training_step_and_generation_match_eager(device):
    model = _llama(device)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)

    def step(m):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), out.logits.detach(), [p.grad for p in m.parameters()]

    me, ma = copy.deepcopy(model), copy.deepcopy(model)
    le, ge, gre = step(me)
    for _ in range(2):  # a first step records and builds, the second replays
        ma.zero_grad(set_to_none=True)
        with accel.eager():
            la, ga, gra = step(ma)
        torch.testing.assert_close(la, le)
        torch.testing.assert_close(ga, ge)
        for a, e in zip(gra, gre):
            torch.testing.assert_close(a, e)
    model.eval()
    with torch.no_grad():
        want = model.generate(ids[:, :8], max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids[:, :8]))
        with accel.eager():
            got = model.generate(ids[:, :8], max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids[:, :8]))
    assert torch.equal(got, want)


def _saved_value_modified():
    a = torch.randn(4, requires_grad=True)
    b = a.exp()
    b.mul_(2)  # exp saved its output for the backward
    b.sum().backward()


RAISING = {
    "mean of an integer tensor": lambda: torch.arange(5).mean(),
    "in-place broadcast to a larger shape": lambda: torch.zeros(3).add_(torch.ones(2, 3)),
    "in-place write to an expanded tensor": lambda: torch.zeros(1).expand(4).add_(1),
    "mismatched shapes": lambda: torch.ones(3) + torch.ones(4),
    "float result into an integer tensor": lambda: torch.arange(4).mul_(0.5),
    "boolean subtraction": lambda: torch.tensor([True]) - torch.tensor([False]),
    "a saved value modified in place": _saved_value_modified,
    "in-place update of a leaf that requires grad": lambda: torch.randn(3, requires_grad=True).mul_(2),
    "integer division by zero": lambda: torch.tensor([1, 2]) // torch.tensor([0, 1]),
}


@pytest.mark.parametrize("name", sorted(RAISING))
def test_programs_that_raise_in_eager_raise_the_same_under_accel(name):
    fn = RAISING[name]
    with pytest.raises(Exception) as eager_error:
        fn()
    with pytest.raises(type(eager_error.value)) as accel_error:
        with accel.eager():
            fn()
    assert str(accel_error.value).splitlines()[0] == str(eager_error.value).splitlines()[0]


@pytest.mark.parametrize("device", DEVICES)
def test_recurrent_networks_match_eager(device):
    """LSTM and GRU forward and backward (CPU: ATen's cells, whose in-place gate updates
    autograd clones for the backward), three steps of SGD."""
    def train(ctx):
        torch.manual_seed(3)
        lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True).to(device)
        gru = nn.GRU(8, 16, batch_first=True).to(device)
        params = list(lstm.parameters()) + list(gru.parameters())
        opt = torch.optim.SGD(params, lr=0.1)
        x = torch.randn(4, 5, 8, device=device)
        losses = []
        for _ in range(3):
            with ctx():
                o1, (h, c) = lstm(x)
                o2, h2 = gru(x)
                loss = o1.square().mean() + o2.square().mean() + h.sum() * 0.01
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.detach())
        return torch.stack(losses), [p.detach() for p in params]

    torch.testing.assert_close(train(accel.eager), train(contextlib.nullcontext))


# -- the features of PyTorch a training program uses around its ops ---------------------
# Each program below runs twice from the same seed, eagerly and under accel.eager(), and
# must give eager's results: what accel defers has to stay in order with what autograd,
# hooks, the random number generator, autocast and the other dispatch keys do around it.


def _mlp(device, *layers):
    return nn.Sequential(nn.Linear(32, 64), *layers, nn.Linear(64, 8)).to(device)


def _batch(device, n=16, generator_seed=1):
    g = torch.Generator().manual_seed(generator_seed)
    return torch.randn(n, 32, generator=g).to(device), torch.randint(0, 8, (n,), generator=g).to(device)


def _autocast_training(ctx, device):
    """Three SGD steps under autocast (CPU: bfloat16; GPU: float16 with a GradScaler). The
    layer norm has no weight: eager's CPU layer norm backward sums a 16-bit input's weight
    gradient with bfloat16 errors (3.5e-4 here) where accel's float32 sum is the float64
    one's (the README's 16-bit limitation; tests/test_half.py checks it against float64)."""
    model = _mlp(device, nn.GELU(), nn.LayerNorm(64, elementwise_affine=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(device, enabled=device == "cuda")
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    losses = []
    for k in range(3):
        x, y = _batch(device, generator_seed=k)
        with ctx():
            with torch.autocast(device, dtype=dtype):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach() for p in model.parameters()]


def _hooks(ctx, device):
    """A tensor hook that rewrites a gradient, a module's full backward hook, a hook after
    a parameter's gradient is accumulated (scaling it in place)."""
    model = _mlp(device, nn.Tanh())
    seen = []
    model[1].register_full_backward_hook(lambda m, gin, gout: seen.append(gout[0] * 1))
    def halve(p):
        p.grad.mul_(0.5)

    model[0].weight.register_post_accumulate_grad_hook(halve)
    x, _ = _batch(device)
    x.requires_grad_()
    with ctx():
        h = model[0](x)
        h.register_hook(lambda g: g * 2 + 0.25)
        out = model[2](model[1](h))
        out.sin().sum().backward()
    return out.detach(), x.grad, [p.grad for p in model.parameters()], seen


def _gradient_penalty(ctx, device):
    """Double backward: a loss of the input gradient's norm (``create_graph=True``), as a
    WGAN-GP critic's."""
    model = _mlp(device, nn.Softplus())
    x, _ = _batch(device)
    x.requires_grad_()
    with ctx():
        out = model(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = out.mean() + 10 * (gx.norm(2, dim=1) - 1).square().mean()
        loss.backward()
    return loss.detach(), gx.detach(), [p.grad for p in model.parameters()]


def _dropout(ctx, device):
    """Dropout and other random ops between fusible calls: the same masks and numbers as
    eager's, in the same order (each draws from the generator when called)."""
    model = _mlp(device, nn.ReLU(), nn.Dropout(0.3))
    x, _ = _batch(device)
    with ctx():
        out = F.dropout(model(x) * 2 + 1, 0.1)
        out.square().sum().backward()
        y = F.dropout(x.sin() + 1, 0.5) + torch.rand_like(x) * x.exp() + torch.randn(32, device=device)
    return out.detach(), y, [p.grad for p in model.parameters()]


def _attention(ctx, device):
    """``nn.MultiheadAttention`` with a causal mask, and ``scaled_dot_product_attention``
    on a scaled, biased input, forward and backward."""
    mha = nn.MultiheadAttention(32, 4, batch_first=True).to(device)
    x, _ = _batch(device, 20)
    q = x.view(2, 10, 32).requires_grad_()
    mask = torch.triu(torch.ones(10, 10, dtype=torch.bool, device=device), 1)
    with ctx():
        out, w = mha(q, q, q, attn_mask=mask)
        h = (q * 0.5 + 1).view(2, 10, 4, 8).transpose(1, 2)
        o2 = F.scaled_dot_product_attention(h, h.tanh(), h, is_causal=True)
        (out.sum() + o2.square().sum()).backward()
    return out.detach(), w, o2.detach(), q.grad, [p.grad for p in mha.parameters()]


def _scripted_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * y + 1).sum(1) - y.exp().mean()


def _scripted_and_unusual_tensors(ctx, device):
    """A TorchScript function; complex tensors, a sparse matmul and a view of a complex
    tensor as real, between fusible calls."""
    with warnings.catch_warnings():  # deprecated from torch 2.13 on, still in use
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(_scripted_fn)
    x, _ = _batch(device)
    z = torch.complex(x, x.flip(0))
    s = x.relu().t().to_sparse()
    with ctx():
        a = scripted(x, x * 0.5)
        b = (z * z.conj() + 1).abs() * 2
        c = torch.sparse.mm(s, x * 2).sin()
        d = torch.view_as_real(z * 2).sin() + 1
    return a, b, c, d


def _parametrized(ctx, device):
    """Spectral norm (power iteration updating buffers in place under ``no_grad``), weight
    norm, an embedding with ``max_norm`` (renormalizing its rows in place), three steps."""
    torch.manual_seed(4)
    emb = nn.Embedding(20, 32, max_norm=1.0)
    sn = nn.utils.parametrizations.spectral_norm(nn.Linear(32, 64))
    wn = nn.utils.parametrizations.weight_norm(nn.Linear(64, 8))
    model = nn.Sequential(emb, sn, nn.Tanh(), wn).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    idx = torch.tensor([[1, 5, 7], [1, 2, 19]], device=device)
    outs = []
    for _ in range(3):
        with ctx():
            out = model(idx)
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
        outs.append(out.detach())
    return outs, [p.detach() for p in model.parameters()], [b for b in model.buffers()]


class _ScaleInPlace(torch.autograd.Function):
    """A custom autograd function that scales its input in place (``mark_dirty``)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        x.mul_(s)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


class _Swish(torch.autograd.Function):
    """x * sigmoid(x) with a hand-written backward from its saved input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * s * (1 + x * (1 - s))


def _custom_functions_and_accumulation(ctx, device):
    """Custom autograd functions; three backward passes through one graph
    (``retain_graph``), accumulating; a loop whose condition reads a value (``item``)."""
    model = _mlp(device, nn.Identity())
    x, _ = _batch(device)
    with ctx():
        h = _Swish.apply(model[0](x))
        out = model[2](_ScaleInPlace.apply(h * 1, 1.5))
        for k in range(3):
            (out * (k + 1)).sin().sum().backward(retain_graph=True)
        y, n = x, 0
        while y.abs().max().item() > 0.05 and n < 50:
            y = y * 0.5 + 0.01 * y.sin()
            n += 1
    return out.detach(), [p.grad for p in model.parameters()], y, n


def _checkpointed(ctx, device):
    """Activation checkpointing, reentrant (its backward runs a backward pass of its own
    inside the outer one) and not, over a block with dropout (the recomputation restores
    the generator's state, so it draws the forward's masks again)."""
    model = _mlp(device, nn.GELU(), nn.Dropout(0.2), nn.LayerNorm(64))
    x, _ = _batch(device)
    x.requires_grad_()
    with ctx():
        a = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=True)
        b = torch.utils.checkpoint.checkpoint(model, x * 2, use_reentrant=False)
        (a.square().sum() + b.sin().sum()).backward()
    return a.detach(), b.detach(), x.grad, [p.grad for p in model.parameters()]


def _inference_mode(ctx, device):
    """Regions under ``inference_mode`` (their outputs are inference tensors), and an
    inference tensor then saved for the backward outside it: eager's error."""
    model = _mlp(device, nn.SiLU())
    x, _ = _batch(device)
    with ctx():
        with torch.inference_mode():
            out = model(x).softmax(-1) * 2
            inference = out.is_inference()
        try:
            (model[0].weight * out.sum()).sum().backward()  # mul saves the inference tensor
            error = None
        except RuntimeError as e:
            error = str(e).splitlines()[0]
    return out, inference, error


def _lbfgs(ctx, device):
    """L-BFGS: a closure that runs forward and backward several times a step, the optimizer
    reading values back (``item``) between them. Two steps of four iterations: a third
    step of five amplifies rounding a hundredfold (its curvature pairs nearly degenerate:
    on the H200 eager's float32 parameters end 2.7e-5 from the float64 run's, outside
    ``assert_close``'s tolerance, accel's 3.1e-6; here both are 3.5e-7 from it)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    x, y = torch.randn(32, 8, device=device), torch.randn(32, 1, device=device)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    with ctx():
        for _ in range(2):
            opt.step(closure)
    return [p.detach() for p in model.parameters()]


def _autograd_functional(ctx, device):
    """``torch.autograd.functional``'s Hessian, Jacobian and Hessian-vector product
    (double backward, over a batch of cotangents); ``torch.func``'s vmap over stacked
    models' parameters (``functional_call``), an ensemble."""
    from torch.func import functional_call, stack_module_state, vmap

    x = torch.linspace(-1, 1, 6, device=device)

    def f(v):
        return (v.sin() * v.exp()).sum() + (v * v).prod()

    models = [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2)).to(device) for _ in range(3)]
    params, buffers = stack_module_state(models)
    batch = torch.randn(4, 8, device=device)
    with ctx():
        h = torch.autograd.functional.hessian(f, x)
        j = torch.autograd.functional.jacobian(lambda v: v.tanh() * 2, x)
        hv = torch.autograd.functional.hvp(f, x, torch.ones(6, device=device))[1]
        ensemble = vmap(lambda p, b, v: functional_call(models[0], (p, b), (v,)),
                        in_dims=(0, 0, None))(params, buffers, batch)
    return h, j, hv, ensemble


def _distributions_and_pruning(ctx, device):
    """``torch.distributions`` (a reparameterized sample, log-probability and KL divergence,
    backward), a pruned linear layer (a forward pre-hook applying its mask), an FFT and
    ``grid_sample`` over an affine grid, ``cdist``."""
    import torch.nn.utils.prune

    mu = torch.zeros(5, device=device, requires_grad=True)
    sig = torch.ones(5, device=device, requires_grad=True)
    lin = nn.Linear(8, 8).to(device)
    torch.nn.utils.prune.l1_unstructured(lin, "weight", amount=0.5)
    img = torch.randn(2, 3, 8, 8, device=device, requires_grad=True)
    theta = torch.tensor([[[0.9, 0.1, 0.0], [-0.1, 0.9, 0.0]]], device=device).repeat(2, 1, 1)
    x = torch.randn(4, 8, device=device)
    with ctx():
        d = torch.distributions.Normal(mu * 2, sig.exp())
        s = d.rsample((10,))
        lp = d.log_prob(s).sum() + torch.distributions.kl_divergence(
            d, torch.distributions.Normal(torch.zeros(5, device=device), 1.0)).sum()
        y = lin(x * 2).relu()
        spectrum = torch.fft.rfft(y * 3, dim=1).abs() + 1
        out = F.grid_sample(img * 2, F.affine_grid(theta * 1.0, (2, 3, 8, 8), align_corners=False),
                            align_corners=False)
        dist = torch.cdist(out.flatten(2) * 0.5, out.flatten(2) + 1)
        (lp + y.sum() + dist.sum() + out.square().sum()).backward()
    return (s.detach(), lp.detach(), mu.grad, sig.grad, y.detach(), spectrum, lin.weight_orig.grad,
            dist.detach(), img.grad)


def _message_passing(ctx, device):
    """A graph attention layer written with scatter and index ops, trained two steps in
    float64 (scatter's and ``index_add``'s GPU sums are atomics, in no fixed order): edge
    scores from gathered node features, a softmax over each node's incoming edges
    (``scatter_reduce`` amax, ``index_add`` of exponentials), ``index_add_`` of weighted
    messages, degree normalization by ``bincount``, ``scatter_add`` and a mean
    ``scatter_reduce`` over expanded indices, ``gather``."""
    g = torch.Generator().manual_seed(3)
    n, e, c = 40, 160, 16
    x = torch.randn(n, c, dtype=torch.float64, generator=g).to(device)
    src = torch.randint(0, n, (e,), generator=g).to(device)
    dst = torch.randint(0, n, (e,), generator=g).to(device)
    lin = nn.Linear(c, c).to(device, torch.float64)
    att = nn.Parameter(torch.randn(2 * c, dtype=torch.float64, generator=g).to(device))
    opt = torch.optim.SGD([*lin.parameters(), att], lr=0.05)
    outs = []
    with ctx():
        for _ in range(2):
            opt.zero_grad()
            h = lin(x)
            score = F.leaky_relu(torch.cat([h[src], h[dst]], -1) @ att, 0.2)
            top = torch.full((n,), -1e9, dtype=h.dtype, device=device).scatter_reduce(
                0, dst, score, "amax", include_self=True)
            ex = (score - top[dst]).exp()
            den = torch.zeros(n, dtype=h.dtype, device=device).index_add(0, dst, ex)
            alpha = ex / den[dst].clamp_min(1e-16)
            out = torch.zeros_like(h).index_add_(0, dst, alpha[:, None] * h[src])
            out = out / torch.bincount(dst, minlength=n).to(h.dtype).clamp_min(1)[:, None]
            idx = src[:, None].expand(e, c)
            summed = torch.zeros_like(h).scatter_add(0, idx, h[dst])
            mean = torch.zeros_like(h).scatter_reduce(0, idx, h[dst], "mean", include_self=False)
            y = F.elu(out) + summed.tanh() + mean.sigmoid() + torch.gather(h, 0, idx[:n])
            loss = y.square().mean()
            loss.backward()
            opt.step()
            outs.append((y.detach(), loss.detach(), att.grad.clone(), lin.weight.grad.clone()))
    return outs, [p.detach() for p in lin.parameters()], att.detach()


def _transformer_and_sparse_gradients(ctx, device):
    """A transformer encoder with a padding mask, trained, then in eval mode under
    ``no_grad`` (its fused fast path, over nested tensors); an embedding with sparse
    gradients and ``SparseAdam``, an ``EmbeddingBag``; CTC loss; bilinear and nearest
    interpolation."""
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
                                2, enable_nested_tensor=True).to(device)
    x = torch.randn(2, 10, 32, device=device)
    mask = torch.zeros(2, 10, dtype=torch.bool, device=device)
    mask[1, 7:] = True
    emb = nn.Embedding(50, 16, sparse=True).to(device)
    bag = nn.EmbeddingBag(50, 16, mode="mean").to(device)
    idx = torch.tensor([[1, 4, 4, 9], [0, 2, 49, 1]], device=device)
    opt = torch.optim.SparseAdam(list(emb.parameters()))
    logits = torch.randn(12, 2, 6, device=device, requires_grad=True)
    img = torch.randn(1, 2, 5, 5, device=device, requires_grad=True)
    with ctx():
        out = enc(x * 1.5, src_key_padding_mask=mask)
        out.square().mean().backward()
        for _ in range(2):
            loss = (emb(idx) * 2).tanh().sum() + bag(idx).sin().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        ctc = F.ctc_loss((logits * 2).log_softmax(-1), torch.tensor([[1, 2, 3], [2, 2, 4]], device=device),
                         torch.tensor([12, 10]), torch.tensor([3, 3]))
        up = F.interpolate(img * 3, scale_factor=2, mode="bilinear", align_corners=False)
        near = F.interpolate(img.exp(), size=(7, 9), mode="nearest")
        (ctc + up.sum() + near.sum()).backward()
    enc.eval()
    with torch.no_grad(), ctx():
        fast = enc(x * 1.5, src_key_padding_mask=mask)
    return (out.detach(), [p.grad for p in enc.parameters()], fast, emb.weight.detach(), bag.weight.grad,
            ctc.detach(), up.detach(), near.detach(), logits.grad, img.grad)


def _func_transforms(ctx, device):
    """``torch.func``: a model's parameter gradients by ``grad`` over ``functional_call``,
    per-sample gradients (``vmap`` of ``grad``), ``jacrev`` and ``hessian``. A region's
    scratch buffers allocated at a flush inside ``grad`` came back as functorch's wrappers,
    without storage ("Cannot access data pointer of Tensor that doesn't have storage")."""
    model = _mlp(device, nn.Tanh())
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = _batch(device)

    def loss(p, x, y):
        return F.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

    def sample_loss(p, xi, yi):
        return loss(p, xi[None], yi[None])

    with ctx():
        grads = torch.func.grad(loss)(params, x, y)
        per_sample = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
        jac = torch.func.jacrev(lambda z: (z.sin() * z).sum(0))(x[:4, :5])
        hess = torch.func.hessian(lambda z: (z.tanh() ** 2).sum())(x[0, :6])
    return grads, per_sample, jac, hess


def _forward_ad(ctx, device):
    """Forward-mode AD: dual tensors through fusible calls, and ``torch.func.jvp`` of a
    model's softmax."""
    import torch.autograd.forward_ad as fwAD

    model = _mlp(device, nn.GELU())
    x, _ = _batch(device)
    t = torch.randn_like(x)
    with ctx():
        with fwAD.dual_level():
            d = fwAD.make_dual(x, t)
            z = (d.sin() * 2 + 1).exp().tanh() * d
            z = F.gelu(z) + z.sum(1, keepdim=True)
            primal, tangent = (v * 1 for v in fwAD.unpack_dual(z))
        out, jv = torch.func.jvp(lambda v: model(v).softmax(-1), (x,), (t,))
    return primal, tangent, out, jv


def _saved_tensor_hooks_and_modes(ctx, device):
    """Saved-tensor hooks (``save_on_cpu``, and hooks that copy each saved value), anomaly
    detection (its NaN checks read every node's gradients), and a user's dispatch mode
    (``FlopCounterMode``) above accel's."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _mlp(device, nn.GELU(), nn.LayerNorm(64))
    x, y = _batch(device)
    packed = []

    def pack(t):
        packed.append(t.detach() * 1)
        return t * 1

    with ctx():
        with torch.autograd.graph.save_on_cpu(pin_memory=device != "cpu"):
            loss = F.cross_entropy(model(x).sin() * 2, y)
        with torch.autograd.detect_anomaly():
            loss.backward()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t + 0):
            loss2 = (model(x).exp() * x.sum()).mean()
        with FlopCounterMode(display=False) as flops:
            loss2.backward()
    return loss.detach(), loss2.detach(), [p.grad for p in model.parameters()], packed, flops.get_total_flops()


def _module_conversion(ctx, device):
    """Parameters given other contents outside the dispatcher between a forward and the
    read of its result: ``Tensor.data = t`` (weight clipping, as a WGAN critic's) and
    ``nn.Module.double()``."""
    model = _mlp(device, nn.Tanh())
    x, _ = _batch(device)
    outs = []
    with ctx():
        for _ in range(2):
            outs.append(model(x).sin() * 2)
            for p in model.parameters():
                p.data = p.data.clamp(-0.05, 0.05)
        outs.append(model(x) + 1)
        model.double()
        outs.append(model(x.double()).exp())
    return [o.detach() for o in outs]


class _VisionBlocks(nn.Module):
    """The blocks of torchvision's mobile and modern convolutional networks, written out: a
    stem with hard-swish (MobileNetV3), an inverted residual with squeeze-and-excitation
    (hard-sigmoid gate) and stochastic depth (EfficientNet), a channel shuffle
    (ShuffleNetV2), a ConvNeXt block (depthwise 7x7, LayerNorm over channels-last, layer
    scale), a GroupNorm + SiLU stage with nearest upsampling (a diffusion UNet's), and a
    pooled head with in-place dropout (MnasNet)."""

    def __init__(self):
        super().__init__()
        c = 16
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c),
                                  nn.Hardswish(inplace=True))
        self.dw = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1, groups=c, bias=False), nn.BatchNorm2d(c),
                                nn.ReLU(inplace=True))
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, 8, 1), nn.ReLU(),
                                nn.Conv2d(8, c, 1), nn.Hardsigmoid())
        self.project = nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))
        self.cn_dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.cn_norm = nn.LayerNorm(c, eps=1e-6)
        self.cn_mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))
        self.cn_scale = nn.Parameter(torch.full((c,), 0.5))
        self.gn = nn.GroupNorm(4, c)
        self.up_conv = nn.Conv2d(c, c, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2, inplace=True),
                                  nn.Linear(c, 10))

    @staticmethod
    def _drop_path(x, p, training):  # torchvision.ops.stochastic_depth, mode "row"
        if not training:
            return x
        keep = torch.empty((x.shape[0], 1, 1, 1), dtype=x.dtype, device=x.device).bernoulli_(1 - p)
        return x * keep.div_(1 - p)

    def forward(self, x):
        x = self.stem(x)
        y = self.dw(x)
        y = y * self.se(y)
        y = self.project(y)
        x = x + self._drop_path(y, 0.25, self.training)
        b, c, h, w = x.shape
        x = x.view(b, 2, c // 2, h, w).transpose(1, 2).contiguous().view(b, c, h, w)
        y = self.cn_dw(x).permute(0, 2, 3, 1)
        y = self.cn_mlp(self.cn_norm(y)) * self.cn_scale
        x = x + self._drop_path(y.permute(0, 3, 1, 2), 0.25, self.training)
        y = F.silu(self.gn(x))
        y = self.up_conv(F.interpolate(y, scale_factor=2, mode="nearest"))
        x = x + F.avg_pool2d(y, 2)
        return self.head(x)


def _vision_blocks(ctx, device):
    """:class:`_VisionBlocks` trained for two SGD steps (momentum, weight decay, label
    smoothing), then evaluated, in float64: the models the blocks come from
    (torchvision's MobileNetV3, EfficientNet, MnasNet, ShuffleNetV2, ConvNeXt, 14 in all)
    matched eager in float64 on both devices, where in float32 a rounding apart at a ReLU's
    kink (a batch norm's output of 7.6e-9 against 0.0) moved early layers' gradients by
    up to 3 %, as it moves eager's from a float64 run's."""
    model = _VisionBlocks().to(device, torch.float64)
    x = torch.randn(4, 3, 32, 32, device=device, dtype=torch.float64)
    y = torch.tensor([1, 7, 3, 3], device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    losses = []
    with ctx():
        for _ in range(2):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            loss.backward()
            losses.append(loss.detach())
            opt.step()
        model.eval()
        with torch.no_grad():
            out = model(x * 0.5)
    return (losses, [p.grad for p in model.parameters()], [p.detach() for p in model.parameters()],
            [b for b in model.buffers()], out)


FEATURE_PROGRAMS = {
    "autocast": _autocast_training, "hooks": _hooks, "gradient penalty": _gradient_penalty,
    "dropout": _dropout, "attention": _attention,
    "TorchScript, complex and sparse": _scripted_and_unusual_tensors,
    "parametrizations": _parametrized, "custom functions": _custom_functions_and_accumulation,
    "checkpointing": _checkpointed, "inference mode": _inference_mode, "L-BFGS": _lbfgs,
    "autograd.functional and an ensemble": _autograd_functional,
    "distributions, pruning, FFT, grid_sample": _distributions_and_pruning,
    "transformer, sparse gradients, CTC": _transformer_and_sparse_gradients,
    "torch.func transforms": _func_transforms, "forward-mode AD": _forward_ad,
    "saved-tensor hooks, anomaly detection, a user's mode": _saved_tensor_hooks_and_modes,
    "module conversion, .data set": _module_conversion,
    "vision blocks (float64)": _vision_blocks,
    "message passing with scatter and index ops (float64)": _message_passing,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(FEATURE_PROGRAMS))
def test_programs_using_autograd_and_torch_features_match_eager(name, device):
    program = FEATURE_PROGRAMS[name]
    torch.manual_seed(0)
    want = program(contextlib.nullcontext, device)
    torch.manual_seed(0)
    got = program(accel.eager, device)
    torch.testing.assert_close(got, want)
