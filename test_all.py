"""The one test command: `python test_all.py` (or `pytest test_all.py`); `--help` lists the tests, and
`python test_all.py SUBSTRING` runs the tests whose name contains it. CPU tests run everywhere; those marked @gpu only
where CUDA exists, each in a process of its own. Tests assert behaviour (agreement with a reference, a loss that goes
down, a clear error on bad input), never timings.

Contents, in the README's script order:
  0. helpers: running a script, bad-input tables
  1. gpt.py: presets, tokenizer, padding, attention, fused loss, FP8, flag types, the timer
  2. train.py: learning, checkpoints, FSDP and DDP, interrupts, bad input
  3. bench_attention.py: sweep, saved-bytes model, OOM, bad input
  4. precision.py: accumulation, autocast, LayerNorm overflow, FP8 scaling
  5. bench_e2e.py: ladder (and its bf16-weights lever), sweep, warm-up table, profile, bad input
  6. memory.py: the analytic model against live tensors, snapshot, checkpointing, the parallelism calculator
  7. ddp.py: all-reduce table, every wrapper, ZeRO and FSDP equal one process, bad input
  8. flash_triton.py: both autograd Functions against float64, plans, the grid, bad input
  9. the repository: each script copied with gpt.py alone runs; code style
  10. leaderboard.py: the course's model written out, memory model, one and two ranks, bad input
  the runner: main()
"""

import argparse
import contextlib
import functools
import importlib.util
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import unittest.mock
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no "USDT: ... profiler_start" lines from the profiler's library
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the scripts import each other by name, wherever the test is started from
import bench_attention as ba
import bench_e2e
import ddp
import gpt
import leaderboard as lb
import memory
import precision

HAS_CUDA = torch.cuda.is_available()

# --- 0. helpers

def gpu(test):
    """Marks a test that needs CUDA. The runner in main() runs it in a process of its own where CUDA exists and
    counts it as skipped elsewhere; under pytest it becomes a skip mark on a machine without CUDA."""
    test.needs_cuda = True
    if HAS_CUDA or "pytest" not in sys.modules:
        return test
    import pytest
    return pytest.mark.skip(reason="needs CUDA")(test)

class Skipped(Exception):
    """Raised by skip(): the runner in main() counts the test as skipped and prints the reason."""


def skip(reason):
    """A test that cannot run where it was started says why in one line and is skipped (under pytest: a skip)."""
    if "pytest" in sys.modules:
        import pytest
        pytest.skip(reason)
    raise Skipped(reason)

def env(**extra):  # unbuffered: a child's lines arrive as it prints them
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}

def run(*args, timeout=600, cwd=HERE, code=0, **extra_env):
    """`python args...` in a fresh process (torchrun, TRITON_INTERPRET), started in cwd: it must exit `code`."""
    p = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env(**extra_env), capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == code, \
        f"{' '.join(map(str, args))} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p

def popen(*args, **kw):  # `python args...`, its stdout read line by line as it comes
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=HERE, text=True, stdout=subprocess.PIPE,
                            env=env(), **kw)

def children(pid):
    return open(f"/proc/{pid}/task/{pid}/children").read().split()

def call_main(script, *args):  # script.main(args) in this process, in milliseconds: (exit status, stdout, stderr)
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            importlib.import_module(script.removesuffix(".py")).main([str(a) for a in args])
        except SystemExit as e:
            code = e.code
            if e.code is None:
                code = 0
            elif not isinstance(e.code, int):  # sys.exit("message") prints it and exits 1
                code = 1
    return code, out.getvalue(), err.getvalue()

def main_ok(script, *args):  # call_main, which must exit 0: (stdout, stderr)
    code, out, err = call_main(script, *args)
    assert code == 0, f"{script} {' '.join(map(str, args))} exited {code}:\n{out[-3000:]}\n{err[-3000:]}"
    return out, err

def check_bad_inputs(script, cases):
    """Each case args -> words (a dict or pairs; args a string or a list) exits 2, `words` in its last stderr line."""
    failures = []
    for args, says in cases.items() if isinstance(cases, dict) else cases:
        args = shlex.split(args) if isinstance(args, str) else args
        try:
            code, out, err = call_main(script, *args)
        except Exception as e:  # a traceback the user would have seen
            failures.append(f"{script} {args}: raised {type(e).__name__}: {e}")
            continue
        lines = [line for line in err.strip().splitlines() if line.strip()]
        if code != 2 or not lines or says.lower() not in lines[-1].lower():
            failures.append(f"{script} {args}: exit {code}, stderr {err.strip()[-300:]!r}, expected '{says}'")
    assert not failures, "\n".join(failures)

def plot_refusal():  # the last line of --plot notes.txt: matplotlib writes no .txt (or, missing, that it is needed)
    if importlib.util.find_spec("matplotlib"):
        return "argument --plot: matplotlib cannot write .txt files"
    return "argument --plot: needs matplotlib"

def refused_before_work(script, cases):
    """check_bad_inputs, and nothing printed before the refusal: no stdout (a table row), on stderr only argparse's
    usage (no progress line)."""
    check_bad_inputs(script, cases)
    for args, _ in cases:
        args = shlex.split(args) if isinstance(args, str) else args
        code, out, err = call_main(script, *args)
        before = err.strip().splitlines()[:-1]
        assert not out and all(line.startswith(("usage:", " ")) for line in before), (script, args, out, err)

def rel_err(got, ref):
    return ((got - ref).norm() / ref.norm()).item()

def assert_raises(says, fn, *args, **kw):  # fn(*args, **kw) raises a ValueError that says `says`
    try:
        fn(*args, **kw)
    except ValueError as e:
        assert says in str(e), (says, str(e))
    else:
        raise AssertionError(f"no error from {fn.__name__}; expected '{says}'")

# --- 1. gpt.py: presets, tokenizer, padding, attention, fused loss, FP8, the timer

def expected_params(c):  # blocks, tied embedding (once), positions, final LayerNorm
    d, f = c.n_embd, c.d_ff
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * f + f) + (f * d + d)
    return c.n_layer * block + c.vocab_size * d + c.block_size * d + 2 * d

def test_presets_param_counts():
    with torch.device("meta"):  # shapes only: nothing allocated
        for config in (gpt.make_config(name, vocab_size=v) for name in gpt.PRESETS for v in (50257, 50304)):
            assert gpt.GPT(config).num_params() == expected_params(config), config
        assert gpt.GPT(gpt.make_config("gpt2")).num_params() == 124_439_808  # GPT-2 124M, as published
    out, _ = main_ok("gpt.py", "--model", "gpt2", "--vocab", 50304)
    assert "124,475,904" in out and "38,633,472" in out, out

def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    config = gpt.make_config("tiny", vocab_size=50304)
    model = gpt.GPT(config)
    idx, targets = torch.randint(0, gpt.GPT2_VOCAB, (2, 2, 16))
    logits, loss = model(idx, targets)  # training: fused loss, no logits at all; near-uniform predictions at init
    assert logits is None and loss.requires_grad and abs(loss.item() - math.log(gpt.GPT2_VOCAB)) < 0.5
    with torch.no_grad():  # evaluation keeps the logits path
        logits, val = model(idx, targets)
    assert logits.shape == (2, 16, 50304) and abs(val.item() - loss.item()) < 1e-2
    model.config.fused_ce = False  # with targets the loss carries the graph, the logits come back detached
    logits, loss = model(idx, targets)
    assert loss.requires_grad and not logits.requires_grad and model(idx)[1] is None
    for name, p in ((n, p) for n, p in model.named_parameters() if n.endswith("c_proj.weight")):  # scaled init
        assert abs(p.std().item() - 0.02 / math.sqrt(2 * config.n_layer)) < 0.003, name

def test_tokenizer_offline_count_and_round_trip():
    enc, text = gpt.gpt2_tokenizer(), open(os.path.join(HERE, "input.txt"), encoding="utf-8").read()
    ids = enc.encode_ordinary(text)
    assert len(ids) == 338_025 and max(ids) < gpt.GPT2_VOCAB and enc.decode(ids) == text
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256] and len(gpt.load_tokens()) == 338_025

def test_vocab_padding_never_sampled():
    assert gpt.round_up(50257, 128) == gpt.round_up(50304, 128) == gpt.round_up(50257, 64) == 50304
    assert gpt.round_up(50257, 8) == 50264
    torch.manual_seed(0)
    model = gpt.GPT(gpt.make_config("tiny", vocab_size=50304))
    with torch.no_grad():  # padded ids score highest
        model.wte.weight[gpt.GPT2_VOCAB:] = 10 * model.wte.weight.abs().max()
    out = model.generate(torch.zeros(2, 1, dtype=torch.long), 20)
    assert out.shape == (2, 21) and out.max().item() < gpt.GPT2_VOCAB

def test_fused_cross_entropy_matches_reference():
    """Chunked linear cross-entropy (one chunk ragged) = F.cross_entropy on the real vocabulary: loss, both grads."""
    gen, grads = torch.Generator().manual_seed(0), {}
    x = torch.randn(300, 32, generator=gen, requires_grad=True)
    w = (torch.randn(50304, 32, generator=gen) * 0.1).requires_grad_()
    y = torch.randint(0, gpt.GPT2_VOCAB, (300,), generator=gen)
    for name in ("fused", "reference", "bf16"):
        x.grad = w.grad = None
        with gpt.autocast("cpu", torch.bfloat16 if name == "bf16" else None):
            loss = (torch.nn.functional.cross_entropy((x @ w.t())[:, :gpt.GPT2_VOCAB].float(), y)
                    if name == "reference" else gpt.linear_cross_entropy(x, w, y, chunk_rows=128))
        (3 * loss).backward()  # a non-unit upstream gradient
        grads[name] = (loss.detach(), x.grad, w.grad)
    for name, tol in (("fused", 1e-5), ("bf16", 2e-2)):  # fp32 to rounding, bf16 autocast to bf16's rounding
        errs = [rel_err(got.double(), ref.double()) for got, ref in zip(grads[name], grads["reference"])]
        assert max(errs) < tol, (name, errs)
    assert grads["fused"][2][gpt.GPT2_VOCAB:].abs().max() == 0  # padded ids: no probability, no gradient

def test_cross_entropy_kernel_matches_torch():
    """The Triton loss kernel (CUDA's path; here interpreted) = the PyTorch path: row losses, gradient, padding."""
    assert "kernel ok" in run("-c", r"""
import torch, gpt, flash_triton  # flash_triton: the interpreter fix for triton <= 3.6
gen = torch.Generator().manual_seed(0)
logits, y = 4 * torch.randn(5, 50304, generator=gen), torch.randint(0, gpt.GPT2_VOCAB, (5,), generator=gen)
a, b, loss_b = logits.clone(), logits.clone(), torch.empty(5)
loss_a = gpt.chunk_loss_and_grad(a, y, gpt.GPT2_VOCAB)
gpt._cross_entropy_rows[(5,)](b, y, loss_b, b.stride(0), gpt.GPT2_VOCAB, 50304, BLOCK=4096)
assert (loss_a - loss_b).abs().max() < 1e-5 and (a - b).abs().max() < 1e-6 and b[:, gpt.GPT2_VOCAB:].abs().max() == 0
print("kernel ok")""", timeout=120, TRITON_INTERPRET="1").stdout

def test_adamw_kernel_matches_torch():
    """The AdamW kernel (CUDA's path of gpt.adamw_step; here interpreted) = its PyTorch path, which is torch's AdamW
    op for op: parameters and moments over three steps, a ragged last block included, with fp32 gradients (gpt.AdamW's
    matrices) and with bf16 ones and a bf16 copy written (MasterWeights'), the latter with lr read from a tensor."""
    assert "kernel ok" in run("-c", r"""
import torch, gpt, flash_triton  # flash_triton: the interpreter fix for triton <= 3.6
gen = torch.Generator().manual_seed(0)
n, settings = 5000, (1e-2, 0.1, 0.9, 0.95, 1e-8)
for low in (False, True):
    torch_side = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)]
    kernel_side = [t.clone() for t in torch_side]
    step = torch.zeros(())
    for scale in (None, torch.tensor([2.5]), None):  # the second step clipped: gradients divided by 2.5
        step += 1
        grad = torch.randn(n, generator=gen)
        if low:
            grad = grad.to(torch.bfloat16)
        param, m, v, copy = torch_side
        gpt.adamw_step(param, grad, m, v, step, *settings, scale, copy if low else None)
        param, m, v, copy = kernel_side
        lr, rest = settings[0], settings[1:]
        if low:  # the learning rate read from a tensor, as a CUDA graph of the step passes it
            lr = torch.tensor(lr)
        gpt._adamw[(2,)](param, grad, m, v, copy, param if scale is None else scale, step, n, lr, *rest,
                         SCALED=scale is not None, LOW=low, LR_ON_GPU=low, BLOCK=4096)
    for a, b in zip(torch_side[:3], kernel_side[:3]):  # parameter, m, v: fp32 rounding apart at most
        assert (a - b).abs().max() <= 1e-6 * a.abs().max(), (low, (a - b).abs().max())
    if low:  # the interpreter truncates bf16 casts, the GPU rounds: the copy within one bf16 step of its master
        copy, param = kernel_side[3].float(), kernel_side[0]
        assert ((copy - param).abs() <= param.abs() * 2**-7).all()
print("kernel ok")""", timeout=120, TRITON_INTERPRET="1").stdout

@gpu
def test_adamw_kernel_gpu_rounds_as_autocast():
    """On the GPU the kernel's bf16 copy is its master rounded to nearest, as autocast's cast; the master follows
    the PyTorch path to fp32 rounding."""
    gen = torch.Generator().manual_seed(0)
    n, settings = 3_000_000, (1e-2, 0.1, 0.9, 0.95, 1e-8)
    cpu = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)]
    gpu = [t.cuda() for t in cpu]
    cpu_step, gpu_step = torch.zeros(()), torch.zeros((), device="cuda")
    for scale in (None, torch.tensor([2.5]), None):  # the second step clipped
        cpu_step += 1
        gpu_step += 1
        grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        gpt.adamw_step(cpu[0], grad, cpu[1], cpu[2], cpu_step, *settings, scale, low=cpu[3])
        gpt.adamw_step(gpu[0], grad.cuda(), gpu[1], gpu[2], gpu_step, *settings,
                       None if scale is None else scale.cuda(), low=gpu[3])
    assert torch.equal(gpu[3], gpu[0].to(torch.bfloat16))
    assert all((a - b.cpu()).abs().max() <= 1e-6 * a.abs().max() for a, b in zip(cpu[:3], gpu[:3]))

@gpu
def test_adamw_matches_torch_fused_and_shares_its_checkpoints():
    """gpt.AdamW (the matrices through the kernel) and torch's fused AdamW, given the same parameters and gradients,
    take the same five steps (three clipped through grad_scale) to fp32 rounding, and a checkpoint of either loads
    into the other and continues alike."""
    model = gpt.GPT(gpt.make_config("tiny")).cuda()
    x, y = memory.random_batch(model.config, 2, 64, "cuda")
    _, loss = model(x, y)
    loss.backward()
    params = [[p.detach().clone().requires_grad_() for p in model.parameters()] for _ in range(2)]
    optimizers = [gpt.adamw(params[0], lr=1e-2), gpt.adamw(params[1], lr=1e-2, matrix_kernel=False)]
    assert type(optimizers[0]) is gpt.AdamW and type(optimizers[1]) is torch.optim.AdamW

    def steps(scales):
        for scale in scales:
            for copy, opt in zip(params, optimizers):
                for p, original in zip(copy, model.parameters()):  # torch's writes them back divided by the scale
                    p.grad = original.grad.clone()
                opt.grad_scale = None if scale is None else torch.tensor(scale, device="cuda")
                opt.step()
        for a, b in zip(*params):
            assert (a - b).abs().max() <= 1e-6 * b.abs().max(), (a.shape, (a - b).abs().max())

    steps([None, 2.0, None, 3.0, 1.5])
    saved = [opt.state_dict() for opt in optimizers]
    optimizers[0].load_state_dict(saved[1])  # each takes the other's state
    optimizers[1].load_state_dict(saved[0])
    steps([None, 2.0])
    assert optimizers[0].state[params[0][0]]["step"].item() == 7

def fused_norms(model, on):  # a switch for matches_plain: each residual add fused with the LayerNorm after it
    model.config.fused_norms = on

def fused_bias(model, on):  # a switch for matches_plain: the fused norms with and without the biases in the kernels
    model.config.fused_norms = True
    model.config.fused_bias = on

def matches_plain(switch, device, dtype, tol):
    """A tiny GPT with switch(model, True) against the same weights with switch(model, False): loss and every
    gradient, the largest relative difference under tol."""
    config = gpt.make_config("tiny")
    torch.manual_seed(0)
    model = gpt.GPT(config).to(device)
    idx = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(5)).to(device)
    results = {}
    for fused in (False, True):
        switch(model, fused)
        model.zero_grad()
        with gpt.autocast(device, dtype):
            _, loss = model(idx, idx)
        loss.backward()
        results[fused] = [loss.detach(), *(p.grad.clone() for p in model.parameters())]
    errs = [rel_err(a.double(), b.double()) for a, b in zip(results[True], results[False])]
    assert max(errs) < tol, errs

def test_fused_norms_match_plain_and_kernels_match_torch():
    """The fused norms' loop (GPT.fused_norm_blocks) runs the model Block.forward runs (CPU, fp32: the same ops, so
    equal); the add + LayerNorm kernels (CUDA's path; here interpreted) = PyTorch's add and layer_norm, forward and
    backward, with a ragged last program (37 rows) and a ragged row (96 of 128 lanes), at both of backward's tiles
    (backward_rows: 8 rows a program below FULL_TILE_ROWS rows, 16 from there)."""
    matches_plain(fused_norms, "cpu", None, 1e-6)
    assert "kernel ok" in run("-c", r"""
import torch, gpt, flash_triton  # flash_triton: the interpreter fix for triton <= 3.6
gen = torch.Generator().manual_seed(0)
N, C = 37, 96
x, y = torch.randn(N, C, generator=gen).requires_grad_(), (0.5 * torch.randn(N, C, generator=gen)).requires_grad_()
norm = torch.nn.LayerNorm(C)
with torch.no_grad():  # not the identity LayerNorm a new module is
    norm.weight.add_(0.1 * torch.randn(C, generator=gen))
    norm.bias.add_(0.1 * torch.randn(C, generator=gen))
dr, dh = torch.randn(N, C, generator=gen), torch.randn(N, C, generator=gen)  # the stream's and LN's gradients
y_bias = (0.1 * torch.randn(C, generator=gen)).requires_grad_()  # c_proj's, with GPTConfig.fused_bias
for yb, full in ((None, gpt.FULL_TILE_ROWS), (y_bias, gpt.FULL_TILE_ROWS), (y_bias, 0)):
    gpt.FULL_TILE_ROWS = full  # 0: N rows count as many, so backward takes the whole tile's 16 rows a program
    inputs = [t for t in (x, y, yb, norm.weight, norm.bias) if t is not None]
    results = []
    for r, h in (gpt.add_layer_norm(x, y, norm, torch.float32, yb),
                 gpt.AddLayerNorm.apply(x, y, yb, norm.weight, norm.bias, norm.eps, torch.float32)):
        results.append([r, h, *torch.autograd.grad((r, h), inputs, (dr, dh))])
    for i, (want, got) in enumerate(zip(*results)):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (yb is None, full, i, (got - want).abs().max())
print("kernel ok")""", timeout=120, TRITON_INTERPRET="1").stdout

@gpu
def test_fused_norms_gpu_match_plain_bf16():
    matches_plain(fused_norms, "cuda", torch.bfloat16, 3e-2)

def test_fused_bias_matches_plain_and_kernel_matches_torch():
    """The biases added by the fused kernels (GPTConfig.fused_bias: c_proj's by the add + LayerNorm, c_fc's by
    bias_gelu) train the model the matmuls' biases train (CPU, fp32); the GELU-backward kernel that sums c_fc's bias
    gradient (CUDA's path; here interpreted) = PyTorch's GELU and sum, forward and backward, ragged both ways, at
    both of backward's tiles (16 and 32 rows a program: gpt.backward_rows); and the flag asks for what it needs."""
    matches_plain(fused_bias, "cpu", None, 1e-6)
    assert_raises("fused_bias needs fused_norms", gpt.make_config, "tiny", fused_bias=True)
    assert "kernel ok" in run("-c", r"""
import torch, gpt, flash_triton  # flash_triton: the interpreter fix for triton <= 3.6
gen = torch.Generator().manual_seed(0)
h0 = torch.randn(70, 1100, generator=gen).requires_grad_()  # 70 rows of 1,100: ragged against 16 or 32 x 1,024
b = (0.1 * torch.randn(1100, generator=gen)).requires_grad_()
dg = torch.randn(70, 1100, generator=gen)
want = torch.nn.functional.gelu(h0 + b, approximate="tanh")
want_grads = torch.autograd.grad(want, (h0, b), dg)
for full in (gpt.FULL_TILE_ROWS, 0):
    gpt.FULL_TILE_ROWS = full  # 0: 70 rows count as many, so backward takes the whole tile's 32 rows a program
    got = gpt.BiasGelu.apply(h0, b)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    for name, w, g in zip(("dh", "db"), want_grads, torch.autograd.grad(got, (h0, b), dg)):
        assert (g - w).abs().max() <= 1e-5 * w.abs().max(), (full, name, (g - w).abs().max())
print("kernel ok")""", timeout=120, TRITON_INTERPRET="1").stdout

@gpu
def test_fused_bias_gpu_matches_plain_bf16():
    matches_plain(fused_bias, "cuda", torch.bfloat16, 3e-2)

@gpu
def test_compiled_gradients_match_eager_gpu():
    """torch.compile of the model with train.py's fused kernels (loss, norms, bias) gives eager's gradients,
    in fp32 and under bf16 autocast: in fp32, a .to() that changed nothing in BiasGelu's forward once made compile
    drop the MLP's gradient (c_fc's came out 0)."""
    torch.manual_seed(0)
    model = gpt.GPT(gpt.make_config("tiny", attn="sdpa", fused_norms=True, fused_bias=True)).cuda()
    idx = torch.randint(0, gpt.GPT2_VOCAB, (2, 128), device="cuda")
    for dtype, tol in ((None, 1e-4), (torch.bfloat16, 3e-2)):
        torch._dynamo.reset()
        found = []
        for runner in (model, gpt.compile_model(model)):
            model.zero_grad(set_to_none=True)
            with gpt.autocast("cuda", dtype):
                _, loss = runner(idx, idx)
            loss.backward()
            found.append({n: torch.zeros_like(p) if p.grad is None else p.grad.float()
                          for n, p in model.named_parameters()})
        for name, ref in found[0].items():
            err = rel_err(found[1][name], ref)
            assert err < tol, f"{dtype}: {name}: relative error {err:.2e}"

def attention_matches_naive(impl, device, dtype, tol):
    """A tiny GPT's logits and gradients with attention `impl` = naive attention's; False if impl cannot run here."""
    results = {}
    for name in ("naive", impl):
        torch.manual_seed(0)
        model = gpt.GPT(gpt.make_config("tiny", attn=name, fused_ce=False)).to(device)
        idx = torch.randint(0, gpt.GPT2_VOCAB, (2, 64), device=device)
        try:
            with gpt.autocast(device, dtype):
                logits, loss = model(idx, idx)
            loss.backward()
        except RuntimeError as e:
            if name != "naive" and "kernel" in str(e).lower():  # e.g. a CUDA-only SDPA backend
                return False
            raise
        results[name] = [logits.float()] + [p.grad.float() for p in model.parameters()]
    for ref, got in zip(results["naive"], results[impl]):
        err = rel_err(got, ref)
        assert err < tol, f"{impl}: relative error {err:.2e}"
    return True

def test_attention_toggles_agree_cpu():
    checked = [impl for impl in ("sdpa", "flash", "math", "cudnn", "efficient")
               if attention_matches_naive(impl, "cpu", None, 1e-5)]
    assert {"sdpa", "math"} <= set(checked), checked
    model = gpt.GPT(gpt.make_config("tiny", attn="math"))
    assert all(b.attn.attend is gpt.ATTENTION["math"] for b in model.h)  # chosen once, at build

@gpu
def test_attention_toggles_agree_gpu():
    for impl in ("sdpa", "flash", "cudnn", "efficient", "math"):
        assert attention_matches_naive(impl, "cuda", torch.bfloat16, 3e-2), impl
        assert attention_matches_naive(impl, "cuda", None, 1e-2) or impl in ("flash", "cudnn"), impl

def test_config_and_device_errors():
    assert_raises("below", gpt.make_config, "tiny", vocab_size=50000)
    assert_raises("unknown attention", gpt.make_config, "tiny", attn="nope")
    for name, says in [("banana", "cuda:N"), ("tpu", "cuda:N"), ("mps", "cuda:N"), ("cuda:x", "cuda:N"),
                       ("cuda:7" if HAS_CUDA else "cuda", "GPU")]:
        assert_raises(says, gpt.resolve_device, name)
    check_bad_inputs("gpt.py", [("--model gpt5", "invalid choice"), ("--seq 0", "--seq: must be at least 1"),
                                ("--seq 2048", "--seq must be between 1 and the block size 256")])

def test_timer_interleaves_and_pairs():
    """Every variant runs in every round, the order rotating; per-round paired ratios read twice the work as ~2x."""
    calls = []

    def step(name, n):
        calls.append(name)
        return torch.ones(n, n) @ torch.ones(n, n)

    work = {"a": functools.partial(step, "a", 160), "b": functools.partial(step, "b", 202)}  # 202^3 / 160^3 = 2.0
    times, peaks = gpt.time_rounds(work, "cpu", rounds=6, steps=2, warmup=1)
    assert [len(t) for t in times.values()] == [6, 6] and peaks == {"a": None, "b": None}
    rounds = ["".join(calls[2 + 4 * r: 6 + 4 * r : 2]) for r in range(6)]  # after the warm-up calls
    assert rounds == ["ab", "ba"] * 3, rounds
    stats = gpt.summarize(times, baseline="a")
    assert stats["a"].ratio == 1.0 and stats["a"].low <= stats["a"].median <= stats["a"].high
    assert 1.3 < stats["b"].ratio < 3.5 and stats["b"].ratio_low <= stats["b"].ratio <= stats["b"].ratio_high, stats
    assert stats["b"].ms().count("(") == 1 and stats["b"].vs().endswith(")")
    for name, t in stats.items():  # mean and sample standard deviation over the rounds, as the course reports them
        ms = times[name]
        mean = sum(ms) / len(ms)
        std = math.sqrt(sum((m - mean) ** 2 for m in ms) / (len(ms) - 1))
        assert abs(t.mean - mean) < 1e-9 and abs(t.std - std) < 1e-9 and t.low <= t.mean <= t.high
        assert t.mean_std() == f"{mean:.2f} ± {std:.2f}"

def test_cublas_workspace_switch_puts_back_what_the_process_started_with():
    """set_cublas_workspace(False) sets both of PyTorch's workspace variables to none; True puts back the values the
    process started with, a user's own included (bench_e2e.py switches per variant, every step)."""
    saved = dict(gpt.CUBLAS_ENV_AT_START)
    try:
        for start in ({"CUBLAS_WORKSPACE_CONFIG": None, "CUBLASLT_WORKSPACE_SIZE": None},
                      {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUBLASLT_WORKSPACE_SIZE": None}):
            gpt.CUBLAS_ENV_AT_START.update(start)
            gpt.set_cublas_workspace(False)
            assert [os.environ.get(name) for name in gpt.CUBLAS_ENV] == [":0:0", "0"]
            gpt.set_cublas_workspace(True)
            assert {name: os.environ.get(name) for name in gpt.CUBLAS_ENV} == start
    finally:
        gpt.CUBLAS_ENV_AT_START.update(saved)
        gpt.set_cublas_workspace(True)

@gpu
def test_gpu_cublas_without_workspace_no_memsets_same_products():
    """PyTorch reads the workspace variables at every cuBLAS call: after set_cublas_workspace(False) the next matmuls
    (plain, with a bias through cuBLASLt, a weight gradient's transposed one) run with no memset before them and give
    the products they give with the workspace, to bf16 rounding. Switched off first, on, then off again: each switch
    allocates the workspace afresh (without that, the second call hands cuBLAS a buffer of 0 bytes and a matmul
    fails). On an H100 the workspace's memsets are there when it is on: what the switch removes."""
    from torch.profiler import ProfilerActivity, profile
    shapes = [(4096, 768), (4096, 3072), (3072, 768), (3072,)]  # x, the gradient g, the weight w, its bias b
    x, g, w, b = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in shapes]
    products, memsets = [], []
    for workspace in (False, True, False):
        gpt.set_cublas_workspace(workspace)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            products.append([x @ w.t(), torch.addmm(b, x, w.t()), g.t() @ x])
            torch.cuda.synchronize()
        memsets.append(sum(e.name.startswith("Memset") for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA))
    gpt.set_cublas_workspace(True)
    assert memsets[0] == memsets[2] == 0, memsets
    if torch.cuda.get_device_capability() == (9, 0):
        assert memsets[1] > 0, memsets
    for without, with_ws, again in zip(*products):
        assert rel_err(without.float(), with_ws.float()) < 1e-2 and torch.equal(without, again)


def test_flag_types_and_device_defaults():
    """gpt.py's argparse types: a value in range comes back parsed; one out of range, or not a number, is argparse's
    one-line error naming the flag, exit status 2. on_device picks the CPU or the GPU default."""
    import argparse
    parser = argparse.ArgumentParser(prog="demo")
    parser.add_argument("--batch", type=gpt.int_in(1))
    parser.add_argument("--seq", type=gpt.int_in(1, 1024))
    parser.add_argument("--lr", type=gpt.float_in(0))
    parser.add_argument("--sizes", type=gpt.int_list(1))
    args = parser.parse_args(["--batch", "4", "--seq", "1024", "--lr", "3e-4", "--sizes", "1, 10,100"])
    assert (args.batch, args.seq, args.lr, args.sizes) == (4, 1024, 3e-4, [1, 10, 100])
    cases = [
        (["--batch", "0"], "argument --batch: must be at least 1, got 0"),
        (["--seq", "2048"], "argument --seq: must be at most 1024, got 2048"),
        (["--batch", "two"], "argument --batch: expected an integer, got 'two'"),
        (["--batch", "1.5"], "argument --batch: expected an integer, got '1.5'"),
        (["--lr", "-1"], "argument --lr: must be at least 0, got -1"),
        (["--lr", "nan"], "argument --lr: expected a finite number, got 'nan'"),
        (["--sizes", "1,,2"], "argument --sizes: expected a comma list of integers, got '1,,2'"),
        (["--sizes", "1,0"], "argument --sizes: must be at least 1, got 0"),
    ]
    for argv, says in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
            parser.parse_args(argv)
            raise AssertionError(f"{argv} was accepted")
        assert err.getvalue().strip().splitlines()[-1] == f"demo: error: {says}", (argv, err.getvalue())
    assert gpt.on_device("cpu", cpu=2, gpu=16) == 2 and gpt.on_device(torch.device("cpu"), cpu="a", gpu="b") == "a"
    if HAS_CUDA:
        assert gpt.on_device("cuda", cpu=2, gpu=16) == 16


def test_saved_tensor_bytes_counts_storages_once():
    """The one saved-for-backward counter: x * y saves both inputs; exp saves its output; a view of a saved storage
    (q, k, v split from one tensor) counts once; tensors named in `exclude` are not counted."""
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    assert gpt.saved_tensor_bytes(lambda: (x @ w).sum()) == (8 * 16 + 16 * 16) * 4
    assert gpt.saved_tensor_bytes(lambda: (x @ w).sum(), exclude=[w]) == 8 * 16 * 4
    assert gpt.saved_tensor_bytes(lambda: x.exp().sum()) == 8 * 16 * 4  # the output, not the input
    qkv = torch.randn(8, 48, requires_grad=True) * 1  # one storage
    q, k, v = qkv.split(16, dim=1)
    assert gpt.saved_tensor_bytes(lambda: ((q @ k.t()) @ v).sum(), exclude=[x]) == (8 * 48 + 8 * 8) * 4

def test_missing_files_and_unwritable_paths_say_what():
    """Missing tokenizer files name the folder they come from; a path where no file can be created says so."""
    try:
        gpt.gpt2_tokenizer(os.path.join(HERE, "no_such_folder"))
        raise AssertionError("no error for a missing tokenizer folder")
    except FileNotFoundError as e:
        assert "copy that folder beside gpt.py" in str(e), e
    assert_raises("choose a file in a folder you can write to", gpt.check_output_path, "/proc/x.png", "--plot")


def test_plot_path_checks_the_format_with_the_flags():
    """type=gpt.plot_path: a --plot name whose extension matplotlib cannot write (notes.txt), or that has none (savefig
    would add .png), is refused as the flags are read, as is a .pgf without the LaTeX matplotlib runs for it."""
    def refusal(text):
        try:
            gpt.plot_path(text)
        except argparse.ArgumentTypeError as e:
            return str(e)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        if importlib.util.find_spec("matplotlib") is None:
            assert "needs matplotlib" in refusal(f"{tmp}/a.png")
            return
        for name in ("a.png", "a.PDF", "a.svg", "a.jpeg"):
            assert refusal(f"{tmp}/{name}") is None, name
        assert refusal(f"{tmp}/notes.txt").startswith("matplotlib cannot write .txt files; use one of "), tmp
        assert "png" in refusal(f"{tmp}/notes.txt").split("use one of ")[1]
        assert refusal(f"{tmp}/ladder") == f"{tmp}/ladder has no extension; name the format, e.g. {tmp}/ladder.png"
        assert refusal(f"{tmp}/missing/a.png").endswith("does not exist") and "is a directory" in refusal(tmp)
        with unittest.mock.patch.object(shutil, "which", return_value=None):
            assert "needs xelatex (LaTeX)" in refusal(f"{tmp}/a.pgf") and "pgf" not in refusal(f"{tmp}/notes.txt")
        with unittest.mock.patch.object(shutil, "which", return_value="/usr/bin/xelatex"):
            assert refusal(f"{tmp}/a.pgf") is None
        assert os.listdir(tmp) == []  # nothing written: the checks leave no file behind


def no_work():  # a variant for the timer that does nothing
    return None

def interrupted(work):  # gpt.run_main(work), work ending in KeyboardInterrupt: (exit status, the last stderr line)
    err, code, on_term = io.StringIO(), None, signal.getsignal(signal.SIGTERM)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            gpt.run_main(work)
    except SystemExit as e:
        code = e.code
    finally:
        signal.signal(signal.SIGTERM, on_term)  # run_main installs its own; this process keeps the runner's
    return code, err.getvalue().strip().splitlines()[-1]

def test_interrupt_line_counts_the_tables_and_rounds_printed():
    """Ctrl-C's last line names the stage and the timer's round under way and counts the tables printed; a finished
    timer's rounds are not said (the line once read "3 of 3 rounds done: 0 table(s) above are complete")."""
    def stop_after_round(n):
        def progress(r):
            if r + 1 == n:
                raise KeyboardInterrupt
        return progress

    def in_round_three():  # a table printed, then the timer of a sweep's second configuration
        gpt.print_table(["a"], [[1]])
        gpt.PROGRESS["stage"] = "configuration 2 of 4"
        gpt.time_rounds({"a": no_work}, "cpu", rounds=3, steps=1, warmup=1, progress=stop_after_round(2))

    def after_the_timer():
        gpt.time_rounds({"a": no_work}, "cpu", rounds=3, steps=1, warmup=1)
        raise KeyboardInterrupt(signal.SIGTERM)
    with unittest.mock.patch.dict(gpt.PROGRESS, {"tables": 0, "stage": "", "timer": ""}):
        code, line = interrupted(in_round_three)
        assert code == 130 and line == ("interrupted (SIGINT) while configuration 2 of 4, timing: 2 of 3 rounds done: "
                                        "the 1 table(s) above are complete, the rest did not finish"), line
    with unittest.mock.patch.dict(gpt.PROGRESS, {"tables": 0, "stage": "", "timer": ""}):
        code, line = interrupted(after_the_timer)
        assert code == 143 and line == "interrupted (SIGTERM): no table was complete yet", line


def test_output_into_head_ends_quietly():
    """`script | head`: when the reader leaves, run_main ends without a BrokenPipeError traceback."""
    code = "import gpt\ndef main():\n    for i in range(200000):\n        print('row', i)\ngpt.run_main(main)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # the reader leaves after one line, as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


@gpu
def test_fp8_linear_matches_bf16():
    """Each FP8 layer's output and gradients within 10% of bf16's (e4m3 and e5m2 round by a few percent)."""
    torch.manual_seed(0)
    for d_in, d_out in ((768, 2304), (768, 3072), (3072, 768)):
        layer, outs = torch.nn.Linear(d_in, d_out).cuda(), []
        x = torch.randn(4, 1024, d_in, device="cuda", requires_grad=True)
        dy = torch.randn(4, 1024, d_out, device="cuda")
        for cls in (torch.nn.Linear, gpt.Fp8Linear):  # the same weights, then in FP8
            layer.__class__, x.grad, layer.weight.grad = cls, None, None
            with gpt.autocast("cuda", torch.bfloat16):
                y = layer(x)
            y.backward(dy)
            outs.append((y.float(), x.grad.float(), layer.weight.grad.float()))
        assert all(rel_err(got, ref) < 0.1 for ref, got in zip(*outs)), (d_in, d_out)

# --- 2. train.py: learning, checkpoints, FSDP and DDP, interrupts, bad input

TINY = ["--device", "cpu", "--steps", 8, "--seq", 32, "--warmup", 2, "--lr", 3e-3, "--eval-every", 4, "--batch", 4]
LAYOUT = dict(atol=2e-3, rtol=0)  # another layout of one run: ~1e-4 apart in fp32; a resume without Adam's state: ~0.3

def step_values(out, field="loss"):
    return [float(ln.split(f"| {field} ")[1].split()[0]) for ln in out.splitlines()
            if ln.startswith("step") and "norm" in ln]

def train_main(*args, code=0):  # train.main in this process: (per-step losses, stdout), exit status `code`
    status, out, err = call_main("train.py", *args)
    assert status == code, f"train.py {args} exited {status}:\n{out[-2000:]}\n{err[-2000:]}"
    return step_values(out), out

@functools.cache
def reference():  # TINY on one process: every variant, resume and layout (same global batch) must reproduce it
    return train_main(*TINY, "--sample", 8)

def test_train_cpu_learns_variants_agree_nan_stops():
    """Val loss falls; --recompute 1, --no-fused-norms and --no-fused-bias are exact, --grad-accum 2 and
    --no-fused-ce agree; a NaN stops at the step named."""
    ref, out = reference()
    steps = [int(ln.split()[1]) for ln in out.splitlines() if "| loss" in ln]
    assert out.startswith("device: cpu") and steps == [*range(8)]
    vals = [float(ln.split()[-1]) for ln in out.splitlines() if ln.startswith("step") and "val loss" in ln]
    assert len(vals) == 2 and vals[1] < min(vals[0] - 0.25, math.log(gpt.GPT2_VOCAB) - 1), vals
    assert "over steps 4-7 |" in out and f"| val loss {vals[1]:.4f}" in out and "--- sample (8 tokens)" in out, out
    assert "parameters, attention sdpa |" in out, out  # the default off a GPU (test_default_attention_rule)
    assert train_main(*TINY, "--stop-after", 3, "--recompute", 1)[0] == ref[:3]
    accum = train_main(*TINY, "--stop-after", 3, "--batch", 2, "--grad-accum", 2)[0]
    torch.testing.assert_close(accum, ref[:3], **LAYOUT)
    torch.testing.assert_close(train_main(*TINY, "--stop-after", 3, "--no-fused-ce")[0], ref[:3], rtol=1e-3, atol=0)
    assert train_main(*TINY, "--stop-after", 3, "--no-fused-norms")[0] == ref[:3]  # on a CPU the same ops
    assert train_main(*TINY, "--stop-after", 3, "--no-fused-bias")[0] == ref[:3]
    finite, out = train_main(*TINY, "--lr", 1e9, "--warmup", 1, code=1)  # each step before the one named: finite
    assert f"stopped: loss is nan at step {len(finite)}; likely cause: a learning rate" in out.splitlines()[-1], out

def test_default_attention_rule():
    """train.py's --attn default: our kernels on a GPU for bf16/fp16 activations of a head dim they take, SDPA
    otherwise (the CPU, fp32, 2.7B's head dim 80)."""
    cases = [("cpu", torch.bfloat16, 64, "sdpa"), ("cuda", None, 64, "sdpa"), ("cuda", torch.float32, 64, "sdpa"),
             ("cuda", torch.bfloat16, 64, "triton"), ("cuda", torch.float16, 128, "triton"),
             ("cuda", torch.bfloat16, 80, "sdpa")]
    with unittest.mock.patch.dict(os.environ):  # without CUDA, importing flash_triton sets TRITON_INTERPRET=1
        got = [gpt.default_attention(device, dtype, D) for device, dtype, D, _ in cases]
    assert got == [want for *_, want in cases], got

def train_proc(args, torchrun=False, signum=None):
    """train.py in a fresh process (torchrun: 2 ranks), `signum` sent after step 0 (to rank 1 under torchrun)."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun else []
    proc, head = popen(*launch, "train.py", *args, stderr=subprocess.PIPE), []
    for line in proc.stdout if signum else []:
        head.append(line)
        if line.startswith("step     0 | loss"):
            kids = children(proc.pid) if torchrun else [proc.pid]
            os.kill(next(int(p) for p in kids if not torchrun or
                         b"RANK=1" in open(f"/proc/{p}/environ", "rb").read().split(b"\0")), signum)
            break
    out, err = proc.communicate(timeout=300)
    return proc.returncode, step_values("".join(head) + out), "".join(head) + out, err

def test_train_interrupts_resume_exactly_across_layouts():
    """Interrupted runs save and say how to resume; resumed on 1 process, DDP or FSDP2, every loss is one process's."""
    ref = reference()[0]
    with tempfile.TemporaryDirectory() as tmp:
        code, first, out, err = train_proc([*TINY, "--ckpt", f"{tmp}/i.pt"], signum=signal.SIGINT)
        last, k = out.strip().splitlines()[-1], len(first)
        assert code == 130 and last.startswith("interrupted (SIGINT) after step") and "Traceback" not in err, (out, err)
        assert "resume with: python train.py" in last and torch.load(f"{tmp}/i.pt", weights_only=True)["step"] == k < 8
        second, out = train_main(*TINY, "--ckpt", f"{tmp}/i.pt", "--resume")
        assert first + second == ref and f"at step {k}" in out and f"over steps {k + (8 - k) // 2}-7" in out, out
        two = [*TINY, "--batch", 2, "--ckpt", f"{tmp}/d.pt"]  # 2 ranks x batch 2: the same global batch
        code, on_ddp, out, err = train_proc(two, True, signal.SIGTERM)
        assert code != 0 and "x 2 processes" in out and "interrupted (SIGTERM) after step" in out, (out, err[-2000:])
        assert "resume with: torchrun --nproc_per_node=2" in out
        assert torch.load(f"{tmp}/d.pt", weights_only=True)["step"] == len(on_ddp) < 6
        code, on_fsdp, out, err = train_proc([*two, "--fsdp", "--resume", "--stop-after", 6], True)
        assert code == 0 and "FSDP" in out, (out, err[-2000:])
        last = train_main(*TINY, "--ckpt", f"{tmp}/d.pt", "--resume")[0]
        torch.testing.assert_close(on_ddp + on_fsdp + last, ref, **LAYOUT)

def free_port():  # a TCP port nothing listens on now, for a rendezvous on localhost
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def two_nodes(args):
    """train.py as a two-node job on this machine: two torchrun agents of one process each, meeting at a c10d
    rendezvous on localhost (gloo), as two machines would meet at the first one's address. (losses, stdout)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
              "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id", "two-nodes",
              "train.py", *map(str, args)]
    agents = [subprocess.Popen(launch, cwd=HERE, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    outs = [agent.communicate(timeout=600) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outs
    out = "".join(o for o, _ in outs)  # rank 0 speaks for the job, on whichever agent it is
    return step_values(out), out

def test_train_two_nodes_on_one_machine_save_and_resume():
    """Two agents (nodes) train one job, save a checkpoint and resume it: every loss is one process's."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [*TINY, "--batch", 2, "--ckpt", f"{tmp}/nodes.pt"]  # 2 ranks x batch 2: the same global batch
        first, out = two_nodes([*args, "--stop-after", 4])
        assert len(first) == 4 and "x 2 processes" in out, out
        second, out = two_nodes([*args, "--resume"])
        assert "resumed from" in out and "at step 4" in out, out
        torch.testing.assert_close(first + second, reference()[0], **LAYOUT)

def test_train_master_weights_resume_exactly_and_share_checkpoints():
    """--bf16 in one process keeps bf16 weights in the model and fp32 masters in the optimizer (gpt.MasterWeights),
    with --grad-accum too: stopped and resumed, every loss is the whole run's, and it loses as autocast does; its
    checkpoint holds the fp32 masters as a run without it saves its weights, so either kind of run resumes the
    other's checkpoint."""
    bf16 = [*TINY, "--bf16"]
    whole, out = train_main(*bf16)
    autocast, out_autocast = train_main(*bf16, "--no-master-weights")
    assert "bf16 weights kept by the optimizer |" in out and "kept by the optimizer" not in out_autocast, out
    torch.testing.assert_close(whole, autocast, atol=1e-3, rtol=0)  # the same math: the clip's norm summed apart
    accumulated = [*bf16, "--grad-accum", 3]  # kept under accumulation too, the micro-batches summed in fp32
    kept, out_kept = train_main(*accumulated)
    assert "bf16 weights kept by the optimizer |" in out_kept and "accum 3" in out_kept, out_kept
    torch.testing.assert_close(kept, train_main(*accumulated, "--no-master-weights")[0], atol=1e-3, rtol=0)
    with tempfile.TemporaryDirectory() as tmp:
        first = train_main(*bf16, "--ckpt", f"{tmp}/m.pt", "--stop-after", 3)[0]
        state = torch.load(f"{tmp}/m.pt", weights_only=True)
        assert state["model"]["h.0.mlp.c_fc.weight"].dtype == torch.float32
        assert state["optimizer"]["state"]["h.0.mlp.c_fc.weight"]["step"].item() == 3
        shutil.copy(f"{tmp}/m.pt", f"{tmp}/a.pt")
        assert first + train_main(*bf16, "--ckpt", f"{tmp}/m.pt", "--resume")[0] == whole
        second = train_main(*bf16, "--ckpt", f"{tmp}/a.pt", "--resume", "--no-master-weights")[0]
        torch.testing.assert_close(first + second, whole, atol=1e-3, rtol=0)
        train_main(*bf16, "--no-master-weights", "--ckpt", f"{tmp}/n.pt", "--stop-after", 3)
        third = train_main(*bf16, "--ckpt", f"{tmp}/n.pt", "--resume")[0]
        torch.testing.assert_close(autocast[:3] + third, autocast, atol=1e-3, rtol=0)

def test_train_data_parallel_keeps_bf16_weights_and_matches_one_process():
    """--bf16 on two ranks keeps the bf16 weights too (gpt.MasterWeights), their gradients all-reduced in bf16: every
    loss is the one-process run's on the same global batch, to bf16's rounding, and the checkpoint rank 0 saves
    resumes in one process where the two ranks stopped."""
    bf16 = [*TINY, "--bf16"]
    one, out_one = train_main(*bf16)
    with tempfile.TemporaryDirectory() as tmp:
        code, two, out, err = train_proc([*bf16, "--batch", 2, "--ckpt", f"{tmp}/b.pt", "--stop-after", 5], True)
        assert code == 0 and "bf16 weights kept by the optimizer" in out and "x 2 processes" in out, (out, err[-2000:])
        rest, out = train_main(*bf16, "--ckpt", f"{tmp}/b.pt", "--resume")  # one process, the same global batch
        assert "at step 5" in out, out
    torch.testing.assert_close(two + rest, one, atol=2e-3, rtol=0)  # bf16 gradients summed apart: ~4e-4

def test_every_script_stops_cleanly_on_signals():
    """SIGINT or SIGTERM mid-run: exit 130 / 143, a last line that says so, no traceback; ddp.py's ranks end too."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # inherited: Python then installs no Ctrl-C handler
        skip("SIGINT is ignored where the tests run (as in a background job started by a script), and the scripts "
             "started from here inherit that, so Ctrl-C cannot be tested")
    cpu = ["--device", "cpu"]
    for script, args, after, signum in [
            ("bench_e2e.py", [*cpu, "--ladder", "--batch", 1, "--seq", 16, "--rounds", 10**6], "round", signal.SIGINT),
            ("bench_attention.py", [*cpu, "--rounds", 10**6], "configurations: ", signal.SIGTERM),  # then the sweep
            ("precision.py", cpu, "== 1.", signal.SIGINT),
            ("memory.py", ["checkpoint", *cpu, "--rounds", 10**6], "round", signal.SIGTERM),
            ("ddp.py", ["selftest", "--backend", "gloo", "--steps", 10**6], "selftest:", signal.SIGTERM),
            ("leaderboard.py", [*cpu, "--steps", 10**6], "predicted peak", signal.SIGINT)]:
        proc = popen(script, *args, stderr=subprocess.STDOUT)
        watchdog = threading.Timer(90, proc.kill)  # a marker that never comes fails the test instead of hanging it
        watchdog.start()
        head = next((line for line in iter(proc.stdout.readline, "") if after in line), None)
        time.sleep(1)  # under way (ddp.py: the ranks started; spawn's resource tracker is no rank)
        ranks = [p for p in children(proc.pid) if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]
        proc.send_signal(signum)
        out = proc.communicate(timeout=60)[0]
        watchdog.cancel()
        last = out.strip().splitlines()[-1] if out.strip() else ""
        stopped = proc.returncode == 128 + signum and last.startswith("interrupted (") and "Traceback" not in out
        assert head and stopped, (script, proc.returncode, out[-2000:])
        assert script != "ddp.py" or (ranks and not any(map(running, ranks))), ranks
        said = "while configuration 1 of 4 (D=16 S=64)" in last and last.endswith("no table was complete yet")
        assert script != "bench_attention.py" or said, last  # the stage and the tables, as printed

def running(pid):  # whether pid exists and has not ended (an ended one nobody reaped is a zombie, state Z)
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

def test_fused_clipping_matches_clip_grad_norm():
    """gpt.clip_gradients, fused AdamW (the clip inside its kernel) and plain, steps as clip_grad_norm_ does."""
    def params_after(clip, fused=True):
        torch.manual_seed(0)
        model, gen = torch.nn.Linear(16, 8), torch.Generator().manual_seed(1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        for scale in (10.0, 0.01):  # clipped, then not: after one step Adam's scale invariance hides a missing clip
            model.weight.grad, model.bias.grad = (torch.randn(p.shape, generator=gen) * scale
                                                  for p in model.parameters())
            clip(model, optimizer)
            optimizer.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = params_after(lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    for fused in (True, False):
        ours = params_after(lambda m, o: gpt.clip_gradients(m, o, 1.0), fused)
        assert (ours - ref).abs().max() < 1e-6 < (params_after(lambda m, o: None) - ref).abs().max() / 100, fused

def test_train_bad_input_and_checkpoints():
    """Each kind of mistake: exit 2, one sentence, before any work; a failed write leaves the last checkpoint only."""
    text = open(os.path.join(HERE, "input.txt"), "rb").read()
    with tempfile.TemporaryDirectory() as tmp:
        open(f"{tmp}/short.txt", "wb").write(text[:2000])  # ~520 tokens: one batch of 2 x 32, a single validation row
        one, R = f"--device cpu --steps 2 --batch 2 --seq 32 --data {tmp}/short.txt", f"--resume --ckpt {tmp}"
        ok = [*one.split(), "--ckpt", f"{tmp}/ok.pt"]  # the short run, with its checkpoint
        assert "evaluating 1 sequences" in train_main(*ok, "--stop-after", 1)[1]
        state = torch.load(f"{tmp}/ok.pt", weights_only=True)
        for name, value in {"shape": {**state, "model": {**state["model"], "wpe.weight": torch.zeros(3, 3)}},
                            "model": {**state, "run": {**state["run"], "model": "gpt2"}}, "bare": state["model"],
                            "tensor": torch.ones(3), "random": os.urandom(4096), "empty": b""}.items():
            with open(f"{tmp}/{name}.pt", "wb") as f:
                f.write(value) if isinstance(value, bytes) else torch.save(value, f)
        check_bad_inputs("train.py", {
            "--model gpt5": "unknown model", "--model gpt2 --seq 2048": "block size", "--bf16 --fp16": "exclusive",
            "--vocab 50000": "--vocab: must be at least 50257", "--min-lr 1e-3": "between 0 and --lr",
            "--device banana": "cuda:N",
            "--fp8": "--fp8 needs", "--fsdp": "under torchrun", "--fsdp --fp16": "GradScaler",
            "--ckpt ''": "a file name", "--model tiny --recompute 5": "above the 4",
            "--ckpt input.txt": "refusing to overwrite", f"--ckpt {tmp}": "is a directory",
            f"--ckpt {tmp}/no/x.pt": "does not exist", f"{R}/none.pt": "--resume needs",
            f"--data {tmp}/input.txt": "missing", "--batch 2000 --seq 256": "training split holds",
            f"{one} --seq 64": "validation split holds", f"{one} --stop-after 1 {R}/ok.pt": "nothing left to run",
            f"{one} --steps 3 {R}/ok.pt": "made with --steps 2, not 3", f"{one} {R}/model.pt": "made with --model gpt2",
            f"{one} {R}/shape.pt": "wpe.weight is (3, 3) there", f"{R}/random.pt": "torch.load cannot read it",
            f"{R}/empty.pt": "empty file", f"{R}/bare.pt": "weights alone", f"{R}/tensor.pt": "bare tensor",
            f"{one} --ckpt {tmp}/ok.pt": "already holds a checkpoint: continue it with --resume",
            "--resume": "needs --ckpt", f"{R}/ok.pt --overwrite": "exclusive", f"--data {tmp}": "is a directory",
            "--lr nan": "--lr: expected a finite number", "--min-lr inf": "finite",
            "--ckpt /proc/x.pt": "cannot be written",
            "--device cpu --model 2.7B --vocab 16777216 --batch 1 --seq 64": "of this machine's memory",
            f"{one} --stop-after 1 {R}/ok.pt --steps 2": "(a step of the run, not a count)",
            **{f"--{f} {v}": f"--{f}: must be at least 1, got {v}" for f in ("batch", "stop-after", "recompute")
               for v in (0, -1)},
            **{f"--{f} -1": f"--{f}: must be at least 0, got -1"
               for f in ("warmup", "grad-clip", "weight-decay", "sample", "fp8")},
            "--batch 2.5": "--batch: expected an integer", "--attn fast": "invalid choice: 'fast'",
            **({} if HAS_CUDA else {"--fp16": "needs a CUDA GPU", "--device cuda": "no CUDA GPU",
                                    "--fp8 0 --bf16": "FP8 tensor"})})
        assert open(os.path.join(HERE, "input.txt"), "rb").read() == text  # --ckpt input.txt left it alone
        def full_disk(obj, path):  # the write fails halfway
            open(path, "wb").write(b"partial")
            raise OSError(28, "No space left on device")
        with unittest.mock.patch.object(torch, "save", full_disk):
            code, _, err = call_main("train.py", *ok, "--stop-after", 1, "--overwrite")
        assert code == 2 and "could not write the checkpoint" in err and "No space left" in err, err
        assert "the previous one is intact" in err, err
        assert not os.path.exists(f"{tmp}/ok.pt.tmp") and torch.load(f"{tmp}/ok.pt", weights_only=True)["step"] == 1
        with unittest.mock.patch.object(torch, "save", full_disk):  # a first save: there is no previous one
            code, _, err = call_main("train.py", *one.split(), "--ckpt", f"{tmp}/first.pt", "--stop-after", 1)
        assert code == 2 and "no checkpoint has been written yet" in err and "intact" not in err, err
        before = open(f"{tmp}/ok.pt", "rb").read()  # a run without --resume leaves it alone, byte for byte
        assert call_main("train.py", *ok)[0] == 2 and open(f"{tmp}/ok.pt", "rb").read() == before
        losses, out = train_main(*ok, "--resume", "--bf16")  # a change of precision is said
        assert "was trained in fp32; this run continues in bf16" in out and len(losses) == 1, out

def test_train_bad_input_under_torchrun_said_once_before_any_process_group():
    """Under torchrun a mistake is found before a process group starts, and said once: rank 0 says it and exits 2
    first, the others exit 2 silently when torchrun ends them (and say it themselves if it never does); no traceback
    from our code (torchrun prints its own, on the failed ranks)."""
    import train
    cases = [  # one mistake found by each check in train.main, in its order
        ("--grad-accum 0", "--grad-accum: must be at least 1, got 0"), ("--fp16 --bf16", "exclusive"),
        ("--device banana", "cuda:N"), ("--min-lr 1e-3", "between 0 and --lr"),
        ("--model nope", "unknown model 'nope'"), ("--data missing.txt", "missing.txt is missing"),
        ("--device cpu --batch 1000 --seq 256", "batch x seq x processes"),  # x 2 processes: too big
        ("--device cpu --model 2.7B --vocab 16777216 --batch 1 --seq 64", "of this machine's memory"),
        ("--resume --ckpt input.txt", "torch.load cannot read it")]
    started = AssertionError("a process group started before every flag and file was checked")
    sigterm = signal.getsignal(signal.SIGTERM)  # a silent rank sets its own, to end its wait
    for rank in (0, 1):  # torchrun's two ranks on one machine (on two machines of one GPU each where only one GPU is)
        ranks = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        if HAS_CUDA and torch.cuda.device_count() < 2:  # else every case would stop at "more processes than GPUs"
            ranks.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        with unittest.mock.patch.dict(os.environ, ranks), unittest.mock.patch.object(train, "RANK_0_GRACE_S", 0), \
                unittest.mock.patch.object(torch.distributed, "init_process_group", side_effect=started):
            if rank == 0:
                check_bad_inputs("train.py", cases)
            else:  # no SIGTERM comes (grace 0): as if rank 0 had not met the mistake, rank 1 says it itself
                for args, says in cases:
                    code, out, err = call_main("train.py", *shlex.split(args))
                    assert code == 2 and out == "" and err.startswith("rank 1: "), (args, code, out, err)
                    assert says.lower() in err.lower(), (args, err)
    signal.signal(signal.SIGTERM, sigterm)
    code, _, out, err = train_proc(["--grad-accum", 0, "--steps", 2], torchrun=True)
    both, says = out + err, "error: argument --grad-accum: must be at least 1, got 0"
    traceback_of_ours = re.findall(r'File ".*(?:train|gpt)\.py", line', both)
    assert code != 0 and both.count(says) == 1 and not traceback_of_ours, (code, both[-3000:])
    first = both.split("Root Cause")[-1]  # torchrun's report of the first rank to fail
    assert "rank      : 0 " in first and "exitcode  : 2 " in first, both[-3000:]

@gpu
def test_train_gpu_recompute_fp8_fused_ce_compile():
    """Recompute lowers the peak, FP8 compiled learns, fused CE = plain, compiled = eager, fp16 learns."""
    # the recompute pair runs first: no compiled graph holds memory yet
    peaks = [float(train_main("--bf16", "--vocab", 50304, "--steps", 2, "--batch", 16, "--seq", 512, "--eval-steps", 1,
                              *extra)[1].split("peak mem")[1].split()[0]) for extra in ([], ["--recompute", 1])]
    assert peaks[1] < 0.85 * peaks[0], peaks
    gpt2 = ["--vocab", 50304, "--steps", 20, "--batch", 8, "--seq", 256, "--warmup", 5, "--eval-steps", 1]
    plain_fp8 = train_main(*gpt2, "--bf16", "--fp8", "--stop-after", 1)[1]  # gpt2's layers: all narrower than 2048
    assert "0 of 48 block Linears in FP8" in plain_fp8, plain_fp8
    losses, out = train_main(*gpt2, "--bf16", "--fp8", 0, "--compile")
    assert "48 of 48 block Linears" in out and len(losses) == 20 and sum(losses[-5:]) / 5 < losses[0] - 1, out[-3000:]
    torch.testing.assert_close(train_main(*gpt2)[0], train_main(*gpt2, "--no-fused-ce")[0], rtol=1e-3, atol=0)
    tiny = ["--model", "tiny", "--steps", 8, "--batch", 4, "--seq", 128, "--warmup", 1, "--lr", 3e-3,
            "--device", "cuda"]
    compiled, eager = (train_main(*tiny, "--bf16", "--nvtx", *extra)[1] for extra in (["--compile"], []))
    torch.testing.assert_close(step_values(compiled), step_values(eager), atol=0.05, rtol=0)
    torch.testing.assert_close(step_values(compiled, "norm"), step_values(eager, "norm"), rtol=0.05, atol=0)
    fp16 = train_main(*tiny, "--fp16")[0]
    assert len(fp16) == 8 and fp16[-1] < fp16[0] - 1, fp16

@gpu
def test_train_gpu_two_ranks_average_as_one_process():
    """Data parallel on two GPUs over NCCL (its average, the gradients left as views of the reduced buffer) trains as
    one GPU does with the whole batch: fp32 eager, and bf16 compiled as one CUDA graph with the kept bf16 weights."""
    if torch.cuda.device_count() < 2:
        skip("needs 2 GPUs")
    tiny = ["--model", "tiny", "--steps", 8, "--seq", 128, "--warmup", 1, "--lr", 3e-3, "--eval-every", 1000]
    two = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *tiny, "--batch", 2]
    for extra, tolerance in (([], LAYOUT), (["--bf16", "--compile"], dict(atol=0.05, rtol=0))):
        one, out_one = train_main(*tiny, "--batch", 4, *extra)
        out_two = run(*two, *extra, timeout=600).stdout
        assert "x 2 processes)" in out_two and len(step_values(out_two)) == 8, out_two
        if extra:
            assert "bf16 weights kept by the optimizer" in out_two, out_two
        torch.testing.assert_close(step_values(out_two), one, **tolerance)
        assert one[-1] < one[0] - 1, out_one

@gpu
def test_graphed_step_matches_train_step_and_undoes_its_warmup():
    """gpt.GraphedStep replays what train_step computes (fp32, two micro-batches, a new lr each step, the clip; and
    bf16 with the kept bf16 weights over three micro-batches, summed in fp32 between them), and its capture leaves
    the weights and AdamW's state as they were: training starts at step 0."""
    config = gpt.make_config("tiny", attn="sdpa", fused_norms=True, fused_bias=True)
    for kept in (False, True):
        micro = 3 if kept else 2
        dtype = torch.bfloat16 if kept else None
        batches = [[torch.randint(0, 50257, (2, 64), device="cuda") for _ in range(2 * micro)] for _ in range(3)]
        runs = []
        for graph in (False, True):
            torch.manual_seed(0)
            model = gpt.GPT(config).cuda()
            if kept:
                optimizer = gpt.MasterWeights(model, 1e-3)
            else:
                optimizer = gpt.configure_optimizer(model, 1e-3)
            first = [p.detach().clone() for p in model.parameters()]
            step = None
            if graph:
                step = gpt.GraphedStep(model, optimizer, batches[0][:micro], batches[0][micro:], dtype, 1.0)
                assert all(torch.equal(p, q) for p, q in zip(model.parameters(), first)), "the warm-up changed weights"
                assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in optimizer.state.values())
            losses = []
            for i, b in enumerate(batches):
                lr = 1e-3 * (i + 1)
                if step is None:
                    loss, _ = gpt.train_step(model, optimizer, b[:micro], b[micro:], dtype, grad_clip=1.0, lr=lr,
                                             return_norm=True)
                else:
                    loss, _ = step(b[:micro], b[micro:], lr)
                losses.append(loss.item())
            assert optimizer.param_groups[0]["lr"] == lr and not torch.is_tensor(optimizer.param_groups[0]["lr"])
            runs.append((losses, [p.detach().float().clone() for p in model.parameters()]))
        (eager_losses, eager_weights), (graph_losses, graph_weights) = runs
        torch.testing.assert_close(graph_losses, eager_losses, rtol=1e-5, atol=0)
        for a, b in zip(graph_weights, eager_weights):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

# --- 3. bench_attention.py: sweep through the timer, saved-bytes model, script and plot, OOM, bad input

def test_bench_attention_sweep_saved_bytes_and_script():
    args = ba.parse_args(["--impl", "naive,flash,efficient,math", "--d", "16", "--seq", "32,64", "--rounds", "3",
                          "--steps", "1", "--warmup", "1", "--dtype", "fp32", "--causal", "--device", "cpu"])
    device = torch.device("cpu")
    sweep = ba.sweep_from(args, device)
    with contextlib.redirect_stderr(io.StringIO()) as progress:  # a line per configuration, on stderr
        results, _ = ba.run_sweep(sweep, ba.make_impls(sweep.impls, device), device)
    assert set(results) == {(16, 32), (16, 64)}, results
    lines = progress.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["[1/2", "[2/2"] and "D=16 S=64: naive ok" in lines[1], lines
    for row in results.values():
        for t in (row[name][mode] for name in ("naive", "flash", "math") for mode in ("fwd", "both")):
            assert 0 < t.low <= t.median <= t.high and t.ratio_low <= t.ratio <= t.ratio_high, t
        assert row["flash"]["both"].ratio == 1.0  # the baseline against itself, round by round
        assert HAS_CUDA or row["efficient"] == ("n/a", "needs CUDA"), row["efficient"]  # n/a, not a crash
    # what naive attention keeps for backward (one B*H*S*S matrix): predicted from the shapes = gpt's counter
    for B, H, S, D, dtype in [(2, 3, 48, 16, torch.float32), (1, 2, 40, 8, torch.bfloat16)]:
        measured = ba.counted_saved_bytes(B, H, S, D, dtype, device)
        assert ba.naive_saved_bytes(B, H, S, D, dtype) == measured, (B, H, S, D, dtype, measured)
    with tempfile.TemporaryDirectory() as tmp:
        plot = ["--plot", os.path.join(tmp, "a.png")] if importlib.util.find_spec("matplotlib") else []
        out, err = main_ok("bench_attention.py", "--impl", "naive,math", "--d", "16", "--seq", "32", "--rounds", "2",
                           "--steps", "1", "--dtype", "fp32", *plot)
        assert out.strip().splitlines()[-1].startswith("summary:"), out + err
        assert "rounds" in out and "saved pred" in out and (not plot or os.path.getsize(plot[1]) > 0), out
        assert HAS_CUDA or out.startswith("CPU smoke run, not a measurement"), out  # said first, before any timing
        assert "configurations: 1 (1 head dims x 1 sequence lengths)" in out and "[1/1, " in err, out + err

PROFILE_MATH_SDPA = """
import torch
import bench_attention as ba
q, k, v, dout = ba.random_qkv(1, 1, 16, 16, torch.float32, torch.device("cpu"))
print(ba.sdpa_ops_in(ba.ATTENTION["math"], q, k, v, dout))
"""

def test_bench_attention_profiler_finds_sdpa_quietly():
    # a fresh process: the profiler's library prints from C++ straight to the process's stderr
    p = run("-c", PROFILE_MATH_SDPA)
    assert "scaled_dot_product" in p.stdout and "USDT" not in p.stderr, p.stdout + p.stderr

def test_bench_attention_bad_input():
    check_bad_inputs("bench_attention.py", [
        ("--d 0", "--d: must be at least 1"), ("--seq 1k", "--seq"), ("--seq 64,", "comma list"),
        ("--impl naive,bogus", "unknown implementation 'bogus'"), ("--device banana", "not a device"),
        ("--rounds 0", "--rounds: must be at least 1"), ("--steps 0", "--steps: must be at least 1"),
        ("--warmup -1", "--warmup: must be at least 0"), ("--batch 0", "--batch"), ("--heads 0", "--heads"),
        ("--impl flash --baseline naive", "--baseline naive"), ("--memory-fraction 1.5", "memory-fraction"),
        ("--memory-fraction 0.5 --device cpu", "needs a CUDA device"), ("--plot /nonexistent/a.png", "--plot"),
        ("--device cpu --batch 10000000", "of this machine's memory")])
    with tempfile.TemporaryDirectory() as tmp:  # said as the flags are read: no configuration runs first
        refused_before_work("bench_attention.py", [
            (f"--device cpu --plot {tmp}/notes.txt", plot_refusal()), (f"--device cpu --plot {tmp}/a", "no extension"),
            ("--full --device cpu", "--full is the course's GPU sweep"),
            ("--full --d 64", "--full sets --d and --seq")])
        assert os.listdir(tmp) == []

def test_bench_attention_gpu_default_is_short_full_is_the_course():
    """On a GPU the default sweep is 3 configurations (a minute, not the course's minutes); --full is all 20 of the
    course's, said to take minutes before it starts."""
    cuda = torch.device("cuda")  # sweep_from and sweep_plan read only its type: no GPU needed
    default, full = (ba.sweep_from(ba.parse_args(flags), cuda) for flags in ([], ["--full"]))
    assert (default.d, default.seq) == ([64], [1024, 4096, 16384]), default
    assert (full.d, full.seq) == ([16, 32, 64, 128], [256, 1024, 4096, 8192, 16384]), full
    assert "takes minutes" in ba.sweep_plan(full, 7, cuda) and "minutes" not in ba.sweep_plan(default, 7, cuda)

@gpu
def test_bench_attention_oom_row_then_next_runs():
    # naive at S=16384 keeps 4 GiB (8x16384x16384 bf16) > 2% of 80 GB; a fresh process: the cap stays there
    out = run("bench_attention.py", "--memory-fraction", "0.02", "--impl", "naive,flash", "--d", "64",
              "--seq", "16384,1024", "--rounds", "2", "--steps", "1", "--warmup", "1").stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("64 ")]
    assert ["64", "16384", "OOM"] == rows[0][:3] and rows[1][:2] == ["64", "1024"] and rows[1][2] != "OOM", out
    assert "first naive OOM, worked through" in out, out

# --- 4. precision.py: IEEE accumulation, autocast capture, LayerNorm overflow, FP8 scaling

def ieee_sum(dtype, addend, n):  # numpy's add.accumulate adds one element at a time, rounding each sum to the dtype
    return float(np.add.accumulate(np.full(n, addend, dtype=dtype))[-1])

def test_precision_cpu_accumulate_autocast_layernorm_fp8():
    out, err = main_ok("precision.py", "--device", "cpu", "--model", "tiny", "--steps", 2, "--rounds", 2)
    assert all(f"== {n}. {name}" in out for n, name in enumerate(precision.SECTIONS, 1)), err + out
    assert out.count("takeaway") == 6 and out.count("skipped: needs CUDA") == 2 and "need FP8 tensor cores" in out
    assert list(precision.RUNS) == list(precision.SECTIONS)  # every section runs, in the documented order
    fp16_sum, accumulate, ulp = ieee_sum(np.float16, np.float16(0.01), 1000), precision.accumulate, precision.ulp
    assert accumulate(0.01, 1000, torch.float16)["total"] == fp16_sum != 10.0
    for cast in ("implicit", "explicit"):  # an fp32 sum of the rounded fp16 addend, either way
        r = accumulate(0.01, 1000, torch.float32, torch.float16, cast)
        assert r["dtype"] == torch.float32 and r["total"] == ieee_sum(np.float32, np.float16(0.01), 1000), r
    r = accumulate(0.01, 1000, torch.float32, torch.float16, "slice")  # a 1-element slice outranks a 0-dim sum
    assert r["dtype"] == torch.float16 and r["total"] == fp16_sum
    r = accumulate(0.001, 10000, torch.float16)  # stalls where the addend is at most half an ulp
    assert r["total"] == ieee_sum(np.float16, np.float16(0.001), 10000) and r["stall_step"] is not None
    assert float(np.float16(0.001)) <= ulp(r["stall_value"], torch.float16) / 2
    assert float(np.spacing(np.float16(r["total"]))) == ulp(r["stall_value"], torch.float16)
    seen = precision.autocast_dtypes(torch.device("cpu"), torch.bfloat16)
    assert seen["fc1 output"] == seen["grad of fc1 output"] == torch.bfloat16, seen
    assert seen["fc1.weight inside context"] == seen["fc1.weight.grad"] == seen["loss (cross_entropy)"] == torch.float32
    big, small = precision.layernorm_case(0.0, 1000.0), precision.layernorm_case(0.0, 1.0)
    assert big["fp16_overflow"] and not big["bf16_overflow"] and big["max_x2"] > 65504, big
    assert not small["fp16_overflow"] and small["fp16_err"] < 0.05, small
    E4M3, round_trip = gpt.E4M3, precision.fp8_round_trip
    values = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    values = values[values.isfinite()]  # every finite e4m3 number; the largest, 448, makes the scale 1
    assert values.abs().max() == 448 and round_trip(values, E4M3)[0] == 0
    # rows of e4m3 numbers times powers of two: a scale per row is exact, one per tensor loses the small rows
    rows = values * 2.0 ** torch.arange(-24, 1, 4.0)[:, None]
    (tensor_err, tensor_low), (row_err, row_low) = round_trip(rows, E4M3), round_trip(rows, E4M3, True)
    assert row_err == 0 < tensor_err and row_low < tensor_low, (tensor_err, row_err, tensor_low, row_low)
    t = torch.randn(64, 96) * torch.logspace(-3, 3, 64)[:, None]  # against the computation written out
    s = 448 / t.abs().max()
    direct = ((t * s).to(E4M3).float() / s - t).norm() / t.norm()
    assert abs(round_trip(t, E4M3)[0] - direct.item()) < 1e-6 * direct.item()
    slow = gpt.Timing(40.0, 39.0, 41.0, ratio=40.0)  # 40 times fp32's time: 0.025x its speed, not 0.0x
    largest = {"fp32 ieee": (gpt.Timing(1.0, 1.0, 1.0, ratio=1.0), 0.0), "tf32": (None, None), "bf16": (slow, 0.0),
               "fp16": (None, None)}
    assert precision.speedups(largest, False) == "tf32 n/a (CUDA-only), bf16 0.025x, fp16 n/a (out of memory)"
    got = precision.capture_linear_tensors("tiny", 1, 16, torch.device("cpu"))  # hooks see (softmax - onehot) / N
    assert len(got) == 10 and got["lm_head output grad"].shape == (16, 50257), list(got)
    assert got["lm_head output grad"].sum(1).abs().max() < 1e-6

def test_precision_bad_input():
    check_bad_inputs("precision.py", [
        ("--only nosuch", "unknown section 'nosuch'"), ("--only formats,nosuch", "choose from"),
        ("--device banana", "not a device"), ("--device mps", "not supported"), ("--model gpt5", "invalid choice"),
        ("--models tiny,gpt5", "unknown model 'gpt5'"), ("--batch 0", "--batch: must be at least 1"),
        ("--batch 5000", "--batch: must be at most 4096"), ("--seq 5000", "--seq must be at most 1024"),
        ("--seq 0", "--seq: must be at least 1"), ("--steps 0", "--steps: must be at least 1"),
        ("--rounds -1", "--rounds: must be at least 1"), ("--batch x", "expected an integer")])

@gpu
def test_precision_gpu_sections_and_fp8_gemms():
    out, _ = main_ok("precision.py", "--only", "autocast,tf32,gradscaler,mixed", "--model", "tiny", "--models", "tiny",
                     "--batch", 4, "--seq", 256, "--steps", 3, "--rounds", 3)
    assert "autocast fp16 on cuda" in out and "skipped: needs CUDA" not in out and "OOM" not in out, out
    assert out.count("takeaway") >= 5 and "GradScaler" in out, out
    if gpt.fp8_supported("cuda"):  # every FP8 GEMM variant against bf16, within e4m3's few-percent rounding
        ops = precision.gemm_variants(256, 128, 512, torch.device("cuda"))
        ref = ops["bf16"]().float()
        assert all(rel_err(op().float(), ref) < 0.1 for op in ops.values())

# --- 5. bench_e2e.py: ladder, sweep, output GEMMs, warm-up table, profile, bad input

def sweep(device, **kw):  # bench_e2e.run_sweep of the tiny model: (times, stats) by (vocab, B, T, fp32, eager, mode)
    plan = bench_e2e.Plan(**{**dict(vocab=[50257], batch=[1, 2], seq=[16], modes=bench_e2e.MODES, rounds=2), **kw})
    results = []
    bench_e2e.run_sweep(plan, [("tiny", gpt.make_config("tiny"))], device, results)
    return results[0][1:]

def rung_losses(config, x, y, device):  # every rung that runs here trains the same model: same seed, batch, loss
    return [bench_e2e.run_step("train", bench_e2e.build(config, s, device), x, y).item()
            for _, change, s in bench_e2e.rungs() if bench_e2e.skip_reason(change, s, device) is None]

def test_bench_e2e_ladder_cpu():
    png = os.path.join(tempfile.mkdtemp(), "ladder.png")
    code, out, err = call_main("bench_e2e.py", "--device", "cpu", "--ladder", "--batch", 1, "--seq", 16, "--rounds", 2,
                               "--plot", png)
    numbered = tuple(f"{i + 1:>2} {name}" for i, (name, _) in enumerate(bench_e2e.LADDER))
    rows = [line for line in out.splitlines() if line.startswith(numbered)]
    expect = [(0, 0), (1, 0), (0, 2), (0, 2), (0, 2)]  # (skipped, speed-ups); then GPU-only or compiled: skipped
    expect += [(1, 0)] * (len(bench_e2e.LADDER) - len(expect))
    assert code == 0 and [(r.count("skipped"), r.count("x (")) for r in rows] == expect, err + out
    assert out.strip().splitlines()[-1].startswith("ladder:") and bench_e2e.starts_with(b"\x89PNG\r\n\x1a\n")(png)
    code, out, err = call_main("bench_e2e.py", "--device", "cpu", "--ladder", "--batch", 1, "--seq", 16, "--rounds", 2,
                               "--rungs", "4,1")  # a few rungs, in the ladder's order, paired among themselves
    rows = [line for line in out.splitlines() if line.startswith(numbered)]
    assert code == 0 and [r[:2] for r in rows] == [" 1", " 4"] and rows[1].count("x (") == 2, out
    settings = {name: s for name, _, s in bench_e2e.rungs()}
    for name, change in bench_e2e.LADDER[bench_e2e.HEADLINE_NUMBER:]:  # each lever: the headline and its change
        assert settings[name] == {**settings[bench_e2e.HEADLINE], **change}, name
    cpu, config = torch.device("cpu"), gpt.make_config("tiny")
    losses = rung_losses(config, *bench_e2e.batch_of(2, 16, cpu), cpu)
    assert len(losses) == 4 and all(abs(v - losses[0]) < 0.02 * losses[0] for v in losses), losses
    fp8 = bench_e2e.build(config, {**bench_e2e.FIRST_RUNG, "fp8": True}, cpu).model  # forced: all four per block
    assert sum(type(m) is gpt.Fp8Linear for m in fp8.modules()) == 4 * config.n_layer

def test_bench_e2e_master_weights_train_as_autocast_bit_for_bit():
    """The MasterWeights rung (bf16 block weights in the model, fp32 masters in the optimizer, one copy each way per
    step) trains exactly as bf16 autocast over fp32 weights: the same losses and weights, bit for bit."""
    cpu, config = torch.device("cpu"), gpt.make_config("tiny")
    plain = {**bench_e2e.FIRST_RUNG, "dtype": torch.bfloat16, "attn": "sdpa", "fused_ce": True}
    runs = []
    for master in (False, True):
        bench = bench_e2e.build(config, {**plain, "master": master}, cpu)
        losses = [bench_e2e.run_step("train", bench, *bench_e2e.batch_of(2, 32, cpu)).item() for _ in range(4)]
        linears = [m.weight for block in bench.model.h for m in block.modules() if type(m) is torch.nn.Linear]
        runs.append((losses, linears, bench.optimizer))
    (losses, fp32, _), (master_losses, bf16, kept) = runs
    assert master_losses == losses and losses[-1] < losses[0], (losses, master_losses)
    assert all(w.dtype == torch.bfloat16 for w in bf16) and len(kept.masters) == 4 * config.n_layer
    assert all(torch.equal(a, b) for a, b in zip(fp32, kept.masters))  # the masters are the plain run's weights
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(fp32, bf16))  # and the bf16 copies their casts
    # clipped: the norm comes from the bf16 gradients (rounded), so close rather than equal. Adam's update hardly
    # sees a gradient's scale; its first moment does: the clipped moments must match, not be norm / 0.05 times larger
    clipped = []
    for master in (False, True):
        bench = bench_e2e.build(config, {**plain, "master": master}, cpu)
        norms = [gpt.train_step(bench.model, bench.optimizer, *bench_e2e.batch_of(2, 32, cpu), torch.bfloat16,
                                grad_clip=0.05, return_norm=True)[1].item() for _ in range(4)]
        if master:
            moments = [m for m, _ in bench.optimizer.moments]
        else:
            linears = [m.weight for block in bench.model.h for m in block.modules() if type(m) is torch.nn.Linear]
            moments = [bench.optimizer.state[w]["exp_avg"] for w in linears]
        clipped.append((norms, moments))
    assert all(norm > 0.5 for norm in clipped[1][0]), clipped[1][0]  # every step clipped, by 10x or more
    assert max(rel_err(a, b) for a, b in zip(clipped[0][1], clipped[1][1])) < 1e-2

def test_master_weights_add_micro_batches_in_fp32():
    """Under accumulation the kept bf16 weights' gradients add up in fp32 and round to bf16 once
    (MasterWeights.hold_gradients): over three micro-batches the gradient AdamW reads is autocast's fp32 sum rounded
    once, bit for bit, where autograd's bf16 sum (a rounding after every micro-batch) is not."""
    cpu, config = torch.device("cpu"), gpt.make_config("tiny")
    plain = {**bench_e2e.FIRST_RUNG, "dtype": torch.bfloat16, "attn": "sdpa", "fused_ce": True}
    tokens = torch.randint(0, config.vocab_size, (3, 2, 2, 32), generator=torch.Generator().manual_seed(2))
    xs, ys = list(tokens[:, 0]), list(tokens[:, 1])  # three micro-batches of B=2, T=32
    read = {}
    for master in (False, True):
        bench = bench_e2e.build(config, {**plain, "master": master}, cpu)
        if master:
            weights = bench.optimizer.low
        else:
            weights = [m.weight for block in bench.model.h for m in block.modules() if type(m) is torch.nn.Linear]
        step = bench.optimizer.step
        def spy(weights=weights, step=step, master=master):  # the gradients as the optimizer step reads them
            read[master] = [w.grad.clone() for w in weights]
            step()
        bench.optimizer.step = spy
        gpt.train_step(bench.model, bench.optimizer, xs, ys, torch.bfloat16)
    summed_once = [g.to(torch.bfloat16) for g in read[False]]  # autocast's fp32 sum, rounded once
    assert all(g.dtype == torch.bfloat16 for g in read[True]) and len(read[True]) == 4 * config.n_layer
    assert all(torch.equal(a, b) for a, b in zip(read[True], summed_once))
    bench = bench_e2e.build(config, {**plain, "master": True}, cpu)  # autograd's own sum, in bf16
    for x, y in zip(xs, ys):
        with gpt.autocast(cpu, torch.bfloat16):
            loss = bench.model(x, y)[1] / len(xs)
        loss.backward()
    in_bf16 = [w.grad for w in bench.optimizer.low]
    assert not all(torch.equal(a, b) for a, b in zip(in_bf16, summed_once))

def test_bench_e2e_idle_gaps_split_short_and_long():
    """The profile's idle line: gaps between kernels (overlapping kernels leave none) split at 20 us, per step."""
    from types import SimpleNamespace
    def event(start, end, device="CUDA"):
        return SimpleNamespace(device_type=getattr(torch.autograd.DeviceType, device),
                               time_range=SimpleNamespace(start=start, end=end))
    events = [event(0, 10), event(5, 30), event(35, 40), event(100, 110), event(112, 200), event(50, 60, "CPU")]
    prof = SimpleNamespace(events=lambda: events)  # gaps 5 (30 -> 35), 60 (40 -> 100), 2 (110 -> 112) us
    short, long, count = bench_e2e.idle_gaps(prof, steps=2)
    assert (round(short * 1e3, 6), round(long * 1e3, 6), count) == (3.5, 30.0, 0.5), (short, long, count)
    assert bench_e2e.idle_gaps(SimpleNamespace(events=lambda: []), steps=1) == (0.0, 0.0, 0.0)

def test_bench_e2e_groups_kernels_by_name():
    """The profile's groups, from kernel names of the headline's step on an H100 (Inductor names a fused kernel
    after its ops: a bias + GELU kernel starts with a cast, and is still element-wise)."""
    names = {"nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "matmul", "_attn_dkdv_kernel": "attention",
             "_add_layer_norm_bwd": "normalization", "_cross_entropy_rows": "cross-entropy",
             "triton_poi_fused__to_copy_add_gelu_10": "element-wise", "_bias_gelu_bwd": "element-wise",
             "triton_poi_fused__to_copy_t_6": "copies", "Memset (Device)": "copies",
             "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizer>": "optimizer",
             "triton_red_fused_sum_view_8": "element-wise"}
    assert {n: bench_e2e.category(n) for n in names} == names

def test_bench_e2e_sweep_numbers_profile_cpu_run():
    cpu = torch.device("cpu")
    times, stats = sweep(cpu)
    assert len(times) == 2 * 3 and all(len(t) == 2 for t in times.values()), times  # batches x modes
    assert all(t.low <= t.median <= t.high and t.low <= t.mean <= t.high and t.peak is None for t in stats.values())
    a, b = (50257, 2, 16, "fp32", "eager", "train"), (50257, 1, 16, "fp32", "eager", "train")
    ratios = sorted(2 * tb / ta for ta, tb in zip(times[a], times[b]))  # tokens/s ratio, per round
    assert bench_e2e.speedup(times, a, b, 2.0) == f"{sum(ratios) / 2:.3f}x ({ratios[0]:.3f}-{ratios[1]:.3f})"
    f, fb, tr = (times[(50257, 1, 16, "fp32", "eager", m)] for m in bench_e2e.MODES)
    split = bench_e2e.step_split(times, (50257, 1, 16, "fp32", "eager"))
    assert split[1].startswith(f"{(fb[0] - f[0] + fb[1] - f[1]) / 2:.2f} (")  # paired: per-round differences
    assert split[3] == f"{(tr[0] + tr[1]) / 2:.2f}"
    faster = {**times, (50257, 1, 16, "fp32", "eager", "train"): [t / 10 for t in f]}  # a train step under its forward
    assert bench_e2e.step_split(faster, (50257, 1, 16, "fp32", "eager"))[2].startswith("noise (-")
    bench = bench_e2e.build(gpt.make_config("tiny"), {**bench_e2e.FIRST_RUNG, "attn": "naive"}, cpu)
    profs = bench_e2e.profile_steps(bench, 1, 16, cpu, warmup=1, steps=1)
    fwd, step = (bench_e2e.category_times(profs[m], False) for m in ("forward", "train"))
    assert {"matmul", "optimizer", "element-wise", "normalization"} <= set(step) and "optimizer" not in fwd, (fwd, step)
    stages = bench_e2e.naive_attention_rows(profs["forward"], bench.config, 1, 16, 1, False, None)
    assert [r[0] for r in stages] == list(bench_e2e.NAIVE_RANGES)
    assert float(stages[1][5][:-1]) < float(stages[2][5][:-1])  # the softmax's FLOP share is the smaller
    # the matmuls at TFLOP/s, the memory-bound softmax at GB/s; the last column: time share over FLOP share
    assert [r[3].split()[-1] for r in stages] == ["TFLOP/s", "GB/s", "TFLOP/s"], stages
    for r in stages:
        ratio = float(r[4][:-1]) / float(r[5][:-1])
        assert abs(float(r[6]) - ratio) <= 0.05 + 0.05 * ratio, r
    trace = os.path.join(tempfile.mkdtemp(), "step.json")  # and the whole script: vocab widths, GEMMs, profile
    out, err = main_ok("bench_e2e.py", "--device", "cpu", "--batch", 1, "--seq", 16, "--vocab", "50257,50304",
                       "--attn", "naive", "--trace", trace, "--rounds", 2, "--warmup", 0, "--nvtx")
    assert all(title in out for title in ("where a train step's time goes", "output-layer GEMMs alone",
                                          "time by category", "naive attention, forward")), err + out
    assert "--nvtx ignored (NVTX ranges need CUDA)" in out and "ms/step, mean ± std" in out, out
    cells = [line.split() for line in out.splitlines() if re.match(r"tiny +\d", line)]  # model vocab batch seq ...
    assert len(cells) == 6 and all(c[4:6] == ["fp32", "eager"] and c[10] == "±" for c in cells), out
    for c in cells:  # median (min-max), then mean ± std: the mean lies within min and max
        low, high = map(float, c[8].strip("()").split("-"))
        assert low <= float(c[9]) <= high and float(c[11]) >= 0, c
    assert out.strip().splitlines()[-1].startswith("best train throughput"), out
    for V in (50257, 50304):  # every vocabulary profiled, a trace each; ours: may be overwritten
        each = os.path.join(os.path.dirname(trace), f"step_tiny_V{V}.json")
        assert bench_e2e.starts_with(b"{")(each) and json.load(open(each))["traceEvents"], out

def table_under(out, title):  # the rows of the first table printed under a line starting with title, cells split
    lines = out[out.index("\n" + title) + 1:].splitlines()[3:]  # past the title, the header and its rule
    rows = []
    for line in lines:
        if not line.strip():
            break
        rows.append(re.split(r" {2,}", line.strip()))
    return rows

def test_bench_e2e_profile_every_configuration_cpu():
    """--trace over two contexts: each configuration profiled (its tables, naive attention's stages against their
    work, a trace file named after it, valid JSON), then the summary: a row each, its top ops as its tables say."""
    d = tempfile.mkdtemp()
    out, err = main_ok("bench_e2e.py", "--device", "cpu", "--batch", 1, "--seq", "16,32", "--attn", "naive",
                       "--mode", "train", "--rounds", 1, "--trace", os.path.join(d, "e2e.json"))
    names = [f"tiny V=50257 B=1 T={T} fp32 eager" for T in (16, 32)]
    assert "sweep: 2 cells (model 1 x vocab 1 x batch 1 x seq 2 x precision 1 x compile 1 x mode 1), then 2 " \
           "configurations profiled" in out, out
    parts = out.split("\nprofile of ")[1:]  # a configuration's tables each; the last also holds the summary
    assert [p.split(",")[0] for p in parts] == names, out
    for part, T in zip(parts, (16, 32)):
        titles = ("forward CPU ops: top 5", "train step CPU ops", "time by category")
        assert all(title in part for title in titles), part
        stages = table_under(part, "naive attention, forward")
        assert [r[0] for r in stages] == list(bench_e2e.NAIVE_RANGES) and stages[1][3].endswith("GB/s"), part
        trace = os.path.join(d, f"e2e_tiny_T{T}.json")
        assert f"wrote the train-step trace to {trace}" in part and json.load(open(trace))["traceEvents"], part
    assert sorted(os.listdir(d)) == ["e2e_tiny_T16.json", "e2e_tiny_T32.json"]  # no e2e.json: one file a configuration
    summary = table_under(out, "profile summary")
    assert [r[0] for r in summary] == names and all(len(r) == 11 for r in summary), out
    for row, part in zip(summary, parts):  # the top op of the forward and of the train step, as their tables list them
        forward, step = table_under(part, "forward CPU ops")[0], table_under(part, "train step CPU ops")[0]
        assert row[1:4] == [forward[0][:48], forward[1], forward[3]] and row[5:8] == [step[0][:48], step[1], step[3]]
        assert all(0 <= float(share[:-1]) <= 100 for share in (row[4], row[8])) and float(row[9]) > 0, row
    assert out.strip().splitlines()[-1].startswith("best train throughput"), out
    config, plan = gpt.make_config("tiny"), bench_e2e.Plan(vocab=[50257], batch=[4], seq=[128, 256], modes=("train",),
                                                           precisions=("fp32", "bf16"))
    assert bench_e2e.trace_paths("t/e2e.json", [("small", config), ("2.7B", config)], plan) == [
        f"t/e2e_{m}_T{T}_{p}.json" for m in ("small", "2.7B") for T in (128, 256) for p in ("fp32", "bf16")]
    one = bench_e2e.Plan(vocab=[50257], batch=[4], seq=[128], modes=("train",), precisions=("bf16",))
    assert bench_e2e.trace_paths("t/e2e.json", [("small", config)], one) == ["t/e2e.json"]  # the name as given

def test_bench_e2e_interrupted_sweep_prints_the_models_it_finished():
    """SIGTERM while the second model is timed: the first model's table is printed, then the line that says where the
    sweep stopped; exit 143, no traceback."""
    proc = popen("bench_e2e.py", "--device", "cpu", "--model", "tiny,small", "--batch", 2, "--seq", 128, "--mode",
                 "train", "--rounds", 3, stderr=subprocess.STDOUT)
    watchdog = threading.Timer(120, proc.kill)  # a marker that never comes fails the test instead of hanging it
    watchdog.start()
    head = next((line for line in iter(proc.stdout.readline, "") if line.startswith("small: timing")), None)
    proc.send_signal(signal.SIGTERM)  # small's warm-up step alone takes seconds here
    out = proc.communicate(timeout=60)[0]
    watchdog.cancel()
    rows = [line.split()[:2] for line in out.splitlines() if line.startswith(("tiny ", "small "))]
    assert head and proc.returncode == 143 and "Traceback" not in out, (proc.returncode, out[-2000:])
    assert "the 1 of 2 models timed before the interrupt:" in out and rows == [["tiny", "50257"]], out[-2000:]
    assert out.strip().splitlines()[-1].endswith("the 1 table(s) above are complete, the rest did not finish"), out


def test_bench_e2e_precision_compile_sweep_cpu():
    """--precisions and --compile-modes: every cell in each variant, in the same rounds, and a table of each variant
    against the first, every mode's ms and paired speed-up; one model per precision, eager and compiled alike."""
    flags = "--device cpu --batch 1 --seq 16 --rounds 2 --precisions fp32,bf16 --compile-modes eager,compiled"
    out, err = main_ok("bench_e2e.py", *flags.split())
    variants = [["fp32", "eager"], ["fp32", "compiled"], ["bf16", "eager"], ["bf16", "compiled"]]
    assert "sweep: 12 cells (model 1 x vocab 1 x batch 1 x seq 1 x precision 2 x compile 2 x mode 3)" in out, out
    cells = table_under(out, "sweep, ")
    assert [r[4:7] for r in cells] == [[*v, m] for v in variants for m in bench_e2e.MODES], out
    assert all(f"{p} compiled {m} (compiling...)" in err for p in ("fp32", "bf16") for m in bench_e2e.MODES), err
    rows = table_under(out, "precision and compile: every variant against fp32 eager")
    assert [r[4:6] for r in rows] == variants and all(len(r) == 6 + 2 * len(bench_e2e.MODES) for r in rows), out
    assert rows[0][7::2] == ["-"] * 3 and all(re.fullmatch(r"[\d.]+x \([\d.]+-[\d.]+\)", c)
                                             for r in rows[1:] for c in r[7::2]), out
    ms = {tuple(r[4:7]): r[7] for r in cells}  # each variant's ms, as the sweep's table has it
    assert all(float(r[6 + 2 * i]) == float(ms[(*r[4:6], m)].split()[0]) for r in rows
               for i, m in enumerate(bench_e2e.MODES)), out
    plan, benches, cpu = bench_e2e.Plan(vocab=[50257], batch=[1], seq=[16], modes=("train",)), {}, torch.device("cpu")
    steps = {v: bench_e2e.sweep_step(benches, gpt.make_config("tiny"), bench_e2e.flag_settings(plan, 50257, v),
                                     "train", 1, 16, cpu) for v in (("bf16", "eager"), ("bf16", "compiled"))}
    eager, compiled = (steps[v].args[1] for v in (("bf16", "eager"), ("bf16", "compiled")))
    assert len(benches) == 1 and compiled.model is eager.model and compiled.runner is not eager.runner
    assert eager.dtype == torch.bfloat16 and isinstance(eager.optimizer, gpt.MasterWeights)  # as --bf16

def test_bench_e2e_bad_input():
    d, j = tempfile.mkdtemp(), os.path.join
    head = bench_e2e.HEADLINE_NUMBER  # a lever past the headline needs the headline in --rungs
    check_bad_inputs("bench_e2e.py", [
        ("--model huge", "unknown model"),
        ("--model tiny --seq 1000", "--seq must be at most 256, the block size of tiny"),
        ("--batch 0", "argument --batch: must be at least 1, got 0"),
        ("--rounds 0", "argument --rounds: must be at least 1, got 0"),
        ("--steps 0", "argument --steps: must be at least 1, got 0"),
        ("--warmup -1", "argument --warmup: must be at least 0, got -1"),
        ("--batch 2,x", "argument --batch: expected an integer, got 'x'"),
        ("--seq 16,,32", "argument --seq: expected a comma list of integers"),
        ("--vocab 50000", "argument --vocab: must be at least 50257, got 50000"),
        ("--mode backward", "invalid choice"),
        ("--bf16 --fp16", "exclusive"),
        ("--device cpu --fp16", "needs a CUDA GPU"),
        ("--device cpu --attn triton", "needs a CUDA"),
        ("--device banana", "not a device"),
        ("--device cuda:7", "--device cuda:7"),
        (["--trace", j(d, "missing", "t.json")], "does not exist"),
        (["--trace", d], "is a directory"),
        (["--trace", j(HERE, "input.txt")], "refusing to overwrite"),
        (["--plot", j(d, "p.png")], "add --ladder"),
        ("--ladder --batch 1,2", "one --batch"),
        (["--ladder", "--plot", j(d, "missing", "p.png")], "does not exist"),
        ("--ladder --bf16", "sets precision"),
        ("--ladder --warmup 0", "--warmup 1 or more"),
        ("--rungs 3", "add --ladder"), (f"--ladder --rungs {head + 1}", f"add {head}"),
        (f"--ladder --rungs {len(bench_e2e.LADDER) + 1}", f"at most {len(bench_e2e.LADDER)}"),
        ("--ladder --rungs 0", "at least 1"),
        ("--warmup-table --warmup 1", "drop --warmup and --rounds"),
        ("--warmup-table --rounds 3", "drop --warmup and --rounds"),
        ("--warmup-table --batch 1,2", "--warmup-table times one --model"),
        ("--warmup-table --vocab 50257,50304", "--warmup-table times one --model"),
        ("--warmup-table --ladder", "--warmup-table times one --model"),
        ("--warmup-table --profile", "--warmup-table times one --model"),
        ("--device cpu --batch 100000", "of this machine's memory"),  # refused, not killed by the OOM killer
        ("--precisions fp64", "argument --precisions: unknown precision 'fp64'; choose from fp32, bf16, fp16"),
        ("--compile-modes jit", "argument --compile-modes: unknown compile mode 'jit'"),
        ("--precisions bf16,fp32,bf16", "--precisions bf16,fp32,bf16 names one twice"),
        ("--compile-modes eager,eager", "names one twice"),
        ("--precisions fp32,bf16 --bf16", "drop --bf16 and --fp16"),
        ("--compile-modes eager,compiled --compile", "drop --compile"),
        ("--device cpu --precisions fp32,fp16", "fp16 (--fp16, --precisions fp16) needs a CUDA GPU"),
        ("--ladder --precisions fp32,bf16", "sets precision"),
        ("--warmup-table --compile-modes eager,compiled", "--warmup-table times one --model"),
    ])
    other = tempfile.mkdtemp()  # several configurations: each one's trace file checked before any work
    open(j(other, "t_tiny_T32.json"), "w").write("notes, not a trace\n")
    refused_before_work("bench_e2e.py", [
        (["--seq", "16,32", "--trace", j(d, "missing", "t.json")], f"{j(d, 'missing', 't_tiny_T16.json')}: the folder"),
        (["--seq", "16,32", "--trace", j(other, "t.json")], "t_tiny_T32.json exists and is not a file this script"),
    ])
    ladder = ["--ladder", "--device", "cpu", "--batch", 1, "--seq", 16]
    refused_before_work("bench_e2e.py", [([*ladder, "--plot", j(d, "notes.txt")], plot_refusal()),
                                         ([*ladder, "--plot", j(d, "ladder")], "no extension")])
    assert os.listdir(d) == []  # as the flags are read: no rung ran, no file written

def test_bench_e2e_warmup_table_cpu():
    """Rows for 0, 1 and 2 warm-up steps, each with steps 1-3 and the settled mean ± std; the untimed steps run
    before the timed ones, one model per row."""
    flags = "--device cpu --warmup-table --mode forward --batch 1 --seq 16 --steps 2"
    out, err = main_ok("bench_e2e.py", *flags.split())
    rows = [line.split() for line in out.splitlines() if line.startswith("forward ")]
    assert [r[1] for r in rows] == ["0", "1", "2"] and all(len(r) == 9 and r[6] == "±" for r in rows), out
    assert all(float(v) > 0 for r in rows for v in r[2:6]), rows
    assert "process start-up" in out and "the first steps pay for:" in out, out
    assert out.strip().splitlines()[-1].startswith("warm-up table: step 1 without warm-up takes"), out
    ratios, last = [r[-1] for r in rows], out.strip().splitlines()[-1]  # step 1 / settled as printed, the summary
    settled_after = re.search(r"after (\d) warm-up step", last)
    if settled_after:  # the row it names is within 10% (printed to 2 decimals)
        assert abs(float(ratios[int(settled_after.group(1))].rstrip("x")) - 1) <= 0.105, (ratios, last)
    else:
        assert last.endswith(f"row by row: {', '.join(ratios)})"), (ratios, last)
    calls, cpu = [], torch.device("cpu")
    def counted(mode, bench, x, y):
        calls.append(mode)
    s = {**bench_e2e.FIRST_RUNG, "vocab": 50257}
    with unittest.mock.patch.object(bench_e2e, "run_step", counted):
        x, y = bench_e2e.batch_of(1, 8, cpu)
        head, rest = bench_e2e.warmup_row(gpt.make_config("tiny"), s, "train", 2, 4, x, y, cpu)
    assert len(head) == bench_e2e.FIRST_STEPS and len(rest) == 4 and calls == ["train"] * (2 + 3 + 4), calls

def test_bench_e2e_warmup_summary_reads_the_rows():
    """The summary says what the table's step 1 / settled column shows: within 10% is 0.9x to 1.1x, so the rows
    0.5x, 0.2x, 0.8x (a CPU's) settle after no number of warm-up steps, and it says so."""
    said = bench_e2e.needed_warmup
    noisy = {("train", 0): 0.5, ("train", 1): 0.2, ("train", 2): 0.8}
    assert said(noisy, ["train"]) == ("with 0, 1 or 2 warm-up steps, step 1 is never within 10% of settled in every "
                                      "mode (step 1 / settled, row by row: 0.50x, 0.20x, 0.80x)")
    assert said({("train", 0): 3.0, ("train", 1): 1.05, ("train", 2): 0.97}, ["train"]).startswith("after 1 warm-up")
    two = {("forward", 0): 0.95, ("forward", 1): 1.0, ("forward", 2): 1.0, ("train", 0): 2.0, ("train", 1): 1.3,
           ("train", 2): 1.08}
    assert said(two, ["forward", "train"]).startswith("after 2 warm-up step(s)"), said(two, ["forward", "train"])

NANOGPT_STAND_IN = """
import dataclasses, gpt

GPTConfig = dataclasses.make_dataclass("GPTConfig", [  # nanoGPT's names and defaults
    ("block_size", int, 1024), ("vocab_size", int, 50304), ("n_layer", int, 12), ("n_head", int, 12),
    ("n_embd", int, 768), ("dropout", float, 0.0), ("bias", bool, True)])

class GPT(gpt.GPT):  # nanoGPT's interface over our model with the plain loss
    def __init__(self, c):
        super().__init__(gpt.GPTConfig(c.n_layer, c.n_head, c.n_embd, 4 * c.n_embd, c.block_size, c.vocab_size,
                                       fused_ce=False))
    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        print("using fused AdamW:", device_type == "cuda")
        return gpt.configure_optimizer(self, learning_rate, weight_decay, betas)
"""

def test_bench_e2e_nanogpt_cpu():
    """--nanogpt times a nanoGPT-interface model.py and ours in paired rounds; a folder without model.py is refused."""
    with tempfile.TemporaryDirectory() as tmp:
        open(os.path.join(tmp, "model.py"), "w").write(NANOGPT_STAND_IN)
        out, err = main_ok("bench_e2e.py", "--nanogpt", tmp, *"--device cpu --batch 1 --seq 16 --rounds 2".split())
        assert "using fused AdamW: False" in err and "using fused" not in out, out + err
        rows = {line[:32].strip(): line for line in out.splitlines() if line.startswith(("nanoGPT model", "ours, "))}
        assert list(rows) == ["nanoGPT model.py", "ours, plain loss (--no-fused-ce)", "ours, the headline"], out
        assert all(rows[n].count("x (") == 1 for n in list(rows)[1:]) and "x (" not in rows["nanoGPT model.py"], out
        assert out.strip().splitlines()[-1].startswith("nanogpt: the headline makes "), out
        # under torchrun: nanoGPT + DDP against our data-parallel step, each with its scaling over one rank's step
        out = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "bench_e2e.py", "--nanogpt",
                  tmp, *"--device cpu --batch 1 --seq 16 --rounds 2".split(), timeout=300).stdout
        rows = {line[:36].strip(): line for line in out.splitlines() if line.startswith(("nanoGPT model", "ours, "))}
        assert list(rows) == ["nanoGPT model.py, one process", "nanoGPT model.py + DDP, 2 processes",
                              "ours, one process", "ours, 2 processes"], out
        assert rows["ours, 2 processes"].count("x (") == 2 and rows["ours, one process"].count("x (") == 1, out
        assert out.strip().splitlines()[-1].startswith("nanogpt: on 2 processes ours makes "), out
        other = os.path.join(tmp, "other.py")
        open(other, "w").write("x = 1\n")
        os.remove(os.path.join(tmp, "model.py"))
        check_bad_inputs("bench_e2e.py", [
            (["--nanogpt", tmp], "no model.py there"),
            (["--nanogpt", other], "it defines no GPT"),
            (["--nanogpt", HERE, "--ladder"], "--nanogpt compares one"),
            (["--nanogpt", HERE, "--warmup", "0"], "--warmup 1 or more"),
        ])
        broken = os.path.join(tmp, "broken.py")
        open(broken, "w").write("import no_such_module\n")
        refused_before_work("bench_e2e.py", [
            (["--nanogpt", os.path.join(HERE, "input.txt")], "input.txt is not a Python file"),
            (["--nanogpt", broken], "not nanoGPT's model.py (ModuleNotFoundError: No module named 'no_such_module')"),
        ])

def lever_curves(device, levers, steps=200, seeds=(0, 1, 2), B=4, T=64):
    """{rung: [losses per step, for each seed]}: the headline and each lever, eager (the math, not the speed), from
    the ladder's initial weights on a learnable token stream drawn per seed."""
    config = gpt.make_config("tiny")
    settings = {name: {**s, "compile": False, "graphs": False} for name, _, s in bench_e2e.rungs()}
    curves = {}
    for name in [bench_e2e.HEADLINE, *levers]:
        curves[name] = []
        for seed in seeds:
            gen = torch.Generator().manual_seed(seed)
            start = torch.randint(0, 97, (steps, B, 1), generator=gen)
            tokens = ((start + torch.arange(T + 1)) * (seed + 3)) % 97  # each row a walk mod 97: predictable
            bench = bench_e2e.build(config, settings[name], torch.device(device))
            losses = [bench_e2e.run_step("train", bench, t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]
            curves[name].append([loss.item() for loss in losses])
    return curves

@gpu
def test_bench_e2e_gpu_levers_train_as_the_headline():
    """The four rungs before the headline (each one lever fewer than the next: autocast's casts instead of bf16
    weights kept by the optimizer, torch's fused AdamW, the embedding's gradient summed apart, cuBLAS with its
    workspace) are the same model and math as the headline (not the FP8 lever past it, which changes the
    arithmetic): over 200 steps and three data seeds each one's loss curve stays within bf16 noise of the
    headline's (mean difference under 1% of the loss, the last 20 steps' mean within 1%), and the loss falls."""
    levers = [name for name, _ in bench_e2e.LADDER[bench_e2e.HEADLINE_NUMBER - 5:bench_e2e.HEADLINE_NUMBER - 1]]
    curves = lever_curves("cuda", levers)
    for name in levers:
        for seed, (ours, head) in enumerate(zip(curves[name], curves[bench_e2e.HEADLINE])):
            mean_head = sum(head) / len(head)
            drift = sum(abs(a - b) for a, b in zip(ours, head)) / len(head) / mean_head
            tail = abs(sum(ours[-20:]) - sum(head[-20:])) / abs(sum(head[-20:]))
            assert drift < 0.01 and tail < 0.01 and ours[-1] < 0.8 * ours[0], (name, seed, drift, tail, ours[::40])

@gpu
def test_bench_e2e_gpu_ladder_peaks_oom():
    cuda = torch.device("cuda")
    torch.cuda.set_per_process_memory_fraction(0.3)  # its own process: the OOM cells leave the others room
    torch._dynamo.reset()  # every rung (compiled, graphed, fused, FP8) starts from the same loss
    losses = rung_losses(gpt.make_config("tiny"), *bench_e2e.batch_of(4, 128, cuda), cuda)
    gpt.set_tf32(False)
    assert len(losses) == len(bench_e2e.LADDER) - (0 if gpt.fp8_supported(cuda) else 1), losses
    assert all(abs(v - losses[0]) < 0.02 * losses[0] for v in losses), losses
    # 4M tokens' activations cannot fit: OOM cells. Two warm-up steps: the second has AdamW's state
    times, stats = sweep(cuda, batch=[4, 8, 16384], seq=[256], warmup=2)
    peak = {(b, m): stats[(50257, b, 256, "fp32", "eager", m)].peak for b in (4, 8) for m in bench_e2e.MODES}
    for b in (4, 8):  # weights and AdamW's state in every cell; the fused loss peaks inside the forward: all may tie
        assert peak[(b, "train")] >= peak[(b, "forward-backward")] >= peak[(b, "forward")] > 0, peak
    assert all(peak[(8, m)] > peak[(4, m)] for m in bench_e2e.MODES), peak
    assert all(stats[(50257, 16384, 256, "fp32", "eager", m)] is None for m in bench_e2e.MODES)
    # a profiled configuration out of memory: its summary row says OOM, and the next configuration goes on
    flags = "--model tiny --batch 16384,4 --seq 256 --mode forward --rounds 1 --profile"
    out, err = main_ok("bench_e2e.py", *flags.split())
    summary = out[out.index("profile summary"):].splitlines()
    assert re.match(r"tiny V=50257 B=16384 T=256 fp32 eager +OOM", summary[3]), out
    assert summary[4].startswith("tiny V=50257 B=4 T=256 fp32 eager") and "OOM" not in summary[4], out
    for extra in ([], ["--compile"]):  # NVTX ranges (no-ops without nsys) in naive attention: eager, and compiled
        flags = "--model tiny --batch 4 --seq 128 --attn naive --mode train --warmup-table --steps 3 --nvtx".split()
        out, err = main_ok("bench_e2e.py", *flags, *extra)
        rows = [line.split() for line in out.splitlines() if line.startswith("train ")]
        assert [r[1] for r in rows] == ["0", "1", "2"] and "warm-up table:" in out.splitlines()[-1], out + err

# --- 6. memory.py: the model against live tensors (one process, DDP, FSDP, nested checkpoints); snapshot summary;
# the parallel calculator by hand; bad input

BF16 = torch.bfloat16
ACCOUNT_CASES = [  # (B, T, dtype, wrapper, group size, loss chunk rows (0: the default), config overrides)
    (1, 32, None, "", 0, 0, {}),
    (6, 64, BF16, "", 0, 160, {}),
    (1, 32, BF16, "", 0, 0, {}),
    (2, 64, None, "", 0, 0, {"fused_ce": False}),
    (2, 32, BF16, "", 0, 0, {"fused_ce": 0, "attn": "naive"}),
    (8, 64, BF16, "", 0, 0, {"recompute": 1}),
    (4, 64, None, "", 0, 0, {"recompute": 3}),
    (2, 64, None, "flat", 3, 0, {}),
    (4, 64, BF16, "fsdp", 0, 0, {"recompute": 1}),
    (4, 64, BF16, "nested", 3, 160, {}),
    (4, 64, None, "fsdp", 0, 0, {}),
    (4, 64, BF16, "ddp", 0, 0, {"recompute": 2}),
]


@contextlib.contextmanager
def loss_chunk_rows(rows):
    """The fused loss's chunk size, as gpt.py runs it and memory.py predicts it, set for the block only."""
    with unittest.mock.patch.object(gpt, "CE_CHUNK_ROWS", rows), unittest.mock.patch.object(memory, "CE_CHUNK_ROWS",
                                                                                            rows):
        yield


def no_comm(_, bucket):  # a DDP comm hook for the fake group, whose all-reduce returns no tensor
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def wrapped_forward(model, how, dtype, k):
    """The forward memory.step runs for one layout: FSDP2, DDP (no communication), or checkpointed groups."""
    if how == "fsdp":  # the one FSDP2 setup, as train.py and ddp.py use it
        return gpt.fully_shard_gpt(model, dtype)
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
        model.register_comm_hook(None, no_comm)
        return model
    return memory.checkpointed(model, how or "none", k)


def measured_spans(model, log, pred):
    """{phase or block: (predicted, measured)}: forward, backward, and each block's stretch of backward, cut at
    LayerNorm backwards (under FSDP a stretch starts with the block above's last op, which holds its unreduced
    gradients)."""
    marks = {name: i for i, (name, _) in enumerate(log) if name in ("forward", "backward")}
    cuts = [i for i in range(marks["forward"], marks["backward"]) if "norm_backward" in str(log[i][0])]
    spans = {ph: (pred["phases"][ph][0], log[marks[ph]][1]) for ph in marks}
    for j, b in enumerate(range(len(model.h) - 1, -1, -1)):
        names = [f"backward: block {b}", f"backward: block {b} attention", f"backward: block {b + 1} done"]
        spans[b] = (max(pred["totals"].get(n, 0) for n in names),
                    max(level for _, level in log[cuts[2 * j] + 1:cuts[2 * j + 2] + 1]))
    return spans


def check_account_case(B, T, dtype, how, k, kw):
    """One layout: the state, every phase and block peak, and the saved bytes equal the prediction; checkpointed
    gradients equal the plain model's. Returns the predicted peak moments of forward and backward."""
    torch.manual_seed(0)
    cfg = gpt.make_config("tiny", **kw)
    model = gpt.GPT(cfg)
    forward, opt = wrapped_forward(model, how, dtype, k), gpt.configure_optimizer(model, lr=1e-3)
    x, y = memory.random_batch(cfg, B, T, "cpu")
    memory.step(model, opt, x, y, dtype, forward=forward)  # AdamW's state now exists
    world = 1
    if how == "fsdp":
        world = 2
    pred = memory.account(cfg, B, T, dtype, "cpu", world=world, groups=k, ddp=how == "ddp", nested=how == "nested")
    what, state = f"{B}x{T} {dtype} {how} k={k} {kw}", pred["moments"]["optimizer step"]
    nbytes = memory.LiveBytes(memory.state_tensors(model, opt)).now()  # DTensors: the local shards
    assert nbytes == state["weights (fp32)"] + state["AdamW moments + step"], (what, nbytes)
    # measured in the second step: DDP rebuilds its buckets (in the order gradients arrived) in its forward
    with memory.LiveBytes(memory.state_tensors(model, opt) + [x, y]) as live:
        memory.step(model, opt, x, y, dtype, lambda ph: live.levels.append((ph, live.reset_peak())), forward)
    spans = measured_spans(model, live.levels, pred)
    bad = [f"{at}: predicted {p:,}, measured {m:,}" for at, (p, m) in spans.items() if abs(p / m - 1) > 1e-3]
    assert not bad, (what, bad)
    if how != "fsdp":
        with gpt.autocast("cpu", dtype):
            saved = gpt.saved_tensor_bytes(lambda: forward(x, y), [*model.parameters(), x, y])
        assert saved == pred["saved"], (what, saved, pred["saved"])
    if k:
        grads = [torch.autograd.grad(f(x, y)[1], list(model.parameters())) for f in (model, forward)]
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads)), what
    return {pred["phases"]["forward"][1], pred["phases"]["backward"][1]}


def test_memory_account_exact_on_cpu():
    """memory.account = live tensors counted op by op: state, saved, phase and per-block peaks, in 12 layouts
    (one process, a DDP rank and an FSDP rank in a fake two-rank group, flat and nested checkpoints). GPU-only and
    not here: the CUDA allocator, NCCL, fp32 LayerNorm under autocast, the Triton loss."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    seen = set()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        for B, T, dtype, how, k, chunk, kw in ACCOUNT_CASES:
            with loss_chunk_rows(chunk or gpt.CE_CHUNK_ROWS):
                seen |= check_account_case(B, T, dtype, how, k, kw)
    finally:
        dist.destroy_process_group()
    assert {"forward: loss chunk", "forward: loss end", "forward end", "backward start", "backward end"} <= seen

def test_memory_nested_checkpointing_matches_and_lowers_peak():
    """Groups of 2 of 6 blocks, each block checkpointed again inside: the plain model's loss and gradients, and a
    lower peak of live tensors than no checkpointing, as account predicts it."""
    torch.manual_seed(0)
    cfg = gpt.make_config("tiny", n_layer=6)
    model = gpt.GPT(cfg)
    opt, (x, y) = gpt.configure_optimizer(model, lr=1e-3), memory.random_batch(cfg, 2, 128, "cpu")
    outs = []
    for scheme in ("none", "nested"):
        loss = memory.checkpointed(model, scheme, 2)(x, y)[1]
        outs.append([loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*outs))
    peaks = {s: max(memory.live_peaks(model, opt, x, y, None, memory.checkpointed(model, s, 2)).values())
             for s in ("none", "nested")}
    assert peaks["nested"] < peaks["none"], peaks
    predicted = memory.account(cfg, 2, 128, None, "cpu", groups=2, nested=True)["peak"]
    assert abs(predicted / peaks["nested"] - 1) < 1e-4, (predicted, peaks)  # as close as the exactness test asks

def test_memory_checkpoint_default_each_scheme_at_its_best_full_sweeps():
    """checkpoint times none and each scheme at its predicted best by default (xl: 3 variants, not 13); --full both
    schemes at 1, sqrt(L) and each best -1..+1 (the course's sweep); --groups both schemes at the sizes given."""
    best, L = {"flat": 2, "nested": 7}, 48  # xl, B=4, T=2048, fp32: account's least activations
    assert memory.checkpoint_variants(best, L, None, False) == [("none", 0), ("flat", 2), ("nested", 7)]
    full = memory.checkpoint_variants(best, L, None, True)
    assert len(full) == 13 and [g for s, g in full if s == "nested"] == [1, 2, 3, 6, 7, 8], full
    assert memory.checkpoint_variants(best, L, [4], False) == [("none", 0), ("flat", 4), ("nested", 4)]

def test_memory_snapshot_summary_from_a_synthetic_trace():
    """Each phase's peak above the level where recording began, its largest allocations and the line that made them."""
    def alloc(addr, size, line=0):  # a frame inside torch, then gpt.py's line; none: autograd's C++ thread
        inner = {"filename": "/v/torch/nn/functional.py", "line": 1, "name": "linear"}
        frames = [inner, {"filename": "/r/gpt.py", "line": line, "name": "forward"}] if line else []
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames}
    def free(addr, size):
        return {"action": "free_completed", "addr": addr, "size": size}
    trace = [alloc(1, 100, 10), alloc(2, 300, 11), free(1, 100), alloc(3, 50, 12),  # level 350, peak 400
             alloc(4, 1000), free(2, 300), free(4, 1000), free(9, 70),  # peak 1350; 9: allocated before recording
             alloc(5, 10, 13), free(5, 10)]
    got = memory.trace_summary(trace, [("forward", 4), ("backward", 8), ("optimizer", 10)], top=2)
    assert got["forward"] == (400, [(300, "gpt.py:11 forward"), (100, "gpt.py:10 forward")]), got
    assert got["backward"] == (1350, [(1000, "autograd's thread (no Python line)")]), got
    assert got["optimizer"] == (-10, [(10, "gpt.py:13 forward")]), got

def synthetic_snapshot():
    """A snapshot shaped like torch.cuda.memory._snapshot(): 1,200 bytes allocated before recording (one block freed
    during it), then allocations and frees (each free requested, then completed) and a segment event; its phases'
    marks. The active level: 1,200 at the start, a peak of 2,550 in backward, 1,350 at the end."""
    def entry(action, addr, size, line=0):
        frames = [{"filename": "/r/gpt.py", "line": line, "name": "forward"}] if line else []
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0, "frames": frames}
    def freed(addr, size):
        return [entry("free_requested", addr, size), entry("free_completed", addr, size)]
    trace = [entry("alloc", 1, 100, 10), entry("alloc", 2, 300, 11), *freed(1, 100),
             entry("segment_alloc", 0, 2 << 20), entry("alloc", 3, 50, 12),  # forward: entries 0-5
             entry("alloc", 4, 1000), *freed(4, 1000), entry("free_completed", 9, 200),  # backward: 6-9
             entry("alloc", 5, 10, 13), entry("free_completed", 5, 10)]  # optimizer: 10-11
    def block(size, state="active_allocated"):
        return {"size": size, "state": state}
    segments = [{"device": 0, "blocks": [block(1000), block(300), block(50), block(4096, "inactive")]},
                {"device": 1, "blocks": [block(777)]}]  # another GPU's: not counted
    marks = [("step: forward", 6), ("step: backward", 10), ("step: optimizer", 12)]
    return {"segments": segments, "device_traces": [trace, []]}, marks

def test_memory_snapshot_timeline_png_and_peaks_table():
    """The active memory timeline from a snapshot (the level before recording from its segments), drawn to a PNG; the
    snapshot part's tables with the recording mocked (no CUDA here): the residual stream = B T d bytes, a run's peaks,
    a run out of memory as a row, every run's timeline in one figure."""
    snapshot, marks = synthetic_snapshot()
    start, entries, levels = memory.active_timeline(snapshot, 0)
    assert (start, max(levels), levels[-1]) == (1200, 2550, 1350), (start, levels)
    assert entries[levels.index(2550)] == 6  # the peak: the 1,000-byte allocation, the first entry of backward
    has_plt = importlib.util.find_spec("matplotlib") is not None
    with tempfile.TemporaryDirectory() as d:
        png = os.path.join(d, "timeline.png")
        if has_plt:
            with contextlib.redirect_stdout(io.StringIO()):
                memory.plot_timelines([memory.timeline_panel(snapshot, marks, "synthetic")], png)
            with open(png, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        runs, results = [(64, "fp32"), (2048, "bf16")], iter([(snapshot, marks, 1200, 2550), None])  # None: OOM
        out = io.StringIO()
        with unittest.mock.patch.object(memory, "record_snapshot", lambda *args: next(results)), \
                contextlib.redirect_stdout(out):
            memory.part_snapshot(torch.device("cuda", 0), "tiny", 4, runs, {"attn": "sdpa"}, "step",
                                 memory.snapshot_paths(os.path.join(d, "s.pickle"), runs), 2, png if has_plt else None)
        out = out.getvalue()
        assert (not has_plt or f"wrote {png}" in out) and "s_T2048_bf16.pickle" in out, out
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines() if line.startswith(("4 x ", "tiny B=4"))}
    for T in (64, 2048):  # tiny: d_model 128
        assert rows[f"4 x {T} x 128"][-2:] == [f"{4 * T * 128 * w / 2**20:,.2f}" for w in (4, 2)], rows
    assert rows["tiny B=4 T=64 fp32"][-4:] == ["n/a", memory.mib(2550), "backward", memory.mib(1200)], rows
    assert rows["tiny B=4 T=2048 bf16"][-4:] == ["OOM", "OOM", "n/a", "n/a"], rows
    assert "highest peak 0.00 GiB allocated (tiny B=4 T=64 fp32)" in out.splitlines()[-1], out

def answer_lines(out):
    """{the line's start, up to its symbols: (numbers put in, the printed result)} of every answer parallel prints with
    a value (tp_calcs (a), the backward's equations, has none)."""
    answers = {}
    for line in out.splitlines():
        parts = line.split(" = ")
        result = parts[-1].split(":")[0]
        if re.match(r"  \([a-d]\) ", line) and result.endswith((" FLOPs", " ms", " devices")):
            answers[" = ".join(parts[:-2])] = (parts[-2], result)
    return answers

def test_memory_parallel_answers_evaluate_to_their_results():
    """Each part of the four calculation problems prints its expression in symbols, then with the numbers, then the
    value: the numbers evaluate to the value printed, and the values are the table's (ffn_costs)."""
    args = ["--d-model", 1024, "--d-ff", 4096, "--batch", 4096, "--seq", 2, "--devices", 8, "--tp", 2, "--tflops", 500]
    out, _ = main_ok("memory.py", "parallel", *args)
    for problem in ("data_parallel_calcs, N_DP = 8", "fsdp_calcs, N_FSDP = 8", "tp_calcs, N_TP = 2",
                    "fsdp_tp_calcs, N_FSDP x N_TP = 4 x 2", "alternate_ring_all_reduce"):
        assert f"\n{problem}\n" in out, problem
    answers = answer_lines(out)
    assert len(answers) == 19 and "dx = all-reduce over i of" in out, list(answers)
    for start, (numbers, result) in answers.items():
        value = eval(numbers.replace(" x ", " * ").replace("^", "**"), {"__builtins__": {}, "max": max})
        unit = result.split()[-1]
        printed = {"FLOPs": f"{value:.4g} FLOPs", "ms": f"{value * 1e3:,.3f} ms", "devices": f"{value:,.1f} devices"}
        assert printed[unit] == result, (start, numbers, result, value)
    B, D, F, C, W = 8192, 1024, 4096, 500e12, 180e9
    costs = memory.ffn_costs(B, D, F, C, W, 8, 2)
    dp_flops = "  (a) backward FLOPs per device = 12 B D D_FF / N_DP"
    assert answers[dp_flops] == ("12 x 8192 x 1024 x 4096 / 8", f"{costs[('DP', 'backward')][0]:.4g} FLOPs")
    tp_comm = "  (c) forward communication = 2 (N_TP - 1) / N_TP x 2 B D / W"
    assert answers[tp_comm][1] == f"{costs[('TP', 'forward')][2] * 1e3:,.3f} ms", answers[tp_comm]
    overlapped = [v for k, v in answers.items() if k.startswith("  (b) forward communication, axes overlapped")]
    assert overlapped[0][0].startswith("max((4 - 1) / 4 x 2 x 3 x 1024 x 4096 / (2 x 1.8e+11), "), overlapped

def test_memory_checkpoint_strategy_and_its_growth_in_depth():
    """checkpoint's answer to the course's question (a) in account's terms: a run keeps one residual stream tensor,
    each scheme's least activations as account finds them; with depth none grows as L, nested groups as sqrt(L)."""
    cfg, dtype = memory.config_of("2.7B", 2048), torch.bfloat16
    pred = memory.predictions(cfg, 4, 2048, dtype, "cuda")
    lines = memory.strategy_lines(cfg, 4, 2048, dtype, "cuda", pred)
    a = memory.residual_stream_bytes(4, 2048, 2560, 4)
    assert f"a = B x T x d_model x 4 B = 4 x 2048 x 2560 x 4 B = {memory.mib(a)} MiB" in lines[0], lines[0]
    for scheme, line in zip(memory.SCHEMES, lines[2:4]):
        g, nbytes = memory.least_activations(pred, scheme, 32)
        assert line.endswith(f"account's least: g={g}, {memory.mib(nbytes)} MiB") and "O(sqrt(L))" in line, line
    assert "O(log L)" in lines[4] and "O(1)" in lines[4] and "O(L^2) compute" in lines[4], lines[4]
    rows = memory.depth_rows(cfg, 4, 2048, dtype, "cuda")
    assert [r[0] for r in rows] == [8, 16, 32, 64, 128], rows
    none, nested = ([float(r[i].replace(",", "")) for r in rows] for i in (1, 5))
    steps = [b - a for a, b in zip(none, none[1:])]
    assert all(abs(b / a - 2) < 1e-3 for a, b in zip(steps, steps[1:])), none  # linear in L: each step twice the last
    assert nested[-1] / nested[2] < 2, nested  # 4x the layers, under 2x the activations: sqrt(L)

def test_memory_parallel_calculator_by_hand():
    """Ring and tree all-reduce by hand, their crossover, bytes per device = total / degree for what is sharded."""
    a, b = 1e-5, 1e9  # 10 us, 1 GB/s
    assert math.isclose(memory.ring_all_reduce_s(4, 1e6, a, b), 2 * 3 * a + 2 * 3 / 4 * 1e-3)
    assert math.isclose(memory.tree_all_reduce_s(4, 1e6, a, b), 2 * 2 * (a + 1e-3))
    assert math.isclose(memory.crossover_bytes(4, a, b), a * b * (3 - 2) / (2 - 3 / 4))  # 8,000 bytes
    assert memory.ring_all_reduce_s(2, 1e6, a, b) < memory.tree_all_reduce_s(2, 1e6, a, b)  # never loses at n=2
    for n in (3, 8, 64, 1000):
        star = memory.crossover_bytes(n, a, b)
        for size in (star / 10, star * 0.99, star * 1.01, star * 10):
            ring_wins = memory.ring_all_reduce_s(n, size, a, b) < memory.tree_all_reduce_s(n, size, a, b)
            assert ring_wins == (size > star), (n, size, star)
    shape = memory.mlp_shape(8, 32, 2, 0, 2)  # 2 blocks 8 -> 32 -> 8: 1024 params; saves 2x8 + 2x32 B a token
    P, kw = 1024, dict(B=8, T=4, width=2, alpha=a, beta=b)
    costs = {(t, stage): memory.layout_costs(shape, 8, t, stage, **kw)[:3] for t in (1, 4) for stage in (0, 3)}
    assert costs[1, 0][0] == {"weights": 4 * P, "gradients": 4 * P, "optimizer state": 8 * P,
                              "activations": 1 * 4 * 2 * (16 + 64)}  # 1 sequence per device
    assert costs[1, 3][0] == {"weights": 4 * P / 8, "gradients": 4 * P / 8, "optimizer state": 8 * P / 8,
                              "activations": 640}
    assert costs[4, 0][0] == {"weights": 4 * P / 4, "gradients": 4 * P / 4, "optimizer state": 8 * P / 4,
                              "activations": 4 * 4 * 2 * (16 + 64 / 4)}  # D = 2: 4 sequences, MLP split 4 ways
    assert costs[4, 3][0]["optimizer state"] == 8 * P / 8 and costs[4, 3][0]["activations"] == 1024
    assert costs[1, 0][1] == 2 * 7 / 8 * 4 * P and costs[1, 3][1] == 7 / 8 * (2 * 2 + 4) * P
    assert costs[4, 0][1] == 2 * 1 / 2 * 4 * P / 4 + 2 * 2 * (2 * 3 / 4) * (4 * 4 * 8 * 2)  # DP over 2, TP's 4
    assert math.isclose(costs[1, 0][2], memory.ring_all_reduce_s(8, 4 * P, a, b))
    code, out, _ = call_main("memory.py", "parallel")
    n = 126 * 2 * 16384 * 53248
    assert code == 0 and "219,848,638,464 parameters" in out and f"N_FSDP = {-(-n * 16 // (95 * 10**9))} " in out
    assert out.count("\n  ring = ") == 1 and "FSDP x TP" in out and "TP sends" in out, out
    code, out, _ = call_main("memory.py", "parallel", "--devices", 2)  # the default TP degree drops to 2
    assert code == 0 and out.splitlines()[-1].endswith("the ring never loses") and "above 0 GB" not in out, out
    assert "nothing to all-reduce" in memory.ring_vs_tree(1, a, b) and "above" in memory.ring_vs_tree(3, a, b)
    assert "never loses" in memory.ring_vs_tree(64, 0, b)  # no latency: only bytes count, and the ring sends fewer
    cfg = gpt.make_config("gpt2")
    budgets = [memory.account(cfg, B, 1024, torch.bfloat16)["peak"] - d for B, d in ((37, 1), (12, 0))]
    assert [memory.predict_max_batch(cfg, 1024, torch.bfloat16, budget) for budget in budgets] == [36, 12]

def test_memory_compiled_prediction_states_its_error():
    """A compiled prediction says how far such predictions have been from the measured peak, computed from the
    checks recorded (a new one moves the band); an eager one does not."""
    flags = ["account", "--model", "tiny", "--fsdp", "--bf16", "--batch", 2, "--seq", 64]
    compiled, _ = main_ok("memory.py", *flags, "--compile")
    eager, _ = main_ok("memory.py", *flags)
    worst = max(error for _, _, error in memory.COMPILED_CHECKS)  # the band follows the checks it is computed from
    band = f"in {len(memory.COMPILED_CHECKS)} configurations it was"
    assert band in compiled and f"up to {worst}% off" in compiled and band not in eager, compiled
    n, close = len(memory.COMPILED_CHECKS), sum(error <= 3 for _, _, error in memory.COMPILED_CHECKS)
    memory.COMPILED_CHECKS.append(("H200", "a check worse than any before", 99.5))
    try:
        note = memory.compiled_band_note()
        want = f"in {n + 1} configurations it was {close} times within 3% of the measured peak and up to 99.5% off"
        assert want in note, note
    finally:
        memory.COMPILED_CHECKS.pop()


def test_memory_ffn_compute_against_communication_by_hand():
    """The handout's FFN layer: FLOPs and ring-collective times by hand, and the device counts where each scheme
    turns communication-bound equal the floors of the closed forms."""
    B, D, F, C, W = 4096, 64, 512, 1e13, 1e11  # B W / C = 40.96, 1.5 F W / C = 7.68, 3 F W / C = 15.36
    costs = memory.ffn_costs(B, D, F, C, W, 4, 2)
    weights = 2 * 3 * D * F  # bytes
    assert costs[("DP", "backward")] == (12 * B * D * F / 4, 12 * B * D * F / 4 / C, 2 * 3 / 4 * weights / W)
    assert costs[("FSDP", "forward")][2] == 3 / 4 * weights / W
    assert costs[("TP", "forward")][0] == 6 * B * D * F / 2 and costs[("TP", "forward")][2] == 2 * B * D / W
    overlapped = costs[("FSDP x TP", "forward, axes overlapped")][2]
    assert overlapped == max(3 / 4 * weights / 2 / W, 2 * B / 4 * D / W)
    expected = {("DP", "backward"): 41, ("FSDP", "forward"): 41, ("FSDP", "backward"): 41, ("TP", "forward"): 8,
                ("TP", "backward"): 16, ("FSDP x TP", "forward, axes overlapped"): 41 * 8}
    for key, devices in expected.items():
        assert memory.most_devices(B, D, F, C, W, key) == devices, key
    out, _ = main_ok("memory.py", "parallel", "--d-model", 1024, "--devices", 8, "--tp", 2, "--tflops", 500)
    assert "the handout's FFN layer" in out and "alternate ring all-reduce" in out, out
    assert "the handout's FFN layer" not in main_ok("memory.py", "parallel", "--d-model", 1024)[0]


def test_memory_bad_input():
    with tempfile.TemporaryDirectory() as d:
        theirs = os.path.join(d, "theirs.pickle")
        for path in (theirs, os.path.join(d, "s_T256_fp32.pickle")):  # the second: a run's name from --out s.pickle
            with open(path, "w") as f:
                f.write("not ours")
        check_bad_inputs("memory.py", [
            ("nonsense", "invalid choice"),
            ("account --model huge", "unknown model"),
            ("account --seq 0", "--seq: must be at least 1"),
            ("account --seq 100000", "--seq: must be at most 65536"),
            ("account --device banana", "not a device"),
            ("account --device cuda:7", "cuda"),
            ("account --batch 0", "--batch"),
            ("account --vocab 100", "vocab"),
            ("account --model tiny --recompute 9", "recompute"),
            ("account --fsdp --ddp", "exclude"),
            ("account --fsdp --world 1", "--world"),
            ("account --compile --device cpu", "--compile"),
            ("checkpoint --recompute 1", "recompute"),
            ("checkpoint --rounds 0", "--rounds"),
            ("checkpoint --groups 0", "--groups"),
            ("checkpoint --device cpu --groups 2,5", "larger than"),
            ("checkpoint --full --groups 2", "--full picks the group sizes itself"),
            ("account --full", "--full is read by checkpoint"),
            ("account --groups 2", "is read by checkpoint, not by account"),
            ("parallel --fsdp", "is read by account, not by parallel"),
            ("parallel --world 4", "--devices"),
            ("account --tflops 100", "--tflops is read by parallel"),
            ("parallel --tflops 0", "--tflops: must be at least 0.001"),
            ("account --world 3", "rank count of account --fsdp or --ddp"),
            ("checkpoint --unfused", "not by checkpoint"),
            ("account --rounds 3", "is read by checkpoint"),
            ("account --top 3", "is read by snapshot"),
            ("account --out s.pickle", "is read by snapshot"),
            ("checkpoint --devices 8", "is read by parallel"),
            ("snapshot --device-gb 80", "is read by parallel"),
            ("parallel --device cpu", "parallel is pure arithmetic"),
            ("parallel --recompute 2", "not by parallel"),
            ("parallel --attn naive", "describe a --model preset"),
            ("parallel --device-gb inf", "expected a finite number"),
            ("parallel --device-gb 1e9", "--device-gb: must be at most"),
            ("parallel --latency-us nan", "expected a finite number"),
            ("parallel --bandwidth-gbs 1e12", "--bandwidth-gbs: must be at most"),
            ("account --sweep --fsdp", "--sweep"),
            ("parallel --device-gb 0", "device-gb"),
            ("parallel --tp 0", "--tp"),
            ("parallel --devices 6 --tp 4", "not divisible"),
            ("parallel --model gpt2 --tp 5 --devices 5", "does not divide"),
            ("parallel --devices 6 --tp 3", "does not divide d_ff"),
            ("parallel --model gpt2 --layers 4", "not both"),
            ("parallel --bandwidth-gbs 0", "bandwidth"),
            ("parallel --params -5", "--params"),
            ("snapshot --out a", ".pickle"),
            ("snapshot --dtypes fp32,fp16", "unknown dtype 'fp16'"),
            ("snapshot --dtypes fp32,fp32", "names a precision twice"),
            ("snapshot --dtypes fp32,bf16 --bf16", "leave out --bf16"),
            ("account --dtypes bf16", "--dtypes is read by snapshot"),
            (f"account --plot {d}/a.png", "--plot is read by snapshot"),
            (f"snapshot --plot {d}/notes.txt", plot_refusal()),
            (f"snapshot --plot {d}/missing/a.png", "does not exist"),
            ("account --seq 128,256", "a list is read by snapshot and account --sweep"),
            ("parallel --seq 1,2", "takes one length for parallel"),
            ("snapshot --seq 128,128", "names a length twice"),
            ("snapshot --seq 128,0", "--seq: must be at least 1"),
            (("snapshot", "--seq", "128,256", "--out", os.path.join(d, "s.pickle")), "not a file this script wrote"),
            ("snapshot --phase sideways", "invalid choice"),
            ("snapshot --device cpu", "needs a CUDA GPU"),
            ("account --attn cudnn --device cpu", "needs a CUDA GPU"),
            (("snapshot", "--out", theirs), "not a file this script wrote"),
            (("snapshot", "--out", os.path.join(d, "missing", "s.pickle")), "does not exist"),
            ("account --batch 100000 --device cpu", "of this machine's memory")])  # the last: refused, not OOM-killed
    err = io.StringIO()  # weights alone beyond any host: "not even batch 1", never "batch 0 fits"
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        memory.check_host_fits(gpt.make_config("2.7B", n_layer=2000), 1, 64, None, 1 << 60)
    assert "not even batch 1 fits" in err.getvalue(), err.getvalue()

@gpu
def test_memory_on_the_gpu():
    """Predicted peak within 10% of max_memory_allocated; snapshots of both phases at T=128 and 2048 (position table
    grown), fp32 and bf16, summarized, each timeline's peak that of the trace's phases; nested checkpointing runs; a
    batch too big names one that fits."""
    import pickle
    for fused, dtype in ((fused, dtype) for fused in (True, False) for dtype in (None, torch.bfloat16)):
        cfg = gpt.make_config("gpt2", fused_ce=fused)
        measured = max(memory.measure_step(cfg, 8, 512, dtype, torch.device("cuda", 0)).values())
        assert abs(memory.account(cfg, 8, 512, dtype)["peak"] / measured - 1) <= 0.10, (fused, dtype, measured)
    with tempfile.TemporaryDirectory() as d:
        out, err = main_ok("memory.py", "snapshot", "--seq", 128, "--batch", 2, "--bf16", "--out", f"{d}/s.pickle")
        assert os.path.getsize(f"{d}/s.pickle") > 0 and "memory_viz" in out and "step: backward" in out, out
        assert "position table" not in out, out
        plot = ["--plot", f"{d}/s.png"] if importlib.util.find_spec("matplotlib") else []
        out, err = main_ok("memory.py", "snapshot", "--seq", "128,2048", "--batch", 2, "--dtypes", "fp32,bf16",
                           "--out", f"{d}/s.pickle", *plot)
        assert "position table" in out and (not plot or os.path.getsize(plot[1]) > 0), out
        for T in (128, 2048):
            for name in ("fp32", "bf16"):
                with open(f"{d}/s_T{T}_{name}.pickle", "rb") as f:
                    _, _, levels = memory.active_timeline(pickle.load(f), 0)
                row = next(line for line in out.splitlines() if line.startswith(f"gpt2 B=2 T={T} {name} "))
                peaks = [float(cell.replace(",", "")) for cell in row.split()[4:6]]  # inference forward, step
                assert abs(max(levels) / 2**20 / max(peaks) - 1) < 0.005, (row, max(levels))
    out, _ = main_ok("memory.py", "checkpoint", "--model", "gpt2", "--batch", 2, "--seq", 2048, "--groups", "3",
                     "--rounds", 2, "--bf16")
    assert "checkpoint: best" in out and "nested g=3" in out, out
    check_bad_inputs("memory.py", [("account --model xl --batch 4096 --seq 1024", "predicts batch")])


# --- 7. ddp.py: every wrapper, ZeRO and FSDP equal one process; all-reduce; optimizer memory; benchmark; bad input

class NoSyncDDP(ddp.DataParallel):  # trains without averaging: the selftest must catch it (module level: a
    def finish_gradient_synchronization(self):  # spawned rank unpickles it by name)
        pass

def kill_rank_one(rank, *_):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)

def rank_threads(rank, world, device):  # a ddp.launch worker: how many threads its rank may use
    return torch.get_num_threads()

def test_ddp_forked_ranks_ask_for_one_thread():
    """A CPU rank forked from a process whose OpenMP threads have run hangs if it asks for several (GNU OpenMP's pool
    does not survive a fork); spawned ranks (where CUDA exists) share the cores. 64 cores, as on a big host."""
    torch.ones(1024, 1024).sum()  # this process's thread pool has run
    with unittest.mock.patch("os.cpu_count", return_value=64):
        threads = ddp.launch(rank_threads, 2, "gloo", 60)
    assert threads == (32 if torch.cuda.is_available() else 1), threads

def test_ddp_selftest_matches_one_process():
    """On 2 and 4 gloo ranks every wrapper ends with one process's weights; a wrapper that never averages is caught."""
    n = len(ddp.TOY_VARIANTS)
    with unittest.mock.patch.dict(ddp.TOY_VARIANTS, {"no-sync": (NoSyncDDP, "sgd", 2e-6)}):  # one more, for the test
        runs = {world: call_main("ddp.py", "selftest", "--world", world, "--backend", "gloo") for world in (2, 4)}
    for code, out, err in runs.values():
        assert code == 1 and f"{n} of {n + 1} variants match one-process training; FAILED: no-sync" in out, out + err
    rows = {ln.split()[0]: ln.split()[1:] for ln in runs[2][1].splitlines() if ln.split()[:1] in (["fsdp"], ["bucket"])}
    assert rows["fsdp"] == ["0.0e+00", "bitwise", "ok"] and rows["bucket"][1:] == ["bitwise", "ok"], runs[2][1]

def allreduce_table(out):  # {(world, size): the row's cells after the size} of `ddp.py allreduce`'s table
    lines = out.split("\n----")[1].split("\nover every rank's")[0].splitlines()[1:]
    return {(int(ln.split()[2]), " ".join(ln.split()[3:5])): ln.split()[5:] for ln in lines}

def test_ddp_allreduce_gloo_rows_bus_bandwidth_and_sums():
    """gloo on 2 and 3 ranks: a row per world and size, busbw = algbw x 2(n-1)/n, every sum exact; an all-reduce
    that does not reduce is caught."""
    out, err = main_ok("ddp.py", "allreduce", "--backend", "gloo", "--worlds", "2,3", "--sizes", "0.001,0.05",
                       "--warmup", 1, "--iters", 3)
    table = allreduce_table(out)
    assert sorted(table) == [(2, "0.001 MiB"), (2, "0.05 MiB"), (3, "0.001 MiB"), (3, "0.05 MiB")], out
    for (world, _), cells in table.items():
        mean, low, high, algbw, busbw = (float(cells[i]) for i in (0, 3, 4, 6, 7))  # (cells[1:3]: "±", std)
        assert 0 < low <= mean <= high and len(cells[5].split("/")) == world and cells[8] == "yes", out
        assert abs(busbw - algbw * 2 * (world - 1) / world) <= 0.01 * busbw, out  # (3 significant digits)
    assert out.splitlines()[-1].startswith("summary: every sum exact"), out
    if not HAS_CUDA:  # forked ranks inherit the patch (with CUDA present, ranks are spawned and would not)
        with unittest.mock.patch.object(ddp.dist, "all_reduce", lambda tensor, *args, **kw: None):
            code, out, err = call_main("ddp.py", "allreduce", "--backend", "gloo", "--worlds", 2, "--sizes", 0.001,
                                       "--warmup", 0, "--iters", 1)
        assert code == 1 and "summary: WRONG all-reduce sums: gloo (CPU) world 2 0.001 MiB" in out, out + err

def test_ddp_optimizer_memory_counts_match_prediction():
    """On 2 gloo ranks every counted byte is the predicted one; AdamW keeps 8 bytes a parameter and a step count a
    tensor on every rank, ZeRO-1 splits exactly that between the ranks; a table row per variant, rank and point."""
    with unittest.mock.patch.object(ddp, "print_optimizer_memory", wraps=ddp.print_optimizer_memory) as printed:
        out, err = main_ok("ddp.py", "optimizer-memory", "--world", 2, "--backend", "gloo", "--batch", 1, "--seq", 8,
                           "--rounds", 1, "--steps", 1)
    memory, timed = printed.call_args.args[:2]  # the bytes themselves, not the table's rounded MiB
    with torch.device("meta"):
        params = list(gpt.GPT(gpt.make_config("tiny", vocab_size=50304)).parameters())
    full = 8 * sum(p.numel() for p in params) + 4 * len(params)
    for ranks in memory.values():
        for points in ranks:
            assert all(sum(counted[:3]) == counted[3] for counted in points.values()), points
    assert [points["after step"][2] for points in memory["BucketDDP"]] == [full] * 2, memory["BucketDDP"]
    sharded = [points["after step"][2] for points in memory["ZeRO-1"]]
    assert sum(sharded) == full and max(sharded) < full and min(sharded) > 0, (sharded, full)
    assert not timed["BucketDDP"]["oom"] and timed["ZeRO-1"]["timing"]["ratio"] > 0, timed
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("BucketDDP ", "ZeRO-1 "))]
    assert len(rows) == 2 * 2 * 3 + 2 and all(r[-3] == r[-2] for r in rows[:12]), out  # predicted = live
    assert out.splitlines()[-1].startswith("summary: ZeRO-1's fullest rank keeps"), out

def test_ddp_benchmark_cpu_smoke():
    """On 2 gloo ranks: a benchmark row per variant. In its own process: rank 0 prints each group's progress line,
    and a spawned rank (where CUDA exists) writes to the terminal, past this runner's capture."""
    with tempfile.TemporaryDirectory() as tmp:
        plot = ["--plot", os.path.join(tmp, "ddp.png")] if importlib.util.find_spec("matplotlib") else []
        p = run("ddp.py", "benchmark", "--world", 2, "--backend", "gloo", "--rounds", 1, "--steps", 1,
                "--warmup", 1, "--variants", "local,torch,zero2,fsdp:bf16,fsdp2", *plot)
        out, err = p.stdout, p.stderr
        assert not plot or os.path.getsize(plot[1]) > 0, out + err
        assert "  group 1 of 1: local (no comm), torch DDP, ZeRO-2, FSDP bf16 compute, torch FSDP2" in out, out
    assert "benchmark: 5 variants x 1 round; --variants narrows it" in out, out
    for label in ("local (no comm)", "torch DDP", "ZeRO-2", "FSDP bf16 compute", "torch FSDP2"):
        row = next((line for line in out.splitlines() if line.startswith(label + "  ")), label)
        assert len(row.split()) >= 10 and float(row[len(label):].split()[0]) > 0 and "x (" in row, out
        assert row[len(label):].split(")")[2].split()[0] == ("-" if label.startswith("local") else "n/a"), row
    assert "exposed comm: n/a on the CPU" in out, out
    assert out.splitlines()[-1].startswith("summary: step (memory) vs torch DDP's: local (no comm)"), out

def test_ddp_benchmark_runs_say_how_far_each_ratio_moved():
    """--runs 2: the benchmark twice, fresh ranks each time, then each variant's ratio to torch DDP as each run's
    table printed it, and its fastest round over torch DDP's (from the same tables' minima), each with its largest
    distance from the runs' median and whether that is within 5%."""
    p = run("ddp.py", "benchmark", "--world", 2, "--backend", "gloo", "--rounds", 2, "--steps", 1, "--warmup", 1,
            "--variants", "local,torch,flat", "--runs", 2)
    out = p.stdout
    assert "run 1 of 2 (fresh ranks)" in out and "run 2 of 2 (fresh ranks)" in out, out
    fastest = [float(m) for m in re.findall(r"^torch DDP\s+[\d.]+ \(([\d.]+)-", out, re.M)]  # its minimum, run by run
    assert len(fastest) == 2, out
    for label in ("local (no comm)", "FlatDDP"):
        lines = [line for line in out.splitlines() if line.startswith(label + "  ") and "x (" in line]  # each run's
        tables = [float(re.search(r"(\d+\.\d+)x \(", line).group(1)) for line in lines]
        minima = [float(re.search(r"[\d.]+ \(([\d.]+)-", line).group(1)) for line in lines]
        row = next(line for line in out.splitlines() if line.startswith(label + "  ") and " / " in line)
        cells = re.split(r"\s{2,}", row.strip())  # variant, ratios, distance, verdict, fastest, distance, verdict
        assert len(tables) == 2 and len(cells) == 7, (label, tables, row)
        fast = [float(x) for x in re.findall(r"(\d+\.\d+)x", cells[4])]
        assert [float(x) for x in re.findall(r"(\d+\.\d+)x", cells[1])] == tables, (tables, row)
        assert all(abs(f - m / t) < 0.005 for f, m, t in zip(fast, minima, fastest)), (fast, minima, fastest)
        for ratios, distance, verdict in ((tables, cells[2], cells[3]), (fast, cells[5], cells[6])):
            middle = statistics.median(ratios)
            spread = max(abs(r / middle - 1) for r in ratios)
            printed = float(distance.rstrip("%"))  # from the unrounded ratios: within rounding of ours
            verdicts = {"yes", "no"}  # at 5.0% as printed, the unrounded value decides
            if printed < 5:
                verdicts = {"yes"}
            elif printed > 5:
                verdicts = {"no"}
            assert abs(printed - 100 * spread) < 0.2 and verdict in verdicts, row
    last = out.splitlines()[-1]
    assert last.startswith("runs: ") and "within 5% of their median over 2 runs; of the fastest rounds'" in last, out

def test_ddp_benchmark_groups_fit_the_card_torch_ddp_in_each():
    """Groups on two simulated 80 GB GPUs: torch DDP in every group, every other row once; the no-comm row beside
    every variant only where it fits (gpt2 yes; xl no: it is timed once, like any other row), each group within
    the budget unless one variant beside torch DDP is already over it."""
    import ddp
    rows = ddp.benchmark_rows([v for v in ddp.VARIANTS if ":fp32" not in v], gpu=True)  # the default variants
    card = unittest.mock.Mock(total_memory=80 * 2**30)
    for model, no_comm_everywhere in (("gpt2", True), ("xl", False)):
        config = gpt.make_config(model)
        with torch.device("meta"):
            weights = 4 * gpt.GPT(config).num_params()
        budget = 0.9 * card.total_memory - weights - 34 * 4 * 1024 * config.n_embd * config.n_layer
        with unittest.mock.patch.object(torch.cuda, "get_device_properties", return_value=card):
            groups = ddp.memory_groups(rows, config, 4, 1024, "nccl", 2, weights)
        keys = [[v.key for v in group if not v.bf16] for group in groups]
        groups_with_no_comm = 1  # xl: the no-comm row is timed once
        if no_comm_everywhere:
            groups_with_no_comm = len(groups)
        assert all("torch" in k for k in keys), keys
        assert sum("local" in k for k in keys) == groups_with_no_comm, (model, keys)
        others = [v.label for group in groups for v in group if v.key not in ("torch", "local") or v.bf16]
        assert sorted(others) == sorted(v.label for v in rows if v.key not in ("torch", "local") or v.bf16), groups
        for group in groups:  # over budget only where one variant beside the shared rows is already too much
            held = weights * sum(ddp.RESIDENT[v.key][0] + ddp.RESIDENT[v.key][1] / 2 for v in group)
            assert held <= budget or len(group) == 2, (model, [v.label for v in group], held / 2**30)
        assert (len(groups) == 1) == (model == "gpt2"), (model, len(groups))  # gpt2: everything at once
    # a row timed without the no-comm model beside it: exposed comm is the difference of medians, marked unpaired
    timing = {"median": 10.0, "low": 9.0, "high": 11.0, "ratio": 1.0, "ratio_low": 1.0, "ratio_high": 1.0}
    result = {"oom": False, "timing": timing, "exposed": None, "peak": None, "phases": [1.0, 2.0, 3.0, 4.0]}
    no_comm = dict(result, timing=dict(timing, median=7.5))
    assert ddp.benchmark_row("NaiveDDP", result, {}, no_comm, gpu=True)[3] == "2.5*"
    assert ddp.benchmark_row("NaiveDDP", dict(result, exposed=2.0), {}, no_comm, gpu=True)[3] == "2.0"

def test_ddp_benchmark_trace_and_bucket_sweep():
    """On 2 gloo ranks: --trace writes rank 0's trace per variant (its profiled steps, gloo's all-reduces) and a
    table of communication per step, an all-reduce per gradient (OverlapDDP) or per bucket; --bucket-mb 1,10 a row
    per size with the buckets BucketDDP makes, and the best sizes, measured and modelled; --plot-trace a picture."""
    with torch.device("meta"):
        params = list(gpt.GPT(gpt.make_config("tiny", vocab_size=50304)).parameters())
    buckets = {mb: len(ddp.plan_buckets(params, mb)) for mb in (1, 10)}
    with tempfile.TemporaryDirectory() as tmp:
        picture = ["--plot-trace", f"{tmp}/timeline.png"] if importlib.util.find_spec("matplotlib") else []
        p = run("ddp.py", "benchmark", "--world", 2, "--backend", "gloo", "--rounds", 1, "--steps", 1, "--warmup", 1,
                "--batch", 1, "--seq", 8, "--variants", "overlap,bucket", "--bucket-mb", "1,10",
                "--trace", f"{tmp}/ddp.json", *picture)  # (its own process: spawned ranks print past a capture)
        out, err = p.stdout, p.stderr
        for tag in ("overlap", "bucket-1mb", "bucket-10mb"):
            with open(f"{tmp}/ddp.{tag}.json") as f:
                names = [e["name"] for e in json.load(f)["traceEvents"]]
            assert names.count(ddp.STEP_MARK) == ddp.TRACE_STEPS and "gloo:all_reduce" in names, (tag, out)
        assert not picture or os.path.getsize(picture[1]) > 0, out + err
    sweep = out.split("bucket sweep: BucketDDP's step per bucket size")[1].split("\nmodel")[0]
    for mb, count in buckets.items():  # cells: bucket MB, buckets, last bucket MB, step ms, measured, model ms
        cells = next(ln for ln in sweep.splitlines() if ln.startswith(f"BucketDDP {mb} MB ")).split()[3:]
        assert cells[:2] == [str(mb), str(count)] and float(cells[5]) > 0, out
        assert cells[4] == "-", out  # measured against a no-comm row, and this run has none
    assert re.search(r"bucket sweep, BucketDDP: measured best (1|10) MB \(.*\); the model's best of these sizes "
                     r"(1|10) MB, its optimum sqrt\(s w o\) = [\d.]+ MB", out), out
    traced = out.split("communication per step in rank 0's trace")[1]
    for label, calls in (("OverlapDDP", len(params)), ("BucketDDP 1 MB", buckets[1]), ("BucketDDP 10 MB", buckets[10])):
        cells = next(ln for ln in traced.splitlines() if ln.startswith(label + "  ")).split()[len(label.split()):]
        assert cells[:2] == ["all-reduce", str(calls)] and float(cells[2]) > 0 and cells[4].endswith("%"), out
    assert out.splitlines()[-1].startswith("summary: step (memory) vs torch DDP's"), out

def test_ddp_trace_overlap_from_kernels():
    """From a GPU trace's kernels (NCCL's on streams of their own): each collective's time per step and the part of
    it beside computation, the first step left out; the timeline names the NCCL lanes; a file --trace did not
    write is not overwritten."""
    def kernel(name, stream, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "tid": stream, "ts": ts, "dur": dur,
                "args": {"stream": stream}}
    def step(ts, dur):
        return {"ph": "X", "cat": "user_annotation", "name": ddp.STEP_MARK, "tid": 1, "ts": ts, "dur": dur}
    reduce, gather = "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ncclDevKernel_AllGather_RING_LL"
    events = [step(0, 100), kernel("sm90_gemm", 7, 10, 50), kernel(reduce, 20, 20, 60),  # the first step: left out
              dict(step(5, 90), cat="gpu_user_annotation"),  # the GPU's copy of a step's range: not a step
              step(1000, 300), kernel("sm90_gemm", 7, 1000, 100), kernel("elementwise", 7, 1150, 50),
              kernel(reduce, 20, 1080, 80),  # beside computation 1080-1100 and 1150-1160
              kernel(gather, 21, 1250, 40)]  # after it
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/t.json", "w") as f:
            json.dump({"traceEvents": events}, f)
        steps, spans = ddp.traced_spans(f"{tmp}/t.json")
        assert steps == [(0, 100), (1000, 1300)], steps
        stats = ddp.comm_overlap(steps, spans)
        assert stats == {"all-reduce": [1, 80, 30], "all-gather": [1, 40, 0], "all": [2, 120, 30]}, stats
        lanes = ddp.timeline_lanes(ddp.in_step(spans, steps[-1]), gpu=True)[1]
        assert lanes == ["stream 7", "stream 20 (NCCL)", "stream 21 (NCCL)"], lanes
        if importlib.util.find_spec("matplotlib"):
            with contextlib.redirect_stdout(io.StringIO()):
                ddp.plot_timelines(f"{tmp}/t.png", {"FSDP": (steps, spans)}, {"FSDP": stats}, gpu=True)
            assert os.path.getsize(f"{tmp}/t.png") > 0
        with open(f"{tmp}/ddp.bucket.json", "w") as f:
            f.write("notes")
        check_bad_inputs("ddp.py", [(f"benchmark --variants bucket --trace {tmp}/ddp.json", "not a file this script")])
    assert [ddp.collective(n) for n in ("gloo:reduce_scatter", "ncclKernel_Broadcast_RING_LL", "aten::mm")] == \
        ["reduce-scatter", "broadcast", None]

def test_ddp_rank_killed_is_one_line():
    """A rank the kernel kills (here: SIGKILL to itself) is reported in one line, exit 2."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            code = ddp.launch(kill_rank_one, 2, "gloo", 30)
        except SystemExit as e:
            code = e.code
    said = err.getvalue().strip()
    assert code == 2 and said == "error: rank 1 was killed by SIGKILL (out of memory?)", said

def test_ddp_bad_inputs():
    gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        check_bad_inputs("ddp.py", [
            ("benchmark --world 0", "argument --world: must be at least 1"),
            ("selftest --world 3", "1, 2, 4 or 8 ranks"),
            ("benchmark --world 4096", f"more than the {gpus} GPUs" if HAS_CUDA else "of this machine's memory"),
            (f"benchmark --plot {tmp}/missing/ddp.png", "does not exist"),
            (f"benchmark --plot {tmp}", "is a directory"),
            ("benchmark --backend gloo --batch 100000", "of this machine's memory"),
            ("selftest --steps 0", "argument --steps: must be at least 1"),
            ("benchmark --warmup 0", "argument --warmup: must be at least 1"),
            ("benchmark --rounds 0", "argument --rounds: must be at least 1"),
            ("benchmark --rounds two", "expected an integer, got 'two'"),
            ("benchmark --seq 100000", "block size"),
            ("benchmark --model banana", "unknown model"),
            ("benchmark --variants ,", "empty"),
            ("benchmark --vocab 100", "below the tokenizer"),
            ("benchmark --variants fsdp,bogus", "unknown 'bogus'"),
            ("benchmark --variants local:bf16", "unknown 'local:bf16'"),
            ("benchmark --bucket-mb 0", "argument --bucket-mb: must be at least"),
            ("benchmark --bucket-mb -5", "argument --bucket-mb: must be at least"),
            ("benchmark --bucket-mb ten", "argument --bucket-mb: expected a number, got 'ten'"),
            ("benchmark --bucket-mb ''", "expected a comma list of bucket sizes in MB"),
            ("benchmark --bucket-mb 1,,10", "expected a comma list of bucket sizes in MB"),
            ("benchmark --bucket-mb 1,1", "1 MB is listed twice"),
            ("benchmark --variants local,torch --bucket-mb 1,10", "sweeps the bucketed variants"),
            ("optimizer-memory --bucket-mb 1,10", "expected a number, got '1,10'"),
            (f"benchmark --trace {tmp}/missing/ddp.json", "does not exist"),
            ("benchmark --trace /proc/ddp.json", "cannot be written there"),
            ("benchmark --timeout 0", "argument --timeout: must be at least 1"),
            ("benchmark --runs 0", "argument --runs: must be at least 1"),
            (f"benchmark --runs 3 --trace {tmp}/ddp.json", "would write each trace 3 times over"),
            ("allreduce --sizes 0", "at least one float32"),
            ("allreduce --sizes -1", "argument --sizes: must be at least 0"),
            ("allreduce --sizes 1,,2", "expected a comma list of sizes in MiB"),
            ("allreduce --worlds 1", "argument --worlds: must be at least 2, got 1"),
            ("allreduce --worlds 2,x", "expected an integer, got 'x'"),
            ("allreduce --iters 0", "argument --iters: must be at least 1"),
            ("allreduce --warmup -1", "argument --warmup: must be at least 0"),
            ("allreduce --backend gloo --sizes 100000", "of this machine's memory"),
            (f"allreduce --backend gloo --plot {tmp}", "is a directory"),
            (f"allreduce --backend gloo --plot {tmp}/ddp", "no extension"),
            ("optimizer-memory --world 0", "argument --world: must be at least 1"),
            ("optimizer-memory --model banana", "unknown model"),
            ("optimizer-memory --backend gloo --batch 100000", "of this machine's memory"),
        ] + ([
            (f"allreduce --backend nccl --worlds {gpus + 1}", f"more than the {gpus} GPUs on this machine"),
        ] if HAS_CUDA else [
            ("selftest --backend nccl", "needs CUDA"),
            ("allreduce --backend nccl", "--backend nccl needs CUDA"),
            ("allreduce --backend both", "--backend both needs CUDA"),
        ]))
        trace_alone = []  # (without matplotlib --plot-trace is refused for that, as --plot is)
        if importlib.util.find_spec("matplotlib"):
            trace_alone = [(f"benchmark --plot-trace {tmp}/t.png", "add --trace")]
        refused_before_work("ddp.py", [(f"allreduce --backend gloo --plot {tmp}/notes.txt", plot_refusal()),
                                       (f"benchmark --backend gloo --plot {tmp}/notes.txt", plot_refusal()),
                                       (f"benchmark --trace {tmp}/ddp.txt", "expected a .json file name"),
                                       *trace_alone])
        assert os.listdir(tmp) == []  # as the flags are read: no rank started, no file written

@gpu
def test_ddp_gpu_selftest_and_benchmark():
    """Over NCCL every wrapper matches one process, and every benchmark row of a small model has numbers, none OOM."""
    world = min(2, torch.cuda.device_count())
    out = run("ddp.py", "selftest", "--world", world, "--timeout", 120, timeout=300).stdout
    assert "10 of 10 variants match" in out
    out = run("ddp.py", "benchmark", "--world", world, "--model", "tiny", "--batch", 2, "--seq", 64, "--rounds", 2,
              "--steps", 1, "--warmup", 1, "--timeout", 120, timeout=600).stdout
    table = out.split("-----")[-1].split("\nstep: median")[0]
    assert "OOM" not in table and "n/a" not in table, out
    assert all(label in table for label in ("BucketDDP bf16 comm", "torch DDP bf16 comm", "ZeRO-2", "FSDP bf16 compute",
                                            "torch FSDP2"))

@gpu
def test_ddp_gpu_allreduce_and_optimizer_memory():
    """NCCL all-reduce rows with exact sums on 2 GPUs (with 1: a one-line refusal, exit 2); memory_allocated within
    2% (+0.05 GiB: the batch, the step's detached logits) of the predicted bytes at every point of GPT small's first
    step, DDP and ZeRO-1."""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        check_bad_inputs("ddp.py", [("allreduce --backend nccl", "needs at least 2 GPUs and this machine has 1")])
    else:
        out = run("ddp.py", "allreduce", "--backend", "nccl", "--worlds", 2, "--sizes", "1,64", "--iters", 5,
                  timeout=300).stdout
        table = allreduce_table(out)
        assert sorted(table) == [(2, "1 MiB"), (2, "64 MiB")] and all(c[8] == "yes" for c in table.values()), out
    out = run("ddp.py", "optimizer-memory", "--world", min(2, gpus), "--model", "small", "--batch", 2, "--seq", 64,
              "--rounds", 2, "--steps", 1, "--warmup", 1, timeout=300).stdout
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("BucketDDP ", "ZeRO-1 "))][:-2]
    assert len(rows) == 2 * 3 * min(2, gpus), out
    assert all(abs(float(r[-2]) - float(r[-3])) <= 0.02 * float(r[-3]) + 0.05 for r in rows), out


# --- 8. flash_triton.py: every autograd Function vs float64, the saved logsumexp, determinism, bad input

def flash_check(device, cases, shapes):
    """The kernels' Functions (the lesson's, launching them directly, and the planned one flash_attention calls) and
    the PyTorch reference against float64: O, the one saved fp32 logsumexp, gradients; the Triton backward bitwise
    twice."""
    import flash_triton as ft
    default = ft.TMA_HEAD_DIMS
    for tma_dims, dtype, tol in cases:
        ft.TMA_HEAD_DIMS = tma_dims  # tiles load through TMA descriptors at these head dims
        ft.PLANS.clear()  # (plans hold that choice)
        # exact fp32 kernels compile slowly (unrolled FMA dots): the first two shapes suffice there
        for shape_q, shape_k, causal in shapes[:2] if dtype == torch.float32 else shapes:
            gen = torch.Generator(device=device).manual_seed(1)
            q, k, v, do = (torch.randn(s, generator=gen, device=device).to(dtype)
                           for s in (shape_q, shape_k, shape_k, shape_q))
            scale = 0.3 if len(shape_q) == 3 else None  # also an explicit scale
            ref = [t.double().requires_grad_() for t in (q, k, v)]
            s = (ref[0] @ ref[1].transpose(-1, -2)) * (shape_q[-1] ** -0.5 if scale is None else scale)
            if causal:
                s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=device).triu(1), -math.inf)
            o_ref = s.softmax(-1) @ ref[2]
            expected = (o_ref, s.logsumexp(-1), *torch.autograd.grad(o_ref, ref, do.double()))
            for fn in (ft.FlashAttention, ft.FlashAttentionPlanned, ft.FlashAttentionTorch):
                if fn is ft.FlashAttention and set(tma_dims) - set(default):
                    continue  # TMA forced at more head dims: only the plans load through descriptors
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                o = fn.apply(*leaves, causal, scale, "ieee")
                lse = [t for t in o.grad_fn.saved_tensors if t.dtype == torch.float32 and t.shape == q.shape[:-1]]
                assert len(lse) == 1, [(t.shape, t.dtype) for t in o.grad_fn.saved_tensors]  # exactly one L
                grads = torch.autograd.grad(o, leaves, do)
                if fn is not ft.FlashAttentionTorch:
                    again = torch.autograd.grad(fn.apply(*leaves, causal, scale, "ieee"), leaves, do)
                    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "backward is not deterministic"
                errs = [rel_err(x.double(), r) for x, r in zip((o, lse[0], *grads), expected)]
                assert max(errs) < tol, (fn.__name__, tma_dims, dtype, shape_q, shape_k, causal, errs)
    ft.TMA_HEAD_DIMS = default
    ft.PLANS.clear()

def flash_grads_in_model_layout(ft):
    """q, k, v as gpt.py makes them (head-transposed views of one (B, S, 3C) projection): the planned Function's
    gradients come back in (B, S, H, D) memory, where the transposes back to (B, S, C) are views, and the
    projection's gradient is the reference's through either kernels' Function."""
    B, S, H, D = 2, 40, 3, 16
    qkv = torch.randn(B, S, 3 * H * D, generator=torch.Generator().manual_seed(2))
    do = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(3))
    grads = {}
    for fn in (ft.FlashAttention, ft.FlashAttentionPlanned, ft.FlashAttentionTorch):
        leaf = qkv.clone().requires_grad_()
        q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in leaf.split(H * D, dim=2))  # (B, H, S, D) views
        o = fn.apply(q, k, v, True, None, "ieee")
        grads[fn] = torch.autograd.grad(o, (q, k, v, leaf), do)
    dq, dk, dv, dqkv = grads[ft.FlashAttentionPlanned]
    assert all(g.transpose(1, 2).is_contiguous() for g in (dq, dk, dv)), [g.stride() for g in (dq, dk, dv)]
    expected = grads[ft.FlashAttentionTorch][3]
    for fn in (ft.FlashAttention, ft.FlashAttentionPlanned):
        assert rel_err(grads[fn][3], expected) < 1e-5, (fn.__name__, rel_err(grads[fn][3], expected))
    # the model's path: the whole projection in, (B, S, C) out, its gradient written whole
    leaf = qkv.clone().requires_grad_()
    y = ft.flash_attention_qkv(leaf, H)
    o = ft.FlashAttentionTorch.apply(*(t.view(B, S, H, D).transpose(1, 2) for t in qkv.split(H * D, 2)), True,
                                     None, "ieee")
    assert y.shape == (B, S, H * D) and rel_err(y, o.transpose(1, 2).reshape(B, S, H * D)) < 1e-5
    (dqkv_whole,) = torch.autograd.grad(y, leaf, do.transpose(1, 2).reshape(B, S, H * D))
    assert dqkv_whole.is_contiguous() and rel_err(dqkv_whole, expected) < 1e-5, rel_err(dqkv_whole, expected)
    assert_raises("3 * heads * d", ft.flash_attention_qkv, qkv[..., :-1], H)
    # and in the model: --attn triton's blocks (whole projection) against the same weights with --attn math
    config = gpt.make_config("tiny", attn="triton", n_layer=1)  # one block: the interpreter is slow
    torch.manual_seed(0)
    model = gpt.GPT(config)
    idx = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(4))
    losses = {}
    for attn in ("triton", "math"):
        for block in model.h:
            block.attn.attend, block.attn.whole_qkv = gpt.ATTENTION[attn], attn == "triton"
        model.zero_grad()
        _, loss = model(idx, idx)
        loss.backward()
        losses[attn] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    assert rel_err(losses["triton"][0], losses["math"][0]) < 1e-5
    assert max(rel_err(a, b) for a, b in zip(losses["triton"][1], losses["math"][1])) < 1e-4

def flash_interpreted():
    # head dims 16/32/64, ragged lengths, Nq != Nk, 3-, 4- and 5-D, causal and not; TMA loads (D128 only by default)
    # at every head dim too: the interpreter runs them as masked loads
    import flash_triton as ft
    flash_check("cpu", [((), torch.float32, 1e-5), ((), torch.float16, 5e-3), ((16, 32, 64), torch.float16, 5e-3)],
                [((1, 2, 37, 16), (1, 2, 37, 16), True), ((2, 40, 32), (2, 100, 32), False),
                 ((1, 1, 100, 64), (1, 1, 100, 64), True), ((2, 1, 2, 33, 16), (2, 1, 2, 33, 16), False)])
    flash_grads_in_model_layout(ft)
    flash_plans(ft, "cpu")
    out, err = main_ok("flash_triton.py")  # without a GPU: the kernels against the PyTorch reference
    assert out.strip().endswith(": ok"), out + err
    out, err = main_ok("flash_triton.py", "--shapes", "1x2x64x16,1x1x40x64")  # --shapes: the shapes checked
    assert "B1 H2 S64 D16 fp32: within" in out and "at 2 shape(s)" in out and out.strip().endswith(": ok"), out + err
    bad = ["--shapes 1x16x1024", "--shapes 1x16x1024x48", "--shapes 0x1x64x64", "--repeats 0"]
    check_bad_inputs("flash_triton.py", [(a, a.split()[0]) for a in [*bad, "--plot /nonexistent/a.png"]])
    check_bad_inputs("flash_triton.py", [  # flags the interpreter cannot honour stop rather than go unheard
        ("--shapes 1x16x16384x64", "too large for the CPU interpreter"),
        ("--shapes 1x2x64x16,1x4x1024x64", "--shapes 1x4x1024x64 is too large"),
        ("--repeats 3", "nothing is timed"), ("--tiles dkdv", "--tiles times the kernels on a CUDA GPU"),
        ("--tiles dq --grid", "drop --grid"), ("--tiles sideways", "invalid choice"),
        ("--shapes 1x2x64x16 --repeats 2", "--repeats times the GPU benchmark")])
    for args in ["--plot flash.png", "--tiles dkdv", "--repeats 3", "--shapes 1x16x16384x64"]:  # GPU-only: one line
        code, out, err = call_main("flash_triton.py", *args.split())
        assert code == 2 and len(err.strip().splitlines()) == 1 and "usage" not in err, (args, code, err)
    x = torch.randn(1, 2, 8, 16)
    ft.FlashAttentionPlanned.apply(x, x, x, False, None, "ieee")  # a plan kept: a bad precision must still be refused
    for args, says in [((torch.randn(1, 2, 8, 48),) * 3, "head dim 48"), ((x, x.half(), x), "dtype"),
                       ((x, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), True), "causal"),
                       ((torch.randn(8, 16),) * 3, "(batch, seq, d)"), ((x, x, x, False, None, "fp8"), "precision"),
                       ((x.double(),) * 3, "dtype"), ((x, x[:, :1], x), "do not match")]:
        for fn in (ft.FlashAttention, ft.FlashAttentionPlanned):
            assert_raises(says, fn.apply, *args)

def test_flash_interpreter_reference_script_bad_input():
    # TRITON_INTERPRET=1 must be set before triton is imported: a fresh process (this one may have imported it)
    run("-c", "import test_all; test_all.flash_interpreted()", timeout=300, TRITON_INTERPRET="1")

def grid_rows(out):  # the --grid tables' rows, split: dtype, D, S, a ms per implementation, the ratios
    return [line.split() for line in out.splitlines() if re.match(r"(bf16|fp16|fp32) +\d+ +\d+ ", line)]

def flash_grid_interpreted():
    import flash_triton as ft
    out, err = main_ok("flash_triton.py", "--grid", "--seqs", "16,32", "--dims", "16", "--dtypes", "fp32")
    assert out.count("ours ms  pytorch ms  sdpa ms") == 3 and out.strip().splitlines()[-1].startswith("summary:"), out
    rows = grid_rows(out)  # a row per (S, pass), a time from every implementation
    assert [r[2] for r in rows] == ["16", "32"] * 3 and all(float(x) > 0 for r in rows for x in r[3:]), out
    def plain_oom_at_32(q, k, v, causal):  # plain PyTorch out of memory at S=32 alone: the grid must go on
        if q.shape[-2] == 32:
            raise torch.OutOfMemoryError("CUDA out of memory (mocked)")
        return ft.plain_attention(q, k, v, causal)
    with contextlib.redirect_stdout(io.StringIO()) as got:
        ft.grid([16, 32, 64], [16], ["fp32"], ["bwd", "fwd"], None, {**ft.GRID_IMPLS, "pytorch": plain_oom_at_32})
    rows = grid_rows(got.getvalue())  # fwd, then bwd: the passes in their order
    assert [(r[2], r[4]) for r in rows if r[4] == "OOM" or r[6] == "n/a"] == [("32", "OOM")] * 2, got.getvalue()
    assert all(float(r[3]) > 0 and float(r[5]) > 0 for r in rows), got.getvalue()  # ours and SDPA: every cell
    assert got.getvalue().strip().endswith("; OOM: pytorch fp32 D16 S32"), got.getvalue()  # the summary names it
    check_bad_inputs("flash_triton.py", [
        ("--grid --seqs 100", "sequence length 100 is not a power of two"), ("--grid --seqs 0", "power of two"),
        ("--grid --seqs 128,x", "'x' is not a whole number"), ("--grid --dims 48", "head dim 48 is not supported"),
        ("--grid --dims 64,-1", "not a whole number"), ("--grid --dtypes fp64", "'fp64' is not one of"),
        ("--grid --passes fwd,sideways", "'sideways' is not one of"), ("--seqs 128", "add --grid"),
        ("--grid --shapes 1x1x64x64", "--shapes"), ("--grid --plot /nonexistent/a.png", "--plot"),
        ("--grid --repeats 3", "the grid times each cell once")])

def test_flash_grid_interpreter_cells_oom_bad_input():
    run("-c", "import test_all; test_all.flash_grid_interpreted()", timeout=300, TRITON_INTERPRET="1")

@gpu
def test_flash_gpu_matches_reference(dtypes=(torch.float32, torch.float16, torch.bfloat16)):
    # full size, every dtype (or those asked for); D128 loads through TMA descriptors, the others by pointer
    tolerance = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
    flash_check("cuda", [((128,), dtype, tolerance[dtype]) for dtype in dtypes],
                [((2, 4, 1024, 64), (2, 4, 1024, 64), True), ((1, 3, 517, 32), (1, 3, 781, 32), False),
                 ((2, 1000, 128), (2, 1000, 128), True), ((1, 2, 300, 16), (1, 2, 300, 16), True),
                 ((2, 2, 3, 256, 64), (2, 2, 3, 256, 64), True)])

def test_flash_plan_key_follows_what_a_call_decides():
    """A plan's key: the same for inputs of one layout anywhere aligned; another for a pointer 2 bytes off 16-byte
    alignment, another dtype, stride, size, causal, scale or precision (fp32's None: torch's setting at the call);
    none for an input that is not a tensor, which the checks then refuse."""
    with unittest.mock.patch.dict(os.environ):  # on a CPU its import sets TRITON_INTERPRET=1: not for other tests
        import flash_triton as ft
    def key(t, causal=True, scale=None, precision=None):
        return ft._plan_key("q, k, v", (t, t, t), causal, scale, precision)
    a, b = torch.zeros(2, 64, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    odd = torch.zeros(2 * 64 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 64, 64)
    assert a.data_ptr() != b.data_ptr() and key(a) == key(b)
    different = [key(odd), key(a.half()), key(torch.zeros(2, 64, 128, dtype=torch.bfloat16)[..., :64]),
                 key(a[:1]), key(a, causal=False), key(a, scale=0.1), key(a, precision="fp8")]
    assert all(k != key(a) for k in different) and len(set(different)) == len(different)
    f = a.float()
    assert key(f)[-1] == ft.torch_fp32_precision() and key(a)[-1] == "tf32"  # the precision a call takes
    assert key(f, precision="ieee") != key(f, precision="tf32")
    assert ft._plan_key("q, k, v", (a, "k", a), True, None, None) is None

def flash_plans(ft, device):
    """A layout's second call goes through the plan its first made, the same answer bit for bit, no new plan; a q 2
    bytes off 16-byte alignment gets a plan of its own (on a GPU: Triton's kernel for that alignment), and so does
    the model's (B, S, 3C) path, reused likewise."""
    ft.PLANS.clear()
    gen = torch.Generator(device=device).manual_seed(6)
    q, k, v, do = (torch.randn(1, 2, 64, 16, generator=gen, device=device).half() for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    first = ft.flash_attention(*leaves, True)
    first_grads = torch.autograd.grad(first, leaves, do)
    plan = first.grad_fn.plan
    assert list(ft.PLANS.values()) == [plan] and len(plan.backwards) == 1, ft.PLANS
    again = ft.flash_attention(*leaves, True)
    assert again.grad_fn.plan is plan and len(ft.PLANS) == 1 and torch.equal(again, first)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(again, leaves, do), first_grads))
    (passes, one_pass, dq_launch, dkdv_launch), = plan.backwards.values()  # Triton's kernels at 64 tokens
    if device == "cuda":  # each kernel's compiled launcher kept on its plan
        assert all(launch.compiled is not None for launch in (plan.fwd, dq_launch, dkdv_launch))
    storage = torch.empty(q.numel() + 1, device=device, dtype=q.dtype)
    q_odd = storage[1:].view(q.shape).copy_(q)  # the same shape and strides, another alignment
    assert q_odd.data_ptr() % 16 != 0
    assert rel_err(ft.flash_attention(q_odd, k, v, True).float(), first.float()) < 1e-3 and len(ft.PLANS) == 2
    qkv = torch.randn(1, 64, 3 * 32, generator=gen, device=device).half().requires_grad_()
    y = ft.flash_attention_qkv(qkv, 2)
    y_again = ft.flash_attention_qkv(qkv, 2)
    assert len(ft.PLANS) == 3 and y_again.grad_fn.plan is y.grad_fn.plan and torch.equal(y, y_again)
    ft.PLANS.clear()

@gpu
def test_flash_plans_same_answer_new_alignment_new_plan():
    import flash_triton as ft
    flash_plans(ft, "cuda")

@gpu
def test_flash_gluon_passes_match_the_triton_kernels():
    """On a Hopper GPU with triton 3.6 the Gluon passes run where GLUON_PASSES says, and their outputs and gradients
    are the Triton kernels' to within 16-bit rounding: causal and not, ragged, Nq != Nk, D64 and D128, both 16-bit
    dtypes, the model's head-transposed layout. From ONE_PASS_FROM tokens on (at D128 lowered here, so that short
    sequences take it) the backward runs in one pass, its dQ tiles added in any order, unless
    torch.use_deterministic_algorithms is on; then the two Gluon passes, bitwise the same run twice."""
    import flash_triton as ft
    import triton
    assert ft.GLUON == triton.__version__.startswith("3.6."), (ft.GLUON, triton.__version__)
    hopper = ft.GLUON and torch.cuda.get_device_capability() == (9, 0)  # else: no Gluon pass anywhere
    every = ("fwd", "dq", "dkdv", "bwd")
    cases = [((2, 4, 1024, 64), (2, 4, 1024, 64), True, ()),  # up to SHORT_SEQ tokens: Triton's kernels
             ((1, 2, 2100, 64), (1, 2, 2100, 64), True, every),
             ((2, 3, 1517, 64), (2, 3, 1781, 64), False, every),  # a ragged last key tile
             ((1, 2, 2048, 64), (1, 2, 100, 64), False, every),  # fewer keys than a dQ key tile
             ((2, 3, 1517, 128), (2, 3, 1781, 128), False, every),  # D128's one pass: 128 keys a program
             ((1, 2, 1500, 128), (1, 2, 1500, 128), True, every),
             ((1, 2, 1200, 128), (1, 2, 1200, 128), True, every)]  # below ONE_PASS_FROM: the two passes

    class OnePassLaunches:  # counts the dK/dV kernel's launches with ONE_PASS on, and runs every launch
        def __init__(self, kernel):
            self.kernel, self.count = kernel, 0

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def counted(*args, **kwargs):
                self.count += int(kwargs["ONE_PASS"])
                return launch(*args, **kwargs)
            return counted
    one_pass = OnePassLaunches(ft._dkdv_gluon_kernel)
    ft._dkdv_gluon_kernel = one_pass
    one_pass_from = dict(ft.ONE_PASS_FROM)
    ft.ONE_PASS_FROM[128] = 1500

    def use_gluon(on):  # (plans hold the choice: made anew after it changes)
        ft.GLUON = on
        ft.PLANS.clear()
    try:
        for dtype in (torch.bfloat16, torch.float16):
            for shape_q, shape_k, causal, passes in cases:
                gen = torch.Generator(device="cuda").manual_seed(5)
                q, k, v, do = (torch.randn(s, generator=gen, device="cuda").to(dtype)
                               for s in (shape_q, shape_k, shape_k, shape_q))
                assert ft._gluon_passes(q, shape_q[2], q, k, v, do) == (passes if hopper else ())

                def run():
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    o = ft.flash_attention(*leaves, causal)
                    return (o.detach(), *torch.autograd.grad(o, leaves, do))
                results = {}  # path -> (O, dQ, dK, dV)
                for path in ("gluon", "deterministic", "triton"):
                    use_gluon(hopper and path != "triton")
                    torch.use_deterministic_algorithms(path == "deterministic", warn_only=True)
                    launches = one_pass.count
                    try:
                        results[path] = run()
                        if path == "deterministic":
                            again = run()
                            assert all(torch.equal(a, b) for a, b in zip(results[path], again)), "not deterministic"
                    finally:
                        torch.use_deterministic_algorithms(False)
                    long_enough = shape_q[2] >= ft.ONE_PASS_FROM[shape_q[3]]
                    expected = int(path == "gluon" and "bwd" in passes and hopper and long_enough)
                    assert one_pass.count - launches == expected, (path, shape_q, one_pass.count - launches)
                use_gluon(hopper)
                for path in ("gluon", "deterministic"):
                    errs = [rel_err(a.float(), b.float()) for a, b in zip(results[path], results["triton"])]
                    assert max(errs) < 1e-2, (path, dtype, shape_q, causal, errs)
        # the model's layout: q, k, v read from one (B, S, 3C) projection, their gradients written into one
        for D in (128, 64):  # (the one-pass backward at both)
            qkv = torch.randn(2, 1600, 3 * 4 * D, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(2, 1600, 4 * D, device="cuda", dtype=torch.bfloat16)
            results = {}  # gluon -> (y, the projection's gradient)
            for gluon in (True, False):
                use_gluon(gluon and hopper)
                leaf = qkv.clone().requires_grad_()
                y = ft.flash_attention_qkv(leaf, 4)
                results[gluon] = (y.detach(), *torch.autograd.grad(y, leaf, dy))
            use_gluon(hopper)
            assert all(rel_err(a.float(), b.float()) < 1e-2 for a, b in zip(results[True], results[False])), D
    finally:
        ft._dkdv_gluon_kernel = one_pass.kernel
        ft.ONE_PASS_FROM.update(one_pass_from)
        use_gluon(hopper)

@gpu
def test_flash_tile_search_times_candidates_today_first():
    """--tiles: today's tiles for the shape first (TUNED, or SHORT_TUNED up to SHORT_SEQ tokens), every candidate
    timed (or its failure a row), both tables left as they were."""
    import flash_triton as ft
    ft.TILE_CANDIDATES = {"dkdv": [(32, 64, 4, 2), (64, 64, 4, 2)], "fwd": [(64, 64, 4, 2), (128, 128, 8, 3)]}
    before = [{D: dict(t) for D, t in table.items()} for table in (ft.TUNED, ft.SHORT_TUNED)]
    assert ft.tuned_table(64, ft.SHORT_SEQ) is ft.SHORT_TUNED and ft.tuned_table(64, 2 * ft.SHORT_SEQ) is ft.TUNED
    for kernel, S in (("dkdv", 512), ("fwd", 2 * ft.SHORT_SEQ)):
        rows = ft.search_tiles(kernel, 1, 2, S, 64)
        today = ft.tuned_table(64, S)[64][kernel]
        assert rows[0][0] == today and len(rows) == 1 + sum(t != today for t in ft.TILE_CANDIDATES[kernel]), rows
        assert all(isinstance(ms, str) or ms > 0 for _, ms in rows), rows
        with contextlib.redirect_stdout(io.StringIO()) as out:
            ft.report_tiles(kernel, (1, 2, S, 64), rows)
        assert out.getvalue().strip().splitlines()[-1].startswith(f"summary: fastest {kernel} tiles at D64"), out
    assert [ft.TUNED, ft.SHORT_TUNED] == before

@gpu
def test_flash_model_path_agrees_with_cudnn_and_is_timed():
    """The model's call, c_attn's output to c_proj's input: ours (whole projection) = cuDNN after the split, output
    and gradient, in bf16; the called/graphed table has a row each and a ratio."""
    import flash_triton as ft
    qkv = torch.randn(2, 256, 3 * 4 * 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 256, 4 * 64, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for impl in ("ours", "sdpa cudnn"):
        y = ft.attention_as_the_model_calls_it(impl, qkv, 4)
        outs[impl] = (y, *torch.autograd.grad(y, qkv, dy))
    assert all(rel_err(a.float(), b.float()) < 2e-2 for a, b in zip(outs["ours"], outs["sdpa cudnn"]))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        ft.report_model_path((2, 4, 256, 64), ft.model_path(2, 4, 256, 64, repeats=2))
    rows = [line.split() for line in out.getvalue().splitlines() if line.startswith(("ours", "sdpa cudnn"))]
    assert len(rows) == 2 and rows[1][-2].startswith("1.00x"), out.getvalue()

@gpu
def test_flash_host_cost_table():
    """The host-time table: a row per implementation, cuDNN's ratio 1.00x; the row planned at every call computes
    what flash_attention does (it only empties the plans), and the empty Function's gradients are shaped like its
    inputs."""
    import flash_triton as ft
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert torch.equal(ft.ours_planned_every_call(q, k, v, True), ft.flash_attention(q, k, v, True))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(ft.NoKernels.apply(*leaves, True), leaves, torch.ones_like(q))
    assert [g.shape for g in grads] == [q.shape] * 3
    with contextlib.redirect_stdout(io.StringIO()) as out:
        times = ft.report_host(repeats=1, calls=20)
    assert list(times) == list(ft.HOST_IMPLS) and all(t[0] > 0 for t in times.values()), times
    rows = [line for line in out.getvalue().splitlines() if line.startswith(tuple(ft.HOST_IMPLS))]
    assert len(rows) == len(ft.HOST_IMPLS) and "1.00x" in rows[2], out.getvalue()

    def unsupported(q, k, v, causal):
        raise RuntimeError("no cuDNN attention on this GPU")
    saved = ft.HOST_IMPLS["sdpa cudnn"]
    ft.HOST_IMPLS["sdpa cudnn"] = unsupported
    try:  # a backend that fails is a row saying so; the others are still timed, with no ratio to fail against
        with contextlib.redirect_stdout(io.StringIO()) as out:
            times = ft.report_host(repeats=2, calls=20)
    finally:
        ft.HOST_IMPLS["sdpa cudnn"] = saved
    assert times["sdpa cudnn"] == "n/a (RuntimeError)" and len(times["ours"]) == 2, times
    assert not re.search(r"\d\.\d\dx", out.getvalue()), out.getvalue()  # no ratio printed

@gpu
def test_flash_grid_gpu_prints_every_cell():
    out, _ = main_ok("flash_triton.py", "--grid", "--seqs", "256,1024", "--dims", "64", "--dtypes", "bf16,fp32")
    rows = grid_rows(out)  # 2 dtypes x 2 seqs x 3 passes, every cell a time: nothing runs out of memory this small
    assert len(rows) == 12 and all(len(r) == 8 and float(x) > 0 for r in rows for x in r[3:]), out
    assert out.strip().splitlines()[-1].startswith("summary:") and "no OOM" in out, out

@gpu
def test_flash_torch_compile():
    """Every kernels' Function compiled whole (fullgraph: a graph break fails): the lesson's FlashAttention.apply,
    flash_attention (planned) and flash_attention_qkv, forward and backward against SDPA, and again at a second batch
    size, which recompiles with symbolic shapes; eager plans made before do not get in the way."""
    import flash_triton as ft
    for D in (64, 128):  # D128 loads through TMA descriptors (planned, eager)
        lesson = torch.compile(ft.FlashAttention.apply, fullgraph=True)
        planned = torch.compile(ft.flash_attention, fullgraph=True)
        whole = torch.compile(ft.flash_attention_qkv, fullgraph=True)
        for B in (2, 3):
            q, k, v = (torch.randn(B, 4, 512, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            ft.flash_attention(q, k, v, True)  # an eager plan for this layout
            o_ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            ref = (o_ref, *torch.autograd.grad(o_ref.float().square().sum(), (q, k, v)))
            for name, attention in (("lesson", lesson), ("planned", planned)):
                o = attention(q, k, v, True)
                ours = (o, *torch.autograd.grad(o.float().square().sum(), (q, k, v)))
                assert all(rel_err(a.float(), b.float()) < 2e-2 for a, b in zip(ours, ref)), (name, B, D)
            # the model's path compiled: the three gradients written into c_attn's one (B, S, 3C) gradient
            qkv = torch.randn(B, 512, 3 * 4 * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            ours, ref = [(y, *torch.autograd.grad(y.float().square().sum(), qkv)) for y in (
                whole(qkv, 4), ft.attention_as_the_model_calls_it("sdpa cudnn", qkv, 4))]
            assert all(rel_err(a.float(), b.float()) < 2e-2 for a, b in zip(ours, ref)), ("qkv", B, D)

@gpu
def test_flash_train_matches_sdpa():
    def losses(attn):
        out = run("train.py", "--model", "tiny", "--steps", "8", "--batch", "4", "--seq", "128", "--bf16", "--device",
                  "cuda", "--attn", attn).stdout
        return [float(m[1]) for m in re.finditer(r"^step(?!.*val).*?\bloss[ :=]+([0-9.]+)", out, re.M)]
    with ThreadPoolExecutor(2) as pool:  # both processes at once
        ref, ours = pool.map(losses, ["sdpa", "triton"])
    assert ref and len(ours) == len(ref) and all(abs(a - b) < 0.05 * abs(b) + 0.02 for a, b in zip(ours, ref)), \
        (ours, ref)

# --- 9. the repository: each script copied with gpt.py alone runs; code style (ruff checks the rest in CI)

DATA = ("input.txt", "gpt2_bpe")  # the training text and the tokenizer's files, for the scripts that read them
COPIES = {  # script: (what it needs beside gpt.py, its smallest CPU command here)
    "bench_e2e.py": ((), "--device cpu --batch 1 --seq 16 --mode forward --rounds 1"),
    "bench_attention.py": ((), "--impl naive,triton --d 16 --seq 32 --rounds 2 --steps 1 --dtype fp32"),
    "precision.py": (DATA, "--device cpu --only formats,accumulate"),
    "ddp.py": ((), "allreduce --backend gloo --worlds 2 --sizes 0.001 --warmup 1 --iters 3"),
    "memory.py": ((), "parallel"),
    "leaderboard.py": ((), "--device cpu --steps 1"),
}


def copied(names):  # a new empty folder holding copies of these files and folders of the repository
    folder = tempfile.mkdtemp()
    for name in names:
        if os.path.isdir(os.path.join(HERE, name)):
            shutil.copytree(os.path.join(HERE, name), os.path.join(folder, name))
        else:
            shutil.copy(os.path.join(HERE, name), folder)
    return folder


def run_copied(names, *commands, **extra_env):
    """Each command (a string of arguments, or (arguments, the exit status it must have)) run with `python` in one
    folder holding copies of names alone: [its stdout and stderr]. The folder is deleted after."""
    folder = copied(names)
    try:
        outputs = []
        for command in commands:
            args, code = command, 0
            if isinstance(command, tuple):
                args, code = command
            p = run(*shlex.split(args), cwd=folder, code=code, timeout=300, **extra_env)
            outputs.append(p.stdout + p.stderr)
        return outputs
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def copy_runs(script):  # COPIES' script copied with gpt.py: its --help, then its command, each exit 0
    needs, command = COPIES[script]
    help_text, out = run_copied([script, "gpt.py", *needs], f"{script} --help", f"{script} {command}")
    assert help_text.startswith("usage:") and out.strip(), (script, help_text[:300], out[-1000:])


def test_each_script_copied_with_gpt_alone_runs():
    """The README's promise, in empty folders: train.py and gpt.py with input.txt and gpt2_bpe/ train, without
    flash_triton.py, and --attn triton stops with one sentence; flash_triton.py alone checks its kernels (the
    interpreter turned on by itself, no GPU); every other script with gpt.py (and the data it reads) runs its --help
    and its smallest CPU command. The GPU's fallback to SDPA, said once, is checked here with flash_triton made
    unimportable (default_attention reads only the device's type)."""
    train, interpret = "train.py --steps 3 --eval-every 3", {}
    if HAS_CUDA:  # in bf16 the default attention is flash_triton.py's: here its fallback, said in one line
        train += " --bf16 --model tiny --batch 8 --seq 64"
        interpret = {"TRITON_INTERPRET": "1"}  # the checks, not the GPU benchmark (without CUDA: set by the file)
    jobs = [functools.partial(run_copied, ["train.py", "gpt.py", *DATA], train, ("train.py --attn triton", 2)),
            functools.partial(run_copied, ["flash_triton.py"], "flash_triton.py --shapes 1x2x64x16", **interpret)]
    jobs += [functools.partial(copy_runs, script) for script in COPIES]
    with ThreadPoolExecutor(2) as pool:  # two processes at once: the imports of torch wait on the disk
        futures = [pool.submit(job) for job in jobs]
        results = [future.result() for future in futures]
    (trained, refused), (checked,) = results[:2]
    assert "attention sdpa" in trained and "summary: median step" in trained, trained[-2000:]
    fallback = "flash_triton.py not found next to gpt.py: attention sdpa\n"
    assert trained.count(fallback) == HAS_CUDA, trained[-2000:]
    lines = refused.strip().splitlines()
    assert lines == ["error: --attn triton runs flash_triton.py's kernels, and there is no flash_triton.py next to "
                     "gpt.py: copy it there, or choose another --attn"], refused
    assert checked.strip().endswith(": ok") and "TRITON_INTERPRET=1" in checked, checked
    said = io.StringIO()
    hidden = unittest.mock.patch.dict(sys.modules, {"flash_triton": None})  # importing it raises, as in a copy
    with hidden, unittest.mock.patch.object(gpt, "SAID", set()), contextlib.redirect_stdout(said):
        picked = [gpt.default_attention("cuda", torch.bfloat16, 64) for _ in range(2)]
        assert_raises("no flash_triton.py next to gpt.py", gpt.make_config, "tiny", attn="triton")
        assert ba.make_impls(["triton"], torch.device("cuda")) == {"triton": "needs flash_triton.py"}
        headline = bench_e2e.headline_settings(gpu=True)  # train.py's headline: our attention
        assert bench_e2e.skip_reason({}, headline, torch.device("cuda")) == "skipped: needs flash_triton.py"
    assert picked == ["sdpa", "sdpa"], picked
    assert said.getvalue() == fallback, said.getvalue()

FOLDING = [  # patterns that make a reader unpick a line; each has a plainer spelling
    (r"__import__\(", "__import__: import at the top, or inside the function"),
    (r"#\s*noqa", "noqa: fix what the linter says instead of silencing it"),
    (r"' \* args\.|\" \* args\.|\} \* \(", "a string times a bool: an if statement reads better"),
    (r"^\s*\w+ = lambda\b", "a named lambda: a def has a name in tracebacks"),
    (r"\(\w+ := ", "a walrus inside an expression: an assignment on its own line reads better"),
]


def tracked_python_files():
    try:  # the tracked scripts; outside a git checkout, the folder's
        names = subprocess.run(["git", "ls-files", "*.py"], cwd=HERE, capture_output=True, text=True).stdout.split()
    except FileNotFoundError:
        names = []
    return names or sorted(n for n in os.listdir(HERE) if n.endswith(".py"))


def test_code_style_no_folding_no_long_lines():
    """No line over 120 characters and none of the folding patterns above, in every tracked script. This file
    builds the patterns from escaped strings, so it does not match itself."""
    bad = []
    for name in tracked_python_files():
        lines = open(os.path.join(HERE, name), encoding="utf-8").read().splitlines()
        for number, line in enumerate(lines, 1):
            if len(line) > 120:
                bad.append(f"{name}:{number}: {len(line)} characters")
            for pattern, why in FOLDING:
                if re.search(pattern, line):
                    bad.append(f"{name}:{number}: {why}")
    assert not bad, "\n".join(bad[:40])


def test_runner_into_a_closed_pipe_ends_quietly():
    """`python test_all.py --help | head`: the reader has left before the list is written; exit 141 and no
    BrokenPipeError on stderr (Python's flush at exit would print one, as an exception ignored)."""
    proc = subprocess.Popen([sys.executable, "test_all.py", "--help"], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, (proc.returncode, err)


def test_isolated_test_that_cannot_run_is_skipped_not_failed():
    """A CUDA test runs in its own process; one that cannot run there (two GPUs on a one-GPU machine, or none)
    exits SKIPPED_EXIT with its reason, and the runner counts it as skipped, not failed."""
    if torch.cuda.device_count() >= 2:
        skip("this machine has two GPUs: the two-GPU test would run")
    name, code, _, output = run_isolated("test_train_gpu_two_ranks_average_as_one_process", env())
    assert code == SKIPPED_EXIT and output.strip().splitlines()[-1] == "needs 2 GPUs", (code, output)


def test_signal_test_skipped_with_its_reason_where_sigint_is_ignored():
    """Started with SIGINT ignored (a background job of a script, here `trap '' INT`), the signal test says why it
    cannot run in one line and counts as skipped, at once, instead of waiting for scripts that ignore Ctrl-C."""
    name = "test_every_script_stops_cleanly_on_signals"
    p = subprocess.run(["sh", "-c", 'trap "" INT; exec "$0" test_all.py "$1"', sys.executable, name], cwd=HERE,
                       env=env(), capture_output=True, text=True, timeout=300)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and lines[-1] == "0 passed, 0 failed", p.stdout + p.stderr
    assert "1 test(s) skipped" in lines[-2], lines
    assert f"SKIP {name}: SIGINT is ignored where the tests run" in p.stdout and "Traceback" not in p.stdout, p.stdout


# --- 10. leaderboard.py: the course's model written out, the memory model, one and two ranks, bad input

def course_forward(state, idx, heads, theta=10000.0, eps=1e-5):
    """The course's BasicsTransformerLM written out plainly from its definition, on a state dict: RMSNorm in fp32,
    RoPE over interleaved pairs written back as two halves, softmax attention under a causal mask, SwiGLU."""
    def rmsnorm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def linear(x, w):
        return x @ w.t()

    def rope(x):  # (B, H, T, D)
        T, D = x.shape[-2:]
        freqs = theta ** -(torch.arange(0, D, 2, dtype=torch.float64) / D)
        angle = (torch.arange(T, dtype=torch.float64)[:, None] * freqs).to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((angle.cos() * x1 - angle.sin() * x2, angle.sin() * x1 + angle.cos() * x2), dim=-1)

    def attention(q, k, v):
        T = q.shape[-2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), scores, float("-inf"))
        weights = torch.exp(scores - scores.max(-1, keepdim=True).values)
        return (weights / weights.sum(-1, keepdim=True)) @ v

    x = state["token_embeddings.weight"][idx]
    B, T, C = x.shape
    layers = len({k.split(".")[1] for k in state if k.startswith("layers.")})
    for i in range(layers):
        p = {k.removeprefix(f"layers.{i}."): v for k, v in state.items() if k.startswith(f"layers.{i}.")}
        h = rmsnorm(x, p["ln1.weight"])
        q, k, v = (linear(h, p[f"attn.{n}_proj.weight"]).view(B, T, heads, C // heads).transpose(1, 2)
                   for n in "qkv")
        y = attention(rope(q), rope(k), v).transpose(1, 2).reshape(B, T, C)
        x = x + linear(y, p["attn.output_proj.weight"])
        h = rmsnorm(x, p["ln2.weight"])
        gate = linear(h, p["ffn.w1.weight"])
        x = x + linear(gate * torch.sigmoid(gate) * linear(h, p["ffn.w3.weight"]), p["ffn.w2.weight"])
    return linear(rmsnorm(x, state["ln_final.weight"]), state["lm_head.weight"])

def test_leaderboard_model_matches_the_course_and_learns():
    """The same weights (norm gains perturbed from 1) give the course's logits to fp32 rounding, and the loss of
    leaderboard.py's step (gpt.train_step: fused loss, AdamW) on the course's random batch falls, with or without
    recompute, by the same values."""
    s = lb.Sizes(layers=2, d_model=32, d_ff=88, heads=4, vocab=96, seq=24, batch=2)
    torch.manual_seed(0)
    model = lb.TransformerLM(s, gpt.ATTENTION["sdpa"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name.startswith("ln_final"):
                p.uniform_(0.5, 1.5)
    idx = torch.randint(s.vocab, (2, s.seq))
    with torch.no_grad():
        got = model(idx)[0]
        want = course_forward({k: v.double() for k, v in model.state_dict().items()}, idx, s.heads)
    assert got.shape == (2, s.seq, s.vocab) and rel_err(got.double(), want) < 1e-5, rel_err(got.double(), want)
    runs = []
    for recompute in (0, 1):
        model, optimizer, dtype = lb.build(s, "sdpa", recompute, keep_attention=False, fused_loss=True,
                                           compile_blocks=False, world=1, bf16=False, device="cpu", seed=0, lr=3e-3)
        x, y = lb.course_batch(s, 0, 1, "cpu", 0)
        runs.append([gpt.train_step(model, optimizer, x, y, dtype).item() for _ in range(6)])
    losses = runs[0]
    assert losses == runs[1] and losses[-1] < losses[0] - 0.1 and abs(losses[0] - math.log(s.vocab)) < 1, runs

def test_leaderboard_memory_model_counts_what_a_block_saves():
    """saved_by_block = the bytes autograd saves in one block, fp32 and bf16 (FSDP's bf16 weights), on the CPU; at
    the leaderboard's size on two 139.8 GiB GPUs the prediction refuses no recompute and takes --recompute 1."""
    s = lb.Sizes(layers=1, d_model=64, d_ff=172, heads=4, vocab=128, seq=48, batch=3)
    for dtype, width in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = lb.TransformerLM(s, gpt.ATTENTION["sdpa"]).to(dtype)
        x = torch.randn(s.batch, s.seq, s.d_model, dtype=dtype, requires_grad=True)
        block, cos, sin = model.layers[0], model.cos, model.sin
        got = gpt.saved_tensor_bytes(lambda: block(x, cos, sin), exclude=[*model.parameters(), *model.buffers()])
        assert got == lb.saved_by_block(s, s.batch * s.seq, width, width), (dtype, got)
    verdicts = []
    for extra in ([], ["--recompute", 1]):
        out, _ = main_ok("leaderboard.py", "--predict", "--preset", "leaderboard", "--world", 2, "--gpu-gib", 139.8,
                         *extra)
        assert "8,125,698,048 parameters" in out and "predicted peak" in out, out
        verdicts.append(out.strip().splitlines()[-1].split(": ")[-1])
    assert verdicts == ["does not fit", "fits"], verdicts

class CountOps(TorchDispatchMode):
    """How many times each of `ops` runs while the mode is on."""

    def __init__(self, ops):
        super().__init__()
        self.ops, self.count = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.ops
        return func(*args, **(kwargs or {}))


def test_leaderboard_kept_attention_is_not_run_again_and_changes_nothing():
    """--keep-attention: a recomputed block's backward runs no attention forward (without it, one per block), its
    gradients are bit for bit those of plain recomputation, and the memory model counts the kept output and
    log-sum-exp of every recomputed block."""
    s = lb.Sizes(layers=3, d_model=64, d_ff=172, heads=4, vocab=512, seq=64, batch=2)
    x, y = lb.course_batch(s, 0, 1, "cpu", 0)
    grads, runs = [], []
    for keep in (False, True):
        torch.manual_seed(0)
        model = lb.TransformerLM(s, gpt.ATTENTION["sdpa"], recompute=1, keep_attention=keep)
        _, loss = model(x, y)
        with CountOps(lb.SDPA_OPS) as counted:
            loss.backward()
        grads.append([p.grad for p in model.parameters()])
        runs.append(counted.count)
    assert runs == [s.layers, 0], runs
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    plain, kept = lb.predict(s, 1, False, 1)[0], lb.predict(s, 1, False, 1, keep_attention=True)[0]
    tokens = s.batch * s.seq
    assert kept["activations: attention's outputs kept (--keep-attention)"] == s.layers * (
        4 * tokens * s.d_model + 4 * s.heads * tokens)
    assert plain["activations: attention's outputs kept (--keep-attention)"] == 0

def test_leaderboard_plain_loss_agrees_and_keeps_what_the_model_counts():
    """--no-fused-loss (the logits made whole, fp32 cross-entropy): the same loss and gradients as the fused output
    layer and loss; autograd keeps the (N, vocab) fp32 log-probabilities, as predict counts beside the final norm's
    bytes, where the fused loss keeps none of the vocabulary's width but its dW."""
    s = lb.Sizes(layers=1, d_model=64, d_ff=172, heads=4, vocab=1000, seq=48, batch=2)
    x, y = lb.course_batch(s, 0, 1, "cpu", 0)
    losses, grads = [], []
    for fused in (True, False):
        torch.manual_seed(0)
        model = lb.TransformerLM(s, gpt.ATTENTION["sdpa"], fused_loss=fused)
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in model.parameters()])
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for plain, fused in zip(grads[1], grads[0]):
        torch.testing.assert_close(plain, fused, rtol=1e-4, atol=1e-6)
    tokens = s.batch * s.seq
    head = torch.randn(tokens, s.d_model, requires_grad=True)  # the final norm's output, as the loss reads it
    kept = gpt.saved_tensor_bytes(lambda: torch.nn.functional.cross_entropy((head @ model.lm_head.weight.t()).float(),
                                                                            y.flatten()),
                                  exclude=[model.lm_head.weight, y])
    # the log-probabilities, the matmul's input, and nll_loss's fp32 total weight (a scalar)
    assert kept == 4 * tokens * s.vocab + 4 * tokens * s.d_model + 4, kept
    rows = lb.predict(s, 1, False, 0, fused_loss=False)[0]
    norm = 4 * tokens * s.d_model  # what the final norm itself keeps (fp32)
    assert rows["activations: final norm, the loss's fp32 log-probabilities"] == norm + kept - 4
    assert "activations: final norm, loss's dx and dW" in lb.predict(s, 1, False, 0)[0]

def test_leaderboard_runs_on_one_and_two_cpu_ranks_alike():
    """python leaderboard.py at tiny size prints the memory table, the timer's table and ms per step; two gloo
    ranks under torchrun (FSDP2 per block, half the batch each), with or without --keep-attention, lose what one
    process loses, rank 0 speaking."""
    outs = []
    two_ranks = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for launch, extra in (([], []), (two_ranks, []), (two_ranks, ["--keep-attention"])):
        p = run(*launch, "leaderboard.py", "--device", "cpu", "--recompute", 1, "--steps", 3, *extra, timeout=300)
        outs.append(p.stdout)
    for out in outs:
        assert out.count("memory per rank, MiB") == 1 and out.count("gpt.time_rounds") == 2, out
        assert out.strip().splitlines()[-1].startswith("summary: ") and "ms per step" in out, out
    one, *sharded = ([float(v) for v in out.split("(mean over ranks): ")[1].splitlines()[0].split()] for out in outs)
    assert len(one) == 4 and one[-1] < one[0], one
    for two in sharded:  # FSDP2 over two ranks, blocks recomputed whole, then keeping attention's output
        torch.testing.assert_close(two, one, atol=2e-4, rtol=0)
    assert "FSDP2 over 2 ranks" in outs[1] and "2 process(es)" in outs[1], outs[1]
    assert "--recompute 1 --keep-attention" in outs[2], outs[2]

@gpu
def test_leaderboard_gpu_recomputed_sharded_blocks_learn():
    """On the GPU in bf16 with every block recomputed, sharded over two GPUs where there are two (FSDP2 must hand a
    recomputed block the inputs it saw in forward, rotary tables included), then keeping attention's output: do_bench
    times the steps, the loss falls, and the table gives the peak per GPU beside the prediction."""
    launch = []
    if torch.cuda.device_count() >= 2:
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    runs = []
    for extra in ([], ["--keep-attention"]):
        out = run(*launch, "leaderboard.py", "--layers", 2, "--d-model", 256, "--heads", 2, "--d-ff", 688, "--vocab",
                  1024, "--seq", 256, "--batch", 2, "--recompute", 1, "--warmup-ms", 1, "--rep-ms", 50, *extra,
                  timeout=600).stdout
        assert "bf16, attention sdpa" in out and "do_bench" in out, out
        losses = [float(v) for v in out.split("(mean over ranks): ")[1].splitlines()[0].split()]
        assert len(losses) >= 3 and losses[-1] < losses[0], losses
        summary = out.strip().splitlines()[-1]
        assert summary.startswith("summary: ") and " MiB allocated, predicted " in summary, summary
        runs.append(losses)
    assert runs[0][0] == runs[1][0], runs  # the same first forward: kept attention changes no number

def test_leaderboard_bad_input():
    """Each mistake exits 2 with one sentence, before any work; a step predicted not to fit is refused."""
    check_bad_inputs("leaderboard.py", [
        ("--device cpu --heads 5", "--d-model 64 is not divisible by --heads 5"),
        ("--device cpu --d-model 12 --heads 4", "head dim 3 (d_model / heads) is odd"),
        ("--device cpu --layers 0", "argument --layers: must be at least 1"),
        ("--device cpu --seq -4", "argument --seq: must be at least 1"),
        ("--device cpu --recompute 3", "--recompute 3 must be between 0 and the 2 layers"),
        ("--device cpu --batch 3 --world 2 --predict", "--batch 3 does not split over 2 ranks"),
        ("--device cpu --world 2", "--world is for --predict"),
        ("--device cpu --attn triton", "--attn triton needs a CUDA GPU"),
        ("--device cpu --bf16 --fp32", "not allowed with argument"),
        ("--device tpu", "--device 'tpu' is not a device"),
        ("--preset leaderboard --device cpu --gpu-gib 139.8", "GiB > 139.80 GiB per GPU; add --recompute 1 or more"),
        ("--device cpu --keep-attention", "add --recompute K"),
        ("--device cpu --recompute 1 --keep-attention --attn naive", "use --attn sdpa, flash, cudnn, efficient"),
        ("--device cpu --recompute 1 --keep-attention --compile", "drop --compile"),
    ])
    code, out, err = call_main("leaderboard.py", "--preset", "leaderboard", "--device", "cpu", "--gpu-gib", 139.8)
    predicted = out.strip().splitlines()[-1].split(" of ")[0]  # the table's last line: "predicted X GiB of ..."
    assert err.strip().splitlines() == [f"error: does not fit: {predicted} > "
                                        "139.80 GiB per GPU; add --recompute 1 or more ranks"], (out, err)
    assert "Traceback" not in err and code == 2


def run_isolated(name, environment):
    """A CUDA test in its own process: a crash, memory cap or poisoned CUDA context stays there; several run at once.
    Its environment is taken before the tests start: a test here may patch os.environ (torchrun's RANK, say) while
    another's process starts."""
    start = time.time()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--isolated", name], cwd=HERE, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment)
    return name, proc.returncode, time.time() - start, proc.stdout

SKIPPED_EXIT = 3  # an isolated test that raised Skipped exits with this: neither passed nor failed

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    tests = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
    cuda = {n for n, f in tests if getattr(f, "needs_cuda", False)}
    if argv[:1] == ["--isolated"]:  # run_isolated's child: one test; exit 1 and its traceback if it failed,
        # SKIPPED_EXIT and the reason if it cannot run here
        try:
            dict(tests)[argv[1]]()
        except Skipped as e:
            print(e)  # the reason, for the runner's SKIP line
            sys.exit(SKIPPED_EXIT)
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        return
    if "-h" in argv or "--help" in argv:
        print("usage: python test_all.py [--gpu-only] [SUBSTRING ...]\n\nRuns every test whose name contains "
              "one of the substrings (all tests without any); --gpu-only keeps the CUDA ones. Tests:")
        print("\n".join(f"  {n}{'  (CUDA)' if n in cuda else ''}" for n, _ in tests), flush=True)  # a closed pipe
        return  # raises here, inside main(), not in Python's flush at exit
    gpu_only, only = "--gpu-only" in argv, [a for a in argv if a != "--gpu-only"]
    tests = [(n, f) for n, f in tests if (not only or any(s in n for s in only)) and (not gpu_only or n in cuda)]
    unknown = [a for a in only if a.startswith("-")]
    if unknown:
        print(f"error: unknown option {unknown[0]}; see python test_all.py --help", file=sys.stderr)
        sys.exit(2)
    if not tests:
        print(f"error: no test matches {' '.join(only) or '--gpu-only'}; python test_all.py --help lists them",
              file=sys.stderr)
        sys.exit(2)
    passed = failed = skipped = cannot_run = 0
    start_all, on_gpu = time.time(), [n for n, _ in tests if n in cuda] if HAS_CUDA else []
    if on_gpu:  # four processes at once: each with every core's worth of spinning threads would take turns for minutes
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 4) // 4))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    pool = ThreadPoolExecutor(3)  # the CUDA tests, three at a time, while the others run here
    isolated = [pool.submit(run_isolated, name, env()) for name in on_gpu]  # env now: before any test patches it
    for name, test in tests:
        if name in cuda:
            skipped += not HAS_CUDA
            continue
        start = time.time()
        output = io.StringIO()  # what the test's code prints (progress lines): shown only if the test fails
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                test()
            passed += 1
            print(f"PASS {name} ({time.time() - start:.1f}s)", flush=True)
        except Skipped as e:  # cannot run here: neither passed nor failed
            cannot_run += 1
            print(f"SKIP {name}: {e}", flush=True)
        except Exception:
            failed += 1
            printed = output.getvalue()[-3000:]
            print(f"FAIL {name} ({time.time() - start:.1f}s)\n{printed}{traceback.format_exc()}", flush=True)
    for done in as_completed(isolated):
        name, code, seconds, output = done.result()
        if code == SKIPPED_EXIT:
            cannot_run += 1
            print(f"SKIP {name}: {output.strip().splitlines()[-1]} (own process)", flush=True)
            continue
        ok = code == 0
        passed, failed = passed + ok, failed + (not ok)
        report = "" if ok else "\n" + output[-6000:]
        print(f"{'PASS' if ok else 'FAIL'} {name} ({seconds:.1f}s, own process){report}", flush=True)
    skips = f"; {skipped} CUDA tests skipped" if skipped else ""
    if cannot_run:
        skips += f"; {cannot_run} test(s) skipped that cannot run here (SKIP above)"
    print(f"({time.time() - start_all:.0f} s{skips})\n{passed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)

if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # `python test_all.py --help | head`: the reader left; end quietly, as the scripts do
        gpt.reader_left()
