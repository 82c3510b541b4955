"""Where a training step's memory goes, predicted before you run it: one GPU, a DDP or an FSDP rank.

A step holds the weights and AdamW's state (16 bytes per parameter), the activations saved for
backward, and short-lived buffers whose timing decides the peak. `account` lists what is alive at
each moment of a step from gpt.py's ops, and is checked byte for byte against live tensors on a CPU
and against max_memory_allocated on a GPU; `--compile` predicts what torch.compile keeps instead.

    python memory.py account --model gpt2 --seq 1024 --batch 16 --bf16 [--compile]   # predicted vs measured
    python memory.py account --sweep --batch 8 [--model xl] [--unfused]   # gpt2..xl x 128..1024 x fp32/bf16
    python memory.py account --model 2.7B --batch 16 --seq 1024 --bf16 --vocab 50304 --fsdp --compile
    python memory.py checkpoint --model 2.7B --batch 4 --seq 2048 --bf16   # best checkpoint group size
    python memory.py parallel [--model xl --world 2]                       # DP, ZeRO-1/2, FSDP per rank
    python memory.py snapshot --model gpt2 --seq 512 --bf16 --out snap.pickle
"""

import argparse
import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from gpt import (CE_CHUNK_ROWS, GPT, GPT2_VOCAB, GPU_ONLY_ATTENTION, amp_dtype, autocast, check_host_memory,
                 check_output_path, compare, compile_model, configure_optimizer, fail, free_memory, gib, is_oom,
                 linear_cross_entropy, make_config, print_table, resolve_device, run_main, synchronize, train_step)

PARTS = ("account", "checkpoint", "parallel", "snapshot")
SWEEP_MODELS = ("gpt2", "medium", "large", "xl")  # "small" has gpt2's shape
SWEEP_SEQS = (128, 256, 512, 1024)
GB = 1e9  # the worked example speaks decimal GB, like GPU data sheets

# --- 1. the analytic model: what is alive at each moment of a training step


def block_shapes(config):
    d, f = config.n_embd, config.d_ff  # ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj
    return [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (f, d), (f,), (d, f), (d,)]


def root_shapes(config):  # wte (tied to lm_head), wpe, ln_f
    return [(config.vocab_size, config.n_embd), (config.block_size, config.n_embd), (config.n_embd,), (config.n_embd,)]


def numel(shapes, world=1):
    """Elements rank 0 holds: FSDP pads each parameter's first dimension to a multiple of the world."""
    return sum(-(-s[0] // world) * math.prod(s[1:]) for s in shapes)


def param_count(config):
    return config.n_layer * numel(block_shapes(config)) + numel(root_shapes(config))


def saved_per_layer(config, B, T, matmul_bytes, ln_bytes=4, resid_bytes=4, cuda=True, compiled=False):
    """Bytes one block saves for backward, as {what: bytes} (widths as in `account`). Eager LayerNorm
    saves its input, an fp32 copy under autocast on CUDA; torch.compile's partitioner (see its forward
    graph) keeps the block's input and attn.c_proj's output instead and recomputes the upcast and the
    residual add in backward: 2 bytes less per N*d with an fp32 residual stream, 4 with FSDP's bf16 one."""
    N, d, f, H = B * T, config.n_embd, config.d_ff, config.n_head
    if compiled:
        saved = {"block input + c_proj output (compiled)": (resid_bytes + matmul_bytes) * N * d}
    else:
        saved = {"ln_1 + ln_2 inputs": 2 * ln_bytes * N * d}
    saved |= {"ln_1 + ln_2 mean, rstd": 2 * 2 * ln_bytes * N,
              "c_attn + c_fc inputs (LN outputs)": 2 * matmul_bytes * N * d,
              "q, k, v": 3 * matmul_bytes * N * d,
              "attention output (c_proj input)": matmul_bytes * N * d,
              "gelu input (c_fc output)": matmul_bytes * N * f,
              "mlp c_proj input (gelu output)": matmul_bytes * N * f}
    if config.attn == "naive":  # softmax's fp32 probs on CUDA under autocast, bmm's bf16 copy, the mask
        probs_bytes = 4 + 2 if (matmul_bytes == 2 and cuda) else matmul_bytes
        saved["attention probs (B*H*T*T) + mask"] = B * H * T * T * probs_bytes + T * T
    else:  # SDPA keeps the output and the fp32 log-sum-exp, never the T x T matrix
        saved["attention logsumexp (fp32)"] = 4 * B * H * T
    return saved


def account(config, B, T, dtype, device_type="cuda", world=0, groups=0, ddp=False, compiled=False):
    """Bytes alive at each moment of a steady-state training step, by component, for one process,
    a DDP rank (ddp) or (world > 1) rank 0 of FSDP2: fully_shard per block then the root, bf16
    gathering when dtype is set. compiled: blocks save what torch.compile keeps (saved_per_layer);
    the fused loss, gpt.py's own chunk loop, is counted as eager runs it.

    Every moment is the base, 4 * params (fp32 weights) + 8 * params (AdamW) + 16 * N (batch), plus
    what is alive only then, each term a count of elements times its width in bytes:
      matmul_bytes  matmul operands and what they save: 2 under autocast, else 4
      resid_bytes   the residual stream and FSDP's gathered weights: 2 only under FSDP's bf16 compute
      ln_bytes      LayerNorm's input and output: 4 on CUDA (autocast's fp32), the stream's width on the CPU
    with N = B*T tokens, d = n_embd, f = d_ff, V = vocab, L = n_layer, and params those this rank holds.
    Returns moments, totals, phases ({forward|backward|optimizer: (bytes, moment)}), peak and
    peak_at, saved (bytes saved for backward beyond weights and batch), params."""
    cuda, fused, fsdp = device_type == "cuda", config.fused_ce, world > 1
    L, d, f, V, ranks = config.n_layer, config.n_embd, config.d_ff, config.vocab_size, max(world, 1)
    N, real_vocab = B * T, min(V, GPT2_VOCAB)
    matmul_bytes = 2 if dtype is not None else 4
    resid_bytes = 2 if fsdp and dtype is not None else 4
    ln_bytes = 2 if resid_bytes == 2 and not cuda else 4
    block_numel, block_shard = numel(block_shapes(config)), numel(block_shapes(config), ranks)  # shard: this rank's
    root_numel, root_shard = numel(root_shapes(config)), numel(root_shapes(config), ranks)
    params = L * block_shard + root_shard
    adamw_steps = (12 * L + 4) * (512 if cuda else 4)  # a 4-byte step per tensor; CUDA's allocator rounds to 512
    base = {"weights (fp32)": 4 * params, "AdamW moments + step": 8 * params + adamw_steps,
            "batch (idx, targets)": 16 * N}
    if ddp:  # DDP copies every gradient into fp32 buckets for its all-reduces; they live all run
        base["DDP gradient buckets (fp32)"] = 4 * params
    block_matrices = 4 * d * d + 2 * d * f  # a block's matrices: autocast makes bf16 copies of them
    weight_cache = matmul_bytes == 2 and not fsdp  # (under FSDP they arrive in bf16: no copies)
    # under FSDP the only copies are LayerNorm's bf16 weights and biases upcast to fp32 (on CUDA)
    autocast_copies = 0 if dtype is None else (16 * d if ln_bytes != resid_bytes else 0) if fsdp else 2 * block_matrices
    per_layer = saved_per_layer(config, B, T, matmul_bytes, ln_bytes, resid_bytes, cuda, compiled)
    block_saved = sum(per_layer.values()) + autocast_copies
    # checkpointed blocks: gpt.py's recompute K checkpoints every K-th block on its own; `groups` k
    # every run of k consecutive blocks (recomputed together). segment_of: block -> first of its run
    every, group = groups or config.recompute, groups or 1
    segment_of = {i: s for s in range(0, L, every or L + 1) for i in range(s, min(s + group, L))} if every else {}
    kept = [resid_bytes * N * d if segment_of.get(i) == i else 0 if i in segment_of else block_saved
            for i in range(L)]

    def saved_during(b):  # while block b runs backward: the blocks below, and b's whole segment recomputed
        first = segment_of.get(b, b)
        held = kept[first] if b in segment_of and ln_bytes != resid_bytes else 0  # its input, unless LN saved it
        return sum(kept[:first]) + held + (b - first + 1) * block_saved

    # ln_f's input, mean and rstd; the positions
    head_saved = ln_bytes * N * d + 2 * ln_bytes * N + 8 * T + (8 * d if ln_bytes != resid_bytes else 0)
    saved = sum(kept) + head_saved
    lm_head_bytes = resid_bytes if fsdp else 4  # lm_head's weight (and so dW) as the loss sees it
    root = {"gathered weights: wte, wpe, ln_f": resid_bytes * root_numel} if fsdp else {}
    gather_buffer = resid_bytes * ranks * block_shard if fsdp else 0  # one block's all-gather buffer
    moments = {}
    if fused:  # gpt.linear_cross_entropy: dx and dW made during the forward, chunk by chunk
        loss_saved = ln_bytes * N * d + lm_head_bytes * V * d
        chunk_rows = [min(CE_CHUNK_ROWS, N - s) for s in range(0, N, CE_CHUNK_ROWS)]
        # on CUDA the Triton kernel writes each chunk's gradient over its logits, in place; the
        # CPU path makes fp32 temporaries: the upcast (under bf16), z - lse and its exp, * scale.
        # The previous chunk's logits are still referenced while the next chunk's are made.
        cpu_temps = 0 if cuda else (8 + (4 if matmul_bytes != 4 else 0)) * real_vocab
        chunk_peak = max(matmul_bytes * V * rows
                         + max(matmul_bytes * V * prev, cpu_temps * rows, matmul_bytes * rows * d)
                         for prev, rows in zip([0] + chunk_rows, chunk_rows))
        ln_f_out = ln_bytes * N * d + (matmul_bytes * N * d if matmul_bytes != ln_bytes else 0)
        fwd = {**base, **root, "saved activations": saved, "all-gather buffer (last block)": gather_buffer,
               "autocast's bf16 weight cache (checkpointed blocks)":
                   len(segment_of) * 2 * block_matrices * weight_cache,
               "ln_f output (+ bf16 copy)": ln_f_out,
               "loss: dx, dW (compute dtype), weight copy":
                   ln_bytes * N * d + matmul_bytes * V * d + 2 * V * d * weight_cache}
        moments["forward: loss chunk"] = {**fwd, "loss: chunk logits and temporaries": chunk_peak}
        moments["forward: loss end"] = {
            **fwd, "loss: last chunk's logits, per-row losses": matmul_bytes * V * chunk_rows[-1] + 8 * N,
            "loss: dW cast to the weight's dtype": 4 * V * d if lm_head_bytes != matmul_bytes else 0}
        moments["backward start"] = {**base, **root, "saved activations": saved + loss_saved,
                                     "loss gradients dx*g, dW*g": ln_bytes * N * d + lm_head_bytes * V * d,
                                     "all-gather buffer (prefetch)": gather_buffer}
    else:  # logits, F.cross_entropy's fp32 log-probs (saved) and, in backward, their gradients
        loss_saved = matmul_bytes * N * d + 4 * N * V + 4 + 2 * V * d * weight_cache
        logits = matmul_bytes * N * V + (4 * N * V if matmul_bytes == 2 else 0)
        moments["forward end"] = {**base, **root, "saved activations": saved + loss_saved,
                                  "logits + fp32 upcast": logits}
        moments["backward start"] = {**base, **root, "saved activations": saved + loss_saved,
                                     "nll + log-softmax grads": 8 * N * V}
        moments["backward: lm_head"] = {
            **base, **root, "saved activations": saved + loss_saved - 4 * N * V,
            "logits grad + lm_head weight grad": matmul_bytes * N * V + (6 if matmul_bytes == 2 else 4) * V * d}

    for b in range(L - 1, -1, -1):
        upcast_dx = matmul_bytes * N * d if matmul_bytes != resid_bytes else 0
        mlp_grads = upcast_dx + matmul_bytes * N * f + matmul_bytes * d * f
        moment = {**base, **root, "saved activations": saved_during(b),
                  "gradients": (L - 1 - b) * 4 * block_shard + 2 * resid_bytes * d,
                  "lm_head weight gradient": lm_head_bytes * V * d, "residual gradient": resid_bytes * N * d,
                  "block backward: MLP gradients": mlp_grads}
        if fsdp:  # this block gathered, the next one's all-gather in flight, the last reduce-scatter kept
            moment["gathered weights: block + prefetch"] = resid_bytes * block_numel + (gather_buffer if b else 0)
            moment["reduce-scatter input (block above)"] = 4 * ranks * block_shard if b < L - 1 else 0
            moments[f"backward: block {b} done"] = {  # its gradients whole, before their reduce-scatter
                **moment, "saved activations": sum(kept[:segment_of.get(b, b)]), "block backward: MLP gradients": 0,
                "block gradients (gathered)": resid_bytes * block_numel,
                "residual gradient": (2 * resid_bytes + max(resid_bytes, ln_bytes)) * N * d}
        moments[f"backward: block {b}"] = moment
        # c_attn's backward: only ln_1's tensors still saved, the block's other gradients made. Under
        # autocast its weight gradients come out of the matmul in bf16, cast to fp32 once dqkv is freed
        cast_bytes, attn_params = lm_head_bytes - matmul_bytes, 3 * d * d + 3 * d
        ln_1_saved = (ln_bytes + matmul_bytes) * N * d + 2 * ln_bytes * N
        c_attn_grads = max(4 * matmul_bytes * N * d - cast_bytes * attn_params,
                           matmul_bytes * N * d + matmul_bytes * 3 * d * d - cast_bytes * 3 * d if cast_bytes else 0)
        moments[f"backward: block {b} attention"] = {
            **moment, "saved activations": saved_during(b) - block_saved + ln_1_saved,
            "block backward: MLP gradients": 0, "block gradients but ln_1's": lm_head_bytes * (block_numel - 2 * d),
            "c_attn backward: dqkv, dx (+ bf16 gradients)": c_attn_grads}
    if fsdp:  # wte's gradient arrives twice (lm_head, embedding) and is summed into a third buffer
        moments["backward end"] = {**base, **root,
                                   "gradients": L * 4 * block_shard + resid_bytes * (root_numel - V * d),
                                   "wte gradient parts + sum": 3 * resid_bytes * V * d,
                                   "reduce-scatter input (block 0)": 4 * ranks * block_shard}
        moments["backward end: root reduce-scatter"] = {**base, "gradients": 4 * params,
                                                        "reduce-scatter input": 4 * ranks * root_shard}
    else:
        moments["backward end"] = {**base, "gradients": 4 * params, "wte gradient parts + sum": 8 * V * d}
    # fused AdamW (CUDA) updates in place; the CPU's loop makes two temporaries the size of wte, the largest
    moments["optimizer step"] = {**base, "gradients": 4 * params,
                                 "AdamW temporaries (CPU)": (not cuda) * 8 * -(-V // ranks) * d}
    totals = {k: sum(v.values()) for k, v in moments.items()}
    phases = {}
    for k, total in totals.items():  # the largest moment of each phase: forward, backward, ...
        phase = k.split()[0].rstrip(":")
        phases[phase] = max(phases.get(phase, (0, "")), (total, k))
    peak_at = max(totals, key=totals.get)
    return {"moments": moments, "totals": totals, "phases": phases, "peak": totals[peak_at], "peak_at": peak_at,
            "saved": saved + loss_saved, "params": params, "layer": block_saved, "per_layer": per_layer}


def predict_max_batch(config, T, dtype, budget, limit=1 << 16):
    """Largest batch whose predicted peak fits in `budget` bytes (0: none), by bisection: the peak grows with B."""
    lo, hi = 0, limit + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if account(config, mid, T, dtype)["peak"] <= budget else (lo, mid)
    return lo

# takeaway: the peak is 16 bytes per parameter, the saved activations and whatever short-lived buffer is alive then.

# --- 2. measuring: the CUDA allocator's peak, or live tensors counted op by op on the CPU


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storages, recounted after every op: what memory_allocated would say,
    on any device. Storages resized in place (FSDP frees gathered weights that way) count at their
    current size; a DTensor counts its local shard. `levels` lists (op, bytes after it)."""

    def __init__(self, tensors=()):
        super().__init__()
        self.storages, self.levels = {}, []
        for t in tensors:
            self.track(t)
        self.peak = self.now()

    def track(self, t):
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                self.track(getattr(t, name))
        elif isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            self.storages.setdefault(id(s), weakref.ref(s, lambda _, k=id(s): self.storages.pop(k, None)))

    def now(self):
        return sum(s.nbytes() for s in (ref() for ref in list(self.storages.values())) if s is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.track(t)
        self.levels.append((func, self.now()))
        self.peak = max(self.peak, self.levels[-1][1])
        return out

    def reset_peak(self):
        peak, self.peak = self.peak, self.now()
        return peak


def saved_bytes(fn, dtype, device, exclude=()):
    """Bytes of distinct storages that autograd saves for backward while fn() runs, beyond the
    tensors in `exclude` (weights and batch: alive anyway)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:  # views of one buffer (q, k, v) count once
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, dtype):
        fn()
    return sum(seen.values())


def state_tensors(model, optimizer):
    return [*model.parameters()] + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def random_batch(config, B, T, device):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, config.vocab_size, (B, T), generator=g).to(device) for _ in range(2)]


def step(model, opt, x, y, dtype, mark=None, forward=None):
    """gpt.train_step through `forward` (the model compiled, or its blocks checkpointed), mark(phase) after each."""
    forward = model if forward is None else forward  # (a compiled module has no truth value)
    # only the loss leaves the forward: the plain loss's logits are freed before backward, as `account` counts
    train_step(lambda x, y: (None, forward(x, y)[1]), opt, x, y, dtype, mark=mark)


def live_peaks(model, opt, x, y, dtype, forward=None):
    """{phase: peak live bytes} of a step on the CPU, after one that makes AdamW's state."""
    step(model, opt, x, y, dtype, forward=forward)
    peaks = {}
    with LiveBytes(state_tensors(model, opt) + [x, y]) as live:
        step(model, opt, x, y, dtype, lambda phase: peaks.__setitem__(phase, live.reset_peak()), forward)
    return peaks


def warm_up_libraries(device, dtype):
    """A linear forward and backward, so cuBLAS allocates its workspaces now (they stay for the
    process) and not inside the first measured step."""
    w = torch.randn(64, 64, device=device, requires_grad=True)
    with autocast(device, dtype):
        torch.nn.functional.linear(torch.randn(2, 64, device=device), w, w[0]).float().sum().backward()
    synchronize(device)


def measure_step(config, B, T, dtype, device, compiled=False):
    """{phase: peak allocated bytes} in the third step of a fresh model (the first allocates
    AdamW's state, and compiles), counted above what was allocated before the model existed."""
    warm_up_libraries(device, dtype)
    free_memory()
    start = torch.cuda.memory_allocated(device)
    model = opt = batch = forward = None
    peaks = {}

    def mark(phase):
        synchronize(device)
        peaks[phase] = torch.cuda.max_memory_allocated(device) - start
        torch.cuda.reset_peak_memory_stats(device)

    try:
        with torch.device(device):  # initialise on the GPU: seconds faster for xl than CPU + .to()
            model = GPT(config)
        opt, batch = configure_optimizer(model, lr=1e-4), random_batch(config, B, T, device)
        forward = compile_model(model) if compiled else model
        for _ in range(2):
            step(model, opt, *batch, dtype, forward=forward)
        torch.cuda.reset_peak_memory_stats(device)
        step(model, opt, *batch, dtype, mark, forward)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        peaks = None
    del model, opt, batch, forward
    free_memory()  # outside the except block, whose traceback holds the tensors
    return peaks

# takeaway: counting live storages after every op gives memory_allocated's answer on any device, CPU included.

# --- 3. account: the model against the allocator (GPU) or against live tensors (CPU)

def fitting_batch(cfg, T, dtype, device):  # 5% kept back: the caching allocator fragments near the limit
    return predict_max_batch(cfg, T, dtype, torch.cuda.mem_get_info(device)[0] * 0.95)

def fits(n):  # the prediction in words
    return f"the model predicts batch {n} fits" if n else "the model predicts not even batch 1 fits in the free memory"


def fail_out_of_memory(cfg, B, T, dtype, device):
    fail(f"batch {B} x seq {T} ({'bf16' if dtype else 'fp32'}, {cfg.n_layer} layers, d={cfg.n_embd}) does not fit in "
         f"this GPU's memory; {fits(fitting_batch(cfg, T, dtype, device))}")


def check_host_fits(cfg, B, T, dtype, peak):  # a counted step runs after an uncounted one: about 2x the peak
    check_host_memory(2 * peak, f"batch {B} x seq {T} ({cfg.n_layer} layers, d={cfg.n_embd})",
                      lambda free: fits(predict_max_batch(cfg, T, dtype, free / 2)))


def config_of(args, model=None, **overrides):
    return make_config(model or args.model, attn=args.attn, vocab_size=args.vocab, fused_ce=not args.unfused,
                       recompute=args.recompute, **overrides)


def print_breakdown(pred, peaks=None):
    """What a block saves, what is alive at the predicted peak, and each phase's peak (predicted, measured)."""
    mib = lambda v: f"{v / 2**20:,.2f}"
    rows = [[k, mib(v)] for k, v in pred["per_layer"].items()]
    print_table(["saved by one block", "MiB"], rows + [["per block, with autocast's copies", mib(pred["layer"])]])
    print()
    rows = [[k, mib(v)] for k, v in pred["moments"][pred["peak_at"]].items() if v]
    print_table([f"alive at the predicted peak ({pred['peak_at']})", "MiB"],
                rows + [["predicted peak", mib(pred["peak"])]])
    print()
    print_table(["phase", "its predicted peak moment", "predicted MiB", "measured MiB"],
                [[ph, at, mib(v), mib(peaks[ph]) if peaks else "n/a"] for ph, (v, at) in pred["phases"].items()])


def part_account(args, device):
    dtype, kw, cuda = amp_dtype(args.bf16), dict(ddp=args.ddp, compiled=args.compile), device.type == "cuda"
    if args.fsdp or args.ddp:  # a rank of torchrun train.py: predicted here, measured there
        cfg = config_of(args)
        pred = account(cfg, args.batch, args.seq, dtype, "cuda", world=args.world if args.fsdp else 0, **kw)
        print_breakdown(pred)
        scheme = f"FSDP2 over {args.world} GPUs ({pred['params']:,} of {param_count(cfg):,} parameters per rank)" \
            if args.fsdp else "a DDP rank"
        print(f"account: predicted peak {gib(pred['peak'])} GiB at {pred['peak_at']} for {scheme}, "
              f"{'compiled' if args.compile else 'eager'}; measure it with torchrun --nproc_per_node={args.world} "
              f"train.py{' --fsdp' * args.fsdp} and the same flags (its summary's peak mem)")
        return
    B, rows, errors = args.batch, [], []
    runs = [(m, T, dt) for m in args.models for T in args.seqs for dt in (None, torch.bfloat16)] \
        if args.sweep else [(args.model, args.seq, dtype)]
    for m, T, dt in runs:
        cfg, name = config_of(args, m), f"{m} T={T} {'bf16' if dt else 'fp32'}"
        pred = account(cfg, B, T, dt, device.type, **kw)
        if cuda:
            peaks = measure_step(cfg, B, T, dt, device, args.compile)
        else:  # no allocator to ask, but live tensors can be counted op by op
            check_host_fits(cfg, B, T, dt, pred["peak"])
            model = GPT(cfg)
            opt, (x, y) = configure_optimizer(model, lr=1e-4), random_batch(cfg, B, T, "cpu")
            peaks = live_peaks(model, opt, x, y, dt)
            saved = saved_bytes(lambda: model(x, y), dt, device, [*model.parameters(), x, y])
        if peaks is None and not args.sweep:
            fail_out_of_memory(cfg, B, T, dt, device)
        cells = ["OOM", "n/a", "n/a"]
        if peaks:
            measured = max(peaks.values())
            errors.append(100 * (pred["peak"] / measured - 1))
            cells = [gib(measured), f"{errors[-1]:+.1f}", max(peaks, key=peaks.get)]
        rows.append([name, gib(pred["peak"]), *cells, pred["peak_at"]])
        if args.sweep:
            print("  " + "  ".join(rows[-1]), flush=True)
        else:
            print_breakdown(pred, peaks)
            if cuda:
                print(f"largest batch predicted to fit in 95% of this GPU's free memory: "
                      f"{fitting_batch(cfg, T, dt, device)}")
            else:
                print(f"saved for backward: predicted {pred['saved']:,} bytes, saved-tensor hooks saw {saved:,}")
    if args.sweep:
        print_table(["model / seq / dtype", "predicted GiB", "measured GiB", "error %", "measured peak phase",
                     "predicted peak moment"], rows)
    worst = f"{max(map(abs, errors)):.{1 if cuda else 4}f}%" if errors else "n/a"
    print(f"account: batch {B}, {'unfused' if args.unfused else 'fused'} loss, attention {args.attn}, recompute "
          f"{args.recompute or 'off'}, {'compiled' if args.compile else 'eager'}; worst |error| {worst} over "
          f"{len(errors)} configurations that fit (target 10%)")

# takeaway: the prediction is exact against live tensors on a CPU; on a GPU the allocator judges it (target 10%).

# --- 4. checkpoint: which group size of recomputed blocks needs the least memory


def grouped_forward(model, k):
    """gpt.py's training forward with every group of k consecutive blocks checkpointed (k=0: none):
    a group keeps only its input, and is recomputed, as a whole, when backward reaches it."""
    def forward(idx, targets):
        x = model.wte(idx) + model.wpe(torch.arange(idx.size(1), device=idx.device))
        for i in range(0, len(model.h), k or len(model.h)):
            group = torch.nn.Sequential(*model.h[i:i + (k or len(model.h))])
            x = checkpoint(group, x, use_reentrant=False) if k else group(x)
        return None, linear_cross_entropy(model.ln_f(x).flatten(0, 1), model.lm_head.weight, targets.flatten())
    return forward


def part_checkpoint(args, device):
    dtype, B, T, cuda = amp_dtype(args.bf16), args.batch, args.seq, device.type == "cuda"
    cfg = config_of(args, block_size=max(T, make_config(args.model).block_size))
    predicted = {k: account(cfg, B, T, dtype, device.type, groups=k)["peak"] for k in range(cfg.n_layer + 1)}
    best = min(range(1, cfg.n_layer + 1), key=predicted.get)
    ks = [0] + sorted({1, best - 1, best, best + 1, round(math.sqrt(cfg.n_layer))} & set(range(1, cfg.n_layer + 1)))
    print(f"{args.model} (block size {cfg.block_size}), B={B}, T={T}, {'bf16' if dtype else 'fp32'}: predicted best "
          f"group size k={best} ({gib(predicted[best])} GiB); measuring k in {ks} (k=0: no checkpointing)")
    if cuda:
        warm_up_libraries(device, dtype)
    start = torch.cuda.memory_allocated(device) if cuda else 0
    try:
        with torch.device(device):
            model = GPT(cfg)
        opt, (x, y) = configure_optimizer(model, lr=1e-4), random_batch(cfg, B, T, device)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        fail(f"{args.model}'s weights ({gib(4 * param_count(cfg))} GiB) and AdamW state do not fit on this GPU")
    variants = {f"k={k}": (lambda k=k: step(model, opt, x, y, dtype, forward=grouped_forward(model, k))) for k in ks}
    timings = compare(variants, device, baseline="k=0", rounds=args.rounds, steps=1, warmup=2,
                      progress=lambda r: print(f"  round {r + 1}/{args.rounds}", flush=True))
    rows, measured = [], {}
    for k in ks:
        t = timings[f"k={k}"]
        if t is not None:  # the allocator's peak in warm-up; on the CPU, live tensors in more steps
            forward = grouped_forward(model, k)
            measured[k] = t.peak - start if cuda else max(live_peaks(model, opt, x, y, dtype, forward).values())
        err = f"{100 * (predicted[k] / measured[k] - 1):+.1f}" if k in measured else "n/a"
        rows.append([f"k={k}" if k else "none", gib(predicted[k]), gib(measured[k]) if k in measured else "OOM", err,
                     t.ms() if t else "OOM", t.vs() if t else "n/a"])
    print_table(["checkpoint groups", "predicted GiB", f"measured GiB ({'allocated' if cuda else 'live tensors'})",
                 "error %", f"ms/step, median (min-max) of {args.rounds} rounds", "vs none (paired)"], rows)
    top = min(measured, key=measured.get, default=None)
    print(f"checkpoint: predicted best k={best}, measured best k={top} ({gib(measured[top]) if measured else 'n/a'} "
          f"GiB; none: {gib(measured[0]) if 0 in measured else 'OOM'})")

# takeaway: checkpointing trades a block's saved activations for a recomputed forward; the group size sets the trade.

# --- 5. parallel: bytes per rank under data parallelism, ZeRO-1, ZeRO-2 and FSDP (ZeRO-3)

SCHEMES = ("DP", "ZeRO-1", "ZeRO-2", "FSDP (ZeRO-3)")


def per_rank_bytes(n_params, world, stage):
    """fp32 weights, gradients and AdamW state (4 + 4 + 8 bytes per parameter) on one rank: ZeRO-1
    shards the optimizer state over the ranks, ZeRO-2 the gradients too, FSDP also the weights
    (stage 0: plain data parallelism, everything replicated)."""
    share = lambda nbytes, s: n_params * nbytes / (world if stage >= s else 1)
    return {"weights": share(4, 3), "gradients": share(4, 2), "optimizer state": share(8, 1)}


def part_parallel(args, device):
    W = args.world
    if args.model:  # a GPT preset: activations from section 1, FSDP's padded shards
        cfg, dtype = config_of(args), amp_dtype(args.bf16)
        single, fsdp = account(cfg, args.batch, args.seq, dtype), account(cfg, args.batch, args.seq, dtype, world=W)
        rows = []
        for stage, name in enumerate(SCHEMES):
            parts = per_rank_bytes(W * fsdp["params"] if stage == 3 else param_count(cfg), W, stage)  # padded
            parts["activations (saved)"] = (fsdp if stage == 3 else single)["saved"]
            rows.append([f"{name}, {W} ranks", *(gib(v) for v in parts.values()), gib(sum(parts.values()))])
        print_table(["scheme", "weights GiB", "gradients GiB", "optimizer GiB", "activations GiB", "sum GiB"], rows)
        print(f"parallel: {args.model}, B={args.batch} T={args.seq} per rank; FSDP's predicted peak with its gathered "
              f"weights and buffers: {gib(fsdp['peak'])} GiB ({fsdp['peak_at']}), one GPU's: {gib(single['peak'])} GiB")
        return
    # the worked example: 126 blocks of two bias-free linear layers, d_model 16384 <-> d_ff 53248
    n = args.params or 126 * 2 * 16384 * 53248
    total, act = n * 16, args.act_gb * GB
    print(f"{n:,} parameters x (4 weights + 4 gradients + 8 AdamW) bytes = {total / GB:,.0f} GB of model state; "
          f"{math.ceil(total / (80 * GB))} GPUs of 80 GB hold it only if it is fully sharded")
    rows = []
    for N in sorted({8, 64, W}):
        for stage, name in enumerate(SCHEMES):
            parts = per_rank_bytes(n, N, stage)
            b = sum(parts.values()) + act
            rows.append([f"{name}, {N} ranks", *(f"{v / GB:,.1f}" for v in parts.values()), f"{act / GB:,.1f}",
                         f"{b / GB:,.1f}", "yes" if b <= args.device_gb * GB else "no"])
    print_table(["scheme", "weights GB", "gradients GB", "optimizer GB", "activations GB", "total GB",
                 f"fits {args.device_gb:g} GB"], rows)
    need = math.ceil(total / (args.device_gb * GB - act)) if args.device_gb * GB > act else "n/a"
    print(f"parallel: N_FSDP = {need} devices of {args.device_gb:g} GB hold {total / GB:,.0f} GB with "
          f"{args.act_gb:g} GB of activations each")

# takeaway: ZeRO shards optimizer state, then gradients, then weights; only full sharding divides all 16 bytes.

# --- 6. snapshot: the allocator's own record of a step, for pytorch.org/memory_viz


def part_snapshot(args, device):
    cfg, dtype = config_of(args), amp_dtype(args.bf16)
    try:
        with torch.device(device):
            model = GPT(cfg)
        opt, (x, y) = configure_optimizer(model, lr=1e-4), random_batch(cfg, args.batch, args.seq, device)
        step(model, opt, x, y, dtype)  # AdamW's state exists before recording starts
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        for _ in range(2):
            step(model, opt, x, y, dtype)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        torch.cuda.memory._record_memory_history(enabled=None)
        model = opt = x = y = e = None
        free_memory()
        fail_out_of_memory(cfg, args.batch, args.seq, dtype, device)
    torch.cuda.memory._dump_snapshot(args.out)
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"snapshot: 2 steps recorded in {args.out}, peak {gib(torch.cuda.max_memory_allocated(device))} GiB "
          f"allocated; drag the file onto https://pytorch.org/memory_viz to see every allocation, its size and the "
          f"Python line that made it")

# takeaway: when the model and the allocator disagree, the snapshot names every allocation and its line.

# --- 7. command line

# per part: (model, batch, seq) on a GPU, and seconds-long sizes on a CPU
DEFAULTS = {"checkpoint": (("2.7B", 4, 2048), ("tiny", 2, 64)), "parallel": ((None, 4, 1024), (None, 4, 1024))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", help=" | ".join(PARTS))
    p.add_argument("--model", help="preset (default gpt2 on a GPU, tiny on a CPU; parallel: the worked example)")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (weights stay fp32)")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--vocab", type=int, default=GPT2_VOCAB)
    p.add_argument("--unfused", action="store_true", help="plain lm_head + F.cross_entropy instead of the fused loss")
    p.add_argument("--recompute", type=int, default=0, metavar="K", help="checkpoint every K-th block (gpt.py)")
    p.add_argument("--fsdp", action="store_true", help="account: predict a rank of torchrun train.py --fsdp")
    p.add_argument("--ddp", action="store_true", help="account: predict a rank of torchrun train.py (DDP)")
    p.add_argument("--compile", action="store_true", help="account: torch.compile's saved tensors (and measure so)")
    p.add_argument("--world", type=int, help="ranks for --fsdp, --ddp and parallel (default 2; worked example 16)")
    p.add_argument("--device")
    p.add_argument("--sweep", action="store_true", help="account: gpt2..xl x T=128..1024, fp32 and bf16 (CUDA)")
    p.add_argument("--rounds", type=int, help="checkpoint: interleaved timing rounds (default 10; 2 on a CPU)")
    p.add_argument("--out", default="memory_snapshot.pickle", help="snapshot: the .pickle to write")
    p.add_argument("--params", type=int, help="parallel: parameter count (default: the worked example)")
    p.add_argument("--device-gb", type=float, default=95.0, help="parallel: memory per device, GB")
    p.add_argument("--act-gb", type=float, default=0.0, help="parallel: activation GB per device")
    args = p.parse_args(argv)
    if args.part not in PARTS:
        fail(f"unknown part '{args.part}'; choose from {', '.join(PARTS)}")
    try:
        device = resolve_device(args.device)
        cuda = device.type == "cuda"
        args.models, args.seqs = [args.model] if args.model else SWEEP_MODELS, [args.seq] if args.seq else SWEEP_SEQS
        model, batch, seq = DEFAULTS.get(args.part, (("gpt2", 8, 512), ("tiny", 2, 64)))[not cuda]
        for name, value in (("model", model), ("batch", batch), ("seq", seq), ("rounds", 10 if cuda else 2),
                            ("world", 16 if args.part == "parallel" and not args.model else 2)):
            if getattr(args, name) is None:
                setattr(args, name, value)
        cfg = config_of(args, args.model or "gpt2")
    except ValueError as e:
        fail(str(e))
    limit = 1 << 16 if args.part == "checkpoint" else cfg.block_size  # checkpoint grows the block size
    rank = args.fsdp or args.ddp  # a rank of torchrun train.py: predicted, not measured
    checks = [(1 <= args.seq <= limit, f"--seq {args.seq} must be between 1 and the block size {limit}"),
              (min(args.batch, args.rounds, 1 if args.params is None else args.params) >= 1,
               "--batch, --rounds and --params must be positive"),
              (args.world >= 1 + rank, f"--world {args.world} must be at least {1 + rank}"),
              (args.device_gb > 0 and args.act_gb >= 0, "--device-gb must be positive and --act-gb not negative"),
              (cuda or args.attn not in GPU_ONLY_ATTENTION, f"--attn {args.attn} needs a CUDA GPU"),
              (not args.sweep or (args.part == "account" and cuda and not (rank or args.compile)),
               "--sweep is for account on a CUDA GPU (measured peaks), one process, eager"),
              (not (rank or args.compile) or args.part == "account", "--fsdp, --ddp and --compile apply to account"),
              (not (args.fsdp and args.ddp), "--fsdp and --ddp exclude each other"),
              (not (args.compile and args.unfused), "--compile models the fused loss (compile rewrites the plain one)"),
              (cuda or rank or not args.compile, "--compile is measured on a CUDA GPU (predicted with --fsdp/--ddp)"),
              (args.part != "checkpoint" or not (args.recompute or args.unfused),
               "checkpoint compares its own group sizes with the fused loss; leave out --recompute and --unfused"),
              (args.part != "snapshot" or args.out.endswith(".pickle"), f"--out {args.out} must name a .pickle file")]
    for ok, message in checks:
        if not ok:
            fail(message)
    if args.part == "snapshot":
        try:
            check_output_path(args.out, "--out", ours=lambda path: open(path, "rb").read(1) == b"\x80")
        except ValueError as e:
            fail(str(e))
        if not cuda:
            fail("snapshot records the CUDA allocator: it needs a CUDA GPU")
    if not cuda and args.part in ("account", "checkpoint") and not rank:
        print(f"no CUDA: {args.part} counts live tensors on the CPU at seconds-long sizes "
              f"(model {args.model}, batch {args.batch}, seq {args.seq})")
    globals()["part_" + args.part.replace("-", "_")](args, device)


if __name__ == "__main__":
    run_main(main)  # Ctrl-C / SIGTERM: one line, exit 130 / 143
