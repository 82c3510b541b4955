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


# --- 2. train.py: learning, checkpoints, DDP, bad input


def train_lines(*args):
    """Run train.py on the CPU and return its per-step loss lines and val losses."""
    out = run("train.py", "--device", "cpu", *args).stdout
    losses = [ln.split("|")[1].split()[1] for ln in out.splitlines() if "| loss" in ln]
    vals = [float(ln.split()[-1]) for ln in out.splitlines() if "val loss" in ln]
    return losses, vals, out


def test_train_cpu_lowers_val_loss():
    losses, vals, out = train_lines("--steps", "30", "--eval-every", "10", "--eval-steps", "4")
    assert out.startswith("device: cpu"), out[:200]
    assert len(losses) == 30 and len(vals) == 3
    steps = [int(ln.split("|")[0].split()[1]) for ln in out.splitlines() if "| loss" in ln]
    assert steps == list(range(30)), steps  # one line per step, in order, none lost to the pipelining
    assert vals[-1] < vals[0] - 0.5, vals
    assert "summary: median step" in out


def test_checkpoint_resume_is_exact():
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--steps", "8", "--eval-every", "4", "--batch", "2", "--seq", "32", "--warmup", "2"]
        whole, _, _ = train_lines(*common, "--ckpt", f"{tmp}/a.pt")
        first, _, _ = train_lines(*common, "--ckpt", f"{tmp}/b.pt", "--stop-after", "4")
        second, _, out = train_lines(*common, "--ckpt", f"{tmp}/b.pt", "--resume")
        assert "resumed from" in out and len(first) == 4 and len(second) == 4
        assert first + second == whole
        a = torch.load(f"{tmp}/a.pt", weights_only=False)
        b = torch.load(f"{tmp}/b.pt", weights_only=False)
        assert a["step"] == b["step"] == 8 and a["pos"] == b["pos"]
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), k


def test_train_ddp_matches_single_process():
    """torchrun with 2 CPU ranks (gloo) x batch 2 trains like one process with batch 4: each rank
    reads its own rows of the same token window and DDP averages the gradients."""
    common = ["--steps", "4", "--seq", "32", "--eval-every", "100", "--device", "cpu"]
    single, _, _ = train_lines(*common, "--batch", "4")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_port=29533", "train.py", *common, "--batch", "2"],
                          cwd=HERE, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = [ln.split("|")[1].split()[1] for ln in proc.stdout.splitlines() if "| loss" in ln]
    assert "x 2 processes" in proc.stdout and len(ddp) == 4
    for a, b in zip(single, ddp):
        assert abs(float(a) - float(b)) < 2e-3, (single, ddp)


def test_fused_clipping_matches_clip_grad_norm():
    """train.clip_gradients with a fused AdamW (the clip applied inside the optimizer's kernel) steps
    like clip_grad_norm_ followed by the same optimizer. Two steps: a clipped one, then an unclipped
    one; with a single step Adam's scale invariance would hide a missing clip."""
    import train

    def params_after(clip):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        gen = torch.Generator().manual_seed(1)
        for scale in (10.0, 0.01):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen) * scale
            clip(model, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    ref = params_after(lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    ours = params_after(lambda m, o: train.clip_gradients(m, o, 1.0))
    unclipped = params_after(lambda m, o: None)
    assert (ours - ref).abs().max() < 1e-6 < (unclipped - ref).abs().max() / 100


def test_train_bad_input():
    assert_bad_input("train.py", "--model", "gpt5", says="unknown model")
    assert_bad_input("train.py", "--model", "gpt2", "--seq", "2048", says="block size")
    assert_bad_input("train.py", "--vocab", "50000", says="below the tokenizer")
    assert_bad_input("train.py", "--bf16", "--fp16", "--device", "cpu", says="exclusive")
    assert_bad_input("train.py", "--batch", "0", says="--batch must be positive")
    assert_bad_input("train.py", "--resume", "--ckpt", "/nonexistent.pt", says="--resume needs")
    if not HAS_CUDA:
        assert_bad_input("train.py", "--fp16", says="needs a CUDA GPU")
        assert_bad_input("train.py", "--device", "cuda", says="no CUDA GPU")


def test_train_stops_on_nan_loss():
    proc = run("train.py", "--device", "cpu", "--lr", "1e9", "--warmup", "1", "--steps", "10", "--batch", "2",
               "--seq", "32", check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("stopped: loss is") and "at step" in last and "learning rate" in last, last
    # the step it names is the first non-finite one: every step before it printed a finite loss
    bad_step = int(last.split("at step")[1].split(";")[0])
    finite = [float(ln.split("|")[1].split()[1]) for ln in proc.stdout.splitlines() if "| loss" in ln]
    assert len(finite) == bad_step and all(math.isfinite(v) for v in finite), proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr


def test_train_missing_input_txt():
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("gpt.py", "train.py"):
            with open(os.path.join(HERE, name)) as src, open(os.path.join(tmp, name), "w") as dst:
                dst.write(src.read())
        os.symlink(os.path.join(HERE, "gpt2_bpe"), os.path.join(tmp, "gpt2_bpe"))
        proc = subprocess.run([sys.executable, "train.py", "--device", "cpu", "--steps", "1"], cwd=tmp,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "input.txt is missing" in proc.stderr, proc.stderr


@gpu
def test_train_gpu_bf16_compile():
    out = run("train.py", "--vocab", "50304", "--bf16", "--compile", "--steps", "30", "--batch", "8",
              "--seq", "256", "--eval-every", "15").stdout
    vals = [float(ln.split()[-1]) for ln in out.splitlines() if "val loss" in ln]
    assert len(vals) == 2 and vals[1] < vals[0], out[-2000:]
    assert "GiB" in out.splitlines()[-1] and "MFU" in out


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
def test_train_gpu_fp16_scaler():
    out = run("train.py", "--fp16", "--steps", "20", "--batch", "8", "--seq", "256", "--eval-every", "10").stdout
    vals = [float(ln.split()[-1]) for ln in out.splitlines() if "val loss" in ln]
    assert len(vals) == 2 and vals[1] < vals[0], out[-2000:]


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


# --- 4. precision.py: IEEE accumulation, autocast capture, LayerNorm overflow

def test_precision_cpu_sections_run():
    # default sections (every one the machine supports); small models keep a GPU run short
    proc = run("precision.py", "--model", "tiny", "--models", "tiny", "--steps", "2")
    out = proc.stdout
    for n, name in enumerate(("formats", "accumulate", "autocast", "layernorm", "tf32"), 1):
        assert f"== {n}. {name}" in out, out
    assert out.count("takeaway") >= 5, out
    if not HAS_CUDA:
        assert out.count("skipped: needs CUDA") == 2, out
        assert "n/a (TF32 is CUDA-only)" in out, out
    assert "Traceback" not in proc.stderr, proc.stderr


def test_precision_accumulate_matches_ieee():
    import numpy as np
    from precision import accumulate, ulp

    # fp16 accumulator: every step rounds to the nearest float16, exactly as numpy's float16 does
    r = accumulate(0.01, 1000, torch.float16)
    acc, x = np.float16(0), np.float16(0.01)
    for _ in range(1000):
        acc = np.float16(acc + x)
    assert r["total"] == float(acc) and r["total"] != 10.0, (r, acc)
    # fp32 accumulator fed fp16 addends: fp32 sums of the rounded addend, in either cast style
    acc32 = np.float32(0)
    for _ in range(1000):
        acc32 = np.float32(acc32 + np.float32(x))
    for cast in ("implicit", "explicit"):
        r = accumulate(0.01, 1000, torch.float32, torch.float16, cast)
        assert r["dtype"] == torch.float32 and r["total"] == float(acc32), (cast, r, acc32)
    # a 1-element slice outranks the 0-dim fp32 sum in type promotion: the sum becomes fp16
    r = accumulate(0.01, 1000, torch.float32, torch.float16, "slice")
    assert r["dtype"] == torch.float16 and r["total"] == float(acc)
    # 0.001 x 10000 in fp16 stalls, and at the stall the addend is at most half an ulp
    r = accumulate(0.001, 10000, torch.float16)
    acc = np.float16(0)
    for _ in range(10000):
        acc = np.float16(acc + np.float16(0.001))
    assert r["total"] == float(acc) and r["stall_step"] is not None
    assert float(np.float16(0.001)) <= ulp(r["stall_value"], torch.float16) / 2
    assert float(np.spacing(acc)) == ulp(r["stall_value"], torch.float16)


def test_precision_autocast_capture_cpu():
    from precision import autocast_dtypes

    seen = autocast_dtypes(torch.device("cpu"), torch.bfloat16)
    assert seen["fc1 output"] == torch.bfloat16, seen
    assert seen["grad of fc1 output"] == torch.bfloat16, seen
    assert seen["fc1.weight inside context"] == torch.float32, seen
    assert seen["fc1.weight.grad"] == torch.float32, seen
    assert seen["loss (cross_entropy)"] == torch.float32, seen


def test_precision_layernorm_fp16_overflow():
    from precision import layernorm_case

    big = layernorm_case(0.0, 1000.0)
    assert big["fp16_overflow"] and not big["bf16_overflow"], big
    assert big["max_x2"] > 65504
    small = layernorm_case(0.0, 1.0)
    assert not small["fp16_overflow"] and small["fp16_err"] < 0.05, small
    proc = run("precision.py", "--only", "layernorm")
    assert "overflow" in proc.stdout.split("fp16 x^2 > 65504")[1], proc.stdout


def test_precision_bad_only():
    assert_bad_input("precision.py", "--only", "nosuch", says="unknown section 'nosuch'")
    assert_bad_input("precision.py", "--only", "formats,nosuch", says="choose from")


@gpu
def test_precision_gpu_sections():
    proc = run("precision.py", "--only", "autocast,tf32,gradscaler", "--model", "tiny", "--batch", "4",
               "--seq", "256", "--steps", "3")
    out = proc.stdout
    assert "autocast fp16 on cuda" in out and "skipped: needs CUDA" not in out, out
    assert out.count("takeaway") >= 4 and "OOM" not in out, out
    assert "GradScaler" in out, out


# --- 5. bench_e2e.py: modes, compare, ladder, profile, OOM

# One thread: on a small shared CPU box, PyTorch's thread pool spinning against other processes
# makes these tiny steps tens of times slower.
_BENCH_E2E_ENV = {"OMP_NUM_THREADS": "1"}
_BENCH_E2E_FAST = ("--steps", 1, "--warmup", 0)


def _bench_e2e_table(text, first_header):
    """The aligned table whose header line starts with first_header, as a list of dicts (cells
    cut at the positions of the dashes under the header), up to the next blank line."""
    import re

    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(first_header))
    spans = [m.span() for m in re.finditer(r"-+", lines[i + 1])]
    headers = [lines[i][a:b].strip() for a, b in spans]
    rows = []
    for line in lines[i + 2:]:
        if not line.strip():
            break
        rows.append(dict(zip(headers, (line[a:b].strip() for a, b in spans))))
    return rows


def test_bench_e2e_modes_compare_and_batch_sweep():
    out = run("bench_e2e.py", "--model", "tiny", "--mode", "all", "--compare", "flash", "--batch", "1,2",
              "--seq", 16, *_BENCH_E2E_FAST, env=_BENCH_E2E_ENV).stdout
    assert out.splitlines()[0].startswith("device: CPU"), out
    rows = [r for r in _bench_e2e_table(out, "config") if r["config"].startswith("tiny")]
    assert len(rows) == 2 * 2 * 3, out  # variants x batches x modes
    assert {r["mode"] for r in rows} == {"forward", "forward-backward", "train"}
    for r in rows:
        mean = float(r["ms (mean ± std, 1 steps)"].split("±")[0])
        # tokens/s must be batch * seq over the mean step time (to the printed rounding)
        expected = int(r["batch"]) * int(r["seq"]) / (mean / 1e3)
        assert abs(float(r["tokens/s"].replace(",", "")) - expected) <= 0.01 * expected + 1, r
        assert r["MFU"] == "n/a" and r["peak alloc (GiB)"] == "n/a", r  # no GPU: not faked
        if "flash" in r["config"]:
            assert r["speedup vs first config"].endswith("x") and float(r["speedup vs first config"][:-1]) > 0, r
        else:
            assert r["speedup vs first config"] == "1.00x", r
    assert "speed of the first config" in out.strip().splitlines()[-1]


def test_bench_e2e_warmup_study_vocab_and_gemm():
    out = run("bench_e2e.py", "--d-model", 64, "--layers", 1, "--heads", 2, "--mode", "forward",
              "--warmup", "0,1", "--vocab", "50257,50304", "--batch", 1, "--seq", 16, "--steps", 2,
              env=_BENCH_E2E_ENV).stdout
    rows = _bench_e2e_table(out, "config")
    rows = [r for r in rows if r["config"].startswith("d64L1")]
    assert "speedup vs first config" not in rows[0]  # only --compare adds it
    assert sorted((r["config"].split("V=")[1], r["warm-up"]) for r in rows) == \
        [("50257", "0"), ("50257", "1"), ("50304", "0"), ("50304", "1")], out
    assert all(float(r["first ms"]) > 0 and float(r["max ms"]) >= float(r["first ms"]) for r in rows), out
    gemm = _bench_e2e_table(out, "vocab")
    by_vocab = {int(r["vocab"]): r for r in gemm}
    assert {50257, 50304, 50432} <= set(by_vocab), out
    assert by_vocab[50257]["vs 50257"] == "1.00x"
    assert by_vocab[50304]["largest 2^k factor"] == "128" and by_vocab[50257]["largest 2^k factor"] == "1"


def test_bench_e2e_profile_and_trace():
    trace = os.path.join(tempfile.mkdtemp(), "step.json")
    out = run("bench_e2e.py", "--model", "tiny", "--mode", "forward", "--attn", "naive", "--profile",
              "--trace", trace, "--batch", 1, "--seq", 16, *_BENCH_E2E_FAST, env=_BENCH_E2E_ENV).stdout
    assert "CPU time" in out  # says that on a CPU the profile is of CPU ops, not GPU kernels
    for title in ("forward CPU ops", "train step CPU ops"):
        ops = _bench_e2e_table(out[out.index(title):], "name")
        assert len(ops) == 10 and all(r["name"] and r["calls/step"] for r in ops), out
        shares = [float(r["share"][:-1]) for r in ops]
        assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 100.5, out
    assert any(r["name"] in ("aten::mm", "aten::addmm") for r in _bench_e2e_table(out, "name")), out
    cats = {r["category"]: r for r in _bench_e2e_table(out, "category")}
    assert {"matmul", "optimizer", "elementwise+norm"} <= set(cats), out
    assert cats["optimizer"]["forward ms/step"] == "0.000"  # no AdamW in a forward pass
    assert abs(sum(float(r["train step share"][:-1]) for r in cats.values()) - 100) < 0.5, out
    stages = _bench_e2e_table(out, "stage")
    assert [r["stage"] for r in stages] == ["attention scores", "softmax", "final matmul"], out
    assert float(stages[1]["FLOP share"][:-1]) < float(stages[2]["FLOP share"][:-1])
    import json

    with open(trace) as f:
        assert json.load(f)["traceEvents"]


def test_bench_e2e_ladder_cpu_form():
    out = run("bench_e2e.py", "--ladder", "--batch", 1, "--seq", 16, *_BENCH_E2E_FAST, env=_BENCH_E2E_ENV).stdout
    rungs = _bench_e2e_table(out, "rung")
    assert [r["rung (train step, B=1 T=16)"].split(",")[0] for r in rungs] == [
        "fp32", "+ TF32 matmuls", "+ bf16 autocast", "+ SDPA flash attention", "+ vocab 50304",
        "+ torch.compile"], out
    timed = [r for r in rungs if not r["ms/step (mean ± std, 1 steps)"].startswith("skipped")]
    skipped = [r for r in rungs if r not in timed]
    assert len(timed) == 4 and len(skipped) == 2, out  # TF32 and compile need CUDA here
    assert all(r["tokens/s"] == "-" for r in skipped)
    assert timed[0]["vs fp32"] == "1.00x" and timed[0]["vs previous"] == "-"
    assert all(float(r["vs fp32"][:-1]) > 0 for r in timed)
    assert out.strip().splitlines()[-1].startswith("ladder:")


def test_bench_e2e_bad_input():
    assert_bad_input("bench_e2e.py", "--model", "huge", says="unknown model")
    assert_bad_input("bench_e2e.py", "--model", "tiny", "--seq", 1000, says="above the block size")
    assert_bad_input("bench_e2e.py", "--batch", 0, says="--batch must be at least 1")


@gpu
def test_bench_e2e_gpu_sweep():
    out = run("bench_e2e.py", "--model", "tiny", "--batch", "4,8", "--seq", 128, "--compare", "bf16",
              "--steps", 3, "--warmup", 1).stdout
    rows = [r for r in _bench_e2e_table(out, "config") if r["config"].startswith("tiny")]
    assert len(rows) == 2 * 2 * 3, out
    for r in rows:
        assert r["MFU"].endswith("%") and float(r["peak alloc (GiB)"]) > 0, r
    peak = {(r["config"], r["batch"], r["mode"]): float(r["peak alloc (GiB)"]) for r in rows}
    for config, batch, mode in peak:
        # backward starts with every saved activation plus the logits' gradient alive, and a
        # train step adds AdamW's state: peaks grow with the mode and with the batch
        assert peak[(config, batch, "train")] >= peak[(config, batch, "forward-backward")] > peak[(config, batch, "forward")], out
        assert peak[(config, "8", mode)] > peak[(config, "4", mode)], out


@gpu
def test_bench_e2e_gpu_oom_row_then_next_runs():
    # B=256 T=256 needs ~13 GiB for the fp32 logits alone; 5% of an 80 GiB GPU is 4 GiB
    out = run("bench_e2e.py", "--model", "tiny", "--mode", "forward", "--batch", "256,2", "--seq", 256,
              "--memory-fraction", 0.05, "--steps", 2, "--warmup", 1).stdout
    rows = {r["batch"]: r for r in _bench_e2e_table(out, "config") if r["config"].startswith("tiny")}
    assert rows["256"]["ms (mean ± std, 2 steps)"] == "OOM", out
    assert float(rows["2"]["ms (mean ± std, 2 steps)"].split("±")[0]) > 0, out
    assert "1 OOM" in out.strip().splitlines()[-1]


# --- 6. memory.py: accounting, residuals, checkpointing, max batch, parallel

def _memory_tiny(B=1, T=16):
    import memory
    from gpt import GPT, make_config
    torch.manual_seed(0)
    cfg = make_config("tiny")
    return memory, cfg, GPT(cfg), *memory.random_batch(cfg, B, T, "cpu")


def test_memory_account_state_bytes():
    """Parameters, gradients and AdamW state predicted from the config alone equal the bytes of
    the real tensors after one AdamW step."""
    from gpt import configure_optimizer
    memory, cfg, model, x, y = _memory_tiny()
    opt = configure_optimizer(model, lr=1e-3)
    memory.train_step(model, opt, x, y, None, "cpu")
    pred = memory.account(cfg, 1, 16, None, "cpu")["state"]
    real = memory.tensor_state_bytes(model, opt)
    assert list(pred.values()) == list(real), (pred, real)
    assert pred["parameters"] == 4 * model.num_params()


def test_memory_account_saved_activations():
    """The per-layer formula (plus head) equals what saved_tensors_hooks see, fp32 and bf16,
    SDPA and naive attention."""
    memory, cfg, model, x, y = _memory_tiny(B=2, T=24)
    for attn in ("sdpa", "naive"):
        model.config.attn = attn
        for dtype in (None, torch.bfloat16):
            measured = memory.saved_bytes(model, lambda: model(x, y)[1], dtype, "cpu", model.parameters())
            pred = memory.account(model.config, 2, 24, dtype, "cpu")["saved"]
            assert pred == measured, (attn, dtype, pred, measured)


def test_memory_residuals_rows_sum():
    out = run("memory.py", "residuals", "--batch", "1", "--seq", "16").stdout
    lines = out.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("---")) + 1
    end = next(i for i, l in enumerate(lines) if l.startswith("block total (eager")) + 1
    cells = [l.rsplit(None, 3) for l in lines[start:end]]
    table = {c[0]: int(c[1].replace(",", "")) for c in cells}
    total = table.pop("block total (eager, hooks)")
    assert total > 0 and sum(table.values()) == total, (table, total)
    assert any("Gelu" in k for k in table) and any("LayerNorm" in k for k in table), table


def test_memory_checkpoint_grads_equal():
    """Checkpointing groups of 3 blocks (4 layers: one full group, one partial) gives the plain
    model's gradients."""
    memory, cfg, model, x, y = _memory_tiny()
    diff = memory.checkpoint_grads_match(model, 3, x, y, None, "cpu")
    assert diff <= 1e-6, diff
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.h[0].parameters())
    assert memory.group_sizes(48) == [1, 2, 4, 7, 8, 16, 32]


def test_memory_parallel_worked_example():
    import memory
    n = 126 * 2 * 16384 * 53248
    out = run("memory.py", "parallel").stdout
    assert "219,848,638,464 parameters" in out and "3,518 GB" in out, out
    assert f"{-(-n * 16 // (80 * 10**9))} GPUs of 80 GB" in out, out
    assert f"N_FSDP = {-(-n * 16 // (95 * 10**9))} devices of 95 GB" in out, out
    # per-device bytes: DP replicates 16 B/param, ZeRO-1/2/3 divide 8, then 8+4, then all 16 by N
    for stage, sharded in enumerate((0, 8, 12, 16)):
        assert memory.per_device_bytes(n, 8, stage) == n * (16 - sharded) + n * sharded / 8
    assert memory.per_device_bytes(n, 4, 3, act_bytes=40, shard_acts=True) == n * 4 + 10
    assert f"{memory.per_device_bytes(n, 8, 2) / 1e9:,.1f}" in out


def test_memory_max_batch_fake_budget():
    import memory
    from gpt import make_config
    cfg = make_config("gpt2")
    peak = lambda B: memory.account(cfg, B, 1024, torch.bfloat16, "cuda")["peak"]
    assert peak(6) > peak(5) > peak(1)
    assert memory.predict_max_batch(cfg, 1024, torch.bfloat16, peak(5)) == 5
    assert memory.predict_max_batch(cfg, 1024, torch.bfloat16, peak(37) - 1) == 36
    assert memory.predict_max_batch(cfg, 1024, torch.bfloat16, peak(1) - 1) == 0
    out = run("memory.py", "max-batch", "--model", "gpt2", "--seq", "1024", "--bf16",
              "--budget-gib", f"{peak(12) / 2**30:.6f}").stdout
    assert "predicted largest batch 12" in out, out


def test_memory_bad_input():
    assert_bad_input("memory.py", "nonsense", says="unknown part")
    assert_bad_input("memory.py", "account", "--model", "tiny", "--seq", "4096", says="block size")


@gpu
def test_memory_peak_runs():
    out = run("memory.py", "peak", "--model", "gpt2", "--batch", "2").stdout
    assert out.count("gpt2 T=") >= 8 and "step peak GiB" in out, out


@gpu
def test_memory_snapshot_files():
    with tempfile.TemporaryDirectory() as d:
        out = run("memory.py", "snapshot", "--model", "gpt2", "--seq", "256", "--batch", "4",
                  "--bf16", "--steps", "2", "--out", d).stdout
        for name in ("snapshot.pickle", "summary.txt"):
            assert os.path.getsize(os.path.join(d, name)) > 0, out
        assert "backward" in out and "allocated at" in out, out


@gpu
def test_memory_account_matches_measured():
    for flag in ([], ["--bf16"]):
        out = run("memory.py", "account", "--model", "gpt2", "--seq", "256", "--batch", "4", *flag).stdout
        line = [l for l in out.splitlines() if l.startswith("measured peak")][0]
        err = float(line.rsplit("error ", 1)[1].rstrip("%"))
        assert abs(err) <= 10, out


def _memory_live_peaks(model, opt, x, y, dtype):
    """Peak bytes of live tensor storages per phase of a second training step on the CPU,
    tracked op by op with a dispatch mode (a stand-in for the CUDA allocator's statistics)."""
    import weakref
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    import memory
    live, state = {}, {"cur": 0, "peak": 0}

    def track(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in live:
            st = t.untyped_storage()
            live[st.data_ptr()] = st.nbytes()
            state["cur"] += st.nbytes()
            state["peak"] = max(state["peak"], state["cur"])
            weakref.finalize(st, lambda k=st.data_ptr(): state.__setitem__("cur", state["cur"] - live.pop(k, 0)))

    class Tracker(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                track(t)
            return out

    peaks = {}

    def mark(phase):
        peaks[phase] = state["peak"]
        state["peak"] = state["cur"]

    with Tracker():
        for t in [*model.parameters(), x, y] + [v for s in opt.state.values() for v in s.values()]:
            track(t)
        state["peak"] = state["cur"]
        memory.train_step(model, opt, x, y, dtype, "cpu", marks=mark)
    return peaks


def test_memory_account_phases_match_live_bytes():
    """The predicted forward-end and backward peaks equal the live tensor bytes of a real step,
    once where the end of backward is the peak (16 B/param) and once the start (activations)."""
    from gpt import configure_optimizer
    phases = set()
    for B, T, dtype in ((1, 32, None), (4, 64, torch.bfloat16)):
        memory, cfg, model, x, y = _memory_tiny(B, T)
        opt = configure_optimizer(model, lr=1e-3)
        memory.train_step(model, opt, x, y, None, "cpu")  # the first step creates AdamW's state
        peaks = _memory_live_peaks(model, opt, x, y, dtype)
        pred = memory.account(cfg, B, T, dtype, "cpu")
        backward = max(v for k, v in pred["totals"].items() if "backward" in k)
        assert abs(peaks["forward"] / pred["totals"]["forward end"] - 1) < 0.002, (peaks, pred["totals"])
        assert abs(peaks["backward"] / backward - 1) < 0.002, (peaks, pred["totals"])
        phases.add(pred["peak_phase"])
    assert phases == {"backward start", "backward end"}, phases


# --- 7. ddp.py: DDP classes equal one process, sharded optimizer, all-reduce

def test_ddp_wrappers_match_one_process():
    """Every wrapper on 2 gloo ranks, each on its half of every batch, ends with the weights of one
    process trained on the whole batch (recomputed here); ranks start from different seeds but
    agree right after construction; the frozen layer stays put and the tied pair stays tied;
    ShardedOptimizer (AdamW, weight decay, a group added after construction) equals plain AdamW
    while each rank holds only part of the state."""
    import ddp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "weights.pt")
        run("ddp.py", "selftest", "--world", 2, "--backend", "gloo", "--timeout", 60, "--save", path,
            timeout=240)
        saved = torch.load(path)
    assert set(saved["variants"]) == set(ddp.TOY_VARIANTS)
    for name, v in saved["variants"].items():
        tol = ddp.TOY_VARIANTS[name][-1]
        initial, final = v["initial"], v["final"]
        for key in initial[0]:
            assert torch.equal(initial[0][key], initial[1][key]), f"{name}: ranks differ in {key} at start"
        reference = ddp.ToyModel()
        reference.load_state_dict(initial[0])
        ddp.train_toy(reference, ddp.toy_optimizer(reference, v["optimizer"]), saved["steps"])
        for rank, state in enumerate(final):
            for key, w in reference.state_dict().items():
                torch.testing.assert_close(state[key], w, atol=tol, rtol=0, msg=f"{name} rank {rank} {key}")
            assert torch.equal(state["frozen.weight"], initial[0]["frozen.weight"]), name
            assert torch.equal(state["out.weight"], state["embed.weight"]), name
            assert not torch.equal(state["hidden.weight"], initial[0]["hidden.weight"]), f"{name} did not train"
    held = saved["variants"]["sharded-adamw"]["state_held"]
    trainable = sum(p.numel() for p in reference.parameters() if p.requires_grad)
    assert sum(held) == trainable and max(held) < trainable, held


def test_ddp_allreduce_tiny():
    """The all-reduce table runs at tiny sizes on 2 gloo ranks; with 2 ranks the bus bandwidth
    factor 2(n-1)/n is 1, so busbw equals algbw."""
    proc = run("ddp.py", "allreduce", "--world", 2, "--backend", "gloo", "--sizes", "4K,64K", "--reps", 3,
               "--warmup", 1, "--timeout", 60, timeout=180)
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("2 ")]
    assert [r[1:3] for r in rows] == [["4", "KiB"], ["64", "KiB"]], proc.stdout
    for r in rows:
        ms, algbw, busbw = map(float, r[-3:])
        assert ms > 0 and busbw == algbw
    assert "2(n-1)/n" in proc.stdout and proc.stdout.splitlines()[-1].startswith("summary:")


def test_ddp_benchmark_cpu_smoke():
    """The benchmark runs each chosen wrapper and torch's DDP in one run and prints a row each."""
    proc = run("ddp.py", "benchmark", "--world", 2, "--backend", "gloo", "--variants", "local,torch,bucket,sharded",
               "--steps", 1, "--warmup", 0, "--seq", 16, "--timeout", 60, timeout=240)
    lines = proc.stdout.splitlines()
    for label in ("local (no comm)", "torch DDP", "BucketDDP", "BucketDDP bf16 comm", "BucketDDP + ShardedOpt"):
        row = next((line for line in lines if line.startswith(label + "  ")), None)
        assert row is not None, f"no row for {label}:\n{proc.stdout}"
        step_ms = float(row[len(label):].split()[4])
        assert step_ms > 0
    assert lines[-1].startswith("summary: BucketDDP"), lines[-1]


def test_ddp_bad_launch_args():
    assert_bad_input("ddp.py", "benchmark", "--world", "0", says="--world must be at least 1")
    assert_bad_input("ddp.py", "allreduce", "--sizes", "3B", says="not a whole number")
    if HAS_CUDA:
        n = torch.cuda.device_count()
        assert_bad_input("ddp.py", "benchmark", "--world", n + 1, says=f"more than the {n} GPUs")
    else:
        assert_bad_input("ddp.py", "selftest", "--backend", "nccl", says="nccl needs CUDA")


@gpu
def test_ddp_selftest_nccl():
    """The same agreement on GPUs over NCCL (ReduceOp.AVG, CUDA streams); the script compares
    against a one-process run on the same GPU and exits 1 on any mismatch."""
    world = min(2, torch.cuda.device_count())
    proc = run("ddp.py", "selftest", "--world", world, "--backend", "nccl", "--timeout", 120, timeout=300)
    assert "7 of 7 variants match" in proc.stdout, proc.stdout


@gpu
def test_ddp_benchmark_gpu_smoke():
    """The GPU paths of the benchmark (CUDA events, memory figures, fused AdamW, torch's bf16
    hook) run for every variant on a small model; every row has numbers, none OOM."""
    world = min(2, torch.cuda.device_count())
    proc = run("ddp.py", "benchmark", "--world", world, "--model", "tiny", "--batch", 2, "--seq", 64,
               "--steps", 2, "--warmup", 1, "--timeout", 120, timeout=300)
    table = proc.stdout.split("-----")[-1]
    assert "OOM" not in table and "n/a" not in table.split("median over steps")[0], proc.stdout
    assert "BucketDDP bf16 comm" in proc.stdout and "torch DDP bf16 comm" in proc.stdout


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
