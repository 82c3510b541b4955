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
    """Run `python script args...` from the repo root; return the CompletedProcess. With
    check=True a non-zero exit fails the test and shows the script's output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), *map(str, args)], cwd=HERE,
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(map(str, args))} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def assert_bad_input(script, *args, says):
    """The script rejects the arguments with exit status 2, no traceback, and a message
    containing `says`."""
    proc = run(script, *args, check=False, timeout=300)
    assert proc.returncode == 2, f"{script} {args}: exit {proc.returncode}, expected 2\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert says.lower() in proc.stderr.lower(), f"expected '{says}' in: {proc.stderr}"


# --- 1. gpt.py: presets, tokenizer, vocabulary padding, attention toggles

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
    assert gpt.GPT(gpt.make_config("gpt2")).num_params() == 124_439_808  # GPT-2 124M, as published


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    config = gpt.make_config("tiny", vocab_size=50304)
    model = gpt.GPT(config)
    idx, targets = torch.randint(0, gpt.GPT2_VOCAB, (2, 2, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 16, 50304)
    assert abs(loss.item() - math.log(50304)) < 0.5  # near-uniform predictions at init
    assert model(idx)[1] is None
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
    plain_forward = model.forward

    def forward_favouring_padding(idx, targets=None):  # padded tokens get by far the top logits
        logits, loss = plain_forward(idx, targets)
        logits[..., gpt.GPT2_VOCAB:] += 100.0
        return logits, loss

    model.forward = forward_favouring_padding
    out = model.generate(torch.zeros(2, 1, dtype=torch.long), 20)
    assert out.shape == (2, 21) and out.max().item() < gpt.GPT2_VOCAB


def attention_matches_naive(impl, device, dtype, tol):
    """Logits and gradients of a tiny GPT with attention `impl` agree with naive attention.
    Returns False if the implementation cannot run here (e.g. a CUDA-only SDPA backend)."""
    results = {}
    for name in ("naive", impl):
        torch.manual_seed(0)
        model = gpt.GPT(gpt.make_config("tiny", attn=name)).to(device)
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
    print(f"  agree with naive on the CPU: {', '.join(checked)}")


@gpu
def test_attention_toggles_agree_gpu():
    for impl in ("sdpa", "flash", "cudnn", "efficient", "math"):
        assert attention_matches_naive(impl, "cuda", torch.bfloat16, 3e-2), impl
        assert attention_matches_naive(impl, "cuda", None, 1e-2) or impl in ("flash", "cudnn"), impl


def test_config_errors():
    for kwargs, says in [({"vocab_size": 50000}, "below"), ({"attn": "nope"}, "unknown attention")]:
        try:
            gpt.make_config("tiny", **kwargs)
            raise AssertionError(f"{kwargs} accepted")
        except ValueError as e:
            assert says in str(e)
    try:
        gpt.make_config("gpt5")
        raise AssertionError("unknown preset accepted")
    except ValueError as e:
        assert "unknown model" in str(e)


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
def test_train_gpu_fp16_scaler():
    out = run("train.py", "--fp16", "--steps", "20", "--batch", "8", "--seq", "256", "--eval-every", "10").stdout
    vals = [float(ln.split()[-1]) for ln in out.splitlines() if "val loss" in ln]
    assert len(vals) == 2 and vals[1] < vals[0], out[-2000:]


# --- 3. bench_attention.py: sweep, saved-bytes model, labels, OOM

def _bench_attention_table(stdout, title):
    """The table printed under the line starting with `title`, as {(D, S): {header: cell}};
    columns are cut at the dash rule, since headers and cells may contain spaces."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    spans, col = [], 0
    for dashes in lines[start + 2].split("  "):
        spans.append((col, col + len(dashes)))
        col += len(dashes) + 2
    cut = lambda line: [line[a:b].strip() for a, b in spans]
    headers, rows = cut(lines[start + 1]), {}
    for line in lines[start + 3:]:
        if not line[:1].isdigit():
            break
        cells = dict(zip(headers, cut(line)))
        rows[(int(cells["D"]), int(cells["S"]))] = cells
    return rows


def test_bench_attention_cpu_sweep():
    args = ["--impl", "naive,flash,efficient,math,triton", "--d", "16,32", "--seq", "32,64", "--steps", "2",
            "--warmup", "1", "--dtype", "fp32", "--causal"]
    out = run("bench_attention.py", *args).stdout
    fwd = _bench_attention_table(out, "forward, ms")
    bwd = _bench_attention_table(out, "backward, ms")
    assert set(fwd) == set(bwd) == {(16, 32), (16, 64), (32, 32), (32, 64)}, out
    for table in (fwd, bwd):
        for row in table.values():
            float(row["naive"].split("±")[0])  # a number, not OOM / n/a
            float(row["math"].split("±")[0])
            if not HAS_CUDA:
                assert row["efficient"] == "n/a", row  # a CUDA-only backend is n/a, not a crash
    assert "n/a efficient:" in out or HAS_CUDA, out
    # memory accounting: prediction from the shapes equals what autograd saved, for every row
    acct = _bench_attention_table(out, "naive attention memory")
    assert set(acct) == set(fwd), out
    assert all(row["saved pred"] == row["saved hooks"] for row in acct.values()), out
    assert out.strip().splitlines()[-1].startswith("summary:"), out
    suite = run("bench_attention.py", "--suite", "flash", "--impl", "naive,math", "--d", "16", "--seq", "64,128",
                "--dtype", "fp32").stdout
    both = _bench_attention_table(suite, "fp32 fwd+bwd")
    assert set(both) == {(16, 64), (16, 128)} and all("(" in row["naive"] for row in both.values()), suite


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


def test_bench_attention_compiled_label():
    out = run("bench_attention.py", "--impl", "compiled", "--d", "16", "--seq", "32", "--steps", "1",
              "--warmup", "0", "--dtype", "fp32").stdout
    cell = _bench_attention_table(out, "forward, ms")[(16, 32)]["compiled"]
    rewrote = "Inductor rewrote the naive attention into SDPA" in out
    assert rewrote or "no SDPA op in the profile" in out, out
    assert cell.endswith("*") == rewrote, out  # the table's mark agrees with what the profiler saw


def test_bench_attention_bad_input():
    assert_bad_input("bench_attention.py", "--d", "0", says="--d values must be positive")
    assert_bad_input("bench_attention.py", "--impl", "naive,bogus", says="unknown implementation 'bogus'")


@gpu
def test_bench_attention_oom_row_then_next_runs():
    # 2% of an 80 GB GPU is 1.6 GiB; naive at S=16384 keeps an 8x16384x16384 bf16 matrix (4 GiB).
    out = run("bench_attention.py", "--memory-fraction", "0.02", "--impl", "naive,flash", "--d", "64",
              "--seq", "16384,1024", "--steps", "2", "--warmup", "1").stdout
    fwd = _bench_attention_table(out, "forward, ms")
    assert fwd[(64, 16384)]["naive"] == "OOM", out
    float(fwd[(64, 1024)]["naive"].split("±")[0])  # the next configuration still ran
    float(fwd[(64, 16384)]["flash"].split("±")[0])  # flash needs no S x S matrix: it fits
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


def main():
    tests = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
    only = sys.argv[1:]  # optional substrings to select tests: python test_all.py tokenizer
    tests = [(n, f) for n, f in tests if not only or any(s in n for s in only)]
    passed = failed = skipped = 0
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
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
