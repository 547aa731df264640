"""MARS: Make vAriance Reduction Shine (Yuan et al. 2024, arXiv:2411.10438) as a torch optimizer, with the
authors' matrix-level instance MARS-M (Liu et al. 2025, arXiv:2510.21800).

Self-contained: imports nothing from this repository, so the file can be copied into any project.

    from mars import MARS
    optimizer = MARS(model.parameters(), lr=6e-3, betas=(0.95, 0.99), weight_decay=0.1)

The class owns parameter groups, state and dispatch; the update rule lives in functional kernels:

- ``_mars_tensor_step`` / ``_adamw_tensor_step``: the readable single-tensor reference (``foreach=False``).
- ``_multi_tensor_mars`` / ``_multi_tensor_adamw`` (the default): ``torch._foreach_*`` ops per device and
  dtype; the AdamW part of the rule runs in torch's fused AdamW kernel wherever every tensor's layout
  allows it, and Newton-Schulz is batched over matrices of the same shape.
- ``fused=True``: ``_fused_mars_tensor_step`` (the reference step as the compiler takes it best) compiled by
  torch.compile (inductor: C++ loops on CPU, Triton kernels on CUDA) into one reduction and one elementwise
  pass per tensor, for the AdamW and Lion rules; Newton-Schulz and the AdamW-rule tensors as in the
  multi-tensor path. Not train.py's default: which path is faster on a GPU is for scripts/gpu_check.sh's
  optimizer row to say (docs/gpu.md).

Tests hold every path equal to the reference and the reference to a float64 transcription of the rule.
"""

import functools
import math

import torch

MARS_TYPES = ("mars-adamw", "mars-lion", "mars-shampoo", "mars-m")
# Which tensors take the MARS rule when optimize_1d=False: "2d" exactly the 2-D ones (the paper's code;
# convolution kernels and other N-D tensors get the AdamW rule), "nd" every tensor with 2 or more dims,
# "none" no tensor (a group of embeddings and head that trains with the AdamW part, as MARS-M's code does).
ROUTINGS = ("2d", "nd", "none")
# The rules whose direction is Newton-Schulz of m: mars-shampoo's and mars-m's (_orthogonal_direction).
_NEWTON_SCHULZ_RULES = ("newton-schulz", "newton-schulz-rms")

# Quintic Newton-Schulz coefficients (a, b, c) of the paper's MARS-Shampoo (the same as Muon's).
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G, steps=5, eps=1e-7, dtype=None):
    """Approximate the orthogonal factor U Vᵀ of each matrix G = U S Vᵀ in G's last two dimensions.

    Each matrix is cast to `dtype` and divided by (its Frobenius norm + eps), so every singular value
    starts in [0, 1]; then `steps` quintic iterations X ← aX + b(XXᵀ)X + c(XXᵀ)²X push the singular values
    into roughly [0.7, 1.2]. The iteration runs on the wide orientation (Xᵀ when rows > cols) so XXᵀ is the
    smaller Gram matrix. Leading dimensions are a batch: a stack of same-shape matrices takes one batched
    matmul per product instead of one matmul per matrix. Returns G's dtype.

    dtype=None means bfloat16 on CUDA, as the paper's code, and elsewhere float32 (float64 for float64
    matrices): CPUs without native bfloat16 matmuls run them several times slower than float32 (here 1.35 s
    vs 0.22 s for a 768x2304 Gram matrix), which made a CPU MARS-Shampoo step take minutes.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs matrices (ndim >= 2), got shape {tuple(G.shape)}")
    if dtype is None:
        dtype = torch.bfloat16 if G.is_cuda else torch.promote_types(G.dtype, torch.float32)
    a, b, c = _NS_COEFFS
    norms = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True)
    X = (G.to(dtype) / (norms + eps)).to(dtype)  # as the paper's code: cast, then divide by G's norm
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT
        B = A @ X
        X = a * X + b * B + c * (A @ B)
    if tall:
        X = X.mT
    return X.to(G.dtype)


class MARS(torch.optim.Optimizer):
    r"""MARS (Algorithm 1 of arXiv:2411.10438) with the AdamW, Lion and Shampoo instances, and MARS-M.

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
        \text{mars-m (2-D):}\; u_t &= 0.2 \sqrt{\max(\text{rows}, \text{cols})}\; \mathrm{NS}(m_t)
            \quad (\text{other tensors: the mars-adamw } u_t) \\
        x &\leftarrow x - \eta_t (u_t + \lambda x)

    Other tensors (with ``optimize_1d=False``): AdamW on the raw gradient with ``betas_1d``,
    ``eps``, weight decay ``weight_decay_1d`` and lr η_t · lr_1d / lr, where lr and lr_1d are the group's
    values at construction (kept in the group as ``lr_1d_factor``), so lr_1d follows the schedule's shape.
    ``amsgrad`` applies to these tensors too, as in the paper's code. Their AdamW adds eps to the
    bias-corrected sqrt(v̂), as torch.optim.AdamW; ``eps_1d_uncorrected=True`` adds it to sqrt(v) before
    the correction, as MARS-M's reference code: m̂ / (sqrt(v̂) + eps / sqrt(1-β2^t)).

    MARS-M (``mars_type="mars-m"``), as its reference code (MARS_M/optimizers/mars_m.py): Newton-Schulz
    normalises m itself (any factor of m cancels, so m is not bias-corrected) with its own normaliser 1e-7,
    and the factor 0.2 sqrt(max(rows, cols)) gives the update the RMS of an AdamW update (Liu et al. 2025,
    "Muon is Scalable for LLM Training"), so lr and weight decay are on AdamW's scale. Its reference trains
    the embeddings, the head and every 1-D tensor with the AdamW part at the same lr and weight decay:
    put those in a group with ``routing="none"``, lr_1d=lr and weight_decay_1d=weight_decay.

    g_{t-1} is the previous step's gradient (approximate MARS, ``is_approx=True``), or ∇f(x_{t-1}, ξ_t)
    supplied by the loop (exact MARS): after a backward pass on the NEXT batch at the current parameters
    call :meth:`update_previous_grad`, then backward on the current batch, :meth:`step`, and
    :meth:`update_last_grad`. A step() without update_last_grad() after the previous one, or an
    update_last_grad() without a stored look-ahead gradient, raises instead of correcting with a stale
    gradient. Under a GradScaler pass ``inverse_scale=1 / scaler.get_scale()`` to update_previous_grad: it
    sees the gradient before scaler.step() unscales it (and a non-finite one is not kept). A tensor with a
    gradient in step() but none in the look-ahead pass takes its own gradient as g_{t-1}.

    Difference from the paper's reference code (MARS's and MARS-M's): there ``last_grad`` starts at zero, so
    its first step uses c_1 = (1 + γβ1/(1-β1)) g_1. Here the correction is zero at t = 1 (c_1 = g_1), as
    x_1 = x_0 in Algorithm 1 (MARS) and Algorithm 2 (MARS-M) implies. Once ‖g_1‖ >= 1 the clip makes the
    two identical.

    State per tensor: 'step' (a float32 0-d tensor on the parameter's device, advanced on the device, so
    no step reads a number back from it), 'exp_avg' (m), 'exp_avg_sq' (v, where the rule uses it),
    'max_exp_avg_sq' (amsgrad), 'last_grad' (g_{t-1}, the optimizer's own copy, never an alias of .grad;
    MARS-handled tensors only) and, in exact mode, 'previous_grad'. m and v have the parameter's dtype,
    except for float16 parameters, where they are float32: (1-β2)·c̃² of a unit-norm c̃ underflows float16
    (each entry of c̃ is about 1/sqrt(numel)), and so do many entries of (1-β1)·c̃. A step skipped by
    torch.amp.GradScaler (inf/nan gradients)
    never reaches step(), so it changes no state.

    Args:
        params: iterable of parameters or of dicts defining parameter groups; every hyperparameter below
            may be overridden per group.
        lr: learning rate η of MARS-handled tensors (default 3e-3); a number or a 0-d tensor (a schedule
            may write either into group['lr']; a tensor stays on the device).
        betas: (β1, β2) for m and v (default (0.95, 0.99)).
        eps: added to the AdamW denominator; also mars-shampoo's Newton-Schulz normaliser (mars-m's is 1e-7,
            its reference's); must be > 0 (default 1e-8).
        weight_decay: decoupled weight decay λ of MARS-handled tensors (default 0).
        amsgrad: use the running maximum of v in the denominator (default False).
        gamma: γ, the strength of the variance-reduction correction (default 0.025).
        is_approx: True uses the previous step's gradient as g_{t-1}; False expects the exact protocol.
        mars_type: "mars-adamw", "mars-lion", "mars-shampoo" or "mars-m".
        optimize_1d: apply MARS to every tensor (default False: only those `routing` names; the rest AdamW).
        routing: "2d" (default, as the paper's code): exactly the 2-D tensors take MARS, so a convolution's
            4-D kernel gets AdamW; "nd": every tensor with 2 or more dimensions takes MARS; "none": every
            tensor of the group takes the AdamW part (with optimize_1d=False).
        lr_1d: AdamW lr of the other tensors at construction (default 3e-3).
        betas_1d: AdamW betas of the other tensors (default (0.9, 0.95)).
        weight_decay_1d: AdamW weight decay of the other tensors (default 0.1).
        eps_1d_uncorrected: the other tensors' AdamW adds eps to sqrt(v) before the bias correction, as
            MARS-M's reference code (default False: to sqrt(v̂), as torch.optim.AdamW and its fused kernel).
        last_grad_dtype: dtype of the stored previous gradient g_{t-1} (None: the parameter's). bfloat16
            halves its memory; the update itself still computes in the parameter's precision.
        foreach: None or True use the multi-tensor path; False the single-tensor reference.
        fused: True compiles the per-tensor update with torch.compile (needs a C++ compiler on CPU, Triton
            on CUDA; the first step compiles for seconds, later steps and lr changes do not recompile).
            None or False: not compiled.
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
        eps_1d_uncorrected=False,
        last_grad_dtype=None,
        foreach=None,
        fused=None,
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
            eps_1d_uncorrected=eps_1d_uncorrected,
            last_grad_dtype=last_grad_dtype,
            foreach=foreach,
            fused=fused,
        )
        _validate(defaults)
        self.__dict__.update(_protocol_state())
        super().__init__(params, defaults)

    # Exact MARS's protocol (see update_previous_grad / update_last_grad) travels with copies and pickles:
    # Optimizer's own __getstate__ keeps only defaults, state and param_groups.
    def __getstate__(self):
        return {**super().__getstate__(), **{key: self.__dict__[key] for key in _protocol_state()}}

    def __setstate__(self, state):
        super().__setstate__(state)
        for key, value in _protocol_state().items():  # a pickle written before these existed
            self.__dict__.setdefault(key, value)

    def add_param_group(self, param_group):
        group = {**self.defaults, **param_group}  # what the group will hold: validate before installing
        _validate(group)
        params = param_group["params"]
        if torch.is_tensor(params):
            params = [params]
        elif not isinstance(params, set):  # Optimizer refuses sets (their order changes between runs)
            params = list(params)
        param_group = {**param_group, "params": params}
        for p in params:
            if torch.is_tensor(p) and p.is_complex():
                raise ValueError(
                    f"MARS does not support complex parameters (got one of shape {tuple(p.shape)}, {p.dtype}); "
                    "optimize torch.view_as_real(p) instead"
                )
        if "lr_1d_factor" not in group:
            lr = float(group["lr"])
            if lr == 0 and not group["optimize_1d"]:
                raise ValueError(
                    "lr=0 with optimize_1d=False leaves the 1-D learning rate lr*lr_1d/lr "
                    "undefined; construct with the peak lr (a schedule may start at 0)"
                )
            # Fixed at construction: a schedule changes group['lr'] and the 1-D lr follows its shape.
            param_group = {**param_group, "lr_1d_factor": lr_1d_factor(lr, group["lr_1d"])}
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict):
        # Which path runs (foreach, fused) is this process's choice, not the checkpoint's: Optimizer's
        # load_state_dict would take the saved groups' values, so a fused=True optimizer restored from a
        # foreach run would silently stop compiling.
        paths = [{key: group[key] for key in ("foreach", "fused")} for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, path in zip(self.param_groups, paths):
            group.update(path)
            # a checkpoint written before the key existed
            group.setdefault("eps_1d_uncorrected", self.defaults["eps_1d_uncorrected"])
        # Optimizer.load_state_dict casts every floating-point state tensor to its parameter's dtype and
        # leaves 'step' where it was saved; MARS keeps some tensors in another dtype (float32 v of float16
        # parameters, last_grad_dtype) and every step on its parameter's device.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if key == "step":
                    self.state[p][key] = torch.as_tensor(value, dtype=torch.float32, device=p.device)
                elif torch.is_tensor(value) and value.dtype != p.dtype:
                    self.state[p][key] = value.to(device=p.device, copy=True)

    @staticmethod
    def _is_mars_tensor(p, group):
        routing = group["routing"]
        return group["optimize_1d"] or (routing != "none" and (p.ndim == 2 or (routing == "nd" and p.ndim > 2)))

    @torch.no_grad()
    def update_previous_grad(self, inverse_scale=None):
        """Exact MARS: keep ∇f(x_t, ξ_{t+1}) -- call after a backward pass on the NEXT batch.

        inverse_scale: multiplies the stored gradient; under torch.amp.GradScaler pass
        1 / scaler.get_scale(), since .grad still holds the scaled gradient here (a number, or a tensor
        on the device to avoid reading the scale back). With it, a look-ahead gradient with an inf or nan
        (the loss scale too high for it, which the scaler never sees) is not kept: the next step corrects
        with the look-ahead gradient stored before it, chosen on the device (no host sync).
        """
        stored = []
        for group in self.param_groups:
            if group["is_approx"]:
                continue
            for p in group["params"]:
                if p.grad is None or not self._is_mars_tensor(p, group):
                    continue
                _check_dense(p.grad)
                state = self.state[p]
                if "previous_grad" not in state:
                    state["previous_grad"] = torch.empty_like(p.grad, dtype=group["last_grad_dtype"] or p.dtype)
                torch.mul(p.grad, 1.0 if inverse_scale is None else inverse_scale, out=state["previous_grad"])
                stored.append(p)
        if inverse_scale is not None:
            self._keep_finite_look_ahead(stored)
        self._look_ahead.update(stored)

    def _keep_finite_look_ahead(self, params):
        """Where any stored look-ahead gradient on a device is not finite, every one on that device (as a
        GradScaler skips a whole step) falls back to the one stored before it; before the first, to zero,
        which gives the next step the reference's first-step correction c = (1 + γβ1/(1-β1)) g."""
        by_device = {}
        for p in params:
            by_device.setdefault(p.device, []).append(p)
        for same_device in by_device.values():
            states = [self.state[p] for p in same_device]
            buffers = [state["previous_grad"] for state in states]
            # The max-norm is finite exactly when every entry is (and, unlike the 2-norm, cannot overflow).
            finite = torch.stack(torch._foreach_norm(buffers, ord=math.inf)).isfinite().all()
            for state, buffer in zip(states, buffers):
                fallback = state.get("last_grad")
                if fallback is None:
                    fallback = torch.zeros((), dtype=buffer.dtype, device=buffer.device)
                torch.where(finite, buffer, fallback, out=buffer)

    @torch.no_grad()
    def update_last_grad(self):
        """Exact MARS: after step(), make the stored look-ahead gradient the g_{t-1} of the next step."""
        exact_groups = [group for group in self.param_groups if not group["is_approx"]]
        if not exact_groups:
            return
        if not self._look_ahead:
            if not self._last_grad_pending:  # no MARS tensor stepped (1-D only, or a ZeRO-1 share without one)
                return
            raise RuntimeError(
                "exact MARS (is_approx=False): update_last_grad() found no look-ahead gradient; call "
                "update_previous_grad() after the backward pass on the next batch, before step()"
            )
        for group in exact_groups:
            for p in group["params"]:
                state = self.state[p]
                if p not in self._look_ahead:
                    if self._last_grad_pending and "last_grad" in state and p.grad is not None:
                        # It stepped, but had no gradient in the look-ahead pass (unused there): its own
                        # gradient, as approximate MARS, rather than a look-ahead gradient from steps ago. (A
                        # step a GradScaler skipped never ran: its gradients may be inf, and nothing moved.)
                        state["last_grad"].copy_(p.grad)
                    continue
                if "last_grad" in state:  # swap the buffers: the old g_{t-1} is overwritten next time
                    state["last_grad"], state["previous_grad"] = state["previous_grad"], state["last_grad"]
                else:
                    state["last_grad"] = state.pop("previous_grad")
        self._look_ahead = set()
        self._last_grad_pending = False

    def _state_for(self, p, group):
        """p's state, allocated on its first step (device follows p; dtypes as the class docstring says)."""
        state = self.state[p]
        if "step" in state:
            return state
        is_mars = self._is_mars_tensor(p, group)
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        moment_dtype = torch.float32 if p.dtype == torch.float16 else p.dtype
        state["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
        if not is_mars or _rule(p, group["mars_type"]) == "adamw":
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
        if is_mars and "last_grad" not in state:
            # No previous gradient at t = 1: g_0 := g_1 makes the correction zero (c_1 = g_1).
            state["last_grad"] = p.grad.to(group["last_grad_dtype"] or p.dtype, copy=True)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One MARS step; returns closure()'s loss when a closure is given."""
        if self._last_grad_pending:
            raise RuntimeError(
                "exact MARS (is_approx=False): step() was called again without update_last_grad() after "
                "the previous step(), so the correction would use a stale gradient; call "
                "update_last_grad() after every step()"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            mars, adamw = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_dense(p.grad)
                entry = (p, self._state_for(p, group))
                (mars if self._is_mars_tensor(p, group) else adamw).append(entry)
            if not mars and not adamw:
                continue
            rules = [_rule(p, group["mars_type"]) for p, _ in mars]  # checked before anything changes
            # Advanced on the device: the fused kernels read their step counts from there.
            torch._foreach_add_([state["step"] for _, state in mars + adamw], 1)
            if mars:
                kernel = _kernel_mars(group)
                kernel(
                    mars,
                    rules,
                    lr=group["lr"],
                    beta1=group["betas"][0],
                    beta2=group["betas"][1],
                    weight_decay=group["weight_decay"],
                    gamma=group["gamma"],
                    is_approx=group["is_approx"],
                    eps=group["eps"],
                )
                self._last_grad_pending |= not group["is_approx"]
            if adamw:
                kernel = _single_tensor_adamw if _reference_path(group) else _multi_tensor_adamw
                kernel(
                    adamw,
                    lr=group["lr"] * group["lr_1d_factor"],
                    beta1=group["betas_1d"][0],
                    beta2=group["betas_1d"][1],
                    weight_decay=group["weight_decay_1d"],
                    eps=group["eps"],
                    eps_uncorrected=group["eps_1d_uncorrected"],
                )
        return loss


def _protocol_state():
    """Exact MARS's protocol between calls: the parameters whose look-ahead gradient update_previous_grad()
    stored since the last update_last_grad(), and whether a step() is waiting for update_last_grad()."""
    return {"_look_ahead": set(), "_last_grad_pending": False}


def lr_1d_factor(lr, lr_1d):
    """The 1-D tensors' lr as a multiple of the group's: lr_1d / lr at the peak lr (1 where lr is 0)."""
    return lr_1d / lr if lr else 1.0


def _validate(hp):
    for name in ("lr", "lr_1d", "eps", "weight_decay", "weight_decay_1d", "gamma"):
        value = hp[name]
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        is_scalar_tensor = name == "lr" and torch.is_tensor(value) and value.ndim == 0 and value.is_floating_point()
        if name == "eps":
            if not (is_number and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"invalid eps: {value!r} (must be a finite number > 0: it keeps the AdamW and Newton-Schulz "
                    "divisions finite)"
                )
            continue
        if not (is_number or is_scalar_tensor) or not 0.0 <= float(value) < math.inf:
            allowed = "a finite number >= 0" + (" or a 0-d floating tensor" if name == "lr" else "")
            raise ValueError(f"invalid {name}: {value!r} (must be {allowed})")
    for name in ("amsgrad", "is_approx", "optimize_1d", "eps_1d_uncorrected"):
        if not isinstance(hp[name], bool):
            raise ValueError(f"invalid {name}: {hp[name]!r} (must be True or False)")
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
    if hp["routing"] == "none" and hp["optimize_1d"]:
        raise ValueError(
            'invalid routing="none" with optimize_1d=True: optimize_1d gives every tensor the MARS rule, '
            '"none" gives none of them; set one of the two'
        )
    dtype = hp["last_grad_dtype"]
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"invalid last_grad_dtype: {dtype!r} (must be None or a floating torch.dtype)")
    for name in ("foreach", "fused"):
        if not (hp[name] is None or isinstance(hp[name], bool)):
            raise ValueError(f"invalid {name}: {hp[name]!r} (must be None, True or False)")
    if hp["fused"] and hp["foreach"] is False:
        raise ValueError("invalid fused=True with foreach=False: the fused path is a multi-tensor path")


def _check_dense(grad):
    if grad.is_sparse:
        raise RuntimeError(
            "MARS does not support sparse gradients (e.g. nn.Embedding(sparse=True)); use dense gradients"
        )


def _rule(p, mars_type):
    """The update direction a MARS-handled tensor takes: "adamw", "lion", "newton-schulz" (mars-shampoo's)
    or "newton-schulz-rms" (mars-m's)."""
    if mars_type == "mars-lion":
        return "lion"
    if mars_type == "mars-shampoo":
        return "newton-schulz" if p.ndim == 2 else "adamw"  # the tensors Newton-Schulz cannot take: AdamW's
    if mars_type == "mars-m":
        return "newton-schulz-rms" if p.ndim == 2 else "adamw"
    if mars_type == "mars-adamw":
        return "adamw"
    # A group's value written after construction (the constructor validates it).
    raise ValueError(f"invalid mars_type: {mars_type!r} (allowed: {', '.join(MARS_TYPES)})")


def _reference_path(group):
    """foreach=False, or a step traced by torch.compile (torch.compile(optimizer.step)): the reference's plain
    ops compile into fused kernels, where torch's fused AdamW kernel and the compiled step cannot be traced."""
    return group["foreach"] is False or torch.compiler.is_compiling()


def _kernel_mars(group):
    if _reference_path(group):
        return _single_tensor_mars
    return _fused_mars if group["fused"] else _multi_tensor_mars


def _opmath(dtype):
    """The dtype arithmetic on `dtype` tensors is carried out in: float32 for the half types."""
    return torch.promote_types(dtype, torch.float32)


def _lr_on(lr, device):
    """lr as the kernels take it: a number as it is, a tensor on `device` (copied without a host sync)."""
    if torch.is_tensor(lr) and lr.device != device:
        return lr.to(device, non_blocking=True)
    return lr


# ---------------------------------------------------------------------------------------------------
# Single-tensor reference: the rule of the class docstring, line by line.


def _single_tensor_mars(entries, rules, *, lr, beta1, beta2, eps, weight_decay, gamma, is_approx):
    for (p, state), rule in zip(entries, rules):
        device_lr = _lr_on(lr, p.device)
        step_size, bias_correction2_rsqrt = _adam_scalars([state["step"]], device_lr, beta1, beta2, p.dtype)
        _mars_tensor_step(
            p,
            p.grad,
            state["last_grad"],
            state["exp_avg"],
            state.get("exp_avg_sq"),
            state.get("max_exp_avg_sq"),
            device_lr,
            step_size[0],
            bias_correction2_rsqrt[0],
            rule=rule,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            gamma=gamma,
            keep_grad=is_approx,
        )


def _single_tensor_adamw(entries, *, lr, beta1, beta2, eps, weight_decay, eps_uncorrected):
    for p, state in entries:
        device_lr = _lr_on(lr, p.device)
        step_size, bias_correction2_rsqrt = _adam_scalars([state["step"]], device_lr, beta1, beta2, p.dtype)
        _adamw_tensor_step(
            p,
            p.grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state.get("max_exp_avg_sq"),
            device_lr,
            step_size[0],
            bias_correction2_rsqrt[0],
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            eps_uncorrected=eps_uncorrected,
        )


def _mars_tensor_step(
    p,
    g,
    g_prev,
    m,
    v,
    v_max,
    lr,
    step_size,
    bias_correction2_rsqrt,
    *,
    rule,
    beta1,
    beta2,
    eps,
    weight_decay,
    gamma,
    keep_grad,
):
    """One MARS step of one tensor; v, v_max are None where the rule keeps none, and step_size,
    bias_correction2_rsqrt are _adam_scalars' (used by the AdamW rule)."""
    g = g.to(m.dtype)  # float16 parameters: c̃ in float32, as m and v (its small entries underflow float16)
    c = g + gamma * beta1 / (1 - beta1) * (g - g_prev)  # c_t, the variance-reduced gradient
    c = c / torch.linalg.vector_norm(c, dtype=_opmath(c.dtype)).clamp_min(1.0)  # c̃_t: ‖c̃_t‖ <= 1
    _rule_step(p, c, m, v, v_max, lr, step_size, bias_correction2_rsqrt, rule, beta1, beta2, eps, weight_decay)
    if keep_grad:
        g_prev.copy_(g)


def _rule_step(p, c, m, v, v_max, lr, step_size, bias_correction2_rsqrt, rule, beta1, beta2, eps, weight_decay):
    """The preconditioned update of a tensor from its clipped c̃_t: AdamW's, Lion's sign, or Newton-Schulz."""
    if rule == "adamw":
        _adamw_tensor_step(
            p,
            c,
            m,
            v,
            v_max,
            lr,
            step_size,
            bias_correction2_rsqrt,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
        )
    else:
        m.lerp_(c, 1 - beta1)  # m_t = β1 m_{t-1} + (1 - β1) c̃_t
        u = m.sign() if rule == "lion" else _orthogonal_direction(m, rule, beta1=beta1, eps=eps)
        p.sub_(lr * (u + weight_decay * p))


def _adamw_tensor_step(
    p, x, m, v, v_max, lr, step_size, bias_correction2_rsqrt, *, beta1, beta2, eps, weight_decay, eps_uncorrected=False
):
    """AdamW on input x (c̃ for MARS tensors, g for the others); v_max is None without amsgrad.

    m_t = β1 m + (1-β1) x, v_t = β2 v + (1-β2) x², p ← p - lr (m̂ / (sqrt(v̂) + eps) + λ p) with
    m̂ = m / (1-β1^t), v̂ = v / (1-β2^t): the update of torch.optim.AdamW, which is why its fused kernel can
    take it. As there, the bias corrections come folded into two scalars (_adam_scalars), so each element
    costs one sqrt and one division. eps_uncorrected: (sqrt(v) + eps) / sqrt(1-β2^t) in the denominator,
    MARS-M's reference AdamW.
    """
    m.lerp_(x.to(m.dtype), 1 - beta1)
    v.mul_(beta2).addcmul_(x, x, value=1 - beta2)
    if v_max is not None:
        v = v_max.copy_(torch.maximum(v_max, v))
    if eps_uncorrected:
        denom = (v.sqrt() + eps) * bias_correction2_rsqrt
    else:
        denom = v.sqrt() * bias_correction2_rsqrt + eps  # sqrt(v̂) + eps
    p.sub_(lr * weight_decay * p + step_size * m / denom)


def _adam_scalars(steps, lr, beta1, beta2, dtype):
    """For each step tensor t (one device): lr / (1-β1^t) and 1 / sqrt(1-β2^t), torch AdamW's step size and
    denominator scale, computed on the device (no host sync) in one stacked pass; dtype is the arithmetic
    dtype of the parameters (float64 ones get float64 corrections from the float32 counts)."""
    t = torch.stack(steps).to(_opmath(dtype))
    return (lr / (1 - beta1**t)).unbind(), (1 - beta2**t).rsqrt().unbind()


# ---------------------------------------------------------------------------------------------------
# Multi-tensor path: the same rule with torch._foreach_* ops, one call per op per (device, dtype).
# Scalars that change per step (lr, the step counts) stay on the device, so nothing here waits on it.


def _multi_tensor_mars(entries, rules, *, lr, beta1, beta2, eps, weight_decay, gamma, is_approx):
    k = gamma * beta1 / (1 - beta1)
    for bucket, bucket_rules in _by_device_and_dtype(entries, rules):
        params = [p for p, _ in bucket]
        grads = [p.grad for p in params]
        last_grads = [state["last_grad"] for _, state in bucket]
        device_lr = _lr_on(lr, params[0].device)
        dtype = bucket[0][1]["exp_avg"].dtype  # c̃'s, as m's: float32 for float16 parameters
        if is_approx and last_grads[0].dtype == dtype:
            # g_prev is replaced by g at the end of the step, so its buffer holds c meanwhile: the
            # step's one gradient-sized buffer, and no allocation.
            c = last_grads
        else:
            # Exact MARS (g_prev belongs to update_last_grad), or g_prev stored in another dtype.
            c = [g_prev.to(dtype, copy=True) for g_prev in last_grads]
        torch._foreach_lerp_(c, [g.to(dtype) for g in grads], 1 + k)  # g + k (g - g_prev)
        norms = torch._foreach_norm(c, dtype=_opmath(dtype))
        torch._foreach_clamp_min_(norms, 1.0)
        torch._foreach_div_(c, norms)  # clip to Frobenius norm <= 1

        for rule in ("lion", *_NEWTON_SCHULZ_RULES, "adamw"):
            picked = [i for i, r in enumerate(bucket_rules) if r == rule]
            if not picked:
                continue
            sub = [bucket[i] for i in picked]
            sub_c = [c[i] for i in picked]
            if rule == "adamw":
                _foreach_adamw(sub, sub_c, device_lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
                continue
            momenta = [state["exp_avg"] for _, state in sub]
            torch._foreach_lerp_(momenta, sub_c, 1 - beta1)
            if rule == "lion":
                torch._foreach_copy_(sub_c, momenta)
                torch._foreach_sign_(sub_c)
                _foreach_apply_update([p for p, _ in sub], sub_c, device_lr, weight_decay)
            else:
                _newton_schulz_update(sub, device_lr, rule, beta1=beta1, eps=eps, weight_decay=weight_decay)
        if is_approx:
            torch._foreach_copy_(last_grads, grads)


def _multi_tensor_adamw(entries, *, lr, beta1, beta2, eps, weight_decay, eps_uncorrected):
    for bucket, _ in _by_device_and_dtype(entries):
        grads = [p.grad for p, _ in bucket]
        device_lr = _lr_on(lr, bucket[0][0].device)
        hyper = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, eps_uncorrected=eps_uncorrected)
        _foreach_adamw(bucket, grads, device_lr, **hyper)


def _by_device_and_dtype(entries, rules=None):
    """(entries, rules) per (device, dtype) of the parameters, in first-seen order."""
    rules = rules if rules is not None else [None] * len(entries)
    buckets = {}
    for entry, rule in zip(entries, rules):
        bucket = buckets.setdefault((entry[0].device, entry[0].dtype), ([], []))
        bucket[0].append(entry)
        bucket[1].append(rule)
    return buckets.values()


def _foreach_apply_update(params, updates, lr, weight_decay):
    """p ← p - lr (u + λ p) for every pair; the buffers of `updates` are scratch.

    A tensor lr is used where it is (the Tensor overloads of the foreach ops), never read back.
    """
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    if torch.is_tensor(lr):
        torch._foreach_mul_(updates, lr)
        torch._foreach_sub_(params, updates)
    else:
        torch._foreach_add_(params, updates, alpha=-lr)


def _newton_schulz_update(entries, lr, rule, *, beta1, eps, weight_decay):
    """A Newton-Schulz rule on 2-D tensors (m already updated), one batched Newton-Schulz per shape."""
    by_shape = {}
    for entry in entries:
        by_shape.setdefault(tuple(entry[0].shape), []).append(entry)
    for same_shape in by_shape.values():
        momenta = torch.stack([state["exp_avg"] for _, state in same_shape])
        u = _orthogonal_direction(momenta, rule, beta1=beta1, eps=eps)
        _foreach_apply_update([p for p, _ in same_shape], list(u.unbind(0)), lr, weight_decay)


def _orthogonal_direction(m, rule, *, beta1, eps):
    """u_t of a Newton-Schulz rule for matrix m, or for a stack of same-shape matrices (leading dimension).

    newton-schulz (mars-shampoo): NS(m / (1-β1)) sqrt(max(1, rows/cols)), normaliser eps.
    newton-schulz-rms (mars-m): 0.2 sqrt(max(rows, cols)) NS(m), normaliser 1e-7, as MARS-M's reference code;
    NS divides m by its norm, so m needs no bias correction, and the factor gives the update AdamW's RMS.
    """
    rows, cols = m.shape[-2:]
    if rule == "newton-schulz":
        return newton_schulz(m / (1 - beta1), eps=eps) * math.sqrt(max(1.0, rows / cols))
    return newton_schulz(m) * (0.2 * math.sqrt(max(rows, cols)))


# Devices whose torch build has the fused AdamW kernel (torch.optim.AdamW(fused=True)'s).
_FUSED_ADAMW_DEVICES = ("cpu", "cuda", "mps", "xpu", "hpu")


def _fused_adamw_can_take(p, x, state):
    """Whether torch's fused AdamW kernel computes the reference's result on these tensors.

    The kernel walks each tensor's memory linearly: every tensor must share p's dtype and strides, and p
    must fill its memory without gaps (the gaps of a strided view would be written).
    """
    tensors = [x] + [state[k] for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in state]
    return (
        p.device.type in _FUSED_ADAMW_DEVICES
        and _is_dense(p)
        and all(t.dtype == p.dtype and t.stride() == p.stride() for t in tensors)
    )


def _is_dense(t):
    """Whether t's elements fill one block of memory without gaps or overlaps, in some dimension order."""
    if t.is_contiguous():  # the common case, checked cheaply: this runs per tensor per step
        return True
    order = sorted(range(t.ndim), key=t.stride, reverse=True)
    return t.permute(order).is_contiguous()


def _foreach_adamw(entries, xs, lr, *, beta1, beta2, eps, weight_decay, eps_uncorrected=False):
    """AdamW on inputs xs: torch's fused kernel on the tensors it can take, the reference on the rest (all of
    them with eps_uncorrected, which the kernel cannot compute)."""
    takes = [not eps_uncorrected and _fused_adamw_can_take(p, x, state) for (p, state), x in zip(entries, xs)]
    fused = [(entry, x) for entry, x, ok in zip(entries, xs, takes) if ok]
    if fused:
        states = [state for (_, state), _ in fused]
        torch._fused_adamw_(
            [p for (p, _), _ in fused],
            [x for _, x in fused],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states if "max_exp_avg_sq" in s],
            [s["step"] for s in states],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad="max_exp_avg_sq" in states[0],
            maximize=False,
        )
    rest = [(entry, x) for entry, x, ok in zip(entries, xs, takes) if not ok]
    if rest:
        steps = [state["step"] for (_, state), _ in rest]
        step_sizes, bias_correction2_rsqrts = _adam_scalars(steps, lr, beta1, beta2, rest[0][0][0].dtype)
        for ((p, state), x), step_size, bias_correction2_rsqrt in zip(rest, step_sizes, bias_correction2_rsqrts):
            _adamw_tensor_step(
                p,
                x,
                state["exp_avg"],
                state["exp_avg_sq"],
                state.get("max_exp_avg_sq"),
                lr,
                step_size,
                bias_correction2_rsqrt,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=weight_decay,
                eps_uncorrected=eps_uncorrected,
            )


# ---------------------------------------------------------------------------------------------------
# fused=True: _fused_mars_tensor_step, the reference step written for the compiler, compiled. The tensors go in
# as 1-D views in memory order, so one compiled graph (per dtype and rule) serves every shape. Every number
# (lr, β1, β2, eps, λ, γ) goes in as a 0-d tensor on the device, so no value is compiled in: a schedule may
# change lr or the betas every step (OneCycleLR cycles β1) and groups may differ in every number without a
# recompilation (docs/mars.md, "the compiled path", says what Python floats did). Tensors whose layouts differ
# (a transposed parameter with a contiguous gradient) take the eager reference, with the numbers as they are.
#
# The graphs a process can need (dtypes x rules x amsgrad x exact/approximate) exceed dynamo's default limit
# of 8 per function only in unusual mixes; the limit is raised for this function, and reaching it raises
# instead of silently running uncompiled.
_RECOMPILE_LIMIT = 64


def _fused_mars_tensor_step(p, g, g_prev, m, v, v_max, lr, step_size, bias_correction2_rsqrt, *, rule, keep_grad, **hp):
    """_mars_tensor_step as inductor compiles it fastest; the same rule, within a rounding."""
    beta1, gamma = hp["beta1"], hp["gamma"]
    g = g.to(m.dtype)
    c = g + gamma * beta1 / (1 - beta1) * (g - g_prev)
    # On CPU with g_prev in c's dtype inductor's float32 sum (a cascade helper) made this reduction 1.8x slower
    # than a float64 sum; with a bfloat16 g_prev the float32 sum is the faster one (4.8 vs 8.3 ms).
    f64_sum = c.is_cpu and g_prev.dtype == c.dtype
    norm = torch.linalg.vector_norm(c, dtype=torch.float64 if f64_sum else _opmath(c.dtype)).clamp_min(1.0)
    # Inductor divides element by element; times the reciprocal (one rounding more) leaves the divider to the
    # AdamW rule's own division: 2-3% of the step on this repository's CPU when memory is fast.
    c = c * norm.reciprocal().to(c.dtype)
    rule_numbers = (hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"])
    _rule_step(p, c, m, v, v_max, lr, step_size, bias_correction2_rsqrt, rule, *rule_numbers)
    if keep_grad:
        g_prev.copy_(g)


@functools.cache
def _compiled_mars_tensor_step(simdlen=None):
    # cpp.dynamic_threads: without it inductor compiled the kernel for a bfloat16 last_grad single-threaded
    # (2.2x slower than float32 here); with it OpenMP picks the threads at run time (C++ backend only).
    options = {"cpp.dynamic_threads": True} | ({"cpp.simdlen": simdlen} if simdlen else {})
    return torch.compile(_fused_mars_tensor_step, dynamic=True, options=options)


def _simdlen(p, g_prev):
    """The vector width to compile p's step for: None (inductor's choice) except for float32 parameters with a
    half-precision g_prev on an AVX-512 CPU, where 256-bit vectors measured 1.2-1.4x faster on this
    repository's AMD EPYC (the 512-bit kernel walks the 16-bit g_prev in half-filled, masked vectors); on
    all-float32 steps the width made no difference, and on bfloat16 or float16 parameters 256 was slower."""
    half = g_prev.dtype in (torch.bfloat16, torch.float16)
    if p.is_cpu and p.dtype == torch.float32 and half and torch.backends.cpu.get_cpu_capability() == "AVX512":
        return 256
    return None


def _fused_mars(entries, rules, *, lr, beta1, beta2, eps, weight_decay, gamma, is_approx):
    hyper = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, gamma=gamma)
    newton_schulz = [(entry, rule) for entry, rule in zip(entries, rules) if rule in _NEWTON_SCHULZ_RULES]
    if newton_schulz:  # not compiled: the multi-tensor path batches Newton-Schulz
        _multi_tensor_mars(*map(list, zip(*newton_schulz)), lr=lr, is_approx=is_approx, **hyper)
    compiled = [(entry, rule) for entry, rule in zip(entries, rules) if rule not in _NEWTON_SCHULZ_RULES]
    if not compiled:
        return
    limits = dict(recompile_limit=_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True)
    with torch._dynamo.config.patch(**limits):
        for bucket, bucket_rules in _by_device_and_dtype(*zip(*compiled)):
            p0 = bucket[0][0]
            opmath = _opmath(p0.dtype)
            device_lr = (
                _lr_on(lr, p0.device) if torch.is_tensor(lr) else torch.full((), lr, dtype=opmath, device=p0.device)
            )
            device_hyper = {
                name: torch.full((), value, dtype=opmath, device=p0.device) for name, value in hyper.items()
            }
            steps = [state["step"] for _, state in bucket]
            scalars = zip(*_adam_scalars(steps, device_lr, beta1, beta2, p0.dtype))
            for (p, state), rule, (step_size, bias_correction2_rsqrt) in zip(bucket, bucket_rules, scalars):
                tensors = [
                    p,
                    p.grad,
                    state["last_grad"],
                    state["exp_avg"],
                    state.get("exp_avg_sq"),
                    state.get("max_exp_avg_sq"),
                ]
                flat = _flat_views(tensors)
                if flat is None:  # layouts differ: the eager reference, which takes the numbers as they are
                    step_fn, args, numbers = _mars_tensor_step, tensors, hyper
                else:
                    step_fn, args, numbers = _compiled_mars_tensor_step(_simdlen(p, tensors[2])), flat, device_hyper
                step_fn(
                    *args,
                    device_lr,
                    step_size,
                    bias_correction2_rsqrt,
                    rule=rule,
                    keep_grad=is_approx,
                    **numbers,
                )


def _flat_views(tensors):
    """1-D views of the tensors (None stays None) in memory order, or None unless they share one dense layout.
    The views are detached, as the compiled graph updates them in place correctly only then (docs/mars.md)."""
    present = [t for t in tensors if t is not None]
    if all(t.is_contiguous() for t in present):  # the common case, checked cheaply: this runs per tensor
        return [None if t is None else t.detach().view(-1) for t in tensors]
    first = present[0]
    if not _is_dense(first) or any(t.stride() != first.stride() for t in present):
        return None
    order = sorted(range(first.ndim), key=first.stride, reverse=True)
    return [None if t is None else t.detach().permute(order).view(-1) for t in tensors]
