"""Where a training step's memory goes, predicted before you run it.

A training step peaks at the start of backward (weights, AdamW's moments and every saved
activation alive, plus the fp32 N x V log-probs of the loss and their gradients, which GPT-2's
50k vocabulary makes the largest single item) or, for small batches, at the end of backward
(16 bytes per parameter). `account` derives both from gpt.py's ops and checks them against
torch.cuda.max_memory_allocated(); the other parts look at the same memory from other angles:
the allocator's history, saved-tensor hooks, checkpointing, batch-size prediction, and ZeRO/FSDP.

    python memory.py peak --batch 8                       # presets x context x fp32/bf16
    python memory.py account --model gpt2 --seq 512 --bf16
    python memory.py account --sweep --batch 8            # the +-10% table for the README
    python memory.py residuals --model gpt2 --seq 512 --bf16 [--compile]
    python memory.py checkpoint --model medium --seq 1024 --bf16
    python memory.py max-batch --model gpt2 --seq 1024 --bf16
    python memory.py snapshot --model gpt2 --seq 512 --bf16 --out snap
    python memory.py parallel                             # the 220B-parameter worked example

Excerpt (NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-22), `python memory.py account --sweep --batch 8`, first rows:

    model / seq / dtype  predicted GiB  measured GiB  error %  measured peak phase  predicted peak phase
    -------------------  -------------  ------------  -------  -------------------  --------------------
    gpt2 T=128 fp32               2.54          2.54     -0.3             backward        backward start
    gpt2 T=128 bf16               2.52          2.45     +2.6             backward        backward start
    gpt2 T=256 fp32               3.68          3.68     -0.1             backward        backward start
    gpt2 T=256 bf16               3.41          3.24     +5.4             backward        backward start
    gpt2 T=512 fp32               5.97          5.99     -0.3             backward        backward start
    gpt2 T=512 bf16               5.21          4.84     +7.7             backward        backward start
    gpt2 T=1024 fp32             10.54         10.55     -0.0             backward        backward start
    gpt2 T=1024 bf16              8.79          8.05     +9.3             backward        backward start
    ...
    account: batch 8, attention sdpa; worst |error| 9.3% over 32 configurations that fit (target 10%; small has gpt2's shape)
"""

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gpt import (GPT, amp_dtype, autocast, configure_optimizer, fail, free_memory, gib, make_config,
                 print_table, resolve_device, round_up, synchronize)

PARTS = ("peak", "snapshot", "account", "residuals", "checkpoint", "max-batch", "parallel")
SWEEP_MODELS = ("gpt2", "medium", "large", "xl")  # "small" has gpt2's shape, so it is one row
SWEEP_SEQS = (128, 256, 512, 1024)
GB = 1e9  # the parallel calculator speaks decimal GB, like GPU data sheets

# --- 1. the analytic model: parameters, optimizer state, saved activations, transients


def param_count(config):
    """Parameters of gpt.py's GPT, from the config alone (tied lm_head counted once)."""
    d, f, L = config.n_embd, config.d_ff, config.n_layer
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    return config.vocab_size * d + config.block_size * d + L * block + 2 * d


def linear_weight_count(config):
    """Elements of the matrices autocast copies to bf16 (all nn.Linear weights + tied lm_head)."""
    d, f, L = config.n_embd, config.d_ff, config.n_layer
    return L * (4 * d * d + 2 * d * f) + config.vocab_size * d


def saved_per_layer(config, B, T, act_bytes, cuda=True):
    """Bytes one block saves for backward, as {op: bytes}. `act_bytes` is 2 under bf16 autocast
    (matmul inputs are cast) and 4 in fp32; the residual stream and LayerNorm stay fp32 either way."""
    N, d, f, H = B * T, config.n_embd, config.d_ff, config.n_head
    a = act_bytes
    rows = {
        "ln_1 + ln_2 inputs (fp32 residual)": 2 * 4 * N * d,
        "ln_1 + ln_2 mean, rstd": 2 * 2 * 4 * N,
        "c_attn + c_fc inputs (LN outputs)": 2 * a * N * d,
        "q, k, v": 3 * a * N * d,
        "attention output (c_proj input)": a * N * d,
        "gelu input (c_fc output)": a * N * f,
        "mlp c_proj input (gelu output)": a * N * f,
    }
    if config.attn == "naive":
        # probs is softmax's output, fp32 on CUDA under autocast (softmax is on autocast's fp32
        # list), plus the bf16 copy bmm saves; and a fresh T x T causal mask each layer.
        probs = B * H * T * T * (4 + 2 if (a == 2 and cuda) else a)
        rows["attention probs (B*H*T*T) + mask"] = probs + T * T
    else:  # SDPA flash / mem-efficient save O and the fp32 logsumexp, never the T x T matrix
        rows["attention logsumexp (fp32)"] = 4 * B * H * T
    return rows


def per_layer_formula(config, act_bytes):
    a = act_bytes
    base = f"{8 + 6 * a}*N*d + {2 * a}*N*d_ff + 16*N"
    extra = " + B*H*T*T*probs_bytes + T*T" if config.attn == "naive" else " + 4*N*H"
    copies = " + 2*(linear weights incl. lm_head) autocast copies" if act_bytes == 2 else ""
    return (f"per layer = {base}{extra}   (N = batch*seq, bytes)\n"
            f"total saved = n_layer*(per layer) + {4 + act_bytes}*N*d + 8*N (ln_f, lm_head input)"
            f" + 4*N*V (fp32 log-probs) + 16*N + 8*T (batch){copies}")


def account(config, B, T, dtype, device_type="cuda"):
    """Predicted bytes alive in each phase of a steady-state training step, by component.
    The peak is the largest phase: usually the start of backward (every activation alive plus
    the loss gradients), for small batches the end of backward (16 bytes per parameter plus the
    embedding's gradients). The first step's optimizer step (AdamW allocating its state) holds
    16 bytes per parameter too, so the steady state also covers the first step."""
    cuda = device_type == "cuda"
    P, V, d, N = param_count(config), config.vocab_size, config.n_embd, B * T
    a = 2 if dtype is not None else 4
    n_tensors = 12 * config.n_layer + 4
    step_bytes = n_tensors * (512 if cuda else 4)  # AdamW's per-tensor `step` (a 512 B block on CUDA)
    layer = sum(saved_per_layer(config, B, T, a, cuda).values())
    head = 4 * N * d + 8 * N + a * N * d  # ln_f input, mean/rstd, lm_head input
    batch = 2 * 8 * N + 8 * T + 4  # idx, targets, position index (int64); nll_loss's total_weight
    logprobs = 4 * N * V  # log_softmax output saved by cross_entropy: fp32 even under autocast
    copies = 2 * linear_weight_count(config) if dtype is not None else 0
    state = {"parameters (fp32)": 4 * P, "AdamW exp_avg + exp_avg_sq + step (fp32)": 8 * P + step_bytes}
    saved = {f"activations: {config.n_layer} layers x {layer / 2**20:.1f} MiB": config.n_layer * layer,
             "activations: ln_f + lm_head input + batch": head + batch,
             "loss: fp32 log-probs (4*N*V)": logprobs,
             "autocast bf16 weight copies (saved by matmuls)": copies}
    grads = {"gradients (fp32)": 4 * P}
    # cross_entropy upcasts bf16 logits to fp32, so at the end of the forward pass the logits,
    # their fp32 copy and the log-probs are alive together
    upcast = 4 * N * V if dtype is not None else 0
    lm_grad = (2 + 4) * V * d if dtype is not None else 4 * V * d  # bf16 grad, then fp32 for wte
    no_logprobs = {k: v for k, v in saved.items() if not k.startswith("loss")}
    phases = {
        "forward end": {**state, **saved, "logits + fp32 upcast (transient)": a * N * V + upcast},
        "backward start": {**state, **saved, "nll + log-softmax grads, 2 x 4*N*V (transient)": 8 * N * V},
        "lm_head backward": {**state, **no_logprobs, "logits grad + lm_head weight grad": a * N * V + lm_grad},
        # wte's gradient arrives twice (lm_head, then the lookup) and is summed into a third
        # V x d buffer before it lands in .grad: two extra fp32 V x d tensors at the very end
        "backward end": {**state, **grads, "wte gradient parts + their sum (transient)": 8 * V * d},
        "optimizer step": {**state, **grads},
    }
    totals = {name: sum(c.values()) for name, c in phases.items()}
    peak_phase = max(totals, key=totals.get)
    return {"phases": phases, "totals": totals, "peak_phase": peak_phase, "peak": totals[peak_phase],
            "layer": layer, "params": P, "saved": sum(saved.values()),
            "state": {"parameters": 4 * P, "gradients": 4 * P, "AdamW state": 8 * P + step_bytes}}


def tensor_state_bytes(model, optimizer):
    """Real bytes of parameters, gradients and optimizer state (tied weights counted once)."""
    params = list(model.parameters())
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return nbytes(params), nbytes(p.grad for p in params if p.grad is not None), nbytes(state)


# --- 2. measuring a real step



def random_batch(config, B, T, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab_size, (B, T), generator=g)
    y = torch.randint(0, config.vocab_size, (B, T), generator=g)
    return x.to(device), y.to(device)


def train_step(model, opt, x, y, dtype, device, marks=None, forward=None):
    """One step; `marks(phase)` is called after each phase (for per-phase memory), `forward`
    replaces model.forward (checkpointing). The logits are dropped at once, as in a training loop."""
    opt.zero_grad(set_to_none=True)
    with autocast(device, dtype):
        loss = (forward or model)(x, y)[1]
    marks and marks("forward")
    loss.backward()
    marks and marks("backward")
    opt.step()
    marks and marks("optimizer")
    return loss.detach()


def measure_step(config, B, T, dtype, device, steps=2):
    """Peak allocated bytes per phase over the first `steps` steps of a fresh model (the first
    step allocates AdamW's state; the second is the steady state), counted above what was
    allocated before the model existed. Returns ({phase: peak bytes}, peak reserved bytes)."""
    free_memory()
    start = torch.cuda.memory_allocated(device)
    with torch.device(device):  # initialise on the GPU: seconds faster for xl than CPU + .to()
        model = GPT(config)
    opt = configure_optimizer(model, lr=1e-4)
    x, y = random_batch(config, B, T, device)
    peaks = {}

    def mark(phase):
        synchronize(device)
        peaks[phase] = max(peaks.get(phase, 0), torch.cuda.max_memory_allocated(device) - start)
        torch.cuda.reset_peak_memory_stats(device)

    try:
        for _ in range(steps):
            torch.cuda.reset_peak_memory_stats(device)
            train_step(model, opt, x, y, dtype, device, marks=mark)
        reserved = torch.cuda.max_memory_reserved(device)
    finally:
        del model, opt, x, y
        free_memory()
    return peaks, reserved


def warm_up_libraries(device, dtype):
    """Run a matmul (forward and backward) so cuBLAS allocates its workspaces now: they stay
    allocated for the process and would otherwise land inside the first measured step.
    Returns the bytes they took (0 once they exist)."""
    free_memory()
    before = torch.cuda.memory_allocated(device)
    w = torch.randn(64, 64, device=device, requires_grad=True)
    x = torch.randn(2, 64, 64, device=device, requires_grad=True)
    with autocast(device, dtype):  # a linear with bias, as in the model: cuBLAS and cuBLASLt paths
        F.linear(x, w, w[0]).float().sum().backward()
    synchronize(device)
    del w, x
    return max(torch.cuda.memory_allocated(device) - before, 0)


# --- 3. parts: peak and account


def configurations(args, models, sweep):
    """(label, config, T, dtype) for --seq and --bf16, or swept over contexts x fp32/bf16."""
    seqs = SWEEP_SEQS if sweep else (args.seq,)
    dtypes = (None, torch.bfloat16) if sweep else (amp_dtype(args.bf16),)
    return [(f"{m} T={T} {'bf16' if dt else 'fp32'}", make_config(m, attn=args.attn), T, dt)
            for m in models for T in seqs for dt in dtypes]


def measure_or_oom(cfg, B, T, dtype, device):
    """measure_step, or None when the configuration does not fit (memory freed, sweep goes on)."""
    warm_up_libraries(device, dtype)
    try:
        return measure_step(cfg, B, T, dtype, device)
    except torch.OutOfMemoryError:
        free_memory()
        return None, None


def part_peak(args, device):
    if device.type != "cuda":
        print("peak: needs CUDA (torch.cuda.max_memory_allocated); nothing to measure on the CPU")
        return
    rows = []
    for label, cfg, T, dtype in configurations(args, (args.model,) if args.model else SWEEP_MODELS, True):
        peaks, reserved = measure_or_oom(cfg, args.batch, T, dtype, device)
        rows.append([label, *(["OOM"] * 3 if peaks is None else
                              [gib(peaks["forward"]), gib(max(peaks.values())), gib(reserved)])])
        print("  " + "  ".join(rows[-1]), flush=True)
    print_table(["model / seq / dtype", "forward peak GiB", "step peak GiB", "reserved GiB"], rows)
    print(f"peak: batch {args.batch}, attention {args.attn}; allocated = max_memory_allocated over the "
          "first two steps above what was allocated before the model; reserved = the allocator's segments")


def part_account(args, device):
    if device.type != "cuda":
        return account_on_cpu(args)
    B, rows, errors = args.batch, [], []
    for label, cfg, T, dtype in configurations(args, SWEEP_MODELS if args.sweep else (args.model,), args.sweep):
        pred = account(cfg, B, T, dtype, "cuda")
        workspace = warm_up_libraries(device, dtype)
        peaks, _ = measure_or_oom(cfg, B, T, dtype, device)
        cells = ["OOM", "n/a", "n/a"]
        if peaks is not None:
            measured = max(peaks.values())
            errors.append(100 * (pred["peak"] - measured) / measured)
            cells = [gib(measured), f"{errors[-1]:+.1f}", max(peaks, key=peaks.get)]
        rows.append([label, gib(pred["peak"]), *cells, pred["peak_phase"]])
        if args.sweep:
            print("  " + "  ".join(rows[-1]), flush=True)
        else:
            print_components(cfg, B, T, dtype, pred, peaks, workspace)
    if args.sweep:
        print_table(["model / seq / dtype", "predicted GiB", "measured GiB", "error %",
                     "measured peak phase", "predicted peak phase"], rows)
    worst = f"{max(map(abs, errors)):.1f}%" if errors else "n/a"
    print(f"account: batch {B}, attention {args.attn}; worst |error| {worst} over {len(errors)} "
          f"configurations that fit (target 10%; small has gpt2's shape)")


def print_components(cfg, B, T, dtype, pred, peaks, workspace):
    a = 2 if dtype is not None else 4
    print(f"{cfg.n_layer} layers, d={cfg.n_embd}, d_ff={cfg.d_ff}, heads={cfg.n_head}, "
          f"V={cfg.vocab_size}, B={B}, T={T}, {'bf16 autocast' if dtype else 'fp32'}, attention {cfg.attn}")
    print(per_layer_formula(cfg, a))
    rows = [[op, f"{b / 2**20:.2f}"] for op, b in saved_per_layer(cfg, B, T, a).items()]
    print_table(["saved by one block", "MiB"], rows + [["total per layer", f"{pred['layer'] / 2**20:.2f}"]])
    print()
    parts = pred["phases"][pred["peak_phase"]]
    rows = [[k, gib(v)] for k, v in parts.items()] + [["predicted peak", gib(pred["peak"])]]
    print_table([f"alive at the predicted peak ({pred['peak_phase']})", "GiB"], rows)
    print()
    # measured phases: forward / backward / optimizer; the predicted ones nest inside them
    rows = [[k, gib(v), gib(peaks[k.split()[0]]) if peaks and k.split()[0] in peaks else ""]
            for k, v in pred["totals"].items()]
    print_table(["phase", "predicted GiB", "measured phase peak GiB"], rows)
    print(f"cuBLAS workspaces allocated before the model ({workspace / 2**20:.1f} MiB) are outside both columns")
    if peaks:
        measured = max(peaks.values())
        print(f"measured peak {gib(measured)} GiB (max_memory_allocated), predicted "
              f"{gib(pred['peak'])} GiB, error {100 * (pred['peak'] - measured) / measured:+.1f}%")


def account_on_cpu(args):
    """Without CUDA the allocator peak cannot be read, but the two halves of the model can be
    checked exactly: state bytes against real tensors, activations against saved-tensor hooks."""
    print("account: no CUDA; checking the model against real tensors and saved-tensor hooks on the CPU")
    cfg, dtype, B, T = make_config(args.model, attn=args.attn), amp_dtype(args.bf16), args.batch, args.seq
    pred = account(cfg, B, T, dtype, "cpu")
    model = GPT(cfg)
    opt = configure_optimizer(model, lr=1e-4)
    x, y = random_batch(cfg, B, T, "cpu")
    saved = saved_bytes(model, lambda: model(x, y)[1], dtype, "cpu", exclude=model.parameters())
    train_step(model, opt, x, y, dtype, "cpu")
    measured = dict(zip(pred["state"], tensor_state_bytes(model, opt)))
    rows = [[k, v, measured[k]] for k, v in pred["state"].items()]
    rows.append(["saved for backward (incl. weight copies)", pred["saved"], saved])
    print(per_layer_formula(cfg, 2 if dtype else 4))
    print_table(["component", "predicted bytes", "measured bytes"], [[r[0], f"{r[1]:,}", f"{r[2]:,}"] for r in rows])
    print(f"account: predicted GPU peak {gib(pred['peak'])} GiB ({pred['peak_phase']}); CPU check "
          f"{'exact' if all(r[1] == r[2] for r in rows) else 'MISMATCH'} for {args.model} B={B} T={T}")


# --- 4. saved tensors: residuals


def saved_bytes(model, fn, dtype, device, exclude=(), by_op=None):
    """Bytes of distinct storages saved for backward while running fn() (dedupe by data_ptr:
    views of one buffer, such as q, k, v of the fused c_attn output, count once). Parameters are
    excluded: they are alive anyway."""
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, dtype):
        out = fn()
    if by_op is not None:
        by_op.update(saved_by_grad_fn(out, skip))
    return sum(seen.values())


def saved_by_grad_fn(out, skip):
    """Walk the autograd graph from `out` and attribute each saved storage to the first grad_fn
    (in reverse-topological walk order) that holds it via a `_saved_*` attribute."""
    owners, totals, stack, visited = set(), {}, [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            val = getattr(node, attr)
            for t in val if isinstance(val, (tuple, list)) else (val,):
                if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in skip | owners:
                    owners.add(t.untyped_storage().data_ptr())
                    totals[node.name()] = totals.get(node.name(), 0) + t.untyped_storage().nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return totals


def part_residuals(args, device):
    cfg, dtype, B, T = make_config(args.model, attn=args.attn), amp_dtype(args.bf16), args.batch, args.seq
    model = GPT(cfg).to(device)
    x, _ = random_batch(cfg, B, T, device)
    block = model.h[0]
    with torch.no_grad(), autocast(device, dtype):
        h = (model.wte(x) + model.wpe(torch.arange(T, device=device))).detach()
    h.requires_grad_(True)
    by_op = {}
    # the block's input is included: its ln_1 saves it, and no other op keeps it alive
    eager = saved_bytes(model, lambda: block(h).sum(), dtype, device, model.parameters(), by_op)
    top = sorted(by_op.items(), key=lambda kv: -kv[1])
    row = lambda name, b: [name, f"{b:,}", f"{b / 2**20:.3f}", f"{100 * b / eager:.1f}"]
    rows = [row(name, b) for name, b in top[:5]] + [row("(all other ops)", sum(b for _, b in top[5:]))]
    rows.append(row("block total (eager, hooks)", eager))
    if args.compile:
        compiled = torch.compile(block)
        with autocast(device, dtype):
            compiled(h)  # compile (under the same autocast state) before the hooks are on
        try:  # the compiled graph saves what its partitioner chose: fused ops save less
            c = saved_bytes(model, lambda: compiled(h).sum(), dtype, device, model.parameters())
            rows.append(row("block total (torch.compile, hooks)", c))
        except Exception as e:  # hooks and compile meet in new ways in each torch release
            rows.append(["block total (torch.compile)", f"n/a: {type(e).__name__}", "", ""])
    print_table(["saved by one block (grad_fn)", "bytes", "MiB", "share %"], rows)
    loss_fn = lambda: model(x, x)[1]
    if device.type == "cuda":  # the allocator's view: memory that the forward pass leaves behind
        free_memory()
        before = torch.cuda.memory_allocated(device)
        with autocast(device, dtype):
            loss = loss_fn()
        measured, how = torch.cuda.memory_allocated(device) - before, "memory_allocated after forward"
        del loss
    else:
        measured, how = saved_bytes(model, loss_fn, dtype, device, model.parameters()), "hooks, whole model"
    predicted = account(cfg, B, T, dtype, device.type)["saved"]
    print(f"residuals: block {eager / 2**20:.2f} MiB x {cfg.n_layer} layers = {eager * cfg.n_layer / 2**20:.1f} MiB;"
          f" whole forward {measured / 2**20:.1f} MiB measured ({how}), {predicted / 2**20:.1f} MiB by account"
          " (the whole forward adds the head: log-probs, lm_head weight copy)")


# --- 5. activation checkpointing over groups of k blocks


def checkpointed_forward(model, k):
    """gpt.py's forward with every group of k blocks recomputed in backward: only the group's
    input is kept, at the price of one more forward of the group."""
    def run_group(x, blocks):
        for b in blocks:
            x = b(x)
        return x

    def forward(idx, targets):
        T = idx.size(1)
        x = model.wte(idx) + model.wpe(torch.arange(T, device=idx.device))
        for i in range(0, len(model.h), k):
            x = checkpoint(run_group, x, model.h[i:i + k], use_reentrant=False)
        logits = model.lm_head(model.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    return forward


def group_sizes(n_layer):
    ks, k = [], 1
    while k <= n_layer:
        ks.append(k)
        k *= 2
    return sorted(set(ks) | {max(1, round(math.sqrt(n_layer)))})


def checkpoint_grads_match(model, k, x, y, dtype, device):
    """Max |grad difference| between plain and checkpointed backward on the same weights."""
    grads = []
    for fwd in (model, checkpointed_forward(model, k)):
        model.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            fwd(x, y)[1].backward()
        grads.append([p.grad.float().clone() for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


def part_checkpoint(args, device):
    cfg, dtype, B, T = make_config(args.model, attn=args.attn), amp_dtype(args.bf16), args.batch, args.seq
    cuda = device.type == "cuda"
    model = GPT(cfg).to(device)
    opt = configure_optimizer(model, lr=1e-4)
    x, y = random_batch(cfg, B, T, device)
    rows, results = [], {}
    for k in [0] + group_sizes(cfg.n_layer):
        fwd = checkpointed_forward(model, k) if k else None
        try:
            train_step(model, opt, x, y, dtype, device, forward=fwd)  # warm-up, allocates AdamW state
            synchronize(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                train_step(model, opt, x, y, dtype, device, forward=fwd)
                synchronize(device)  # wall time of the whole step needs the GPU to finish
                times.append(1000 * (time.perf_counter() - t0))
            peak = torch.cuda.max_memory_allocated(device) if cuda else None
            diff = checkpoint_grads_match(model, k, x, y, dtype, device) if k else 0.0
            results[k] = (peak, min(times))
            rows.append([f"k={k}" if k else "no checkpointing", gib(peak) if cuda else "n/a",
                         f"{min(times):.1f}", f"{diff:.1e}" if k else "-"])
        except torch.OutOfMemoryError:
            free_memory()
            rows.append([f"k={k}" if k else "no checkpointing", "OOM", "OOM", "n/a"])
        print(f"  k={k} done", flush=True)
    print_table(["checkpoint groups", "peak GiB (allocated)", "step ms (min)", "max |grad diff|"], rows)
    if cuda and 0 in results and len(results) > 1:
        # every k recomputes each block once, so the time barely depends on k: pick least memory
        best = min((k for k in results if k), key=lambda k: results[k])
        (peak, t), (peak0, t0) = results[best], results[0]
        print(f"checkpoint: best single level k={best}: {gib(peak)} GiB vs {gib(peak0)} GiB without, "
              f"step {t:.1f} vs {t0:.1f} ms ({100 * (t / t0 - 1):+.0f}%)")
    else:
        print("checkpoint: peak memory needs CUDA; gradients above compare with the plain model on the CPU")


# --- 6. max-batch: invert the model against a memory budget


def predict_max_batch(config, T, dtype, budget_bytes, limit=1 << 16):
    """Largest batch whose predicted peak fits in budget_bytes (0 if not even batch 1 fits).
    The peak grows monotonically with the batch, so doubling then bisection finds it."""
    fits = lambda B: account(config, B, T, dtype, "cuda")["peak"] <= budget_bytes
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def part_max_batch(args, device):
    cfg, dtype, T = make_config(args.model, attn=args.attn), amp_dtype(args.bf16), args.seq
    cuda = device.type == "cuda"
    if args.budget_gib is not None:
        budget, source = args.budget_gib * 2**30, f"--budget-gib {args.budget_gib:g}"
    elif cuda:
        warm_up_libraries(device, dtype)  # its workspaces are then already out of the free memory
        free_b, _ = torch.cuda.mem_get_info(device)
        # keep a margin: the caching allocator reserves more than it hands out (fragmentation)
        budget, source = free_b * (1 - args.margin), f"free GPU memory minus {100 * args.margin:.0f}%"
    else:
        print("max-batch: needs CUDA for the free-memory budget (or pass --budget-gib)")
        return
    B = predict_max_batch(cfg, T, dtype, budget)
    print(f"budget {gib(budget)} GiB ({source}); predicted largest batch {B} for {args.model} "
          f"T={T} {'bf16' if dtype else 'fp32'}")
    if not cuda or args.budget_gib is not None or B == 0:
        print(f"max-batch: predicted {B}; verification runs only on CUDA against free memory")
        return
    rows = []
    for b in (B, round_up(B + 1, 8)):
        peaks, reserved = measure_or_oom(cfg, b, T, dtype, device)
        measured = ["OOM", "OOM", "OOM"] if peaks is None else [gib(max(peaks.values())), gib(reserved), "fits"]
        rows.append([b, gib(account(cfg, b, T, dtype, "cuda")["peak"]), *measured])
        print(f"  ran batch {b}", flush=True)
    print_table(["batch", "predicted GiB", "measured GiB", "reserved GiB", "result"], rows)
    print(f"max-batch: predicted {B}; {rows[0][4]} at {B}, {rows[1][4]} at {rows[1][0]}")


# --- 7. parallel: memory per device under DP, ZeRO-1/2/3


def per_device_bytes(n_params, n_devices, stage, weight_b=4, grad_b=4, optim_b=8, act_bytes=0,
                     shard_acts=False):
    """Bytes per device. ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3
    (FSDP) also the weights; stage 0 is plain data parallel (everything replicated)."""
    shard = lambda b, s: n_params * b / (n_devices if stage >= s else 1)
    acts = act_bytes / n_devices if shard_acts else act_bytes
    return shard(optim_b, 1) + shard(grad_b, 2) + shard(weight_b, 3) + acts


def part_parallel(args, device):
    # the worked example: 126 blocks of two bias-free linear layers, d_model 16384 <-> d_ff 53248
    n = args.params or 126 * 2 * 16384 * 53248
    print(f"{n:,} parameters (--params)" if args.params else
          f"worked example: 126 blocks x 2 linear layers x 16384 x 53248 = {n:,} parameters")
    bpp = args.weight_bytes + args.grad_bytes + args.optim_bytes
    total = n * bpp
    print(f"weights {args.weight_bytes} + gradients {args.grad_bytes} + Adam {args.optim_bytes} = "
          f"{bpp} bytes/parameter -> {total / GB:,.0f} GB of model state")
    act = args.act_gb * GB
    print(f"{math.ceil(total / (80 * GB))} GPUs of 80 GB are needed just to hold that state, "
          f"if it is fully sharded")
    rows = []
    for N in sorted({8, 64, args.devices}):
        for stage, name in enumerate(("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3 / FSDP")):
            b = per_device_bytes(n, N, stage, args.weight_bytes, args.grad_bytes, args.optim_bytes,
                                 act, args.shard_activations)
            rows.append([f"{name} N={N}", f"{b / GB:,.1f}", "yes" if b <= args.device_gb * GB else "no"])
    print_table(["scheme", "GB per device", f"fits {args.device_gb:g} GB"], rows)
    free = args.device_gb * GB - (act if not args.shard_activations else 0)
    need = "n/a" if free <= 0 else math.ceil(total / free) if not args.shard_activations \
        else math.ceil((total + act) / (args.device_gb * GB))
    print(f"parallel: N_FSDP = {need} devices of {args.device_gb:g} GB hold {total / GB:,.0f} GB "
          f"(ZeRO-3, activations {args.act_gb:g} GB{' sharded' if args.shard_activations else ' per device'})")


# --- 8. snapshot: the allocator's own record of the step


def summarize_trace(snapshot, device_index, top=8):
    """Replay alloc/free events: the peak of live bytes and the largest blocks alive then."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for ev in snapshot["device_traces"][device_index]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    largest = sorted(at_peak.values(), key=lambda e: -e["size"])[:top]
    return peak, largest


def code_frame(ev):
    """The innermost frame from our scripts (gpt.py, memory.py), else the innermost Python frame."""
    frames = ev.get("frames") or []
    ours = [f for f in frames if os.path.basename(f["filename"]) in ("gpt.py", "memory.py")]
    f = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"


def part_snapshot(args, device):
    if device.type != "cuda":
        print("snapshot: needs CUDA (torch.cuda.memory._record_memory_history)")
        return
    cfg, dtype, B, T = make_config(args.model, attn=args.attn), amp_dtype(args.bf16), args.batch, args.seq
    os.makedirs(args.out, exist_ok=True)
    model = GPT(cfg).to(device)
    opt = configure_optimizer(model, lr=1e-4)
    x, y = random_batch(cfg, B, T, device)
    train_step(model, opt, x, y, dtype, device)  # warm-up: AdamW state exists before recording
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    curve = []

    def mark(phase):
        synchronize(device)
        curve.append([f"step {len(curve) // 3 + 1} {phase}", gib(torch.cuda.max_memory_allocated(device)),
                      gib(torch.cuda.memory_allocated(device))])
        torch.cuda.reset_peak_memory_stats(device)

    for _ in range(args.steps):
        torch.cuda.reset_peak_memory_stats(device)
        train_step(model, opt, x, y, dtype, device, marks=mark)
    pkl = os.path.join(args.out, "snapshot.pickle")
    torch.cuda.memory._dump_snapshot(pkl)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"wrote {pkl}: drag it onto https://pytorch.org/memory_viz")
    try:
        from torch.cuda import _memory_viz
        html = os.path.join(args.out, "timeline.html")
        with open(html, "w") as f:
            f.write(_memory_viz.trace_plot(snap))
        print(f"wrote {html} (its viewer page loads a script from the web, so it needs network access)")
    except (ImportError, AttributeError, TypeError) as e:
        print(f"no HTML timeline: torch.cuda._memory_viz unavailable ({e})")
    print_table(["phase", "phase peak GiB", "at phase end GiB"], curve)
    peak, largest = summarize_trace(snap, torch.cuda.current_device() if device.index is None else device.index)
    rows = [[f"{e['size'] / 2**20:.1f}", code_frame(e)] for e in largest]
    print(f"\nlargest blocks allocated during recording and live at its peak ({gib(peak)} GiB above "
          "what was already allocated):")
    print_table(["MiB", "allocated at"], rows)
    summary = os.path.join(args.out, "summary.txt")
    with open(summary, "w") as f:
        f.write("\n".join(" | ".join(r) for r in curve + rows) + "\n")
    print(f"snapshot: {args.steps} steps recorded; {pkl}, {summary}")


# --- 9. command line


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", help=" | ".join(PARTS))
    p.add_argument("--model", default=None, help="preset (default gpt2 on a GPU, tiny on a CPU)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (weights stay fp32)")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--device", default=None)
    p.add_argument("--sweep", action="store_true", help="account: gpt2..xl x 128..1024 x fp32/bf16")
    p.add_argument("--compile", action="store_true", help="residuals: also the compiled block")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 3 on a GPU, 1 on a CPU)")
    p.add_argument("--out", default="memory_snapshot", help="snapshot: output folder")
    p.add_argument("--budget-gib", type=float, default=None, help="max-batch: a memory budget instead of free memory")
    p.add_argument("--margin", type=float, default=0.05, help="max-batch: fraction of free memory kept back")
    p.add_argument("--params", type=int, default=None, help="parallel: parameter count (default: worked example)")
    p.add_argument("--devices", type=int, default=16, help="parallel: N devices")
    p.add_argument("--device-gb", type=float, default=95.0)
    p.add_argument("--act-gb", type=float, default=0.0, help="parallel: activation GB per replica")
    p.add_argument("--shard-activations", action="store_true")
    p.add_argument("--weight-bytes", type=int, default=4)
    p.add_argument("--grad-bytes", type=int, default=4)
    p.add_argument("--optim-bytes", type=int, default=8)
    args = p.parse_args()
    if args.part not in PARTS:
        fail(f"unknown part '{args.part}'; choose from {', '.join(PARTS)}")
    if args.part == "max-batch":
        # Near the limit the caching allocator fails on fragmentation before the tensors fill the
        # GPU: a few N x V loss buffers of many GiB each need contiguous blocks. Expandable segments
        # let a segment grow in place instead. Must be set before the first CUDA allocation.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        device = resolve_device(args.device)
        amp_dtype(args.bf16)
        cuda = device.type == "cuda"
        if args.model is None and args.part != "peak":
            args.model = "gpt2" if cuda else "tiny"
        for name, on_gpu, on_cpu in (("batch", 8, 2), ("seq", 512, 64), ("steps", 3, 1)):
            if getattr(args, name) is None:  # GPU headline sizes, or seconds-long ones on a CPU
                setattr(args, name, on_gpu if cuda else on_cpu)
        cfg = make_config(args.model or "gpt2", attn=args.attn)
    except ValueError as e:
        fail(str(e))
    if args.seq < 1 or args.seq > cfg.block_size:
        fail(f"--seq {args.seq} must be between 1 and the block size {cfg.block_size}")
    if min(args.batch, args.steps, args.devices, args.device_gb, args.params or 1) <= 0 or args.act_gb < 0:
        fail("--batch, --steps, --devices, --device-gb and --params must be positive")
    if args.budget_gib is not None and args.budget_gib <= 0:
        fail("--budget-gib must be positive")
    if not 0 <= args.margin < 1:
        fail("--margin must be a fraction in [0, 1)")
    if args.part == "account" and args.sweep and not cuda:
        fail("account --sweep measures peaks and needs CUDA")
    if not cuda and args.part in ("account", "residuals", "checkpoint"):
        print(f"no CUDA: {args.part} runs its CPU part at seconds-long sizes "
              f"(model {args.model}, batch {args.batch}, seq {args.seq})")
    globals()["part_" + args.part.replace("-", "_")](args, device)


if __name__ == "__main__":
    main()
