"""Data parallelism from the collective up: all-reduce bandwidth, then four ways to average gradients.

Every rank holds the whole model, runs its own slice of the batch and averages the gradients with an
all-reduce. Doing that one tensor at a time after backward (NaiveDDP) pays a latency per tensor;
one flat buffer (FlatDDP) pays one big latency with nothing overlapped; starting each reduction from
a gradient hook (OverlapDDP) hides it behind the rest of backward but launches hundreds of small
collectives; buckets of ~25 MB (BucketDDP) get both, and sending bf16 halves the bytes.
ShardedOptimizer (ZeRO-1) keeps each rank's AdamW state for only ~1/world of the parameters.

    python ddp.py allreduce                      # NCCL bandwidth table, world 2/4/6/8 as GPUs allow
    python ddp.py allreduce --world 2 --plot allreduce.png
    python ddp.py benchmark --world 2            # GPT xl, B=4 per rank, T=512, bf16: all variants
    torchrun --nproc_per_node=2 ddp.py benchmark # the same under torchrun (also multi-node)
    python ddp.py selftest --world 2             # every class against one process on the whole batch

Without a GPU everything runs on gloo with tiny sizes: a smoke run, not a measurement.

Excerpt (2x NVIDIA H200, NVLink, torch 2.11.0+cu130, 2026-11-22),
`python ddp.py benchmark --world 2 --variants local,torch,bucket --steps 15 --warmup 3`:

    variant              fwd ms  bwd ms  comm wait ms  optim ms  step ms  comm share  vs torch DDP  init GiB  peak to sync GiB  peak w/ optim GiB
    -------------------  ------  ------  ------------  --------  -------  ----------  ------------  --------  ----------------  -----------------
    local (no comm)        20.6    43.0             -      13.2     77.6          0%         0.70x      5.94             27.34              27.34
    torch DDP              24.4    72.8        in bwd      13.2    111.0         30%         1.00x     11.79             33.16              33.16
    torch DDP bf16 comm    22.2    74.7        in bwd      13.1    110.3         30%         0.99x     11.72             35.98              35.98
    BucketDDP              19.6    59.3           1.2      12.7     95.1         18%         0.86x     11.78             33.13              33.13
    BucketDDP bf16 comm    19.8    63.1           5.9      12.7    108.5         28%         0.98x     14.87             36.22              36.22
    median over steps, averaged over ranks; memory: allocated, the largest rank's. comm share = (step - local step) / step, the part of the step data parallelism costs; torch DDP waits inside its backward.
"""

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import weakref
from datetime import timedelta

# NVLink SHARP (NVLS) multicast reserves NVSwitch multicast memory that the workplace's shared
# GPUs must not claim; NCCL reads this when a communicator is created, so it has to be set before
# init_process_group (spawned ranks inherit it through the environment).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from gpt import GPT, autocast, configure_optimizer, fail, gib, make_config, print_table, set_tf32

# --- 1. launching ranks: our own spawn on 127.0.0.1, or torchrun's environment


def under_torchrun():
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_launch(world, backend):
    """Exit 2 with one sentence for a world or backend this machine cannot run."""
    if backend == "nccl" and not torch.cuda.is_available():
        fail("--backend nccl needs CUDA GPUs and this machine has none; use --backend gloo")
    if world < 1:
        fail(f"--world must be at least 1, got {world}")
    if under_torchrun():
        if world != int(os.environ["WORLD_SIZE"]):
            fail(f"--world {world} differs from torchrun's WORLD_SIZE {os.environ['WORLD_SIZE']}")
        world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # GPUs needed on this machine
    if backend == "nccl" and world > torch.cuda.device_count():
        fail(f"--world {world} is more than the {torch.cuda.device_count()} GPUs on this machine")


def launch(worker, world, backend, args):
    """Run worker(rank, world, device, args) on every rank; return rank 0's result (None on the
    other ranks under torchrun). Spawned ranks hand rank 0's result back through a JSON file."""
    if under_torchrun():
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
        return run_rank(rank, world, backend, worker, args, "env://", None, local_rank)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        init = f"tcp://127.0.0.1:{free_port()}"
        try:
            # fork on the CPU: children inherit the imported torch instead of each spending
            # seconds importing it again (and torch._dynamo, which the first optimizer imports);
            # CUDA cannot survive a fork, so GPUs need spawn
            if backend != "nccl":
                import torch._dynamo  # noqa: F401
            mp.start_processes(run_rank, args=(world, backend, worker, args, init, out), nprocs=world,
                               start_method="spawn" if backend == "nccl" else "fork")
        except mp.ProcessRaisedException as e:
            print(f"error: a rank failed:\n{e}", file=sys.stderr)
            sys.exit(1)
        except mp.ProcessExitedException as e:  # a rank called fail() (2) or was killed
            sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)
        with open(out) as f:
            return json.load(f)


def run_rank(rank, world, backend, worker, args, init_method, out, local_rank=None):
    local_rank = rank if local_rank is None else local_rank
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # ranks share the cores: left alone, each would start a thread per core and they thrash
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # the timeout turns a rank that never arrives (a crash, an OOM on one GPU) into an error
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)
    try:
        result = worker(rank, world, device, args)
    finally:
        dist.destroy_process_group()
    if rank == 0 and out is not None:
        with open(out, "w") as f:
            json.dump(result, f)
    return result if rank == 0 else None


def gather(obj):
    """obj from every rank, as a list indexed by rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def now(device):
    """A point in time: a CUDA event on the current stream (GPU time), else the CPU clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed_ms(marks):
    """Milliseconds between consecutive marks (on a GPU, waits for the last one first)."""
    if isinstance(marks[0], float):
        return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
    marks[-1].synchronize()
    return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]


# --- 2. averaging gradients: four wrappers with one interface, and a sharded optimizer


def average_op():
    """(op, divisor): NCCL averages inside the collective; gloo has no AVG, so sum and divide."""
    if dist.get_backend() == "nccl":
        return dist.ReduceOp.AVG, 1
    return dist.ReduceOp.SUM, dist.get_world_size()


class DataParallel(nn.Module):
    """What the wrappers share: rank 0's parameters and buffers at construction, and forward."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        # parameters() yields a tied tensor once (GPT's lm_head.weight is wte.weight): it is sent
        # once here and later has one gradient, reduced once. Frozen ones are sent but not reduced.
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        self.names = {p: name for name, p in module.named_parameters()}
        self.op, self.divisor = average_op()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_gradient_error(self, params):
        names = ", ".join(self.names[p] for p in params)
        return RuntimeError(f"no gradient for {names} before finish_gradient_synchronization: every "
                            "trainable parameter must be used in forward on every rank")

    def gradients(self):
        missing = [p for p in self.trainable if p.grad is None]
        if missing:
            raise self.no_gradient_error(missing)
        return [p.grad for p in self.trainable]


def on_gradient(p, method):
    """Call method(p) once p.grad is complete in each backward. The hook holds the wrapper only
    weakly: a strong reference would tie every parameter to its wrapper in a cycle the garbage
    collector cannot see through, and models would pile up on the GPU between benchmark rows."""
    ref = weakref.WeakMethod(method)
    p.register_post_accumulate_grad_hook(lambda param: ref() and ref()(param))


class NaiveDDP(DataParallel):
    """After backward, one blocking all-reduce per gradient: ~580 collectives for GPT-2 xl, each
    paying the launch latency, and the GPU computes nothing while they run."""

    def finish_gradient_synchronization(self):
        for grad in self.gradients():
            dist.all_reduce(grad, op=self.op)
            if self.divisor > 1:
                grad.div_(self.divisor)


class FlatDDP(DataParallel):
    """One all-reduce of every gradient copied into one flat buffer: full bandwidth and a single
    latency, paid for with a copy in, a copy out and a second gradient-sized buffer."""

    def finish_gradient_synchronization(self):
        grads = self.gradients()
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=self.op)
        if self.divisor > 1:
            flat.div_(self.divisor)
        for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(part.view_as(grad))


class OverlapDDP(DataParallel):
    """An asynchronous all-reduce per gradient, started the moment backward has finished it, so
    communication runs while backward computes the layers below. comm_dtype=torch.bfloat16
    sends half the bytes and averages back into the fp32 gradient."""

    def __init__(self, module, comm_dtype=None):
        super().__init__(module)
        self.comm_dtype = comm_dtype
        self.in_flight = []  # (parameter, tensor sent, work handle)
        for p in self.trainable:
            # fires once per backward, after every use of p (both uses of a tied weight) has been
            # summed into p.grad: each gradient leaves complete, and only once
            on_gradient(p, self.reduce)

    def reduce(self, p):
        sent = p.grad if self.comm_dtype in (None, p.grad.dtype) else p.grad.to(self.comm_dtype)
        # every rank runs the same graph, so the hooks fire and the collectives queue in one order
        self.in_flight.append((p, sent, dist.all_reduce(sent, op=self.op, async_op=True)))

    def finish_gradient_synchronization(self):
        done = {p for p, _, _ in self.in_flight}
        if len(done) != len(self.trainable):
            raise self.no_gradient_error([p for p in self.trainable if p not in done])
        for p, sent, work in self.in_flight:
            work.wait()  # on a GPU: the compute stream waits for NCCL's, the CPU goes on
            if sent is not p.grad:
                p.grad.copy_(sent)
            if self.divisor > 1:
                p.grad.div_(self.divisor)
        self.in_flight = []


def bucket_params(params, cap_bytes):
    """Split params, in the order given, into consecutive buckets of at most cap_bytes (a larger
    parameter gets a bucket of its own), each of one dtype and device."""
    buckets, size = [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        kind = (p.dtype, p.device)
        if not buckets or size + nbytes > cap_bytes or kind != (buckets[-1][0].dtype, buckets[-1][0].device):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class BucketDDP(DataParallel):
    """Gradients grouped into ~bucket_mb buckets in reverse registration order (roughly the order
    backward produces them); a bucket's asynchronous all-reduce starts when its last gradient
    arrives. The gradients live in the bucket buffers (p.grad is a view), so the reduced values
    need no copy back, and a fresh gradient costs one copy in."""

    def __init__(self, module, bucket_mb=25, comm_dtype=None):
        super().__init__(module)
        self.grad_buffers, self.comm_buffers, self.sizes, self.slot = [], [], [], {}
        for i, params in enumerate(bucket_params(self.trainable[::-1], bucket_mb * 2**20)):
            grads = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                device=params[0].device)
            cast = comm_dtype not in (None, grads.dtype)
            comm = torch.empty_like(grads, dtype=comm_dtype) if cast else grads
            offset = 0
            for p in params:
                n = p.numel()
                self.slot[p] = (i, grads[offset:offset + n].view_as(p),
                                comm[offset:offset + n].view_as(p) if cast else None)
                offset += n
                on_gradient(p, self.gradient_ready)
            self.grad_buffers.append(grads)
            self.comm_buffers.append(comm)
            self.sizes.append(len(params))
        self.arrived = [0] * len(self.sizes)
        self.next_bucket, self.works = 0, []

    def gradient_ready(self, p):
        i, grad_view, comm_view = self.slot[p]
        if comm_view is not None:
            comm_view.copy_(p.grad)  # cast to the communication dtype on the way in
        elif p.grad.data_ptr() != grad_view.data_ptr():
            grad_view.copy_(p.grad)  # a fresh gradient (zero_grad set it to None): copy it in
        p.grad = grad_view  # the fresh tensor is freed; after the sync it holds the average
        self.arrived[i] += 1
        if self.arrived[i] > self.sizes[i]:
            raise RuntimeError("backward ran twice without finish_gradient_synchronization; "
                               "BucketDDP does not support gradient accumulation")
        # buckets leave strictly in order, so every rank queues the same collectives in the same
        # order even if some gradient arrives early
        while self.next_bucket < len(self.sizes) and self.arrived[self.next_bucket] == self.sizes[self.next_bucket]:
            buffer = self.comm_buffers[self.next_bucket]
            self.works.append(dist.all_reduce(buffer, op=self.op, async_op=True))
            self.next_bucket += 1

    def finish_gradient_synchronization(self):
        if self.next_bucket < len(self.sizes):
            stuck = self.next_bucket
            raise self.no_gradient_error([p for p, (i, _, _) in self.slot.items() if i == stuck])
        for grads, comm, work in zip(self.grad_buffers, self.comm_buffers, self.works):
            work.wait()
            if comm is not grads:
                grads.copy_(comm)
            if self.divisor > 1:
                grads.div_(self.divisor)
        self.arrived = [0] * len(self.sizes)
        self.next_bucket, self.works = 0, []


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: each rank keeps optimizer_cls state (AdamW: two fp32 tensors per parameter) for
    about 1/world of the parameters, steps only those, then broadcasts them to the other ranks.
    An elementwise optimizer gives exactly the unsharded result; the price is a broadcast of
    every parameter each step, about the cost of one more all-reduce's all-gather half."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.owners = []  # (parameter, owning rank), in the same order on every rank
        self.load = [0] * self.world  # elements owned per rank
        self.local = None  # optimizer_cls over this rank's shard, made when it gets one
        self.group_pairs = []  # (our param group, the local optimizer's group for it)
        super().__init__(params, kwargs)  # calls add_param_group for each group

    def add_param_group(self, param_group):
        super().add_param_group(param_group)  # validates and fills in the defaults
        group = self.param_groups[-1]
        mine = []
        for p in group["params"]:
            owner = min(range(self.world), key=self.load.__getitem__)  # least-loaded rank
            self.load[owner] += p.numel()
            self.owners.append((p, owner))
            if owner == self.rank:
                mine.append(p)
        if not mine:
            return
        shard = {**group, "params": mine}
        if self.local is None:
            self.local = self.optimizer_cls([shard], **self.kwargs)
        else:
            self.local.add_param_group(shard)
        self.group_pairs.append((group, self.local.param_groups[-1]))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, shard in self.group_pairs:  # carry learning-rate schedules over to the shard
            shard.update((k, v) for k, v in group.items() if k != "params")
        if self.local is not None:
            self.local.step()
        works = [dist.broadcast(p, src=owner, async_op=True) for p, owner in self.owners]
        for work in works:
            work.wait()
        return loss


# --- 3. correctness: a toy model with a tied and a frozen weight, against one process


class ToyModel(nn.Module):
    """Small enough for gloo on two CPU cores, awkward enough to catch the usual bugs: a tied
    weight (reduced twice, its gradient doubles), a frozen layer (must stay untouched and never be
    waited for) and a buffer (must come from rank 0)."""

    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim).requires_grad_(False)
        self.hidden = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("shift", torch.randn(dim))

    def forward(self, idx, targets):
        h = self.embed(idx)
        h = torch.tanh(self.hidden(self.norm(h + self.frozen(h)))) + self.shift
        logits = self.out(h)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def toy_batch(step, batch=8, seq=6, vocab=16):
    g = torch.Generator().manual_seed(step)
    return torch.randint(vocab, (batch, seq), generator=g), torch.randint(vocab, (batch, seq), generator=g)


def toy_optimizer(model, kind, sharded=False):
    """SGD, or AdamW with a decayed and an undecayed group; the sharded AdamW gets its second
    group through add_param_group after construction."""
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    decay = {"params": [p for p in params if p.dim() >= 2]}
    other = {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}
    if not sharded:
        return torch.optim.AdamW([decay, other], lr=0.05, weight_decay=0.1)
    optimizer = ShardedOptimizer([decay], torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    optimizer.add_param_group(other)
    return optimizer


def train_toy(model, optimizer, steps, rank=0, world=1):
    """Train where rank r takes the r-th of world equal slices of each batch: the mean of the
    slices' mean losses is the whole batch's mean loss, so the averaged gradient is the same."""
    device = next(model.parameters()).device
    for step in range(steps):
        x, y = toy_batch(step)
        part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        _, loss = model(x[part].to(device), y[part].to(device))
        loss.backward()
        if hasattr(model, "finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()


def state_of(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# name: (class, keyword arguments, optimizer, sharded, tolerance). Tiny buckets force several.
TOY_VARIANTS = {
    "naive": (NaiveDDP, {}, "sgd", False, 2e-6),
    "flat": (FlatDDP, {}, "sgd", False, 2e-6),
    "overlap": (OverlapDDP, {}, "sgd", False, 2e-6),
    "overlap-bf16": (OverlapDDP, {"comm_dtype": torch.bfloat16}, "sgd", False, 1e-2),
    "bucket": (BucketDDP, {"bucket_mb": 0.0002}, "sgd", False, 2e-6),
    "bucket-bf16": (BucketDDP, {"bucket_mb": 0.0002, "comm_dtype": torch.bfloat16}, "sgd", False, 1e-2),
    "sharded-adamw": (BucketDDP, {"bucket_mb": 0.0002}, "adamw", True, 2e-6),
}


def selftest_worker(rank, world, device, args):
    rows, saved = [], {}
    for name, (cls, kwargs, kind, sharded, tol) in TOY_VARIANTS.items():
        torch.manual_seed(100 + rank)  # different weights on every rank until the wrapper syncs them
        model = ToyModel().to(device)
        wrapped = cls(model, **kwargs)
        initial = gather(state_of(model))
        optimizer = toy_optimizer(model, kind, sharded)
        train_toy(wrapped, optimizer, args.steps, rank, world)
        final = gather(state_of(model))
        # elements whose optimizer state this rank holds: a shard of them when sharded
        local = optimizer.local if sharded else optimizer
        held = gather(sum(p.numel() for p in local.state) if local is not None else 0)
        if rank == 0:
            reference = ToyModel().to(device)
            reference.load_state_dict(initial[0])
            train_toy(reference, toy_optimizer(reference, kind), args.steps)
            spread = max(max_diff(s, initial[0]) for s in initial)
            error = max(max_diff(s, state_of(reference)) for s in final)
            ok = spread == 0 and error <= tol
            rows.append([name, f"{spread:.1e}", f"{error:.1e}", f"{tol:.0e}", "ok" if ok else "FAIL"])
            saved[name] = {"optimizer": kind, "initial": initial, "final": final, "state_held": held}
    if rank == 0 and args.save:
        torch.save({"steps": args.steps, "variants": saved}, args.save)
    return rows


def run_selftest(args, world, backend):
    print(f"selftest: every wrapper on {world} ranks ({backend}) vs one process on the whole batch, "
          f"{args.steps} steps")
    rows = launch(selftest_worker, world, backend, args)
    if rows is None:
        return
    print_table(["variant", "max |rank - rank 0| at start", "max |w - reference| at end",
                 "tolerance", "result"], rows)
    failed = [r[0] for r in rows if r[-1] != "ok"]
    print(f"selftest: {len(rows) - len(failed)} of {len(rows)} variants match one-process training"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if failed:
        sys.exit(1)


# --- 4. all-reduce bandwidth


def parse_size(text):
    """'1M', '10MB', '1GiB', '4096' -> bytes (K/M/G are powers of 1024)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in "KMG" else t
    if not number.isdigit() or int(number) * scale < 4 or int(number) * scale % 4:
        raise ValueError(f"size '{text}' is not a whole number of float32 values (like 1M, 64K, 1G)")
    return int(number) * scale


def size_label(nbytes):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def allreduce_worker(rank, world, device, args):
    rows = []
    for nbytes in args.size_bytes:
        x = torch.full((nbytes // 4,), float(rank + 1), device=device)
        dist.all_reduce(x)  # doubles as a warm-up and a check that the sum is right
        if x[0].item() != world * (world + 1) / 2:
            raise RuntimeError(f"all-reduce returned {x[0].item()}, expected {world * (world + 1) / 2}")
        times = []
        for i in range(args.warmup + args.reps):
            dist.barrier()  # start together, or a late rank's delay is timed as transfer
            if device.type == "cuda":
                torch.cuda.synchronize()
            marks = [now(device)]
            dist.all_reduce(x)
            marks.append(now(device))
            if i >= args.warmup:
                times.append(elapsed_ms(marks)[0])
        per_rank = gather(times)
        # a collective is done when its slowest rank is; the median resists stray slow runs
        rows.append([world, nbytes, statistics.median(max(run) for run in zip(*per_rank))])
        del x
    return rows


def bus_factor(world):
    """nccl-tests' all-reduce bus-bandwidth factor: each rank sends and receives 2(n-1)/n of the
    buffer, so algbw x 2(n-1)/n is comparable across world sizes and with link speeds."""
    return 2 * (world - 1) / world


def plot_allreduce(rows, path, plt):
    fig, ax = plt.subplots(figsize=(6, 4))
    for world in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == world]
        ax.plot([r[1] for r in mine], [r[1] / r[2] / 1e6 * bus_factor(world) for r in mine], "o-",
                label=f"{world} ranks")
    ax.set(xscale="log", xlabel="buffer (bytes, float32)", ylabel="bus bandwidth (GB/s)",
           title="all-reduce")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def run_allreduce(args, worlds, backend):
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ModuleNotFoundError:
            fail("--plot needs matplotlib (pip install matplotlib)")
    where = (f"{torch.cuda.get_device_name()} GPUs, NCCL" if backend == "nccl"
             else "CPU processes, gloo (no GPU: small sizes, a smoke run)")
    print(f"all-reduce of float32 on {where}, torch {torch.__version__}: median of {args.reps} runs "
          f"after {args.warmup} warm-up, world {', '.join(map(str, worlds))}")
    rows = []
    for world in worlds:
        part = launch(allreduce_worker, world, backend, args)
        if part is None:
            return
        rows += part
    table = [[w, size_label(n), f"{ms:.3f}", f"{n / ms / 1e6:.3g}", f"{n / ms / 1e6 * bus_factor(w):.3g}"]
             for w, n, ms in rows]
    print_table(["world", "size", "time (ms)", "algbw (GB/s)", "busbw (GB/s)"], table)
    print("algbw = bytes / time; busbw = algbw x 2(n-1)/n (nccl-tests' all-reduce definition); "
          "time = slowest rank's, median of runs; GB = 1e9 bytes")
    if args.plot:
        plot_allreduce(rows, args.plot, plt)
        print(f"plot saved to {args.plot}")
    w, n, ms = rows[-1]
    print(f"summary: all-reduce of {size_label(n)} on {w} ranks takes {ms:.3f} ms, "
          f"{n / ms / 1e6 * bus_factor(w):.1f} GB/s bus bandwidth")


# --- 5. benchmark: the same GPT step under every wrapper

LABELS = {"local": "local (no comm)", "torch": "torch DDP", "naive": "NaiveDDP", "flat": "FlatDDP",
          "overlap": "OverlapDDP", "bucket": "BucketDDP", "sharded": "BucketDDP + ShardedOpt"}
COMM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def variant_list(args):
    """(label, key, comm dtype name): one row per wrapper, and per comm dtype where it applies."""
    out = []
    for key in args.variants:
        for name in args.comm_dtypes if key in ("torch", "overlap", "bucket", "sharded") else ["fp32"]:
            if key == "torch" and name == "bf16" and args.backend != "nccl":
                continue  # torch's bf16 compression hook needs NCCL
            label = LABELS[key] + (" bf16 comm" if name == "bf16" else "")
            out.append((label, key, name))
    return out


def wrap(key, model, comm, args, device):
    if key == "local":
        return model
    if key == "torch":
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_mb)
        if comm is not None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return ddp
    if key in ("naive", "flat"):
        return (NaiveDDP if key == "naive" else FlatDDP)(model)
    if key == "overlap":
        return OverlapDDP(model, comm)
    return BucketDDP(model, args.bucket_mb, comm)


def sharded_adamw(model, device):
    """configure_optimizer's AdamW (same groups and betas), with its state sharded."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return ShardedOptimizer(groups, torch.optim.AdamW, lr=3e-4, betas=(0.9, 0.95),
                            fused=device.type == "cuda")


def measure_variant(key, comm, args, rank, device):
    """Median ms of forward, backward, waiting for communication, optimizer step and the whole
    step on this rank, and memory in bytes: allocated after init, peak before and with the step."""
    cuda = device.type == "cuda"
    torch.manual_seed(rank)
    config = make_config(args.model, vocab_size=args.vocab)
    with torch.device(device):
        model = GPT(config)
    wrapped = wrap(key, model, comm, args, device)
    optimizer = sharded_adamw(model, device) if key == "sharded" else configure_optimizer(model, lr=3e-4)
    init = torch.cuda.memory_allocated(device) if cuda else None
    # random tokens, different on every rank as in real data parallelism: speed does not depend
    # on what the tokens say, and this skips the tokenizer
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(50257, (args.batch, args.seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
    phases, peaks = [], []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        # events on the compute stream: "backward" ends when its kernels do, and "wait" is only
        # the time that stream then stalls for all-reduces that were not hidden behind backward
        marks = [now(device)]
        with autocast(device, torch.bfloat16 if cuda else None):
            _, loss = wrapped(x, y)
        marks.append(now(device))
        loss.backward()
        marks.append(now(device))
        finish()
        marks.append(now(device))
        before = torch.cuda.max_memory_allocated(device) if cuda else None
        optimizer.step()
        marks.append(now(device))
        after = torch.cuda.max_memory_allocated(device) if cuda else None
        # BucketDDP's gradients are views into its buckets: zeroing them in place (rather than
        # dropping them) lets autograd accumulate straight into the bucket, with no copy per step
        optimizer.zero_grad(set_to_none=not isinstance(wrapped, BucketDDP))
        times = elapsed_ms(marks)
        if step >= args.warmup:
            phases.append(times + [sum(times)])
            peaks.append((before, after))
    return {"ms": [statistics.median(column) for column in zip(*phases)], "init": init,
            "before": max(p[0] for p in peaks) if cuda else None,
            "after": max(p[1] for p in peaks) if cuda else None}


def benchmark_worker(rank, world, device, args):
    set_tf32(True)
    results = []
    for label, key, comm in variant_list(args):
        try:
            mine = measure_variant(key, COMM_DTYPES[comm], args, rank, device)
        except torch.OutOfMemoryError:
            mine = None  # reported as OOM; identical ranks run out at the same point
        gc.collect()  # reference cycles (modules, torch's DDP) would keep this model on the GPU
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ranks = gather(mine)
        ok = all(r is not None for r in ranks)
        row = {"label": label, "key": key, "comm": comm, "oom": not ok}
        if ok:  # times averaged over ranks, memory the largest rank's
            row["ms"] = [statistics.fmean(col) for col in zip(*(r["ms"] for r in ranks))]
            for k in ("init", "before", "after"):
                row[k] = None if ranks[0][k] is None else max(r[k] for r in ranks)
        results.append(row)
        if rank == 0:
            print(f"  {label}: " + ("OOM" if not ok else f"{row['ms'][-1]:.1f} ms/step"), flush=True)
    return results


def benchmark_table(results):
    def step_of(key, comm="fp32"):
        return next((r["ms"][-1] for r in results if r["key"] == key and r["comm"] == comm and not r["oom"]), None)

    local, torch_ddp = step_of("local"), step_of("torch")
    rows = []
    for r in results:
        if r["oom"]:
            rows.append([r["label"]] + ["OOM"] * 10)
            continue
        fwd, bwd, wait, opt, step = r["ms"]
        rows.append([r["label"], f"{fwd:.1f}", f"{bwd:.1f}",
                     "in bwd" if r["key"] == "torch" else "-" if r["key"] == "local" else f"{wait:.1f}",
                     f"{opt:.1f}", f"{step:.1f}",
                     "n/a" if local is None else f"{max(0.0, 1 - local / step):.0%}",
                     "n/a" if torch_ddp is None else f"{step / torch_ddp:.2f}x",
                     *("n/a" if r[k] is None else gib(r[k]) for k in ("init", "before", "after"))])
    print_table(["variant", "fwd ms", "bwd ms", "comm wait ms", "optim ms", "step ms", "comm share",
                 "vs torch DDP", "init GiB", "peak to sync GiB", "peak w/ optim GiB"], rows)
    print("median over steps, averaged over ranks; memory: allocated, the largest rank's. comm share = "
          "(step - local step) / step, the part of the step data parallelism costs; torch DDP waits "
          "inside its backward.")
    parts = [f"{label} {step:.1f} ms" + (f" ({step / torch_ddp:.2f}x torch DDP)" if torch_ddp else "")
             for label, step in (("BucketDDP", step_of("bucket")), ("BucketDDP bf16", step_of("bucket", "bf16")))
             if step is not None]
    parts += [f"{label} {step:.1f} ms" for label, step in (("torch DDP", torch_ddp), ("no comm", local)) if step]
    sharded = next((r for r in results if r["key"] == "sharded" and r["comm"] == "fp32" and not r["oom"]), None)
    plain = next((r for r in results if r["key"] == "bucket" and r["comm"] == "fp32" and not r["oom"]), None)
    if sharded and plain and plain["after"] is not None:
        parts.append(f"ShardedOptimizer peak {gib(sharded['after'])} vs {gib(plain['after'])} GiB")
    print("summary: " + ("; ".join(parts) if parts else "no variant ran"))


def run_benchmark(args, world, backend):
    try:
        config = make_config(args.model, vocab_size=args.vocab)
    except ValueError as e:
        fail(str(e))
    if args.seq > config.block_size:
        fail(f"--seq {args.seq} is longer than the {args.model} block size {config.block_size}")
    with torch.device("meta"):
        n = GPT(config).num_params()
    where = (f"{world}x {torch.cuda.get_device_name()} over NCCL, bf16 autocast" if backend == "nccl"
             else f"{world} CPU processes over gloo, fp32 (no GPU: a smoke run, not a measurement)")
    print(f"data-parallel GPT {args.model} ({n / 1e6:.0f}M parameters) on {where}, torch {torch.__version__}: "
          f"B={args.batch} per rank, T={args.seq}, AdamW (fused on GPU), median of {args.steps} steps after {args.warmup} warm-up")
    results = launch(benchmark_worker, world, backend, args)
    if results is not None:
        benchmark_table(results)


# --- 6. command line


def positive_list(text, parse, flag):
    try:
        values = [parse(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        fail(f"{flag}: {e}")
    if not values:
        fail(f"{flag} is empty")
    return values


def main():
    parser = argparse.ArgumentParser(description="All-reduce bandwidth and data-parallel training, "
                                     "from one all-reduce per gradient to buckets and ZeRO-1.")
    sub = parser.add_subparsers(dest="command", required=True)
    ar = sub.add_parser("allreduce", help="all-reduce time and bandwidth table")
    ar.add_argument("--world", help="comma-separated world sizes (default 2,4,6,8 as GPUs allow; 2 on CPU)")
    ar.add_argument("--sizes", help="float32 buffer sizes, K/M/G = 2^10/2^20/2^30 bytes "
                    "(default 1M,10M,100M,1G; 4K,64K,1M on CPU)")
    ar.add_argument("--reps", type=int, default=20, help="timed runs per size (median reported)")
    ar.add_argument("--warmup", type=int, default=5)
    ar.add_argument("--plot", help="save a bus-bandwidth plot to this PNG (needs matplotlib)")
    bm = sub.add_parser("benchmark", help="GPT training step under every wrapper")
    bm.add_argument("--world", type=int, help="ranks (default 2, or torchrun's)")
    bm.add_argument("--model", help="preset (default xl on GPU, tiny on CPU)")
    bm.add_argument("--batch", type=int, help="sequences per rank (default 4; 2 on CPU)")
    bm.add_argument("--seq", type=int, help="context length (default 512; 32 on CPU)")
    bm.add_argument("--vocab", type=int, default=50304, help="vocabulary, padded to a multiple of 128")
    bm.add_argument("--steps", type=int, help="timed steps (default 20; 2 on CPU)")
    bm.add_argument("--warmup", type=int, help="untimed steps first (default 5; 1 on CPU)")
    bm.add_argument("--variants", default=",".join(LABELS), help=f"any of {','.join(LABELS)}")
    bm.add_argument("--comm-dtype", default="fp32,bf16", help="fp32, bf16 or both, for torch/overlap/bucket/sharded")
    bm.add_argument("--bucket-mb", type=float, default=25, help="bucket size for BucketDDP and torch DDP")
    st = sub.add_parser("selftest", help="every wrapper against one process on the whole batch")
    st.add_argument("--world", type=int, help="ranks (default 2, or torchrun's)")
    st.add_argument("--steps", type=int, default=3)
    st.add_argument("--save", help="write every rank's weights and the initial ones to this file")
    for p in (ar, bm, st):
        p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                       help="auto: nccl when there is a GPU, else gloo on the CPU")
        p.add_argument("--timeout", type=float, default=120,
                       help="seconds a collective may wait before the run fails instead of hanging")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    backend = args.backend = args.backend if args.backend != "auto" else "nccl" if cuda else "gloo"
    gpus = torch.cuda.device_count() if backend == "nccl" else 0
    default_world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 2
    for flag, least in (("reps", 1), ("steps", 1), ("batch", 1), ("seq", 1), ("timeout", 1), ("warmup", 0)):
        if getattr(args, flag, None) is not None and getattr(args, flag) < least:
            fail(f"--{flag} must be at least {least}")
    if int(os.environ.get("RANK", 0)) != 0:  # under torchrun only rank 0 prints
        sys.stdout = open(os.devnull, "w")

    if args.command == "allreduce":
        defaults = [w for w in (2, 4, 6, 8) if w <= gpus] if gpus else [2]
        worlds = positive_list(args.world, int, "--world") if args.world else defaults or [gpus]
        if under_torchrun() and not args.world:
            worlds = [default_world]
        args.size_bytes = positive_list(args.sizes or ("1M,10M,100M,1G" if gpus else "4K,64K,1M"),
                                        parse_size, "--sizes")
        for world in worlds:
            check_launch(world, backend)
        run_allreduce(args, worlds, backend)
        return
    world = default_world if args.world is None else args.world
    check_launch(world, backend)
    if args.command == "selftest":
        run_selftest(args, world, backend)
        return
    on_gpu = backend == "nccl"
    for flag, gpu_value, cpu_value in (("model", "xl", "tiny"), ("batch", 4, 2), ("seq", 512, 32),
                                       ("steps", 20, 2), ("warmup", 5, 1)):
        if getattr(args, flag) is None:
            setattr(args, flag, gpu_value if on_gpu else cpu_value)
    args.variants = positive_list(args.variants, str.strip, "--variants")
    args.comm_dtypes = positive_list(args.comm_dtype, str.strip, "--comm-dtype")
    for v in args.variants:
        if v not in LABELS:
            fail(f"unknown variant '{v}'; choose from {', '.join(LABELS)}")
    for c in args.comm_dtypes:
        if c not in COMM_DTYPES:
            fail(f"unknown --comm-dtype '{c}'; choose from fp32, bf16")
    if args.bucket_mb <= 0:
        fail("--bucket-mb must be positive")
    run_benchmark(args, world, backend)


if __name__ == "__main__":
    main()
