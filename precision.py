"""fp32, TF32, bf16 and fp16, measured rather than asserted.

A float format is a trade between range (exponent bits) and resolution (mantissa bits). bf16 keeps
fp32's range with 7 mantissa bits, so it needs no loss scaling but accumulates badly; fp16 has
3 more mantissa bits but a range that gradients fall out of, hence GradScaler; TF32 is fp32 storage
fed to the tensor cores with a 10-bit mantissa. Each section below runs alone and ends with one
line saying what its numbers show.

    python precision.py                         # every section the machine supports
    python precision.py --only accumulate,layernorm
    python precision.py --only tf32 --model gpt2 --batch 8 --seq 1024
    python precision.py --only mixed --models tiny,gpt2 --steps 10

Sections: formats, accumulate, autocast, layernorm, tf32, gradscaler, mixed (the last two need CUDA).

Excerpt (NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-22), section 7 (`--only mixed`):

    model            precision               step (ms)  k tokens/s  peak allocated (GiB)
    ---------------  ----------------------  ---------  ----------  --------------------
    tiny B=8 T=256                     fp32        7.3       280.7                  1.74
    tiny B=8 T=256                     tf32        8.0       255.4                  1.74
    tiny B=8 T=256            bf16 autocast        8.2       249.2                  1.35
    tiny B=8 T=256   fp16 autocast + scaler        9.9       207.9                  1.35
    gpt2 B=8 T=1024                    fp32      160.6        51.0                 12.14
    gpt2 B=8 T=1024                    tf32       68.0       120.5                 12.14
    gpt2 B=8 T=1024           bf16 autocast       39.8       206.0                  8.88
    gpt2 B=8 T=1024  fp16 autocast + scaler       41.2       198.7                  8.88
    takeaway: bf16 autocast against fp32: tiny 0.89x the speed at 0.78x the peak memory; gpt2 4.04x the speed at 0.73x the peak memory; mixed precision pays where large matmuls dominate the step, much less where launches and casts do.
"""

import argparse
import gc
import math
import os
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt import (GPT, autocast, configure_optimizer, fail, gib, load_tokens, make_config,
                 print_table, resolve_device, set_tf32, synchronize)

SECTIONS = ("formats", "accumulate", "autocast", "layernorm", "tf32", "gradscaler", "mixed")
CUDA_ONLY = ("gradscaler", "mixed")
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def short(dtype):
    return SHORT.get(dtype, str(dtype).replace("torch.", ""))


# --- 1. formats: what the bits buy


def format_row(name, bits, mantissa, eps, largest, smallest_normal):
    exponent = bits - 1 - mantissa
    digits = (mantissa + 1) * math.log10(2)  # significand bits (implicit 1 included) in decimal
    return [name, 1, exponent, mantissa, f"{eps:.3g}", f"{largest:.4g}", f"{smallest_normal:.3g}",
            f"{digits:.1f}"]


def formats_table():
    rows = []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16),
                        ("fp8 e4m3", torch.float8_e4m3fn), ("fp8 e5m2", torch.float8_e5m2)):
        fi = torch.finfo(dtype)
        mantissa = round(-math.log2(fi.eps))
        rows.append(format_row(name, fi.bits, mantissa, fi.eps, fi.max, fi.smallest_normal))
        if name == "fp32":
            # TF32 is not a storage dtype (torch.finfo has no entry): it is the tensor cores'
            # input format, 1 sign / 8 exponent / 10 mantissa bits, so fp32's range with fp16's
            # resolution. The layout is NVIDIA's; the values follow from it.
            rows.append(format_row("tf32 (layout)", 19, 10, 2.0**-10, (2 - 2.0**-10) * 2.0**127,
                                   2.0**-126))
    return rows


def section_formats(args, device):
    print_table(["format", "sign", "exponent bits", "mantissa bits", "eps", "largest",
                 "smallest normal", "decimal digits"], formats_table())
    print("takeaway: bf16 and TF32 keep fp32's exponent (range to 3.4e38) with 8 and 11 significant "
          "bits; fp16 buys 3 more bits of resolution with a range that ends at 65504.")


# --- 2. accumulate: why a low-precision running sum stops growing


def ulp(x, dtype):
    """Gap between x and the next larger number of dtype (x a positive normal number)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(x))


def accumulate(value, n, acc_dtype, addend_dtype=None, cast="implicit"):
    """Add `value` n times to a running sum that starts as a 0-dim tensor of acc_dtype, one
    rounded addition per step, like a naive reduction loop. The addends are stored in
    addend_dtype (default: acc_dtype). cast: "implicit" adds x[i] and lets type promotion decide
    (a 0-dim fp32 sum plus a 0-dim fp16 addend stays fp32), "explicit" adds x[i].to(acc_dtype),
    "slice" adds x[i:i+1], a 1-element tensor, which promotion ranks above a 0-dim one, so the
    sum silently becomes the addend's dtype.
    Returns dict(total, dtype (of the sum at the end), stall_step, stall_value): the step after
    which the sum never changed again, None if it grew to the end."""
    addends = torch.full((n,), value, dtype=addend_dtype or acc_dtype)
    acc = torch.zeros((), dtype=acc_dtype)
    last_change = 0
    for i in range(n):
        x = {"implicit": addends[i], "explicit": addends[i].to(acc_dtype), "slice": addends[i:i + 1]}[cast]
        new = (acc + x).reshape(())
        if new != acc:
            last_change = i + 1
        acc = new
    stalled = last_change < n
    return {"total": acc.item(), "dtype": acc.dtype, "stall_step": last_change + 1 if stalled else None,
            "stall_value": acc.item() if stalled else None}


def accumulate_rows():
    rows = []
    for value, n in ((0.01, 1000), (0.001, 10000)):
        exact = value * n
        for acc_dtype, addend_dtype, cast in ((torch.float32, None, "implicit"),
                                              (torch.float16, None, "implicit"),
                                              (torch.bfloat16, None, "implicit"),
                                              (torch.float32, torch.float16, "implicit"),
                                              (torch.float32, torch.float16, "explicit"),
                                              (torch.float32, torch.float16, "slice"),
                                              (torch.float32, torch.bfloat16, "implicit"),
                                              (torch.float32, torch.bfloat16, "explicit")):
            r = accumulate(value, n, acc_dtype, addend_dtype, cast)
            addend = addend_dtype or acc_dtype
            stored = torch.tensor(value, dtype=addend).item()  # the addend after rounding
            stall = "-"
            if r["stall_step"] is not None:
                u = ulp(r["stall_value"], r["dtype"])
                stall = f"step {r['stall_step']} at {r['stall_value']:g} (ulp {u:.3g}, half {u / 2:.3g})"
            rows.append([f"{value} x {n}", short(acc_dtype), short(addend), cast, f"{stored:.8g}",
                         short(r["dtype"]), f"{r['total']:.6f}", f"{abs(r['total'] - exact) / exact:.2e}",
                         stall])
    return rows


def section_accumulate(args, device):
    print_table(["sum", "acc", "addend", "cast", "addend stored", "sum dtype", "result",
                 "rel error", "stops growing"], accumulate_rows())
    print("takeaway: once the addend is below half an ulp of the running sum, round-to-nearest "
          "returns the sum unchanged (fp16 and bf16 stall); an fp32 sum of fp16/bf16 addends only "
          "inherits the addend's rounding, unless promotion makes the sum fp16 (x[i:i+1]).")


# --- 3. autocast: which dtype each op really produced


class ToyModel(nn.Module):
    def __init__(self, d_in=64, d_hidden=128, n_out=10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.relu = nn.ReLU()
        self.ln = nn.LayerNorm(d_hidden)
        self.fc2 = nn.Linear(d_hidden, n_out)

    def forward(self, x):
        return self.fc2(self.ln(self.relu(self.fc1(x))))


def autocast_dtypes(device, dtype, batch=32):
    """Run the toy model forward and backward under autocast(device, dtype) and return what the
    hooks saw: {what: torch.dtype}. An empty dict means autocast refused the dtype on this device
    (torch warns and disables it rather than raising)."""
    torch.manual_seed(0)
    model = ToyModel().to(device)
    seen = {}
    hooks = []
    for name, module in model.named_children():
        def forward_hook(mod, inputs, output, name=name):
            seen[f"{name} output"] = output.dtype
            if name == "fc1":  # read while the context is active: are the weights cast in place?
                seen["fc1.weight inside context"] = mod.weight.dtype

        def backward_hook(mod, grad_input, grad_output, name=name):
            seen[f"grad of {name} output"] = grad_output[0].dtype

        hooks.append(module.register_forward_hook(forward_hook))
        hooks.append(module.register_full_backward_hook(backward_hook))
    # an input that requires grad, so the full backward hooks also see the first layer's gradient
    x = torch.randn(batch, 64, device=device, requires_grad=True)
    y = torch.randint(0, 10, (batch,), device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(device.type, dtype=dtype):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
    if any("autocast" in str(w.message).lower() for w in caught):
        return {}
    seen["loss (cross_entropy)"] = loss.dtype
    loss.backward()  # outside the context, as recommended: backward ops reuse the forward's dtypes
    seen["fc1.weight.grad"] = model.fc1.weight.grad.dtype
    seen["ln.weight.grad"] = model.ln.weight.grad.dtype
    for h in hooks:
        h.remove()
    return seen


AUTOCAST_ROWS = ("fc1.weight inside context", "fc1 output", "relu output", "ln output", "fc2 output",
                 "loss (cross_entropy)", "grad of fc2 output", "grad of ln output", "grad of fc1 output",
                 "fc1.weight.grad", "ln.weight.grad")


def section_autocast(args, device):
    captured = {name: autocast_dtypes(device, dtype) for name, dtype in LOW.items()}
    rows = [[what] + [short(captured[n][what]) if captured[n] else "n/a" for n in LOW]
            for what in AUTOCAST_ROWS]
    print_table(["tensor (toy Linear-ReLU-LayerNorm-Linear)"] + [f"autocast {n} on {device.type}" for n in LOW],
                rows)
    if device.type == "cpu":
        print("note: this is the CPU autocast policy, which differs from CUDA's (its op lists are "
              "separate; e.g. CUDA autocast runs LayerNorm in fp32, CPU may not); run on a GPU for "
              "the CUDA table.")
    print("takeaway: autocast leaves the parameters and their gradients in fp32 and casts per op: "
          "matmuls run in the low dtype, reductions like the loss stay in fp32, and backward "
          "mirrors the forward's dtypes.")


# --- 4. layernorm: where low-precision statistics break


def layernorm_in(x, dtype, eps=1e-5):
    """LayerNorm with every operation in dtype, statistics by the one-pass formula
    var = E[x^2] - E[x]^2: x^2 is where fp16 overflows, and the subtraction of two nearly equal
    numbers is where a short mantissa loses the variance."""
    x = x.to(dtype)
    mean = x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) - mean * mean
    return (x - mean) * torch.rsqrt(var + eps)


def layernorm_case(offset, scale, rows=64, width=768):
    """Errors against a float64 reference for inputs offset + scale * N(0, 1)."""
    g = torch.Generator().manual_seed(0)
    x = offset + scale * torch.randn(rows, width, generator=g)
    ref = F.layer_norm(x.double(), (width,))
    out = {"max_x2": (x.double() ** 2).max().item()}
    for name, dtype in LOW.items():
        y = layernorm_in(x, dtype)
        out[f"{name}_overflow"] = bool(torch.isinf((x.to(dtype) * x.to(dtype))).any())
        out[f"{name}_err"] = (y.double() - ref).abs().max().item()
    # what torch's own kernel does with a bf16 input: statistics accumulated in fp32 internally
    out["torch_bf16_err"] = (F.layer_norm(x.bfloat16(), (width,)).double() - ref).abs().max().item()
    return out


def fmt_err(e):
    return "inf/nan" if not math.isfinite(e) else f"{e:.2e}"


LAYERNORM_CASES = ((0.0, 1.0), (0.0, 30.0), (0.0, 100.0), (0.0, 1000.0), (10.0, 0.1), (100.0, 1.0))


def section_layernorm(args, device):
    rows = []
    for offset, scale in LAYERNORM_CASES:
        r = layernorm_case(offset, scale)
        rows.append([f"{offset:g} + {scale:g}*N(0,1)", f"{r['max_x2']:.3g}",
                     "overflow" if r["fp16_overflow"] else "no", fmt_err(r["fp16_err"]),
                     fmt_err(r["bf16_err"]), fmt_err(r["torch_bf16_err"])])
    print_table(["input x (768 wide)", "max x^2", "fp16 x^2 > 65504", "fp16 max abs err",
                 "bf16 max abs err", "F.layer_norm(bf16) err"], rows)
    print("takeaway: all-fp16 statistics overflow once |x| > 256; bf16 never overflows but loses "
          "a small variance under a large mean (E[x^2] - E[x]^2 cancels), so statistics belong in "
          "fp32, as torch's LayerNorm kernel and autocast keep them.")


# --- 5. tf32: matmul speed and error, and what TF32 does to memory


def time_op(fn, device, iters):
    """Mean milliseconds per call after two warm-up calls. CUDA events time the GPU work itself;
    the host only queues kernels, so wall-clock time without a synchronize would be wrong."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


MATMUL_MODES = ("fp32 ieee", "tf32", "bf16", "fp16")


def matmul_rows(device, sizes):
    """Table rows, and {mode: (ms, rel error)} at the largest size for the takeaway."""
    rows, largest = [], {}
    for n in sizes:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, generator=g)
        b = torch.randn(n, n, device=device, generator=g)
        ref = a.double() @ b.double()
        for mode in MATMUL_MODES:
            if mode == "tf32" and device.type != "cuda":
                rows.append([f"{n}", mode, "n/a", "n/a", "n/a (TF32 is CUDA-only)"])
                continue
            set_tf32(mode == "tf32")
            dtype = LOW.get(mode, torch.float32)
            x, y = a.to(dtype), b.to(dtype)
            err = ((x @ y).double() - ref).norm().item() / ref.norm().item()
            iters = max(3, min(100, int(4e12 / (2 * n**3)))) if device.type == "cuda" else 3
            ms = time_op(lambda: x @ y, device, iters)
            rows.append([f"{n}", mode, f"{ms:.3f}", f"{2 * n**3 / ms / 1e9:.3g}", f"{err:.2e}"])
            largest[mode] = (ms, err)
            del x, y
        set_tf32(False)
        del a, b, ref
    return rows, largest


def train_step(model, optimizer, x, y, dtype=None, scaler=None):
    """One optimizer step; fp16 goes through the scaler (see section 6)."""
    optimizer.zero_grad(set_to_none=True)
    with autocast(x.device, dtype):
        _, loss = model(x, y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    return loss.detach()


def cublas_workspace_config():
    """The configured cuBLAS workspace size as torch reports it ('n/a' on a torch without the
    query: torch.backends.cuda.cublas_workspace_size is recent) and the environment override."""
    env = f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', 'unset')}"
    query = getattr(torch.backends.cuda, "cublas_workspace_size", None)
    try:
        return f"{query() / 2**20:.0f} MiB, {env}" if query else f"n/a, {env}"
    except (RuntimeError, AttributeError):  # a build without CUDA lacks the binding
        return f"n/a, {env}"


def fresh_model(config, batch, T, device):
    """A seeded model, its AdamW and a (batch, T) token batch, built after the previous row's
    tensors are freed and the peak counter reset, so each row's memory figures are its own."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    x = torch.randint(0, config.vocab_size, (batch, T), device=device)
    return model, configure_optimizer(model, lr=1e-4), x


def tf32_memory_rows(args, device):
    """A GPT training step with TF32 off and on, and where its memory goes. The cuBLAS workspace
    comes out of the caching allocator, so it hides inside memory_allocated; clearing the
    workspaces after the step and watching memory_allocated drop measures it. Whatever cuBLAS
    allocates by itself, outside the allocator, shows only in the device-wide figure from
    cudaMemGetInfo (which also holds the CUDA context)."""
    config = make_config(args.model)
    T = min(args.seq, config.block_size)
    rows, measured = [], {}
    for enabled in (False, True):
        set_tf32(enabled)
        torch._C._cuda_clearCublasWorkspaces()  # each setting starts without the other's workspace
        try:
            model, optimizer, x = fresh_model(config, args.batch, T, device)
            train_step(model, optimizer, x, x)  # warm-up: creates optimizer state and workspaces
            ms = time_op(lambda: train_step(model, optimizer, x, x), device, args.steps)
            allocated = torch.cuda.memory_allocated(device)
            peak = torch.cuda.max_memory_allocated(device)
            reserved = torch.cuda.memory_reserved(device)
            free, total = torch.cuda.mem_get_info(device)
            torch._C._cuda_clearCublasWorkspaces()
            workspace = allocated - torch.cuda.memory_allocated(device)
            rows.append([f"{args.model} B={args.batch} T={T}", "on" if enabled else "off", f"{ms:.1f}",
                         gib(allocated), gib(peak), gib(reserved), f"{workspace / 2**20:.1f}",
                         gib(total - free)])
            measured[enabled] = (peak, reserved, workspace, total - free)
            del model, optimizer, x
        except torch.OutOfMemoryError:
            model = optimizer = x = None  # drop the references so the next setting starts clean
            rows.append([f"{args.model} B={args.batch} T={T}", "on" if enabled else "off"] + ["OOM"] * 6)
    set_tf32(False)
    gc.collect()
    torch.cuda.empty_cache()
    return rows, measured


def section_tf32(args, device):
    sizes = (1024, 2048, 4096, 8192) if device.type == "cuda" else (128, 256)
    rows, largest = matmul_rows(device, sizes)
    print_table(["n (n x n @ n x n)", "mode", "time (ms, mean)", "TFLOP/s", "rel error vs fp64"], rows)
    n, (fp32_ms, fp32_err) = sizes[-1], largest["fp32 ieee"]
    errors = ", ".join(f"{m} {e:.1e}" for m, (_, e) in largest.items() if math.isfinite(e))
    if device.type != "cuda":
        print(f"takeaway: at n={n} the relative errors are {errors}; TF32, its speed-up and the "
              "GPT-step memory table need NVIDIA tensor cores (CUDA).")
        return
    speedups = ", ".join(f"{m} {fp32_ms / ms:.1f}x" for m, (ms, _) in largest.items() if m != "fp32 ieee")
    print(f"takeaway (matmul): at n={n}, speed over fp32 {speedups}; relative errors {errors}.")
    print(f"\nGPT training step, TF32 off vs on (mean of {args.steps} steps after 1 warm-up; "
          f"cuBLAS workspace configured: {cublas_workspace_config()})")
    rows, measured = tf32_memory_rows(args, device)
    print_table(["model", "TF32", "step (ms)", "allocated after step (GiB)", "max allocated (GiB)",
                 "reserved (GiB)", "cuBLAS workspaces in allocated (MiB)", "device used (GiB)"], rows)
    if len(measured) == 2:
        diff = [(on - off) / 2**20 for off, on in zip(measured[False], measured[True])]
        print("takeaway (memory): TF32 on minus off: max allocated {:+.1f} MiB, reserved {:+.1f} MiB, "
              "cuBLAS workspaces {:+.1f} MiB, device used {:+.1f} MiB; TF32 changes how fp32 inputs "
              "are rounded inside the matmul, not what is stored.".format(*diff))


# --- 6. gradscaler: fp16 gradients that vanish without loss scaling


def count_activation_grads(model, counts):
    """Hook every Linear: count elements of the gradient arriving at its output (the tensor that
    is fp16/bf16 under autocast) that are exactly zero or not finite. In fp32 these gradients are
    almost never exactly zero (GELU, softmax), so zeros in fp16 are underflow."""
    def hook(module, grad_input, grad_output):
        g = grad_output[0]
        counts["zero"] += (g == 0).sum().item()
        counts["nonfinite"] += (~torch.isfinite(g)).sum().item()
        counts["total"] += g.numel()

    return [m.register_full_backward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]


def gradscaler_run(dtype, use_scaler, tokens, args, device):
    torch.manual_seed(0)
    config = make_config("tiny")
    model = GPT(config).to(device)
    optimizer = configure_optimizer(model, lr=1e-3)
    scaler = torch.amp.GradScaler(device.type) if use_scaler else None
    counts = {"zero": 0, "nonfinite": 0, "total": 0}
    hooks = count_activation_grads(model, counts)
    g = torch.Generator().manual_seed(0)
    T, B = config.block_size, args.batch
    losses, skipped, param_zero = [], 0, []
    for step in range(args.steps):
        starts = torch.randint(0, len(tokens) - T - 1, (B,), generator=g)
        x = torch.stack([tokens[s:s + T] for s in starts]).to(device)
        y = torch.stack([tokens[s + 1:s + T + 1] for s in starts]).to(device)
        scale = scaler.get_scale() if scaler else None
        losses.append(train_step(model, optimizer, x, y, dtype, scaler).item())
        if scaler and scaler.get_scale() < scale:
            skipped += 1  # the scaler found inf/nan gradients, skipped the step and halved the scale
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        param_zero.append((grads == 0).float().mean().item())
    for h in hooks:
        h.remove()
    name = f"{short(dtype)} autocast" + (" + GradScaler" if use_scaler else "")
    return [name, f"{100 * counts['zero'] / counts['total']:.2f}",
            f"{100 * counts['nonfinite'] / counts['total']:.4f}", f"{100 * sum(param_zero) / len(param_zero):.2f}",
            f"{losses[0]:.3f}", f"{losses[-1]:.3f}",
            f"{scaler.get_scale():.0f}" if scaler else "-", skipped if scaler else "-"]


def section_gradscaler(args, device):
    tokens = load_tokens()
    rows = [gradscaler_run(dtype, use_scaler, tokens, args, device)
            for dtype, use_scaler in ((torch.float16, False), (torch.float16, True), (torch.bfloat16, False))]
    print(f"tiny GPT, B={args.batch} T=256, {args.steps} steps of AdamW lr 1e-3 on input.txt")
    print_table(["run", "act-grad zero (%)", "act-grad inf/nan (%)", "param-grad zero (%)",
                 "loss first", "loss last", "final scale", "skipped steps"], rows)
    zeros = ", ".join(f"{row[0]} {row[1]}%" for row in rows)
    print(f"takeaway: activation-gradient elements that were exactly zero: {zeros}; fp16 flushes "
          "anything below 6e-8 to zero, the scaler multiplies the loss to keep such gradients "
          "representable (skipping a step when they overflow), bf16's fp32-sized range needs neither.")


# --- 7. mixed: what each precision buys per training step


MIXED_MODES = (("fp32", None, False), ("tf32", None, True), ("bf16 autocast", torch.bfloat16, False),
               ("fp16 autocast + scaler", torch.float16, False))


def mixed_row(model_name, mode, dtype, tf32, args, device):
    config = make_config(model_name)
    T = min(args.seq, config.block_size)
    set_tf32(tf32)  # autocast rows keep TF32 off: their matmuls are already bf16/fp16
    try:
        model, optimizer, x = fresh_model(config, args.batch, T, device)
        scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        ms = time_op(lambda: train_step(model, optimizer, x, x, dtype, scaler), device, args.steps)
        peak = torch.cuda.max_memory_allocated(device)
        del model, optimizer, x
        return [f"{model_name} B={args.batch} T={T}", mode, f"{ms:.1f}", f"{args.batch * T / ms:.1f}", gib(peak)]
    except torch.OutOfMemoryError:
        return [f"{model_name} B={args.batch} T={T}", mode, "OOM", "OOM", "OOM"]
    finally:
        set_tf32(False)
        gc.collect()
        torch.cuda.empty_cache()


def section_mixed(args, device):
    rows, gains = [], []
    for model_name in args.models:
        for mode, dtype, tf32 in MIXED_MODES:
            rows.append(mixed_row(model_name, mode, dtype, tf32, args, device))
            print(f"  measured {model_name} {mode}", flush=True)
        fp32, bf16 = rows[-len(MIXED_MODES)], rows[-2]
        if "OOM" not in (fp32[2], bf16[2]):
            gains.append(f"{model_name} {float(fp32[2]) / float(bf16[2]):.2f}x the speed at "
                         f"{float(bf16[4]) / float(fp32[4]):.2f}x the peak memory")
    print(f"train step, mean of {args.steps} steps after 2 warm-ups; peak = max_memory_allocated")
    print_table(["model", "precision", "step (ms)", "k tokens/s", "peak allocated (GiB)"], rows)
    print(f"takeaway: bf16 autocast against fp32: {'; '.join(gains) or 'n/a'}; mixed precision pays "
          "where large matmuls dominate the step, much less where launches and casts do.")


# --- main


def parse_only(text):
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise ValueError(f"unknown section '{','.join(unknown) or text}'; choose from {', '.join(SECTIONS)}")
    return names


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma list of sections")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--model", default="gpt2", help="model of the TF32 training step (section 5)")
    parser.add_argument("--models", default="tiny,gpt2", help="comma list of models for section 7")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (sections 5-7)")
    args = parser.parse_args()
    try:
        only = parse_only(args.only)
        device = resolve_device(args.device)
        args.models = [m.strip() for m in args.models.split(",") if m.strip()]
        for name in [args.model, *args.models]:
            make_config(name)
    except ValueError as e:
        fail(str(e))
    if args.batch < 1 or args.seq < 1 or args.steps < 1:
        fail("--batch, --seq and --steps must be positive")
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    else:
        print(f"device: cpu, torch {torch.__version__}: small sizes, seconds-long; "
              f"{', '.join(CUDA_ONLY)} and the TF32 parts need CUDA")
    ran, skipped = [], []
    for i, name in enumerate(SECTIONS, 1):
        if name not in only:
            continue
        print(f"\n== {i}. {name}")
        if name in CUDA_ONLY and device.type != "cuda":
            print("skipped: needs CUDA")
            skipped.append(name)
            continue
        globals()[f"section_{name}"](args, device)
        synchronize(device)
        ran.append(name)
    print(f"\nprecision.py on {device.type}: ran {', '.join(ran) or 'nothing'}"
          + (f"; skipped {', '.join(skipped)} (needs CUDA)" if skipped else ""))


if __name__ == "__main__":
    main()
