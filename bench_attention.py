"""Attention implementations side by side: time, memory, and where each one breaks.

Naive attention materialises the S x S score and probability matrices for every batch element
and head, and autograd keeps the probabilities for backward, so its memory grows as S^2 and long
sequences run out of memory; fused kernels (SDPA's flash / cuDNN / mem-efficient backends, our
Triton kernel) keep only O(S) statistics and recompute the rest in backward. This script measures
both the time and the memory, and checks the S^2 arithmetic against the allocator.

    python bench_attention.py                          # batch 8, 1 head, D 16..128 x S 256..16384, bf16
    python bench_attention.py --dtype fp32 --causal    # the same sweep in fp32, causal
    python bench_attention.py --impl naive,flash --d 64 --seq 1024,4096
    python bench_attention.py --memory-fraction 0.05   # cap the GPU memory to see OOM cells
    python bench_attention.py --suite flash --d 64     # batch 1, causal, S 128..65536, do_bench, TFLOP/s

Implementations: naive (eager PyTorch), compiled (the same function under torch.compile, one graph
per head dim with the sequence length dynamic; a cell is marked * where the profiler saw that
Inductor replaced the function with an SDPA kernel), flash / cudnn / efficient / math (SDPA
pinned to one backend, so a backend that cannot run the input is n/a instead of silently falling
back), triton (flash_attention from flash_triton.py). On a CPU the defaults shrink to a tiny
sweep that finishes in seconds.

Output excerpt (NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-22; `--steps 30`, D=64 rows of the forward table):

    forward, ms (mean ± std of 30)
    D    S      naive        compiled      flash        cudnn        efficient    math          triton
    ---  -----  -----------  ------------  -----------  -----------  -----------  ------------  -----------
    64     256  0.250±0.057  0.289±0.082*  0.153±0.030  0.179±0.030  0.125±0.024   0.507±0.061  0.205±0.058
    64    1024  0.226±0.054  0.335±0.080*  0.165±0.028  0.176±0.032  0.083±0.016   0.573±0.077  0.105±0.024
    64    4096  0.810±0.015  0.425±0.037*  0.141±0.024  0.148±0.022  0.283±0.031   2.408±0.062  0.181±0.024
    64    8192  3.580±0.038  0.847±0.807*  0.458±0.024  0.296±0.028  1.098±0.027  10.026±0.086  0.311±0.048
    64   16384  9.860±0.059  1.145±0.064*  1.789±0.038  1.142±0.038  4.172±0.046  37.320±0.397  1.192±0.055
"""

import argparse
import math
import os
import re
import statistics
import time

import torch
import torch.nn.functional as F

from gpt import (SDPA_BACKENDS, fail, free_memory, gib, is_oom, mean_std, print_table, resolve_device,
                 synchronize)

IMPLS = ("naive", "compiled", *SDPA_BACKENDS, "triton")
SUITE_IMPLS = ("triton", "naive", *SDPA_BACKENDS)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GPU_SWEEP = dict(batch=8, heads=1, d=[16, 32, 64, 128], seq=[256, 1024, 4096, 8192, 16384], steps=100, warmup=10)
CPU_SWEEP = dict(batch=2, heads=1, d=[16, 32], seq=[64, 128], steps=3, warmup=1)
GPU_SUITE = dict(batch=1, heads=1, d=[16, 32, 64, 128], seq=[2**i for i in range(7, 17)])
CPU_SUITE = dict(batch=1, heads=1, d=[16, 32], seq=[128, 256])
MIB = 2**20

# --- 1. the implementations


def naive_attention(q, k, v, causal=False):
    """Attention written out, on (..., S, D) tensors. gpt.naive_attention is always causal; the
    classic exercise is not, so this one takes a flag. The scale is a Python float on purpose:
    multiplying by a number saves nothing for backward (the gradient is just grad * scale)."""
    S = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    if causal:
        future = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(dim=-1) @ v


def sdpa_backend(name, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[name])

    def run(q, k, v):
        # Pinned to one backend: if it cannot take these inputs SDPA raises ("No available
        # kernel") instead of quietly running another backend under this column's name.
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def triton_attention(causal, device):
    """flash_attention from flash_triton.py, or a string saying why it cannot run here."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "needs CUDA (or TRITON_INTERPRET=1)"
    try:
        from flash_triton import flash_attention
    except Exception as e:  # a missing file or a kernel module that does not import: no column
        return f"unavailable: flash_triton.py does not import ({type(e).__name__}: {e})"
    return lambda q, k, v: flash_attention(q, k, v, causal=causal)


def make_impls(names, causal, device):
    """name -> callable(q, k, v), or name -> reason string when it cannot run on this machine."""
    impls = {}
    for name in names:
        if name == "naive":
            impls[name] = lambda q, k, v: naive_attention(q, k, v, causal)
        elif name == "compiled":
            # One graph per head dim, with the sequence length symbolic: a compile per (D, S)
            # would cost more GPU time than the measurements. D must stay static (automatic
            # dynamic shapes would make it symbolic on the first recompile): the scale 1/sqrt(D)
            # would then be a symbol and Inductor's SDPA pattern stops matching.
            config = torch._dynamo.config
            config.automatic_dynamic_shapes = False
            setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", 64)
            compiled = torch.compile(naive_attention)
            impls[name] = lambda q, k, v: compiled(*seq_dynamic(q, k, v), causal)
        elif name == "triton":
            impls[name] = triton_attention(causal, device)
        elif device.type != "cuda" and name in ("cudnn", "efficient"):
            impls[name] = "needs CUDA"
        else:
            impls[name] = sdpa_backend(name, causal)  # flash and math also have CPU kernels
    return impls


def seq_dynamic(*tensors):
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)  # the sequence dimension
    return tensors


def random_qkv(B, H, S, D, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, dout = (torch.randn(B, H, S, D, dtype=dtype, device=device, generator=gen) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


# --- 2. what naive attention keeps for backward, predicted and measured


def naive_saved_bytes(B, H, S, D, dtype, causal):
    """Bytes autograd saves for backward in naive_attention, from the shapes alone.
    q @ k^T saves q and k (views, no copies); `* scale` by a Python float saves nothing;
    masked_fill saves only its bool S x S mask (one per call, broadcast over B and H);
    softmax saves its *output* (its backward needs only the probabilities), and probs @ v saves
    the same probabilities plus v. So the raw and scaled scores are never saved: one B*H*S*S
    matrix, not two, is what stays alive from forward to backward."""
    e = dtype.itemsize
    return 3 * B * H * S * D * e + B * H * S * S * e + (S * S if causal else 0)


def measure_saved_bytes(fn, *inputs):
    """Bytes of the tensors autograd saves while fn(*inputs) runs, counted once per storage (the
    same probabilities are saved by softmax and by the matmul; views of q share q's storage)."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[(storage.data_ptr(), str(t.device))] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    return sum(storages.values())


def naive_peak_bytes(B, H, S, D, dtype, causal):
    """Allocated bytes above the inputs at naive attention's high-water mark, which is in
    backward: the saved probabilities, their gradient (dout @ v^T), the softmax backward's output
    (the score gradient) and that gradient times the scale (the mul's backward makes a new
    tensor) are four B*H*S*S tensors alive at once, plus the output, dv and the mask. Four is
    what the H100 sweep measured (non-causal); with three, the prediction fell short by one S*S
    matrix. (Forward peaks at two: scores and probabilities.)"""
    e = dtype.itemsize
    return 4 * B * H * S * S * e + 2 * B * H * S * D * e + (S * S if causal else 0)


# --- 3. measuring one configuration: time (CUDA events) and memory (allocator)


def time_ms(run, steps, device, setup=lambda: None):
    """Mean and std in ms of run(setup()) over `steps` calls; setup is not timed. On CUDA each
    call is bracketed by events and we synchronize once at the end, so the host never waits in
    between and the events measure GPU time only."""
    times = []
    if device.type == "cuda":
        pairs = []
        for _ in range(steps):
            arg = setup()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(arg)
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in pairs]
    else:
        for _ in range(steps):
            arg = setup()
            t0 = time.perf_counter()
            run(arg)
            times.append((time.perf_counter() - t0) * 1e3)
    return mean_std(times)


def clear_grads(*tensors):
    for t in tensors:
        t.grad = None  # None, not zero: otherwise backward adds into the old gradient (extra kernel)


SDPA_KERNEL = re.compile(r"scaled_dot_product|flash|fmha|efficient_attention|cudnn", re.IGNORECASE)


def sdpa_ops_in(fn, q, k, v, dout):
    """Names of SDPA ops that ran in one forward+backward of fn. Inductor's pattern matcher can
    rewrite matmul-softmax-matmul into an SDPA call; the profiler shows what really ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(q, k, v).backward(dout)
        synchronize(q.device)
    clear_grads(q, k, v)
    return sorted({e.name for e in prof.events() if SDPA_KERNEL.search(e.name)})


def measure(fn, impl, B, H, S, D, dtype, device, steps, warmup):
    """Time 'steps' forwards and 'steps' backwards, and the memory around one backward."""
    q, k, v, dout = random_qkv(B, H, S, D, dtype, device)
    for _ in range(max(1, warmup)):  # at least one: torch.compile compiles on its first call
        fn(q, k, v).backward(dout)
    clear_grads(q, k, v)
    result = {}
    if device.type == "cuda":
        synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn(q, k, v)
        result["before"] = torch.cuda.memory_allocated(device)  # inputs + output + saved tensors
        out.backward(dout)
        synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device)
        result["residue"] = result["before"] - baseline  # what forward left alive
        result["baseline"] = baseline
        del out
        clear_grads(q, k, v)
    if impl == "compiled":
        result["sdpa_ops"] = sdpa_ops_in(fn, q, k, v, dout)
    result["fwd"] = time_ms(lambda _: fn(q, k, v), steps, device)

    def fresh_forward():  # each backward needs its own graph; building it is not timed
        clear_grads(q, k, v)
        return fn(q, k, v)

    result["bwd"] = time_ms(lambda out: out.backward(dout), steps, device, fresh_forward)
    return result




def guarded(work, device):
    """work() or "OOM" or ("n/a", reason). The exception is dropped before memory is freed:
    its traceback holds the frames, and the frames hold the tensors."""
    try:
        cell = work()
    except Exception as e:
        cell = "OOM" if is_oom(e) else ("n/a", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:150]}")
    free_memory()
    return cell


# --- 4. the default sweep: tables of time and memory


def fmt_cell(cell, show):
    if cell == "OOM" or cell == "skip":
        return cell
    if isinstance(cell, tuple):
        return "n/a"
    return show(cell)


def run_sweep(args, impls, device, dtype):
    results, notes = {}, {}
    configs = [(D, S) for D in args.d for S in args.seq]
    for i, (D, S) in enumerate(configs, 1):
        row = {}
        for name, fn in impls.items():
            if isinstance(fn, str):
                row[name] = ("n/a", fn)
            else:
                row[name] = guarded(lambda: measure(fn, name, args.batch, args.heads, S, D, dtype, device,
                                                    args.steps, args.warmup), device)
            if isinstance(row[name], tuple):
                notes.setdefault(name, row[name][1])
        results[(D, S)] = row
        states = ", ".join(f"{n} {c if isinstance(c, str) else 'n/a' if isinstance(c, tuple) else 'ok'}"
                           for n, c in row.items())
        print(f"[{i}/{len(configs)}] D={D} S={S}: {states}", flush=True)
    return results, notes


def rewritten(cell):
    return isinstance(cell, dict) and bool(cell.get("sdpa_ops"))


def print_sweep(results, notes, impls, device, steps):
    names = list(impls)
    star = lambda cell, text: text + ("*" if rewritten(cell) else "")
    tables = [(f"forward, ms (mean ± std of {steps})", lambda c: star(c, f"{c['fwd'][0]:.3f}±{c['fwd'][1]:.3f}")),
              (f"backward, ms (mean ± std of {steps})", lambda c: star(c, f"{c['bwd'][0]:.3f}±{c['bwd'][1]:.3f}"))]
    if device.type == "cuda":
        tables.append(("memory allocated just before backward / peak during forward+backward, MiB",
                       lambda c: star(c, f"{c['before'] / MIB:.0f} / {c['peak'] / MIB:.0f}")))
    for title, show in tables:
        print(f"\n{title}")
        print_table(["D", "S", *names], [[D, S, *(fmt_cell(row[n], show) for n in names)]
                                        for (D, S), row in results.items()])
    for name, reason in notes.items():
        print(f"n/a {name}: {reason}")
    cells = [row["compiled"] for row in results.values() if isinstance(row.get("compiled"), dict)]
    if cells:
        ops = sorted({op for cell in cells for op in cell["sdpa_ops"]})
        if ops:
            print(f"* compiled: Inductor rewrote the naive attention into SDPA in {sum(map(rewritten, cells))} of"
                  f" {len(cells)} configurations; the profiler saw {', '.join(ops)}")
        else:
            print("compiled: no SDPA op in the profile of any configuration: Inductor kept matmul, fused softmax, matmul")


# --- 5. memory accounting for naive attention: prediction vs measurement, and where it breaks


def print_memory_accounting(results, args, dtype, device):
    print(f"\nnaive attention memory, MiB, B={args.batch} H={args.heads} {args.dtype}{' causal' if args.causal else ''}")
    rows, prev = [], {}
    for (D, S), row in results.items():
        saved = naive_saved_bytes(args.batch, args.heads, S, D, dtype, args.causal)
        hooked = guarded(lambda: measure_saved_bytes(lambda q, k, v: naive_attention(q, k, v, args.causal),
                                                     *random_qkv(args.batch, args.heads, S, D, dtype, device)[:3]),
                         device)
        out_bytes = args.batch * args.heads * S * D * dtype.itemsize
        cells = [D, S, f"{saved / MIB:.2f}", fmt_cell(hooked, lambda b: f"{b / MIB:.2f}")]
        cell = row.get("naive")
        if device.type == "cuda":
            residue = saved - 2 * out_bytes  # q, k, v existed before; the output is new
            peak = naive_peak_bytes(args.batch, args.heads, S, D, dtype, args.causal)
            cells += [f"{residue / MIB:.2f}", fmt_cell(cell, lambda c: f"{c['residue'] / MIB:.2f}"),
                      fmt_cell(cell, lambda c: f"{S * S / prev[D][0] ** 2:.0f}x / {c['residue'] / prev[D][1]:.1f}x"
                               if D in prev else "-"),
                      f"{peak / MIB:.0f}", fmt_cell(cell, lambda c: f"{(c['peak'] - c['baseline']) / MIB:.0f}")]
            if isinstance(cell, dict):
                prev[D] = (S, cell["residue"])
        rows.append(cells)
    headers = ["D", "S", "saved pred", "saved hooks"]
    if device.type == "cuda":
        headers += ["residue pred", "residue meas", "growth S² / meas", "peak-base pred", "peak-base meas"]
    print_table(headers, rows)
    print("saved: bytes autograd keeps for backward, predicted from the shapes (q, k, v, one B·H·S² probability"
          " matrix, the causal mask) vs counted by saved_tensors_hooks, once per storage")
    if device.type == "cuda":
        print("residue: allocated after forward - before forward (predicted: saved - q,k,v + output); the growth"
              " column sets it against S² from the row above; peak-base: peak - allocated before forward")
        print_first_oom(results, args, dtype, device)


def print_first_oom(results, args, dtype, device):
    """Work out, from the total GPU memory, the shortest power-of-two sequence at which naive
    attention cannot fit, for the smallest head dimension of the sweep."""
    total = torch.cuda.get_device_properties(device).total_memory * (args.memory_fraction or 1.0)
    B, H, D, e = args.batch, args.heads, min(args.d), dtype.itemsize
    need = lambda S: 4 * B * H * S * D * e + naive_peak_bytes(B, H, S, D, dtype, args.causal)  # + q,k,v,dout
    S = 128
    while need(S) <= total:
        S *= 2
    print(f"first naive OOM, worked through: {torch.cuda.get_device_name(device)} has {gib(total)} GiB"
          f"{' under --memory-fraction' if args.memory_fraction else ''}. At B={B} H={H} D={D} S={S} one B·H·S²"
          f" {args.dtype} matrix is {B}·{H}·{S}²·{e} B = {gib(B * H * S * S * e)} GiB; backward holds four at once"
          f" (probs, dprobs, dscores, dscores·scale) plus q,k,v,dout,out,dv: {gib(need(S))} GiB > {gib(total)} GiB."
          f" S={S // 2} needs {gib(need(S // 2))} GiB and fits: half the length, a quarter of the memory.")
    measured = [(D_, S_) for (D_, S_), row in results.items() if row.get("naive") == "OOM"]
    print(f"measured: naive ran out of memory at {', '.join(f'D={d} S={s}' for d, s in measured)}" if measured
          else "measured: naive did not run out of memory in this sweep")


# --- 6. --suite flash: latency and TFLOP/s with triton.testing.do_bench


def attention_flops(B, H, S, D, causal):
    """FlashAttention's convention: forward 4·B·H·S²·D (two matmuls), halved when causal; the
    backward counts 2.5x the forward (five matmuls, one recomputed)."""
    return 4 * B * H * S * S * D / (2 if causal else 1)


def bench_ms(fn, device, grads):
    """Median ms. do_bench warms up, flushes L2 between calls and syncs; on a CPU there is no
    CUDA to sync, so a plain perf_counter median."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, grad_to_none=grads, return_mode="median")
    fn()
    times = []
    for _ in range(5):
        clear_grads(*grads)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_suite_config(fn, B, H, S, D, dtype, device):
    q, k, v, dout = random_qkv(B, H, S, D, dtype, device)
    fwd = bench_ms(lambda: fn(q, k, v), device, [q, k, v])
    out = fn(q, k, v)
    bwd = bench_ms(lambda: out.backward(dout, retain_graph=True), device, [q, k, v])
    del out
    both = bench_ms(lambda: fn(q, k, v).backward(dout), device, [q, k, v])
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": both}


def run_suite(args, impls, device, dtypes):
    B, H = args.batch, args.heads
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        results, notes, broke = {}, {}, set()
        for D in args.d:
            for S in args.seq:
                row = {}
                for name, fn in impls.items():
                    if isinstance(fn, str):
                        row[name] = ("n/a", fn)
                    elif (name, D) in broke:
                        row[name] = "skip"  # out of memory at a shorter S already: longer cannot fit
                    else:
                        row[name] = guarded(lambda: bench_suite_config(fn, B, H, S, D, dtype, device), device)
                        if row[name] == "OOM":
                            broke.add((name, D))
                    if isinstance(row[name], tuple):
                        notes.setdefault(name, row[name][1])
                results[(D, S)] = row
                print(f"{dtype_name} D={D} S={S}: " + ", ".join(
                    f"{n} {c if isinstance(c, str) else 'n/a' if isinstance(c, tuple) else 'ok'}" for n, c in row.items()),
                    flush=True)
        for mode, factor in (("fwd", 1.0), ("bwd", 2.5), ("fwd+bwd", 3.5)):
            print(f"\n{dtype_name} {mode}, B={B} H={H} causal: median ms (TFLOP/s, FA convention)")
            show = lambda c, D, S: f"{c[mode]:.3f} ({factor * attention_flops(B, H, S, D, True) / c[mode] / 1e9:.3g})"
            print_table(["D", "S", *impls], [[D, S, *(fmt_cell(row[n], lambda c: show(c, D, S)) for n in impls)]
                                             for (D, S), row in results.items()])
        for name, reason in notes.items():
            print(f"n/a {name}: {reason}")
        print("skip: out of memory at a shorter sequence. TFLOP/s counts causal work (halved) for every impl: naive"
              " and math compute the full S x S, so they show at most half their matmul rate.")
        yield dtype_name, results


# --- 7. main


def parse_list(text, flag):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"{flag} takes comma-separated integers, got '{text}'")
    if not values or min(values) < 1:
        fail(f"{flag} values must be positive integers, got '{text}'")
    return values


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=["sweep", "flash"], default="sweep")
    parser.add_argument("--impl", help=f"comma-separated, from {','.join(IMPLS)}")
    parser.add_argument("--d", help="head dimensions, comma-separated")
    parser.add_argument("--seq", help="sequence lengths, comma-separated")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--dtype", choices=list(DTYPES), help="sweep default bf16; suite default bf16 and fp32")
    parser.add_argument("--causal", action="store_true", help="causal mask (the flash suite is always causal)")
    parser.add_argument("--steps", type=int, help="timed forwards and backwards per cell (GPU default 100)")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--memory-fraction", type=float, help="cap this process's GPU memory, e.g. 0.05")
    parser.add_argument("--device")
    args = parser.parse_args()

    try:
        device = resolve_device(args.device)
    except (RuntimeError, ValueError) as e:
        fail(str(e))
    suite = args.suite == "flash"
    defaults = (GPU_SUITE if suite else GPU_SWEEP) if device.type == "cuda" else (CPU_SUITE if suite else CPU_SWEEP)
    names = args.impl.split(",") if args.impl else list(SUITE_IMPLS if suite else IMPLS)
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        fail(f"unknown implementation '{unknown[0]}'; choose from {', '.join(IMPLS)}")
    args.d = parse_list(args.d, "--d") if args.d else defaults["d"]
    args.seq = parse_list(args.seq, "--seq") if args.seq else defaults["seq"]
    for flag in ("batch", "heads", "steps", "warmup"):
        if getattr(args, flag) is None:
            setattr(args, flag, defaults.get(flag, 1))
        if getattr(args, flag) < (0 if flag == "warmup" else 1):
            fail(f"--{flag} must be {'non-negative' if flag == 'warmup' else 'at least 1'}, got {getattr(args, flag)}")
    if args.memory_fraction is not None:
        if device.type != "cuda":
            fail("--memory-fraction caps GPU memory and needs a CUDA device")
        if not 0 < args.memory_fraction <= 1:
            fail(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
        # The caching allocator raises OutOfMemoryError past this fraction of the GPU's memory.
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device)

    where = (f"{torch.cuda.get_device_name(device)}" if device.type == "cuda"
             else "CPU: no CUDA GPU, so a tiny sweep that finishes in seconds instead of the GPU default")
    import triton

    print(f"{where}; torch {torch.__version__}, triton {triton.__version__}; batch {args.batch}, heads {args.heads},"
          f" D {args.d}, S {args.seq}" + ("" if suite else f", {args.steps} timed steps after {args.warmup} warm-up"))
    if suite:
        args.causal = True
        dtypes = [args.dtype] if args.dtype else ["bf16", "fp32"]
        impls = make_impls(names, True, device)
        last = None
        for dtype_name, results in run_suite(args, impls, device, dtypes):
            last = (dtype_name, results)
        print(suite_summary(*last, args))
        return
    args.dtype = args.dtype or "bf16"
    dtype = DTYPES[args.dtype]
    print(f"{args.dtype}{', causal' if args.causal else ', not causal'}; fp32 matmuls use torch's default (TF32 off)")
    impls = make_impls(names, args.causal, device)
    results, notes = run_sweep(args, impls, device, dtype)
    print_sweep(results, notes, impls, device, args.steps)
    if "naive" in impls:
        print_memory_accounting(results, args, dtype, device)
    print(sweep_summary(results, args))


def sweep_summary(results, args):
    """One line: at the largest configuration every impl reached, fwd+bwd of each, fastest first."""
    (D, S), row = list(results.items())[-1]
    done = {n: c["fwd"][0] + c["bwd"][0] for n, c in row.items() if isinstance(c, dict)}
    ranked = sorted(done.items(), key=lambda kv: kv[1])
    ooms = [n for n, c in row.items() if c == "OOM"]
    text = ", ".join(f"{n} {ms:.3f}" for n, ms in ranked) or "no implementation ran"
    return (f"summary: D={D} S={S} {args.dtype}, forward+backward ms: {text}"
            + (f"; OOM: {', '.join(ooms)}" if ooms else ""))


def suite_summary(dtype_name, results, args):
    (D, S), row = list(results.items())[-1]
    done = sorted(((c["fwd+bwd"], n) for n, c in row.items() if isinstance(c, dict)))
    text = ", ".join(f"{n} {ms:.3f} ms" for ms, n in done) or "no implementation ran"
    return f"summary: {dtype_name} causal D={D} S={S}, forward+backward median: {text}"


if __name__ == "__main__":
    main()
