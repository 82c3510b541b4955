"""The CS336 leaderboard: one whole training step of an 8B Transformer on two GPUs, as fast as it goes.

The course's model (CS336 2026, assignment 2's BasicsTransformerLM: pre-norm RMSNorm, rotary positions, SwiGLU, an
untied output layer, no biases) at 34 layers, d_model 4096, seq 32,768, vocab 151,936, global batch 2, in bf16. One
step is forward, loss, backward and AdamW, timed with triton.testing.do_bench as the course times it. It fits two GPUs
only sharded (FSDP2 per block), each block recomputed in backward, and with the output layer fused with the loss: the
65,536 x 151,936 logits alone would be 20 GB. Before anything is allocated, the memory model predicts each GPU's peak
and refuses what cannot fit. Without CUDA the defaults are a tiny model that runs in seconds. On two H200s the step
takes 5.7 s with SDPA's attention (6.2 s with flash_triton.py's), 58% MFU, 68 GiB per GPU (README: the levers).

    torchrun --nproc_per_node=2 leaderboard.py --recompute 1 --compile   # the leaderboard's step on two GPUs
    python leaderboard.py --layers 4 --recompute 1                      # one GPU: 4 of the 34 layers
    python leaderboard.py --predict --world 2 --gpu-gib 139.8           # the memory model alone (no GPU needed)
    python leaderboard.py --device cpu                                  # tiny, in seconds
"""

import argparse
import gc
import os
import statistics
import sys
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from gpt import (ATTENTION, CE_CHUNK_ROWS, GPU_ONLY_ATTENTION, adamw, check_host_memory, compile_model, is_oom,
                 fail, float_in, fmt_mfu, fully_shard_gpt, gib, int_in, linear_cross_entropy, mfu,
                 on_device, print_table, resolve_device, run_main, start_process_group, time_rounds, train_step)


# --- 1. the course's model: RMSNorm, rotary positions, causal attention, SwiGLU, pre-norm blocks, untied output

@dataclass(frozen=True)
class Sizes:
    layers: int
    d_model: int
    d_ff: int
    heads: int
    vocab: int
    seq: int
    batch: int  # the global batch: sequences per step over all ranks


PRESETS = {"leaderboard": Sizes(34, 4096, 11008, 32, 151936, 32768, 2),  # the course's Config
           "tiny": Sizes(2, 64, 172, 4, 512, 64, 2)}
ROPE_THETA = 10_000.0
RMS_EPS = 1e-5


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in fp32 whatever x's dtype (the squares of bf16 activations lose precision and can
    overflow), returned in x's dtype. No mean subtracted and no bias: LayerNorm's cheaper cousin."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        # one call, a fused kernel on the GPU: it saves only its fp32 input and one rstd per row for backward
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), RMS_EPS).to(x.dtype)


def rope_tables(seq, head_dim, device=None):
    """(cos, sin), each (seq, head_dim / 2) in fp32: position t turns pair i by the angle t * theta^(-2i / head_dim),
    fast turns for the first pairs, slow ones for the last."""
    freqs = ROPE_THETA ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)  # (D/2,)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), freqs)  # (T, D/2)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """x (B, H, T, D) with each pair of neighbouring dims (2i, 2i+1) turned by its position's angle, in fp32, back in
    x's dtype. Applied to queries and keys, a query at t and a key at s score by the offset t - s alone. The course's
    model writes the turned pairs' halves one after the other instead of side by side: q and k are permuted alike,
    so every score q.k, and so the output, is the same."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, H, T, D/2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]  # (B, H, T, D/2) each
    turned = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, T, D/2, 2)
    return turned.flatten(-2).to(x.dtype)  # (B, H, T, D): the pairs side by side again


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads, attend):
        super().__init__()
        self.heads, self.attend = heads, attend  # attend: one of gpt.ATTENTION, picked once
        # three projections as the course has them, so its weights load as they are (one (3d, d) matmul would read
        # x once instead of three times)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.output_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        H = self.heads
        q = self.q_proj(x).view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D): a head is a batch to the matmuls
        k = self.k_proj(x).view(B, T, H, C // H).transpose(1, 2)
        v = self.v_proj(x).view(B, T, H, C // H).transpose(1, 2)
        y = self.attend(rotate(q, cos, sin), rotate(k, cos, sin), v)  # (B, H, T, D), causal; values not turned
        return self.output_proj(y.transpose(1, 2).reshape(B, T, C))  # the heads side by side again: (B, T, C)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): a gate learned per hidden unit; three matrices where GPT-2's MLP has two."""

    def __init__(self, d, d_ff):
        super().__init__()
        self.w1 = nn.Linear(d, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d, bias=False)
        self.w3 = nn.Linear(d, d_ff, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (..., d_ff) gated, back to (..., d)


class Block(nn.Module):
    """Pre-norm: each branch reads a normalized copy of the residual stream, which itself is never normalized."""

    def __init__(self, s, attend):
        super().__init__()
        self.ln1 = RMSNorm(s.d_model)
        self.attn = CausalSelfAttention(s.d_model, s.heads, attend)
        self.ln2 = RMSNorm(s.d_model)
        self.ffn = SwiGLU(s.d_model, s.d_ff)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.ffn(self.ln2(x))


def init_like_the_course(module):
    """Truncated normals at 3 std: a Linear's std sqrt(2 / (fan_in + fan_out)), the embedding's 1."""
    for m in module.modules():
        std = None
        if isinstance(m, nn.Linear):
            std = (2 / (m.in_features + m.out_features)) ** 0.5
        elif isinstance(m, nn.Embedding):
            std = 1.0
        if std is not None:
            nn.init.trunc_normal_(m.weight, std=std, a=-3 * std, b=3 * std)


# The fused kernels F.scaled_dot_product_attention dispatches to, one aten op each: what --keep-attention saves.
SDPA_OPS = {torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
KEEPS_ATTENTION = ("sdpa", "flash", "cudnn", "efficient")  # the --attn choices that run one of them


def attention_kept(ctx, op, *args, **kwargs):
    """Selective recomputation's policy: attention's outputs (its output and log-sum-exp) are saved in forward and
    handed back when the block is recomputed; every other op runs again. At 32K tokens attention is the costliest op
    of a block and its output only (T, d) per sequence."""
    if op in SDPA_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class TransformerLM(nn.Module):
    """The course's BasicsTransformerLM, module for module (its state dict's names). forward(idx, targets) returns
    (logits, None) without targets, else (None, mean loss) through gpt.py's fused output layer and loss."""

    def __init__(self, s, attend, recompute=0, keep_attention=False, fused_loss=True):
        super().__init__()
        self.sizes, self.recompute = s, recompute  # recompute K: every K-th block's activations redone in backward
        self.fused_loss = fused_loss
        self.context = noop_context_fn  # checkpoint's default: everything recomputed
        if keep_attention:  # ... but attention's outputs, kept from forward
            self.context = partial(create_selective_checkpoint_contexts, attention_kept)
        self.token_embeddings = nn.Embedding(s.vocab, s.d_model)
        self.layers = nn.ModuleList(Block(s, attend) for _ in range(s.layers))
        self.ln_final = RMSNorm(s.d_model)
        self.lm_head = nn.Linear(s.d_model, s.vocab, bias=False)  # untied: a matrix of its own
        cos, sin = rope_tables(s.seq, s.d_model // s.heads)
        self.register_buffer("cos", cos, persistent=False)  # one table for every layer, as the course shares it
        self.register_buffer("sin", sin, persistent=False)
        init_like_the_course(self)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.token_embeddings(idx)  # (B, T, C)
        cos, sin = self.cos[:T], self.sin[:T]  # (T, D/2): broadcast over batch and heads
        K = self.recompute
        for i, block in enumerate(self.layers):
            if K and i % K == 0 and torch.is_grad_enabled():  # keep the block's input alone, redo the rest later
                x = checkpoint(block, x, cos, sin, use_reentrant=False, context_fn=self.context)
            else:
                x = block(x, cos, sin)
        x = self.ln_final(x)
        if targets is None:
            return self.lm_head(x), None  # (B, T, vocab)
        if not self.fused_loss:  # the course's way: every logit made, in fp32 for the softmax
            logits = self.lm_head(x).flatten(0, 1).float()  # (B*T, vocab)
            return None, F.cross_entropy(logits, targets.flatten())
        # The logits never exist whole: chunks of rows, each turned into its gradient at once (gpt.py, section 4).
        return None, linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten(),  # (B*T, C)
                                          n_valid=self.sizes.vocab)

# takeaway: the course's model is GPT-2's with three swaps (RMSNorm, rotary positions, SwiGLU) and no biases.


# --- 2. the step: sharded per block, recomputed per block, compiled per block, through gpt.train_step

def build(s, attn, recompute, keep_attention, fused_loss, compile_blocks, world, bf16, device, seed, lr):
    """(model, optimizer, autocast dtype) on this rank. Several ranks: FSDP2 per block (gpt.fully_shard_gpt), bf16
    weights gathered and fp32 gradients reduce-scattered, each rank holding 1/world of the fp32 weights, gradients
    and AdamW moments. One process: fp32 weights under bf16 autocast."""
    torch.manual_seed(seed)  # the same initial weights on every rank: each keeps its shard of them
    with torch.device(device):  # built where it runs: no host copy of 8B parameters
        model = TransformerLM(s, ATTENTION[attn], recompute, keep_attention, fused_loss)
    if compile_blocks:  # one compiled graph that every block shares (same shapes); FSDP's hooks stay outside it
        for i, block in enumerate(model.layers):
            model.layers[i] = compile_model(block)
    dtype = None
    if world > 1:
        # cast_inputs=False: the rotary tables stay fp32. Cast by FSDP2, they were bf16 in forward but fp32 when a
        # checkpointed block was recomputed on the GPU (the cast skipped in backward), and checkpoint refused that.
        fully_shard_gpt(model, torch.bfloat16 if bf16 else None, blocks=model.layers, cast_inputs=False)
    elif bf16:
        dtype = torch.bfloat16
    # gpt.adamw: fused on the GPU; torch's step for FSDP's sharded (DTensor) parameters, gpt's kernel otherwise
    return model, adamw(list(model.parameters()), lr, weight_decay=0.01, betas=(0.9, 0.999)), dtype


def course_batch(s, rank, world, device, seed):
    """(inputs, targets): random tokens as the course's test draws them, the same global batch on every rank, each
    rank its own rows."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(s.vocab, (2, s.batch, s.seq), generator=gen)  # inputs and targets, (B, T) each
    rows = slice(rank * s.batch // world, (rank + 1) * s.batch // world)
    return tokens[0, rows].to(device), tokens[1, rows].to(device)

# takeaway: gpt.train_step is the whole step (forward, fused loss, backward, AdamW); the model decides the rest.


# --- 3. the memory model: one rank's peak, predicted from tensor sizes before anything is allocated

def block_params(s):
    return 4 * s.d_model ** 2 + 3 * s.d_model * s.d_ff + 2 * s.d_model  # 4 attention matrices, SwiGLU's 3, 2 norms


def all_params(s):
    return s.layers * block_params(s) + 2 * s.vocab * s.d_model + s.d_model  # + embedding, lm_head, final norm


def saved_by_block(s, tokens, width, stream):
    """Bytes one block saves for backward, eager, as autograd saves them on the CPU: each norm's fp32 input, rstd and
    normalized input (for the weight's gradient; a fused GPU kernel may keep less), and its weight's fp32 copy when
    the weights are bf16 (stream 2); `width` bytes (the matmuls' dtype) for the norms' outputs, rotated q and k, v,
    the attention output and its (B, T, C) copy, and SwiGLU's four (N, d_ff) tensors (w1 x, its silu, w3 x, their
    product); the attention's fp32 log-sum-exp per head and row."""
    d = s.d_model
    weight_copies = 0
    if stream == 2:
        weight_copies = 2 * 4 * d
    return tokens * (16 * d + 8 + width * (7 * d + 4 * s.d_ff) + 4 * s.heads) + weight_copies


def predict(s, world, bf16, recompute, keep_attention=False, fused_loss=True):
    """({what: bytes}, peak): what one rank holds, and its peak. The state (fp32 weights and AdamW's moments, 1/world
    each under FSDP) and the gathered bf16 weights stay all step. On top of them, the larger of two moments, because
    backward makes the gradients as it frees the activations, so the two are never all there at once:
      start of backward: every activation kept for it, and the larger transient, the loss's (a chunk of logits) or
        the top block's backward (its activations recomputed, its unreduced gradients, the stream's gradients);
      end of backward: every gradient made, the bottom block's backward and the root's unreduced gradients
        (embedding and lm_head, reduce-scattered last).
    keep_attention: each recomputed block also keeps attention's output and log-sum-exp from forward. fused_loss=False:
    the logits made whole, an fp32 copy for the softmax, its fp32 log-probabilities kept for backward."""
    width = 2 if bf16 else 4  # the matmuls' dtype, and the gathered weights' under FSDP
    fsdp = world > 1
    stream = 4
    if fsdp and bf16:  # FSDP's bf16 weights make bf16 activations; autocast keeps an fp32 stream
        stream = 2
    tokens = s.batch // world * s.seq
    d, share = s.d_model, all_params(s) / world
    checkpointed = 0
    if recompute:
        checkpointed = len(range(0, s.layers, recompute))
    whole = s.layers - checkpointed
    kept = 0  # bytes of attention's outputs a recomputed block keeps: (B, H, T, D) in width, fp32 log-sum-exp (B, H, T)
    if keep_attention:
        kept = width * tokens * d + 4 * s.heads * tokens
    rows = {"weights (fp32)": 4 * share, "AdamW moments (2 x fp32)": 8 * share}
    if fsdp:
        rows["gathered: embedding, lm_head, final norm"] = width * (2 * s.vocab * d + d)  # the root's: whole step
        rows["gathered: two blocks (one prefetched)"] = 2 * width * block_params(s)
    elif bf16:
        rows["autocast's bf16 weight copies, kept"] = 2 * (block_params(s) - 2 * d) * whole
    state = sum(rows.values())
    activations = {"activations: blocks kept whole": whole * saved_by_block(s, tokens, width, stream),
                   "activations: recomputed blocks' inputs": checkpointed * stream * tokens * d,
                   "activations: attention's outputs kept (--keep-attention)": checkpointed * kept}
    if fused_loss:
        activations["activations: final norm, loss's dx and dW"] = (4 + stream) * tokens * d + width * s.vocab * d
        loss = width * min(CE_CHUNK_ROWS, tokens) * s.vocab + stream * tokens * d  # a chunk's logits, dx
    else:  # (N, vocab) each: the fp32 log-probabilities kept; in backward the gradients of the loss and of the softmax
        activations["activations: final norm, the loss's fp32 log-probabilities"] = ((4 + stream) * tokens * d
                                                                                      + 4 * tokens * s.vocab)
        # backward's two fp32 gradients (of the loss, of the softmax); forward's logits and their fp32 copy are less
        loss = 8 * tokens * s.vocab
    block = 2 * stream * tokens * d + 2 * width * tokens * s.d_ff  # the stream's gradients, SwiGLU's two
    root = 0
    if fsdp:
        block += (width + 4) * block_params(s)  # its gradients before and during their reduce-scatter
        root = width * 2 * s.vocab * d  # lm_head's and the embedding's gradients, unreduced until the end
    top = block  # the top block's activations: kept (counted with the activations) or recomputed now
    if checkpointed:
        top += saved_by_block(s, tokens, width, stream) - kept  # what it kept is counted above
    bottom = block + saved_by_block(s, tokens, width, stream)  # the bottom block's activations, kept or recomputed
    rows.update(activations)
    rows["gradients (fp32)"] = 4 * share
    start = state + sum(activations.values()) + max(loss, top)
    end = state + 4 * share + bottom + root
    rows["at the start of backward: activations, the larger transient"] = start
    rows["at the end of backward: gradients, the bottom block's backward"] = end
    peak = max(start, end)
    return rows, peak


def print_prediction(s, world, bf16, recompute, keep_attention, fused_loss, capacity):
    """The table, with and without recomputing every block, and the verdict for `recompute`; its predicted peak."""
    K = recompute or 1
    without, peak_without = predict(s, world, bf16, 0, fused_loss=fused_loss)
    with_k, peak_k = predict(s, world, bf16, K, keep_attention, fused_loss)
    recomputing = f"--recompute {K}"
    if keep_attention:
        recomputing += " --keep-attention"
    unit, scale = "GiB", 2**30
    if peak_without < 2**30:  # a tiny model's table in MiB
        unit, scale = "MiB", 2**20
    table = [[name, f"{without[name] / scale:,.2f}", f"{with_k[name] / scale:,.2f}"] for name in without]
    table.append(["predicted peak (the larger moment)", f"{peak_without / scale:,.2f}", f"{peak_k / scale:,.2f}"])
    layout = "one process"
    if world > 1:
        layout = f"FSDP2 over {world} ranks"
    print_table([f"memory per rank, {unit} ({layout}, {all_params(s):,} parameters)", "no recompute", recomputing],
                table)
    print("an estimate from tensor sizes as autograd saves them on the CPU; allocated bytes, not reserved. The GPU's "
          "fused kernels save less: the 8B step on two H200s peaked 7% under its prediction eager, 9-10% compiled")
    peak = peak_without
    if recompute:
        peak = peak_k
    if capacity:
        print(f"predicted {amount(peak)} of {amount(capacity)} per GPU: {fits_in_words(peak, capacity)}")
    return peak


def amount(nbytes):
    if nbytes < 2**30:
        return f"{nbytes / 2**20:,.2f} MiB"
    return f"{gib(nbytes)} GiB"


def fits_in_words(peak, capacity):
    if peak <= capacity:
        return "fits"
    return "does not fit"

# takeaway: 16 bytes a parameter over two ranks is 61 GiB each; at 32,768 tokens only recomputed activations fit.


# --- 4. timing: do_bench on the GPU (ranks kept in lockstep), gpt.py's one timer on the CPU

def in_lockstep(step, device):
    """(call, finish, ran): step wrapped for do_bench on several ranks. do_bench sizes its warm-up and repetitions
    from each rank's own first timings, so two ranks can choose different counts, and a rank left inside FSDP's
    all-gather, waiting for one that has finished, would hang. Each call first asks every rank (one small
    all-reduce): the step runs only when all are calling. A rank done with do_bench answers from finish() until no
    rank is calling. ran: for each call, whether the step ran (the calls that did not are left out of the times)."""
    ran = []

    def count_calling(calling):
        votes = torch.tensor([float(calling)], device=device)
        dist.all_reduce(votes)  # every rank reads the same count, so every rank decides the same
        return int(votes.item())  # a host sync: microseconds against a step of seconds

    def call():
        ran.append(count_calling(True) == dist.get_world_size())
        if ran[-1]:
            step()

    def finish():
        while count_calling(False):
            pass

    return call, finish, ran


def bench_gpu(step, device, world, warmup_ms, rep_ms):
    """ms of each timed step, from triton.testing.do_bench as the course times it (L2 flushed before each)."""
    import triton.testing
    call, finish, ran = step, None, []
    if world > 1:
        call, finish, ran = in_lockstep(step, device)
    times = triton.testing.do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    if finish is None:
        return times
    finish()
    return [t for t, went in zip(times, ran[-len(times):]) if went]


def bench_cpu(step, device, world, rounds, warmup):
    """ms of each step from gpt.time_rounds, one step a round; several ranks meet at a barrier each round."""
    sync = None
    if world > 1:
        sync = dist.barrier
    times, _ = time_rounds({"step": step}, device, rounds=rounds, steps=1, warmup=warmup, sync=sync)
    return times["step"]


def train_flops_per_token(s):
    """gpt.flops_per_token's count for this model: 6 per matmul parameter (SwiGLU has 3 matrices, the embedding is
    a lookup) plus attention's 12 L d T, not halved for the causal mask."""
    matmul_params = s.layers * (4 * s.d_model ** 2 + 3 * s.d_model * s.d_ff) + s.vocab * s.d_model
    return 6 * matmul_params + 12 * s.layers * s.d_model * s.seq

# takeaway: do_bench's mean is the course's number; on several ranks it needs the ranks to agree on the count.


# --- 5. command line

def parse_args(argv):
    p = argparse.ArgumentParser(description="The CS336 leaderboard's training step: predicted memory, then timed.")
    p.add_argument("--preset", choices=PRESETS, help="sizes (default: leaderboard on a GPU, tiny on the CPU)")
    for flag, what in (("--layers", "blocks"), ("--d-model", "width"), ("--d-ff", "SwiGLU's hidden width"),
                       ("--heads", "attention heads"), ("--vocab", "vocabulary"), ("--seq", "sequence length"),
                       ("--batch", "global batch: sequences per step over all ranks")):
        p.add_argument(flag, type=int_in(1), help=f"{what} (default: the preset's)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 compute (the default on a GPU)")
    precision.add_argument("--fp32", action="store_true", help="fp32 compute (the default on the CPU)")
    p.add_argument("--recompute", type=int_in(0), default=0, metavar="K",
                   help="recompute every K-th block's activations in backward (1: all; 0: none)")
    p.add_argument("--keep-attention", action="store_true",
                   help="recomputed blocks keep attention's output from forward instead of running attention again")
    p.add_argument("--no-fused-loss", action="store_true",
                   help="make the logits whole, then cross-entropy (as the course's model does): the lever's cost")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--attn", choices=ATTENTION, help="attention (default: sdpa, the fastest here)")
    p.add_argument("--warmup-ms", type=float_in(0), default=10_000, help="do_bench's warm-up on a GPU (course: 10 s)")
    p.add_argument("--rep-ms", type=float_in(1), default=30_000, help="do_bench's timed span on a GPU (course: 30 s)")
    p.add_argument("--steps", type=int_in(1), default=4, help="timed steps on the CPU")
    p.add_argument("--warmup", type=int_in(1), default=1, help="warm-up steps on the CPU")
    p.add_argument("--lr", type=float_in(0), default=1e-3)
    p.add_argument("--predict", action="store_true", help="print the memory prediction and exit")
    p.add_argument("--world", type=int_in(1), help="--predict: ranks (default: torchrun's, or 1)")
    p.add_argument("--gpu-gib", type=float_in(0.001),
                   help="memory per GPU to check against (default: the GPU's); with it, bf16 is the default")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda if present)")
    p.add_argument("--seed", type=int_in(), default=0)
    return p.parse_args(argv)


def sizes_from(args, device):
    """The preset's sizes with any flag overriding them, or a ValueError."""
    preset = args.preset or on_device(device, cpu="tiny", gpu="leaderboard")
    flags = {"layers": args.layers, "d_model": args.d_model, "d_ff": args.d_ff, "heads": args.heads,
             "vocab": args.vocab, "seq": args.seq, "batch": args.batch}
    s = replace(PRESETS[preset], **{k: v for k, v in flags.items() if v is not None})
    if s.d_model % s.heads:
        raise ValueError(f"--d-model {s.d_model} is not divisible by --heads {s.heads}")
    if s.d_model // s.heads % 2:
        raise ValueError(f"the head dim {s.d_model // s.heads} (d_model / heads) is odd; rotary positions turn pairs")
    if args.recompute > s.layers:
        raise ValueError(f"--recompute {args.recompute} must be between 0 and the {s.layers} layers")
    return preset, s


def ranks(device_name):
    """(rank, world, device) from torchrun's RANK, WORLD_SIZE and LOCAL_RANK, or one process without them."""
    device = resolve_device(device_name)
    if "RANK" not in os.environ:
        return 0, 1, device
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"local rank {local} has no GPU: this machine has {torch.cuda.device_count()}")
        device = torch.device("cuda", local)
    return rank, world, device


def check_run(args, s, world, device):
    """The combinations a run cannot take, as a ValueError."""
    if s.batch % world:
        raise ValueError(f"--batch {s.batch} does not split over {world} ranks: give each rank the same rows")
    if device.type == "cpu" and args.attn in GPU_ONLY_ATTENTION:
        raise ValueError(f"--attn {args.attn} needs a CUDA GPU")
    if args.keep_attention and not args.recompute:
        raise ValueError("--keep-attention keeps attention's output in recomputed blocks: add --recompute K")
    if args.keep_attention and (args.attn or "sdpa") not in KEEPS_ATTENTION:
        choices = ", ".join(KEEPS_ATTENTION)
        raise ValueError(f"--keep-attention saves the output of SDPA's kernels: use --attn {choices}")
    if args.keep_attention and args.compile:
        raise ValueError("--keep-attention picks ops of an eager block to save; a compiled block runs Inductor's "
                         "kernels instead: drop --compile")
    if args.world is not None and not args.predict:
        raise ValueError("--world is for --predict; a run takes its ranks from torchrun")


def capacity_of(args, device):
    if args.gpu_gib is not None:
        return args.gpu_gib * 2**30
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def report(s, times, losses, timer, world, device, predicted, rank):
    """The result table (rank 0 prints it), the losses (mean over ranks), and the one-line summary."""
    peak = torch.zeros((), device=device)
    if device.type == "cuda":
        peak.fill_(torch.cuda.max_memory_allocated(device))
    losses = torch.stack(losses).float()
    if world > 1:
        dist.all_reduce(losses)
        losses /= world
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if not times:
        return ["no timed step ran: raise --rep-ms"], losses
    mean, median = statistics.mean(times), statistics.median(times)
    tokens = s.batch * s.seq
    utilisation = mfu(train_flops_per_token(s) * tokens / world / (median / 1e3), device)
    memory = "n/a"
    if device.type == "cuda":
        memory = amount(peak.item())
    if rank:
        return "", losses
    print_table(["timer", "steps", "mean ms", "median ms (min-max)", "tokens/s", "MFU", "peak mem per GPU"],
                [[timer, len(times), f"{mean:.1f}", f"{median:.1f} ({min(times):.1f}-{max(times):.1f})",
                  f"{tokens / (median / 1e3):,.0f}", fmt_mfu(utilisation), memory]])
    return (f"summary: {mean:.1f} ms per step ({timer} mean), median {median:.1f} | {tokens / (median / 1e3):,.0f} "
            f"tok/s | MFU {fmt_mfu(utilisation)} | peak {memory} allocated, predicted {amount(predicted)}"), losses


def run(args, rank, world, device):
    """Predict, refuse what cannot fit, build, time, report. Rank 0 speaks."""
    say = print
    if rank:
        say = quiet
    preset, s = sizes_from(args, device)
    check_run(args, s, world, device)
    bf16 = args.bf16 or (not args.fp32 and (device.type == "cuda" or args.gpu_gib is not None))  # a GPU's default
    # SDPA by default, not gpt.default_attention's flash_triton.py: at head dim 128 and 32,768 tokens SDPA's kernel
    # made the 8B step 5.68 s against 6.23 s with flash_triton.py's (2 x H200, compiled, 2026-11-28)
    attn = args.attn or "sdpa"
    say(f"device: {device} | {preset} sizes{cpu_note(device, args.preset)}: {describe(s)} | "
        f"{'bf16' if bf16 else 'fp32'}, attention {attn}, {world} process(es)")
    capacity = capacity_of(args, device)
    if rank == 0:
        predicted = print_prediction(s, world, bf16, args.recompute, args.keep_attention, not args.no_fused_loss,
                                     capacity)
    else:
        predicted = predict(s, world, bf16, args.recompute, args.keep_attention, not args.no_fused_loss)[1]
    if args.predict:
        return
    if capacity and predicted > capacity:
        raise ValueError(f"does not fit: predicted {amount(predicted)} > {amount(capacity)} per GPU; add "
                         "--recompute 1 or more ranks")
    if device.type == "cpu":
        check_host_memory(world * predicted, f"the step at {s}", "use smaller sizes")
    if world > 1:
        start_process_group(device)
    model, optimizer, dtype = build(s, attn, args.recompute, args.keep_attention, not args.no_fused_loss, args.compile,
                                    world, bf16, device, args.seed, args.lr)
    x, y = course_batch(s, rank, world, device, args.seed)
    losses = []

    def step():
        losses.append(train_step(model, optimizer, x, y, dtype))
        say(f"step {len(losses) - 1}", file=sys.stderr, flush=True)  # on a GPU: queued, maybe not yet run

    if args.compile:
        say("compiling... (torch.compile, each block: the first step takes a minute or more)", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        times = bench_gpu(step, device, world, args.warmup_ms, args.rep_ms)
        timer = "do_bench"
    else:
        times = bench_cpu(step, device, world, args.steps, args.warmup)
        timer = "gpt.time_rounds"
    summary, losses = report(s, times, losses, timer, world, device, predicted, rank)
    say("loss by step (mean over ranks): " + " ".join(f"{v:.4f}" for v in losses.tolist()))
    say(summary)


def describe(s):
    return (f"{s.layers} layers, d_model {s.d_model}, d_ff {s.d_ff}, {s.heads} heads, vocab {s.vocab}, seq {s.seq}, "
            f"batch {s.batch}")


def quiet(*args, **kwargs):  # what ranks other than 0 print
    return None


def cpu_note(device, preset):
    if device.type == "cpu" and preset is None:
        return " (no CUDA: seconds)"
    return ""


def main(argv=None):
    args = parse_args(argv)
    world = 1
    try:
        rank, world, device = ranks(args.device)
        if args.predict and args.world is not None:
            world = args.world
        run(args, rank, world, device)
        if dist.is_initialized():
            gc.collect()  # FSDP2's modules hold reference cycles: freed now, not at exit after the group is gone
            dist.barrier()  # every rank past its last collective before the group is torn down
    except ValueError as e:
        fail(str(e))
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        fail("out of memory, against the prediction: add --recompute 1, or lower --seq or --batch")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
