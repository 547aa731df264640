"""MARS: Make vAriance Reduction Shine (Yuan et al. 2024, arXiv:2411.10438) as a torch optimizer.

Self-contained: imports nothing from this repository, so the file can be copied into any project.

    from mars import MARS
    optimizer = MARS(model.parameters(), lr=6e-3, betas=(0.95, 0.99), weight_decay=0.1)

The class owns parameter groups, state and dispatch; the update rule lives in two functional kernels
beside each other: ``_single_tensor_mars`` (the readable reference, ``foreach=False``) and
``_multi_tensor_mars`` (the default, ``torch._foreach_*`` ops per device and dtype; on CPU the AdamW part
of the rule runs in torch's fused AdamW kernel). Tests hold the paths equal and hold each to a float64
transcription of the rule.
"""

import math

import torch

MARS_TYPES = ("mars-adamw", "mars-lion", "mars-shampoo")
# Which tensors take the MARS rule when optimize_1d=False: "2d" exactly the 2-D ones (the paper's code;
# convolution kernels and other N-D tensors get the AdamW rule), "nd" every tensor with 2 or more dims.
ROUTINGS = ("2d", "nd")

# Quintic Newton-Schulz coefficients (a, b, c) of the paper's MARS-Shampoo (the same as Muon's).
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G, steps=5, eps=1e-7, dtype=None):
    """Approximate the orthogonal factor U Vᵀ of a 2-D matrix G = U S Vᵀ.

    G is cast to `dtype` and divided by (its Frobenius norm + eps), so every singular value starts in
    [0, 1]; then `steps` quintic iterations X ← aX + b(XXᵀ)X + c(XXᵀ)²X push the singular values into
    roughly [0.7, 1.2]. The iteration runs on the wide orientation (Gᵀ when rows > cols) so XXᵀ is the
    smaller Gram matrix. Returns G's dtype.

    dtype=None means bfloat16 on CUDA, as the paper's code, and float32 elsewhere: CPUs without native
    bfloat16 matmuls run them several times slower than float32 (here 1.35 s vs 0.22 s for a
    768x2304 Gram matrix), which made a CPU MARS-Shampoo step take minutes.
    """
    if G.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D tensor, got shape {tuple(G.shape)}")
    if dtype is None:
        dtype = torch.bfloat16 if G.is_cuda else torch.float32
    a, b, c = _NS_COEFFS
    X = G.to(dtype) / (G.norm() + eps)
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        B = A @ X
        X = a * X + b * B + c * (A @ B)
    if tall:
        X = X.T
    return X.to(G.dtype)


class MARS(torch.optim.Optimizer):
    r"""MARS (Algorithm 1 of arXiv:2411.10438) with the AdamW, Lion and Shampoo instances.

    For a parameter tensor x with gradient g_t at step t (from 1) and the group's current lr η_t:

    Tensors MARS handles (2-D ones -- with ``routing="nd"`` every tensor with ndim >= 2 -- or every tensor
    when ``optimize_1d=True``):

    .. math::
        c_t &= g_t + \gamma \tfrac{\beta_1}{1-\beta_1} (g_t - g_{t-1}) \qquad (c_1 = g_1) \\
        \tilde c_t &= c_t / \max(1, \lVert c_t \rVert_F) \\
        m_t &= \beta_1 m_{t-1} + (1-\beta_1) \tilde c_t \\
        \text{mars-adamw:}\; v_t &= \beta_2 v_{t-1} + (1-\beta_2) \tilde c_t^2, \quad
            u_t = \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}
            \quad (\text{amsgrad: } \max_{s \le t} v_s \text{ in place of } v_t) \\
        \text{mars-lion:}\; u_t &= \operatorname{sign}(m_t) \\
        \text{mars-shampoo (2-D):}\; u_t &= \mathrm{NS}\big(m_t / (1-\beta_1)\big)
            \sqrt{\max(1, \text{rows}/\text{cols})} \quad (\text{other tensors: the mars-adamw } u_t) \\
        x &\leftarrow x - \eta_t (u_t + \lambda x)

    Other tensors (with ``optimize_1d=False``): AdamW on the raw gradient with ``betas_1d``,
    ``eps``, weight decay ``weight_decay_1d`` and lr η_t · lr_1d / lr, where lr and lr_1d are the group's
    values at construction (kept in the group as ``lr_1d_factor``), so lr_1d follows the schedule's shape.
    ``amsgrad`` applies to these tensors too, as in the paper's code.

    g_{t-1} is the previous step's gradient (approximate MARS, ``is_approx=True``), or ∇f(x_{t-1}, ξ_t)
    supplied by the loop (exact MARS): after a backward pass on the NEXT batch at the current parameters
    call :meth:`update_previous_grad`, then backward on the current batch, :meth:`step`, and
    :meth:`update_last_grad`.

    Difference from the paper's reference code: there ``last_grad`` starts at zero, so its first step
    uses c_1 = (1 + γβ1/(1-β1)) g_1. Here the correction is zero at t = 1 (c_1 = g_1), as Algorithm 1's
    x_0 = x_1 implies. Once ‖c_1‖ > 1 the clip makes the two identical.

    State per tensor: 'step' (a Python int, so bias corrections need no device sync), 'exp_avg' (m),
    'exp_avg_sq' (v, where the rule uses it), 'last_grad' (g_{t-1}, the optimizer's own copy, never an
    alias of .grad; MARS-handled tensors only), 'max_exp_avg_sq' (amsgrad) and, in exact mode,
    'previous_grad'. A step skipped by torch.amp.GradScaler (inf/nan gradients) never reaches step(), so
    it changes no state.

    Args:
        params: iterable of parameters or of dicts defining parameter groups; every hyperparameter below
            (except foreach's default) may be overridden per group.
        lr: learning rate η of MARS-handled tensors (default 3e-3).
        betas: (β1, β2) for m and v (default (0.95, 0.99)).
        eps: added to the AdamW denominator; also Newton-Schulz's normaliser (default 1e-8).
        weight_decay: decoupled weight decay λ of MARS-handled tensors (default 0).
        amsgrad: use the running maximum of v in the denominator (default False).
        gamma: γ, the strength of the variance-reduction correction (default 0.025).
        is_approx: True uses the previous step's gradient as g_{t-1}; False expects the exact protocol.
        mars_type: "mars-adamw", "mars-lion" or "mars-shampoo".
        optimize_1d: apply MARS to every tensor (default False: only those `routing` names; the rest AdamW).
        routing: "2d" (default, as the paper's code): exactly the 2-D tensors take MARS, so a convolution's
            4-D kernel gets AdamW; "nd": every tensor with 2 or more dimensions takes MARS.
        lr_1d: AdamW lr of the other tensors at construction (default 3e-3).
        betas_1d: AdamW betas of the other tensors (default (0.9, 0.95)).
        weight_decay_1d: AdamW weight decay of the other tensors (default 0.1).
        foreach: None or True use the multi-tensor path; False the single-tensor reference.
    """

    def __init__(
        self,
        params,
        lr=3e-3,
        betas=(0.95, 0.99),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        gamma=0.025,
        is_approx=True,
        mars_type="mars-adamw",
        optimize_1d=False,
        routing="2d",
        lr_1d=3e-3,
        betas_1d=(0.9, 0.95),
        weight_decay_1d=0.1,
        foreach=None,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            gamma=gamma,
            is_approx=is_approx,
            mars_type=mars_type,
            optimize_1d=optimize_1d,
            routing=routing,
            lr_1d=lr_1d,
            betas_1d=betas_1d,
            weight_decay_1d=weight_decay_1d,
            foreach=foreach,
        )
        _validate(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate(group)
        if "lr_1d_factor" not in group:
            if group["lr"] == 0 and not group["optimize_1d"]:
                raise ValueError(
                    "lr=0 with optimize_1d=False leaves the 1-D learning rate lr*lr_1d/lr "
                    "undefined; construct with the peak lr (a schedule may start at 0)"
                )
            # Fixed at construction: a schedule changes group['lr'] and the 1-D lr follows its shape.
            group["lr_1d_factor"] = group["lr_1d"] / group["lr"] if group["lr"] else 1.0

    @staticmethod
    def _is_mars_tensor(p, group):
        return group["optimize_1d"] or p.ndim == 2 or (group["routing"] == "nd" and p.ndim > 2)

    @torch.no_grad()
    def update_previous_grad(self):
        """Exact MARS: keep ∇f(x_t, ξ_{t+1}) -- call after a backward pass on the NEXT batch."""
        for group in self.param_groups:
            if group["is_approx"]:
                continue
            for p in group["params"]:
                if p.grad is None or not self._is_mars_tensor(p, group):
                    continue
                _check_dense(p.grad)
                state = self.state[p]
                if "previous_grad" in state:
                    state["previous_grad"].copy_(p.grad)
                else:
                    state["previous_grad"] = p.grad.detach().clone(memory_format=torch.preserve_format)

    @torch.no_grad()
    def update_last_grad(self):
        """Exact MARS: after step(), make the stored gradient the g_{t-1} of the next step."""
        for group in self.param_groups:
            if group["is_approx"]:
                continue
            for p in group["params"]:
                state = self.state[p]
                if "previous_grad" not in state:
                    continue
                if "last_grad" in state:
                    state["last_grad"].copy_(state["previous_grad"])
                else:
                    state["last_grad"] = state["previous_grad"].clone()

    def _init_state(self, p, group):
        """Allocate what the rule needs for p (state dtype and device follow p)."""
        state = self.state[p]
        if "step" in state:
            return state
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        is_mars = self._is_mars_tensor(p, group)
        uses_v = not is_mars or _uses_second_moment(p, group["mars_type"])
        if uses_v:
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if is_mars and "last_grad" not in state:
            # No previous gradient at t = 1: g_0 := g_1 makes the correction zero (c_1 = g_1).
            state["last_grad"] = p.grad.detach().clone(memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One MARS step; returns closure()'s loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            mars, adamw = _TensorLists(), _TensorLists()
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_dense(p.grad)
                state = self._init_state(p, group)
                state["step"] += 1
                (mars if self._is_mars_tensor(p, group) else adamw).append(p, state)
            foreach = group["foreach"] is None or group["foreach"]
            kernel_mars = _multi_tensor_mars if foreach else _single_tensor_mars
            kernel_adamw = _multi_tensor_adamw if foreach else _single_tensor_adamw
            if mars.params:
                kernel_mars(
                    mars,
                    lr=group["lr"],
                    betas=group["betas"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    amsgrad=group["amsgrad"],
                    gamma=group["gamma"],
                    is_approx=group["is_approx"],
                    mars_type=group["mars_type"],
                )
            if adamw.params:
                kernel_adamw(
                    adamw,
                    lr=group["lr"] * group["lr_1d_factor"],
                    betas=group["betas_1d"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay_1d"],
                    amsgrad=group["amsgrad"],
                )
        return loss


def _validate(hp):
    for name in ("lr", "lr_1d", "eps", "weight_decay", "weight_decay_1d", "gamma"):
        value = hp[name]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0.0:
            raise ValueError(f"invalid {name}: {value!r} (must be a number >= 0)")
    for name in ("betas", "betas_1d"):
        betas = hp[name]
        if (
            not isinstance(betas, (tuple, list))
            or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)
        ):
            raise ValueError(f"invalid {name}: {betas!r} (must be two numbers in [0, 1))")
    if hp["mars_type"] not in MARS_TYPES:
        raise ValueError(f"invalid mars_type: {hp['mars_type']!r} (allowed: {', '.join(MARS_TYPES)})")
    if hp["routing"] not in ROUTINGS:
        raise ValueError(f"invalid routing: {hp['routing']!r} (allowed: {', '.join(ROUTINGS)})")
    if hp["foreach"] not in (None, True, False):
        raise ValueError(f"invalid foreach: {hp['foreach']!r} (must be None, True or False)")


def _check_dense(grad):
    if grad.is_sparse:
        raise RuntimeError(
            "MARS does not support sparse gradients (e.g. nn.Embedding(sparse=True)); use dense gradients"
        )


def _uses_second_moment(p, mars_type):
    """mars-adamw everywhere, and mars-shampoo on the tensors Newton-Schulz cannot take, keep v."""
    return mars_type == "mars-adamw" or (mars_type == "mars-shampoo" and p.ndim != 2)


class _TensorLists:
    """One group's (parameter, state) pairs, with the parallel lists the kernels consume."""

    def __init__(self, entries=None):
        self.entries = entries if entries is not None else []

    def append(self, p, state):
        self.entries.append((p, state))

    @property
    def params(self):
        return [p for p, _ in self.entries]

    @property
    def grads(self):
        return [p.grad for p, _ in self.entries]

    @property
    def steps(self):
        return [s["step"] for _, s in self.entries]

    def get(self, key):
        return [s[key] for _, s in self.entries]

    def by_device_and_dtype(self):
        buckets = {}
        for p, s in self.entries:
            buckets.setdefault((p.device, p.dtype), _TensorLists()).append(p, s)
        return buckets.values()


# ---------------------------------------------------------------------------------------------------
# Single-tensor reference: the rule of the class docstring, line by line.


def _single_tensor_mars(tl, *, lr, betas, eps, weight_decay, amsgrad, gamma, is_approx, mars_type):
    beta1, beta2 = betas
    k = gamma * beta1 / (1 - beta1)
    for p, state in tl.entries:
        g, t = p.grad, state["step"]
        m, g_prev = state["exp_avg"], state["last_grad"]
        c = torch.lerp(g_prev, g, 1 + k)  # g + k (g - g_prev), as foreach
        c = c / c.norm().clamp_min(1.0)  # clip to Frobenius norm <= 1
        m.lerp_(c, 1 - beta1)  # m = β1 m + (1 - β1) c
        if mars_type == "mars-lion":
            u = m.sign()
        elif mars_type == "mars-shampoo" and p.ndim == 2:
            u = newton_schulz(m / (1 - beta1), eps=eps) * math.sqrt(max(1.0, p.size(0) / p.size(1)))
        else:
            u = _adam_direction(state, c, beta2, t, eps, amsgrad) / (1 - beta1**t)
        p.sub_(lr * (u + weight_decay * p))
        if is_approx:
            g_prev.copy_(g)


def _single_tensor_adamw(tl, *, lr, betas, eps, weight_decay, amsgrad):
    beta1, beta2 = betas
    for p, state in tl.entries:
        g, t = p.grad, state["step"]
        state["exp_avg"].lerp_(g, 1 - beta1)
        u = _adam_direction(state, g, beta2, t, eps, amsgrad) / (1 - beta1**t)
        p.sub_(lr * (u + weight_decay * p))


def _adam_direction(state, x, beta2, t, eps, amsgrad):
    """Update v with x² and return m / (sqrt(v / (1 - β2^t)) + eps)."""
    v = state["exp_avg_sq"]
    v.mul_(beta2).addcmul_(x, x, value=1 - beta2)
    if amsgrad:
        v = torch.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
    return state["exp_avg"] / ((v / (1 - beta2**t)).sqrt() + eps)


# ---------------------------------------------------------------------------------------------------
# Multi-tensor path: the same rule with torch._foreach_* ops, one call per op per (device, dtype).
# Every per-tensor scalar (bias corrections) is a Python float from the Python-int step, and the clip
# divides by max(norm, 1) kept on the device, so nothing here waits on the device.


def _multi_tensor_mars(tl, *, lr, betas, eps, weight_decay, amsgrad, gamma, is_approx, mars_type):
    beta1, beta2 = betas
    k = gamma * beta1 / (1 - beta1)
    for b in tl.by_device_and_dtype():
        grads, last_grads = b.grads, b.get("last_grad")
        if is_approx:
            # g_prev is replaced by g at the end of the step, so its buffer holds c meanwhile: the
            # step's one gradient-sized buffer, and no allocation.
            c = last_grads
            torch._foreach_lerp_(c, grads, 1 + k)  # g + k (g - g_prev)
        else:
            # Exact MARS: g_prev belongs to the loop's protocol (update_last_grad); c gets its own buffer.
            c = torch._foreach_lerp(last_grads, grads, 1 + k)
        norms = torch._foreach_norm(c)
        torch._foreach_clamp_min_(norms, 1.0)
        torch._foreach_div_(c, norms)  # clip to Frobenius norm <= 1

        if mars_type == "mars-lion":
            torch._foreach_lerp_(b.get("exp_avg"), c, 1 - beta1)
            torch._foreach_copy_(c, b.get("exp_avg"))
            torch._foreach_sign_(c)
            if weight_decay != 0:
                torch._foreach_mul_(b.params, 1 - lr * weight_decay)
            torch._foreach_add_(b.params, c, alpha=-lr)
        else:
            # mars-shampoo's 2-D tensors take Newton-Schulz; every other tensor the AdamW rule on c̃.
            is_ns = [mars_type == "mars-shampoo" and p.ndim == 2 for p in b.params]
            for (p, state), c_i, ns in zip(b.entries, c, is_ns):
                if ns:
                    m = state["exp_avg"].lerp_(c_i, 1 - beta1)
                    u = newton_schulz(m / (1 - beta1), eps=eps)
                    if weight_decay != 0:
                        p.mul_(1 - lr * weight_decay)
                    p.add_(u, alpha=-lr * math.sqrt(max(1.0, p.size(0) / p.size(1))))
            if not all(is_ns):
                adam = _TensorLists([e for e, ns in zip(b.entries, is_ns) if not ns])
                c_adam = [c_i for c_i, ns in zip(c, is_ns) if not ns]
                _foreach_adam(
                    adam,
                    c_adam,
                    c_adam,
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    eps=eps,
                    weight_decay=weight_decay,
                    amsgrad=amsgrad,
                )
        if is_approx:
            torch._foreach_copy_(last_grads, grads)


def _multi_tensor_adamw(tl, *, lr, betas, eps, weight_decay, amsgrad):
    beta1, beta2 = betas
    for b in tl.by_device_and_dtype():
        _foreach_adam(
            b, b.grads, None, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad
        )


# Devices where torch's fused AdamW kernel runs on the tensors MARS gives it: one pass over p, m, v and
# the input instead of eight foreach passes. On CUDA the kernel wants its step counts as device tensors,
# and building those from the Python-int steps would sync with the host, so CUDA takes the foreach ops.
_FUSED_ADAM_DEVICES = ("cpu",)


def _foreach_adam(b, x, scratch, *, lr, beta1, beta2, eps, weight_decay, amsgrad):
    """AdamW on input x for the params of b: the mars-adamw rule with x = c̃, or plain AdamW with x = g.

    The update x_p ← x_p(1 - lr λ) - lr·m̂/(sqrt(v̂) + eps) is exactly torch.optim.AdamW's, which is why
    its fused kernel can take it where one exists.

    scratch receives the denominator (it may be x itself: x is dead once v is updated); None allocates
    it. m̂ / (sqrt(v̂) + eps) is computed as m·s/(1-β1^t) / (sqrt(v) + eps·s) with s = sqrt(1-β2^t),
    which saves a pass over the denominator.
    """
    params, m, v = b.params, b.get("exp_avg"), b.get("exp_avg_sq")
    v_max = b.get("max_exp_avg_sq") if amsgrad else []
    if params[0].device.type in _FUSED_ADAM_DEVICES:
        steps = [torch.tensor(float(t)) for t in b.steps]
        torch._fused_adamw_(
            params,
            x,
            m,
            v,
            v_max,
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=amsgrad,
            maximize=False,
        )
        return
    torch._foreach_lerp_(m, x, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, x, x, value=1 - beta2)
    if amsgrad:
        torch._foreach_maximum_(v_max, v)
        v = v_max
    if scratch is None:
        denom = torch._foreach_sqrt(v)
    else:
        denom = scratch
        torch._foreach_copy_(denom, v)
        torch._foreach_sqrt_(denom)
    s = [math.sqrt(1 - beta2**t) for t in b.steps]
    torch._foreach_add_(denom, [eps * si for si in s])
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_addcdiv_(params, m, denom, [-lr * si / (1 - beta1**t) for si, t in zip(s, b.steps)])
