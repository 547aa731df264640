"""ZeRO-1 (zero.ShardedOptimizer, zero_stage=1) on 2 gloo ranks: the same training as plain DDP and as one
process for every optimizer, about half the state on each rank (exactly what memory_plan plans), and a
checkpoint format that moves between sharded and unsharded optimizers.

The 2-rank part runs once, in two spawned processes, for all optimizers; the tests read its report.
"""

import copy
import dataclasses
import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.common import rendezvous
from marsgpt import memory_plan
from marsgpt.checkpoint import cpu_copy
from marsgpt.config import TrainConfig
from marsgpt.parallel import Parallelism
from marsgpt.runtime import Dist
from marsgpt.training_optimizer import build_optimizer
from model import GPT, GPTConfig

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
STEPS = 3
MODEL = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, bias=False)
# name -> the keys of TrainConfig that select the optimizer
SETTINGS = {
    "mars-adamw": dict(optimizer="mars-adamw"),
    "mars-adamw-exact": dict(optimizer="mars-adamw", is_approx=False),
    "mars-lion": dict(optimizer="mars-lion"),
    "mars-shampoo": dict(optimizer="mars-shampoo"),
    "adamw": dict(optimizer="adamw"),
    "muon": dict(optimizer="muon", learning_rate=6e-4),
    "mars-m": dict(optimizer="mars-m"),
    "mars-m-exact": dict(optimizer="mars-m", is_approx=False),
    "moonlight": dict(optimizer="moonlight"),
}


def config(name):
    shape = {k: v for k, v in MODEL.items() if k != "vocab_size"}
    return dataclasses.replace(TrainConfig(), **shape, **SETTINGS[name], batch_size=2, zero_stage=1)


def placement(cfg, rank, sharded):
    """ZeRO-1 over the WORLD_SIZE ranks (each optimizer a ShardedOptimizer), or one process's optimizer."""
    return (
        Parallelism.of(cfg, Dist(torchrun=True, rank=rank, world_size=WORLD_SIZE)) if sharded else Parallelism.single()
    )


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, MODEL["vocab_size"], (2, MODEL["block_size"]), generator=g)
    return x, torch.roll(x, -1, dims=1)


def state_bytes(optimizer):
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def train(model, optimizer, forward_backward):
    """STEPS steps of train.py's protocol with the trainer's optimizer: the loss scaled by a GradScaler, as float16
    runs do (by a power of two: exact), clipping, and for exact MARS the next step's gradient first (to the MARS
    that holds this rank's share under ZeRO-1)."""
    for step in range(STEPS):
        if optimizer.look_ahead is not None:
            forward_backward(step + 1, optimizer)
            optimizer.unscale(look_ahead=True)
            optimizer.keep_look_ahead_gradient()
            optimizer.zero_grad()
        forward_backward(step, optimizer)
        optimizer.unscale()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


def scaled_optimizer(model, cfg, parallel):
    """The trainer's optimizer with a GradScaler of its own, as a float16 run has (its scale a power of two: exact)."""
    return build_optimizer(model, cfg, parallel, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))


def ddp_forward_backward(ddp_model, rank):
    def run(step, optimizer):
        x, y = batch(step, rank)
        optimizer.scale(ddp_model(x, y)[1]).backward()

    return run


def one_process_forward_backward(model):
    """Both ranks' batches in one process: the mean of their losses is what DDP's averaged gradient descends."""

    def run(step, optimizer):
        loss = sum(model(*batch(step, rank))[1] for rank in range(WORLD_SIZE)) / WORLD_SIZE
        optimizer.scale(loss).backward()

    return run


def saved_and_loaded(state):
    """state as a checkpoint returns it: through torch.save and torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def tensors(state):
    """Every tensor of a state tree, depth first."""
    if torch.is_tensor(state):
        return [state]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else []
    return [t for v in values for t in tensors(v)]


def gathering(optimizer):
    """What one more state_dict() of the sharded `optimizer` sends and receives point to point, this rank's
    share of the state, and on rank 0 where the gathered tensors live and whether cpu_copy copies them."""
    messages, real = [], dist.batch_isend_irecv

    def recording(ops):
        messages.extend((op.op.__name__, op.tensor.numel() * op.tensor.element_size()) for op in ops)
        return real(ops)

    dist.batch_isend_irecv = recording
    try:
        state = optimizer.state_dict()
    finally:
        dist.batch_isend_irecv = real
    inner = optimizer.optimizers
    share = [t for opt in inner for t in tensors(opt.local.state_dict())]
    report = dict(messages=messages, share_bytes=[t.numel() * t.element_size() for t in share])
    if dist.get_rank() == 0:
        gathered = tensors(state)
        live = {t.untyped_storage().data_ptr() for t in share}
        report.update(
            devices={t.device.type for t in gathered},
            apart_from_the_live_state=not live & {t.untyped_storage().data_ptr() for t in gathered},
            kept_by_cpu_copy=[a.data_ptr() == b.data_ptr() for a, b in zip(gathered, tensors(cpu_copy(state)))],
        )
    return report


def worker(rank, rendezvous_env, report_path):
    os.environ.update(rendezvous_env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    report = {}
    for name in SETTINGS:
        cfg = config(name)
        torch.manual_seed(0)
        models = {kind: GPT(GPTConfig(**MODEL)) for kind in ("sharded", "ddp", "single")}
        initial = [p.detach().clone() for p in models["sharded"].parameters()]
        for kind in ("ddp", "single"):
            models[kind].load_state_dict(models["sharded"].state_dict())
        placements = {kind: placement(cfg, rank, kind == "sharded") for kind in models}
        optimizers = {kind: scaled_optimizer(m, cfg, placements[kind]) for kind, m in models.items()}
        passes = {kind: ddp_forward_backward(DDP(models[kind]), rank) for kind in ("sharded", "ddp")}
        passes["single"] = one_process_forward_backward(models["single"])
        for kind in models:
            train(models[kind], optimizers[kind], passes[kind])
        params = {kind: [p.detach().clone() for p in m.parameters()] for kind, m in models.items()}
        # as checkpoints hold them (the live state dicts share tensors with the optimizers, which train on)
        sharded_state = saved_and_loaded(optimizers["sharded"].state_dict())  # collective: rank 0's is all
        unsharded_state = saved_and_loaded(optimizers["ddp"].state_dict())
        gathered = gathering(optimizers["sharded"])

        # Checkpoint and resume both ways: a sharded optimizer from the unsharded state, an unsharded one from
        # the sharded state (rank 0's, as a checkpoint holds it); each continues as the original does.
        from_sharded = [saved_and_loaded(sharded_state)]
        dist.broadcast_object_list(from_sharded, src=0)
        resumes = dict(
            sharded=(True, "ddp", saved_and_loaded(unsharded_state)), ddp=(False, "sharded", from_sharded[0])
        )
        continued = {}
        for kind, (shard, original, state) in resumes.items():
            model = copy.deepcopy(models[original])
            optimizer = scaled_optimizer(model, cfg, placement(cfg, rank, shard))
            optimizer.load_state_dict(state)
            train(model, optimizer, ddp_forward_backward(DDP(model), rank))
            train(models[original], optimizers[original], passes[original])
            continued[kind] = [
                (p.detach().clone(), q.detach().clone())
                for p, q in zip(model.parameters(), models[original].parameters())
            ]
        planned = memory_plan.plan(cfg, WORLD_SIZE, model_args=MODEL)
        report[name] = dict(
            initial=initial,
            params=params,
            continued=continued,
            held_bytes=state_bytes(optimizers["sharded"]),
            unsharded_bytes=state_bytes(optimizers["ddp"]),
            planned_bytes=planned.rank_state_bytes[rank],
            planned_save_bytes=planned.save_bytes,
            sharded_state=sharded_state,
            unsharded_state=unsharded_state,
            gathering=gathered,
        )
    torch.save(report, f"{report_path}.{rank}")
    # Leave without tearing the gloo group down: its destructor can deadlock with its own thread at exit
    # (seen in this test under load), and the report is on disk already.
    os._exit(0)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zero") / "report")
    with rendezvous() as env:
        mp.spawn(worker, args=(env, path), nprocs=WORLD_SIZE, join=True)
    return [torch.load(f"{path}.{rank}", weights_only=False) for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("name", SETTINGS)
def test_sharded_trains_the_same_parameters_as_plain_ddp_and_one_process(reports, name):
    """Bit for bit plain DDP's: each parameter's update is computed from the same all-reduced gradient, by
    the same kernels, only on one rank instead of all. One process sums the two batches' gradients in
    another order, so it agrees to float32 rounding -- except Muon and Moonlight, whose Newton-Schulz iteration
    runs in bfloat16 (torch.optim.Muon): there float32 rounding becomes bfloat16 rounding (2^-8) compounded over
    five iterations, and the test bounds the difference of the parameters' displacement relative to it."""
    for report in reports:
        params = report[name]["params"]
        for sharded, ddp, single, initial in zip(
            params["sharded"], params["ddp"], params["single"], report[name]["initial"]
        ):
            assert torch.equal(sharded, ddp)
            if name in ("muon", "moonlight"):
                assert (sharded - single).norm() < 2**-4 * (single - initial).norm()
            else:
                torch.testing.assert_close(sharded, single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", SETTINGS)
def test_each_rank_holds_its_share_of_the_state_as_planned(reports, name):
    held = [report[name]["held_bytes"] for report in reports]
    unsharded = reports[0][name]["unsharded_bytes"]
    assert sum(held) == unsharded
    assert all(0.3 * unsharded < h < 0.7 * unsharded for h in held), held
    assert held == [report[name]["planned_bytes"] for report in reports]


@pytest.mark.parametrize("name", SETTINGS)
def test_the_sharded_checkpoint_is_the_unsharded_format(reports, name):
    sharded, unsharded = reports[0][name]["sharded_state"], reports[0][name]["unsharded_state"]
    assert_same_structure(sharded, unsharded)
    assert reports[1][name]["sharded_state"] in (None, {"optimizers": [None, None]})  # gathered on rank 0 only


@pytest.mark.parametrize("name", SETTINGS)
def test_rank_0_gathers_the_state_one_tensor_at_a_time_into_one_host_copy(reports, name):
    """Each state tensor of the other rank's share is one message of its own size (never a whole share), rank
    0 gets host tensors apart from its live state, and the checkpoint writer's cpu_copy keeps them as they
    are instead of copying them a second time. (The CPU build cannot pin memory, so a pinned copy would not
    show here; the code makes none: it copies with .to("cpu"), which is synchronous and pageable.)"""
    rank_0, rank_1 = reports[0][name]["gathering"], reports[1][name]["gathering"]
    assert rank_1["messages"] == [("isend", n) for n in rank_1["share_bytes"]]
    assert rank_0["messages"] == [("irecv", n) for n in rank_1["share_bytes"]]
    assert rank_0["devices"] == {"cpu"} and rank_0["apart_from_the_live_state"]
    assert rank_0["kept_by_cpu_copy"] and all(rank_0["kept_by_cpu_copy"])
    # over NCCL each message is a buffer on rank 0's GPU: the largest is what the memory plan adds for a save
    assert max(n for _, n in rank_0["messages"]) == reports[0][name]["planned_save_bytes"]


@pytest.mark.parametrize("name", SETTINGS)
def test_sharded_and_unsharded_optimizers_resume_each_other(reports, name):
    for report in reports:
        for kind in ("sharded", "ddp"):
            assert all(torch.equal(resumed, original) for resumed, original in report[name]["continued"][kind])


def assert_same_structure(a, b):
    """Equal up to float rounding, with the same keys, types and shapes everywhere."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same_structure(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_structure(x, y)
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    else:
        assert a == b
