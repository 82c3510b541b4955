"""The one test command: `python test_all.py` (or `pytest test_all.py`).

CPU smoke and correctness tests run everywhere; tests marked with @gpu run only when CUDA is
present. Tests assert behaviour (agreement with a reference, a loss that goes down, a clear error
on bad input), never timings. The last line printed is `N passed, N failed`.
"""

import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
HAS_CUDA = torch.cuda.is_available()


def gpu(test):
    """Mark a test as needing CUDA: skipped (and reported as such) on a CPU machine."""
    test.needs_cuda = True
    if not HAS_CUDA and "pytest" in sys.modules:
        import pytest

        return pytest.mark.skip(reason="needs CUDA")(test)
    return test


def run(script, *args, env=None, timeout=600, check=True):
    """Run `python script args...` in a fresh process from the repo root; return the
    CompletedProcess. With check=True a non-zero exit fails the test and shows the output. Use it
    where a fresh process matters (torchrun, signals, TRITON_INTERPRET); otherwise call_main."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), *map(str, args)], cwd=HERE,
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(map(str, args))} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def call_main(script, *args):
    """Run script.main([args]) in this process: (exit status, stdout, stderr). No interpreter
    start-up and no second torch import, so a bad-input case costs milliseconds, not seconds."""
    import contextlib
    import importlib
    import io

    module = importlib.import_module(script.removesuffix(".py"))
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            module.main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return code, out.getvalue(), err.getvalue()


def check_bad_inputs(cases):
    """Each (script, args, words) case must exit 2 with one line on stderr containing `words`
    (case-insensitive), no traceback, and nothing on stdout but a device line. Every case runs;
    the failures are reported together."""
    failures = []
    for script, args, says in cases:
        try:
            code, out, err = call_main(script, *args)
        except Exception as e:  # a traceback the user would have seen
            failures.append(f"{script} {args}: raised {type(e).__name__}: {e}")
            continue
        lines = [line for line in err.strip().splitlines() if line.strip()]
        if code != 2 or not lines or says.lower() not in lines[-1].lower():
            failures.append(f"{script} {args}: exit {code}, stderr {err.strip()[-300:]!r}, expected '{says}'")
    assert not failures, "\n".join(failures)


def assert_bad_input(script, *args, says):
    check_bad_inputs([(script, args, says)])


# --- 1. gpt.py: presets, tokenizer, padding, attention, fused loss, FP8, the timer

import math  # noqa: E402

import gpt  # noqa: E402


def expected_params(c):
    """Parameter count implied by a config: blocks, tied embedding (once), positions, final LN."""
    d, f = c.n_embd, c.d_ff
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * f + f) + (f * d + d)
    return c.n_layer * block + c.vocab_size * d + c.block_size * d + 2 * d


def test_presets_param_counts():
    for name in gpt.PRESETS:
        for vocab in (50257, 50304):
            config = gpt.make_config(name, vocab_size=vocab)
            with torch.device("meta"):
                n = gpt.GPT(config).num_params()
            assert n == expected_params(config), (name, vocab, n)
    with torch.device("meta"):
        assert gpt.GPT(gpt.make_config("gpt2")).num_params() == 124_439_808  # GPT-2 124M, as published
    code, out, _ = call_main("gpt.py", "--model", "gpt2", "--vocab", 50304)
    assert code == 0 and "124,475,904" in out and "38,633,472" in out, out


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    config = gpt.make_config("tiny", vocab_size=50304)
    model = gpt.GPT(config)
    idx, targets = torch.randint(0, gpt.GPT2_VOCAB, (2, 2, 16))
    logits, loss = model(idx, targets)  # training: fused loss, no logits at all
    assert logits is None and loss.requires_grad
    assert abs(loss.item() - math.log(gpt.GPT2_VOCAB)) < 0.5  # near-uniform predictions at init
    with torch.no_grad():  # evaluation keeps the logits path
        logits, val = model(idx, targets)
    assert logits.shape == (2, 16, 50304) and abs(val.item() - loss.item()) < 1e-2
    model.config.fused_ce = False
    logits, loss = model(idx, targets)
    # with targets the loss carries the graph and the logits come back detached (see GPT.forward)
    assert loss.requires_grad and not logits.requires_grad and model(idx)[1] is None
    for name, p in model.named_parameters():  # residual projections get the scaled init
        if name.endswith("c_proj.weight"):
            assert abs(p.std().item() - 0.02 / math.sqrt(2 * config.n_layer)) < 0.003, name


def test_tokenizer_offline_count_and_round_trip():
    enc = gpt.gpt2_tokenizer()
    with open(os.path.join(HERE, "input.txt"), encoding="utf-8") as f:
        text = f.read()
    ids = enc.encode_ordinary(text)
    assert len(ids) == 338_025 and max(ids) < gpt.GPT2_VOCAB
    assert enc.decode(ids) == text
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert len(gpt.load_tokens()) == 338_025


def test_vocab_padding_never_sampled():
    assert gpt.round_up(50257, 128) == 50304 and gpt.round_up(50304, 128) == 50304
    assert gpt.round_up(50257, 64) == 50304 and gpt.round_up(50257, 8) == 50264
    torch.manual_seed(0)
    model = gpt.GPT(gpt.make_config("tiny", vocab_size=50304))
    with torch.no_grad():
        model.wte.weight[gpt.GPT2_VOCAB:] = 10 * model.wte.weight.abs().max()  # padded ids score highest
    out = model.generate(torch.zeros(2, 1, dtype=torch.long), 20)
    assert out.shape == (2, 21) and out.max().item() < gpt.GPT2_VOCAB


def test_fused_cross_entropy_matches_reference():
    """LinearCrossEntropy over chunks (one ragged) equals F.cross_entropy on the real vocabulary,
    loss and both gradients, fp32 to rounding; padded ids get no probability and no gradient;
    bf16 autocast agrees to bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    N, d, V = 300, 32, 50304
    x = torch.randn(N, d, generator=gen, requires_grad=True)
    w = (torch.randn(V, d, generator=gen) * 0.1).requires_grad_()
    y = torch.randint(0, gpt.GPT2_VOCAB, (N,), generator=gen)
    grads = {}
    for name in ("fused", "reference", "bf16"):
        x.grad = w.grad = None
        with gpt.autocast("cpu", torch.bfloat16 if name == "bf16" else None):
            if name == "reference":
                loss = torch.nn.functional.cross_entropy((x @ w.t())[:, :gpt.GPT2_VOCAB].float(), y)
            else:
                loss = gpt.linear_cross_entropy(x, w, y, chunk_rows=128)
        (3 * loss).backward()  # a non-unit upstream gradient
        grads[name] = (loss.detach(), x.grad, w.grad)
    for name, tol in (("fused", 1e-5), ("bf16", 2e-2)):
        for got, ref in zip(grads[name], grads["reference"]):
            err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
            assert err < tol, (name, err)
    assert grads["fused"][2][gpt.GPT2_VOCAB:].abs().max() == 0


def test_cross_entropy_kernel_matches_torch():
    """The Triton kernel (CUDA path; here under TRITON_INTERPRET=1) gives the PyTorch path's
    per-row losses and gradient, padded columns included, on a chunk of rows."""
    code = r"""
import torch, gpt
gen = torch.Generator().manual_seed(0)
logits = 4 * torch.randn(5, 50304, generator=gen)
y = torch.randint(0, gpt.GPT2_VOCAB, (5,), generator=gen)
a, b, loss_b = logits.clone(), logits.clone(), torch.empty(5)
loss_a = gpt.chunk_loss_and_grad(a, y, gpt.GPT2_VOCAB, 0.1)
gpt._cross_entropy_rows[(5,)](b, y, loss_b, b.stride(0), gpt.GPT2_VOCAB, 50304, 0.1, BLOCK=4096)
assert (loss_a - loss_b).abs().max() < 1e-5 and (a - b).abs().max() < 1e-8 and b[:, gpt.GPT2_VOCAB:].abs().max() == 0
print("kernel ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert "kernel ok" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def attention_matches_naive(impl, device, dtype, tol):
    """Logits and gradients of a tiny GPT with attention `impl` agree with naive attention.
    Returns False if the implementation cannot run here (e.g. a CUDA-only SDPA backend)."""
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
            if name != "naive" and "kernel" in str(e).lower():
                return False
            raise
        results[name] = [logits.float()] + [p.grad.float() for p in model.parameters()]
    for ref, got in zip(results["naive"], results[impl]):
        err = (ref - got).norm() / ref.norm()
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
    for kwargs, says in [({"vocab_size": 50000}, "below"), ({"attn": "nope"}, "unknown attention")]:
        try:
            gpt.make_config("tiny", **kwargs)
            raise AssertionError(f"{kwargs} accepted")
        except ValueError as e:
            assert says in str(e)
    for name, says in [("banana", "cuda:N"), ("tpu", "cuda:N"), ("mps", "cuda:N"), ("cuda:x", "cuda:N"),
                       ("cuda:7" if HAS_CUDA else "cuda", "GPU")]:
        try:
            gpt.resolve_device(name)
            raise AssertionError(f"--device {name} accepted")
        except ValueError as e:
            assert says in str(e), (name, str(e))
    check_bad_inputs([("gpt.py", ["--model", "gpt5"], "invalid choice"),
                      ("gpt.py", ["--seq", "0"], "--seq must be between")])


def test_timer_interleaves_and_pairs():
    """Every variant runs in every round, in a rotating order; ratios are per-round pairs, so a
    variant that does twice the work reads about 2x however the machine's speed drifts."""
    calls = []

    def work(name, n):
        def step():
            calls.append(name)
            torch.ones(n, n) @ torch.ones(n, n)
        return step

    times, peaks = gpt.time_rounds({"a": work("a", 160), "b": work("b", 202)}, "cpu", rounds=6, steps=2,
                                   warmup=1)
    assert [len(t) for t in times.values()] == [6, 6] and peaks == {"a": None, "b": None}
    rounds = ["".join(calls[2 + 4 * r: 6 + 4 * r : 2]) for r in range(6)]  # after the warm-up calls
    assert rounds == ["ab", "ba"] * 3, rounds
    stats = gpt.summarize(times, baseline="a")
    assert stats["a"].ratio == 1.0 and stats["a"].low <= stats["a"].median <= stats["a"].high
    assert 1.3 < stats["b"].ratio < 3.5, stats["b"]  # 202^3 / 160^3 = 2.0 flops
    assert stats["b"].ratio_low <= stats["b"].ratio <= stats["b"].ratio_high
    assert stats["b"].ms().count("(") == 1 and stats["b"].vs().endswith(")")


@gpu
def test_fp8_linear_matches_bf16():
    """Each FP8 layer's output and gradients against the same layer in bf16: within 10% relative
    (e4m3 keeps 3 mantissa bits, e5m2 2: a few percent is expected, 10% is broken)."""
    torch.manual_seed(0)
    for d_in, d_out in ((768, 2304), (768, 3072), (3072, 768)):
        layer = torch.nn.Linear(d_in, d_out).cuda()
        x = torch.randn(4, 1024, d_in, device="cuda", requires_grad=True)
        dy = torch.randn(4, 1024, d_out, device="cuda")
        outs = []
        for convert in (False, True):
            if convert:
                layer.__class__ = gpt.Fp8Linear
            x.grad = layer.weight.grad = None
            with gpt.autocast("cuda", torch.bfloat16):
                y = layer(x)
            y.backward(dy)
            outs.append((y.float(), x.grad.float(), layer.weight.grad.float()))
        for ref, got in zip(*outs):
            assert ((got - ref).norm() / ref.norm()).item() < 0.1, (d_in, d_out)


# --- 2. train.py: learning, checkpoints, FSDP and DDP, interrupts, bad input

TINY = ["--device", "cpu", "--steps", "8", "--seq", "32", "--warmup", "2", "--lr", "3e-3", "--eval-every", "4"]


def step_losses(out):
    return [float(line.split("| loss")[1].split()[0]) for line in out.splitlines() if "| loss" in line]


def train_main(*args, code=0):
    """train.main in this process: (per-step losses, stdout); the exit status must be `code`."""
    status, out, err = call_main("train.py", *args)
    assert status == code, f"train.py {args} exited {status}:\n{out[-2000:]}\n{err[-2000:]}"
    return step_losses(out), out


_REFERENCE = {}


def reference_losses():
    """TINY on one process, batch 4: the run every layout, resume and variant is compared with."""
    if not _REFERENCE:
        _REFERENCE["losses"], _REFERENCE["out"] = train_main(*TINY, "--batch", 4, "--sample", 8)
    return _REFERENCE["losses"]


def close(a, b, tol=2e-3):
    """Losses of the same run in another layout: equal to fp32 rounding. A resume that lost the
    optimizer state is off by ~0.3 at the next step; the layouts agree to ~1e-4."""
    return len(a) == len(b) and all(abs(x - y) < tol for x, y in zip(a, b))


def test_train_cpu_lowers_val_loss():
    reference_losses()
    out = _REFERENCE["out"]
    assert out.startswith("device: cpu"), out[:200]
    steps = [int(line.split("|")[0].split()[1]) for line in out.splitlines() if "| loss" in line]
    assert steps == list(range(8)), steps  # one line per step, in order, none lost to the pipelining
    vals = [float(line.split()[-1]) for line in out.splitlines() if "val loss" in line]
    assert len(vals) == 2 and vals[1] < vals[0] - 0.25 and vals[1] < math.log(gpt.GPT2_VOCAB) - 1, vals
    assert "summary: median step" in out and "--- sample (8 tokens)" in out


def test_train_recompute_and_unfused_loss_agree():
    """Recomputing every block's activations changes nothing, and the unfused loss (logits made)
    agrees with the fused one to 1e-3 relative (fp32, tiny)."""
    ref = reference_losses()[:3]
    assert train_main(*TINY, "--batch", 4, "--stop-after", 3, "--recompute", 1)[0] == ref
    unfused = train_main(*TINY, "--batch", 4, "--stop-after", 3, "--no-fused-ce")[0]
    assert len(unfused) == 3 and all(abs(a - b) < 1e-3 * b for a, b in zip(unfused, ref)), (unfused, ref)


def rank_pid(parent, rank):
    """The pid of torchrun's worker process with RANK=rank (a child of `parent`), from /proc."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/environ", "rb") as env:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == parent and f"RANK={rank}".encode() in env.read().split(b"\0"):
                    return int(pid)
        except OSError:
            pass


def run_until_step(cmd, signum, pid_of=lambda proc: proc.pid):
    """Run cmd; send `signum` to pid_of(proc) once step 0's line is out. (exit status, stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    head = []
    for line in proc.stdout:
        head.append(line)
        if line.startswith("step     0 | loss"):
            os.kill(pid_of(proc), signum)
            break
    out, err = proc.communicate(timeout=300)
    return proc.returncode, "".join(head) + out, err


def test_train_sigint_saves_and_resumes_exactly():
    """Ctrl-C: the step finishes, the checkpoint is written, one line says how to resume, exit 130,
    no traceback; the resumed run gives the uninterrupted run's losses bit for bit, and its summary
    names the steps it ran."""
    import signal

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "train.py", *TINY, "--batch", "4", "--ckpt", f"{tmp}/i.pt"]
        code, out, err = run_until_step(cmd, signal.SIGINT)
        last = out.strip().splitlines()[-1]
        assert code == 130 and last.startswith("interrupted (SIGINT) after step"), (code, out[-800:], err[-800:])
        assert "resume with: python train.py" in last and "Traceback" not in err, (last, err[-800:])
        first = step_losses(out)
        assert torch.load(f"{tmp}/i.pt", weights_only=True)["step"] == len(first) < 8
        second, out = train_main(*TINY, "--batch", 4, "--ckpt", f"{tmp}/i.pt", "--resume")
        assert first + second == reference_losses(), (first, second)
        k = len(first)
        assert f"resumed from {tmp}/i.pt at step {k}" in out and f"over steps {k + (8 - k) // 2}-7" in out, out


def test_train_ddp_fsdp_match_one_process_and_resume_across():
    """torchrun, 2 CPU ranks (gloo) x batch 2 against one process x batch 4 (the same global batch):
    DDP, stopped by SIGTERM sent to rank 1 alone (both ranks stop after the same step, rank 0 writes
    the checkpoint, exit 143); FSDP2 resuming DDP's checkpoint to step 6; one process resuming
    FSDP's checkpoint to the end. Every step's loss matches the one-process run."""
    import signal

    ref = reference_losses()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
                "train.py", *TINY, "--batch", "2"]
    with tempfile.TemporaryDirectory() as tmp:
        code, out, err = run_until_step(torchrun + ["--ckpt", f"{tmp}/d.pt"], signal.SIGTERM,
                                        pid_of=lambda proc: rank_pid(proc.pid, 1))
        ddp = step_losses(out)
        assert code != 0 and "interrupted (SIGTERM) after step" in out, (out[-1500:], err[-1500:])
        assert "x 2 processes" in out and "resume with: torchrun --nproc_per_node=2" in out
        assert torch.load(f"{tmp}/d.pt", weights_only=True)["step"] == len(ddp) < 6 and close(ddp, ref[:len(ddp)])
        proc = subprocess.run(torchrun + ["--fsdp", "--ckpt", f"{tmp}/d.pt", "--resume", "--stop-after", "6"],
                              cwd=HERE, capture_output=True, text=True, timeout=300)
        fsdp = step_losses(proc.stdout)
        assert proc.returncode == 0 and "FSDP" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert close(fsdp, ref[len(ddp):6]), (ddp, fsdp, ref)
        last, _ = train_main(*TINY, "--batch", 4, "--ckpt", f"{tmp}/d.pt", "--resume")
        assert close(last, ref[6:]), (last, ref)


def test_fused_clipping_matches_clip_grad_norm():
    """train.clip_gradients, fused AdamW (the clip applied inside the optimizer's kernel) and plain,
    steps like clip_grad_norm_ followed by the same optimizer. Two steps: a clipped one, then an
    unclipped one; with a single step Adam's scale invariance would hide a missing clip."""
    import train

    def params_after(clip, fused=True):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        gen = torch.Generator().manual_seed(1)
        for scale in (10.0, 0.01):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen) * scale
            clip(model, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    ref = params_after(lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    unclipped = params_after(lambda m, o: None)
    for fused in (True, False):
        ours = params_after(lambda m, o: train.clip_gradients(m, o, 1.0), fused)
        assert (ours - ref).abs().max() < 1e-6 < (unclipped - ref).abs().max() / 100, fused


def test_train_bad_input_and_checkpoints():
    """Every kind of mistake exits 2 with one sentence before any work: ranges, devices, combinations,
    paths (input.txt is never written over), data too short, files that are not checkpoints of this
    run. A short text that holds one batch trains; a failed write leaves no .tmp behind."""
    with open(os.path.join(HERE, "input.txt"), "rb") as f:
        text = f.read()
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/short.txt", "wb") as f:
            f.write(text[:2000])  # ~520 tokens: one batch of 2 x 32, a single validation row
        run1 = ["--device", "cpu", "--steps", "2", "--batch", "2", "--seq", "32", "--data", f"{tmp}/short.txt"]
        assert "evaluating 1 sequences per process" in train_main(*run1, "--ckpt", f"{tmp}/ok.pt", "--stop-after", 1)[1]
        state = torch.load(f"{tmp}/ok.pt", weights_only=True)
        for name, value in {"shape": {**state, "model": {**state["model"], "wpe.weight": torch.zeros(3, 3)}},
                            "model": {**state, "run": {**state["run"], "model": "gpt2"}}, "bare": state["model"],
                            "tensor": torch.ones(3)}.items():
            torch.save(value, f"{tmp}/{name}.pt")
        with open(f"{tmp}/random.pt", "wb") as f, open(f"{tmp}/empty.pt", "wb"):
            f.write(os.urandom(4096))
        resume = ["--resume", "--ckpt"]
        cases = [
            (["--model", "gpt5"], "unknown model"), (["--model", "gpt2", "--seq", "2048"], "block size"),
            (["--vocab", "50000"], "below the tokenizer"), (["--bf16", "--fp16"], "exclusive"),
            (["--batch", "0"], "--batch must be positive"), (["--stop-after", "0"], "--stop-after must be positive"),
            (["--stop-after", "-1"], "--stop-after must be positive"), (["--warmup", "-1"], "--warmup cannot be negative"),
            (["--grad-clip", "-1"], "--grad-clip cannot"), (["--weight-decay", "-0.1"], "--weight-decay cannot"),
            (["--sample", "-5"], "--sample cannot"), (["--min-lr", "1e-3"], "between 0 and --lr"),
            (["--device", "banana"], "cuda:N"), (["--device", "tpu"], "cuda:N"), (["--fp8"], "--fp8 needs"),
            (["--fsdp"], "under torchrun"), (["--fsdp", "--fp16"], "sharded GradScaler"),
            (["--recompute", "0"], "--recompute must be positive"), (["--model", "tiny", "--recompute", "5"], "above the 4"),
            (["--ckpt", ""], "needs a file name"), (["--ckpt", "input.txt"], "refusing to overwrite"),
            (["--ckpt", tmp], "is a directory"), (["--ckpt", f"{tmp}/no/x.pt"], "does not exist"),
            (resume + [f"{tmp}/none.pt"], "--resume needs"), (["--data", f"{tmp}/input.txt"], "input.txt is missing"),
            (["--batch", "2000", "--seq", "256"], "training split holds"), (run1 + ["--seq", "64"], "validation split holds"),
            (run1 + ["--stop-after", "1"] + resume + [f"{tmp}/ok.pt"], "nothing left to run"),
            (run1 + ["--steps", "3"] + resume + [f"{tmp}/ok.pt"], "made with --steps 2, not 3"),
            (run1 + resume + [f"{tmp}/model.pt"], "made with --model gpt2"),
            (run1 + resume + [f"{tmp}/shape.pt"], "wpe.weight is (3, 3) there"),
            (resume + [f"{tmp}/random.pt"], "torch.load cannot read it"), (resume + [f"{tmp}/empty.pt"], "empty file"),
            (resume + [f"{tmp}/bare.pt"], "weights alone"), (resume + [f"{tmp}/tensor.pt"], "bare tensor"),
        ] + ([] if HAS_CUDA else [(["--fp16"], "needs a CUDA GPU"), (["--device", "cuda"], "no CUDA GPU"),
                                  (["--fp8"], "FP8 tensor cores")])
        check_bad_inputs([("train.py", args, says) for args, says in cases])
        with open(os.path.join(HERE, "input.txt"), "rb") as f:
            assert f.read() == text  # --ckpt input.txt left it alone

        def failing_save(obj, path):  # a disk that fills up halfway through the write
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(28, "No space left on device")

        saved, torch.save = torch.save, failing_save
        try:
            code, _, err = call_main("train.py", *run1, "--ckpt", f"{tmp}/ok.pt", "--stop-after", 1)
        finally:
            torch.save = saved
        assert code == 2 and "could not write the checkpoint" in err and "No space left" in err, err
        assert not os.path.exists(f"{tmp}/ok.pt.tmp") and torch.load(f"{tmp}/ok.pt", weights_only=True)["step"] == 1


def test_train_stops_on_nan_loss():
    _, out = train_main("--device", "cpu", "--lr", "1e9", "--warmup", "1", "--steps", "10", "--batch", "2",
                        "--seq", "32", code=1)
    last = out.strip().splitlines()[-1]
    assert last.startswith("stopped: loss is") and "at step" in last and "learning rate" in last, last
    # the step it names is the first non-finite one: every step before it printed a finite loss
    finite = step_losses(out)
    assert len(finite) == int(last.split("at step")[1].split(";")[0]) and all(map(math.isfinite, finite)), out


@gpu
def test_train_gpu_bf16_compile_and_fp16_scaler():
    for flags in (["--vocab", "50304", "--bf16", "--compile"], ["--fp16"]):
        out = run("train.py", *flags, "--steps", "20", "--batch", "8", "--seq", "256", "--eval-every", "10").stdout
        vals = [float(ln.split()[-1]) for ln in out.splitlines() if "val loss" in ln]
        assert len(vals) == 2 and vals[1] < vals[0] and "GiB" in out.splitlines()[-1] and "MFU" in out, out[-2000:]


@gpu
def test_train_gpu_compile_matches_eager_with_grad_accum():
    """CUDA graphs (--compile on one GPU) across micro-steps: gradients accumulate over replays, so
    each step's loss and accumulated grad norm match the eager run's."""
    def loss_and_norm(*extra):
        out = run("train.py", "--model", "tiny", "--bf16", "--grad-accum", "2", "--steps", "8", "--batch", "4",
                  "--seq", "128", "--warmup", "1", "--lr", "3e-3", "--device", "cuda", *extra).stdout
        return [(float(ln.split("| loss")[1].split()[0]), float(ln.split("| norm")[1].split()[0]))
                for ln in out.splitlines() if "| loss" in ln]

    compiled, eager = loss_and_norm("--compile"), loss_and_norm()
    assert len(compiled) == len(eager) == 8
    for (loss_c, norm_c), (loss_e, norm_e) in zip(compiled, eager):
        assert abs(loss_c - loss_e) < 0.05 and abs(norm_c - norm_e) < 0.05 * norm_e, (compiled, eager)


@gpu
def test_train_gpu_fp8_learns_and_fused_ce_matches():
    """gpt2 with --fp8 --compile: the per-layer table, and a loss that falls over 20 steps. The fused
    output layer + loss against the logits path at gpt2 size: every one of 20 steps' losses within
    1e-3 relative (fp32: the two differ in summation order and the padded vocabulary alone)."""
    common = ["--vocab", "50304", "--steps", "20", "--batch", "8", "--seq", "256", "--warmup", "5", "--eval-every", "100"]
    out = run("train.py", *common, "--bf16", "--fp8", "--compile").stdout
    losses = step_losses(out)
    assert "FP8 (e4m3" in out and len(losses) == 20 and sum(losses[-5:]) / 5 < losses[0] - 1, out[-3000:]
    fused, unfused = (step_losses(run("train.py", *common, *extra).stdout) for extra in ([], ["--no-fused-ce"]))
    assert len(fused) == len(unfused) == 20, (fused, unfused)
    assert all(abs(a - b) < 1e-3 * b for a, b in zip(fused, unfused)), (fused, unfused)


@gpu
def test_train_gpu_recompute_lowers_peak_memory():
    """--recompute 1 keeps one input per block instead of every activation: the measured peak of the
    training steps (gpt2, bf16, B=16, T=512) falls well below the plain run's."""
    def peak(*extra):
        out = run("train.py", "--bf16", "--vocab", "50304", "--steps", "3", "--batch", "16", "--seq", "512",
                  "--eval-every", "100", *extra).stdout
        return float(out.split("peak mem")[1].split()[0]), out

    (plain, _), (less, out) = peak(), peak("--recompute", "1")
    assert "recompute 12/12 blocks" in out and less < 0.85 * plain, (plain, less, out[-500:])


# --- 3. bench_attention.py: sweep through the timer, saved-bytes model, labels, OOM, bad input

def test_bench_attention_cpu_sweep():
    import bench_attention as ba

    args = ba.parse_args(["--impl", "naive,flash,efficient,math", "--d", "16", "--seq", "32,64", "--rounds", "3",
                          "--steps", "1", "--warmup", "1", "--dtype", "fp32", "--causal"])
    results, notes = ba.run_sweep(args, ba.make_impls(args.impl, True, args.device), args.device, torch.float32)
    assert set(results) == {(16, 32), (16, 64)}, results
    for row in results.values():
        for name in ("naive", "flash", "math"):
            for mode in ("fwd", "both"):
                t = row[name][mode]
                assert 0 < t.low <= t.median <= t.high and t.ratio_low <= t.ratio <= t.ratio_high, (name, mode, t)
        assert row["flash"]["both"].ratio == 1.0  # the baseline against itself, round by round
        assert HAS_CUDA or row["efficient"] == ("n/a", "needs CUDA"), row["efficient"]  # n/a, not a crash
    with tempfile.TemporaryDirectory() as tmp:
        plot = os.path.join(tmp, "a.png")
        plot_args = ["--plot", plot] if _has_matplotlib() else []
        code, out, err = call_main("bench_attention.py", "--impl", "naive,math", "--d", "16", "--seq", "32", "--rounds",
                                   "2", "--steps", "1", "--dtype", "fp32", *plot_args)
        assert code == 0 and out.strip().splitlines()[-1].startswith("summary:"), out + err
        assert "rounds" in out and ("saved pred" in out) and (not plot_args or os.path.getsize(plot) > 0), out
    code, out, err = call_main("bench_attention.py", "--suite", "flash", "--impl", "naive", "--d", "16", "--seq", "64",
                               "--dtype", "fp32")
    assert code == 0 and "fp32 fwd+bwd" in out and out.strip().splitlines()[-1].startswith("summary:"), out + err


def _has_matplotlib():
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def test_bench_attention_saved_bytes_prediction():
    from bench_attention import measure_saved_bytes, naive_attention, naive_saved_bytes

    for B, H, S, D, dtype, causal in [(2, 3, 48, 16, torch.float32, False), (1, 2, 40, 8, torch.bfloat16, True),
                                      (3, 1, 64, 32, torch.float32, True)]:
        q, k, v = (torch.randn(B, H, S, D, dtype=dtype, requires_grad=True) for _ in range(3))
        measured = measure_saved_bytes(lambda q, k, v: naive_attention(q, k, v, causal), q, k, v)
        predicted = naive_saved_bytes(B, H, S, D, dtype, causal)
        assert predicted == measured, (B, H, S, D, dtype, causal, predicted, measured)
        # exactly one B*H*S*S matrix is kept (the probabilities), not scores and probabilities
        assert measured < 3 * B * H * S * D * dtype.itemsize + 2 * B * H * S * S * dtype.itemsize


def test_bench_attention_bad_input():
    check_bad_inputs([("bench_attention.py", args, says) for args, says in [
        (["--d", "0"], "--d values must be positive"), (["--seq", "1k"], "comma-separated integers"),
        (["--impl", "naive,bogus"], "unknown implementation 'bogus'"), (["--device", "banana"], "not a device"),
        (["--rounds", "0"], "--rounds must be at least 1"), (["--steps", "0"], "--steps must be at least 1"),
        (["--warmup", "-1"], "non-negative"), (["--batch", "0"], "--batch"), (["--heads", "0"], "--heads"),
        (["--impl", "flash", "--baseline", "naive"], "--baseline naive"), (["--memory-fraction", "1.5"], "memory-fraction"),
        (["--plot", "/nonexistent/a.png"], "--plot"), (["--suite", "bogus"], "invalid choice")]])


@gpu
def test_bench_attention_compiled_label():
    import bench_attention as ba

    args = ba.parse_args(["--impl", "compiled", "--d", "64", "--seq", "256", "--rounds", "1", "--steps", "1"])
    results, _ = ba.run_sweep(args, ba.make_impls(args.impl, False, args.device), args.device, torch.bfloat16)
    cell = results[(64, 256)]["compiled"]
    assert isinstance(cell, dict) and isinstance(cell["sdpa_ops"], list), cell  # what the profiler saw, stars or not


@gpu
def test_bench_attention_oom_row_then_next_runs():
    # 2% of an 80 GB GPU is 1.6 GiB; naive at S=16384 keeps an 8x16384x16384 bf16 matrix (4 GiB).
    # A fresh process: the memory cap would otherwise stay on this one.
    out = run("bench_attention.py", "--memory-fraction", "0.02", "--impl", "naive,flash", "--d", "64",
              "--seq", "16384,1024", "--rounds", "2", "--steps", "1", "--warmup", "1").stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("64 ")]
    assert ["64", "16384", "OOM"] == rows[0][:3] and rows[1][:2] == ["64", "1024"] and rows[1][2] != "OOM", out
    assert "first naive OOM, worked through" in out, out


# --- 4. precision.py: IEEE accumulation, autocast capture, LayerNorm overflow, FP8 scaling

def test_precision_cpu_sections_run():
    code, out, err = call_main("precision.py", "--device", "cpu", "--model", "tiny", "--steps", 2, "--rounds", 2)
    assert code == 0 and "Traceback" not in err, err
    for n, name in enumerate(("formats", "accumulate", "autocast", "layernorm", "tf32", "gradscaler", "mixed",
                              "fp8"), 1):
        assert f"== {n}. {name}" in out, out
    assert out.count("takeaway") == 6 and out.count("skipped: needs CUDA") == 2, out
    assert "n/a (TF32 is CUDA-only)" in out and "need FP8 tensor cores" in out, out


def test_precision_accumulate_matches_ieee():
    import numpy as np
    from precision import accumulate, ulp

    def ieee_sum(acc_type, addend, n):  # numpy rounds each addition to acc_type, as IEEE does
        acc = acc_type(0)
        for _ in range(n):
            acc = acc_type(acc + addend)
        return float(acc)
    fp16_sum = ieee_sum(np.float16, np.float16(0.01), 1000)
    r = accumulate(0.01, 1000, torch.float16)
    assert r["total"] == fp16_sum != 10.0, r
    # fp32 sum of fp16 addends: fp32 sums of the rounded addend, in either cast style; but a
    # 1-element slice outranks the 0-dim fp32 sum in type promotion and the sum becomes fp16
    for cast in ("implicit", "explicit"):
        r = accumulate(0.01, 1000, torch.float32, torch.float16, cast)
        assert r["dtype"] == torch.float32 and r["total"] == ieee_sum(np.float32, np.float16(0.01), 1000), r
    r = accumulate(0.01, 1000, torch.float32, torch.float16, "slice")
    assert r["dtype"] == torch.float16 and r["total"] == fp16_sum
    # 0.001 x 10000 in fp16 stalls, and at the stall the addend is at most half an ulp
    r = accumulate(0.001, 10000, torch.float16)
    assert r["total"] == ieee_sum(np.float16, np.float16(0.001), 10000) and r["stall_step"] is not None
    assert float(np.float16(0.001)) <= ulp(r["stall_value"], torch.float16) / 2
    assert float(np.spacing(np.float16(r["total"]))) == ulp(r["stall_value"], torch.float16)


def test_precision_autocast_capture_and_layernorm_overflow():
    from precision import autocast_dtypes, layernorm_case

    seen = autocast_dtypes(torch.device("cpu"), torch.bfloat16)
    assert seen["fc1 output"] == seen["grad of fc1 output"] == torch.bfloat16, seen
    assert seen["fc1.weight inside context"] == seen["fc1.weight.grad"] == torch.float32, seen
    assert seen["loss (cross_entropy)"] == torch.float32, seen
    big, small = layernorm_case(0.0, 1000.0), layernorm_case(0.0, 1.0)
    assert big["fp16_overflow"] and not big["bf16_overflow"] and big["max_x2"] > 65504, big
    assert not small["fp16_overflow"] and small["fp16_err"] < 0.05, small


def test_precision_fp8_scaling_errors():
    from precision import capture_linear_tensors, fp8_round_trip

    E4M3 = gpt.E4M3
    values = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    values = values[values.isfinite()]  # every finite e4m3 number; the largest, 448, makes the scale 1
    assert values.abs().max() == 448 and fp8_round_trip(values, E4M3)[0] == 0
    # rows of representable values times powers of two: a scale per row is exact, one per tensor
    # pushes the small rows below the smallest normal (and loses them)
    rows = values * 2.0 ** torch.arange(-24, 1, 4.0)[:, None]
    (tensor_err, tensor_low), (row_err, row_low) = fp8_round_trip(rows, E4M3), fp8_round_trip(rows, E4M3, True)
    assert row_err == 0 and 0 < tensor_err and row_low < tensor_low, (tensor_err, row_err, tensor_low, row_low)
    # against the computation written out
    t = torch.randn(64, 96) * torch.logspace(-3, 3, 64)[:, None]
    s = 448 / t.abs().max()
    direct = ((t * s).to(E4M3).float() / s - t).norm() / t.norm()
    assert abs(fp8_round_trip(t, E4M3)[0] - direct.item()) < 1e-6 * direct.item()
    assert fp8_round_trip(t, E4M3, True)[0] <= fp8_round_trip(t, E4M3)[0]
    # real tensors: the gradient reaching the output layer is (softmax - onehot) / N, rows sum to 0
    got = capture_linear_tensors("tiny", 1, 16, torch.device("cpu"))
    assert len(got) == 10 and got["h.2.attn.c_attn output grad"].shape == (16, 384), list(got)
    assert got["lm_head input"].shape == (16, 128) and got["lm_head output grad"].shape == (16, 50257)
    assert got["lm_head output grad"].sum(1).abs().max() < 1e-6


def test_precision_bad_input():
    check_bad_inputs([("precision.py", ["--only", "nosuch"], "unknown section 'nosuch'"),
                      ("precision.py", ["--only", "formats,nosuch"], "choose from"),
                      ("precision.py", ["--device", "banana"], "not a device"),
                      ("precision.py", ["--device", "mps"], "not supported"),
                      ("precision.py", ["--model", "gpt5"], "unknown model"),
                      ("precision.py", ["--models", "tiny,gpt5"], "unknown model"),
                      ("precision.py", ["--batch", 0], "--batch must be between"),
                      ("precision.py", ["--seq", 5000], "--seq must be between"),
                      ("precision.py", ["--steps", 0], "--steps must be between"),
                      ("precision.py", ["--rounds", -1], "--rounds must be between"),
                      ("precision.py", ["--batch", "x"], "invalid int value")])


@gpu
def test_precision_gpu_sections():
    code, out, err = call_main("precision.py", "--only", "autocast,tf32,gradscaler,mixed", "--model", "tiny",
                               "--models", "tiny", "--batch", 4, "--seq", 256, "--steps", 3, "--rounds", 3)
    assert code == 0 and "autocast fp16 on cuda" in out and "skipped" not in out, out
    assert out.count("takeaway") >= 5 and "OOM" not in out and "GradScaler" in out, out


@gpu
def test_precision_fp8_gemms_agree_gpu():
    """Every FP8 GEMM variant (cast beforehand, row-wise, cast each call) against bf16: within
    e4m3's few-percent rounding; and the round trip gives the CPU's numbers on the GPU."""
    from precision import fp8_round_trip, gemm_variants

    ops = gemm_variants(256, 128, 512, torch.device("cuda"))
    ref = ops["bf16"]().float()
    for name, op in ops.items():
        assert ((op().float() - ref).norm() / ref.norm()).item() < 0.1, name
    t = torch.randn(64, 96) * torch.logspace(-3, 3, 64)[:, None]
    for rowwise in (False, True):
        assert abs(fp8_round_trip(t.cuda(), gpt.E4M3, rowwise)[0] - fp8_round_trip(t, gpt.E4M3, rowwise)[0]) < 1e-6


# --- 5. bench_e2e.py: ladder, sweep, output GEMMs, profile, bad input

def _bench_e2e_args(**kw):
    import types

    import bench_e2e

    return types.SimpleNamespace(**{"vocab": [50257], "batch": [1, 2], "seq": [16], "modes": bench_e2e.MODES,
                                    "tf32": False, "dtype": None, "attn": "sdpa", "compile": False, "rounds": 2,
                                    "steps": 1, "warmup": 1, **kw})


def test_bench_e2e_ladder_cpu():
    png = os.path.join(tempfile.mkdtemp(), "ladder.png")
    code, out, err = call_main("bench_e2e.py", "--device", "cpu", "--ladder", "--batch", 1, "--seq", 16, "--rounds", 2,
                               "--plot", png)
    assert code == 0, err
    import bench_e2e

    lines = {name: next(line for line in out.splitlines() if line.startswith(name)) for name, _ in bench_e2e.LADDER}
    skipped = [name for name, line in lines.items() if "skipped" in line]
    assert skipped == ["+ TF32 matmuls", "+ torch.compile (PDL)", "+ CUDA graphs", "+ fused linear-CE",
                       "+ FP8 matmuls"], out  # TF32 and every compiled rung need the GPU; four are timed
    timed = [line for name, line in lines.items() if name not in skipped]
    assert all(line.count("x (") == 2 for line in timed[1:]), out  # paired speed-ups vs previous and vs first
    assert out.strip().splitlines()[-1].startswith("ladder:") and f"wrote the ladder plot to {png}" in out
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_e2e_ladder_rungs_train_the_same_model():
    """Same seed, same batch: every rung that runs here starts from the same loss."""
    import bench_e2e

    cpu = torch.device("cpu")
    config, (x, y) = gpt.make_config("tiny"), bench_e2e.batch_of(2, 16, cpu)
    losses = {name: bench_e2e.run_step("train", bench_e2e.build(config, s, cpu), x, y).item()
              for name, change, s in bench_e2e.rungs() if bench_e2e.skip_reason(change, s, cpu) is None}
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses.values()), losses
    first = losses["fp32, naive attention, vocab 50257"]
    assert all(abs(v - first) < 0.02 * first for v in losses.values()), losses


def test_bench_e2e_sweep_numbers():
    import bench_e2e

    args = _bench_e2e_args()
    [(name, times, stats)] = bench_e2e.run_sweep(args, [("tiny", gpt.make_config("tiny"))], torch.device("cpu"))
    assert len(times) == 2 * 3 and all(len(t) == 2 for t in times.values()), times  # batches x modes
    assert all(t.low <= t.median <= t.high and t.peak is None for t in stats.values())
    a, b = (50257, 2, 16, "train"), (50257, 1, 16, "train")
    ratios = sorted(2 * tb / ta for ta, tb in zip(times[a], times[b]))  # tokens/s ratio, per round
    mid = (ratios[0] + ratios[1]) / 2
    assert bench_e2e.speedup(times, a, b, 2.0) == f"{mid:.3f}x ({ratios[0]:.3f}-{ratios[1]:.3f})"
    f, fb, tr = (times[(50257, 1, 16, m)] for m in bench_e2e.MODES)
    split = bench_e2e.step_split(times, 50257, 1, 16)
    assert split[1].startswith(f"{(fb[0] - f[0] + fb[1] - f[1]) / 2:.2f} (")  # paired: per-round differences
    assert split[3] == f"{(tr[0] + tr[1]) / 2:.2f}"


def test_bench_e2e_cpu_run_gemms_profile_trace():
    trace = os.path.join(tempfile.mkdtemp(), "step.json")
    code, out, err = call_main("bench_e2e.py", "--device", "cpu", "--batch", 1, "--seq", 16, "--vocab", "50257,50304",
                               "--attn", "naive", "--trace", trace, "--rounds", 1)
    assert code == 0 and out.startswith("device: CPU"), err
    for title in ("sweep,", "where a train step's time goes", "output-layer GEMMs alone", "forward CPU ops",
                  "time by category", "naive attention, forward"):
        assert title in out, title
    assert out.strip().splitlines()[-1].startswith("best train throughput"), out
    import json

    import bench_e2e

    with open(trace) as f:
        assert json.load(f)["traceEvents"]
    assert bench_e2e.starts_with(b"{")(trace)  # ours: the next run may overwrite it


def test_bench_e2e_profile_categories():
    import bench_e2e

    cpu = torch.device("cpu")
    bench = bench_e2e.build(gpt.make_config("tiny"), {**bench_e2e.FIRST_RUNG, "attn": "naive"}, cpu)
    profs = bench_e2e.profile_steps(bench, 1, 16, cpu, warmup=1, steps=1)
    fwd, step = (bench_e2e.category_times(profs[m], False) for m in ("forward", "train"))
    assert {"matmul", "optimizer", "elementwise+norm"} <= set(step) and "optimizer" not in fwd, (fwd, step)
    stages = bench_e2e.naive_attention_rows(profs["forward"], bench["config"], 1, 16, 1, False)
    assert [r[0] for r in stages] == list(bench_e2e.NAIVE_RANGES)
    assert float(stages[1][4][:-1]) < float(stages[2][4][:-1])  # the softmax's FLOP share is the smaller


def test_bench_e2e_bad_input():
    d = tempfile.mkdtemp()
    check_bad_inputs([("bench_e2e.py", args, says) for args, says in (
        (["--model", "huge"], "unknown model"),
        (["--model", "tiny", "--seq", 1000], "--seq must be at least 1 and at most 256"),
        (["--batch", 0], "--batch must be at least 1"),
        (["--batch", "2,x"], "integers separated by commas"),
        (["--vocab", 50000], "--vocab must be at least 50257"),
        (["--rounds", 0], "--rounds must be at least 1"),
        (["--steps", 0], "--steps must be at least 1"),
        (["--warmup", 0], "--warmup must be at least 1"),
        (["--mode", "backward"], "invalid choice"),
        (["--bf16", "--fp16"], "exclusive"),
        (["--device", "cpu", "--fp16"], "needs a CUDA GPU"),
        (["--device", "cpu", "--attn", "triton"], "needs a CUDA GPU"),
        (["--device", "banana"], "not a device"),
        (["--device", "cuda:7"], "--device cuda:7"),
        (["--trace", os.path.join(d, "missing", "t.json")], "does not exist"),
        (["--trace", d], "is a directory"),
        (["--trace", os.path.join(HERE, "input.txt")], "refusing to overwrite"),
        (["--plot", os.path.join(d, "p.png")], "add --ladder"),
        (["--ladder", "--plot", os.path.join(d, "missing", "p.png")], "does not exist"),
        (["--ladder", "--batch", "1,2"], "one --batch"),
        (["--ladder", "--bf16"], "sets precision"))])


@gpu
def test_bench_e2e_gpu_ladder_rungs_agree():
    """Every rung, compiled, graphed, fused and FP8 ones included, starts from the same loss."""
    import bench_e2e

    cuda = torch.device("cuda")
    torch._dynamo.reset()
    config, (x, y) = gpt.make_config("tiny"), bench_e2e.batch_of(4, 128, cuda)
    losses = {name: bench_e2e.run_step("train", bench_e2e.build(config, s, cuda), x, y).item()
              for name, change, s in bench_e2e.rungs() if bench_e2e.skip_reason(change, s, cuda) is None}
    gpt.set_tf32(False)
    assert len(losses) == len(bench_e2e.LADDER) - (0 if gpt.fp8_supported(cuda) else 1), losses
    first = losses["fp32, naive attention, vocab 50257"]
    assert all(abs(v - first) < 0.02 * first for v in losses.values()), losses


@gpu
def test_bench_e2e_gpu_peaks_and_oom():
    import bench_e2e

    cuda = torch.device("cuda")
    args = _bench_e2e_args(batch=[4, 8, 16384], seq=[256])  # 4M tokens' activations cannot fit: OOM cells
    [(_, times, stats)] = bench_e2e.run_sweep(args, [("tiny", gpt.make_config("tiny"))], cuda)
    peak = {(b, m): stats[(50257, b, 256, m)].peak for b in (4, 8) for m in bench_e2e.MODES}
    for b in (4, 8):  # backward keeps every saved activation alive, a train step adds AdamW's state
        assert peak[(b, "train")] >= peak[(b, "forward-backward")] > peak[(b, "forward")] > 0, peak
    assert all(peak[(8, m)] > peak[(4, m)] for m in bench_e2e.MODES), peak
    assert all(stats[(50257, 16384, 256, m)] is None for m in bench_e2e.MODES)
    # out of memory outside a sweep cell (the profiled configuration): one line, exit 2
    assert_bad_input("bench_e2e.py", "--model", "tiny", "--batch", 16384, "--seq", 256, "--mode", "forward",
                     "--rounds", 1, "--profile", says="out of GPU memory in the profiled configuration")


# --- 6. memory.py: the analytic model against live tensors, FSDP ranks, checkpointing, parallel

def _memory_setup(B, T, dtype=None, wrap=None, **overrides):
    """memory, config, model, optimizer, x, y for tiny after one step (AdamW's state exists)."""
    import memory
    from gpt import GPT, configure_optimizer, make_config
    torch.manual_seed(0)
    cfg = make_config("tiny", **overrides)
    model = GPT(cfg)
    wrap and wrap(model)
    opt = configure_optimizer(model, lr=1e-3)
    x, y = memory.random_batch(cfg, B, T, "cpu")
    memory.step(model, opt, x, y, dtype)
    return memory, cfg, model, opt, x, y


def _memory_check(pred, measured, what):
    assert abs(pred / measured - 1) < 1e-3, f"{what}: predicted {pred:,}, measured {measured:,}"


def _memory_blocks_check(memory, pred, model, opt, x, y, dtype, forward=None, what=""):
    """The peak of live bytes while each block runs backward (the backward pass cut at LayerNorm
    backwards: ln_f's, then each block's ln_2 and ln_1 from the top; a stretch starts with the last
    op of the block above, which under FSDP holds that block's unreduced gradients) is predicted."""
    log = []

    class Logged(memory.LiveBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            log.append((str(func), self.now()))
            return out

    with Logged(memory.state_tensors(model, opt) + [x, y]):
        with torch.autocast("cpu", dtype, enabled=dtype is not None):
            loss = (forward or model)(x, y)[1]
        log.clear()
        loss.backward()
    cuts = [i for i, (name, _) in enumerate(log) if "native_layer_norm_backward" in name]
    for j, b in enumerate(range(len(model.h) - 1, -1, -1)):
        measured = max(level for _, level in log[cuts[2 * j] + 1:cuts[2 * j + 2] + 1])
        moments = (pred[f"backward: block {b}"], pred.get(f"backward: block {b + 1} done", 0))
        _memory_check(max(moments), measured, f"{what}, block {b}")


def test_memory_account_exact_on_cpu():
    """Parameter and AdamW bytes, bytes saved for backward (saved-tensor hooks) and the forward and
    backward peaks of live tensors (counted op by op) equal the model's prediction: fused and plain
    loss, fp32 and bf16, SDPA and naive attention, with and without recomputation, at sizes where
    the peak is the loss chunk, the start or the end of backward."""
    moments = set()
    for B, T, dtype, kw in ((1, 32, None, {}), (4, 64, torch.bfloat16, {}), (2, 64, None, {"fused_ce": False}),
                            (2, 32, torch.bfloat16, {"fused_ce": False, "attn": "naive"}),
                            (8, 64, torch.bfloat16, {"recompute": 1}), (4, 64, None, {"recompute": 3})):
        memory, cfg, model, opt, x, y = _memory_setup(B, T, dtype, **kw)
        pred = memory.account(cfg, B, T, dtype, "cpu")
        state = pred["moments"]["optimizer step"]
        nbytes = sum(t.untyped_storage().nbytes() for t in memory.state_tensors(model, opt))
        assert nbytes == state["weights (fp32)"] + state["AdamW moments + step"], (kw, nbytes)
        saved = memory.saved_bytes(lambda: model(x, y), dtype, "cpu", [*model.parameters(), x, y])
        assert saved == pred["saved"], (kw, dtype, saved, pred["saved"])
        peaks = memory.live_peaks(model, opt, x, y, dtype)
        for phase in ("forward", "backward"):
            _memory_check(pred["phases"][phase][0], peaks[phase], f"{kw} {dtype} {phase}")
        moments.add(pred["peak_at"])
    assert {"forward: loss chunk", "backward start", "backward end"} <= moments, moments


def test_memory_checkpoint_groups_on_cpu():
    """Groups of k recomputed blocks give the plain model's gradients, and each block's backward
    (its group recomputed) holds the bytes predicted, for groups and for gpt.py's recompute K."""
    memory, cfg, model, opt, x, y = _memory_setup(2, 64)
    grads = []
    for k in (0, 3):
        model.zero_grad(set_to_none=True)
        memory.grouped_forward(model, k)(x, y)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))
    model.zero_grad(set_to_none=True)
    for k in (2, 3):
        pred = memory.account(cfg, 2, 64, None, "cpu", groups=k)["totals"]
        _memory_blocks_check(memory, pred, model, opt, x, y, None, memory.grouped_forward(model, k), f"groups of {k}")
    memory, cfg, model, opt, x, y = _memory_setup(2, 64, torch.bfloat16, recompute=2)
    pred = memory.account(cfg, 2, 64, torch.bfloat16, "cpu")["totals"]
    _memory_blocks_check(memory, pred, model, opt, x, y, torch.bfloat16, what="recompute 2")


def test_memory_fsdp_rank_on_cpu():
    """One process plays rank 0 of W through torch's fake process group (collectives do nothing,
    every buffer is real): the rank's weights are 1/W of the model's, each parameter padded to a
    multiple of W rows, and its forward, backward and per-block peaks (gathered weights, prefetch,
    reduce-scatter buffers, recomputation) are what account(world=W) predicts. Not shown on a CPU:
    the CUDA allocator, NCCL, and LayerNorm in fp32 under bf16 autocast (account models both)."""
    import math
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    for W, dtype, K in ((4, torch.bfloat16, 1), (2, None, 0)):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=W)
        try:
            mesh, mp = init_device_mesh("cpu", (W,)), MixedPrecisionPolicy(dtype, torch.float32)
            wrap = lambda model: [fully_shard(m, mesh=mesh, mp_policy=mp) for m in [*model.h, model]]
            memory, cfg, model, opt, x, y = _memory_setup(4, 64, dtype, wrap, recompute=K)
            pred = memory.account(cfg, 4, 64, dtype, "cpu", world=W)
            padded = sum(-(-p.shape[0] // W) * math.prod(p.shape[1:]) for p in model.parameters())
            local = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
            assert local == 4 * padded == 4 * pred["params"] and padded * W < memory.param_count(cfg) + W * 1024
            peaks = memory.live_peaks(model, opt, x, y, dtype)
            for phase in ("forward", "backward"):
                _memory_check(pred["phases"][phase][0], peaks[phase], f"W={W} {dtype} {phase}")
            _memory_blocks_check(memory, pred["totals"], model, opt, x, y, dtype, what=f"W={W} {dtype}")
        finally:
            dist.destroy_process_group()


def test_memory_parallel_rows_and_max_batch():
    """Per rank, DP replicates 16 B/param and ZeRO-1/2/FSDP divide 8, 12, 16 of them by the ranks;
    the GPT rows use FSDP's padded shards. The largest batch that fits a budget inverts the model."""
    import memory
    from gpt import make_config
    n = 126 * 2 * 16384 * 53248
    for stage, sharded in enumerate((0, 8, 12, 16)):
        assert sum(memory.per_rank_bytes(n, 8, stage).values()) == n * (16 - sharded) + n * sharded / 8
    code, out, _ = call_main("memory.py", "parallel")
    assert code == 0 and "219,848,638,464 parameters" in out and "3,518 GB" in out, out
    assert f"N_FSDP = {-(-n * 16 // (95 * 10**9))} devices" in out, out
    code, out, _ = call_main("memory.py", "parallel", "--model", "xl", "--world", "2", "--bf16")
    rows = {line.split(",")[0]: line.split()[-5:] for line in out.splitlines() if " ranks " in line}
    fsdp = memory.account(make_config("xl"), 4, 1024, torch.bfloat16, world=2)
    assert rows["FSDP (ZeRO-3)"][0] == f"{4 * fsdp['params'] / 2**30:.2f}", out
    assert float(rows["ZeRO-2"][1]) * 2 == float(rows["DP"][1]) and rows["ZeRO-2"][0] == rows["DP"][0], out
    assert f"{fsdp['peak'] / 2**30:.2f} GiB" in out.splitlines()[-1], out
    cfg = make_config("gpt2")
    peak = lambda B: memory.account(cfg, B, 1024, torch.bfloat16)["peak"]
    assert [memory.predict_max_batch(cfg, 1024, torch.bfloat16, peak(B) - d) for B, d in ((37, 1), (12, 0), (1, 1))] == [36, 12, 0]


def test_memory_bad_input():
    with tempfile.TemporaryDirectory() as d:
        theirs = os.path.join(d, "theirs.pickle")
        open(theirs, "w").write("not ours")
        check_bad_inputs([("memory.py", args, says) for args, says in [
            (["nonsense"], "unknown part"), (["account", "--model", "huge"], "unknown model"),
            (["account", "--device", "banana"], "not a device"), (["account", "--device", "cuda:7"], "cuda"),
            (["account", "--seq", "4096"], "block size"), (["account", "--batch", "0"], "positive"),
            (["account", "--vocab", "100"], "vocab"), (["account", "--recompute", "9"], "recompute"),
            (["account", "--fsdp", "--world", "1"], "--world"), (["checkpoint", "--recompute", "1"], "recompute"),
            (["account", "--sweep", "--fsdp"], "--sweep"), (["parallel", "--device-gb", "0"], "device-gb"),
            (["parallel", "--act-gb", "-1"], "act-gb"), (["checkpoint", "--rounds", "0"], "positive"),
            (["parallel", "--params", "-5"], "positive"), (["snapshot", "--out", "snap"], ".pickle"),
            (["snapshot", "--out", theirs], "not a file this script wrote"),
            (["snapshot", "--out", os.path.join(d, "missing", "s.pickle")], "does not exist"),
            (["account", "--attn", "cudnn", "--device", "cpu"], "needs a CUDA GPU")]])


@gpu
def test_memory_account_matches_measured():
    """The predicted peak is within 10% of max_memory_allocated for gpt2, fused and plain loss."""
    import memory
    from gpt import make_config
    device = torch.device("cuda", torch.cuda.current_device())
    for fused in (True, False):
        for dtype in (None, torch.bfloat16):
            cfg = make_config("gpt2", fused_ce=fused)
            measured = max(memory.measure_step(cfg, 8, 512, dtype, device).values())
            pred = memory.account(cfg, 8, 512, dtype)["peak"]
            assert abs(pred / measured - 1) <= 0.10, (fused, dtype, pred, measured)


@gpu
def test_memory_snapshot_and_out_of_memory_line():
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "s.pickle")
        code, stdout, err = call_main("memory.py", "snapshot", "--seq", "256", "--batch", "4", "--bf16", "--out", out)
        assert code == 0 and os.path.getsize(out) > 0 and "allocated at" in stdout, (stdout, err)
    assert_bad_input("memory.py", "account", "--model", "xl", "--batch", "4096", "--seq", "1024", says="predicts batch")


# --- 7. ddp.py: every wrapper, ZeRO and FSDP equal one process; the interleaved benchmark; bad input

def test_ddp_selftest_matches_one_process():
    """On 4 gloo ranks every wrapper ends with the weights of one process on the whole batch, and the
    selftest catches a wrapper that trains without averaging."""
    import ddp

    no_sync = type("NoSync", (ddp.DataParallel,), {"finish_gradient_synchronization": lambda self: None})
    ddp.TOY_VARIANTS["no-sync"] = (no_sync, "sgd", 2e-6)
    try:
        code, out, err = call_main("ddp.py", "selftest", "--world", 4, "--backend", "gloo")
    finally:
        del ddp.TOY_VARIANTS["no-sync"]
    n = len(ddp.TOY_VARIANTS)
    assert code == 1 and f"{n} of {n + 1} variants match one-process training; FAILED: no-sync" in out, out + err


def test_ddp_benchmark_and_allreduce_cpu_smoke():
    """On 2 gloo ranks: a benchmark row per variant with step, paired ratio and phase split, and the
    all-reduce table (2 ranks: busbw = algbw x 2(n-1)/n = algbw)."""
    import importlib.util

    with tempfile.TemporaryDirectory() as tmp:
        plot = ["--plot", os.path.join(tmp, "ddp.png")] if importlib.util.find_spec("matplotlib") else []
        code, out, err = call_main("ddp.py", "benchmark", "--world", 2, "--backend", "gloo", "--rounds", 1, "--steps", 1,
                                   "--warmup", 1, "--variants", "local,torch,zero2,fsdp:bf16,fsdp2", *plot)
        assert code == 0 and (not plot or os.path.getsize(plot[1]) > 0), out + err
    for label in ("local (no comm)", "torch DDP", "ZeRO-2", "FSDP bf16 compute", "torch FSDP2"):
        row = next((line for line in out.splitlines() if line.startswith(label + "  ")), label)
        assert len(row.split()) >= 10 and float(row[len(label):].split()[0]) > 0 and "x (" in row, out
    assert out.splitlines()[-1].startswith("summary: step (memory) vs torch DDP's: local (no comm)"), out
    code, out, err = call_main("ddp.py", "allreduce", "--world", 2, "--backend", "gloo", "--sizes", "4K,64K", "--reps", 3, "--warmup", 1)
    rows = [line.split() for line in out.splitlines() if line.startswith("2 ")]
    assert code == 0 and [r[1:3] for r in rows] == [["4", "KiB"], ["64", "KiB"]], out + err
    assert all(float(r[-3]) > 0 and r[-1] == r[-2] for r in rows) and out.splitlines()[-1].startswith("summary:")


def test_ddp_rank_killed_is_one_line():
    """A rank the kernel kills (here: SIGKILL to itself) is reported in one line, exit 2."""
    import contextlib
    import io
    import signal
    import types

    import ddp

    worker = lambda rank, *_: rank == 1 and os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            code = ddp.launch(worker, 2, "gloo", types.SimpleNamespace(timeout=30))
        except SystemExit as e:
            code = e.code
    assert code == 2 and err.getvalue().strip() == "error: rank 1 was killed by SIGKILL (out of memory?)", err.getvalue()


def test_ddp_bad_inputs():
    with tempfile.TemporaryDirectory() as tmp:
        check_bad_inputs([("ddp.py", args.split(), says) for args, says in [
            ("benchmark --world 0", "--world must be at least 1"), ("selftest --world 3", "1, 2, 4 or 8 ranks"),
            ("benchmark --world 4096", f"more than the {torch.cuda.device_count()} GPUs" if HAS_CUDA else "GiB of host memory"),
            (f"benchmark --plot {tmp}/missing/ddp.png", "does not exist"), (f"benchmark --plot {tmp}", "is a directory"),
            ("selftest --steps 0", "at least 1"), ("allreduce --sizes 3B", "not a whole number"), ("allreduce --sizes 1X", "not a whole"),
            ("allreduce --sizes 4096G", "4096 GiB"), ("allreduce --warmup -1", "at least 0"), ("allreduce --world 2,x", "--world"),
            ("benchmark --warmup 0", "--warmup must be at least 1"), ("benchmark --rounds 0", "--rounds must be at least 1"),
            ("benchmark --seq 100000", "block size"), ("benchmark --model banana", "unknown model"), ("benchmark --variants ,", "empty"),
            ("benchmark --vocab 100", "below the tokenizer"), ("benchmark --variants fsdp,bogus", "unknown 'bogus'"),
            ("benchmark --variants local:bf16", "unknown 'local:bf16'"), ("benchmark --bucket-mb 0", "--bucket-mb must be at least"),
            ("benchmark --timeout 0", "--timeout must be at least 1"),
        ] + ([] if HAS_CUDA else [("selftest --backend nccl", "needs CUDA")])])


@gpu
def test_ddp_gpu_selftest_and_benchmark():
    """Over NCCL every wrapper matches one process, and the benchmark's GPU paths (CUDA events, memory
    groups, torch's bf16 hook, FSDP2) give numbers in every row of a small model, none OOM."""
    world = min(2, torch.cuda.device_count())
    assert "10 of 10 variants match" in run("ddp.py", "selftest", "--world", world, "--timeout", 120, timeout=300).stdout
    out = run("ddp.py", "benchmark", "--world", world, "--model", "tiny", "--batch", 2, "--seq", 64, "--rounds", 2,
              "--steps", 1, "--warmup", 1, "--timeout", 120, timeout=600).stdout
    table = out.split("-----")[-1].split("\nstep: median")[0]
    assert "OOM" not in table and "n/a" not in table, out
    assert all(label in table for label in ("BucketDDP bf16 comm", "torch DDP bf16 comm", "ZeRO-2", "FSDP bf16 compute", "torch FSDP2"))


# --- 8. flash_triton.py: both autograd Functions vs a float64 reference, the saved logsumexp, determinism

def _flash_interpreted(code, timeout=300):
    """Run `code` in a fresh Python with TRITON_INTERPRET=1 set before triton is imported (this
    process may already have imported triton without it); return its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _flash_check(device, cases, shapes):
    """FlashAttention (Triton) and FlashAttentionTorch, called as Function.apply(q, k, v, is_causal,
    scale, precision), against softmax(QK^T)V in float64 written out here: O, the one fp32
    logsumexp among the saved tensors, and the gradients; the Triton backward twice, bitwise.
    A case (tma_dims, dtype, tol) loads tiles through TMA descriptors at the head dims tma_dims."""
    import flash_triton as ft

    for tma_dims, dtype, tol in cases:
        ft.TMA_HEAD_DIMS, default = tma_dims, ft.TMA_HEAD_DIMS
        # exact fp32 kernels compile slowly (unrolled FMA dots): the first two shapes suffice there
        for shape_q, shape_k, causal in shapes[:2] if dtype == torch.float32 else shapes:
            gen = torch.Generator(device=device).manual_seed(1)
            q, k, v = (torch.randn(shape, generator=gen, device=device).to(dtype) for shape in (shape_q, shape_k, shape_k))
            do = torch.randn(shape_q, generator=gen, device=device).to(dtype)
            scale = 0.3 if len(shape_q) == 3 else None  # also an explicit scale
            ref = [t.double().requires_grad_() for t in (q, k, v)]
            s = (ref[0] @ ref[1].transpose(-1, -2)) * (shape_q[-1] ** -0.5 if scale is None else scale)
            if causal:
                s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=device).triu(1), -math.inf)
            o_ref, lse_ref = s.softmax(-1) @ ref[2], s.logsumexp(-1)
            expected = (o_ref, lse_ref, *torch.autograd.grad(o_ref, ref, do.double()))
            for fn in (ft.FlashAttention, ft.FlashAttentionTorch):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                o = fn.apply(*leaves, causal, scale, "ieee")
                lse = [t for t in o.grad_fn.saved_tensors if t.dtype == torch.float32 and t.shape == q.shape[:-1]]
                assert len(lse) == 1, [(t.shape, t.dtype) for t in o.grad_fn.saved_tensors]
                grads = torch.autograd.grad(o, leaves, do)
                if fn is ft.FlashAttention:
                    again = torch.autograd.grad(fn.apply(*leaves, causal, scale, "ieee"), leaves, do)
                    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "backward is not deterministic"
                errs = [((x.double() - r).norm() / r.norm()).item() for x, r in zip((o, lse[0], *grads), expected)]
                assert max(errs) < tol, (fn.__name__, tma_dims, dtype, shape_q, shape_k, causal, errs)
        ft.TMA_HEAD_DIMS = default


def test_flash_interpreter_matches_reference():
    # head dims 16/32/64, ragged lengths (37, 100), Nq != Nk, 3-, 4- and 5-D, causal and not; TMA
    # loads (D128 only by default) at every head dim too: the interpreter runs them as masked loads
    _flash_interpreted("import torch, test_all\ntest_all._flash_check('cpu', [((), torch.float32, 1e-5), "
                       "((), torch.float16, 5e-3), ((16, 32, 64), torch.float16, 5e-3)], "
                       "[((1, 2, 37, 16), (1, 2, 37, 16), True), ((2, 40, 32), (2, 100, 32), False), "
                       "((1, 1, 100, 64), (1, 1, 100, 64), True), ((2, 1, 2, 33, 16), (2, 1, 2, 33, 16), False)])")


def test_flash_script_and_bad_input():
    out = _flash_interpreted(r'''
import torch, test_all, flash_triton as ft
code, out, err = test_all.call_main("flash_triton.py")
assert code == 0 and "passed" in out.splitlines()[-1], out + err
test_all.check_bad_inputs([("flash_triton.py", args, says) for args, says in [
    (["--shapes", "1x16x1024"], "BxHxSxD"), (["--shapes", "1x16x1024x48"], "BxHxSxD"),
    (["--shapes", "0x1x64x64"], "BxHxSxD"), (["--plot", "/nonexistent/a.png"], "--plot")]])
x = torch.randn(1, 2, 8, 16)
for args, says in [((torch.randn(1, 2, 8, 48),) * 3, "head dim 48"), ((x, x.half(), x), "dtype"),
                   ((x, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), True), "causal"),
                   ((torch.randn(8, 16),) * 3, "(batch, seq, d)"), ((x, x, x, False, None, "fp8"), "precision"),
                   ((x.double(),) * 3, "dtype"), ((x, x[:, :1], x), "do not match")]:
    try:
        ft.FlashAttention.apply(*args)
    except ValueError as e:
        assert says in str(e), (says, str(e))
    else:
        raise AssertionError(f"no error for {says}")
print("errors ok")
''')
    assert "errors ok" in out


@gpu
def test_flash_gpu_matches_reference():
    # full size, every dtype; D128 loads through TMA descriptors, the others by pointer
    tma = (128,)
    _flash_check("cuda", [(tma, torch.float32, 1e-4), (tma, torch.float16, 5e-3), (tma, torch.bfloat16, 3e-2)],
                 [((2, 4, 1024, 64), (2, 4, 1024, 64), True), ((1, 3, 517, 32), (1, 3, 781, 32), False),
                  ((2, 1000, 128), (2, 1000, 128), True), ((1, 2, 300, 16), (1, 2, 300, 16), True),
                  ((2, 2, 3, 256, 64), (2, 2, 3, 256, 64), True)])


@gpu
def test_flash_torch_compile():
    import torch.nn.functional as F

    import flash_triton as ft

    for D in (64, 128):  # D128 loads through TMA descriptors
        q, k, v = (torch.randn(2, 4, 512, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        o = torch.compile(ft.FlashAttention.apply)(q, k, v, True)
        grads = torch.autograd.grad(o.float().square().sum(), (q, k, v))
        o_ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads_ref = torch.autograd.grad(o_ref.float().square().sum(), (q, k, v))
        for a, b in zip((o, *grads), (o_ref, *grads_ref)):
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2, D


@gpu
def test_flash_train_matches_sdpa():
    import re

    def losses(attn, *extra):
        proc = run("train.py", "--model", "tiny", "--attn", attn, "--steps", "8", "--batch", "4", "--seq", "128",
                   "--bf16", "--device", "cuda", *extra, timeout=600)
        values = [float(m.group(1)) for line in proc.stdout.splitlines() if line.startswith("step") and "val" not in line
                  for m in [re.search(r"\bloss[ :=]+([0-9.]+)", line)] if m]
        assert values, proc.stdout[-2000:]
        return values

    ref = losses("sdpa")
    for ours in (losses("triton"), losses("triton", "--compile")):  # Inductor launches the kernels itself
        assert len(ours) == len(ref)
        assert all(abs(a - b) < 0.05 * abs(b) + 0.02 for a, b in zip(ours, ref)), (ours, ref)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    tests = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
    if "-h" in argv or "--help" in argv:
        print("usage: python test_all.py [--gpu-only] [SUBSTRING ...]\n\nRuns every test whose name contains "
              "one of the substrings (all tests without any); --gpu-only keeps the CUDA ones. Tests:")
        print("\n".join(f"  {n}{'  (CUDA)' if getattr(f, 'needs_cuda', False) else ''}" for n, f in tests))
        return
    gpu_only = "--gpu-only" in argv
    only = [a for a in argv if a != "--gpu-only"]
    if unknown := [a for a in only if a.startswith("-")]:
        print(f"error: unknown option {unknown[0]}; see python test_all.py --help", file=sys.stderr)
        sys.exit(2)
    tests = [(n, f) for n, f in tests if not only or any(s in n for s in only)]
    tests = [(n, f) for n, f in tests if not gpu_only or getattr(f, "needs_cuda", False)]
    if not tests:
        print(f"error: no test matches {' '.join(only) or '--gpu-only'}; python test_all.py --help lists them",
              file=sys.stderr)
        sys.exit(2)
    passed = failed = skipped = 0
    start_all = time.time()
    for name, test in tests:
        if getattr(test, "needs_cuda", False) and not HAS_CUDA:
            skipped += 1
            continue
        start = time.time()
        try:
            test()
            passed += 1
            print(f"PASS {name} ({time.time() - start:.1f}s)", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name} ({time.time() - start:.1f}s)\n{traceback.format_exc()}", flush=True)
    print(f"({time.time() - start_all:.0f} s; {skipped} CUDA tests skipped)" if skipped else
          f"({time.time() - start_all:.0f} s)")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
