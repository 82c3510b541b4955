"""Attention implementations side by side: time, memory, and where each one breaks.

Naive attention materialises the S x S score and probability matrices for every batch element
and head, and autograd keeps the probabilities for backward, so its memory grows as S^2 and long
sequences run out of memory; fused kernels (SDPA's flash / cuDNN / mem-efficient backends, the
Triton kernel) keep only O(S) statistics and recompute the rest in backward. The implementations
are gpt.py's own (causal, as the model uses them), plus naive attention under torch.compile.

    python bench_attention.py                          # batch 8, 1 head, D 64 x S 1024, 4096, 16384, bf16
    python bench_attention.py --full                   # the course's sweep, D 16..128 x S 256..16384: minutes
    python bench_attention.py --dtype fp32             # the same sweep in fp32
    python bench_attention.py --impl naive,flash --d 64 --seq 1024,4096
    python bench_attention.py --memory-fraction 0.05   # cap the GPU memory to see OOM cells
    python bench_attention.py --d 64 --plot attention.png   # ms and peak memory against S
"""

import argparse
import logging
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from functools import partial

import torch

from gpt import (ATTENTION, GPU_ONLY_ATTENTION, PROGRESS, SDPA_BACKENDS, check_host_memory, compare, fail,
                 flash_triton_found, float_in, free_memory, gib, int_in, int_list, is_oom, naive_attention, name_list,
                 on_device, plot_path, plot_to, print_table, resolve_device, run_main, saved_tensor_bytes, synchronize)

IMPLS = (*ATTENTION, "compiled")
DEFAULT_IMPLS = ("naive", "compiled", *SDPA_BACKENDS, "triton")  # "sdpa" runs one of these: ask for it by name
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the GPU default: GPT-2's head dim at S growing 4x a step, three points against S^2 (3 of the course's 20
# configurations, chosen to finish in about a minute); --full: all 20, minutes
GPU_SWEEP = dict(batch=8, heads=1, d=[64], seq=[1024, 4096, 16384], rounds=10, steps=5, warmup=3)
COURSE_SIZES = dict(d=[16, 32, 64, 128], seq=[256, 1024, 4096, 8192, 16384])
CPU_SWEEP = dict(batch=2, heads=1, d=[16, 32], seq=[64, 128], rounds=3, steps=2, warmup=1)
MIB = 2**20


@dataclass(frozen=True)
class Sweep:  # the flags as plain values, read once in main
    impls: list
    baseline: str
    batch: int
    heads: int
    d: list
    seq: list
    dtype: str
    rounds: int
    steps: int
    warmup: int
    memory_fraction: float = None

# --- 1. the implementations: gpt.py's registry, and naive attention compiled


def make_impls(names, device):
    """name -> callable(q, k, v) from gpt.ATTENTION, or name -> reason string when it cannot run here.
    SDPA pinned to one backend (flash, cudnn, efficient, math) raises when that backend cannot take
    the inputs: the cell says n/a instead of timing another backend under this column's name."""
    impls = {}
    for name in names:
        interpreted = name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"  # the kernels in numpy
        if name == "compiled":
            impls[name] = compiled_naive()
        elif device.type != "cuda" and name in GPU_ONLY_ATTENTION and not interpreted:
            impls[name] = "needs CUDA" + (" (or TRITON_INTERPRET=1)" if name == "triton" else "")
        elif name == "triton" and not flash_triton_found():  # bench_attention.py copied with gpt.py alone
            impls[name] = "needs flash_triton.py"
        else:
            impls[name] = ATTENTION[name]  # flash and math also have CPU kernels
    return impls


def compiled_naive():
    """gpt.naive_attention under torch.compile, one graph per head dim with the sequence length
    symbolic: a compile per (D, S) would cost more GPU time than the measurements. D must stay
    static (automatic dynamic shapes would make it symbolic on the first recompile): the scale
    1/sqrt(D) would then be a symbol and Inductor's SDPA pattern stops matching. A cell is marked
    * where the profiler saw that Inductor replaced the function with an SDPA kernel."""
    # Inductor may split a long softmax reduction and then builds the plain softmax kernels instead of its
    # online-softmax one; it warns each time. Harmless: the result is the same softmax, and the timer measures
    # whatever kernels Inductor chose. The message starts with a newline, hence the leading \s*.
    warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled on the fly", category=UserWarning)
    # Dynamo drops gpt.naive_attention's record_function ranges (kept for bench_e2e.py's eager profile) from the
    # graph, and says so; the compiled function is the same either way.
    for name in ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch"):
        logging.getLogger(name).addFilter(not_a_profiler_notice)
    config = torch._dynamo.config
    config.automatic_dynamic_shapes = False
    setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", 64)
    compiled = torch.compile(naive_attention)

    def run(q, k, v):
        for t in (q, k, v):
            torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)  # the sequence dimension
        return compiled(q, k, v)
    return run


def not_a_profiler_notice(record):  # a logging filter: False drops Dynamo's "Profiler ... will be ignored"
    return not record.getMessage().startswith("Profiler ")


def random_qkv(B, H, S, D, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, dout = (torch.randn(B, H, S, D, dtype=dtype, device=device, generator=gen) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout

# takeaway: one registry of implementations, the model's; a benchmark adds only what it measures.

# --- 2. what naive attention keeps for backward, predicted and measured


def naive_saved_bytes(B, H, S, D, dtype):
    """Bytes autograd saves for backward in gpt.naive_attention, from the shapes alone.
    q @ k^T saves q and k (views, no copies); `* scale` by a Python float saves nothing;
    masked_fill saves only its bool S x S mask (one per call, broadcast over B and H);
    softmax saves its *output* (its backward needs only the probabilities), and probs @ v saves
    the same probabilities plus v. So the raw and scaled scores are never saved: one B*H*S*S
    matrix, not two, is what stays alive from forward to backward."""
    e = dtype.itemsize
    return 3 * B * H * S * D * e + B * H * S * S * e + S * S


def counted_saved_bytes(B, H, S, D, dtype, device):
    """What gpt.saved_tensor_bytes counts for naive attention: each saved storage once (softmax and the
    matmul after it save the same probabilities), q, k and v included (q @ k^T saves them)."""
    q, k, v, _ = random_qkv(B, H, S, D, dtype, device)
    return saved_tensor_bytes(partial(naive_attention, q, k, v))


def naive_peak_bytes(B, H, S, D, dtype):
    """Allocated bytes above the inputs at naive attention's high-water mark, which is in
    backward: the saved probabilities, their gradient (dout @ v^T), the softmax backward's output
    (the score gradient) and that gradient times the scale (the mul's backward makes a new
    tensor) are four B*H*S*S tensors alive at once, plus the output, dv and the mask. (Counting
    three, a prediction falls short of the allocator by one S*S matrix; forward peaks at two.)"""
    e = dtype.itemsize
    return 4 * B * H * S * S * e + 2 * B * H * S * D * e + S * S

# takeaway: naive attention keeps one B*H*S*S probability matrix for backward; its backward holds four at once.

# --- 3. measuring one configuration: memory (allocator) here, time with gpt.py's timer


def clear_grads(*tensors):
    for t in tensors:
        t.grad = None  # None, not zero: otherwise backward adds into the old gradient (extra kernel)


SDPA_KERNEL = re.compile(r"scaled_dot_product|flash|fmha|efficient_attention|cudnn", re.IGNORECASE)


def sdpa_ops_in(fn, q, k, v, dout):
    """Names of SDPA ops that ran in one forward+backward of fn. Inductor's pattern matcher can
    rewrite matmul-softmax-matmul into an SDPA call; the profiler shows what really ran."""
    # Kineto, the profiler's library, prints "USDT: ... profiler_start/stop" at each profile unless its log level
    # is above every level (6); read when the first profile starts. Only op names are wanted here.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # acc_events: the profile has one cycle anyway; without it torch warns that events of earlier cycles are dropped
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as prof:
        fn(q, k, v).backward(dout)
        synchronize(q.device)
    clear_grads(q, k, v)
    return sorted({e.name for e in prof.events() if SDPA_KERNEL.search(e.name)})


def measure_memory(fn, impl, q, k, v, dout, device):
    """One forward+backward first (torch.compile compiles on its first call; a backend that
    cannot take the inputs raises here), then, on CUDA, the memory around one backward."""
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
    return result


def time_config(fns, q, k, v, dout, sweep, device):
    """Forward and forward+backward of every implementation, interleaved in rounds (gpt.compare):
    {name: {"fwd": Timing, "both": Timing}}; None where an implementation ran out of memory."""
    baseline = sweep.baseline if sweep.baseline in fns else None
    timings = {}
    for mode, step in (("fwd", lambda fn: fn(q, k, v)),
                       # autograd.grad, not .backward(): nothing accumulates into .grad between steps
                       ("both", lambda fn: torch.autograd.grad(fn(q, k, v), (q, k, v), dout))):
        variants = {name: (lambda fn=fn: step(fn)) for name, fn in fns.items()}
        timings[mode] = compare(variants, device, baseline, sweep.rounds, sweep.steps, sweep.warmup)
    return {name: {mode: timings[mode][name] for mode in timings} for name in fns}


def guarded(work):
    """work() or "OOM" or ("n/a", reason). The exception is dropped before memory is freed:
    its traceback holds the frames, and the frames hold the tensors."""
    try:
        cell = work()
    except Exception as e:
        if is_oom(e):
            cell = "OOM"
        else:
            cell = ("n/a", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:150]}")
    free_memory()
    return cell


def run_config(sweep, impls, device, D, S):
    """{impl: cell} of one (D, S): each implementation's memory alone, then all of them timed together.
    The inputs die with this frame."""
    q, k, v, dout = random_qkv(sweep.batch, sweep.heads, S, D, DTYPES[sweep.dtype], device)
    row = {}
    for name, fn in impls.items():
        if isinstance(fn, str):  # the reason it cannot run here
            row[name] = ("n/a", fn)
        else:
            row[name] = guarded(partial(measure_memory, fn, name, q, k, v, dout, device))
    ran = {name: fn for name, fn in impls.items() if isinstance(row[name], dict)}
    if ran:
        timed = guarded(partial(time_config, ran, q, k, v, dout, sweep, device))
        for name in ran:
            if isinstance(timed, dict):
                row[name] = {**row[name], **timed[name]}
            else:  # "OOM" or ("n/a", reason): the whole timing failed
                row[name] = timed
    return row

# takeaway: memory is read around one backward by the allocator; time comes from the one interleaved timer.

# --- 4. the default sweep: tables of time and memory


def fmt_cell(cell, show):
    if cell in ("OOM", "skip"):
        return cell
    if isinstance(cell, tuple):
        return "n/a"
    return show(cell)


def status(cell):  # a cell in the progress line
    if isinstance(cell, str):
        return cell
    if isinstance(cell, tuple):
        return "n/a"
    return "ok"


def run_sweep(sweep, impls, device):
    """{(D, S): {impl: cell}}: a cell is a dict (memory, then "fwd" and "both" Timings, None if
    out of memory in the timer's warm-up), "OOM", or ("n/a", reason); and {impl: first reason for n/a}."""
    results, notes = {}, {}
    configs = [(D, S) for D in sweep.d for S in sweep.seq]
    start = time.perf_counter()
    for i, (D, S) in enumerate(configs, 1):
        PROGRESS["stage"] = f"configuration {i} of {len(configs)} (D={D} S={S})"  # said if interrupted
        row = results[D, S] = run_config(sweep, impls, device, D, S)
        free_memory()
        for name, cell in row.items():
            if isinstance(cell, tuple):
                notes.setdefault(name, cell[1])
        # progress on stderr: stdout keeps the tables alone
        done = ", ".join(f"{n} {status(c)}" for n, c in row.items())
        print(f"[{i}/{len(configs)}, {time.perf_counter() - start:.0f} s] D={D} S={S}: {done}", file=sys.stderr,
              flush=True)
    PROGRESS["stage"] = ""
    return results, notes


def rewritten(cell):
    return isinstance(cell, dict) and bool(cell.get("sdpa_ops"))


def star(cell):  # marks a cell where Inductor put an SDPA kernel in place of naive attention
    return "*" if rewritten(cell) else ""


def timing(key, show):
    """A table cell from one Timing of a measured cell (None: out of memory in the timer's warm-up)."""
    def text(cell):
        if cell[key] is None:
            return "OOM"
        return show(cell[key]) + star(cell)
    return text


def print_sweep(results, notes, impls, device, sweep):
    names = list(impls)
    rounds = f"median (min-max) over {sweep.rounds} rounds of {sweep.steps} steps, implementations interleaved"
    tables = [(f"forward, ms: {rounds}", timing("fwd", lambda t: t.ms(3))),
              (f"forward+backward, ms: {rounds}", timing("both", lambda t: t.ms(3))),
              (f"forward+backward vs {sweep.baseline}: median of the per-round ratios (min-max)",
               timing("both", lambda t: t.vs()))]
    if device.type == "cuda":
        tables.append(("memory allocated just before backward / peak during forward+backward, MiB",
                       lambda c: f"{c['before'] / MIB:.0f} / {c['peak'] / MIB:.0f}{star(c)}"))
    for title, show in tables:
        print(f"\n{title}")
        print_table(["D", "S", *names],
                    [[D, S, *(fmt_cell(row[n], show) for n in names)] for (D, S), row in results.items()])
    for name, reason in notes.items():
        print(f"n/a {name}: {reason}")
    cells = [row["compiled"] for row in results.values() if isinstance(row.get("compiled"), dict)]
    if cells:
        ops = sorted({op for cell in cells for op in cell["sdpa_ops"]})
        if ops:
            print(f"* compiled: Inductor rewrote the naive attention into SDPA in {sum(map(rewritten, cells))} of"
                  f" {len(cells)} configurations; the profiler saw {', '.join(ops)}")
        else:
            print("compiled: no SDPA op in the profile of any configuration: Inductor kept matmul, fused softmax, "
                  "matmul")


def plot_sweep(results, impls, path, ms, memory):
    """forward+backward ms(cell) and, with memory, peak MiB against S: a column per head dim."""
    plt = plot_to(path)
    dims = sorted({D for D, _ in results})
    metrics = [("forward+backward, ms", ms)] + ([("peak memory, MiB", lambda c: c["peak"] / MIB)] if memory else [])
    fig, axes = plt.subplots(len(metrics), len(dims), figsize=(4.5 * len(dims), 3.5 * len(metrics)), squeeze=False)
    for col, D in enumerate(dims):
        for row, (label, value) in enumerate(metrics):
            ax = axes[row][col]
            for name in impls:
                cells = [(S, results[D, S][name]) for d, S in results if d == D]
                points = [(S, value(c)) for S, c in cells if isinstance(c, dict) and value(c) is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", label=name)
            ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel=label, title=f"D={D}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")

# takeaway: fused kernels grow linearly in S where naive attention grows as S^2, and that is where it breaks.

# --- 5. memory accounting for naive attention: prediction vs measurement, and where it breaks


def print_memory_accounting(results, sweep, device):
    B, H, dtype = sweep.batch, sweep.heads, DTYPES[sweep.dtype]
    print(f"\nnaive attention memory, MiB, B={B} H={H} {sweep.dtype} causal")
    rows, prev = [], {}
    for (D, S), row in results.items():
        saved = naive_saved_bytes(B, H, S, D, dtype)
        hooked = guarded(partial(counted_saved_bytes, B, H, S, D, dtype, device))
        out_bytes = B * H * S * D * dtype.itemsize
        cells = [D, S, f"{saved / MIB:.2f}", fmt_cell(hooked, lambda b: f"{b / MIB:.2f}")]
        cell = row.get("naive")
        if device.type == "cuda":
            residue = saved - 2 * out_bytes  # q, k, v existed before; the output is new
            peak = naive_peak_bytes(B, H, S, D, dtype)
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
        print_first_oom(results, sweep, device)


def naive_need_bytes(B, H, S, D, dtype):  # naive attention's peak plus its inputs q, k, v, dout
    return 4 * B * H * S * D * dtype.itemsize + naive_peak_bytes(B, H, S, D, dtype)


def print_first_oom(results, sweep, device):
    """Work out, from the total GPU memory, the shortest power-of-two sequence at which naive
    attention cannot fit, for the smallest head dimension of the sweep."""
    total = torch.cuda.get_device_properties(device).total_memory * (sweep.memory_fraction or 1.0)
    B, H, D, dtype = sweep.batch, sweep.heads, min(sweep.d), DTYPES[sweep.dtype]
    e = dtype.itemsize
    S = 128
    while naive_need_bytes(B, H, S, D, dtype) <= total:
        S *= 2
    capped = " under --memory-fraction" if sweep.memory_fraction else ""
    print(f"first naive OOM, worked through: {torch.cuda.get_device_name(device)} has {gib(total)} GiB{capped}."
          f" At B={B} H={H} D={D} S={S} one B·H·S² {sweep.dtype} matrix is {B}·{H}·{S}²·{e} B ="
          f" {gib(B * H * S * S * e)} GiB; backward holds four at once (probs, dprobs, dscores, dscores·scale) plus"
          f" q,k,v,dout,out,dv: {gib(naive_need_bytes(B, H, S, D, dtype))} GiB > {gib(total)} GiB. S={S // 2} needs"
          f" {gib(naive_need_bytes(B, H, S // 2, D, dtype))} GiB and fits: half the length, a quarter of the memory.")
    measured = [(D_, S_) for (D_, S_), row in results.items() if row.get("naive") == "OOM"]
    print(f"measured: naive ran out of memory at {', '.join(f'D={d} S={s}' for d, s in measured)}" if measured
          else "measured: naive did not run out of memory in this sweep")

# takeaway: the S^2 arithmetic predicts the allocator's figures and the first sequence length that cannot fit.

# --- 6. main


def parse_args(argv):
    """The flags, each validated by its type= helper (a bad value: argparse's one-line error, exit 2)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", type=name_list(IMPLS, "implementation"),
                   help=f"comma-separated, from {','.join(IMPLS)} (default: all but sdpa)")
    p.add_argument("--baseline", help="implementation the ratio column divides by (default flash, else the first)")
    p.add_argument("--d", type=int_list(1), help="head dimensions, comma-separated (GPU default 64)")
    p.add_argument("--seq", type=int_list(1), help="sequence lengths, comma-separated (GPU default 1024,4096,16384)")
    p.add_argument("--full", action="store_true", help="the course's sweep on a GPU: D 16,32,64,128 x S "
                   "256,1024,4096,8192,16384, 20 configurations (minutes)")
    p.add_argument("--batch", type=int_in(1))
    p.add_argument("--heads", type=int_in(1))
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--causal", action="store_true", help="the default and only mask: gpt.py's attention is causal")
    p.add_argument("--rounds", type=int_in(1), help="rounds of the interleaved timer (GPU default 10)")
    p.add_argument("--steps", type=int_in(1), help="steps per implementation per round (GPU default 5)")
    p.add_argument("--warmup", type=int_in(0), help="untimed steps per implementation first")
    p.add_argument("--memory-fraction", type=float_in(1e-3, 1), help="cap this process's GPU memory, e.g. 0.05")
    p.add_argument("--device")
    p.add_argument("--plot", type=plot_path, help="draw ms and peak memory against S into this figure (.png, .pdf, "
                   ".svg, ...: the name's extension; needs matplotlib)")
    return p.parse_args(argv)


def sweep_from(args, device):
    """The flags as a Sweep of plain values, defaults by device (gpt.on_device); ValueError in one
    sentence for a combination that cannot work."""
    defaults = on_device(device, cpu=CPU_SWEEP, gpu=GPU_SWEEP)
    if args.full and (args.d or args.seq):
        raise ValueError("--full sets --d and --seq to the course's sweep; drop them or drop --full")
    if args.full and device.type != "cuda":
        raise ValueError("--full is the course's GPU sweep (minutes on an H100); on a CPU give --d and --seq")
    if args.full:
        defaults = {**defaults, **COURSE_SIZES}
    impls = args.impl or list(DEFAULT_IMPLS)
    baseline = args.baseline or ("flash" if "flash" in impls else impls[0])
    if baseline not in impls:
        raise ValueError(f"--baseline {baseline} is not among the implementations ({', '.join(impls)})")
    if args.memory_fraction is not None and device.type != "cuda":
        raise ValueError("--memory-fraction caps GPU memory and needs a CUDA device")

    def pick(value, name):  # the flag, or the device's default
        return defaults[name] if value is None else value
    return Sweep(impls, baseline, batch=pick(args.batch, "batch"), heads=pick(args.heads, "heads"), d=pick(args.d, "d"),
                 seq=pick(args.seq, "seq"), dtype=args.dtype, rounds=pick(args.rounds, "rounds"),
                 steps=pick(args.steps, "steps"), warmup=pick(args.warmup, "warmup"),
                 memory_fraction=args.memory_fraction)


def check_cpu_memory(sweep):  # naive's peak and the inputs: the most any implementation holds
    dtype = DTYPES[sweep.dtype]
    need = max(naive_need_bytes(sweep.batch, sweep.heads, S, D, dtype) for D in sweep.d for S in sweep.seq)
    check_host_memory(need, f"batch {sweep.batch} x {sweep.heads} heads at S {max(sweep.seq)}",
                      "lower --batch, --heads or --seq")


def sweep_plan(sweep, n_impls, device):
    """One line before the sweep: how much work it is, and the flags that narrow it."""
    n = len(sweep.d) * len(sweep.seq)
    line = (f"configurations: {n} ({len(sweep.d)} head dims x {len(sweep.seq)} sequence lengths), each timing "
            f"{n_impls} implementations, a progress line each (stderr)")
    if device.type == "cuda" and (sweep.d, sweep.seq) == (COURSE_SIZES["d"], COURSE_SIZES["seq"]):
        line += "; the course's sweep takes minutes on an H100 (its first 10 configurations took over 2)"
    if n > 4:
        line += "; --d and --seq narrow it, e.g. --d 64 --seq 1024,4096 runs 2"
    return line


def main(argv=None):
    args = parse_args(argv)
    plot = args.plot  # its path and format were checked with the flags (gpt.plot_path)
    try:
        device = resolve_device(args.device)
        sweep = sweep_from(args, device)
    except ValueError as e:
        fail(str(e))
    if device.type == "cpu":
        check_cpu_memory(sweep)
    if sweep.memory_fraction is not None:
        # The caching allocator raises OutOfMemoryError past this fraction of the GPU's memory.
        torch.cuda.set_per_process_memory_fraction(sweep.memory_fraction, device)
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}")
        # The first backward runs on autograd's device thread, which finds no CUDA context current yet; torch says so
        # and makes the primary context current there, as it should. Nothing is wrong, so the notice is not shown.
        warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context",
                                category=UserWarning)
    else:  # a CPU shares its cores with everything else: its timings have moved 50x between two runs
        print(f"CPU smoke run, not a measurement: a tiny sweep that finishes in seconds, with timings that can move "
              f"tens of times between runs; torch {torch.__version__}")
    print(f"batch {sweep.batch}, heads {sweep.heads}, D {sweep.d}, S {sweep.seq}, {sweep.dtype}, causal; "
          f"{sweep.rounds} rounds of {sweep.steps} steps after {sweep.warmup} warm-up; fp32 matmuls use torch's "
          "default (TF32 off)")
    try:
        impls = make_impls(sweep.impls, device)
        print(sweep_plan(sweep, len(impls), device), flush=True)
        results, notes = run_sweep(sweep, impls, device)
        print_sweep(results, notes, impls, device, sweep)
        if "naive" in impls:
            print_memory_accounting(results, sweep, device)
        if plot:
            plot_sweep(results, impls, plot, lambda c: c["both"] and c["both"].median, device.type == "cuda")
        print(sweep_summary(results, sweep))
    except (torch.OutOfMemoryError, RuntimeError) as e:  # outside a sweep cell (cells catch their own)
        if not is_oom(e):
            raise
        where = "GPU" if device.type == "cuda" else "host"
        fail(f"out of {where} memory outside the sweep cells: {str(e).splitlines()[0][:120]}")


def sweep_summary(results, sweep):
    """One line: at the largest configuration, forward+backward of each implementation, fastest
    first, with its paired ratio to the baseline."""
    (D, S), row = list(results.items())[-1]
    done = {n: c["both"] for n, c in row.items() if isinstance(c, dict) and c.get("both") is not None}
    text = ", ".join(f"{n} {t.median:.3f} ms ({t.vs()})" for n, t in sorted(done.items(), key=lambda kv: kv[1].median))
    ooms = [n for n, c in row.items() if c == "OOM" or (isinstance(c, dict) and c.get("both") is None)]
    oom_text = f"; OOM: {', '.join(ooms)}" if ooms else ""
    return (f"summary: D={D} S={S} {sweep.dtype}, forward+backward median ms (vs {sweep.baseline}): "
            f"{text or 'no implementation ran'}{oom_text}")


if __name__ == "__main__":
    run_main(main)  # Ctrl-C / SIGTERM: one line, exit 130 / 143
