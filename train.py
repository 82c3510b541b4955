"""Train GPT-2 on Tiny Shakespeare, as fast as one GPU (or several) allows.

Each flag is a speed-up the other scripts measure: --tf32, --bf16 / --fp16, --attn, --vocab 50304, --compile
(on one GPU with CUDA graphs), --fp8 (H100/H200, in the block layers wide enough to gain), and the output
layer fused with the loss (--no-fused-ce turns it off). The loop never makes the GPU wait: a step's loss is
read back while the GPU runs the next. Several GPUs: torchrun, DDP or --fsdp (FSDP2: weights, gradients and
optimizer state sharded); --recompute K recomputes every K-th block's activations in backward. Ctrl-C saves
--ckpt and prints how to resume. Without CUDA the same command trains `tiny` on a short context.

    python train.py --vocab 50304 --bf16 --compile                 # the headline run
    python train.py --vocab 50304 --bf16 --compile --fp8 0         # FP8 in every block (--fp8: >= 2048 wide)
    torchrun --nproc_per_node=2 train.py --model xl --vocab 50304 --bf16 --compile       # DDP
    torchrun --nproc_per_node=2 train.py --model 2.7B --vocab 50304 --fsdp --bf16 --compile --recompute 2
    python train.py --steps 40 --ckpt run.pt --stop-after 20; python train.py --steps 40 --ckpt run.pt --resume
"""

import argparse
import math
import os
import shlex
import signal
import statistics
import sys
from collections import Counter
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt import (FP8_MIN_WIDTH, GPT, GPT2_VOCAB, amp_dtype, autocast, check_host_memory, check_output_path,
                 clip_gradients, clock, compile_model, configure_optimizer, elapsed_ms, fail, flops_per_token,
                 fmt_mfu, fp8_supported, fully_shard_gpt, gib, gpt2_tokenizer, is_oom, load_tokens, make_config, mfu,
                 print_table, resolve_device, set_tf32, step_bytes, use_fp8)

# --- 1. the model on the GPUs: FP8 layers, FSDP2 sharding, then torch.compile and DDP
def wrap(model, args, world, device):
    """The module the loop calls: compiled (CUDA graphs only on one GPU without accumulation: DDP
    and FSDP launch their collectives from outside the graphs, see compile_model), then DDP. Under
    FSDP, torch.compile cannot trace the all-gather hooks around each block: it compiles the block's
    forward (one graph that all blocks share) and runs the embeddings and the loss eagerly."""
    if args.compile:
        model = compile_model(model, cuda_graphs=device.type == "cuda" and world == 1 and args.grad_accum == 1)
    if world > 1 and not args.fsdp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


# --- 2. one optimizer step
def train_step(model, optimizer, scaler, batches, lr, dtype, args, world, vote):
    """One optimizer step over the micro-batches (x, y) with autocast to `dtype`. It only queues
    GPU work and returns the mean loss, the grad norm and (several processes) the stop votes
    summed over the ranks, as GPU tensors: nothing here waits."""
    device, accum = batches[0][0].device, len(batches)
    loss_sum = torch.zeros((), device=device)
    for micro, (x, y) in enumerate(batches):
        # DDP all-reduces gradients in backward: skip it on all but the last micro-step. FSDP
        # reduce-scatters after every micro-step: waiting would keep whole gradients, not shards.
        sync = micro == accum - 1 or world == 1 or args.fsdp
        with nullcontext() if sync else model.no_sync():
            with autocast(device, dtype):
                _, loss = model(x, y)
            scaler.scale(loss / accum).backward()
        loss_sum += loss.detach() / accum
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    norm = clip_gradients(model, optimizer, args.grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if world == 1:
        return loss_sum, norm, None
    # one all-reduce averages the loss and counts the ranks asked to stop (StopSignal); queued, not awaited
    stats = torch.stack([loss_sum, torch.full((), float(vote), device=device)])
    dist.all_reduce(stats)
    return stats[0] / world, norm, stats[1]


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

def train(args, config, data, state, rank, world, device):
    log = print if rank == 0 else (lambda *a, **k: None)
    dtype = amp_dtype(args.bf16, args.fp16)
    set_tf32(args.tf32)
    train_tokens, val, eval_plan = data
    torch.manual_seed(args.seed)  # the same initial weights on every rank

    with torch.device(device):  # built where it trains: no host copy of a 2.7B model to initialise and move
        raw_model = GPT(config)
    if args.fp8 is not None:
        plan = use_fp8(raw_model, args.fp8)
        if rank == 0:
            print_fp8_table(plan, args, config)
    if args.fsdp:
        fully_shard_gpt(raw_model, torch.bfloat16 if args.bf16 else None)  # in place: now sharded
    optimizer = configure_optimizer(raw_model, args.lr, args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=args.fp16)  # fp16 gradients underflow without it
    step, pos = 0, 0
    if state is not None:
        step, pos = apply_checkpoint(state, args.ckpt, raw_model, optimizer, scaler)
        log(f"resumed from {args.ckpt} at step {step}")
    model = wrap(raw_model, args, world, device)

    B, T, accum = args.batch, args.seq, args.grad_accum
    tokens_per_step = B * T * accum * world
    flops_per_step = flops_per_token(config, T) * tokens_per_step / world  # per GPU
    log(f"model {args.model}: {raw_model.num_params():,} parameters | {tokens_per_step:,} tokens per step "
        f"(batch {B} x seq {T} x accum {accum} x {world} process{'es' * (world > 1)}{', FSDP' * args.fsdp})")
    if eval_plan[0] < B:
        log(f"the validation split holds {len(val):,} tokens: evaluating {eval_plan[0]} sequences per process")
    nan_hint = "fp16 overflow without loss scaling" if args.fp16 else f"a learning rate too high (--lr {args.lr})"
    steps = StepLog(step, tokens_per_step, flops_per_step, device, nan_hint, log)
    if args.compile:
        log("compiling... (torch.compile: the first step takes 20-60 s)")
    stop, stopping = StopSignal(), False
    try:
        for step in range(step, args.last):
            batches = []
            for _ in range(accum):
                batches.append(get_batch(train_tokens, pos + rank * B * T, B, T, device))
                pos = next_position(pos, B * T * world, len(train_tokens))
            lr = lr_at(step, args)
            loss, norm, votes = train_step(model, optimizer, scaler, batches, lr, dtype, args, world,
                                           vote=stop.signum is not None)
            steps.queue(step, lr, loss, norm, votes)  # prints the previous step's line while the GPU runs this one
            at_eval = (step + 1) % args.eval_every == 0 or step + 1 == args.last
            # every rank has read the same votes at this point, so all take the same branch
            stopping = steps.stop_votes > 0 if world > 1 else stop.signum is not None
            if at_eval or stopping:
                steps.pause()  # val loss and the checkpoint must see this step's weights
                if not stopping:
                    val_mean = val_loss(raw_model, val, eval_plan, args, rank, world, device, dtype)
                    log(f"step {step:5d} | val loss {val_mean:.4f}")
                if args.ckpt:
                    save_checkpoint(args.ckpt, raw_model, optimizer, scaler, step + 1, pos, args, rank, world)
                steps.resume()
            if stopping:
                break
    finally:
        stop.restore()
    if stopping:
        name = signal.Signals(stop.signum or signal.SIGTERM).name
        launcher = ["torchrun", f"--nproc_per_node={world}"] if world > 1 else ["python"]
        again = shlex.join(launcher + ["train.py"] + [a for a in args.argv if a != "--resume"] + ["--resume"])
        saved = f"checkpoint {args.ckpt} holds step {step + 1}; resume with: {again}" if args.ckpt else \
            "nothing saved (no --ckpt)"
        log(f"interrupted ({name}) after step {step}: {saved}")
        raise SystemExit(128 + (stop.signum or signal.SIGTERM))
    log(steps.summary(recompute_cost(config, T)) + f" | val loss {val_mean:.4f}")
    if args.sample and (args.fsdp or rank == 0):  # under FSDP every rank must take part in each forward
        print_sample(raw_model, args.sample, device, dtype, args.seed, log)

def recompute_cost(config, T):
    """' | recompute ...': the blocks recomputed and the forward FLOPs they add to a step, as a
    share of the step's model FLOPs (a block's forward: 2 per weight, 4*d*T of attention, per token)."""
    K, L, d = config.recompute, config.n_layer, config.n_embd
    if not K:
        return ""
    n = len(range(0, L, K))
    extra = n * (2 * (4 * d * d + 2 * d * config.d_ff) + 4 * d * T) / flops_per_token(config, T)
    return f" | recompute {n}/{L} blocks: +{100 * extra:.0f}% FLOPs (not in MFU)"

def print_fp8_table(plan, args, config):
    """Which Linears run their matmuls in FP8: the block's four where both widths reach --fp8
    (default gpt.FP8_MIN_WIDTH: narrower matmuls are too small to repay the scaling passes)."""
    rows = Counter((name.split(".", 2)[2], f"{n_in} x {n_out}",  # h.3.attn.c_attn -> attn.c_attn
                    "FP8 (e4m3; gradients e5m2)" if fp8 else f"bf16 (below {args.fp8} wide)")
                   for name, n_in, n_out, fp8 in plan)
    rows[("lm_head", f"{config.n_embd} x {config.vocab_size}", "bf16" + " (fused with the loss)" * config.fused_ce)] = 1
    print_table(["Linear layer", "in x out", "matmuls in", "count"], [[*k, n] for k, n in rows.items()])
    n = sum(fp8 for *_, fp8 in plan)
    print(f"--fp8 {args.fp8}: {n} of {len(plan)} block Linears in FP8" + "; --fp8 0 converts all" * (n < len(plan)))


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

def lr_at(step, args):
    """Linear warm-up, then cosine decay to min_lr."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (args.lr - args.min_lr)


# --- 5. checkpoints: one file for one process, DDP and FSDP, written atomically
# Full (unsharded) state dicts keyed by parameter name, gathered to rank 0's CPU and written by it,
# rather than torch.distributed.checkpoint (each rank writes its own shards into a folder): one
# file anyone can torch.load, that resumes on any number of processes with or without FSDP. The
# price is a gather through rank 0's host memory (2.7B: 11 GB of weights + 22 GB of Adam state),
# fine at these sizes; sharded writes win when that no longer fits.
KIND = "nanoperf train.py checkpoint, format 2"

def precision_of(args):
    """The flags that set the arithmetic: a resumed run may change them, and is told so."""
    return " + ".join(["bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"] + ["tf32"] * bool(args.tf32)
                      + ([f"fp8 (min width {args.fp8})"] if args.fp8 is not None else []))

def run_fields(args, world):
    """What must match for a resumed run to continue the same run (the data order and schedule)."""
    return {"model": args.model, "vocab": args.vocab, "seq": args.seq, "grad_accum": args.grad_accum,
            "steps": args.steps, "sequences": args.batch * world}

def save_checkpoint(path, model, optimizer, scaler, step, pos, args, rank, world):
    if not (args.fsdp or rank == 0):  # gathering FSDP's shards takes every rank; DDP's ranks hold copies
        return
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it all, the others {}
    state = {"kind": KIND, "model": get_model_state_dict(model, options=options),
             "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
             "scaler": scaler.state_dict(), "step": step, "pos": pos, "run": run_fields(args, world),
             "precision": precision_of(args)}
    if rank != 0:
        return
    try:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # a crash mid-write leaves the previous checkpoint intact
    except (OSError, RuntimeError) as e:  # torch.save reports a file it cannot open as a RuntimeError
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[-1]
        raise ValueError(f"could not write the checkpoint {path} ({reason}); the previous one is intact") from None
    finally:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")

def read_checkpoint(path, args, world):
    """The checkpoint at `path`, or a ValueError saying in one sentence why it is not one for this run."""
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path} is an empty file, not a checkpoint")
    try:  # weights_only: plain tensors and containers, never arbitrary pickled code; mmap: no copy
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ValueError(f"{path} is not a checkpoint: torch.load cannot read it ({type(e).__name__})") from None
    if not (isinstance(state, dict) and state.get("kind") == KIND):
        weights = isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())
        what = ("a bare tensor" if isinstance(state, torch.Tensor) else "weights alone (a state_dict)" if weights
                else f"a {type(state).__name__} of another kind")
        raise ValueError(f"{path} holds {what}, not a train.py checkpoint")
    for key, now in run_fields(args, world).items():
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
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    scaler.load_state_dict(state["scaler"])
    return state["step"], state["pos"]


# --- 6. evaluation and sampling
@torch.no_grad()
def val_loss(model, val, plan, args, rank, world, device, dtype):
    """Mean loss over the first batches of the validation split (the same every time). Each rank
    takes its own rows of each batch, as in training, and the sums are all-reduced: FSDP needs
    every rank in every forward anyway, since each one all-gathers the weights from all ranks."""
    rows, n_batches = plan
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(n_batches):
        x, y = get_batch(val, (i * world + rank) * rows * args.seq, rows, args.seq, device)
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
    p.add_argument("--model", help="preset: tiny, gpt2, small, medium, large, xl, 2.7B (default gpt2; tiny on CPU)")
    p.add_argument("--vocab", type=int, default=GPT2_VOCAB, help="vocabulary size (50304: 50257 padded)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--fp16", action="store_true", help="fp16 autocast with a GradScaler (CUDA only)")
    p.add_argument("--tf32", action="store_true", help="TF32 tensor cores for fp32 matmuls")
    p.add_argument("--fp8", type=int, nargs="?", const=FP8_MIN_WIDTH, metavar="MIN_WIDTH", help="FP8 matmuls "
                   f"(H100/H200, with --bf16) in block Linears MIN_WIDTH wide (default {FP8_MIN_WIDTH}; 0: all)")
    p.add_argument("--no-fused-ce", action="store_true", help="materialise the logits for the loss (unfused)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--attn", default="sdpa", help="naive, sdpa, flash, cudnn, efficient, math, triton")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (under torchrun, 2+ processes)")
    p.add_argument("--recompute", type=int, metavar="K", help="recompute every K-th block in backward (1: all)")
    p.add_argument("--batch", type=int, help="sequences per micro-step per GPU (default 16; 8 on CPU)")
    p.add_argument("--seq", type=int, help="context length (default 1024; 64 on CPU)")
    p.add_argument("--steps", type=int, help="optimizer steps, the span of the schedule (default 200; 50 on CPU)")
    p.add_argument("--stop-after", type=int, metavar="STEP", help="stop when the run reaches this step (counted from "
                   "the run's start, also after --resume), as if interrupted")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--min-lr", type=float, help="final learning rate of the cosine decay (default lr/10)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the global grad norm (0: off)")
    p.add_argument("--eval-every", type=int, default=50, help="val loss every N steps (and at the end)")
    p.add_argument("--eval-steps", type=int, default=10, help="val batches per evaluation (at most all of val)")
    p.add_argument("--sample", type=int, default=0, metavar="N", help="print N generated tokens at the end")
    p.add_argument("--data", help="training text (default: input.txt next to gpt.py); the last 10%% is validation")
    p.add_argument("--ckpt", help="checkpoint path, written at every evaluation, at the end and on Ctrl-C")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt")
    p.add_argument("--overwrite", action="store_true", help="start over, replacing the checkpoint at --ckpt")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda if present)")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # for the resume command printed on Ctrl-C
    return args

def check_flags(args):
    """Value ranges, before anything starts (ValueError)."""
    positive = ("batch", "seq", "steps", "grad_accum", "eval_every", "eval_steps", "stop_after", "recompute", "lr")
    for flag in positive + ("warmup", "weight_decay", "grad_clip", "sample", "fp8", "min_lr"):
        value, name = getattr(args, flag), "--" + flag.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
        if value is not None and (value <= 0 if flag in positive else value < 0):
            raise ValueError(f"{name} {'must be positive' if flag in positive else 'cannot be negative'}, got {value}")
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    if not 0 <= args.min_lr <= args.lr:
        raise ValueError(f"--min-lr {args.min_lr} must be between 0 and --lr {args.lr}")
    amp_dtype(args.bf16, args.fp16)  # raises if both
    if args.fsdp and args.fp16:
        raise ValueError("--fsdp runs in bf16 or fp32 here; fp16 would need a sharded GradScaler")
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite are exclusive: continue the checkpoint, or start over")
    if args.resume and args.ckpt is None:
        raise ValueError("--resume needs --ckpt PATH, the checkpoint to continue")
    if args.ckpt is not None:  # never write over a file that is not one of our checkpoints
        check_output_path(args.ckpt, "--ckpt", ours=None if args.resume else is_checkpoint)
    if args.resume and not os.path.isfile(args.ckpt):
        raise ValueError(f"--resume needs an existing --ckpt file, and '{args.ckpt}' does not exist")
    if args.ckpt and os.path.isfile(args.ckpt) and not (args.resume or args.overwrite):  # nor over a run of ours
        raise ValueError(f"--ckpt {args.ckpt} already holds a checkpoint: continue it with --resume, or start over "
                         "with --overwrite or another --ckpt")

def check_run(args, world, device):
    """Device-dependent defaults and checks, the data and the checkpoint to resume: (config,
    (train, val, eval plan), checkpoint state or None), or a ValueError."""
    on_cpu = device.type == "cpu"
    for name, cpu_gpu in {"model": ("tiny", "gpt2"), "batch": (8, 16), "seq": (64, 1024), "steps": (50, 200)}.items():
        if getattr(args, name) is None:
            setattr(args, name, cpu_gpu[not on_cpu])
    config = make_config(args.model, vocab_size=args.vocab, attn=args.attn, fused_ce=not args.no_fused_ce)
    if args.recompute is not None and args.recompute > config.n_layer:
        raise ValueError(f"--recompute {args.recompute} is above the {config.n_layer} layers of '{args.model}'")
    config.recompute = args.recompute or 0
    if args.seq > config.block_size:
        raise ValueError(f"--seq {args.seq} is above the block size {config.block_size} of '{args.model}'")
    if args.fp16 and device.type != "cuda":
        raise ValueError("--fp16 needs a CUDA GPU (its GradScaler is CUDA-only here); use --bf16 on the CPU")
    if on_cpu and args.attn in ("cudnn", "efficient", "triton"):
        raise ValueError(f"--attn {args.attn} needs a CUDA GPU")
    if args.fp8 is not None and not fp8_supported(device):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
        raise ValueError(f"--fp8 needs a GPU with FP8 tensor cores (H100, H200, Ada), and {name} has none")
    if args.fp8 is not None and not args.bf16:
        raise ValueError("--fp8 needs --bf16: the layers around the FP8 matmuls run in bf16")

    if args.data and os.path.isdir(args.data):
        raise ValueError(f"--data {args.data} is a directory; give the text file itself")
    tokens = load_tokens(args.data) if args.data else load_tokens()
    train_tokens, val = tokens[: int(0.9 * len(tokens))], tokens[int(0.9 * len(tokens)) :]  # the last 10%: validation
    window = args.batch * args.seq * world  # tokens one micro-step reads across the ranks
    if window + 1 > len(train_tokens):
        raise ValueError(f"the training split holds {len(train_tokens):,} tokens, fewer than one step's "
                         f"batch x seq x processes = {window:,}; lower --batch or --seq, or use more text")
    rows = min(args.batch, (len(val) - 1) // (args.seq * world))  # sequences per rank that fit in val
    if rows == 0:
        raise ValueError(f"the validation split holds {len(val):,} tokens, fewer than --seq {args.seq} x "
                         f"{world} process(es); lower --seq or use more text")
    eval_plan = (rows, min(args.eval_steps, (len(val) - 1) // (rows * args.seq * world)))
    if on_cpu:
        check_host_memory(step_bytes(config, args.batch, args.seq, args.bf16),
                          f"model {args.model} at batch {args.batch} x seq {args.seq}")

    state = read_checkpoint(args.ckpt, args, world) if args.resume else None
    args.last = min(args.steps, args.stop_after or args.steps)  # the loop runs up to here
    if state is not None and state["step"] >= args.last:
        stop = f" --stop-after {args.stop_after} (a step of the run, not a count)" if args.stop_after else ""
        raise ValueError(f"{args.ckpt} is at step {state['step']}: nothing left to run with --steps {args.steps}{stop}")
    if state is not None and state.get("precision", precision_of(args)) != precision_of(args):
        args.note = f"note: {args.ckpt} was trained in {state['precision']}; this run continues in {precision_of(args)}"
    return config, (train_tokens, val, eval_plan), state

def init_distributed(args):
    """(rank, world, device); torchrun sets RANK, WORLD_SIZE and LOCAL_RANK."""
    if "RANK" not in os.environ:
        if args.fsdp:
            raise ValueError("--fsdp shards the model across processes: run it under torchrun --nproc_per_node=2")
        return 0, 1, resolve_device(args.device)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if args.fsdp and world < 2:
        raise ValueError("--fsdp with one process shards nothing: use --nproc_per_node=2 or more")
    device = resolve_device(args.device)
    if cuda := device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"local rank {local} has no GPU: this machine has {torch.cuda.device_count()}")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return rank, world, device

def main(argv=None):
    args = parse_args(argv)
    world, quiet = 1, os.environ.get("RANK", "0") != "0"  # under torchrun, rank 0 speaks for all
    try:
        check_flags(args)
        rank, world, device = init_distributed(args)
        config, data, state = check_run(args, world, device)
        if rank == 0:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "no CUDA"
            note = " -- tiny preset and short context unless you chose sizes" if device.type == "cpu" else ""
            print(f"device: {device} ({name}){note}")
            if getattr(args, "note", None):
                print(args.note)
        train(args, config, data, state, rank, world, device)
        if world > 1:  # every rank past its last collective (and rank 0's save) before the group is torn down:
            dist.barrier()  # gloo threads still holding work at interpreter exit abort the process
    except (ValueError, FileNotFoundError) as e:  # every rank meets the same one
        raise SystemExit(2) if quiet else fail(str(e))
    except FloatingPointError as e:
        if not quiet:
            print(f"stopped: {e}")
        raise SystemExit(1)
    except KeyboardInterrupt:
        print("interrupted outside the training loop: nothing more to save", file=sys.stderr)
        raise SystemExit(130)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        where = " in host memory" if device.type != "cuda" else \
            f" in the {gib(torch.cuda.get_device_properties(device).total_memory)} GiB of {device}"
        fail(f"out of memory: model {args.model} at batch {args.batch} x seq {args.seq} does not fit{where}; "
             f"lower --batch, or add --recompute 1, --fsdp or --bf16")
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()

if __name__ == "__main__":
    main()
