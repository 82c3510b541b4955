"""Data parallelism from the collective up: all-reduce bandwidth, four ways to average gradients (one
all-reduce per tensor, one flat buffer, one per gradient overlapping backward, ~25 MB buckets), then
sharding the optimizer state (ZeRO-1), the gradients (ZeRO-2) and the weights themselves (FSDP: each
layer all-gathered just before it runs, its gradients reduce-scattered). Every class is checked against
one process training on the whole batch, and timed against PyTorch's DDP and FSDP2.

    python ddp.py allreduce                      # NCCL bandwidth table, world 2/4/6/8 as GPUs allow
    python ddp.py benchmark --world 2            # GPT xl, B=4 per rank, T=512, bf16: every variant
    python ddp.py benchmark --variants local,torch,bucket,fsdp:bf16 --plot ddp.png
    python ddp.py selftest --world 2             # every class against one process on the whole batch

Without a GPU everything runs on gloo at tiny sizes: a smoke run, not a measurement. The measured
tables (2x H200) are in the README.
"""

import argparse
import logging
import os
import signal
import statistics
import sys
import tempfile
import weakref
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from gpt import (GPT, Timing, autocast, clock, configure_optimizer, elapsed_ms, fail, free_memory, fully_shard_gpt,
                 gib, lazily, make_config, plot_to, print_table, round_up, run_main, set_tf32, summarize,
                 synchronize, time_rounds)

# newer torch names the flat collectives *_single. gloo does a reduce-scatter as an all-reduce that keeps
# its slice (twice the traffic, fine for a CPU smoke run); NCCL does the real thing. Both average inside.
all_gather_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_into = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
AVG = dist.ReduceOp.AVG

# --- 1. averaging gradients: four wrappers with one interface


def on_gradient(p, method):
    """Call method(p) once p.grad is complete in each backward (every use of p summed in). The hook holds
    the wrapper weakly: a strong reference is a cycle the garbage collector cannot see through."""
    ref = weakref.WeakMethod(method)
    p.register_post_accumulate_grad_hook(lambda param: ref() and ref()(param))


class DataParallel(nn.Module):
    """What the wrappers share: rank 0's parameters and buffers at construction, and forward."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        with torch.no_grad():  # parameters() yields a tied tensor (GPT's lm_head = wte) once
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        self.trainable = [p for p in module.parameters() if p.requires_grad]  # frozen: never reduced

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def check(self, missing):
        if missing:
            names = {p: name for name, p in self.module.named_parameters()}
            raise RuntimeError(f"no gradient for {', '.join(names[p] for p in missing)} before "
                               "finish_gradient_synchronization: every trainable parameter must be used in forward")

    def all_reduce_flat(self, params):
        """One all-reduce of one flat copy of the gradients after backward: one latency, full bandwidth,
        paid for with a copy in, a copy out and a second gradient-sized buffer."""
        self.check([p for p in params if p.grad is None])
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=AVG)
        for p, part in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(part.view_as(p))


class NaiveDDP(DataParallel):
    """After backward, one blocking all-reduce per gradient: ~580 collectives for GPT-2 xl, each
    paying the launch latency, and the GPU computes nothing while they run."""

    def finish_gradient_synchronization(self):
        self.check([p for p in self.trainable if p.grad is None])
        for p in self.trainable:
            dist.all_reduce(p.grad, op=AVG)


class FlatDDP(DataParallel):
    def finish_gradient_synchronization(self):
        self.all_reduce_flat(self.trainable)


class OverlapDDP(DataParallel):
    """An asynchronous all-reduce per gradient, started the moment backward has finished it, so
    communication runs while backward computes the layers below."""

    def __init__(self, module):
        super().__init__(module)
        self.works = {}
        for p in self.trainable:
            on_gradient(p, self.reduce)

    def reduce(self, p):
        # every rank runs the same graph, so the hooks fire and the collectives queue in one order
        self.works[p] = dist.all_reduce(p.grad, op=AVG, async_op=True)

    def finish_gradient_synchronization(self):
        self.check([p for p in self.trainable if p not in self.works])
        for work in self.works.values():
            work.wait()  # on a GPU: the compute stream waits for NCCL's, the CPU goes on
        self.works = {}


class BucketDDP(DataParallel):
    """Gradients in ~bucket_mb buckets, in reverse registration order (roughly the order backward
    makes them); a bucket's asynchronous all-reduce starts when its last gradient arrives. p.grad is
    a view into its bucket, so the average needs no copy back. comm_dtype=bfloat16 sends half."""

    def __init__(self, module, bucket_mb=25, comm_dtype=None):
        super().__init__(module)
        self.comm_dtype, self.world = comm_dtype, dist.get_world_size()
        self.buckets, self.slot = [[]], {}  # slot: parameter -> (bucket, offset)
        for p in self.trainable[::-1]:
            b = self.buckets[-1]
            full = sum(q.nbytes for q in b) + p.nbytes > bucket_mb * 2**20
            if b and (full or (p.dtype, p.device) != (b[0].dtype, b[0].device)):
                self.buckets.append([])  # (a parameter above the cap gets a bucket of its own)
            self.slot[p] = (len(self.buckets) - 1, sum(q.numel() for q in self.buckets[-1]))
            self.buckets[-1].append(p)
            on_gradient(p, self.gradient_ready)
        self.sizes = [sum(p.numel() for p in b) for b in self.buckets]  # elements per bucket
        self.grads = [None] * len(self.buckets)  # one flat gradient buffer per bucket, made when used
        self.arrived, self.next_bucket, self.works = [0] * len(self.buckets), 0, []

    def view(self, flat, p):
        return flat[self.slot[p][1]:self.slot[p][1] + p.numel()].view_as(p)

    def gradient_ready(self, p):
        i = self.slot[p][0]
        if self.grads[i] is None:
            self.grads[i] = p.new_zeros(self.sizes[i])
        view = self.view(self.grads[i], p)
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)  # a fresh gradient (zero_grad set it to None): copy it in
        p.grad = view
        self.arrived[i] += 1
        if self.arrived[i] > len(self.buckets[i]):
            raise RuntimeError("backward ran twice without finish_gradient_synchronization; "
                               "BucketDDP does not support gradient accumulation")
        # buckets leave strictly in order, so every rank queues the same collectives in one order
        while (i := self.next_bucket) < len(self.buckets) and self.arrived[i] == len(self.buckets[i]):
            grads = self.grads[i]
            sent = grads if self.comm_dtype in (None, grads.dtype) else grads.to(self.comm_dtype)
            self.works.append(self.reduce(i, sent))
            self.next_bucket += 1

    def reduce(self, i, sent):
        """Start bucket i's collective: (where the average belongs, where it lands, its work)."""
        return self.grads[i], sent, dist.all_reduce(sent, op=AVG, async_op=True)

    def finish_gradient_synchronization(self):
        self.check(self.buckets[self.next_bucket] if self.next_bucket < len(self.buckets) else [])
        for target, out, work in self.works:
            work.wait()
            if out is not target:  # sent in comm_dtype: back into the fp32 buffer
                target.copy_(out)
        self.arrived, self.next_bucket, self.works = [0] * len(self.buckets), 0, []

# takeaway: bucketing plus overlap is what torch DDP does: few large collectives, most hidden behind backward.

# --- 2. ZeRO: the optimizer state sharded (ZeRO-1), then the gradients too (ZeRO-2)


class ZeRO2(BucketDDP):
    """BucketDDP with each bucket reduce-scattered (an all-reduce's first half): a rank receives the
    averaged gradient of only its 1/world slice of every bucket, and drops the full gradients after
    the sync. ShardedOptimizer steps the slices, then the buckets are all-gathered (the second half)
    in place: the parameters live in one flat buffer per bucket. Same bytes as one all-reduce."""

    def __init__(self, module, bucket_mb=25, comm_dtype=None):
        super().__init__(module, bucket_mb, comm_dtype)
        self.sizes = [round_up(n, self.world) for n in self.sizes]  # padded: a bucket splits evenly
        self.params = [self.flatten(i) for i in range(len(self.buckets))]
        self.shard_grads = [flat.new_zeros(flat.numel() // self.world) for flat in self.params]
        for flat, grad, bucket in zip(self.params, self.shard_grads, self.buckets):
            lo = dist.get_rank() * grad.numel()
            for p in bucket:  # the part of p in this rank's slice (the model's own memory), its gradient
                a, b = max(self.slot[p][1], lo), min(self.slot[p][1] + p.numel(), lo + grad.numel())
                p.zero2 = (weakref.ref(self), *((flat[a:b], grad[a - lo:b - lo]) if a < b else (None, None)))

    def flatten(self, i):
        """Move bucket i's parameters into one flat buffer (one at a time: no second model)."""
        flat = self.buckets[i][0].new_zeros(self.sizes[i])
        for p in self.buckets[i]:
            self.view(flat, p).copy_(p.detach())
            p.data = self.view(flat, p)
        return flat

    def reduce(self, i, sent):
        out = self.shard_grads[i] if sent is self.grads[i] else sent.new_empty(sent.numel() // self.world)
        return self.shard_grads[i], out, reduce_scatter_into(out, sent, op=AVG, async_op=True)

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        self.grads = [None] * len(self.buckets)  # the full gradients have served: a rank keeps only its slices
        for p in self.trainable:
            p.grad = None

    def all_gather_parameters(self):
        """After the optimizer stepped this rank's slices: every rank gets every slice."""
        return [all_gather_into(flat, flat.chunk(self.world)[dist.get_rank()], async_op=True) for flat in self.params]


class ShardedOptimizer(torch.optim.Optimizer):
    """Optimizer state (AdamW: two fp32 tensors per parameter) for ~1/world of the parameters on
    each rank. ZeRO-1, after any wrapper: each parameter goes to the least-loaded rank, which steps
    it and broadcasts it. ZeRO-2, for a ZeRO2 wrapper's parameters: each rank steps its slice of
    every bucket (the only gradient it received), then the wrapper all-gathers the buckets."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.optimizer_cls, self.kwargs, self.rank = optimizer_cls, kwargs, dist.get_rank()
        self.owners, self.load = [], [0] * dist.get_world_size()  # ZeRO-1: (parameter, owner); elements per rank
        self.pieces, self.wrappers = [], {}  # ZeRO-2: (slice, its gradient); the ZeRO2 wrappers to gather
        self.local, self.group_pairs = None, []  # optimizer_cls over what this rank steps; (our group, its)
        super().__init__(params, kwargs)  # calls add_param_group for each group

    def add_param_group(self, param_group):
        super().add_param_group(param_group)  # validates and fills in the defaults
        group, mine = self.param_groups[-1], []
        for p in group["params"]:
            if hasattr(p, "zero2"):
                self.wrappers[p.zero2[0]] = True
                if p.zero2[1] is not None:
                    mine.append(p.zero2[1])
                    self.pieces.append(p.zero2[1:])
                continue
            owner = min(range(len(self.load)), key=self.load.__getitem__)
            self.load[owner] += p.numel()
            self.owners.append((p, owner))
            mine += [p] if owner == self.rank else []
        if mine and self.local is None:
            self.local = self.optimizer_cls([{**group, "params": mine}], **self.kwargs)
        elif mine:
            self.local.add_param_group({**group, "params": mine})
        if mine:
            self.group_pairs.append((group, self.local.param_groups[-1]))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group, shard in self.group_pairs:  # carry learning-rate schedules over to the shard
            shard.update((k, v) for k, v in group.items() if k != "params")
        for piece, grad in self.pieces:
            piece.grad = grad
        if self.local is not None:
            self.local.step()
        works = [dist.broadcast(p, src=owner, async_op=True) for p, owner in self.owners]
        for work in works + [work for wrapper in self.wrappers for work in wrapper().all_gather_parameters()]:
            work.wait()
        return loss

# takeaway: an all-reduce is a reduce-scatter plus an all-gather; ZeRO-2 steps the optimizer in between.

# --- 3. FSDP: the weights sharded too, each layer gathered just before it runs


class FSDP(DataParallel):
    """Each trainable parameter of 2+ dims (a tied one once) is split along dim 0, padded to a multiple
    of the world size: .module's parameters become this rank's shards, which any torch optimizer steps;
    1-D ones stay whole, in fp32. The units are the entries of the model's nn.ModuleLists (GPT's
    blocks) plus the rest (embeddings, final norm, tied output layer), gathered for the whole step. A
    unit's weights are all-gathered just before it runs, cast to compute_dtype first (bf16: half the
    bytes travel), and freed after, the next unit's all-gather in flight meanwhile. Each gradient is
    reduce-scattered in fp32 once backward has finished it; the 1-D ones are all-reduced at the end.
    Not with activation checkpointing: it re-runs forward inside backward."""

    def __init__(self, module, compute_dtype=None):
        if getattr(getattr(module, "config", None), "recompute", 0):
            raise ValueError("FSDP does not support activation checkpointing (config.recompute)")
        super().__init__(module)
        self.compute_dtype, self.rank, self.world = compute_dtype, dist.get_rank(), dist.get_world_size()
        layers = [layer for m in module.modules() if isinstance(m, nn.ModuleList) for layer in m]
        unit_of = {m: u for u, layer in enumerate(layers, 1) for m in layer.modules()}  # the rest: unit 0
        self.slots = [[] for _ in range(len(layers) + 1)]  # per unit: (module, name, parameter) to install
        self.sharded = [[] for _ in self.slots]  # per unit: the parameters it gathers
        self.full, self.shard_of = {}, {}  # shard: (full tensor, alias to write it, rows); full: shard
        for m, name, p in [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if p is not None]:
            self.slots[unit_of.get(m, 0)].append((m, name, p))
            if p.requires_grad and p.dim() >= 2 and p not in self.full:
                self.shard_(p)
                self.sharded[unit_of.get(m, 0)].append(p)
        self.replicated = [p for p in self.trainable if p.dim() < 2]
        self.gathers = [[] for _ in self.slots]  # all-gathers in flight, per unit
        self.pending, self.settled, self.reduced = [], 0, set()  # reduce-scatters: (work, shard, out)
        for u, layer in enumerate(layers, 1):
            layer.register_forward_pre_hook(partial(self.pre_forward, u))
            layer.register_forward_hook(partial(self.post_forward, u))

    def shard_(self, p):
        """Keep this rank's rows of p (p.data becomes the shard) and make the full tensor it is
        gathered into: the leaf the layer computes with, whose memory exists only while gathered."""
        padded = p.new_zeros(round_up(p.shape[0], self.world), *p.shape[1:])
        padded[:p.shape[0]] = p.detach()
        full = torch.empty(padded.shape, dtype=self.compute_dtype or p.dtype, device=p.device, requires_grad=True)
        # the all-gather writes through an alias: the same memory but its own version counter, so
        # autograd does not take a refill for a change to the weights it saved for backward
        alias = torch.empty(0, dtype=full.dtype, device=p.device).set_(full.untyped_storage(), 0, full.shape)
        full.untyped_storage().resize_(0)
        self.full[p], self.shard_of[full] = (full, alias, p.shape[0]), p
        on_gradient(full, self.reduce_scatter)
        p.data = padded.chunk(self.world)[self.rank].clone()

    def gather(self, u):
        """Start all-gathering those of unit u's weights that are neither here nor on their way."""
        for p in self.sharded[u] if u < len(self.slots) else []:
            full, alias, _ = self.full[p]
            if full.untyped_storage().nbytes() == 0:
                full.untyped_storage().resize_(full.nbytes)  # cast first: compute_dtype bytes travel
                self.gathers[u].append(all_gather_into(alias, p.detach().to(full.dtype), async_op=True))

    def wait(self, u):
        self.gather(u)
        for work in self.gathers[u]:
            work.wait()  # on a GPU the compute stream waits for NCCL's; the CPU goes on queueing
        self.gathers[u] = []

    def free(self, u):
        for p in self.sharded[u]:
            self.full[p][0].untyped_storage().resize_(0)

    def install(self, u, on=True):
        """Point unit u's modules at the gathered weights and at compute_dtype copies of the others
        (differentiable: the fp32 parameter gets the gradient); or back at the parameters."""
        for m, name, p in self.slots[u]:
            if not on:
                m._parameters[name] = p
            elif p in self.full:
                m._parameters[name] = self.full[p][0][:self.full[p][2]]  # not the padding rows
            elif self.compute_dtype is not None:
                m._parameters[name] = p.to(self.compute_dtype)

    def forward(self, *args, **kwargs):
        self.gather(0)
        self.gather(1)  # the first layer comes right behind the root
        self.wait(0)
        self.install(0)
        try:
            return self.module(*args, **kwargs)
        finally:
            self.install(0, on=False)
            if not torch.is_grad_enabled():
                self.free(0)

    def pre_forward(self, u, module, args):
        self.wait(u)
        self.gather(u + 1)  # the next layer's all-gather runs while this one computes
        self.install(u)

    def post_forward(self, u, module, args, output):
        self.install(u, on=False)
        if not torch.is_grad_enabled() or u < len(self.slots) - 1:
            self.free(u)  # (the last layer's weights are the first backward needs: kept)
        outputs = [output] if torch.is_tensor(output) else output
        if (out := next((t for t in outputs if torch.is_tensor(t) and t.requires_grad), None)) is not None:
            out.register_hook(lambda grad: self.pre_backward(u))  # when the layer's backward starts

    def pre_backward(self, u):
        self.wait(u)  # its backward reads the weights again
        self.gather(u - 1)  # the layer below starts coming
        self.settle(self.settled)  # reduce-scatters from two layers up are done: release them
        self.settled = len(self.pending)

    def reduce_scatter(self, full):
        p = self.shard_of[full]
        grad = full.grad.to(p.dtype)  # reduced in the shards' fp32, whatever the compute dtype
        full.grad = None
        full.untyped_storage().resize_(0)  # backward is done with these weights
        out = torch.empty_like(p)
        self.pending.append((reduce_scatter_into(out, grad, op=AVG, async_op=True), p, out))
        self.reduced.add(p)

    def settle(self, n):
        """Wait for the first n reduce-scatters in flight; their averages become the shards' .grad."""
        for work, p, out in self.pending[:n]:
            work.wait()
            p.grad = out if p.grad is None else p.grad + out
        self.pending = self.pending[n:]

    def finish_gradient_synchronization(self):
        self.check([p for p in self.full if p not in self.reduced])
        self.settle(len(self.pending))
        self.settled, self.reduced = 0, set()
        if self.replicated:  # one all-reduce, so every rank ends with the same bits
            self.all_reduce_flat(self.replicated)
        for u in range(len(self.slots)):
            self.free(u)

    @torch.no_grad()
    def gather_full_params(self):
        """{name: full tensor} of every parameter (a tied one once), the sharded ones all-gathered."""
        out = {name: p.detach().clone() for name, p in self.module.named_parameters()}
        for name, p in self.module.named_parameters():
            if p in self.full:
                out[name] = p.new_empty(p.shape[0] * self.world, *p.shape[1:])
                all_gather_into(out[name], p.detach())
                out[name] = out[name][:self.full[p][2]]
        return out

# takeaway: FSDP keeps 1/world of the weights; it pays an all-gather per layer in forward and again in backward.

# --- 4. correctness: a toy model on every rank against one process on the whole batch


class ToyModel(nn.Module):
    """Small, and awkward enough to catch the usual bugs: a tied output layer (its gradient has two
    parts), a frozen layer (never reduced or waited for), a buffer (must come from rank 0), layers in
    an nn.ModuleList (FSDP's units) and 15 embedding rows (FSDP pads them)."""

    def __init__(self, vocab=15, dim=8):
        super().__init__()
        self.embed, self.norm = nn.Embedding(vocab, dim), nn.LayerNorm(dim)
        self.frozen = nn.Linear(dim, dim).requires_grad_(False)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("shift", torch.randn(dim))

    def forward(self, idx, targets):
        h = self.embed(idx)
        h = h + self.frozen(h)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.out(self.norm(h) + self.shift.to(h.dtype)).float()
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def toy_optimizer(model, kind):
    """SGD, or AdamW with a decayed and an undecayed group, sharded ("zero-adamw") with the second
    group added after construction."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if kind != "zero-adamw":
        return torch.optim.SGD(params, lr=0.5) if kind == "sgd" else torch.optim.AdamW(groups, lr=.05, weight_decay=.1)
    optimizer = ShardedOptimizer(groups[:1], torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    optimizer.add_param_group(groups[1])
    return optimizer


def train_toy(model, optimizer, steps, rank=0, world=1, dtype=None, parts=1):
    """Rank r trains on the r-th of world slices of each batch: the mean of the slices' mean losses
    is the whole batch's, so the averaged gradient is the same. The one-process reference sums the
    gradients of `parts` = world slices as the ranks' all-reduce does (one 8-row backward would add
    its rows in another order: ~1e-8 apart): with 2 ranks bitwise the same arithmetic, a + b being
    b + a. For FSDP's compute_dtype it casts every parameter to dtype for the forward, as FSDP does."""
    device = next(model.parameters()).device
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randint(15, (8, 6), generator=g).to(device) for _ in "xy")
        for i in range(rank * parts, (rank + 1) * parts):
            part = slice(i * 8 // (world * parts), (i + 1) * 8 // (world * parts))
            if dtype is None:
                loss = model(x[part], y[part])[1]
            else:
                cast = {n: p.to(dtype) for n, p in model.named_parameters()}
                loss = torch.func.functional_call(model, cast, (x[part], y[part]))[1]
            loss.backward()
        for p in model.parameters() if parts > 1 else []:  # the mean over the slices, in fp32 as the ranks take it
            if p.grad is not None:
                p.grad /= parts
        getattr(model, "finish_gradient_synchronization", lambda: None)()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()


def toy_state(model):
    """Every parameter (a tied one once) and buffer, whole, on the CPU."""
    inner = getattr(model, "module", model)
    params = model.gather_full_params() if isinstance(model, FSDP) else dict(inner.named_parameters())
    return {k: v.detach().cpu().clone() for k, v in [*params.items(), *inner.named_buffers()]}


TINY = 0.0002  # MB: a bucket or two per parameter
# name: (wrapper, optimizer, tolerance). ZeRO-1 is BucketDDP with a ShardedOptimizer.
TOY_VARIANTS = {
    "naive": (NaiveDDP, "sgd", 2e-6), "flat": (FlatDDP, "sgd", 2e-6), "overlap": (OverlapDDP, "sgd", 2e-6),
    "bucket": (partial(BucketDDP, bucket_mb=TINY), "sgd", 2e-6),
    "bucket-bf16": (partial(BucketDDP, bucket_mb=TINY, comm_dtype=torch.bfloat16), "sgd", 1e-2),
    "zero1-adamw": (partial(BucketDDP, bucket_mb=TINY), "zero-adamw", 2e-6),
    "zero2-adamw": (partial(ZeRO2, bucket_mb=TINY), "zero-adamw", 2e-6),
    "fsdp": (FSDP, "sgd", 2e-6), "fsdp-adamw": (FSDP, "adamw", 2e-6),
    "fsdp-fp16": (partial(FSDP, compute_dtype=torch.float16), "sgd", 2e-6),
}


def selftest_worker(rank, world, device, args):
    """Per variant, every rank's weights after training against one process on the whole batch
    from rank 0's initial weights (a rank the broadcast missed differs too); for FSDP, after one
    more sync, fp32 gradients shaped like the shards, the replicated ones the same bits on every
    rank; for ZeRO, the optimizer state split between the ranks."""
    rows = []
    for name, (wrapper, kind, tol) in args.toy_variants.items():
        torch.manual_seed(100 + rank)  # different weights on every rank until the wrapper syncs them
        wrapped = wrapper(ToyModel().to(device))
        initial, optimizer = toy_state(wrapped), toy_optimizer(wrapped.module, kind)
        train_toy(wrapped, optimizer, args.steps, rank, world)
        final, ok = gather(toy_state(wrapped)), True
        if isinstance(wrapped, FSDP):
            train_toy(wrapped, None, 1, rank, world)
            replicated = gather([p.grad.cpu() for p in wrapped.replicated])
            ok = all(gather(all(p.grad.dtype == torch.float32 and p.grad.shape == p.shape for p in wrapped.trainable)))
            ok &= all(torch.equal(a, b) for r in replicated for a, b in zip(r, replicated[0]))
        if isinstance(optimizer, ShardedOptimizer):
            held = gather(sum(p.numel() for p in optimizer.local.state) if optimizer.local else 0)
            ok &= sum(held) == sum(p.numel() for p in wrapped.trainable) and (world == 1 or max(held) < sum(held))
        if rank == 0:
            reference, dtype = ToyModel().to(device), getattr(wrapped, "compute_dtype", None)
            reference.load_state_dict(initial, strict=False)  # (the tied output layer comes with embed)
            optimizer = toy_optimizer(reference, kind.removeprefix("zero-"))
            train_toy(reference, optimizer, args.steps, dtype=dtype, parts=world)
            ref = toy_state(reference)
            error = max((state[k] - w).abs().max().item() for state in final for k, w in ref.items())
            exact = world == 2 and dtype is None and tol < 1e-5  # fp32 on 2 ranks: bit for bit (see train_toy)
            ok &= all(torch.equal(state[k], w) for state in final for k, w in ref.items()) if exact else error <= tol
            rows.append([name, f"{error:.1e}", "bitwise" if exact else f"{tol:.0e}", "ok" if ok else "FAIL"])
    return rows


def run_selftest(args, world):
    if 8 % world:  # equal slices: the mean of their mean losses is the whole batch's
        fail(f"--world {world}: the selftest's batch of 8 sequences splits evenly over 1, 2, 4 or 8 ranks")
    check_launch(world, args.backend, 0, "the selftest")
    print(f"selftest: every wrapper on {world} ranks ({args.backend}) vs one process on the whole batch, "
          f"{args.steps} steps")
    args.toy_variants = dict(TOY_VARIANTS)  # they travel with args: a spawned rank imports ddp afresh
    rows = launch(selftest_worker, world, args.backend, args)
    print_table(["variant", "max |w - reference| on any rank", "tolerance", "result"], rows)
    failed = [r[0] for r in rows if r[-1] != "ok"]
    print(f"selftest: {len(rows) - len(failed)} of {len(rows)} variants match one-process training"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)

# takeaway: fp32 on two ranks must reproduce one process bit for bit; a missed or doubled average shows.

# --- 5. all-reduce bandwidth: small messages pay latency, large ones the link's bandwidth


def parse_size(text):
    """'1M', '10MB', '1GiB', '4096' -> bytes (K/M/G are powers of 1024)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, scale = (t[:-1], {"K": 2**10, "M": 2**20, "G": 2**30}[t[-1]]) if t[-1:] in ("K", "M", "G") else (t, 1)
    if not number.isdigit() or int(number) * scale < 4 or int(number) * scale % 4:
        raise ValueError(f"size '{text}' is not a whole number of float32 values (like 1M, 64K, 1G)")
    return int(number) * scale


def size_label(nbytes):
    units = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
    return next((f"{nbytes / s:g} {u}" for u, s in units if nbytes >= s), f"{nbytes} B")


def allreduce_worker(rank, world, device, args):
    """ms per all-reduce of each size: the slowest rank's (a collective ends when its last rank
    does), median of the runs (it resists stray slow ones)."""
    rows = []
    for nbytes in args.sizes:
        x = torch.full((nbytes // 4,), float(rank + 1), device=device)
        dist.all_reduce(x)  # doubles as a warm-up and a check that the sum is right
        if x[0].item() != world * (world + 1) / 2:
            raise RuntimeError(f"all-reduce returned {x[0].item()}, expected {world * (world + 1) / 2}")
        times = []
        for _ in range(args.warmup + args.reps):
            dist.barrier()  # start together, or a late rank's delay is timed as transfer
            synchronize(device)
            start = clock(device)
            dist.all_reduce(x)
            times.append(elapsed_ms(start, clock(device)))
        rows.append([world, nbytes, statistics.median(max(run) for run in zip(*gather(times[args.warmup:])))])
        del x
    return rows


def run_allreduce(args, gpu):
    args.warmup = 5 if args.warmup is None else args.warmup
    try:
        args.sizes = [parse_size(s) for s in (args.sizes or ("1M,10M,100M,1G" if gpu else "4K,64K,1M")).split(",")]
    except ValueError as e:
        fail(f"--sizes: {e}")
    big, memory = max(args.sizes), torch.cuda.get_device_properties(0).total_memory if gpu else 0
    if gpu and big > 0.9 * memory:
        fail(f"--sizes {size_label(big)}: the buffer does not fit in one {torch.cuda.get_device_name(0)} "
             f"({gib(memory)} GiB)")
    gpus = torch.cuda.device_count() if gpu else 2
    worlds = [args.world] if args.world else [w for w in (2, 4, 6, 8) if w <= gpus] or [gpus]
    for world in worlds:
        check_launch(world, args.backend, 0 if gpu else 2 * big, f"an all-reduce of {size_label(big)}")
    where = f"{torch.cuda.get_device_name()} GPUs, NCCL" if gpu else "CPU processes, gloo (no GPU: a smoke run)"
    print(f"all-reduce of float32 on {where}, torch {torch.__version__}: median of {args.reps} runs after "
          f"{args.warmup} warm-up, world {', '.join(map(str, worlds))}")
    # nccl-tests' bus bandwidth: a rank sends and receives 2(n-1)/n of the buffer, so algbw x 2(n-1)/n
    # compares across world sizes and with link speeds
    rows = [[w, size_label(n), f"{ms:.3f}", f"{n / ms / 1e6:.3g}", f"{n / ms / 1e6 * 2 * (w - 1) / w:.3g}"]
            for world in worlds for w, n, ms in launch(allreduce_worker, world, args.backend, args)]
    print_table(["world", "size", "time (ms)", "algbw (GB/s)", "busbw (GB/s)"], rows)
    print("algbw = bytes / time; busbw = algbw x 2(n-1)/n (nccl-tests' all-reduce definition); "
          "time = slowest rank's, median of runs; GB = 1e9 bytes")
    print(f"summary: all-reduce of {rows[-1][1]} on {rows[-1][0]} ranks takes {rows[-1][2]} ms, "
          f"{rows[-1][4]} GB/s bus bandwidth")

# takeaway: a collective costs a latency plus bytes over bandwidth; few large messages beat many small ones.

# --- 6. benchmark: the same GPT step under every variant, interleaved in rounds

LABELS = {"local": "local (no comm)", "torch": "torch DDP", "naive": "NaiveDDP", "flat": "FlatDDP",
          "overlap": "OverlapDDP", "bucket": "BucketDDP", "sharded": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "FSDP",
          "fsdp2": "torch FSDP2"}
# what a variant keeps between steps, in fp32 weights (AdamW's moments are two): (whole, split over
# the ranks). FlatDDP's flat copy only lives during its sync, but counts.
RESIDENT = {"local": (3, 0), "torch": (4, 0), "naive": (3, 0), "flat": (4, 0), "overlap": (3, 0), "bucket": (4, 0),
            "sharded": (2, 2), "zero2": (1, 3), "fsdp": (0, 4), "fsdp2": (0, 4)}
# key:bf16 is what torch DDP, BucketDDP and ZeRO send, and what FSDP gathers and computes with
VARIANTS = [k + d for k in LABELS
            for d in ("", ":fp32", ":bf16")[:3 if k in ("torch", "bucket", "sharded", "zero2", "fsdp") else 2]]


def make_step(key, bf16, args, rank, device, marks):
    """One training step of GPT under one variant. Each step appends to marks a clock() before it
    and after each phase: forward, backward, waiting for the gradients' communication, optimizer."""
    torch.manual_seed(rank)
    with torch.device(device):
        model = wrapped = GPT(make_config(args.model, vocab_size=args.vocab))
    dtype = torch.bfloat16 if bf16 else None
    if key == "torch":
        ids = [device.index] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=args.bucket_mb)
        if dtype:
            wrapped.register_comm_hook(None, bf16_compress_hook)
    elif key in ("bucket", "sharded", "zero2"):
        wrapped = (ZeRO2 if key == "zero2" else BucketDDP)(model, args.bucket_mb, dtype)
    elif key == "fsdp":
        wrapped = FSDP(model, dtype)
    elif key == "fsdp2":
        fully_shard_gpt(model, torch.bfloat16)
    elif key != "local":
        wrapped = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP}[key](model)
    optimizer = configure_optimizer(model, lr=3e-4)
    if key in ("sharded", "zero2"):  # the same AdamW (groups, betas), its state sharded
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
        optimizer = ShardedOptimizer(groups, torch.optim.AdamW, lr=3e-4, betas=(0.9, 0.95),
                                     fused=device.type == "cuda")
    # random tokens, different on every rank as in real data parallelism: speed does not depend on
    # what the tokens say, and this skips the tokenizer
    tokens = torch.randint(50257, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1000 + rank))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    sync = getattr(wrapped, "finish_gradient_synchronization", lambda: None)  # torch's syncs inside backward

    def step():
        t = [clock(device)]
        with autocast(device, torch.bfloat16 if device.type == "cuda" else None):
            loss = wrapped(x, y)[1]
        t.append(clock(device))
        loss.backward()
        t.append(clock(device))
        sync()
        t.append(clock(device))
        optimizer.step()
        # BucketDDP's gradients are views into its buckets: zeroing them in place lets autograd add
        # straight into them. The others drop theirs: memory for the other variants of the round.
        optimizer.zero_grad(set_to_none=key not in ("bucket", "sharded"))
        marks.append(t + [clock(device)])
    return step


def memory_groups(rows, config, args, world, weights):
    """The rows in groups whose models fit on one GPU together (on the CPU one group), each group
    with the torch DDP and no-comm rows to pair with."""
    shared = [r for r in rows if r[1] in ("torch", "local") and not r[2]]
    groups, rest = [], [r for r in rows if r not in shared]
    if args.backend != "nccl" or not rest:
        return [shared + rest]
    # on top of what all keep: one step's gradients and activations (~34 bytes a token, layer and width in bf16)
    budget = 0.9 * min(torch.cuda.get_device_properties(i).total_memory for i in range(world)) - weights \
        - 34 * args.batch * args.seq * config.n_embd * config.n_layer
    for row in rest:
        held = sum(RESIDENT[k][0] + RESIDENT[k][1] / world for _, k, _ in groups[-1] + [row]) if groups else 0
        if not groups or held * weights > budget:
            groups.append(list(shared))
        groups[-1].append(row)
    return groups


def time_group(group, results, args, rank, device):
    """Each variant of the group built and warmed up by gpt.time_rounds (its peak memory: the
    timer's peak less what the others already held), those out of memory on any rank dropped on
    all of them, the rest timed interleaved; the phase split from the clocks of the timed steps."""
    cuda, local, base = device.type == "cuda", LABELS["local"], LABELS["torch"]
    marks = {label: [] for label, _, _ in group}
    steps = {label: lazily(partial(make_step, key, bf16, args, rank, device, marks[label]), device)
             for label, key, bf16 in group}
    warm, peaks = time_rounds(steps, device, rounds=0, warmup=args.warmup)  # out of memory: None
    fits = [all(ok) for ok in zip(*gather([warm[label] is not None for label in steps]))]
    steps = {label: step for (label, step), ok in zip(steps.items(), fits) if ok}
    results.update({label: {"oom": True} for label, _, _ in group if label not in steps and label not in results})
    free_memory()  # (a variant out of memory on another rank lets go of its model here)

    def sync():  # every rank finishes a round before any starts the next
        synchronize(device)
        dist.barrier()

    for label in marks:
        marks[label].clear()  # (the warm-up's)
    every = gather(time_rounds(steps, device, args.rounds, args.steps, warmup=0, sync=sync)[0])
    times = {label: [max(r[label][i] for r in every) for i in range(args.rounds)] for label in steps}  # slowest rank
    timings = summarize(times, baseline=base if base in times else None)
    # each phase's median over the timed steps on each rank, and each variant's own peak
    split = gather({label: [statistics.median(ms) for ms in zip(*[[elapsed_ms(a, b) for a, b in zip(t, t[1:])]
                                                                  for t in marks[label]])] for label in steps})
    own = gather({label: peaks[label] - steps[label].state["others"] for label in steps} if cuda else {})
    for label in steps:
        exposed = [a - b for a, b in zip(times[label], times[local])] if local in times else None
        results.setdefault(label, {
            "oom": False, "timing": vars(timings[label]), "peak": max(r[label] for r in own) if cuda else None,
            "phases": [statistics.fmean(ms) for ms in zip(*(r[label] for r in split))],  # mean over ranks
            "exposed": statistics.median(exposed) if exposed else None})
    return timings[base].median if base in timings else None


def benchmark_worker(rank, world, device, args):
    """{label: result} of every group's rows, and torch DDP's median in each group."""
    set_tf32(True)
    results, baselines = {}, []
    for g, group in enumerate(args.groups):
        if rank == 0:
            print(f"  group {g + 1} of {len(args.groups)}: {', '.join(label for label, _, _ in group)}", flush=True)
        baselines.append(time_group(group, results, args, rank, device))
        free_memory()  # the group's models are gone with time_group's frame
    return {"rows": results, "baselines": [b for b in baselines if b]}


def print_benchmark(out, args, world):
    rows, base = out["rows"], out["rows"].get(LABELS["torch"], {})
    vs = lambda r: f" ({r['peak'] / base['peak']:.2f}x)" if r.get("peak") and base.get("peak") else ""  # noqa: E731
    print_table(["variant", "step ms", "vs torch DDP (paired)", "exposed comm ms", "fwd ms", "bwd ms", "wait ms",
                 "optim ms", "peak GiB (vs torch DDP)"],
                [[label] + ["OOM"] * 8 if r["oom"] else
                 [label, Timing(**r["timing"]).ms(1), Timing(**r["timing"]).vs(),
                  "-" if r["exposed"] is None or label == LABELS["local"] else f"{r['exposed']:.1f}",
                  *(f"{ms:.1f}" for ms in r["phases"]), "n/a" if r["peak"] is None else gib(r["peak"]) + vs(r)]
                 for label, r in rows.items()])
    spread = out["baselines"]  # torch DDP's median in each group
    groups = (f". {len(args.groups)} groups to fit in memory: torch DDP {min(spread):.1f}-{max(spread):.1f} ms "
              "across them" if len(spread) > 1 else "")
    print(f"step: median (min-max) over {args.rounds} rounds of {args.steps} steps, a round's time the slowest rank's; "
          "ratios paired within rounds. exposed comm: median of (step - no-comm step). fwd/bwd/wait/optim: medians "
          "over the timed steps, mean over ranks (torch DDP and FSDP2 wait inside bwd). peak: allocated, the "
          "variant's own, largest rank" + groups)
    done = {label: r for label, r in rows.items() if not r["oom"]}
    if args.plot:
        fig, ax = plot_to(args.plot).subplots(figsize=(8, 1 + 0.4 * len(done)))
        for k, phase in enumerate(["forward", "backward", "comm wait", "optimizer"]):
            ax.barh(list(done), [r["phases"][k] for r in done.values()],
                    left=[sum(r["phases"][:k]) for r in done.values()], label=phase)
        ax.invert_yaxis()
        ax.set(xlabel="ms per step (median phases)",
               title=f"GPT {args.model}, {world} ranks, B={args.batch} T={args.seq}")
        ax.legend()
        fig.savefig(args.plot, bbox_inches="tight")
        print(f"plot saved to {args.plot}")
    parts = [f"{label} {r['timing']['ratio']:.2f}x{vs(r)}" for label, r in done.items()
             if r["timing"]["ratio"] and label != LABELS["torch"]]
    print("summary: step (memory) vs torch DDP's: " + ("; ".join(parts) or "no torch DDP row to compare with"))


def run_benchmark(args, gpu, world):
    for flag, on_gpu, on_cpu in (("model", "xl", "tiny"), ("batch", 4, 2), ("seq", 512, 32), ("rounds", 30, 2),
                                 ("warmup", 3, 1)):
        setattr(args, flag, getattr(args, flag) or (on_gpu if gpu else on_cpu))
    try:
        config = make_config(args.model, vocab_size=args.vocab)
        if args.plot:
            plot_to(args.plot)
    except ValueError as e:
        fail(str(e))
    if args.seq > config.block_size:
        fail(f"--seq {args.seq} is longer than the {args.model} block size {config.block_size}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        bad = f"unknown {next(v for v in variants if v not in VARIANTS)!r}" if variants else "empty"
        fail(f"--variants: {bad}; choose from {', '.join(LABELS)}")
    # (label, key, bf16) per row; torch's bf16 hook needs NCCL
    rows = [(LABELS[k] + (" bf16 compute" if k == "fsdp" else " bf16 comm") * (d == "bf16"), k, d == "bf16")
            for k, _, d in (v.partition(":") for v in variants) if not (k == "torch" and d == "bf16" and not gpu)]
    with torch.device("meta"):
        weights = 4 * GPT(config).num_params()
    # on the CPU all the variants live in each rank's memory at once; a GPU holds them itself
    held = 0 if gpu else int(weights * (1 + sum(sum(RESIDENT[k]) for _, k, _ in rows)))
    check_launch(world, args.backend, held, f"the benchmark of GPT {args.model}")
    args.groups = memory_groups(rows, config, args, world, weights)
    print(f"data-parallel GPT {args.model} ({weights / 4e6:.0f}M parameters) on "
          + (f"{world}x {torch.cuda.get_device_name()} over NCCL, bf16 autocast" if gpu else
             f"{world} CPU processes over gloo, fp32 (no GPU: a smoke run, not a measurement)")
          + f", torch {torch.__version__}: B={args.batch} per rank, T={args.seq}, AdamW; {args.rounds} rounds of "
          f"{args.steps} steps per variant after {args.warmup} warm-up")
    print_benchmark(launch(benchmark_worker, world, args.backend, args), args, world)

# takeaway: interleaved rounds beside a no-comm row show what communication costs a step, phase by phase.

# --- 7. launching the ranks, and the command line


def gather(obj):
    """obj from every rank, as a list indexed by rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_rank(rank, world, backend, worker, args, tmp):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: the parent stops them all
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # ranks share the cores: left alone, each would start a thread per core and they thrash
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # the timeout turns a rank that never arrives (a crash, an OOM on one GPU) into an error
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout), device_id=device if backend == "nccl" else None)
    try:
        result = worker(rank, world, device, args)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(result, f"{tmp}/result.pt")


def launch(worker, world, backend, args):
    """worker(rank, world, device, args) on every rank; rank 0's result. The ranks are forked on a
    machine without CUDA (they inherit the imported torch: fast) and spawned where CUDA exists, even
    for gloo ranks: once this process has asked the driver anything (is_available does), a forked
    child's first CUDA call fails, and torch's optimizers make one in every step. They meet in a
    file store, and rank 0 hands its result back in a file beside it."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # no line per rank stopped
    with tempfile.TemporaryDirectory() as tmp:
        method = "spawn" if backend == "nccl" or torch.cuda.is_available() else "fork"
        ranks = mp.start_processes(run_rank, (world, backend, worker, args, tmp), world, False, start_method=method)
        try:
            while not ranks.join():
                pass
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (gpt.run_main): no rank outlives the parent
            for process in ranks.processes:
                process.kill()
                process.join()
            raise
        except mp.ProcessRaisedException as e:  # a bug: its traceback
            print(f"error: rank {e.error_index} failed:\n{e}", file=sys.stderr)
            sys.exit(1)
        except mp.ProcessExitedException as e:  # a rank called fail() and said why (2), or was killed
            if e.exit_code is not None and e.exit_code < 0:
                name = signal.Signals(-e.exit_code).name
                fail(f"rank {e.error_index} was killed by {name}" + " (out of memory?)" * (name == "SIGKILL"))
            sys.exit(e.exit_code or 1)
        return torch.load(f"{tmp}/result.pt")


def check_launch(world, backend, rank_bytes, what):
    """Exit 2 with one sentence before starting ranks this machine cannot hold."""
    if backend == "nccl" and world > torch.cuda.device_count():
        fail(f"--world {world} is more than the {torch.cuda.device_count()} GPUs on this machine")
    # a spawned GPU rank imports torch and makes a CUDA context (~2 GiB of host memory); a forked
    # CPU rank shares the parent's torch but holds its own models
    need = world * (rank_bytes + (2**31 if backend == "nccl" else 2**28))
    meminfo = open("/proc/meminfo").read() if os.path.exists("/proc/meminfo") else ""
    free = next((int(ln.split()[1]) * 1024 for ln in meminfo.splitlines() if ln.startswith("MemAvailable:")), None)
    if free is not None and need > free:
        fail(f"{what} on {world} ranks needs about {gib(need)} GiB of host memory; {gib(free)} GiB are free")


def main(argv=None):
    parser = argparse.ArgumentParser(description="All-reduce bandwidth and data-parallel training: DDP, ZeRO, FSDP.")
    sub = parser.add_subparsers(dest="command", required=True)
    ar = sub.add_parser("allreduce", help="all-reduce time and bandwidth table")
    ar.add_argument("--sizes", help="float32 buffer sizes, K/M/G = 2^10/2^20/2^30 bytes "
                                    "(default 1M,10M,100M,1G; 4K,64K,1M on CPU)")
    ar.add_argument("--reps", type=int, default=20, help="timed runs per size (median reported)")
    bm = sub.add_parser("benchmark", help="a GPT training step under every variant, interleaved in rounds")
    bm.add_argument("--model", help="preset (default xl on GPU, tiny on CPU)")
    bm.add_argument("--batch", type=int, help="sequences per rank (default 4; 2 on CPU)")
    bm.add_argument("--seq", type=int, help="context length (default 512; 32 on CPU)")
    bm.add_argument("--vocab", type=int, default=50304, help="vocabulary, padded to a multiple of 128")
    bm.add_argument("--rounds", type=int, help="interleaved rounds (default 30: with 8, paired ratios moved 12%% "
                                               "between runs; 2 on CPU)")
    bm.add_argument("--variants", default=",".join(v for v in VARIANTS if ":fp32" not in v),
                    help=f"comma-separated, from: {','.join(LABELS)}; key:bf16 sends (fsdp: computes with) bf16")
    bm.add_argument("--bucket-mb", type=float, default=25, help="bucket size for BucketDDP, ZeRO and torch DDP")
    bm.add_argument("--plot", help="save the step split per variant to this PNG (needs matplotlib)")
    bm.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    st = sub.add_parser("selftest", help="every wrapper against one process on the whole batch")
    st.add_argument("--steps", type=int, default=3, help="training steps compared")
    for p in (ar, bm):
        p.add_argument("--warmup", type=int, help="untimed runs first (default 5 per size; 3 steps a variant, CPU 1)")
    for p in (ar, bm, st):
        p.add_argument("--world", type=int, help="ranks (default 2; allreduce: 2,4,6,8 as GPUs allow)")
        p.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl with GPUs, else gloo")
        p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait before the run fails")
    args = parser.parse_args(argv)

    gpu = args.backend == "nccl" or (args.backend is None and torch.cuda.is_available())
    args.backend = "nccl" if gpu else "gloo"
    if "RANK" in os.environ:
        fail("ddp.py starts its own ranks, one per GPU: run it with python, not torchrun")
    if gpu and not torch.cuda.is_available():
        fail("--backend nccl needs CUDA GPUs and this machine has none; use --backend gloo")
    for flag, least in (("reps", 1), ("steps", 1), ("batch", 1), ("seq", 1), ("rounds", 1), ("timeout", 1),
                        ("vocab", 1), ("warmup", int(args.command == "benchmark")), ("bucket_mb", 0.001), ("world", 1)):
        if isinstance(getattr(args, flag, None), (int, float)) and getattr(args, flag) < least:
            fail(f"--{flag.replace('_', '-')} must be at least {least:g}, got {getattr(args, flag):g}")
    if args.command == "allreduce":
        return run_allreduce(args, gpu)
    if args.command == "selftest":
        return run_selftest(args, args.world or 2)
    run_benchmark(args, gpu, args.world or 2)

# takeaway: the parent starts a process per rank and stops them all; a killed or failing rank is one clear line.


if __name__ == "__main__":
    run_main(main)  # Ctrl-C / SIGTERM: one line, exit 130 / 143
