"""Train GPT-2 on Tiny Shakespeare, as fast as one GPU (or several) allows.

Each flag is one of the speed-ups the other scripts measure: --tf32 (fp32 matmuls on the tensor
cores), --bf16 / --fp16 (autocast mixed precision; fp16 needs a GradScaler), --attn (naive, SDPA or
its backends, our Triton kernel), --vocab 50304 (a tensor-core-friendly vocabulary) and --compile
(torch.compile fuses the elementwise work between the matmuls; on one GPU it also replays the
forward and backward as CUDA graphs: compile_model). Multi-GPU: torchrun. The loop itself
never makes the GPU wait: a step's loss is read back while the GPU runs the next one (StepLog).

    python train.py --vocab 50304 --bf16 --compile                 # the headline run
    python train.py --vocab 50304 --bf16 --compile --sample 200    # and print a sample
    torchrun --nproc_per_node=2 train.py --vocab 50304 --bf16 --compile
    python train.py --steps 40 --ckpt run.pt --stop-after 20; python train.py --steps 40 --ckpt run.pt --resume

On a machine without CUDA the same command trains the `tiny` preset on a short context.
Excerpt (NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-22; `--vocab 50304 --bf16 --compile`, defaults otherwise):

    step   198 | loss 5.0827 | lr 6.02e-05 | norm 0.736 | dt    35.7 ms |    458,926 tok/s | MFU 39.7% | mem 9.95 GiB
    step   199 | loss 4.7906 | lr 6.00e-05 | norm 0.911 | dt    35.6 ms |    460,022 tok/s | MFU 39.8% | mem 9.95 GiB
    step   199 | val loss 5.6711
    summary: median step 35.5 ms over steps 10-199 | 461,734 tok/s | MFU 39.9% | peak mem 9.95 GiB
"""

import argparse
import math
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt import (GPT, GPT2_VOCAB, amp_dtype, autocast, configure_optimizer, fail, flops_per_token,
                 gpt2_tokenizer, load_tokens, make_config, mfu, resolve_device, set_tf32)

# --- 1. command line


def parse_args():
    p = argparse.ArgumentParser(description="Train GPT-2 on Tiny Shakespeare.")
    p.add_argument("--model", help="preset: tiny, gpt2, small, medium, large, xl, 2.7B (default gpt2; tiny on CPU)")
    p.add_argument("--vocab", type=int, default=GPT2_VOCAB, help="vocabulary size; 50304 pads 50257 to a multiple of 128")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--fp16", action="store_true", help="fp16 autocast with a GradScaler (CUDA only)")
    p.add_argument("--tf32", action="store_true", help="TF32 tensor cores for fp32 matmuls")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--attn", default="sdpa", help="naive, sdpa, flash, cudnn, efficient, math, triton")
    p.add_argument("--batch", type=int, help="sequences per micro-step per GPU (default 16; 8 on CPU)")
    p.add_argument("--seq", type=int, help="context length (default 1024; 64 on CPU)")
    p.add_argument("--steps", type=int, help="optimizer steps, the span of the schedule (default 200; 50 on CPU)")
    p.add_argument("--stop-after", type=int, help="stop after this many steps, as if interrupted")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--min-lr", type=float, help="final learning rate of the cosine decay (default lr/10)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the global grad norm (0: off)")
    p.add_argument("--eval-every", type=int, default=50, help="val loss every N steps (and at the end)")
    p.add_argument("--eval-steps", type=int, default=10, help="val batches per evaluation (at most all of val)")
    p.add_argument("--sample", type=int, default=0, metavar="N", help="print N generated tokens at the end")
    p.add_argument("--ckpt", help="checkpoint path, written at every evaluation and at the end")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda if present)")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


def check_args(args, device):
    """Fill the device-dependent defaults and reject impossible combinations (ValueError)."""
    on_cpu = device.type == "cpu"
    defaults = {"model": ("tiny", "gpt2"), "batch": (8, 16), "seq": (64, 1024), "steps": (50, 200)}
    for name, (cpu_value, gpu_value) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, cpu_value if on_cpu else gpu_value)
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    config = make_config(args.model, vocab_size=args.vocab, attn=args.attn)
    positive = {"--batch": args.batch, "--seq": args.seq, "--steps": args.steps,
                "--grad-accum": args.grad_accum, "--eval-every": args.eval_every, "--eval-steps": args.eval_steps}
    for flag, value in positive.items():
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if args.seq > config.block_size:
        raise ValueError(f"--seq {args.seq} is above the block size {config.block_size} of '{args.model}'")
    amp_dtype(args.bf16, args.fp16)  # raises if both
    if args.fp16 and not device.type == "cuda":
        raise ValueError("--fp16 needs a CUDA GPU (its GradScaler is CUDA-only here); use --bf16 on the CPU")
    if on_cpu and args.attn in ("cudnn", "efficient", "triton"):
        raise ValueError(f"--attn {args.attn} needs a CUDA GPU")
    if args.resume and not (args.ckpt and os.path.exists(args.ckpt)):
        raise ValueError(f"--resume needs an existing --ckpt file, and '{args.ckpt}' is not one")
    return config


# --- 2. data: Tiny Shakespeare as GPT-2 tokens, read sequentially so a run can resume exactly


def split_tokens(tokens):
    n = int(0.9 * len(tokens))
    return tokens[:n], tokens[n:]


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


# --- 3. learning-rate schedule: linear warm-up, then cosine decay to min_lr


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (args.lr - args.min_lr)


# --- 4. checkpoints: everything a run needs to continue exactly, written atomically


def save_checkpoint(path, model, optimizer, scaler, step, pos, args):
    state = {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(), "step": step, "pos": pos,
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "run": {k: getattr(args, k) for k in ("model", "vocab", "batch", "seq", "grad_accum", "steps")},
    }
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash mid-write leaves the previous checkpoint intact


def load_checkpoint(path, model, optimizer, scaler, args):
    state = torch.load(path, map_location="cpu", weights_only=False)
    for key, saved in state["run"].items():
        if getattr(args, key) != saved:
            raise ValueError(f"checkpoint was made with --{key.replace('_', '-')} {saved}, not {getattr(args, key)}")
    # accept state dicts saved from a compiled or DDP-wrapped model as well
    weights = {k.replace("_orig_mod.", "").replace("module.", ""): v for k, v in state["model"].items()}
    model.load_state_dict(weights)
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"], state["pos"]


# --- 5. evaluation and sampling


@torch.no_grad()
def val_loss(model, val, args, device, dtype):
    """Mean loss over the first eval_steps batches of the validation split (the same every time)."""
    n_batches = min(args.eval_steps, (len(val) - 1) // (args.batch * args.seq))
    model.eval()
    losses = []
    for i in range(n_batches):
        x, y = get_batch(val, i * args.batch * args.seq, args.batch, args.seq, device)
        with autocast(device, dtype):
            losses.append(model(x, y)[1].item())
    model.train()
    return sum(losses) / len(losses)


def print_sample(model, n_tokens, device, dtype):
    enc = gpt2_tokenizer()
    prompt = torch.tensor([enc.encode_ordinary("\n")], device=device)
    with autocast(device, dtype):
        out = model.generate(prompt, n_tokens, temperature=0.8, top_k=200)
    print(f"--- sample ({n_tokens} tokens)\n{enc.decode(out[0].tolist())}\n---")


# --- 6. distributed set-up (torchrun sets RANK, WORLD_SIZE and LOCAL_RANK)


def init_distributed(device_arg):
    if "RANK" not in os.environ:
        return 0, 1, resolve_device(device_arg)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise ValueError(f"local rank {local} has no GPU: this machine has {torch.cuda.device_count()}")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    return rank, world, device


# --- 7. the training loop


def train(args, config, rank, world, device):
    log = print if rank == 0 else (lambda *a, **k: None)
    dtype = amp_dtype(args.bf16, args.fp16)
    set_tf32(args.tf32)
    train_tokens, val = split_tokens(load_tokens())
    torch.manual_seed(args.seed)

    raw_model = GPT(config).to(device)
    optimizer = configure_optimizer(raw_model, args.lr, args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=args.fp16)  # fp16 gradients underflow without it
    step, pos = 0, 0
    if args.resume:
        step, pos = load_checkpoint(args.ckpt, raw_model, optimizer, scaler, args)
        log(f"resumed from {args.ckpt} at step {step}")
    model = compile_model(raw_model, device, world, args.grad_accum) if args.compile else raw_model
    if world > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    B, T, accum = args.batch, args.seq, args.grad_accum
    tokens_per_step = B * T * accum * world
    flops_per_step = flops_per_token(config, T) * tokens_per_step / world  # per GPU
    log(f"model {args.model}: {raw_model.num_params():,} parameters | {tokens_per_step:,} tokens per step "
        f"(batch {B} x seq {T} x accum {accum} x {world} process{'es' * (world > 1)})")
    last = min(args.steps, args.stop_after or args.steps)
    nan_hint = "fp16 overflow without loss scaling" if args.fp16 else f"a learning rate too high (--lr {args.lr})"
    steps = StepLog(tokens_per_step, flops_per_step, device, nan_hint, log)
    for step in range(step, last):
        batches = []
        for _ in range(accum):
            batches.append(get_batch(train_tokens, pos + rank * B * T, B, T, device))
            pos = next_position(pos, B * T * world, len(train_tokens))
        lr = lr_at(step, args)
        loss, norm = train_step(model, optimizer, scaler, batches, lr, dtype, args.grad_clip, world)
        steps.queue(step, lr, loss, norm)  # prints the previous step's line while the GPU runs this one
        if (step + 1) % args.eval_every == 0 or step + 1 == last:
            steps.finish()  # val loss and the checkpoint must see this step's weights
            if rank == 0:
                # rank 0 alone: the weights are identical on every rank, and eval uses no collective
                print(f"step {step:5d} | val loss {val_loss(raw_model, val, args, device, dtype):.4f}")
                if args.ckpt:
                    save_checkpoint(args.ckpt, raw_model, optimizer, scaler, step + 1, pos, args)
            steps.restart_clock()  # evaluation is not part of the next step's time
    log(steps.summary())
    if args.sample and rank == 0:
        print_sample(raw_model, args.sample, device, dtype)


def compile_model(model, device, world, accum):
    """torch.compile fuses the elementwise work between the matmuls, and two options help it more:
    - CUDA graphs (what mode="reduce-overhead" turns on): the compiled forward and backward are
      recorded once, then each replayed with one launch instead of hundreds of kernel launches.
      Only on one GPU without accumulation: DDP's hooks launch all-reduces from outside the
      graphs, and a micro-step's gradients would live in graph memory that the next micro-step's
      replay overwrites.
    - programmatic dependent launch (Hopper and newer GPUs; ignored elsewhere): each generated
      Triton kernel may start while the previous one finishes, instead of after."""
    cuda_graphs = device.type == "cuda" and world == 1 and accum == 1
    return torch.compile(model, options={"triton.cudagraphs": cuda_graphs, "triton.enable_pdl": True})


def clip_gradients(model, optimizer, max_norm):
    """Global gradient norm; gradients scaled down to max_norm if above it (max_norm 0: never).
    A fused optimizer clips inside its own kernel: it divides each gradient by
    `optimizer.grad_scale` as it reads it (the hook GradScaler uses to unscale), which saves a
    read and a write of every gradient, 1 GB per step at 124M parameters."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if max_norm and optimizer.defaults["fused"]:
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)  # as clip_grad_norm_
    elif max_norm:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm)
    return norm


def train_step(model, optimizer, scaler, batches, lr, dtype, grad_clip, world):
    """One optimizer step over the micro-batches (x, y) with autocast to `dtype`. It only queues
    GPU work and returns the mean loss and the grad norm as GPU tensors: nothing here waits."""
    device, accum = batches[0][0].device, len(batches)
    loss_sum = torch.zeros((), device=device)
    for micro, (x, y) in enumerate(batches):
        # DDP all-reduces gradients during backward; skip it on all but the last micro-step
        sync = micro == accum - 1 or world == 1
        with nullcontext() if sync else model.no_sync():
            with autocast(device, dtype):
                _, loss = model(x, y)
            scaler.scale(loss / accum).backward()
        loss_sum += loss.detach() / accum
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    norm = clip_gradients(model, optimizer, grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if world > 1:
        dist.all_reduce(loss_sum)
        loss_sum /= world
    return loss_sum, norm


class StepLog:
    """A line per step that never makes the GPU wait for the host.

    `loss.item()` would block until everything queued has run, leaving the GPU idle while the host
    prints and then queues the next step's first kernels. Instead each step's loss and grad norm
    are copied to (pinned) host memory without blocking, followed by an event, and step k's line
    is printed once step k+1 is queued: the host waits for step k alone while the GPU runs k+1.
    Step times are read off those events, on the GPU's own timeline: from the end of one step to
    the end of the next, so any time the GPU sat idle waiting for the host is counted."""

    def __init__(self, tokens_per_step, flops_per_step, device, nan_hint, log):
        self.tokens, self.flops, self.device = tokens_per_step, flops_per_step, device
        self.nan_hint, self.log = nan_hint, log
        self.times, self.pending = [], None
        self.restart_clock()

    def restart_clock(self):
        """Time the next step from here: what ran since the last step (evaluation) is not counted."""
        self.last_end = timestamp(self.device)

    def queue(self, step, lr, loss, norm):
        values = torch.stack([loss.float(), norm.float()]).to("cpu", non_blocking=True)
        end = timestamp(self.device)  # queued after the copy: once it fires, `values` is on the host
        previous, self.pending = self.pending, (step, lr, values, self.last_end, end)
        self.last_end = end
        if previous is not None:
            self.print_line(*previous)

    def finish(self):
        """Wait for the last queued step and print its line."""
        if self.pending is not None:
            self.print_line(*self.pending)
            self.pending = None

    def print_line(self, step, lr, values, start, end):
        dt = seconds_between(start, end)  # waits for `end`, and so for `values`
        self.times.append(dt)
        loss, norm = values.tolist()
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}; likely cause: {self.nan_hint}")
        self.log(f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | norm {norm:.3f} | dt {dt * 1e3:7.1f} ms | "
                 f"{self.tokens / dt:10,.0f} tok/s | MFU {fmt_mfu(self.flops / dt, self.device)} | "
                 f"mem {fmt_mem(self.device)}")

    def summary(self):
        """Median step time once the first steps (compilation, cuDNN/cuBLAS warm-up) are behind us."""
        skip = min(10, len(self.times) // 2)
        median = statistics.median(self.times[skip:])
        return (f"summary: median step {median * 1e3:.1f} ms over steps {skip}-{len(self.times) - 1} | "
                f"{self.tokens / median:,.0f} tok/s | MFU {fmt_mfu(self.flops / median, self.device)} | "
                f"peak mem {fmt_mem(self.device)}")


def timestamp(device):
    """A point on the device's timeline: on a GPU an event queued behind the work already queued
    (it fires when the GPU gets there); on the CPU, where ops run as they are called, the clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start, end):
    if isinstance(end, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def fmt_mfu(flops_per_s, device):
    u = mfu(flops_per_s, device)
    return "n/a" if u is None else f"{100 * u:.1f}%"


def fmt_mem(device):
    """Peak memory allocated by tensors so far (not what the caching allocator reserved)."""
    if device.type != "cuda":
        return "n/a"
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"


def main():
    args = parse_args()
    try:
        rank, world, device = init_distributed(args.device)
        config = check_args(args, device)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "no CUDA"
        note = " -- tiny preset and short context unless you chose sizes" if device.type == "cpu" else ""
        print(f"device: {device} ({name}){note}")
    try:
        train(args, config, rank, world, device)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    except FloatingPointError as e:
        print(f"stopped: {e}")
        raise SystemExit(1)
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
