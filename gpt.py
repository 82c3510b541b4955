"""GPT-2 in one file: the model every nanoperf script trains, times or takes apart.

The architecture is GPT-2's (pre-LayerNorm blocks, learned position embeddings, a 4x GELU MLP,
input and output embeddings tied, residual projections initialised with std 0.02/sqrt(2*n_layer)).
Around it sit the few things every script needs: size presets, vocabulary padding, an attention
toggle (naive / SDPA and its backends / our Triton kernel), the AdamW set-up, the FLOPs-per-token
and MFU arithmetic against the detected GPU's peak, an offline GPT-2 tokenizer, and small helpers
for precision, errors and tables.

    from gpt import GPT, make_config
    model = GPT(make_config("gpt2", vocab_size=50304, attn="flash"))

Run `python gpt.py` to print the presets and their parameter counts (CPU, no training).
"""

import hashlib
import math
import os
import statistics
import sys
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.profiler import record_function

HERE = os.path.dirname(os.path.abspath(__file__))
GPT2_VOCAB = 50257  # tokens the GPT-2 BPE can produce; a larger vocab_size is padding

# --- 1. configuration and presets


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    d_ff: int = 3072
    block_size: int = 1024  # longest context, the size of the position table
    vocab_size: int = GPT2_VOCAB
    attn: str = "sdpa"  # see ATTENTION_IMPLS; read at every forward, so it can be switched


# name: (n_layer, n_head, n_embd, d_ff). `small`..`2.7B` are the usual benchmark sizes.
PRESETS = {
    "tiny": (4, 4, 128, 512),  # trains in seconds on a CPU
    "gpt2": (12, 12, 768, 3072),  # GPT-2 124M
    "small": (12, 12, 768, 3072),
    "medium": (24, 16, 1024, 4096),
    "large": (36, 20, 1280, 5120),
    "xl": (48, 25, 1600, 6400),
    "2.7B": (32, 32, 2560, 10240),
}
TINY_BLOCK_SIZE = 256


def make_config(name, **overrides):
    """The config of a preset, with any field overridden (vocab_size=50304, attn="flash", ...)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model '{name}'; choose from {', '.join(PRESETS)}")
    n_layer, n_head, n_embd, d_ff = PRESETS[name]
    block_size = TINY_BLOCK_SIZE if name == "tiny" else 1024
    config = GPTConfig(n_layer, n_head, n_embd, d_ff, block_size)
    config = replace(config, **overrides)
    check_config(config)
    return config


def check_config(config):
    """Raise ValueError, in one sentence, for a config that cannot work."""
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
    if config.vocab_size < GPT2_VOCAB:
        raise ValueError(f"vocab {config.vocab_size} is below the tokenizer's {GPT2_VOCAB} tokens")
    if config.attn not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention '{config.attn}'; choose from {', '.join(ATTENTION_IMPLS)}")


def round_up(n, multiple):
    """Smallest multiple of `multiple` that is >= n: round_up(50257, 128) == 50304."""
    return (n + multiple - 1) // multiple * multiple


# --- 2. attention: one function, several implementations

# SDPA pinned to one backend: if that backend cannot run the inputs, SDPA raises instead of
# silently falling back, so a benchmark labelled "flash" really measured flash.
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
ATTENTION_IMPLS = ("naive", "sdpa", *SDPA_BACKENDS, "triton")


def naive_attention(q, k, v):
    """Causal attention written out. It materialises the (T, T) score and probability matrices
    per head and keeps both for backward: the memory and bandwidth cost FlashAttention removes.
    The record_function ranges name the three stages in torch.profiler (and as NVTX ranges under
    torch.autograd.profiler.emit_nvtx, for Nsight Systems)."""
    T = q.size(-2)
    with record_function("attention scores"):
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    with record_function("softmax"):
        probs = scores.softmax(dim=-1)
    with record_function("final matmul"):
        return probs @ v


def attention(q, k, v, impl):
    """Causal self-attention of (B, H, T, D) tensors with the chosen implementation."""
    if impl == "naive":
        return naive_attention(q, k, v)
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if impl == "triton":
        try:
            from flash_triton import flash_attention
        except ModuleNotFoundError as e:
            if e.name != "flash_triton":
                raise
            raise RuntimeError("--attn triton needs flash_triton.py next to gpt.py") from None
        return flash_attention(q, k, v, causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[impl])):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# --- 3. the model


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        H = self.config.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = attention(q, k, v, self.config.attn)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


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
        # Each block adds two projections into the residual stream; scaling their init keeps the
        # stream's variance from growing with depth (GPT-2 paper, section 2.3).
        for name, p in self.named_parameters():
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

    def forward(self, idx, targets=None):
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than the block size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            # Training differentiates the loss; the logits come back detached, for inspection.
            # Under torch.compile, an output that requires grad but gets none in backward is
            # handed a zero gradient: a logits-sized tensor (1.6 GB at B=16, T=1024, vocab 50304)
            # to fill and read every step.
            logits = logits.detach()
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Append max_new_tokens sampled tokens to idx (B, T). Padded vocabulary entries are
        never sampled: the tokenizer cannot decode them."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :].float() / temperature
            logits[:, GPT2_VOCAB:] = float("-inf")
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, GPT2_VOCAB)).values[:, -1:]
                logits[logits < kth] = float("-inf")
            probs = logits.softmax(dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


# --- 4. optimizer, FLOPs and MFU


def configure_optimizer(model, lr, weight_decay=0.1, betas=(0.9, 0.95)):
    """AdamW with weight decay on matrices and embeddings only (biases and LayerNorm gains are
    not decayed). fused=True on CUDA does the update of all tensors in a few kernels."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)


def matmul_params(config):
    """Parameters that take part in a matmul per token: every block's weights and the output
    layer (tied to wte). The position table is a lookup, so it is left out."""
    d, L = config.n_embd, config.n_layer
    per_block = 4 * d * d + 2 * d * config.d_ff  # qkv + attention proj + the two MLP matrices
    return L * per_block + config.vocab_size * d


def flops_per_token(config, seq_len):
    """Training FLOPs (forward + backward) per token: 6 per matmul parameter (2 forward, 4
    backward) plus attention's QK^T and PV, 12 * n_layer * n_embd * seq_len, counted without
    the causal halving as PaLM's MFU does."""
    return 6 * matmul_params(config) + 12 * config.n_layer * config.n_embd * seq_len


# Dense bf16 tensor-core peak per GPU, matched on torch.cuda.get_device_name() (first match wins).
GPU_PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM, reported as "NVIDIA H100 80GB HBM3"
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


def gpu_peak_flops(device):
    """bf16 dense peak of the device's GPU in FLOP/s, or None if unknown (or not a GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_FLOPS if key in name), None)


def mfu(flops_per_s, device):
    """Model FLOPs utilisation against the bf16 peak (also for fp32 runs, as is customary), or
    None where the peak is unknown: better no number than a wrong one."""
    peak = gpu_peak_flops(device)
    return None if peak is None else flops_per_s / peak


# --- 5. tokenizer and data

BPE_FILES = {  # file: sha256, the hashes tiktoken itself expects for its "gpt2" encoding
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gpt2_tokenizer(bpe_dir=os.path.join(HERE, "gpt2_bpe")):
    """tiktoken's "gpt2" encoding built from the BPE files in the repo: no network access."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    paths = {name: os.path.join(bpe_dir, name) for name in BPE_FILES}
    for name, path in paths.items():
        if not os.path.exists(path):
            raise FileNotFoundError(f"GPT-2 BPE file {path} is missing")
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != BPE_FILES[name]:
                raise ValueError(f"{path} does not have the expected sha256 {BPE_FILES[name]}")
    ranks = data_gym_to_mergeable_bpe_ranks(paths["vocab.bpe"], paths["encoder.json"])
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=R50K_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": GPT2_VOCAB - 1},
        explicit_n_vocab=GPT2_VOCAB,
    )


def load_tokens(path=os.path.join(HERE, "input.txt")):
    """The text file as a 1-D int64 tensor of GPT-2 tokens (input.txt: 338,025 tokens)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing; it holds the training text (Tiny Shakespeare)")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return torch.tensor(gpt2_tokenizer().encode_ordinary(text), dtype=torch.long)


# --- 6. small helpers the scripts share: device, precision, errors, tables


def fail(message):
    """Stop on bad input with one sentence and exit status 2 (no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def resolve_device(name=None):
    """`name` or the best available device; a CUDA device on a machine without one is an error."""
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for but this machine has no CUDA GPU")
    if device.type == "cuda" and device.index is None:  # memory APIs want an indexed device
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def amp_dtype(bf16=False, fp16=False):
    """The autocast dtype the --bf16/--fp16 flags ask for (None: full precision)."""
    if bf16 and fp16:
        raise ValueError("--bf16 and --fp16 are exclusive; pick one")
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else None


def autocast(device, dtype):
    """Autocast to dtype on device, or nothing when dtype is None."""
    return nullcontext() if dtype is None else torch.autocast(torch.device(device).type, dtype=dtype)


def set_tf32(enabled):
    """TF32 for fp32 matmuls (10-bit mantissa on the tensor cores, ~8x the fp32 FLOP rate).
    Newer torch has the fp32_precision controls and warns when they are mixed with the older
    set_float32_matmul_precision, so use one or the other, never both."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32" if enabled else "ieee"
    else:
        torch.set_float32_matmul_precision("high" if enabled else "highest")


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def mean_std(values):
    """(mean, sample standard deviation) of a list; std is 0 for a single value."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def print_table(headers, rows):
    """Print rows (lists of values) under headers as an aligned plain-text table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        # first column (the configuration) left-aligned, numbers right-aligned
        print("  ".join(c.ljust(w) if i == 0 or n == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def is_oom(error):
    """True for out-of-memory errors, including those cuBLAS and some kernels raise as a plain
    RuntimeError."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def free_memory():
    """Return cached GPU memory after a configuration (or an OOM): collect the Python cycles that
    keep tensors alive, then release the caching allocator's free blocks."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gib(nbytes):
    return f"{nbytes / 2**30:.2f}"


if __name__ == "__main__":
    rows = []
    for name in PRESETS:
        config = make_config(name)
        with torch.device("meta"):  # count parameters without allocating them
            n = GPT(config).num_params()
        rows.append([name, config.n_layer, config.n_head, config.n_embd, config.d_ff, f"{n:,}"])
    print_table(["preset", "layers", "heads", "d_model", "d_ff", "params (vocab 50257)"], rows)
    print("parameter counts include the tied embedding once and the position table")
