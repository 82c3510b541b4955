"""Data parallelism written out: four ways to average gradients (per tensor, one flat buffer, overlapping backward,
~25 MB buckets), then sharding the optimizer state (ZeRO-1), the gradients (ZeRO-2) and the weights (FSDP: each
layer gathered just before it runs). Each is checked against one process on the whole batch, timed against torch's.

    python ddp.py selftest --world 2             # every class against one process on the whole batch
    python ddp.py benchmark --world 2            # GPT xl, B=4 per rank, T=512, bf16: every variant
    python ddp.py benchmark --variants local,torch,bucket,fsdp:bf16 --plot ddp.png

Without a GPU everything runs on gloo at tiny sizes: a smoke run, not a measurement.
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
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from gpt import (GPT, Timing, autocast, check_host_memory, clock, configure_optimizer, elapsed_ms, fail, free_memory,
                 fully_shard_gpt, gib, lazily, make_config, plot_to, print_table, round_up, run_main, set_tf32,
                 step_bytes, summarize, synchronize, time_rounds)

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

class BucketDDP(DataParallel):
    """Gradients in ~bucket_mb buckets in reverse order (roughly backward's), each all-reduced once complete. p.grad
    is a view into its bucket, so the average needs no copy back. comm_dtype=bfloat16 sends half."""
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
        return [all_gather_into(flat, flat.chunk(self.world)[dist.get_rank()], async_op=True) for flat in self.params]

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
            mine += [p] if owner == self.rank else []
        if mine and self.local is None:
            self.local = self.optimizer_cls([{**group, "params": mine}], **self.kwargs)
        elif mine:
            self.local.add_param_group({**group, "params": mine})
        self.group_pairs += [(group, self.local.param_groups[-1])] if mine else []

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
    if kind != "zero-adamw":
        return torch.optim.SGD(params, lr=0.5) if kind == "sgd" else torch.optim.AdamW(groups, lr=.05, weight_decay=.1)
    optimizer = ShardedOptimizer(groups[:1], torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    optimizer.add_param_group(groups[1])
    return optimizer

def train_toy(model, optimizer, steps, rank=0, world=1, dtype=None, parts=1):
    """Rank r trains on the r-th of world slices of each batch. The one-process reference sums the gradients of
    `parts` slices as the all-reduce does (one 8-row backward adds in another order): on 2 ranks the same bits."""
    device = next(model.parameters()).device
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randint(15, (8, 6), generator=g).to(device) for _ in "xy")
        for i in range(rank * parts, (rank + 1) * parts):
            part = slice(i * 8 // (world * parts), (i + 1) * 8 // (world * parts))
            inputs = (x[part], y[part])
            cast = {n: p.to(dtype) for n, p in model.named_parameters()} if dtype else None  # as FSDP computes
            (model(*inputs) if cast is None else torch.func.functional_call(model, cast, inputs))[1].backward()
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
TOY_VARIANTS = {"naive": (NaiveDDP, "sgd", 2e-6), "flat": (FlatDDP, "sgd", 2e-6), "overlap": (OverlapDDP, "sgd", 2e-6),
                "bucket": (partial(BucketDDP, bucket_mb=TINY), "sgd", 2e-6),
                "bucket-bf16": (partial(BucketDDP, bucket_mb=TINY, comm_dtype=torch.bfloat16), "sgd", 1e-2),
                "zero1-adamw": (partial(BucketDDP, bucket_mb=TINY), "zero-adamw", 2e-6),
                "zero2-adamw": (partial(ZeRO2, bucket_mb=TINY), "zero-adamw", 2e-6),
                "fsdp": (FSDP, "sgd", 2e-6), "fsdp-adamw": (FSDP, "adamw", 2e-6),
                "fsdp-fp16": (partial(FSDP, compute_dtype=torch.float16), "sgd", 2e-6)}

def selftest_worker(rank, world, device, args):
    """Per variant: every rank's weights against one process from rank 0's initial weights; FSDP's gradients
    shaped like the shards, in fp32, the replicated ones equal on all ranks; ZeRO's state split between ranks."""
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

def run_selftest(args):
    if 8 % args.world:  # equal slices: the mean of their mean losses is the whole batch's
        fail(f"--world {args.world}: the selftest's batch of 8 sequences splits evenly over 1, 2, 4 or 8 ranks")
    check_launch(args.world, args.backend, 0, "the selftest")
    print(f"selftest: every wrapper on {args.world} ranks ({args.backend}) vs one process, {args.steps} steps")
    args.toy_variants = dict(TOY_VARIANTS)  # they travel with args: a spawned rank imports ddp afresh
    rows = launch(selftest_worker, args.world, args.backend, args)
    print_table(["variant", "max |w - reference| on any rank", "tolerance", "result"], rows)
    failed = [r[0] for r in rows if r[-1] != "ok"]
    print(f"selftest: {len(rows) - len(failed)} of {len(rows)} variants match one-process training"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)

# takeaway: fp32 on two ranks must reproduce one process bit for bit; a missed or doubled average shows.

# --- 5. benchmark: the same GPT step under every variant, interleaved in rounds
LABELS = {"local": "local (no comm)", "torch": "torch DDP", "naive": "NaiveDDP", "flat": "FlatDDP",
          "overlap": "OverlapDDP", "bucket": "BucketDDP", "sharded": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "FSDP",
          "fsdp2": "torch FSDP2"}
# what a variant keeps between steps, in fp32 weights (AdamW's moments are two): (whole, split over the ranks)
RESIDENT = {"local": (3, 0), "torch": (4, 0), "naive": (3, 0), "flat": (4, 0), "overlap": (3, 0), "bucket": (4, 0),
            "sharded": (2, 2), "zero2": (1, 3), "fsdp": (0, 4), "fsdp2": (0, 4)}
# key:bf16 is what torch DDP, BucketDDP and ZeRO send, and what FSDP gathers and computes with
VARIANTS = [k + d for k in LABELS
            for d in ("", ":fp32", ":bf16")[:3 if k in ("torch", "bucket", "sharded", "zero2", "fsdp") else 2]]

def make_step(key, bf16, args, rank, device, marks):
    """One GPT training step under one variant; it appends to marks a clock() at the start and after each phase."""
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
        optimizer = ShardedOptimizer(groups, torch.optim.AdamW, lr=3e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    tokens = torch.randint(50257, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1000 + rank))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # random: speed does not depend on what they say
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
        # BucketDDP's gradients are views into its buckets, zeroed in place; the others free theirs for the round
        optimizer.zero_grad(set_to_none=key not in ("bucket", "sharded"))
        marks.append(t + [clock(device)])
    return step

def memory_groups(rows, config, args, world, weights):
    """The rows in groups that fit on one GPU together (CPU: one group), each with the torch DDP and no-comm rows."""
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
    """Warm up each variant (peak: the timer's less the others'), drop any out of memory on a rank, time the rest."""
    cuda, local, base = device.type == "cuda", LABELS["local"], LABELS["torch"]
    marks = {label: [] for label, _, _ in group}
    steps = {label: lazily(partial(make_step, key, bf16, args, rank, device, marks[label]), device)
             for label, key, bf16 in group}
    warm, peaks = time_rounds(steps, device, rounds=0, warmup=args.warmup)  # out of memory: None
    fits = [all(ok) for ok in zip(*gather([warm[label] is not None for label in steps]))]
    steps = {label: step for (label, step), ok in zip(steps.items(), fits) if ok}
    results.update({label: {"oom": True} for label, _, _ in group if label not in steps and label not in results})
    free_memory()  # (a variant out of memory on another rank lets go of its model here)
    sync = lambda: (synchronize(device), dist.barrier())  # noqa: E731 (all ranks end a round before any goes on)
    every = gather(time_rounds(steps, device, args.rounds, args.steps, warmup=0, sync=sync)[0])
    times = {label: [max(r[label][i] for r in every) for i in range(args.rounds)] for label in steps}  # slowest rank
    timings = summarize(times, baseline=base if base in times else None)
    split = gather({label: [statistics.median(ms) for ms in zip(*[[elapsed_ms(a, b) for a, b in zip(t, t[1:])]
                                                                  for t in marks[label][args.warmup:]])]
                    for label in steps})
    own = gather({label: peaks[label] - steps[label].state["others"] for label in steps} if cuda else {})
    for label in steps:
        exposed = [a - b for a, b in zip(times[label], times[local])] if local in times else None
        results.setdefault(label, {
            "oom": False, "timing": vars(timings[label]), "peak": max(r[label] for r in own) if cuda else None,
            "phases": [statistics.fmean(ms) for ms in zip(*(r[label] for r in split))],  # mean over ranks
            "exposed": statistics.median(exposed) if exposed else None})

def benchmark_worker(rank, world, device, args):
    """{label: result} of every group's rows."""
    set_tf32(True)
    results = {}
    for g, group in enumerate(args.groups):
        if rank == 0:
            print(f"  group {g + 1} of {len(args.groups)}: {', '.join(label for label, _, _ in group)}", flush=True)
        time_group(group, results, args, rank, device)
        free_memory()  # the group's models are gone with time_group's frame
    return results

def print_benchmark(rows, args, world):
    base = rows.get(LABELS["torch"], {})
    vs = lambda r: f" ({r['peak'] / base['peak']:.2f}x)" if r.get("peak") and base.get("peak") else ""  # noqa: E731
    print_table(["variant", "step ms", "vs torch DDP (paired)", "exposed comm ms", "fwd ms", "bwd ms", "wait ms",
                 "optim ms", "peak GiB (vs torch DDP)"],
                [[label] + ["OOM"] * 8 if r["oom"] else
                 [label, Timing(**r["timing"]).ms(1), Timing(**r["timing"]).vs(),
                  "-" if r["exposed"] is None or label == LABELS["local"] else f"{r['exposed']:.1f}",
                  *(f"{ms:.1f}" for ms in r["phases"]), "n/a" if r["peak"] is None else gib(r["peak"]) + vs(r)]
                 for label, r in rows.items()])
    print(f"step: median (min-max) over {args.rounds} rounds of {args.steps} steps, the slowest rank's; ratios paired "
          "in rounds. exposed comm: median of (step - no-comm step). fwd/bwd/wait/optim: medians, mean over ranks "
          "(torch DDP and FSDP2 wait inside bwd). peak: allocated, the variant's own, largest rank")
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

def run_benchmark(args, gpu):
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
    held = 0 if gpu else int(weights * (1 + sum(sum(RESIDENT[k]) for _, k, _ in rows))  # CPU: all in host memory
                             + step_bytes(config, args.batch, args.seq, False))  # and one step's activations
    check_launch(args.world, args.backend, held, f"the benchmark of GPT {args.model}")
    args.groups = memory_groups(rows, config, args, args.world, weights)
    print(f"data-parallel GPT {args.model} ({weights / 4e6:.0f}M parameters) on "
          + (f"{args.world}x {torch.cuda.get_device_name()} over NCCL, bf16 autocast" if gpu else
             f"{args.world} CPU processes over gloo, fp32 (no GPU: a smoke run, not a measurement)")
          + f", torch {torch.__version__}: B={args.batch} per rank, T={args.seq}, AdamW; {args.rounds} rounds of "
          f"{args.steps} steps per variant after {args.warmup} warm-up")
    print_benchmark(launch(benchmark_worker, args.world, args.backend, args), args, args.world)

# takeaway: interleaved rounds beside a no-comm row show what communication costs a step, phase by phase.

# --- 6. launching the ranks, and the command line
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
    """worker(rank, world, device, args) on every rank; rank 0's result, via a file. Forked ranks start fast, but
    where CUDA exists they are spawned: once this process has asked the driver anything, a fork's CUDA fails."""
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
    # a spawned GPU rank imports torch and makes a CUDA context (~2 GiB of host memory); a forked CPU rank does not
    check_host_memory(world * (rank_bytes + (2**31 if backend == "nccl" else 2**28)), f"{what} on {world} ranks",
                      "lower --batch, --seq or --world, or use a smaller --model")

def main(argv=None):
    parser = argparse.ArgumentParser(description="Data-parallel training written out: DDP, ZeRO, FSDP.")
    sub = parser.add_subparsers(dest="command", required=True)
    bm = sub.add_parser("benchmark", help="a GPT training step under every variant, interleaved in rounds")
    bm.add_argument("--model", help="preset (default xl on GPU, tiny on CPU)")
    bm.add_argument("--batch", type=int, help="sequences per rank (default 4; 2 on CPU)")
    bm.add_argument("--seq", type=int, help="context length (default 512; 32 on CPU)")
    bm.add_argument("--vocab", type=int, default=50304, help="vocabulary, padded to a multiple of 128")
    bm.add_argument("--rounds", type=int, help="interleaved rounds (default 30, 2 on CPU: with 8, ratios moved 12%%)")
    bm.add_argument("--warmup", type=int, help="untimed steps per variant first (default 3; 1 on CPU)")
    bm.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    bm.add_argument("--variants", default=",".join(v for v in VARIANTS if ":fp32" not in v),
                    help=f"comma-separated, from: {','.join(LABELS)}; key:bf16 sends (fsdp: computes with) bf16")
    bm.add_argument("--bucket-mb", type=float, default=25, help="bucket size for BucketDDP, ZeRO and torch DDP")
    bm.add_argument("--plot", help="save the step split per variant to this PNG (needs matplotlib)")
    st = sub.add_parser("selftest", help="every wrapper against one process on the whole batch")
    st.add_argument("--steps", type=int, default=3, help="training steps compared")
    for p in (bm, st):
        p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
        p.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl with GPUs, else gloo")
        p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait before the run fails")
    args = parser.parse_args(argv)
    gpu = args.backend == "nccl" or (args.backend is None and torch.cuda.is_available())
    args.backend = "nccl" if gpu else "gloo"
    if "RANK" in os.environ:
        fail("ddp.py starts its own ranks, one per GPU: run it with python, not torchrun")
    if gpu and not torch.cuda.is_available():
        fail("--backend nccl needs CUDA GPUs and this machine has none; use --backend gloo")
    for flag in ("world", "steps", "batch", "seq", "rounds", "warmup", "vocab", "timeout", "bucket_mb"):
        least = 0.001 if flag == "bucket_mb" else 1
        if (value := getattr(args, flag, None)) is not None and value < least:
            fail(f"--{flag.replace('_', '-')} must be at least {least:g}, got {value:g}")
    if args.command == "selftest":
        return run_selftest(args)
    run_benchmark(args, gpu)

# takeaway: the parent starts a process per rank and stops them all; a killed or failing rank is one clear line.

if __name__ == "__main__":
    run_main(main)  # Ctrl-C / SIGTERM: one line, exit 130 / 143
