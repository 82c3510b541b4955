"""End-to-end timing of GPT training: where a step's time goes and what each optimization buys.

A training step is a forward pass, a backward pass (about twice the forward's FLOPs) and an AdamW
update. This script times each of the three by model size, batch and context, in any precision,
attention implementation, vocabulary size and with or without torch.compile, and climbs the classic
speed ladder for GPT-2 124M: fp32 -> TF32 -> bf16 -> flash attention -> vocab 50304 -> compile.

    python bench_e2e.py --model small,medium,large,xl,2.7B --seq 512 --compare bf16,compile
    python bench_e2e.py --ladder
    python bench_e2e.py --model gpt2 --batch 16 --seq 1024 --bf16 --mode train --vocab 50257,50304
    python bench_e2e.py --model gpt2 --seq 1024 --bf16 --vocab 50304 --mode train --batch 64,72,80,96,112,128
    python bench_e2e.py --model gpt2 --batch 8 --seq 1024 --bf16 --attn naive --profile --trace step.json
    python bench_e2e.py --model gpt2 --seq 1024 --mode train --warmup 0,1,2,5 --compile --bf16

Times are the mean ± sample std over --steps timed steps after --warmup untimed ones, measured with
CUDA events around each step (CPU: wall clock). MFU uses gpt.flops_per_token against the detected
GPU's bf16 peak (n/a when unknown); peak memory is torch.cuda.max_memory_allocated (allocated, not
reserved). Without a GPU every mode falls back to the tiny preset at small sizes and says so.

Output excerpt (NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-22), `python bench_e2e.py --ladder`:

    rung (train step, B=16 T=1024)      ms/step (mean ± std, 10 steps)  tokens/s  vs previous  vs fp32  MFU    peak alloc (GiB)
    ----------------------------------  ------------------------------  --------  -----------  -------  -----  ----------------
    fp32, naive attention, vocab 50257                     388.4 ± 0.2    42,180            -    1.00x   3.6%             31.84
    + TF32 matmuls                                         184.1 ± 0.3    88,990        2.11x    2.11x   7.7%             31.84
    + bf16 autocast                                        163.0 ± 0.6   100,495        1.13x    2.38x   8.7%             29.55
    + SDPA flash attention                                  75.6 ± 0.5   216,752        2.16x    5.14x  18.7%             16.04
    + vocab 50304                                           50.1 ± 0.3   327,005        1.51x    7.75x  28.3%             16.05
    + torch.compile                                         37.5 ± 0.4   436,881        1.34x   10.36x  37.8%              9.98
"""

import argparse
import math
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from itertools import product

import torch

from gpt import (ATTENTION_IMPLS, GPT, GPTConfig, PRESETS, amp_dtype, autocast, check_config,
                 configure_optimizer, fail, flops_per_token, free_memory, gib, gpu_peak_flops, is_oom,
                 make_config, mean_std, mfu, print_table, resolve_device, set_tf32, synchronize)

MODES = ("forward", "forward-backward", "train")
# The forward pass does 2 of the 6 training FLOPs per matmul parameter (backward does 4).
MODE_FLOP_SHARE = {"forward": 1 / 3, "forward-backward": 1.0, "train": 1.0}
COMPARE_OPTIONS = ("tf32", "bf16", "fp16", "compile", *ATTENTION_IMPLS)
# Output-layer widths for the GEMM microbenchmark: GPT-2's 50257 (odd), nearby multiples of
# 2..16, 50304 (= 128 * 393) and a few wider multiples of 64 and 128.
GEMM_VOCABS = (50257, 50258, 50260, 50264, 50272, 50280, 50288, 50296, 50304, 50368, 50432, 51200)
NAIVE_RANGES = ("attention scores", "softmax", "final matmul")  # record_function names in gpt.py
# The speed ladder: (rung, change on top of the previous rung, runs on the CPU?). TF32 is a
# tensor-core mode with no CPU equivalent; Inductor's CPU compile takes about a minute, longer
# than the whole CPU ladder, so that rung is left to the GPU too.
LADDER = (("fp32, naive attention, vocab 50257", {}, True),
          ("+ TF32 matmuls", {"tf32": True}, False),
          ("+ bf16 autocast", {"dtype": torch.bfloat16}, True),
          ("+ SDPA flash attention", {"attn": "flash"}, True),
          ("+ vocab 50304", {"vocab": 50304}, True),
          ("+ torch.compile", {"compile": True}, False))


# --- 1. command line and what a "variant" is


def parse_ints(text, flag, minimum):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        fail(f"{flag} takes integers separated by commas, got '{text}'")
    if any(v < minimum for v in values):
        fail(f"{flag} must be at least {minimum}, got '{text}'")
    return values


def base_variant(args, vocab):
    """The settings one measurement runs with; --compare adds options on top of these."""
    try:
        dtype = amp_dtype(args.bf16, args.fp16)
    except ValueError as e:
        fail(str(e))
    return {"tf32": args.tf32, "dtype": dtype, "attn": args.attn, "compile": args.compile, "vocab": vocab}


def add_option(variant, option):
    """The variant with one --compare option switched on (bf16, fp16, tf32, compile or an attn)."""
    if option in ("bf16", "fp16"):
        return {**variant, "dtype": torch.bfloat16 if option == "bf16" else torch.float16}
    if option in ("tf32", "compile"):
        return {**variant, option: True}
    return {**variant, "attn": option}


def describe(variant):
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(variant["dtype"])
    parts = ([dtype] if dtype else []) + (["tf32"] if variant["tf32"] else [])
    words = ["+".join(parts) or "fp32", variant["attn"]]  # fp32, tf32, bf16, bf16+tf32, ...
    if variant["compile"]:
        words.append("compiled")
    return " ".join(words) + f" V={variant['vocab']}"


def model_configs(args, cpu):
    """[(name, GPTConfig)] for --model or the explicit --d-model/--layers/--heads/--d-ff."""
    dims = (args.d_model, args.layers, args.heads)
    if any(d is not None for d in dims):
        if None in dims:
            fail("a custom model needs all of --d-model, --layers and --heads (--d-ff defaults to 4x)")
        if min(dims) < 1 or (args.d_ff is not None and args.d_ff < 1):
            fail("--d-model, --layers, --heads and --d-ff must be positive")
        config = GPTConfig(args.layers, args.heads, args.d_model, args.d_ff or 4 * args.d_model)
        try:
            check_config(config)
        except ValueError as e:
            fail(str(e))
        return [(f"d{args.d_model}L{args.layers}", config)]
    names = (args.model or ("tiny" if cpu else "small")).split(",")
    try:
        return [(name, make_config(name)) for name in names]
    except ValueError as e:
        fail(str(e))


def check_sizes(configs, vocabs, seqs):
    for name, config in configs:
        for vocab in vocabs:
            try:
                check_config(replace(config, vocab_size=vocab))
            except ValueError as e:
                fail(str(e))
        if max(seqs) > config.block_size:
            fail(f"--seq {max(seqs)} is above the block size {config.block_size} of model {name}")


# --- 2. one step of forward / forward+backward / train, and timing it


def phase(name, nvtx):
    """An NVTX range for Nsight Systems (--nvtx), otherwise nothing."""
    return torch.cuda.nvtx.range(name) if nvtx else nullcontext()


def run_step(mode, bench, x, y, nvtx):
    """The forward runs with autograd on, as in training: it records the graph and keeps the
    activations backward needs, which is most of a training step's memory."""
    with phase("forward", nvtx), autocast(x.device, bench["dtype"]):
        _, loss = bench["runner"](x, y)
    if mode != "forward":
        with phase("backward", nvtx):
            bench["scaler"].scale(loss).backward()  # fp16 only: scale so small grads survive
    if mode == "train":
        with phase("optimizer", nvtx):
            bench["scaler"].step(bench["optimizer"])
            bench["scaler"].update()
    bench["model"].zero_grad(set_to_none=True)


def time_steps(mode, bench, x, y, warmup, steps, nvtx):
    """Per-step times in ms and the peak allocated bytes (None on CPU). CUDA events are recorded
    around every step without synchronizing in between, so the CPU queues work ahead as in real
    training; one synchronize at the end waits for all of it before the events are read."""
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(x.device)
    with phase("warm-up", nvtx):
        for _ in range(warmup):
            run_step(mode, bench, x, y, nvtx)
    synchronize(x.device)
    if not cuda:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            run_step(mode, bench, x, y, nvtx)
            times.append((time.perf_counter() - start) * 1e3)
        return times, None
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        run_step(mode, bench, x, y, nvtx)
        end.record()
    synchronize(x.device)
    return [start.elapsed_time(end) for start, end in events], torch.cuda.max_memory_allocated(x.device)


def build(config, variant, device):
    """A fresh model (same seed every time), its runner (compiled or not) and optimizer."""
    set_tf32(variant["tf32"])
    config = replace(config, vocab_size=variant["vocab"], attn=variant["attn"])
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: a 2.7B model takes minutes on the CPU
        model = GPT(config)
    runner = model
    if variant["compile"]:
        torch._dynamo.reset()  # compile from scratch, so warm-up really includes compilation
        runner = torch.compile(model, dynamic=False)  # one graph per shape, no dynamic kernels
    return {"model": model, "runner": runner, "dtype": variant["dtype"], "config": config,
            "optimizer": configure_optimizer(model, lr=1e-4),
            "scaler": torch.amp.GradScaler(device.type, enabled=variant["dtype"] == torch.float16)}


def measure(bench, mode, batch, seq, warmup, steps, device, nvtx):
    """A result dict for one configuration, or None if it ran out of GPU memory."""
    try:
        g = torch.Generator(device="cpu").manual_seed(1)
        x, y = torch.randint(0, 50257, (2, batch, seq), generator=g).to(device)
        times, peak = time_steps(mode, bench, x, y, warmup, steps, nvtx)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        times = None
    bench["model"].zero_grad(set_to_none=True)
    free_memory()  # outside the except block, where the traceback no longer pins tensors
    if times is None:
        return None
    mean, std = mean_std(times)
    tokens_per_s = batch * seq / (mean / 1e3)
    flops = flops_per_token(bench["config"], seq) * MODE_FLOP_SHARE[mode] * tokens_per_s
    return {"mean": mean, "std": std, "first": times[0], "max": max(times), "tok/s": tokens_per_s,
            "mfu": mfu(flops, device), "peak": peak}


# --- 3. the sweep table (with --compare speedups and the --warmup study)


def fmt_mfu(value):
    return "n/a" if value is None else f"{100 * value:.1f}%"


def fmt_peak(value):
    return "n/a" if value is None else gib(value)


def try_build(config, variant, device):
    try:
        return build(config, variant, device)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
    free_memory()
    return None


def run_sweep(args, configs, vocabs, batches, seqs, modes, warmups, variants, device):
    """Rows sorted so that the variants of one configuration sit together. A model is built
    once per (model, vocab, warm-up, variant) and reused for every batch, context and mode, so
    in a warm-up study every setting starts from a fresh model (and a fresh compile)."""
    rows = []
    for (mi, (name, config)), (vi, vocab), (wi, warmup) in product(enumerate(configs), enumerate(vocabs),
                                                                   enumerate(warmups)):
        for ci, variant in enumerate(variants(vocab)):
            label = f"{name} {describe(variant)}"
            bench = try_build(config, variant, device)
            params = bench and bench["model"].num_params()
            for (bi, batch), (si, seq), (oi, mode) in product(enumerate(batches), enumerate(seqs), enumerate(modes)):
                result = bench and measure(bench, mode, batch, seq, warmup, args.steps, device, args.nvtx)
                shown = "OOM" if result is None else f"{result['mean']:.2f} ms"
                print(f"  {label} B={batch} T={seq} {mode} warm-up {warmup}: {shown}", file=sys.stderr, flush=True)
                rows.append({"key": (mi, vi, wi, bi, si, oi), "variant": ci, "label": label, "params": params,
                             "batch": batch, "seq": seq, "mode": mode, "warmup": warmup, "result": result})
            del bench
            free_memory()
    rows.sort(key=lambda r: (r["key"], r["variant"]))
    return rows


def print_sweep(rows, steps, study, compare):
    base = {r["key"]: r["result"] for r in rows if r["variant"] == 0}
    headers = ["config", "params (M)", "batch", "seq", "mode"]
    headers += ["warm-up"] if study else []
    headers += [f"ms (mean ± std, {steps} steps)"]
    headers += ["first ms", "max ms"] if study else []
    headers += ["tokens/s", "MFU", "peak alloc (GiB)"]
    headers += ["speedup vs first config"] if compare else []
    table = []
    for r in rows:
        res = r["result"]
        row = [r["label"], "OOM" if r["params"] is None else f"{r['params'] / 1e6:.1f}", r["batch"], r["seq"], r["mode"]]
        row += [r["warmup"]] if study else []
        if res is None:
            row += ["OOM"] + (["OOM", "OOM"] if study else []) + ["OOM", "n/a", "OOM"]
        else:
            row += [f"{res['mean']:.2f} ± {res['std']:.2f}"]
            row += [f"{res['first']:.2f}", f"{res['max']:.2f}"] if study else []
            row += [f"{res['tok/s']:,.0f}", fmt_mfu(res["mfu"]), fmt_peak(res["peak"])]
        if compare:
            ref = base.get(r["key"])
            row.append("n/a" if res is None or ref is None else f"{ref['mean'] / res['mean']:.2f}x")
        table.append(row)
    print_table(headers, table)


def sweep_summary(rows, compare):
    done = [r for r in rows if r["result"] is not None]
    ooms = len(rows) - len(done)
    if not done:
        return f"every one of {len(rows)} configurations ran out of memory"
    if compare:
        base = {r["key"]: r["result"] for r in rows if r["variant"] == 0}
        last = max(r["variant"] for r in rows)
        pairs = [(base[r["key"]]["mean"], r["result"]["mean"]) for r in done
                 if r["variant"] == last and base.get(r["key"])]
        if pairs:
            geo = math.exp(statistics.fmean(math.log(b / v) for b, v in pairs))
            label = next(r["label"] for r in done if r["variant"] == last)
            return (f"'{label.split(' ', 1)[1]}' is {geo:.2f}x the speed of the first config "
                    f"(geometric mean over {len(pairs)} rows); {ooms} OOM")
    best = max(done, key=lambda r: (MODES.index(r["mode"]), r["result"]["tok/s"]))
    return (f"best {best['mode']} throughput: {best['result']['tok/s']:,.0f} tokens/s ({best['label']}, "
            f"B={best['batch']} T={best['seq']}); {ooms} OOM")


# --- 4. the output layer's GEMM alone: why vocab 50304 beats 50257


def time_ms(fn, device):
    """Mean ms of fn(): triton.testing.do_bench on the GPU (it flushes the L2 cache between
    runs), the median of a few wall-clock runs on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn)
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def gemm_microbench(config, tokens, dtype, device):
    """The three matmuls of the output layer in a training step: logits = x W^T (forward),
    dx = dlogits W and dW = dlogits^T x (backward), for several vocabulary widths. Tensor cores
    read tiles of 8/16/64/128 elements; a width with no such factor (50257 is odd) needs masked
    edge tiles and less efficient kernels for the whole matrix."""
    dtype = dtype or torch.float32
    K, rows = config.n_embd, []
    for V in sorted(set(GEMM_VOCABS)):
        x = torch.randn(tokens, K, device=device, dtype=dtype)
        w = torch.randn(V, K, device=device, dtype=dtype)
        g = torch.randn(tokens, V, device=device, dtype=dtype)
        fwd = time_ms(lambda: x @ w.t(), device)
        bwd = time_ms(lambda: g @ w, device) + time_ms(lambda: g.t() @ x, device)
        rows.append((V, fwd, bwd))
        del x, w, g
        free_memory()
    ref = rows[0][1] + rows[0][2]
    table = [[V, V & -V, f"{fwd:.3f}", f"{bwd:.3f}", f"{6 * tokens * K * V / ((fwd + bwd) / 1e3) / 1e12:.1f}",
              f"{ref / (fwd + bwd):.2f}x"] for V, fwd, bwd in rows]
    print(f"\noutput-layer GEMMs alone: {tokens} tokens x {K} x vocab, {str(dtype).replace('torch.', '')}")
    print_table(["vocab", "largest 2^k factor", "fwd ms", "bwd ms (2 GEMMs)", "TFLOP/s", "vs 50257"], table)


# --- 5. --profile: top kernels, time by category, naive attention's softmax vs matmuls


def kernel_times(prof, cuda):
    """[(name, calls, total us)] by descending time: GPU kernels on CUDA, CPU ops (self time)
    on the CPU. User ranges (record_function, NVTX) are left out: they would count twice."""
    out = []
    for e in prof.key_averages():
        if getattr(e, "is_user_annotation", False) or e.key in NAIVE_RANGES or e.key.startswith("ProfilerStep"):
            continue
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.key, e.count, e.self_device_time_total))
        elif not cuda and e.device_type == torch.autograd.DeviceType.CPU:
            out.append((e.key, e.count, e.self_cpu_time_total))
    return sorted((k for k in out if k[2] > 0), key=lambda k: -k[2])


def category(name):
    n = name.lower()
    if any(s in n for s in ("flash", "fmha", "attention", "sdpa", "attn")):
        return "attention (fused kernels)"
    if any(s in n for s in ("adam", "multi_tensor")):
        return "optimizer"
    if any(s in n for s in ("gemm", "xmma", "nvjet", "cutlass", "matmul", "aten::mm", "aten::addmm",
                            "aten::bmm", "triton_tem", "splitk")):
        return "matmul"
    if any(s in n for s in ("memcpy", "memset", "aten::copy_", "aten::fill_", "aten::zero_")):
        return "copy/fill"
    return "elementwise+norm"


def category_times(prof, cuda):
    """{category: us}. Everything run inside the optimizer's own profiler range
    ("Optimizer.step#AdamW.step") counts as optimizer: on the CPU AdamW is a string of plain
    elementwise ops that a name alone cannot tell apart. On the GPU each op's kernels are the
    ones it launched (including Inductor's, launched from compiled code); kernel time that the
    profiler could not link to a CPU op is shown as "unlinked"."""
    sums = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or e.is_async:
            continue
        parent, in_optimizer = e, False
        while parent is not None and not in_optimizer:
            in_optimizer, parent = parent.name.startswith("Optimizer.step"), parent.cpu_parent
        work = [(k.name, k.duration) for k in e.kernels] if cuda else \
            [(e.name, e.self_cpu_time_total)] if e.name.startswith("aten::") else []
        for name, us in work:
            key = "optimizer" if in_optimizer else category(name)
            sums[key] = sums.get(key, 0.0) + us
    unlinked = sum(k[2] for k in kernel_times(prof, cuda)) - sum(sums.values())
    if cuda and unlinked > 0.01 * sum(sums.values()):
        sums["unlinked"] = unlinked
    return sums


def print_top_kernels(title, kernels, steps, top=10):
    total = sum(k[2] for k in kernels) or 1
    print(f"\n{title}: top {top} of {len(kernels)}, {total / 1e3 / steps:.2f} ms per step in all")
    print_table(["name", "calls/step", "ms/step", "share"],
                [[name[:80], f"{calls / steps:g}", f"{us / 1e3 / steps:.3f}", f"{100 * us / total:.1f}%"]
                 for name, calls, us in kernels[:top]])


def print_categories(profs, steps, cuda):
    fwd, step = category_times(profs["forward"], cuda), category_times(profs["train"], cuda)
    t_fwd, t_step = sum(fwd.values()) or 1, sum(step.values()) or 1
    print("\ntime by category (kernel/op name; optimizer = inside AdamW.step; naive attention's matmuls "
          "count as matmul, its softmax as elementwise)")
    print_table(["category", "forward ms/step", "forward share", "train step ms/step", "train step share"],
                [[c, f"{fwd.get(c, 0) / 1e3 / steps:.3f}", f"{100 * fwd.get(c, 0) / t_fwd:.1f}%",
                  f"{us / 1e3 / steps:.3f}", f"{100 * us / t_step:.1f}%"]
                 for c, us in sorted(step.items(), key=lambda kv: -kv[1])])


def print_naive_attention(prof, config, batch, seq, steps, cuda):
    """Forward only (the ranges in gpt.naive_attention wrap the forward ops). The softmax does
    few FLOPs but reads and writes the whole (T, T) matrix, so its time share far exceeds its
    FLOP share: it is memory-bound while the matmuls run on the tensor cores."""
    times = {}
    for e in prof.key_averages():
        if e.key in NAIVE_RANGES and e.device_type == torch.autograd.DeviceType.CPU:
            times[e.key] = times.get(e.key, 0.0) + (e.device_time_total if cuda else e.cpu_time_total)
    if len(times) < len(NAIVE_RANGES):
        print("\nnaive attention: the record_function ranges were not recorded (compiled model?)")
        return
    scores = config.n_layer * batch * config.n_head * seq * seq  # elements of all score matrices
    head = config.n_embd // config.n_head
    # matmuls: 2 FLOPs per multiply-add; scores also scaled and masked (2 per element);
    # softmax: max, subtract, exp, sum, divide (5 per element)
    flops = {"attention scores": scores * (2 * head + 2), "softmax": 5 * scores, "final matmul": 2 * scores * head}
    t_all, f_all = sum(times.values()) or 1, sum(flops.values())
    print(f"\nnaive attention, forward, all {config.n_layer} layers ({'GPU kernel' if cuda else 'CPU'} time)")
    print_table(["stage", "ms/step", "time share", "GFLOP/step", "FLOP share", "time share / FLOP share"],
                [[k, f"{times[k] / 1e3 / steps:.3f}", f"{100 * times[k] / t_all:.1f}%", f"{flops[k] / 1e9:.3g}",
                  f"{100 * flops[k] / f_all:.2f}%", f"{(times[k] / t_all) / (flops[k] / f_all):.1f}"]
                 for k in NAIVE_RANGES])


def profile(config, variant, batch, seq, warmup, steps, device, trace):
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = device.type == "cuda"
    what = "GPU kernel time" if cuda else "CPU time of each op (no GPU here: CPU ops, not kernels)"
    print(f"\nprofile of {describe(variant)} B={batch} T={seq}, {steps} steps each: {what}")
    bench = build(config, variant, device)
    x, y = torch.randint(0, 50257, (2, batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(max(warmup, 1)):  # compile, allocate and tune before anything is recorded
        run_step("train", bench, x, y, False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profs = {}
    for mode in ("forward", "train"):
        with torch_profile(activities=activities) as profs[mode]:
            for _ in range(steps):
                run_step(mode, bench, x, y, False)
            synchronize(device)
    fwd, step = kernel_times(profs["forward"], cuda), kernel_times(profs["train"], cuda)
    kind = "kernels" if cuda else "CPU ops"
    print_top_kernels(f"forward {kind}", fwd, steps)
    print_top_kernels(f"train step {kind} (forward, backward, AdamW)", step, steps)
    print_categories(profs, steps, cuda)
    if bench["config"].attn == "naive":
        print_naive_attention(profs["forward"], bench["config"], batch, seq, steps, cuda)
    if trace:
        profs["train"].export_chrome_trace(trace)
        print(f"\nwrote the train-step trace to {trace} (open it in ui.perfetto.dev or chrome://tracing)")


# --- 6. the speed ladder


def run_ladder(config, batch, seq, warmup, steps, device, nvtx):
    variant = {"tf32": False, "dtype": None, "attn": "naive", "compile": False, "vocab": 50257}
    table, first, prev = [], None, None
    for name, change, on_cpu in LADDER:
        variant = {**variant, **change}
        if not on_cpu and device.type != "cuda":
            print(f"  {name}: skipped on the CPU", file=sys.stderr, flush=True)
            table.append([name, "skipped on CPU (GPU rung)", "-", "-", "-", "-", "-"])
            continue
        bench = try_build(config, variant, device)
        res = bench and measure(bench, "train", batch, seq, warmup, steps, device, nvtx)
        del bench
        free_memory()
        shown = "OOM" if res is None else f"{res['mean']:.1f} ms"
        print(f"  {name}: {shown}", file=sys.stderr, flush=True)
        if res is None:
            table.append([name, "OOM", "OOM", "n/a", "n/a", "n/a", "OOM"])
            continue
        first = first or res
        table.append([name, f"{res['mean']:.1f} ± {res['std']:.1f}", f"{res['tok/s']:,.0f}",
                      "-" if prev is None else f"{prev['mean'] / res['mean']:.2f}x",
                      f"{first['mean'] / res['mean']:.2f}x", fmt_mfu(res["mfu"]), fmt_peak(res["peak"])])
        prev = res
    print_table([f"rung (train step, B={batch} T={seq})", f"ms/step (mean ± std, {steps} steps)", "tokens/s",
                 "vs previous", "vs fp32", "MFU", "peak alloc (GiB)"], table)
    if first is None:
        return "ladder: no rung ran"
    return (f"ladder: {first['mean']:.1f} ms -> {prev['mean']:.1f} ms per step, "
            f"speedup over fp32 {first['mean'] / prev['mean']:.2f}x ({prev['tok/s']:,.0f} tokens/s)")


# --- 7. main


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"comma list of presets: {', '.join(PRESETS)} (default small; CPU: tiny)")
    p.add_argument("--d-model", type=int, help="custom model width (with --layers, --heads)")
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--d-ff", type=int, help="custom MLP width (default 4 x d-model)")
    p.add_argument("--batch", help="comma list (default 8; ladder 16; CPU: 2)")
    p.add_argument("--seq", help="comma list of context lengths (default 512; ladder 1024; CPU: 64)")
    p.add_argument("--mode", default="all", choices=(*MODES, "all"))
    p.add_argument("--warmup", help="untimed steps; a comma list is a warm-up study (default 3; CPU: 1)")
    p.add_argument("--steps", type=int, help="timed steps (default 10; CPU: 3)")
    p.add_argument("--tf32", action="store_true", help="TF32 tensor cores for fp32 matmuls")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--fp16", action="store_true", help="fp16 autocast with a GradScaler")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--attn", default="sdpa", choices=ATTENTION_IMPLS)
    p.add_argument("--vocab", default="50257", help="comma list; two or more add the output-GEMM microbenchmark")
    p.add_argument("--compare", help="comma list of options added one after another to the flags given "
                   f"({', '.join(COMPARE_OPTIONS)}); each row gets a speedup over the flags alone")
    p.add_argument("--ladder", action="store_true", help="only the GPT-2 speed ladder (train steps)")
    p.add_argument("--profile", action="store_true", help="torch.profiler view of the first configuration")
    p.add_argument("--trace", help="write the profiled train steps as a Chrome/Perfetto trace (implies --profile)")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges for Nsight Systems (CUDA only)")
    p.add_argument("--memory-fraction", type=float, help="cap this process's share of GPU memory")
    p.add_argument("--device", help="cuda or cpu (default: cuda if present)")
    args = p.parse_args()

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        fail(str(e))
    cpu = device.type != "cuda"
    if cpu and (args.nvtx or args.memory_fraction is not None):
        fail("--nvtx and --memory-fraction need a CUDA GPU")
    if args.memory_fraction is not None:
        if not 0 < args.memory_fraction <= 1:
            fail(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device)
    if args.steps is not None and args.steps < 1:
        fail(f"--steps must be at least 1, got {args.steps}")
    configs = model_configs(args, cpu)
    if args.ladder and args.model is None and not cpu:
        configs = [("gpt2", make_config("gpt2"))]
    batches = parse_ints(args.batch or ("2" if cpu else "16" if args.ladder else "8"), "--batch", 1)
    seqs = parse_ints(args.seq or ("64" if cpu else "1024" if args.ladder else "512"), "--seq", 1)
    warmups = parse_ints(args.warmup or ("1" if cpu else "3"), "--warmup", 0)
    vocabs = parse_ints(args.vocab, "--vocab", 1)
    args.steps = args.steps or (3 if cpu else 10)
    check_sizes(configs, vocabs + ([50304] if args.ladder else []), seqs)
    options = args.compare.split(",") if args.compare else []
    if unknown := [o for o in options if o not in COMPARE_OPTIONS]:
        fail(f"unknown --compare option '{unknown[0]}'; choose from {', '.join(COMPARE_OPTIONS)}")
    base_variant(args, vocabs[0])  # --bf16 with --fp16 fails here, before anything runs

    peak = gpu_peak_flops(device)
    if cpu:
        print(f"device: CPU (no CUDA GPU), torch {torch.__version__}: small sizes that finish in seconds; "
              "CPU numbers show the method, not GPU performance, and MFU/memory are n/a")
    else:
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, bf16 peak "
              f"{'unknown (MFU n/a)' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}")

    if args.ladder:
        name, config = configs[0]
        print(f"speed ladder: {name}, B={batches[0]} T={seqs[0]}, {warmups[0]} warm-up + {args.steps} timed train steps")
        print("\n" + run_ladder(config, batches[0], seqs[0], warmups[0], args.steps, device, args.nvtx))
        return

    def variants(vocab):
        out = [base_variant(args, vocab)]
        for option in options:
            out.append(add_option(out[-1], option))
        return out

    modes = MODES if args.mode == "all" else (args.mode,)
    speedup = "; speedup = the first config's ms / this row's ms, same shape and mode" if options else ""
    print(f"timing {', '.join(modes)}: {args.steps} timed steps after the warm-up, mean ± sample std{speedup}")
    rows = run_sweep(args, configs, vocabs, batches, seqs, modes, warmups, variants, device)
    print_sweep(rows, args.steps, len(warmups) > 1, bool(options))
    if len(vocabs) > 1:
        set_tf32(args.tf32)
        gemm_microbench(configs[0][1], batches[0] * seqs[0], base_variant(args, vocabs[0])["dtype"], device)
    if args.profile or args.trace:
        profile(configs[0][1], base_variant(args, vocabs[0]), batches[0], seqs[0], warmups[0], args.steps,
                device, args.trace)
    print("\n" + sweep_summary(rows, bool(options)))


if __name__ == "__main__":
    main()
