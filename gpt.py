"""GPT-2 in one file: the model every nanoperf script trains, times or takes apart, then the tools they share.

GPT-2 (pre-LayerNorm blocks, learned positions, tied embeddings) with two speed-ups built in: the output layer fused
with the loss over chunks of tokens, so the [tokens, vocab] logits never exist, and FP8 matmuls for wide Linears.
`python gpt.py [--model gpt2]` prints the presets' parameters and FLOPs, or where one preset's parameters are."""

import argparse
import math
import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
GPT2_VOCAB = 50257  # tokens the GPT-2 BPE can produce; a larger vocab_size is padding

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

PRESETS = {"tiny": (4, 4, 128, 512), "gpt2": (12, 12, 768, 3072), "small": (12, 12, 768, 3072),
           "medium": (24, 16, 1024, 4096), "large": (36, 20, 1280, 5120), "xl": (48, 25, 1600, 6400),
           "2.7B": (32, 32, 2560, 10240)}  # name: (n_layer, n_head, n_embd, d_ff)
def make_config(name, **overrides):  # a preset's config, any field overridden (vocab_size=50304, attn="flash")
    if name not in PRESETS:
        raise ValueError(f"unknown model '{name}'; choose from {', '.join(PRESETS)}")
    return check_config(replace(GPTConfig(*PRESETS[name], 256 if name == "tiny" else 1024), **overrides))

def check_config(config):  # a config that cannot work is a ValueError in one sentence
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
    if config.vocab_size < GPT2_VOCAB:
        raise ValueError(f"vocab {config.vocab_size} is below the tokenizer's {GPT2_VOCAB} tokens")
    if config.attn not in ATTENTION:
        raise ValueError(f"unknown attention '{config.attn}'; choose from {', '.join(ATTENTION)}")
    if not 0 <= config.recompute <= config.n_layer:
        raise ValueError(f"--recompute {config.recompute} must be between 1 and the {config.n_layer} layers")
    return config

# --- 2. attention: causal self-attention of (B, H, T, D) tensors, one function per implementation
def naive_attention(q, k, v):  # the (T, T) scores and probabilities kept for backward: what FlashAttention removes
    from torch.autograd.profiler import record_function  # ranges for bench_e2e.py's profile
    T = q.size(-2)
    with record_function("attention scores"):
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    with record_function("softmax"):
        probs = scores.softmax(dim=-1)
    with record_function("final matmul"):
        return probs @ v

def sdpa_attention(q, k, v):  # SDPA picks the fastest backend that runs the inputs (cuDNN on an H100)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

def pinned_sdpa(backend):  # raises rather than fall back: a benchmark of "flash" really measured flash
    def attend(q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attend

def triton_attention(q, k, v):  # flash_triton.py, this repo's FlashAttention in Triton
    from flash_triton import flash_attention
    return flash_attention(q, k, v, causal=True)

SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
ATTENTION = {"naive": naive_attention, "sdpa": sdpa_attention,
             **{name: pinned_sdpa(backend) for name, backend in SDPA_BACKENDS.items()}, "triton": triton_attention}
GPU_ONLY_ATTENTION = ("cudnn", "efficient", "triton")

# --- 3. the model
class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.attend = ATTENTION[config.attn]  # picked here once, not looked up every forward
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        return self.c_proj(self.attend(q, k, v).transpose(1, 2).reshape(B, T, C))

class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.d_ff)
        self.c_proj = nn.Linear(config.d_ff, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's GELU

class Block(nn.Module):
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

    def forward(self, idx, targets=None, blocks=None):  # logits detached with a loss: compile zero-fills their grad
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than the block size {self.config.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        K, blocks = self.config.recompute, self.h if blocks is None else blocks  # blocks: x -> x, memory.py's groups
        for i, block in enumerate(blocks):  # recompute: keep a block's input, redo its activations in backward
            recompute = K and i % K == 0 and torch.is_grad_enabled()
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        x = self.ln_f(x)
        if targets is not None and self.config.fused_ce and torch.is_grad_enabled():
            return None, linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten())
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        return logits.detach(), F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):  # never a padding token
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[0][:, -1, :].float() / temperature
            logits[:, GPT2_VOCAB:] = float("-inf")
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, GPT2_VOCAB)).values[:, -1:]
                logits[logits < kth] = float("-inf")
            idx = torch.cat([idx, torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)], dim=1)
        return idx

# --- 4. the output layer and the loss, fused over chunks of rows: the [N, V] logits (1.6 GB in bf16 at N=16,384)
# never exist. A kernel turns each chunk's logits into their gradient, at once multiplied into dx and dW, in forward.
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
    for start in range(0, n_cols, BLOCK):  # the second read of a row mostly hits the L2 cache
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(row + cols, mask=cols < n_valid, other=float("-inf")).to(tl.float32)
        grad = tl.exp(z - lse)
        grad = tl.where(cols == target, grad - 1.0, grad)
        tl.store(row + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < n_cols)

def chunk_loss_and_grad(logits, targets, n_valid):  # the kernel on a GPU; on a CPU its reference
    if logits.is_cuda:
        losses = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
        _cross_entropy_rows[(logits.shape[0],)](logits, targets, losses, logits.stride(0), n_valid,
                                                logits.shape[1], BLOCK=4096, num_warps=8)
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
    def forward(ctx, x, weight, targets, chunk_rows):  # matmuls in the autocast dtype, as nn.Linear's
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        xc, w = x.to(dtype), weight.to(dtype)
        N, n_valid = x.shape[0], min(GPT2_VOCAB, weight.shape[0])
        losses, dx, dw = [], torch.empty_like(x), torch.zeros_like(weight, dtype=dtype)
        with torch.autocast(x.device.type, enabled=False):
            for start in range(0, N, chunk_rows):
                rows = slice(start, start + chunk_rows)
                logits = xc[rows] @ w.t()
                losses.append(chunk_loss_and_grad(logits, targets[rows], n_valid))
                dx[rows] = logits @ w  # `logits` now holds their gradient
                dw.addmm_(logits.t(), xc[rows])  # the matmul accumulates in fp32 inside
        ctx.save_for_backward(dx, dw.to(weight.dtype))
        ctx.n_rows = N
        return torch.cat(losses).sum() / N

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dw = ctx.saved_tensors  # gradients of the sum of the losses; the loss is their mean
        scale = grad_loss / ctx.n_rows
        return dx * scale, dw * scale, None, None

CE_CHUNK_ROWS = 8192  # rows enough for efficient matmuls
def linear_cross_entropy(x, weight, targets, chunk_rows=None):  # (N, d) hidden states, (N,) targets
    return LinearCrossEntropy.apply(x, weight, targets, chunk_rows or CE_CHUNK_ROWS)

# --- 5. FP8 matmuls (H100/H200), twice the bf16 rate: e4m3 activations and weights, e5m2 gradients, amax scales
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
def to_fp8(t, dtype):  # (t scaled into dtype's range and cast, the inverse scale)
    amax = t.detach().abs().amax().float().clamp(min=1e-12)
    scale = torch.finfo(dtype).max / amax
    return (t.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype), scale.reciprocal()

def fp8_mm(a8, a_inv, b8, b_inv):  # a (M, K) row-major, b (K, N) column-major, bf16 out
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
    def forward(self, x):
        y = Fp8Matmul.apply(x.flatten(0, -2), self.weight).unflatten(0, x.shape[:-1])
        return y if self.bias is None else y + self.bias.to(y.dtype)

# FP8 for a block's Linears both ways >= FP8_MIN_WIDTH: narrower ones don't repay the scaling; lm_head: fused loss
FP8_LAYERS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
FP8_MIN_WIDTH = 2048
def fp8_supported(device):
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)

def use_fp8(model, min_width=FP8_MIN_WIDTH):  # FP8_LAYERS >= min_width both ways: [(name, in, out, converted)]
    plan = []
    for name, m in model.named_modules():
        if type(m) is nn.Linear and name.endswith(FP8_LAYERS):
            chosen = min(m.in_features, m.out_features) >= min_width
            if chosen:
                m.__class__ = Fp8Linear
            plan.append((name, m.in_features, m.out_features, chosen))
    return plan

# ====== The shared tools: optimizer, compilation, FSDP2, a training step, FLOPs and MFU, tokenizer, timer, helpers
# --- 6. optimizer, compilation, sharding and one training step
def configure_optimizer(model, lr, weight_decay=0.1, betas=(0.9, 0.95)):
    # weight decay on matrices and embeddings, not biases or LayerNorm gains; fused: a few kernels for all
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=all(p.is_cuda for p in params))

def compile_model(model, cuda_graphs=False):  # CUDA graphs: one GPU, no grad accumulation (a replay overwrites grads)
    return torch.compile(model, options={"triton.cudagraphs": cuda_graphs, "triton.enable_pdl": True})

def fully_shard_gpt(model, param_dtype=None):  # per block: one block's all-gather overlaps the last one's compute
    from torch.distributed import get_world_size
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(next(model.parameters()).device.type, (get_world_size(),))  # not FSDP2's default CUDA
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)

def clip_gradients(model, optimizer, max_norm):  # the global norm; gradients scaled to max_norm above it (0: never)
    # a fused AdamW divides each gradient by grad_scale as it reads it: a pass saved. FSDP's norm is a DTensor
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if max_norm and optimizer.defaults["fused"]:
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)  # as clip_grad_norm_
    elif max_norm:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)  # takes the parameters, not grads
    return norm

def train_step(model, optimizer, x, y, dtype=None, scaler=None, grad_clip=0.0, mark=None):
    """One optimizer step; the loss comes back as a GPU tensor, nothing waits. mark(phase) after each phase."""
    mark = mark or (lambda phase: None)
    with autocast(x.device, dtype):
        _, loss = model(x, y)
    mark("forward")
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()  # fp16: scale so small gradients survive
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    mark("backward")
    if grad_clip:
        clip_gradients(model, optimizer, grad_clip)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    mark("optimizer")
    return loss.detach()

# --- 7. FLOPs and MFU
def flops_per_token(config, seq_len):
    # 6 per matmul parameter (2 forward, 4 backward) plus attention's QK^T and PV, 12 L d T, unhalved, as PaLM counts
    d, L = config.n_embd, config.n_layer
    matmul_params = L * (4 * d * d + 2 * d * config.d_ff) + config.vocab_size * d
    return 6 * matmul_params + 12 * L * d * seq_len

GPU_PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                  ("GH200", 989e12), ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12))
def gpu_peak_flops(device):  # dense bf16 FLOP/s of the first key in the GPU's name ("H100": the SXM part), or None
    if torch.device(device).type != "cuda":
        return None
    return next((peak for key, peak in GPU_PEAK_FLOPS if key in torch.cuda.get_device_name(device)), None)

def mfu(flops_per_s, device):  # of the bf16 peak, for fp32 and FP8 runs too, as is customary; None, never a guess
    return None if (peak := gpu_peak_flops(device)) is None else flops_per_s / peak

def fmt_mfu(value):
    return "n/a" if value is None else f"{100 * value:.1f}%"

def step_bytes(config, B, T, bf16):  # a train step's peak, about: 16 bytes a parameter (weights, gradients, moments),
    # ~(34 d + 5 H T) bytes a token a layer in 16-bit (Korthikanti 2022; fp32 2x), fp32 logits (fused: one chunk)
    with torch.device("meta"):
        params = GPT(config).num_params()
    acts = config.n_layer * B * T * (34 * config.n_embd + 5 * config.n_head * T) * (1 if bf16 else 2)
    return 16 * params + acts + (min(B * T, CE_CHUNK_ROWS) if config.fused_ce else 2 * B * T) * config.vocab_size * 4

# --- 8. tokenizer and data
R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
def gpt2_tokenizer(bpe_dir=os.path.join(HERE, "gpt2_bpe")):  # tiktoken's "gpt2" from the repo's files: offline
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    ranks = data_gym_to_mergeable_bpe_ranks(*(os.path.join(bpe_dir, n) for n in ("vocab.bpe", "encoder.json")))
    return tiktoken.Encoding(name="gpt2", pat_str=R50K_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": GPT2_VOCAB - 1}, explicit_n_vocab=GPT2_VOCAB)

def load_tokens(path=os.path.join(HERE, "input.txt")):  # the text as a 1-D int64 tensor of GPT-2 tokens
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; it holds the training text (Tiny Shakespeare)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text (was a checkpoint or binary file written over it?)") from None
    return torch.tensor(gpt2_tokenizer().encode_ordinary(text), dtype=torch.long)

# --- 9. the one timer: variants in rounds (A B C, B C A, ...) as a shared GPU's speed drifts; ratios paired per round
def clock(device):  # on a GPU an event queued behind the work already queued: it fires when the GPU gets there
    if torch.device(device).type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event

def elapsed_ms(start, end):  # waits for the GPU to reach `end`
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

    def mean_std(self, digits=2):  # as the CS336 benchmarking script reports a timing
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"

    def vs(self):
        return "-" if self.ratio is None else f"{self.ratio:.3f}x ({self.ratio_low:.3f}-{self.ratio_high:.3f})"

def time_rounds(variants, device, rounds=20, steps=3, warmup=2, sync=None, progress=None):
    """({name: [ms per step, a round each] or None (OOM)}, {name: peak bytes}) for {name: fn queueing a step}. The
    warm-up also compiles and captures CUDA graphs. One sync a round (ddp.py's: all ranks): the host queues ahead."""
    cuda = torch.device(device).type == "cuda"
    names, times, peaks = list(variants), {}, {}
    for i, name in enumerate(names):
        times[name] = None
        PROGRESS["doing"] = f"warming up variant {i + 1} of {len(names)} ({name})"
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
    for r in range(rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        marks = []
        for name in order:
            start = clock(device)
            for _ in range(steps):
                variants[name]()
            marks.append((name, start, clock(device)))
        (sync or (lambda: synchronize(device)))()
        for name, start, end in marks:
            times[name].append(elapsed_ms(start, end) / steps)
        PROGRESS["doing"] = f"timing: {r + 1} of {rounds} rounds done"
        if progress:
            progress(r)
    return times, peaks

def lazily(make, device, held=lambda: 0, note=None):
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

def summarize(times, baseline=None, peaks=None):  # {name: Timing or None}; ratios to `baseline` paired per round
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
    times, peaks = time_rounds(variants, device, rounds, steps, warmup, progress=progress)
    return summarize(times, baseline, peaks)

# --- 10. small helpers: device, precision, memory, errors, paths, tables
# --- flags: argparse `type=` helpers, the one way every script validates a number. A bad value is argparse's
# own error: one sentence naming the flag as the last line, exit status 2, no traceback.
def _number(text, kind):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got '{text}'")
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


def round_up(n, multiple):  # round_up(50257, 128) == 50304
    return (n + multiple - 1) // multiple * multiple

def fail(message):  # bad input: one sentence and exit status 2, no traceback
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)

def resolve_device(name=None):  # cpu, cuda or cuda:N (default: the best there is) as an indexed device, or ValueError
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
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
    if bf16 and fp16:
        raise ValueError("--bf16 and --fp16 are exclusive; pick one")
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else None

def autocast(device, dtype):
    return nullcontext() if dtype is None else torch.autocast(torch.device(device).type, dtype=dtype)

def set_tf32(enabled):  # torch warns if fp32_precision and set_float32_matmul_precision are mixed: one or the other
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32" if enabled else "ieee"
    else:
        torch.set_float32_matmul_precision("high" if enabled else "highest")

def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)

def check_output_path(path, flag, ours=None):  # before any work: a bad path costs seconds; ours(path): a file we wrote
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
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be written there: {e.strerror or e}") from None

# Ctrl-C and SIGTERM: one line, exit 130 / 143, no traceback, saying what finished (tables printed, the timer's note)
PROGRESS = {"tables": 0, "doing": "starting"}
def run_main(main):
    import signal
    def on_term(signum, frame):
        raise KeyboardInterrupt(signum)
    signal.signal(signal.SIGTERM, on_term)
    try:
        main()
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args else signal.SIGINT
        print(f"\ninterrupted ({signal.Signals(signum).name}) while {PROGRESS['doing']}: {PROGRESS['tables']} "
              "table(s) above are complete, the rest did not run", file=sys.stderr)
        raise SystemExit(128 + signum) from None

def is_oom(error):
    text = str(error).lower()  # cuBLAS and some kernels raise a RuntimeError; the CPU says "not enough memory"
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "not enough memory" in text

def free_memory():
    __import__("gc").collect()  # the cycles that keep tensors alive first, then the allocator's free blocks
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

def gib(nbytes):
    return f"{nbytes / 2**30:.2f}"

def check_host_memory(need, what, hint="lower --batch or --seq, or use a smaller --model"):
    """CPU: refuse what the OOM killer would end without a word (exit 137). hint: words, or words from free bytes."""
    info = open("/proc/meminfo").read().split() if os.path.exists("/proc/meminfo") else []  # Linux; elsewhere no check
    if "MemAvailable:" in info and need > (free := int(info[info.index("MemAvailable:") + 1]) * 1024):
        fail(f"{what} needs about {gib(need)} GiB of this machine's memory and {gib(free)} GiB are free; "
             f"{hint(free) if callable(hint) else hint}")

def print_table(headers, rows):
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 or n == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    PROGRESS["tables"] += 1

def plot_to(path):  # pyplot for a --plot PNG: matplotlib is imported only then
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
    p.add_argument("--vocab", type=int, default=GPT2_VOCAB, help="vocabulary size (50304 pads to a multiple of 128)")
    p.add_argument("--seq", type=int, help="context for the FLOPs per token (default: the block size)")
    args = p.parse_args(argv)
    try:
        configs = {name: make_config(name, vocab_size=args.vocab) for name in ([args.model] if args.model else PRESETS)}
    except ValueError as e:
        fail(str(e))
    if args.seq is not None and not 1 <= args.seq <= min(c.block_size for c in configs.values()):
        fail(f"--seq must be between 1 and the block size, got {args.seq}")
    with torch.device("meta"):  # count parameters without allocating them
        rows = [[name, c.n_layer, c.n_head, c.n_embd, c.d_ff, f"{GPT(c).num_params():,}",
                 f"{flops_per_token(c, args.seq or c.block_size) / 1e9:.2f}"] for name, c in configs.items()]
    print_table(["preset", "layers", "heads", "d_model", "d_ff", f"params (vocab {args.vocab})", "train GFLOP/token"],
                rows)
    if args.model:
        c, d = configs[args.model], configs[args.model].n_embd
        parts = {"token embedding = output layer (tied)": c.vocab_size * d, "position table": c.block_size * d,
                 f"{c.n_layer} x attention (qkv, proj)": c.n_layer * (4 * d * d + 4 * d),
                 f"{c.n_layer} x MLP": c.n_layer * (2 * d * c.d_ff + c.d_ff + d),
                 "LayerNorms": (2 * c.n_layer + 1) * 2 * d}
        print()
        print_table(["where the parameters are", "parameters", "share"],
                    [[k, f"{n:,}", f"{100 * n / sum(parts.values()):.1f}%"] for k, n in parts.items()])
    print("parameter counts include the tied embedding once and the position table; FLOPs: 6 per matmul "
          "parameter plus attention, at the block size unless --seq")

if __name__ == "__main__":
    main()
