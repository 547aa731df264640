"""MARS's fused=True step (mars.py's ``MARS(..., fused=True)``): every tensor of the optimizer in two Triton launches
per device and dtype, as torch keeps its fused kernels apart from torch/optim/adam.py.

mars.py imports this module only where fused=True is asked for or runs, so mars.py copied alone steps on every
other path; this module imports torch, and Triton inside its functions, never mars.py. What mars.py calls:

- ``check_available()``: ValueError where Triton cannot be imported (the constructor's check);
- ``check_device(device, dtype)``: RuntimeError unless the kernel runs on ``device`` (each step's check);
- ``step(parts, newton_schulz=..., is_dense=...) -> rest``: the step of the parts' tensors the kernel takes,
  step counts included; returns the parts of the others, for the path ``foreach`` says.

A part is mars.py's ``_Part``: one group's tensors that step alike as parallel lists (``params``, ``grads``,
``last_grads``, ``exp_avgs``, ``exp_avg_sqs``, ``max_exp_avg_sqs``, ``steps``, ``rules``; ``last_grads`` and
``rules`` None for the AdamW part), its ``numbers`` (lr, beta1, beta2, eps, weight_decay, gamma, eps_uncorrected)
and ``subset(indices)``. ``newton_schulz(params, momenta, lr, rule, *, beta1, eps, weight_decay)`` is mars.py's
batched Newton-Schulz, which takes the Newton-Schulz rules' tensors once the kernel has updated m; ``is_dense(t)``
is mars.py's test of a tensor filling its memory, which its own fused AdamW shares.
"""

import functools
import math

import torch

# Launch 1 (norm_pass) adds 1 to every step count and sums c_t² over each chunk of every MARS tensor, c_t formed
# from g and g_prev as it goes and never stored. Launch 2 (update_pass) adds up each tensor's chunk sums into
# ‖c_t‖ and, in one pass over memory, forms c̃_t again and updates m, v (v_max), p and g_prev ← g; the AdamW part
# takes AdamW on g in the same launch. Per element of float32 MARS-AdamW that reads g, g_prev, then g, g_prev, p,
# m, v and writes p, m, v, g_prev: 44 bytes, against AdamW's 28. Both launches walk a table on the device that
# lists every tensor's addresses, rule and hyperparameter row (_upload), so one compiled kernel serves any number
# of tensors, groups, shapes and settings: Triton compiles a variant per dtype combination and alignment
# (_kernel_constants), never per shape or number. A tensor is walked in memory order, so every tensor its rule
# touches must share the parameter's strides and fill its memory (_kernel_row); the others step on the path
# `foreach` says. Newton-Schulz rules take the elementwise part here (c̃_t, m, g_prev), then the multi-tensor
# path's batched Newton-Schulz.
#
# The table is built on the host at each step (gradients may be reallocated, lr follows the schedule) and
# copied to the device from pinned memory without waiting; a tensor lr is copied into it on the device. Nothing
# is read back. The kernels are defined on first use (_kernels), so that this module imports without Triton.

_CHUNK = 16384  # elements of one tensor a program handles: GPT-2 small's 124M parameters are ~7,600 programs
_BLOCK = 1024  # elements a program loads at once (4 warps of 32 threads, 8 float32 each)
# The table's rows. Per tensor (int64): the addresses of p, g, g_prev, m, v, v_max (0 where absent) and of its
# step count, its number of elements, its rule, its hyperparameter row, and the index and number of its chunk
# sums of c² in the first launch's output. Per part (float64): lr, β1, β2, eps, λ, k = γβ1/(1-β1), log2 β1,
# log2 β2 (the bias corrections are 1 - 2^(t log2 β)), and eps_uncorrected (1 or 0).
_TENSOR_FIELDS = 12
_NUMEL, _RULE = 7, 8  # the fields of a tensor row the host reads again (the kernels read every field by number)
_HYPER_FIELDS = 9
# The rule of a tensor row: 0 the AdamW part (AdamW on g); then the MARS rules on c̃_t: AdamW's, Lion's, and
# Newton-Schulz's (m and g_prev here, the rest after the kernel).
_KERNEL_RULES = {None: 0, "adamw": 1, "lion": 2, "newton-schulz": 3, "newton-schulz-rms": 3}
# The parameter dtypes the kernel takes, each with the dtype it reads m and v in (float32 for float16 parameters,
# as MARS keeps them) and the one it computes in (float64 for float64 parameters, float32 for the others, as torch).
_KERNEL_DTYPES = {
    torch.float32: (torch.float32, torch.float32),
    torch.bfloat16: (torch.bfloat16, torch.float32),
    torch.float16: (torch.float32, torch.float32),
    torch.float64: (torch.float64, torch.float64),
}
_FUSED_DEVICE_ERROR = "`fused=True` requires all the params to be floating point Tensors of supported devices"


def step(parts, *, newton_schulz, is_dense):
    """The step of the parts' tensors the kernel takes (all their tensors, usually), their step counts included;
    returns the parts of the others, for the path `foreach` says. newton_schulz, is_dense: the module docstring's."""
    rest, launches = [], {}  # (device, dtype, g_prev's dtype or None) -> {id(part): (part, [(index, row)])}
    for part in parts:
        left = []
        for i, p in enumerate(part.params):
            row = _kernel_row(part, i, is_dense)
            if row is None:
                left.append(i)
                continue
            key = (p.device, p.dtype, part.last_grads[i].dtype if part.rules else None)
            launches.setdefault(key, {}).setdefault(id(part), (part, []))[1].append((i, row))
        if left:
            rest.append(part.subset(left))
    # The AdamW parts join the MARS tensors of their device and dtype: a group steps in two launches.
    for key in [key for key in launches if key[2] is None]:
        host = next((other for other in launches if other[:2] == key[:2] and other[2] is not None), None)
        if host is not None:
            launches[host].update(launches.pop(key))
    for (device, dtype, last_grad_dtype), members in launches.items():
        _launch_kernels(device, dtype, last_grad_dtype or dtype, list(members.values()), newton_schulz)
    return rest


def _kernel_row(part, i, is_dense):
    """Tensor i's row of the table without its hyperparameter row and chunk sums (_TENSOR_FIELDS), or None where
    the kernel cannot take it: a parameter of another dtype, or whose gradient, moments (float32 for float16
    parameters) or g_prev have other dtypes than the kernel reads them in, or whose memory has gaps, or whose
    gradient and state do not share its strides; a step count not a float32 on its device."""
    p, g, step = part.params[i], part.grads[i], part.steps[i]
    if p.dtype not in _KERNEL_DTYPES or g.dtype != p.dtype or step.dtype != torch.float32 or step.device != p.device:
        return None
    g_prev = part.last_grads[i] if part.rules else None
    moments = (part.exp_avgs[i], part.exp_avg_sqs[i], part.max_exp_avg_sqs[i])
    moment_dtype, _ = _KERNEL_DTYPES[p.dtype]
    if any(m is not None and m.dtype != moment_dtype for m in moments):
        return None
    if g_prev is not None and g_prev.dtype not in _KERNEL_DTYPES:
        return None
    tensors = (p, g, g_prev, *moments)
    contiguous = p.is_contiguous()  # the common case, checked cheaply: this runs per tensor per step
    if not contiguous and not is_dense(p):
        return None
    row = []
    for t in tensors:
        if t is None:
            row.append(0)
        elif t.is_contiguous() if contiguous else t.stride() == p.stride():
            row.append(t.data_ptr())
        else:
            return None
    return row + [step.data_ptr(), p.numel(), _KERNEL_RULES[part.rules[i] if part.rules else None]]


def _launch_kernels(device, dtype, last_grad_dtype, members, newton_schulz):
    """The two launches over `members`, [(part, [(index, row)])] of one device and parameter dtype whose MARS
    tensors keep g_prev in last_grad_dtype; then newton_schulz for those rules."""
    rows, hypers, lr_tensors, newton_schulz_jobs = [], [], [], []
    for part, taken in members:
        numbers = part.numbers
        beta1, beta2 = numbers["beta1"], numbers["beta2"]
        lr = numbers["lr"]
        if torch.is_tensor(lr):
            lr = lr.to(device, non_blocking=True)  # copied into the table on the device: no host sync
            lr_tensors.append((len(hypers), lr))
        k = numbers["gamma"] * beta1 / (1 - beta1)
        hyper = len(hypers)
        hypers.append(
            [0.0 if torch.is_tensor(lr) else lr, beta1, beta2, numbers["eps"], numbers["weight_decay"], k]
            + [_log2(beta1), _log2(beta2), float(numbers["eps_uncorrected"])]
        )
        by_rule = {}
        for i, row in taken:
            rows.append(row + [hyper])
            if row[_RULE] == _KERNEL_RULES["newton-schulz"]:
                by_rule.setdefault(part.rules[i], []).append(i)
        newton_schulz_jobs += [(part, rule, picked, lr) for rule, picked in by_rule.items()]
    first_programs, second_programs, sums = _programs(tuple((row[_NUMEL], row[_RULE] != 0) for row in rows))
    for row, where in zip(rows, sums):
        row += where
    table, hyper_rows, first, second = _upload(rows, hypers, first_programs, second_programs, device)
    for index, lr in lr_tensors:
        hyper_rows[index * _HYPER_FIELDS].copy_(lr)
    _, compute_dtype = _KERNEL_DTYPES[dtype]
    sums = torch.empty(len(first) // 2, dtype=compute_dtype, device=device)
    norm_pass, update_pass = _kernels()
    constants = _kernel_constants(dtype, last_grad_dtype, rows)
    norm_pass[(len(first) // 2,)](table, hyper_rows, first, sums, **constants)
    if len(second):
        update_pass[(len(second) // 2,)](table, hyper_rows, second, sums, **constants)
    for part, rule, picked, lr in newton_schulz_jobs:
        numbers = {k: part.numbers[k] for k in ("beta1", "eps", "weight_decay")}
        newton_schulz([part.params[i] for i in picked], [part.exp_avgs[i] for i in picked], lr, rule, **numbers)


def _log2(beta):
    return math.log2(beta) if beta > 0 else -math.inf


@functools.lru_cache(maxsize=256)
def _programs(layout):
    """Each launch's programs as flat (tensor, first element) pairs, for `layout` = ((numel, is MARS), ...) per
    tensor, and per tensor the index and number of its chunk sums: the first launch has a program per chunk of
    each MARS tensor and one per other tensor (its step count), the second a program per chunk of every tensor.
    Cached: a training run steps one layout."""
    first, second, sums = [], [], []
    for tensor, (numel, is_mars) in enumerate(layout):
        starts = range(0, numel, _CHUNK)
        own = starts if is_mars and numel else range(1)
        sums.append((len(first) // 2, len(own) if is_mars else 0))
        first += [x for start in own for x in (tensor, start)]
        second += [x for start in starts for x in (tensor, start)]
    return torch.tensor(first, dtype=torch.int64), torch.tensor(second, dtype=torch.int64), tuple(sums)


def _upload(rows, hypers, first_programs, second_programs, device):
    """The table on `device`, one copy from pinned memory that nothing waits for, as four views: the tensor rows,
    the hyperparameter rows (float64), and each launch's programs. Every view starts on 16 bytes, as Triton
    compiles pointer arguments for (an unaligned one would compile another variant)."""
    sections = [
        torch.tensor(rows, dtype=torch.int64).view(-1),
        torch.tensor(hypers, dtype=torch.float64).view(-1).view(torch.int64),
        first_programs,
        second_programs,
    ]
    sizes = [len(section) + len(section) % 2 for section in sections]
    host = torch.zeros(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for section, offset in zip(sections, offsets):
        host[offset : offset + len(section)] = section
    table = host.to(device, non_blocking=True)
    views = [table[offset : offset + len(section)] for section, offset in zip(sections, offsets)]
    views[1] = views[1].view(torch.float64)
    return views


def _kernel_constants(dtype, last_grad_dtype, rows):
    """The compile-time constants of both launches: the dtypes of p and g, of m and v, of g_prev, and of the
    arithmetic; the sizes; and whether every address and size is a multiple of 16 bytes and 16 elements, which
    lets the kernel move 16 bytes per load and store."""
    import triton.language as tl

    names = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    names[torch.float64] = tl.float64
    moments, compute = _KERNEL_DTYPES[dtype]
    bits = 0  # the data addresses (fields 0-5) and sizes OR-ed: a multiple of 16 where every one is
    for row in rows:
        bits |= row[0] | row[1] | row[2] | row[3] | row[4] | row[5] | row[_NUMEL]
    return dict(
        P=names[dtype], M=names[moments], L=names[last_grad_dtype], C=names[compute],
        CHUNK=_CHUNK, BLOCK=_BLOCK, ALIGNED=bits % 16 == 0,
    )  # fmt: skip


def check_device(device, dtype):
    """RuntimeError unless the kernel runs on `device`: CUDA (ROCm's GPUs too, as torch names them; untested there),
    or CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, as the tests run it). Checked at each step before
    the state is touched, as torch's fused optimizers check: the parameters may be built on the meta device and
    moved before the first step."""
    if device.type == "cuda" or (device.type == "cpu" and _kernels_interpreted()):
        return
    raise RuntimeError(
        f"{_FUSED_DEVICE_ERROR} (MARS's fused step is a Triton kernel, which runs on CUDA tensors), but got {dtype} "
        f"and {device.type}: construct MARS with fused=None for these parameters (the default path), or set "
        "TRITON_INTERPRET=1 before the first step to run the kernel in Triton's interpreter on CPU tensors (slow: "
        "for tests)"
    )


def check_available():
    """ValueError for fused=True where Triton cannot be imported: the kernel cannot run."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        raise ValueError(
            f"fused=True runs MARS's step as a Triton kernel, and Triton cannot be imported here ({error}); it comes "
            "with torch's CUDA builds on Linux (or: pip install triton). Without it, use fused=None (the default path)"
        ) from None


def _kernels_interpreted():
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when they were built)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernels()[0], InterpretedFunction)


@functools.cache
def _kernels():
    """(norm_pass, update_pass), compiled by Triton on first launch; run by its interpreter where
    TRITON_INTERPRET=1 was set when they were first needed. Row and field numbers are _TENSOR_FIELDS' and
    _HYPER_FIELDS' (the interpreter resolves no names but Triton's inside a kernel)."""
    import triton
    import triton.language as tl

    @triton.jit
    def norm_pass(table, hyper, programs, sums, P: tl.constexpr, M: tl.constexpr, L: tl.constexpr,
                  C: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
        # Program i: its tensor's step count += 1 (the chunk at 0), and Σ c² over its chunk into sums[i].
        program = tl.program_id(0)
        tensor = tl.load(programs + 2 * program)
        start = tl.load(programs + 2 * program + 1)
        row = table + 12 * tensor
        if start == 0:
            step = tl.load(row + 6).to(tl.pointer_type(tl.float32))
            tl.store(step, tl.load(step) + 1)
        if tl.load(row + 8) != 0:
            numel = tl.load(row + 7)
            g_ptr = tl.load(row + 1).to(tl.pointer_type(P))
            g_prev_ptr = tl.load(row + 2).to(tl.pointer_type(L))
            if ALIGNED:
                numel, start = tl.multiple_of(numel, 16), tl.multiple_of(start, CHUNK)
                g_ptr, g_prev_ptr = tl.multiple_of(g_ptr, 16), tl.multiple_of(g_prev_ptr, 16)
            end = tl.minimum(start + CHUNK, numel)
            k = tl.load(hyper + 9 * tl.load(row + 9) + 5).to(C)
            total = tl.zeros([BLOCK], dtype=C)
            for offset in range(start, end, BLOCK):
                index = offset + tl.arange(0, BLOCK)
                inside = index < end
                g = tl.load(g_ptr + index, mask=inside, other=0).to(C)
                g_prev = tl.load(g_prev_ptr + index, mask=inside, other=0).to(C)
                c = g + k * (g - g_prev)  # c_t, as _mars_tensor_step forms it
                total += c * c
            tl.store(sums + program, tl.sum(total, axis=0))

    @triton.jit
    def update_pass(table, hyper, programs, sums, P: tl.constexpr, M: tl.constexpr, L: tl.constexpr,
                    C: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
        # Program i: the rule of its tensor on its chunk, as _mars_tensor_step and _adamw_tensor_step compute it.
        # The scalars in float64 (a few per program), the elements in C; divisions and square roots rounded as
        # torch rounds them (Triton's plain float32 ones are approximate).
        program = tl.program_id(0)
        tensor = tl.load(programs + 2 * program)
        start = tl.load(programs + 2 * program + 1)
        row = table + 12 * tensor
        numel = tl.load(row + 7)
        rule = tl.load(row + 8)
        numbers = hyper + 9 * tl.load(row + 9)
        lr = tl.load(numbers)
        beta1 = tl.load(numbers + 1)
        beta2 = tl.load(numbers + 2)
        eps = tl.load(numbers + 3).to(C)
        weight_decay = tl.load(numbers + 4)
        k = tl.load(numbers + 5).to(C)
        t = tl.load(tl.load(row + 6).to(tl.pointer_type(tl.float32))).to(tl.float64)
        step_size = (lr / (1 - tl.exp2(t * tl.load(numbers + 6)))).to(C)  # lr / (1 - β1^t)
        bias_correction2_rsqrt = (1 / tl.sqrt(1 - tl.exp2(t * tl.load(numbers + 7)))).to(C)
        eps_uncorrected = tl.load(numbers + 8) != 0
        lr_decay = (lr * weight_decay).to(C)
        weight = (1 - beta1).to(C)  # of c̃ (g) in m's lerp
        p_ptr = tl.load(row).to(tl.pointer_type(P))
        g_ptr = tl.load(row + 1).to(tl.pointer_type(P))
        g_prev_ptr = tl.load(row + 2).to(tl.pointer_type(L))
        m_ptr = tl.load(row + 3).to(tl.pointer_type(M))
        v_ptr = tl.load(row + 4).to(tl.pointer_type(M))
        v_max_ptr = tl.load(row + 5).to(tl.pointer_type(M))
        amsgrad = tl.load(row + 5) != 0
        if ALIGNED:
            numel, start = tl.multiple_of(numel, 16), tl.multiple_of(start, CHUNK)
            p_ptr, g_ptr = tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16)
            g_prev_ptr, m_ptr = tl.multiple_of(g_prev_ptr, 16), tl.multiple_of(m_ptr, 16)
            v_ptr, v_max_ptr = tl.multiple_of(v_ptr, 16), tl.multiple_of(v_max_ptr, 16)
        end = tl.minimum(start + CHUNK, numel)
        clip = tl.full([], 1.0, C)  # max(1, ‖c_t‖) of a MARS tensor, from its chunk sums
        if rule != 0:
            first = tl.load(row + 10)
            count = tl.load(row + 11)
            squares = tl.zeros([BLOCK], dtype=C)
            for j in range(0, count, BLOCK):
                index = j + tl.arange(0, BLOCK)
                squares += tl.load(sums + first + index, mask=index < count, other=0)
            if C == tl.float64:
                clip = tl.maximum(tl.sqrt(tl.sum(squares, axis=0)), 1.0)
            else:
                clip = tl.maximum(tl.sqrt_rn(tl.sum(squares, axis=0)), 1.0)
        for offset in range(start, end, BLOCK):
            index = offset + tl.arange(0, BLOCK)
            inside = index < end
            g = tl.load(g_ptr + index, mask=inside, other=0).to(C)
            x = g  # AdamW's input: g, or c̃_t for a MARS rule
            if rule != 0:
                g_prev = tl.load(g_prev_ptr + index, mask=inside, other=0).to(C)
                c = g + k * (g - g_prev)
                x = c / clip if C == tl.float64 else tl.div_rn(c, clip)
                if C == tl.float64 and L != tl.float64:  # through float32, as torch casts float64 to the half types
                    tl.store(g_prev_ptr + index, g.to(tl.float32).to(L), mask=inside)
                else:
                    tl.store(g_prev_ptr + index, g.to(L), mask=inside)
            m = tl.load(m_ptr + index, mask=inside, other=0).to(C)
            if weight < 0.5:  # torch.lerp's two formulas
                m = m + weight * (x - m)
            else:
                m = x - (x - m) * (1 - weight)
            tl.store(m_ptr + index, m.to(M), mask=inside)
            if rule == 2:  # Lion: p ← p - lr (sign(m) + λ p); sign keeps 0 and NaN
                p = tl.load(p_ptr + index, mask=inside, other=0).to(C)
                sign = tl.where(m > 0, 1.0, tl.where(m < 0, -1.0, m))
                p = p - lr.to(C) * (sign + weight_decay.to(C) * p)
                tl.store(p_ptr + index, p.to(P), mask=inside)
            elif rule != 3:  # AdamW: v, v_max, then p ← p - (lr λ p + step_size m / denom)
                v = tl.load(v_ptr + index, mask=inside, other=0).to(C)
                v = v * beta2.to(C) + (1 - beta2).to(C) * x * x
                tl.store(v_ptr + index, v.to(M), mask=inside)
                if amsgrad:
                    v = tl.maximum(tl.load(v_max_ptr + index, mask=inside, other=0).to(C), v)
                    tl.store(v_max_ptr + index, v.to(M), mask=inside)
                root = tl.sqrt(v) if C == tl.float64 else tl.sqrt_rn(v)
                if eps_uncorrected:
                    denominator = (root + eps) * bias_correction2_rsqrt
                else:
                    denominator = root * bias_correction2_rsqrt + eps
                p = tl.load(p_ptr + index, mask=inside, other=0).to(C)
                u = step_size * m
                u = u / denominator if C == tl.float64 else tl.div_rn(u, denominator)
                p = p - (lr_decay * p + u)
                tl.store(p_ptr + index, p.to(P), mask=inside)

    return norm_pass, update_pass
