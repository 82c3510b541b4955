"""FlashAttention-2, forward and backward, in Triton: the kernel lesson of nanoperf.

Attention never needs the (S, S) score matrix in memory: each program keeps a tile of queries on chip, streams
key/value tiles past it with an online softmax (a running max and sum) and writes O and the row logsumexp L once;
the backward recomputes P from Q, K and L, one kernel owning dQ per query tile, one dK/dV per key tile (no atomics).
Sections 1-4 are that lesson: the kernels, FlashAttention.apply(q, k, v, is_causal) launching them, the same loop in
PyTorch. Sections 5-6 are the fast path the model calls: on Hopper (triton 3.6), Gluon kernels in FlashAttention-3's
way (matmuls overlapped, a warp-specialized forward, a one-pass backward), and a plan kept per layout. The file
imports nothing from the repository: copy it and it runs.

    python flash_triton.py                 # the benchmark (on a CPU: the kernels against the reference)
    python flash_triton.py --shapes 8x16x2048x64 --plot flash.png
    python flash_triton.py --grid --plot grid.png   # the course's grid: ours, plain PyTorch, SDPA
    python flash_triton.py --tiles dkdv --dims 64   # every candidate tile of one kernel, timed in its pass
    o = FlashAttention.apply(q, k, v, True)  # the lesson; flash_attention_qkv(qkv, n_head): the model's fast path
"""

import argparse
import importlib.util
import itertools
import math
import os
import signal
import statistics
import sys
import time
from functools import partial

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Without a GPU the kernels run (slowly, in numpy) under TRITON_INTERPRET=1, set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import triton
import triton.language as tl

if INTERPRETED:  # triton <= 3.6's interpreter takes int() of a 1-element array for a loop bound,
    from triton.runtime import interpreter  # which numpy refuses: range(0, n, BLOCK) fails. As 3.9 does:

    def _patch_lang_tensor(tensor, scope, original=interpreter._patch_lang_tensor):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = _patch_lang_tensor

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)): exp2 is the native instruction
LOG2E_K = tl.constexpr(LOG2E)  # kernels may read globals only when they are constexpr
LN2_K = tl.constexpr(0.6931471805599453)


# --- 1. Triton forward: one program per (query tile, batch*head)


@triton.jit
def _rows(base, n_rows, stride, BLOCK: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
    # One head's (n_rows, D) matrix as a TMA descriptor (the copy engine computes the addresses
    # and fills rows past the end with zeros), or the plain pointer for per-thread addressing.
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, D], strides=[stride, 1], block_shape=[BLOCK, D])
    else:  # both branches return: the compiler must not see a pointer after a descriptor
        return base


@triton.jit
def _tile(src, start, n_rows, stride, BLOCK: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr,
          TMA: tl.constexpr, TRANS: tl.constexpr):
    # Rows start..start+BLOCK of a _rows matrix, as [BLOCK, D] or transposed [D, BLOCK]. Full tiles
    # load without a mask; only ragged or diagonal tiles pay for the bounds check.
    if TMA:
        t = src.load([start, 0])
        if TRANS:
            t = tl.trans(t)
    else:
        rows = start + tl.arange(0, BLOCK)
        if TRANS:
            ptrs, inside = src + rows[None, :] * stride + tl.arange(0, D)[:, None], rows[None, :] < n_rows
        else:
            ptrs, inside = src + rows[:, None] * stride + tl.arange(0, D)[None, :], rows[:, None] < n_rows
        if MASKED:
            t = tl.load(ptrs, mask=inside, other=0.0)
        else:
            t = tl.load(ptrs)
    return t


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, K, V, skn, svn, offs_m, lo, hi, Nk, qk_scale,
               CAUSAL: tl.constexpr, MASKED: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr, TMA: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _tile(K, start_n, Nk, skn, BLOCK_N, D, MASKED, TMA, False)
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
        alpha = tl.math.exp2(m_i - m_new)  # the online softmax: rescales what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile(V, start_n, Nk, svn, BLOCK_N, D, MASKED, TMA, False)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, L, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, H, Nq, Nk, qk_scale,
                     CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr, TMA: tl.constexpr):
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # causal: the unmasked stage ends on a key-tile boundary
    # Under torch.compile, Inductor launches these kernels and types Python floats as fp64; fp64
    # scales would turn the whole softmax fp64 (and tl.dot's fp32 accumulator a type error).
    qk_scale = tl.cast(qk_scale, tl.float32)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    if CAUSAL:  # the last query tiles see the most keys: start them first, for a shorter tail
        start_m = tl.cdiv(Nq, BLOCK_M) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    K = _rows(K + b * skb + h * skh, Nk, skn, BLOCK_N, D, TMA)
    V = _rows(V + b * svb + h * svh, Nk, svn, BLOCK_N, D, TMA)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :], mask=offs_m[:, None] < Nq, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # first the key tiles entirely visible and in bounds, unmasked; then the diagonal (causal) or ragged last tile
    if CAUSAL:
        full_end = start_m * BLOCK_M
        masked_end = tl.minimum(full_end + BLOCK_M, Nk)
    else:
        full_end = Nk // BLOCK_N * BLOCK_N
        masked_end = Nk
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, skn, svn, offs_m, 0, full_end, Nk, qk_scale,
                               CAUSAL, False, D, BLOCK_N, PRECISION, TMA)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, skn, svn, offs_m, full_end, masked_end, Nk, qk_scale,
                               CAUSAL, True, D, BLOCK_N, PRECISION, TMA)
    o = (acc / l_i[:, None]).to(O.dtype.element_ty)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], o, mask=offs_m[:, None] < Nq)
    tl.store(L + bh * Nq + offs_m, (m_i + tl.math.log2(l_i)) * LN2_K, mask=offs_m < Nq)

# takeaway: O and L are written once; the (S, S) scores only ever exist one tile at a time, on chip.

# --- 2. Triton backward: dQ (and D = rowsum(dO*O)) per query tile, then dK/dV per key tile


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, K, V, skn, svn, offs_m, lo, hi, Nk, qk_scale,
              CAUSAL: tl.constexpr, MASKED: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
              PRECISION: tl.constexpr, TMA: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # Key rows past Nk load as zeros: their dS multiplies a zero K row, so no score mask.
        kT = _tile(K, start_n, Nk, skn, BLOCK_N, D, MASKED, TMA, True)
        vT = _tile(V, start_n, Nk, svn, BLOCK_N, D, MASKED, TMA, True)
        p = tl.math.exp2(tl.dot(q, kT, input_precision=PRECISION) * qk_scale - lse2[:, None])
        if CAUSAL and MASKED:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = tl.dot(do, vT, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_dq_kernel(Q, K, V, O, DO, L, Delta, DQ, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                    sdb, sdh, sdn, sgb, sgh, sgn, H, Nq, Nk, qk_scale, scale,
                    CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DIAG: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    tl.static_assert(BLOCK_M % BLOCK_N == 0 and BLOCK_M % DIAG == 0)  # key slices tile the query tile
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)  # see _attn_fwd_kernel
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    if CAUSAL:  # as in the forward: the longest query tiles first
        start_m = tl.cdiv(Nq, BLOCK_M) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    K += b * skb + h * skh
    V += b * svb + h * svh
    Kt, Vt = _rows(K, Nk, skn, BLOCK_N, D, TMA), _rows(V, Nk, svn, BLOCK_N, D, TMA)
    Kd, Vd = _rows(K, Nk, skn, DIAG, D, TMA), _rows(V, Nk, svn, DIAG, D, TMA)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rows = offs_m[:, None] < Nq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdn + offs_d[None, :], mask=rows, other=0.0)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], mask=rows, other=0.0)
    # D = rowsum(dO * O) of the rows this program owns, left for the dK/dV kernel: no pass of its own
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh * Nq + offs_m, delta, mask=offs_m < Nq)
    lse2 = tl.load(L + bh * Nq + offs_m, mask=offs_m < Nq, other=float("inf")) * LOG2E_K
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:  # the diagonal in thin key slices, then every key tile left of it unmasked
        full_end = start_m * BLOCK_M
        dq = _dq_inner(dq, q, do, lse2, delta, Kd, Vd, skn, svn, offs_m, full_end, tl.minimum(full_end + BLOCK_M, Nk),
                       Nk, qk_scale, CAUSAL, True, D, DIAG, PRECISION, TMA)
    else:  # the ragged last key tile, masked, then the full ones
        full_end = Nk // BLOCK_N * BLOCK_N
        dq = _dq_inner(dq, q, do, lse2, delta, Kt, Vt, skn, svn, offs_m, full_end, Nk, Nk, qk_scale,
                       CAUSAL, True, D, BLOCK_N, PRECISION, TMA)
    dq = _dq_inner(dq, q, do, lse2, delta, Kt, Vt, skn, svn, offs_m, 0, full_end, Nk, qk_scale,
                   CAUSAL, False, D, BLOCK_N, PRECISION, TMA)
    dq_ptrs = DQ + b * sgb + h * sgh + offs_m[:, None] * sgn + offs_d[None, :]  # in q's layout (_grad_buffer)
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=rows)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, L, Delta, sqn, sdn, offs_n, lo, hi, Nq, qk_scale,
                CAUSAL: tl.constexpr, MASKED: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                PRECISION: tl.constexpr, TMA: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qT = _tile(Q, start_m, Nq, sqn, BLOCK_M, D, MASKED, TMA, True)
        # Rows past Nq get L = +inf, so their P is exactly 0 without a score mask.
        if MASKED:
            lse2 = tl.load(L + offs_m, mask=offs_m < Nq, other=float("inf")) * LOG2E_K
            delta = tl.load(Delta + offs_m, mask=offs_m < Nq, other=0.0)
        else:
            lse2 = tl.load(L + offs_m) * LOG2E_K
            delta = tl.load(Delta + offs_m)
        pT = tl.math.exp2(tl.dot(k, qT, input_precision=PRECISION) * qk_scale - lse2[None, :])
        if CAUSAL and MASKED:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        do = _tile(DO, start_m, Nq, sdn, BLOCK_M, D, MASKED, TMA, False)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_dkdv_kernel(Q, K, V, DO, L, Delta, DKV, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
                      sdb, sdh, sdn, sgb, sgh, sgn, off_k, off_v, H, Nq, Nk, qk_scale, scale,
                      CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      DIAG: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    tl.static_assert(BLOCK_N % BLOCK_M == 0 and BLOCK_N % DIAG == 0)  # query slices tile the key tile
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)  # see _attn_fwd_kernel
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    Q += b * sqb + h * sqh
    DO += b * sdb + h * sdh
    Qt, DOt = _rows(Q, Nq, sqn, BLOCK_M, D, TMA), _rows(DO, Nq, sdn, BLOCK_M, D, TMA)
    Qd, DOd = _rows(Q, Nq, sqn, DIAG, D, TMA), _rows(DO, Nq, sdn, DIAG, D, TMA)
    L += bh * Nq
    Delta += bh * Nq
    # with causal, key tile 0 sees every query: program order already starts the heaviest first
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    rows = offs_n[:, None] < Nk
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :], mask=rows, other=0.0)
    v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :], mask=rows, other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    full_end = Nq // BLOCK_M * BLOCK_M
    if CAUSAL:
        # the diagonal in thin query slices (less masked work), the tiles below unmasked, a ragged last one
        dk, dv = _dkdv_inner(dk, dv, k, v, Qd, DOd, L, Delta, sqn, sdn, offs_n, start_n,
                             tl.minimum(start_n + BLOCK_N, Nq), Nq, qk_scale, CAUSAL, True, D, DIAG, PRECISION, TMA)
        full_start = start_n + BLOCK_N
    else:
        full_start = 0
    dk, dv = _dkdv_inner(dk, dv, k, v, Qt, DOt, L, Delta, sqn, sdn, offs_n, full_start, full_end, Nq,
                         qk_scale, CAUSAL, False, D, BLOCK_M, PRECISION, TMA)
    dk, dv = _dkdv_inner(dk, dv, k, v, Qt, DOt, L, Delta, sqn, sdn, offs_n, tl.maximum(full_start, full_end),
                         Nq, Nq, qk_scale, CAUSAL, True, D, BLOCK_M, PRECISION, TMA)
    out = DKV + b * sgb + h * sgh + offs_n[:, None] * sgn + offs_d[None, :]  # dK and dV: one tensor, two offsets
    tl.store(out + off_k, (dk * scale).to(DKV.dtype.element_ty), mask=rows)
    tl.store(out + off_v, dv.to(DKV.dtype.element_ty), mask=rows)

# takeaway: the backward recomputes P from L, and each gradient has one owner: no atomics, deterministic.

# --- 3. the autograd.Function: FlashAttention.apply(q, k, v, is_causal) launches the kernels itself

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim, 16-bit inputs; dkdv iterates BLOCK_M query slices
# over its key tile, dq BLOCK_N key slices. From @triton.autotune on an H100 (bf16, causal; D16 keeps D64's).
D64_TILES = {"fwd": (128, 64, 8, 3), "dkdv": (64, 64, 4, 3), "dq": (128, 64, 4, 2)}
TUNED = {16: D64_TILES, 32: {"fwd": (64, 64, 4, 3), "dkdv": (32, 64, 4, 3), "dq": (64, 64, 4, 3)}, 64: D64_TILES,
         128: {"fwd": (128, 128, 8, 3), "dkdv": (64, 64, 4, 2), "dq": (128, 64, 8, 3)}}
# fp32: twice the shared memory, exact dots on CUDA cores; small interpreter tiles cross many boundaries
FP32_TILES = {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}
INTERPRETER_TILES = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}


def tiles_for(dtype, D):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of each kernel for inputs of this dtype and head dim. Section 6's
    plans take smaller 16-bit tiles up to SHORT_SEQ tokens, where they measured faster."""
    if INTERPRETED:
        return INTERPRETER_TILES
    if dtype == torch.float32:
        return FP32_TILES
    return TUNED[D]


def torch_fp32_precision():  # newer torch has fp32_precision, and reading allow_tf32 there warns
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        tf32 = m.fp32_precision == "tf32"
    else:
        tf32 = m.allow_tf32
    return "tf32" if tf32 else "ieee"


def _precision(q, precision):
    # only fp32 dots have a choice; 16-bit inputs always take the tensor cores' native path. Reading torch's
    # setting only for fp32 keeps torch.compile's graph whole.
    if q.dtype != torch.float32:
        return "tf32"
    if precision is None:
        return torch_fp32_precision()
    return precision


def _default_scale(D):
    # 1/sqrt(D) as a plain float, D found among HEAD_DIMS by value: while torch.compile traces symbolic shapes D is a
    # symbol, and a symbolic float passed to a Triton kernel was typed as an integer by inductor (torch 2.11)
    for d in HEAD_DIMS:
        if d == D:
            return d**-0.5
    raise ValueError(f"head dim {D} is not supported; use one of {HEAD_DIMS}")  # (check_inputs says so first)


def _as_4d(t):
    # (batch, seq, d) -> (batch, 1, seq, d), (..., heads, seq, d) -> (batch, heads, seq, d); last dim contiguous
    if t.dim() != 4:
        t = t.unsqueeze(1) if t.dim() == 3 else t.flatten(0, -4)
    return t if t.stride(-1) == 1 else t.contiguous()


def check_inputs(q, k, v, causal, precision=None):
    """ValueError, in one sentence, for shapes attention cannot take (with a precision: or the kernels)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise ValueError("q, k and v must be torch tensors")
    if q.dim() < 3 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k, v must all be (batch, seq, d), (batch, heads, seq, d) or more leading dims; "
                         f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-2] == 0 or k.shape[-2] == 0 or q.numel() == 0:
        raise ValueError("sequence length and batch must be at least 1")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs equal query and key lengths, got {q.shape[-2]} and {k.shape[-2]}")
    if precision is None:  # the PyTorch reference takes any head dim, dtype and device
        return
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[-1]} is not supported; use one of {HEAD_DIMS}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES.values():
        raise ValueError(f"q, k, v must share one dtype among fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"tensors on {q.device} need TRITON_INTERPRET=1 (set before triton is imported); "
                         "the kernels run on CUDA GPUs")
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"precision must be 'ieee' (exact fp32 dot) or 'tf32', got '{precision}'")


class FlashAttention(torch.autograd.Function):
    """FlashAttention-2 as an autograd op, the course's interface: apply(q, k, v, is_causal=False, scale=None,
    precision=None) on (..., seq, d) tensors. Each call checks, picks tiles, computes the grid and launches the
    kernels above with kernel[grid](...). Saves q, k, v, O and the fp32 logsumexp L (q's shape less its last
    dimension): the backward recomputes P from them, nothing (S, S) is kept. The model calls the same kernels
    through section 6's flash_attention, which works all this out once per layout."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, precision=None):
        check_inputs(q, k, v, is_causal, precision or "ieee")  # None: torch's setting, read next (fp32 only)
        precision = _precision(q, precision)
        if scale is None:
            scale = _default_scale(q.shape[-1])
        q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)  # (..., S, D) -> (B, H, S, D): a (b, h, n) stride each
        B, H, Nq, D = q4.shape
        Nk = k4.shape[2]
        o = torch.empty(B, H, Nq, D, device=q.device, dtype=q.dtype)
        lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)  # L, a row per query (B*H, Nq) for the kernel
        bm, bn, warps, stages = tiles_for(q.dtype, D)["fwd"]
        grid = (triton.cdiv(Nq, bm), B * H)  # a program per (query tile, batch*head)
        # the kernels take exp2, so the scale comes with log2(e) folded in. TMA=False: tiles load through plain
        # pointers (section 6's plans load D128's through the copy engine's descriptors)
        _attn_fwd_kernel[grid](q4, k4, v4, o, lse, *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3],
                               *o.stride()[:3], H, Nq, Nk, scale * LOG2E, CAUSAL=is_causal, D=D, BLOCK_M=bm,
                               BLOCK_N=bn, PRECISION=precision, TMA=False, num_warps=warps, num_stages=stages)
        o, lse = o.view(q.shape), lse.view(q.shape[:-1])  # (B, H, S, D) -> the caller's (..., S, D), and L (..., S)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.precision = is_causal, scale, precision
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        q4, k4, v4, o4, do4 = map(_as_4d, (q, k, v, o, do))  # (B, H, S, D) each
        B, H, Nq, D = q4.shape
        Nk = k4.shape[2]
        tiles = tiles_for(q.dtype, D)
        delta = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)  # rowsum(dO * O), a row per query
        dq = torch.empty(B, H, Nq, D, device=q.device, dtype=q.dtype)
        dkv = torch.empty(2, B, H, Nk, D, device=k.device, dtype=k.dtype)  # dK and dV in one tensor: dV at stride(0)
        tail = (H, Nq, Nk, ctx.scale * LOG2E, ctx.scale)
        meta = dict(CAUSAL=ctx.causal, D=D, PRECISION=ctx.precision, TMA=False)
        # dQ first, a program per query tile: it also writes Delta, which every dK/dV program reads. DIAG: the
        # causal diagonal's sub-tile, half of the dimension that iterates (at least a dot's 16): less masked work
        bm, bn, warps, stages = tiles["dq"]
        _attn_dq_kernel[(triton.cdiv(Nq, bm), B * H)](
            q4, k4, v4, o4, do4, lse, delta, dq, *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3],
            *o4.stride()[:3], *do4.stride()[:3], *dq.stride()[:3], *tail, BLOCK_M=bm, BLOCK_N=bn,
            DIAG=max(bn // 2, 16), num_warps=warps, num_stages=stages, **meta)
        # then dK and dV, a program per key tile
        bm, bn, warps, stages = tiles["dkdv"]
        _attn_dkdv_kernel[(triton.cdiv(Nk, bn), B * H)](
            q4, k4, v4, do4, lse, delta, dkv, *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3],
            *do4.stride()[:3], *dkv.stride()[1:4], 0, dkv.stride(0), *tail, BLOCK_M=bm, BLOCK_N=bn,
            DIAG=max(bm // 2, 16), num_warps=warps, num_stages=stages, **meta)
        dk, dv = dkv.unbind(0)
        # (B, H, S, D) -> the caller's shapes; None for is_causal, scale and precision
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), None, None, None

# takeaway: the Function is glue: check the inputs, pick tiles, compute each grid, launch. It saves only q, k, v,
# O and L; the backward launches dQ's kernel first because dK/dV's reads the Delta it writes.

# --- 4. the reference: FlashAttention-2 tile by tile in plain PyTorch, on (..., seq, d) tensors


def _torch_forward(q, k, v, causal, scale, block=64):
    """O and L (natural-log logsumexp of the scaled scores, fp32, shaped like q without its last
    dimension) by the FA2 forward loop: per query tile, an online softmax over key tiles."""
    q, k, v = q.float(), k.float(), v.float()
    Nq, Nk = q.shape[-2], k.shape[-2]
    o, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    for i in range(0, Nq, block):
        qi = q[..., i : i + block, :]
        rows = torch.arange(i, i + qi.shape[-2], device=q.device)
        m = q.new_full(qi.shape[:-1], -math.inf)
        l, acc = torch.zeros_like(m), torch.zeros_like(qi)
        for j in range(0, min(Nk, i + block) if causal else Nk, block):  # skip tiles above the diagonal
            s = (qi @ k[..., j : j + block, :].transpose(-1, -2)) * scale
            if causal:
                cols = torch.arange(j, j + s.shape[-1], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)  # rescales what was summed under the old max
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[..., j : j + block, :]
            m = m_new
        o[..., i : i + block, :] = acc / l[..., None]
        lse[..., i : i + block] = m + torch.log(l)
    return o, lse


class FlashAttentionTorch(torch.autograd.Function):
    """The readable reference: the tiled forward, a backward that recomputes P from L; FlashAttention's apply."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, precision=None):
        check_inputs(q, k, v, is_causal)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        o, lse = _torch_forward(q, k, v, is_causal, scale)
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = is_causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        """The FA2 backward equations, with P = exp(S - L) recomputed from the saved L rather than
        stored: dV = P^T dO, dP = dO V^T, dS = P * (dP - D) with D = rowsum(dO * O), dQ = scale dS K,
        dK = scale dS^T Q. (Here in one piece; the kernels go tile by tile.)"""
        q, k, v, o, lse = ctx.saved_tensors
        qf, kf, vf, o, do = (t.float() for t in (q, k, v, o, do))
        p = torch.exp((qf @ kf.transpose(-1, -2)) * ctx.scale - lse[..., None])
        if ctx.causal:
            p = p.masked_fill(torch.ones(p.shape[-2:], dtype=torch.bool, device=p.device).triu(1), 0.0)
        ds = p * (do @ vf.transpose(-1, -2) - (do * o).sum(-1, keepdim=True)) * ctx.scale
        dq, dk, dv = ds @ kf, ds.transpose(-1, -2) @ qf, p.transpose(-1, -2) @ do
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None

# takeaway: the same online softmax in a dozen lines of PyTorch, the yardstick for every kernel test.

# --- 5. Hopper: the forward and the backward in Gluon, matmuls overlapped (FlashAttention-3's way)
#
# Hopper's tensor cores run asynchronously: wgmma is issued, the warpgroup goes on, and a wait retires
# it. Triton retires every matmul whose result is not a loop-carried accumulator at once (its IR puts
# `warp_group_dot_wait {pendings = 0}` straight after S's and dP's dots), so above the tensor cores sit
# idle while the warpgroup computes exp2 and dS. Gluon, Triton's lower-level dialect, leaves the schedule
# to the kernel: shared memory, TMA copies and their mbarriers, and each wgmma's issue and wait are
# written out. Per tile: issue S and dP back to back, wait for S only (wait(1)), compute P while dP runs,
# wait for dP, compute dS, issue the gradient's matmul and leave it running into the next tile. The
# forward does the same a tile apart (issue S_t and P_{t-1} V_{t-1}, wait for S_t only, compute tile t's
# softmax while the tensor cores multiply tile t-1's P by V) and is also warp-specialized, as
# FlashAttention-3's is: a producer partition only issues TMA copies, two consumer warpgroups only compute,
# each at its own pace, and they meet only at the rings' mbarriers. At head dim 64 (at 128 on long sequences)
# the backward also runs in one pass: the dK/dV loop computes each query slice's dQ share too and the copy
# engine adds it into an fp32 dQ (TMA reduce-add), five matmuls a tile instead of the two passes' seven. Used on
# Hopper for 16-bit inputs of head dim 64 or 128 when called eagerly (GLUON_PASSES says which pass where: each
# where it measured faster); torch.compile traces the Triton kernels above.

try:  # Gluon, Triton's lower-level dialect. Experimental: its API moves between releases.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon.language._core import builtin  # (for the TMA reduce-add below)
    from triton._C.libtriton import ir
    # written and measured with triton 3.6 (3.9 renamed its copies), never under the interpreter
    GLUON = triton.__version__.startswith("3.6.") and not INTERPRETED
except ImportError:  # an older triton: the decorators below only wrap the Gluon kernels, which never run
    gluon, gl, GLUON = triton, tl, False

    def builtin(fn):
        return fn


@gluon.jit
def _online_softmax(s, m_i, offs_m, offs_n, Nk, qk_scale, causal, MASKED: gl.constexpr):
    # _fwd_inner's softmax step on one score tile: P (fp32, not yet normalized) and the new running row max.
    # `causal` is a value, not a constexpr: a warp-specialized partition gets its arguments as values (triton 3.6).
    if MASKED:
        keep = (offs_n[None, :] < Nk) & ((offs_m[:, None] >= offs_n[None, :]) | (causal == 0))
        s = gl.where(keep, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
    return p, m_new


@gluon.jit
def _fwd_producer(q_desc, k_desc, v_desc, smem, bars, b, h, off_m, n_tiles):
    # The producer partition: the consumers' two Q tiles, then key tile t's K and V into ring stage t % STAGES as
    # soon as both consumers have released the tile that was there (the empty barriers count two arrivals)
    q_smem, k_smem, v_smem = smem
    q_ready, k_ready, v_ready, k_empty, v_empty = bars
    STAGES: gl.constexpr = k_smem.type.shape[0]  # (constexprs read off the buffers' shapes)
    BLOCK_N: gl.constexpr = k_smem.type.shape[3]
    ROWS: gl.constexpr = q_smem.type.shape[3]
    for c in gl.static_range(2):
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, off_m + c * ROWS, 0], q_ready.index(c), q_smem.index(c))
    for t in range(n_tiles):
        stage = t % STAGES
        phase = (t // STAGES) & 1
        mbarrier.wait(k_empty.index(stage), phase ^ 1)  # fresh barriers count as released: no wait on the first pass
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, h, t * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, h, t * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _fwd_consumer(o_desc, smem, bars, L, bh, b, h, off_m, n_tiles, full, Nq, Nk, qk_scale, causal, c):
    # A consumer partition (one warpgroup): rows off_m + c*ROWS .. +ROWS of the query tile against every key tile.
    # Per tile t: issue S_t and P_{t-1} V_{t-1}, wait for S_t only, release K_t, compute tile t's softmax while
    # P_{t-1} V_{t-1} runs, wait for it, release V_{t-1}, rescale O.
    q_smem, k_smem, v_smem = smem
    q_ready, k_ready, v_ready, k_empty, v_empty = bars
    dtype: gl.constexpr = q_smem.dtype
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[3]
    ROWS: gl.constexpr = q_smem.type.shape[3]
    D: gl.constexpr = q_smem.type.shape[4]
    # register layouts: S is a [ROWS, BLOCK_N] wgmma accumulator, O [ROWS, D]; P feeds P V from registers
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_m = off_m + c * ROWS + gl.arange(0, ROWS, layout=row_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    q_t = q_smem.index(c).reshape([ROWS, D])

    # tile 0 alone (every row sees key 0): its scores and softmax start the running max m_i and sum l_i
    mbarrier.wait(q_ready.index(c), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_t, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), zero_s, use_acc=False)
    mbarrier.arrive(k_empty.index(0), count=1)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    if full > 0:
        p, m_i = _online_softmax(s, m_i, offs_m, cols, Nk, qk_scale, causal, False)
    else:
        p, m_i = _online_softmax(s, m_i, offs_m, cols, Nk, qk_scale, causal, True)
    l_i = gl.sum(p, 1)
    p = gl.convert_layout(p.to(dtype), p_layout)  # carried into the next tile as P V's 16-bit A operand
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)

    for t in range(1, n_tiles):
        ks = t % STAGES
        vs = (t - 1) % STAGES
        mbarrier.wait(k_ready.index(ks), (t // STAGES) & 1)
        s = warpgroup_mma(q_t, k_smem.index(ks).reshape([BLOCK_N, D]).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        mbarrier.wait(v_ready.index(vs), ((t - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(vs).reshape([BLOCK_N, D]), acc, is_async=True)  # P_{t-1} V_{t-1}
        s = warpgroup_mma_wait(1, deps=(s, ))  # S_t done; P_{t-1} V_{t-1} still running, under this softmax
        mbarrier.arrive(k_empty.index(ks), count=1)
        if t >= full:
            p_t, m_new = _online_softmax(s, m_i, offs_m, t * BLOCK_N + cols, Nk, qk_scale, causal, True)
        else:
            p_t, m_new = _online_softmax(s, m_i, offs_m, t * BLOCK_N + cols, Nk, qk_scale, causal, False)
        alpha = gl.exp2(m_i - m_new)  # rescales what was summed under the old max
        l_i = l_i * alpha + gl.sum(p_t, 1)
        m_i = m_new
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(vs), count=1)
        acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
        p = gl.convert_layout(p_t.to(dtype), p_layout)

    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(last).reshape([BLOCK_N, D]), acc)
    q_t.store((acc / gl.convert_layout(l_i, o_row_layout)[:, None]).to(dtype))  # O out through this Q's buffer
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, off_m + c * ROWS, 0], q_smem.index(c))  # past Nq: clipped
    gl.store(L + bh * Nq + offs_m, (m_i + gl.log2(l_i)) * LN2_K, mask=offs_m < Nq)
    tma.store_wait(pendings=0)


@gluon.jit
def _fwd_gluon_kernel(q_desc, k_desc, v_desc, o_desc, L, H, Nq, Nk, qk_scale, CAUSAL: gl.constexpr,
                      D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr):
    # _attn_fwd_kernel's work for one query tile of BLOCK_M rows, warp-specialized: a producer partition (the
    # default one, 4 warps) only issues TMA copies; two consumer warpgroups of BLOCK_M/2 rows each only compute.
    # No warp waits for another except through the ring's mbarriers, so while one consumer is in its softmax
    # the other's matmuls can have the tensor cores.
    ROWS: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_desc.dtype
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    if CAUSAL:  # the longest query tiles first
        start_m = gl.cdiv(Nq, BLOCK_M) - 1 - gl.program_id(0)
    else:
        start_m = gl.program_id(0)
    off_m = start_m * BLOCK_M
    # key tiles 0 .. n_tiles-1; those from `full` on are masked (the diagonal, or a ragged last tile)
    if CAUSAL:
        n_tiles = gl.cdiv(gl.minimum(off_m + BLOCK_M, Nk), BLOCK_N)
        full = gl.minimum(off_m, Nk) // BLOCK_N
    else:
        n_tiles = gl.cdiv(Nk, BLOCK_N)
        full = Nk // BLOCK_N

    # shared memory: each consumer's Q tile (O leaves through it), rings of K and V tiles; ready barriers flip
    # when a copy lands, empty ones when both consumers are done with a stage
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival from each consumer
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()  # the barriers' initialization, visible to the copy engine

    smem = (q_smem, k_smem, v_smem)
    bars = (q_ready, k_ready, v_ready, k_empty, v_empty)
    qk_scale = qk_scale.to(gl.float32)
    gl.warp_specialize([
        (_fwd_producer, (q_desc, k_desc, v_desc, smem, bars, b, h, off_m, n_tiles)),
        (_fwd_consumer, (o_desc, smem, bars, L, bh, b, h, off_m, n_tiles, full, Nq, Nk, qk_scale, CAUSAL, 0)),
        (_fwd_consumer, (o_desc, smem, bars, L, bh, b, h, off_m, n_tiles, full, Nq, Nk, qk_scale, CAUSAL, 1)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])  # each consumer's warps, and its registers a thread


@gluon.jit
def _key_start(t, n_diag, diag_start, BLOCK_N: gl.constexpr):
    # the t-th key tile a dQ program visits: the diagonal ones first (from diag_start), then 0, BLOCK_N, ...
    if t < n_diag:
        start = diag_start + t * BLOCK_N
    else:
        start = (t - n_diag) * BLOCK_N
    return start


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, ready, t, n_tiles, n_diag, diag_start, b, h,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    # the copy engine loads key tile t (if there is one) into ring stage t % NUM_STAGES; ready[stage] flips when done
    stage = t % NUM_STAGES
    pred = t < n_tiles
    start = _key_start(t, n_diag, diag_start, BLOCK_N)
    bar = ready.index(stage)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [b, h, start, 0], bar, k_smem.index(stage), pred)
    tma.async_copy_global_to_shared(v_desc, [b, h, start, 0], bar, v_smem.index(stage), pred)


@gluon.jit
def _dq_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, O, L, Delta, sob, soh, son, H, Nq, Nk,
                     qk_scale, scale, CAUSAL: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    # _attn_dq_kernel's work (Delta, then dQ of one query tile) with one warpgroup of 4 warps, BLOCK_M = 64 rows.
    # The descriptors are 4-D over (B, H, S, D) with the tensors' own strides: rows past S read as zeros and
    # stores past S are clipped, for the model's head-transposed layout too.
    gl.static_assert(BLOCK_M == 16 * gl.num_warps(), "each warp owns 16 query rows")
    dtype: gl.constexpr = q_desc.dtype
    qk_scale = qk_scale.to(gl.float32)
    scale = scale.to(gl.float32)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    if CAUSAL:  # the longest query tiles first
        start_m = gl.cdiv(Nq, BLOCK_M) - 1 - gl.program_id(0)
    else:
        start_m = gl.program_id(0)
    off_m = start_m * BLOCK_M

    # register layouts: S and dP are [BLOCK_M, BLOCK_N] wgmma accumulators, dQ [BLOCK_M, D]; dS feeds dQ's
    # wgmma from registers (its A operand)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                        instr_shape=[16, D, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])  # 16-byte loads of O, dO

    # shared memory: Q and dO once; a ring of K and V tiles; the descriptors' blocks are [1, 1, rows, D]
    q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, D], v_desc.layout)
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(qbar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()  # the barriers' initialization, visible to the copy engine

    if CAUSAL:  # the diagonal (masked) tiles, then every tile left of it
        diag_start = off_m // BLOCK_N * BLOCK_N  # a key tile may be wider than the query tile (D64: 128 keys)
        n_diag = gl.maximum(gl.cdiv(gl.minimum(off_m + BLOCK_M, Nk) - diag_start, BLOCK_N), 0)
        n_tiles = n_diag + gl.cdiv(gl.minimum(diag_start, Nk), BLOCK_N)
    else:
        diag_start = 0
        n_diag = 0
        n_tiles = gl.cdiv(Nk, BLOCK_N)

    mbarrier.expect(qbar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, off_m, 0], qbar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [b, h, off_m, 0], qbar, do_smem)
    for i in gl.static_range(NUM_STAGES - 1):  # the first key tiles in flight
        _issue_kv(k_desc, v_desc, k_smem, v_smem, ready, i, n_tiles, n_diag, diag_start, b, h, BLOCK_N, NUM_STAGES)

    # Delta = rowsum(dO * O) of this tile's rows, for the loop and for the dK/dV kernel
    rows_b = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    cols_b = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    o = gl.load(O + b * sob + h * soh + rows_b[:, None] * son + cols_b[None, :], mask=rows_b[:, None] < Nq,
                other=0.0)
    q2d = q_smem.reshape([BLOCK_M, D])
    do2d = do_smem.reshape([BLOCK_M, D])
    mbarrier.wait(qbar, 0)
    delta_b = gl.sum(o.to(gl.float32) * do2d.load(blk).to(gl.float32), axis=1)
    gl.store(Delta + bh * Nq + rows_b, delta_b, mask=rows_b < Nq)
    delta = gl.convert_layout(delta_b, row_layout)
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
    lse2 = gl.load(L + bh * Nq + offs_m, mask=offs_m < Nq, other=float("inf")) * LOG2E_K  # rows past Nq: P = 0

    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, D], gl.float32, dq_layout))
    for j in range(n_tiles):
        stage = j % NUM_STAGES
        mbarrier.wait(ready.index(stage), (j // NUM_STAGES) & 1)
        kt = k_smem.index(stage).reshape([BLOCK_N, D])
        vt = v_smem.index(stage).reshape([BLOCK_N, D])
        s = warpgroup_mma(q2d, kt.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do2d, vt.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s, dq = warpgroup_mma_wait(1, deps=(s, dq))  # S and dQ_{j-1} done (they retire in order); dP in flight
        gl.thread_barrier()  # every warp is past tile j-1's dQ matmul: its ring stage may be overwritten
        _issue_kv(k_desc, v_desc, k_smem, v_smem, ready, j + NUM_STAGES - 1, n_tiles, n_diag, diag_start, b, h,
                  BLOCK_N, NUM_STAGES)
        p = gl.exp2(s * qk_scale - lse2[:, None])  # while dP runs; key rows past Nk are zeros: no mask needed
        if CAUSAL:
            if j < n_diag:
                offs_n = diag_start + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
                p = gl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        ds = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), ds_layout)
        dq = warpgroup_mma(ds, kt, dq, is_async=True)  # left running into the next tile's S and dP
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    mbarrier.invalidate(qbar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    q2d.store((dq * scale).to(dtype))  # dQ * scale out through Q's buffer, which no matmul reads any more
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [b, h, off_m, 0], q_smem)
    tma.store_wait(pendings=0)


@triton.jit
def _delta_kernel(O, DO, Delta, sob, soh, son, sdb, sdh, sdn, H, Nq, D: tl.constexpr, BLOCK: tl.constexpr):
    # Delta = rowsum(dO * O) of BLOCK rows: the one-pass backward reads every query slice's before any dQ exists
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    mask = rows[:, None] < Nq
    o = tl.load(O + (bh // H) * sob + (bh % H) * soh + rows[:, None] * son + cols[None, :], mask=mask, other=0.0)
    do = tl.load(DO + (bh // H) * sdb + (bh % H) * sdh + rows[:, None] * sdn + cols[None, :], mask=mask, other=0.0)
    tl.store(Delta + bh * Nq + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=rows < Nq)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    # cp.reduce.async.bulk.tensor ... .add: the copy engine adds a shared-memory tile into global memory (the add
    # happens in L2). triton 3.6's Gluon builder has the op; its language does not expose it yet, so this calls the
    # builder directly (a private API: check it when triton moves).
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _dkdv_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dqa_desc, L, Delta, H, Nq, qk_scale, scale,
                       CAUSAL: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_STAGES: gl.constexpr, ONE_PASS: gl.constexpr):
    # _attn_dkdv_kernel's work for one key tile of BLOCK_N = 64 keys (one warpgroup), query slices of BLOCK_M
    # streaming through a ring; P^T and dS^T feed dV's and dK's matmuls from registers, as P does in the forward.
    # ONE_PASS: the whole backward, FlashAttention-3's way. Each slice's share of dQ from this key tile,
    # dQ^T_j = K^T dS^T_j, goes to the copy engine, which adds it into an fp32 dQ in global memory (TMA reduce-add,
    # into dqa_desc): the dQ pass and its recomputed S, P and dP are gone, five matmuls a tile instead of seven.
    # The adds from different key tiles land in whatever order they arrive: dQ is not bitwise reproducible.
    # Launched with 8 warps (GLUON_TILES: D128's one pass) a program takes 128 keys, two warpgroups of 64, as
    # cuDNN's backward does: dQ^T's matmul sums over all 128 keys, each warpgroup computing half of the slice's
    # queries.
    gl.static_assert(BLOCK_N == 16 * gl.num_warps(), "each warp owns 16 key rows")
    dtype: gl.constexpr = q_desc.dtype
    qk_scale = qk_scale.to(gl.float32)
    scale = scale.to(gl.float32)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    start_n = gl.program_id(0) * BLOCK_N
    L += bh * Nq
    Delta += bh * Nq

    # register layouts: S^T and dP^T are [BLOCK_N, BLOCK_M] wgmma accumulators, dK and dV [BLOCK_N, D], dQ^T
    # [D, BLOCK_M] (with two warpgroups, split between them along the queries). ONE_PASS with one warpgroup takes
    # every A operand from registers: K and V (loaded once) for S^T and dP^T, K^T for dQ^T (dS^T, its B operand,
    # goes through shared memory); the two passes, and two warpgroups (short of registers), read them from
    # shared memory.
    WARPGROUPS: gl.constexpr = gl.num_warps() // 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                        instr_shape=[16, D, 16])
    dqt_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WARPGROUPS],
                                                         instr_shape=[16, BLOCK_M // WARPGROUPS, 16])
    pds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)  # P^T, dS^T
    kv_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)  # K, V
    kt_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dqt_layout, k_width=2)  # K^T
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # along the query slice
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # along the key tile
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])  # L, Delta: one register each

    # shared memory: K and V once; a ring of Q and dO slices; ONE_PASS: dS^T and two fp32 dQ tiles, one filling
    # while the copy engine reads the other
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, D], do_desc.layout)
    if ONE_PASS:
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, D], dqa_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, h, start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b, h, start_n, 0], kv_bar, v_smem)
    if CAUSAL:  # query slices before the key tile see none of it
        lo = start_n
    else:
        lo = 0
    n_iter = (Nq - lo + BLOCK_M - 1) // BLOCK_M  # <= 0 when lo >= Nq: dK = dV = 0 (and nothing added to dQ)
    slice_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
    for i in gl.static_range(NUM_STAGES - 1):  # the first query slices in flight
        mbarrier.expect(ready.index(i), slice_bytes, pred=i < n_iter)
        tma.async_copy_global_to_shared(q_desc, [b, h, lo + i * BLOCK_M, 0], ready.index(i), q_smem.index(i),
                                        pred=i < n_iter)
        tma.async_copy_global_to_shared(do_desc, [b, h, lo + i * BLOCK_M, 0], ready.index(i), do_smem.index(i),
                                        pred=i < n_iter)

    offs_n = start_n + gl.arange(0, BLOCK_N, layout=row_layout)
    zeros_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    # The zero accumulators pass through a (no-op) wait, which defines their registers before the loop: a register
    # of an in-flight wgmma defined otherwise on some path to its wait (here: the loop's zero-trip exit) makes
    # ptxas serialize every wgmma of the kernel (its warning C7515).
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(gl.zeros([BLOCK_N, D], gl.float32, kv_layout),
                                                         gl.zeros([BLOCK_N, D], gl.float32, kv_layout)))
    dk = warpgroup_mma_init(dk)
    dv = warpgroup_mma_init(dv)
    k_t = k_smem.reshape([BLOCK_N, D])
    v_t = v_smem.reshape([BLOCK_N, D])
    mbarrier.wait(kv_bar, 0)
    if ONE_PASS:
        zeros_qt = gl.zeros([D, BLOCK_M], gl.float32, dqt_layout)
    if ONE_PASS and WARPGROUPS == 1:
        k_a = k_t.load(kv_a)
        v_a = v_t.load(kv_a)
        kt = k_t.permute((1, 0)).load(kt_a)  # dQ^T's A operand
    else:
        k_a = k_t
        v_a = v_t
        kt = k_t.permute((1, 0))

    # L and Delta of a query slice (one register each), loaded a slice ahead; rows past Nq: L = +inf, so P^T = 0
    offs_v = lo + gl.arange(0, BLOCK_M, layout=vec_layout)
    l_next = gl.load(L + offs_v, mask=offs_v < Nq, other=float("inf"))
    delta_next = gl.load(Delta + offs_v, mask=offs_v < Nq, other=0.0)
    for j in range(n_iter):
        start_m = lo + j * BLOCK_M
        stage = j % NUM_STAGES
        l_v = l_next
        delta_v = delta_next
        offs_v = start_m + BLOCK_M + gl.arange(0, BLOCK_M, layout=vec_layout)
        l_next = gl.load(L + offs_v, mask=offs_v < Nq, other=float("inf"))
        delta_next = gl.load(Delta + offs_v, mask=offs_v < Nq, other=0.0)
        if WARPGROUPS > 1:
            # S^T's and dP^T's accumulators start at -L/scale and -Delta (down every key row), so the matmuls
            # return S^T - L/scale and dP^T - Delta: the two columns (16 values a thread) live only until the
            # matmuls are issued, not across the exponentials, which two warpgroups are short of registers for
            s_start = zeros_s - gl.convert_layout(l_v / scale, col_layout)[None, :]
            dp_start = zeros_s - gl.convert_layout(delta_v, col_layout)[None, :]
        mbarrier.wait(ready.index(stage), (j // NUM_STAGES) & 1)
        q_t = q_smem.index(stage).reshape([BLOCK_M, D])
        do_t = do_smem.index(stage).reshape([BLOCK_M, D])
        if WARPGROUPS > 1:
            sT = warpgroup_mma(k_a, q_t.permute((1, 0)), s_start, is_async=True)
            dpT = warpgroup_mma(v_a, do_t.permute((1, 0)), dp_start, is_async=True)
        else:
            sT = warpgroup_mma(k_a, q_t.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
            dpT = warpgroup_mma(v_a, do_t.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        # in flight, oldest first: dV_{j-1}, dK_{j-1}, S^T, dP^T. Leave dP^T; slice j-1's Q and dO are read.
        sT, dk, dv = warpgroup_mma_wait(num_outstanding=1, deps=(sT, dk, dv))
        nj = j + NUM_STAGES - 1  # slice j-1's stage is free: load slice j+NUM_STAGES-1 into it
        ns = nj % NUM_STAGES
        mbarrier.expect(ready.index(ns), slice_bytes, pred=nj < n_iter)
        tma.async_copy_global_to_shared(q_desc, [b, h, lo + nj * BLOCK_M, 0], ready.index(ns), q_smem.index(ns),
                                        pred=nj < n_iter)
        tma.async_copy_global_to_shared(do_desc, [b, h, lo + nj * BLOCK_M, 0], ready.index(ns), do_smem.index(ns),
                                        pred=nj < n_iter)

        if WARPGROUPS > 1:
            pT = gl.exp2(sT * qk_scale)  # qk_scale (S^T - L/scale) = S^T scale log2(e) - L log2(e)
        else:
            pT = gl.exp2(sT * qk_scale - (gl.convert_layout(l_v, col_layout) * LOG2E_K)[None, :])  # while dP^T runs
        if CAUSAL:
            if start_m < start_n + BLOCK_N:  # the diagonal slice(s): only queries at or after their key
                offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
                pT = gl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        dv = warpgroup_mma(gl.convert_layout(pT.to(dtype), pds_layout), do_t, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT, ))  # dP^T done; dV still running
        if WARPGROUPS > 1:
            dsT = pT * dpT
        else:
            dsT = pT * (dpT - gl.convert_layout(delta_v, col_layout)[None, :])
        if ONE_PASS:
            dsT = (dsT * scale).to(dtype)  # the softmax scale in dS^T once: dK and dQ both carry it
            ds_smem.store(dsT)
            fence_async_shared()
            # dQ's tile goes into the buffer whose add (issued two slices ago) the copy engine has finished
            # reading. Two warpgroups, which wait for each other at every barrier, check that at the barrier they
            # meet at anyway; one warpgroup checks it later, under dQ^T's matmul.
            buf = j % 2
            if WARPGROUPS > 1:
                tma.store_wait(pendings=1)
            gl.thread_barrier()  # dQ^T's matmul reads every warp's rows of dS^T
            dqt = warpgroup_mma(kt, ds_smem, zeros_qt, use_acc=False, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(dsT, pds_layout), q_t, dk, is_async=True)  # runs into slice j+1
            dqt = warpgroup_mma_wait(num_outstanding=1, deps=(dqt, ))  # dV and dQ^T done
            if WARPGROUPS == 1:
                tma.store_wait(pendings=1)
                gl.thread_barrier()
            # stored transposed (the buffer is [BLOCK_M, D], as dQ is), then added into dQ
            dq_smem.index(buf).reshape([BLOCK_M, D]).permute((1, 0)).store(dqt)
            fence_async_shared()
            gl.thread_barrier()
            _tma_reduce_add(dqa_desc, [b, h, start_m, 0], dq_smem.index(buf))  # rows past Nq: clipped
        else:
            # dK's matmul is left running into the next slice's S^T and dP^T
            dk = warpgroup_mma(gl.convert_layout(dsT.to(dtype), pds_layout), q_t, dk, is_async=True)

    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    tma.store_wait(pendings=0)  # (ONE_PASS) the last adds have read their buffers, which the epilogue's may reuse
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    if not ONE_PASS:  # (one pass: scaled already, through dS^T)
        dk = dk * scale
    # out through shared memory and TMA stores (rows past Nk clipped by the copy engine)
    dk_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, D], dk_desc.layout)
    dv_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, D], dv_desc.layout)
    dk_smem.reshape([BLOCK_N, D]).store(dk.to(dtype))
    dv_smem.reshape([BLOCK_N, D]).store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, h, start_n, 0], dk_smem)
    tma.async_copy_shared_to_global(dv_desc, [b, h, start_n, 0], dv_smem)
    tma.store_wait(pendings=0)

# takeaway: where the compiler serializes the matmuls, writing out each one's issue and wait lets the exponentials and
# dS run under them: the same math, faster where the registers allow it. Warps that only load and warps that only
# compute, meeting at mbarriers, took the forward to cuDNN's speed; the same split slowed the backward, whose passes
# keep one warpgroup a program (two at D128's one pass, in step). A 64-row matmul reading both operands from shared
# memory asks it for about as many bytes a cycle as it serves: an operand already in registers (P, dS, K, V) feeds
# the tensor cores from there. One pass instead of two saves the dQ pass's recomputed matmuls, and pays in a dQ tile
# written out every slice and in gradients that are no longer bitwise reproducible. Where registers run out, a value
# folded into a matmul's starting accumulator (-L/scale, -Delta) is one fewer held across the loop.

# --- 6. the fast path: what the model calls (flash_attention, flash_attention_qkv), planned once per layout
#
# FlashAttention (section 3) works everything out at every call and launches the same Triton kernels everywhere.
# FlashAttentionPlanned (behind flash_attention) and FlashAttentionQKV (behind flash_attention_qkv, gpt.py's call)
# keep its interface, math and saved tensors, and add what speed asks for: tiles per head dim and sequence length,
# TMA loads at D128, on Hopper section 5's Gluon passes where each measured faster (_gluon_passes: the one switch
# between the two kinds of kernel), gradients written in the model's memory layout, and a plan per layout, so that
# a later call only allocates and launches. The one-pass backward (section 5) adds dQ up in whatever order the adds
# land: not bitwise reproducible, so torch.use_deterministic_algorithms(True) keeps the two passes.

# At gpt2's 1,024 tokens (B16 H12 D64) the tile search (--tiles, H100) picks smaller tiles than TUNED's (section 3),
# more programs: forward (64, 64, 4, 3) 0.921x the time of TUNED's, dq (64, 64, 4, 2) 0.907x, dkdv (32, 64, 4, 3)
# 0.984x. Sequences up to SHORT_SEQ tokens take them where a head dim has them (shorter ones unmeasured).
SHORT_SEQ = 1024
SHORT_TUNED = {64: {"fwd": (64, 64, 4, 3), "dkdv": (32, 64, 4, 3), "dq": (64, 64, 4, 2)}}
TMA_HEAD_DIMS = (128,)  # tiles load through Hopper's tensor-memory accelerator (descriptors)
KERNELS = {"fwd": _attn_fwd_kernel, "dkdv": _attn_dkdv_kernel, "dq": _attn_dq_kernel}
# The passes that run as Gluon kernels (section 5) past SHORT_SEQ tokens, per head dim, each where it measured
# faster than its Triton kernel (the pass alone, do_bench, 5 repeats, H200): dQ 0.94x at S16384 D64,
# 0.85x at B4 S4096 D128, 0.93x at S16384 D128; dK/dV 0.91x and 0.95x at those two. At S16384 D64 dK/dV lost
# (1.03-1.08x) while P^T and dS^T went through shared memory; from registers it takes 0.87-0.90x Triton's time there,
# and 0.94x its own earlier time at D128 (H100, 3 interleaved repeats). At GPT-2's 1,024 tokens the passes take
# 0.92x and 0.84x the GPU time, but launching a Gluon kernel (its descriptors built, its arguments specialized: no
# compiled launcher kept) costs the host more than that: called, forward+backward took 0.424 ms against 0.360 (H100).
# Short sequences keep Triton's.
# The forward, warp-specialized (128 query rows, 128 keys a tile), against Triton's (H100, 3 interleaved repeats,
# ratios of medians): 0.94x at S16384 D64, 0.83x at S16384 D128, 0.78x at B4 S4096 D128, where cuDNN's forward
# takes 1.02x, 1.04x and 0.98x its time. Without the producer (one warpgroup of 64 rows a program, the tensor
# cores' overlap alone) it was 0.99x, 0.94x and 0.85x; two warpgroups kept in step by thread barriers, 0.95-1.18x.
# At GPT-2's shape 1.6x (the same launch cost).
# The backward runs in one pass ("bwd": _dkdv_gluon_kernel's ONE_PASS) from ONE_PASS_FROM tokens on, unless
# torch.use_deterministic_algorithms is on. At D64: 0.93-0.94x the two passes' time at S16384 (H100, 3 interleaved
# repeats). At D128 with one warpgroup it took 1.21-1.33x; with two (128 keys, operands from shared memory, the
# accumulators started at -L/scale and -Delta): 0.90-1.00x at S16384 (the backward alone, six measurements of 15
# interleaved repeats, H100; forward+backward 1.04-1.05x cuDNN's in three runs, 1.06-1.11x before), but
# 1.05-1.07x at B2 S8192 and 1.06x at B4 S4096: fewer query slices a program.
GLUON_PASSES = {64: ("fwd", "dq", "dkdv", "bwd"), 128: ("fwd", "dq", "dkdv", "bwd")}
ONE_PASS_FROM = {64: SHORT_SEQ + 1, 128: 16384}
# (BLOCK_M, BLOCK_N, num_warps, num_stages) of each Gluon pass, per head dim. dQ at D64 takes 128 keys a tile:
# half the loop trips (waits, barriers, copies issued) for the same work, 0.93-0.95x the time of 64-key tiles at
# S16384 (219 registers, two programs an SM; at D128 they take 251 and fit one: 1.14-1.18x). dK/dV with 128 keys
# (two warpgroups, 8 warps, one Q/dO ring) took 1.05-1.19x at D64 (H100, 3 interleaved repeats).
GLUON_TILES = {64: {"fwd": (128, 128, 4, 2), "dq": (64, 128, 4, 2), "dkdv": (64, 64, 4, 2), "bwd": (64, 64, 4, 2)},
               128: {"fwd": (128, 128, 4, 2), "dq": (64, 64, 4, 2), "dkdv": (64, 64, 4, 2), "bwd": (64, 128, 8, 2)}}
# The forward's partitions share the SM's 64K registers: 12 warps launched at 168 a thread, then the producer's
# warps give theirs up (setmaxnreg) to the consumers' 232
FWD_REGS = (168, 232)
GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
SM90 = {}  # device -> is it a Hopper GPU (compute capability 9.0)


def tuned_table(D, n):  # the table whose tiles 16-bit inputs of head dim D and n tokens take
    if n <= SHORT_SEQ and D in SHORT_TUNED:
        return SHORT_TUNED
    return TUNED


def _tiles(dtype, D, n):
    if INTERPRETED:
        return INTERPRETER_TILES
    if dtype == torch.float32:
        return FP32_TILES
    return tuned_table(D, n)[D]


def _aligned(t):  # TMA descriptors need 16-byte aligned bases and row strides
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def _use_tma(*tensors):  # fp32 keeps the exact-dot path; torch.compile's tracing has no addresses to check
    return (tensors[0].shape[-1] in TMA_HEAD_DIMS and tensors[0].dtype != torch.float32 and
            not torch.compiler.is_compiling() and all(map(_aligned, tensors)))


def _gluon_passes(q4, n, *tensors):
    """The passes ("fwd", "dq", "dkdv", "bwd") that run as Gluon kernels: on a Hopper GPU, for 16-bit inputs of a
    head dim in GLUON_PASSES longer than SHORT_SEQ tokens whose tensors TMA can address, when not traced by
    torch.compile."""
    if not GLUON or q4.dtype not in GLUON_DTYPES or q4.shape[-1] not in GLUON_PASSES or n <= SHORT_SEQ:
        return ()
    if torch.compiler.is_compiling() or not all(map(_aligned, tensors)):
        return ()
    if q4.device not in SM90:
        SM90[q4.device] = torch.cuda.get_device_capability(q4.device) == (9, 0)
    if not SM90[q4.device]:
        return ()
    return GLUON_PASSES[q4.shape[-1]]


def _descriptor(t, rows):
    # a TMA descriptor over a (B, H, S, D) view with its own strides: blocks of `rows` rows of one head
    block = [1, 1, rows, t.shape[-1]]
    dtype = gl.float32 if t.dtype == torch.float32 else GLUON_DTYPES[t.dtype]  # fp32: the one-pass dQ accumulator
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                            gl.NVMMASharedLayout.get_default_for(block, dtype))


def _grad_buffer(t, n):
    # n gradients shaped like t (B, H, S, D) in one (n, B, H, S, D) tensor, laid out as t is: the model's q, k and v
    # are head-transposed views of one (B, S, 3, H, D) projection, so theirs go to (B, S, H, D) memory, where
    # autograd's transpose back to (B, S, H*D) is a view (contiguous (B, H, S, D) gradients would each be copied).
    B, H, S, D = t.shape
    if H > 1 and t.stride(1) < t.stride(2):  # heads inside tokens
        strides = (B * S * H * D, S * H * D, D, H * D, 1)
    else:
        strides = (B * H * S * D, H * S * D, S * D, D, 1)
    return torch.empty_strided((n, B, H, S, D), strides, device=t.device, dtype=t.dtype)


def _scratch(size, alignment, stream):  # Triton's allocator for the in-kernel TMA descriptors' scratch buffer
    return torch.empty(size, device="cuda", dtype=torch.int8)


# Triton's kernel[grid](...) derives, at every call, what it specializes on (each integer's value 1 or
# divisibility by 16, each pointer's 16-byte alignment), hashes it into a cache key and then launches:
# about 31 us a launch on an H100's host, against 13 us for calling the compiled kernel it returned.
class Launch:
    """One Triton kernel's launch with its tiles, grid and every argument that is not a tensor fixed: the first call
    goes through kernel[grid] (Triton specializes, compiles or loads, and launches), later calls straight to the
    compiled kernel's launcher. Later tensors must be laid out and aligned as the first call's were: a Plan's key
    sees to that."""

    def __init__(self, name, n, BH, dtype, scalars, **meta):
        # n rows (queries, or keys for dkdv) of B*H heads; scalars: the signature's arguments after its tensors
        bm, bn, warps, stages = _tiles(dtype, meta["D"], n)[name]
        if name != "fwd":  # the diagonal's sub-tile: half of the dimension that iterates, at least a dot's 16
            meta["DIAG"] = max((bm if name == "dkdv" else bn) // 2, 16)
        tile = bn if name == "dkdv" else bm
        self.grid = ((n + tile - 1) // tile, BH, 1)  # (triton.cdiv costs microseconds a call on the host)
        self.kernel, self.scalars = KERNELS[name], scalars
        self.meta = dict(meta, BLOCK_M=bm, BLOCK_N=bn)
        self.options = dict(num_warps=warps, num_stages=stages)
        self.compiled = None  # (the compiled kernel's launcher for the grid, its constexpr values), once launched

    def __call__(self, *tensors):
        args = (*tensors, *self.scalars)
        if self.meta["TMA"]:  # the allocator is per thread, and backward runs on autograd's own
            triton.set_allocator(_scratch)
        if self.compiled is not None:
            launcher, constexprs = self.compiled
            launcher(*args, *constexprs)  # the same kernel Triton would pick, without picking it again
            return
        compiled = self.kernel[self.grid](*args, **self.meta, **self.options)
        if not (INTERPRETED or torch.compiler.is_compiling()):  # (nothing compiled to keep under either)
            # the compiled kernel takes every parameter in the signature's order, the constexprs after the arguments
            constexprs = tuple(self.meta[p.name] for p in self.kernel.params[len(args):])
            self.compiled = compiled[self.grid], constexprs


# A call's plan. A model calls attention with the same layouts every step: the same shapes, strides, dtype and
# device, causal, scale and precision. What a call works out from them (the checks, which kernels run, their
# tiles, grids and arguments other than tensors, each compiled kernel) is worked out on a layout's first call and
# kept under a key of exactly those values and each input's 16-byte alignment (Triton specializes a pointer on it):
# any value that changes, changes the key. A later call allocates its outputs and launches. At GPT-2's shape the
# kernels take ~0.37 ms a forward+backward; working it all out again at every call cost the host 0.25-0.43 ms
# more (section 7's host table, H100), enough to leave the GPU waiting. Plans hold the tables' choices: clear
# PLANS after changing GLUON or a table.
PLANS = {}  # _plan_key(...) -> Plan


def _plan_key(kind, tensors, causal, scale, precision, *more):
    """None where nothing is kept: an input that is not a tensor (the checks say what is wrong), and torch.compile's
    tracing (its tensors have no addresses; the compiled graph is the plan there)."""
    if not all(isinstance(t, torch.Tensor) for t in tensors) or torch.compiler.is_compiling():
        return None
    layouts = [(t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors]
    return kind, *layouts, causal, scale, precision, _precision(tensors[0], precision), *more  # (as given, as taken)


def _new_plan(key, q4, k4, v4, causal, scale, precision):  # a Plan, kept under key unless key is None
    if scale is None:
        scale = _default_scale(q4.shape[-1])
    plan = Plan(q4, k4, v4, causal, scale, precision)
    if key is not None:
        PLANS[key] = plan
    return plan


class Plan:
    """The kernels for one layout of (B, H, S, D) q, k and v, causal or not, one scale and precision: forward()
    allocates O and L and launches; backward() launches into gradient buffers, its launches kept per layout of dO."""

    def __init__(self, q4, k4, v4, causal, scale, precision):
        B, H, Nq, D = q4.shape
        self.shape, self.Nk = q4.shape, k4.shape[2]
        self.causal, self.scale, self.precision = causal, scale, precision
        self.qkv_strides = (*q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3])  # (b, h, n) each
        self.o_strides = (Nq * H * D, D, H * D, 1)  # O's, (B, H, S, D) seen in (B, S, H, D) memory: see forward()
        self.fwd = None  # None: the Gluon forward (O is aligned: a fresh tensor)
        if "fwd" not in _gluon_passes(q4, Nq, q4, k4, v4):
            scalars = (*self.qkv_strides, *self.o_strides[:3], H, Nq, self.Nk, scale * LOG2E)
            self.fwd = Launch("fwd", Nq, B * H, q4.dtype, scalars, CAUSAL=causal, D=D, PRECISION=precision,
                              TMA=_use_tma(q4, k4, v4))
        self.backwards = {}  # (dO's strides, its alignment, deterministic or not) -> _plan_backward(...)

    def forward(self, q4, k4, v4):
        """O in (B, S, H, D) memory seen as (B, H, S, D) (the model's o.transpose(1, 2).reshape(B, S, H*D) is free),
        and the fp32 logsumexp L, natural log like torch.logsumexp."""
        B, H, Nq, D = self.shape
        o = torch.empty_strided(self.shape, self.o_strides, device=q4.device, dtype=q4.dtype)
        lse = torch.empty(B, H, Nq, device=q4.device, dtype=torch.float32)
        if self.fwd is not None:
            self.fwd(q4, k4, v4, o, lse)
            return o, lse
        bm, bn, warps, stages = GLUON_TILES[D]["fwd"]
        _fwd_gluon_kernel[((Nq + bm - 1) // bm, B * H)](
            _descriptor(q4, bm // 2), _descriptor(k4, bn), _descriptor(v4, bn), _descriptor(o, bm // 2), lse, H, Nq,
            self.Nk, self.scale * LOG2E, CAUSAL=self.causal, D=D, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages,
            CONSUMER_REGS=FWD_REGS[1], num_warps=warps, maxnreg=FWD_REGS[0])
        return o, lse

    def _plan_backward(self, q4, k4, v4, o4, do4, dq, dkv):
        """(the Gluon passes, one pass or two, the dQ and dK/dV kernels' Launch where Triton's run) for one dO."""
        B, H, Nq, D = self.shape
        passes = _gluon_passes(q4, Nq, q4, k4, v4, do4)  # (the gradients' buffers are aligned: fresh tensors)
        # One pass (section 5's ONE_PASS) from ONE_PASS_FROM tokens on, unless torch.use_deterministic_algorithms
        one_pass = "bwd" in passes and Nq >= ONE_PASS_FROM[D] and not torch.are_deterministic_algorithms_enabled()
        tail = (H, Nq, self.Nk, self.scale * LOG2E, self.scale)
        meta = dict(CAUSAL=self.causal, D=D, PRECISION=self.precision, TMA=_use_tma(q4, k4, v4, do4))
        dq_launch = dkdv_launch = None
        if "dq" not in passes:
            dq_launch = Launch("dq", Nq, B * H, q4.dtype, (*self.qkv_strides, *o4.stride()[:3], *do4.stride()[:3],
                                                           *dq[1], *tail), **meta)
        if "dkdv" not in passes:
            dkdv_launch = Launch("dkdv", self.Nk, B * H, q4.dtype, (*self.qkv_strides, *do4.stride()[:3], *dkv[1],
                                                                    dkv[2], dkv[3], *tail), **meta)
        return passes, one_pass, dq_launch, dkdv_launch

    def backward(self, q4, k4, v4, o4, do4, lse, dq, dkv):
        """dQ into dq = (tensor, its (b, h, n) strides), dK and dV into dkv = (one tensor, their (b, h, n) strides, dK's
        offset, dV's offset), the last dimension contiguous, laid out alike at every call. Whole tensors with strides
        and offsets, never views into them: under torch.compile a kernel writing into an offset or gapped view, or
        into one tensor passed twice, is what PyTorch's handling of mutated kernel arguments has got wrong."""
        key = None  # while torch.compile traces (no addresses there, and a graph break): planned anew
        if not torch.compiler.is_compiling():
            key = (do4.stride(), do4.data_ptr() % 16 == 0, torch.are_deterministic_algorithms_enabled())
        planned = self.backwards.get(key)
        if planned is None:
            planned = self._plan_backward(q4, k4, v4, o4, do4, dq, dkv)
            if key is not None:
                self.backwards[key] = planned
        passes, one_pass, dq_launch, dkdv_launch = planned
        B, H, Nq, D = self.shape
        delta = torch.empty(B, H, Nq, device=q4.device, dtype=torch.float32)
        if passes:  # the gradients as (B, H, S, D) views, for their descriptors
            dq4 = dq[0].as_strided(q4.shape, (*dq[1], 1))
            dk4 = dkv[0].as_strided(k4.shape, (*dkv[1], 1), dkv[0].storage_offset() + dkv[2])
            dv4 = dkv[0].as_strided(k4.shape, (*dkv[1], 1), dkv[0].storage_offset() + dkv[3])
        # One pass: Delta first, then the dK/dV kernel has the copy engine add dQ into dq_acc. Otherwise dQ first:
        # it also writes Delta = rowsum(dO * O), which the dK/dV kernel reads; each gradient has one owner, no atomics.
        dq_acc = None
        if one_pass:
            _delta_kernel[((Nq + 63) // 64, B * H)](o4, do4, delta, *o4.stride()[:3], *do4.stride()[:3], H, Nq, D=D,
                                                    BLOCK=64)
            dq_acc = torch.zeros(B, H, Nq, D, device=q4.device, dtype=torch.float32)  # the copy engine adds into it
        elif dq_launch is None:
            bm, bn, warps, stages = GLUON_TILES[D]["dq"]
            _dq_gluon_kernel[((Nq + bm - 1) // bm, B * H)](
                _descriptor(q4, bm), _descriptor(k4, bn), _descriptor(v4, bn), _descriptor(do4, bm),
                _descriptor(dq4, bm), o4, lse, delta, *o4.stride()[:3], H, Nq, self.Nk, self.scale * LOG2E, self.scale,
                CAUSAL=self.causal, D=D, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=stages, num_warps=warps)
        else:
            dq_launch(q4, k4, v4, o4, do4, lse, delta, dq[0])
        if dkdv_launch is None:
            bm, bn, warps, stages = GLUON_TILES[D]["bwd" if one_pass else "dkdv"]
            dqa_desc = _descriptor(dq_acc, bm) if one_pass else None
            _dkdv_gluon_kernel[((self.Nk + bn - 1) // bn, B * H)](
                _descriptor(q4, bm), _descriptor(k4, bn), _descriptor(v4, bn), _descriptor(do4, bm),
                _descriptor(dk4, bn), _descriptor(dv4, bn), dqa_desc, lse, delta, H, Nq, self.scale * LOG2E,
                self.scale, CAUSAL=self.causal, D=D, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=stages, ONE_PASS=one_pass,
                num_warps=warps)
        else:
            dkdv_launch(q4, k4, v4, do4, lse, delta, dkv[0])
        if one_pass:
            dq4.copy_(dq_acc)  # to 16 bits, in the gradient's layout


class FlashAttentionPlanned(torch.autograd.Function):
    """FlashAttention (section 3) through a plan kept per layout: apply(q, k, v, is_causal=False, scale=None,
    precision=None) on (..., seq, d) tensors, saving the same q, k, v, O and fp32 logsumexp L. flash_attention
    calls it."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, precision=None):
        key = _plan_key("q, k, v", (q, k, v), is_causal, scale, precision)
        plan = PLANS.get(key)
        if plan is None:  # this layout's first call (or a traced one): check, then plan
            check_inputs(q, k, v, is_causal, precision or "ieee")  # None: torch's setting, read next (fp32 only)
            plan = _new_plan(key, _as_4d(q), _as_4d(k), _as_4d(v), is_causal, scale, _precision(q, precision))
        o, lse = plan.forward(_as_4d(q), _as_4d(k), _as_4d(v))
        if q.dim() != 4:  # (a view costs microseconds of Python, which a short kernel notices)
            o, lse = o.view(q.shape), lse.view(q.shape[:-1])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan = plan
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        q4, k4, v4, o4, do4 = map(_as_4d, (q, k, v, o, do))
        dq_buffer = _grad_buffer(q4, 1)
        dkv_buffer = _grad_buffer(k4, 2)  # dV laid out as dK: one set of strides for the kernel
        ctx.plan.backward(q4, k4, v4, o4, do4, lse, (dq_buffer, dq_buffer.stride()[1:4]),
                          (dkv_buffer, dkv_buffer.stride()[1:4], 0, dkv_buffer.stride(0)))
        dq, (dk, dv) = dq_buffer[0], dkv_buffer.unbind(0)
        if q.dim() != 4:
            dq, dk, dv = dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
        return dq, dk, dv, None, None, None


def _heads(qkv, n_head):
    # (B, S, 3*H*D) -> q, k, v, each (B, H, S, D): views of where the projection wrote them, nothing copied
    B, S, width = qkv.shape
    return qkv.view(B, S, 3, n_head, width // (3 * n_head)).permute(2, 0, 3, 1, 4).unbind(0)


class FlashAttentionQKV(torch.autograd.Function):
    """apply(qkv, n_head, is_causal=True, scale=None): attention from a (B, S, 3*C) projection (q, k, v side by
    side, as GPT-2's c_attn writes them) to (B, S, C). The kernels read q, k and v where they lie, and backward
    writes their three gradients into one (B, S, 3*C) tensor: split into heads on the way in and concatenated on
    the way back out, they would each cost a copy in autograd."""

    @staticmethod
    def forward(ctx, qkv, n_head, is_causal=True, scale=None):
        key = _plan_key("qkv", (qkv,), is_causal, scale, None, n_head)
        plan = PLANS.get(key)
        if plan is None and (qkv.dim() != 3 or qkv.shape[-1] % (3 * n_head)):
            raise ValueError(f"qkv must be (batch, seq, 3 * heads * d) with {n_head} heads; got {tuple(qkv.shape)}")
        qkv = qkv.contiguous()  # (itself when it already is: c_attn's output)
        q, k, v = _heads(qkv, n_head)
        if plan is None:  # this layout's first call (or a traced one): check, then plan
            check_inputs(q, k, v, is_causal, "ieee")
            plan = _new_plan(key, q, k, v, is_causal, scale, _precision(q, None))
        o, lse = plan.forward(q, k, v)
        ctx.save_for_backward(qkv, o, lse)
        ctx.n_head, ctx.plan = n_head, plan
        B, S, H, D = o.transpose(1, 2).shape
        return o.transpose(1, 2).view(B, S, H * D)  # (B, S, C): o's memory is (B, S, H, D) already

    @staticmethod
    def backward(ctx, dy):
        qkv, o, lse = ctx.saved_tensors
        B, H, S, D = o.shape
        do = _as_4d(dy.reshape(B, S, H, D).transpose(1, 2))  # (B, H, S, D), a view of dy when it is contiguous
        dqkv = torch.empty_like(qkv)  # (B, S, 3*C), contiguous like qkv: q's gradient at 0, k's at C, v's at 2C
        strides = (dqkv.stride(0), D, dqkv.stride(1))  # (b, h, n) in it
        ctx.plan.backward(*_heads(qkv, ctx.n_head), o, do, lse, (dqkv, strides), (dqkv, strides, H * D, 2 * H * D))
        return dqkv, None, None, None


def flash_attention_qkv(qkv, n_head, causal=True, scale=None):
    """flash_attention from GPT-2's (B, S, 3*C) q, k, v projection to its (B, S, C) output, heads side by side;
    fp32 inputs use torch's fp32 matmul setting."""
    return FlashAttentionQKV.apply(qkv, n_head, causal, scale)


def flash_attention(q, k, v, causal=False, scale=None, precision=None):
    """softmax(scale * q k^T) v with the Triton kernels, differentiable; q (..., Nq, D), k and v (..., Nk, D),
    scale 1/sqrt(D) by default. `precision` (fp32 inputs only): "ieee" exact dots, "tf32" tensor-core ones,
    None torch's fp32 matmul setting, so --attn triton matches the rest of the model. The fast path, planned per
    layout (section 6); FlashAttention.apply (section 3) gives the same answer to rounding, worked out every call."""
    return FlashAttentionPlanned.apply(q, k, v, causal, scale, precision)

# takeaway: tile sizes are per head dim and dtype; a layout's first call plans (checks, kernels, tiles, grids,
# arguments, compiled launchers) and later calls only allocate and launch; the Function saves only q, k, v, O and L.

# --- 7. benchmark against SDPA's backends (do_bench: each pipeline alone, L2 flushed between calls)

# long context at D64 and D128, GPT-2 124M's attention (B16 H12 S1024 D64), small head dims, one fp32 row
GPT2_SHAPE = (16, 12, 1024, 64, "bf16")  # B16, T1024, gpt2's 12 heads of 64
SHAPES = [(1, 16, 16384, 64, "bf16"), (1, 16, 16384, 128, "bf16"), GPT2_SHAPE,
          (4, 16, 4096, 128, "bf16"), (4, 16, 4096, 32, "bf16"), (4, 16, 4096, 16, "bf16"), (4, 16, 4096, 64, "fp32")]


def tflops(B, H, S, D, dtype, ms):
    """Causal fwd+bwd, FA convention: forward 4*B*H*S^2*D (two matmuls) halved, backward 2.5x that."""
    return 3.5 * 2 * B * H * S * S * D / ms / 1e9


def sdpa(backend, q, k, v, causal):
    with sdpa_kernel(getattr(SDPBackend, backend)):  # pinned: raises instead of silently falling back
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


# ours, then SDPA's cuDNN and flash backends (16-bit only) or its memory-efficient one (the fused kernel for fp32)
IMPLS = {"bf16": {"ours": flash_attention, "sdpa cudnn": partial(sdpa, "CUDNN_ATTENTION"),
                  "sdpa flash": partial(sdpa, "FLASH_ATTENTION")},
         "fp32": {"ours ieee": partial(flash_attention, precision="ieee"),
                  "ours tf32": partial(flash_attention, precision="tf32"),
                  "sdpa efficient": partial(sdpa, "EFFICIENT_ATTENTION")}}


def time_impl(f, B, H, S, D, dtype):
    """Causal (fwd, fwd+bwd, fwd+bwd graphed or None) ms, do_bench medians; or why it could not run."""
    try:
        q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(4))
        fwd = triton.testing.do_bench(lambda: f(q, k, v, True), return_mode="median")
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def step():  # autograd.grad rather than .backward(): no gradient accumulation kernels in the timing
            return torch.autograd.grad(f(q, k, v, True), (q, k, v), do)
        both = triton.testing.do_bench(step, return_mode="median")
        try:  # the same calls captured once and replayed: GPU time without Python's launch cost
            graphed = triton.testing.do_bench_cudagraph(step, return_mode="median")
        except Exception:  # a backend that cannot be captured gets n/a
            graphed = None
        return fwd, both, graphed
    except Exception as e:  # a failure is a cell; the benchmark goes on
        if isinstance(e, torch.OutOfMemoryError):
            return "OOM"
        return f"{type(e).__name__}: {str(e).strip()[:120]}"


def run_benchmark(shapes, repeats):
    """{(B, H, S, D, dtype): {impl: [(fwd, fwd+bwd, graphed ms) per repeat] or why not}}. Each
    repeat times every implementation in turn, so a ratio pairs calls made close in time."""
    results = {}
    for B, H, S, D, dtype in shapes:
        times = results[B, H, S, D, dtype] = {}
        for _ in range(repeats):
            for name, f in IMPLS[dtype].items():
                if isinstance(times.get(name), str):
                    continue  # it failed once: no second try
                t = time_impl(f, B, H, S, D, DTYPES[dtype])
                torch.cuda.empty_cache()  # the inputs died with time_impl's frame
                if isinstance(t, str):
                    times[name] = t
                    print(f"  B{B} H{H} S{S} D{D} {dtype} {name}: {t}", flush=True)
                else:
                    times.setdefault(name, []).append(t)
                    print(f"  B{B} H{H} S{S} D{D} {dtype} {name}: fwd+bwd {t[1]:.3f} ms", flush=True)
    return results


def spread(xs, digits=3, suffix=""):
    """'median (min-max)' of repeated measurements; the median alone for one."""
    text = f"{statistics.median(xs):.{digits}f}{suffix}"
    if len(xs) > 1:
        text += f" ({min(xs):.{digits}f}-{max(xs):.{digits}f})"
    return text


def report_cells(key, t, base):
    """One implementation's numbers: fwd, fwd+bwd, TFLOP/s, fwd+bwd vs SDPA (paired by repeat), graphed."""
    if isinstance(t, str):
        return ["OOM" if t == "OOM" else "n/a"] * 5
    fwd, both, graphed = ([r[j] for r in t if r[j]] for j in range(3))
    vs = [a[1] / b[1] for a, b in zip(t, base)] if base else []
    return [f"{statistics.median(fwd):.3f}", spread(both), f"{tflops(*key, statistics.median(both)):.0f}",
            spread(vs, 2, "x") if vs else "n/a", f"{statistics.median(graphed):.3f}" if graphed else "n/a"]


def report(results, repeats):
    """The table, then the summary: ours over SDPA cuDNN (efficient for fp32), paired by repeat."""
    rows, parts = [], []
    for key, times in results.items():
        base = next((t for name, t in times.items() if name.startswith("sdpa") and not isinstance(t, str)), None)
        label = "B{} H{} S{} D{} {}".format(*key)
        for i, (name, t) in enumerate(times.items()):
            cells = report_cells(key, t, base)
            rows.append([label if i == 0 else "", name, *cells])
            if name in ("ours", "ours tf32") and cells[3] != "n/a":
                parts.append(f"{label} {name} {cells[3]}")
    print(f"\ncausal; do_bench medians; fwd+bwd: median (min-max) of {repeats} repeats; vs SDPA: the first SDPA "
          "row that ran (cuDNN; efficient for fp32), paired by repeat; graphed: replayed from a CUDA graph; "
          "n/a: see above")
    print_table(["shape", "impl", "fwd ms", "fwd+bwd ms", "TFLOP/s", "fwd+bwd vs SDPA", "graphed ms"], rows)
    print("summary: ours fwd+bwd / SDPA: " + ("; ".join(parts) or "n/a"))


def pyplot():  # matplotlib, only for --plot (its presence checked before any work)
    import matplotlib.pyplot as plt

    plt.switch_backend("Agg")
    return plt


def plot_tflops(results, path):
    """fwd+bwd TFLOP/s, a group of bars per shape, a bar per implementation."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(2 + 1.5 * len(results), 4))
    width = 0.8 / max(map(len, results.values()))
    for name in dict.fromkeys(name for times in results.values() for name in times):
        bars = []
        for x, (key, times) in enumerate(results.items()):
            t = times.get(name)
            if isinstance(t, list):  # each bar at its place within its shape's group
                offset = width * (list(times).index(name) - (len(times) - 1) / 2)
                bars.append((x + offset, tflops(*key, statistics.median(r[1] for r in t))))
        if bars:
            ax.bar(*zip(*bars), width, label=name)
    ax.set_xticks(range(len(results)), ["B{} H{}\nS{} D{}\n{}".format(*key) for key in results])
    ax.set(ylabel="causal fwd+bwd TFLOP/s", title="FlashAttention-2 in Triton vs SDPA")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")

def attention_as_the_model_calls_it(impl, qkv, n_head):
    """c_attn's (B, S, 3C) output to the (B, S, C) that c_proj reads, as gpt.py does it: ours takes the projection
    whole; SDPA (cuDNN) needs the split into heads, and autograd concatenates the three gradients back."""
    if impl == "ours":
        return flash_attention_qkv(qkv, n_head)
    B, S, width = qkv.shape
    C = width // 3
    q, k, v = (t.view(B, S, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, dim=2))
    return sdpa("CUDNN_ATTENTION", q, k, v, True).transpose(1, 2).reshape(B, S, C)


def model_path(B, H, S, D, repeats):
    """Forward+backward from c_attn's output to c_proj's input at one shape, called and graphed, ours and cuDNN in
    turn each repeat: {impl: [(called ms, graphed ms)]}. What the model pays, layout copies included."""
    times = {"ours": [], "sdpa cudnn": []}
    for _ in range(repeats):
        for impl in times:
            qkv = torch.randn(B, S, 3 * H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16)

            def step():
                return torch.autograd.grad(attention_as_the_model_calls_it(impl, qkv, H), qkv, dy)
            called = triton.testing.do_bench(step, return_mode="median")
            graphed = triton.testing.do_bench_cudagraph(step, return_mode="median")
            times[impl].append((called, graphed))
    return times


def report_model_path(shape, times):
    B, H, S, D = shape
    rows = []
    for impl, t in times.items():
        called, graphed = ([r[j] for r in t] for j in range(2))
        vs = [a[0] / b[0] for a, b in zip(t, times["sdpa cudnn"])]
        rows.append([impl, spread(called), spread(graphed), spread(vs, 2, "x")])
    print(f"\nas the model calls it, B{B} H{H} S{S} D{D} bf16: c_attn's (B, S, 3C) output to (B, S, C), "
          "forward+backward, do_bench medians (min-max over repeats); ours takes the projection whole, cuDNN after "
          "the split")
    print_table(["impl", "called ms", "graphed ms", "called vs cuDNN"], rows)


class NoKernels(torch.autograd.Function):
    """An autograd.Function that launches nothing (its forward and backward allocate their outputs): what the
    mechanism alone costs the host, our Function's floor."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, do):
        return torch.empty_like(do), torch.empty_like(do), torch.empty_like(do), None


def ours_planned_every_call(q, k, v, causal):  # checks, tiles, grids, and Triton's own choice at every launch
    PLANS.clear()
    return flash_attention(q, k, v, causal)


HOST_IMPLS = {"ours": flash_attention, "ours, planned at every call": ours_planned_every_call,
              "sdpa cudnn": partial(sdpa, "CUDNN_ATTENTION"), "autograd.Function launching nothing": NoKernels.apply}


def host_us(f, calls=2000):
    """Host microseconds a causal forward+backward of f costs, on one head of 128 tokens (bf16, D64): kernels that
    short finish before the host has launched the next, so the wall clock over many calls is the host's time."""
    q, k, v, do = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        return torch.autograd.grad(f(q, k, v, True), (q, k, v), do)
    for _ in range(100):  # compiled, plans kept, the allocator's blocks cached
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def report_host(repeats, calls=2000):
    """What the host spends on one forward+backward, each implementation in turn each repeat: a call's Python and
    launches, which a busy host stretches and which the GPU hides only while its own work takes longer."""
    times = {name: [] for name in HOST_IMPLS}
    for _ in range(repeats):
        for name, f in HOST_IMPLS.items():
            if isinstance(times[name], str):
                continue  # it failed once: no second try
            try:
                times[name].append(host_us(f, calls))
            except Exception as e:  # SDPA's cuDNN backend on a GPU it does not support, say: a row saying so
                times[name] = f"n/a ({type(e).__name__})"
    base = times["sdpa cudnn"]
    rows = []
    for name, t in times.items():
        if isinstance(t, str):
            rows.append([name, t, "n/a"])
        elif isinstance(base, str):
            rows.append([name, spread(t, 0), "n/a"])
        else:
            rows.append([name, spread(t, 0), spread([a / b for a, b in zip(t, base)], 2, "x")])
    print("\nhost time per causal forward+backward (B1 H1 S128 D64 bf16: the GPU waits on the host), microseconds "
          f"over {calls} calls, median (min-max) over repeats")
    print_table(["impl", "host us per call", "vs cuDNN"], rows)
    return times

# takeaway: compare against SDPA's own fused kernels, paired by repeat, and graphed to remove launch costs; the
# host's time a call, apart, says how much of a called time is the host's.

# --- 7b. --tiles: the search behind TUNED, one kernel at a time (its pass timed with every candidate, bf16)

TILE_CANDIDATES = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages), within each kernel's static_assert
    "fwd": [(m, n, w, st) for m in (64, 128) for n in (32, 64, 128) if m % n == 0 for w in (4, 8) for st in (2, 3, 4)],
    "dq": [(m, n, w, st) for m in (64, 128) for n in (32, 64, 128) if m % n == 0 for w in (4, 8) for st in (2, 3, 4)],
    "dkdv": [(m, n, w, st) for m in (32, 64, 128) for n in (64, 128) if n % m == 0 for w in (4, 8) for st in (2, 3, 4)],
}


def search_tiles(kernel, B, H, S, D):
    """[(tiles, ms or why not)] for `kernel` at causal (B, H, S, D) in bf16, today's tiles for the shape first: the
    forward timed for "fwd", the backward (dQ then dK/dV) for the other two, every other kernel on today's tiles."""
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = D**-0.5
    o, lse = Plan(q, k, v, True, scale, "tf32").forward(q, k, v)
    dq_buffer, dkv_buffer = _grad_buffer(q, 1), _grad_buffer(k, 2)
    dq, dkv = (dq_buffer, dq_buffer.stride()[1:4]), (dkv_buffer, dkv_buffer.stride()[1:4], 0, dkv_buffer.stride(0))
    table = tuned_table(D, S)
    tuned = table[D]
    rows = []
    for tiles in [tuned[kernel]] + [t for t in TILE_CANDIDATES[kernel] if t != tuned[kernel]]:
        table[D] = {**tuned, kernel: tiles}
        try:
            plan = Plan(q, k, v, True, scale, "tf32")  # a plan takes its tiles when it is made: one per candidate
            if kernel == "fwd":
                ms = triton.testing.do_bench(lambda: plan.forward(q, k, v), return_mode="median")
            else:
                ms = triton.testing.do_bench(lambda: plan.backward(q, k, v, o, do, lse, dq, dkv), return_mode="median")
            rows.append((tiles, ms))
            print(f"  {kernel} {tiles}: {ms:.3f} ms", file=sys.stderr, flush=True)
        except Exception as e:  # out of shared memory or registers: a row, and the search goes on
            first_sentence = str(e).strip().splitlines()[0].split(". ")[0]  # "out of resource: shared memory, ..."
            rows.append((tiles, first_sentence[:80] or type(e).__name__))
        finally:
            table[D] = tuned
    return rows


def report_tiles(kernel, shape, rows):
    """The candidates fastest first, each against today's tiles for the shape (the first row); failures last."""
    B, H, S, D = shape
    today, today_ms = rows[0]
    timed = sorted((r for r in rows if not isinstance(r[1], str)), key=lambda r: r[1])
    table = []
    for tiles, ms in timed:
        vs = "n/a"
        if not isinstance(today_ms, str):
            vs = f"{ms / today_ms:.3f}x"
        name = f"{tiles} (today)" if tiles == today else str(tiles)
        table.append([name, f"{ms:.3f}", vs, ""])
    table += [[str(tiles), "-", "n/a", why] for tiles, why in rows if isinstance(why, str)]
    what = "forward" if kernel == "fwd" else "backward (dQ, then dK/dV)"
    print(f"\n{kernel} tiles at B{B} H{H} S{S} D{D} bf16, causal: the {what} pass, do_bench median ms")
    print_table(["(BLOCK_M, BLOCK_N, warps, stages)", "ms", "vs today's", "why not timed"], table)
    if timed:
        print(f"summary: fastest {kernel} tiles at D{D}: {timed[0][0]}, {timed[0][1]:.3f} ms, {table[0][2]} of "
              f"today's {today}")

# takeaway: a tile that fits shared memory is not the fastest one; time the pass it runs in, per head dim and length.

# --- 8. the course's benchmarking grid: ours, plain PyTorch and SDPA; batch 1, one head, causal

GPU_GRID = {"seqs": [2**i for i in range(7, 17)], "dims": list(HEAD_DIMS), "dtypes": ["bf16", "fp32"]}  # S 128-65536
CPU_GRID = {"seqs": [16, 32], "dims": [16], "dtypes": ["fp32"]}  # the interpreter: seconds, not hours
GRID_PASSES = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward+backward"}


def plain_attention(q, k, v, causal):
    """Attention as the formula reads: the (S, S) scores and probabilities in memory, kept by autograd."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (..., S, S)
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def sdpa_attention(q, k, v, causal):  # SDPA's own choice of backend (cuDNN or flash for bf16, efficient for fp32)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


GRID_IMPLS = {"ours": flash_attention, "pytorch": plain_attention, "sdpa": sdpa_attention}


def median_ms(fn):
    """fn's median time in ms: do_bench on a GPU (L2 flushed before each call); under the interpreter the
    CPU's wall clock, after one warm-up call (do_bench needs a GPU driver)."""
    if not INTERPRETED:
        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_pass(name, f, q, k, v, do):
    """Median ms of one pass of causal attention f; autograd.grad, unlike .backward(), accumulates no .grad."""
    if name == "fwd":
        return median_ms(lambda: f(q, k, v, True))
    if name == "fwd+bwd":
        return median_ms(lambda: torch.autograd.grad(f(q, k, v, True), (q, k, v), do))
    o = f(q, k, v, True)  # the backward alone replays one forward's graph, which retain_graph keeps for the next call
    return median_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))


def time_cell(impl, f, S, D, dtype, passes):
    """{pass: median ms, "OOM" or "n/a"} of f on one (1, 1, S, D) head per q, k, v; the inputs die with this frame."""
    device = "cpu" if INTERPRETED else "cuda"
    q, k, v, do = (torch.randn(1, 1, S, D, device=device, dtype=dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))  # the forward is timed as training runs it, saving for backward
    cell = {}
    for name in passes:
        try:
            cell[name] = time_pass(name, f, q, k, v, do)
        except torch.OutOfMemoryError:  # plain PyTorch's (S, S) matrices at long S: a cell, and the grid goes on
            cell[name] = "OOM"
        except RuntimeError as e:  # a backend that refuses these inputs: a cell too, and the reason
            cell[name] = "n/a"
            print(f"  n/a: {impl} {name} at S{S} D{D} {dtype}: {str(e).strip().splitlines()[0][:120]}", flush=True)
        if not INTERPRETED:  # after the except block, whose traceback held the failed pass's tensors
            torch.cuda.empty_cache()
    return cell


def run_grid(seqs, dims, dtypes, passes, impls):
    """{(dtype, D, S): {impl: {pass: ms, "OOM" or "n/a"}}}, a progress line per row."""
    keys = [(dtype, D, S) for dtype in dtypes for D in dims for S in seqs]
    results, last, start = {}, passes[-1], time.perf_counter()
    for i, (dtype, D, S) in enumerate(keys, 1):
        row = {name: time_cell(name, f, S, D, DTYPES[dtype], passes) for name, f in impls.items()}
        results[dtype, D, S] = row
        done = ", ".join(f"{name} {fmt_ms(cell[last])}" for name, cell in row.items())
        print(f"  [{i}/{len(keys)}, {time.perf_counter() - start:.0f} s] {dtype} D{D} S{S} {last} ms: {done}",
              flush=True)
    return results


def fmt_ms(ms):
    return ms if isinstance(ms, str) else f"{ms:.3f}"


def ratio(cells, other, name):  # the other implementation's time over ours: above 1, ours is faster
    ours, theirs = cells["ours"][name], cells[other][name]
    if isinstance(ours, str) or isinstance(theirs, str):
        return "n/a"
    return f"{theirs / ours:.3g}"


def print_grid(results, passes):
    """One table per pass: a row per (dtype, D, S), a column per implementation, then theirs / ours."""
    impls = list(next(iter(results.values())))
    others = [name for name in impls if name != "ours"]
    for name in passes:
        rows = [[dtype, D, S, *(fmt_ms(cells[impl][name]) for impl in impls),
                 *(ratio(cells, other, name) for other in others)] for (dtype, D, S), cells in results.items()]
        clock = "wall clock" if INTERPRETED else "do_bench"
        print(f"\n{GRID_PASSES[name]}, causal, batch 1, one head; ms: median ({clock})")
        print_table(["dtype", "D", "S", *(f"{impl} ms" for impl in impls), *(f"{other} / ours" for other in others)],
                    rows)


def grid_summary(results, name):
    """One line: each other implementation's time over ours (median over the rows where both ran), and the OOMs."""
    parts = []
    for other in [impl for impl in next(iter(results.values())) if impl != "ours"]:
        ratios = [float(r) for r in (ratio(cells, other, name) for cells in results.values()) if r != "n/a"]
        if ratios:
            parts.append(f"{other} / ours {statistics.median(ratios):.3g}x (median of {len(ratios)} rows)")
    ooms = [f"{impl} {dtype} D{D} S{S}" for (dtype, D, S), cells in results.items() for impl, cell in cells.items()
            if "OOM" in cell.values()]
    oom_text = "no OOM"
    if ooms:
        oom_text = f"OOM: {ooms[0]} and {len(ooms) - 1} more" if len(ooms) > 1 else f"OOM: {ooms[0]}"
    return f"summary: {GRID_PASSES[name]}: {'; '.join(parts) or 'nothing to compare'}; {oom_text}"


def plot_grid(results, name, path):
    """ms of one pass against S, a line per implementation, a panel per (dtype, D)."""
    plt = pyplot()
    dtypes = list(dict.fromkeys(dtype for dtype, _, _ in results))
    dims = list(dict.fromkeys(D for _, D, _ in results))
    fig, axes = plt.subplots(len(dtypes), len(dims), figsize=(4 * len(dims), 3.2 * len(dtypes)), squeeze=False)
    for (r, dtype), (c, D) in itertools.product(enumerate(dtypes), enumerate(dims)):
        ax = axes[r][c]
        for impl in next(iter(results.values())):
            points = [(S, cells[impl][name]) for (t, d, S), cells in results.items()
                      if (t, d) == (dtype, D) and not isinstance(cells[impl][name], str)]
            if points:
                ax.plot(*zip(*points), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="sequence length", ylabel=f"{GRID_PASSES[name]} ms", title=f"{dtype} D={D}")
        ax.legend(fontsize=7)
    # two short lines: one long line was wider than a single panel's figure and came out cut at both ends
    fig.suptitle(f"causal attention, {GRID_PASSES[name]}\nbatch 1, one head")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # (the saved area grown to all the text, as plot_tflops's)
    print(f"wrote {path}")


def grid(seqs, dims, dtypes, passes, plot, impls=GRID_IMPLS):
    """The grid, defaults by machine (the course's on a GPU, a tiny one under the interpreter); passes in order."""
    if INTERPRETED:
        defaults = CPU_GRID
        print("no CUDA GPU: a tiny grid under TRITON_INTERPRET=1 timed by the wall clock: a test, not a measurement")
    else:
        defaults = GPU_GRID
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    seqs, dims, dtypes = seqs or defaults["seqs"], dims or defaults["dims"], dtypes or defaults["dtypes"]
    passes = [name for name in GRID_PASSES if name in (passes or GRID_PASSES)]  # fwd, bwd, fwd+bwd: in that order
    rows = len(seqs) * len(dims) * len(dtypes)
    print(f"grid: {rows} rows (S x D x dtype) x {len(impls)} implementations x {len(passes)} passes = "
          f"{rows * len(impls) * len(passes)} timings; on a GPU do_bench runs each for about 0.1 s and each "
          "(D, dtype) compiles the kernels first: this takes a while. A line per row:", flush=True)
    results = run_grid(seqs, dims, dtypes, passes, impls)
    print_grid(results, passes)
    if plot:
        plot_grid(results, passes[-1], plot)
    print(grid_summary(results, passes[-1]))

# takeaway: the (S, S) matrices make plain attention quadratic in memory; the fused kernels stay linear.

# --- 9. main: flags, each validated by a type= helper (a bad value: argparse's one-line error, exit 2)


def print_table(headers, rows):
    cells = [[str(c) for c in row] for row in (headers, *rows)]
    widths = [max(map(len, column)) for column in zip(*cells)]
    for n, row in enumerate([cells[0], ["-" * w for w in widths], *cells[1:]]):
        padded = (c.ljust(w) if i < 2 or n < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        print("  ".join(padded).rstrip())


def whole_number(text, low=1):
    if not text.strip().isdigit() or int(text) < low:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number of at least {low}")
    return int(text)


def shape(text):  # --shapes: BxHxSxD
    sizes = text.split("x")
    if len(sizes) != 4 or not all(s.isdigit() and int(s) > 0 for s in sizes) or int(sizes[3]) not in HEAD_DIMS:
        raise argparse.ArgumentTypeError(f"'{text}' is not BxHxSxD with positive sizes and D one of {HEAD_DIMS}")
    return (*map(int, sizes), "bf16")


def power_of_two(text):  # --seqs
    n = whole_number(text, 0)
    if not 16 <= n <= 65536 or n & (n - 1):
        raise argparse.ArgumentTypeError(f"sequence length {n} is not a power of two from 16 to 65536")
    return n


def head_dim(text):  # --dims
    n = whole_number(text)
    if n not in HEAD_DIMS:
        raise argparse.ArgumentTypeError(f"head dim {n} is not supported by the kernels; use one of {HEAD_DIMS}")
    return n


def one_of(choices):  # --dtypes, --passes
    def parse(text):
        if text not in choices:
            raise argparse.ArgumentTypeError(f"'{text}' is not one of {', '.join(choices)}")
        return text
    return parse


def comma_list(item):  # type=comma_list(item): "a,b" -> [item("a"), item("b")], duplicates dropped
    def parse(text):
        return list(dict.fromkeys(item(part.strip()) for part in text.split(",")))
    return parse


def fail(message):
    """A refusal of well-formed flags that this machine cannot honour (no CUDA GPU): one sentence and exit status 2,
    no usage block and no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def plot_problem(path):  # why --plot cannot write `path`, checked before any work; or None
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"--plot {path} must name a PNG file in an existing, writable folder"
    if importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib (pip install matplotlib)"
    return None


CHECK_SHAPE = (2, 3, 80, 32, "fp32")  # the interpreter's default check: ragged tiles, several heads
INTERPRETER_WORK = 2**20  # most B*H*S^2 a --shapes check may cost on the interpreter: 1x4x512 took 20 s, 2 cores


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=comma_list(shape), help="comma-separated BxHxSxD, bf16, e.g. 1x16x16384x64 "
                   "(default: the targets and fp32); without a GPU: the shapes the kernels are checked at, in fp32")
    p.add_argument("--repeats", type=whole_number, help="times each shape is measured, every implementation in turn "
                   "(default 2)")
    p.add_argument("--plot", help="draw fwd+bwd TFLOP/s per shape (with --grid: ms against S) into this PNG")
    p.add_argument("--grid", action="store_true", help="the course's grid: batch 1, causal, ours vs plain PyTorch "
                   "vs SDPA over every S, D, dtype and pass")
    p.add_argument("--seqs", type=comma_list(power_of_two), help="grid sequence lengths (default 128,256,...,65536)")
    p.add_argument("--dims", type=comma_list(head_dim), help="grid head dims (default 16,32,64,128)")
    p.add_argument("--dtypes", type=comma_list(one_of(list(DTYPES))), help="grid dtypes (default bf16,fp32)")
    p.add_argument("--passes", type=comma_list(one_of(list(GRID_PASSES))), help="grid passes (default all)")
    p.add_argument("--tiles", choices=list(TILE_CANDIDATES), help="time every candidate tile of this kernel in its "
                   "pass, bf16, at B1 H16 S16384 for each of --dims (default 64,128) or at --shapes; CUDA GPU only")
    args = p.parse_args(argv)
    narrowing = [flag for flag in ("seqs", "dims", "dtypes", "passes") if getattr(args, flag) is not None]
    if args.tiles:  # the search takes head dims too
        narrowing = [flag for flag in narrowing if flag != "dims"]
    if narrowing and not args.grid:
        p.error(f"--{narrowing[0]} narrows the grid: add --grid")
    if args.tiles and (args.grid or args.repeats is not None or args.plot):
        p.error("--tiles searches one kernel's tiles; drop --grid, --repeats and --plot")
    if args.grid and args.shapes:
        p.error("--shapes chooses the benchmark's shapes; the grid takes --seqs and --dims")
    if args.grid and args.repeats is not None:
        p.error("--repeats repeats the benchmark; the grid times each cell once, a do_bench median")
    problem = interpreter_problem(args) if INTERPRETED else None
    if problem:  # the flags are fine, the machine has no GPU: one line, no usage block
        fail(problem)
    problem = plot_problem(args.plot) if args.plot else None
    if problem:
        p.error(problem)
    return args


def interpreter_problem(args):  # why the flags ask what the interpreter cannot do; or None
    if args.tiles:
        return "--tiles times the kernels on a CUDA GPU; without one they are only checked (no flags)"
    if args.plot and not args.grid:
        return "--plot draws the GPU benchmark, and this machine has no CUDA GPU (nothing is timed)"
    if args.repeats is not None:
        return "--repeats times the GPU benchmark; without a CUDA GPU nothing is timed (the kernels are checked)"
    for B, H, S, D, _ in args.shapes or []:
        if B * H * S * S > INTERPRETER_WORK:  # the interpreter's time grows with B*H*S^2 (the tiles each head visits)
            return (f"--shapes {B}x{H}x{S}x{D} is too large for the CPU interpreter: B*H*S^2 = {B * H * S * S:,} is "
                    f"above {INTERPRETER_WORK:,} (about 20 s); try 1x2x64x16, or run on a CUDA GPU")
    return None


def check_error(B, H, S, D):
    """The largest relative error of O, L, dQ, dK, dV between either Function that runs the kernels (section 3's and
    section 6's) and section 4's reference, causal, fp32."""
    q, k, v, do = torch.randn(4, B, H, S, D, generator=torch.Generator().manual_seed(0))
    outs = {}
    for fn in (FlashAttention, FlashAttentionPlanned, FlashAttentionTorch):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fn.apply(*leaves, True)
        outs[fn] = (o, o.grad_fn.saved_tensors[-1], *torch.autograd.grad(o, leaves, do))  # O, L, dQ, dK, dV
    reference = outs[FlashAttentionTorch]
    return max(((a - b).norm() / b.norm()).item() for fn in (FlashAttention, FlashAttentionPlanned)
               for a, b in zip(outs[fn], reference))


def self_check(shapes):
    """No GPU: small causal cases in fp32 (the interpreter's bf16 dots are not trustworthy), the kernels against
    section 4's reference, a line per shape; exit 1 if they differ."""
    print("no CUDA GPU: the kernels run under TRITON_INTERPRET=1, through FlashAttention and the planned path, "
          "against the PyTorch reference, causal, in fp32; no benchmark", flush=True)
    errors = []
    for B, H, S, D, _ in shapes:
        errors.append(check_error(B, H, S, D))
        verdict = "ok" if errors[-1] < 1e-5 else "FAIL"
        print(f"  B{B} H{H} S{S} D{D} fp32: within {errors[-1]:.1e}: {verdict}", flush=True)
    error = max(errors)
    verdict = "ok" if error < 1e-5 else "FAIL"
    print(f"summary: O, L, dQ, dK, dV at {len(shapes)} shape(s) within {error:.1e} of the reference (relative): "
          f"{verdict}")
    sys.exit(0 if error < 1e-5 else 1)


def main(argv=None):
    args = parse_args(argv)
    if args.grid:
        grid(args.seqs, args.dims, args.dtypes, args.passes, args.plot)
        return
    if args.tiles:
        shapes = [(1, 16, 16384, D) for D in args.dims or (64, 128)]
        if args.shapes:
            shapes = [shape[:4] for shape in args.shapes]  # (B, H, S, D); the search is bf16
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
        for shape in shapes:
            report_tiles(args.tiles, shape, search_tiles(args.tiles, *shape))
        return
    if INTERPRETED:
        self_check(args.shapes or [CHECK_SHAPE])
    shapes, repeats, plot = args.shapes or SHAPES, args.repeats or 2, args.plot
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    results = run_benchmark(shapes, repeats)
    if plot:
        plot_tflops(results, plot)
    report(results, repeats)
    if GPT2_SHAPE in shapes:  # the GPT-2 shape again, from c_attn's output as gpt.py calls attention
        report_model_path(GPT2_SHAPE[:4], model_path(*GPT2_SHAPE[:4], repeats))
        report_host(repeats)  # and what its called time rests on: the host's share of a call


if __name__ == "__main__":
    def on_term(signum, frame):
        raise KeyboardInterrupt(signum)
    signal.signal(signal.SIGTERM, on_term)
    try:
        main()
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: one line, exit 130 / 143
        signum = e.args[0] if e.args else signal.SIGINT
        print(f"\ninterrupted ({signal.Signals(signum).name}): the tables above are complete, the rest did not run",
              file=sys.stderr)
        raise SystemExit(128 + signum) from None
    except BrokenPipeError:  # piped into head: end quietly (stdout to /dev/null, or the exit's flush complains)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
