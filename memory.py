"""Where a training step's memory goes, predicted before you run it: one GPU, a DDP or an FSDP rank.

A step holds the weights and AdamW's state (16 bytes per parameter), the activations saved for
backward, and short-lived buffers whose timing decides the peak. `account` lists what is alive at
each moment of a step, one function per component, checked against live tensors on a CPU and
max_memory_allocated on a GPU; `checkpoint` trades activations for recomputation, flat or nested
(sqrt(L) groups); `parallel` is the course's calculator for collectives, DP, ZeRO, FSDP and TP;
`snapshot` records the allocator's own history for memory_viz and draws its timeline.

    python memory.py account --model gpt2 --seq 1024 --batch 16 --bf16 [--compile]   # predicted vs measured
    python memory.py account --sweep --batch 8 [--model xl] [--unfused]   # gpt2..xl x 128..1024 x fp32/bf16
    python memory.py account --model 2.7B --batch 16 --seq 1024 --bf16 --vocab 50304 --fsdp --compile
    python memory.py checkpoint --model xl --batch 4 --seq 2048 --bf16 [--full]   # each at its best [every size]
    python memory.py parallel --bf16 [--devices 64 --tp 4 | --model xl --tp 5 --devices 10]   # pure arithmetic
    python memory.py parallel --bf16 --tflops 990     # + the handout's FFN layer, each answer's expression
    python memory.py snapshot --model 2.7B --batch 4 --seq 128,2048 --dtypes fp32,bf16 --plot snap.png"""

import argparse
import math
import os
import sys
import weakref
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from gpt import (CE_CHUNK_ROWS, GPT, GPT2_VOCAB, GPU_ONLY_ATTENTION, GPTConfig, amp_dtype, autocast,
                 check_host_memory, check_output_path, compare, compile_model, configure_optimizer, fail, float_in,
                 free_memory, gib, int_in, int_list, is_oom, make_config, name_list, on_device, plot_path, plot_to,
                 print_table, resolve_device, run_main, saved_tensor_bytes, synchronize, train_step)

PARTS = ("account", "checkpoint", "parallel", "snapshot")
SWEEP_MODELS = ("gpt2", "medium", "large", "xl")  # "small" has gpt2's shape
SWEEP_SEQS = (128, 256, 512, 1024)
GB = 1e9  # parallel speaks decimal GB and GB/s, like GPU data sheets and the course

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


@dataclass
class StepSizes:
    """What every term of `account` is made of: the model, N = B*T tokens, and the widths in bytes of
      matmul  matmul operands and what they save: 2 under autocast, else 4
      resid   the residual stream and FSDP's gathered weights: 2 only under FSDP's bf16 compute
      ln      LayerNorm's input and output: 4 on CUDA (autocast's fp32), the stream's width on the CPU
    ranks is 1, or FSDP's world (then every parameter is a padded shard: see `numel`)."""
    config: GPTConfig
    N: int
    T: int
    cuda: bool
    ranks: int
    matmul: int
    resid: int
    ln: int

    @property
    def fsdp(self):
        return self.ranks > 1

    def shard(self, shapes):  # elements of these parameters on this rank
        return numel(shapes, self.ranks)

    @property
    def params(self):  # parameters this rank holds: L blocks and the root (wte, wpe, ln_f)
        return self.config.n_layer * self.shard(block_shapes(self.config)) + self.shard(root_shapes(self.config))

    @property
    def weight_copy(self):  # bytes per weight of autocast's bf16 copies (under FSDP weights arrive in bf16: none)
        return 2 if self.matmul == 2 and not self.fsdp else 0

    @property
    def lm_head_bytes(self):  # lm_head's weight (and so its gradient) as the loss sees it
        return self.resid if self.fsdp else 4

    @property
    def gather_buffer(self):  # FSDP: one block's all-gather buffer, every rank's shard
        return self.resid * self.ranks * self.shard(block_shapes(self.config)) if self.fsdp else 0


def sizes_of(config, B, T, dtype, device_type, world):
    cuda, ranks = device_type == "cuda", max(world, 1)
    matmul = 4 if dtype is None else 2
    resid = 2 if ranks > 1 and dtype is not None else 4
    ln = 2 if resid == 2 and not cuda else 4
    return StepSizes(config, B * T, T, cuda, ranks, matmul, resid, ln)


def block_matrices(config):  # elements of a block's four matrices: c_attn 3d², attn c_proj d², c_fc and c_proj 2df
    return 4 * config.n_embd ** 2 + 2 * config.n_embd * config.d_ff


def state_bytes(s, ddp):
    """Alive at every moment: fp32 weights 4 P; AdamW's two fp32 moments 8 P and a 4-byte step per tensor
    (12 L + 4 of them; CUDA's allocator rounds each to 512 bytes); the batch 16 N (int64 idx, targets); under DDP
    its fp32 gradient buckets 4 P, alive all run. P: the parameters this rank holds."""
    steps = (12 * s.config.n_layer + 4) * (512 if s.cuda else 4)
    base = {"weights (fp32)": 4 * s.params, "AdamW moments + step": 8 * s.params + steps,
            "batch (idx, targets)": 16 * s.N}
    if ddp:
        base["DDP gradient buckets (fp32)"] = 4 * s.params
    return base


def gathered_root(s):  # FSDP: wte, wpe and ln_f gathered whole (resid bytes each) for the whole step
    if not s.fsdp:
        return {}
    return {"gathered weights: wte, wpe, ln_f": s.resid * numel(root_shapes(s.config))}


def autocast_copies(s):
    """Weight copies one block keeps for backward under autocast: its matrices in bf16, 2 * block_matrices bytes;
    under FSDP they arrive in bf16 and only LayerNorm's 4 vectors are upcast to fp32 on CUDA, 4 * 4d bytes."""
    if s.matmul == 4:  # fp32: no copies
        return 0
    if not s.fsdp:
        return 2 * block_matrices(s.config)
    if s.ln != s.resid:
        return 16 * s.config.n_embd
    return 0


def checkpoint_plan(n_layer, recompute, groups):
    """{block: first block of its checkpointed run}, {} without checkpointing: gpt.py's recompute K checkpoints
    every K-th block alone; `groups` g checkpoints every run of g consecutive blocks (recomputed together)."""
    every, size = groups or recompute, groups or 1
    if not every:
        return {}
    return {i: first for first in range(0, n_layer, every) for i in range(first, min(first + size, n_layer))}


def kept_per_block(s, plan, block_saved):
    """What each block keeps from its forward to its backward: a run's first block its input, N d resid bytes;
    the rest of a checkpointed run nothing; a block outside any run all it saves (block_saved)."""
    kept = []
    for i in range(s.config.n_layer):
        if plan.get(i) == i:
            kept.append(s.resid * s.N * s.config.n_embd)
        elif i in plan:
            kept.append(0)
        else:
            kept.append(block_saved)
    return kept


def saved_during(s, b, plan, kept, block_saved, nested):
    """Saved while block b runs backward: what the blocks below keep, plus b's run recomputed from its first block
    up to b: (b - first + 1) whole blocks; nested (each block checkpointed again inside the run's recompute) only
    the inputs of blocks first+1..b, N d resid bytes each, and b whole. The run's input is saved again by LayerNorm
    when their widths agree (one storage), else it is held on its own."""
    first = plan.get(b, b)
    held = kept[first] if b in plan and s.ln != s.resid else 0
    if nested and b in plan:
        return sum(kept[:first]) + held + (b - first) * s.resid * s.N * s.config.n_embd + block_saved
    return sum(kept[:first]) + held + (b - first + 1) * block_saved


def head_saved(s):  # ln_f's input (ln N d), its mean and rstd (2 ln N), the positions (8 T), fp32 ln_f weights (8 d)
    d = s.config.n_embd
    upcast_weights = 8 * d if s.ln != s.resid else 0
    return s.ln * s.N * d + 2 * s.ln * s.N + 8 * s.T + upcast_weights


def fused_loss_moments(s, alive, saved, n_checkpointed):
    """gpt.linear_cross_entropy: dx and dW made during the forward, chunk by chunk of CE_CHUNK_ROWS rows. On CUDA the
    Triton kernel writes each chunk's gradient over its logits (V rows matmul bytes); the CPU path makes fp32
    temporaries per row: the upcast (under bf16), z - lse and its exp. The previous chunk's logits are still
    referenced while the next chunk's are made. dW is the first chunk's product, made while that chunk's logits
    live, and the later chunks add to it. Returns (moments, bytes the loss saves for backward)."""
    d, V, N, mm = s.config.n_embd, s.config.vocab_size, s.N, s.matmul
    loss_saved = s.ln * N * d + s.lm_head_bytes * V * d  # ln_f's output, lm_head's weight
    chunk_rows = [min(CE_CHUNK_ROWS, N - start) for start in range(0, N, CE_CHUNK_ROWS)]
    cpu_temps = 0  # fp32 bytes per row the CPU path makes: z - lse and its exp, and the upcast under 16-bit
    if not s.cuda:
        upcast = 0
        if mm != 4:
            upcast = 4
        cpu_temps = (8 + upcast) * min(V, GPT2_VOCAB)
    dw = mm * V * d  # dW, in the compute dtype
    chunk_peak = 0
    for i, (prev, rows) in enumerate(zip([0] + chunk_rows, chunk_rows)):
        beside = max(mm * V * prev, cpu_temps * rows, mm * rows * d)  # the last logits, CPU temporaries, dx's chunk
        if i == 0:  # no dW yet while those are made; then the first chunk's dW is made beside its logits
            beside = max(beside, dw)
        else:
            beside += dw
        chunk_peak = max(chunk_peak, mm * V * rows + beside)
    ln_f_out = s.ln * N * d + (mm * N * d if mm != s.ln else 0)
    forward = {**alive, "saved activations": saved, "all-gather buffer (last block)": s.gather_buffer,
               "autocast's bf16 weight cache (checkpointed blocks)":
                   n_checkpointed * block_matrices(s.config) * s.weight_copy,
               "ln_f output (+ bf16 copy)": ln_f_out,
               "loss: dx, weight copy": s.ln * N * d + V * d * s.weight_copy}
    last_chunk = mm * V * chunk_rows[-1] + 8 * N  # its logits, and every row's loss (fp32) and target
    dw_cast = 4 * V * d if s.lm_head_bytes != mm else 0
    return {"forward: loss chunk": {**forward, "loss: chunk logits, temporaries, dW": chunk_peak},
            "forward: loss end": {**forward, "loss: dW (compute dtype)": dw,
                                  "loss: last chunk's logits, per-row losses": last_chunk,
                                  "loss: dW cast to the weight's dtype": dw_cast},
            "backward start": {**alive, "saved activations": saved + loss_saved,
                               "loss gradients dx*g, dW*g": s.ln * N * d + s.lm_head_bytes * V * d,
                               "all-gather buffer (prefetch)": s.gather_buffer}}, loss_saved


def plain_loss_moments(s, alive, saved):
    """lm_head's logits (N V), F.cross_entropy's fp32 log-probs (4 N V, saved) and, in backward, their gradients.
    Returns (moments, bytes the loss saves for backward)."""
    d, V, N, mm = s.config.n_embd, s.config.vocab_size, s.N, s.matmul
    loss_saved = mm * N * d + 4 * N * V + 4 + V * d * s.weight_copy  # ln_f output, log-probs, the weight copy
    logits = mm * N * V + (4 * N * V if mm == 2 else 0)  # + the fp32 upcast under autocast
    weight_grads = (6 if mm == 2 else 4) * V * d  # fp32, and its bf16 first under autocast
    return {"forward end": {**alive, "saved activations": saved + loss_saved, "logits + fp32 upcast": logits},
            "backward start": {**alive, "saved activations": saved + loss_saved, "nll + log-softmax grads": 8 * N * V},
            "backward: lm_head": {**alive, "saved activations": saved + loss_saved - 4 * N * V,
                                  "logits grad + lm_head weight grad": mm * N * V + weight_grads}}, loss_saved


def block_backward_moments(s, b, alive, during, below, block_saved):
    """Block b's backward: its MLP gradients (dx upcast to the stream, the gelu gradient N f, dW d f) with its whole
    recomputed or saved activations (`during`); then c_attn's, when only ln_1's tensors are still saved and the
    block's other gradients exist (under autocast its weight gradients come out of the matmul in bf16, cast to fp32
    once dqkv is freed). FSDP: this block gathered, the next one's all-gather in flight, the last reduce-scatter
    kept, and a moment when the block is done, its gradients whole before their reduce-scatter."""
    L, d, f, N, mm = s.config.n_layer, s.config.n_embd, s.config.d_ff, s.N, s.matmul
    block_numel, block_shard = numel(block_shapes(s.config)), s.shard(block_shapes(s.config))
    upcast_dx = mm * N * d if mm != s.resid else 0
    moment = {**alive, "saved activations": during,
              "gradients": (L - 1 - b) * 4 * block_shard + 2 * s.resid * d,  # the blocks above, ln_2's
              "lm_head weight gradient": s.lm_head_bytes * s.config.vocab_size * d,
              "residual gradient": s.resid * N * d,
              "block backward: MLP gradients": upcast_dx + mm * N * f + mm * d * f}
    moments = {}
    if s.fsdp:
        moment["gathered weights: block + prefetch"] = s.resid * block_numel + (s.gather_buffer if b else 0)
        moment["reduce-scatter input (block above)"] = 4 * s.ranks * block_shard if b < L - 1 else 0
        moments[f"backward: block {b} done"] = {
            **moment, "saved activations": below, "block backward: MLP gradients": 0,
            "block gradients (gathered)": s.resid * block_numel,
            "residual gradient": (2 * s.resid + max(s.resid, s.ln)) * N * d}
    moments[f"backward: block {b}"] = moment
    cast_bytes, attn_params = s.lm_head_bytes - mm, 3 * d * d + 3 * d
    ln_1_saved = (s.ln + mm) * N * d + 2 * s.ln * N
    bf16_grads = mm * N * d + mm * 3 * d * d - cast_bytes * 3 * d if cast_bytes else 0
    moments[f"backward: block {b} attention"] = {
        **moment, "saved activations": during - block_saved + ln_1_saved, "block backward: MLP gradients": 0,
        "block gradients but ln_1's": s.lm_head_bytes * (block_numel - 2 * d),
        "c_attn backward: dqkv, dx (+ bf16 gradients)": max(4 * mm * N * d - cast_bytes * attn_params, bf16_grads)}
    return moments


def end_moments(s, base, alive):
    """Backward's end: every gradient (4 P); wte's arrives twice (lm_head, embedding) and is summed into a third
    buffer, or with the fused loss and gpt.TiedEmbedding the embedding's rows are added into a copy of the loss's
    dW (two buffers); FSDP then reduce-scatters the root. The optimizer: fused AdamW (CUDA) updates in place; the
    CPU's loop makes two fp32 temporaries the size of wte's shard, the largest tensor."""
    L, d, V = s.config.n_layer, s.config.n_embd, s.config.vocab_size
    tied = s.config.fused_ce and s.config.embedding_into_dw
    wte_buffers = 3  # lm_head's, the embedding's and their sum
    rows = 0
    if tied:  # the loss's dW and its copy, made while the embedding's gradient rows are alive
        wte_buffers, rows = 2, s.resid * s.N * d
    grads = 4 * s.params
    if s.fsdp:
        block_shard, root_shard = s.shard(block_shapes(s.config)), s.shard(root_shapes(s.config))
        root_but_wte = numel(root_shapes(s.config)) - V * d
        moments = {"backward end": {**alive, "gradients": L * 4 * block_shard + s.resid * root_but_wte,
                                    "wte gradient parts + sum": wte_buffers * s.resid * V * d,
                                    "embedding's gradient rows": rows,
                                    "reduce-scatter input (block 0)": 4 * s.ranks * block_shard},
                   "backward end: root reduce-scatter": {**base, "gradients": grads,
                                                         "reduce-scatter input": 4 * s.ranks * root_shard}}
    else:
        parts = 4 * (wte_buffers - 1) * V * d  # the sum (or copy) is the gradient, counted in grads
        moments = {"backward end": {**base, "gradients": grads, "wte gradient parts + sum": parts,
                                    "embedding's gradient rows": rows}}
    adamw_temps = 0 if s.cuda else 8 * -(-V // s.ranks) * d
    moments["optimizer step"] = {**base, "gradients": grads, "AdamW temporaries (CPU)": adamw_temps}
    return moments


def account(config, B, T, dtype, device_type="cuda", world=0, groups=0, ddp=False, compiled=False, nested=False):
    """Bytes alive at each moment of a steady-state training step, by component, for one process,
    a DDP rank (ddp) or (world > 1) rank 0 of FSDP2: fully_shard per block then the root, bf16
    gathering when dtype is set. compiled: blocks save what torch.compile keeps (saved_per_layer);
    the fused loss, gpt.py's own chunk loop, is counted as eager runs it. groups g: every run of g
    blocks checkpointed (nested: each block again inside the run's recompute).

    Every moment is the state (state_bytes) plus what is alive only then, each term a count of
    elements times its width in bytes (StepSizes), one function per component above.
    Returns moments, totals, phases ({forward|backward|optimizer: (bytes, moment)}), peak and
    peak_at, saved (bytes saved for backward beyond weights and batch), params."""
    s = sizes_of(config, B, T, dtype, device_type, world)
    base = state_bytes(s, ddp)
    alive = {**base, **gathered_root(s)}
    per_layer = saved_per_layer(config, B, T, s.matmul, s.ln, s.resid, s.cuda, compiled)
    block_saved = sum(per_layer.values()) + autocast_copies(s)
    plan = checkpoint_plan(config.n_layer, config.recompute, groups)
    kept = kept_per_block(s, plan, block_saved)
    saved = sum(kept) + head_saved(s)
    if config.fused_ce:
        moments, loss_saved = fused_loss_moments(s, alive, saved, len(plan))
    else:
        moments, loss_saved = plain_loss_moments(s, alive, saved)
    for b in range(config.n_layer - 1, -1, -1):
        during = saved_during(s, b, plan, kept, block_saved, nested)
        moments |= block_backward_moments(s, b, alive, during, sum(kept[:plan.get(b, b)]), block_saved)
    moments |= end_moments(s, base, alive)
    totals = {k: sum(v.values()) for k, v in moments.items()}
    phases = {}
    for k, total in totals.items():  # the largest moment of each phase: forward, backward, ...
        phase = k.split()[0].rstrip(":")
        phases[phase] = max(phases.get(phase, (0, "")), (total, k))
    peak_at = max(totals, key=totals.get)
    return {"moments": moments, "totals": totals, "phases": phases, "peak": totals[peak_at], "peak_at": peak_at,
            "saved": saved + loss_saved, "params": s.params, "layer": block_saved, "per_layer": per_layer}


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
            key = id(s)  # the storage's entry leaves with it (the callback runs when it is freed)
            self.storages.setdefault(key, weakref.ref(s, lambda _: self.storages.pop(key, None)))

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


def config_of(model, T, **overrides):
    """A preset's config; its learned position table (wpe) grown to T rows when T is longer (main says so)."""
    preset = make_config(model, **overrides)
    return make_config(model, **overrides, block_size=max(preset.block_size, T))


def mib(nbytes):
    return f"{nbytes / 2**20:,.2f}"


def print_breakdown(pred, peaks=None):
    """What a block saves, what is alive at the predicted peak, and each phase's peak (predicted, measured)."""
    rows = [[k, mib(v)] for k, v in pred["per_layer"].items()]
    print_table(["saved by one block", "MiB"], rows + [["per block, with autocast's copies", mib(pred["layer"])]])
    print()
    rows = [[k, mib(v)] for k, v in pred["moments"][pred["peak_at"]].items() if v]
    print_table([f"alive at the predicted peak ({pred['peak_at']})", "MiB"],
                rows + [["predicted peak", mib(pred["peak"])]])
    print()
    print_table(["phase", "its predicted peak moment", "predicted MiB", "measured MiB"],
                [[ph, at, mib(v), mib(peaks[ph]) if peaks else "n/a"] for ph, (v, at) in pred["phases"].items()])


# What torch.compile saves is decided by its partitioner; saved_per_layer(compiled=True) models it from one compiled
# block's forward graph. Every check of that model against the allocator (|predicted / measured - 1|, torch 2.11):
COMPILED_CHECKS = [
    ("H200", "2.7B FSDP, 2 ranks of train.py", 0.9),
    ("H200", "2.7B FSDP --recompute 2, 2 ranks", 1.5),
    ("H200", "xl FSDP, 2 ranks", 1.2),
    ("H200", "xl DDP, 2 ranks", 2.3),
    ("H100", "account --model large --seq 512 --batch 6 --bf16", 4.3),
    ("H200", "account --model large --seq 512 --batch 6 --bf16", 4.0),
    ("H200", "account --model gpt2 --seq 1024 --batch 16 --vocab 50304 --bf16", 7.2),
    ("H200", "account --model medium --seq 1024 --batch 8 --bf16", 11.4),
    ("H200", "2.7B FSDP, 4 ranks of train.py --vocab 50304 (50.19 GiB predicted, 49.62 measured)", 1.1),
]


def compiled_band_note():
    """The line a compiled prediction carries, computed from COMPILED_CHECKS: the model's error so far. What is
    left is the partitioner's: in a whole model's graph (the fused norms reach across blocks) it keeps or recomputes
    tensors differently from one block's graph, and differently again as the sizes change, so the error grows with
    the model and the context where the activations dominate the peak; eager predictions stay within 2%."""
    worst = max(error for _, _, error in COMPILED_CHECKS)
    close = sum(error <= 3 for _, _, error in COMPILED_CHECKS)
    gpus = "/".join(dict.fromkeys(gpu for gpu, _, _ in COMPILED_CHECKS))
    return (f"compiled: what torch.compile saves is modelled from one block's graph, not read from the model's; "
            f"checked on {gpus} (torch 2.11) in {len(COMPILED_CHECKS)} configurations it was {close} times within 3% "
            f"of the measured peak and up to {worst}% off (largest for activation-heavy runs); eager ones within 2%")


def predict_rank(cfg, B, T, dtype, world, fsdp, compiled):
    """A rank of torchrun train.py (FSDP2 over `world` GPUs, or DDP): predicted here, measured there."""
    pred = account(cfg, B, T, dtype, "cuda", world=world if fsdp else 0, ddp=not fsdp, compiled=compiled)
    print_breakdown(pred)
    scheme = "a DDP rank"
    flag = ""
    if fsdp:
        scheme = f"FSDP2 over {world} GPUs ({pred['params']:,} of {param_count(cfg):,} parameters per rank)"
        flag = " --fsdp"
    if compiled:
        print(compiled_band_note())
    print(f"account: predicted peak {gib(pred['peak'])} GiB at {pred['peak_at']} for {scheme}, "
          f"{'compiled' if compiled else 'eager'}; measure it with torchrun --nproc_per_node={world} "
          f"train.py{flag} and the same flags (its summary's peak mem)")


def measure_on_cpu(cfg, B, T, dtype, peak):
    """({phase: peak live bytes}, bytes saved for backward) of a fresh model's step, counted op by op."""
    check_host_fits(cfg, B, T, dtype, peak)
    model = GPT(cfg)
    opt, (x, y) = configure_optimizer(model, lr=1e-4), random_batch(cfg, B, T, "cpu")
    peaks = live_peaks(model, opt, x, y, dtype)
    with autocast("cpu", dtype):  # what autocast's casts save counts too
        saved = saved_tensor_bytes(lambda: model(x, y), exclude=[*model.parameters(), x, y])
    return peaks, saved


def part_account(device, runs, B, overrides, compiled, sweep):
    """runs: [(model, seq, dtype)], predicted and measured (the allocator on a GPU, live tensors on a CPU)."""
    cuda, rows, errors = device.type == "cuda", [], []
    for m, T, dt in runs:
        cfg, name = config_of(m, T, **overrides), f"{m} T={T} {'bf16' if dt else 'fp32'}"
        pred = account(cfg, B, T, dt, device.type, compiled=compiled)
        if cuda:
            peaks = measure_step(cfg, B, T, dt, device, compiled)
        else:  # no allocator to ask, but live tensors can be counted op by op
            peaks, saved = measure_on_cpu(cfg, B, T, dt, pred["peak"])
        if peaks is None and not sweep:
            fail_out_of_memory(cfg, B, T, dt, device)
        cells = ["OOM", "n/a", "n/a"]
        if peaks:
            measured = max(peaks.values())
            errors.append(100 * (pred["peak"] / measured - 1))
            cells = [gib(measured), f"{errors[-1]:+.1f}", max(peaks, key=peaks.get)]
        rows.append([name, gib(pred["peak"]), *cells, pred["peak_at"]])
        if sweep:
            print("  " + "  ".join(rows[-1]), flush=True)
        elif cuda:
            print_breakdown(pred, peaks)
            print(f"largest batch predicted to fit in 95% of this GPU's free memory: "
                  f"{fitting_batch(cfg, T, dt, device)}")
        else:
            print_breakdown(pred, peaks)
            print(f"saved for backward: predicted {pred['saved']:,} bytes, saved-tensor hooks saw {saved:,}")
    if sweep:
        print_table(["model / seq / dtype", "predicted GiB", "measured GiB", "error %", "measured peak phase",
                     "predicted peak moment"], rows)
    worst = "n/a"
    if errors:
        digits = 4  # the CPU count is exact: show how exact
        if cuda:
            digits = 1
        worst = f"{max(map(abs, errors)):.{digits}f}%"
    if compiled:
        print(compiled_band_note())
    loss = "fused" if overrides["fused_ce"] else "unfused"
    print(f"account: batch {B}, {loss} loss, attention {overrides['attn']}, recompute "
          f"{overrides['recompute'] or 'off'}, {'compiled' if compiled else 'eager'}; worst |error| {worst} over "
          f"{len(errors)} configurations that fit (target 10%)")

# takeaway: the prediction is exact against live tensors on a CPU; on a GPU the allocator judges it (target 10%).

# --- 4. checkpoint: groups of blocks recomputed, flat or nested, and the group size that needs the least memory

SCHEMES = ("flat", "nested")
WARMUP_STEPS = 2  # untimed steps per variant before its timed rounds; a GPU's peak is read over them


def checkpointed_blocks(blocks, group, nested=False):
    """The blocks as GPT.forward(blocks=...) runs them: every run of `group` consecutive blocks checkpointed as one
    (it keeps only its input; backward recomputes the run whole). nested: inside that recompute each block is
    checkpointed again, so the run's blocks keep only their inputs and one block at a time is whole: about
    L/g + g inputs and one block alive, least near g = sqrt(L) (the sqrt(N) scheme), for a third forward."""
    def run_of(first):
        def forward(x):
            for block in blocks[first:first + group]:
                x = checkpoint(block, x, use_reentrant=False) if nested else block(x)
            return x
        return forward
    return [partial(checkpoint, run_of(first), use_reentrant=False) for first in range(0, len(blocks), group)]


def checkpointed(model, scheme, group):  # model(x, y) with its blocks checkpointed by `scheme` ("none": as they are)
    if scheme == "none":
        return model
    return partial(model, blocks=checkpointed_blocks(model.h, group, scheme == "nested"))


def predictions(cfg, B, T, dtype, device_type):
    """{(scheme, group size): account's prediction}, every group size of both schemes and ("none", 0)."""
    out = {("none", 0): account(cfg, B, T, dtype, device_type)}
    for scheme in SCHEMES:
        for g in range(1, cfg.n_layer + 1):
            out[scheme, g] = account(cfg, B, T, dtype, device_type, groups=g, nested=scheme == "nested")
    return out


def most_saved(pred):  # the most bytes saved for backward at any moment: what checkpointing shrinks
    return max(moment.get("saved activations", 0) for moment in pred["moments"].values())


def label(scheme, g):
    return "none" if scheme == "none" else f"{scheme} g={g}"


def print_round(r, rounds):  # the timer's progress: stderr, so the tables on stdout stay clean
    print(f"  round {r + 1}/{rounds}", file=sys.stderr, flush=True)


def measure_checkpointing(model, opt, x, y, dtype, device, variants, rounds):
    """{variant: (Timing or None, measured peak bytes or None)}: the one timer over every variant; the peak is the
    allocator's in its warm-up on a GPU (max_memory_allocated, reset before each variant: the weights and the batch
    count, as in the prediction), live tensors in more steps on a CPU."""
    cuda = device.type == "cuda"
    steps = {label(*v): partial(step, model, opt, x, y, dtype, forward=checkpointed(model, *v)) for v in variants}
    timings = compare(steps, device, baseline="none", rounds=rounds, steps=1, warmup=WARMUP_STEPS,
                      progress=partial(print_round, rounds=rounds))
    measured = {}
    for v in variants:
        t = timings[label(*v)]
        peak = None
        if t is not None and cuda:
            peak = t.peak
        elif t is not None:
            peak = max(live_peaks(model, opt, x, y, dtype, checkpointed(model, *v)).values())
        measured[v] = (t, peak)
    return measured


def least_activations(pred, scheme, L):
    """(g, bytes): the group size whose step saves the least for backward at any moment, then the lowest peak."""
    g = min(range(1, L + 1), key=lambda g: (most_saved(pred[scheme, g]), pred[scheme, g]["peak"]))
    return g, most_saved(pred[scheme, g])


def strategy_lines(cfg, B, T, dtype, device_type, pred):
    """The course's question (a), answered with account's model of this model: what flat and nested groups keep at
    their least, in the terms a written answer uses (a block's saved bytes s, a run's input a), and how it grows."""
    L, s = cfg.n_layer, pred["none", 0]["layer"]
    width = sizes_of(cfg, B, T, dtype, device_type, 1).resid  # a run keeps its input: one residual stream tensor
    a = width * B * T * cfg.n_embd
    (g_flat, flat), (g_nested, nested) = (least_activations(pred, scheme, L) for scheme in SCHEMES)
    return [f"gradient_checkpointing (a), as account models it: L = {L} blocks, each saving s = {mib(s)} MiB for "
            f"backward; a checkpointed run keeps only its input, a = B x T x d_model x {width} B = {B} x {T} x "
            f"{cfg.n_embd} x {width} B = {mib(a)} MiB",
            f"  none: L s = {L} x {mib(s)} = {mib(L * s)} MiB of blocks' activations: O(L) (with what the head and "
            f"the loss save, account's total: {mib(most_saved(pred['none', 0]))} MiB)",
            f"  flat, runs of g blocks recomputed whole: about L/g a + g s, least near g = sqrt(L a / s) = "
            f"{math.sqrt(L * a / s):.1f}, about 2 sqrt(L a s): O(sqrt(L)), for one extra forward; account's least: "
            f"g={g_flat}, {mib(flat)} MiB",
            f"  nested, each block checkpointed again inside its run's recompute: about (L/g + g) a + s, least near "
            f"g = sqrt(L) = {math.sqrt(L):.1f}, about 2 sqrt(L) a + s: O(sqrt(L)) inputs and one block, for two extra "
            f"forwards; account's least: g={g_nested}, {mib(nested)} MiB",
            "  nesting deeper (account models one and two levels, not this): halving every run down to single blocks "
            "keeps about log2(L) inputs and one block, O(log L), for O(L log L) compute; the least of all, one block "
            "and the model's input, O(1), comes from wrapping each checkpoint around all the blocks below it, every "
            "block then recomputed from the input: O(L^2) compute"]


def depth_rows(cfg, B, T, dtype, device_type):
    """How the least activations grow with depth: [L, none, flat g, flat, nested g, nested] for L/4 .. 4 L layers of
    this width, each by account (none grows as L, both schemes as sqrt(L))."""
    rows = []
    for L in sorted({max(1, cfg.n_layer // 4), max(1, cfg.n_layer // 2), cfg.n_layer, 2 * cfg.n_layer,
                     4 * cfg.n_layer}):
        pred = predictions(replace(cfg, n_layer=L), B, T, dtype, device_type)
        (g_flat, flat), (g_nested, nested) = (least_activations(pred, scheme, L) for scheme in SCHEMES)
        rows.append([L, mib(most_saved(pred["none", 0])), g_flat, mib(flat), g_nested, mib(nested)])
    return rows


def print_strategy(cfg, B, T, dtype, device_type, pred):
    print("\n".join(strategy_lines(cfg, B, T, dtype, device_type, pred)))
    print_table([f"layers (d={cfg.n_embd}, B={B}, T={T})", "none: activations MiB", "flat: least at g", "flat MiB",
                 "nested: least at g", "nested MiB"], depth_rows(cfg, B, T, dtype, device_type))
    print()


def best_of(measured):  # the lowest measured peak; within 1% of it, the fastest
    fit = {v: (t, peak) for v, (t, peak) in measured.items() if peak is not None}
    low = min(peak for _, peak in fit.values())
    return min((v for v, (_, peak) in fit.items() if peak <= 1.01 * low), key=lambda v: fit[v][0].median)


def full_sizes(best, L):  # --full: near each scheme's best, and 1 and sqrt(L)
    near = {best[s] + i for s in SCHEMES for i in (-1, 0, 1)}
    return sorted(({1, round(math.sqrt(L))} | near) & set(range(1, L + 1)))


def checkpoint_variants(best, L, sizes, full):
    """none first; then both schemes at each of `sizes` (--groups), or at full_sizes (--full); by default only each
    scheme at its own predicted best: the comparison this part is about, in the fewest steps."""
    if full:
        sizes = full_sizes(best, L)
    if sizes:
        return [("none", 0)] + [(scheme, g) for scheme in SCHEMES for g in sizes]
    return [("none", 0)] + [(scheme, best[scheme]) for scheme in SCHEMES]


def part_checkpoint(device, cfg, B, T, dtype, rounds, sizes, full=False):
    """Predicted and measured peak and step time of no checkpointing, then flat and nested groups of each size."""
    cuda, L = device.type == "cuda", cfg.n_layer
    pred = predictions(cfg, B, T, dtype, device.type)
    print_strategy(cfg, B, T, dtype, device.type, pred)  # arithmetic: the written answer before the measurements
    best = {scheme: least_activations(pred, scheme, L)[0] for scheme in SCHEMES}
    variants = checkpoint_variants(best, L, sizes, full)
    measuring = f"g in {sorted({g for _, g in variants[1:]})}"
    if not (sizes or full):
        measuring = f"each scheme at its least (--full: g in {full_sizes(best, L)})"
    # the size of the work, said before it starts: at xl, T=2048 in fp32 one step takes seconds on an H200
    steps = len(variants) * (WARMUP_STEPS + rounds)
    shorter = ""
    if full:
        shorter = "; for a shorter run drop --full: none and each scheme at its best g, 3 rounds on a GPU"
    print(f"checkpoint: timing {len(variants)} variants ({measuring}) x {rounds} rounds at {L} layers, "
          f"{'bf16' if dtype else 'fp32'}: {steps} train steps of B={B}, T={T} ({WARMUP_STEPS} warm-up steps per "
          f"variant first, then one per round){shorter}")
    if cuda:
        warm_up_libraries(device, dtype)
    try:
        with torch.device(device):
            model = GPT(cfg)
        opt, (x, y) = configure_optimizer(model, lr=1e-4), random_batch(cfg, B, T, device)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        fail(f"{L} layers' weights ({gib(4 * param_count(cfg))} GiB) and AdamW state do not fit on this GPU")
    measured = measure_checkpointing(model, opt, x, y, dtype, device, variants, rounds)
    rows = []
    for v in variants:
        (t, peak), p = measured[v], pred[v]
        err = "n/a" if peak is None else f"{100 * (p['peak'] / peak - 1):+.1f}"
        rows.append([label(*v), mib(most_saved(p)), mib(p["peak"]), p["peak_at"], "OOM" if peak is None else mib(peak),
                     err, t.ms() if t else "OOM", t.vs() if t else "n/a"])
    print_table(["checkpointing", "predicted activations MiB", "predicted peak MiB", "predicted peak moment",
                 f"measured peak MiB ({'allocated' if cuda else 'live tensors'})", "error %",
                 f"ms/step, median (min-max) of {rounds} rounds", "vs none (paired)"], rows)
    print("past the least activations the weights, gradients and AdamW state set the peak: more recomputation buys "
          "little memory there")
    if all(peak is None for _, peak in measured.values()):
        print("checkpoint: nothing fit, even nested; lower --batch or --seq")
        return
    top = best_of(measured)
    (t, peak), none = measured[top], measured[("none", 0)][1]
    vs_none = f"{t.ratio:.2f}x the time of none" if t.ratio else "none did not fit"
    print(f"checkpoint: best {label(*top)}: peak {mib(peak)} MiB (none: {'OOM' if none is None else mib(none)} MiB), "
          f"{vs_none}; least predicted activations at flat g={best['flat']}, nested g={best['nested']}")

# takeaway: checkpointing trades saved activations for recomputed forwards; nesting trades one more for sqrt(L).

# --- 5. parallel: the course's calculator, pure arithmetic. A collective costs alpha per step (latency) plus its
# bytes over beta (bandwidth); then bytes per device and communication per step for DP, ZeRO, FSDP, TP, FSDP + TP

MESSAGE_SIZES = [10 ** k for k in range(3, 11)]  # 1 KB .. 10 GB


def ring_all_reduce_s(n, nbytes, alpha, beta):
    """A reduce-scatter then an all-gather around a ring, n-1 steps each of S/n bytes: 2(n-1) a + 2(n-1)/n S/b."""
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def tree_all_reduce_s(n, nbytes, alpha, beta):
    """Reduce up a binary tree, broadcast back down: log2(n) steps each way of all S bytes: 2 log2(n) (a + S/b)."""
    return 2 * math.log2(n) * (alpha + nbytes / beta)


def crossover_bytes(n, alpha, beta):
    """The size where ring and tree take equal time, S* = a b (n-1-log2 n) / (log2 n - (n-1)/n): below it the tree's
    fewer latency steps win, above it the ring's n-fold smaller messages. 0: the ring never loses (n <= 2)."""
    if n <= 2:
        return 0.0
    return alpha * beta * (n - 1 - math.log2(n)) / (math.log2(n) - (n - 1) / n)


def ring_vs_tree(n, alpha, beta):  # the crossover in words: at 2 devices both take 2 latency steps (log2 2 = 2-1)
    if n == 1:
        return "on 1 device there is nothing to all-reduce"
    if n == 2:
        return ("on 2 devices ring and tree take the same 2 latency steps and the ring sends half the tree's bytes: "
                "the ring never loses")
    if alpha == 0:  # only the bandwidth terms are left, and 2(n-1)/n < 2 log2(n) from n = 2 on
        return f"on {n} devices with no latency the ring all-reduce never loses: it sends fewer bytes than the tree"
    return f"on {n} devices the ring all-reduce beats the tree above {crossover_bytes(n, alpha, beta) / GB:.4g} GB"


def gather_s(n, nbytes, alpha, beta):
    """A ring all-gather (or reduce-scatter) of S bytes in all: n-1 steps of S/n bytes: (n-1) a + (n-1)/n S/b."""
    return (n - 1) * alpha + (n - 1) / n * nbytes / beta


def print_collectives(n, alpha, beta):
    rows = []
    for size in MESSAGE_SIZES:
        ring, tree = ring_all_reduce_s(n, size, alpha, beta), tree_all_reduce_s(n, size, alpha, beta)
        faster = "tree"
        if ring < tree:
            faster = "ring"
        elif ring == tree:  # one device: neither sends anything
            faster = "equal"
        rows.append([f"{size / GB:g}", f"{ring * 1e6:,.1f}", f"{tree * 1e6:,.1f}", faster])
    print_table([f"all-reduce over {n} devices, GB", "ring us", "tree us", "faster"], rows)
    a_us, b_gbs = alpha * 1e6, beta / GB
    print(f"  ring = 2(n-1) a + 2(n-1)/n S/b = {2 * (n - 1)} x {a_us:g} us + {2 * (n - 1) / n:.4f} x S / "
          f"{b_gbs:g} GB/s")
    print(f"  tree = 2 log2(n) (a + S/b) = {2 * math.log2(n):.4f} x ({a_us:g} us + S / {b_gbs:g} GB/s)")
    if n <= 2 or alpha == 0:
        print(f"  no crossover: {ring_vs_tree(n, alpha, beta)}")
        return
    star = crossover_bytes(n, alpha, beta)
    print(f"  crossover S* = a b (n-1-log2 n) / (log2 n - (n-1)/n) = {star / GB:.6g} GB: the ring is faster above it")


@dataclass
class ModelShape:
    """What the calculator needs of a model. Activations saved per token and layer, bytes: `replicated` on every TP
    rank (LayerNorm's tensors, the inputs of the column-parallel matmuls), `split` divided by the TP degree (the
    heads' q, k, v and outputs, the MLP's d_ff-wide tensors). tp_all_reduces: per layer and step, of N d activations
    each: 2 forward + 2 backward with attention (after attention's and the MLP's row-parallel matmul), 1 + 1 without."""
    name: str
    params: int
    layers: int
    d: int
    heads: int  # 0: blocks without attention
    replicated: float
    split: float
    tp_all_reduces: int


REPLICATED_UNDER_TP = ("ln_1 + ln_2 inputs", "ln_1 + ln_2 mean, rstd", "c_attn + c_fc inputs (LN outputs)")


def gpt_shape(name, cfg, T, width):  # a preset: what its blocks save (section 1) for one sequence, per token
    saved = saved_per_layer(cfg, 1, T, width)
    replicated = sum(v for k, v in saved.items() if k in REPLICATED_UNDER_TP) / T
    split = sum(v for k, v in saved.items() if k not in REPLICATED_UNDER_TP) / T
    return ModelShape(name, param_count(cfg), cfg.n_layer, cfg.n_embd, cfg.n_head, replicated, split, 4)


def mlp_shape(d, d_ff, layers, params, width):
    """The course's worked model: blocks of two bias-free linear layers d -> d_ff -> d, no attention; each saves
    its input: the first's (d, the same on every TP rank), the second's (d_ff, split)."""
    name = f"{layers} blocks of d {d} -> d_ff {d_ff} -> d"
    return ModelShape(name, params or 2 * layers * d * d_ff, layers, d, 0, width * d, width * d_ff, 2)


def per_rank_bytes(n_params, world, stage):
    """fp32 weights, gradients and AdamW state (4 + 4 + 8 bytes per parameter) on one rank: ZeRO-1
    shards the optimizer state over the ranks, ZeRO-2 the gradients too, FSDP also the weights
    (stage 0: plain data parallelism, everything replicated)."""
    def share(nbytes, sharded_from):
        return n_params * nbytes / (world if stage >= sharded_from else 1)
    return {"weights": share(4, 3), "gradients": share(4, 2), "optimizer state": share(8, 1)}


# name: (tensor-parallel, ZeRO stage over the data-parallel ranks)
LAYOUTS = {"DP": (False, 0), "ZeRO-1": (False, 1), "ZeRO-2": (False, 2), "FSDP (ZeRO-3)": (False, 3),
           "TP x DP": (True, 0), "FSDP x TP": (True, 3)}


def gb(nbytes):  # 5 significant digits: enough to check a written answer
    return f"{nbytes / GB:,.5g} GB"


def layout_costs(shape, N, t, stage, B, T, width, alpha, beta):
    """One device's bytes {weights, gradients, optimizer state, activations}, bytes it sends per step, seconds of
    communication per step (none overlapped), and the formulas with their numbers. N devices: t-way tensor
    parallel (every matrix split t ways) inside, D = N/t data-parallel ranks, each B/D sequences of T tokens."""
    D, P, L = N // t, shape.params / t, shape.layers
    parts = per_rank_bytes(P, D, stage)
    seqs = B / D
    parts["activations"] = seqs * T * L * (shape.replicated + shape.split / t)
    shares = [f"{nbytes}/{D}" if stage >= first else str(nbytes) for nbytes, first in ((4, 3), (4, 2), (8, 1))]
    lines = [f"state ({' + '.join(shares)}) B x {P / 1e9:,.5g}e9 params{f' (1/{t} each, TP)' if t > 1 else ''} = "
             f"{gb(sum(parts.values()) - parts['activations'])}",
             f"activations {seqs:g} seq x {T} tok x {L} layers x ({shape.replicated:,g} + {shape.split:,g}/{t}) B = "
             f"{gb(parts['activations'])}"]
    a_us, b_gbs = f"{alpha * 1e6:g} us", f"{beta / GB:g} GB/s"
    if stage == 3:  # per layer: weights gathered in forward and again in backward, gradients reduce-scattered
        sent = (D - 1) / D * (2 * width + 4) * P
        seconds = 2 * L * gather_s(D, width * P / L, alpha, beta) + L * gather_s(D, 4 * P / L, alpha, beta)
        lines.append(f"FSDP sends ({D}-1)/{D} x (2 x {width} + 4) B x {P / 1e9:,.5g}e9 = {gb(sent)} in 3 x {L} "
                     f"collectives: 3 x {L} x ({D}-1) x {a_us} + {gb(sent)} / {b_gbs} = {seconds * 1e3:,.2f} ms")
    else:  # the fp32 gradients all-reduced as one bucket (ZeRO-1/2: reduce-scatter + all-gather, the same bytes)
        sent = 2 * (D - 1) / D * 4 * P
        seconds = ring_all_reduce_s(D, 4 * P, alpha, beta)
        lines.append(f"gradient all-reduce sends 2({D}-1)/{D} x 4 B x {P / 1e9:,.5g}e9 = {gb(sent)}: "
                     f"2({D}-1) x {a_us} + {gb(sent)} / {b_gbs} = {seconds * 1e3:,.2f} ms")
    if t > 1:  # activations all-reduced inside every layer: B/D sequences x T tokens x d, `width` bytes each
        size, count = seqs * T * shape.d * width, L * shape.tp_all_reduces
        tp_sent, tp_seconds = count * 2 * (t - 1) / t * size, count * ring_all_reduce_s(t, size, alpha, beta)
        lines.append(f"TP sends {L} layers x {shape.tp_all_reduces} all-reduces x 2({t}-1)/{t} x ({seqs:g} x {T} x "
                     f"{shape.d} x {width} B = {gb(size)}) = {gb(tp_sent)}: {count} x (2({t}-1) x {a_us} + "
                     f"2({t}-1)/{t} x {gb(size)} / {b_gbs}) = {tp_seconds * 1e3:,.2f} ms")
        sent, seconds = sent + tp_sent, seconds + tp_seconds
    return parts, sent, seconds, lines


def part_parallel(shape, N, t, B, T, width, alpha, beta, device_gb):
    state = 16 * shape.params
    print(f"{shape.name}: {shape.params:,} parameters x (4 weights + 4 gradients + 8 AdamW) bytes = "
          f"{state / GB:,.1f} GB of model state; {N} devices of {device_gb:g} GB, TP degree {t}, global batch {B} "
          f"x {T} tokens, activations and gathered weights {width} bytes, gradients reduced in fp32")
    print_collectives(N, alpha, beta)
    print()
    rows, notes = [], []
    for name, (tensor_parallel, stage) in LAYOUTS.items():
        tp = t if tensor_parallel else 1
        parts, sent, seconds, lines = layout_costs(shape, N, tp, stage, B, T, width, alpha, beta)
        total = sum(parts.values())
        rows.append([name, f"{N // tp} x {tp}", *(f"{v / GB:,.2f}" for v in parts.values()), f"{total / GB:,.2f}",
                     "yes" if total <= device_gb * GB else "no", f"{sent / GB:,.3f}", f"{seconds * 1e3:,.2f}"])
        notes += [f"  {name:14} {line}" for line in lines]
    print_table(["layout", "DP x TP", "weights GB", "gradients GB", "optimizer GB", "activations GB", "total GB",
                 f"fits {device_gb:g} GB", "sent GB/step", "comm ms/step"], rows)
    print("\n".join(notes))
    n_fsdp = math.ceil(state / (device_gb * GB))  # at least 1: --device-gb is finite and at most 1e5
    devices_hold = f"{n_fsdp} devices of {device_gb:g} GB hold"
    if n_fsdp == 1:
        devices_hold = f"1 device of {device_gb:g} GB holds"
    print(f"parallel: N_FSDP = {devices_hold} the "
          f"{state / GB:,.0f} GB of state fully sharded (activations aside); {ring_vs_tree(N, alpha, beta)}")

# The handout's written problems: one SwiGLU FFN layer, x (B, D) -> y (B, D) through W1, W2 (D, F) and W3 (F, D),
# 2-byte values, C FLOP/s of compute and W bytes/s of egress per device, latency ignored. A scheme is compute-bound
# while its communication takes no longer than its matmuls (the two overlap).


def ffn_costs(B, D, F, C, W, n_fsdp, n_tp):
    """{(scheme, pass): (FLOPs per device, compute s, communication s)} for n_fsdp-way data sharding (DP's or
    FSDP's) and n_tp-way tensor parallelism of the FFN layer; DP and FSDP rows use n_fsdp, TP rows n_tp."""
    forward, backward = 6 * B * D * F, 12 * B * D * F  # 3 matmuls of 2 B D F; backward: dX and dW of each
    weights = 2 * 3 * D * F  # bytes of W1, W2, W3
    n, t = n_fsdp, n_tp
    costs = {
        # DP: forward alone; backward: an all-reduce of the gradients (ring: 2(n-1)/n of the bytes)
        ("DP", "backward"): (backward / n, 2 * (n - 1) / n * weights / W),
        # FSDP: weights all-gathered before each pass; backward also reduce-scatters the gradients
        ("FSDP", "forward"): (forward / n, (n - 1) / n * weights / W),
        ("FSDP", "backward"): (backward / n, 2 * (n - 1) / n * weights / W),
        # TP (W1, W2 column-parallel, W3 row-parallel): forward all-reduces y, backward all-reduces dx, (B, D) each
        ("TP", "forward"): (forward / t, 2 * (t - 1) / t * 2 * B * D / W),
        ("TP", "backward"): (backward / t, 2 * (t - 1) / t * 2 * B * D / W),
    }
    # FSDP x TP forward: all-gather this TP rank's weights over the FSDP axis; all-reduce y(j) (B/n, D) over TP
    fsdp_axis = (n - 1) / n * weights / t / W
    tp_axis = 2 * (t - 1) / t * 2 * (B / n) * D / W
    costs[("FSDP x TP", "forward, axes overlapped")] = (forward / (n * t), max(fsdp_axis, tp_axis))
    costs[("FSDP x TP", "forward, axes in turn")] = (forward / (n * t), fsdp_axis + tp_axis)
    return {key: (flops, flops / C, comm) for key, (flops, comm) in costs.items()}


def largest_fitting(fits, limit):
    """The largest k in 1..limit with fits(k), for a condition that holds up to a point and not after; 0 if none."""
    if not fits(1):
        return 0
    low = 1
    while low * 2 <= limit and fits(low * 2):
        low *= 2
    high = min(2 * low, limit + 1)  # fits(low) and not fits(high) (or high is past the limit): bisect between
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def most_devices(B, D, F, C, W, key, limit=1 << 20):
    """The largest device count at which `key` stays compute-bound, found by evaluating ffn_costs (a check on the
    closed forms). FSDP x TP: the best integer split n_fsdp x n_tp, each TP degree up to 4096 tried."""
    def bound(n, t):
        _, compute, comm = ffn_costs(B, D, F, C, W, n, t)[key]
        return comm <= compute
    if key[0] != "FSDP x TP":
        return largest_fitting(lambda N: bound(N, N), limit)
    best = 0
    for t in range(1, 4097):
        n = largest_fitting(lambda n: bound(n, t), limit)
        if n == 0:  # a larger TP degree fails already at n = 1
            break
        best = max(best, n * t)
    return best


def as_number(value):  # a number put into a printed expression: exact enough to check, and valid Python (1.8e+11)
    return f"{value:.10g}"


def in_flops(value):
    return f"{value:.4g} FLOPs"


def in_ms(seconds):
    return f"{seconds * 1e3:,.3f} ms"


def answer(part, lhs, symbols, numbers, result, why):
    """One part of a written answer: the expression in the handout's symbols, the same with the numbers put in, its
    value, then why, in words (the handout asks for a sentence)."""
    return f"  ({part}) {lhs} {symbols} = {numbers} = {result}: {why}"


TP_BACKWARD = ("  (a) backward on TP rank i: dz(i) = dy W3(i)^T; dx2(i) = dz(i) * f(x1(i)); "
               "dx1(i) = dz(i) * f'(x1(i)) * x2(i); dW3(i) = z(i)^T dy; dW2(i) = x^T dx2(i); dW1(i) = x^T dx1(i); "
               "dx = all-reduce over i of (dx1(i) W1(i)^T + dx2(i) W2(i)^T): each rank's dx is a partial sum over "
               "its D_FF / N_TP columns")


def ffn_answers(B, D, F, C, W, N, t):
    """The handout's four calculation problems on its FFN layer, part by part as a student writes them: {problem:
    [lines]}. Each value is ffn_costs' (the table's arithmetic) or a closed form checked against most_devices; the
    expressions say how, in the handout's symbols and then with these numbers. 2-byte values: W1, W2 and W3 are
    2 x 3 D D_FF bytes. DP and FSDP over N devices, TP over t, FSDP x TP over N/t x t."""
    n = N // t
    one, grid = ffn_costs(B, D, F, C, W, N, t), ffn_costs(B, D, F, C, W, n, t)
    b, d, f, c, w = (as_number(v) for v in (B, D, F, C, W))
    forward, backward, weights = f"6 x {b} x {d} x {f}", f"12 x {b} x {d} x {f}", f"2 x 3 x {d} x {f}"
    matmuls = "x W1, x W2 and z W3, 2 B D D_FF FLOPs each over all the rows"
    twice = "dX and dW of each of the three: twice the forward"
    dp_bound = 1 + B * W / C
    tp_forward, tp_backward = 1 + 1.5 * F * W / C, 1 + 3 * F * W / C
    in_turn = (3 * B * F * W / C + 3 * F + 2 * B) ** 2 / (24 * B * F)
    overlapped = grid[("FSDP x TP", "forward, axes overlapped")]
    sequential = grid[("FSDP x TP", "forward, axes in turn")]
    fsdp_axis = f"({n} - 1) / {n} x {weights} / ({t} x {w})"
    tp_axis = f"2 x ({t} - 1) / {t} x 2 x ({b} / {n}) x {d} / {w}"
    return {
        f"data_parallel_calcs, N_DP = {N}": [
            answer("a", "backward FLOPs per device =", "12 B D D_FF / N_DP", f"{backward} / {N}",
                   in_flops(one[("DP", "backward")][0]),
                   "dX and dW of W1, W2 and W3, 2 B D D_FF FLOPs each over all the rows, the rows split N_DP ways"),
            answer("b", "backward communication =", "2 (N_DP - 1) / N_DP x 2 x 3 D D_FF / W",
                   f"2 x ({N} - 1) / {N} x {weights} / {w}", in_ms(one[("DP", "backward")][2]),
                   "a ring all-reduce (a reduce-scatter, then an all-gather) of the 2-byte gradients of W1, W2, W3"),
            answer("c", "N_DP <=", "1 + B W / C", f"1 + {b} x {w} / {c}", f"{dp_bound:,.1f} devices",
                   "compute hides the all-reduce while 12 B D D_FF / (N_DP C) >= 12 (N_DP - 1) D D_FF / (N_DP W)")],
        f"fsdp_calcs, N_FSDP = {N}": [
            answer("a", "forward FLOPs per device =", "6 B D D_FF / N_FSDP", f"{forward} / {N}",
                   in_flops(one[("FSDP", "forward")][0]), f"{matmuls}, the rows split N_FSDP ways"),
            answer("a", "backward FLOPs per device =", "12 B D D_FF / N_FSDP", f"{backward} / {N}",
                   in_flops(one[("FSDP", "backward")][0]), twice),
            answer("b", "forward communication =", "(N_FSDP - 1) / N_FSDP x 2 x 3 D D_FF / W",
                   f"({N} - 1) / {N} x {weights} / {w}", in_ms(one[("FSDP", "forward")][2]),
                   "a ring all-gather of W1, W2, W3 before the pass"),
            answer("b", "backward communication =", "2 (N_FSDP - 1) / N_FSDP x 2 x 3 D D_FF / W",
                   f"2 x ({N} - 1) / {N} x {weights} / {w}", in_ms(one[("FSDP", "backward")][2]),
                   "all-gather them again, then reduce-scatter their gradients: the same bytes twice"),
            answer("c", "N_FSDP <=", "1 + B W / C", f"1 + {b} x {w} / {c}", f"{dp_bound:,.1f} devices",
                   "forward and backward alike: compute and communication both double in backward")],
        f"tp_calcs, N_TP = {t}": [
            TP_BACKWARD,
            answer("b", "forward FLOPs per device =", "6 B D D_FF / N_TP", f"{forward} / {t}",
                   in_flops(one[("TP", "forward")][0]), f"{matmuls}, each rank on D_FF / N_TP hidden columns"),
            answer("b", "backward FLOPs per device =", "12 B D D_FF / N_TP", f"{backward} / {t}",
                   in_flops(one[("TP", "backward")][0]), twice),
            answer("c", "forward communication =", "2 (N_TP - 1) / N_TP x 2 B D / W",
                   f"2 x ({t} - 1) / {t} x 2 x {b} x {d} / {w}", in_ms(one[("TP", "forward")][2]),
                   "a ring all-reduce of y's partial sums, (B, D) in 2 bytes"),
            answer("c", "backward communication =", "2 (N_TP - 1) / N_TP x 2 B D / W",
                   f"2 x ({t} - 1) / {t} x 2 x {b} x {d} / {w}", in_ms(one[("TP", "backward")][2]),
                   "a ring all-reduce of dx's partial sums, the same size"),
            answer("d", "forward: N_TP <=", "1 + 1.5 D_FF W / C", f"1 + 1.5 x {f} x {w} / {c}",
                   f"{tp_forward:,.1f} devices", "while 6 B D D_FF / (N_TP C) >= 4 (N_TP - 1) B D / (N_TP W)"),
            answer("d", "backward: N_TP <=", "1 + 3 D_FF W / C", f"1 + 3 x {f} x {w} / {c}",
                   f"{tp_backward:,.1f} devices", "twice the compute against the same all-reduce")],
        f"fsdp_tp_calcs, N_FSDP x N_TP = {n} x {t}": [
            answer("a", "forward FLOPs per device =", "6 B D D_FF / (N_FSDP N_TP)", f"{forward} / ({n} x {t})",
                   in_flops(overlapped[0]), f"{matmuls}, each device on B / N_FSDP rows and D_FF / N_TP columns"),
            answer("b", "forward communication, axes overlapped =",
                   "max((N_FSDP - 1) / N_FSDP x 2 x 3 D D_FF / (N_TP W), 2 (N_TP - 1) / N_TP x 2 (B / N_FSDP) D / W)",
                   f"max({fsdp_axis}, {tp_axis})", in_ms(overlapped[2]),
                   "the FSDP axis all-gathers this TP rank's weights while the TP axis all-reduces y(j), "
                   "(B / N_FSDP, D)"),
            answer("b", "forward communication, axes in turn =", "the same two terms added", f"{fsdp_axis} + {tp_axis}",
                   in_ms(sequential[2]), "one collective after the other, on shared links"),
            answer("c", "N <=", "(1 + B W / C) (1 + 1.5 D_FF W / C)",
                   f"(1 + {b} x {w} / {c}) x (1 + 1.5 x {f} x {w} / {c})", f"{dp_bound * tp_forward:,.1f} devices",
                   "overlapped, each axis has its own bound: N_FSDP <= 1 + B W / C and N_TP <= 1 + 1.5 D_FF W / C"),
            answer("d", "N <=", "(3 B D_FF W / C + 3 D_FF + 2 B)^2 / (24 B D_FF)",
                   f"(3 x {b} x {f} x {w} / {c} + 3 x {f} + 2 x {b})^2 / (24 x {b} x {f})", f"{in_turn:,.1f} devices",
                   "in turn the axes share one budget, 3 D_FF (N_FSDP - 1) + 2 B (N_TP - 1) <= 3 B D_FF W / C, best "
                   "split with 3 D_FF N_FSDP and 2 B N_TP each half the bracket (about 3/8 B D_FF W^2 / C^2 when both "
                   "are large)")]}


def print_ffn(B, D, F, C, W, N, t):
    """The handout's FFN questions, numerically: FLOPs, compute and communication time per device (DP and FSDP over
    N devices, TP over t, FSDP x TP over N/t x t) and the most devices each scheme reaches compute-bound; then each
    problem's parts as expressions, symbols first (ffn_answers)."""
    n = N // t
    print(f"\nthe handout's FFN layer: B={B:,} rows, D={D:,}, D_FF={F:,}, 2-byte values, C={C / 1e12:g} TFLOP/s, "
          f"W={W / GB:g} GB/s egress, latency ignored; DP and FSDP over {N} devices, TP over {t}, FSDP x TP over "
          f"{n} x {t}")
    costs = ffn_costs(B, D, F, C, W, N, t)
    two_d = ffn_costs(B, D, F, C, W, n, t)
    for key in costs:
        if key[0] == "FSDP x TP":
            costs[key] = two_d[key]
    rows = []
    for key, (flops, compute, comm) in costs.items():
        bound = "compute"
        if comm > compute:
            bound = "communication"
        rows.append([f"{key[0]} {key[1]}", f"{flops:.4g}", f"{compute * 1e3:,.3f}", f"{comm * 1e3:,.3f}", bound,
                     f"{most_devices(B, D, F, C, W, key):,}"])
    print_table(["scheme, pass", "FLOPs per device", "compute ms", "communication ms", "bound by",
                 "most devices, compute-bound"], rows)
    print("the handout's written answers, part by part: each expression in its symbols, then with these numbers, "
          "then its value")
    for problem, lines in ffn_answers(B, D, F, C, W, N, t).items():
        print(f"{problem}\n" + "\n".join(lines))
    weights = 2 * 3 * D * F
    print("alternate_ring_all_reduce")
    print(f"  alternate ring all-reduce of the {weights / GB:.4g} GB of weights (each device passes whole tensors "
          f"on, N-1 steps of S bytes): (N-1) S / W = {(N - 1) * weights / W * 1e3:,.2f} ms over {N} devices, "
          f"against the ring's 2(N-1)/N S / W = {2 * (N - 1) / N * weights / W * 1e3:,.2f} ms")

# takeaway: sharding divides bytes by the degree; the price is communication, latency-bound for small messages.

# --- 6. snapshot: the allocator's own record of an inference forward and a training step, for pytorch.org/memory_viz


def made_at(frames):  # the innermost Python line outside torch itself
    for frame in frames:
        if "/torch/" not in frame["filename"]:
            return f"{os.path.basename(frame['filename'])}:{frame['line']} {frame['name']}"
    if frames:
        return f"{frames[0]['name']} (inside torch)"
    return "autograd's thread (no Python line)"


def trace_summary(trace, marks, top=5):
    """{phase: (peak bytes above the level where recording began, its `top` largest allocations as (bytes, where))}
    from the allocator's trace (a snapshot's "device_traces"[device]): marks [(phase, index of its first entry
    after it)] split the trace. A free of a block allocated before recording counts at its size. The allocator
    records sizes (rounded up to 512 bytes) and Python stacks, not shapes."""
    live, level, start, out = {}, 0, 0, {}
    for phase, end in marks:
        peak, made = level, []
        for entry in trace[start:end]:
            if entry["action"] == "alloc":
                live[entry["addr"]] = entry["size"]
                level += entry["size"]
                peak = max(peak, level)
                made.append((entry["size"], made_at(entry.get("frames", []))))
            elif entry["action"] == "free_completed":
                level -= live.pop(entry["addr"], entry["size"])
        out[phase] = (peak, sorted(made, reverse=True)[:top])
        start = end
    return out


def print_trace_summary(summary, base):
    rows = []
    for phase, (peak, largest) in summary.items():
        for i, (size, where) in enumerate(largest):
            rows.append([phase if i == 0 else "", mib(base + peak) if i == 0 else "", i + 1, mib(size), where])
    print_table(["phase", "its peak MiB (allocated)", "#", "allocation MiB", "made at"], rows)


def trace_length(device):  # entries recorded so far; a mark between phases
    synchronize(device)
    return len(torch.cuda.memory._snapshot()["device_traces"][device.index])


INFERENCE = "inference forward (no grad)"


def record_phases(model, opt, x, y, dtype, device, phase):
    """Marks [(phase, trace length)] while recording an inference forward (no grad: nothing saved, the logits whole)
    and/or a training step (forward, backward, optimizer)."""
    marks = []
    if phase in ("forward", "both"):
        with torch.no_grad(), autocast(device, dtype):
            model(x)
        marks.append((INFERENCE, trace_length(device)))
    if phase in ("step", "both"):
        step(model, opt, x, y, dtype, lambda name: marks.append((f"step: {name}", trace_length(device))))
    return marks


def record_snapshot(device, cfg, B, T, dtype, phase, out):
    """One run: a fresh model, AdamW's state made by one step, then the allocator's history of `phase` written to
    `out`. Returns (snapshot, marks, bytes allocated when recording began, peak allocated), or None out of memory
    (the caller frees what the run made)."""
    try:
        with torch.device(device):
            model = GPT(cfg)
        opt, (x, y) = configure_optimizer(model, lr=1e-4), random_batch(cfg, B, T, device)
        step(model, opt, x, y, dtype)  # AdamW's state exists before recording starts
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        # a history of this run alone: the marks count its entries from 0
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python", clear_history=True)
        marks = record_phases(model, opt, x, y, dtype, device, phase)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        torch.cuda.memory._record_memory_history(enabled=None)
        return None
    torch.cuda.memory._dump_snapshot(out)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot, marks, base, torch.cuda.max_memory_allocated(device)


def peak_cells(summary, base):
    """[inference forward peak, training step peak, the step's phase at its peak] in allocated MiB, n/a where that
    part was not recorded (--phase)."""
    steps = {phase.removeprefix("step: "): peak for phase, (peak, _) in summary.items() if phase != INFERENCE}
    cells = ["n/a", "n/a", "n/a"]
    if INFERENCE in summary:
        cells[0] = mib(base + summary[INFERENCE][0])
    if steps:
        at = max(steps, key=steps.get)
        cells[1:] = [mib(base + steps[at]), at]
    return cells


def active_timeline(snapshot, device=0):
    """(start, [trace entry], [bytes allocated after it]) over the allocations and frees of the allocator's trace of
    `device` in a snapshot (torch.cuda.memory._snapshot()): the active memory timeline memory_viz draws. A block
    counts until its free completes (a free still waiting on another stream leaves it active). start, what was
    allocated when recording began: the blocks still active in the snapshot's segments, less what the trace added."""
    trace = snapshot["device_traces"][device]
    sign = {"alloc": 1, "free_completed": -1}
    changes = [(i, sign[entry["action"]] * entry["size"]) for i, entry in enumerate(trace) if entry["action"] in sign]
    active = sum(block["size"] for segment in snapshot["segments"] if segment.get("device", device) == device
                 for block in segment["blocks"] if block["state"] != "inactive")
    start = active - sum(change for _, change in changes)
    entries, levels, level = [], [], start
    for i, change in changes:
        level += change
        entries.append(i)
        levels.append(level)
    return start, entries, levels


def timeline_panel(snapshot, marks, title, device=0):
    """One run as plot_timelines draws it: its active memory timeline, and its phases as spans of trace entries."""
    start, entries, levels = active_timeline(snapshot, device)
    spans, first = [], 0
    for phase, end in marks:
        spans.append((phase, first, end))
        first = end
    return {"title": title, "start": start, "entries": entries, "levels": levels, "spans": spans}


def plot_timelines(panels, path):
    """A panel per run: allocated GiB against the trace's entries in order, as memory_viz draws it (the entries'
    time_us would stretch the pauses where the phases are marked), each phase shaded, the starting level dashed."""
    plt = plot_to(path)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        x, y = [0, *panel["entries"]], [level / 2**30 for level in (panel["start"], *panel["levels"])]
        ax.fill_between(x, y, step="post", alpha=0.3)
        ax.plot(x, y, drawstyle="steps-post", linewidth=0.8)
        ax.axhline(y[0], color="gray", linestyle="--", linewidth=0.8, label="when recording began")
        for i, (phase, first, end) in enumerate(panel["spans"]):
            ax.axvspan(first, end, color=f"C{i + 1}", alpha=0.15, label=phase)
        ax.set(title=f"{panel['title']}: peak {max(y):.2f} GiB", xlabel="allocator trace entry",
               ylabel="allocated GiB")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


SNAPSHOT_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # --dtypes: autocast's dtype for each name


def residual_stream_bytes(B, T, d, width):
    """One block's output, the residual stream it hands the next: B x T x d_model values of `width` bytes."""
    return B * T * d * width


def print_residual_stream(B, seqs, d):
    """The residual stream's size per block, from the shapes alone (the course asks for it in fp32)."""
    rows = [[f"{B} x {T} x {d}", mib(residual_stream_bytes(B, T, d, 4)), mib(residual_stream_bytes(B, T, d, 2))]
            for T in seqs]
    print_table(["residual stream per block, B x T x d_model", "fp32 MiB", "bf16 MiB"], rows)
    print("  B x T x d_model x bytes / 2^20; under --bf16 autocast this model's stream stays fp32 (the weights are "
          "fp32, and a matmul's bf16 output added to it is promoted): its blocks' outputs are the fp32 column\n")


def is_pickle(path):  # a file this script wrote: a pickle starts with its protocol byte, 0x80
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"


def snapshot_paths(out, runs):
    """The .pickle of each run: --out itself for one run, else --out named for its context and dtype
    (snap.pickle -> snap_T2048_bf16.pickle)."""
    if len(runs) == 1:
        return [out]
    stem = out.removesuffix(".pickle")
    return [f"{stem}_T{T}_{name}.pickle" for T, name in runs]


def part_snapshot(device, model, B, runs, overrides, phase, paths, top, plot):
    """runs [(seq, dtype name)], each recorded into its path, its phases' peaks and largest allocations printed;
    then every run's peaks side by side (context against context, fp32 against bf16) and, with plot, their
    timelines. Out of memory: the one run refused with the batch that fits, or one run of several reported."""
    cfgs = {T: config_of(model, T, **overrides) for T, _ in runs}
    print_residual_stream(B, list(cfgs), cfgs[runs[0][0]].n_embd)
    rows, panels, highest = [], [], (0, "")
    for (T, name), path in zip(runs, paths):
        what, dtype = f"{model} B={B} T={T} {name}", SNAPSHOT_DTYPES[name]
        print(f"{what}: recording into {path}", flush=True)  # a run of 2.7B takes seconds
        recorded = record_snapshot(device, cfgs[T], B, T, dtype, phase, path)
        free_memory()
        if recorded is None and len(runs) == 1:
            fail_out_of_memory(cfgs[T], B, T, dtype, device)
        if recorded is None:
            print(f"{what}: out of memory, not recorded; the next run goes on\n")
            rows.append([what, "OOM", "OOM", "n/a", "n/a"])
            continue
        snapshot, marks, base, peak = recorded
        summary = trace_summary(snapshot["device_traces"][device.index], marks, top)
        print_trace_summary(summary, base)
        print()
        rows.append([what, *peak_cells(summary, base), mib(base)])
        highest = max(highest, (peak, what))
        if plot:
            panels.append(timeline_panel(snapshot, marks, what, device.index))
    print_table(["run", "inference forward peak MiB", "train step peak MiB", "the step's peak phase",
                 "weights + AdamW state MiB"], rows)
    print("  peaks are allocated bytes (max over the phase), the weights and AdamW state included")
    if panels:
        plot_timelines(panels, plot)
    if not highest[1]:
        print("snapshot: no run fit in this GPU's memory; lower --batch or --seq")
        return
    recorded_in = f"recorded in {paths[0]}"
    if len(paths) > 1:
        recorded_in = f"recorded in {len(paths)} files ({paths[0]} ... {paths[-1]})"
    print(f"snapshot: {phase} {recorded_in}, highest peak {gib(highest[0])} GiB allocated ({highest[1]}); drag a "
          f"file onto https://pytorch.org/memory_viz to see every allocation, its size and the Python line that "
          f"made it")

# takeaway: when the model and the allocator disagree, the snapshot names every allocation and its line.

# --- 7. command line

# per part: (model, batch, seq) seconds-long on a CPU and the headline on a GPU, as gpt.on_device picks
DEFAULTS = {"account": (("tiny", 2, 64), ("gpt2", 8, 512)), "checkpoint": (("tiny", 2, 64), ("xl", 4, 2048)),
            "snapshot": (("tiny", 2, 64), ("gpt2", 4, 128)), "parallel": ((None, 64, 1024), (None, 64, 1024))}
MAX_SEQ = 1 << 16
XXL = (16384, 53248, 126)  # the course's worked model: d_model, d_ff, blocks of two linear layers


def course_d_ff(d_model, d_ff):  # the course's model: 4 d_model unless given; the worked example's by default
    if d_ff:
        return d_ff
    return 4 * d_model if d_model else XXL[1]


def parallel_shape(model, T, overrides, d, d_ff, layers, params, width):  # a preset's, or the course's blocks
    if model:
        return gpt_shape(model, config_of(model, T, **overrides), T, width)
    return mlp_shape(d or XXL[0], course_d_ff(d, d_ff), layers or XXL[2], params, width)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=PARTS)
    p.add_argument("--model", help="preset (default gpt2 on a GPU, xl for checkpoint, tiny on a CPU; parallel: the "
                                   "course's worked model of two-linear blocks)")
    p.add_argument("--batch", type=int_in(1), help="sequences (parallel: the global batch)")
    p.add_argument("--seq", type=int_list(1, MAX_SEQ), help="tokens (beyond a preset's block size wpe grows); "
                   "snapshot and account --sweep take a list, e.g. 128,2048")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast, fp32 weights; parallel: 2-byte activations")
    p.add_argument("--attn", help="attention implementation (default sdpa)")
    p.add_argument("--vocab", type=int_in(GPT2_VOCAB), help=f"vocabulary (default {GPT2_VOCAB})")
    p.add_argument("--unfused", action="store_true", help="plain lm_head + F.cross_entropy instead of the fused loss")
    p.add_argument("--recompute", type=int_in(0), metavar="K", help="checkpoint every K-th block (gpt.py)")
    p.add_argument("--fsdp", action="store_true", help="account: predict a rank of torchrun train.py --fsdp")
    p.add_argument("--ddp", action="store_true", help="account: predict a rank of torchrun train.py (DDP)")
    p.add_argument("--compile", action="store_true", help="account: torch.compile's saved tensors (and measure so)")
    p.add_argument("--world", type=int_in(2), help="account --fsdp/--ddp: ranks (default 2)")
    p.add_argument("--device", help="account, checkpoint, snapshot: cpu, cuda, cuda:1 (default cuda if present)")
    p.add_argument("--sweep", action="store_true", help="account: gpt2..xl x T=128..1024, fp32 and bf16 (CUDA)")
    p.add_argument("--rounds", type=int_in(1), help="checkpoint: interleaved timing rounds (default 3, --full 5; 2 "
                   "on a CPU)")
    p.add_argument("--groups", type=int_list(1), help="checkpoint: group sizes, both schemes at each, e.g. 4,7 "
                   "(default: each scheme at its predicted best; 1,2 on a CPU)")
    p.add_argument("--full", action="store_true", help="checkpoint: the full sweep, both schemes at 1, sqrt(L) and "
                   "each one's best -1, +0, +1, 5 rounds on a GPU (the GPU default, xl B=4 T=2048 fp32: 13 "
                   "variants x 5 rounds, minutes)")
    p.add_argument("--phase", choices=("forward", "step", "both"),
                   help="snapshot: an inference forward (no grad), a training step, or both (default)")
    p.add_argument("--top", type=int_in(1), help="snapshot: largest allocations listed per phase (default 5)")
    p.add_argument("--out", help="snapshot: the .pickle to write (default memory_snapshot.pickle; several runs: one "
                   "file each, named for its seq and dtype)")
    p.add_argument("--dtypes", type=name_list(list(SNAPSHOT_DTYPES), "dtype"),
                   help="snapshot: the precisions to record one after the other, e.g. fp32,bf16 (default fp32, or "
                        "bf16 with --bf16)")
    p.add_argument("--plot", type=plot_path, help="snapshot: draw each run's active memory timeline, its phases "
                   "shaded, into this figure (.png, .pdf, .svg, ...: the name's extension; needs matplotlib)")
    p.add_argument("--devices", type=int_in(1), help="parallel: devices in all (default 64)")
    p.add_argument("--tp", type=int_in(1),
                   help="parallel: tensor-parallel degree of the TP layouts (default 4, or 2 or 1 to divide --devices)")
    # upper bounds: beyond them a figure is a typo, and the calculator's answers would be nonsense (0 devices)
    p.add_argument("--bandwidth-gbs", type=float_in(1e-3, 1e5), help="parallel: link bandwidth, GB/s (default 180)")
    p.add_argument("--latency-us", type=float_in(0, 1e6), help="parallel: latency per collective step, us (default 5)")
    p.add_argument("--device-gb", type=float_in(1e-3, 1e5), help="parallel: memory per device, GB (default 95)")
    p.add_argument("--params", type=int_in(1), help="parallel: parameter count of the course's model")
    p.add_argument("--d-model", type=int_in(1), help="parallel: the course's model's width (default 16384)")
    p.add_argument("--d-ff", type=int_in(1), help="parallel: its hidden width (default 4 d_model; 53248)")
    p.add_argument("--layers", type=int_in(1), help="parallel: its blocks (default 126)")
    p.add_argument("--tflops", type=float_in(1e-3, 1e6),
                   help="parallel: compute per device, TFLOP/s; adds the handout's FFN layer: compute against "
                        "communication for DP, FSDP, TP and FSDP x TP (B = batch x seq rows)")
    return p.parse_args(argv)


# flags only some parts read: {flag: (the parts, in words)}; given to another part it would be ignored in silence
PARALLEL_FLAGS = ("devices", "tp", "bandwidth_gbs", "latency_us", "device_gb", "params", "d_model", "d_ff", "layers",
                  "tflops")
READ_BY = {"unfused": (("account", "snapshot"), "account and snapshot"),
           "recompute": (("account", "snapshot"), "account and snapshot"),
           **dict.fromkeys(("fsdp", "ddp", "compile", "sweep"), (("account",), "account")),
           "world": (("account",), "account --fsdp or --ddp (parallel counts its ranks with --devices)"),
           **dict.fromkeys(("rounds", "groups", "full"), (("checkpoint",), "checkpoint")),
           **dict.fromkeys(("phase", "top", "out", "dtypes", "plot"), (("snapshot",), "snapshot")),
           "device": (("account", "checkpoint", "snapshot"),
                      "account, checkpoint and snapshot (parallel is pure arithmetic)"),
           **dict.fromkeys(PARALLEL_FLAGS, (("parallel",), "parallel"))}
# parallel's defaults: the course's cluster (None in argparse, so that another part can tell they were given)
PARALLEL_DEFAULTS = {"devices": 64, "tp": 4, "bandwidth_gbs": 180.0, "latency_us": 5.0, "device_gb": 95.0}


def unread_flag(args):
    """The sentence refusing the first flag given that args.part would not read; None when every flag is read."""
    for dest, (parts, readers) in READ_BY.items():
        if getattr(args, dest) not in (None, False) and args.part not in parts:
            return f"--{dest.replace('_', '-')} is read by {readers}, not by {args.part}: leave it out"
    if args.world is not None and not (args.fsdp or args.ddp):
        return "--world is the rank count of account --fsdp or --ddp: add one of them, or leave --world out"
    if args.part == "parallel" and not args.model and (args.attn or args.vocab):
        return "--attn and --vocab describe a --model preset; parallel's default model has no attention or vocabulary"
    return None


def checks(args, cuda, cfg, devices, tp):
    """Rules across flags: (ok, the sentence when not)."""
    rank, course = args.fsdp or args.ddp, args.d_model or args.d_ff or args.layers or args.params
    unread = unread_flag(args)
    return [(unread is None, unread),
            (cuda or cfg.attn not in GPU_ONLY_ATTENTION, f"--attn {cfg.attn} needs a CUDA GPU"),
            (not args.sweep or (cuda and not (rank or args.compile)),
             "--sweep measures peaks on a CUDA GPU, one process, eager"),
            (not (args.fsdp and args.ddp), "--fsdp and --ddp exclude each other"),
            (not (args.compile and args.unfused), "--compile models the fused loss (compile rewrites the plain one)"),
            (cuda or rank or not args.compile, "--compile is measured on a CUDA GPU (predicted with --fsdp/--ddp)"),
            (not (args.full and args.groups), "--full picks the group sizes itself; drop --groups or --full"),
            (not args.groups or max(args.groups) <= cfg.n_layer,
             f"--groups {max(args.groups or [0])} is larger than the model's {cfg.n_layer} layers"),
            (args.out is None or args.out.endswith(".pickle"), f"--out {args.out} must name a .pickle file"),
            (len(args.seq or [0]) == 1 or args.part == "snapshot" or args.sweep,
             f"--seq takes one length for {args.part}; a list is read by snapshot and account --sweep"),
            (len(set(args.seq or [])) == len(args.seq or []), "--seq names a length twice"),
            (len(set(args.dtypes or [])) == len(args.dtypes or []), "--dtypes names a precision twice"),
            (not (args.dtypes and args.bf16), "--dtypes names the precisions itself; leave out --bf16"),
            (not (course and args.model), "give --model or the course's --d-model/--d-ff/--layers/--params, not both"),
            (args.part != "parallel" or devices % tp == 0, f"--devices {devices} is not divisible by --tp {tp}"),
            (args.part != "parallel" or not args.model or cfg.n_head % tp == 0,
             f"--tp {tp} does not divide {args.model}'s {cfg.n_head} attention heads"),
            (args.part != "parallel" or args.model or course_d_ff(args.d_model, args.d_ff) % tp == 0,
             f"--tp {tp} does not divide d_ff {course_d_ff(args.d_model, args.d_ff)}")]


def parallel_values(devices, tp, bandwidth_gbs, latency_us, device_gb):
    """parallel's flags as given, else PARALLEL_DEFAULTS; the default TP degree divides the devices (2 -> TP over 2)."""
    given = dict(devices=devices, tp=tp, bandwidth_gbs=bandwidth_gbs, latency_us=latency_us, device_gb=device_gb)
    values = {k: default if given[k] is None else given[k] for k, default in PARALLEL_DEFAULTS.items()}
    if tp is None:
        values["tp"] = math.gcd(values["devices"], PARALLEL_DEFAULTS["tp"])
    return values


def announce_cpu(part, model, B, T, full):  # measured on 2 cores: account 4 s, checkpoint 8 s of wall time
    sizes = f"model {model}, batch {B}, seq {T}"
    if (model, B, T) == DEFAULTS[part][0] and not full:  # checkpoint --full times more variants
        print(f"no CUDA: {part} counts live tensors on the CPU at its CPU default, {sizes}: under 10 s on 2 cores")
    else:
        print(f"no CUDA: {part} counts live tensors on the CPU for {sizes}; the time grows with each (every op is "
              f"counted; the CPU default, tiny, 2, 64, takes under 10 s on 2 cores)")


def main(argv=None):
    args = parse(argv)
    try:
        device = resolve_device(args.device)
        model, batch, seq = on_device(device, *DEFAULTS[args.part])
        model, B, seqs = args.model or model, args.batch or batch, args.seq or [seq]
        T = max(seqs)  # the longest sets the position table (a list: snapshot and account --sweep)
        overrides = dict(attn=args.attn or "sdpa", vocab_size=args.vocab or GPT2_VOCAB, fused_ce=not args.unfused,
                         recompute=args.recompute or 0)
        cfg = config_of(model or "gpt2", T, **overrides)
    except ValueError as e:
        fail(str(e))
    cuda, dtype = device.type == "cuda", amp_dtype(args.bf16)
    par = parallel_values(args.devices, args.tp, args.bandwidth_gbs, args.latency_us, args.device_gb)
    for ok, message in checks(args, cuda, cfg, par["devices"], par["tp"]):
        if not ok:
            fail(message)
    if args.part == "parallel":  # pure arithmetic
        shape = parallel_shape(args.model, T, overrides, args.d_model, args.d_ff, args.layers, args.params,
                               2 if args.bf16 else 4)
        part_parallel(shape, par["devices"], par["tp"], B, T, 2 if args.bf16 else 4, par["latency_us"] * 1e-6,
                      par["bandwidth_gbs"] * GB, par["device_gb"])
        if args.tflops:
            d, d_ff = cfg.n_embd, cfg.d_ff
            if not args.model:
                d, d_ff = args.d_model or XXL[0], course_d_ff(args.d_model, args.d_ff)
            print_ffn(B * T, d, d_ff, args.tflops * 1e12, par["bandwidth_gbs"] * GB, par["devices"], par["tp"])
        return
    if args.part == "snapshot":  # its runs: every --seq in every --dtypes, a .pickle each
        recordings = [(t, name) for t in seqs for name in args.dtypes or ["bf16" if args.bf16 else "fp32"]]
        paths = snapshot_paths(args.out or "memory_snapshot.pickle", recordings)
        try:
            for path in paths:
                check_output_path(path, "--out", ours=is_pickle)
        except ValueError as e:
            fail(str(e))
        if not cuda:
            fail("snapshot records the CUDA allocator: it needs a CUDA GPU")
    preset = make_config(model).block_size
    if T > preset:
        print(f"--seq {T} is longer than {model}'s {preset}-token context: its learned position table (wpe) is "
              f"extended to {T} rows, randomly initialised like every weight here (memory and time are measured)")
    if not cuda and not (args.fsdp or args.ddp):  # (snapshot refused the CPU above)
        announce_cpu(args.part, model, B, T, args.full)
    if args.part == "account" and (args.fsdp or args.ddp):
        predict_rank(cfg, B, T, dtype, args.world or 2, args.fsdp, args.compile)
    elif args.part == "account":
        runs = [(model, T, dtype)]
        if args.sweep:
            runs = [(m, t, dt) for m in ([args.model] if args.model else SWEEP_MODELS)
                    for t in (args.seq or SWEEP_SEQS) for dt in (None, torch.bfloat16)]
        part_account(device, runs, B, overrides, args.compile, args.sweep)
    elif args.part == "checkpoint":
        gpu_rounds, groups = 3, args.groups or on_device(device, [1, 2], None)  # CPU: tiny's 4 layers, g 1 and 2
        if args.full:
            gpu_rounds, groups = 5, None
        rounds = args.rounds or on_device(device, cpu=2, gpu=gpu_rounds)
        part_checkpoint(device, cfg, B, T, dtype, rounds, groups, args.full)
    else:
        part_snapshot(device, model, B, recordings, overrides, args.phase or "both", paths, args.top or 5, args.plot)


if __name__ == "__main__":
    run_main(main)  # Ctrl-C / SIGTERM: one line, exit 130 / 143
