"""scripts/: each run script launches torchrun over the node's GPUs with its config files after
--init_from=auto (a rerun resumes; the caller's own --init_from wins); multinode.sh and the SLURM example do
the same across nodes, and the SLURM example stops and requeues its job before the time limit. torchrun,
nvidia-smi, python, srun, scancel and scontrol are stand-ins on PATH."""

import glob
import os
import re
import signal
import subprocess

from marsgpt.config import load_config
from marsgpt.config_schema import config_to_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "scripts", "slurm_mars_small.sbatch")


def fake_bin(tmp_path, gpus=None, torch_gpus=0, torchrun='echo "$@"'):
    """A PATH where torchrun runs `torchrun` (prints its arguments), nvidia-smi lists `gpus` GPUs, python (asked
    for torch.cuda.device_count()) prints torch_gpus or fails when that is None (no torch), srun prints the
    SRUN_CPUS_PER_TASK and TORCHINDUCTOR_CACHE_DIR its step gets and runs its command (after its options),
    scontrol lists the hosts node0 and node1 and prints its other commands, and scancel prints its arguments and
    sends TERM to the step."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    tools = {
        "torchrun": torchrun,
        "python": "exit 1" if torch_gpus is None else f"echo {torch_gpus}",
        "srun": 'echo "SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-unset}" '
        '"TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-unset}"; while [[ $1 == -* ]]; do shift; done; '
        'exec "$@"',
        "scontrol": '[[ "$1 $2" == "show hostnames" ]] && printf "node0\\nnode1\\n" || echo "scontrol $*"',
        "scancel": f'echo "scancel $*"; kill -TERM "$(cat {tmp_path}/step.pid)"',
    }
    if gpus is not None:
        tools["nvidia-smi"] = f'for i in $(seq 0 {gpus - 1}); do echo "GPU $i: H100 (UUID: x)"; done'
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "NPROC": ""}


def launch(script, env, *args):
    """The words torchrun was given."""
    run = subprocess.run([*script_command(script), *args], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def script_command(script):
    return ["bash", os.path.join(ROOT, "scripts", script)]


def train_config(argv):
    """The configuration train.py would run with, from torchrun's words."""
    args = argv[argv.index("train.py") + 1 :]
    return load_config([a if a.startswith("--") else os.path.join(ROOT, a) for a in args])


def test_run_scripts_launch_their_paper_run_and_resume_when_run_again(tmp_path):
    env = fake_bin(tmp_path)
    scripts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "scripts", "run_*.sh")))
    scripts.remove("run_cifar.sh")  # the vision grid, tested in tests/test_vision.py
    openwebtext = {
        f"run_{opt}_{size}.sh"
        for size in ("small", "medium", "large")
        for opt in ("mars", "adamw", "muon", "mars_m", "moonlight")
    }
    fineweb = {
        f"run_{opt}_{size}_fw.sh" for size in ("small", "xl") for opt in ("mars", "adamw", "mars_m", "moonlight")
    }
    assert set(scripts) == openwebtext | fineweb
    for script in scripts:
        name = script[len("run_") : -len(".sh")]
        opt, size = re.fullmatch(r"(.+)_(small|medium|large|xl)(_fw)?", name).groups()[:2]
        argv = launch(script, env, "--max_iters=10")
        configs = [f"config/train_gpt2_{size}_{opt}.py"] + (["config/fineweb_edu.py"] if name.endswith("_fw") else [])
        assert argv == [
            "--standalone",
            "--nproc_per_node=1",
            "train.py",
            "--init_from=auto",
            *configs,
            "--max_iters=10",
        ]
        paper_run = config_to_dict(load_config([os.path.join(ROOT, c) for c in configs]))
        assert config_to_dict(train_config(argv)) == paper_run | dict(init_from="auto", max_iters=10), script


def test_the_caller_s_init_from_wins(tmp_path):
    env = fake_bin(tmp_path)
    assert train_config(launch("run_mars_small.sh", env, "--init_from=resume")).init_from == "resume"
    fresh = train_config(launch("run_muon_large.sh", env, "--init_from=scratch", "--overwrite=True"))
    assert (fresh.init_from, fresh.overwrite) == ("scratch", True)


def test_gpu_count_nproc_override_and_nvidia_smi_fallback(tmp_path):
    assert "--nproc_per_node=8" in launch("run_mars_small.sh", fake_bin(tmp_path, gpus=8, torch_gpus=8))
    assert "--nproc_per_node=3" in launch("run_mars_small.sh", {**fake_bin(tmp_path / "a", torch_gpus=8), "NPROC": "3"})
    assert "--nproc_per_node=4" in launch("run_mars_small.sh", fake_bin(tmp_path / "b", gpus=4, torch_gpus=None))
    assert "--nproc_per_node=1" in launch("run_mars_small.sh", fake_bin(tmp_path / "c", torch_gpus=None))


def test_multinode_uses_c10d_rendezvous_and_resumes(tmp_path):
    env = {**fake_bin(tmp_path), "NPROC": "8", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0"}
    argv = launch("multinode.sh", env, "config/train_gpt2_xl_mars.py")
    assert argv == [
        "--nnodes=2",
        "--node_rank=1",
        "--rdzv_id=mars",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node0:29500",
        "--nproc_per_node=8",
        "train.py",
        "--init_from=auto",
        "config/train_gpt2_xl_mars.py",
    ]
    missing = subprocess.run(
        script_command("multinode.sh"), env=fake_bin(tmp_path / "c"), capture_output=True, text=True
    )
    assert missing.returncode != 0 and "set NNODES" in missing.stderr


def sbatch_options():
    return [line.split()[1] for line in open(SBATCH) if line.startswith("#SBATCH ")]


def test_slurm_example_requeues_and_gives_the_step_its_cpus(tmp_path):
    slurm = dict(
        SLURM_SUBMIT_DIR=ROOT,
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="8",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_NODEID="1",
        SLURM_JOB_ID="4242",
        SLURM_CPUS_PER_TASK="32",
    )
    env = {key: value for key, value in fake_bin(tmp_path).items() if key != "TORCHINDUCTOR_CACHE_DIR"}
    run = subprocess.run(["bash", SBATCH, "--max_iters=10"], env={**env, **slurm}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    step_env, torchrun = run.stdout.splitlines()
    # srun (Slurm >= 22.05) does not inherit --cpus-per-task; the compile caches are on the shared file system
    assert step_env.split() == ["SRUN_CPUS_PER_TASK=32", f"TORCHINDUCTOR_CACHE_DIR={ROOT}/.torchinductor"]
    mine = dict(env, **slurm, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))  # a cache the user chose is kept
    run = subprocess.run(["bash", SBATCH], env=mine, capture_output=True, text=True)
    assert run.stdout.splitlines()[0].split()[1] == f"TORCHINDUCTOR_CACHE_DIR={tmp_path / 'cache'}"
    assert torchrun.split() == [
        "--nnodes=2",
        "--node_rank=1",
        "--rdzv_id=4242",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node0:29500",
        "--nproc_per_node=8",
        "train.py",
        "--init_from=auto",  # the requeued job resumes from the checkpoint
        "config/train_gpt2_small_mars.py",
        "--max_iters=10",
    ]
    options = sbatch_options()
    assert {"--requeue", "--open-mode=append", "--cpus-per-task=32"} <= set(options)


def test_slurm_example_stops_the_step_at_a_checkpoint_and_requeues_before_the_time_limit(tmp_path):
    """SLURM sends SIGUSR1 to the batch script 10 minutes before --time runs out (B:, the script only); the script
    passes SIGTERM to the job step (train.py saves and exits; here a stand-in that says it got TERM), waits for it
    to end, and requeues the job. srun ends the whole step when one node's torchrun fails."""
    assert "--signal=B:USR1@600" in sbatch_options()
    assert "srun --kill-on-bad-exit=1 bash scripts/multinode.sh" in open(SBATCH).read()
    step = f'echo $$ > {tmp_path}/step.pid; trap "echo step stopped by TERM; exit 0" TERM; echo training; '
    step += "while :; do sleep 0.05; done"
    slurm = dict(SLURM_SUBMIT_DIR=ROOT, SLURM_NNODES="2", SLURM_JOB_NODELIST="node[0-1]", SLURM_NODEID="0")
    env = {**fake_bin(tmp_path, torchrun=step), **slurm, "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "32"}
    job = subprocess.Popen(["bash", SBATCH], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in job.stdout:  # the step is running: the time limit is near
        lines.append(line)
        if line.startswith("training"):
            break
    job.send_signal(signal.SIGUSR1)
    output = "".join(lines) + job.communicate(timeout=60)[0]
    assert job.returncode == 0, output
    assert output.splitlines()[-4:] == [
        "time limit near: stopping job 4242 at a checkpoint, then requeueing it",
        "scancel --signal=TERM 4242",
        "step stopped by TERM",
        "scontrol requeue 4242",
    ], output


def test_slurm_example_s_world_sizes_divide_each_recipe_s_micro_batches():
    options = dict(option.split("=", 1) for option in sbatch_options() if "=" in option)
    world_size = int(options["--nodes"]) * int(options["--gpus-per-node"])
    assert train_config(["train.py", "config/train_gpt2_small_mars.py"]).gradient_accumulation_steps % world_size == 0
    documented = re.findall(r"^#\s+(.+): (\d+) micro-batches of (\d+) sequences: (.+) GPUs$", open(SBATCH).read(), re.M)
    assert {size for sizes, *_ in documented for size in sizes.split(", ")} == {"small", "medium", "large", "xl"}
    for sizes, micro_batches, batch_size, world_sizes in documented:
        for size in sizes.split(", "):
            cfg = train_config(["train.py", f"config/train_gpt2_{size}_mars.py"])
            assert (cfg.gradient_accumulation_steps, cfg.batch_size) == (int(micro_batches), int(batch_size))
        divisors = [n for n in range(1, int(micro_batches) + 1) if int(micro_batches) % n == 0]
        assert [int(n) for n in re.findall(r"\d+", world_sizes)] == divisors
