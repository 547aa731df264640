"""MARS's step on sharded (DTensor) parameters, FSDP2's and HSDP's, and the owner-computes exchange it runs on.

mars.py imports this module only when DTensor parameters are given or step, so mars.py copied alone steps every
unsharded parameter; this module imports torch, and torch.distributed inside its functions, never mars.py. What
mars.py calls:

- ``step(parts, kernels)``: the step of the parts' tensors (mars.py's ``_Part``), whose parameters are DTensors;
  ``kernels`` is mars.py itself, whose multi-tensor functions step each rank's shards;
- ``on_every_shard(flag, params)``: a boolean every rank holding a shard of these parameters agrees on.

What marsgpt/fsdp.py's ShardedMuon and marsgpt/memory_plan.py use: ``map_whole_tensors`` (fn on whole tensors at
owner ranks), ``balanced_owners``, ``newton_schulz_cost`` and ``owner_buckets`` (how the exchange is scheduled).
"""

import contextlib
import math
import time

import torch

# MiB of whole matrices one rank owns in one bucket of the exchange (docs/mars.md, "Sharded parameters", gives
# the memory it bounds): GPT-2 XL's exchange on 8 GPUs then holds 0.60 GiB at most on a rank (MARS-Shampoo; planned,
# `python -m bench.bench_fsdp`), against 2.18 GiB all at once.
BUCKET_MIB = 64

# The rule on a rank's shards is elementwise except two things that look at a whole tensor, and only those
# communicate. c_t's clip needs the whole tensor's Frobenius norm: the square root of its shards' sums of squares
# added up over the process group (one all-reduce per step and group). Newton-Schulz needs the whole matrix: each
# matrix has an owner rank (balanced_owners), every rank sends its rows of m to the owners (an all-to-all), each
# owner runs Newton-Schulz on the matrices it owns, and a second all-to-all returns every rank its rows of the
# result. The exchange runs in buckets (owner_buckets: at most bucket_mib of whole matrices per owner), one pair of
# all-to-alls each, started asynchronously so that the next bucket travels to its owners and the last one's
# results back while this one's Newton-Schulz runs. A rank's shard is its DTensor's local tensor (a view, so the
# in-place rule updates the parameter and the state); state stays DTensors, which torch.distributed.checkpoint
# saves and reshards. On gloo the all-to-all of CUDA tensors goes through the host; on NCCL it stays on the device.


class _Split:
    """How a DTensor's shards make the whole tensor: split along tensor dim `dim` into `world` pieces over the
    process group `group` (the one mesh dim that shards it; replicated on the others), in torch.chunk's sizes,
    as Shard(dim) places them. None from split_of for a whole tensor on every rank."""

    def __init__(self, group, dim, shape, rank, world):
        self.group, self.dim, self.shape, self.rank, self.world = group, dim, tuple(shape), rank, world
        chunk = -(-shape[dim] // world)  # ceil: the first ranks hold `chunk` rows each, then the rest
        self.sizes = [max(0, min(chunk, shape[dim] - r * chunk)) for r in range(world)]
        self.offsets = [min(r * chunk, shape[dim]) for r in range(world)]

    def local_shape(self, rank):
        shape = list(self.shape)
        shape[self.dim] = self.sizes[rank]
        return shape


def split_of(p):
    """p's _Split where p is a DTensor sharded over a mesh dimension (one of size 1 too: a mesh of one still runs
    the exchange, as more ranks do), else None."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    sharding = [(i, pl) for i, pl in enumerate(p.placements) if not pl.is_replicate()]
    if not sharding:
        return None
    if len(sharding) > 1 or type(sharding[0][1]) is not Shard:
        raise NotImplementedError(
            f"MARS steps DTensors sharded along one tensor dimension over one mesh dimension (FSDP2, HSDP); got "
            f"placements {p.placements} on mesh {mesh}"
        )
    if p.grad is not None and p.grad.placements != p.placements:
        raise NotImplementedError(f"gradient placements {p.grad.placements} differ from the parameter's {p.placements}")
    mesh_dim, placement = sharding[0]
    split = _Split(mesh.get_group(mesh_dim), placement.dim, p.shape, mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim))
    if tuple(p.to_local().shape) != tuple(split.local_shape(split.rank)):  # torch.chunk's sizes, as Shard's
        raise NotImplementedError(f"unexpected local shape {tuple(p.to_local().shape)} of {p.shape} {p.placements}")
    return split


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------------------------------------------
# The step.


def step(parts, kernels):
    """Every part whose parameters are DTensors: the multi-tensor rule on the shards, with c_t's norms from
    _whole_norms (one all-reduce for all the parts) and Newton-Schulz at the owners (_newton_schulz_at_owners), in
    buckets of the smallest exchange_bucket_mib of the parts' groups."""
    prepared = []  # the MARS tensors' (local lists, c, splits, lr, numbers) per part, device and dtype
    for part in parts:
        numbers = part.numbers
        for device, lists in kernels._by_device_and_dtype(*part.tensors):
            local = [None if lst is None else [_local(t) for t in lst] for lst in lists]
            lr = kernels._lr_on(numbers["lr"], device)
            params, grads, last_grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, _ = local
            if last_grads is None:  # the AdamW part: elementwise, so nothing to communicate
                hyper = {k: numbers[k] for k in ("beta1", "beta2", "eps", "weight_decay", "eps_uncorrected")}
                kernels._foreach_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, **hyper)
                continue
            c = kernels._corrected_gradients(
                grads, last_grads, exp_avgs[0].dtype, beta1=numbers["beta1"], gamma=numbers["gamma"]
            )
            prepared.append((local, c, [split_of(p) for p in lists[0]], lr, numbers))
    all_norms = _whole_norms([(c, splits) for _, c, splits, _, _ in prepared])
    splits_by_id = {id(p): split for local, _, splits, _, _ in prepared for p, split in zip(local[0], splits)}
    jobs = []  # (params, momenta, lr, rule, numbers) of every Newton-Schulz rule's tensors, for one exchange

    def defer_to_owners(params, momenta, lr, rule, **numbers):
        jobs.append((params, momenta, lr, rule, numbers))

    for (local, c, _, lr, numbers), norms in zip(prepared, all_norms):
        hyper = {k: numbers[k] for k in ("beta1", "beta2", "eps", "weight_decay")}
        kernels._clipped_update(*local, c, norms, lr, **hyper, newton_schulz=defer_to_owners)
    if jobs:
        mib = min(part.exchange_bucket_mib or BUCKET_MIB for part in parts)
        _newton_schulz_at_owners(jobs, splits_by_id, kernels, mib * 2**20)


def _whole_norms(prepared):
    """The Frobenius norm of each whole tensor, for [(c, splits)] of shards: a sharded tensor's is the square root
    of its shards' sums of squares summed over its process group, all of them in one all-reduce per process
    group (FSDP2: one; HSDP: the shard dimension's, as the replicas hold the same gradients)."""
    import torch.distributed as dist

    norms = [list(torch._foreach_norm(c, dtype=torch.promote_types(c[0].dtype, torch.float32))) for c, _ in prepared]
    by_group = {}
    for b, (_, splits) in enumerate(prepared):
        for i, split in enumerate(splits):
            if split is not None:
                by_group.setdefault(split.group, []).append((b, i))
    for group, where in by_group.items():
        squares = torch.stack([norms[b][i].to(torch.float64).square() for b, i in where])
        dist.all_reduce(squares, group=group)
        for (b, i), norm in zip(where, squares.sqrt().unbind()):
            norms[b][i] = norm.to(norms[b][i].dtype)
    return norms


def on_every_shard(flag, params):
    """A boolean 0-d tensor, True on every rank only where it is True on every rank that shares a process group
    with one of these parameters' shards (one all-reduce per group; none for whole tensors)."""
    groups = {split.group: None for split in map(split_of, params) if split is not None}
    if not groups:
        return flag
    import torch.distributed as dist

    flag = flag.to(torch.float32)
    for group in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return flag.bool()


def _newton_schulz_at_owners(jobs, splits_by_id, kernels, bucket_bytes):
    """The Newton-Schulz rules' updates, jobs = [(params, momenta, lr, rule, numbers)] of shards with m already
    updated: whole tensors as one process steps them; sharded ones at their owners, one exchange per process
    group and dtype. Each owner returns Newton-Schulz's result before its factor, in the narrower of m's dtype and
    the iteration's (kernels.newton_schulz_dtype: bfloat16 on recent GPUs), which loses nothing: one process
    casts that result to m's dtype, then multiplies by the factor, as every rank does here with its rows."""
    exchanges = {}
    for params, momenta, lr, rule, numbers in jobs:
        whole = [i for i, p in enumerate(params) if splits_by_id[id(p)] is None]
        if whole:
            kernels._newton_schulz_update([params[i] for i in whole], [momenta[i] for i in whole], lr, rule, **numbers)
        for p, m in zip(params, momenta):
            split = splits_by_id[id(p)]
            if split is not None:
                exchanges.setdefault((split.group, m.dtype, p.device), []).append((p, m, split, lr, rule, numbers))
    for (group, dtype, device), items in exchanges.items():
        _exchange_newton_schulz(group, items, kernels.newton_schulz_dtype(device, dtype), kernels, bucket_bytes)


def _exchange_newton_schulz(group, items, iteration_dtype, kernels, bucket_bytes):
    """The updates of items = [(p, m, split, lr, rule, numbers)] on one process group, bucket by bucket: each
    owner's Newton-Schulz batched by shape and rule (newton_schulz_iterate_, with product buffers of a quarter of
    a bucket), each rank's rows of the result applied as they come back."""
    dtype = items[0][1].dtype
    result_dtype = min(dtype, iteration_dtype, key=lambda d: d.itemsize)

    def batch(i):
        _, _, split, _, rule, numbers = items[i]
        return split.shape, rule, numbers["beta1"], numbers["eps"]

    def directions(key, stacks):
        shape, rule, beta1, eps = key
        stacked = stacks.pop(key)
        divisor, eps, _ = kernels._newton_schulz_terms(rule, shape, beta1=beta1, eps=eps)
        if divisor is not None:
            stacked.div_(divisor)
        X = newton_schulz_start(stacked, eps=eps, dtype=iteration_dtype)
        del stacked  # cast down: freed here (newton_schulz_start's argument held it while it ran)
        return newton_schulz_iterate_(X, kernels._NS_COEFFS, buffer_bytes=bucket_bytes / 4)

    shards, splits = [m for _, m, *_ in items], [split for _, _, split, *_ in items]
    for indices, rows in _at_owners(group, shards, splits, directions, batch, result_dtype, bucket_bytes):
        _apply(items, indices, rows, kernels)
        del rows  # before the next bucket's Newton-Schulz


def _apply(items, indices, rows, kernels):
    """p ← p - lr (u + λ p) with u = factor × each row of Newton-Schulz's result, as one process applies it."""
    by_job = {}  # (lr, weight decay) -> parameters and their updates
    for i, row in zip(indices, rows):
        p, m, split, lr, rule, numbers = items[i]
        *_, factor = kernels._newton_schulz_terms(rule, split.shape, beta1=numbers["beta1"], eps=numbers["eps"])
        job = by_job.setdefault((id(lr), numbers["weight_decay"]), (lr, [], []))
        job[1].append(p)
        job[2].append(row.to(m.dtype).mul_(factor))
    for (_, weight_decay), (lr, params, updates) in by_job.items():
        kernels._foreach_apply_update(params, updates, lr, weight_decay)


def newton_schulz_start(G, *, eps, dtype):
    """mars.newton_schulz's X_0 for a stack of matrices G (k, rows, cols): G cast to `dtype`, divided by its norm
    (+ eps) in G's dtype, cast again, as there; in G's memory where `dtype` is G's (G is overwritten either way)."""
    norms = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True)
    if dtype.itemsize < G.dtype.itemsize:
        G.copy_(G.to(dtype))
        return G.div_(norms + eps).to(dtype)
    return G.to(dtype).div_(norms + eps)


def newton_schulz_iterate_(X, coefficients, *, steps=5, buffer_bytes=math.inf):
    """mars.newton_schulz's iterations on X_0 = X (a stack), in X's memory: what an owner runs, holding its matrices
    once. Every elementwise op is newton_schulz's, in its order, in place; each iteration's two products with XXᵀ
    run on blocks of X's columns (its long side) of at most buffer_bytes each (but no fewer columns than X has
    rows: XXᵀ's size), whose new value depends only on XXᵀ and on themselves. Returns X."""
    a, b, c = coefficients
    tall = X.size(-2) > X.size(-1)
    wide = X.mT if tall else X
    rows, columns = wide.shape[-2:]
    block = block_columns(wide.numel() // max(1, columns) * wide.element_size(), rows, columns, buffer_bytes)
    for _ in range(steps):
        A = wide @ wide.mT
        for start in range(0, columns, block):
            columns_block = wide[..., start : start + block]
            B = A @ columns_block
            C = A @ B
            columns_block.mul_(a).add_(B.mul_(b)).add_(C.mul_(c))  # a X + b B + c (A B)
            del B, C  # before the next block's: two product buffers at a time
        del A
    return X


def block_columns(column_bytes, rows, columns, buffer_bytes):
    """Columns of a block of newton_schulz_iterate_'s products: as many as buffer_bytes holds, at least `rows`."""
    if buffer_bytes >= columns * column_bytes:
        return columns
    return min(columns, max(rows, int(buffer_bytes // column_bytes)))


# ---------------------------------------------------------------------------------------------------
# The owner-computes exchange.


def newton_schulz_cost(shape):
    """Multiply-adds of Newton-Schulz on a matrix (each iteration: three n x n x N products, n <= N)."""
    n, big = sorted(shape[-2:])
    return n * n * big


def balanced_owners(costs, world):
    """An owner rank for each job: the costliest first, each to the least loaded rank (the lowest on ties).
    Deterministic, so every rank computes the same assignment without communicating."""
    load, owners = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owners[i] = min(range(world), key=lambda r: (load[r], r))
        load[owners[i]] += costs[i]
    return owners


def owner_buckets(sizes, owners, world, bucket_bytes):
    """The exchange's buckets, in order, each a sorted list of indices into sizes (bytes of each whole tensor) and
    owners (its owner rank): every rank's own tensors, in index order, fill the buckets up to bucket_bytes per
    rank (a larger tensor by itself), so that every bucket gives every rank with tensors left about the same work.
    The same on every rank, without communicating."""
    queues = [[i for i in range(len(sizes)) if owners[i] == r] for r in range(world)]
    buckets = []
    while any(queues):
        bucket = []
        for queue in queues:
            held = 0
            while queue and (held == 0 or held + sizes[queue[0]] <= bucket_bytes):
                held += sizes[queue[0]]
                bucket.append(queue.pop(0))
        buckets.append(sorted(bucket))
    return buckets


def map_whole_tensors(params, tensors, fn, result_dtype=None, bucket_mib=None):
    """[fn(whole) for each of `tensors`], each shaped and placed like its parameter in `params`, computed where its
    whole value is: for a DTensor parameter (FSDP2, HSDP), `tensors` holds this rank's rows of it (a local tensor);
    the whole goes to one owner rank, which computes fn there, and this rank gets back its rows of the result, in
    result_dtype (default the tensor's). For a whole parameter fn runs here. This is MARS's owner exchange
    (owners balanced by Newton-Schulz's cost, buckets of bucket_mib per owner, default BUCKET_MIB) for other
    whole-matrix rules: marsgpt/fsdp.py's ShardedMuon steps torch.optim.Muon's rule with it."""
    splits = [split_of(p) for p in params]
    results, exchanges = [None] * len(params), {}
    for i, (split, tensor) in enumerate(zip(splits, tensors)):
        if split is None:
            results[i] = fn(tensor)
        else:
            exchanges.setdefault((split.group, tensor.dtype, tensor.device), []).append(i)

    def compute(key, stacks):
        return torch.stack([fn(whole) for whole in stacks.pop(key).unbind(0)])

    for (group, dtype, _), items in exchanges.items():
        shards, item_splits = [tensors[i] for i in items], [splits[i] for i in items]
        bucket_bytes = (bucket_mib or BUCKET_MIB) * 2**20
        for indices, rows in _at_owners(group, shards, item_splits, compute, int, result_dtype or dtype, bucket_bytes):
            for j, row in zip(indices, rows):
                results[items[j]] = row
    return results


def _at_owners(group, shards, splits, compute, batch, result_dtype, bucket_bytes):
    """Yields (indices, rows) bucket by bucket (owner_buckets): rows[k] is this rank's rows of the result for the
    whole tensor indices[k], `shards` this rank's rows of each, split as `splits` say over the process group
    `group`. Every tensor goes whole to its owner rank, where those of one batch(index) are stacked and
    compute(key, stacks) takes the stack of its key out of stacks and returns the results (it may overwrite the
    stack); every rank gets its rows of each result back in result_dtype. While an owner computes a bucket, the
    next one's all-to-all to the owners and the last one's back are in flight."""
    rank, world = splits[0].rank, splits[0].world
    owners = balanced_owners([newton_schulz_cost(split.shape) for split in splits], world)
    sizes = [math.prod(split.shape) * shard.element_size() for split, shard in zip(splits, shards)]
    buckets = owner_buckets(sizes, owners, world, bucket_bytes)
    row_numel = [math.prod(split.shape) // max(1, split.shape[split.dim]) for split in splits]

    def to_owners(number):
        owned = [[i for i in buckets[number] if owners[i] == r] for r in range(world)]
        send = _joined([shards[i].reshape(-1) for r in range(world) for i in owned[r]], shards[0])
        send_sizes = [sum(shards[i].numel() for i in owned[r]) for r in range(world)]
        receive_sizes = [sum(splits[i].sizes[r] * row_numel[i] for i in owned[rank]) for r in range(world)]
        return owned, send_sizes, receive_sizes, _Transfer(send, send_sizes, receive_sizes, group, "to owners", number)

    def back(number, coming):
        """Bucket `number` once its pieces are here: the next bucket sent on its way, this one's results computed
        and sent back. Returns (what is coming next, this bucket's results on their way back)."""
        owned, send_sizes, receive_sizes, transfer = coming
        received = transfer.wait()
        coming = to_owners(number + 1) if number + 1 < len(buckets) else None
        stacks, members = _stacks(received, owned[rank], splits, batch)
        del received  # copied into the stacks, or viewed by the one stack
        with _phase("Newton-Schulz", number):
            results = {}
            for key in list(stacks):
                for j, result in zip(members[key], compute(key, stacks).unbind(0)):
                    results[j] = result
        transfer.release()
        reply = _reply(results, owned[rank], splits, receive_sizes, result_dtype, shards[0].device)
        del results
        return coming, (number, owned, _Transfer(reply, receive_sizes, send_sizes, group, "back", number))

    def rows_of(number, owned, transfer):
        returned, offset, rows = transfer.wait(), 0, {}
        for r in range(world):
            for i in owned[r]:
                rows[i] = returned[offset : offset + shards[i].numel()].view(shards[i].shape)
                offset += shards[i].numel()
        return buckets[number], [rows[i] for i in buckets[number]]

    coming = to_owners(0) if buckets else None
    returning = None
    for number in range(len(buckets)):
        coming, going = back(number, coming)
        if returning is not None:
            yield rows_of(*returning)
            returning[2].release()
        returning = going
    if returning is not None:
        yield rows_of(*returning)
        returning[2].release()


def _joined(flat, like):
    return torch.cat(flat) if flat else like.new_empty(0)


def _stacks(received, owned, splits, batch):
    """The whole tensors this rank owns, from the pieces every rank sent (in rank order; each rank's in `owned`
    order), stacked by batch: ({key: stack}, {key: [index of each matrix in the stack]}). One tensor split along
    its first dimension is `received` itself, viewed; otherwise each piece is copied into its stack."""
    members = {}
    for i in owned:
        members.setdefault(batch(i), []).append(i)
    if len(owned) == 1 and splits[owned[0]].dim == 0:
        i = owned[0]
        return {batch(i): received.view(1, *splits[i].shape)}, members
    stacks = {key: received.new_empty((len(indices), *splits[indices[0]].shape)) for key, indices in members.items()}
    where = {i: (stacks[key], k) for key, indices in members.items() for k, i in enumerate(indices)}
    offset = 0
    for r in range(splits[owned[0]].world if owned else 0):
        for i in owned:
            split = splits[i]
            stack, k = where[i]
            n = math.prod(split.local_shape(r))
            stack[k].narrow(split.dim, split.offsets[r], split.sizes[r]).copy_(
                received[offset : offset + n].view(split.local_shape(r))
            )
            offset += n
    return stacks, members


def _reply(results, owned, splits, sizes, dtype, device):
    """What this rank sends back: every rank's rows of each result it owns (rank by rank, in `owned` order), in
    `dtype`. One result split along its first dimension and held whole in `dtype` is sent as it is."""
    if len(owned) == 1:
        result = results[owned[0]]
        if splits[owned[0]].dim == 0 and result.dtype == dtype and result.is_contiguous():
            return result.view(-1)
    reply = torch.empty(sum(sizes), dtype=dtype, device=device)
    offset = 0
    for r in range(len(sizes)):
        for i in owned:
            split = splits[i]
            n = math.prod(split.local_shape(r))
            reply[offset : offset + n].view(split.local_shape(r)).copy_(
                results[i].narrow(split.dim, split.offsets[r], split.sizes[r])
            )
            offset += n
    return reply


# ---------------------------------------------------------------------------------------------------
# The all-to-alls, asynchronous, and a timeline of them for the benchmark.

_events = None  # a list while timeline() records


@contextlib.contextmanager
def timeline():
    """Record the exchange's phases on this rank while the block runs: yields a list that fills with (phase,
    bucket, start, end), host times from time.perf_counter(). "to owners" and "back" are an all-to-all from its
    start until its result was needed, "waiting" the part of that the host spent blocked in it (the rest was
    hidden behind other work), "Newton-Schulz" an owner's computation (on a GPU: its launches, unless the device
    is synchronised around it)."""
    global _events
    kept, _events = _events, []
    try:
        yield _events
    finally:
        _events = kept


@contextlib.contextmanager
def _phase(name, number):
    start = time.perf_counter()
    try:
        yield
    finally:
        if _events is not None:
            _events.append((name, number, start, time.perf_counter()))


class _Transfer:
    """dist.all_to_all_single with uneven splits, started asynchronously: NCCL's on the device, gloo's on host
    tensors (gloo has no all-to-all for CUDA tensors, so those travel through the host). wait() returns what it
    received, on the sender's device; release() lets the buffer it sent go. The exchange releases it well after
    the wait, once other work has run: gloo's worker thread holds the buffer a moment longer than the wait, so
    a release at the wait would free it sooner or later by chance, and the step's peak with it."""

    def __init__(self, send, send_sizes, receive_sizes, group, name, number):
        import torch.distributed as dist

        self.device, self.name, self.number = send.device, name, number
        host = send.device.type != "cpu" and dist.get_backend(group) == "gloo"
        self.send = send.to("cpu") if host else send
        self.received = self.send.new_empty(sum(receive_sizes))
        self.start = time.perf_counter()
        self.work = dist.all_to_all_single(
            self.received, self.send, receive_sizes, send_sizes, group=group, async_op=True
        )

    def wait(self):
        waited = time.perf_counter()
        self.work.wait()
        done = time.perf_counter()
        if _events is not None:
            _events.append((self.name, self.number, self.start, done))
            _events.append(("waiting", self.number, waited, done))
        received = self.received.to(self.device)
        self.received = self.work = None
        return received

    def release(self):
        self.send = None
