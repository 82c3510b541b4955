"""Data parallelism written out: four ways to average gradients (per tensor, one flat buffer, overlapping backward,
~25 MB buckets), then sharding the optimizer state (ZeRO-1), the gradients (ZeRO-2) and the weights (FSDP: each
layer gathered just before it runs). Each is checked against one process on the whole batch, timed against torch's
and traced (communication beside computation, a picture per step), beside the all-reduce they rest on, a bucket
sweep with its overhead model, and the optimizer memory that sharding saves.

    python ddp.py selftest --world 2             # every class against one process on the whole batch
    python ddp.py benchmark --world 2            # GPT xl, B=4 per rank, T=512, bf16: every variant
    python ddp.py benchmark --variants local,torch,bucket,fsdp:bf16 --plot ddp.png
    python ddp.py benchmark --variants naive,overlap,bucket,fsdp:bf16 --trace ddp.json --plot-trace ddp_timeline.png
    python ddp.py benchmark --variants local,torch,bucket --bucket-mb 1,10,100,1000   # bucket sweep beside its model
    python ddp.py benchmark --world 2 --model large --runs 3  # three runs: how far each ratio moves between them
    python ddp.py allreduce --plot allreduce.png # gloo (CPU) beside NCCL (GPU): 1 MiB to 1 GiB, worlds 2, 4, 6
    python ddp.py optimizer-memory --world 2     # AdamW's state per rank, whole vs ZeRO-1, counted vs predicted

Without a GPU everything runs on gloo at tiny sizes: a smoke run, not a measurement.
"""

import argparse
import json
import logging
import math
import os
import signal
import statistics
import sys
import tempfile
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.profiler import ProfilerActivity, profile, record_function

from gpt import (GPT, Timing, check_host_memory, check_output_path, clock, configure_optimizer, elapsed_ms, fail,
                 float_in, free_memory, fully_shard_gpt, gib, int_in, int_list, is_oom, lazily, make_config, on_device,
                 plot_path, plot_to, print_table, round_up, run_main, set_tf32, step_bytes, summarize, synchronize,
                 time_rounds, train_step)

# newer torch names the flat collectives *_single. gloo reduce-scatters by an all-reduce that keeps its slice (twice
# the traffic, fine for a CPU smoke run); NCCL does the real thing. Both average inside.
all_gather_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_into = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
AVG = dist.ReduceOp.AVG

# --- 1. averaging gradients: four wrappers with one interface
def on_gradient(p, method):
    """Call method(p) once p.grad is complete in each backward. Held weakly: a strong reference is a cycle."""
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
        """One all-reduce of a flat copy of the gradients: one latency, full bandwidth, a second gradient buffer."""
        self.check([p for p in params if p.grad is None])
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=AVG)
        for p, part in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(part.view_as(p))

class NaiveDDP(DataParallel):
    """After backward, one blocking all-reduce per gradient: ~580 latencies for GPT-2 xl, nothing computed meanwhile."""
    def finish_gradient_synchronization(self):
        self.check([p for p in self.trainable if p.grad is None])
        for p in self.trainable:
            dist.all_reduce(p.grad, op=AVG)

class FlatDDP(DataParallel):
    def finish_gradient_synchronization(self):
        self.all_reduce_flat(self.trainable)

class OverlapDDP(DataParallel):
    """An asynchronous all-reduce per gradient as backward finishes it: it runs while the layers below compute."""
    def __init__(self, module):
        super().__init__(module)
        self.works = {}
        for p in self.trainable:
            on_gradient(p, self.reduce)

    def reduce(self, p):  # every rank runs the same graph: the hooks fire, the collectives queue, in one order
        self.works[p] = dist.all_reduce(p.grad, op=AVG, async_op=True)

    def finish_gradient_synchronization(self):
        self.check([p for p in self.trainable if p not in self.works])
        for work in self.works.values():
            work.wait()  # on a GPU: the compute stream waits for NCCL's, the CPU goes on
        self.works = {}

def plan_buckets(params, bucket_mb):
    """params in reverse order (roughly the order backward finishes them) in buckets of at most bucket_mb MiB, each of
    one dtype and device; a parameter above the cap gets a bucket of its own."""
    buckets = [[]]
    for p in params[::-1]:
        b = buckets[-1]
        full = sum(q.nbytes for q in b) + p.nbytes > bucket_mb * 2**20
        if b and (full or (p.dtype, p.device) != (b[0].dtype, b[0].device)):
            buckets.append([])
        buckets[-1].append(p)
    return buckets

class BucketDDP(DataParallel):
    """Gradients in ~bucket_mb buckets in reverse order (roughly backward's), each all-reduced once complete. p.grad
    is a view into its bucket, so the average needs no copy back. comm_dtype=bfloat16 sends half."""
    def __init__(self, module, bucket_mb=25, comm_dtype=None):
        super().__init__(module)
        self.comm_dtype, self.world = comm_dtype, dist.get_world_size()
        self.buckets, self.slot = plan_buckets(self.trainable, bucket_mb), {}  # slot: parameter -> (bucket, offset)
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.slot[p] = (i, offset)
                offset += p.numel()
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
        while self.next_bucket < len(self.buckets) and self.complete(self.next_bucket):
            i = self.next_bucket
            grads = self.grads[i]
            sent = grads if self.comm_dtype in (None, grads.dtype) else grads.to(self.comm_dtype)
            self.works.append(self.reduce(i, sent))
            self.next_bucket += 1

    def complete(self, i):
        return self.arrived[i] == len(self.buckets[i])

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
    """BucketDDP with each bucket reduce-scattered (an all-reduce's first half): a rank keeps the average of only its
    1/world slice. ShardedOptimizer steps the slices, then the flat parameter buckets are all-gathered in place."""
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
        rank = dist.get_rank()
        return [all_gather_into(flat, flat.chunk(self.world)[rank], async_op=True) for flat in self.params]

class ShardedOptimizer(torch.optim.Optimizer):
    """AdamW's two fp32 tensors per parameter for ~1/world of the parameters on each rank. ZeRO-1: each parameter
    goes to the least-loaded rank, which steps and broadcasts it. ZeRO-2 (a ZeRO2 wrapper's parameters): each rank
    steps its slice of every bucket, then the wrapper all-gathers the buckets."""
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
            if owner == self.rank:
                mine.append(p)
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
    """Each trainable parameter of 2+ dims is split along dim 0 (padded): .module's parameters become this rank's
    shards, which any torch optimizer steps; 1-D ones stay whole. A unit (an nn.ModuleList entry; unit 0: the rest)
    is all-gathered just before it runs, in compute_dtype (bf16: half the bytes), and freed after, the next unit's
    gather in flight. Gradients are reduce-scattered in fp32 as backward finishes them, 1-D ones all-reduced."""
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
        owned = [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if p is not None]
        for m, name, p in owned:  # every module's own parameters: a tied one under each module that holds it
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
        """p.data becomes this rank's rows; the full tensor the layer computes with has memory only while gathered."""
        padded = p.new_zeros(round_up(p.shape[0], self.world), *p.shape[1:])
        padded[:p.shape[0]] = p.detach()
        full = torch.empty(padded.shape, dtype=self.compute_dtype or p.dtype, device=p.device, requires_grad=True)
        # the all-gather writes through an alias (own version counter): autograd takes no refill for a change
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
        """Point unit u's modules at the gathered weights and compute_dtype copies of the rest; or back."""
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
        differentiable = [t for t in outputs if torch.is_tensor(t) and t.requires_grad]
        if differentiable:
            differentiable[0].register_hook(lambda grad: self.pre_backward(u))  # when the layer's backward starts

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
    """The usual bugs' traps: a tied output layer, a frozen layer, a buffer, an nn.ModuleList, 15 rows to pad."""
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
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

def toy_optimizer(model, kind):
    """SGD, or AdamW with a decayed and an undecayed group; "zero-adamw" shards it, adding a group late."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1)
    optimizer = ShardedOptimizer(groups[:1], torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    optimizer.add_param_group(groups[1])
    return optimizer

def train_toy(model, optimizer, steps, rank=0, world=1, dtype=None, parts=1):
    """Rank r trains on the r-th of world slices of each batch. The one-process reference sums the gradients of
    `parts` slices as the all-reduce does (one 8-row backward adds in another order): on 2 ranks the same bits."""
    device = next(model.parameters()).device
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(15, (8, 6), generator=g).to(device)
        y = torch.randint(15, (8, 6), generator=g).to(device)
        for i in range(rank * parts, (rank + 1) * parts):
            part = slice(i * 8 // (world * parts), (i + 1) * 8 // (world * parts))
            if dtype is None:
                loss = model(x[part], y[part])[1]
            else:  # every parameter cast for the forward, as FSDP computes
                cast = {n: p.to(dtype) for n, p in model.named_parameters()}
                loss = torch.func.functional_call(model, cast, (x[part], y[part]))[1]
            loss.backward()
        if parts > 1:  # the mean over the slices, in fp32 as the ranks take it
            for p in model.parameters():
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
    "naive": (NaiveDDP, "sgd", 2e-6),
    "flat": (FlatDDP, "sgd", 2e-6),
    "overlap": (OverlapDDP, "sgd", 2e-6),
    "bucket": (partial(BucketDDP, bucket_mb=TINY), "sgd", 2e-6),
    "bucket-bf16": (partial(BucketDDP, bucket_mb=TINY, comm_dtype=torch.bfloat16), "sgd", 1e-2),
    "zero1-adamw": (partial(BucketDDP, bucket_mb=TINY), "zero-adamw", 2e-6),
    "zero2-adamw": (partial(ZeRO2, bucket_mb=TINY), "zero-adamw", 2e-6),
    "fsdp": (FSDP, "sgd", 2e-6),
    "fsdp-adamw": (FSDP, "adamw", 2e-6),
    "fsdp-fp16": (partial(FSDP, compute_dtype=torch.float16), "sgd", 2e-6),
}

def selftest_worker(rank, world, device, steps, variants):
    """Per variant: every rank's weights against one process from rank 0's initial weights; FSDP's gradients
    shaped like the shards, in fp32, the replicated ones equal on all ranks; ZeRO's state split between ranks."""
    rows = []
    for name, (wrapper, kind, tol) in variants.items():
        torch.manual_seed(100 + rank)  # different weights on every rank until the wrapper syncs them
        wrapped = wrapper(ToyModel().to(device))
        initial, optimizer = toy_state(wrapped), toy_optimizer(wrapped.module, kind)
        train_toy(wrapped, optimizer, steps, rank, world)
        final, ok = gather(toy_state(wrapped)), True
        if isinstance(wrapped, FSDP):  # one more backward: the gradients as the optimizer would see them
            train_toy(wrapped, None, 1, rank, world)
            shaped = all(p.grad.dtype == torch.float32 and p.grad.shape == p.shape for p in wrapped.trainable)
            replicated = gather([p.grad.cpu() for p in wrapped.replicated])
            ok = all(gather(shaped))
            ok &= all(torch.equal(a, b) for r in replicated for a, b in zip(r, replicated[0]))
        if isinstance(optimizer, ShardedOptimizer):  # every parameter's state on one rank, no rank with all of it
            held = gather(sum(p.numel() for p in optimizer.local.state) if optimizer.local else 0)
            ok &= sum(held) == sum(p.numel() for p in wrapped.trainable)
            ok &= world == 1 or max(held) < sum(held)
        if rank == 0:
            dtype = getattr(wrapped, "compute_dtype", None)
            error, exact, same = against_one_process(initial, final, kind, steps, world, dtype, tol, device)
            tolerance = "bitwise" if exact else f"{tol:.0e}"
            rows.append([name, f"{error:.1e}", tolerance, "ok" if ok and same else "FAIL"])
    return rows

def against_one_process(initial, final, kind, steps, world, dtype, tol, device):
    """(largest error, whether bits were asked for, whether every rank matched) against one process trained from
    the same initial weights on the whole batch, on the ranks' device (fp16 on a CPU rounds differently)."""
    reference = ToyModel().to(device)
    reference.load_state_dict(initial, strict=False)  # (the tied output layer comes with embed)
    train_toy(reference, toy_optimizer(reference, kind.removeprefix("zero-")), steps, dtype=dtype, parts=world)
    ref = toy_state(reference)
    error = max((state[k] - w).abs().max().item() for state in final for k, w in ref.items())
    exact = world == 2 and dtype is None and tol < 1e-5  # fp32 on 2 ranks: bit for bit (see train_toy)
    if exact:
        return error, exact, all(torch.equal(state[k], w) for state in final for k, w in ref.items())
    return error, exact, error <= tol

def run_selftest(world, backend, steps, timeout):
    if 8 % world:  # equal slices: the mean of their mean losses is the whole batch's
        fail(f"--world {world}: the selftest's batch of 8 sequences splits evenly over 1, 2, 4 or 8 ranks")
    check_launch(world, backend, 0, "the selftest")
    print(f"selftest: every wrapper on {world} ranks ({backend}) vs one process, {steps} steps")
    # the variants travel with the worker: a spawned rank imports ddp afresh (a test may have added one)
    rows = launch(partial(selftest_worker, steps=steps, variants=dict(TOY_VARIANTS)), world, backend, timeout)
    print_table(["variant", "max |w - reference| on any rank", "tolerance", "result"], rows)
    failed = [r[0] for r in rows if r[-1] != "ok"]
    summary = f"selftest: {len(rows) - len(failed)} of {len(rows)} variants match one-process training"
    if failed:
        summary += f"; FAILED: {', '.join(failed)}"
    print(summary)
    sys.exit(1 if failed else 0)

# takeaway: fp32 on two ranks must reproduce one process bit for bit; a missed or doubled average shows.

# --- 5. all-reduce bandwidth: small messages pay latency, large ones the link's bandwidth
MiB = 2**20

def comma_numbers(text, low, what):
    """A comma list of numbers, each at least low ("0.5,10" -> [0.5, 10.0]); `what` names them in the error."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected a comma list of {what}, got '{text}'")
    return [float_in(low)(item) for item in items]

def size_list(text):
    """type= for --sizes: a comma list of MiB, each holding at least one float32."""
    sizes = comma_numbers(text, 0, "sizes in MiB")
    if min(sizes) * MiB < 4:
        raise argparse.ArgumentTypeError(f"a size must hold at least one float32 (4 bytes), got {min(sizes):g} MiB")
    return sizes

def float32_count(mb):
    return max(1, round(mb * MiB / 4))

def size_label(mb):
    return f"{mb / 1024:g} GiB" if mb >= 1024 else f"{mb:g} MiB"

def time_allreduce(n, rank, world, device, warmup, iters):
    """(this rank's ms per all-reduce of n float32 over the timed iterations, whether every sum was exact), or
    None where a rank had no memory for the buffer: then every rank skips the size together."""
    try:
        x = torch.empty(n, device=device)
    except RuntimeError as e:
        if not is_oom(e):
            raise
        x = None
    if not all(gather(x is not None)):
        return None
    expected = world * (world + 1) / 2  # rank r sends r + 1: a sum of small integers, exact in float32
    times, exact = [], True
    for i in range(warmup + iters):
        x.fill_(rank + 1)
        dist.barrier()  # start together, or a late rank's delay is timed as transfer
        synchronize(device)
        start = clock(device)
        dist.all_reduce(x)  # a sum, as nccl-tests measure it
        ms = elapsed_ms(start, clock(device))
        exact &= bool(x.eq(expected).all())  # (after the clock: the check is not timed)
        if i >= warmup:
            times.append(ms)
    return times, exact

def allreduce_worker(rank, world, device, sizes, warmup, iters):
    """{MiB: [every rank's (ms per iteration, exact)] or None (out of memory)}, gathered to rank 0."""
    results = {}
    for mb in sizes:
        results[mb] = gather(time_allreduce(float32_count(mb), rank, world, device, warmup, iters))
        results[mb] = None if None in results[mb] else results[mb]
    return results

def allreduce_row(backend, world, mb, per_rank):
    """One table row: the statistics over every rank's iterations, and the bandwidths from their mean."""
    name = f"{backend} ({'GPU' if backend == 'nccl' else 'CPU'})"
    if per_rank is None:
        return [name, world, size_label(mb)] + ["OOM"] * 7, None
    timing = summarize({"all": [ms for times, _ in per_rank for ms in times]})["all"]
    algbw = 4 * float32_count(mb) / timing.mean / 1e6  # bytes per ms / 1e6 = GB/s
    busbw = algbw * 2 * (world - 1) / world  # nccl-tests: a rank sends and receives 2(n-1)/n of the buffer
    rank_means = "/".join(f"{statistics.fmean(times):.3g}" for times, _ in per_rank)
    exact = all(ok for _, ok in per_rank)
    return [name, world, size_label(mb), timing.mean_std(3), f"{timing.low:.3f}", f"{timing.high:.3f}", rank_means,
            f"{algbw:.3g}", f"{busbw:.3g}", "yes" if exact else "NO"], busbw

def allreduce_runs(backend, worlds, asked, gpus):
    """([(backend, world)] to run, the NCCL worlds left out): gloo takes any world (CPU processes), NCCL a GPU
    per rank."""
    backends = ["gloo", "nccl"] if backend == "both" else [backend]
    too_big = [w for w in worlds if w > gpus] if "nccl" in backends else []
    if backend == "nccl" and too_big and asked:
        fail(f"--worlds {too_big[0]} is more than the {gpus} GPUs on this machine (NCCL takes one GPU per rank)")
    runs = [(b, w) for w in worlds for b in backends if b == "gloo" or w <= gpus]
    if not runs:
        fail(f"an NCCL all-reduce needs at least 2 GPUs and this machine has {gpus}; use --backend gloo")
    return runs, too_big

def plot_bus_bandwidth(path, curves):
    """curves: {(backend, world): ([bytes], [GB/s])}, a line each."""
    fig, ax = plot_to(path).subplots(figsize=(7, 4.5))
    for (backend, world), (sizes, busbw) in curves.items():
        ax.plot(sizes, busbw, marker="o", label=f"{backend}, {world} ranks")
    ax.set(xscale="log", yscale="log", xlabel="all-reduce size (bytes, float32)", ylabel="bus bandwidth (GB/s)",
           title=f"all-reduce bus bandwidth, torch {torch.__version__}")
    ax.legend()
    fig.savefig(path, bbox_inches="tight")
    print(f"plot saved to {path}")

def run_allreduce(device, backend, sizes, worlds, warmup, iters, plot, timeout):
    gpus = torch.cuda.device_count()
    default_worlds = on_device(device, cpu=[2, 4], gpu=[2, 4, 6] + ([8] if gpus >= 8 else []))
    runs, skipped = allreduce_runs(backend, worlds or default_worlds, worlds is not None, gpus)
    sizes = sizes or on_device(device, cpu=[0.1, 1, 10, 100], gpu=[1, 10, 100, 1024])
    warmup = on_device(device, cpu=2, gpu=5) if warmup is None else warmup
    iters = iters or on_device(device, cpu=10, gpu=20)
    for b, world in runs:  # gloo: the buffer, gloo's copies of it and the check, ~3x on every rank
        rank_bytes = 3 * 4 * float32_count(max(sizes)) if b == "gloo" else 0
        check_launch(world, b, rank_bytes, f"a {b} all-reduce of {size_label(max(sizes))}", "lower --sizes or --worlds")
    where = "gloo on CPU processes"
    if backend == "nccl":
        where = f"NCCL on {torch.cuda.get_device_name()} GPUs"
    elif backend == "both":
        where += f" and NCCL on {torch.cuda.get_device_name()} GPUs"
    defaults = on_device(device, cpu=" (CPU defaults: small sizes, worlds 2 and 4; a smoke run, not a measurement)",
                         gpu="")
    print(f"all-reduce of float32, {where}, torch {torch.__version__}: {warmup} warm-up then {iters} timed "
          f"iterations, a barrier before each{defaults}")
    if skipped:
        print(f"NCCL skips world {', '.join(map(str, skipped))}: this machine has {gpus} GPU(s), one per rank")
    measured = {}  # (world, MiB, backend): every rank's results
    for b, world in runs:
        print(f"  {b} on {world} ranks", flush=True)
        results = launch(partial(allreduce_worker, sizes=sizes, warmup=warmup, iters=iters), world, b, timeout)
        measured.update({(world, mb, b): per_rank for mb, per_rank in results.items()})
    print_allreduce(measured, plot)

def print_allreduce(measured, plot):
    """The table (gloo and NCCL rows of a world and size next to each other), the plot and the summary."""
    rows, curves, best = [], {}, None
    for (world, mb, backend), per_rank in sorted(measured.items()):
        row, busbw = allreduce_row(backend, world, mb, per_rank)
        rows.append(row)
        if busbw is not None:
            nbytes, bandwidths = curves.setdefault((backend, world), ([], []))
            nbytes.append(4 * float32_count(mb))
            bandwidths.append(busbw)
            best = row if best is None or busbw > float(best[8]) else best
    print_table(["backend", "world", "size", "ms mean ± std", "min ms", "max ms", "each rank's mean ms",
                 "algbw GB/s", "busbw GB/s", "sum exact"], rows)
    print("over every rank's timed iterations; algbw = bytes / mean time; busbw = algbw x 2(n-1)/n (nccl-tests' "
          "all-reduce definition: it compares across world sizes and with link speeds); GB = 1e9 bytes")
    if plot:
        plot_bus_bandwidth(plot, curves)
    wrong = [f"{r[0]} world {r[1]} {r[2]}" for r in rows if r[-1] == "NO"]
    if wrong:
        print(f"summary: WRONG all-reduce sums: {'; '.join(wrong)}")
        sys.exit(1)
    if best is None:
        print("summary: every size was out of memory")
    else:
        print(f"summary: every sum exact; the highest bus bandwidth, {best[8]} GB/s, is {best[0]} on {best[1]} ranks "
              f"at {best[2]}")

# takeaway: a collective costs a latency plus bytes over bandwidth; few large messages beat many small ones.

# --- 6. optimizer state: AdamW's moments whole on every rank, or sharded (ZeRO-1), counted against the arithmetic
SHARDING = {"BucketDDP": "bucket", "ZeRO-1": "sharded"}  # AdamW on every rank, or ShardedOptimizer(AdamW)

def stepped_here(optimizer):
    """The parameters whose AdamW state this rank keeps: all of them, or ShardedOptimizer's share."""
    if isinstance(optimizer, ShardedOptimizer):
        return [p for p, owner in optimizer.owners if owner == optimizer.rank]
    return [p for group in optimizer.param_groups for p in group["params"]]

def held_bytes(wrapped, optimizer):
    """(parameters, gradients, optimizer state) bytes this rank holds, counted tensor by tensor."""
    params = sum(p.nbytes for p in wrapped.module.parameters())  # (a tied one once)
    grads = sum(g.nbytes for g in wrapped.grads if g is not None)  # BucketDDP's p.grad are views into its buckets
    inner = optimizer.local if isinstance(optimizer, ShardedOptimizer) else optimizer  # (None: it steps nothing)
    states = inner.state.values() if inner is not None else []
    state = sum(t.nbytes for s in states for t in s.values() if torch.is_tensor(t))
    return params, grads, state

def predicted_bytes(wrapped, optimizer, point):
    """The arithmetic: 4 bytes a parameter for fp32 weights, 4 for gradients once backward ran, and once the
    optimizer stepped, AdamW's 8 (two fp32 moments) and a 4-byte step count per tensor, for those this rank steps."""
    total = 4 * sum(p.numel() for p in wrapped.module.parameters())
    if point != "built":
        total += 4 * sum(p.numel() for p in wrapped.trainable)
    if point == "after step":
        mine = stepped_here(optimizer)
        total += 8 * sum(p.numel() for p in mine) + 4 * len(mine)
    return total

def measure_first_step(key, setup, rank, device):
    """{point: (params, grads, state, predicted, live, peak)} bytes at three points of this rank's first step. live:
    memory_allocated on a GPU (peak: max_memory_allocated), the counted bytes on a CPU (peak: None)."""
    cuda = device.type == "cuda"
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    wrapped, optimizer, sync, x, y = build_variant(key, False, setup, rank, device)
    points = {}

    def record(point):
        synchronize(device)
        counted = held_bytes(wrapped, optimizer)
        live = torch.cuda.memory_allocated(device) - base if cuda else sum(counted)
        peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
        points[point] = (*counted, predicted_bytes(wrapped, optimizer, point), live, peak)

    def mark(phase):  # gpt.train_step calls it after forward, backward and the optimizer step
        if phase == "backward":
            sync()
            record("before step")
        elif phase == "optimizer":
            record("after step")

    record("built")
    train_step(wrapped, optimizer, x, y, on_device(device, cpu=None, gpu=torch.bfloat16), mark=mark)
    return points

def optimizer_memory_worker(rank, world, device, setup):
    """({label: every rank's measure_first_step}, {label: timed result}): the memory of each variant alone, then
    both timed in rounds."""
    set_tf32(True)  # as the benchmark times its steps
    memory = {}
    for label, key in SHARDING.items():
        memory[label] = gather(measure_first_step(key, setup, rank, device))
        free_memory()  # the variant's model is gone with measure_first_step's frame
    timed = {}
    time_group([Variant(label, key, False, setup.bucket_mb, key) for label, key in SHARDING.items()], timed, setup,
               rank, device, "BucketDDP")
    return memory, timed

def run_optimizer_memory(setup, config, world, backend, timeout):
    gpu = backend == "nccl"
    weights, where = prepare_run(setup, config, world, backend, SHARDING.values(), "the optimizer-memory run")
    print(f"optimizer state per rank, GPT {setup.model} ({weights / 4e6:.1f}M parameters) on {where}, torch "
          f"{torch.__version__}: B={setup.batch} per rank, T={setup.seq}; BucketDDP with AdamW on every rank vs "
          "ZeRO-1 (BucketDDP with ShardedOptimizer(AdamW)), bytes at the first step")
    memory, timed = launch(partial(optimizer_memory_worker, setup=setup), world, backend, timeout)
    print_optimizer_memory(memory, timed, world, gpu, setup)

def print_optimizer_memory(memory, timed, world, gpu, setup):
    unit, scale = ("GiB", 2**30) if gpu else ("MiB", 2**20)
    rows = []
    for label, ranks in memory.items():
        for rank, points in enumerate(ranks):
            for point, (params, grads, state, predicted, live, peak) in points.items():
                cells = [f"{b / scale:.3f}" for b in (params, grads, state, predicted, live)]
                rows.append([label, rank, point, *cells, "n/a" if peak is None else f"{peak / scale:.3f}"])
    print_table(["variant", "rank", "point", f"params {unit}", f"grads {unit}", f"optimizer state {unit}",
                 f"predicted {unit}", f"live {unit}", f"peak {unit}"], rows)
    live = "memory_allocated; peak: max_memory_allocated since the model was built"
    if not gpu:
        live = "the counted bytes (a CPU has no allocator to ask)"
    print("counted: the parameters, BucketDDP's gradient buckets and the optimizer's state tensors; predicted: 4 bytes "
          "a parameter, +4 once backward ran, +8 (AdamW's moments) and 4 per tensor (its step) for the parameters this "
          f"rank steps; live: {live}")
    print()
    print_table(["variant", "step ms", "mean ± std ms", f"vs {next(iter(timed))} (paired)", "optimizer ms", "peak GiB"],
                [timed_row(label, r) for label, r in timed.items()])
    print(f"step: median (min-max) over {setup.rounds} rounds of {setup.steps} steps, the slowest rank's; optimizer: "
          "the median optimizer phase (ZeRO-1's includes broadcasting the parameters it stepped)")
    full = max(points["after step"][2] for points in memory["BucketDDP"])
    sharded = max(points["after step"][2] for points in memory["ZeRO-1"])
    ratio = timed.get("ZeRO-1", {}).get("timing", {}).get("ratio")
    print(f"summary: ZeRO-1's fullest rank keeps {sharded / full:.0%} of AdamW's state (1/world = {1 / world:.0%})"
          + ("" if ratio is None else f"; its step takes {ratio:.2f}x BucketDDP's"))

def timed_row(label, result):
    if result["oom"]:
        return [label] + ["OOM"] * 5
    timing = Timing(**result["timing"])
    peak = "n/a" if result["peak"] is None else gib(result["peak"])
    return [label, timing.ms(1), timing.mean_std(1), timing.vs(), f"{result['phases'][3]:.1f}", peak]

# takeaway: ZeRO-1 splits by whole parameters: even for GPT xl, lopsided where one tensor (an embedding) dominates.

# --- 7. benchmark: the same GPT step under every variant, interleaved in rounds
LABELS = {"local": "local (no comm)", "torch": "torch DDP", "naive": "NaiveDDP", "flat": "FlatDDP",
          "overlap": "OverlapDDP", "bucket": "BucketDDP", "sharded": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "FSDP",
          "fsdp2": "torch FSDP2"}
# what a variant keeps between steps, in fp32 weights (AdamW's moments are two): (whole, split over the ranks)
RESIDENT = {"local": (3, 0), "torch": (4, 0), "naive": (3, 0), "flat": (4, 0), "overlap": (3, 0), "bucket": (4, 0),
            "sharded": (2, 2), "zero2": (1, 3), "fsdp": (0, 4), "fsdp2": (0, 4)}
# key:bf16 is what torch DDP, BucketDDP and ZeRO send, and what FSDP gathers and computes with; key:fp32 is key
BF16_KEYS = ("torch", "bucket", "sharded", "zero2", "fsdp")
BUCKETED = ("bucket", "sharded", "zero2")  # built with --bucket-mb: a sweep runs them once per size
VARIANTS = [name for key in LABELS for name in (key, key + ":fp32", key + ":bf16")
            if not name.endswith(":bf16") or key in BF16_KEYS]

def variant_list(text):
    """type= for --variants: a comma list of VARIANTS."""
    variants = [v.strip() for v in text.split(",") if v.strip()]
    if not variants:
        raise argparse.ArgumentTypeError(f"empty; choose from {', '.join(LABELS)}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown[0]!r}; choose from {', '.join(LABELS)} (key:bf16 for "
                                         f"{', '.join(BF16_KEYS)})")
    return variants

def bucket_list(text):
    """type= for benchmark's --bucket-mb: a comma list of bucket sizes in MB, each once ("1,10" -> [1.0, 10.0])."""
    sizes = comma_numbers(text, 0.001, "bucket sizes in MB")
    twice = [mb for mb in sizes if sizes.count(mb) > 1]
    if twice:
        raise argparse.ArgumentTypeError(f"{twice[0]:g} MB is listed twice")
    return sizes

@dataclass(frozen=True)
class Variant:
    """One benchmark row: the wrapper's key, whether it sends bf16 (FSDP: gathers and computes in it), the bucket
    size it is built with, and its name in file names (--trace ddp.json writes ddp.<tag>.json)."""
    label: str
    key: str
    bf16: bool
    bucket_mb: float
    tag: str

@dataclass(frozen=True)
class StepSetup:
    """What every rank's GPT step trains and how it is timed: plain values, which travel to spawned ranks."""
    model: str
    vocab: int
    batch: int
    seq: int
    bucket_mb: float
    warmup: int
    rounds: int
    steps: int

def build_variant(key, bf16, setup, rank, device):
    """GPT under one variant: (the model as trained, its optimizer, the gradient sync after backward, x, y)."""
    torch.manual_seed(rank)
    with torch.device(device):
        model = wrapped = GPT(make_config(setup.model, vocab_size=setup.vocab))
    dtype = torch.bfloat16 if bf16 else None
    if key == "torch":
        ids = [device.index] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=setup.bucket_mb)
        if dtype:
            wrapped.register_comm_hook(None, bf16_compress_hook)
    elif key in ("bucket", "sharded"):
        wrapped = BucketDDP(model, setup.bucket_mb, dtype)
    elif key == "zero2":
        wrapped = ZeRO2(model, setup.bucket_mb, dtype)
    elif key == "fsdp":
        wrapped = FSDP(model, dtype)
    elif key == "fsdp2":
        fully_shard_gpt(model, torch.bfloat16)
    elif key != "local":
        wrapped = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP}[key](model)
    optimizer = configure_optimizer(model, lr=3e-4)
    if key in ("sharded", "zero2"):  # the same AdamW (groups, betas), its state sharded
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
        fused = device.type == "cuda"
        optimizer = ShardedOptimizer(groups, torch.optim.AdamW, lr=3e-4, betas=(0.9, 0.95), fused=fused)
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(50257, (setup.batch, setup.seq + 1), generator=generator)
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # random: speed does not depend on what they say
    sync = getattr(wrapped, "finish_gradient_synchronization", None) or no_sync  # torch's sync inside backward
    return wrapped, optimizer, sync, x, y

def no_sync():
    pass

def make_step(key, bf16, setup, rank, device, marks):
    """One GPT training step (gpt.train_step) under one variant; it appends to marks a step's clock() at the start
    and after each phase: forward, backward, the gradient sync, the optimizer."""
    wrapped, optimizer, sync, x, y = build_variant(key, bf16, setup, rank, device)
    dtype = on_device(device, cpu=None, gpu=torch.bfloat16)

    def mark(phase):  # train_step calls it after forward, backward and the optimizer
        marks[-1].append(clock(device))
        if phase == "backward":  # the wrapper's average: a phase of its own between backward and the optimizer
            sync()
            marks[-1].append(clock(device))

    def step():
        marks.append([clock(device)])
        train_step(wrapped, optimizer, x, y, dtype, mark=mark)
    return step

def memory_groups(rows, config, batch, seq, backend, world, weights):
    """The rows in groups that fit on one GPU together (CPU: one group). torch DDP is in every group, so that
    every ratio is paired; the no-comm row too where it fits beside the largest variant, else it is timed in a
    group of its own like any other row (an xl model on an 80 GB card: torch DDP, no-comm and one more
    variant would hold 10 or 11 fp32 copies of the weights)."""
    if backend != "nccl":
        return [rows]
    # on top of what all keep: one step's gradients and activations (~34 bytes a token, layer and width in bf16)
    smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(world))
    budget = 0.9 * smallest - weights - 34 * batch * seq * config.n_embd * config.n_layer

    def held(group):  # each variant's resident copies of the weights; sharded copies are 1/world of them
        return weights * sum(RESIDENT[v.key][0] + RESIDENT[v.key][1] / world for v in group)

    torch_ddp = [v for v in rows if v.key == "torch" and not v.bf16]
    no_comm = [v for v in rows if v.key == "local" and not v.bf16]
    rest = [r for r in rows if r not in torch_ddp + no_comm]
    shared = torch_ddp + no_comm
    if rest and max(held(shared + [row]) for row in rest) > budget:
        shared, rest = torch_ddp, no_comm + rest
    groups = [list(shared)]
    for row in rest:
        if len(groups[-1]) > len(shared) and held(groups[-1] + [row]) > budget:
            groups.append(list(shared))
        groups[-1].append(row)
    return groups

def all_ranks_synchronize(device):  # a round ends on every rank before any goes on
    synchronize(device)
    dist.barrier()

def phase_medians(marks):
    """Median ms of each phase over the steps, from each step's clocks (start, then after each phase)."""
    per_step = [[elapsed_ms(a, b) for a, b in zip(clocks, clocks[1:])] for clocks in marks]  # steps x phases
    return [statistics.median(ms) for ms in zip(*per_step)]

def time_group(group, results, setup, rank, device, baseline=LABELS["torch"], trace=None):
    """Warm up each variant (peak: the timer's less the others'), drop any out of memory on a rank, time the rest;
    then, with a trace path, profile those not yet traced (a variant in every group is traced once)."""
    cuda, local = device.type == "cuda", LABELS["local"]
    marks = {v.label: [] for v in group}
    steps = {v.label: lazily(partial(make_step, v.key, v.bf16, replace(setup, bucket_mb=v.bucket_mb), rank, device,
                                     marks[v.label]), device) for v in group}
    warm, peaks = time_rounds(steps, device, rounds=0, warmup=setup.warmup)  # out of memory: None
    fits = [all(ok) for ok in zip(*gather([warm[label] is not None for label in steps]))]
    steps = {label: step for (label, step), ok in zip(steps.items(), fits) if ok}
    for v in group:
        if v.label not in steps:
            results.setdefault(v.label, {"oom": True})
    free_memory()  # (a variant out of memory on another rank lets go of its model here)
    every = gather(time_rounds(steps, device, setup.rounds, setup.steps, warmup=0,
                               sync=partial(all_ranks_synchronize, device))[0])
    # a round takes as long as its slowest rank
    times = {label: [max(r[label][i] for r in every) for i in range(setup.rounds)] for label in steps}
    timings = summarize(times, baseline=baseline if baseline in times else None)
    fastest = timings[baseline].low if baseline in timings else None  # torch DDP's fastest round in these rounds
    split = gather({label: phase_medians(marks[label][setup.warmup:]) for label in steps})
    own = gather({label: peaks[label] - steps[label].state["others"] for label in steps} if cuda else {})
    for label in steps:
        exposed = [a - b for a, b in zip(times[label], times[local])] if local in times else None
        results.setdefault(label, {
            "oom": False, "timing": vars(timings[label]), "peak": max(r[label] for r in own) if cuda else None,
            "phases": [statistics.fmean(ms) for ms in zip(*(r[label] for r in split))],  # mean over ranks
            "exposed": statistics.median(exposed) if exposed else None,
            "fastest": timings[label].low / fastest if fastest else None})
    if trace:
        paths = {v.label: trace_file(trace, v.tag) for v in group if "trace" not in results[v.label]}
        trace_steps({label: steps[label] for label in paths if label in steps}, paths, rank, device)
        for label in paths:
            results[label]["trace"] = paths[label] if label in steps else None

def benchmark_worker(rank, world, device, setup, groups, trace=None, fit_bytes=None):
    """{"rows": {label: result} of every group's rows, "fit": the all-reduce model's (o, w) or None}."""
    set_tf32(True)
    fit = None
    if fit_bytes:  # first, while the GPU holds no model: the buffer is the largest bucket swept
        fit = allreduce_fit(rank, world, device, fit_bytes)
    results = {}
    for g, group in enumerate(groups):
        if rank == 0:
            print(f"  group {g + 1} of {len(groups)}: {', '.join(v.label for v in group)}", flush=True)
        time_group(group, results, setup, rank, device, trace=trace)
        free_memory()  # the group's models are gone with time_group's frame
    return {"rows": results, "fit": fit}

def memory_vs_torch(result, base):
    """' (0.52x)': a variant's peak against torch DDP's, where both were measured."""
    if result.get("peak") and base.get("peak"):
        return f" ({result['peak'] / base['peak']:.2f}x)"
    return ""

def benchmark_row(label, result, base, no_comm, gpu):
    if result["oom"]:
        return [label] + ["OOM"] * 8
    timing = Timing(**result["timing"])
    exposed = "-"  # the no-comm row itself, or no no-comm row to compare with
    if label != LABELS["local"] and result["exposed"] is not None:  # paired with no-comm in the same rounds
        exposed = f"{result['exposed']:.1f}"
    elif label != LABELS["local"] and no_comm and not no_comm["oom"]:  # no-comm timed in another group: unpaired
        exposed = f"{timing.median - no_comm['timing']['median']:.1f}*"
    if not gpu and exposed != "-":  # a smoke run's difference of two medians is noise, negative as often as not
        exposed = "n/a"
    peak = "n/a" if result["peak"] is None else gib(result["peak"]) + memory_vs_torch(result, base)
    return [label, timing.ms(1), timing.vs(), exposed, *(f"{ms:.1f}" for ms in result["phases"]), peak]

def plot_phases(path, done, title):
    fig, ax = plot_to(path).subplots(figsize=(8, 1 + 0.4 * len(done)))
    for k, phase in enumerate(["forward", "backward", "comm wait", "optimizer"]):
        ax.barh(list(done), [r["phases"][k] for r in done.values()],
                left=[sum(r["phases"][:k]) for r in done.values()], label=phase)
    ax.invert_yaxis()
    ax.set(xlabel="ms per step (median phases)", title=title)
    ax.legend()
    fig.savefig(path, bbox_inches="tight")
    print(f"plot saved to {path}")

def print_benchmark(rows, setup, world, plot, gpu):
    base, no_comm = rows.get(LABELS["torch"], {}), rows.get(LABELS["local"])
    table = [benchmark_row(label, r, base, no_comm, gpu) for label, r in rows.items()]
    print_table(["variant", "step ms", "vs torch DDP (paired)", "exposed comm ms", "fwd ms", "bwd ms", "wait ms",
                 "optim ms", "peak GiB (vs torch DDP)"], table)
    exposed = "median of (step - no-comm step)"
    if any(row[3].endswith("*") for row in table):
        exposed += (" in the same rounds; *: the no-comm model did not fit beside that variant and was timed in "
                    "another group, so the difference of the two medians, unpaired")
    if not gpu:
        exposed = ("n/a on the CPU: the difference of two medians of a smoke run is within its noise (CPU runs gave "
                   "values below zero), so it says nothing about communication; a GPU run gives the median of "
                   "(step - no-comm step)")
    print(f"step: median (min-max) over {setup.rounds} rounds of {setup.steps} steps, the slowest rank's; ratios "
          f"paired in rounds. exposed comm: {exposed}. fwd/bwd/wait/optim: medians, mean over "
          "ranks (torch DDP and FSDP2 wait inside bwd). peak: allocated, the variant's own, largest rank")
    if plot:
        done = {label: r for label, r in rows.items() if not r["oom"]}
        plot_phases(plot, done, f"GPT {setup.model}, {world} ranks, B={setup.batch} T={setup.seq}")

def print_summary(rows):
    base = rows.get(LABELS["torch"], {})
    parts = [f"{label} {r['timing']['ratio']:.2f}x{memory_vs_torch(r, base)}" for label, r in rows.items()
             if not r["oom"] and r["timing"]["ratio"] and label != LABELS["torch"]]
    print("summary: step (memory) vs torch DDP's: " + ("; ".join(parts) or "no torch DDP row to compare with"))

def benchmark_rows(variants, gpu, sizes=(25,)):
    """A Variant per variant asked for, those built with --bucket-mb once per size where several are given; torch's
    bf16 hook needs NCCL, so the CPU leaves it out."""
    rows = []
    for variant in variants:
        key, _, dtype = variant.partition(":")
        bf16 = dtype == "bf16"
        if key == "torch" and bf16 and not gpu:
            continue
        label, tag = LABELS[key], key
        if bf16:
            label += " bf16 compute" if key == "fsdp" else " bf16 comm"
            tag += "-bf16"
        if key not in BUCKETED or len(sizes) == 1:
            rows.append(Variant(label, key, bf16, sizes[0], tag))
            continue
        rows += [Variant(f"{label} {mb:g} MB", key, bf16, mb, f"{tag}-{mb:g}mb") for mb in sizes]
    return rows

def prepare_run(setup, config, world, backend, keys, what):
    """Exit 2 where this machine cannot hold the run (on a CPU: every variant's model and state in host memory at
    once, and one step's activations); else (the fp32 weights' bytes, where it runs in words)."""
    with torch.device("meta"):
        weights = 4 * GPT(config).num_params()
    held = int(weights * (1 + sum(sum(RESIDENT[k]) for k in keys)) + step_bytes(config, setup.batch, setup.seq, False))
    if backend == "nccl":
        held = 0
    check_launch(world, backend, held, f"{what} of GPT {setup.model}")
    if backend == "nccl":
        return weights, f"{world}x {torch.cuda.get_device_name()} over NCCL, bf16 autocast"
    return weights, f"{world} CPU processes over gloo, fp32 (no GPU: CPU defaults, a smoke run, not a measurement)"

def check_benchmark_flags(rows, sizes, trace, plot_trace, runs):
    """Exit 2 with one sentence before any rank starts: flags that cannot work together, a trace file in the way."""
    if runs > 1 and trace:
        fail(f"--runs {runs} would write each trace {runs} times over: trace one run (drop --runs), or drop --trace")
    if len(sizes) > 1 and not any(v.key in BUCKETED for v in rows):
        fail(f"--bucket-mb {','.join(f'{mb:g}' for mb in sizes)} sweeps the bucketed variants: add bucket, sharded "
             "or zero2 to --variants")
    if plot_trace and not trace:
        fail("--plot-trace draws the traces --trace writes: add --trace PATH.json")
    if trace is not None and not trace.endswith(".json"):
        fail(f"--trace {trace}: expected a .json file name (a Chrome/Perfetto trace; each variant's goes beside it)")
    try:
        for v in rows if trace is not None else []:
            check_output_path(trace_file(trace, v.tag), "--trace", ours=is_json)
    except ValueError as e:
        fail(str(e))

def run_benchmark(setup, config, variants, sizes, world, backend, outputs, timeout, runs=1):
    """outputs: (--plot, --trace, --plot-trace) paths or None. runs > 1: the whole benchmark again, fresh ranks each
    time, then how far each ratio moved between the runs."""
    plot, trace, plot_trace = outputs
    gpu = backend == "nccl"
    rows = benchmark_rows(variants, gpu, sizes)
    check_benchmark_flags(rows, sizes, trace, plot_trace, runs)
    weights, where = prepare_run(setup, config, world, backend, [v.key for v in rows], "the benchmark")
    groups = memory_groups(rows, config, setup.batch, setup.seq, backend, world, weights)
    print(f"data-parallel GPT {setup.model} ({weights / 4e6:.0f}M parameters) on {where}, torch {torch.__version__}: "
          f"B={setup.batch} per rank, T={setup.seq}, AdamW; {setup.rounds} rounds of {setup.steps} steps per variant "
          f"after {setup.warmup} warm-up")
    plan = f"{len(rows)} variants"
    if len(sizes) > 1:
        plan += f" (bucketed ones at {', '.join(f'{mb:g}' for mb in sizes)} MB; torch DDP at {sizes[0]:g})"
    if len(groups) > 1:  # torch DDP (and no-comm, where it fits) is timed again in every group: every ratio is paired
        again = "the no-comm and torch DDP models"
        if not all(any(v.key == "local" for v in group) for group in groups):
            again = "torch DDP (the no-comm model does not fit beside every variant: it is timed once)"
        plan += (f" in {len(groups)} groups that fit on a GPU together, each also timing {again} "
                 f"({sum(len(group) for group in groups)} timed in all)")
    rounds = f"{setup.rounds} round{'s' if setup.rounds > 1 else ''}"
    print(f"benchmark: {plan} x {rounds}; --variants narrows it (e.g. --variants local,torch,bucket), "
          f"--rounds shortens it", flush=True)
    swept = [v for v in rows if v.key == "bucket" and len(sizes) > 1]
    fit_bytes = None
    if swept:  # the all-reduce model's bandwidth at the largest bucket (no bucket holds more than every gradient)
        fit_bytes = 4 * min(float32_count(max(sizes)), round(weights / 4))
    every = []
    for run in range(runs):
        if runs > 1:
            print(f"\nrun {run + 1} of {runs} (fresh ranks)", flush=True)
        results = launch(partial(benchmark_worker, setup=setup, groups=groups, trace=trace, fit_bytes=fit_bytes),
                         world, backend, timeout)
        print_benchmark(results["rows"], setup, world, plot, gpu)
        if swept:
            print_bucket_sweep(swept, results["rows"], results["fit"], config, gpu)
        if trace:
            print_traces(results["rows"], plot_trace, gpu)
        print_summary(results["rows"])
        every.append(results["rows"])
    if runs > 1:
        print_runs(every)

def ratio_spreads(every, kind="ratio"):
    """[(label, [its ratio in each run], largest |ratio / median of the runs - 1|)] for every variant with a ratio
    to torch DDP in every run (not torch DDP itself, nor one out of memory in any run). kind "ratio": the median of
    its per-round ratios, as each run's table prints it; "fastest": its fastest round over torch DDP's fastest round
    in the same rounds."""
    spreads = []
    for label in every[0]:
        ratios = []
        for rows in every:
            row = rows.get(label)  # None: the variant did not run in this launch
            if row is not None and not row["oom"]:
                ratios.append(row["timing"]["ratio"] if kind == "ratio" else row["fastest"])
        if label == LABELS["torch"] or len(ratios) < len(every) or None in ratios:
            continue
        middle = statistics.median(ratios)
        spreads.append((label, ratios, max(abs(r / middle - 1) for r in ratios)))
    return spreads

def print_runs(every, band=0.05):
    """Whether the table repeats: each ratio over the runs, and its largest distance from their median; the same for
    the ratio of fastest rounds, which a run's slow rounds cannot move (where the GPU, not Python, sets the pace, the
    medians of the variants that communicate during backward moved between launches while their fastest rounds did
    not)."""
    typical = ratio_spreads(every)
    fastest = {label: (ratios, spread) for label, ratios, spread in ratio_spreads(every, "fastest")}
    print(f"\nthe ratios to torch DDP over {len(every)} runs (each run fresh ranks; a ratio: the median of its "
          "per-round ratios; fastest rounds: its fastest round over torch DDP's in the same rounds)")
    rows = []
    for label, ratios, spread in typical:
        fast, fast_spread = fastest[label]  # both kinds need torch DDP in the variant's rounds: the same variants
        rows.append([label, " / ".join(f"{r:.3f}x" for r in ratios), f"{100 * spread:.1f}%",
                     "yes" if spread <= band else "no", " / ".join(f"{r:.3f}x" for r in fast),
                     f"{100 * fast_spread:.1f}%", "yes" if fast_spread <= band else "no"])
    print_table(["variant", "vs torch DDP, run by run", "largest distance from their median", f"within {band:.0%}",
                 "fastest rounds, run by run", "largest distance", f"within {band:.0%}"], rows)
    held = sum(spread <= band for _, _, spread in typical)
    held_fast = sum(spread <= band for _, spread in fastest.values())
    print(f"runs: {held} of {len(typical)} ratios stayed within {band:.0%} of their median over {len(every)} runs; "
          f"of the fastest rounds' ratios, {held_fast} of {len(fastest)}")

# takeaway: interleaved rounds beside a no-comm row show what communication costs a step, phase by phase.

# --- 8. where the time goes: rank 0's traces (communication beside computation), and the bucket sweep's model
TRACE_STEPS = 3  # profiled per variant: the first pays the profiler's start-up, the numbers come from the others
STEP_MARK = "ddp.py step"  # the record_function range around each profiled step
COLOURS = {None: "tab:blue", "all-reduce": "tab:orange", "all-gather": "tab:green", "reduce-scatter": "tab:red",
           "broadcast": "tab:purple", "other": "tab:gray"}  # computation, then each kind of collective

def trace_file(path, tag):  # ddp.json -> ddp.overlap.json
    return f"{path.removesuffix('.json')}.{tag}.json"

def is_json(path):  # a file --trace may overwrite: a JSON object, as it writes
    with open(path, "rb") as f:
        return f.read(64).lstrip().startswith(b"{")

def trace_steps(steps, paths, rank, device):
    """Rank 0 profiles TRACE_STEPS steps of each variant (CPU ops, and CUDA kernels on a GPU) into paths[label];
    every rank runs them, so that the collectives pair up. A synchronize ends each step inside its range: the
    step's kernels lie within it."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # else the profiler prints its stages on stderr every time
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    for label, step in steps.items():
        if rank == 0:
            print(f"  tracing {label} -> {paths[label]}", flush=True)
        profiler = profile(activities=activities) if rank == 0 else nullcontext()
        with profiler:
            for _ in range(TRACE_STEPS):
                with record_function(STEP_MARK):
                    step()
                    synchronize(device)
                dist.barrier()  # (outside the range: NCCL's barrier is a kernel too)
        if rank == 0:
            profiler.export_chrome_trace(paths[label])

def collective(name):
    """The collective an NCCL kernel or a gloo op runs ('all-reduce', ...), or None for computation."""
    if not name.startswith(("nccl", "gloo:")):
        return None
    squashed = name.lower().replace("_", "")  # ncclDevKernel_AllReduce_Sum_f32_RING_LL, gloo:all_reduce
    kinds = [kind for kind in COLOURS if kind and kind.replace("-", "") in squashed]
    return (kinds or ["other"])[0]

def traced_spans(path):
    """(each step's (start, end), [(lane, collective or None, start, end)]) in us, from a trace_steps file. With
    CUDA: the kernels, a lane per stream. On a CPU: the ops of the thread that ran the step, and gloo's collectives,
    which run on gloo's own threads."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    # the CPU's ranges (the GPU's copies of them, "gpu_user_annotation", need not be there)
    marks = [e for e in events if e["name"] == STEP_MARK and e.get("cat") == "user_annotation"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in marks)
    kernels = [e for e in events if e.get("cat", "").lower() == "kernel"]  # (older kineto wrote "Kernel")
    if kernels:
        return steps, [(f"stream {e['args'].get('stream', e['tid'])}", collective(e["name"]), e["ts"],
                        e["ts"] + e["dur"]) for e in kernels]
    threads, spans = {}, []
    for e in events:
        if e["name"].startswith("gloo:"):
            lane = f"gloo thread {threads.setdefault(e['tid'], len(threads) + 1)}"
            spans.append((lane, collective(e["name"]), e["ts"], e["ts"] + e["dur"]))
        elif e["tid"] == marks[0]["tid"] and e.get("cat") == "cpu_op" and not e["name"].startswith("c10d::"):
            spans.append(("main thread", None, e["ts"], e["ts"] + e["dur"]))  # (c10d:: only queues a collective)
    return steps, spans

def merged(intervals):
    """(start, end) pairs sorted and joined where they overlap: when something runs."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out

def shared_time(xs, ys):
    """The time two merged lists of intervals have in common."""
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += min(b, ys[k][1]) - max(a, ys[k][0])
            k += 1
    return total

def in_step(spans, step):
    return [s for s in spans if step[0] <= s[2] < step[1]]

def comm_overlap(steps, spans):
    """{collective: [calls, us running, us of it beside computation]} per step, the mean over the traced steps after
    the first; "all" joins the kinds where there are several."""
    measured, stats = steps[1:] or steps, {}
    for step in measured:
        inside = in_step(spans, step)
        compute, kinds = merged((a, b) for _, kind, a, b in inside if kind is None), {}
        for _, kind, a, b in inside:
            if kind:
                kinds.setdefault(kind, []).append((a, b))
        if len(kinds) > 1:
            kinds["all"] = [interval for kind in sorted(kinds) for interval in kinds[kind]]
        for kind, intervals in kinds.items():
            comm, total = merged(intervals), stats.setdefault(kind, [0, 0.0, 0.0])
            total[0] += len(intervals) / len(measured)
            total[1] += sum(b - a for a, b in comm) / len(measured)
            total[2] += shared_time(comm, compute) / len(measured)
    return stats

def print_traces(results, plot, gpu):
    traced = {label: traced_spans(r["trace"]) for label, r in results.items() if r.get("trace")}
    stats = {label: comm_overlap(*spans) for label, spans in traced.items()}
    rows = []
    for label, kinds in stats.items():
        rows += [[label, kind, f"{calls:g}", f"{us / 1e3:.2f}", f"{beside / 1e3:.2f}", f"{100 * beside / us:.0f}%"]
                 for kind, (calls, us, beside) in sorted(kinds.items(), key=lambda item: item[0] == "all") if us]
        if not kinds:
            rows.append([label, "none", "0", "0.00", "0.00", "-"])
    what = "NCCL kernels against the other kernels"
    if not gpu:
        what = "CPU: gloo's collectives on its threads against the ops of the step's thread; the ranks share the cores"
    print(f"\ncommunication per step in rank 0's trace ({what}): the mean of the {TRACE_STEPS - 1} steps after the "
          "first, each ending in a synchronize")
    print_table(["variant", "collective", "calls/step", "comm ms/step", "overlapped ms/step", "overlapped %"], rows)
    print(f"traces (open them in ui.perfetto.dev): {', '.join(r['trace'] for r in results.values() if r.get('trace'))}")
    if plot:
        plot_timelines(plot, traced, stats, gpu)

def timeline_lanes(inside, gpu):
    """The lanes of one step, computing ones first, and their names: on a GPU one that only communicates is NCCL's."""
    computing = sorted({lane for lane, kind, _, _ in inside if kind is None})
    talking = sorted({lane for lane, kind, _, _ in inside if kind} - set(computing))
    return computing + talking, computing + [f"{lane} (NCCL)" if gpu else lane for lane in talking]

def plot_timelines(path, traced, stats, gpu):
    """The last traced step of each variant, a panel each on one time axis: a lane per CUDA stream (CPU: per
    thread), computation in blue, each collective in its colour."""
    lanes = {label: timeline_lanes(in_step(spans, steps[-1]), gpu) for label, (steps, spans) in traced.items()}
    heights = [max(1, len(order)) for order, _ in lanes.values()]
    fig, axes = plot_to(path).subplots(len(traced), 1, sharex=True, squeeze=False, layout="constrained",
                                       figsize=(11, 1 + 0.55 * sum(heights)), gridspec_kw={"height_ratios": heights})
    for ax, (label, (steps, spans)) in zip(axes[:, 0], traced.items()):
        (start, end), (order, names) = steps[-1], lanes[label]
        inside = in_step(spans, steps[-1])
        for y, lane in enumerate(order):
            for kind, colour in COLOURS.items():
                bars = merged((a, b) for at, k, a, b in inside if at == lane and k == kind)
                if bars:
                    ax.broken_barh([((a - start) / 1e3, (b - a) / 1e3) for a, b in bars], (y - 0.4, 0.8),
                                   color=colour, label=kind or "computation")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        _, us, beside = stats[label].get("all") or next(iter(stats[label].values()), (0, 0.0, 0.0))
        share = f", {100 * beside / us:.0f}% of it overlapped" if us else ""
        ax.set_title(f"{label}: this step {(end - start) / 1e3:.1f} ms; communicating {us / 1e3:.1f} ms a step{share}",
                     fontsize=9, loc="left")
    handles = {}
    for ax in axes[:, 0]:
        handles.update(zip(*ax.get_legend_handles_labels()[::-1]))
    fig.legend(list(handles.values()), list(handles), loc="outside upper right", fontsize=8)
    axes[-1, 0].set_xlabel("ms from the step's start on rank 0 (its CPU's first call; the step ends in a synchronize)")
    fig.savefig(path, bbox_inches="tight")
    print(f"timeline saved to {path}")

def allreduce_fit(rank, world, device, nbytes):
    """(o, w, nbytes): the all-reduce model t(S) = o + S / w on these ranks, o in seconds from a one-float all-reduce
    (all latency), w = S / t(S) in bytes/s at S = nbytes (algbw, the course's w); None where nbytes did not fit."""
    warmup, iters = on_device(device, cpu=(1, 3), gpu=(5, 20))
    seconds = []
    for n in (1, nbytes // 4):
        timed = time_allreduce(n, rank, world, device, warmup, iters)  # (None on every rank together)
        if timed is None:
            return None
        slowest = [max(ms) for ms in zip(*gather(timed[0]))]  # an all-reduce ends when its last rank has it
        seconds.append(statistics.median(slowest) / 1e3)
    free_memory()
    return seconds[0], nbytes / seconds[1], nbytes

def print_bucket_sweep(swept, results, fit, config, gpu):
    """BucketDDP's step per bucket size beside the model: overhead = n_b o + (the last bucket's bytes) / w."""
    with torch.device("meta"):
        named = [(name, p) for name, p in GPT(config).named_parameters() if p.requires_grad]
    numel, rows, model = sum(p.numel() for _, p in named), [], {}
    base, no_comm = results.get(LABELS["torch"], {}), results.get(LABELS["local"])
    for v in swept:
        plan = plan_buckets([p for _, p in named], v.bucket_mb)
        size = 2 if v.bf16 else 4  # the bytes a gradient element sends
        last, r = size * sum(p.numel() for p in plan[-1]), results[v.label]
        if fit:
            model[v] = (len(plan) * fit[0] + last / fit[1]) * 1e3
        rows.append([v.label, f"{v.bucket_mb:g}", len(plan), f"{last / MiB:.1f}",
                     "OOM" if r["oom"] else f"{r['timing']['median']:.1f}",
                     benchmark_row(v.label, r, base, no_comm, gpu)[3], f"{model[v]:.2f}" if fit else "n/a"])
    print("\nbucket sweep: BucketDDP's step per bucket size (MB = 2^20 bytes, as torch's bucket_cap_mb)")
    print_table(["variant", "bucket MB", "buckets", "last bucket MB", "step ms", "overhead ms (measured)",
                 "overhead ms (model)"], rows)
    if fit:
        name, first = named[0]  # the first parameter is the last one backward finishes: its bucket leaves last
        print(f"model (2025's ddp_bucketed_benchmarking): overhead = n_b o + (last bucket) / w: each bucket's "
              f"all-reduce pays o, and the last starts only as backward ends, so nothing hides it. Here o = "
              f"{fit[0] * 1e6:.1f} us (a one-float all-reduce), w = {fit[1] / 1e9:.3g} GB/s (algbw at "
              f"{size_label(fit[2] / MiB)}); measured: the step less the no-comm step, paired (n/a on the CPU)")
        print(f"with n_b equal buckets of s bytes in all: n_b o + s / (n_b w), least at n_b = sqrt(s / (w o)), buckets "
              f"of sqrt(s w o); but GPT's {name} ({first.nbytes / MiB:.1f} MB, also the output layer) has its gradient "
              "only as backward ends: no last bucket is smaller")
    for bf16 in sorted({v.bf16 for v in swept}):
        family = [v for v in swept if v.bf16 == bf16]
        done = [v for v in family if not results[v.label]["oom"]]
        wrapper = LABELS["bucket"]
        if bf16:
            wrapper += " bf16 comm"
        line = f"bucket sweep, {wrapper}: measured best "
        if done:
            best = min(done, key=lambda v: results[v.label]["timing"]["median"])
            line += f"{best.bucket_mb:g} MB ({results[best.label]['timing']['median']:.1f} ms a step)"
        else:
            line += "n/a (every size out of memory)"
        if fit:
            s = (2 if bf16 else 4) * numel  # the bytes this variant sends
            line += (f"; the model's best of these sizes {min(family, key=model.get).bucket_mb:g} MB, its optimum "
                     f"sqrt(s w o) = {math.sqrt(s * fit[1] * fit[0]) / MiB:.3g} MB for s = {s / MiB:.1f} MB")
        print(line)

# takeaway: a trace shows where communication runs; buckets trade a latency each against the last one's exposed tail.

# --- 9. launching the ranks, and the command line
def gather(obj):
    """obj from every rank, as a list indexed by rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

def run_rank(rank, world, backend, worker, timeout, tmp, threads):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: the parent stops them all
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads)
    # the timeout turns a rank that never arrives (a crash, an OOM on one GPU) into an error
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout), device_id=device if backend == "nccl" else None)
    try:
        result = worker(rank, world, device)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(result, f"{tmp}/result.pt")

def launch(worker, world, backend, timeout):
    """worker(rank, world, device) on every rank (partial() binds its other arguments); rank 0's result, via a
    file. Forked ranks start fast, but where CUDA exists they are spawned: once this process has asked the driver
    anything, a fork's CUDA fails. A rank that fails or is killed ends the run in one line."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # no line per rank stopped
    with tempfile.TemporaryDirectory() as tmp:
        method = "spawn" if backend == "nccl" or torch.cuda.is_available() else "fork"
        # CPU ranks share the cores: left alone, each would start a thread per core and they would thrash. A forked
        # rank gets one thread: GNU OpenMP's thread pool does not survive a fork, and a forked child that asks it
        # for several threads waits for them forever (DataLoader's forked workers run on one thread for this reason)
        threads = 1
        if method == "spawn":
            threads = max(1, (os.cpu_count() or 1) // world)
        args = (world, backend, worker, timeout, tmp, threads)
        ranks = mp.start_processes(run_rank, args, world, False, start_method=method)
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
                why = " (out of memory?)" if name == "SIGKILL" else ""
                fail(f"rank {e.error_index} was killed by {name}{why}")
            sys.exit(e.exit_code or 1)
        return torch.load(f"{tmp}/result.pt")

def check_launch(world, backend, rank_bytes, what, hint="lower --batch, --seq or --world, or use a smaller --model"):
    """Exit 2 with one sentence before starting ranks this machine cannot hold."""
    if backend == "nccl" and world > torch.cuda.device_count():
        fail(f"--world {world} is more than the {torch.cuda.device_count()} GPUs on this machine")
    # a spawned GPU rank imports torch and makes a CUDA context (~2 GiB of host memory); a forked CPU rank does not
    check_host_memory(world * (rank_bytes + (2**31 if backend == "nccl" else 2**28)), f"{what} on {world} ranks", hint)

def step_setup(device, model, vocab, batch, seq, bucket_mb, warmup, rounds, steps):
    """The GPT step's flags with their CPU/GPU defaults, and the model's config; one that cannot work ends here."""
    setup = StepSetup(model=model or on_device(device, cpu="tiny", gpu="xl"),
                      vocab=vocab,
                      batch=batch or on_device(device, cpu=2, gpu=4),
                      seq=seq or on_device(device, cpu=32, gpu=512),
                      bucket_mb=bucket_mb,
                      warmup=warmup or on_device(device, cpu=1, gpu=3),
                      rounds=rounds or on_device(device, cpu=2, gpu=30),
                      steps=steps)
    try:
        config = make_config(setup.model, vocab_size=vocab)
    except ValueError as e:
        fail(str(e))
    if setup.seq > config.block_size:
        fail(f"--seq {setup.seq} is longer than the {setup.model} block size {config.block_size}")
    return setup, config

def add_step_flags(p):
    p.add_argument("--model", help="preset (default xl on GPU, tiny on CPU)")
    p.add_argument("--batch", type=int_in(1), help="sequences per rank (default 4; 2 on CPU)")
    p.add_argument("--seq", type=int_in(1), help="context length (default 512; 32 on CPU)")
    p.add_argument("--vocab", type=int_in(1), default=50304,
                   help="vocabulary size (default 50304: GPT-2's 50,257 padded to a multiple of 128)")
    p.add_argument("--rounds", type=int_in(1),
                   help="interleaved rounds (default 30; 2 on CPU)")
    p.add_argument("--warmup", type=int_in(1), help="untimed steps per variant first (default 3; 1 on CPU)")
    p.add_argument("--steps", type=int_in(1), default=2, help="steps per variant per round")

def build_parser():
    parser = argparse.ArgumentParser(description="Data-parallel training written out: all-reduce, DDP, ZeRO, FSDP.")
    sub = parser.add_subparsers(dest="command", required=True)
    ar = sub.add_parser("allreduce", help="all-reduce time and bandwidth over gloo (CPU) and NCCL (GPU)")
    ar.add_argument("--sizes", type=size_list, help="MiB, a comma list (default 1,10,100,1024; 0.1,1,10,100 on CPU)")
    ar.add_argument("--worlds", type=int_list(2), help="ranks, a comma list (default 2,4,6, 8 with 8 GPUs; CPU: 2,4)")
    ar.add_argument("--backend", choices=["gloo", "nccl", "both"], help="default: both with GPUs, else gloo")
    ar.add_argument("--warmup", type=int_in(0), help="untimed all-reduces per size first (default 5; 2 on CPU)")
    ar.add_argument("--iters", type=int_in(1), help="timed all-reduces per size and rank (default 20; 10 on CPU)")
    ar.add_argument("--plot", type=plot_path, help="save bus bandwidth against size, a line per backend and world, to "
                    "this figure (.png, .pdf, .svg, ...: the name's extension; needs matplotlib)")
    st = sub.add_parser("selftest", help="every wrapper against one process on the whole batch")
    st.add_argument("--steps", type=int_in(1), default=3, help="training steps compared")
    om = sub.add_parser("optimizer-memory", help="AdamW's state per rank, whole (DDP) or sharded (ZeRO-1)")
    add_step_flags(om)
    om.add_argument("--bucket-mb", type=float_in(0.001), default=25, help="bucket size in MB for BucketDDP and ZeRO-1")
    bm = sub.add_parser("benchmark", help="a GPT training step under every variant, interleaved in rounds")
    add_step_flags(bm)
    bm.add_argument("--variants", type=variant_list, default=",".join(v for v in VARIANTS if ":fp32" not in v),
                    help=f"comma-separated, from: {','.join(LABELS)}; key:bf16 sends (fsdp: computes with) bf16")
    bm.add_argument("--plot", type=plot_path, help="save the step split per variant to this figure (.png, .pdf, "
                    ".svg, ...: the name's extension; needs matplotlib)")
    bm.add_argument("--bucket-mb", type=bucket_list, default=[25], metavar="MB[,MB...]",
                    help="bucket size in MB (2^20 bytes) for BucketDDP, ZeRO and torch DDP; a comma list "
                    "(1,10,100,1000) runs BucketDDP and ZeRO once per size (torch DDP takes the first) and prints the "
                    "bucket sweep beside its overhead model")
    bm.add_argument("--runs", type=int_in(1), default=1,
                    help="run the whole benchmark N times, each with fresh ranks, and print how far each ratio "
                    "moved between runs (its largest distance from the runs' median, against +-5%%), and the ratio "
                    "of each variant's fastest round to torch DDP's")
    bm.add_argument("--trace", metavar="PATH.json",
                    help=f"write rank 0's torch.profiler trace (Chrome/Perfetto JSON) of {TRACE_STEPS} steps of each "
                    "variant after its rounds: PATH.json -> PATH.<variant>.json, e.g. ddp.overlap.json; prints each "
                    "variant's communication per step and how much of it overlaps computation")
    bm.add_argument("--plot-trace", type=plot_path, metavar="FIGURE",
                    help="with --trace: draw one traced step of each variant to this figure, a panel each on one time "
                    "axis, a lane per CUDA stream (CPU: per thread), computation and each collective in its colour")
    for p in (st, om, bm):
        p.add_argument("--world", type=int_in(1), default=2, help="ranks (default 2)")
        p.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl with GPUs, else gloo")
    for p in (ar, st, om, bm):
        p.add_argument("--timeout", type=float_in(1), default=300,
                       help="seconds a collective may wait before the run fails")
    return parser

def main(argv=None):
    args = build_parser().parse_args(argv)
    if "RANK" in os.environ:
        fail("ddp.py starts its own ranks, one per GPU: run it with python, not torchrun")
    cuda = torch.cuda.is_available()
    backend = args.backend
    if backend is None and not cuda:
        backend = "gloo"
    elif backend is None:  # the all-reduce table puts gloo beside NCCL where both exist
        backend = "both" if args.command == "allreduce" else "nccl"
    if backend != "gloo" and not cuda:
        fail(f"--backend {backend} needs CUDA GPUs and this machine has none; use --backend gloo")
    device = "cpu" if backend == "gloo" else "cuda"  # gloo: CPU tensors and the CPU defaults
    if args.command == "allreduce":
        return run_allreduce(device, backend, args.sizes, args.worlds, args.warmup, args.iters, args.plot,
                             args.timeout)
    if args.command == "selftest":
        return run_selftest(args.world, backend, args.steps, args.timeout)
    sizes = args.bucket_mb if args.command == "benchmark" else [args.bucket_mb]
    setup, config = step_setup(device, args.model, args.vocab, args.batch, args.seq, sizes[0], args.warmup,
                               args.rounds, args.steps)
    if args.command == "optimizer-memory":
        return run_optimizer_memory(setup, config, args.world, backend, args.timeout)
    run_benchmark(setup, config, args.variants, sizes, args.world, backend, (args.plot, args.trace, args.plot_trace),
                  args.timeout, args.runs)

# takeaway: the parent starts a process per rank and stops them all; a killed or failing rank is one clear line.

if __name__ == "__main__":
    run_main(main)  # Ctrl-C / SIGTERM: one line, exit 130 / 143
