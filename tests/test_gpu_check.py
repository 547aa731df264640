"""scripts/gpu_check.sh and its driver scripts/gpu_check.py, on CPU: argument handling, the synthetic data,
the table and each row's pass/fail rule (fed made-up results), the memory-plan hook, and a --device=cpu run
of every check end to end."""

import dataclasses
import gzip
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from train_helpers import subprocess_env

from marsgpt import hellaswag, launch, metrics
from marsgpt.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_check = load_script("gpu_check")
worker = load_script("gpu_check_worker")
Row, Finished, PASS, FAIL, SKIP = gpu_check.Row, gpu_check.Finished, gpu_check.PASS, gpu_check.FAIL, gpu_check.SKIP


def error_lines(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ---------------------------------------------------------------------------------------------------
# Arguments.


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--only", "nosuch", "resume"], "no check named nosuch; the checks are: data, single"),
        (["--device=tpu"], "invalid choice: 'tpu'"),
        (["--only"], "expected at least one argument"),
    ],
)
def test_bad_arguments_give_one_error_line_and_exit_2(argv, says, capsys):
    assert gpu_check.main(argv) == 2
    assert says in error_lines(capsys)


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "report.md"
    out.write_text("mine")
    assert gpu_check.main(["--device=cpu", "--out", str(out)]) == 2
    assert f"--out {out} is a file" in error_lines(capsys)
    assert out.read_text() == "mine"


def test_without_cuda_it_says_it_needs_a_gpu_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "cuda_available", lambda: False)
    out = tmp_path / "out"
    assert gpu_check.main(["--out", str(out)]) == 2
    assert "needs a CUDA GPU" in error_lines(capsys)
    assert not out.exists()


@pytest.mark.slow
def test_the_shell_script_runs_the_driver_with_its_arguments():
    done = subprocess.run(["bash", SCRIPT, "--only", "nosuch"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith("error: no check named nosuch") and len(done.stderr.splitlines()) == 1


def test_only_runs_the_checks_it_names_after_those_they_need():
    names = [c.name for c in gpu_check.with_needs(["hellaswag", "torchrun"])]
    assert names == ["data", "single", "torchrun", "hellaswag"]
    assert [c.name for c in gpu_check.with_needs(["optimizer"])] == ["optimizer"]


def test_the_budgets_fit_in_fourteen_minutes_and_the_first_ten_minutes_checks_in_eight():
    assert gpu_check.TOTAL_BUDGET_S == gpu_check.budget_of(gpu_check.CHECKS) <= gpu_check.TIME_LIMIT_S == 14 * 60
    first = gpu_check.with_needs(gpu_check.FIRST_TEN_MINUTES, gpu_check.FIRST_TEN_MINUTES)
    assert [c.name for c in first] == list(gpu_check.FIRST_TEN_MINUTES)  # in its own order: the real path first
    assert gpu_check.budget_of(first) <= gpu_check.FIRST_TEN_MINUTES_LIMIT_S == 8 * 60


# ---------------------------------------------------------------------------------------------------
# The synthetic data.


def test_the_synthetic_data_is_a_dataset_train_py_reads_with_gpt2_s_vocabulary(tmp_path):
    gpu_check.make_synthetic_data(str(tmp_path / "synthetic"), train_tokens=50_000, val_tokens=5_000)
    cfg = load_config([f"--data_path={tmp_path}", "--dataset=synthetic"])
    train_data, val_data, vocab_size = launch.load_data(cfg)
    assert vocab_size == 50304  # GPT-2's 50257, padded
    assert (train_data.num_tokens, val_data.num_tokens) == (50_000, 5_000)
    x, y = train_data.get_batch(seed=0, step=0, micro_step=0, batch_size=15, block_size=1024)
    assert x.shape == y.shape == (15, 1024)
    assert torch.equal(x[:, 1:], y[:, :-1])
    ids = np.fromfile(tmp_path / "synthetic" / "train.bin", dtype=np.uint16)
    assert 50_000 < ids.max() < 50257  # the whole vocabulary, within the GPT-2 ids


def test_the_hellaswag_file_is_in_the_official_format(tmp_path):
    path = str(tmp_path / "hs.jsonl")
    gpu_check.write_hellaswag_file(path, num_examples=8)
    examples = hellaswag.load_examples(path)
    assert len(examples) == 8
    assert all(len(set(e["endings"])) == 4 and 0 <= e["label"] < 4 for e in examples)


# ---------------------------------------------------------------------------------------------------
# The report.


def test_the_table_has_one_row_per_result_and_escapes_pipes():
    rows = [
        Row("one", "python train.py --x=1", "ok", PASS, seconds=12.4),
        Row("two", "", "loss a|b", FAIL, seconds=3),
    ]
    text = gpu_check.render_markdown({"date": "today", "device": "1 x GPU"}, rows)
    lines = text.splitlines()
    assert lines[:4] == ["# GPU check", "", "- date: today", "- device: 1 x GPU"]
    table = lines[lines.index("| what | command | result | pass | seconds |") :]
    assert table[1] == "|---|---|---|---|---|"
    assert table[2] == "| one | `python train.py --x=1` | ok | pass | 12 |"
    assert table[3] == "| two |  | loss a\\|b | fail | 3 |"
    assert len(table) == 4


def test_the_exit_status_is_1_when_any_row_failed():
    assert gpu_check.exit_status([Row("a", "", "", PASS), Row("b", "", "", SKIP)]) == 0
    assert gpu_check.exit_status([Row("a", "", "", PASS), Row("b", "", "", FAIL)]) == 1


def test_the_report_says_in_progress_until_the_last_check(tmp_path):
    rows = [Row("a", "c", "ok", PASS), Row("b", "c", "bad", FAIL)]
    gpu_check.write_report(str(tmp_path), {"date": "d"}, rows, 2, 3, 10)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["complete"] is False and report["status"].startswith("in progress, 2 of 3 checks run")
    assert "in progress, 2 of 3 checks run: 1 pass, 1 fail" in (tmp_path / "gpu_check.md").read_text()
    gpu_check.write_report(str(tmp_path), {"date": "d"}, rows, 3, 3, 10)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["complete"] is True and report["status"].startswith("complete: 1 pass, 1 fail, 0 skipped")
    assert [r["status"] for r in report["rows"]] == [PASS, FAIL]


# ---------------------------------------------------------------------------------------------------
# Each row's pass/fail rule, fed made-up results.

OK = Finished(0, "world size 1 on cuda:0\n")


def compiled_result(**values):
    """What scripts/gpu_check_worker.py's compiled_run writes for a CUDA run that went well."""
    result = dict(
        device="cuda:0",
        world_size=1,
        ddp=True,
        compiled=True,
        backend="inductor",
        tokens_per_step=245_760,
        steps=10,
        skipped=0,
        error="",
        first_step_s=23.5,
        eval_s=6.25,
        graphs_after_warm_up=6,
        graphs=6,
        graph_breaks={},
        step_s=0.5,
        tokens_per_sec=491_520.0,
        mfu=42.46,
        mfu_llmc=39.87,
        attention_kernel="flash",
        deterministic=False,
        plan_bytes=12 * 2**30,
        peak_allocated_bytes=11.8 * 2**30,
        peak_reserved_bytes=12.5 * 2**30,
        total_bytes=139.8 * 2**30,
    )
    return dict(result, **values)


def test_a_compiled_run_gives_its_compile_graphs_throughput_memory_and_attention_kernel_rows():
    rows = gpu_check.compiled_rows("w", "c", OK, 120, compiled_result(), cuda=True)
    assert [(r.what, r.status) for r in rows] == [
        ("w: compile", PASS),
        ("w: graph breaks and recompiles", PASS),
        ("w", PASS),
        ("w: peak memory", PASS),
        ("w: attention kernel", PASS),
    ]
    assert [r.result for r in rows] == [
        "first step 23.5 s, first evaluation 6.2 s, each compiling its graphs",
        "no graph break; 6 graph(s) compiled in the warm-up, no recompile after it (forbidden)",
        "491,520 tokens/s, MFU 42.5% (39.9% as llm.c counts), 500 ms/step of 245,760 tokens (10 steps; compiled, "
        "DDP over 1 rank)",
        "peak 11.8 GiB allocated, 12.5 GiB reserved, of 139.8 GiB; plan 12.0 GiB (compiled), measured/plan 0.98 "
        "(tolerance 5%)",
        "flash; expected a fused kernel (flash, memory-efficient, cuDNN)",
    ]
    unknown_gpu = gpu_check.compiled_rows("w", "c", OK, 120, compiled_result(mfu=None, mfu_llmc=None), cuda=True)
    assert unknown_gpu[2].status == PASS and "MFU n/a" in unknown_gpu[2].result


@pytest.mark.parametrize(
    "values, row, says",
    [
        (dict(graph_breaks={"Unsupported: call_method": 2}), 1, "2 graph break(s): Unsupported: call_method"),
        (
            dict(error="RuntimeError: Detected recompile when torch.compile stance is 'fail_on_recompile'. x"),
            1,
            "recompiled after the warm-up: RuntimeError: Detected recompile",
        ),
        (dict(graphs=7), 1, "graphs after the warm-up 6, at the end 7"),
        (dict(first_step_s=None, eval_s=None), 0, "first step not reached, first evaluation not reached"),
        (dict(ddp=False), 2, "compiled True, DDP False: not the real path"),
        (dict(error="OutOfMemoryError: CUDA out of memory", tokens_per_sec=None), 2, "not measured: OutOfMemoryError"),
        (dict(peak_allocated_bytes=12.7 * 2**30), 3, "measured/plan 1.06 (tolerance 5%)"),
        (dict(peak_allocated_bytes=11.3 * 2**30), 3, "measured/plan 0.94 (tolerance 5%)"),
        (dict(attention_kernel="math"), 4, "math; expected a fused kernel"),
        (dict(attention_kernel="flash", deterministic=True), 4, "flash; expected math"),
    ],
)
def test_a_compiled_run_fails_a_row_on_a_graph_break_a_recompile_a_plain_model_memory_or_the_wrong_kernel(
    values, row, says
):
    rows = gpu_check.compiled_rows("w", "c", OK, 120, compiled_result(**values), cuda=True)
    assert rows[row].status == FAIL and says in rows[row].result, rows[row].result
    assert [r.status for i, r in enumerate(rows) if i != row].count(FAIL) <= 1  # the others stand on their own


def test_a_compiled_run_that_wrote_nothing_is_one_failed_row_and_the_cpu_judges_no_kernel():
    timed_out = Finished(-9, "", timed_out=True)
    [row] = gpu_check.compiled_rows("w", "c", timed_out, 120, {}, cuda=True)
    assert row.status == FAIL and row.result == "timed out: still running at the end of its 120 s budget"
    cpu = compiled_result(attention_kernel="flash (CPU)", peak_rss_bytes=2**29, backend="aot_eager")
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "total_bytes"):
        del cpu[key]
    rows = gpu_check.compiled_rows("w", "c", OK, 120, cpu, cuda=False)
    assert all(r.status == PASS for r in rows)
    assert rows[0].result.endswith("each compiling its graphs (aot_eager)")
    assert rows[3].result == "peak resident set 0.5 GiB (host memory)"
    assert rows[4].result == "flash (CPU) (on CUDA: a fused kernel (flash, memory-efficient, cuDNN))"


def test_on_cuda_the_paper_config_s_compile_is_judged_against_its_cold_start_targets():
    targets = gpu_check.COLD_START_TARGETS_S
    [compile_row, *_] = gpu_check.compiled_rows("w", "c", OK, 150, compiled_result(), cuda=True, targets=targets)
    assert compile_row.status == PASS
    assert compile_row.result == (
        "first step 23.5 s, first evaluation 6.2 s, each compiling its graphs; "
        "target first step <= 30 s and first evaluation <= 10 s, cold"
    )
    h200 = compiled_result(first_step_s=78.5, eval_s=33.8)  # the whole model's compile on 2026-12-04
    assert gpu_check.compiled_rows("w", "c", OK, 150, h200, cuda=True, targets=targets)[0].status == FAIL
    on_cpu = gpu_check.compiled_rows("w", "c", OK, 150, h200, cuda=False, targets=targets)[0]
    assert on_cpu.status == PASS and on_cpu.result.endswith("cold (judged on CUDA only)")


# A profile as profile_summary gives it (made up, not measured)
H200_LIKE_PROFILE = dict(
    steps=2,
    span_s=1.05,
    busy=0.93,
    kinds={"matmul": 0.55, "attention": 0.15, "inductor's fused": 0.2, "multi-tensor (optimizer step, clipping)": 0.1},
    top=[dict(name="nvjet_tst_128x256", ms=300.0, calls=96)],
)


def test_the_profile_merges_overlapping_kernels_into_busy_time_and_sorts_them_by_kind():
    spans = [  # (name, start, end) in microseconds, as torch.profiler gives them; two streams overlap at 10-20
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 20),
        ("triton_per_fused_add_native_layer_norm_0", 10, 30),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 50, 60),
        ("void at::native::multi_tensor_apply_kernel<...>", 60, 70),
        ("norm_pass", 70, 75),
        ("Memcpy HtoD (Pinned -> Device)", 90, 100),
        ("pytorch_flash::flash_fwd_kernel<...>", 100, 140),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 140, 150),
        ("void at::native::vectorized_elementwise_kernel<...>", 150, 160),
    ]
    summary = worker.profile_summary(spans)
    assert summary["span_s"] == 160e-6
    assert summary["busy"] == pytest.approx(125 / 160)  # the gaps 30-50 and 75-90; 10-20 counted once
    total = 20 + 20 + 10 + 10 + 5 + 10 + 40 + 10 + 10
    assert summary["kinds"] == pytest.approx(
        {
            "NCCL": 10 / total,
            "copies": 10 / total,
            "matmul": 30 / total,
            "attention": 40 / total,
            "MARS kernel": 5 / total,
            "multi-tensor (optimizer step, clipping)": 10 / total,
            "inductor's fused": 20 / total,
            "other": 10 / total,
        }
    )
    assert [k["name"] for k in summary["top"][:2]] == ["pytorch_flash::flash_fwd_kernel<...>", spans[0][0]]
    assert worker.profile_summary([]) is None


def test_on_cuda_the_profile_takes_the_gpu_s_activity_alone_and_keeps_the_trace_gzipped(tmp_path, monkeypatch):
    """profile_steps on CUDA (torch.profiler and torch.cuda mocked): the profiler records the GPU's activity alone,
    the steps run inside it, the summary is of the CUDA events, and the trace is written gzipped."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    import train

    def event(name, device_type, start, end):
        return SimpleNamespace(
            name=name, device_type=device_type, cpu_parent=None, time_range=SimpleNamespace(start=start, end=end)
        )

    asked, steps = [], []

    class Profile:
        def __init__(self, activities):
            asked.append(activities)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [event("aten::mm", DeviceType.CPU, 0, 100), event("nvjet_tst", DeviceType.CUDA, 10, 30)]

        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                f.write('{"traceEvents": []}')

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(train, "train_step", lambda run, it: steps.append(it))
    run = SimpleNamespace(dist=SimpleNamespace(device_type="cuda", device="cuda:0"))
    trace = str(tmp_path / "small_mars_trace.json.gz")
    summary = worker.profile_steps(run, 12, 2, trace)
    assert asked == [[ProfilerActivity.CUDA]] and steps == [12, 13]
    assert summary["kinds"] == {"matmul": 1.0} and summary["span_s"] == 20e-6 and summary["steps"] == 2
    with gzip.open(trace, "rt") as f:
        assert json.load(f) == {"traceEvents": []}
    assert os.listdir(tmp_path) == ["small_mars_trace.json.gz"]


def test_the_profile_row_names_how_busy_the_gpu_was_and_fails_without_a_profile():
    result = compiled_result(profile=dict(H200_LIKE_PROFILE, trace="logs/small_mars_trace.json.gz"))
    row = gpu_check.profile_row("w", "c", result, cuda=True)
    assert row.status == PASS and row.result == (
        "2 steps over 1.05 s: the GPU busy 93% of it; by kind: matmul 55%, inductor's fused 20%, attention 15%, "
        "multi-tensor (optimizer step, clipping) 10%; trace logs/small_mars_trace.json.gz"
    )
    cut_short = gpu_check.profile_row("w", "c", compiled_result(), cuda=True)
    assert cut_short.status == FAIL and cut_short.result == "not measured: the run ended before its profile"


def test_a_requeued_compile_passes_when_it_compiles_no_graph_and_its_first_step_is_shorter_than_the_cold_one():
    cold = compiled_result()
    warm = dict(first_step_s=8.0, eval_s=2.0, backend="inductor", graphs=6, graphs_compiled=0, graphs_from_cache=9)
    row = gpu_check.warm_compile_row("w", "c", OK, 45, warm, cold, cuda=True)
    assert row.status == PASS
    assert row.result == (
        "first step 8.0 s, first evaluation 2.0 s from the compile_cache.bin the first run left, the inductor cache "
        "empty (0 graphs compiled, 9 from the cache); cold: first step 23.5 s, first evaluation 6.2 s"
    )
    assert gpu_check.warm_compile_row("w", "c", OK, 45, dict(warm, first_step_s=24.0), cold, True).status == FAIL
    compiled_again = gpu_check.warm_compile_row("w", "c", OK, 45, dict(warm, graphs_compiled=2), cold, True)
    assert compiled_again.status == FAIL and "(2 graphs compiled, 9 from the cache)" in compiled_again.result
    no_cold = gpu_check.warm_compile_row("w", "c", OK, 45, warm, {}, True)
    assert no_cold.status == FAIL and no_cold.result.endswith("cold: not measured")
    timed_out = gpu_check.warm_compile_row("w", "c", Finished(-9, "", timed_out=True), 45, {}, cold, True)
    assert timed_out.status == FAIL and timed_out.result.startswith("timed out")
    on_cpu = gpu_check.warm_compile_row("w", "c", OK, 45, dict(warm, backend="aot_eager"), cold, cuda=False)
    assert on_cpu.status == PASS and on_cpu.result.endswith("(aot_eager: no inductor cache to reuse)")


def test_the_quickstart_row_times_the_script_s_three_commands_against_30_s():
    sampled = Finished(0, "def f():\n---------------\n")
    runs = [("prepare", OK, 2.0), ("train", OK, 20.5), ("sample", sampled, 3.0)]
    records = [{metrics.ITER: 7000, metrics.STEP_MS: 2.25}]
    row = gpu_check.quickstart_row("w", "c", runs, 40, records, cuda=True)
    assert row.status == PASS
    assert row.result == (
        "25.5 s: corpus 2.0 s, 7,000 steps 20.5 s, 2.2 ms/step at the end, sample 3.0 s; target <= 30 s"
    )
    slow = [runs[0], ("train", OK, 80.0), runs[2]]
    assert gpu_check.quickstart_row("w", "c", slow, 40, records, cuda=True).status == FAIL
    assert gpu_check.quickstart_row("w", "c", slow, 40, records, cuda=False).result.endswith(
        "(judged on CUDA only; 7000 steps on the CPU)"
    )
    cut = [runs[0], ("train", Finished(-9, "", timed_out=True), 40.0)]
    row = gpu_check.quickstart_row("w", "c", cut, 40, records, cuda=True)
    assert row.status == FAIL and row.result.startswith("train: timed out: still running at the end of its 40 s")
    assert "metrics.jsonl to iter 7000" in row.result
    unsampled = gpu_check.quickstart_row("w", "c", [*runs[:2], ("sample", OK, 3.0)], 40, records, True)
    assert unsampled.status == FAIL and unsampled.result == "exit 0, but no sample in sample.py's output"


def test_on_cuda_the_quickstart_runs_the_script_s_commands_whole_with_a_cold_compile_cache(tmp_path, monkeypatch):
    """scripts/quickstart.sh's three commands, its corpus and run in <work>; on CUDA the whole 7,000 steps, and
    training with a compile cache of its own (a new user's), not the GPT-2 runs'."""
    commands = []

    def run_command(argv, log_path, timeout_s, stop_at=None, env=None):
        commands.append((argv, env))
        return Finished(0, "def f():\n---------------\n" if "sample.py" in argv else "")

    monkeypatch.setattr(gpu_check, "run_command", run_command)
    ctx = gpu_check.Context(device="cuda", work=str(tmp_path), logs=str(tmp_path))
    ctx.check, ctx.deadline = gpu_check.CHECKS_BY_NAME["quickstart"], float("inf")
    [row] = gpu_check.check_quickstart(ctx)
    assert row.status == PASS and row.result.endswith("target <= 30 s")  # three exits 0 and a sample, in no time
    (prepare, _), (train, train_env), (sample, sample_env) = commands
    with open(os.path.join(ROOT, "scripts", "quickstart.sh")) as f:
        assert 'exec python -m scripts.quickstart "$@"' in f.read()  # the script runs scripts/quickstart.py's steps
    with open(os.path.join(ROOT, "scripts", "quickstart.py")) as f:
        steps = f.read()
    assert "from data.stdlib_char import prepare" in steps and prepare[1:3] == ["-m", "data.stdlib_char.prepare"]
    assert "train.main([CONFIG," in steps and train[1:3] == ["train.py", "config/quickstart.py"]
    assert not any(a.startswith(("--max_iters", "--eval_iters")) for a in train)
    assert 'sample.main([f"--out_dir={out_dir}", *SAMPLE])' in steps
    assert sample[-3:] == ["--start=def ", "--num_samples=1", "--max_new_tokens=400"]
    cache = train_env["TORCHINDUCTOR_CACHE_DIR"]
    assert cache.startswith(str(tmp_path)) and cache != gpu_check.compile_env(ctx)["TORCHINDUCTOR_CACHE_DIR"]
    assert sample_env is None
    cpu = dict(gpu_check.quickstart_commands(gpu_check.Context(device="cpu", work=str(tmp_path), logs="")))
    assert "--max_iters=100" in cpu["train"]


def test_the_requeued_compile_starts_on_an_empty_inductor_cache_with_the_cold_run_s_compile_cache_bin(
    tmp_path, monkeypatch
):
    """check_compile_warm on CUDA (the worker mocked): small_mars's compile_cache.bin copied into the relaunch's
    out_dir, the relaunch given an inductor cache directory of its own, and its row judged."""
    launched = []

    def run_command(argv, log_path, timeout_s, stop_at=None, env=None):
        out_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("--out_dir="))
        launched.append((os.listdir(out_dir), env))
        result = dict(first_step_s=8.0, eval_s=2.0, backend="inductor", graphs_compiled=0, graphs_from_cache=9)
        with open(argv[argv.index("compiled") + 1], "w") as f:
            json.dump(result, f)
        return Finished(0, "")

    monkeypatch.setattr(gpu_check, "run_command", run_command)
    ctx = gpu_check.Context(device="cuda", work=str(tmp_path), logs=str(tmp_path))
    os.makedirs(ctx.out_dir("small_mars"))
    with open(os.path.join(ctx.out_dir("small_mars"), "compile_cache.bin"), "wb") as f:
        f.write(b"the cold run's")
    with open(os.path.join(tmp_path, "small_mars.json"), "w") as f:
        json.dump(compiled_result(), f)
    ctx.check, ctx.deadline = gpu_check.CHECKS_BY_NAME["small_mars_warm"], float("inf")
    [row] = gpu_check.check_compile_warm(gpu_check.SMALL_MARS, ctx)
    [(files, env)] = launched
    assert files == ["compile_cache.bin"]
    with open(os.path.join(ctx.out_dir("small_mars_warm"), "compile_cache.bin"), "rb") as f:
        assert f.read() == b"the cold run's"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(tmp_path, "compile_cache_requeued")
    assert row.status == PASS and "(0 graphs compiled, 9 from the cache)" in row.result


def test_the_deterministic_run_is_reported_against_the_default_one():
    default = compiled_result()
    deterministic = compiled_result(tokens_per_sec=245_760.0, peak_allocated_bytes=23.6 * 2**30, deterministic=True)
    row = gpu_check.determinism_row("w", "c", deterministic, default)
    assert row.status == PASS and row.result == "0.50x the default run's tokens/s, 2.00x its peak memory"
    assert gpu_check.determinism_row("w", "c", compiled_result(tokens_per_sec=None), default).status == FAIL


def test_a_run_that_runs_out_of_time_still_reports_what_metrics_jsonl_measured():
    timed_out = Finished(-9, "", timed_out=True)
    records = [{"iter": 0, "val/loss": 10.9}, {"iter": 5, "train/loss": 10.0, "tokens_per_sec": 469_123.0}]
    row = gpu_check.launch_row("w", "c", timed_out, 20, records, "world size 1 on cuda:0")
    assert row.status == FAIL
    assert row.result == (
        "timed out: still running at the end of its 20 s budget; metrics.jsonl to iter 5, 469,123 tokens/s at iter 5"
    )
    row = gpu_check.launch_row("w", "c", timed_out, 20, [], "world size 1 on cuda:0")
    assert row.result.endswith("; metrics.jsonl has no record yet")


def test_a_launch_passes_only_on_the_expected_device_with_a_finite_val_loss():
    records = [{"iter": 0, "val/loss": 10.9}, {"iter": 10, "val/loss": 10.5}]
    row = gpu_check.launch_row("w", "c", OK, 30, records, "world size 1 on cuda:0")
    assert row.status == PASS and row.result == "exit 0; world size 1 on cuda:0; 10 steps, val loss 10.900 -> 10.500"
    elsewhere = gpu_check.launch_row(
        "w", "c", Finished(0, "world size 1 on cpu\n"), 30, records, "world size 1 on cuda:0"
    )
    assert elsewhere.status == FAIL and "never says 'world size 1 on cuda:0'" in elsewhere.result
    diverged = gpu_check.launch_row("w", "c", OK, 30, [{"iter": 0, "val/loss": None}], "world size 1 on cuda:0")
    assert diverged.status == FAIL


def test_the_fsdp_launch_row_wants_the_sharding_line_and_a_checkpoint_of_one_file_per_rank(tmp_path):
    """Beyond launch_row's conditions: the run says it shards over its ranks, and its ckpt.pt names a shard
    directory with one .distcp file per rank (a one-file checkpoint, or none, fails the row)."""
    from marsgpt import checkpoint

    records = [{"iter": 0, "val/loss": 10.9}, {"iter": 10, "val/loss": 10.5}]
    printed = Finished(0, "world size 2 on cpu; 2 micro-batches per rank per step\nmemory: FSDP2 over 2 GPUs\n")
    out = str(tmp_path)

    def row(finished):
        return gpu_check.fsdp_launch_row("w", "c", finished, 30, records, 2, out, cuda=False)

    unsharded = row(Finished(0, "world size 2 on cpu\n"))
    assert unsharded.status == FAIL and unsharded.result == "exit 0, but its output never says 'FSDP2 over 2 GPUs'"
    missing = row(printed)
    assert missing.status == FAIL and "; its checkpoint: " in missing.result and "ckpt.pt" in missing.result
    checkpoint.save_checkpoint(os.path.join(out, "ckpt.pt"), dict(model={"w": torch.ones(2)}, model_args={}))
    one_file = row(printed)
    assert one_file.status == FAIL
    assert one_file.result.endswith("its checkpoint is not sharded one file per rank (0 .distcp files)")
    assert row(Finished(1, "error: boom\n")).result.startswith("exit 1: error: boom")


def test_fsdp_step_rows_show_bench_fsdp_s_times_and_bytes_and_fail_what_it_did_not_measure():
    rows = gpu_check.fsdp_step_rows(
        [
            bench_row("FSDP2 mars-adamw step vs FSDP2 AdamW(fused=True) step", 3.0, 1.5, 2.0, note="124M params"),
            bench_row("FSDP2 mars-m step vs its step in one process", float("nan"), 20.0, note="one process"),
            bench_row("FSDP2 mars-adamw step: bytes sent per rank", 80 / 1024, unit="KiB", note="allreduce_ x1"),
            bench_row("FSDP2 mars-m step: bytes sent per rank", 2048.0, unit="KiB", note="alltoall_base_ x2"),
        ],
        "cmd",
        cuda=True,
    )
    assert [(r.status, r.result) for r in rows] == [
        (PASS, "3 ms = 2.00x of 1.5 ms; 124M params (the bench states no target)"),
        (FAIL, "not measured: one process"),
        (PASS, "80 bytes: allreduce_ x1"),
        (PASS, "2,048.0 KiB: alltoall_base_ x2"),
    ]
    nothing = gpu_check.fsdp_step_rows([], "cmd", cuda=True)
    assert [(r.status, r.result) for r in nothing] == [(FAIL, "the bench gave no row")]


def test_on_cuda_the_fsdp_check_shards_over_every_gpu_at_the_config_s_shapes(tmp_path, monkeypatch):
    """check_fsdp's CUDA branch: both torchrun launches on every GPU (8 here), train.py at config/quickstart.py's
    own shapes with 2 micro-batches per rank, the bench worker told it runs on CUDA. The commands cannot start
    here: each is recorded and answered with a failure, which its row reports."""
    ctx = gpu_check.Context(device="cuda", work=str(tmp_path), logs=str(tmp_path), gpus=8)
    ctx.check, ctx.deadline = gpu_check.CHECKS_BY_NAME["fsdp"], float("inf")
    commands = []
    monkeypatch.setattr(ctx, "run", lambda argv, stop_at=None, env=None: commands.append(argv) or Finished(1, "no"))
    rows = gpu_check.check_fsdp(ctx)
    train_argv, bench_argv = commands
    for argv in commands:
        launcher = argv[argv.index("torch.distributed.run") + 1 :][:2]
        assert launcher == ["--standalone", "--nproc_per_node=8"]
    assert train_argv[train_argv.index("train.py") + 1] == "config/quickstart.py"
    assert "--zero_stage=3" in train_argv and "--gradient_accumulation_steps=16" in train_argv
    assert not any(a.startswith(("--n_layer", "--compile")) for a in train_argv)  # no --device=cpu shapes
    assert bench_argv[-3:] == ["fsdp", ctx.result_path, "cuda"]
    assert [(r.what, r.status) for r in rows] == [
        ("FSDP2: train.py --zero_stage=3 under torchrun, 8 processes", FAIL),
        ("FSDP2 steps (bench/bench_fsdp.py)", FAIL),
    ]


def bench_row(benchmark, ours, reference=None, ratio=None, unit="ms", target="", note=""):
    return dict(benchmark=benchmark, ours=ours, reference=reference, unit=unit, ratio=ratio, target=target, note=note)


def cuda_bench_rows(monkeypatch, ratio=1.2, sync_free=True, difference=2e-6):
    """The rows bench_mars.run gives on CUDA, named by bench_mars's own code (its contenders built on tiny CPU
    tensors, its CUDA-only sync rows with the sync check mocked): each kernel contender `difference` from the
    default path per unit of update, each step `ratio` x the baseline's 1.42 ms."""
    from bench import bench_mars

    params = bench_mars.make_params("cpu", [(4, 4), (4,)])
    contenders = bench_mars.make_contenders(params, dict(lr=1e-3, weight_decay=0.1))
    monkeypatch.setattr(bench_mars, "_sync_free", lambda optimizer: sync_free)
    rows = [
        bench_row(bench_mars.equality_row_name(name), difference, unit="rel", target=bench_mars.EQUALITY_TARGET)
        for name in bench_mars.kernel_settings()
    ]
    rows += [
        bench_row(bench_mars.step_row_name(name), 1.42 * ratio, 1.42, ratio, target=c[2])
        for name, c in contenders.items()
    ]
    rows += [
        bench_row(bench_mars.compile_row_name(name), 1.5, unit="s")
        for name, (opt, _, _) in contenders.items()
        if bench_mars.fused(opt)
    ]
    rows += bench_mars.sync_rows(contenders)
    rows.append(bench_row(bench_mars.OVERHEAD_ROW, 90.0, 60.0, 1.5, unit="us"))
    rows.append(bench_row(bench_mars.SHAMPOO_ROW, 14.0, 3.7, 3.8, target="<= 4 (issue: 15 ms vs 3.7 ms on H200)"))
    rows.append(bench_row("mars-adamw state", 1400.0, 475.0, 2.95, unit="MiB"))
    return rows


KERNEL_CHECKS = [
    "MARS-AdamW (fused=True) against the default path: difference per unit of update",
    "MARS-Lion (fused=True) against the default path: difference per unit of update",
    "MARS-AdamW (fused=True, bfloat16 last_grad) against the default path: difference per unit of update",
]
STEP_ROWS = [
    "MARS-AdamW step vs AdamW(fused=True): fused=True (the kernel) and the default path",
    "MARS-Lion step vs AdamW(fused=True): fused=True (the kernel) and the default path",
]


def test_optimizer_rows_fail_nothing_measured_and_within_target_among_bench_mars_s_cuda_rows(monkeypatch):
    rows = gpu_check.optimizer_rows(cuda_bench_rows(monkeypatch), "bench")
    assert [r.status for r in rows] == [PASS] * len(rows), [(r.what, r.result) for r in rows if r.status != PASS]
    assert [r.what for r in rows] == KERNEL_CHECKS + STEP_ROWS + [
        "AdamW(foreach=True) step vs AdamW(fused=True)",
        "MARS-AdamW (fused=True, bfloat16 last_grad) step vs AdamW(fused=True)",
        "MARS-AdamW (fused=True, bfloat16 last_grad) first step (compiles)",
        "MARS-AdamW (fused=True) host time per step at width 8 (the calls alone)",
        "mars-shampoo step vs its Newton-Schulz FLOPs at the matmul rate",
        "MARS steps under set_sync_debug_mode('error')",
    ]
    assert rows[0].result.startswith("2e-06 (target <= 0.0001; ")
    assert rows[-1].result == "no host sync in any of 5 steps"


def test_the_kernel_is_checked_against_the_default_path_first_on_cuda(monkeypatch):
    """The rows that say whether fused=True computes on the GPU what the default path computes there: pass
    within the bench's target, fail above it or where the bench gave no row; none on a CPU (no kernel runs)."""
    from bench import bench_mars

    far = gpu_check.optimizer_rows(cuda_bench_rows(monkeypatch, difference=0.3), "bench")
    assert [(r.what, r.status) for r in far[:3]] == [(what, FAIL) for what in KERNEL_CHECKS]
    bench = [r for r in cuda_bench_rows(monkeypatch) if r["benchmark"] != KERNEL_CHECKS[1]]
    rows = gpu_check.optimizer_rows(bench, "bench")
    assert (rows[1].what, rows[1].status, rows[1].result) == (KERNEL_CHECKS[1], FAIL, "bench_mars gave no such row")
    assert [r.status for r in rows[:3]] == [PASS, FAIL, PASS]
    cpu = [r for r in cuda_bench_rows(monkeypatch) if r["benchmark"] not in KERNEL_CHECKS]
    assert [r.what for r in gpu_check.optimizer_rows(cpu, "bench", cuda=False)[:2]] == STEP_ROWS
    assert bench_mars.EQUALITY_TARGET == "<= 1e-4"


def test_the_step_path_row_judges_the_kernel_beside_the_default_path(monkeypatch):
    from bench import bench_mars

    bench = cuda_bench_rows(monkeypatch)
    kernel = next(r for r in bench if r["benchmark"] == bench_mars.step_row_name("MARS-AdamW (fused=True)"))
    kernel.update(ours=1.63, ratio=1.15)
    default = next(r for r in bench if r["benchmark"] == bench_mars.step_row_name("MARS-AdamW (foreach)"))
    default.update(ours=4.33, ratio=3.05)
    row = gpu_check.optimizer_rows(bench, "bench")[3]
    assert row.status == PASS
    assert row.result == (
        "fused=True 1.63 ms = 1.15x (first step 1.5 s: compiling), default (foreach) 4.33 ms = 3.05x; target <= 1.2"
    )
    kernel.update(ours=2.13, ratio=1.5)  # faster than the default path, and still over the target
    row = gpu_check.optimizer_rows(bench, "bench")[3]
    assert row.status == FAIL and row.result.endswith("default (foreach) 4.33 ms = 3.05x; target <= 1.2")
    on_cpu = [r for r in bench if not r["benchmark"].startswith(tuple(bench_mars.kernel_settings()))]  # no kernel
    cpu = gpu_check.optimizer_rows(on_cpu, "bench", cuda=False)
    assert cpu[0].status == PASS and cpu[0].result == "default (foreach) 4.33 ms = 3.05x; fused=True runs on CUDA only"
    assert (cpu[-1].status, cpu[-1].result) == (SKIP, "skipped: a host sync exists only on CUDA")


def test_optimizer_rows_fail_on_a_host_sync_a_missing_number_or_missing_rows(monkeypatch):
    from bench import bench_mars

    rows = gpu_check.optimizer_rows(cuda_bench_rows(monkeypatch, ratio=2.0, sync_free=False), "bench")
    statuses = {r.what: r.status for r in rows}
    assert statuses[STEP_ROWS[0]] == FAIL  # 2.0 > 1.2
    assert statuses["AdamW(foreach=True) step vs AdamW(fused=True)"] == PASS  # no target
    assert rows[-1].status == FAIL and rows[-1].result.startswith("host sync in: MARS-AdamW (foreach) step without")
    bench = cuda_bench_rows(monkeypatch)
    lion = next(r for r in bench if r["benchmark"] == bench_mars.step_row_name("MARS-Lion (fused=True)"))
    lion.update(ours=None, ratio=None, note="crashed")
    row = next(r for r in gpu_check.optimizer_rows(bench, "bench") if r.what == STEP_ROWS[1])
    assert row.status == FAIL and row.result.startswith("not measured")
    rows = gpu_check.optimizer_rows([bench_row("something else", 1.0, unit="MiB")], "bench")
    assert [r.status for r in rows] == [FAIL] * 6  # three kernel checks, two steps, the host syncs
    assert rows[-1].result == "bench_mars gave no host-sync row"


def records_of(losses):
    """metrics.jsonl records: a train loss at each iter, a val loss every 8."""
    records = []
    for it, loss in enumerate(losses):
        if it % 8 == 0:
            records.append({"iter": it, "val/loss": loss + 1, "eval/train_loss": loss + 2})
        records.append({"iter": it, "train/loss": loss, "tokens_per_sec": 100.0 + it})  # timing may differ
    return records


KILLED = Finished(-9, "iter 14: ...\n", stopped=True)


def test_resume_passes_when_every_loss_is_the_same_float():
    losses = list(np.linspace(11, 9, 32))
    resumed = records_of(losses)
    for record in resumed:
        if "tokens_per_sec" in record:
            record["tokens_per_sec"] *= 2  # wall-clock fields are not compared
    row = gpu_check.resume_row("w", "c", 60, OK, KILLED, 8, OK, records_of(losses), resumed)
    assert row.status == PASS
    assert row.result == (
        "SIGKILL at 'iter 14', resumed from iter 8: all 40 losses equal the uninterrupted run's "
        "(bitwise, largest difference 0)"
    )


def test_resume_fails_on_a_difference_a_missing_record_or_a_run_that_was_not_killed():
    losses = list(np.linspace(11, 9, 32))
    changed = records_of(losses)
    next(r for r in changed if r["iter"] == 17 and "train/loss" in r)["train/loss"] += 1e-7
    row = gpu_check.resume_row("w", "c", 60, OK, KILLED, 8, OK, records_of(losses), changed)
    assert row.status == FAIL and "train/loss at iter 17" in row.result
    short = gpu_check.resume_row("w", "c", 60, OK, KILLED, 8, OK, records_of(losses), records_of(losses[:-1]))
    assert short.status == FAIL and "train/loss at iter 31 is in one run only" in short.result
    finished_first = gpu_check.resume_row("w", "c", 60, OK, OK, None, OK, [], [])
    assert finished_first.status == FAIL and finished_first.result.startswith("never killed: the run finished")
    no_checkpoint = gpu_check.resume_row("w", "c", 60, OK, KILLED, None, KILLED, [], [])
    assert no_checkpoint.status == FAIL and "before its first checkpoint" in no_checkpoint.result
    crashed = gpu_check.resume_row("w", "c", 60, OK, KILLED, 8, Finished(1, "RuntimeError: boom\n"), [], [])
    assert crashed.status == FAIL and crashed.result == "resume from iter 8: exit 1: RuntimeError: boom"


def test_compare_losses_treats_two_missing_values_as_equal_and_one_as_a_difference():
    a = [{"iter": 1, "train/loss": None}, {"iter": 2, "train/loss": 3.0}]
    assert gpu_check.compare_losses(a, a, 0.0) == (2, 0.0, None)
    b = [{"iter": 1, "train/loss": 1.0}, {"iter": 2, "train/loss": 3.0}]
    count, largest, mismatch = gpu_check.compare_losses(a, b, 0.0)
    assert (count, largest) == (2, math.inf) and mismatch == "train/loss at iter 1: None vs 1.0"
    assert gpu_check.compare_losses(b, [dict(r, **{"train/loss": r["train/loss"] + 0.01}) for r in b], 0.1)[2] is None


def cuda_memory(**values):
    result = dict(
        device="cuda:0",
        steps=2,
        oom="",
        peak_allocated_bytes=48.4 * 2**30,
        peak_reserved_bytes=52.3 * 2**30,
        total_bytes=139.8 * 2**30,
        plan_bytes=None,
        plan_note="n/a (plan not available)",
    )
    return dict(result, **values)


def test_memory_rows_without_a_plan_report_the_peak_and_say_so():
    row = gpu_check.memory_row("w", "c", OK, 55, cuda_memory())
    assert row.status == PASS
    assert row.result == ("peak 48.4 GiB allocated, 52.3 GiB reserved, of 139.8 GiB; plan: n/a (plan not available)")


def test_memory_rows_compare_the_peak_with_the_plan_within_its_tolerance():
    close = gpu_check.memory_row("w", "c", OK, 55, cuda_memory(plan_bytes=47 * 2**30, plan_note=""))
    assert close.status == PASS and close.result.endswith("plan 47.0 GiB, measured/plan 1.03 (tolerance 5%)")
    for plan_gib, ratio in ((44, "1.10"), (52, "0.93")):  # either way
        far = gpu_check.memory_row("w", "c", OK, 55, cuda_memory(plan_bytes=plan_gib * 2**30, plan_note=""))
        assert far.status == FAIL and f"measured/plan {ratio}" in far.result
    broken = gpu_check.memory_row(
        "w", "c", OK, 55, cuda_memory(plan_note="memory_plan.plan failed: x", plan_error=True)
    )
    assert broken.status == FAIL and broken.result.endswith("plan: memory_plan.plan failed: x")


def test_memory_rows_fail_on_out_of_memory_or_a_crash_and_report_host_memory_on_cpu():
    oom = gpu_check.memory_row("w", "c", OK, 55, cuda_memory(oom="CUDA out of memory. Tried to allocate 2 GiB"))
    assert oom.status == FAIL
    assert oom.result == "out of memory on a 139.8 GiB GPU: CUDA out of memory. Tried to allocate 2 GiB"
    crash = gpu_check.memory_row("w", "c", Finished(1, "Traceback\nValueError: bad\n"), 55, {})
    assert crash.status == FAIL and crash.result == "exit 1: ValueError: bad"
    cpu = dict(device="cpu", steps=2, oom="", peak_rss_bytes=2**29, plan_bytes=None, plan_note="n/a")
    row = gpu_check.memory_row("w", "c", OK, 55, cpu)
    assert row.status == PASS and row.result == "peak resident set 0.50 GiB (host memory, not a GPU's)"


def test_sample_and_hellaswag_rows_read_the_tools_output():
    sample = gpu_check.sample_row("w", "c", Finished(0, "The cat sat\n---------------\n"), 15)
    assert sample.status == PASS and sample.result == "exit 0; a sample of 11 characters"
    assert gpu_check.sample_row("w", "c", Finished(0, "\n"), 15).status == FAIL
    line = "hellaswag: n=8 acc=0.2500 acc_norm=0.3750 (0.1s, x.jsonl)\n"
    row = gpu_check.hellaswag_row("w", "c", Finished(0, line), 15, 8)
    assert row.status == PASS and row.details == dict(n=8, acc=0.25, acc_norm=0.375)
    assert gpu_check.hellaswag_row("w", "c", Finished(0, line), 15, 10).status == FAIL


# ---------------------------------------------------------------------------------------------------
# The memory-plan hook: the plan train.py prints, per GPU.


@pytest.mark.slow
def test_the_memory_plan_row_reads_memplan_and_reports_its_failure(monkeypatch):
    from marsgpt import memory_plan

    cfg = load_config(["config/train_gpt2_xl_mars.py"])
    expected = memory_plan.plan(cfg, world_size=8).total_bytes
    assert worker.memory_plan(cfg, 8) == dict(plan_bytes=int(expected), plan_note="")

    def broken(cfg, world_size):
        raise ValueError("no plan")

    monkeypatch.setattr(memory_plan, "plan", broken)
    assert worker.memory_plan(cfg, 8) == dict(
        plan_bytes=None, plan_note="memory_plan.plan failed: ValueError: no plan", plan_error=True
    )


def test_the_optimizer_worker_hands_on_bench_mars_s_own_rows(tmp_path, monkeypatch):
    from bench import bench_mars

    calls, rows = [], [bench_row("MARS-AdamW step vs AdamW(fused=True)", 2.0, 1.0, 2.0)]

    def run(quick=False):
        calls.append(quick)
        return rows

    monkeypatch.setattr(bench_mars, "run", run)
    assert worker.main(["optimizer", str(tmp_path / "r.json")]) == 0
    assert calls == [True]
    assert json.loads((tmp_path / "r.json").read_text()) == dict(rows=rows)


def mock_cuda(monkeypatch, gpus=8, name="NVIDIA H200", memory_gib=139.8, native_bf16=True):
    """torch.cuda as a node with `gpus` GPUs shows it; is_bf16_supported counts emulation unless told not to."""
    props = type("Properties", (), dict(name=name, total_memory=int(memory_gib * 2**30)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: native_bf16 or including_emulation
    )
    monkeypatch.setattr(torch.version, "cuda", "13.0")


def test_on_cuda_the_fsdp_worker_joins_nccl_on_its_rank_s_gpu_and_times_gpt2_small(monkeypatch):
    """gpu_check_worker's fsdp branch for CUDA, reached with torch.cuda and the process group mocked: the rank's
    GPU (LOCAL_RANK) made current and bound to NCCL, bench_fsdp.measure on GPT-2 small's shapes there, the rows
    labelled with the GPUs; and bench_fsdp's step timing synchronises that GPU on both sides of the step."""
    import torch.distributed as dist

    from bench import bench_fsdp

    calls = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw["device_id"])))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroyed"))

    def measure(config, rounds, device):
        calls.append(("measure", config, rounds, device))
        times = {name: 1e-3 for name in ("adamw", *bench_fsdp.RULES, bench_fsdp.MARS_M_BFLOAT16, *bench_fsdp.MUONS)}
        sent = {name: ({}, {}) for name in times}
        timeline = [("Newton-Schulz", 0, 0.0, 1.0), ("step", None, 0.0, 1.0)]
        return dict(times=times, whole=times, sent=sent, parameters=124e6, world=8, rounds=rounds, timeline=timeline)

    monkeypatch.setattr(bench_fsdp, "measure", measure)
    result = worker.fsdp_steps("cuda")
    gpu = torch.device("cuda", 3)
    assert calls == [
        ("set_device", gpu),
        ("nccl", gpu),
        ("measure", bench_fsdp.GPT2_SMALL, worker.FSDP_ROUNDS, gpu),
        "destroyed",
    ]
    assert result["world"] == 8 and "124.0M params, fp32, 8 GPUs" in result["rows"][0]["note"]

    calls.clear()
    optimizer = type("Optimizer", (), {"step": lambda self: calls.append("step")})()
    assert bench_fsdp.timed_step(optimizer, gpu, ranks=False) >= 0
    assert calls == [("synchronize", gpu), "step", ("synchronize", gpu)]


def test_the_device_worker_counts_emulated_bfloat16_as_none(monkeypatch):
    mock_cuda(monkeypatch, gpus=4, name="Tesla V100-SXM2-32GB", memory_gib=32, native_bf16=False)
    info = worker.device_info()
    assert info == dict(
        torch=torch.__version__, cuda="13.0", gpus=4, name="Tesla V100-SXM2-32GB", memory_bytes=32 * 2**30, bf16=False
    )


def test_on_cuda_main_warms_the_node_then_reads_it_and_runs_the_real_path(tmp_path, monkeypatch, capsys):
    """main's CUDA branch with torch.cuda mocked. The commands, which cannot start here, are recorded and
    answered: the warm-up first, within its own budget, then the device read (the real worker, in-process)
    within 10 s; torchrun on every GPU; the paper config compiled under DDP through torchrun on one rank, at its
    own shapes, with recompiles and graph breaks logged."""
    mock_cuda(monkeypatch)
    commands = []

    def read_device_info(work, logs, budget_s):
        commands.append((["device"], budget_s, None))
        return worker.device_info()

    def run_command(argv, log_path, timeout_s, stop_at=None, env=None):
        commands.append((argv, timeout_s, env))
        if "warm" in argv:
            path = argv[argv.index("warm") + 1]
            result = dict(import_s=21.5, devices=[f"cuda:{i}" for i in range(8)], seconds=33.0)
        elif "compiled" in argv:
            path = argv[argv.index("compiled") + 1]
            trace = path.removesuffix(".json") + "_trace.json.gz"
            open(trace, "wb").close()
            result = compiled_result(profile=dict(H200_LIKE_PROFILE, trace=trace))
        else:
            out_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("--out_dir="))
            os.makedirs(out_dir)
            records = [{"iter": 0, "val/loss": 10.9}, {"iter": 10, "val/loss": 10.2}]
            with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            return Finished(0, "world size 8 on cuda:0; 1 micro-batch per rank per step\n")
        with open(path, "w") as f:
            json.dump(result, f)
        return Finished(0, "")

    monkeypatch.setattr(gpu_check, "run_command", run_command)
    monkeypatch.setattr(gpu_check, "read_device_info", read_device_info)
    out = tmp_path / "out"
    assert gpu_check.main(["--out", str(out), "--only", "torchrun", "small_mars"]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["device"] == f"8 x NVIDIA H200 (139.8 GiB, bf16 yes), torch {torch.__version__}, CUDA 13.0"
    (warm, warm_budget, _), (device, device_budget, _), (launch_argv, _, _), (compiled, _, env) = commands
    assert warm[-2] == "warm" and warm_budget == gpu_check.WARM_UP_BUDGET_S
    assert device == ["device"] and device_budget == gpu_check.DEVICE_INFO_BUDGET_S == 10
    assert launch_argv[launch_argv.index("torch.distributed.run") + 1 : launch_argv.index("train.py")] == [
        "--standalone",
        "--nproc_per_node=8",
    ]
    launcher = compiled[compiled.index("torch.distributed.run") + 1 : compiled.index("scripts.gpu_check_worker") - 1]
    assert launcher == ["--standalone", "--nproc_per_node=1"]
    assert "config/train_gpt2_small_mars.py" in compiled and "--compile=True" in compiled
    assert "--gradient_accumulation_steps=8" in compiled and not any(a.startswith("--n_layer") for a in compiled)
    assert env["TORCH_LOGS"] == "recompiles,graph_breaks" and env["TORCHINDUCTOR_CACHE_DIR"].endswith("compile_cache")
    rows = [(r["check"], r["what"], r["status"]) for r in report["rows"]]
    assert rows[:3] == [
        ("warm", "warm-up: the modules imported, a CUDA context and cuBLAS on every GPU", PASS),
        ("data", "synthetic token data and a tiny HellaSwag file", PASS),
        ("torchrun", "torchrun, 8 processes (one per GPU)", PASS),
    ]
    assert [what for check, what, status in rows[3:]] == [
        "GPT-2 small, MARS (paper config, compiled, DDP): compile",
        "GPT-2 small, MARS (paper config, compiled, DDP): graph breaks and recompiles",
        "GPT-2 small, MARS (paper config, compiled, DDP)",
        "GPT-2 small, MARS (paper config, compiled, DDP): peak memory",
        "GPT-2 small, MARS (paper config, compiled, DDP): attention kernel",
        "GPT-2 small, MARS (paper config, compiled, DDP): profile",
    ]
    assert all(status == PASS for _, _, status in rows)
    assert compiled[compiled.index("compiled") + 2 : compiled.index("compiled") + 4] == ["10", "2"]  # steps, profiled
    assert (out / "logs" / "small_mars_trace.json.gz").is_file()  # moved out of <work>, which goes
    assert report["rows"][0]["result"] == "33.0 s (21.5 s importing), on " + ", ".join(f"cuda:{i}" for i in range(8))


def test_the_warm_up_loads_the_modules_and_runs_a_matmul_on_each_device():
    result = worker.warm_up(["cpu"])
    assert result["devices"] == ["cpu"] and result["seconds"] >= result["import_s"] >= 0
    assert "train" in sys.modules


def test_the_memory_rows_build_the_model_on_the_gpu_not_on_the_cpu(monkeypatch):
    """models_built_on(device): train.setup's GPT is built, and initialised, on the device. On the meta device
    here: not one of its initialisations touches a tensor on the CPU (GPT-2 XL's take over a minute there)."""
    from marsgpt import launch
    from model import GPT, GPTConfig

    initialised = []
    for name in ("normal_", "kaiming_uniform_", "uniform_", "zeros_"):
        real = getattr(torch.nn.init, name)

        def record(tensor, *args, _real=real, **kwargs):
            initialised.append(tensor.device.type)
            return _real(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.nn.init, name, record)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    with worker.models_built_on("meta"):
        model = launch.GPT(config)
    assert initialised and set(initialised) == {"meta"}
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert launch.GPT is GPT  # restored


def test_the_device_worker_reports_torch_and_the_gpus(tmp_path, capsys):
    assert worker.main(["device", str(tmp_path / "d.json")]) == 0
    info = json.loads((tmp_path / "d.json").read_text())
    assert (info["torch"], info["gpus"]) == (torch.__version__, torch.cuda.device_count())
    assert worker.main(["nosuch", str(tmp_path / "x.json")]) == 2
    assert error_lines(capsys).startswith("error: usage: gpu_check_worker.py")


# ---------------------------------------------------------------------------------------------------
# Running: commands, checks and the driver.


def test_a_command_is_killed_at_its_stop_line_or_at_its_timeout(tmp_path):
    log = str(tmp_path / "log")
    code = "import time; print('start', flush=True); print('iter 14: x', flush=True); time.sleep(60)"
    stopped = gpu_check.run_command([sys.executable, "-c", code], log, 120, stop_at="iter 14:")
    assert (stopped.returncode, stopped.stopped, stopped.timed_out) == (-9, True, False)
    assert stopped.output == "start\niter 14: x\n"
    slow = gpu_check.run_command([sys.executable, "-c", "import time; time.sleep(60)"], log, 0.5)
    assert slow.timed_out and not slow.ok
    assert gpu_check.failure(slow, 1) == "timed out: still running at the end of its 1 s budget"
    assert open(log).read().count("$ ") == 2  # each command heads its output in the log


def fake_check(name, run, needs=(), cuda_only=False):
    return gpu_check.Check(name, f"what {name}", 5, run, needs, cuda_only)


def test_a_failing_check_fails_its_row_and_the_checks_that_need_it_but_not_the_others(tmp_path, monkeypatch, capsys):
    def boom(ctx):
        raise RuntimeError("boom")

    checks = (
        fake_check("first", lambda ctx: [Row("first", "cmd", "fine", PASS)]),
        fake_check("broken", boom),
        fake_check("after", lambda ctx: [Row("after", "cmd", "fine", PASS)], needs=("broken",)),
        fake_check("cuda", lambda ctx: [Row("cuda", "cmd", "fine", PASS)], cuda_only=True),
        fake_check("last", lambda ctx: [Row("last", "cmd", "fine", PASS)]),
    )
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    monkeypatch.setattr(gpu_check, "CHECKS_BY_NAME", {c.name: c for c in checks})
    monkeypatch.setattr(
        gpu_check, "read_device_info", lambda work, logs, budget_s: dict(torch="2.x", cuda=None, gpus=0)
    )
    monkeypatch.setattr(gpu_check, "warm_up", lambda work, logs, budget_s: Row("warm-up", "", "ok", PASS, check="warm"))
    out = tmp_path / "out"
    assert gpu_check.main(["--device=cpu", "--out", str(out)]) == 1
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["complete"] is True
    assert [(r["check"], r["status"], r["result"]) for r in report["rows"]] == [
        ("warm", PASS, "ok"),
        ("first", PASS, "fine"),
        ("broken", FAIL, "RuntimeError: boom"),
        ("after", FAIL, "not run: it needs broken, which failed"),
        ("cuda", SKIP, "skipped: needs CUDA"),
        ("last", PASS, "fine"),
    ]
    assert "RuntimeError: boom" in (out / "logs" / "broken.log").read_text()  # the traceback
    stdout = capsys.readouterr().out
    assert stdout == (out / "gpu_check.md").read_text() and "| what broken |  | RuntimeError: boom | fail |" in stdout


FIRST10 = os.path.join(ROOT, "scripts", "gpu_first10.sh")
SYNC_ROW = ("optimizer", "MARS steps under set_sync_debug_mode('error')")  # CUDA only: skipped on the CPU


def run_on_cpu(script, out, *args):
    done = subprocess.run(
        ["bash", script, "--device=cpu", "--out", str(out), *args],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["complete"] is True and report["device"].startswith("cpu")
    assert done.stdout == (out / "gpu_check.md").read_text()
    # every row ran its own pass condition; only what needs CUDA (the host-sync check) is skipped
    assert [(r["check"], r["status"]) for r in report["rows"] if r["status"] != PASS] in ([], [(SYNC_ROW[0], SKIP)])
    assert [(r["check"], r["what"]) for r in report["rows"] if r["status"] == SKIP] in ([], [SYNC_ROW])
    for check in {r["check"] for r in report["rows"]} - {"data"}:
        assert (out / "logs" / f"{check}.log").read_text().startswith("$ "), check
    return report, {(r["check"], r["what"]): r for r in report["rows"]}


@pytest.mark.slow
def test_the_first_ten_minutes_run_end_to_end_on_cpu_within_their_budgets(tmp_path):
    """scripts/gpu_first10.sh --device=cpu: the warm-up and every check of FIRST_TEN_MINUTES, in its order, each
    within its budget (a check past it is killed and fails), the whole within the sum."""
    out = tmp_path / "out"
    report, rows = run_on_cpu(FIRST10, out)
    assert (out / "gpu_check.md").read_text().startswith("# GPU check: the first ten minutes\n")
    checks = list(dict.fromkeys(r["check"] for r in report["rows"]))
    assert checks == ["warm", *gpu_check.FIRST_TEN_MINUTES]
    first10 = gpu_check.with_needs(gpu_check.FIRST_TEN_MINUTES, gpu_check.FIRST_TEN_MINUTES)
    assert report["budget"] == f"{gpu_check.budget_of(first10)} s (--first10)"
    seconds = float(report["status"].rsplit(", ", 1)[1].removesuffix(" s"))
    assert seconds <= gpu_check.budget_of(first10) * gpu_check.CPU_BUDGET_FACTOR
    # the real path: compiled, under DDP, with its graphs, speed, memory and attention kernel
    what = "GPT-2 small, MARS (paper config, compiled, DDP)"
    throughput = rows["small_mars", what]["details"]
    assert throughput["tokens_per_sec"] > 0 and throughput["steps"] == gpu_check.TIMED_STEPS
    graphs = rows["small_mars", f"{what}: graph breaks and recompiles"]["details"]
    assert graphs["graph_breaks"] == {} and graphs["graphs"] == graphs["graphs_after_warm_up"] >= 2
    assert rows["small_mars", f"{what}: attention kernel"]["details"]["kernel"] == "flash (CPU)"
    profile = rows["small_mars", f"{what}: profile"]["details"]
    assert profile["steps"] == gpu_check.PROFILED_STEPS and 0 < profile["busy"] <= 1
    assert (out / profile["trace"]).is_file()
    # FSDP2: train.py sharded over 2 gloo ranks with its checkpoint in 2 shard files; the sharded steps measured
    launch = rows["fsdp", "FSDP2: train.py --zero_stage=3 under torchrun, 2 processes"]
    assert launch["details"]["shard_files"] == 2 and "FSDP2 over 2 GPUs" in launch["result"]
    fsdp = {r["what"]: r for r in report["rows"] if r["check"] == "fsdp"}
    assert fsdp["FSDP2 mars-m step vs FSDP2 AdamW(fused=True) step"]["details"]["ours"] > 0
    assert fsdp["FSDP2 mars-adamw step: bytes sent per rank"]["result"].endswith(": allreduce_ x1: 80 bytes")
    assert re.search(
        r": allreduce_ x1: \d+ bytes, alltoall_base_ x2: [\d.,]+ KiB$",
        mars_m_bytes := fsdp["FSDP2 mars-m step: bytes sent per rank"]["result"],
    ), mars_m_bytes
    assert re.search(
        r": alltoall_base_ x2: [\d.,]+ KiB$", fsdp["FSDP2 muon-owners step: bytes sent per rank"]["result"]
    )
    # MARS's default path measured (the kernel runs on CUDA only); a bitwise resume; the compile again; the quickstart
    optimizer = [r for r in report["rows"] if r["check"] == "optimizer"]
    assert [r["what"] for r in optimizer[:2]] == STEP_ROWS
    assert all(r["details"]["default"]["ours"] > 0 and r["details"]["kernel"] is None for r in optimizer[:2])
    resume = rows["resume", "killed with SIGKILL and resumed (not compiled, --deterministic=True)"]["details"]
    assert resume["losses"] > 0 and resume["max_abs_difference"] == 0
    assert 0 <= resume["resumed_from"] < gpu_check.RESUME_RUN["max_iters"]
    warm = rows["small_mars_warm", f"{what}: compile, requeued elsewhere"]
    assert warm["status"] == PASS and warm["details"]["first_step_s"] > 0
    quickstart = rows["quickstart", "the quickstart: scripts/quickstart.sh's commands"]
    assert quickstart["status"] == PASS and quickstart["details"]["steps"] == gpu_check.QUICKSTART_CPU["max_iters"]


@pytest.mark.slow
def test_the_other_checks_run_end_to_end_on_cpu(tmp_path):
    """The launch paths, the tools and GPT-2 XL's memory (memory_small and small_deterministic run memory_xl's and
    small_mars's code with another config or one more key, and each process start costs seconds on a small CPU)."""
    only = ("single", "torchrun", "sample", "hellaswag", "memory_xl")
    report, rows = run_on_cpu(SCRIPT, tmp_path / "out", "--only", *only)
    assert [r["check"] for r in report["rows"]] == [
        "warm",
        "data",
        "single",
        "torchrun",
        "sample",
        "hellaswag",
        "memory_xl",
    ]
    assert "world size 1 on cpu" in rows["single", "one process: python train.py, device auto"]["result"]
    assert rows["hellaswag", "marsgpt/hellaswag.py --data on a tiny local file"]["details"]["n"] == 8
    assert rows["memory_xl", "peak memory: GPT-2 XL, MARS, 5 x 1024"]["details"]["steps"] == 2


def test_a_warm_up_that_runs_out_of_time_is_a_failed_row(tmp_path, monkeypatch):
    calls = []

    def run_command(argv, log_path, timeout_s, stop_at=None, env=None):
        calls.append((argv[-2], timeout_s))
        return Finished(-9, "", timed_out=True)

    monkeypatch.setattr(gpu_check, "run_command", run_command)
    row = gpu_check.warm_up(str(tmp_path), str(tmp_path), gpu_check.WARM_UP_BUDGET_S)
    assert calls == [("warm", gpu_check.WARM_UP_BUDGET_S)]
    assert (row.check, row.status) == ("warm", FAIL)
    assert row.result == f"timed out: still running at the end of its {gpu_check.WARM_UP_BUDGET_S} s budget"


@pytest.mark.slow
@pytest.mark.parametrize("plant", [None, "recompile", "graph break"])
def test_the_compiled_run_catches_a_recompile_after_the_warm_up_and_any_graph_break(
    data_path, tmp_path, monkeypatch, plant
):
    """gpu_check_worker.compiled_run in this process (one rank without torchrun; aot_eager on the CPU), its
    graphs and breaks read by compile_rows: clean, with a batch of another shape among the timed steps (a
    recompile, which the fail_on_recompile stance turns into an error), with a graph break in the MLP."""
    from train_helpers import tiny_args

    import model as model_module
    import train

    if plant == "recompile":
        step = train.train_step

        def train_step(run, it):
            if it == worker.WARM_UP_STEPS:  # the first timed step
                run.cfg = dataclasses.replace(run.cfg, batch_size=run.cfg.batch_size + 1)
            return step(run, it)

        monkeypatch.setattr(train, "train_step", train_step)
    elif plant == "graph break":
        forward = model_module.MLP.forward

        def broken(self, x):
            torch._dynamo.graph_break()
            return forward(self, x)

        monkeypatch.setattr(model_module.MLP, "forward", broken)
    argv = tiny_args(data_path, str(tmp_path / "out"), compile=True, eval_iters=2)
    result = worker.compiled_run(3, argv)
    row = gpu_check.compile_rows("w", "c", result)[1]
    if plant is None:
        assert row.status == PASS and result["steps"] == 3 and result["graph_breaks"] == {}, row.result
    elif plant == "recompile":
        assert row.status == FAIL and row.result.startswith("recompiled after the warm-up: RuntimeError: Detected")
    else:
        assert row.status == FAIL and " graph break(s): " in row.result, row.result


@pytest.mark.slow
def test_the_mesh_of_one_row_runs_the_sharded_step_against_the_unsharded_one_on_one_gloo_rank(monkeypatch):
    """gpu_check's mesh_of_one row on the CPU, end to end in this process: bench_fsdp.mesh_of_one on one gloo rank
    (the quick shapes; MARS-Shampoo's and MARS-M's owner exchange on a mesh of one), its rows as the table shows
    them: the times measured, the parameters the unsharded step's to the target, the memory CUDA's only."""
    import torch.distributed as dist

    from bench import bench_fsdp
    from bench.common import rendezvous

    with rendezvous() as environment:
        for key, value in {**environment, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(key, value)
        result = worker.mesh_of_one_steps("cpu")
    assert not dist.is_initialized()
    rows = gpu_check.mesh_of_one_rows(result["rows"], "cmd", cuda=False)
    names = [r.what for r in rows]
    for rule in bench_fsdp.MESH_OF_ONE_RULES:
        what = f"{rule} step on a mesh of one (the owner exchange)"
        assert names.count(f"{what} vs the unsharded step") == 1
        equal = next(r for r in rows if r.what == f"{what}: its parameters against the unsharded step's")
        assert equal.status == PASS and 0 <= equal.details["ours"] <= 1e-4  # float32 Newton-Schulz on the CPU
        memory = next(r for r in rows if r.what == f"{what}: peak memory beyond the state vs the plan")
        assert memory.status == PASS and memory.result.startswith("not measured: ")
        assert memory.details["reference"] > 0  # the plan


def test_the_mesh_of_one_rows_judge_equality_and_memory_on_cuda_and_fail_what_was_not_measured():
    rows = gpu_check.mesh_of_one_rows(
        [
            bench_row("x step on a mesh of one vs the unsharded step", 12.0, 10.0, 1.2, note="124M"),
            bench_row("x: its parameters", 0.002, unit="lr", ratio=0.002, target="<= 0.01"),
            bench_row("x: its parameters, far", 0.5, unit="lr", ratio=0.5, target="<= 0.01"),
            bench_row("x: peak memory", 105.0, 100.0, 1.05, unit="MiB", target="<= 1.1", note="plan"),
            bench_row("x: peak memory, over", 150.0, 100.0, 1.5, unit="MiB", target="<= 1.1", note="plan"),
            bench_row("x: peak memory, none", float("nan"), 100.0, unit="MiB", target="<= 1.1", note="CUDA only"),
        ],
        "cmd",
        cuda=True,
    )
    assert [r.status for r in rows] == [PASS, PASS, FAIL, PASS, FAIL, FAIL]
    assert rows[3].result == "105 MiB of 100 MiB planned; plan; target <= 1.1"
    nothing = gpu_check.mesh_of_one_rows([], "cmd", cuda=True)
    assert [(r.status, r.result) for r in nothing] == [(FAIL, "the bench gave no row")]


def test_on_cuda_the_mesh_of_one_worker_runs_on_its_gpu_over_nccl_at_gpt2_small_s_shapes(monkeypatch):
    """gpu_check_worker's mesh_of_one branch for CUDA, with torch.cuda and the process group mocked: the GPU made
    current and bound to NCCL, bench_fsdp.mesh_of_one on GPT-2 small's shapes there, rows labelled 1 GPU."""
    import torch.distributed as dist

    from bench import bench_fsdp

    calls = []
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw["device_id"])))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroyed"))

    def mesh_of_one(config, device):
        calls.append(("mesh_of_one", config, device))
        measured = dict(sharded_ms=2.0, whole_ms=1.0, difference=0.0, peak_bytes=2**20, planned_bytes=2**20)
        return dict(rules={"mars-m": measured}, parameters=124e6)

    monkeypatch.setattr(bench_fsdp, "mesh_of_one", mesh_of_one)
    result = worker.mesh_of_one_steps("cuda")
    gpu = torch.device("cuda", 0)
    assert calls == [("set_device", gpu), ("nccl", gpu), ("mesh_of_one", bench_fsdp.GPT2_SMALL, gpu), "destroyed"]
    assert "124.0M params, fp32, 1 GPU" in result["rows"][0]["note"]
    assert [r.status for r in gpu_check.mesh_of_one_rows(result["rows"], "cmd", cuda=True)] == [PASS] * 3
