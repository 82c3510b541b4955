"""FlashAttention-2, forward and backward, in Triton: the kernel lesson of nanoperf.

Attention never needs the (S, S) score matrix in memory: each program keeps a tile of queries
on chip, streams key/value tiles past it with an online softmax (a running max and sum), and
writes O and the row logsumexp L once. The backward recomputes P from Q, K and L instead of
storing it, with one kernel that owns dK/dV per key tile and one that owns dQ per query tile, so
no atomics are needed and the gradients are bitwise deterministic. Causal masking skips the tiles
above the diagonal and masks only the diagonal ones.

    python flash_triton.py                 # checks vs a float64 reference, then the benchmark
    python flash_triton.py --autotune      # search tile sizes / warps / stages per shape
    python flash_triton.py --head-dims 64 --seqs 16384 --dtype fp16

    from flash_triton import flash_attention
    y = flash_attention(q, k, v, causal=True)      # (B, S, D) or (B, H, S, D)

Excerpt (NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-22; bf16, causal, H=16;
cells: median ms / TFLOP/s):

    shape               fwd ours     fwd sdpa flash  fwd sdpa cudnn  fwd+bwd ours  fwd+bwd sdpa flash  fwd+bwd sdpa cudnn
    B1 H16 S16384 D64   1.330 / 413     1.977 / 278     1.295 / 424   5.212 / 369         6.944 / 277         4.550 / 423
    B4 H16 S4096 D128   0.655 / 420     0.913 / 301     0.516 / 532   2.634 / 365         3.632 / 265         2.034 / 473
"""

import argparse
import math
import os
import sys

import torch

# The Triton interpreter must be chosen before triton is imported: without a GPU the kernels run
# (slowly, in numpy) under TRITON_INTERPRET=1, which is what the CPU tests rely on.
INTERPRETED = not torch.cuda.is_available()
if INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gpt import fail, print_table  # noqa: E402

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)): exp2 is the native instruction
# kernels may read globals only when they are constexpr
LOG2E_K = tl.constexpr(LOG2E)
LN2_K = tl.constexpr(0.6931471805599453)

# --- 1. the reference: FlashAttention-2 tile by tile in plain PyTorch


def _torch_forward(q, k, v, causal, scale, block=64):
    """O and L (natural-log logsumexp of the scaled scores, fp32) of (B, H, S, D) tensors, by the
    FA2 forward loop: per query tile, an online softmax over key tiles. Computed in fp32."""
    q, k, v = q.float(), k.float(), v.float()
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(B, H, Nq, device=q.device)
    for i in range(0, Nq, block):
        qi = q[:, :, i : i + block]
        rows = torch.arange(i, i + qi.shape[2], device=q.device)
        m = torch.full(qi.shape[:3], -math.inf, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qi)
        for j in range(0, min(Nk, i + block) if causal else Nk, block):  # skip tiles above the diagonal
            s = (qi @ k[:, :, j : j + block].transpose(-1, -2)) * scale
            if causal:
                cols = torch.arange(j, j + s.shape[-1], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)  # rescales what was summed under the old max
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[:, :, j : j + block]
            m = m_new
        o[:, :, i : i + block] = acc / l[..., None]
        lse[:, :, i : i + block] = m + torch.log(l)
    return o, lse


def _torch_backward(q, k, v, o, lse, do, causal, scale, block=64):
    """dQ, dK, dV by the FA2 backward equations, recomputing P = exp(S - L) tile by tile:
    dV = P^T dO, dP = dO V^T, dS = P * (dP - D) with D = rowsum(dO * O), dQ = scale dS K,
    dK = scale dS^T Q."""
    q, k, v, o, do = (t.float() for t in (q, k, v, o, do))
    delta = (do * o).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    Nq, Nk = q.shape[2], k.shape[2]
    for j in range(0, Nk, block):
        kj, vj = k[:, :, j : j + block], v[:, :, j : j + block]
        cols = torch.arange(j, j + kj.shape[2], device=q.device)
        for i in range(j // block * block if causal else 0, Nq, block):
            qi, doi = q[:, :, i : i + block], do[:, :, i : i + block]
            p = torch.exp((qi @ kj.transpose(-1, -2)) * scale - lse[:, :, i : i + block, None])
            if causal:
                rows = torch.arange(i, i + qi.shape[2], device=q.device)
                p = p.masked_fill(cols[None, :] > rows[:, None], 0.0)
            dv[:, :, j : j + block] += p.transpose(-1, -2) @ doi
            ds = p * (doi @ vj.transpose(-1, -2) - delta[:, :, i : i + block, None])
            dq[:, :, i : i + block] += scale * ds @ kj
            dk[:, :, j : j + block] += scale * ds.transpose(-1, -2) @ qi
    return dq, dk, dv


class FlashAttentionTorch(torch.autograd.Function):
    """The readable reference: O from the tiled forward, L kept for a backward that recomputes P."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        o, lse = _torch_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _torch_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def naive_reference(q, k, v, causal, scale):
    """O and L in float64 with the full score matrix: the ground truth for small shapes."""
    q, k, v = q.double(), k.double(), v.double()
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return s.softmax(-1) @ v, s.logsumexp(-1)


# --- 2. Triton forward: one program per (query tile, batch*head)


@triton.jit
def _load_tile(ptrs, rows, n_rows, MASKED: tl.constexpr):
    # Full tiles load without a mask; only ragged or diagonal tiles pay for the bounds check.
    if MASKED:
        return tl.load(ptrs, mask=rows < n_rows, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_vn, offs_m, lo, hi, Nk, qk_scale,
               CAUSAL: tl.constexpr, MASKED: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K + offs_n[:, None] * stride_kn + offs_d[None, :], offs_n[:, None], Nk, MASKED)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            keep = offs_n[None, :] < Nk
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            qk = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        else:  # the scale folds into one multiply-add with the max subtraction
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_new[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(V + offs_n[:, None] * stride_vn + offs_d[None, :], offs_n[:, None], Nk, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, O, L, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                H, Nq, Nk, qk_scale,
                CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # see _dkdv_kernel
    start_m = tl.program_id(0)
    if CAUSAL:  # the last query tiles have the most keys: start them first to shorten the tail
        start_m = tl.num_programs(0) - 1 - start_m
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    Q += b * sqb + h * sqh
    K += b * skb + h * skh
    V += b * svb + h * svh
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * sqn + offs_d[None, :], mask=offs_m[:, None] < Nq, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # Stage 1: key tiles entirely visible and in bounds, no masking at all.
    # Stage 2: the diagonal tiles (causal) or the ragged last tile (non-causal), masked.
    if CAUSAL:
        full_end = start_m * BLOCK_M
        masked_end = tl.minimum(full_end + BLOCK_M, Nk)
    else:
        full_end = Nk // BLOCK_N * BLOCK_N
        masked_end = Nk
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, skn, svn, offs_m, 0, full_end, Nk, qk_scale,
                               CAUSAL, False, D, BLOCK_N, PRECISION)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, skn, svn, offs_m, full_end, masked_end, Nk,
                               qk_scale, CAUSAL, True, D, BLOCK_N, PRECISION)
    o = acc / l_i[:, None]
    O += b * sob + h * soh
    tl.store(O + offs_m[:, None] * son + offs_d[None, :], o.to(O.dtype.element_ty), mask=offs_m[:, None] < Nq)
    tl.store(L + bh * Nq + offs_m, (m_i + tl.math.log2(l_i)) * LN2_K, mask=offs_m < Nq)


# --- 3. Triton backward: D = rowsum(dO*O), then dK/dV per key tile, then dQ per query tile


@triton.jit
def _delta_kernel(O, DO, Delta, sob, soh, son, sdb, sdh, sdn, H, Nq, D: tl.constexpr, BLOCK_M: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_d = tl.arange(0, D)
    rows = offs_m[:, None] < Nq
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdn + offs_d[None, :], mask=rows, other=0.0)
    tl.store(Delta + bh * Nq + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_m < Nq)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, L, Delta, sqn, sdn, offs_n, lo, hi, Nq, qk_scale,
                CAUSAL: tl.constexpr, MASKED: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                PRECISION: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qT = _load_tile(Q + offs_m[None, :] * sqn + offs_d[:, None], offs_m[None, :], Nq, MASKED)
        # Rows past Nq get L = +inf, so their P is exactly 0 without a score mask.
        if MASKED:
            lse2 = tl.load(L + offs_m, mask=offs_m < Nq, other=float("inf")) * LOG2E_K
        else:
            lse2 = tl.load(L + offs_m) * LOG2E_K
        pT = tl.math.exp2(tl.dot(k, qT, input_precision=PRECISION) * qk_scale - lse2[None, :])
        if CAUSAL and MASKED:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        do = _load_tile(DO + offs_m[:, None] * sdn + offs_d[None, :], offs_m[:, None], Nq, MASKED)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        delta = _load_tile(Delta + offs_m, offs_m, Nq, MASKED)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, L, Delta, DK, DV, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
                 sdb, sdh, sdn, H, Nq, Nk, qk_scale, scale,
                 CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DIAG_M: tl.constexpr, PRECISION: tl.constexpr):
    # Under torch.compile, Inductor launches these kernels and types Python floats as fp64; fp64
    # scales would turn the whole softmax fp64 (and tl.dot's fp32 accumulator a type error).
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)
    start_n = tl.program_id(0) * BLOCK_N  # with causal, tile 0 sees every query: heavy tiles first
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    rows = offs_n[:, None] < Nk
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :], mask=rows, other=0.0)
    v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :], mask=rows, other=0.0)
    Q += b * sqb + h * sqh
    DO += b * sdb + h * sdh
    L += bh * Nq
    Delta += bh * Nq
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    full_end = Nq // BLOCK_M * BLOCK_M
    if CAUSAL:
        # The diagonal tile in thin query slices (less masked-away work), then every query tile
        # below it unmasked, then a ragged last tile if any. Key rows past Nk are never stored.
        diag_end = tl.minimum(start_n + BLOCK_N, Nq)
        dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, L, Delta, sqn, sdn, offs_n, start_n, diag_end, Nq,
                             qk_scale, CAUSAL, True, D, DIAG_M, PRECISION)
        full_start = start_n + BLOCK_N
    else:
        full_start = 0
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, L, Delta, sqn, sdn, offs_n, full_start, full_end, Nq,
                         qk_scale, CAUSAL, False, D, BLOCK_M, PRECISION)
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, L, Delta, sqn, sdn, offs_n, tl.maximum(full_start, full_end),
                         Nq, Nq, qk_scale, CAUSAL, True, D, BLOCK_M, PRECISION)
    out = bh * Nk * D + offs_n[:, None] * D + offs_d[None, :]  # dK, dV are contiguous (B, H, Nk, D)
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=rows)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=rows)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, K, V, skn, svn, offs_m, lo, hi, Nk, qk_scale,
              CAUSAL: tl.constexpr, MASKED: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
              PRECISION: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # Key rows past Nk load as zeros: their dS multiplies a zero K row, so no score mask.
        kT = _load_tile(K + offs_n[None, :] * skn + offs_d[:, None], offs_n[None, :], Nk, MASKED)
        vT = _load_tile(V + offs_n[None, :] * svn + offs_d[:, None], offs_n[None, :], Nk, MASKED)
        p = tl.math.exp2(tl.dot(q, kT, input_precision=PRECISION) * qk_scale - lse2[:, None])
        if CAUSAL and MASKED:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = tl.dot(do, vT, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, DO, L, Delta, DQ, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
               sdb, sdh, sdn, H, Nq, Nk, qk_scale, scale,
               CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               DIAG_N: tl.constexpr, PRECISION: tl.constexpr):
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)  # see _dkdv_kernel
    start_m = tl.program_id(0)
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - start_m
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rows = offs_m[:, None] < Nq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdn + offs_d[None, :], mask=rows, other=0.0)
    lse2 = tl.load(L + bh * Nq + offs_m, mask=offs_m < Nq, other=float("inf")) * LOG2E_K
    delta = tl.load(Delta + bh * Nq + offs_m, mask=offs_m < Nq, other=0.0)
    K += b * skb + h * skh
    V += b * svb + h * svh
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        full_end = start_m * BLOCK_M
        dq = _dq_inner(dq, q, do, lse2, delta, K, V, skn, svn, offs_m, full_end,
                       tl.minimum(full_end + BLOCK_M, Nk), Nk, qk_scale, CAUSAL, True, D, DIAG_N, PRECISION)
    else:
        full_end = Nk // BLOCK_N * BLOCK_N
        dq = _dq_inner(dq, q, do, lse2, delta, K, V, skn, svn, offs_m, full_end, Nk, Nk, qk_scale,
                       CAUSAL, True, D, BLOCK_N, PRECISION)
    dq = _dq_inner(dq, q, do, lse2, delta, K, V, skn, svn, offs_m, 0, full_end, Nk, qk_scale,
                   CAUSAL, False, D, BLOCK_N, PRECISION)
    tl.store(DQ + bh * Nq * D + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=rows)


# --- 4. launchers, tile configurations and the autograd.Function

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim for 16-bit inputs; dkdv's BLOCK_M is the
# query slice it iterates over its key tile (the diagonal tile uses half of it), dq's BLOCK_N the
# key slice. Winners of --autotune on an H100, bf16, causal (B1 H16 S16384 D64 and B4 H16 S4096
# D128); 16 and 32 take the D64 ones.
TUNED = {64: {"fwd": (128, 64, 8, 3), "dkdv": (64, 64, 4, 3), "dq": (128, 64, 4, 2)},
         128: {"fwd": (128, 128, 8, 3), "dkdv": (64, 64, 4, 2), "dq": (128, 64, 8, 3)}}
CONFIGS = {kernel: {D: TUNED[max(D, 64)][kernel] for D in HEAD_DIMS} for kernel in ("fwd", "dkdv", "dq")}
# fp32 tiles take twice the shared memory, and exact fp32 dots run on the CUDA cores, not the
# tensor cores: small tiles keep registers (and compile time) in check. The interpreter uses
# small tiles too, so the CPU tests cross many tile boundaries.
FP32_CONFIGS = {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}
INTERPRETER_CONFIG = (16, 16, 4, 1)


def _config(kernel, D, dtype, override=None):
    if override is not None:
        return override
    if INTERPRETED:
        return INTERPRETER_CONFIG
    return FP32_CONFIGS[kernel] if dtype == torch.float32 else CONFIGS[kernel][D]


def _dot_precision(dtype, precision):
    # Only fp32 dots have a choice; 16-bit inputs always use the tensor cores' native path.
    return precision if dtype == torch.float32 else "tf32"


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def flash_forward(q, k, v, causal=False, scale=None, precision="ieee", config=None):
    """O (laid out as (B, S, H, D) in memory, returned as a (B, H, S, D) view) and L (fp32,
    (B, H, Nq), natural log) of checked (B, H, S, D) inputs."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    # (B, S, H, D) memory makes o.transpose(1, 2).reshape(B, S, H*D) in the model free
    o = torch.empty(B, Nq, H, D, device=q.device, dtype=q.dtype).transpose(1, 2)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    BM, BN, warps, stages = _config("fwd", D, q.dtype, config)
    grid = (triton.cdiv(Nq, BM), B * H)
    _fwd_kernel[grid](q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                      H, Nq, Nk, scale * LOG2E, CAUSAL=causal, D=D, BLOCK_M=BM, BLOCK_N=BN,
                      PRECISION=_dot_precision(q.dtype, precision), num_warps=warps, num_stages=stages)
    return o, lse


def flash_backward(q, k, v, o, lse, do, causal=False, scale=None, precision="ieee", configs=None):
    """dQ, dK, dV (contiguous (B, H, S, D)) by three kernels, none of which uses atomics."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    if do.stride(-1) != 1:
        do = do.contiguous()
    configs = configs or {}
    delta = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    _delta_kernel[(triton.cdiv(Nq, 64), B * H)](o, do, delta, *_strides(o), *_strides(do), H, Nq, D=D, BLOCK_M=64)
    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(do), H, Nq, Nk, scale * LOG2E, scale)
    BM, BN, warps, stages = _config("dkdv", D, q.dtype, configs.get("dkdv"))
    _dkdv_kernel[(triton.cdiv(Nk, BN), B * H)](q, k, v, do, lse, delta, dk, dv, *common, CAUSAL=causal, D=D,
                                               BLOCK_M=BM, BLOCK_N=BN, DIAG_M=max(BM // 2, 16),
                                               PRECISION=_dot_precision(q.dtype, precision), num_warps=warps, num_stages=stages)
    BM, BN, warps, stages = _config("dq", D, q.dtype, configs.get("dq"))
    _dq_kernel[(triton.cdiv(Nq, BM), B * H)](q, k, v, do, lse, delta, dq, *common, CAUSAL=causal, D=D,
                                             BLOCK_M=BM, BLOCK_N=BN, DIAG_N=max(BN // 2, 16),
                                             PRECISION=_dot_precision(q.dtype, precision), num_warps=warps, num_stages=stages)
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    """The Triton kernels as an autograd op on checked (B, H, S, D) tensors."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, precision):
        o, lse = flash_forward(q, k, v, causal, scale, precision)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.precision = causal, scale, precision
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale, ctx.precision)
        return dq, dk, dv, None, None, None


def torch_fp32_precision():
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # newer torch; reading allow_tf32 there would warn
        return "tf32" if matmul.fp32_precision == "tf32" else "ieee"
    return "tf32" if matmul.allow_tf32 else "ieee"


def check_inputs(q, k, v, causal, precision):
    """Raise ValueError, in one sentence, for inputs the kernels do not support."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise ValueError("q, k and v must be torch tensors")
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k, v must all be (batch, seq, d) or (batch, heads, seq, d); got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[-1]} is not supported; use one of {HEAD_DIMS}")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError("sequence length must be at least 1")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs equal query and key lengths, got {q.shape[-2]} and {k.shape[-2]}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES.values():
        raise ValueError(f"q, k, v must share one dtype among fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"tensors on {q.device} need TRITON_INTERPRET=1 (set before triton is imported); "
                         "the kernels run on CUDA GPUs")
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"precision must be 'ieee' (exact fp32 dot) or 'tf32', got '{precision}'")


def flash_attention(q, k, v, causal=False, scale=None, precision=None):
    """softmax(scale * q k^T) v with the Triton kernels, differentiable. q: (B, [H,] Nq, D), k and
    v: (B, [H,] Nk, D); scale defaults to 1/sqrt(D). `precision` applies to fp32 inputs only:
    "ieee" for exact fp32 dots, "tf32" for the faster tensor-core ones; None follows torch's fp32
    matmul setting (gpt.set_tf32), so --attn triton matches the rest of the model."""
    if precision is None:  # only fp32 dots read it; skipping the read keeps torch.compile's graph whole
        precision = torch_fp32_precision() if q.dtype == torch.float32 else "ieee"
    check_inputs(q, k, v, causal, precision)
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o = FlashAttention.apply(q, k, v, causal, scale, precision)
    return o.squeeze(1) if squeeze else o


# --- 5. correctness checks against the references


def relative_error(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def check_shape(B, H, Nq, Nk, D, dtype, causal, device, precision="ieee"):
    """Relative errors of O, L, dQ, dK, dV from the Triton kernels and from FlashAttentionTorch,
    both against the float64 reference."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, device=device, generator=gen).to(dtype) for n in (Nq, Nk, Nk))
    do = torch.randn(B, H, Nq, D, device=device, generator=gen).to(dtype)
    scale = D**-0.5
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    o_ref, lse_ref = naive_reference(*leaves, causal, scale)
    grads_ref = torch.autograd.grad(o_ref, leaves, do.double())
    o, lse = flash_forward(q, k, v, causal, scale, precision)
    grads = flash_backward(q, k, v, o, lse, do, causal, scale, precision)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o_t = FlashAttentionTorch.apply(*leaves, causal, scale)
    grads_t = torch.autograd.grad(o_t, leaves, do)
    triton_err = [relative_error(x, r) for x, r in zip((o, lse, *grads), (o_ref, lse_ref, *grads_ref))]
    torch_err = [relative_error(x, r) for x, r in zip((o_t, *grads_t), (o_ref, *grads_ref))]
    return triton_err, torch_err


TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # relative, by input dtype


def run_checks(device, dtypes):
    """Print a table of relative errors; return True when all are within the dtype's tolerance."""
    if device.type == "cuda":
        shapes = [(2, 4, 1024, 1024, 64, True), (1, 3, 517, 781, 32, False), (2, 4, 1000, 1000, 128, True),
                  (1, 2, 300, 300, 16, True)]
    else:  # the interpreter: small shapes, ragged lengths, Nq != Nk
        shapes = [(1, 2, 48, 48, 16, True), (1, 1, 40, 72, 32, False)]
    rows, ok = [], True
    for dtype in dtypes:
        # exact fp32 kernels compile slowly (unrolled FMA dots): two shapes are enough there
        for B, H, Nq, Nk, D, causal in shapes[:2] if dtype == torch.float32 else shapes:
            triton_err, torch_err = check_shape(B, H, Nq, Nk, D, dtype, causal, device)
            passed = max(triton_err + torch_err) < TOLERANCE[dtype]
            ok &= passed
            rows.append([f"{dtype_name(dtype)} B{B} H{H} Nq{Nq} Nk{Nk} D{D}{' causal' if causal else ''}",
                         *(f"{e:.1e}" for e in triton_err), f"{max(torch_err):.1e}", "ok" if passed else "FAIL"])
    print_table(["shape", "O err", "L err", "dQ err", "dK err", "dV err", "torch ref max err", "check"], rows)
    return ok


def dtype_name(dtype):
    return next(name for name, d in DTYPES.items() if d == dtype)


# --- 6. benchmark against SDPA's flash and cuDNN backends


def attention_flops(B, H, S, D, causal, mode):
    """FA convention: 4*B*H*S^2*D for the forward (two matmuls), halved for causal; backward 2.5x."""
    fwd = 4 * B * H * S * S * D / (2 if causal else 1)
    return fwd if mode == "fwd" else 3.5 * fwd


def make_impls():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def f(q, k, v, causal):
            with sdpa_kernel(backend):  # pinned: raises instead of silently falling back
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return f

    return {"ours": lambda q, k, v, causal: flash_attention(q, k, v, causal),
            "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}


def time_impl(f, B, H, S, D, dtype, causal):
    """(fwd ms, fwd+bwd ms) medians from do_bench, or None on OOM or when a backend cannot run."""
    q = k = v = do = None
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
        fwd = triton.testing.do_bench(lambda: f(q, k, v, causal), return_mode="median")
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        # autograd.grad rather than .backward(): no gradient accumulation kernels in the timing
        both = triton.testing.do_bench(lambda: torch.autograd.grad(f(q, k, v, causal), (q, k, v), do),
                                       return_mode="median")
        return fwd, both
    except (torch.OutOfMemoryError, RuntimeError) as e:
        print(f"  ({B}x{H}x{S}x{D}: {type(e).__name__}: {str(e).splitlines()[0][:80]})")
        return None
    finally:
        del q, k, v, do
        torch.cuda.empty_cache()


def run_benchmark(args, dtype):
    impls = make_impls()
    causal = not args.non_causal
    rows, headline = [], {}
    for D in args.head_dims:
        for S in args.seqs:
            B = max(1, args.tokens // S)
            times = {name: time_impl(f, B, args.heads, S, D, dtype, causal) for name, f in impls.items()}
            cells = []
            for mode, i in (("fwd", 0), ("fwd+bwd", 1)):
                flops = attention_flops(B, args.heads, S, D, causal, mode)
                for name in impls:
                    t = times[name]
                    cells.append("n/a" if t is None else f"{t[i]:.3f} / {flops / t[i] / 1e9:.0f}")
            rows.append([f"B{B} H{args.heads} S{S} D{D}", *cells])
            headline[(B, S, D)] = times
            print(f"  measured B={B} S={S} D={D}", flush=True)
    names = list(impls)
    print(f"\n{dtype_name(dtype)}, {'causal' if causal else 'non-causal'}; cells: median ms / TFLOP/s (FA convention)")
    print_table(["shape", *(f"fwd {n}" for n in names), *(f"fwd+bwd {n}" for n in names)], rows)
    return headline


# --- 7. autotune: time each candidate configuration per kernel and keep the fastest


def autotune_candidates(kernel):
    if kernel == "fwd":
        tiles = [(128, 64), (128, 128), (64, 64), (128, 32)]
    elif kernel == "dkdv":
        tiles = [(32, 128), (64, 128), (16, 128), (32, 64), (64, 64)]
    else:
        tiles = [(128, 32), (128, 64), (64, 32), (64, 64), (128, 16)]
    stages = (3, 4) if kernel == "fwd" else (2, 3)  # the backward holds more tiles per stage
    return [(bm, bn, w, s) for bm, bn in tiles for w in (4, 8) for s in stages]


def _autotune_inputs(B, H, S, D, dtype, causal):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    o, lse = flash_forward(q, k, v, causal)
    return q, k, v, o, lse, do


def _launch_candidate(kernel, config, inputs, causal):
    q, k, v, o, lse, do = inputs
    if kernel == "fwd":
        return flash_forward(q, k, v, causal, config=config)
    # dkdv and dq are timed through the whole backward (the other kernel at its default)
    return flash_backward(q, k, v, o, lse, do, causal, configs={kernel: config})


def _compile_candidates(job):
    """Worker: compile (by running once) a share of the candidates, filling Triton's disk cache."""
    shape, dtype, causal, candidates = job
    inputs = _autotune_inputs(*shape, dtype, causal)
    for kernel, config in candidates:
        try:
            _launch_candidate(kernel, config, inputs, causal)
        except Exception:
            pass  # reported when the main process times it
    torch.cuda.synchronize()


def autotune_shape(B, H, S, D, dtype, causal):
    """Winning (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel for one shape. Compiling is
    the slow part and is single-threaded in Triton, so worker processes compile in parallel first."""
    import multiprocessing

    candidates = [(kernel, c) for kernel in ("fwd", "dkdv", "dq") for c in autotune_candidates(kernel)]
    workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    jobs = [((B, H, S, D), dtype, causal, candidates[i::workers]) for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(_compile_candidates, jobs)
    inputs = _autotune_inputs(B, H, S, D, dtype, causal)
    winners = {}
    for kernel in ("fwd", "dkdv", "dq"):
        results = []
        for c in autotune_candidates(kernel):
            try:
                ms = triton.testing.do_bench(lambda: _launch_candidate(kernel, c, inputs, causal),
                                             return_mode="median")
                results.append((ms, c))
            except Exception as e:  # a tile that does not fit in shared memory or registers
                print(f"  {kernel} {c}: skipped ({type(e).__name__})")
        results.sort()
        winners[kernel] = results[0][1]
        print(f"  {kernel:5s} " + ", ".join(f"{c} {ms:.3f} ms" for ms, c in results[:5]), flush=True)
    return winners


# --- 8. main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="benchmark dtype")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seq for each seq")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--autotune", action="store_true", help="search tile configs per shape instead")
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()
    bad_dims = [d for d in args.head_dims if d not in HEAD_DIMS]
    if bad_dims:
        fail(f"head dim {bad_dims[0]} is not supported; use one of {HEAD_DIMS}")
    if min(args.seqs) < 1 or args.heads < 1 or args.tokens < 1:
        fail("--seqs, --heads and --tokens must be positive")
    dtype = DTYPES[args.dtype]

    if INTERPRETED:
        print("no CUDA GPU: running the kernels under TRITON_INTERPRET=1 on small shapes (seconds); "
              "no benchmark")
        ok = run_checks(torch.device("cpu"), [torch.float32, torch.float16])
        print(f"summary: correctness {'passed' if ok else 'FAILED'} on CPU (interpreter); benchmark needs a GPU")
        sys.exit(0 if ok else 1)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if args.autotune:
        for D in args.head_dims:
            for S in args.seqs:
                B = max(1, args.tokens // S)
                print(f"autotune {args.dtype} B={B} H={args.heads} S={S} D={D} causal={not args.non_causal}")
                winners = autotune_shape(B, args.heads, S, D, dtype, not args.non_causal)
                print(f"  winners D={D} S={S}: {winners}")
        print("summary: copy the winners into CONFIGS")
        return
    ok = True
    if not args.skip_checks:
        ok = run_checks(torch.device("cuda"), [torch.float32, torch.float16, torch.bfloat16])
    headline = run_benchmark(args, dtype)
    parts = []
    for (B, S, D), t in headline.items():
        if S == max(args.seqs) or (D == 128 and S == 4096):
            if t["ours"] and t["sdpa flash"] and t["sdpa cudnn"]:
                parts.append(f"S={S} D={D}: fwd+bwd {t['ours'][1]:.2f} ms = {t['ours'][1] / t['sdpa flash'][1]:.2f}x "
                             f"flash, {t['ours'][1] / t['sdpa cudnn'][1]:.2f}x cuDNN; fwd {t['ours'][0] / t['sdpa flash'][0]:.2f}x flash")
    checks = "skipped" if args.skip_checks else "passed" if ok else "FAILED"
    print(f"summary: checks {checks}; " + "; ".join(parts))


if __name__ == "__main__":
    main()
