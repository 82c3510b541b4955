"""Train GPT-2 on Tiny Shakespeare, as fast as one GPU (or several) allows.

Each flag is a speed-up the other scripts measure: --tf32, --bf16 / --fp16, --attn, --vocab 50304, --compile (and
then the whole step, micro-batches and all-reduce included, one CUDA graph: --no-cuda-graph), --fp8 (H100/H200, in
the block layers wide enough to gain); on by default, the output layer fused with the loss (--no-fused-ce turns it
off), each residual add fused with the LayerNorm after it (--no-fused-norms), the MLP's and c_proj's biases added by
those kernels (--no-fused-bias), cuBLAS without a workspace, so no memset runs before each matmul
(--cublas-workspace keeps PyTorch's), the tied embedding's gradient added into the fused loss's, AdamW's matrices
stepped by gpt.py's kernel, with --bf16 the blocks' weights kept in bf16 by the optimizer, cast once a step,
micro-batches' gradients summed in fp32 (--no-master-weights) and, on a GPU in bf16/fp16, flash_triton.py's
attention (--attn sdpa for SDPA's). The loop never makes the GPU wait: a step's loss is read back while the GPU runs
the next. Several GPUs: torchrun, data parallel (the gradients averaged after backward by one all-reduce per dtype,
the kept bf16 weights' in bf16, inside the graph) or --fsdp (FSDP2: weights, gradients and optimizer state sharded);
--recompute K recomputes every K-th block's activations in backward. Ctrl-C saves --ckpt and prints how to resume.
--nvtx names each step and its phases for Nsight Systems (nsys profile --trace=cuda,nvtx). Without CUDA the same
command trains `tiny` on a short context.

    python train.py --vocab 50304 --bf16 --compile                 # the headline run
    python train.py --vocab 50304 --bf16 --compile --fp8 0         # FP8 in every block (--fp8: >= 2048 wide)
    torchrun --nproc_per_node=2 train.py --vocab 50304 --bf16 --compile          # data parallel on two GPUs
    torchrun --nproc_per_node=2 train.py --model 2.7B --vocab 50304 --fsdp --bf16 --compile --recompute 2
    python train.py --steps 40 --ckpt run.pt --stop-after 20; python train.py --steps 40 --ckpt run.pt --resume
"""

import argparse
import contextlib
import io
import math
import os
import shlex
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

import gpt  # gpt.NVTX: the switch --nvtx sets
from gpt import (ATTENTION, FP8_MIN_WIDTH, GPT, GPT2_VOCAB, GPU_ONLY_ATTENTION, GraphedStep, MasterWeights, amp_dtype,
                 autocast, average_gradients, check_host_memory, check_output_path, clock, compile_model,
                 configure_optimizer, default_attention, elapsed_ms, fail, float_in, flops_per_token, fmt_mfu,
                 fp8_supported, fully_shard_gpt, gib, gpt2_tokenizer, int_in, is_oom, load_tokens, make_config, mfu,
                 nvtx_range, on_device, print_table, resolve_device, set_cublas_workspace, set_tf32,
                 start_process_group, step_bytes, train_step, use_fp8)

# --- 1. the model on the GPUs: FP8 layers, FSDP2 sharding, torch.compile; the step as one CUDA graph
def graphed(run, device):
    """Whether the step runs as one CUDA graph (gpt.GraphedStep): on a GPU, compiled, with one process or several,
    with or without accumulation. Not with fp16 (GradScaler checks for infs on the host), nor FSDP (its all-gathers
    are launched by hooks around each block), nor --no-cuda-graph."""
    return device.type == "cuda" and run.compile and run.cuda_graph and not run.fp16 and not run.fsdp

def master_weights_apply(run):
    """gpt.MasterWeights: bf16 block weights in the model, fp32 masters in the optimizer, training in bf16, in one
    process or data parallel (the bf16 gradients all-reduced in bf16, half the bytes of fp32's), with or without
    accumulation (the micro-batches' gradients summed in fp32, rounded to bf16 once). Not with FSDP, which keeps
    its own fp32 shards, nor FP8, whose Linears cast their own weights."""
    return run.master_weights and run.bf16 and run.fp8 is None and not run.fsdp

def build(run, config, state, rank, world, device, log):
    """(raw model, the module the loop calls, optimizer, scaler, first step, read position)."""
    torch.manual_seed(run.seed)  # the same initial weights on every rank
    with torch.device(device):  # built where it trains: no host copy of a 2.7B model to initialise and move
        raw_model = GPT(config)
    if run.fp8 is not None:
        plan = use_fp8(raw_model, run.fp8)
        if rank == 0:
            print_fp8_table(plan, run.fp8, config)
    if run.fsdp:
        fully_shard_gpt(raw_model, torch.bfloat16 if run.bf16 else None)  # in place: now sharded
    if master_weights_apply(run):  # the blocks' weights become bf16 here, before compiling
        optimizer = MasterWeights(raw_model, run.lr, run.weight_decay)
    else:
        optimizer = configure_optimizer(raw_model, run.lr, run.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=run.fp16)  # fp16 gradients underflow without it
    step, pos = 0, 0
    if state is not None:
        step, pos = apply_checkpoint(state, run.ckpt, raw_model, optimizer, scaler)
        log(f"resumed from {run.ckpt} at step {step}")
    if world > 1 and not run.fsdp:  # as DDP starts: every rank from rank 0's weights
        weights = list(raw_model.state_dict().values())
        if isinstance(optimizer, MasterWeights):  # and from its fp32 masters, which the optimizer steps
            weights += optimizer.masters
        for t in weights:
            dist.broadcast(t, 0)
    model = raw_model
    if run.compile:  # under FSDP it compiles each block's forward (one graph all blocks share), not the hooks
        model = compile_model(raw_model)
    return raw_model, model, optimizer, scaler, step, pos


# --- 2. one optimizer step: gpt.train_step (micro-batches, lr, the ranks' gradients averaged, GradScaler), captured
# in one CUDA graph where it can be; then the ranks' vote
def average_and_vote(loss, vote, world):
    """One all-reduce averages the loss over the ranks and counts those asked to stop (StopSignal): queued, not
    awaited; StepLog reads both a step later. The gradients were averaged inside the step."""
    stats = torch.stack([loss, torch.full((), float(vote), device=loss.device)])
    dist.all_reduce(stats)
    return stats[0] / world, stats[1]

def micro_batches(tokens, pos, run, rank, world, device):
    """(inputs, targets, next read position): grad_accum micro-batches, each rank its own rows of each."""
    B, T = run.batch, run.seq
    xs, ys = [], []
    for _ in range(run.grad_accum):
        x, y = get_batch(tokens, pos + rank * B * T, B, T, device)
        xs.append(x)
        ys.append(y)
        pos = next_position(pos, B * T * world, len(tokens))
    return xs, ys, pos


# --- 3. the loop: a line per step without waiting, and a clean stop on Ctrl-C / SIGTERM
class StepLog:
    """A line per step that never makes the GPU wait for the host.

    `loss.item()` would block until everything queued has run, leaving the GPU idle while the host
    prints and then queues the next step's first kernels. Instead each step's loss and grad norm
    are copied to (pinned) host memory without blocking, followed by an event, and step k's line
    is printed once step k+1 is queued: the host waits for step k alone while the GPU runs k+1.
    Step times are read off those events, on the GPU's own timeline: from the end of one step to
    the end of the next, so any time the GPU sat idle waiting for the host is counted."""

    def __init__(self, first_step, tokens_per_step, flops_per_step, device, nan_hint, log):
        self.first, self.tokens, self.flops, self.device = first_step, tokens_per_step, flops_per_step, device
        self.nan_hint, self.log = nan_hint, log
        self.times, self.pending, self.stop_votes, self.peak = [], None, 0, 0
        self.resume()

    def pause(self):
        """Before evaluating or saving: wait for the last step, print its line, keep its peak memory."""
        if self.pending is not None:
            self.print_line(*self.pending)
            self.pending = None
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))

    def resume(self):
        """Time and track memory afresh from here: neither the time nor the memory of evaluation
        (whose [tokens, vocab] logits can outweigh a training step's) counts."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.last_end = clock(self.device)

    def mem(self):  # allocated by tensors in training steps, not what the allocator reserved
        cuda = self.device.type == "cuda"
        return f"{gib(max(self.peak, torch.cuda.max_memory_allocated(self.device)))} GiB" if cuda else "n/a"

    def queue(self, step, lr, loss, norm, votes=None):
        values = torch.stack([loss.float(), norm.float()] + ([] if votes is None else [votes]))
        values = values.to("cpu", non_blocking=True)
        end = clock(self.device)  # queued after the copy: once it fires, `values` is on the host
        previous, self.pending = self.pending, (step, lr, values, self.last_end, end)
        self.last_end = end
        if previous is not None:
            self.print_line(*previous)

    def print_line(self, step, lr, values, start, end):
        dt = elapsed_ms(start, end) / 1e3  # waits for `end`, and so for `values`
        self.times.append(dt)
        loss, norm, *votes = values.tolist()
        self.stop_votes += sum(votes)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}; likely cause: {self.nan_hint}")
        self.log(f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | norm {norm:.3f} | dt {dt * 1e3:7.1f} ms | "
                 f"{self.tokens / dt:10,.0f} tok/s | MFU {fmt_mfu(mfu(self.flops / dt, self.device))} | "
                 f"mem {self.mem()}")

    def summary(self, extra=""):
        """Median step time once the first steps (compilation, cuDNN/cuBLAS warm-up) are behind us."""
        skip = min(10, len(self.times) // 2)
        median = statistics.median(self.times[skip:])
        return (f"summary: median step {median * 1e3:.1f} ms over steps {self.first + skip}-"
                f"{self.first + len(self.times) - 1} | {self.tokens / median:,.0f} tok/s | "
                f"MFU {fmt_mfu(mfu(self.flops / median, self.device))} | peak mem {self.mem()}{extra}")

class StopSignal:
    """Ctrl-C (SIGINT) and SIGTERM set a flag instead of raising in the middle of a step, so the
    loop can finish the step, save and say how to resume. Under torchrun every rank must stop
    after the same step (FSDP's next forward would wait forever for a rank that left, and saving
    needs them all): each rank's flag rides in the all-reduce that already averages the loss, and
    StepLog reads the sum with the loss, a step later, so agreeing costs no extra sync."""

    def __init__(self):
        self.signum = None
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, signum, frame):
        self.signum = self.signum or signum

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

def quiet(*args, **kwargs):  # the log of ranks other than 0
    return None

def train(run, config, data, state, rank, world, device):
    log = print if rank == 0 else quiet
    dtype = amp_dtype(run.bf16, run.fp16)
    set_tf32(run.tf32)
    set_cublas_workspace(run.cublas_workspace)
    train_tokens, val, eval_plan = data
    raw_model, model, optimizer, scaler, step, pos = build(run, config, state, rank, world, device, log)
    # Data parallel: the gradients averaged over the ranks once, after the last micro-batch (gpt.average_gradients).
    # FSDP reduce-scatters inside backward, after every micro-batch.
    reduce = None
    if world > 1 and not run.fsdp:
        reduce = partial(average_gradients, [p for p in raw_model.parameters() if p.requires_grad], world)
    graph = None
    tokens_per_step = run.batch * run.seq * run.grad_accum * world
    flops_per_step = flops_per_token(config, run.seq) * tokens_per_step / world  # per GPU
    weights = ""
    if isinstance(optimizer, MasterWeights):
        weights = ", bf16 weights kept by the optimizer"
    log(f"model {run.model}: {raw_model.num_params():,} parameters, attention {config.attn}{weights} | "
        f"{tokens_per_step:,} tokens per step "
        f"(batch {run.batch} x seq {run.seq} x accum {run.grad_accum} x {processes(world, run.fsdp)})")
    if eval_plan[0] < run.batch:
        log(f"the validation split holds {len(val):,} tokens: evaluating {eval_plan[0]} sequences per process")
    nan_hint = f"a learning rate too high (--lr {run.lr})"
    if run.fp16:
        nan_hint = "fp16 overflow without loss scaling"
    steps = StepLog(step, tokens_per_step, flops_per_step, device, nan_hint, log)
    if run.compile:
        log("compiling... (torch.compile: the first step takes 20-60 s)")
    stop, stopping = StopSignal(), False
    try:
        for step in range(step, run.last):
            xs, ys, pos = micro_batches(train_tokens, pos, run, rank, world, device)
            lr = lr_at(step, run.lr, run.min_lr, run.warmup, run.steps)
            if graph is None and graphed(run, device):  # captured at the first step, after warm-up steps it undoes
                graph = GraphedStep(model, optimizer, xs, ys, dtype, run.grad_clip, reduce)
            with nvtx_range(f"step {step}"):
                if graph is None:
                    loss, norm = train_step(model, optimizer, xs, ys, dtype, scaler, run.grad_clip, lr=lr,
                                            reduce=reduce, return_norm=True)
                else:
                    loss, norm = graph(xs, ys, lr)
            votes = None
            if world > 1:
                loss, votes = average_and_vote(loss, stop.signum is not None, world)
            steps.queue(step, lr, loss, norm, votes)  # prints the previous step's line while the GPU runs this one
            at_eval = (step + 1) % run.eval_every == 0 or step + 1 == run.last
            # every rank has read the same votes at this point, so all take the same branch
            stopping = stop.signum is not None
            if world > 1:
                stopping = steps.stop_votes > 0
            if at_eval or stopping:
                steps.pause()  # val loss and the checkpoint must see this step's weights
                if not stopping:
                    val_mean = val_loss(raw_model, val, eval_plan, run.seq, rank, world, device, dtype)
                    log(f"step {step:5d} | val loss {val_mean:.4f}")
                if run.ckpt:
                    save_checkpoint(run.ckpt, raw_model, optimizer, scaler, step + 1, pos, run, rank, world)
                steps.resume()
            if stopping:
                break
    finally:
        stop.restore()
    if stopping:
        log(f"interrupted ({signal.Signals(stop.signum or signal.SIGTERM).name}) after step {step}: "
            + resume_hint(run, step + 1, world))
        raise SystemExit(128 + (stop.signum or signal.SIGTERM))
    log(steps.summary(recompute_cost(config, run.seq)) + f" | val loss {val_mean:.4f}")
    if run.sample and (run.fsdp or rank == 0):  # under FSDP every rank must take part in each forward
        print_sample(raw_model, run.sample, device, dtype, run.seed, log)

def processes(world, fsdp):  # "1 process", "2 processes, FSDP"
    words = f"{world} process"
    if world > 1:
        words += "es"
    if fsdp:
        words += ", FSDP"
    return words

def resume_hint(run, step, world):
    """What the checkpoint holds and the command that continues it: the same flags with --resume."""
    if not run.ckpt:
        return "nothing saved (no --ckpt)"
    launcher, nodes = ["python"], ""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun's processes on this node
    if world > 1:
        launcher = ["torchrun", f"--nproc_per_node={per_node}"]
    if per_node < world:  # several nodes: each starts its agent again, meeting where they met before
        launcher[1:1] = [f"--nnodes={world // per_node}"]
        nodes = " (on every node, with this job's --rdzv-* flags)"
    again = shlex.join(launcher + ["train.py"] + [a for a in run.argv if a != "--resume"] + ["--resume"])
    return f"checkpoint {run.ckpt} holds step {step}; resume with: {again}{nodes}"

def recompute_cost(config, T):
    """' | recompute ...': the blocks recomputed and the forward FLOPs they add to a step, as a
    share of the step's model FLOPs (a block's forward: 2 per weight, 4*d*T of attention, per token)."""
    K, L, d = config.recompute, config.n_layer, config.n_embd
    if not K:
        return ""
    n = len(range(0, L, K))
    extra = n * (2 * (4 * d * d + 2 * d * config.d_ff) + 4 * d * T) / flops_per_token(config, T)
    return f" | recompute {n}/{L} blocks: +{100 * extra:.0f}% FLOPs (not in MFU)"

def print_fp8_table(plan, min_width, config):
    """Which Linears run their matmuls in FP8: the block's four where both widths reach --fp8
    (default gpt.FP8_MIN_WIDTH: narrower matmuls are too small to repay the scaling passes)."""
    rows = Counter((name.split(".", 2)[2], f"{n_in} x {n_out}",  # h.3.attn.c_attn -> attn.c_attn
                    "FP8 (e4m3; gradients e5m2)" if fp8 else f"bf16 (below {min_width} wide)")
                   for name, n_in, n_out, fp8 in plan)
    head = "bf16"
    if config.fused_ce:
        head = "bf16 (fused with the loss)"
    rows[("lm_head", f"{config.n_embd} x {config.vocab_size}", head)] = 1
    print_table(["Linear layer", "in x out", "matmuls in", "count"], [[*k, n] for k, n in rows.items()])
    n = sum(fp8 for *_, fp8 in plan)
    hint = ""
    if n < len(plan):
        hint = "; --fp8 0 converts all"
    print(f"--fp8 {min_width}: {n} of {len(plan)} block Linears in FP8{hint}")


# --- 4. data: Tiny Shakespeare as GPT-2 tokens, read sequentially so a run can resume exactly
def get_batch(tokens, pos, B, T, device):
    """Inputs and next-token targets from tokens[pos : pos + B*T + 1]. Pinned host memory lets the
    copy to the GPU run asynchronously (non_blocking), overlapping the previous step's work."""
    chunk = tokens[pos : pos + B * T + 1]
    x, y = chunk[:-1].view(B, T), chunk[1:].view(B, T)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y

def next_position(pos, stride, n_tokens):
    """Advance the read position by one step of all ranks; wrap before running off the end."""
    pos += stride
    return 0 if pos + stride + 1 > n_tokens else pos

def lr_at(step, lr, min_lr, warmup, steps):
    """Linear warm-up to lr over `warmup` steps, then cosine decay to min_lr at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (lr - min_lr)


# --- 5. checkpoints: one file for one process, DDP and FSDP, written atomically
# Full (unsharded) state dicts keyed by parameter name, gathered to rank 0's CPU and written by it,
# rather than torch.distributed.checkpoint (each rank writes its own shards into a folder): one
# file anyone can torch.load, that resumes on any number of processes with or without FSDP. The
# price is a gather through rank 0's host memory (2.7B: 11 GB of weights + 22 GB of Adam state),
# fine at these sizes; sharded writes win when that no longer fits.
KIND = "nanoperf train.py checkpoint, format 2"

def precision_of(run):
    """The flags that set the arithmetic: a resumed run may change them, and is told so."""
    parts = ["fp32"]
    if run.bf16:
        parts = ["bf16"]
    if run.fp16:
        parts = ["fp16"]
    if run.tf32:
        parts.append("tf32")
    if run.fp8 is not None:
        parts.append(f"fp8 (min width {run.fp8})")
    return " + ".join(parts)

def run_fields(run, world):
    """What must match for a resumed run to continue the same run (the data order and schedule)."""
    return {"model": run.model, "vocab": run.vocab, "seq": run.seq, "grad_accum": run.grad_accum,
            "steps": run.steps, "sequences": run.batch * world}

def save_checkpoint(path, model, optimizer, scaler, step, pos, run, rank, world):
    if not (run.fsdp or rank == 0):  # gathering FSDP's shards takes every rank; DDP's ranks hold copies
        return
    if isinstance(optimizer, MasterWeights):  # the fp32 masters, as a run without it saves its weights
        model_state, optimizer_state = optimizer.full_state(model)
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it all, the others {}
        model_state = get_model_state_dict(model, options=options)
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    state = {"kind": KIND, "model": model_state, "optimizer": optimizer_state,
             "scaler": scaler.state_dict(), "step": step, "pos": pos, "run": run_fields(run, world),
             "precision": precision_of(run)}
    if rank != 0:
        return
    before = "the previous one is intact"
    if not os.path.exists(path):
        before = "no checkpoint has been written yet"
    try:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # a crash mid-write leaves the previous checkpoint intact
    except (OSError, RuntimeError) as e:  # torch.save reports a file it cannot open as a RuntimeError
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[-1]
        raise ValueError(f"could not write the checkpoint {path} ({reason}); {before}") from None
    finally:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")

def read_checkpoint(path, run, world):
    """The checkpoint at `path`, or a ValueError saying in one sentence why it is not one for this run."""
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path} is an empty file, not a checkpoint")
    try:  # weights_only: plain tensors and containers, never arbitrary pickled code; mmap: no copy
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ValueError(f"{path} is not a checkpoint: torch.load cannot read it ({type(e).__name__})") from None
    if not (isinstance(state, dict) and state.get("kind") == KIND):
        what = f"a {type(state).__name__} of another kind"
        if isinstance(state, torch.Tensor):
            what = "a bare tensor"
        elif isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values()):
            what = "weights alone (a state_dict)"
        raise ValueError(f"{path} holds {what}, not a train.py checkpoint")
    for key, now in run_fields(run, world).items():
        flag = "sequences per micro-step (--batch x processes)" if key == "sequences" else "--" + key.replace("_", "-")
        if state["run"].get(key) != now:
            raise ValueError(f"{path} was made with {flag} {state['run'].get(key)}, not {now}")
    return state

def is_checkpoint(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("kind") == KIND
    except Exception:
        return False

def apply_checkpoint(state, path, model, optimizer, scaler):
    """Load the full state into the (possibly sharded) model and optimizer: each rank keeps its shard."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # DTensors report the full shape
    have = {k: tuple(v.shape) for k, v in state["model"].items()}
    if have != want:
        k = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))[0]
        raise ValueError(f"{path} does not fit this model: {k} is {have.get(k, 'missing')} there, "
                         f"{want.get(k, 'absent')} here")
    if isinstance(optimizer, MasterWeights):
        optimizer.load_full_state(model, state["model"], state["optimizer"])
    else:
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=options)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    scaler.load_state_dict(state["scaler"])
    return state["step"], state["pos"]


# --- 6. evaluation and sampling
@torch.no_grad()
def val_loss(model, val, plan, T, rank, world, device, dtype):
    """Mean loss over the first batches of the validation split (the same every time). Each rank
    takes its own rows of each batch, as in training, and the sums are all-reduced: FSDP needs
    every rank in every forward anyway, since each one all-gathers the weights from all ranks."""
    rows, n_batches = plan
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(n_batches):
        x, y = get_batch(val, (i * world + rank) * rows * T, rows, T, device)
        with autocast(device, dtype):
            total += model(x, y)[1].float()
    model.train()
    if world > 1:
        dist.all_reduce(total)
    return total.item() / (n_batches * world)

def print_sample(model, n_tokens, device, dtype, seed, log):
    enc = gpt2_tokenizer()
    prompt = torch.tensor([enc.encode_ordinary("\n")], device=device)
    with autocast(device, dtype):  # a seeded generator: every rank draws the same tokens
        out = model.generate(prompt, n_tokens, temperature=0.8, top_k=200,
                             generator=torch.Generator(device).manual_seed(seed))
    log(f"--- sample ({n_tokens} tokens)\n{enc.decode(out[0].tolist())}\n---")


# --- 7. command line and the checks made before any work
def parse_args(argv):
    p = argparse.ArgumentParser(description="Train GPT-2 on Tiny Shakespeare.")
    positive = int_in(1)
    p.add_argument("--model", help="preset: tiny, gpt2, small, medium, large, xl, 2.7B (default gpt2; tiny on CPU)")
    p.add_argument("--vocab", type=int_in(GPT2_VOCAB), default=GPT2_VOCAB, help="vocabulary size (50304: 50257 "
                   "padded); at least the tokenizer's 50257")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--fp16", action="store_true", help="fp16 autocast with a GradScaler (CUDA only)")
    p.add_argument("--tf32", action="store_true", help="TF32 tensor cores for fp32 matmuls")
    p.add_argument("--fp8", type=int_in(0), nargs="?", const=FP8_MIN_WIDTH, metavar="MIN_WIDTH", help="FP8 matmuls "
                   f"(H100/H200, with --bf16) in block Linears MIN_WIDTH wide (default {FP8_MIN_WIDTH}; 0: all)")
    p.add_argument("--no-fused-ce", action="store_true", help="materialise the logits for the loss (unfused)")
    p.add_argument("--no-fused-norms", action="store_true", help="residual adds and LayerNorms as separate ops "
                   "(fused by default, except with --fsdp or --recompute)")
    p.add_argument("--no-fused-bias", action="store_true", help="biases added by the matmuls, not by the fused "
                   "GELU and add + LayerNorm kernels (fused with the fused norms by default)")
    p.add_argument("--no-master-weights", action="store_true", help="autocast's casts of the fp32 weights every "
                   "step, not bf16 weights kept by the optimizer (gpt.MasterWeights: by default with --bf16, without "
                   "--fsdp or --fp8)")
    p.add_argument("--no-cuda-graph", action="store_true", help="launch the step's kernels from Python every step, "
                   "not one CUDA graph of the whole step (by default with --compile on a GPU, except fp16 and FSDP)")
    p.add_argument("--cublas-workspace", action="store_true", help="keep cuBLAS's workspace (PyTorch's default; "
                   "without it, the default here, cuBLAS's Hopper kernels need no memset before each matmul)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--attn", choices=ATTENTION, help="attention implementation (default: triton on a GPU with "
                   "--bf16/--fp16 where its kernels take the head dim, else sdpa)")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (under torchrun, 2+ processes)")
    p.add_argument("--recompute", type=positive, metavar="K", help="recompute every K-th block in backward (1: all)")
    p.add_argument("--batch", type=positive, help="sequences per micro-step per GPU (default 16; 8 on CPU)")
    p.add_argument("--seq", type=positive, help="context length (default 1024; 64 on CPU)")
    p.add_argument("--steps", type=positive, help="optimizer steps, the span of the schedule (default 200; 50 on CPU)")
    p.add_argument("--stop-after", type=positive, metavar="STEP", help="stop when the run reaches this step (counted "
                   "from the run's start, also after --resume), as if interrupted")
    p.add_argument("--grad-accum", type=positive, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float_in(0), default=6e-4, help="peak learning rate")
    p.add_argument("--warmup", type=int_in(0), default=20, help="linear warm-up steps")
    p.add_argument("--min-lr", type=float_in(0), help="final learning rate of the cosine decay (default lr/10)")
    p.add_argument("--weight-decay", type=float_in(0), default=0.1)
    p.add_argument("--grad-clip", type=float_in(0), default=1.0, help="clip the global grad norm (0: off)")
    p.add_argument("--eval-every", type=positive, default=50, help="val loss every N steps (and at the end)")
    p.add_argument("--eval-steps", type=positive, default=10, help="val batches per evaluation (at most all of val)")
    p.add_argument("--sample", type=int_in(0), default=0, metavar="N", help="print N generated tokens at the end")
    p.add_argument("--data", help="training text (default: input.txt next to gpt.py); the last 10%% is validation")
    p.add_argument("--ckpt", help="checkpoint path, written at every evaluation, at the end and on Ctrl-C")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt")
    p.add_argument("--overwrite", action="store_true", help="start over, replacing the checkpoint at --ckpt")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges (step, forward, backward, optimizer step; naive "
                   "attention's stages) for nsys profile --trace=cuda,nvtx; CUDA only, ignored on the CPU")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda if present)")
    p.add_argument("--seed", type=int_in(), default=1337)
    return p.parse_args(argv)

@dataclass(frozen=True)
class Run:
    """The run's settings: the flags with the device's defaults filled in, made once in main and passed down."""
    model: str
    vocab: int
    batch: int
    seq: int
    steps: int
    last: int  # the loop stops before this step: --steps, or --stop-after
    stop_after: int
    grad_accum: int
    lr: float
    min_lr: float
    warmup: int
    weight_decay: float
    grad_clip: float
    eval_every: int
    eval_steps: int
    bf16: bool
    fp16: bool
    tf32: bool
    fp8: int
    fused_ce: bool
    fused_norms: bool
    fused_bias: bool
    cublas_workspace: bool
    cuda_graph: bool  # asked for (not --no-cuda-graph); used where graphed says
    master_weights: bool  # asked for (not --no-master-weights); used where master_weights_apply says
    compile: bool
    attn: str
    fsdp: bool
    recompute: int
    sample: int
    seed: int
    data: str
    ckpt: str
    resume: bool
    argv: tuple  # the command line, repeated by the resume command printed on Ctrl-C

def settings(args, argv, device):
    """The flags as a Run, with the defaults of this device (GPU: the headline run; CPU: seconds)."""
    min_lr = args.lr / 10
    if args.min_lr is not None:
        min_lr = args.min_lr
    if min_lr > args.lr:
        raise ValueError(f"--min-lr {min_lr} must be between 0 and --lr {args.lr}")
    steps = args.steps or on_device(device, cpu=50, gpu=200)
    last = steps
    if args.stop_after is not None:
        last = min(steps, args.stop_after)
    return Run(model=args.model or on_device(device, cpu="tiny", gpu="gpt2"), vocab=args.vocab,
               batch=args.batch or on_device(device, cpu=8, gpu=16),
               seq=args.seq or on_device(device, cpu=64, gpu=1024), steps=steps, last=last,
               stop_after=args.stop_after, grad_accum=args.grad_accum, lr=args.lr,
               min_lr=min_lr, warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
               eval_every=args.eval_every, eval_steps=args.eval_steps, bf16=args.bf16, fp16=args.fp16,
               tf32=args.tf32, fp8=args.fp8, fused_ce=not args.no_fused_ce, fused_norms=not args.no_fused_norms,
               fused_bias=not args.no_fused_bias, cublas_workspace=args.cublas_workspace,
               master_weights=not args.no_master_weights, cuda_graph=not args.no_cuda_graph, compile=args.compile,
               attn=args.attn, fsdp=args.fsdp, recompute=args.recompute or 0, sample=args.sample, seed=args.seed,
               data=args.data,
               ckpt=args.ckpt, resume=args.resume, argv=tuple(argv))

def check_flags(args):
    """Combinations, and the checkpoint path, before anything starts (ValueError)."""
    amp_dtype(args.bf16, args.fp16)  # raises if both
    if args.fsdp and args.fp16:
        raise ValueError("--fsdp runs in bf16 or fp32 here; fp16 would need a sharded GradScaler")
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite are exclusive: continue the checkpoint, or start over")
    if args.resume and args.ckpt is None:
        raise ValueError("--resume needs --ckpt PATH, the checkpoint to continue")
    if args.ckpt is not None:  # never write over a file that is not one of our checkpoints
        ours = is_checkpoint
        if args.resume:
            ours = None
        check_output_path(args.ckpt, "--ckpt", ours=ours)
    if args.resume and not os.path.isfile(args.ckpt):
        raise ValueError(f"--resume needs an existing --ckpt file, and '{args.ckpt}' does not exist")
    if args.ckpt and os.path.isfile(args.ckpt) and not (args.resume or args.overwrite):  # nor over a run of ours
        raise ValueError(f"--ckpt {args.ckpt} already holds a checkpoint: continue it with --resume, or start over "
                         "with --overwrite or another --ckpt")

def check_model(run, device):
    """The model's config, or a ValueError: sizes within the preset, the device able to run the flags."""
    # FSDP gathers a block's weights when the block is called; the fused norms read the next block's ln_1 before
    fused_norms = run.fused_norms and not run.fsdp
    preset = make_config(run.model)  # a ValueError for an unknown name
    head_dim = preset.n_embd // preset.n_head
    attn = run.attn or default_attention(device, amp_dtype(run.bf16, run.fp16), head_dim)  # the fastest measured
    config = make_config(run.model, vocab_size=run.vocab, attn=attn, fused_ce=run.fused_ce, fused_norms=fused_norms,
                         fused_bias=run.fused_bias and fused_norms)  # the fused norms' kernels add the biases
    if run.recompute > config.n_layer:
        raise ValueError(f"--recompute {run.recompute} is above the {config.n_layer} layers of '{run.model}'")
    config.recompute = run.recompute
    if run.seq > config.block_size:
        raise ValueError(f"--seq {run.seq} is above the block size {config.block_size} of '{run.model}'")
    if run.fp16 and device.type != "cuda":
        raise ValueError("--fp16 needs a CUDA GPU (its GradScaler is CUDA-only here); use --bf16 on the CPU")
    if device.type == "cpu" and run.attn in GPU_ONLY_ATTENTION:
        raise ValueError(f"--attn {run.attn} needs a CUDA GPU")
    if run.fp8 is not None and not fp8_supported(device):
        name = "the CPU"
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
        raise ValueError(f"--fp8 needs a GPU with FP8 tensor cores (H100, H200, Ada), and {name} has none")
    if run.fp8 is not None and not run.bf16:
        raise ValueError("--fp8 needs --bf16: the layers around the FP8 matmuls run in bf16")
    return config

def check_data(run, world):
    """(train tokens, val tokens, eval plan (rows, batches)), or a ValueError when a step or val does not fit."""
    if run.data and os.path.isdir(run.data):
        raise ValueError(f"--data {run.data} is a directory; give the text file itself")
    if run.data:
        tokens = load_tokens(run.data)
    else:
        tokens = load_tokens()
    train_tokens, val = tokens[: int(0.9 * len(tokens))], tokens[int(0.9 * len(tokens)) :]  # the last 10%: validation
    window = run.batch * run.seq * world  # tokens one micro-step reads across the ranks
    if window + 1 > len(train_tokens):
        raise ValueError(f"the training split holds {len(train_tokens):,} tokens, fewer than one step's "
                         f"batch x seq x processes = {window:,}; lower --batch or --seq, or use more text")
    rows = min(run.batch, (len(val) - 1) // (run.seq * world))  # sequences per rank that fit in val
    if rows == 0:
        raise ValueError(f"the validation split holds {len(val):,} tokens, fewer than --seq {run.seq} x "
                         f"{world} process(es); lower --seq or use more text")
    return train_tokens, val, (rows, min(run.eval_steps, (len(val) - 1) // (rows * run.seq * world)))

def check_resume(run, world):
    """(checkpoint state or None, a note to print or None), or a ValueError when it cannot continue this run."""
    if not run.resume:
        return None, None
    state = read_checkpoint(run.ckpt, run, world)
    if state["step"] >= run.last:
        stop = ""
        if run.stop_after:
            stop = f" --stop-after {run.stop_after} (a step of the run, not a count)"
        raise ValueError(f"{run.ckpt} is at step {state['step']}: nothing left to run with --steps {run.steps}{stop}")
    before = state.get("precision", precision_of(run))
    if before != precision_of(run):
        return state, f"note: {run.ckpt} was trained in {before}; this run continues in {precision_of(run)}"
    return state, None

def said_once(quiet, check, *args):
    """check(*args), a check that ends the process itself (argparse: usage and error, or --help; gpt's memory
    check) or prints a note (gpt.default_attention's): on torchrun's ranks other than 0 (quiet) without a word, rank
    0 saying the same once."""
    if not quiet:
        return check(*args)
    said = io.StringIO()  # kept, in case rank 0 does not meet the same mistake
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            return check(*args)
    except SystemExit as e:
        if e.code == 2:  # a mistake (--help exits 0)
            exit_after_rank_0(said.getvalue())
        raise

RANK_0_GRACE_S = 30  # rank 0 meets the same mistake within moments: this limit is reached only without torchrun

def exit_after_rank_0(message):
    """A rank other than 0 that met a mistake exits 2 once rank 0, meeting the same, has printed it and exited:
    torchrun ends the other ranks (SIGTERM) as soon as one exits, and a rank 0 ended before it prints would leave
    no sentence at all. That SIGTERM ends the wait. If it never comes, rank 0 did not meet this mistake (a host
    memory check passed there by a hair, a file missing on this node only): this rank says it itself."""
    signal.signal(signal.SIGTERM, exit_2)
    time.sleep(RANK_0_GRACE_S)
    print(f"rank {os.environ.get('RANK', '?')}: {message.strip()}", file=sys.stderr)
    raise SystemExit(2)

def exit_2(signum, frame):  # torchrun's SIGTERM after rank 0 exited 2: the same status, no traceback
    raise SystemExit(2)

def ranks_and_device(fsdp, device_name):
    """(rank, world, device) from torchrun's RANK, WORLD_SIZE and LOCAL_RANK, before any process group exists."""
    if "RANK" not in os.environ:
        if fsdp:
            raise ValueError("--fsdp shards the model across processes: run it under torchrun --nproc_per_node=2")
        return 0, 1, resolve_device(device_name)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if fsdp and world < 2:
        raise ValueError("--fsdp with one process shards nothing: use --nproc_per_node=2 or more")
    device = resolve_device(device_name)
    if device.type != "cuda":
        return rank, world, device
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", local + 1))  # the same on every rank: all say it, rank 0 too
    if per_host > torch.cuda.device_count():
        raise ValueError(f"--nproc_per_node={per_host} is more processes than the {torch.cuda.device_count()} "
                         "GPU(s) of this machine: one GPU per process")
    return rank, world, torch.device("cuda", local)

def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    quiet = os.environ.get("RANK", "0") != "0"  # under torchrun, rank 0 speaks for all
    args = said_once(quiet, parse_args, argv)
    world, device = 1, None
    try:
        # Every check reads only flags, files and torchrun's variables, before any process group exists:
        # each rank meets the same mistake alone and exits 2, and none is left waiting for another.
        check_flags(args)
        rank, world, device = ranks_and_device(args.fsdp, args.device)
        run = settings(args, argv, device)
        config = said_once(quiet, check_model, run, device)  # a fallback note (no flash_triton.py): rank 0's alone
        data = check_data(run, world)
        if device.type == "cpu":  # refused here, not ended by the OOM killer without a word
            said_once(quiet, check_host_memory, step_bytes(config, run.batch, run.seq, run.bf16),
                      f"model {run.model} at batch {run.batch} x seq {run.seq}")
        state, note = check_resume(run, world)
        if world > 1:
            start_process_group(device)
        gpt.NVTX = args.nvtx and device.type == "cuda"  # torch.cuda.nvtx needs a CUDA build
        if rank == 0:
            print(device_line(device, args.nvtx))
            if note:
                print(note)
        train(run, config, data, state, rank, world, device)
        if world > 1:  # every rank past its last collective (and rank 0's save) before the group is torn down:
            dist.barrier()  # gloo threads still holding work at interpreter exit abort the process
    except (ValueError, FileNotFoundError) as e:  # every rank meets the same one
        if quiet:
            exit_after_rank_0(f"error: {e}")
        fail(str(e))
    except FloatingPointError as e:
        if not quiet:
            print(f"stopped: {e}")
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("interrupted outside the training loop: nothing more to save", file=sys.stderr)
        raise SystemExit(130) from None
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        fail(f"out of memory: model {run.model} at batch {run.batch} x seq {run.seq} does not fit{memory_of(device)}; "
             f"lower --batch, or add --recompute 1, --fsdp or --bf16")
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()

def device_line(device, nvtx):
    if device.type == "cuda":
        return f"device: {device} ({torch.cuda.get_device_name(device)})"
    line = f"device: {device} (no CUDA) -- tiny preset and short context unless you chose sizes"
    if nvtx:
        line += "; --nvtx ignored (NVTX ranges need CUDA)"
    return line

def memory_of(device):  # where an OOM ran out
    if device.type != "cuda":
        return " in host memory"
    return f" in the {gib(torch.cuda.get_device_properties(device).total_memory)} GiB of {device}"

if __name__ == "__main__":
    main()
