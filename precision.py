"""fp32, TF32, bf16, fp16 and FP8, measured rather than asserted.

A float format is a trade between range (exponent bits) and resolution (mantissa bits). bf16 keeps
fp32's range with 7 mantissa bits, so it needs no loss scaling but accumulates badly; fp16 has
3 more mantissa bits but a range that gradients fall out of, hence GradScaler; TF32 is fp32 storage
fed to the tensor cores with a 10-bit mantissa; FP8 (e4m3, e5m2) needs a scale per tensor or per
row, and pays only where the GEMM saves more than the casts cost. Each section ends with a takeaway.

    python precision.py                         # every section the machine supports
    python precision.py --only accumulate,layernorm
    python precision.py --only tf32 --model gpt2 --batch 8 --seq 1024
    python precision.py --only mixed --models tiny,gpt2 --rounds 10
    python precision.py --only fp8              # H100/H200: which Linear layers gain from FP8
"""

import argparse
import copy
import math
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt import (E4M3, E5M2, FP8_LAYERS, FP8_MIN_WIDTH, GPT, GPT2_VOCAB, PRESETS, Fp8Linear, autocast, compare,
                 compile_model, configure_optimizer, fail, fp8_mm, fp8_supported, free_memory, gib, int_in, is_oom,
                 lazily, load_tokens, make_config, name_list, on_device, print_table, resolve_device, round_up,
                 run_main, set_tf32, summarize, synchronize, time_rounds, to_fp8, train_step, use_fp8)

SECTIONS = ("formats", "accumulate", "autocast", "layernorm", "tf32", "gradscaler", "mixed", "fp8")
CUDA_ONLY = ("gradscaler", "mixed")
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# --- 1. formats: what the bits buy
FORMAT_HEADERS = ["format", "exponent bits", "mantissa bits", "eps", "largest", "smallest normal",
                  "smallest subnormal", "range (binades)", "decimal digits"]


def format_row(name, bits, mantissa, eps, largest, smallest_normal):
    subnormal = smallest_normal * eps  # the last mantissa bit below the smallest normal
    digits = (mantissa + 1) * math.log10(2)  # significand bits (implicit 1 included) in decimal
    return [name, bits - 1 - mantissa, mantissa, f"{eps:.3g}", f"{largest:.4g}", f"{smallest_normal:.3g}",
            f"{subnormal:.3g}", f"{math.log2(largest / subnormal):.1f}", f"{digits:.1f}"]


def formats_table():
    rows = []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16),
                        ("fp8 e4m3", torch.float8_e4m3fn), ("fp8 e5m2", torch.float8_e5m2)):
        fi = torch.finfo(dtype)
        rows.append(format_row(name, fi.bits, round(-math.log2(fi.eps)), fi.eps, fi.max, fi.smallest_normal))
        if name == "fp32":
            # TF32 is no storage dtype (torch.finfo has none) but the tensor cores' input format,
            # NVIDIA's 1 sign / 8 exponent / 10 mantissa bits: fp32's range, fp16's resolution.
            rows.append(format_row("tf32 (layout)", 19, 10, 2.0**-10, (2 - 2.0**-10) * 2.0**127, 2.0**-126))
    return rows


def section_formats(settings, device):
    print_table(FORMAT_HEADERS, formats_table())
    print("takeaway: bf16 and TF32 keep fp32's exponent (range to 3.4e38) with 8 and 11 significant "
          "bits; fp16 buys 3 more bits of resolution with a range that ends at 65504; FP8 spans so few "
          "binades that every tensor needs its own scale.")

# takeaway: exponent bits buy range, mantissa bits resolution; bf16 gives up resolution to keep fp32's range.

# --- 2. accumulate: why a low-precision running sum stops growing
def ulp(x, dtype):
    """Gap between x and the next larger number of dtype (x a positive normal number)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(x))


def accumulate(value, n, acc_dtype, addend_dtype=None, cast="implicit"):
    """Add `value` n times to a 0-dim running sum of acc_dtype, one rounded addition per step like a
    naive reduction loop, the addends stored in addend_dtype (default acc_dtype). cast: "implicit"
    adds x[i] and lets type promotion decide (0-dim fp32 + 0-dim fp16 stays fp32), "explicit" adds
    x[i].to(acc_dtype), "slice" adds x[i:i+1], a 1-element tensor, which promotion ranks above a
    0-dim one, so the sum silently becomes the addend's dtype. Returns dict(total, dtype (of the
    final sum), stall_step, stall_value): the step after which the sum never changed, or None."""
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
        f32, f16, b16 = torch.float32, torch.float16, torch.bfloat16
        for acc_dtype, addend_dtype, cast in ((f32, None, "implicit"), (f16, None, "implicit"), (b16, None, "implicit"),
                                              (f32, f16, "implicit"), (f32, f16, "explicit"), (f32, f16, "slice"),
                                              (f32, b16, "implicit"), (f32, b16, "explicit")):
            r, addend = accumulate(value, n, acc_dtype, addend_dtype, cast), addend_dtype or acc_dtype
            u = ulp(r["stall_value"], r["dtype"]) if r["stall_step"] else None
            stall = f"step {r['stall_step']} at {r['stall_value']:g} (ulp {u:.3g}, half {u / 2:.3g})" if u else "-"
            rows.append([f"{value} x {n}", SHORT[acc_dtype], SHORT[addend], cast,
                         f"{torch.tensor(value, dtype=addend).item():.8g}",  # the addend after rounding
                         SHORT[r["dtype"]], f"{r['total']:.6f}", f"{abs(r['total'] - exact) / exact:.2e}", stall])
    return rows


def section_accumulate(settings, device):
    print_table(["sum", "acc", "addend", "cast", "addend stored", "sum dtype", "result",
                 "rel error", "stops growing"], accumulate_rows())
    print("takeaway: once the addend is below half an ulp of the running sum, round-to-nearest "
          "returns the sum unchanged (fp16 and bf16 stall); an fp32 sum of fp16/bf16 addends only "
          "inherits the addend's rounding, unless promotion makes the sum fp16 (x[i:i+1]).")

# takeaway: accumulate in fp32; low-precision addends then cost only their own rounding.

# --- 3. autocast: which dtype each op really produced
def autocast_dtypes(device, dtype, batch=32):
    """Run a toy model forward and backward under autocast(device, dtype) and return what the
    hooks saw: {what: torch.dtype}."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(64, 128), relu=nn.ReLU(), ln=nn.LayerNorm(128),
                                      fc2=nn.Linear(128, 10))).to(device)
    seen, hooks = {}, []
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
    with torch.autocast(device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    seen["loss (cross_entropy)"] = loss.dtype
    loss.backward()  # outside the context, as recommended: backward ops reuse the forward's dtypes
    seen["fc1.weight.grad"] = model.fc1.weight.grad.dtype
    seen["ln.weight.grad"] = model.ln.weight.grad.dtype
    for h in hooks:
        h.remove()
    return seen


def section_autocast(settings, device):
    captured = {name: autocast_dtypes(device, dtype) for name, dtype in LOW.items()}
    rows = [[what] + [SHORT[captured[n][what]] for n in LOW] for what in captured["bf16"]]  # in the order seen
    print_table(["tensor (toy Linear-ReLU-LayerNorm-Linear)"] + [f"autocast {n} on {device.type}" for n in LOW], rows)
    if device.type == "cpu":
        print("note: the CPU autocast policy (its op lists differ from CUDA's); run on a GPU for CUDA's.")
    print("takeaway: autocast leaves the parameters and their gradients in fp32 and casts per op: "
          "matmuls run in the low dtype, reductions like the loss stay in fp32, and backward "
          "mirrors the forward's dtypes.")

# takeaway: autocast casts per op; parameters, their gradients and reductions stay fp32.

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


def section_layernorm(settings, device):
    rows = []
    for offset, scale in ((0.0, 1.0), (0.0, 30.0), (0.0, 100.0), (0.0, 1000.0), (10.0, 0.1), (100.0, 1.0)):
        r = layernorm_case(offset, scale)
        rows.append([f"{offset:g} + {scale:g}*N(0,1)", f"{r['max_x2']:.3g}",
                     "overflow" if r["fp16_overflow"] else "no"]
                    + [f"{e:.2e}" if math.isfinite(e) else "inf/nan"
                       for e in (r["fp16_err"], r["bf16_err"], r["torch_bf16_err"])])
    print_table(["input x (768 wide)", "max x^2", "fp16 x^2 > 65504", "fp16 max abs err",
                 "bf16 max abs err", "F.layer_norm(bf16) err"], rows)
    print("takeaway: all-fp16 statistics overflow once |x| > 256; bf16 never overflows but loses "
          "a small variance under a large mean (E[x^2] - E[x]^2 cancels), so statistics belong in "
          "fp32, as torch's LayerNorm kernel and autocast keep them.")

# takeaway: normalization statistics belong in fp32, whatever the activations' dtype.

# --- 5. tf32: matmul speed and error, and what TF32 does to memory
MATMUL_MODES = ("fp32 ieee", "tf32", "bf16", "fp16")


def matmul_rows(device, sizes, settings):
    """Table rows, and {mode: (Timing, rel error)} at the largest size for the takeaway. The
    modes of one size run interleaved in gpt.py's timer; TF32 is a process-wide switch, so each
    variant sets it before queueing its matmul."""
    rows, largest = [], {}
    for n in sizes:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, generator=g)
        b = torch.randn(n, n, device=device, generator=g)
        ref = a.double() @ b.double()
        ops, errors = {}, {}
        for mode in [m for m in MATMUL_MODES if m != "tf32" or device.type == "cuda"]:
            x, y = a.to(LOW.get(mode, torch.float32)), b.to(LOW.get(mode, torch.float32))
            set_tf32(mode == "tf32")
            errors[mode] = ((x @ y).double() - ref).norm().item() / ref.norm().item()
            ops[mode] = lambda x=x, y=y, tf32=mode == "tf32": (set_tf32(tf32), x @ y)
        stats = compare(ops, device, baseline="fp32 ieee", rounds=settings.rounds, steps=settings.steps)
        set_tf32(False)
        for mode in MATMUL_MODES:
            t = stats.get(mode)
            if t is None:  # not timed here (TF32 on a CPU), or out of memory in the timer's warm-up
                rows.append([n, mode, "n/a" if mode not in ops else "OOM", "n/a", "n/a", not_run(mode, ops)])
            else:
                rows.append([n, mode, t.ms(3), f"{2 * n**3 / t.median / 1e9:.3g}", t.vs(), f"{errors[mode]:.2e}"])
            largest[mode] = (t, errors.get(mode))
    return rows, largest


def not_run(mode, ops):  # why a mode of matmul_rows has no time
    if mode not in ops:
        return "n/a (TF32 is CUDA-only)"
    return "n/a (out of memory)"


def seeded_model(config, batch, T, device):
    """The same model, AdamW and (batch, T) token batch for every row."""
    torch.manual_seed(0)
    model = GPT(config).to(device)
    return model, configure_optimizer(model, lr=1e-4), torch.randint(0, 50257, (batch, T), device=device)


def tf32_memory_rows(settings, device):
    """A GPT training step with TF32 off and on, and where its memory goes. cuBLAS workspaces come
    out of the caching allocator, hidden inside memory_allocated: clearing them after the step
    and watching memory_allocated drop measures them. What cuBLAS allocates by itself shows only
    in the device-wide figure from cudaMemGetInfo (which also holds the CUDA context)."""
    config = make_config(settings.model)
    T = min(settings.seq, config.block_size)
    rows, measured = [], {}
    for enabled in (False, True):
        set_tf32(enabled)
        torch._C._cuda_clearCublasWorkspaces()  # each setting starts without the other's workspace
        free_memory()  # the previous row's tensors, so that each row's figures are its own
        torch.cuda.reset_peak_memory_stats(device)
        model, optimizer, x = seeded_model(config, settings.batch, T, device)
        for _ in range(2):  # the first step creates AdamW's state and the workspaces
            train_step(model, optimizer, x, x)
        synchronize(device)
        allocated, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
        reserved, (free, total) = torch.cuda.memory_reserved(device), torch.cuda.mem_get_info(device)
        torch._C._cuda_clearCublasWorkspaces()
        workspace = allocated - torch.cuda.memory_allocated(device)
        rows.append([f"{settings.model} B={settings.batch} T={T}", "on" if enabled else "off", gib(allocated),
                     gib(peak), gib(reserved), f"{workspace / 2**20:.1f}", gib(total - free)])
        measured[enabled] = (peak, reserved, workspace, total - free)
        del model, optimizer, x
    set_tf32(False)
    free_memory()
    return rows, measured


def speedups(largest, cuda):
    """'tf32 1.9x, bf16 3.7x, ...': each mode's speed over fp32 (the inverse of its paired time ratio) to three
    significant digits, so a mode 40 times slower reads 0.025x, not 0.0x; n/a and why for a mode without a time."""
    parts = []
    for mode in MATMUL_MODES[1:]:
        t = largest[mode][0]
        if mode == "tf32" and not cuda:
            parts.append(f"{mode} n/a (CUDA-only)")
        elif t is None:
            parts.append(f"{mode} n/a (out of memory)")
        elif t.ratio is None:
            parts.append(f"{mode} n/a (fp32 ran out of memory)")
        else:
            parts.append(f"{mode} {1 / t.ratio:.3g}x")
    return ", ".join(parts)


def section_tf32(settings, device):
    sizes = (1024, 2048, 4096, 8192) if device.type == "cuda" else (128, 256)
    rows, largest = matmul_rows(device, sizes, settings)
    print(f"n x n @ n x n, {settings.rounds} rounds of {settings.steps} matmuls per mode")
    print_table(["n", "mode", "ms, median (min-max)", "TFLOP/s", "time vs fp32 (paired)", "rel error vs fp64"], rows)
    errors = ", ".join(f"{m} {e:.1e}" for m, (t, e) in largest.items() if t is not None)
    cuda = device.type == "cuda"
    print(f"takeaway (matmul): at n={sizes[-1]}, speed over fp32 {speedups(largest, cuda)}; relative errors {errors}"
          + ("." if cuda else "; TF32 and the GPT-step memory table need CUDA, and a CPU's bf16/fp16 matmul speed "
             "depends on its own kernels: it says nothing about a GPU's."))
    if device.type != "cuda":
        return
    print("\nGPT training step, TF32 off vs on, after 2 steps (memory only: the step time is section 7's)")
    rows, measured = tf32_memory_rows(settings, device)
    print_table(["model", "TF32", "allocated after step (GiB)", "max allocated (GiB)", "reserved (GiB)",
                 "cuBLAS workspaces in allocated (MiB)", "device used (GiB)"], rows)
    diff = [(on - off) / 2**20 for off, on in zip(measured[False], measured[True])]
    print("takeaway (memory): TF32 on minus off: max allocated {:+.1f} MiB, reserved {:+.1f} MiB, "
          "cuBLAS workspaces {:+.1f} MiB, device used {:+.1f} MiB; TF32 changes how fp32 inputs "
          "are rounded inside the matmul, not what is stored.".format(*diff))

# takeaway: TF32 rounds a matmul's fp32 inputs; it changes speed and error, not what is stored.

# --- 6. gradscaler: fp16 gradients that vanish without loss scaling
def gradscaler_run(dtype, use_scaler, tokens, settings, device):
    torch.manual_seed(0)
    config = make_config("tiny")
    model = GPT(config).to(device)
    optimizer = configure_optimizer(model, lr=1e-3)
    scaler = torch.amp.GradScaler(device.type) if use_scaler else None
    counts = {"zero": 0, "nonfinite": 0, "total": 0}

    def hook(module, grad_input, grad_output):
        """The gradient arriving at a Linear's output (fp16/bf16 under autocast): in fp32 it is
        almost never exactly zero (GELU, softmax), so zeros in fp16 are underflow."""
        counts["zero"] += (grad_output[0] == 0).sum().item()
        counts["nonfinite"] += (~torch.isfinite(grad_output[0])).sum().item()
        counts["total"] += grad_output[0].numel()
    hooks = [m.register_full_backward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    T, B = config.block_size, settings.batch
    losses, skipped = [], 0
    for step in range(settings.steps):
        chunk = tokens[step * B * T:(step + 1) * B * T + 1].to(device)
        x, y = chunk[:-1].view(B, T), chunk[1:].view(B, T)
        scale = scaler.get_scale() if scaler else None
        losses.append(train_step(model, optimizer, x, y, dtype, scaler).item())
        if scaler and scaler.get_scale() < scale:
            skipped += 1  # the scaler found inf/nan gradients, skipped the step and halved the scale
    for h in hooks:
        h.remove()
    name = f"{SHORT[dtype]} autocast" + (" + GradScaler" if use_scaler else "")
    return [name, f"{100 * counts['zero'] / counts['total']:.2f}", f"{100 * counts['nonfinite'] / counts['total']:.4f}",
            f"{losses[0]:.3f}", f"{losses[-1]:.3f}", f"{scaler.get_scale():.0f}" if scaler else "-",
            skipped if scaler else "-"]


def section_gradscaler(settings, device):
    tokens = load_tokens()
    rows = [gradscaler_run(dtype, use_scaler, tokens, settings, device)
            for dtype, use_scaler in ((torch.float16, False), (torch.float16, True), (torch.bfloat16, False))]
    print(f"tiny GPT, B={settings.batch} T=256, {settings.steps} steps of AdamW lr 1e-3 on input.txt")
    print_table(["run", "act-grad zero (%)", "act-grad inf/nan (%)", "loss first", "loss last", "final scale",
                 "skipped steps"], rows)
    zeros = ", ".join(f"{row[0]} {row[1]}%" for row in rows)
    print(f"takeaway: activation-gradient elements that were exactly zero: {zeros}; fp16 flushes "
          "anything below 6e-8 to zero, the scaler multiplies the loss to keep such gradients "
          "representable (skipping a step when they overflow), bf16's fp32-sized range needs neither.")

# takeaway: fp16 needs a loss scale to keep small gradients representable; bf16's range does not.

# --- 7. mixed: what each precision buys per training step
MIXED_MODES = (("fp32", None, False), ("tf32", None, True), ("bf16 autocast", torch.bfloat16, False),
               ("fp16 autocast + scaler", torch.float16, False))


def mixed_step(config, T, dtype, tf32, settings, device):
    """One precision's training step, its model built when gpt.lazily first calls this (in the timer's
    warm-up, where an out-of-memory marks this row alone)."""
    model, optimizer, x = seeded_model(config, settings.batch, T, device)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    def step():
        set_tf32(tf32)  # autocast rows keep TF32 off: their matmuls are already bf16/fp16
        train_step(model, optimizer, x, x, dtype, scaler)
    return step


def section_mixed(settings, device):
    rows, gains = [], []
    for model_name in settings.models:
        config = make_config(model_name)
        T = min(settings.seq, config.block_size)
        variants = {mode: lazily(partial(mixed_step, config, T, dtype, tf32, settings, device), device)
                    for mode, dtype, tf32 in MIXED_MODES}
        print(f"  {model_name}: {len(variants)} precisions, {settings.rounds} rounds", flush=True)
        times, peaks = time_rounds(variants, device, settings.rounds, settings.steps)
        set_tf32(False)
        # the timer's peak is process-wide: a row's own is that minus what the other rows held then
        stats = summarize(times, "fp32", {m: p - variants[m].state["others"] for m, p in peaks.items()})
        for mode, t in stats.items():
            rows.append([f"{model_name} B={settings.batch} T={T}", mode] + (["OOM"] * 4 if t is None else
                        [t.ms(1), f"{settings.batch * T / t.median:.1f}", gib(t.peak), t.vs()]))
        fp32, bf16 = stats["fp32"], stats["bf16 autocast"]
        if fp32 and bf16:
            gains.append(f"{model_name} {1 / bf16.ratio:.2f}x the speed at {bf16.peak / fp32.peak:.2f}x peak memory")
        del variants
        free_memory()
    print(f"train step, {settings.rounds} rounds of {settings.steps} steps, all precisions of a model interleaved; "
          "peak = max_memory_allocated of that row alone")
    print_table(["model", "precision", "step ms, median (min-max)", "k tokens/s", "peak allocated (GiB)",
                 "time vs fp32 (paired)"], rows)
    print(f"takeaway: bf16 autocast against fp32: {'; '.join(gains) or 'n/a'}; mixed precision pays "
          "where large matmuls dominate the step, much less where launches and casts do.")

# takeaway: mixed precision pays where large matmuls dominate the step.

# --- 8. fp8: two 8-bit formats, a scale per tensor or per row, and where the GEMM pays
# e4m3 (3 mantissa bits, max 448) for weights and activations, e5m2 (2 bits, twice the binades)
# for gradients. A scale maps the tensor's largest magnitude to the format's max before the cast
# (dynamic scaling, every step). FP8 is floating point: the scale cannot change a value's relative
# rounding, only push small values below the smallest normal, where bits are lost; that is where
# one scale per row beats one per tensor.

FP8 = {"e4m3": E4M3, "e5m2": E5M2}
FP8_TOKENS = 16384  # B=16, T=1024


def fp8_shapes(config):
    """(name, in, out features) of a block's four Linears and the output layer (vocab 50304)."""
    d, f = config.n_embd, config.d_ff
    return (("attn.c_attn", d, 3 * d), ("attn.c_proj", d, d), ("mlp.c_fc", d, f), ("mlp.c_proj", f, d),
            ("lm_head", d, round_up(GPT2_VOCAB, 128)))


def to_fp8_rowwise(t, dtype):
    """gpt.to_fp8 with one scale per row (per token). (The weight-gradient GEMM sums over the
    tokens, so there the scales would have to run along the other axis.)"""
    amax = t.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = torch.finfo(dtype).max / amax
    return (t.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype), scale.reciprocal()


def fp8_round_trip(t, dtype, rowwise=False):
    """(relative Frobenius error of t after scaling, casting to dtype and back; fraction of its
    nonzero values that the scale left below dtype's smallest normal)."""
    q, inverse = (to_fp8_rowwise if rowwise else to_fp8)(t, dtype)
    t = t.float()
    error = ((q.float() * inverse - t).norm() / t.norm()).item()
    low = ((t.abs() / inverse < torch.finfo(dtype).smallest_normal) & (t != 0)).sum() / (t != 0).sum()
    return error, low.item()


def capture_linear_tensors(model_name, B, T, device, dtype=None):
    """{"<layer> input" / "<layer> output grad": (tokens, features) fp32 tensor} for the middle
    block's four Linears and the output layer, from one forward and backward of a freshly
    initialised model on the first B*T+1 tokens of input.txt."""
    config = make_config(model_name, fused_ce=False)  # the lm_head module must run to be hooked
    torch.manual_seed(0)
    model = GPT(config).to(device)
    captured, hooks = {}, []
    def keep(key, t):
        captured[key] = t.detach().flatten(0, -2).float()
    for name in [f"h.{config.n_layer // 2}.{n}" for n in FP8_LAYERS] + ["lm_head"]:
        m = model.get_submodule(name)
        hooks.append(m.register_forward_hook(lambda m, i, o, n=name: keep(f"{n} input", i[0])))
        hooks.append(m.register_full_backward_hook(lambda m, gi, go, n=name: keep(f"{n} output grad", go[0])))
    tokens = load_tokens()[: B * T + 1].to(device)
    with autocast(device, dtype):
        _, loss = model(tokens[:-1].view(B, T), tokens[1:].view(B, T))
    loss.backward()
    for h in hooks:
        h.remove()
    return captured


def fp8_error_rows(tensors):
    """Table rows, and {tensor: {(format, row-wise?): fp8_round_trip}} for the takeaway."""
    rows, found = [], {}
    for name, t in tensors.items():
        amax = t.abs().amax(dim=-1).clamp(min=1e-30)
        r = found[name] = {(f, rw): fp8_round_trip(t, dtype, rw) for f, dtype in FP8.items() for rw in (False, True)}
        rows.append([name, "x".join(map(str, t.shape)), f"{torch.log2(amax.max() / amax.min()).item():.1f}"]
                    + [f"{100 * r[f, False][i]:.2f} / {100 * r[f, True][i]:.2f}" for i in (0, 1) for f in FP8])
    return rows, found


def gemm_variants(M, K, N, device):
    """x @ w^T at one Linear's shape: bf16; FP8 with operands cast beforehand (one scale per
    tensor, or per row); FP8 with both casts each call, as separate (eager) kernels."""
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=device, dtype=torch.bfloat16)
    (x8, xi), (w8, wi) = to_fp8(x, E4M3), to_fp8(w, E4M3)
    (xr, xri), (wr, wri) = to_fp8_rowwise(x, E4M3), to_fp8_rowwise(w, E4M3)

    def cast_and_mm():
        (a, ai), (b, bi) = to_fp8(x, E4M3), to_fp8(w, E4M3)
        return fp8_mm(a, ai, b.t(), bi)
    return {"bf16": lambda: x @ w.t(),
            "fp8 tensorwise": lambda: fp8_mm(x8, xi, w8.t(), wi),  # w8.t(): (K, N) column-major
            "fp8 row-wise": lambda: torch._scaled_mm(xr, wr.t(), scale_a=xri, scale_b=wri.reshape(1, -1),
                                                     out_dtype=torch.bfloat16),
            "fp8 + both casts": cast_and_mm}


def layer_variants(name, K, N, M, device):
    """Forward and backward of one Linear, compiled (the casts fuse into neighbouring kernels),
    as nn.Linear under bf16 autocast and as gpt.Fp8Linear with the same weights."""
    bf16 = nn.Linear(K, N, bias=name != "lm_head", device=device)
    fp8 = copy.deepcopy(bf16)
    fp8.__class__ = Fp8Linear  # what gpt.use_fp8 does to each chosen layer
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)

    def fwd_bwd(layer, run):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with autocast(device, torch.bfloat16):
            y = run(x)
        y.backward(dy)
    runs = {"nn.Linear bf16": (bf16, compile_model(bf16)), "Fp8Linear": (fp8, compile_model(fp8))}
    return {k: lambda layer=layer, run=run: fwd_bwd(layer, run) for k, (layer, run) in runs.items()}


def section_fp8(settings, device):
    print_table(FORMAT_HEADERS, [row for row in formats_table() if row[0].startswith("fp8")])
    cuda = device.type == "cuda"
    B, T = (settings.batch, settings.seq) if cuda else (1, min(settings.seq, 128))
    rows, found = fp8_error_rows(capture_linear_tensors(settings.model, B, T, device, torch.bfloat16 if cuda else None))
    print(f"\nreal tensors ({settings.model} at initialisation, B={B} T={T} of input.txt"
          f"{', bf16 autocast' if cuda else ''}), each cell tensorwise / row-wise scaling")
    print_table(["tensor", "shape", "row amax spread (binades)", "e4m3 error (%)", "e5m2 error (%)",
                 "e4m3 below smallest normal (%)", "e5m2 below smallest normal (%)"], rows)
    median = {f: sorted(r[f, False][0] for r in found.values())[len(found) // 2] for f in FP8}
    worst = max((n for n in found if "grad" in n), key=lambda n: found[n]["e4m3", False][1])
    low = {k: f"{100 * found[worst][k][1]:.1f}%" for k in found[worst]}
    print(f"takeaway: e4m3's extra mantissa bit halves the error (median {100 * median['e4m3']:.2f}% vs e5m2 "
          f"{100 * median['e5m2']:.2f}%), but gradients span more binades: {low['e4m3', False]} of {worst} falls "
          f"below e4m3's smallest normal with one scale per tensor ({low['e4m3', True]} row-wise), "
          f"{low['e5m2', False]} in e5m2; the error norm hides it, the large values dominate it.")
    if not fp8_supported(device):
        print("GEMM speed and the per-layer table need FP8 tensor cores: run on an H100/H200.")
        return
    config = make_config(settings.model)
    with torch.device("meta"):  # what gpt.use_fp8 would convert in this model, asked of gpt.use_fp8
        converted = {name.split(".", 2)[2] for name, *_, chosen in use_fp8(GPT(config)) if chosen}
    gemm_rows, layer_rows, gains = [], [], []
    torch._dynamo.config.automatic_dynamic_shapes = False  # one graph per layer shape, each kept:
    torch._dynamo.config.recompile_limit = max(16, torch._dynamo.config.recompile_limit)
    for name, K, N in fp8_shapes(config):
        stats = compare(gemm_variants(FP8_TOKENS, K, N, device), device, "bf16", settings.rounds, settings.steps)
        gemm_rows += [[name, f"{FP8_TOKENS}x{K}x{N}", variant, t.ms(3),
                       f"{2 * FP8_TOKENS * K * N / t.median / 1e9:.0f}", t.vs()] for variant, t in stats.items()]
        print(f"  {name}: compiling nn.Linear and Fp8Linear...", flush=True)
        stats = compare(layer_variants(name, K, N, FP8_TOKENS, device), device, "nn.Linear bf16", settings.rounds,
                        settings.steps)
        ref, t = stats["nn.Linear bf16"], stats["Fp8Linear"]
        gains += [name] if t.ratio_high < 1 else []
        layer_rows.append([name, ref.ms(3), t.ms(3), t.vs(), "yes" if t.ratio_high < 1 else "no",
                           "yes" if name in converted else "no"])
        free_memory()
    print(f"\nGEMMs x @ w^T, {FP8_TOKENS} tokens, bf16 out, {settings.rounds} rounds of {settings.steps}")
    print_table(["layer", "M x K x N", "GEMM", "ms, median (min-max)", "TFLOP/s", "time vs bf16 (paired)"], gemm_rows)
    print(f"\none {settings.model} Linear alone, forward + backward (3 GEMMs), compiled, {FP8_TOKENS} tokens, "
          f"{settings.rounds} rounds of {settings.steps}")
    print_table(["layer", "nn.Linear bf16, ms", "Fp8Linear, ms", "time vs bf16 (paired)", "FP8 faster every round",
                 "gpt.use_fp8 converts"], layer_rows)
    print(f"takeaway: alone, FP8 is faster in every round at {', '.join(gains) or 'no layer'}; gpt.use_fp8 "
          f"converts {', '.join(sorted(converted)) or 'none'} of {settings.model}'s (both widths >= {FP8_MIN_WIDTH}, "
          "a line drawn by timing whole compiled blocks); the bare FP8 GEMM is the ceiling, the casts what "
          "it must beat.")

# takeaway: FP8 pays only where the GEMM's saving beats the casts around it.

# --- main
RUNS = {"formats": section_formats, "accumulate": section_accumulate, "autocast": section_autocast,
        "layernorm": section_layernorm, "tf32": section_tf32, "gradscaler": section_gradscaler, "mixed": section_mixed,
        "fp8": section_fp8}  # SECTIONS, in order


@dataclass(frozen=True)
class Settings:  # the flags as plain values, read once in main; every section takes them
    model: str
    models: list
    batch: int
    seq: int
    steps: int
    rounds: int


def parse_args(argv):
    """The flags, each validated by its type= helper (a bad value: argparse's one-line error, exit 2)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", type=name_list(SECTIONS, "section"), default=list(SECTIONS),
                        help=f"comma list of sections: {', '.join(SECTIONS)}")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--model", choices=list(PRESETS), default="gpt2",
                        help="model of the TF32 step (5), FP8 tensors and shapes (8)")
    parser.add_argument("--models", type=name_list(list(PRESETS), "model"), default=["tiny", "gpt2"],
                        help="comma list of models for section 7")
    parser.add_argument("--batch", type=int_in(1, 4096), default=8)
    parser.add_argument("--seq", type=int_in(1), help="context (default 1024; at most the models' block size)")
    parser.add_argument("--steps", type=int_in(1, 1000), default=10, help="steps per variant per round (sections 5-8)")
    parser.add_argument("--rounds", type=int_in(1, 1000), help="timed rounds (default 10; CPU 3)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    only = args.only
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        fail(str(e))
    longest = max(make_config(name).block_size for name in [args.model, *args.models])
    if args.seq is not None and args.seq > longest:
        fail(f"--seq must be at most {longest}, the longest block size of these models, got {args.seq}")
    seq = min(1024, longest) if args.seq is None else args.seq
    settings = Settings(args.model, args.models, args.batch, seq, args.steps,
                        args.rounds or on_device(device, cpu=3, gpu=10))
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    else:
        print(f"device: cpu, torch {torch.__version__}: small sizes, seconds-long; {', '.join(CUDA_ONLY)}, "
              "the TF32 parts and FP8 speed need CUDA")
    skipped = [name for name in only if name in CUDA_ONLY and device.type != "cuda"]
    for i, name in enumerate(SECTIONS, 1):
        if name not in only:
            continue
        print(f"\n== {i}. {name}")
        if name in skipped:
            print("skipped: needs CUDA")
            continue
        try:
            RUNS[name](settings, device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
            fail(f"out of GPU memory in section {name}; try a smaller --batch or --seq")
        synchronize(device)
    ran = [name for name in SECTIONS if name in only and name not in skipped]
    skipped_text = f"; skipped {', '.join(skipped)} (needs CUDA)" if skipped else ""
    print(f"\nprecision.py on {device.type}: ran {', '.join(ran) or 'nothing'}{skipped_text}")


if __name__ == "__main__":
    run_main(main)  # Ctrl-C / SIGTERM: one line, exit 130 / 143
