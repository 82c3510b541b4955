"""GPT-2 in one file: the model every nanoperf script trains, times or takes apart, then its levers and tools.

Part 1, the model, read as nanoGPT's model.py reads: the config and presets, attention and its toggles, the MLP, the
block, GPT with its padded vocabulary and generate. Each speed-up is entered by one switch you can see in the model
code (a GPTConfig field), its kernels further down. Part 2, the levers train.py uses by default, a section each that
says what it buys and the flag that turns it off: the output layer fused with the loss, each residual add fused with
the LayerNorm after it, AdamW's kernel for the matrices, bf16 weights kept by the optimizer, cuBLAS without a
workspace; then FP8, behind --fp8. Part 3, the tools the scripts share: the optimizer and one training step, the step
as one CUDA graph, FLOPs and MFU, the tokenizer, the one timer, flag types, tables and small helpers.

    python gpt.py                  # the presets: parameters and training FLOPs per token
    python gpt.py --model gpt2     # where one preset's parameters are
"""

import argparse
import gc
import importlib.util
import math
import os
import shutil
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
GPT2_VOCAB = 50257  # tokens the GPT-2 BPE can produce; a larger vocab_size is padding


# ====================================================================================================================
# Part 1: the model
# ====================================================================================================================

# --- 1. configuration and presets: tiny trains in seconds on a CPU (256-token context), gpt2 is GPT-2 124M

@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    d_ff: int = 3072
    block_size: int = 1024  # longest context, the size of the position table
    vocab_size: int = GPT2_VOCAB
    attn: str = "sdpa"  # see ATTENTION; chosen once, when the model is built
    fused_ce: bool = True  # training loss through LinearCrossEntropy (section 4)
    recompute: int = 0  # activation checkpointing of every recompute-th block (1: all, 0: none)
    fused_norms: bool = False  # each residual add fused with the LayerNorm after it (section 5; not with recompute)
    fused_bias: bool = False  # the MLP's and c_proj's biases added by those kernels too (section 5; with fused_norms)
    embedding_into_dw: bool = True  # with fused_ce: the embedding's gradient added into the loss's dW (section 4)


PRESETS = {  # name: (n_layer, n_head, n_embd, d_ff); gpt2 and small are the same 124M model under two names
    "tiny": (4, 4, 128, 512),
    "gpt2": (12, 12, 768, 3072),
    "small": (12, 12, 768, 3072),
    "medium": (24, 16, 1024, 4096),
    "large": (36, 20, 1280, 5120),
    "xl": (48, 25, 1600, 6400),
    "2.7B": (32, 32, 2560, 10240),
}


def make_config(name, **overrides):
    """A preset's config with any field overridden: make_config("gpt2", vocab_size=50304, attn="flash")."""
    if name not in PRESETS:
        raise ValueError(f"unknown model '{name}'; choose from {', '.join(PRESETS)}")
    block_size = 1024
    if name == "tiny":
        block_size = 256  # short enough that a CPU trains it in seconds
    return check_config(replace(GPTConfig(*PRESETS[name], block_size), **overrides))


def check_config(config):
    """The config itself, or a ValueError in one sentence if it cannot work."""
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
    if config.vocab_size < GPT2_VOCAB:
        raise ValueError(f"vocab {config.vocab_size} is below the tokenizer's {GPT2_VOCAB} tokens")
    if config.attn not in ATTENTION:
        raise ValueError(f"unknown attention '{config.attn}'; choose from {', '.join(ATTENTION)}")
    if config.attn == "triton" and not flash_triton_found():  # here, not at the first forward: before any work
        raise ValueError("--attn triton runs flash_triton.py's kernels, and there is no flash_triton.py next to "
                         "gpt.py: copy it there, or choose another --attn")
    if not 0 <= config.recompute <= config.n_layer:
        raise ValueError(f"--recompute {config.recompute} must be between 0 (none) and the {config.n_layer} layers")
    if config.fused_bias and not config.fused_norms:
        raise ValueError("fused_bias needs fused_norms: the add + LayerNorm kernels add c_proj's biases")
    return config


# --- 2. attention: causal self-attention of (B, H, T, D) tensors, one function per implementation

def naive_attention(q, k, v):
    """Attention as the formula reads: the (T, T) scores and probabilities are kept for backward, which is what
    FlashAttention removes."""
    from torch.autograd.profiler import record_function  # ranges for bench_e2e.py's profile
    T = q.size(-2)
    with record_function("attention scores"), nvtx_range("attention scores"):
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    with record_function("softmax"), nvtx_range("softmax"):
        probs = scores.softmax(dim=-1)
    with record_function("final matmul"), nvtx_range("final matmul"):
        return probs @ v


def sdpa_attention(q, k, v):
    """PyTorch's scaled_dot_product_attention: it picks the fastest backend that runs the inputs (cuDNN on an H100)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def pinned_sdpa(backend):
    """SDPA with one backend only. It raises rather than fall back, so a benchmark of "flash" really measured flash."""
    def attend(q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attend


def triton_attention(q, k, v):
    """flash_triton.py: this repository's FlashAttention-2 in Triton."""
    from flash_triton import flash_attention
    return flash_attention(q, k, v, causal=True)


def triton_attention_qkv(qkv, n_head):
    """The same kernels on c_attn's whole (B, T, 3C) output, returning (B, T, C): the model's path for --attn
    triton. They read q, k, v where the projection wrote them and write its gradient whole, where the split into
    heads below would cost autograd a concatenating copy of the three gradients every layer and step."""
    from flash_triton import flash_attention_qkv
    return flash_attention_qkv(qkv, n_head, causal=True)


SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
ATTENTION = {  # --attn NAME
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "flash": pinned_sdpa("FLASH_ATTENTION"),
    "cudnn": pinned_sdpa("CUDNN_ATTENTION"),
    "efficient": pinned_sdpa("EFFICIENT_ATTENTION"),
    "math": pinned_sdpa("MATH"),
    "triton": triton_attention,
}
GPU_ONLY_ATTENTION = ("cudnn", "efficient", "triton")
SAID = set()  # the notes default_attention has printed: each once a process


def flash_triton_found():
    """Whether flash_triton.py can be imported: the one file gpt.py uses (for --attn triton) that a script copied
    with gpt.py alone lacks. Looked up, not imported: without a GPU, importing it turns on Triton's interpreter."""
    return importlib.util.find_spec("flash_triton") is not None


def default_attention(device, dtype, head_dim):
    """train.py's --attn default: our Triton kernels on a GPU for bf16/fp16 activations of a head dim they have
    tiles for (gpt2's train step on an H100: 1.021-1.025x as fast as with cuDNN), SDPA's own choice otherwise
    (fp32, head dims like 2.7B's 80, and a copy without flash_triton.py, which says so once)."""
    if torch.device(device).type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    if not flash_triton_found():
        note = "flash_triton.py not found next to gpt.py: attention sdpa"
        if note not in SAID:
            SAID.add(note)
            print(note, flush=True)
        return "sdpa"
    from flash_triton import HEAD_DIMS
    if head_dim not in HEAD_DIMS:
        return "sdpa"
    return "triton"


# --- 3. the model

def matmul_dtype(x):
    """The dtype nn.Linear would multiply x in: autocast's, if it is on, else x's own. The fused functions below
    cast to it themselves."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def project(linear, x, bias=True):
    """linear(x); bias=False: its matmul only, the bias left to a fused kernel (section 5). FP8 Linears (section 9)
    keep FP8."""
    if bias:
        return linear(x)
    if isinstance(linear, Fp8Linear):
        return linear.matmul(x)
    return F.linear(x, linear.weight)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.attend = ATTENTION[config.attn]  # picked here once, not looked up every forward
        self.whole_qkv = config.attn == "triton"  # our kernels take the projection whole (triton_attention_qkv)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, fused_bias=False):
        """fused_bias: c_proj's bias left to the caller, whose add + LayerNorm kernel adds it (section 5)."""
        B, T, C = x.shape  # batch, time (tokens), channels (n_embd)
        qkv = self.c_attn(x)  # (B, T, 3C)
        if self.whole_qkv:
            y = triton_attention_qkv(qkv, self.n_head)  # (B, T, 3C) -> (B, T, C), nothing copied
        else:
            q, k, v = qkv.split(C, dim=2)  # each (B, T, C)
            H = self.n_head
            q = q.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D): a head is a batch of its own to the matmuls
            k = k.view(B, T, H, C // H).transpose(1, 2)
            v = v.view(B, T, H, C // H).transpose(1, 2)
            y = self.attend(q, k, v)  # (B, H, T, D)
            y = y.transpose(1, 2).reshape(B, T, C)  # the heads side by side again: (B, T, C)
        return project(self.c_proj, y, bias=not fused_bias)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.d_ff)
        self.c_proj = nn.Linear(config.d_ff, config.n_embd)

    def forward(self, x, fused_bias=False):
        """fused_bias: c_fc's bias added by the GELU kernel, c_proj's left to the caller's add + LayerNorm (section
        5): each bias gradient summed by the kernel that writes the gradient it sums, not by a pass of its own."""
        if fused_bias:
            h = project(self.c_fc, x, bias=False)  # (..., d_ff): c_fc's matmul only
            return project(self.c_proj, bias_gelu(h, self.c_fc.bias), bias=False)
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's GELU


class Block(nn.Module):
    """Pre-LayerNorm: the residual stream x is never normalized itself, only what each branch reads."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2: token and position embeddings, n_layer blocks, a final LayerNorm, the output layer tied to the token
    embedding. forward(idx, targets) returns (logits, loss); training with the fused loss returns no logits."""

    def __init__(self, config):
        super().__init__()
        check_config(config)
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix, one gradient
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # residual projections scaled: variance does not grow with depth
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # parameters() counts a tied one once

    def forward(self, idx, targets=None, blocks=None):
        """idx (B, T) token ids -> (logits (B, T, vocab), loss). With targets while training and the fused loss:
        (None, loss), the logits never exist. With targets otherwise the logits come back detached: compile would
        zero-fill their gradient every step. blocks: what runs in place of self.h (memory.py passes checkpointed
        groups of blocks), each a function x -> x."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than the block size {self.config.block_size}")
        fused_loss = targets is not None and self.config.fused_ce and torch.is_grad_enabled()
        x, head_weight = self.embed(idx, fused_loss and self.config.embedding_into_dw)
        K = self.config.recompute
        if self.config.fused_norms and blocks is None and not K:
            x = self.fused_norm_blocks(x)
        else:
            for i, block in enumerate(self.h if blocks is None else blocks):
                if K and i % K == 0 and torch.is_grad_enabled():  # keep the block's input, redo its activations later
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
            x = self.ln_f(x)
        if fused_loss:
            return None, linear_cross_entropy(x.flatten(0, 1), head_weight, targets.flatten())  # (B*T, C)
        logits = self.lm_head(x)  # (B, T, vocab)
        if targets is None:
            return logits, None
        return logits.detach(), F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def embed(self, idx, tied):
        """Token plus position embeddings (B, T, C), and the output layer's weight; tied: both through TiedEmbedding
        (section 4), where the tied matrix's two gradients meet."""
        head_weight = self.lm_head.weight
        if tied:
            tokens, head_weight = TiedEmbedding.apply(idx, self.wte.weight)
        else:
            tokens = self.wte(idx)
        return tokens + self.wpe(torch.arange(idx.shape[1], device=idx.device)), head_weight  # (B, T, C) + (T, C)

    def fused_norm_blocks(self, x):
        """The blocks and ln_f as Block.forward runs them, each residual add fused with the LayerNorm after it
        (section 5): x (B, T, C) -> ln_f's output. It reads the next block's ln_1 before that block runs, so a
        wrapper that gathers a block's weights when the block is called (FSDP), or any hook on a block, needs the
        plain loop."""
        B, T, C = x.shape
        low = matmul_dtype(x)  # the dtype the matmuls read: the autocast one, if on
        fused_bias = self.config.fused_bias  # c_proj's biases added here, by add_layer_norm
        x = x.flatten(0, 1)  # (B*T, C): a row per token, as the kernels read them
        h = self.h[0].ln_1(x).to(low)  # the first norm has no add before it
        for i, block in enumerate(self.h):
            y = block.attn(h.view(B, T, C), fused_bias).flatten(0, 1)
            x, h = add_layer_norm(x, y, block.ln_2, low, block.attn.c_proj.bias if fused_bias else None)
            norm, dtype = self.ln_f, x.dtype  # the last block: ln_f, in x's dtype as under autocast (the loss casts)
            if i + 1 < len(self.h):
                norm, dtype = self.h[i + 1].ln_1, low
            y = block.mlp(h, fused_bias)
            x, h = add_layer_norm(x, y, norm, dtype, block.mlp.c_proj.bias if fused_bias else None)
        return h.view(B, T, C)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """idx (B, T) extended by max_new_tokens sampled tokens; never a padding token (ids from GPT2_VOCAB on)."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]  # the last block_size tokens at most
            logits, _ = self(context)  # (B, T, vocab)
            logits = logits[:, -1, :].float() / temperature  # the next token's: (B, vocab)
            logits[:, GPT2_VOCAB:] = float("-inf")
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, GPT2_VOCAB)).values[:, -1:]
                logits[logits < kth] = float("-inf")
            next_token = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, next_token], dim=1)
        return idx


# ====================================================================================================================
# Part 2: the levers train.py uses by default, each with what it buys and the flag that turns it off, then FP8 behind
# its flag. (Its default attention, flash_triton.py's kernels, is section 2's default_attention: --attn sdpa.)
# ====================================================================================================================

# --- 4. the output layer fused with the loss: the [N, V] logits (1.6 GB in bf16 at N=16,384) never exist. Off:
# train.py --no-fused-ce (GPTConfig.fused_ce). Over chunks of rows, a kernel turns each chunk's logits into their
# gradient, at once multiplied into dx and dW, in forward. With it, the tied embedding's gradient is added into the
# loss's dW (TiedEmbedding: two passes over 154 MB in fp32 fewer at gpt2's size; GPTConfig.embedding_into_dw, which
# no train.py flag turns off: bench_e2e.py's ladder times it).

@triton.jit
def _cross_entropy_rows(logits_ptr, targets_ptr, loss_ptr, stride, n_valid, n_cols, BLOCK: tl.constexpr):
    # One program per row: its loss, then softmax - onehot over the logits (columns from n_valid on: padding, 0).
    # The 1/N waits for backward: a float argument breaks Inductor's relaunch under dynamic shapes (torch 2.11).
    row = logits_ptr + tl.program_id(0).to(tl.int64) * stride
    m = float("-inf")  # running max and sum of exp(z - m): one exp per element
    s = 0.0
    for start in range(0, n_valid, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(row + cols, mask=cols < n_valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(targets_ptr + tl.program_id(0))
    tl.store(loss_ptr + tl.program_id(0), lse - tl.load(row + target).to(tl.float32))
    # The second read goes from the row's end back: the tiles the first read loaded last are the likeliest to be
    # still in L2 (the ~50 MB it holds are about 500 rows of 100 KB, fewer than the rows in flight).
    n_tiles = tl.cdiv(n_cols, BLOCK)
    for i in range(0, n_tiles):
        cols = (n_tiles - 1 - i) * BLOCK + tl.arange(0, BLOCK)
        z = tl.load(row + cols, mask=cols < n_valid, other=float("-inf")).to(tl.float32)
        grad = tl.exp(z - lse)
        grad = tl.where(cols == target, grad - 1.0, grad)
        tl.store(row + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < n_cols)


def chunk_loss_and_grad(logits, targets, n_valid):
    """Each row's loss; the logits are overwritten by their gradient. The kernel on a GPU; on a CPU its reference."""
    if logits.is_cuda:
        losses = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
        # tiles of 8,192 columns, 16 warps, for 8,192 x 50,304 on an H100: 0.807 ms with the second read backwards,
        # 0.881 front to back; 4,096 columns and 8 warps 0.821 and 0.881 (one read + one write at 3 TB/s: 0.549)
        _cross_entropy_rows[(logits.shape[0],)](logits, targets, losses, logits.stride(0), n_valid,
                                                logits.shape[1], BLOCK=8192, num_warps=16)
        return losses
    z = logits[:, :n_valid].float()
    lse = torch.logsumexp(z, dim=1)
    grad = torch.exp(z - lse[:, None])
    grad[torch.arange(len(targets)), targets] -= 1
    losses = lse - z.gather(1, targets[:, None]).squeeze(1)  # before the logits (z, in fp32) are overwritten
    logits[:, :n_valid] = grad.to(logits.dtype)
    logits[:, n_valid:] = 0
    return losses


class LinearCrossEntropy(torch.autograd.Function):
    """mean_i cross_entropy(x_i W^T, y_i) with its gradients for x and W computed in forward."""
    @staticmethod
    def forward(ctx, x, weight, targets, chunk_rows, n_valid):
        dtype = matmul_dtype(x)  # the matmuls in the autocast dtype, as nn.Linear's would be
        xc, w = x.to(dtype), weight.to(dtype)
        N = x.shape[0]
        losses, dx, dw = [], torch.empty_like(x), None
        with torch.autocast(x.device.type, enabled=False):
            for start in range(0, N, chunk_rows):
                rows = slice(start, start + chunk_rows)
                logits = xc[rows] @ w.t()
                losses.append(chunk_loss_and_grad(logits, targets[rows], n_valid))
                dx[rows] = logits @ w  # `logits` now holds their gradient
                if dw is None:  # the first chunk's product is dW so far: no zeroed dW to add it to
                    dw = logits.t() @ xc[rows]
                else:  # the matmul accumulates in fp32 inside
                    dw.addmm_(logits.t(), xc[rows])
        ctx.save_for_backward(dx, dw.to(weight.dtype))
        ctx.n_rows = N
        return torch.cat(losses).sum() / N

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dw = ctx.saved_tensors  # gradients of the sum of the losses; the loss is their mean
        scale = grad_loss / ctx.n_rows
        return dx * scale, dw * scale, None, None, None


class TiedEmbedding(torch.autograd.Function):
    """The token embedding wte(idx), and wte's weight again for the fused loss: the tied matrix's two gradients
    meet here. Autograd would add the embedding's rows into a zeroed (vocab, C) buffer and then add that to the
    loss's dW, two extra passes over 154 MB in fp32 at gpt2's size, plus the zeroing; here they go into dW itself."""
    @staticmethod
    def forward(ctx, idx, weight):
        ctx.save_for_backward(idx)
        return F.embedding(idx, weight), weight.view_as(weight)  # (B, T, C) rows; the weight, for the output layer

    @staticmethod
    def backward(ctx, grad_rows, grad_weight):
        (idx,) = ctx.saved_tensors
        rows = grad_rows.flatten(0, 1)  # (B*T, C): row i adds into the weight's row idx[i], repeated ids add up
        # out of place, so autograd's buffer is not modified; compiled, Inductor adds into dW's own buffer
        return None, grad_weight.index_put((idx.flatten(),), rows, accumulate=True)


CE_CHUNK_ROWS = 8192  # rows enough for efficient matmuls


def linear_cross_entropy(x, weight, targets, chunk_rows=None, n_valid=None):
    """The mean cross-entropy of x @ weight.T against targets: x (N, d) hidden states, targets (N,). n_valid: the
    output rows that are tokens (default: GPT-2's 50,257; the rest is padding, given no probability)."""
    if n_valid is None:
        n_valid = min(GPT2_VOCAB, weight.shape[0])
    return LinearCrossEntropy.apply(x, weight, targets, chunk_rows or CE_CHUNK_ROWS, n_valid)


# --- 5. each residual add fused with the LayerNorm after it: on an H100 the train step about 3% faster (1.026x and
# 1.033x, paired against the same model without it); off: train.py --no-fused-norms (GPTConfig.fused_norms). The
# biases added by the same kernels: 1.008x and 1.013x as fast again; off: --no-fused-bias (GPTConfig.fused_bias).
# A pre-LN block ends with x = x + branch and the next branch starts with LN(x): forward, one kernel reads x (fp32)
# and the branch's output y (bf16) once and writes the new x and LN(x) already in the matmuls' dtype; backward, one
# kernel reads r = x + y, LN's output gradient and the gradient coming down the residual stream once, and writes the
# stream's gradient, the branch's gradient in its own dtype and each program's partial sums for the LayerNorm's
# weight and bias. Per element of gpt2's 16,384 x 768 activations: forward 6 bytes read, 6 written; backward 10 read,
# 6 written. Alone, the forward takes 1.09x the time of Inductor's own fused add + LayerNorm, so the gain is in the
# backward and the kernels around it. GPT.fused_norm_blocks runs the blocks this way. With GPTConfig.fused_bias the
# same kernels also add c_proj's bias to the branch (forward) and sum its gradient from the branch gradient they
# write (backward), and c_fc's bias goes into GELU (bias_gelu below): a Linear's bias gradient is the column sum of
# its output's gradient, which otherwise costs a pass of its own over that gradient (by the profile, 0.42 ms a step
# for gpt2's c_fc, 0.25 for both c_proj; c_attn's stays in its matmul).

# (rows per program, warps), searched alone at 16,384 x 768 on an H100 over 4-64 rows and 1-8 warps: forward
# 59 us (16 rows and 4 warps: 61; its 12 bytes an element take 50 us at 3.0 TB/s); backward 80 us (16 rows and
# 4 warps: 97; its 16 bytes: 67 us). Backward, one warp a program: more of them fit on each SM at once.
ADD_LN_FWD_TILE, ADD_LN_BWD_TILE = (4, 4), (16, 1)
# Both backward kernels' tiles (this one's and bias-GELU's below) were searched at gpt2's 16,384 rows (B=16, T=1,024).
# At 8,192 (--grad-accum 2 --batch 8), searched again on an H200 (each Function's backward, CUDA-graphed), half the
# rows a program is faster: add + LayerNorm 42 us with 8 rows against 53 with 16 (at 16,384 rows: 75 against 70);
# bias-GELU 56 us with 16 rows against 67 with 32 (at 16,384: 98 both). So below 16,384 rows, half (backward_rows).
FULL_TILE_ROWS = 16384


def backward_rows(n_rows, rows):
    """Rows a program for a backward kernel whose tile has `rows` at FULL_TILE_ROWS rows or more: half below."""
    if n_rows < FULL_TILE_ROWS:
        return max(1, rows // 2)
    return rows


@triton.jit
def _add_layer_norm_fwd(X, Y, YB, W, B, R, H, Mean, Rstd, n_rows, C, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                        Y_BIAS: tl.constexpr):
    # r = x + y (+ y's bias); h = (r - mean) / std * w + b, one row of C <= BLOCK values at a time, ROWS per program
    eps = tl.cast(eps, tl.float32)  # Inductor passes a Python float as fp64
    cols = tl.arange(0, BLOCK)
    inside = cols < C
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)  # loaded once for the program's rows
    b = tl.load(B + cols, mask=inside, other=0.0).to(tl.float32)
    if Y_BIAS:
        yb = tl.load(YB + cols, mask=inside, other=0.0).to(tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < n_rows:
            at = row.to(tl.int64) * C + cols
            r = tl.load(X + at, mask=inside, other=0.0).to(tl.float32)
            r += tl.load(Y + at, mask=inside, other=0.0).to(tl.float32)
            if Y_BIAS:
                r += yb  # c_proj's bias, added here instead of in c_proj's matmul
            tl.store(R + at, r.to(R.dtype.element_ty), mask=inside)  # the residual stream goes on in fp32
            mean = tl.sum(r, 0) / C
            centered = tl.where(inside, r - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 0) / C + eps)
            tl.store(H + at, (centered * rstd * w + b).to(H.dtype.element_ty), mask=inside)  # the next matmul's input
            tl.store(Mean + row, mean)  # two floats a row, so that backward need not reduce the row again
            tl.store(Rstd + row, rstd)


@triton.jit
def _add_layer_norm_bwd(DH, DR_in, R, W, Mean, Rstd, DR, DY, Parts, n_rows, C, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                        Y_BIAS: tl.constexpr):
    # dr = dr_in + LN'(dh): g = dh * w, xhat = (r - mean) * rstd, dr = dr_in + rstd (g - mean(g) - xhat mean(g xhat));
    # dy = dr (the add passes its gradient to both inputs); dw += dh * xhat, db += dh and y's dbias += dy over the rows
    cols = tl.arange(0, BLOCK)
    inside = cols < C
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    db = tl.zeros([BLOCK], tl.float32)
    dyb = tl.zeros([BLOCK], tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < n_rows:
            at = row.to(tl.int64) * C + cols
            rstd = tl.load(Rstd + row)
            r = tl.load(R + at, mask=inside, other=0.0).to(tl.float32)
            xhat = tl.where(inside, (r - tl.load(Mean + row)) * rstd, 0.0)
            dh = tl.load(DH + at, mask=inside, other=0.0).to(tl.float32)
            g = dh * w
            dx_hat = g - (xhat * tl.sum(xhat * g, 0) + tl.sum(g, 0)) / C
            dr = tl.load(DR_in + at, mask=inside, other=0.0).to(tl.float32) + dx_hat * rstd
            tl.store(DR + at, dr.to(DR.dtype.element_ty), mask=inside)  # fp32, down the residual stream
            dy = dr.to(DY.dtype.element_ty)
            tl.store(DY + at, dy, mask=inside)  # bf16 under autocast, into the branch
            dw += dh * xhat
            db += dh
            if Y_BIAS:
                dyb += dy.to(tl.float32)  # the values c_proj's matmuls read: its bias gradient sums them
    # Parts (2 or 3, programs, C): this program's rows of dw, db (and dyb), summed over the programs by the caller
    tl.store(Parts + tl.program_id(0) * C + cols, dw, mask=inside)
    tl.store(Parts + (tl.num_programs(0) + tl.program_id(0)) * C + cols, db, mask=inside)
    if Y_BIAS:
        tl.store(Parts + (2 * tl.num_programs(0) + tl.program_id(0)) * C + cols, dyb, mask=inside)


class AddLayerNorm(torch.autograd.Function):
    """(r, h) = (x + y + y_bias, layer_norm(r, w, b) in out_dtype) for x, y (N, C), y_bias (C,) or None, with the
    two kernels above."""

    @staticmethod
    def forward(ctx, x, y, y_bias, weight, bias, eps, out_dtype):
        x, y = x.contiguous(), y.contiguous()  # rows of C values, one after the other
        N, C = x.shape
        r, h = torch.empty_like(x), torch.empty(N, C, device=x.device, dtype=out_dtype)
        mean = torch.empty(N, device=x.device, dtype=torch.float32)
        rstd = torch.empty(N, device=x.device, dtype=torch.float32)
        rows, warps = ADD_LN_FWD_TILE
        has_bias = y_bias is not None  # without one, the kernel is given LN's bias as YB and never reads it
        _add_layer_norm_fwd[((N + rows - 1) // rows,)](x, y, y_bias if has_bias else bias, weight, bias, r, h, mean,
                                                       rstd, N, C, eps, BLOCK=triton.next_power_of_2(C), ROWS=rows,
                                                       Y_BIAS=has_bias, num_warps=warps)
        ctx.save_for_backward(r, weight, mean, rstd)  # r is the next add's x as well: saved once
        ctx.y_dtype, ctx.has_bias = y.dtype, has_bias
        return r, h

    @staticmethod
    def backward(ctx, dr_in, dh):
        r, weight, mean, rstd = ctx.saved_tensors
        N, C = r.shape
        rows, warps = ADD_LN_BWD_TILE
        rows = backward_rows(N, rows)
        grid = ((N + rows - 1) // rows,)  # (triton.cdiv costs microseconds a call on the host in newer Triton)
        dr, dy = torch.empty_like(r), torch.empty(N, C, device=r.device, dtype=ctx.y_dtype)
        n_sums = 3 if ctx.has_bias else 2  # dw, db (and y's bias gradient)
        parts = torch.empty(n_sums, grid[0], C, device=r.device, dtype=torch.float32)  # (which sum, programs, C)
        _add_layer_norm_bwd[grid](dh.contiguous(), dr_in.contiguous(), r, weight, mean, rstd, dr, dy, parts, N, C,
                                  BLOCK=triton.next_power_of_2(C), ROWS=rows, Y_BIAS=ctx.has_bias, num_warps=warps)
        sums = parts.sum(1).to(weight.dtype)  # one reduction for all of them
        dy_bias = None
        if ctx.has_bias:
            dy_bias = sums[2]
        return dr, dy, dy_bias, sums[0], sums[1], None, None


def add_layer_norm(x, y, norm, out_dtype, y_bias=None):
    """(r, norm(r) in out_dtype), r = x + y (+ y_bias), for x, y (N, C): the kernels on a GPU, PyTorch's ops
    elsewhere."""
    if x.is_cuda:
        return AddLayerNorm.apply(x, y, y_bias, norm.weight, norm.bias, norm.eps, out_dtype)
    if y_bias is not None:
        y = y + y_bias.to(y.dtype)  # as nn.Linear adds it, in the matmul's dtype
    r = x + y
    return r, norm(r).to(out_dtype)


# c_fc's bias and GELU: forward, g = gelu(h0 + b) in PyTorch's ops (Inductor fuses them into one kernel); backward,
# one kernel reads GELU's output gradient and h0, writes h0's gradient dh = dg * gelu'(h0 + b) and per-program
# column sums of dh, the bias gradient, instead of a second read of dh (100 MB a layer in gpt2's step) for it.
# (rows, columns, warps) a program, as first written; searched on an H200 over 4-64 rows, 256-2048 columns and 2-8
# warps: at 16,384 rows none is faster by more than 0.2 us of its 98; below that backward_rows halves its rows.
BIAS_GELU_TILE = (32, 1024, 4)

# GPT-2's GELU's derivative in Triton, for this kernel's backward
GELU_K = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi): GPT-2's tanh GELU is x * sigmoid(2u)


@triton.jit
def _sigmoid_2u(x):  # sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): GELU is 0.5 x (1 + tanh(u)) = x sigmoid(2u)
    two_u = (x + 0.044715 * x * x * x) * GELU_K  # (a constexpr on the left of a tensor breaks the interpreter)
    return 1.0 / (1.0 + tl.exp(-two_u))


@triton.jit
def _gelu_grad(x):  # d/dx of x sigmoid(2u): sigmoid(2u) + x sigmoid(2u) (1 - sigmoid(2u)) 2u'
    s = _sigmoid_2u(x)
    return s + x * s * (1.0 - s) * GELU_K * (1.0 + 3 * 0.044715 * x * x)


@triton.jit
def _bias_gelu_bwd(DG, H0, B, DH, Parts, n_rows, F, ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    # dh = dg * gelu'(h0 + b) for ROWS rows and BLOCK_F columns; db += dh over those rows
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    inside = cols < F
    b = tl.load(B + cols, mask=inside, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK_F], tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < n_rows:
            at = row.to(tl.int64) * F + cols
            h = tl.load(H0 + at, mask=inside, other=0.0).to(tl.float32) + b
            dh = (tl.load(DG + at, mask=inside, other=0.0).to(tl.float32) * _gelu_grad(h)).to(DH.dtype.element_ty)
            tl.store(DH + at, dh, mask=inside)
            db += dh.to(tl.float32)  # the values c_fc's matmuls read: its bias gradient sums them
    tl.store(Parts + tl.program_id(0) * F + cols, db, mask=inside)  # (programs, F), summed by the caller


class BiasGelu(torch.autograd.Function):
    """gelu(h0 + b) for h0 (N, F), b (F,), GPT-2's tanh GELU in fp32, out in h0's dtype; backward: the kernel above."""

    @staticmethod
    def forward(ctx, h0, b):
        ctx.save_for_backward(h0, b)
        g = F.gelu(h0.float() + b, approximate="tanh")
        if g.dtype != h0.dtype:  # no .to() in fp32: torch.compile (2.11) handed backward a zero dg for an output
            g = g.to(h0.dtype)  # that .to() returned as it was, and c_fc's gradients came out 0
        return g

    @staticmethod
    def backward(ctx, dg):
        h0, b = ctx.saved_tensors
        N, width = h0.shape
        rows, cols, warps = BIAS_GELU_TILE
        rows = backward_rows(N, rows)
        grid = ((N + rows - 1) // rows, (width + cols - 1) // cols)
        dh = torch.empty_like(h0)
        parts = torch.empty(grid[0], width, device=h0.device, dtype=torch.float32)
        _bias_gelu_bwd[grid](dg.contiguous(), h0, b, dh, parts, N, width, ROWS=rows, BLOCK_F=cols, num_warps=warps)
        return dh, parts.sum(0).to(b.dtype)


def bias_gelu(h0, b):
    """gelu(h0 + b) for h0 (..., F): BiasGelu on a GPU, PyTorch's ops elsewhere (as nn.Linear adds b, then GELU)."""
    if h0.is_cuda:
        return BiasGelu.apply(h0.reshape(-1, h0.shape[-1]), b).view(h0.shape)
    return F.gelu(h0 + b.to(h0.dtype), approximate="tanh")


# --- 6. AdamW's kernel for the matrices: gpt2's optimizer step on an H100 1.27 ms, against 1.53 with torch's fused
# AdamW for every parameter (its multi-tensor launches reach 2.3 TB/s, these 2.7). No train.py flag turns it off:
# configure_optimizer(..., matrix_kernel=False) does (bench_e2e.py's ladder times both).

@triton.jit
def _adamw(param_ptr, grad_ptr, m_ptr, v_ptr, low_ptr, scale_ptr, step_ptr, n, lr, weight_decay, beta1, beta2, eps,
           SCALED: tl.constexpr, LOW: tl.constexpr, LR_ON_GPU: tl.constexpr, BLOCK: tl.constexpr):
    # One AdamW step of BLOCK elements of an fp32 parameter, in torch's fused AdamW's arithmetic and order: read
    # the parameter, its gradient and the moments m and v, write the three back (28 bytes a parameter). LOW: the
    # gradient is bf16 and the new parameter is also written in bf16 (MasterWeights' weight copy).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    step = tl.load(step_ptr)  # this step's number, kept on the GPU as torch's fused AdamW keeps it: no host sync
    if LR_ON_GPU:  # lr is a one-element tensor: a CUDA graph of the step reads each step's learning rate from it
        lr = tl.load(lr)
    step_size = lr / (1.0 - tl.exp2(step * tl.log2(beta1)))  # lr / (1 - beta1^step)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    p = tl.load(param_ptr + offs, mask=inside)
    g = tl.load(grad_ptr + offs, mask=inside).to(tl.float32)
    if SCALED:  # clip_gradients' divisor, read on the GPU (as torch's fused AdamW reads it)
        g = g / tl.load(scale_ptr)
    m = tl.load(m_ptr + offs, mask=inside)
    v = tl.load(v_ptr + offs, mask=inside)
    p = p * (1.0 - lr * weight_decay)  # decoupled weight decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) / bias2_sqrt + eps))
    tl.store(param_ptr + offs, p, mask=inside)
    tl.store(m_ptr + offs, m, mask=inside)
    tl.store(v_ptr + offs, v, mask=inside)
    if LOW:
        tl.store(low_ptr + offs, p.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=inside)  # as autocast rounds


ADAMW_BLOCK, ADAMW_WARPS = 1024, 4  # gpt2's 50 matrices on an H100: 1.27 ms a step with 1,024 and 4 or 2,048 and 8,
# 1.37 with 2,048 and 4 or 4,096 and 8 (the vectors in torch's fused launch included; torch's fused for all 1.53)


def adamw_step(param, grad, m, v, step, lr, weight_decay, beta1, beta2, eps, grad_scale=None, low=None):
    """One AdamW step of an fp32 parameter and its moments m, v; step: a one-element float tensor, this step's
    number (already counted); grad divided by grad_scale (a one-element tensor) if given; low: a bf16 tensor that
    receives the new parameter (then grad may be bf16). The kernel on a GPU; on a CPU the same arithmetic in
    PyTorch (torch's AdamW, op for op)."""
    if param.is_cuda:
        n = param.numel()
        scale = param if grad_scale is None else grad_scale  # (param stands in, unread, when nothing scales)
        _adamw[(triton.cdiv(n, ADAMW_BLOCK),)](param, grad, m, v, param if low is None else low, scale, step, n, lr,
                                               weight_decay, beta1, beta2, eps, SCALED=grad_scale is not None,
                                               LOW=low is not None, LR_ON_GPU=torch.is_tensor(lr), BLOCK=ADAMW_BLOCK,
                                               num_warps=ADAMW_WARPS)
        return
    g = grad.float()
    if grad_scale is not None:
        g = g / grad_scale
    param.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias2_sqrt = math.sqrt(1 - beta2 ** float(step))
    param.addcdiv_(m, (v.sqrt() / bias2_sqrt).add_(eps), value=-lr / (1 - beta1 ** float(step)))
    if low is not None:
        low.copy_(param)


class AdamW(torch.optim.AdamW):
    """torch's AdamW, whose step gives each CUDA matrix (wte, wpe and the blocks' Linear weights: all but 0.1% of
    gpt2's parameters) to _adamw, one launch a matrix, and the rest to torch's own step. torch's fused AdamW runs
    every parameter through a few multi-tensor launches of a few hundred blocks each, at 2.3 TB/s on an H100 for
    gpt2; the matrices' launches here, thousands of blocks each, reach 2.7 (bench_e2e.py's ladder). The state is
    torch's (step, exp_avg, exp_avg_sq, the step on the GPU as fused keeps it): checkpoints load either way. Unlike
    torch's fused AdamW the kernel does not write the gradients back divided by grad_scale (4 bytes a parameter
    fewer); train_step drops them next anyway. Torch's step takes everything on a CPU, FSDP's sharded (DTensor)
    parameters, and fp16's skipped steps."""

    def ours(self, group, p):
        """Whether _adamw steps p: an fp32 CUDA matrix with a contiguous fp32 gradient, not a DTensor, neither amsgrad
        nor maximize, and no fp16 skipped-step check (GradScaler's found_inf). lr: a float, or a tensor on the GPU."""
        g = p.grad
        if g is None or type(g) is not torch.Tensor or not p.is_cuda or p.dim() < 2:
            return False
        if p.dtype != torch.float32 or g.dtype != torch.float32 or not (p.is_contiguous() and g.is_contiguous()):
            return False
        unusual = group["amsgrad"] or group["maximize"]
        return not unusual and getattr(self, "found_inf", None) is None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # torch's optimizer interface (distributed checkpoints call step(closure=None))
            with torch.enable_grad():
                loss = closure()
        mine = [(group, p) for group in self.param_groups for p in group["params"] if self.ours(group, p)]
        for _, p in mine:
            state = self.state[p]
            if not state:  # as torch's fused AdamW starts it
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if mine:
            torch._foreach_add_([self.state[p]["step"] for _, p in mine], 1)  # one launch counts them all
        for group, p in mine:
            state, (beta1, beta2) = self.state[p], group["betas"]
            adamw_step(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group["lr"],
                       group["weight_decay"], beta1, beta2, group["eps"], getattr(self, "grad_scale", None))
        grads = [p.grad for _, p in mine]
        for _, p in mine:  # torch's step passes over a parameter without a gradient: it does the rest
            p.grad = None
        try:
            super().step()
        finally:
            for (_, p), grad in zip(mine, grads):
                p.grad = grad
        return loss


# --- 7. bf16 weights kept by the optimizer, cast once a step: on an H100 (gpt2, B=16, CUDA graphs) a step 0.66 ms
# shorter than with autocast's casts. Off: train.py --no-master-weights (on by default with --bf16, one process or data
# parallel, with or without --grad-accum; not with --fsdp or --fp8).

class MasterWeights:
    """Weights cast once, where they change: an optimizer (step, zero_grad, param_groups) for a model whose
    blocks' matmul weights are bf16, with their fp32 masters and AdamW's moments kept here.

    Under bf16 autocast every forward casts each fp32 weight to bf16 again, and each backward casts its bf16
    gradient back: two small kernels per weight and step, 96 for gpt2's 48 block Linears. Here the model holds
    the bf16 copy itself (the forward casts nothing), and one kernel per weight (adamw_step's) reads the bf16
    gradient, steps the fp32 master and writes the new bf16 copy. The values are autocast's (the same
    round-to-nearest casts, made once per step instead of once per use); on a CPU training matches it bit for
    bit. The token embedding (tied to the output layer) and every vector stay fp32, as autocast keeps them,
    with gpt.AdamW. Gradients clip as with torch's fused AdamW (clip_gradients sets grad_scale). Checkpoints:
    full_state and load_full_state, in an autocast run's layout. Data parallel, average_gradients all-reduces the
    bf16 gradients in bf16. Under accumulation the micro-batches' bf16 gradients add up in fp32 and round to bf16
    once, as one batch's would (hold_gradients). On an H100 (gpt2, B=16, CUDA graphs, traced) a step
    takes 0.66 ms less than the same step with autocast's casts (bench_e2e.py's ladder, rungs 14 and 15)."""

    def __init__(self, model, lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8):
        self.names, self.low, self.masters, self.moments = [], [], [], []
        for name, module in model.named_modules():
            if type(module) is not nn.Linear or not name.startswith("h."):  # the blocks' Linears
                continue
            master = module.weight.detach()
            module.weight = nn.Parameter(master.to(torch.bfloat16))  # what the forward reads
            self.names.append(name + ".weight")
            self.masters.append(master)
            self.low.append(module.weight)
            self.moments.append((torch.zeros_like(master), torch.zeros_like(master)))  # AdamW's m and v
        self.own = [p for p in model.parameters() if p.dtype == torch.float32]  # their own masters
        self.optimizer = adamw(self.own, lr, weight_decay, betas)
        self.matrices = {"params": self.low, "lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}
        self.defaults = self.optimizer.defaults
        self.step_count = torch.zeros((), device=self.masters[0].device)  # the matrices' step number
        self.grad_scale = None  # clip_gradients' divisor on a GPU (a fused AdamW's attribute), passed on by step
        self.sums = None  # under accumulation, between micro-batches: the bf16 gradients' fp32 sum (hold_gradients)

    @property
    def param_groups(self):  # train_step sets each group's lr; loading a state replaces the optimizer's groups
        return [self.matrices, *self.optimizer.param_groups]

    @property
    def state(self):
        return self.optimizer.state

    @torch.no_grad()
    def step(self):
        self.optimizer.grad_scale = self.grad_scale  # torch's fused AdamW reads it there
        self.step_count += 1
        group = self.matrices
        beta1, beta2 = group["betas"]
        for master, low, (m, v) in zip(self.masters, self.low, self.moments):
            if low.grad is not None:
                adamw_step(master, low.grad, m, v, self.step_count, group["lr"], group["weight_decay"], beta1, beta2,
                           group["eps"], self.grad_scale, low=low)
        self.optimizer.step()

    def zero_grad(self, set_to_none=True):
        for p in self.low + self.own:
            p.grad = None

    @torch.no_grad()
    def hold_gradients(self, last):
        """Accumulation in fp32 for the bf16 weights (train_step calls it after each micro-batch's backward, from
        three micro-batches on). Left to autograd, each micro-batch's bf16 gradient would be added into a bf16 sum,
        rounding once per micro-batch. Here the sum so far is kept in fp32 and the weights' gradients cleared;
        after the last micro-batch its gradient and the fp32 sum are added and rounded to bf16 once. Two
        micro-batches need none of it: autograd's one bf16 add of two bf16 gradients rounds once already."""
        if last:
            for p, total in zip(self.low, self.sums):
                p.grad.add_(total)  # computed in fp32, rounded to bf16 once
            self.sums = None
            return
        grads = [p.grad for p in self.low]
        if self.sums is None:
            self.sums = [g.float() for g in grads]
        else:
            torch._foreach_add_(self.sums, grads)
        for p in self.low:
            p.grad = None  # the next backward writes a fresh bf16 gradient

    def full_state(self, model):
        """(model state, optimizer state) as an autocast run's checkpoint holds them (full state dicts by parameter
        name, on the CPU): each master in its bf16 weight's place, its moments and step beside the other weights'.
        A checkpoint resumes with MasterWeights or without, on one GPU or several."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optimizer_state = get_optimizer_state_dict(model, self.optimizer, options=options)
        for name, master, (m, v) in zip(self.names, self.masters, self.moments):
            model_state[name] = master.cpu()
            step = self.step_count.detach().cpu().clone()  # a tensor of its own, as torch's AdamW keeps it
            optimizer_state["state"][name] = {"step": step, "exp_avg": m.cpu(), "exp_avg_sq": v.cpu()}
        decayed = optimizer_state["param_groups"][0]  # adamw's first group: the matrices, in the model's order
        order = [name for name, p in model.named_parameters() if p.dim() >= 2]
        decayed["params"] = [name for name in order if name in decayed["params"] or name in self.names]
        return model_state, optimizer_state

    @torch.no_grad()
    def load_full_state(self, model, model_state, optimizer_state):
        """full_state's inverse: masters, their bf16 weights (rounded as autocast rounds), moments and step, and the
        other parameters with their own AdamW's state."""
        for name, master, low, (m, v) in zip(self.names, self.masters, self.low, self.moments):
            master.copy_(model_state[name])
            low.copy_(master)
            m.copy_(optimizer_state["state"][name]["exp_avg"])
            v.copy_(optimizer_state["state"][name]["exp_avg_sq"])
        self.step_count.copy_(optimizer_state["state"][self.names[0]]["step"])  # one count for all the masters
        options = StateDictOptions(full_state_dict=True, strict=False)  # the bf16 weights are set above
        set_model_state_dict(model, {k: t for k, t in model_state.items() if k not in self.names}, options=options)
        state = {k: t for k, t in optimizer_state["state"].items() if k not in self.names}
        groups = [{**g, "params": [k for k in g["params"] if k not in self.names]}
                  for g in optimizer_state["param_groups"]]
        set_optimizer_state_dict(model, self.optimizer, {"state": state, "param_groups": groups}, options=options)


# --- 8. cuBLAS without a workspace: no memset before each matmul, about 0.4 ms a CUDA-graphed step of gpt2 on an
# H100. Off: train.py --cublas-workspace (PyTorch's default). With a workspace, cuBLAS's Hopper matmul kernels hand
# out their output tiles from a counter kept in it, and cuBLAS zeroes that counter with a memset before every such
# matmul: gpt2's step has 102 of them, and in a CUDA-graphed step each memset and the gaps on either side of it cost
# about 4 us. Without a workspace cuBLAS picks the same kernels with their tiles scheduled statically: no memsets, no
# slower matmuls at gpt2's shapes (bench_e2e.py's ladder). PyTorch reads these two variables at every cuBLAS call
# (torch 2.11), so a process can switch between variants; a CUDA graph keeps the kernels it captured.
CUBLAS_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")
CUBLAS_ENV_AT_START = {name: os.environ.get(name) for name in CUBLAS_ENV}  # what enabled=True restores


def set_cublas_workspace(enabled):
    """cuBLAS with the workspace this process started with (True) or with none (False): ':0:0' is no blocks of no
    KiB, and cuBLASLt's (bias epilogues) is sized to match, so PyTorch does not warn that it exceeds cuBLAS's."""
    before = [os.environ.get(name) for name in CUBLAS_ENV]
    for name in CUBLAS_ENV:
        os.environ.pop(name, None)
        if enabled and CUBLAS_ENV_AT_START[name] is not None:
            os.environ[name] = CUBLAS_ENV_AT_START[name]
    if not enabled:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":0:0"
        os.environ["CUBLASLT_WORKSPACE_SIZE"] = "0"
    if torch.cuda.is_initialized() and [os.environ.get(name) for name in CUBLAS_ENV] != before:
        # PyTorch allocates a stream's workspace at its first cuBLAS call and hands that buffer to every later call
        # with the size the variables give then: after a change it must be allocated afresh, or cuBLAS would be told
        # of a workspace larger than the buffer (a failed matmul). CUDA graphs capture their own (cudagraph trees
        # clear these the same way around each capture).
        torch._C._cuda_clearCublasWorkspaces()


# --- 9. FP8 matmuls (H100/H200), twice the bf16 rate: e4m3 activations and weights, e5m2 gradients, amax scales.
# Not on by default: train.py --fp8 turns it on, in the block Linears FP8_MIN_WIDTH wide and up (precision.py times
# it against bf16).

E4M3 = torch.float8_e4m3fn  # 3 mantissa bits, max 448: activations and weights
E5M2 = torch.float8_e5m2  # 2 mantissa bits, max 57344: gradients, whose range is wider


def to_fp8(t, dtype):
    """(t scaled so its largest magnitude lands at dtype's max and cast, the inverse scale to undo it)."""
    amax = t.detach().abs().amax().float().clamp(min=1e-12)
    fp8_max = torch.finfo(dtype).max
    scale = fp8_max / amax
    scaled = (t.float() * scale).clamp(-fp8_max, fp8_max)
    return scaled.to(dtype), scale.reciprocal()


def fp8_mm(a8, a_inv, b8, b_inv):
    """a (M, K) row-major times b (K, N) column-major (what the FP8 tensor cores take), bf16 out."""
    return torch._scaled_mm(a8, b8, scale_a=a_inv, scale_b=b_inv, out_dtype=torch.bfloat16)


class Fp8Matmul(torch.autograd.Function):
    """y = x W^T with all three matmuls of a Linear (forward, dX, dW) in FP8."""
    @staticmethod
    def forward(ctx, x, weight):
        x8, x_inv = to_fp8(x, E4M3)
        w8, w_inv = to_fp8(weight, E4M3)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        return fp8_mm(x8, x_inv, w8.t(), w_inv)

    @staticmethod
    def backward(ctx, dy):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        dy8, dy_inv = to_fp8(dy, E5M2)
        dx = fp8_mm(dy8, dy_inv, w8.t().contiguous().t(), w_inv)  # the second operand column-major
        dw = fp8_mm(dy8.t().contiguous(), dy_inv, x8.t().contiguous().t(), x_inv)
        return dx, dw.float()


class Fp8Linear(nn.Linear):
    """nn.Linear whose matmuls run in FP8; weight and bias stay fp32 (the optimizer's copy)."""
    def matmul(self, x):  # x W^T without the bias
        y = Fp8Matmul.apply(x.flatten(0, -2), self.weight)  # (tokens, out): the batch dims flattened
        return y.unflatten(0, x.shape[:-1])  # back to (..., out)

    def forward(self, x):
        y = self.matmul(x)
        if self.bias is None:
            return y
        return y + self.bias.to(y.dtype)


# FP8 for a block's Linears both ways >= FP8_MIN_WIDTH: narrower ones don't repay the scaling; lm_head: fused loss
FP8_LAYERS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
FP8_MIN_WIDTH = 2048


def fp8_supported(device):
    """FP8 tensor cores: compute capability 8.9 (Ada) and up, H100 and H200 included."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def use_fp8(model, min_width=FP8_MIN_WIDTH):
    """Turns the FP8_LAYERS at least min_width wide both ways into Fp8Linear: [(name, in, out, converted)]."""
    plan = []
    for name, m in model.named_modules():
        if type(m) is nn.Linear and name.endswith(FP8_LAYERS):
            chosen = min(m.in_features, m.out_features) >= min_width
            if chosen:
                m.__class__ = Fp8Linear
            plan.append((name, m.in_features, m.out_features, chosen))
    return plan


# ====================================================================================================================
# Part 3: the shared tools: optimizer, training step, CUDA graph, FSDP2, FLOPs and MFU, tokenizer, timer, helpers
# ====================================================================================================================

# --- 10. the optimizer, compilation, sharding and one training step

def configure_optimizer(model, lr, weight_decay=0.1, betas=(0.9, 0.95), matrix_kernel=True):
    """The model's AdamW (adamw below), over every parameter that trains."""
    return adamw([p for p in model.parameters() if p.requires_grad], lr, weight_decay, betas, matrix_kernel)


def adamw(params, lr, weight_decay=0.1, betas=(0.9, 0.95), matrix_kernel=True):
    """AdamW with weight decay on matrices and embeddings, not on biases or LayerNorm gains; fused on a GPU (a few
    kernels for all the parameters instead of a dozen per parameter), the matrices through _adamw below unless
    matrix_kernel is False (torch's fused AdamW for all)."""
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = AdamW if matrix_kernel else torch.optim.AdamW
    return optimizer(groups, lr=lr, betas=betas, fused=all(p.is_cuda for p in params))


def compile_model(model):
    """torch.compile with PDL: a kernel's prologue starts while the one before it finishes. Inductor's own CUDA
    graphs stay off: GraphedStep captures the whole step, micro-batches and optimizer included."""
    return torch.compile(model, options={"triton.cudagraphs": False, "triton.enable_pdl": True})


def fully_shard_gpt(model, param_dtype=None, blocks=None, cast_inputs=True):
    """FSDP2 per block, then the whole model: one block's all-gather overlaps the block before it's compute.
    blocks: the modules sharded one by one (default model.h, GPT's blocks). cast_inputs=False passes each block's
    floating inputs on as they are, not cast to param_dtype (fp32 tables shared by every block stay fp32)."""
    from torch.distributed import get_world_size
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(next(model.parameters()).device.type, (get_world_size(),))  # not FSDP2's default CUDA
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=cast_inputs)
    if blocks is None:
        blocks = model.h
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def clip_gradients(model, optimizer, max_norm):
    """The gradients' global norm; above max_norm they are scaled down to it (max_norm 0: never)."""
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if len({g.dtype for g in grads}) == 1:
        norm = torch.nn.utils.get_total_norm(grads)
    else:  # MasterWeights' bf16 gradients beside fp32 ones: get_total_norm would round the bf16 ones' norms to bf16
        # and stack the mixed dtypes with a copy per gradient (0.2 ms a step for gpt2 on an H100): a multi-tensor
        # norm per dtype, in fp32
        by_dtype = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        norms = [n for group in by_dtype.values() for n in torch._foreach_norm(group, 2, dtype=torch.float32)]
        norm = torch.linalg.vector_norm(torch.stack(norms))
    if hasattr(norm, "full_tensor"):  # FSDP: a DTensor of this rank's part; the whole norm is needed
        norm = norm.full_tensor()
    if max_norm and optimizer.defaults["fused"]:
        # a fused AdamW divides each gradient by grad_scale as it reads it: no separate pass over the gradients
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)  # the scale clip_grad_norm_ uses
    elif max_norm:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)  # takes the parameters, not grads
    return norm

def no_mark(phase):
    """train_step's mark(phase) when none is given."""
    return None


def train_step(model, optimizer, x, y, dtype=None, scaler=None, grad_clip=0.0, mark=None, *, lr=None, reduce=None,
               return_norm=False):
    """One optimizer step; the loss comes back as a GPU tensor, nothing waits. x, y: a batch, or lists of
    micro-batches whose gradients add up (each loss divided by their number: the step sees their mean). Keywords:
    lr set on every parameter group first (a schedule's value); reduce(): called once after the last micro-batch's
    backward, before the clip (average_gradients: the mean over the ranks); return_norm: (loss, global grad norm),
    the norm also without clipping. mark(phase) after each phase; NVTX ranges (forward, backward, optimizer step)
    if gpt.NVTX."""
    mark = mark or no_mark
    batches = list(zip(x, y)) if isinstance(x, (list, tuple)) else [(x, y)]
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    total = None
    hold = isinstance(optimizer, MasterWeights) and len(batches) > 2  # bf16 gradients summed in fp32
    for i, (xb, yb) in enumerate(batches):
        with nvtx_range("forward"), autocast(xb.device, dtype):
            _, loss = model(xb, yb)
        mark("forward")
        if len(batches) > 1:  # the step's gradient: the mean of the micro-batches'
            loss = loss / len(batches)
        with nvtx_range("backward"):
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()  # fp16: scale so small gradients survive
            if hold:
                optimizer.hold_gradients(last=i == len(batches) - 1)
        mark("backward")
        total = loss.detach() if total is None else total + loss.detach()
    if reduce is not None:
        with nvtx_range("all-reduce"):
            reduce()
        mark("all-reduce")
    with nvtx_range("optimizer step"):
        if scaler is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        norm = clip_gradients(model, optimizer, grad_clip) if grad_clip or return_norm else None
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
    mark("optimizer")
    if return_norm:
        return total, norm
    return total


def start_process_group(device):
    """torchrun's ranks join one process group: gloo between CPU processes, NCCL between GPUs (each rank bound to
    its own GPU first, so NCCL and every allocation use it)."""
    import torch.distributed as dist
    if device.type != "cuda":
        dist.init_process_group("gloo")
        return
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)


def average_gradients(params, world):
    """Data parallelism's one promise, kept after the last backward: every rank holds the mean of all the ranks'
    gradients. Copied into one flat buffer per dtype for one all-reduce each: one per gradient (~150 for gpt2) would
    each pay the collective's fixed latency. Each dtype is summed in itself: fp32 gradients in fp32, MasterWeights'
    bf16 ones in bf16, half the bytes on the wire (what torch's DDP does with bf16 weights). NCCL averages as it
    reduces (ReduceOp.AVG, each input scaled by 1/world: exact for two ranks, as halving is); gloo has no average,
    so its sum is divided after. The gradients then become views of the reduced buffer, not copies back out of it:
    the divide and the copy were ~1.3% of a two-GPU gpt2 step on H200s (33.0 against 33.4 ms a step, paired twice).
    Inside a CUDA graph (GraphedStep) it costs no host time; torch's DDP overlaps the same all-reduce with the
    backward instead, from hooks that a graph of the compiled step cannot hold."""
    import torch.distributed as dist
    with_grad = [p for p in params if p.grad is not None]
    for dtype in dict.fromkeys(p.grad.dtype for p in with_grad):  # in the order met: the same on every rank
        same = [p for p in with_grad if p.grad.dtype == dtype]
        flat = torch.cat([p.grad.flatten() for p in same])  # (their elements,)
        if dist.get_backend() == "nccl":
            dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        else:
            dist.all_reduce(flat)  # the sum over the ranks
            flat /= world
        for p, part in zip(same, flat.split([p.numel() for p in same])):
            p.grad = part.view_as(p)  # the old gradient is freed; the optimizer reads the averaged one in place


# --- 11. the step as one CUDA graph, on a GPU with --compile (train.py --no-cuda-graph launches it from Python)

class GraphedStep:
    """train_step captured once in a CUDA graph and replayed every step: all its micro-batches' forwards and
    backwards, the all-reduce, the clip and AdamW are queued by one call, graph.replay(), where otherwise the host
    launches each of their kernels from Python. A compiled gpt2 step without a graph is host-bound: on an H200,
    two micro-batches of 8 took 53.5 ms where one of 16 took 31 ms with CUDA graphs; as one graph, 32.2-32.3 ms.

    A replay runs the captured kernels on the captured addresses, so everything a step reads must stay in place:
    the batch is copied into buffers the graph reads; the learning rate is a GPU tensor that AdamW's kernels read
    (a float would be baked in); the loss and the grad norm come back in tensors the graph writes; nothing inside
    may wait for the host (no .item(), no fp16 GradScaler, whose step checks for infs on the host). The capture
    follows a few warm-up steps (torch.compile's compilation, cuBLAS's and NCCL's setup, the optimizer's state),
    which are then undone: the weights and the optimizer's state are put back, so training starts where it was."""

    def __init__(self, model, optimizer, xs, ys, dtype, grad_clip, reduce=None, warmup=3):
        self.model, self.optimizer = model, optimizer
        self.xs = [x.clone() for x in xs]  # the graph's inputs: each step's batch is copied in here
        self.ys = [y.clone() for y in ys]
        self.lr = torch.zeros((), device=xs[0].device)
        groups = optimizer.param_groups
        plain = [(group["lr"], group.get("capturable")) for group in groups]
        for group in groups:  # torch's fused AdamW reads a tensor lr on the GPU, and asks for capturable to capture
            group["lr"], group["capturable"] = self.lr, True
        saved = {id(t): t.detach().clone() for t in step_state(model, optimizer)}  # what the warm-up will change
        self.lr.fill_(float(plain[0][0]))
        step = partial(train_step, model, optimizer, self.xs, self.ys, dtype, grad_clip=grad_clip, reduce=reduce,
                       return_norm=True)
        side = torch.cuda.Stream()  # warm-up off the default stream, as capture needs (torch.cuda.graphs' notes)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss, self.norm = step()
        with torch.no_grad():  # the warm-up steps undone; state made by them (AdamW's moments) back to its zeros
            for t in step_state(model, optimizer):
                if id(t) in saved:
                    t.copy_(saved[id(t)])
                else:
                    t.zero_()
        for group, (lr, capturable) in zip(groups, plain):  # floats again for checkpoints; the graph keeps self.lr
            group["lr"] = lr
            if capturable is None:
                group.pop("capturable")
            else:
                group["capturable"] = capturable

    def __call__(self, xs, ys, lr):
        """(loss, grad norm) of one step on micro-batches xs, ys at learning rate lr, as train_step returns them."""
        for buffer, x in zip(self.xs + self.ys, xs + ys):
            buffer.copy_(x, non_blocking=True)
        self.lr.fill_(lr)
        for group in self.optimizer.param_groups:  # what the optimizer reports (checkpoints, logs)
            group["lr"] = lr
        self.graph.replay()
        return self.loss, self.norm


def step_state(model, optimizer):
    """Every tensor an optimizer step writes: the weights and buffers, the optimizer's state (MasterWeights: its
    fp32 masters, moments and step count too)."""
    tensors = list(model.parameters()) + list(model.buffers())
    inner = optimizer
    if isinstance(optimizer, MasterWeights):
        inner = optimizer.optimizer
        tensors += optimizer.masters + [t for pair in optimizer.moments for t in pair] + [optimizer.step_count]
    tensors += [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
    return tensors


# --- 12. FLOPs and MFU

def flops_per_token(config, seq_len):
    """Training FLOPs per token: 6 per matmul parameter (2 forward, 4 backward) plus attention's QK^T and PV,
    12 L d T, not halved for the causal mask, as PaLM counts."""
    d, L = config.n_embd, config.n_layer
    matmul_params = L * (4 * d * d + 2 * d * config.d_ff) + config.vocab_size * d
    return 6 * matmul_params + 12 * L * d * seq_len


GPU_PEAK_FLOPS = (  # dense bf16 FLOP/s; the first key found in the GPU's name wins ("H100" alone: the SXM part)
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


def gpu_peak_flops(device):
    """The detected GPU's dense bf16 peak in FLOP/s, or None for a CPU or a GPU not in the table."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in GPU_PEAK_FLOPS:
        if key in name:
            return peak
    return None


def mfu(flops_per_s, device):
    """Model FLOPs utilization against the bf16 peak, for fp32 and FP8 runs too, as is customary; None, never a
    guess, where the peak is unknown."""
    peak = gpu_peak_flops(device)
    if peak is None:
        return None
    return flops_per_s / peak


def fmt_mfu(value):
    if value is None:
        return "n/a"
    return f"{100 * value:.1f}%"


def step_bytes(config, B, T, bf16):
    """A train step's peak memory, roughly, for the host-memory check: 16 bytes a parameter (weights, gradients, two
    AdamW moments), ~(34 d + 5 H T) bytes a token a layer of activations in 16-bit (Korthikanti et al. 2022; twice
    that in fp32), and fp32 logits (with the fused loss: one chunk of rows, and no gradient copy)."""
    with torch.device("meta"):
        params = GPT(config).num_params()
    bytes_per_value = 1 if bf16 else 2  # the 34 d + 5 H T is already counted in 16-bit bytes
    activations = config.n_layer * B * T * (34 * config.n_embd + 5 * config.n_head * T) * bytes_per_value
    logit_rows = 2 * B * T  # the logits and their gradient
    if config.fused_ce:
        logit_rows = min(B * T, CE_CHUNK_ROWS)
    return 16 * params + activations + logit_rows * config.vocab_size * 4


# --- 13. tokenizer and data

R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
BPE_DIR = os.path.join(HERE, "gpt2_bpe")
INPUT_TXT = os.path.join(HERE, "input.txt")


def gpt2_tokenizer(bpe_dir=BPE_DIR):
    """tiktoken's "gpt2" encoding built from the repository's BPE files: no download."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    vocab_bpe = os.path.join(bpe_dir, "vocab.bpe")
    encoder_json = os.path.join(bpe_dir, "encoder.json")
    for path in (vocab_bpe, encoder_json):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: the GPT-2 tokenizer's two files come with the repository "
                                    f"in gpt2_bpe/; copy that folder beside gpt.py")
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json)
    return tiktoken.Encoding(name="gpt2", pat_str=R50K_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": GPT2_VOCAB - 1}, explicit_n_vocab=GPT2_VOCAB)


def load_tokens(path=INPUT_TXT):
    """The text as a 1-D int64 tensor of GPT-2 tokens."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; it holds the training text (Tiny Shakespeare)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text (was a checkpoint or binary file written over it?)") from None
    return torch.tensor(gpt2_tokenizer().encode_ordinary(text), dtype=torch.long)


# --- 14. the one timer: variants in rounds (A B C, B C A, ...) as a shared GPU's speed drifts; ratios paired per round

def clock(device):
    """A time stamp. On a GPU, an event queued behind the work already queued: it fires when the GPU gets there,
    so the host never waits to take it."""
    if torch.device(device).type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed_ms(start, end):
    """Milliseconds between two clock() stamps; on a GPU this waits for the GPU to reach `end`."""
    if isinstance(end, float):
        return (end - start) * 1e3
    end.synchronize()
    return start.elapsed_time(end)


@dataclass
class Timing:
    """One variant's ms per step over the rounds, and the per-round ratios to the baseline."""
    median: float
    low: float
    high: float
    mean: float = None
    std: float = None  # sample standard deviation over the rounds (0 with one round)
    ratio: float = None
    ratio_low: float = None
    ratio_high: float = None
    peak: int = None  # max_memory_allocated during its warm-up, bytes (None on the CPU)

    def ms(self, digits=2):
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}-{self.high:.{digits}f})"

    def mean_std(self, digits=2):
        """Mean ± standard deviation, as the CS336 benchmarking script reports a timing."""
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"

    def vs(self):
        if self.ratio is None:
            return "-"
        return f"{self.ratio:.3f}x ({self.ratio_low:.3f}-{self.ratio_high:.3f})"


def time_rounds(variants, device, rounds=20, steps=3, warmup=2, sync=None, progress=None):
    """({name: [ms per step, a round each] or None (OOM)}, {name: peak bytes}) for {name: fn queueing a step}. The
    warm-up also compiles and captures CUDA graphs. One sync a round (ddp.py's: all ranks): the host queues ahead."""
    cuda = torch.device(device).type == "cuda"
    names, times, peaks = list(variants), {}, {}
    for i, name in enumerate(names):
        times[name] = None
        label = name
        if isinstance(name, tuple):  # bench_e2e's cells: (vocab, batch, seq, precision, compile mode, mode)
            label = " ".join(map(str, name))
        PROGRESS["timer"] = f"warming up variant {i + 1} of {len(names)} ({label})"
        try:
            if cuda:
                synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(warmup):
                variants[name]()
            synchronize(device)
            peaks[name] = torch.cuda.max_memory_allocated(device) if cuda else None
            times[name] = []
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
        if times[name] is None:
            free_memory()  # outside the except block, whose traceback still holds the tensors
    live = [n for n in names if times[n] is not None]
    PROGRESS["timer"] = f"timing: 0 of {rounds} rounds done"
    for r in range(rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        marks = []
        for name in order:
            start = clock(device)
            for _ in range(steps):
                variants[name]()
            marks.append((name, start, clock(device)))
        if sync is None:
            synchronize(device)
        else:
            sync()
        for name, start, end in marks:
            times[name].append(elapsed_ms(start, end) / steps)
        PROGRESS["timer"] = f"timing: {r + 1} of {rounds} rounds done"
        if progress:
            progress(r)
    PROGRESS["timer"] = ""  # done: what follows (a table, the next configuration) is no longer its rounds
    return times, peaks


def nothing_held():
    return 0


def lazily(make, device, held=nothing_held, note=None):
    """A variant made by make() at its first call, in the warm-up: an OOM marks it alone. state["others"]: bytes
    the others held then (max_memory_allocated covers the whole process)."""
    state = {}
    def variant():
        if "step" not in state:
            state["others"] = torch.cuda.memory_allocated(device) - held() if device.type == "cuda" else 0
            if note:
                print(note, file=sys.stderr, flush=True)
            state["step"] = make()
        try:
            state["step"]()
        except RuntimeError:  # out of memory: the timer gives up on this variant, let its model go
            state.pop("step")
            raise
    variant.state = state
    return variant


def summarize(times, baseline=None, peaks=None):
    """{name: Timing, or None for a variant that ran out of memory}; ratios to `baseline` paired per round."""
    out, base, peaks = {}, times.get(baseline), peaks or {}
    for name, ms in times.items():
        if ms is None:  # out of memory in its warm-up
            out[name] = None
            continue
        std = statistics.stdev(ms) if len(ms) > 1 else 0.0
        t = out[name] = Timing(statistics.median(ms), min(ms), max(ms), statistics.mean(ms), std, peak=peaks.get(name))
        if base:
            ratios = [a / b for a, b in zip(ms, base)]
            t.ratio, t.ratio_low, t.ratio_high = statistics.median(ratios), min(ratios), max(ratios)
    return out


def compare(variants, device, baseline=None, rounds=20, steps=3, warmup=2, progress=None):
    """time_rounds then summarize: {name: Timing or None}."""
    times, peaks = time_rounds(variants, device, rounds, steps, warmup, progress=progress)
    return summarize(times, baseline, peaks)

# --- 15. small helpers: flags, device, precision, memory, errors, paths, tables

# Flags: argparse `type=` helpers, the one way every script validates a number. A bad value is argparse's own error:
# one sentence naming the flag as the last line, exit status 2, no traceback.
def _number(text, kind):
    try:
        value = kind(text)
    except ValueError:
        what = "a number"
        if kind is int:
            what = "an integer"
        raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got '{text}'")
    return value


def _check_range(value, low, high):
    if low is not None and value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low:g}, got {value:g}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"must be at most {high:g}, got {value:g}")
    return value


def int_in(low=None, high=None):
    """type=int_in(1): an integer in [low, high] (either end open when None)."""
    def parse(text):
        return _check_range(_number(text, int), low, high)
    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def float_in(low=None, high=None):
    """type=float_in(0): a finite number in [low, high]."""
    def parse(text):
        return _check_range(_number(text, float), low, high)
    parse.__name__ = "number"
    return parse


def int_list(low=None, high=None):
    """type=int_list(1): a comma list of integers, each in [low, high], as a list ("1,2,4" -> [1, 2, 4])."""
    def parse(text):
        items = [item.strip() for item in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"expected a comma list of integers, got '{text}'")
        return [_check_range(_number(item, int), low, high) for item in items]
    parse.__name__ = "list of integers"
    return parse


def on_device(device, cpu, gpu):
    """The one rule for defaults: the headline's value on a CUDA GPU, a seconds-long one on a CPU."""
    if torch.device(device).type == "cuda":
        return gpu
    return cpu


def saved_tensor_bytes(fn, exclude=()):
    """Bytes autograd saves for backward while fn() runs: distinct storages, beyond those of `exclude` (the weights
    and the batch, alive anyway). Views share a storage (q, k, v of one qkv tensor; probabilities saved by softmax
    and again by the matmul after it) and count once."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen.setdefault((storage.data_ptr(), str(t.device)), storage.nbytes())
        return t

    def unpack(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        fn()
    return sum(seen.values())


def name_list(choices, what="name"):
    """type=name_list(CHOICES, "section"): a comma list of names, each one of choices, as a list ("a,b" -> [a, b])."""
    def parse(text):
        items = [item.strip() for item in text.split(",")]
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} '{unknown[0]}'; choose from {', '.join(choices)}")
        return items
    parse.__name__ = f"list of {what}s"
    return parse


NVTX = False  # --nvtx (train.py, bench_e2e.py): named ranges on Nsight Systems' timeline (CUDA builds only)
def nvtx_range(name):
    """A named NVTX range while gpt.NVTX is on (nsys profile --trace=cuda,nvtx shows it), else nothing. Not inside
    torch.compile's tracing: a range there would split the graph."""
    if NVTX and not torch.compiler.is_compiling():
        return torch.cuda.nvtx.range(name)
    return nullcontext()


def round_up(n, multiple):
    """The next multiple: round_up(50257, 128) == 50304."""
    return (n + multiple - 1) // multiple * multiple


def fail(message):
    """Bad input: one sentence and exit status 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def resolve_device(name=None):
    """cpu, cuda or cuda:N (default: a GPU if there is one) as an indexed torch.device, or a ValueError."""
    if not name:
        name = "cpu"
        if torch.cuda.is_available():
            name = "cuda"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device '{name}' is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name} is not supported here; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for but this machine has no CUDA GPU")
    if device.type == "cuda" and device.index is None:  # memory APIs want an indexed device
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s), numbered from 0")
    return device


def amp_dtype(bf16=False, fp16=False):
    """The autocast dtype of --bf16 / --fp16, or None for fp32."""
    if bf16 and fp16:
        raise ValueError("--bf16 and --fp16 are exclusive; pick one")
    if bf16:
        return torch.bfloat16
    if fp16:
        return torch.float16
    return None


def autocast(device, dtype):
    """torch.autocast to dtype, or nothing for dtype None (fp32)."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def set_tf32(enabled):
    """TF32 tensor cores for fp32 matmuls and convolutions. Torch warns if its two switches (fp32_precision, newer,
    and set_float32_matmul_precision) are mixed, so this uses the newer one where it exists, else the older."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        precision = "ieee"
        if enabled:
            precision = "tf32"
        matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision
    elif enabled:
        torch.set_float32_matmul_precision("high")
    else:
        torch.set_float32_matmul_precision("highest")


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def check_output_path(path, flag, ours=None):
    """A ValueError unless `path` can be written, checked before any work (a bad path should cost seconds, not a
    run). ours(path): whether an existing file is one this script wrote, so others are never overwritten."""
    if not path:
        raise ValueError(f"{flag} needs a file name")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory, not a file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable")
    if ours is not None and os.path.exists(path) and not ours(path):
        raise ValueError(f"{flag} {path} exists and is not a file this script wrote; refusing to overwrite it")
    probe = f"{path}.probe{os.getpid()}"  # permissions can pass where a write fails (/proc, a read-only mount)
    try:
        open(probe, "wb").close()
        os.remove(probe)
    except OSError as e:  # e.g. /proc/x.png: the folder exists, but no file can be created in it
        raise ValueError(f"{flag} {path} cannot be written there ({e.strerror or e}); "
                         "choose a file in a folder you can write to") from None


# What run_main says if interrupted: tables printed so far (print_table counts them), the script's stage (a sweep's
# "configuration 3 of 20") and the timer's round; the timer clears its note when done, so it never outlives its work.
PROGRESS = {"tables": 0, "stage": "", "timer": ""}


def interrupted_line(signal_name):
    """run_main's last line on Ctrl-C or SIGTERM: what was under way and how many tables are whole, from PROGRESS."""
    line = f"interrupted ({signal_name})"
    under_way = [part for part in (PROGRESS["stage"], PROGRESS["timer"]) if part]
    if under_way:
        line += f" while {', '.join(under_way)}"
    if PROGRESS["tables"] == 0:
        return f"{line}: no table was complete yet"
    return f"{line}: the {PROGRESS['tables']} table(s) above are complete, the rest did not finish"


def reader_left():
    """`python script.py | head`: the reader left; end quietly, as `cat` would (exit 141, no traceback)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit would raise again
    raise SystemExit(141) from None  # 128 + SIGPIPE, what a shell reports for a writer whose reader left


def run_main(main):
    """main() with Ctrl-C and SIGTERM as one line, exit 130 / 143, no traceback, saying what finished."""
    import signal

    def on_term(signum, frame):
        raise KeyboardInterrupt(signum)
    signal.signal(signal.SIGTERM, on_term)
    try:
        main()
    except BrokenPipeError:
        reader_left()
    except KeyboardInterrupt as e:
        signum = signal.SIGINT
        if e.args:
            signum = e.args[0]
        print("\n" + interrupted_line(signal.Signals(signum).name), file=sys.stderr)
        raise SystemExit(128 + signum) from None


def is_oom(error):
    """Whether an exception is out-of-memory: cuBLAS and some kernels raise a plain RuntimeError, and the CPU's
    allocator says "not enough memory"."""
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "not enough memory" in text


def free_memory():
    """Collect the reference cycles that keep tensors alive first, then return the allocator's free blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gib(nbytes):
    return f"{nbytes / 2**30:.2f}"


def available_host_bytes():
    """MemAvailable from /proc/meminfo (Linux), or None where there is no such file."""
    if not os.path.exists("/proc/meminfo"):
        return None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts in KiB
    return None


def check_host_memory(need, what, hint="lower --batch or --seq, or use a smaller --model"):
    """On the CPU: refuse what the OOM killer would end without a word (exit 137). hint: words, or a function of
    the free bytes returning words."""
    free = available_host_bytes()
    if free is None or need <= free:
        return
    if callable(hint):
        hint = hint(free)
    fail(f"{what} needs about {gib(need)} GiB of this machine's memory and {gib(free)} GiB are free; {hint}")


def print_table(headers, rows):
    """An aligned plain-text table: the first column left-aligned, the others right-aligned, a rule under the
    header."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        line = []
        for i, (cell, width) in enumerate(zip(row, widths)):
            if i == 0 or n == 0:
                line.append(cell.ljust(width))
            else:
                line.append(cell.rjust(width))
        print("  ".join(line).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    PROGRESS["tables"] += 1


def plot_path(text):
    """type=plot_path: a --plot file that can be written and whose extension names a format matplotlib writes, checked
    as the flags are read: a figure drawn last must not fail after the run (savefig reads the format from the name)."""
    try:
        check_output_path(text, "--plot")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--plot ")) from None  # argparse names the flag itself
    try:
        from matplotlib import rcParams
        from matplotlib.backend_bases import FigureCanvasBase
    except ModuleNotFoundError:
        raise argparse.ArgumentTypeError("needs matplotlib (pip install matplotlib)") from None
    extension = os.path.splitext(text)[1].removeprefix(".").lower()  # savefig lower-cases it too
    formats = set(FigureCanvasBase.get_supported_filetypes())  # this matplotlib's own list: png, pdf, svg, ...
    tex = rcParams["pgf.texsystem"]
    if shutil.which(tex) is None:  # matplotlib lays out a .pgf's text by running LaTeX
        formats.discard("pgf")
    if not extension:  # savefig would add .png and write a file other than the one named
        raise argparse.ArgumentTypeError(f"{text} has no extension; name the format, e.g. {text}.png")
    if extension == "pgf" and "pgf" not in formats:
        raise argparse.ArgumentTypeError(f"a .pgf figure needs {tex} (LaTeX), which is not installed; use .pdf or .svg")
    if extension not in formats:
        raise argparse.ArgumentTypeError(f"matplotlib cannot write .{extension} files; use one of "
                                         f"{', '.join(sorted(formats))}")
    return text


def plot_to(path):
    """pyplot for a --plot figure, after checking the path: matplotlib is imported only then."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    check_output_path(path, "--plot")
    return plt


def main(argv=None):
    p = argparse.ArgumentParser(description="The GPT-2 presets: parameters, and where they and the FLOPs are.")
    p.add_argument("--model", choices=PRESETS, help="one preset in detail")
    p.add_argument("--vocab", type=int_in(GPT2_VOCAB), default=GPT2_VOCAB,
                   help="vocabulary size (50304 pads to a multiple of 128)")
    p.add_argument("--seq", type=int_in(1), help="context for the FLOPs per token (default: the block size)")
    args = p.parse_args(argv)
    names = list(PRESETS)
    if args.model:
        names = [args.model]
    configs = {name: make_config(name, vocab_size=args.vocab) for name in names}
    shortest_block = min(c.block_size for c in configs.values())
    if args.seq is not None and args.seq > shortest_block:
        fail(f"--seq must be between 1 and the block size {shortest_block}, got {args.seq}")
    rows = []
    with torch.device("meta"):  # count parameters without allocating them
        for name, c in configs.items():
            seq = args.seq or c.block_size
            rows.append([name, c.n_layer, c.n_head, c.n_embd, c.d_ff, f"{GPT(c).num_params():,}",
                         f"{flops_per_token(c, seq) / 1e9:.2f}"])
    print_table(["preset", "layers", "heads", "d_model", "d_ff", f"params (vocab {args.vocab})", "train GFLOP/token"],
                rows)
    if args.model:
        c = configs[args.model]
        d = c.n_embd
        parts = {  # weights and biases of each kind
            "token embedding = output layer (tied)": c.vocab_size * d,
            "position table": c.block_size * d,
            f"{c.n_layer} x attention (qkv, proj)": c.n_layer * (4 * d * d + 4 * d),
            f"{c.n_layer} x MLP": c.n_layer * (2 * d * c.d_ff + c.d_ff + d),
            "LayerNorms": (2 * c.n_layer + 1) * 2 * d,
        }
        total = sum(parts.values())
        print()
        print_table(["where the parameters are", "parameters", "share"],
                    [[k, f"{n:,}", f"{100 * n / total:.1f}%"] for k, n in parts.items()])
    print("parameter counts include the tied embedding once and the position table; FLOPs: 6 per matmul "
          "parameter plus attention, at the block size unless --seq")


if __name__ == "__main__":
    run_main(main)
