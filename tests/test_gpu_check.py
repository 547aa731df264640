"""scripts/gpu_check.sh and its driver scripts/gpu_check.py, on CPU: argument handling, the synthetic data,
the table and each row's pass/fail rule (fed made-up results), the memory-plan hook, and a --device=cpu run
of every check end to end."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from train_helpers import subprocess_env

import hellaswag
import launch
from configurator import load_config

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


def test_the_shell_script_runs_the_driver_with_its_arguments():
    done = subprocess.run(["bash", SCRIPT, "--only", "nosuch"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith("error: no check named nosuch") and len(done.stderr.splitlines()) == 1


def test_only_runs_the_checks_it_names_after_those_they_need():
    names = [c.name for c in gpu_check.with_needs(["hellaswag", "torchrun"])]
    assert names == ["data", "single", "torchrun", "hellaswag"]
    assert [c.name for c in gpu_check.with_needs(["optimizer"])] == ["optimizer"]


def test_the_budgets_fit_in_eight_minutes():
    assert gpu_check.TOTAL_BUDGET_S <= 8 * 60


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


def train_line(**values):
    line = {"iter": 15, "train/loss": 10.9, "tokens_per_sec": 469_123.0, "step_ms": 262.0, "mfu": 40.46}
    return dict(line, **values)


def test_throughput_reports_the_last_train_line():
    records = [{"iter": 0, "val/loss": 10.9}, train_line(iter=5, tokens_per_sec=1.0), train_line()]
    row = gpu_check.throughput_row("w", "c", OK, 100, records)
    assert row.status == PASS
    assert row.result == "469,123 tokens/s, MFU 40.5%, 262 ms/step (steps to 15), loss 10.900"
    unknown_gpu = gpu_check.throughput_row("w", "c", OK, 100, [train_line(mfu=None)])
    assert unknown_gpu.status == PASS and "MFU n/a" in unknown_gpu.result


@pytest.mark.parametrize(
    "finished, records, says",
    [
        (Finished(2, "step 0\nerror: data directory x not found\n"), [], "exit 2: error: data directory x not found"),
        (Finished(-9, "", timed_out=True), [], "timed out: still running at the end of its 100 s budget"),
        (Finished(-11, "Fatal Python error\n"), [], "killed by SIGSEGV"),
        (OK, [{"iter": 0, "val/loss": 10.9}], "no train line"),
        (OK, [train_line(**{"train/loss": None})], "loss None"),
    ],
)
def test_throughput_fails_on_a_failed_run_or_a_missing_or_non_finite_line(finished, records, says):
    row = gpu_check.throughput_row("w", "c", finished, 100, records)
    assert row.status == FAIL and says in row.result


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


def bench_row(benchmark, ours, reference=None, ratio=None, unit="ms", target="", note=""):
    return dict(benchmark=benchmark, ours=ours, reference=reference, unit=unit, ratio=ratio, target=target, note=note)


SYNC_ROWS = [bench_row(f"{t} step without host sync", 1, unit="bool", target="1") for t in ("mars-adamw", "mars-lion")]


def test_optimizer_rows_judge_fused_adamw_by_the_bench_s_target_and_every_sync_row():
    rows = gpu_check.optimizer_rows(
        [
            bench_row("MARS-AdamW step vs AdamW(foreach=True)", 5.0, 3.5, 1.43, target="<= 1.3 (CPU)"),  # not CUDA
            bench_row("MARS-AdamW step vs AdamW(fused=True)", 2.1, 1.5, 1.4, target="<= 1.5 (CUDA)"),
            bench_row("MARS-Lion step vs AdamW(fused=True)", 4.33, 1.42, 3.05, target="<= 1.4"),
            bench_row("MARS-Shampoo step vs AdamW(fused=True)", 15.0, 1.42, 10.6),
            *SYNC_ROWS,
            bench_row("mars-adamw state", 1400.0, 475.0, 2.95, unit="MiB"),
        ],
        "bench",
    )
    assert [(r.what, r.status) for r in rows] == [
        ("MARS-AdamW step vs AdamW(fused=True)", PASS),
        ("MARS-Lion step vs AdamW(fused=True)", FAIL),
        ("MARS-Shampoo step vs AdamW(fused=True)", PASS),
        ("MARS steps under set_sync_debug_mode('error')", PASS),
    ]
    assert rows[0].result == "2.1 ms vs 1.5 ms: 1.40x, target <= 1.5"
    assert rows[1].result == "4.33 ms vs 1.42 ms: 3.05x, target <= 1.4"
    assert rows[2].result.endswith("(the bench states no target)")
    assert rows[3].result == "no host sync: mars-adamw step without host sync, mars-lion step without host sync"


def test_optimizer_rows_fail_on_a_host_sync_a_missing_number_or_missing_rows():
    syncing = SYNC_ROWS[:1] + [bench_row("mars-shampoo step without host sync", 0, unit="bool")]
    unmeasured = bench_row("MARS-AdamW step vs AdamW(fused=True)", None, note="crashed")
    rows = gpu_check.optimizer_rows([unmeasured, *syncing], "bench")
    assert [r.status for r in rows] == [FAIL, FAIL]
    assert rows[0].result == "not measured: crashed"
    assert rows[1].result == "host sync in: mars-shampoo step without host sync"
    rows = gpu_check.optimizer_rows([bench_row("something else", 1.0)], "bench")
    assert [(r.status, r.result) for r in rows] == [
        (FAIL, "bench_mars gave no fused-AdamW row"),
        (FAIL, "bench_mars gave no host-sync row"),
    ]


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
    close = gpu_check.memory_row("w", "c", OK, 55, cuda_memory(plan_bytes=44 * 2**30, plan_note=""))
    assert close.status == PASS and close.result.endswith("plan 44.0 GiB, measured/plan 1.10 (tolerance 15%)")
    far = gpu_check.memory_row("w", "c", OK, 55, cuda_memory(plan_bytes=30 * 2**30, plan_note=""))
    assert far.status == FAIL and "measured/plan 1.61" in far.result
    broken = gpu_check.memory_row("w", "c", OK, 55, cuda_memory(plan_note="memplan.plan failed: x", plan_error=True))
    assert broken.status == FAIL and broken.result.endswith("plan: memplan.plan failed: x")


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


def test_the_memory_plan_row_reads_memplan_and_reports_its_failure(monkeypatch):
    import memplan

    cfg = load_config(["config/train_gpt2_xl_mars.py"])
    expected = memplan.plan(cfg, world_size=8).total_bytes
    assert worker.memory_plan(cfg, 8) == dict(plan_bytes=int(expected), plan_note="")

    def broken(cfg, world_size):
        raise ValueError("no plan")

    monkeypatch.setattr(memplan, "plan", broken)
    assert worker.memory_plan(cfg, 8) == dict(
        plan_bytes=None, plan_note="memplan.plan failed: ValueError: no plan", plan_error=True
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
    monkeypatch.setattr(gpu_check, "read_device_info", lambda work, logs: dict(torch="2.x", cuda=None, gpus=0))
    out = tmp_path / "out"
    assert gpu_check.main(["--device=cpu", "--out", str(out)]) == 1
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["complete"] is True
    assert [(r["check"], r["status"], r["result"]) for r in report["rows"]] == [
        ("first", PASS, "fine"),
        ("broken", FAIL, "RuntimeError: boom"),
        ("after", FAIL, "not run: it needs broken, which failed"),
        ("cuda", SKIP, "skipped: needs CUDA"),
        ("last", PASS, "fine"),
    ]
    assert "RuntimeError: boom" in (out / "logs" / "broken.log").read_text()  # the traceback
    stdout = capsys.readouterr().out
    assert stdout == (out / "gpu_check.md").read_text() and "| what broken |  | RuntimeError: boom | fail |" in stdout


# Every kind of check once: small_adamw and memory_small run the same code as small_mars and memory_xl,
# with another config, and each process start costs seconds on a small CPU.
END_TO_END = ["single", "torchrun", "small_mars", "optimizer", "resume", "memory_xl", "sample", "hellaswag"]


@pytest.mark.slow
def test_the_checks_run_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", SCRIPT, "--device=cpu", "--out", str(out), "--only", *END_TO_END],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    statuses = {r["check"]: r["status"] for r in report["rows"]}
    assert statuses == {"data": PASS, **{name: SKIP if name == "optimizer" else PASS for name in END_TO_END}}
    assert report["complete"] is True and report["device"].startswith("cpu")
    assert done.stdout == (out / "gpu_check.md").read_text()
    rows = {r["check"]: r for r in report["rows"]}
    assert "world size 1 on cpu" in rows["single"]["result"]
    assert rows["small_mars"]["details"]["tokens_per_sec"] > 0
    assert rows["resume"]["details"]["losses"] > 0 and rows["resume"]["details"]["max_abs_difference"] == 0
    assert 0 <= rows["resume"]["details"]["resumed_from"] < gpu_check.RESUME_RUN["max_iters"]
    assert rows["memory_xl"]["details"]["steps"] == 2
    assert rows["hellaswag"]["details"]["n"] == gpu_check.HELLASWAG_EXAMPLES
    for name in END_TO_END:
        if name != "optimizer":
            assert (out / "logs" / f"{name}.log").read_text().startswith("$ "), name
