"""End-to-end timing of GPT training: where a step's time goes and what each optimization buys.

The speed ladder trains GPT-2 124M (B=16, T=1024) with one change per rung, from fp32 with naive attention to
train.py's headline (our Triton attention, fused biases, cuBLAS without a workspace, the tied weight's gradient
summed in place, AdamW's own kernel, bf16 weights kept by the optimizer), then a lever on the headline (FP8 forced
onto every block Linear), all rungs in the same rounds of gpt.py's timer (paired ratios); --rungs times a few.
--nanogpt times nanoGPT's model.py against the headline the same way (under torchrun: both data parallel, each
beside its one-GPU step). The sweep splits a step into forward, backward and optimizer by model, batch, context,
vocabulary, precision and compile mode (--precisions, --compile-modes: each against the first, paired);
--warmup-table shows what the first steps pay for; --profile groups each configuration's kernels and sets each
group against its limit, then sums them up a row each; --nvtx names the phases for Nsight Systems.

    python bench_e2e.py --ladder --plot ladder.png
    python bench_e2e.py --ladder --rungs 14,15,16   # the rung before the headline, it, and its FP8 lever
    python bench_e2e.py --nanogpt ../nanoGPT
    torchrun --nproc_per_node=2 bench_e2e.py --nanogpt ../nanoGPT   # nanoGPT + DDP against train.py's data parallel
    python bench_e2e.py --model gpt2 --batch 16 --seq 1024 --bf16 --mode train --vocab 50257,50304
    python bench_e2e.py --model small --batch 4 --seq 512 --warmup-table
    python bench_e2e.py --model gpt2 --batch 16 --seq 1024 --vocab 50304 --bf16 --compile --mode train --profile
    python bench_e2e.py ... --profile --attn triton    # the same with the headline's attention (--attn: sdpa)
    # CS336 a2 (the course's xl is our 2.7B): every size x context profiled (a trace each), then fp32 against bf16,
    # eager against compiled, each mode
    python bench_e2e.py --model small,medium,large,2.7B --seq 128,256,512,1024 --batch 4 --attn naive --trace e2e.json
    python bench_e2e.py --model small,medium,large,2.7B --seq 128,256,512,1024 --batch 4 --precisions fp32,bf16
    python bench_e2e.py --model small,medium,large,2.7B --seq 128,256,512,1024 --batch 4 --compile-modes eager,compiled
    nsys profile --trace=cuda,nvtx -o e2e python bench_e2e.py --nvtx --attn naive --batch 4 --rounds 2 --steps 1
"""

import argparse
import contextlib
import os
import statistics
import sys
from dataclasses import dataclass, replace
from functools import partial
from itertools import product

import torch

import gpt  # gpt.NVTX: the switch --nvtx sets
from gpt import (ATTENTION, FP8_MIN_WIDTH, GPT, GPT2_VOCAB, GPU_ONLY_ATTENTION, PRESETS, PROGRESS, GPTConfig,
                 GraphedStep, MasterWeights, amp_dtype, autocast, average_gradients, check_host_memory,
                 check_output_path, clock, compile_model, configure_optimizer, elapsed_ms, fail, flash_triton_found,
                 flops_per_token, fmt_mfu, fp8_supported, free_memory, gib, gpu_peak_flops, int_in, int_list, is_oom,
                 lazily, make_config, mfu, name_list, nvtx_range, on_device, plot_path, plot_to, print_table,
                 resolve_device, run_main, set_cublas_workspace, set_tf32, step_bytes, summarize, synchronize,
                 time_rounds, train_step, use_fp8)

# --- 1. the speed ladder: one change per rung, on top of everything above it
HEADLINE = "+ bf16 weights kept by the optimizer"  # = python train.py --vocab 50304 --bf16 --compile (on a GPU)
FP8_RUNG = "+ FP8 block Linears (forced)"
LADDER = (("fp32, naive attention, vocab 50257", {}),
          ("+ TF32 matmuls", {"tf32": True}),
          ("+ bf16 autocast", {"dtype": torch.bfloat16}),
          ("+ SDPA attention", {"attn": "sdpa"}),  # a fused kernel: cuDNN's on an H100
          ("+ vocab 50304", {"vocab": 50304}),
          ("+ torch.compile (PDL)", {"compile": True}),  # gpt.compile_model, train.py's compile
          ("+ CUDA graphs", {"graphs": True}),
          ("+ fused linear-CE", {"fused_ce": True}),
          ("+ residual adds fused into LayerNorm", {"fused_norms": True}),  # gpt.py section 5
          ("+ our Triton attention", {"attn": "triton"}),  # flash_triton.py on c_attn's output, not SDPA's cuDNN
          # c_fc's bias added by the GELU kernel, c_proj's by the add + LayerNorm ones
          ("+ biases added by the fused kernels", {"fused_bias": True}),
          ("+ cuBLAS without a workspace", {"cublas_workspace": False}),  # gpt.set_cublas_workspace: no memsets
          ("+ embedding's gradient into the loss's", {"embedding_into_dw": True}),  # gpt.TiedEmbedding
          ("+ AdamW's matrices by our kernel", {"adamw_kernel": True}),  # gpt.AdamW: one launch of _adamw each
          (HEADLINE, {"master": True}),  # gpt.MasterWeights: the weights cast once a step, by the optimizer
          # levers past the headline: each is the headline plus its own change, timed against the headline
          (FP8_RUNG, {"fp8": True, "master": False}))  # FP8 Linears cast their own weights (as train.py --fp8)
LEVER_NOTES = {  # printed under the table for each lever that ran
    FP8_RUNG: "gpt.use_fp8(model, min_width=0), all four Linears of each block; by default use_fp8 (train.py "
              f"--fp8) converts only those {FP8_MIN_WIDTH}+ wide on both sides (see precision.py --only fp8)"}
FIRST_RUNG = {"tf32": False, "dtype": None, "attn": "naive", "vocab": 50257, "compile": False, "graphs": False,
              "fused_ce": False, "fused_norms": False, "fused_bias": False, "master": False,
              "fp8": False, "cublas_workspace": True, "embedding_into_dw": False,
              "adamw_kernel": False}
RUNG_NUMBERS = {name: i + 1 for i, (name, _) in enumerate(LADDER)}  # as the table and --rungs number them
HEADLINE_NUMBER = RUNG_NUMBERS[HEADLINE]
# All rungs live at once, to run in the same rounds: at B=16 T=1024 each gpt2 keeps 1.5 GB of weights and
# AdamW moments, the fp32 rung's step ~30 GB of activations, the CUDA graph pool ~10 GB: ~55 GB for the first ten
# rungs. A rung that does not fit is marked OOM and the others go on; --rungs times a few (the levers, say).

def skip_reason(change, s, device):
    # TF32 has no CPU equivalent (the rungs after it still run); Inductor's CPU compile takes minutes a rung
    cuda = device.type == "cuda"
    if not cuda and ("tf32" in change or s["attn"] in GPU_ONLY_ATTENTION):
        return "skipped: GPU only"
    if not cuda and s["compile"]:
        return "skipped on the CPU (compiling)"
    if s["fp8"] and not fp8_supported(device):
        return "skipped: needs FP8 tensor cores (H100/H200)"
    if s["attn"] == "triton" and not flash_triton_found():  # bench_e2e.py copied with gpt.py alone
        return "skipped: needs flash_triton.py"

@dataclass
class Bench:
    """One built variant: the model, what calls it (the model or its compiled wrapper), its optimizer, precision."""
    model: torch.nn.Module
    runner: object
    optimizer: torch.optim.Optimizer
    dtype: torch.dtype = None
    tf32: bool = False
    scaler: torch.amp.GradScaler = None
    config: GPTConfig = None
    cublas_workspace: bool = True  # False: gpt.set_cublas_workspace(False) before each of its steps
    graphed: bool = False  # its train step captured in a CUDA graph (gpt.GraphedStep) at the first call
    grad_clip: float = 0.0
    reduce: object = None  # gpt.average_gradients over the ranks (torchrun), or None
    graph: object = None  # the GraphedStep, once captured

@dataclass(frozen=True)
class Plan:
    """What the sweep and the timer run, from the flags with this device's defaults (made once, in settings)."""
    batch: list
    seq: list
    vocab: list
    modes: tuple  # of MODES
    rounds: int = 3
    steps: int = 1
    warmup: int = 1
    precisions: tuple = ("fp32",)  # of PRECISIONS: every cell runs in each (--precisions, or --bf16 / --fp16)
    compiles: tuple = ("eager",)  # of COMPILE_MODES (--compile-modes, or --compile)
    tf32: bool = False
    attn: str = "sdpa"

    @property
    def variants(self):
        """[(precision, compile mode)]: what every cell of the sweep runs as, the first the baseline."""
        return list(product(self.precisions, self.compiles))

def build(config, s, device):
    config = replace(config, vocab_size=s["vocab"], attn=s["attn"], fused_ce=s["fused_ce"],
                     fused_norms=s["fused_norms"], fused_bias=s["fused_bias"],
                     embedding_into_dw=s["embedding_into_dw"])
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: a 2.7B model takes minutes on the CPU
        model = GPT(config)
    if s["fp8"]:  # forced: by default use_fp8 converts only Linears >= FP8_MIN_WIDTH wide, none of gpt2's
        use_fp8(model, min_width=0)
    if s["master"]:  # the blocks' weights become bf16 before compiling: the compiled forward reads them as they are
        optimizer = MasterWeights(model, lr=1e-4)
    else:
        optimizer = configure_optimizer(model, lr=1e-4, matrix_kernel=s["adamw_kernel"])
    runner = compile_model(model) if s["compile"] else model
    scaler = None
    if s["dtype"] == torch.float16:
        scaler = torch.amp.GradScaler(device.type)
    return Bench(model, runner, optimizer, s["dtype"], s["tf32"], scaler, config, s["cublas_workspace"], s["graphs"])

def train_once(bench, x, y):
    """gpt.train_step, or on a rung with CUDA graphs the same step captured whole (gpt.GraphedStep, as train.py
    runs it), captured at the first call."""
    if not bench.graphed:
        return train_step(bench.runner, bench.optimizer, x, y, bench.dtype, bench.scaler, bench.grad_clip,
                          reduce=bench.reduce)
    if bench.graph is None:
        bench.graph = GraphedStep(bench.runner, bench.optimizer, [x], [y], bench.dtype, bench.grad_clip, bench.reduce)
    return bench.graph([x], [y], bench.optimizer.param_groups[0]["lr"])[0]

def run_step(mode, bench, x, y):
    # The forward runs with autograd on, as in training: it keeps the activations backward needs, most of
    # a step's memory. With the fused linear-CE the output layer's backward matmuls run (and count) here.
    set_tf32(bench.tf32)  # process-wide switches: each variant sets its own before queueing
    set_cublas_workspace(bench.cublas_workspace)
    if mode == "train":  # gpt.train_step: forward, backward, AdamW, gradients dropped (NVTX ranges inside)
        return train_once(bench, x, y)
    with nvtx_range("forward"), autocast(x.device, bench.dtype):
        _, loss = bench.runner(x, y)
    if mode == "forward-backward":
        if bench.scaler is not None:
            loss = bench.scaler.scale(loss)
        with nvtx_range("backward"):
            loss.backward()
        bench.model.zero_grad(set_to_none=True)

def batch_of(B, T, device):
    return torch.randint(0, 50257, (2, B, T), generator=torch.Generator().manual_seed(1)).to(device)

def held_bytes(bench):  # what a built model keeps between steps: weights and AdamW's moments
    if bench is None:
        return 0
    state = [t for s in bench.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    masters = []
    if isinstance(bench.optimizer, MasterWeights):  # fp32 masters and their moments, beside the bf16 weights
        masters = [*bench.optimizer.masters, *(t for pair in bench.optimizer.moments for t in pair)]
    return sum(t.numel() * t.element_size() for t in [*bench.model.parameters(), *state, *masters])

def timed(variants, device, plan, quiet=False):
    """gpt.time_rounds, a progress line a round (quiet: none, torchrun's ranks but 0); peaks less what the other
    variants held (none without warm-up)."""
    def progress(r):
        if not quiet:
            print(f"  round {r + 1}/{plan.rounds}", file=sys.stderr, flush=True)
    times, peaks = time_rounds(variants, device, plan.rounds, plan.steps, plan.warmup, progress=progress)
    own = {}
    for name, peak in peaks.items():
        own[name] = None
        if peak is not None and plan.warmup > 0:
            own[name] = peak - variants[name].state["others"]
    return times, own

def speedup(times, name, base, work=1.0):
    """Paired: median (min-max) over rounds of work * base ms / name ms."""
    if times.get(name) is None or times.get(base) is None:
        return "n/a"
    return summarize({"b": [work * ms for ms in times[base]], "n": times[name]}, baseline="n")["b"].vs()

def rungs():
    """(name, change, settings): up to the headline each rung adds its change to the rung above; past it, each
    lever adds its own change to the headline."""
    settings, past_headline = dict(FIRST_RUNG), False
    for name, change in LADDER:
        yield name, change, {**settings, **change}
        if not past_headline:
            settings = {**settings, **change}
        past_headline = past_headline or name == HEADLINE

def ladder_step(config, s, x, y, device):  # a rung's train step, built at its first call (gpt.lazily)
    return partial(run_step, "train", build(config, s, device), x, y)

def run_ladder(config, B, T, device, plan, plot=None, plt=None, chosen=None):
    """chosen: the rung numbers to time (from 1, as the table lists them); None: all."""
    torch._dynamo.reset()  # the compiled rungs compile here, from scratch
    x, y = batch_of(B, T, device)
    ladder = [(name, change) for name, change in LADDER if chosen is None or RUNG_NUMBERS[name] in chosen]
    variants, skipped = {}, {}
    for name, change, settings in rungs():
        if (name, change) not in ladder:
            continue
        reason = skip_reason(change, settings, device)
        if reason:
            skipped[name] = reason
            continue
        note = f"  {name}: first step"
        if settings["compile"]:
            note = f"  {name}: compiling..."
        variants[name] = lazily(partial(ladder_step, config, settings, x, y, device), device, note=note)
    print(f"timing {len(variants)} rungs together: {plan.warmup} warm-up steps each, then "
          f"{plan.rounds} rounds of {plan.steps} steps", file=sys.stderr, flush=True)
    times, peaks = timed(variants, device, plan)
    stats = summarize(times, peaks=peaks)
    flops = flops_per_token(config, T)  # useful work: vocabulary padding is not counted
    rows, first, prev = [], None, None
    for name, _ in ladder:
        t = stats.get(name)
        if t is None:
            rows.append([f"{RUNG_NUMBERS[name]:>2} {name}", skipped.get(name, "OOM")] + ["-"] * 5)
            continue
        tok_s = B * T / (t.median / 1e3)
        rows.append([f"{RUNG_NUMBERS[name]:>2} {name}", t.ms(), f"{tok_s:,.0f}",
                     "-" if prev is None else speedup(times, name, prev),
                     "-" if first is None else speedup(times, name, first), fmt_mfu(mfu(flops * tok_s, device)),
                     "n/a" if t.peak is None else gib(t.peak)])
        first = first or name
        if prev != HEADLINE:  # the levers past the headline are each paired with the headline
            prev = name
    print(f"\nspeed ladder, train steps of {B}x{T} tokens, {plan.rounds} rounds of {plan.steps} steps "
          "(speed-ups paired: median of per-round ratios, min-max; the levers past the headline against it)")
    print_table(["# rung", "ms/step, median (min-max)", "tokens/s", "speed-up vs previous", "vs first rung",
                 "MFU", "peak alloc (GiB)"], rows)
    if (config.n_layer, config.n_embd, B, T) == (12, 768, 16, 1024) and stats.get(HEADLINE):
        print(f"'{HEADLINE}' is train.py's headline configuration: python train.py --vocab 50304 --bf16 --compile")
    for name, note in LEVER_NOTES.items():
        if stats.get(name):
            print(f"'{name}': {note}")
    if plt is not None and first is not None:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        plot_ladder(plt, plot, [n for n, _ in ladder if stats.get(n)], stats, f"train step, B={B} T={T}, {where}")
    if first is None:
        return "ladder: no rung ran"
    # the summary ends on train.py's configuration (or the last rung timed before it), then each lever against it
    levers = ""
    if stats.get(HEADLINE):
        names = [name for name, _ in ladder]
        past = [name for name in names[names.index(HEADLINE) + 1:] if stats.get(name)]
        levers = "".join(f"; {name}: {speedup(times, name, HEADLINE)} its speed" for name in past)
    end = prev
    return (f"ladder: {stats[first].median:.1f} -> {stats[end].median:.1f} ms per step ({end.lstrip('+ ')}), "
            f"{speedup(times, end, first)} the speed of the first rung, "
            f"{B * T / (stats[end].median / 1e3):,.0f} tokens/s{levers}")

def plot_ladder(plt, path, names, stats, title):
    ms = [stats[n].median for n in names]
    err = [[m - stats[n].low for n, m in zip(names, ms)], [stats[n].high - m for n, m in zip(names, ms)]]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(names)))
    ax.barh(range(len(names)), ms, xerr=err, color="tab:blue")
    for i, n in enumerate(names):
        ax.text(stats[n].high, i, f"  {stats[n].median:.1f}", va="center")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set(xlabel="ms per train step (median over rounds, bars: min-max)", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote the ladder plot to {path}")


# --- 2. against nanoGPT: its model.py and train.py's headline, in the same rounds; under torchrun, both data parallel
# nanoGPT's train.py step (bf16 autocast, torch.compile, fused AdamW, clip 1.0) against the ladder's
# headline rung with the same clip (train.py's default), with and without the fused loss; same tokens. Under
# torchrun --nproc_per_node=N: nanoGPT compiled then wrapped in torch's DDP, as its train.py runs it, against
# train.py's data-parallel step (one CUDA graph, the gradients averaged after backward), each beside its own
# one-GPU step run on every GPU at once: the paired ratio to nanoGPT + DDP, and each one's scaling.
def load_nanogpt(path):
    import importlib.util

    file = os.path.join(path, "model.py") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        fail(f"--nanogpt {path}: no model.py there; give a nanoGPT checkout (git clone of karpathy/nanoGPT)")
    if not file.endswith(".py"):  # importlib finds no loader for another suffix
        fail(f"--nanogpt {path} is not a Python file; give a nanoGPT checkout or its model.py")
    spec = importlib.util.spec_from_file_location("nanogpt_model", file)
    module = importlib.util.module_from_spec(spec)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            spec.loader.exec_module(module)
    except Exception as e:
        fail(f"--nanogpt {file}: not nanoGPT's model.py ({type(e).__name__}: {e})")
    for name in ("GPT", "GPTConfig"):
        if not hasattr(module, name):
            fail(f"--nanogpt {file}: not nanoGPT's model.py (it defines no {name})")
    return module

def build_nanogpt(module, config, device, ddp=False, workspace=True):
    """nanoGPT's GPT at our sizes, vocab 50304, no bias or dropout, with its own fused AdamW; ddp: compiled, then
    wrapped in torch's DDP (its bucketed all-reduces overlap the backward), as nanoGPT's train.py does."""
    torch.manual_seed(0)
    cfg = module.GPTConfig(block_size=config.block_size, vocab_size=50304, n_layer=config.n_layer,
                           n_head=config.n_head, n_embd=config.n_embd, dropout=0.0, bias=False)
    with contextlib.redirect_stdout(sys.stderr):  # it prints its parameter counts
        model = module.GPT(cfg).to(device)
        optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device.type)
    runner, dtype = model, None  # on the CPU a smoke run: eager fp32
    if device.type == "cuda":
        runner, dtype = torch.compile(model), torch.bfloat16
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        device_ids = None
        if device.type == "cuda":
            device_ids = [device.index]
        runner = DDP(runner, device_ids=device_ids)
    return Bench(model, runner, optimizer, dtype, cublas_workspace=workspace)

def nanogpt_step(bench, x, y):
    set_cublas_workspace(bench.cublas_workspace)  # PyTorch's default, as nanoGPT's train.py runs, unless the row says
    with autocast(x.device, bench.dtype):
        _, loss = bench.runner(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(bench.model.parameters(), 1.0)
    bench.optimizer.step()
    bench.optimizer.zero_grad(set_to_none=True)

def build_headline(config, s, device, world=1):
    """Ours at settings s, clipped at 1.0 as nanoGPT's train.py; world > 1: the gradients averaged over the ranks
    after backward (gpt.average_gradients), inside the step's CUDA graph as train.py runs it."""
    bench = replace(build(config, s, device), grad_clip=1.0)
    if world > 1:
        bench.reduce = partial(average_gradients, [p for p in bench.model.parameters() if p.requires_grad], world)
    return bench

def headline_step(bench, x, y):
    set_cublas_workspace(bench.cublas_workspace)
    return train_once(bench, x, y)

def built_step(make, step, x, y):  # gpt.lazily's make(): the variant built at its first call, then its step
    return partial(step, make(), x, y)

def ranks_text(n, gpu):  # "one GPU", "2 GPUs"; on the CPU "one process", "2 processes"
    unit = "GPU"
    if not gpu:
        unit = "process"
    if n == 1:
        return f"one {unit}"
    if gpu:
        return f"{n} GPUs"
    return f"{n} processes"

def nanogpt_variants(module, config, device, x, y, world, quiet):
    """({name: a step built at its first call}, {name: (ranks it runs on, the one-rank row it scales from)}, the
    baseline's name). One process: nanoGPT as its train.py runs it (cuBLAS's workspace on) and, on a GPU, with the
    headline's cuBLAS setting too (how much of the lead is that switch, which any model can take); ours with and
    without the fused loss. Under torchrun: each one's step on one GPU (every rank alone, no communication) and data
    parallel on all of them; ours as train.py runs it on several (bf16 weights kept by the optimizer, their
    gradients all-reduced in bf16) and, where that applies, with autocast's casts and fp32 gradients instead."""
    gpu = device.type == "cuda"
    headline = headline_settings(gpu)
    makers, spans = {}, {}  # name: (build(), step(bench, x, y)); name: (ranks, one-rank row)
    if world == 1:
        base = "nanoGPT model.py"
        makers[base] = (partial(build_nanogpt, module, config, device), nanogpt_step)
        if gpu:
            makers["nanoGPT model.py, cuBLAS without a workspace"] = (
                partial(build_nanogpt, module, config, device, workspace=False), nanogpt_step)
        makers["ours, plain loss (--no-fused-ce)"] = (
            partial(build_headline, config, {**headline, "fused_ce": False}, device), headline_step)
        makers["ours, the headline"] = (partial(build_headline, config, headline, device), headline_step)
    else:
        one, many = ranks_text(1, gpu), ranks_text(world, gpu)
        theirs_alone, ours_alone = f"nanoGPT model.py, {one}", f"ours, {one}"
        base = f"nanoGPT model.py + DDP, {many}"
        makers[theirs_alone] = (partial(build_nanogpt, module, config, device), nanogpt_step)
        makers[base] = (partial(build_nanogpt, module, config, device, ddp=True), nanogpt_step)
        makers[ours_alone] = (partial(build_headline, config, headline, device), headline_step)
        makers[f"ours, {many}"] = (partial(build_headline, config, headline, device, world), headline_step)
        spans[base], spans[f"ours, {many}"] = (world, theirs_alone), (world, ours_alone)
        if headline["master"]:  # the lever train.py --no-master-weights turns off: fp32 gradients on the wire
            casts = f"ours, {many}, autocast's casts (--no-master-weights)"
            makers[casts] = (partial(build_headline, config, {**headline, "master": False}, device, world),
                             headline_step)
            spans[casts] = (world, ours_alone)
    note = "compiling..."
    if not gpu:
        note = "first step"
    variants = {}
    for name, (make, step) in makers.items():
        say = None
        if not quiet:
            say = f"  {name}: {note}"
        variants[name] = lazily(partial(built_step, make, step, x, y), device, note=say)
        spans.setdefault(name, (1, None))
    return variants, spans, base

def headline_settings(gpu):
    """The ladder's headline rung; on the CPU a smoke run: no compile, no CUDA graphs, fp32 (no bf16 weights)."""
    headline = dict(list(rungs())[[n for n, _ in LADDER].index(HEADLINE)][2])
    if not gpu:
        headline.update(compile=False, graphs=False, dtype=None, attn="sdpa", master=False)
    return headline

def run_nanogpt(path, module, config, B, T, device, plan, rank=0, world=1):
    x, y = batch_of(B, T, device)
    gpu = device.type == "cuda"
    variants, spans, base = nanogpt_variants(module, config, device, x, y, world, quiet=rank != 0)
    if rank == 0:
        print(f"timing nanoGPT's model.py and ours together: {plan.warmup} warm-up steps each, then "
              f"{plan.rounds} rounds of {plan.steps} steps", file=sys.stderr, flush=True)
    times, peaks = timed(variants, device, plan, quiet=rank != 0)
    if rank != 0:
        return None
    stats = summarize(times, peaks=peaks)
    headers = ["variant", "ms/step, median (min-max)", "tokens/s (all its ranks)", f"tokens/s vs {base} (paired)"]
    if world > 1:
        headers.append(f"scaling: tokens/s vs its step on {ranks_text(1, gpu)} (paired)")
    headers.append("peak alloc (GiB)")
    rows = []
    for name, t in stats.items():
        ranks, alone = spans[name]
        if t is None:
            rows.append([name, "OOM"] + ["-"] * (len(headers) - 3) + ["n/a"])
            continue
        vs = "-"
        if name != base:
            vs = speedup(times, name, base, work=ranks / world)
        row = [name, t.ms(), f"{ranks * B * T / t.median * 1e3:,.0f}", vs]
        if world > 1:
            scaling = "-"
            if alone is not None:
                scaling = speedup(times, name, alone, work=world)
            row.append(scaling)
        row.append("n/a" if t.peak is None else gib(t.peak))
        rows.append(row)
    how = "bf16, compiled, fused AdamW" if gpu else "fp32, eager (CPU smoke run)"
    print(f"\nnanoGPT ({os.path.abspath(path)}) against train.py's headline: {config.n_layer} layers, B={B} T={T} "
          f"per rank, vocab 50304, {how}, clip 1.0; {plan.rounds} rounds of {plan.steps} steps")
    print_table(headers, rows)
    if world == 1:
        return f"nanogpt: the headline makes {speedup(times, 'ours, the headline', base)} nanoGPT's tokens/s"
    ours = f"ours, {ranks_text(world, gpu)}"
    return (f"nanogpt: on {ranks_text(world, gpu)} ours makes {speedup(times, ours, base)} nanoGPT + DDP's tokens/s; "
            f"scaling {speedup(times, ours, spans[ours][1], work=world)} (ours), "
            f"{speedup(times, base, spans[base][1], work=world)} (nanoGPT + DDP) of its step on {ranks_text(1, gpu)}")


# --- 3. the sweep: forward / forward+backward / train step by model, vocab, batch, context, precision and compile
MODES = ("forward", "forward-backward", "train")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --precisions NAME: autocast's dtype
COMPILE_MODES = ("eager", "compiled")

def mode_flops(config, T, mode):
    # the forward does 2 of the 6 per matmul parameter, plus the output layer's backward (4) when fused
    train = flops_per_token(config, T)
    if mode != "forward":
        return train
    return train / 3 + (4 * config.vocab_size * config.n_embd if config.fused_ce else 0)

def cell_name(name, vocab, B, T, precision, compile_mode):  # one configuration, as every table and note names it
    return f"{name} V={vocab} B={B} T={T} {precision} {compile_mode}"

def sweep_step(benches, config, s, mode, B, T, device):
    """A cell's step: the first cell of a vocabulary and precision builds the model its other cells share, eager and
    compiled alike (a compiled cell calls the same model through torch.compile: one model's memory, not two)."""
    key = (s["vocab"], s["dtype"])
    if key not in benches:
        benches[key] = build(config, {**s, "compile": False}, device)
    bench = benches[key]
    if s["compile"]:  # Dynamo caches its graphs by the model's code: each cell's wrapper reuses them
        bench = replace(bench, runner=compile_model(bench.model))
    return partial(run_step, mode, bench, *batch_of(B, T, device))

def held_by(benches, key):  # bytes the model of this (vocabulary, dtype) keeps, for gpt.lazily
    return held_bytes(benches.get(key))

def flag_settings(plan, vocab, variant):
    """The sweep's, warm-up table's and profile's step: train.py's with these flags (fused loss, norms, biases on),
    in one variant: (precision, compile mode)."""
    precision, compile_mode = variant
    dtype = PRECISIONS[precision]
    return {**FIRST_RUNG, "tf32": plan.tf32, "dtype": dtype, "attn": plan.attn, "vocab": vocab,
            "compile": compile_mode == "compiled", "fused_ce": True, "fused_norms": True, "fused_bias": True,
            "cublas_workspace": False, "embedding_into_dw": True, "adamw_kernel": True,
            "master": dtype == torch.bfloat16}  # as train.py --bf16 in one process

def sweep_cells(name, config, plan, device):
    """{(vocab, batch, seq, precision, compile mode, mode): variant}, one model per vocabulary and precision shared
    by its cells. Train cells warm up first, so AdamW's state exists and every cell's peak counts it. Without
    warm-up every model is built here, before the timer starts: the first round pays for the rest (allocation,
    compilation)."""
    benches, variants = {}, {}
    train_first = sorted(plan.modes, key="train".__ne__)
    for vocab, B, T, variant, mode in product(plan.vocab, plan.batch, plan.seq, plan.variants, train_first):
        s = flag_settings(plan, vocab, variant)
        make = partial(sweep_step, benches, config, s, mode, B, T, device)
        key = (vocab, B, T, *variant, mode)
        if plan.warmup == 0:
            variants[key] = make()
            continue
        note = f"  {cell_name(name, vocab, B, T, *variant)} {mode}"
        if s["compile"]:
            note += " (compiling...)"
        variants[key] = lazily(make, device, held=partial(held_by, benches, (vocab, s["dtype"])), note=note)
    return variants

def fresh_compiler(plan):
    """Before each model: Dynamo's caches emptied (another model's graphs are of no use), one graph per shape (no
    dynamic-shape kernels), and room for every shape and precision (past the limit Dynamo runs eager, silently)."""
    if "compiled" not in plan.compiles:
        return
    torch._dynamo.reset()
    torch._dynamo.config.automatic_dynamic_shapes = False
    shapes = len(plan.vocab) * len(plan.batch) * len(plan.seq) * len(plan.precisions)
    torch._dynamo.config.recompile_limit = max(8, shapes)

def run_sweep(plan, configs, device, results):
    """One gpt.time_rounds per model: its cells' speed-ups are paired. Each model's result goes into results as it
    finishes, so that an interrupted sweep can still print the models done."""
    for name, config in configs:
        fresh_compiler(plan)
        variants = sweep_cells(name, config, plan, device)
        print(f"{name}: timing {len(variants)} cells together", file=sys.stderr, flush=True)
        times, peaks = timed(variants, device, plan)
        results.append((name, times, summarize(times, peaks=peaks)))
        del variants  # and the models with them
        free_memory()

def sweep_line(configs, plan, profiled):
    """The sweep's size, said before it starts; with --profile, how many configurations follow."""
    sizes = {"model": len(configs), "vocab": len(plan.vocab), "batch": len(plan.batch), "seq": len(plan.seq),
             "precision": len(plan.precisions), "compile": len(plan.compiles), "mode": len(plan.modes)}
    cells = 1
    for n in sizes.values():
        cells *= n
    line = f"sweep: {cells} cells ({' x '.join(f'{what} {n}' for what, n in sizes.items())})"
    if profiled:
        line += f", then {cells // len(plan.modes)} configurations profiled (every mode of each)"
    return line

def print_sweep(plan, results, device):
    base = (plan.vocab[0], plan.batch[0], plan.seq[0])
    headers = ["model", "vocab", "batch", "seq", "precision", "compile", "mode", "ms/step, median (min-max)",
               "ms/step, mean ± std", "tokens/s", "MFU", "peak alloc (GiB)",
               f"speed-up vs V={base[0]} B={base[1]} T={base[2]}"]
    table, split, done = [], [], []
    for name, times, stats in results:
        config = make_config(name)
        for vocab, B, T, variant, mode in product(plan.vocab, plan.batch, plan.seq, plan.variants, plan.modes):
            key, first = (vocab, B, T, *variant, mode), (*base, *variant, mode)
            t, cells = stats[key], [name, vocab, B, T, *variant, mode]
            if t is None:
                table.append([*cells, "OOM", "OOM", "OOM", "n/a", "OOM", "n/a"])
                continue
            tok_s = B * T / (t.median / 1e3)
            done.append((tok_s, mode, cell_name(name, vocab, B, T, *variant)))
            flops = mode_flops(config, T, mode) * tok_s  # useful work: padding is not counted
            # the speed-up is in tokens per second: per round, (B*T / ms) over the first cell's
            table.append([*cells, t.ms(), t.mean_std(), f"{tok_s:,.0f}", fmt_mfu(mfu(flops, device)),
                          "n/a" if t.peak is None else gib(t.peak),
                          "-" if key == first else speedup(times, key, first, B * T / (base[1] * base[2]))])
            if mode == "train" and len(plan.modes) == 3:
                split.append([cell_name(name, vocab, B, T, *variant), *step_split(times, key[:-1])])
    print(f"\nsweep, {plan.rounds} rounds of {plan.steps} steps per cell after {plan.warmup} warm-up steps "
          "(speed-up: tokens/s over the first shape's cell of the same variant and mode, paired per round)")
    print_table(headers, table)
    if split:
        print("\nwhere a train step's time goes (paired per round: backward = forward-backward - forward, "
              "optimizer = train - forward-backward; the fused linear-CE computes the output layer's "
              "gradients in the forward; noise: the part's median came out below 0, the rounds moving by more than "
              "it weighs, as a host-bound eager step's do on a busy host: more --rounds, or a quiet host)")
        print_table(["config", "forward ms", "backward ms", "optimizer ms", "train step ms"], split)
    if len(plan.variants) > 1:
        print_variants(plan, results)
    if not done:
        return f"every one of {len(table)} cells ran out of memory"
    tok_s, mode, cell = max(done, key=lambda d: (MODES.index(d[1]), d[0]))
    return f"best {mode} throughput: {tok_s:,.0f} tokens/s ({cell}); {len(table) - len(done)} OOM"

def step_split(times, cell):
    """Median over rounds of forward, backward and optimizer, from the three modes' times in each round; cell:
    (vocab, batch, seq, precision, compile mode)."""
    f, fb, tr = (times.get((*cell, m)) for m in MODES)
    if None in (f, fb, tr):
        return ["n/a"] * 4
    parts = [f, [b - a for a, b in zip(f, fb)], [c - b for b, c in zip(fb, tr)]]
    total = statistics.median(tr)
    cells = []
    for part in parts:
        ms = statistics.median(part)
        if ms < 0:  # a later mode timed faster than the one it contains: the rounds disagree by more than this part
            cells.append(f"noise ({ms:.2f})")
        else:
            cells.append(f"{ms:.2f} ({100 * ms / total:.0f}%)")
    return [*cells, f"{total:.2f}"]

def print_variants(plan, results):
    """The course's fp32 against bf16 and eager against compiled: each variant against the first, shape by shape and
    mode by mode, in the same rounds (the speed-up: the first's ms over its own, median (min-max) of the rounds)."""
    base = plan.variants[0]
    headers = ["model", "vocab", "batch", "seq", "precision", "compile"]
    for mode in plan.modes:
        headers += [f"{mode} ms", f"{mode} speed-up"]
    rows = []
    for name, times, stats in results:
        for vocab, B, T, variant in product(plan.vocab, plan.batch, plan.seq, plan.variants):
            row = [name, vocab, B, T, *variant]
            for mode in plan.modes:
                key, first = (vocab, B, T, *variant, mode), (vocab, B, T, *base, mode)
                row.append("OOM" if stats[key] is None else f"{stats[key].median:.2f}")
                row.append("-" if variant == base else speedup(times, key, first))
            rows.append(row)
    print(f"\nprecision and compile: every variant against {' '.join(base)}, median ms a step and the speed-up "
          "(paired per round: median (min-max) of its ratios)")
    print_table(headers, rows)


# --- 4. the warm-up table: what a model's first steps pay for, and how many warm-up steps to skip
# Each row builds a fresh model (and optimizer) and gives its caching allocator's blocks back first, then runs
# 0, 1 or 2 untimed steps and times the next ones one by one: the benchmarking script's question, measured.
WARMUPS, FIRST_STEPS = (0, 1, 2), 3

def step_times(step, n, device):
    """ms of each of n steps, timed one by one: CUDA events and a sync after each (perf_counter on the CPU)."""
    synchronize(device)  # nothing queued before the first step's start
    times = []
    for _ in range(n):
        start = clock(device)
        step()
        times.append(elapsed_ms(start, clock(device)))  # waits for the step: the next starts on an idle GPU
    return times

def warmup_row(config, s, mode, warmup, settled, x, y, device):
    """[step 1..FIRST_STEPS ms], [settled ms] of a fresh model after `warmup` untimed steps."""
    free_memory()  # the allocator's cached blocks go back: this model's first step allocates afresh
    if warmup == 0:
        torch._dynamo.reset()  # and, compiled, compiles afresh (later rows reuse the compiled graphs)
    bench = build(config, s, device)
    step = partial(run_step, mode, bench, x, y)
    for _ in range(warmup):
        step()
    ms = step_times(step, FIRST_STEPS + settled, device)
    return ms[:FIRST_STEPS], ms[FIRST_STEPS:]

def run_warmup_table(name, config, plan, settled, device):
    B, T, cuda = plan.batch[0], plan.seq[0], device.type == "cuda"
    s = flag_settings(plan, plan.vocab[0], plan.variants[0])  # one variant: checked with the flags
    x, y = batch_of(B, T, device)
    # once a process: a throwaway eager model's first steps (CUDA context, cuBLAS/cuDNN handles and plans, kernels
    # loaded at first use), so that the rows below show what each new model pays
    first = warmup_row(config, {**s, "compile": False}, "train", 0, 0, x, y, device)[0]
    rows, ratios = [], {}
    for mode, warmup in product(plan.modes, WARMUPS):
        print(f"  {mode}, {warmup} warm-up steps", file=sys.stderr, flush=True)
        head, rest = warmup_row(config, s, mode, warmup, settled, x, y, device)
        settled_steps = summarize({"settled": rest})["settled"]  # the timer's statistics: mean and sample std
        ratios[(mode, warmup)] = head[0] / settled_steps.mean  # the row's last column, and what the summary reads
        rows.append([mode, warmup, *[f"{ms:.2f}" for ms in head], settled_steps.mean_std(),
                     f"{ratios[(mode, warmup)]:.2f}x"])
    where = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"\nwarm-up: {name} B={B} T={T}, {where}; each row a fresh model; steps timed one by one "
          f"(synchronized); settled: mean ± std of the {settled} steps after step {FIRST_STEPS}")
    print(f"process start-up (before the table): its first eager train step took {first[0]:.2f} ms, the next "
          f"{first[1]:.2f} ms")
    print_table(["mode", "warm-up steps", *[f"step {i + 1} (ms)" for i in range(FIRST_STEPS)],
                 "settled (ms), mean ± std", "step 1 / settled"], rows)
    print(first_steps_pay_for(cuda, s["compile"]))
    return "warm-up table: step 1 without warm-up takes " + ", ".join(
        f"{ratios[(m, 0)]:.2f}x ({m})" for m in plan.modes) + " a settled step; " + needed_warmup(ratios, plan.modes)

def first_steps_pay_for(cuda, compiled):
    """The line under the table: what the first steps of a model, and of the process, spend time on."""
    if not cuda:
        return ("the first steps pay for: memory the allocator has not yet mapped and AdamW's state (created by the "
                "first optimizer step); on a GPU also cuBLAS/cuDNN setup, kernel loading and, compiled, compilation")
    what = ("the first steps pay for: cudaMalloc of memory the caching allocator has not yet cached, AdamW's state "
            "(created by the first optimizer step), cuBLAS/cuDNN plan and algorithm choice for new shapes")
    if compiled:
        what += ("; compiled: Dynamo tracing and Inductor compiling and autotuning its kernels (step 1 of the "
                 "first row per mode; Inductor's on-disk cache makes a repeat cheaper)")
    return what + ("; train.py's compiled run on one GPU also captures CUDA graphs in its first steps (not "
                   "measured here); once a process: CUDA context, library handles, kernel loading (line above)")

def needed_warmup(ratios, modes):
    """From the table's step 1 / settled column, {(mode, warm-up steps): ratio}: the fewest warm-up steps after which
    step 1 is within 10% of the settled mean (above or below: a step 1 at 0.5x is no settled step either) in every
    mode, or that no row's is."""
    for warmup in WARMUPS:
        if all(abs(ratios[(mode, warmup)] - 1) <= 0.1 for mode in modes):
            return f"after {warmup} warm-up step(s) step 1 is within 10% of settled"
    shown = ", ".join(f"{ratios[(mode, warmup)]:.2f}x" for mode in modes for warmup in WARMUPS)
    counts = f"{', '.join(map(str, WARMUPS[:-1]))} or {WARMUPS[-1]}"
    return (f"with {counts} warm-up steps, step 1 is never within 10% of settled in every mode (step 1 / settled, "
            f"row by row: {shown})")


# --- 5. the output layer's GEMMs alone: why vocab 50304 beats 50257
# GPT-2's 50257 (odd), nearby multiples of 2..16, 50304 (= 128 * 393) and wider multiples of 64 and 128
GEMM_VOCABS = (50257, 50258, 50260, 50264, 50272, 50280, 50288, 50296, 50304, 50368, 50432, 51200)

def gemm_variants(tokens, K, dtype, device, vocabs=GEMM_VOCABS):
    """logits = x W^T, dx = dlogits W and dW = dlogits^T x, one variant per vocabulary width. Tensor cores
    read tiles of 8/16/64/128 elements: an odd width needs masked edge tiles and slower kernels throughout."""
    x = torch.randn(tokens, K, device=device, dtype=dtype)

    def make(V):
        w = torch.randn(V, K, device=device, dtype=dtype)
        g = torch.randn(tokens, V, device=device, dtype=dtype)
        return lambda: (x @ w.t(), g @ w, g.t() @ x)
    return {V: lazily(partial(make, V), device) for V in vocabs}

def gemm_microbench(tokens, K, dtype, device, plan):
    dtype = dtype or torch.float32
    plan = replace(plan, warmup=max(1, plan.warmup))  # a variant's first call allocates its matrices
    times, _ = timed(gemm_variants(tokens, K, dtype, device), device, plan)
    stats, base = summarize(times), GEMM_VOCABS[0]
    rows = [[V, V & -V, "OOM", "n/a", "n/a"] if t is None else
            [V, V & -V, t.ms(3), f"{6 * tokens * K * V / (t.median / 1e3) / 1e12:.3g}",
             "-" if V == base else speedup(times, V, base, V / base)] for V, t in stats.items()]
    print(f"\noutput-layer GEMMs alone (forward + 2 backward): {tokens} tokens x {K} x vocab, "
          f"{str(dtype).replace('torch.', '')}, {plan.rounds} rounds")
    print_table(["vocab", "largest 2^k factor", "ms, median (min-max)", "TFLOP/s", f"FLOP/s vs {base} (paired)"], rows)
    free_memory()


# --- 6. --profile: top kernels, time by category, naive attention's softmax vs matmuls
NAIVE_RANGES = ("attention scores", "softmax", "final matmul")  # record_function names in gpt.py

def kernel_times(prof, cuda):
    """[(name, calls, us)], slowest first: GPU kernels, or CPU ops' self time. User ranges would count twice."""
    out = []
    for e in prof.key_averages():
        if getattr(e, "is_user_annotation", False) or e.key in NAIVE_RANGES or e.key.startswith("ProfilerStep"):
            continue
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.key, e.count, e.self_device_time_total))
        elif not cuda and e.device_type == torch.autograd.DeviceType.CPU:
            out.append((e.key, e.count, e.self_cpu_time_total))
    return sorted((k for k in out if k[2] > 0), key=lambda k: -k[2])

GROUPS = ("matmul", "attention", "cross-entropy", "normalization", "element-wise", "optimizer", "copies")

def category(name):
    """A kernel's or op's group, by its name (Inductor names a fused kernel after its ops)."""
    n = name.lower()
    if any(s in n for s in ("flash", "fmha", "attention", "sdpa", "attn", "cudnn")):  # cuDNN: SDPA's helpers too
        return "attention"
    if any(s in n for s in ("adam", "multi_tensor")):
        return "optimizer"
    if any(s in n for s in ("gemm", "xmma", "nvjet", "cutlass", "matmul", "aten::mm", "aten::addmm",
                            "aten::bmm", "triton_tem", "splitk", "scaled_mm")):
        return "matmul"
    if any(s in n for s in ("cross_entropy", "nll_loss", "log_softmax")):
        return "cross-entropy"
    if any(s in n for s in ("layer_norm", "layernorm")):
        return "normalization"
    if "gelu" in n:  # Inductor's bias + GELU kernel is named triton_..._to_copy_add_gelu: element-wise, not a copy
        return "element-wise"
    if any(s in n for s in ("memcpy", "memset", "copy", "fill_", "zero_", "aten::cat", "clone", "transpose")):
        return "copies"
    return "element-wise"

def category_times(prof, cuda):
    """{group: us}. All inside the optimizer's profiler range counts as optimizer: on the CPU AdamW is plain
    elementwise ops a name cannot tell apart. On the GPU an op's kernels are those it launched; kernel time
    linked to no CPU op goes to its group by name."""
    sums = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or e.is_async:
            continue
        parent, in_optimizer = e, False
        while parent is not None and not in_optimizer:
            in_optimizer, parent = parent.name.startswith("Optimizer.step"), parent.cpu_parent
        if cuda:
            work = [(k.name, k.duration) for k in e.kernels]
        else:  # an aten op's own time; the ranges around ops would count it twice
            work = [(e.name, e.self_cpu_time_total)] if e.name.startswith("aten::") else []
        for name, us in work:
            key = "optimizer" if in_optimizer else category(name)
            sums[key] = sums.get(key, 0.0) + us
    if cuda:  # kernels no CPU op launched (a CUDA graph's replay, some of Inductor's): by name
        linked = {}
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CPU or e.is_async:
                continue
            for k in e.kernels:
                linked[k.name] = linked.get(k.name, 0.0) + k.duration
        for name, _, us in kernel_times(prof, cuda):
            if us - linked.get(name, 0.0) > 0:
                sums[category(name)] = sums.get(category(name), 0.0) + us - linked.get(name, 0.0)
    return sums

def group_floors(config, B, T, fused_ce):
    """(FLOPs, bytes) each group cannot do with less, per bf16 train step. Matmuls and attention: their FLOPs
    (gpt.flops_per_token's terms, causal attention halved). The rest is memory-bound: bytes read and written
    once, residual stream fp32, matmul inputs bf16 (N tokens, width d, MLP width f, L layers, P parameters).
    LayerNorm reads 4 and writes 2 bytes an element forward, reads 6 and writes 4 backward (2L + 1 of them);
    GELU reads and writes 2 forward, reads 4 and writes 2 backward; the 2L residual adds read 8, write 4; the
    loss reads the bf16 logits and writes their gradient (unfused, once more); fused AdamW reads weight,
    gradient and moments and writes three (28 bytes a parameter); copies cast fp32 weights to bf16 (4 + 2)."""
    N, d, f, L, V = B * T, config.n_embd, config.d_ff, config.n_layer, config.vocab_size
    P = L * (4 * d * d + 2 * d * f + 9 * d + f) + V * d + config.block_size * d + 2 * d
    matmul = 6 * N * (L * (4 * d * d + 2 * d * f) + V * d)
    return {"matmul": (matmul, 0), "attention": (6 * L * d * T * N, 0),
            "cross-entropy": (0, N * V * (4 if fused_ce else 8)), "normalization": (0, 16 * N * d * (2 * L + 1)),
            "element-wise": (0, 10 * N * f * L + 12 * N * d * 2 * L), "optimizer": (0, 28 * P), "copies": (0, 6 * P)}

def copy_bandwidth(device):
    """Bytes per second (read + write) a 1 GiB device copy moves: the memory roof."""
    a, b = (torch.empty(2**29, dtype=torch.bfloat16, device=device) for _ in range(2))
    ms = statistics.median(time_rounds({"copy": lambda: b.copy_(a)}, device, rounds=10, steps=5)[0]["copy"])
    return 2 * a.nbytes / (ms / 1e3)

def naive_attention_rows(prof, config, B, T, steps, cuda, dtype):
    """Forward only (gpt.naive_attention's ranges), each stage against its work: the two matmuls at the TFLOP/s
    they reach; the softmax does few FLOPs but reads and writes the whole (T, T) matrix, memory-bound, so at the
    GB/s it moves. Its time share far exceeds its FLOP share."""
    times = {}
    for e in prof.key_averages():
        if e.key in NAIVE_RANGES and e.device_type == torch.autograd.DeviceType.CPU:
            times[e.key] = times.get(e.key, 0.0) + (e.device_time_total if cuda else e.cpu_time_total)
    if len(times) < len(NAIVE_RANGES):
        return None  # compiled: the ranges are gone
    scores = config.n_layer * B * config.n_head * T * T  # elements of all score matrices
    head = config.n_embd // config.n_head
    # matmuls: 2 FLOPs per multiply-add, scores also scaled and masked (2 per element); softmax 5 per element
    flops = {"attention scores": scores * (2 * head + 2), "softmax": 5 * scores, "final matmul": 2 * scores * head}
    size = torch.finfo(dtype or torch.float32).bits // 8  # the scores' bytes an element
    # the softmax reads the scores once and writes the probabilities once: in fp32 on a GPU (autocast runs the
    # softmax in fp32), in the scores' dtype on the CPU
    softmax_bytes = scores * (size + (4 if cuda else size))
    t_all, f_all = sum(times.values()) or 1, sum(flops.values())
    rows = []
    for k in NAIVE_RANGES:
        seconds = times[k] / 1e6 / steps  # a step's
        achieved = "n/a"  # a range the clock saw no time in
        if seconds and k == "softmax":
            achieved = f"{softmax_bytes / seconds / 1e9:,.1f} GB/s"
        elif seconds:
            achieved = f"{flops[k] / seconds / 1e12:.3g} TFLOP/s"
        rows.append([k, f"{times[k] / 1e3 / steps:.3f}", f"{flops[k] / 1e9:.3g}", achieved,
                     f"{100 * times[k] / t_all:.1f}%", f"{100 * flops[k] / f_all:.2f}%",
                     f"{(times[k] / t_all) / (flops[k] / f_all):.1f}"])
    return rows

def profile_steps(bench, B, T, device, warmup, steps):
    from torch.profiler import ProfilerActivity, profile
    # Kineto, the profiler's library, prints "USDT: ... profiler_start/stop" at each profile unless its log level is
    # above every level (6); it is read when the first profile starts
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    x, y = batch_of(B, T, device)
    for _ in range(warmup):  # compile, allocate and tune before anything is recorded
        run_step("train", bench, x, y)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profs = {}
    for mode in MODES:  # train last: its wall time is the step's
        with profile(activities=activities) as profs[mode]:
            synchronize(device)
            start = clock(device)
            for _ in range(steps):
                run_step(mode, bench, x, y)
            end = clock(device)
            synchronize(device)
        profs["wall_ms"] = elapsed_ms(start, end) / steps  # (the train steps', recorded last)
    return profs

def print_groups(groups, wall_ms, bench, B, T, steps, device, bandwidth):
    """The train step by group against each group's limit here (FLOPs at the bf16 peak, bytes at the copy
    bandwidth, None on the CPU). Idle: the step's wall time no kernel filled (the GPU waiting for the CPU)."""
    peak, cuda = gpu_peak_flops(device), device.type == "cuda"
    floors, busy = group_floors(bench.config, B, T, bench.config.fused_ce), sum(groups.values()) / 1e3 / steps
    rows = []
    for group in GROUPS:
        ms, (flops, nbytes) = groups.get(group, 0.0) / 1e3 / steps, floors[group]
        floor = None  # ms at the limit
        if peak and bandwidth:
            floor = (flops / peak if flops else nbytes / bandwidth) * 1e3
        limit = f"{flops / 1e9:,.0f} GFLOP at the bf16 peak" if flops else f"{nbytes / 1e9:,.2f} GB at copy speed"
        rows.append([group, f"{ms:.2f}", f"{100 * ms / wall_ms:.1f}%", limit, "n/a" if floor is None else
                     f"{floor:.2f}", "n/a" if floor is None or not ms else f"{ms / floor:.1f}x"])
    idle = max(0.0, wall_ms - busy) if cuda else None
    rows.append(["idle (no kernel running)", "n/a" if idle is None else f"{idle:.2f}",
                 "n/a" if idle is None else f"{100 * idle / wall_ms:.1f}%", "0", "0", "-"])
    where = (f"peak {peak / 1e12:.0f} TFLOP/s bf16, copy {bandwidth / 1e9:.0f} GB/s measured" if peak and bandwidth
             else "limits n/a: no known GPU")
    print(f"\ntime by category: the train step ({wall_ms:.2f} ms wall per step, {where})")
    print_table(["group", "ms/step", "share of step", "its limit", "ms at the limit", "x its limit"], rows)

def idle_gaps(prof, steps, long_us=20.0):
    """(ms of short gaps, ms of long gaps, long gaps) per step between the GPU's kernels, from the first to the last.
    A gap under long_us is the launch latency between one kernel and the next, a longer one the GPU waiting for
    the CPU (Python, a launch, a synchronization); CUDA graphs remove the second kind, not the first."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    short, long, count = 0.0, 0.0, 0
    busy_until = spans[0][1] if spans else 0.0
    for start, end in spans[1:]:  # kernels on several streams may overlap: a gap is time no kernel runs
        gap = start - busy_until
        if gap >= long_us:
            long, count = long + gap, count + 1
        elif gap > 0:
            short += gap
        busy_until = max(busy_until, end)
    return short / 1e3 / steps, long / 1e3 / steps, count / steps

def top_kernel(ks, steps):
    """A profile's summary cells: its top kernel (or CPU op), calls a step, its share, the share of all but matmuls."""
    if not ks:
        return ["n/a"] * 4
    total = sum(us for _, _, us in ks)
    name, calls, us = ks[0]
    other = sum(us for n, _, us in ks if category(n) != "matmul")
    return [name[:48], f"{calls / steps:g}", f"{100 * us / total:.1f}%", f"{100 * other / total:.1f}%"]

def print_profile(profs, bench, B, T, steps, device, trace, bandwidth, top=10):
    """One configuration's tables (its top kernels, the train step by group, naive attention's stages) and trace;
    returns its cells of the summary."""
    cuda, kind = device.type == "cuda", "kernels" if device.type == "cuda" else "CPU ops"
    ks = {mode: kernel_times(profs[mode], cuda) for mode in MODES}
    total = {mode: sum(us for _, _, us in ks[mode]) or 1 for mode in MODES}  # us in all its steps
    for title, mode in ((f"forward {kind}", "forward"), (f"train step {kind} (forward, backward, AdamW)", "train")):
        print(f"\n{title}: top {top} of {len(ks[mode])}, {total[mode] / 1e3 / steps:.2f} ms per step in all")
        print_table(["name", "calls/step", "ms/step", "share"],
                    [[n[:80], f"{c / steps:g}", f"{us / 1e3 / steps:.3f}", f"{100 * us / total[mode]:.1f}%"]
                     for n, c, us in ks[mode][:top]])
    print_groups(category_times(profs["train"], cuda), profs["wall_ms"], bench, B, T, steps, device, bandwidth)
    if cuda:
        short, long, count = idle_gaps(profs["train"], steps)
        print(f"idle between kernels: {short:.2f} ms a step in gaps under 20 us (launch latency), {long:.2f} ms in "
              f"{count:.1f} longer gaps a step (the GPU waiting for the CPU)")
    if bench.config.attn == "naive":
        rows = naive_attention_rows(profs["forward"], bench.config, B, T, steps, cuda, bench.dtype)
        print(f"\nnaive attention, forward, all {bench.config.n_layer} layers: each stage's time against its work")
        if rows is None:
            print("(the record_function ranges were not recorded: compiled model)")
        else:
            print_table(["stage", "ms/step", "GFLOP/step", "achieved", "time share", "FLOP share",
                         "time share / FLOP share"], rows)
    if trace:
        profs["train"].export_chrome_trace(trace)
        print(f"\nwrote the train-step trace to {trace} (open it in ui.perfetto.dev or chrome://tracing)")
    forward, backward = total["forward"], total["forward-backward"] - total["forward"]
    backward_cell = f"{backward / 1e3 / steps:.2f}"
    if backward < 0:  # two recordings: on a busy CPU their ops' times can differ by more than the backward's
        backward_cell = "n/a (noise)"
    return [*top_kernel(ks["forward"], steps), *top_kernel(ks["train"], steps), f"{forward / 1e3 / steps:.2f}",
            backward_cell]

def profile_configs(configs, plan):
    """[(name, config, (vocab, batch, seq, precision, compile mode))]: every configuration of the sweep, in order."""
    return [(name, config, (vocab, B, T, *variant)) for (name, config), vocab, B, T, variant
            in product(configs, plan.vocab, plan.batch, plan.seq, plan.variants)]

def trace_paths(path, configs, plan):
    """A trace file per profile_configs: PATH for one configuration; for several, PATH with the model's name and each
    value the sweep varies (e2e.json -> e2e_small_T512.json)."""
    todo = profile_configs(configs, plan)
    if len(todo) == 1:
        return [path]
    stem, ext = os.path.splitext(path)
    varies = [len(values) > 1 for values in (plan.vocab, plan.batch, plan.seq, plan.precisions, plan.compiles)]
    paths = []
    for name, _, cell in todo:
        parts = [f"{tag}{value}" for tag, value, shown in zip(("V", "B", "T", "", ""), cell, varies) if shown]
        paths.append("_".join([stem, name, *parts]) + ext)
    return paths

def run_profile(name, config, cell, plan, device, trace, bandwidth, top):
    """One configuration's profile: its model built afresh, warmed up (compiled), then each mode recorded."""
    vocab, B, T, precision, compile_mode = cell
    s = flag_settings(plan, vocab, (precision, compile_mode))
    what = "CPU time of each op (no GPU: ops, not kernels)"
    if device.type == "cuda":
        what = "GPU kernel time"
    print(f"\nprofile of {cell_name(name, *cell)}, {plan.steps} steps of each mode: {what}")
    fresh_compiler(plan)
    if s["compile"]:
        print(f"  {cell_name(name, *cell)}: compiling...", file=sys.stderr, flush=True)
    bench = build(config, s, device)
    profs = profile_steps(bench, B, T, device, plan.warmup, plan.steps)
    return print_profile(profs, bench, B, T, plan.steps, device, trace, bandwidth, top)

def run_profiles(configs, plan, device, traces):
    """Every configuration's profile, one after another, then the summary table: a row each (OOM: said in its row,
    and the next goes on)."""
    todo = profile_configs(configs, plan)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None  # the memory roof, measured once
    top = 10 if len(todo) == 1 else 5  # several configurations: shorter tables, the summary compares them
    unit = "kernel" if device.type == "cuda" else "op"
    headers = ["configuration", f"forward: top {unit}", "calls/step", "its share", "non-matmul share",
               f"train step: top {unit}", "calls/step", "its share", "non-matmul share", "forward ms", "backward ms"]
    rows = []
    for i, ((name, config, cell), trace) in enumerate(zip(todo, traces)):
        PROGRESS["stage"] = f"profile {i + 1} of {len(todo)} ({cell_name(name, *cell)})"  # said if interrupted
        row = None
        try:
            row = run_profile(name, config, cell, plan, device, trace, bandwidth, top)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
        if row is None:
            print(f"\n{cell_name(name, *cell)}: out of memory (OOM); the next configuration goes on")
            row = ["OOM"] + ["-"] * (len(headers) - 2)
        rows.append([cell_name(name, *cell), *row])
        free_memory()  # outside the except block, whose traceback held the tensors
    PROGRESS["stage"] = ""
    print(f"\nprofile summary, a row per configuration: {unit} time ({unit}s' own, summed) in {plan.steps} steps of "
          f"each mode; shares of the mode's {unit} time; backward = forward-backward less forward")
    print_table(headers, rows)


# --- 7. command line
def starts_with(magic):
    def ours(path):
        with open(path, "rb") as f:
            return f.read(64).lstrip().startswith(magic)
    return ours

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ladder", action="store_true", help="the GPT-2 speed ladder, every rung in the same rounds")
    p.add_argument("--plot", type=plot_path, help="with --ladder: draw ms per rung into this figure (.png, .pdf, "
                   ".svg, ...: the name's extension; needs matplotlib)")
    p.add_argument("--rungs", type=int_list(1, len(LADDER)), help=f"with --ladder: time only these rungs, by "
                   f"the table's numbers (1-{len(LADDER)}; a lever past the headline needs it, {HEADLINE_NUMBER})")
    p.add_argument("--nanogpt", metavar="PATH", help="time nanoGPT's model.py (a checkout of karpathy/nanoGPT) "
                   "against train.py's headline, in the same rounds (default 30 rounds of 3 steps)")
    p.add_argument("--warmup-table", action="store_true", help="step 1, 2, 3 and the settled step (mean ± std of "
                   "--steps more) after 0, 1 and 2 warm-up steps, each step timed alone; a fresh model each row")
    p.add_argument("--model", help=f"comma list of {', '.join(PRESETS)} (default small; ladder gpt2; CPU tiny)")
    p.add_argument("--batch", type=int_list(1), help="comma list (default 8; ladder 16; CPU 2)")
    p.add_argument("--seq", type=int_list(1), help="comma list of context lengths (default 512; ladder 1024; CPU 64)")
    p.add_argument("--vocab", type=int_list(GPT2_VOCAB, 1 << 20), help="comma list of vocabulary sizes (default "
                   "50257); 2+ add the output-GEMM benchmark")
    p.add_argument("--mode", choices=(*MODES, "all"), help="what one step does: the forward (autograd on), forward "
                   "and backward, or the train step with AdamW (default all)")
    p.add_argument("--rounds", type=int_in(1), help="timed rounds (default 10; ladder 20; CPU 3)")
    p.add_argument("--steps", type=int_in(1), help="steps per variant per round (default 3; ladder 2; CPU 1); "
                   "--warmup-table: settled steps (default 20; CPU 5)")
    p.add_argument("--warmup", type=int_in(0), help="untimed steps per variant first (default 3; CPU 1); 0: the "
                   "first round pays for allocation and compilation, peaks n/a")
    p.add_argument("--tf32", action="store_true", help="TF32 tensor cores for fp32 matmuls")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--fp16", action="store_true", help="fp16 autocast with a GradScaler")
    p.add_argument("--compile", action="store_true", help="gpt.compile_model (without CUDA graphs: a forward-only "
                   "step would leave a graph's backward pending)")
    p.add_argument("--precisions", type=name_list(PRECISIONS, "precision"), help="comma list of fp32, bf16, fp16: "
                   "every cell in each, in the same rounds, and a table of each against the first (instead of "
                   "--bf16 / --fp16)")
    p.add_argument("--compile-modes", type=name_list(COMPILE_MODES, "compile mode"), help="comma list of eager, "
                   "compiled: as --precisions, eager against compiled (instead of --compile)")
    p.add_argument("--attn", default="sdpa", choices=ATTENTION)
    p.add_argument("--profile", action="store_true", help="torch.profiler view of every configuration of the sweep, "
                   "then a summary table with a row each")
    p.add_argument("--trace", help="write each profiled configuration's train steps as a Chrome/Perfetto trace "
                   "(implies --profile; several configurations: e2e.json -> e2e_small_T512.json, ...)")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges (forward, backward, optimizer step; naive "
                   "attention's stages) for nsys profile --trace=cuda,nvtx; CUDA only, ignored on the CPU")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if present)")
    return p.parse_args(argv)

def check_combinations(args, n_models, cpu):
    """Flags that do not go together, refused before any model is built."""
    single = n_models == 1 and len(args.batch or [1]) == 1 and len(args.seq or [1]) == 1
    variants = len(args.precisions or [1]) * len(args.compile_modes or [1])
    tuned = (args.profile or args.trace or args.mode or args.compile or args.bf16 or args.fp16 or args.tf32
             or args.vocab or args.attn != "sdpa" or args.precisions or args.compile_modes)
    for flag, names in (("--precisions", args.precisions), ("--compile-modes", args.compile_modes)):
        if names and len(set(names)) < len(names):
            fail(f"{flag} {','.join(names)} names one twice")
    if args.precisions and (args.bf16 or args.fp16):
        fail("--precisions lists the precisions to run; drop --bf16 and --fp16")
    if args.compile_modes and args.compile:
        fail("--compile-modes lists eager and/or compiled; drop --compile")
    if cpu and (args.fp16 or "fp16" in (args.precisions or [])):
        fail("fp16 (--fp16, --precisions fp16) needs a CUDA GPU (its GradScaler); use bf16 on the CPU")
    if cpu and args.attn in GPU_ONLY_ATTENTION:
        fail(f"--attn {args.attn} needs a CUDA GPU")
    if args.ladder and not single:
        fail("--ladder takes one --model, one --batch and one --seq")
    if args.ladder and tuned:
        fail("--ladder sets precision, attention, vocab and compile itself, and cannot be profiled; drop those flags")
    if args.plot and not args.ladder:
        fail("--plot draws the ladder; add --ladder")
    if args.rungs and not args.ladder:
        fail("--rungs picks rungs of the ladder; add --ladder")
    if args.rungs and max(args.rungs) > HEADLINE_NUMBER and HEADLINE_NUMBER not in args.rungs:
        fail(f"--rungs {','.join(map(str, args.rungs))}: the levers past the headline are timed against it; "
             f"add {HEADLINE_NUMBER}")
    if args.nanogpt and (args.ladder or tuned or not single):
        fail("--nanogpt compares one --model, --batch and --seq at train.py's headline settings; drop the other flags")
    if (args.ladder or args.nanogpt) and args.warmup == 0:
        fail("--ladder and --nanogpt build (and compile) each variant in its first warm-up step: --warmup 1 or more")
    if args.warmup_table and (args.ladder or args.nanogpt or args.profile or args.trace or not single
                              or len(args.vocab or [1]) > 1 or variants > 1):
        fail("--warmup-table times one --model, --batch, --seq, --vocab, precision and compile mode; drop --ladder, "
             "--nanogpt and --profile")
    if args.warmup_table and (args.warmup is not None or args.rounds is not None):
        fail("--warmup-table times 0, 1 and 2 warm-up steps itself, a step at a time; drop --warmup and --rounds")
    needs_flash = args.attn == "triton" or (args.nanogpt and not cpu)  # on a GPU the headline's attention is ours
    if needs_flash and not flash_triton_found():  # bench_e2e.py copied with gpt.py alone
        fail("--attn triton, and --nanogpt on a GPU (train.py's headline), run flash_triton.py's kernels, and there is "
             "no flash_triton.py next to gpt.py: copy it there")

def settings(args, device):
    """([(name, config)], Plan): the flags with this device's defaults (GPU: the headline sizes; CPU: seconds)."""
    cpu = device.type != "cuda"
    gpu_model, gpu_batch, gpu_seq, gpu_rounds, gpu_steps = "small", 8, 512, 10, 3
    if args.ladder:
        gpu_model, gpu_batch, gpu_seq, gpu_rounds, gpu_steps = "gpt2", 16, 1024, 20, 2
    if args.nanogpt:
        gpu_model, gpu_batch, gpu_seq, gpu_rounds = "gpt2", 16, 1024, 30
    names = [name.strip() for name in (args.model or on_device(device, cpu="tiny", gpu=gpu_model)).split(",")]
    try:
        configs = [(name, make_config(name)) for name in names]
        dtype = amp_dtype(args.bf16, args.fp16)
    except ValueError as e:
        fail(str(e))
    precision = [name for name, d in PRECISIONS.items() if d == dtype]  # --bf16, --fp16 or neither
    check_combinations(args, len(names), cpu)
    block = min(c.block_size for _, c in configs)
    seq = args.seq or [min(block, on_device(device, cpu=64, gpu=gpu_seq))]
    if max(seq) > block:
        fail(f"--seq must be at most {block}, the block size of {', '.join(names)}, got {max(seq)}")
    steps = args.steps or on_device(device, cpu=1, gpu=gpu_steps)
    if args.warmup_table:
        steps = args.steps or on_device(device, cpu=5, gpu=20)  # the settled steps
    warmup = args.warmup
    if warmup is None:
        warmup = on_device(device, cpu=1, gpu=3)
    modes = (args.mode,)
    if args.mode in (None, "all"):
        modes = MODES
    plan = Plan(batch=args.batch or [on_device(device, cpu=2, gpu=gpu_batch)], seq=seq,
                vocab=args.vocab or [GPT2_VOCAB], modes=modes,
                rounds=args.rounds or on_device(device, cpu=3, gpu=gpu_rounds), steps=steps, warmup=warmup,
                precisions=tuple(args.precisions or precision), tf32=args.tf32, attn=args.attn,
                compiles=tuple(args.compile_modes or ["compiled" if args.compile else "eager"]))
    if cpu:  # the largest configuration as the ladder's first rung runs it: fp32, all the logits
        B, T = max(plan.batch), max(plan.seq)
        check_host_memory(max(step_bytes(replace(c, vocab_size=max(plan.vocab), fused_ce=False), B, T, False)
                              for _, c in configs), f"batch {B} x seq {T}")
    return configs, plan

def device_line(device, nvtx, world=1):
    if device.type != "cuda":
        line = (f"device: CPU (no CUDA GPU), torch {torch.__version__}: small sizes that finish in seconds; CPU "
                "numbers show the method, not GPU performance, and MFU/memory are n/a")
        if nvtx:
            line += "; --nvtx ignored (NVTX ranges need CUDA)"
        if world > 1:
            line += f"; {world} processes (gloo)"
        return line
    peak = gpu_peak_flops(device)
    peak_text = "unknown (MFU n/a)"
    if peak is not None:
        peak_text = f"{peak / 1e12:.0f} TFLOP/s"
    gpus = ""
    if world > 1:
        gpus = f" x {world} (one a process, NCCL)"
    return f"device: {torch.cuda.get_device_name(device)}{gpus}, torch {torch.__version__}, bf16 peak {peak_text}"

def start_ranks(device):
    """torchrun's rank on its own GPU (NCCL), or on the CPU (gloo); its device."""
    import torch.distributed as dist
    if device.type != "cuda":
        dist.init_process_group("gloo")
        return device
    local = int(os.environ["LOCAL_RANK"])
    if local >= torch.cuda.device_count():
        fail(f"--nproc_per_node is more than the {torch.cuda.device_count()} GPU(s) of this machine: one GPU a process")
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device

def main(argv=None):
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not args.nanogpt:
        fail("under torchrun bench_e2e.py runs --nanogpt PATH only (nanoGPT + DDP against train.py's data parallel)")
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        fail(str(e))
    if world > 1:
        device = start_ranks(device)
    configs, plan = settings(args, device)
    plt, profiled = None, args.profile or args.trace
    traces = [None] * len(profile_configs(configs, plan))
    if args.trace:
        traces = trace_paths(args.trace, configs, plan)
    try:
        for path in traces:
            if path:
                check_output_path(path, "--trace", ours=starts_with(b"{"))
        if args.plot:  # its path and format were checked with the flags (gpt.plot_path)
            plt = plot_to(args.plot)  # matplotlib, imported only for --plot
    except ValueError as e:
        fail(str(e))
    module = None
    if args.nanogpt:
        module = load_nanogpt(args.nanogpt)
    gpt.NVTX = args.nvtx and device.type == "cuda"  # torch.cuda.nvtx needs a CUDA build
    if rank == 0:
        print(device_line(device, args.nvtx, world))
    (name, config), B, T = configs[0], plan.batch[0], plan.seq[0]
    what = "the ladder"
    try:
        if args.nanogpt:
            what = "the nanoGPT comparison"
            summary = run_nanogpt(args.nanogpt, module, config, B, T, device, plan, rank, world)
            if rank == 0:
                print("\n" + summary)
            if world > 1:
                torch.distributed.destroy_process_group()
            return
        if args.ladder:
            print("\n" + run_ladder(config, B, T, device, plan, args.plot, plt, args.rungs))
            return
        if args.warmup_table:
            what = "the warm-up table"
            print("\n" + run_warmup_table(name, config, plan, plan.steps, device))
            return
        what = "the sweep"
        print(sweep_line(configs, plan, profiled))
        results = []
        try:
            run_sweep(plan, configs, device, results)
        except KeyboardInterrupt:
            if results:  # a long sweep stopped at its last model (say, a 2.7B compile) keeps the models it timed
                print(f"\nthe {len(results)} of {len(configs)} models timed before the interrupt:", flush=True)
                print_sweep(plan, results, device)
            raise
        summary = print_sweep(plan, results, device)
        if len(plan.vocab) > 1:
            what = "the output-GEMM benchmark"
            set_tf32(plan.tf32)
            for precision in plan.precisions:
                gemm_microbench(B * T, config.n_embd, PRECISIONS[precision], device, plan)
        if profiled:
            what = "the profiles"
            run_profiles(configs, plan, device, traces)
        print("\n" + summary)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        where = "host"
        if device.type == "cuda":
            where = "GPU"
        fail(f"out of {where} memory in {what}; lower --batch or --seq")

if __name__ == "__main__":
    run_main(main)  # Ctrl-C / SIGTERM: one line, exit 130 / 143
