"""mars_sharded.py, MARS's step on FSDP2-sharded (DTensor) parameters, on gloo ranks in float64: every rule,
approximate and exact (the hand-written protocol and step(closure)), with a bfloat16 last_grad, on uneven and empty
shards, in buckets of one matrix per owner, of several and all in one, equal to one process to 1e-12; the
collectives of a step (one norm all-reduce, no all-gather; Newton-Schulz rules two all-to-alls more per bucket);
the results sent back in bfloat16 where Newton-Schulz runs in it; the negative control (each shard's own norm in
the clip moves the run); a GradScaler's fallback agreed by every rank; torch.distributed.checkpoint resuming
2 -> 1, 1 -> 2 and 2 -> 2 ranks as the uninterrupted run; fused=True refused in one line; the trainer's AdamW,
Muon and Moonlight (ShardedMuon's owners) equal to one process to 1e-12 as well; and a user's own FSDP2 loop
(docs/mars.md's example) under torchrun.

The 2-rank part runs once for the whole module, in two spawned processes that meet through a file (no port to
race for); each case's result or error goes into a per-rank report that the tests read. The 4-rank 2 x 2 HSDP
mesh (and a 1-D mesh of 4) has a spawn of its own, and so has a 1-D mesh of 3. Without ranks (the quick tier):
the owner's Newton-Schulz against mars.newton_schulz, the buckets and the timeline.
"""

import contextlib
import copy
import math
import os
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from doc_examples import docs_example
from train_helpers import subprocess_env

import mars
import mars_sharded
from bench.bench_fsdp import newton_schulz_in
from mars import MARS
from model import GPT, GPTConfig, hidden_matrix_params

TOL = 1e-12  # float64 sharded against one process
STEPS = 3
LOSS_SCALE = 40.0  # gradients with Frobenius norms above 1, so c_t's clip is active on most tensors
RULES = ("mars-adamw", "mars-lion", "mars-shampoo", "mars-m")
NEWTON_SCHULZ_RULES = ("mars-shampoo", "mars-m")


# ---------------------------------------------------------------------------------------------------
# Models: float64, their shapes uneven over 2 ranks.


def gpt(seed=0):
    """model.GPT with odd sizes: c_attn (27, 9), c_proj (9, 9), c_fc (36, 9), mlp.c_proj (9, 36), wte = lm_head
    (11, 9), wpe (7, 9); 9 rows split 5 + 4 over 2 ranks. No biases: the key third of c_attn.bias has an exactly
    zero gradient (softmax ignores a shift of every logit), so its AdamW step amplifies rounding noise and two
    correct summation orders differ there by 4e-13 (the Toy net below has biases)."""
    torch.manual_seed(seed)
    config = GPTConfig(block_size=7, vocab_size=11, n_layer=2, n_head=3, n_embd=9, dropout=0.0, bias=False)
    return GPT(config).to(torch.float64)


class Toy(nn.Module):
    """A (1, 3) matrix, whose shard on rank 1 of 2 is empty, an (11, 7) embedding and biases."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 7)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.GELU(), nn.Linear(5, 7))])
        self.head = nn.Linear(7, 3)
        self.out = nn.Linear(3, 1)

    def forward(self, idx, targets):
        y = self.out(torch.tanh(self.head(self.blocks[0](self.emb(idx))))).squeeze(-1)
        return None, F.mse_loss(y, targets.to(y.dtype) / 10)


def toy(seed=0):
    torch.manual_seed(seed)
    return Toy().to(torch.float64)


MODELS = {"gpt": gpt, "toy": toy}


def blocks_of(net):
    return list(net.transformer.h) if isinstance(net, GPT) else list(net.blocks)


def shard(net, mesh=None):
    """FSDP2 as a trainer wraps it: each block, then the root (embeddings, head, final norm)."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks_of(net):
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def make_mars(net, mars_type, **options):
    """The trainer's groups: decayed matrices and the rest (MARS-M: the blocks' matrices, and the rest in the
    AdamW part, as its reference)."""
    common = dict(lr=2e-2, betas=(0.9, 0.95), gamma=0.025, lr_1d=1e-2, betas_1d=(0.9, 0.95), weight_decay_1d=0.1)
    if mars_type == "mars-m" and isinstance(net, GPT):
        hidden, rest = hidden_matrix_params(net)
        settings = dict(common, weight_decay=0.1, lr_1d=2e-2)
        groups = [dict(params=hidden, **settings), dict(params=rest, **settings, routing="none")]
    else:
        named = sorted(net.named_parameters())
        decay = [p for n, p in named if p.ndim >= 2 and not n.startswith(("emb", "transformer.w"))]
        rest = [p for _, p in named if all(p is not q for q in decay)]
        groups = [dict(params=decay, weight_decay=0.1, **common), dict(params=rest, weight_decay=0.0, **common)]
    return MARS(groups, mars_type=mars_type, **options)


def global_batches(steps, world, per_rank=2, seed=123):
    """steps + 1 global batches (one more for exact MARS's look-ahead), each `world` equal slices."""
    g = torch.Generator().manual_seed(seed)
    shape = (world * per_rank, 7)
    return [
        (torch.randint(0, 11, shape, generator=g), torch.randint(0, 11, shape, generator=g)) for _ in range(steps + 1)
    ]


def rank_slice(batch, rank, world):
    return tuple(t.chunk(world)[rank] for t in batch)


def loss_of(net, batch):
    return net(*batch)[1] * LOSS_SCALE


def train_step(net, opt, batch, next_batch, exact, counting=None):
    """One step of a user's loop: approximate MARS, exact MARS's hand-written protocol (exact="protocol") or
    exact MARS through step(closure) (exact="closure"). counting: a context around step()."""
    counting = counting or contextlib.nullcontext()
    if exact == "closure":

        def closure():
            opt.zero_grad()
            loss = loss_of(net, batch)
            loss.backward()
            return loss

        with counting:
            opt.step(closure)
        return
    if exact == "protocol":
        loss_of(net, next_batch).backward()
        opt.update_previous_grad()
        opt.zero_grad()
    loss_of(net, batch).backward()
    with counting:
        opt.step()
    if exact == "protocol":
        opt.update_last_grad()
    opt.zero_grad()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def largest_difference(net_a, opt_a, net_b, opt_b):
    """max |a - b| over the parameters and every state tensor, paired by parameter name (the same state keys)."""
    worst = 0.0
    params_b = dict(net_b.named_parameters())
    for name, pa in net_a.named_parameters():
        pb = params_b[name]
        worst = max(worst, (full(pa.detach()) - full(pb.detach())).abs().max().item())
        state_a, state_b = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert sorted(state_a) == sorted(state_b), (name, sorted(state_a), sorted(state_b))
        for key in state_a:
            a, b = full(state_a[key]).double(), full(state_b[key]).double()
            worst = max(worst, (a - b).abs().max().item() if a.numel() else 0.0)
    return worst


def full_params(net):
    return {n: full(p.detach()).clone() for n, p in net.named_parameters()}


def params_difference(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


def comm_counts(mode):
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


# ---------------------------------------------------------------------------------------------------
# The cases each rank runs.


def equality_cases():
    for model in MODELS:
        for mars_type in RULES:
            for exact in (None, "protocol", "closure"):
                for last_grad_dtype in (None, torch.bfloat16):
                    yield dict(model=model, mars_type=mars_type, exact=exact, last_grad_dtype=last_grad_dtype)
        yield dict(model=model, mars_type="mars-adamw", exact=None, optimize_1d=True)
        yield dict(model=model, mars_type="mars-lion", exact="protocol", optimize_1d=True)
        yield dict(model=model, mars_type="mars-adamw", exact=None, amsgrad=True)
        for mars_type in NEWTON_SCHULZ_RULES:
            for bucket in BUCKETS:
                yield dict(model=model, mars_type=mars_type, exact=None, exchange_bucket_mib=bucket)
            yield dict(model=model, mars_type=mars_type, exact="protocol", exchange_bucket_mib=BUCKETS[0])
            yield dict(model=model, mars_type=mars_type, exact=None, iteration_dtype=torch.bfloat16)


# exchange_bucket_mib: one matrix per owner in each bucket (every matrix here is larger), several, all in one
BUCKETS = (1e-6, 2e-3, math.inf)
# The 4-rank cases: (mesh, case)
HSDP = [
    (mesh, dict(model=model, mars_type=mars_type, exact=exact, **bucket))
    for mesh, models in (("HSDP 2 x 2", ("gpt",)), ("FSDP over 4", tuple(MODELS)), ("FSDP over 3", tuple(MODELS)))
    for model in models
    for mars_type in RULES
    for exact in (None, "protocol")
    for bucket in ({}, *([{"exchange_bucket_mib": BUCKETS[0]}] if mars_type in NEWTON_SCHULZ_RULES else []))
]


def label(case):
    return " ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in case.items() if v is not None)


def expected_counts(case, world=2):
    """The collectives of one step(): the clip's all-reduce; Newton-Schulz's all-to-all there and back, once per
    bucket (the default bucket and all in one: every matrix here in one; one matrix per owner: several)."""
    if case["mars_type"] not in NEWTON_SCHULZ_RULES:
        return {"allreduce_": 1}
    buckets = buckets_of(case, world)
    return {"allreduce_": 1, "alltoall_base_": 2 * buckets}


def buckets_of(case, world=2):
    """How many buckets the step's exchange of case's model has on `world` ranks (mars_sharded.owner_buckets)."""
    net = MODELS[case["model"]]()
    opt = make_mars(net, case["mars_type"])
    shapes = [
        p.shape
        for group in opt.param_groups
        for p in group["params"]
        if mars.update_rule(p, group) in mars.NEWTON_SCHULZ_RULES
    ]
    owners = mars_sharded.balanced_owners([mars_sharded.newton_schulz_cost(s) for s in shapes], world)
    bucket = (case.get("exchange_bucket_mib") or mars_sharded.BUCKET_MIB) * 2**20
    return len(mars_sharded.owner_buckets([math.prod(s) * 8 for s in shapes], owners, world, bucket))


def sharded_against_one_process(rank, world, case, mesh=None):
    """(max |difference| from one process after STEPS steps, the collectives of the second step())."""
    from torch.distributed.tensor.debug import CommDebugMode

    options = {k: v for k, v in case.items() if k not in ("model", "exact", "iteration_dtype")}
    exact = case["exact"]
    options["is_approx"] = exact is None
    net = MODELS[case["model"]]()
    reference = copy.deepcopy(net)
    sharded = shard(net, mesh=mesh)
    opt_reference, opt = make_mars(reference, **options), make_mars(sharded, **options)
    data = global_batches(STEPS, world)
    counts = None
    with newton_schulz_in(case.get("iteration_dtype")):
        for t in range(STEPS):
            train_step(reference, opt_reference, data[t], data[t + 1], exact)
            # CommDebugMode cannot watch a forward pass (its module hooks fail inside one): not around step(closure)
            mode = CommDebugMode() if t == 1 and exact != "closure" else None
            local = rank_slice(data[t], rank, world), rank_slice(data[t + 1], rank, world)
            train_step(sharded, opt, *local, exact, counting=mode)
            if mode is not None:
                counts = comm_counts(mode)
    return largest_difference(reference, opt_reference, sharded, opt), counts


def bytes_of_a_step(rank, world, model, mars_type, dtype):
    """The bytes one rank's all-to-alls send in its second step() (bench_fsdp.SentBytes: without the rank's own
    share) with Newton-Schulz in `dtype` (None: the CPU's, float64 here)."""
    from bench.bench_fsdp import SentBytes

    net = shard(MODELS[model]())
    opt = make_mars(net, mars_type)
    data = global_batches(STEPS, world)
    with newton_schulz_in(dtype):
        for t in range(2):
            counting = SentBytes(world) if t == 1 else None
            train_step(net, opt, rank_slice(data[t], rank, world), None, None, counting=counting)
    return counting.sent["alltoall_base_"]


TORCH_OPTIMIZERS = ("adamw", "muon", "moonlight")


def torch_optimizer_against_one_process(rank, world, name):
    """The trainer's other optimizers as the registry builds them (training_optimizer.build_optimizer: AdamW through
    DTensor's dispatch, Muon and Moonlight's matrices through ShardedMuon's owners) over the sharded GPT, against
    the same entry over the plain one: (max |difference| after STEPS steps, the collectives of the second step).
    torch's Muon runs Newton-Schulz in bfloat16: its owner computes it on the whole matrix from the same float64
    momentum as one process, so the bfloat16 matmuls see the same inputs."""
    from torch.distributed.tensor.debug import CommDebugMode

    from marsgpt.config import TrainConfig
    from marsgpt.parallel import Parallelism
    from marsgpt.runtime import Dist
    from marsgpt.training_optimizer import build_optimizer

    cfg = TrainConfig(optimizer=name, learning_rate=2e-2, muon_adamw_lr=1e-2, weight_decay=0.1)
    net = gpt()
    reference = copy.deepcopy(net)
    sharded = shard(net)
    opt_reference = build_optimizer(reference, cfg, Parallelism.single())
    fsdp2 = Parallelism(Dist(torchrun=True, rank=rank, world_size=world), zero_stage=3)
    opt = build_optimizer(sharded, cfg, fsdp2)
    data = global_batches(STEPS, world)
    counts = None
    for t in range(STEPS):
        train_step(reference, opt_reference, data[t], data[t + 1], None)
        mode = CommDebugMode() if t == 1 else None
        train_step(sharded, opt, rank_slice(data[t], rank, world), None, None, counting=mode)
        if mode is not None:
            counts = comm_counts(mode)
    return largest_difference(reference, opt_reference, sharded, opt), counts


def shard_local_norms(buckets):
    """mars_sharded._whole_norms without its all-reduce: each shard clipped by its own norm (the negative control)."""
    return [list(torch._foreach_norm(c, dtype=torch.promote_types(c[0].dtype, torch.float32))) for c, _ in buckets]


def scaler_fallback(rank, world, model, mars_type):
    """Exact MARS with update_previous_grad(inverse_scale) and an inf in the look-ahead gradient of one entry that
    rank 1 holds, at step 2: every rank must drop its look-ahead gradients, as one process does. Returns the
    difference from one process and the collectives of that update_previous_grad()."""
    from torch.distributed.tensor.debug import CommDebugMode

    nets = {"one": MODELS[model]()}
    nets["sharded"] = shard(copy.deepcopy(nets["one"]))
    opts = {key: make_mars(net, mars_type, is_approx=False) for key, net in nets.items()}
    poisoned = "transformer.h.0.mlp.c_fc.weight" if model == "gpt" else "blocks.0.0.weight"
    row = {"gpt": 30, "toy": 4}[model]  # in the second half of the rows: on rank 1
    data = global_batches(STEPS, world)
    counts = None
    for t in range(STEPS):
        for key, net in nets.items():
            batch, next_batch = data[t], data[t + 1]
            if key == "sharded":
                batch, next_batch = rank_slice(batch, rank, world), rank_slice(next_batch, rank, world)
            loss_of(net, next_batch).backward()
            grad = dict(net.named_parameters())[poisoned].grad
            if t == 1 and key == "one":
                grad[row, 0] = float("inf")
            elif t == 1 and rank == 1:
                split = -(-grad.shape[0] // world)
                grad.to_local()[row - split, 0] = float("inf")
            mode = CommDebugMode() if key == "sharded" and t == 1 else contextlib.nullcontext()
            with mode:
                opts[key].update_previous_grad(inverse_scale=torch.tensor(0.5, dtype=torch.float64))
            if key == "sharded" and t == 1:
                counts = comm_counts(mode)
            opts[key].zero_grad()
            loss_of(net, batch).backward()
            opts[key].step()
            opts[key].update_last_grad()
            opts[key].zero_grad()
    return largest_difference(nets["one"], opts["one"], nets["sharded"], opts["sharded"]), counts


# Checkpoints: train SAVE_AT steps, save, train to TOTAL; resumed runs load the save and train to TOTAL.
CHECKPOINT_CASES = {  # MARS's settings, and how exact MARS gets its second gradient (None: approximate)
    "mars-adamw bfloat16 last_grad": dict(mars_type="mars-adamw", exact=None, last_grad_dtype=torch.bfloat16),
    "mars-m exact": dict(mars_type="mars-m", exact="protocol"),
    "mars-shampoo exact bfloat16 last_grad": dict(
        mars_type="mars-shampoo", exact="protocol", last_grad_dtype=torch.bfloat16
    ),
    # x_{t-1}, which step(closure) keeps, must come back through torch.distributed.checkpoint's template too (the
    # fresh optimizer's state, which torch creates with a closure-less step)
    "mars-adamw exact through a closure": dict(mars_type="mars-adamw", exact="closure"),
}
SAVE_AT, TOTAL = 2, 4


def case_mars(net, options):
    settings = {key: value for key, value in options.items() if key != "exact"}
    return make_mars(net, **settings, is_approx=options["exact"] is None)


def train_range(net, opt, data, steps, exact, rank=0, world=1):
    for t in steps:
        batch, next_batch = data[t], data[t + 1]
        if world > 1:
            batch, next_batch = rank_slice(batch, rank, world), rank_slice(next_batch, rank, world)
        train_step(net, opt, batch, next_batch, exact)


def dcp_save(net, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(net, opt)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)


def dcp_load(net, opt, path):
    """As a user resumes: the state dicts of the fresh model and optimizer as the template (torch takes a zero-lr
    step() to create the optimizer's state), loaded in place, then set."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(net, opt)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def one_process_checkpoints(root):
    """Before the ranks start: one process trains each checkpoint case, saving at SAVE_AT (for 1 -> 2)."""
    data = global_batches(TOTAL, 2)
    for name, options in CHECKPOINT_CASES.items():
        net = gpt()
        opt = case_mars(net, options)
        train_range(net, opt, data, range(SAVE_AT), options["exact"])
        dcp_save(net, opt, os.path.join(root, f"{name} 1 process"))


def sharded_checkpoints(rank, world, root):
    """{case: {run: full parameters at TOTAL}}: "uninterrupted" (saving at SAVE_AT on the way, a torch.distributed
    .checkpoint directory and a full-state file), "1 -> 2" and "2 -> 2" (each loaded into a fresh sharded model
    with other weights)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    data = global_batches(TOTAL, world)
    results = {}
    for name, options in CHECKPOINT_CASES.items():
        runs = results[name] = {}
        net = shard(gpt())
        opt = case_mars(net, options)
        train_range(net, opt, data, range(SAVE_AT), options["exact"], rank, world)
        dcp_save(net, opt, os.path.join(root, f"{name} 2 ranks"))
        # one file, as a trainer writes ckpt.pt: every shard gathered to rank 0's host (torch refuses a group
        # value that is not a tensor, number, string, list or dict: last_grad_dtype goes by name)
        gathered = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(net, opt, options=gathered)
        if rank == 0:
            torch.save({"model": model_state, "optimizer": optimizer_state}, os.path.join(root, f"{name}.pt"))
        train_range(net, opt, data, range(SAVE_AT, TOTAL), options["exact"], rank, world)
        runs["uninterrupted"] = full_params(net)
        for source in ("1 process", "2 ranks"):
            net = shard(gpt(seed=99))  # other weights: the load must replace them
            opt = case_mars(net, options)
            dcp_load(net, opt, os.path.join(root, f"{name} {source}"))
            train_range(net, opt, data, range(SAVE_AT, TOTAL), options["exact"], rank, world)
            runs[f"{source.split()[0]} -> 2"] = full_params(net)
    return results


def one_process_resumes(root):
    """After the ranks: each 2-rank checkpoint (the torch.distributed.checkpoint directory, and the full-state
    file) loaded into one process's plain model, trained to TOTAL."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    data = global_batches(TOTAL, 2)
    results = {}
    for name, options in CHECKPOINT_CASES.items():
        net = gpt(seed=99)
        opt = case_mars(net, options)
        dcp_load(net, opt, os.path.join(root, f"{name} 2 ranks"))
        train_range(net, opt, data, range(SAVE_AT, TOTAL), options["exact"])
        results[(name, "2 -> 1")] = full_params(net)
        net = gpt(seed=99)
        opt = case_mars(net, options)
        state = torch.load(os.path.join(root, f"{name}.pt"), weights_only=True)
        whole = StateDictOptions(full_state_dict=True)
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=whole)
        train_range(net, opt, data, range(SAVE_AT, TOTAL), options["exact"])
        results[(name, "2 -> 1, full-state file")] = full_params(net)
    return results


def fused_refusal():
    net = shard(gpt())
    try:
        MARS(net.parameters(), fused=True)
    except ValueError as error:
        return str(error)
    return None


# ---------------------------------------------------------------------------------------------------
# The ranks.


def recorded(report, key, fn, *args):
    """report[key] = fn(*args), or the traceback: one case failing must not hide the others."""
    try:
        report[key] = fn(*args)
    except Exception:
        report[key] = {"error": traceback.format_exc()}


def two_rank_worker(rank, world, store, root, report_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    report = {}
    try:
        for case in equality_cases():
            recorded(report, ("equality", label(case)), sharded_against_one_process, rank, world, case)
        for name in TORCH_OPTIMIZERS:
            recorded(report, ("torch", name), torch_optimizer_against_one_process, rank, world, name)
        for model in MODELS:
            for mars_type in NEWTON_SCHULZ_RULES:
                for dtype in (None, torch.bfloat16):
                    key = ("bytes", model, mars_type, dtype)
                    recorded(report, key, bytes_of_a_step, rank, world, model, mars_type, dtype)
        whole_norms = mars_sharded._whole_norms
        mars_sharded._whole_norms = shard_local_norms
        try:
            for mars_type in RULES:
                case = dict(model="gpt", mars_type=mars_type, exact=None)
                recorded(report, ("shard-local norms", mars_type), sharded_against_one_process, rank, world, case)
        finally:
            mars_sharded._whole_norms = whole_norms
        for model in MODELS:
            for mars_type in RULES:
                recorded(report, ("scaler", model, mars_type), scaler_fallback, rank, world, model, mars_type)
        recorded(report, "fused", fused_refusal)
        recorded(report, "checkpoints", sharded_checkpoints, rank, world, root)
    finally:
        torch.save(report, f"{report_path}.{rank}")
        dist.destroy_process_group()


def hsdp_worker(rank, world, store, report_path):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    report = {}
    try:
        if world == 4:
            meshes = {
                "HSDP 2 x 2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
                # 4 shards: 9 rows split 3, 3, 3, 0; the Toy's (5, 7) and (1, 3) matrices 2, 2, 1, 0 and 1, 0, 0, 0
                "FSDP over 4": init_device_mesh("cpu", (4,)),
            }
        else:  # 3 shards: 9 rows split 3, 3, 3; the Toy's (5, 7) and (1, 3) matrices 2, 2, 1 and 1, 0, 0
            meshes = {"FSDP over 3": init_device_mesh("cpu", (3,))}
        for mesh_name, case in HSDP:
            if mesh_name not in meshes:
                continue
            key = (mesh_name, label(case))
            recorded(report, key, sharded_against_one_process, rank, world, case, meshes[mesh_name])
    finally:
        torch.save(report, f"{report_path}.{rank}")
        dist.destroy_process_group()


def spawn(fn, world, tmp_path, *args):
    report = str(tmp_path / "report")
    mp.spawn(fn, args=(world, str(tmp_path / "store"), *args, report), nprocs=world, join=True)
    return [torch.load(f"{report}.{rank}", weights_only=False) for rank in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    one_process_checkpoints(str(root))
    reports = spawn(two_rank_worker, 2, tmp_path_factory.mktemp("ranks"), str(root))
    return reports, one_process_resumes(str(root))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn(hsdp_worker, 4, tmp_path_factory.mktemp("four_ranks"))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return spawn(hsdp_worker, 3, tmp_path_factory.mktemp("three_ranks"))


def results(reports, key):
    """Every rank's result for key; a rank's error fails the test with its traceback."""
    found = [report[key] for report in reports]
    for result in found:
        if isinstance(result, dict) and "error" in result:
            pytest.fail(result["error"])
    return found


# ---------------------------------------------------------------------------------------------------
# The tests.

EQUALITY = [label(case) for case in equality_cases()]


@pytest.mark.slow
@pytest.mark.parametrize("case", EQUALITY)
def test_sharded_step_equals_one_process(two_ranks, case):
    for difference, _ in results(two_ranks[0], ("equality", case)):
        assert difference <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mars_type", NEWTON_SCHULZ_RULES)
def test_newton_schulz_results_come_back_in_bfloat16_where_it_runs_in_bfloat16(two_ranks, model, mars_type):
    """With Newton-Schulz in bfloat16 (as on a GPU) each owner sends its results back in bfloat16, which loses
    nothing (the iteration's result is bfloat16-valued; every rank multiplies by the rule's factor after the cast,
    as one process does): the step equals one process (test_sharded_step_equals_one_process's iteration_dtype
    cases) and the all-to-alls send (8 + 2) / (8 + 8) of the bytes they send for float64 parameters otherwise:
    over both ranks, as many elements go back as went to the owners (a rank's own share of each stays)."""
    full = sum(results(two_ranks[0], ("bytes", model, mars_type, None)))
    half = sum(results(two_ranks[0], ("bytes", model, mars_type, torch.bfloat16)))
    assert full > 0 and half * 16 == full * 10


@pytest.mark.slow
@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_the_trainer_s_torch_optimizers_on_sharded_parameters_equal_one_process(two_ranks, name):
    """AdamW elementwise on each rank's rows (no collective); Muon's and Moonlight's matrices orthogonalised whole
    at their owners (two all-to-alls a step, nothing gathered)."""
    for difference, counts in results(two_ranks[0], ("torch", name)):
        assert difference <= TOL
        assert counts == ({} if name == "adamw" else {"alltoall_base_": 2})


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in equality_cases() if c["exact"] != "closure"], ids=label)
def test_a_step_sends_one_norm_all_reduce_and_no_all_gather(two_ranks, case):
    """The closure's own forward and backward (FSDP2's all-gathers and reduce-scatters) are not the step's, so the
    closure cases are left out."""
    for _, counts in results(two_ranks[0], ("equality", label(case))):
        assert counts == expected_counts(case)


@pytest.mark.slow
@pytest.mark.parametrize("mars_type", RULES)
def test_shard_local_norms_would_move_the_run(two_ranks, mars_type):
    """The negative control: clipping each shard by its own norm (no all-reduce) is not the rule."""
    for difference, counts in results(two_ranks[0], ("shard-local norms", mars_type)):
        assert difference > 1e-6 and "allreduce_" not in counts


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mars_type", RULES)
def test_an_overflow_on_one_ranks_shard_drops_every_ranks_look_ahead(two_ranks, model, mars_type):
    for difference, counts in results(two_ranks[0], ("scaler", model, mars_type)):
        assert difference <= TOL and counts == {"allreduce_": 1}


@pytest.mark.slow
def test_fused_is_refused_on_dtensor_parameters_in_one_line(two_ranks):
    for message in results(two_ranks[0], "fused"):
        assert message is not None and "\n" not in message
        assert message.startswith("fused=True does not run on DTensor (FSDP2) parameters")


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINT_CASES)
def test_checkpoints_reshard_and_resume_as_the_uninterrupted_run(two_ranks, name):
    """2 -> 2 continues bit for bit; 1 -> 2 and 2 -> 1 (a torch.distributed.checkpoint directory, and a full-state
    file written on rank 0) continue to 1e-12, where one and two ranks round the clip's norm differently."""
    reports, one_process = two_ranks
    for runs in results(reports, "checkpoints"):
        uninterrupted = runs[name]["uninterrupted"]
        assert params_difference(runs[name]["2 -> 2"], uninterrupted) == 0
        assert params_difference(runs[name]["1 -> 2"], uninterrupted) <= TOL
        assert params_difference(one_process[(name, "2 -> 1")], uninterrupted) <= TOL
        assert params_difference(one_process[(name, "2 -> 1, full-state file")], uninterrupted) <= TOL


FOUR = [(mesh, case) for mesh, case in HSDP if mesh != "FSDP over 3"]
THREE = [(mesh, case) for mesh, case in HSDP if mesh == "FSDP over 3"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,case", FOUR, ids=[f"{m}: {label(c)}" for m, c in FOUR])
def test_four_ranks_hsdp_and_empty_shards(four_ranks, mesh, case):
    """A 2 x 2 (replicate, shard) mesh, whose replicas each run the rule on their shard group, and a 1-D mesh of 4
    with empty shards: equal to one process, with the same collectives per step (buckets on the shard group)."""
    for difference, counts in results(four_ranks, (mesh, label(case))):
        assert difference <= TOL and counts == expected_counts(case, world=2 if mesh.startswith("HSDP") else 4)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,case", THREE, ids=[f"{m}: {label(c)}" for m, c in THREE])
def test_three_ranks_an_odd_number_of_owners(three_ranks, mesh, case):
    """A 1-D mesh of 3: every matrix split in torch.chunk's uneven sizes and the owners balanced over an odd number of
    ranks: equal to one process, with the same collectives per step."""
    for difference, counts in results(three_ranks, (mesh, label(case))):
        assert difference <= TOL and counts == expected_counts(case, world=3)


def fsdp2_example_in_one_process():
    """What docs/mars.md's FSDP2 example computes, in one process on the whole batches: (model, optimizer)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 40), nn.GELU(), nn.Linear(40, 16)) for _ in range(2)]
    model = nn.Sequential(*blocks, nn.LayerNorm(16), nn.Linear(16, 1))
    return model, MARS(model.parameters(), lr=3e-3, mars_type="mars-shampoo", weight_decay=0.1)


@pytest.mark.slow
def test_a_users_fsdp2_loop_trains_as_one_process(tmp_path):
    """docs/mars.md's FSDP2 example, as a user runs it (torchrun, 2 gloo ranks): its torch.distributed.checkpoint
    holds the parameters and the optimizer state one process reaches on the whole batches (float32: to rounding)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    script = tmp_path / "fsdp2_mars.py"
    script.write_text(docs_example("fsdp2"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    # subprocess_env puts the repository root on the path: the example imports mars from there
    run = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr

    model, optimizer = fsdp2_example_in_one_process()
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 1, generator=generator)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    loaded_model, loaded_optimizer = fsdp2_example_in_one_process()
    model_state, optimizer_state = get_state_dict(loaded_model, loaded_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(tmp_path / "mars-fsdp2"))
    set_state_dict(loaded_model, loaded_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for p, q in zip(model.parameters(), loaded_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        assert optimizer.state[p].keys() == loaded_optimizer.state[q].keys()
        for key, value in optimizer.state[p].items():
            torch.testing.assert_close(loaded_optimizer.state[q][key], value, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Without ranks.


@pytest.mark.parametrize("shape", [(3, 40, 24), (2, 24, 40), (1, 130, 9)], ids=str)
@pytest.mark.parametrize("buffer_bytes", [math.inf, 1_000, 1])
def test_the_owner_s_newton_schulz_is_mars_newton_schulz_in_column_blocks(shape, buffer_bytes):
    """newton_schulz_start and newton_schulz_iterate_ on a stack (wide, tall; in blocks of any number of columns,
    at least the rows: the last one narrower) equal mars.newton_schulz to float64 rounding: the same elementwise
    ops in the same order, each block's products those of the whole matrix's columns. In bfloat16 to bfloat16's
    precision (a block's matmul may accumulate in another order)."""
    generator = torch.Generator().manual_seed(0)
    G = torch.randn(shape, generator=generator, dtype=torch.float64)
    X = mars_sharded.newton_schulz_start(G.clone(), eps=1e-7, dtype=torch.float64)
    owner = mars_sharded.newton_schulz_iterate_(X, mars._NS_COEFFS, buffer_bytes=buffer_bytes)
    assert (owner - mars.newton_schulz(G, dtype=torch.float64)).abs().max() <= 1e-12
    low = G.float()
    X = mars_sharded.newton_schulz_start(low.clone(), eps=1e-7, dtype=torch.bfloat16)
    assert X.dtype == torch.bfloat16
    owner = mars_sharded.newton_schulz_iterate_(X, mars._NS_COEFFS, buffer_bytes=buffer_bytes)
    one_process = mars.newton_schulz(low, dtype=torch.bfloat16)
    assert (owner.float() - one_process).abs().max() <= 0.02
    if buffer_bytes == math.inf:  # the same products: the same bits
        assert torch.equal(owner.float(), one_process)


def test_newton_schulz_s_bfloat16_result_comes_back_from_bfloat16_bit_for_bit():
    """Why the owners may send bfloat16: the result is bfloat16-valued before newton_schulz casts it back, so the
    cast to bfloat16 and back loses nothing, and the factor applied after it gives one process's update."""
    m = torch.randn(48, 16, generator=torch.Generator().manual_seed(1))
    result = mars.newton_schulz(m, dtype=torch.bfloat16)
    assert torch.equal(result.to(torch.bfloat16).float(), result)
    rule = dict(beta1=0.9, eps=1e-8)
    _, _, factor = mars._newton_schulz_terms("newton-schulz", m.shape, **rule)
    sent = mars.newton_schulz(m / (1 - rule["beta1"]), eps=rule["eps"], dtype=torch.bfloat16).to(torch.bfloat16)
    with newton_schulz_in(torch.bfloat16):
        u = mars._orthogonal_direction(m, "newton-schulz", **rule)
    assert torch.equal(sent.float().mul_(factor), u)


def test_owner_buckets_hold_at_most_the_bound_per_owner_and_every_matrix_once():
    sizes = [500, 100, 300, 300, 50, 2_000, 100, 100]
    owners = mars_sharded.balanced_owners(sizes, 3)
    for bound in (1, 350, 600, math.inf):
        buckets = mars_sharded.owner_buckets(sizes, owners, 3, bound)
        assert sorted(i for bucket in buckets for i in bucket) == list(range(len(sizes)))
        for bucket in buckets:
            for rank in range(3):
                mine = [sizes[i] for i in bucket if owners[i] == rank]
                assert len(mine) <= 1 or sum(mine) <= bound  # a larger matrix by itself
        if bound == 1:  # one matrix per owner and bucket: as many buckets as the busiest owner has matrices
            assert len(buckets) == max(owners.count(rank) for rank in range(3))
        if bound == math.inf:
            assert buckets == [list(range(len(sizes)))]


def test_the_owners_product_blocks_are_at_least_as_wide_as_the_matrix_is_high():
    assert mars_sharded.block_columns(column_bytes=100, rows=20, columns=1_000, buffer_bytes=math.inf) == 1_000
    assert mars_sharded.block_columns(column_bytes=100, rows=20, columns=1_000, buffer_bytes=5_000) == 50
    assert mars_sharded.block_columns(column_bytes=100, rows=20, columns=1_000, buffer_bytes=1) == 20
    assert mars_sharded.block_columns(column_bytes=100, rows=20, columns=10, buffer_bytes=1) == 10


def test_the_timeline_records_phases_only_while_it_is_open():
    with mars_sharded.timeline() as events:
        with mars_sharded._phase("Newton-Schulz", 3):
            pass
    with mars_sharded._phase("Newton-Schulz", 4):
        pass
    assert [(name, number) for name, number, *_ in events] == [("Newton-Schulz", 3)]
    ((_, _, start, end),) = events
    assert start <= end


@pytest.mark.parametrize("bucket", [0, -1.0, "64", True])
def test_a_bucket_that_is_no_positive_number_is_refused_naming_the_argument(bucket):
    with pytest.raises(ValueError, match=r"^invalid exchange_bucket_mib: .*number of MiB > 0"):
        MARS([torch.nn.Parameter(torch.zeros(2, 2))], exchange_bucket_mib=bucket)
