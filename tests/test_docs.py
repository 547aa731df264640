"""README.md and docs/: every command they show runs as shown, in a quick form (extracted from the files, so a doc
that changes is tested as written), on a copy of the repository; the figures the README quotes from deterministic
commands are what those commands print. A command that needs a GPU, the network, several nodes or hours is listed
with the reason it is not run."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from doc_examples import ROOT, doc_commands
from test_memory_plan import memory_table_module


@dataclasses.dataclass(frozen=True)
class Run:
    """How a doc's command runs here: `fill` replaces its placeholders (each key must be in the command), `quick`
    is appended (later keys win over the doc's own), after the `needs` of SETUPS ran once in the copy; it must end
    with one of `rc` and print `expect`."""

    quick: str = ""
    fill: tuple = ()  # (placeholder, text) pairs; {tree} in the text is the copy's path
    needs: tuple = ()
    rc: tuple = (0,)
    expect: str = ""


@dataclasses.dataclass(frozen=True)
class Skip:
    reason: str


SHORT = "--device=cpu --max_iters=2 --eval_interval=2 --eval_iters=1 --log_interval=1"
PLAN = "--dry_run=True"  # a paper run's quick form: its memory plan, with no data, GPU or network
QUICKSTART = "--max_iters=2 --eval_iters=1 --log_interval=1 --device=cpu"
GPU = "needs a CUDA GPU: scripts/gpu_check.sh runs it on one (docs/gpu.md)"
NAME = "a name or pattern in the text, not a command to run"
# a benchmark's own command: its quick form runs in python -m bench.run_all --quick's table (below), its command line
# in tests/test_bench.py (--help)
IN_RUN_ALL = "python -m bench.run_all --quick runs it (minutes); tests/test_bench.py runs its --help"
CIFAR = "--device=cpu --epochs=1 --width=8 --batch_size=8 --data_dir={tree}/cifar"

COMMANDS = {
    # README: set-up
    "python3 -m venv .venv && source .venv/bin/activate": Run(),
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": Skip(
        "the network; .ci/run runs it in a new virtual environment"
    ),
    "pip install -r requirements.txt -r requirements-extra.txt -r requirements-test.txt -c constraints.txt": Skip(
        "the network; .ci/run runs it in a new virtual environment"
    ),
    "pip install -r requirements.txt -c constraints.txt": Skip(
        "the network; measured in a new virtual environment for the README (Set-up)"
    ),
    "pip install torch==2.13.0": Skip("the network, and PyPI's CUDA build for a GPU machine"),
    "pip freeze | grep -ci nvidia": Run(rc=(0, 1)),  # grep -c exits 1 when it counts none
    "pip install <this repository>": Skip("tests/test_mars_install.py installs the repository in a new environment"),
    "python -m <folder>.<name>": Skip(NAME),
    # README: quickstart, test
    "bash scripts/quickstart.sh": Run(quick=QUICKSTART, expect="def "),
    "time bash scripts/quickstart.sh": Run(quick=QUICKSTART, expect="def "),
    "bash scripts/quickstart.sh --init_from=scratch --overwrite=True": Run(quick=QUICKSTART, needs=("quickstart",)),
    'python sample.py --out_dir=out-quickstart --start="def "': Run(quick="--max_new_tokens=20", needs=("quickstart",)),
    "torchrun --standalone --nproc_per_node=2 train.py config/quickstart.py --gradient_accumulation_steps=2 "
    "--batch_size=6": Run(quick=SHORT + " --out_dir=out-ddp", needs=("stdlib_char",), expect="world size 2 on cpu"),
    "python -m bench.bench_threads --quick": Skip(IN_RUN_ALL),
    "ruff check . && ruff format --check . && python -m pytest -q": Run(
        quick="--collect-only", expect="tests collected"
    ),
    'python -m pytest -q -m "not slow"': Run(quick="--collect-only", expect="tests collected"),
    "python -m pytest -q -n 0 tests/test_docs.py": Run(quick="--collect-only", expect="tests collected"),  # itself
    "ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE TEST_MKLDNN=0 python -m pytest -q tests/test_mars.py": Run(
        quick="-m 'not slow' -k reference", expect="passed"
    ),
    "ATEN_CPU_CAPABILITY=avx512 python -m pytest -q tests/test_memory_plan.py": Run(
        quick="-m 'not slow' -k allocated", expect="passed"
    ),
    # README: the paper's runs (their quick form: the memory plan, which reads the configs, builds no model and
    # needs no data; the run scripts under torchrun as they launch them)
    **{
        f"bash scripts/{script}.sh": Run(quick=PLAN, expect="memory plan per GPU")
        for script in ("run_mars_small", "run_mars_medium", "run_mars_large", "run_mars_xl_fw", "run_adamw_xl_fw")
    },
    **{
        f"bash scripts/{script}.sh": Run(quick=PLAN, expect="memory plan per GPU")
        for script in (
            "run_adamw_{small,medium,large}",
            "run_muon_{small,medium,large}",
            "run_mars_m_{small,medium,large}",
            "run_mars_m_{small,xl}_fw",
            "run_moonlight_{small,medium,large}",
            "run_moonlight_{small,xl}_fw",
        )
    },
    "bash scripts/run_{mars,adamw,muon}_{small,medium,large}.sh": Run(quick=PLAN, expect="memory plan per GPU"),
    "python train.py config/train_gpt2_small_mars.py": Run(quick=PLAN, expect="memory plan per GPU"),
    "python train.py": Run(quick=PLAN, expect="memory plan per GPU"),
    "python -m marsgpt.config config/<file>.py": Run(
        fill=(("<file>", "train_gpt2_small_mars"),), expect="learning_rate"
    ),
    "python train.py config/train_gpt2_xl_mars.py --dry_run=True --plan_world_size=8 --gpu_memory_gb=40": Run(
        expect="does NOT fit"
    ),
    "python -m scripts.memory_table": Skip("2-3 minutes; test_the_readme_s_figures_are_what_its_commands_print"),
    "NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash scripts/multinode.sh config/train_gpt2_xl_mars.py "
    "config/fineweb_edu.py": Skip("two nodes; tests/test_scripts.py runs it with a stand-in torchrun"),
    "NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash scripts/multinode.sh config/train_gpt2_xl_mars.py --zero_stage=3 "
    "--hsdp_replicas=2": Skip("two nodes; tests/test_scripts.py runs multinode.sh with a stand-in torchrun"),
    "sbatch scripts/slurm_mars_small.sbatch": Skip("SLURM; tests/test_scripts.py runs it with stand-in srun"),
    "sbatch scripts/slurm_mars_small.sbatch [--key=value ...]": Skip("SLURM; tests/test_scripts.py runs it"),
    "bash scripts/gpu_first10.sh": Run(quick="--help", expect="usage"),
    "bash scripts/gpu_check.sh": Run(quick="--help", expect="usage"),
    # docs/data.md
    "python -m data.manifest data/openwebtext": Run(needs=("openwebtext",)),
    "python -m data.stdlib_char.prepare": Run(expect="vocabulary"),
    "python data/stdlib_char/prepare.py": Run(expect="vocabulary"),
    "python -m data.shakespeare_char.prepare": Run(quick="--input README.md", expect="vocabulary"),
    "python data/shakespeare_char/prepare.py": Run(quick="--input README.md", expect="vocabulary"),
    "python -m data.openwebtext.prepare [--data_files owt/*.parquet] [--num_proc N]": Run(
        fill=(("[--data_files owt/*.parquet]", "--data_files {tree}/owt/*.parquet"), ("[--num_proc N]", "")),
        needs=("parquet",),
    ),
    "python -m data.fineweb_edu.prepare [--subset sample-10BT\\|sample-100BT\\|sample-350BT] [--data_files ...] "
    "[--shard_size 100000000] [--num_proc N]": Run(
        fill=(
            ("[--subset sample-10BT\\|sample-100BT\\|sample-350BT] ", ""),
            ("[--data_files ...]", "--data_files {tree}/owt/*.parquet"),
            ("[--shard_size 100000000]", "--shard_size 1000"),
            ("[--num_proc N]", "--num_proc 1"),
        ),
        needs=("parquet",),
    ),
    "python -m data.manifest": Run(quick="--help", expect="usage"),
    "python -m data.<name>.prepare": Skip(NAME),
    "python -m data.manifest <dir>": Run(fill=(("<dir>", "data/stdlib_char"),), needs=("stdlib_char",)),
    # docs/evaluation.md
    'python sample.py --out_dir=out-quickstart --start="def " --num_samples=3 --max_new_tokens=300': Run(
        quick="--max_new_tokens=20", needs=("quickstart",)
    ),
    "python sample.py --init_from=gpt2 --start=FILE:prompt.txt --temperature=0.8 --top_k=200": Skip(
        "the Hugging Face hub (GPT-2's weights)"
    ),
    "python -m marsgpt.hellaswag --ckpt out [--data hellaswag_val.jsonl] [--device cuda] [--limit 500]": Run(
        fill=(("[--data hellaswag_val.jsonl] ", ""), ("[--device cuda] ", ""), ("[--limit 500]", "--limit 4")),
        needs=("gpt2_checkpoint", "hellaswag"),
        expect="hellaswag: n=4",
    ),
    "python -m marsgpt.hellaswag --ckpt out --prompt llm.c": Run(
        quick="--limit 4", needs=("gpt2_checkpoint", "hellaswag"), expect="hellaswag: n=4"
    ),
    "python -m marsgpt.hellaswag --ckpt out --scores scores.jsonl [--overwrite]": Run(
        fill=(("[--overwrite]", "--overwrite"),), quick="--limit 4", needs=("gpt2_checkpoint", "hellaswag")
    ),
    "python train.py config/train_gpt2_small_mars.py --hellaswag_interval=1000 "
    "[--hellaswag_path=hellaswag_val.jsonl]": Run(
        fill=(("[--hellaswag_path=hellaswag_val.jsonl]", "--hellaswag_path=data/hellaswag/hellaswag_val.jsonl"),),
        quick=PLAN,
        needs=("hellaswag",),
        expect="memory plan per GPU",
    ),
    "lm_eval --model hf --model_args pretrained=hf/ --tasks arc_easy,arc_challenge,boolq,hellaswag,openbookqa,"
    "piqa,winogrande --device cuda:0 --batch_size 16": Skip("a GPU and the hub's datasets"),
    "python -m marsgpt.export_hf out/ hf/": Run(needs=("gpt2_checkpoint",)),
    "python -m marsgpt.export_hf": Run(quick="--help", expect="usage"),
    "python -m marsgpt.hellaswag --ckpt out --device cuda --dtype float32 --scores ours.jsonl": Run(
        fill=(("--device cuda", "--device cpu"),),
        quick="--limit 4 --overwrite",
        needs=("gpt2_checkpoint", "hellaswag"),
    ),
    "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model hf --model_args pretrained=hf/ --include_path docs/lm_eval "
    "--tasks hellaswag_local --device cuda:0 --batch_size 16 --log_samples --output_path lm_eval_out/": Skip(
        "lm-evaluation-harness and a GPU; tests/test_hellaswag.py runs the local task when lm_eval is installed"
    ),
    "python -m pytest tests/test_hellaswag.py -k lm_evaluation_harness -s": Run(rc=(0, 5)),  # 5: none collected
    "python -m marsgpt.plot out_mars out_adamw --out curves.png [--labels MARS AdamW]": Run(
        fill=(
            ("out_mars out_adamw", "out-quickstart out-quickstart"),
            ("[--labels MARS AdamW]", "--labels MARS AdamW"),
        ),
        needs=("quickstart",),
    ),
    "pip install lm-eval==0.4.13 accelerate": Skip("the network"),
    "lm_eval": Skip(NAME),
    # docs/gpu.md: what ran on a GPU (its commands need one; the CPU forms gpu_check runs are tested in
    # tests/test_gpu_check.py)
    "torchrun --nproc_per_node=1": Skip(NAME),
    "torchrun --standalone --nproc_per_node=1 train.py config/train_gpt2_small_mars.py": Run(
        quick=PLAN, expect="memory plan per GPU"
    ),
    "python train.py config/quickstart.py": Run(
        quick=SHORT + " --out_dir=out-train", needs=("stdlib_char",), expect="best val loss"
    ),
    "python -m bench.run_all --quick --only mars": Skip(IN_RUN_ALL),
    "python -m scripts.gpu_check_worker warm <work>/warm.json": Run(fill=(("<work>", "{tree}"),)),
    "python train.py config/quickstart.py --max_iters=10 ...": Skip(NAME),
    "python -m torch.distributed.run --standalone --nproc_per_node=<GPUs> train.py config/quickstart.py ...": Skip(
        NAME
    ),
    "python sample.py --out_dir=<single's run> --start=The --num_samples=1 --max_new_tokens=32": Skip(
        "gpu_check's rows: tests/test_gpu_check.py runs them on the CPU"
    ),
    "python -m marsgpt.hellaswag --ckpt <single's run> --data <work>/hellaswag_tiny.jsonl": Skip(
        "gpu_check's rows: tests/test_gpu_check.py runs them on the CPU"
    ),
    "python -m torch.distributed.run --standalone --nproc_per_node=<GPUs> train.py config/quickstart.py --max_iters=10 "
    "--eval_interval=10 --log_interval=5 --zero_stage=3 --gradient_accumulation_steps=<2 x GPUs>": Skip(GPU),
    "python -m torch.distributed.run --standalone --nproc_per_node=<GPUs> -m scripts.gpu_check_worker fsdp RESULT "
    "cuda": Skip(GPU),
    "torchrun --standalone --nproc_per_node=1 -m scripts.gpu_check_worker compiled RESULT 10 2 "
    "config/train_gpt2_small_mars.py --compile=True --gradient_accumulation_steps=8 --eval_iters=2": Skip(GPU),
    "python -m data.stdlib_char.prepare --output_dir=<work>/quickstart_data/stdlib_char": Run(
        fill=(("<work>", "{tree}"),), expect="vocabulary"
    ),
    "python train.py config/quickstart.py --data_path=<work>/quickstart_data --out_dir=<work>/runs/quickstart": Run(
        fill=(("<work>", "{tree}"),), quick=SHORT, needs=("work_data",), expect="best val loss"
    ),
    'python sample.py ... --start="def " --num_samples=1 --max_new_tokens=400': Skip(NAME),
    "python train.py config/quickstart.py --deterministic=True --dropout=0.1 --max_iters=40 --eval_interval=8": Run(
        quick=SHORT + " --out_dir=out-deterministic", needs=("stdlib_char",), expect="best val loss"
    ),
    "torchrun --nproc_per_node=1 train.py config/train_gpt2_small_mars.py --compile=True "
    "--gradient_accumulation_steps=8 --eval_iters=2": Skip(GPU),
    "python -m torch.distributed.run --standalone --nproc_per_node=1 train.py config/quickstart.py --max_iters=10 "
    "--eval_interval=10 --log_interval=5 --zero_stage=3 --gradient_accumulation_steps=2": Run(
        quick="--device=cpu --eval_iters=1 --out_dir=out-fsdp", needs=("stdlib_char",), expect="best val loss"
    ),
    "python -m torch.distributed.run --standalone --nproc_per_node=1 -m scripts.gpu_check_worker fsdp "
    "<work>/fsdp.json cuda": Skip(GPU),
    "python -m torch.distributed.run --standalone --nproc_per_node=1 -m scripts.gpu_check_worker mesh_of_one RESULT "
    "cuda": Skip(GPU),
    "python -m bench.bench_fsdp --exchange": Skip(
        "8 gloo ranks for minutes; tests/test_memory_plan.py runs its measurement against the plan"
    ),
    "python train.py ... 2>&1 | tee log": Skip(
        "the shape of a pipeline, not a command; tests/test_train_faults.py runs one in a terminal and presses Ctrl-C"
    ),
    "python train.py config/quickstart.py --max_iters=40 --eval_interval=8 --log_interval=1 --dropout=0.1 "
    "--deterministic=True; SIGKILL at 'iter 14:'; again with --init_from=resume": Skip(
        "a procedure, not a command; tests/test_train_faults.py kills and resumes runs"
    ),
    # docs/memory.md
    "python train.py config/train_gpt2_<size>_<optimizer>.py --dry_run=True --plan_world_size=8 "
    "--gpu_memory_gb=<40|80> [--zero_stage=1] [--activation_checkpointing=True] [--deterministic=True]": Run(
        fill=(
            ("<size>_<optimizer>", "large_muon"),
            ("<40|80>", "80"),
            ("[--zero_stage=1] [--activation_checkpointing=True] [--deterministic=True]", "--zero_stage=1"),
        ),
        expect="fits",
    ),
    "python train.py config/<run>.py --dry_run=True --plan_world_size=8 --gpu_memory_gb=80 --batch_size=B": Run(
        fill=(("<run>", "train_gpt2_medium_mars"), ("=B", "=16")), expect="fits"
    ),
    "python train.py config/train_gpt2_xl_mars.py --dry_run=True --plan_world_size=8 --gpu_memory_gb=<40|80> "
    "--zero_stage=<1|3> --n_layer=L --n_embd=C --n_head=H --batch_size=1 --gradient_accumulation_steps=8 "
    "--activation_checkpointing=True": Run(
        fill=(("<40|80>", "40"), ("<1|3>", "3"), ("=L", "=32"), ("=C", "=4096"), ("=H", "=32")), expect="fits"
    ),
    # docs/results.md
    "bash scripts/study_small.sh --out study_small": Run(quick="--dry_run"),
    "python -m bench.run_all --quick": Run(),
    "python -m scripts.study_small --out /work/study-out": Run(
        fill=(("/work/study-out", "{tree}/study-out"),), quick="--dry_run", needs=("stdlib_char",)
    ),
    # docs/training.md
    "python train.py config/train_gpt2_small_mars.py [--key=value ...]": Run(
        fill=(("[--key=value ...]", PLAN),), expect="memory plan per GPU"
    ),
    "bash scripts/run_mars_small.sh [--key=value ...]": Run(fill=(("[--key=value ...]", PLAN),)),
    "python train.py --help": Run(expect="--learning_rate"),
    "bash scripts/run_mars_small.sh --zero_stage=3": Run(quick=PLAN, expect="FSDP2"),
    "torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_xl_mars.py --zero_stage=3": Skip(
        "8 GPUs; the same with --nproc_per_node=1 runs above (docs/gpu.md)"
    ),
    "python train.py [config files ...] [--key=value ...]": Skip(NAME),
    "python -m marsgpt.config <files> [--key=value ...]": Run(
        fill=(("<files>", "config/quickstart.py"), ("[--key=value ...]", "--max_iters=3")), expect="max_iters"
    ),
    "torchrun": Skip(NAME),
    "torchrun --standalone": Skip(NAME),
    "bash scripts/run_mars_small.sh --wandb_log=False": Run(quick=PLAN),
    "torchrun --nnodes --node_rank --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500": Skip(NAME),
    "python -m bench.bench_compile": Skip(IN_RUN_ALL),
    "python train.py config/...": Skip(NAME),
    "python -m bench.bench_run_dir": Skip(IN_RUN_ALL),
    "nohup python train.py ...": Skip(NAME),
    "python -m scripts.copy_run out/ backup/out/": Run(needs=("gpt2_checkpoint",)),
    "python -m scripts.copy_run": Run(quick="--help", expect="usage"),
    # docs/vision.md
    "python -m vision.train_cifar --dataset=cifar10 --data_dir=data/cifar --device=cuda --learning_rate=1e-3 "
    "--out_dir=out-cifar/mars_1e-3": Run(quick=CIFAR, needs=("cifar",)),
    "python -m vision.train_cifar --mars_routing=nd --learning_rate=1e-3 --out_dir=out-cifar/mars-nd_1e-3": Run(
        quick=CIFAR, needs=("cifar",)
    ),
    "bash scripts/run_cifar.sh mars cifar10": Run(quick=CIFAR, needs=("cifar",)),
    'LRS="1e-3" bash scripts/run_cifar.sh adamw cifar100 --device=cuda:1 --wandb_log=True': Skip(
        "a second GPU and wandb; run_cifar.sh's other forms run above"
    ),
    "python -m vision.train_cifar --help": Run(expect="--learning_rate"),
    "sudo apt-get install dataset-fashion-mnist": Skip("a system package (root and the network)"),
    "python -m vision.cpu_study --out=out-cifar-study --epochs=15 --plot=assets/vision_cpu_study.png": Skip(
        "the Fashion-MNIST files (/usr/share/datasets) and about an hour"
    ),
    "python -m vision.train_cifar": Skip(NAME),
    "python -m vision.bench_loader": Run(quick="--images 64 --rounds 1"),
    "bash scripts/run_cifar.sh mars-nd": Run(quick="cifar10 " + CIFAR, needs=("cifar",)),
    "bash scripts/run_cifar.sh adamw|muon|mars|mars-nd cifar10|cifar100": Skip(NAME),
    "bash scripts/run_cifar.sh mars": Run(quick="cifar10 " + CIFAR, needs=("cifar",)),
}


def test_a_choice_in_braces_stands_for_one_command_per_choice():
    assert each_command("bash scripts/run_{mars,adamw}_{small,xl}.sh --x") == [
        "bash scripts/run_mars_small.sh --x",
        "bash scripts/run_mars_xl.sh --x",
        "bash scripts/run_adamw_small.sh --x",
        "bash scripts/run_adamw_xl.sh --x",
    ]
    assert each_command("python -m pytest -q") == ["python -m pytest -q"]


def test_every_command_the_docs_show_is_run_here_or_skipped_with_a_reason():
    shown = doc_commands()
    unknown = [f"{docs[0]}: {command}" for command, docs in shown.items() if command not in COMMANDS]
    assert not unknown, "commands the docs show that COMMANDS does not list (add each, run or skipped):\n" + "\n".join(
        unknown
    )
    gone = [command for command in COMMANDS if command not in shown]
    assert not gone, f"COMMANDS lists commands no doc shows any more: {gone}"
    for command, how in COMMANDS.items():
        if isinstance(how, Run):
            assert all(placeholder in command for placeholder, _ in how.fill), command


# ---------------------------------------------------------------------------------------------------
# The copy of the repository the commands run in, and what some need first.


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of the repository's files (not its runs, data, environments or git history)."""
    tree = str(tmp_path_factory.mktemp("repository") / "repo")
    leave_out = {".git", "__pycache__", ".pytest_cache", ".torchinductor", "wandb", "build"}

    def ignore(folder, names):
        top = os.path.abspath(folder) == ROOT
        return [
            n
            for n in names
            if n in leave_out
            or (top and (n.startswith((".venv", "out", "study")) or n.endswith(".egg-info")))
            or n.endswith((".bin", ".pkl", ".parquet", ".jsonl"))
        ]

    shutil.copytree(ROOT, tree, ignore=ignore)
    return tree


def environment():
    """This interpreter's tools first on PATH, one thread, the hub offline, no wandb."""
    bin_dir = os.path.dirname(sys.executable)
    return dict(
        os.environ,
        PATH=bin_dir + os.pathsep + os.environ["PATH"],
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
    )


def shell(tree, command, timeout=600):
    """bash runs `command` in the copy; a pipeline fails where any of its commands does (pipefail)."""
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        cwd=tree,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_documents(tree, _=None):
    os.makedirs(os.path.join(tree, "owt"), exist_ok=True)
    texts = [f"Document {i}: the quick brown fox jumps over the lazy dog. " * 20 for i in range(200)]
    pq.write_table(pa.table(dict(text=texts)), os.path.join(tree, "owt", "tiny.parquet"))


def write_gpt2_checkpoint(tree, tiny_checkpoint):
    """A one-layer GPT with GPT-2's vocabulary in out/, as train.py saves one."""
    tiny_checkpoint(os.path.join(tree, "out"), 50304, block_size=64)


def write_hellaswag(tree, _):
    from scripts.gpu_check import write_hellaswag_file

    os.makedirs(os.path.join(tree, "data", "hellaswag"), exist_ok=True)
    write_hellaswag_file(os.path.join(tree, "data", "hellaswag", "hellaswag_val.jsonl"))


def write_cifar(tree, _):
    from test_vision import write_python_cifar10

    write_python_cifar10(os.path.join(tree, "cifar"))


def prepare(command):
    return lambda tree, _: shell(tree, command)


SETUPS = {
    "stdlib_char": prepare("python -m data.stdlib_char.prepare"),
    "quickstart": prepare(f"bash scripts/quickstart.sh {QUICKSTART}"),
    "work_data": prepare("python -m data.stdlib_char.prepare --output_dir=quickstart_data/stdlib_char"),
    "parquet": write_documents,
    "openwebtext": lambda tree, _: (
        write_documents(tree) or shell(tree, "python -m data.openwebtext.prepare --data_files owt/tiny.parquet")
    ),
    "gpt2_checkpoint": write_gpt2_checkpoint,
    "hellaswag": write_hellaswag,
    "cifar": write_cifar,
}


@pytest.fixture(scope="module")
def done():
    """The setups run in the module's copy so far."""
    return set()


def ready(tree, done, needs, tiny_checkpoint):
    for need in needs:
        if need not in done:
            finished = SETUPS[need](tree, tiny_checkpoint)
            if isinstance(finished, subprocess.CompletedProcess):
                assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
            done.add(need)


def each_command(command):
    """The commands `command` stands for: one per choice of each {a,b} in it (the docs' shorthand, which bash
    would expand into one command with the others as its arguments)."""
    choices = re.search(r"\{([^{}]*,[^{}]*)\}", command)
    if not choices:
        return [command]
    before, after = command[: choices.start()], command[choices.end() :]
    return [each for choice in choices.group(1).split(",") for each in each_command(before + choice + after)]


RUNS = [(command, how) for command, how in COMMANDS.items() if isinstance(how, Run)]


@pytest.mark.slow
@pytest.mark.parametrize("command, how", RUNS, ids=[command[:60] for command, _ in RUNS])
def test_the_command_runs_as_the_docs_show_it(tree, done, tiny_checkpoint, command, how):
    ready(tree, done, how.needs, tiny_checkpoint)
    for placeholder, text in how.fill:
        command = command.replace(placeholder, text.format(tree=tree))
    for each in each_command(command):
        each = f"{each} {how.quick.format(tree=tree)}".strip()
        finished = shell(tree, each)
        output = finished.stdout + finished.stderr
        assert finished.returncode in how.rc, f"{each}: exit {finished.returncode}\n{output[-3000:]}"
        assert how.expect in output, f"{each}: no {how.expect!r} in\n{output[-3000:]}"


# ---------------------------------------------------------------------------------------------------
# The README's figures from deterministic commands.


def readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return " ".join(f.read().split())


def plan_total(argv):
    """The total line of the memory plan `python train.py argv` prints, in GiB as printed."""
    done = subprocess.run(
        [sys.executable, "train.py", *argv], cwd=ROOT, env=environment(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return re.search(r"^ {2}total +([\d.]+) GiB", done.stdout, re.MULTILINE).group(1)


@pytest.mark.slow
def test_the_readme_s_memory_figures_are_what_its_dry_run_prints():
    """'Will it fit?': GPT-2 XL's plans on 8 GPUs of 40 GiB, each the total line of the command the README names,
    with the flag the figure stands beside."""
    text = readme()
    command = re.search(r"`python train.py (config/train_gpt2_xl_mars.py --dry_run=True [^`]+)`", text).group(1)
    figures = re.search(
        r"\(([\d.]+) GiB plain, ([\d.]+) with ZeRO-1, ([\d.]+) with checkpointing, ([\d.]+) with both\)", text
    ).groups()
    deterministic = re.search(r"`--deterministic=True` costs far more memory \(GPT-2 XL: ([\d.]+) GiB plain\)", text)
    flags = [[], ["--zero_stage=1"], ["--activation_checkpointing=True"]]
    flags += [["--zero_stage=1", "--activation_checkpointing=True"], ["--deterministic=True"]]
    printed = [plan_total(command.split() + f) for f in flags]
    assert printed == [*figures, deterministic.group(1)]


@pytest.mark.slow
def test_the_readme_s_largest_models_are_the_ladder_s():
    """The README's table of the largest GPT-2-shaped model MARS trains on 8 GPUs (python -m scripts.memory_table's
    ladder): each shape it names fits, with its size as printed, and the ladder's next shape does not."""
    memory_table = memory_table_module()
    rows = re.findall(r"\| (\d+) GiB \| ([^|]+) \| ([^|]+) \|", readme())
    assert [int(gb) for gb, *_ in rows] == list(memory_table.GPU_MEMORY_GB)
    for gb, *cells in rows:
        for sharding, cell in zip(memory_table.SHARDINGS, cells):
            size, n_layer, n_embd = re.fullmatch(r"([\d.]+)B \((\d+) layers x (\d+)\)", cell.strip()).groups()
            index = [shape[:2] for shape in memory_table.LADDER].index((int(n_layer), int(n_embd)))
            found = memory_table.largest_models_from(int(gb), sharding, memory_table.LADDER[index : index + 2])
            assert found is not None and found[0] == memory_table.LADDER[index], (gb, sharding)
            assert f"{found[1].n_params / 1e9:.2f}" == size, (gb, sharding)
