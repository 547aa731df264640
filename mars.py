"""MARS: Make vAriance Reduction Shine (Yuan et al. 2024, arXiv:2411.10438) as a torch optimizer, with the
authors' matrix-level instance MARS-M (Liu et al. 2025, arXiv:2510.21800).

One file that imports only torch: copy it into a project, or install it (``pip install <this repository>``, the
distribution mars-optimizer, which also installs its two siblings: mars_triton.py, the Triton kernel of
``fused=True``, and mars_sharded.py, the step of sharded (DTensor) parameters; copy those beside this one for
what they serve). docs/mars.md is its manual.

    from mars import MARS
    optimizer = MARS(model.parameters(), lr=6e-3, betas=(0.95, 0.99), weight_decay=0.1)

Laid out as torch/optim/adam.py: the class owns the parameter groups, the state and exact MARS's protocols, and
hands each group's tensors, as parallel lists, to the functional ``mars()``, the one place that picks the path:

- ``_single_tensor_mars`` (``foreach=False``, or a step traced by torch.compile): the rule tensor by tensor, the
  reference the other paths are tested against (and it against a float64 transcription of the rule);
- ``_multi_tensor_mars`` (the default): ``torch._foreach_*`` ops per device and dtype, the AdamW rule in torch's
  fused AdamW kernel, Newton-Schulz batched over matrices of one shape;
- ``mars_triton.step`` (``fused=True``): a Triton kernel, two launches per device and dtype for every tensor of
  the optimizer (CUDA; CPU tensors in Triton's interpreter), in the module mars_triton.py, imported only there;
- ``mars_sharded.step`` (DTensor parameters: FSDP2, HSDP): the multi-tensor rule on each rank's shards, with c_t's
  norm and Newton-Schulz taken on whole tensors, in the module mars_sharded.py, imported only when a DTensor steps.
"""

import importlib
import math
import sys
import warnings
from typing import NamedTuple

import torch

__version__ = "0.2.0"

MARS_TYPES = ("mars-adamw", "mars-lion", "mars-shampoo", "mars-m")
# Which tensors take the MARS rule when optimize_1d=False: "2d" exactly the 2-D ones (the paper's code;
# convolution kernels and other N-D tensors get the AdamW rule), "nd" every tensor with 2 or more dims,
# "none" no tensor (a group of embeddings and head that trains with the AdamW part, as MARS-M's code does).
ROUTINGS = ("2d", "nd", "none")
# The update rules whose direction is Newton-Schulz of m: mars-shampoo's and mars-m's (_orthogonal_direction).
NEWTON_SCHULZ_RULES = ("newton-schulz", "newton-schulz-rms")
# The group settings that say how this process computes the step, not what the rule is (load_state_dict keeps them).
_PATH_KEYS = ("foreach", "fused", "exchange_bucket_mib")

# Quintic Newton-Schulz coefficients (a, b, c) of the paper's MARS-Shampoo (the same as Muon's).
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz_dtype(device, dtype=torch.float32):
    """The dtype Newton-Schulz runs in by default on `device` for matrices of `dtype`: bfloat16 on GPUs of compute
    capability 8 and later, as the paper's code; float16 on older GPUs, which emulate bfloat16 slowly (and float16
    lands nearer the exact iteration); float32 on CPUs (float64 for float64 matrices). docs/mars.md has the
    measurements."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.promote_types(dtype, torch.float32)
    if torch.version.hip or torch.cuda.get_device_properties(device).major >= 8:
        return torch.bfloat16
    return torch.float16


def newton_schulz(G, steps=5, eps=1e-7, dtype=None):
    """Approximate the orthogonal factor U Vᵀ of each matrix G = U S Vᵀ in G's last two dimensions.

    Each matrix is cast to `dtype` (None: newton_schulz_dtype's) and divided by (its Frobenius norm + eps), so
    every singular value starts in [0, 1]; then `steps` quintic iterations X ← aX + b(XXᵀ)X + c(XXᵀ)²X push them
    into roughly [0.7, 1.2], on the wide orientation (Xᵀ when rows > cols: XXᵀ is the smaller Gram matrix).
    Leading dimensions are a batch: one batched matmul per product for a stack of same-shape matrices. Returns
    G's dtype.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs matrices (ndim >= 2), got shape {tuple(G.shape)}")
    if dtype is None:
        dtype = newton_schulz_dtype(G.device, G.dtype)
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


class MARSWeightDecayWarning(UserWarning):
    """A parameter group set weight_decay but not weight_decay_1d, and that changes what its AdamW-rule tensors
    (biases, norm weights) decay at compared with the paper's code (docs/mars.md, "Parameter groups")."""


class MARS(torch.optim.Optimizer):
    r"""MARS (Algorithm 1 of arXiv:2411.10438) with the AdamW, Lion and Shampoo instances, and MARS-M.

    For a tensor x that MARS handles (the 2-D ones by default: ``routing``, ``optimize_1d``), with gradient g_t at
    step t (from 1) and the group's lr η_t:

    .. math::
        c_t &= g_t + \gamma \tfrac{\beta_1}{1-\beta_1} (g_t - g_{t-1}) \quad (c_1 = g_1), \qquad
            \tilde c_t = c_t / \max(1, \lVert c_t \rVert_F), \qquad
            m_t = \beta_1 m_{t-1} + (1-\beta_1) \tilde c_t \\
        u_t &= \hat m_t / (\sqrt{\hat v_t} + \epsilon),\ v_t = \beta_2 v_{t-1} + (1-\beta_2) \tilde c_t^2
            \ \text{(mars-adamw)}, \qquad \operatorname{sign}(m_t) \ \text{(mars-lion)} \\
        u_t &= \mathrm{NS}\big(m_t / (1-\beta_1)\big) \sqrt{\max(1, r/c)} \ \text{(mars-shampoo)}, \qquad
            0.2 \sqrt{\max(r, c)}\, \mathrm{NS}(m_t) \ \text{(mars-m; both on } r \times c \text{ matrices)} \\
        x &\leftarrow x - \eta_t (u_t + \lambda x)

    The other tensors take AdamW on g_t with ``betas_1d``, ``weight_decay_1d`` and the lr η_t · lr_1d / lr.
    g_{t-1} is the previous step's gradient (``is_approx=True``, the paper's default) or, for exact MARS
    (``is_approx=False``), ∇f(x_{t-1}, ξ_t), the current batch's gradient at the previous parameters: pass step() a
    closure (MARS evaluates it at x_{t-1}, then at x_t), or call :meth:`update_previous_grad` after a backward pass
    on the next batch and :meth:`update_last_grad` after step(). Every number of a group is read at each step, so
    a scheduler may write lr (the 1-D lr follows it), betas, weight decays or gamma.

    The defaults are the paper's code's. docs/mars.md describes every argument, the state, the paths (``foreach``,
    ``fused``), exact MARS's two protocols, sharded (FSDP2) parameters, and where this departs from the reference
    code (c_1 = g_1; the previous gradient is the optimizer's own copy).
    """

    def __init__(
        self, params, lr=3e-3, betas=(0.95, 0.99), eps=1e-8, weight_decay=0.0, amsgrad=False, gamma=0.025,
        is_approx=True, mars_type="mars-adamw", optimize_1d=False, routing="2d", lr_1d=3e-3, betas_1d=(0.9, 0.95),
        weight_decay_1d=0.1, eps_1d_uncorrected=False, last_grad_dtype=None, foreach=None, fused=None,
        exchange_bucket_mib=None,
    ):  # fmt: skip
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, gamma=gamma, is_approx=is_approx,
            mars_type=mars_type, optimize_1d=optimize_1d, routing=routing, lr_1d=lr_1d, betas_1d=betas_1d,
            weight_decay_1d=weight_decay_1d, eps_1d_uncorrected=eps_1d_uncorrected, last_grad_dtype=last_grad_dtype,
            foreach=foreach, fused=fused, exchange_bucket_mib=exchange_bucket_mib,
        )  # fmt: skip
        _validate(defaults)
        self._protocol = _new_protocol()
        self._lr_1d_seen = []  # per group: the lr_1d and lr_1d_factor the last step left there (_live_lr_1d)
        super().__init__(params, defaults)

    def __getstate__(self):  # exact MARS's protocol and the lr_1d record travel with copies and pickles
        return {**super().__getstate__(), "_protocol": self._protocol, "_lr_1d_seen": self._lr_1d_seen}

    def __setstate__(self, state):
        super().__setstate__(state)  # also what Optimizer.load_state_dict calls, with state and groups only
        self.__dict__.setdefault("_protocol", _new_protocol())
        for group in [self.defaults, *self.param_groups]:  # pickled by a mars.py before the setting
            group.setdefault("exchange_bucket_mib", None)
        if len(self.__dict__.setdefault("_lr_1d_seen", [])) != len(self.param_groups):
            self._lr_1d_seen[:] = [_lr_1d_left(group) for group in self.param_groups]

    def add_param_group(self, param_group):
        group = {**self.defaults, **param_group}  # what the group will hold: validate before installing
        _validate(group)
        if group["fused"]:
            _fused_kernel().check_available()
        params = param_group["params"]
        if torch.is_tensor(params):
            params = [params]
        elif not isinstance(params, set):  # Optimizer refuses sets (their order changes between runs)
            params = list(params)
        param_group = {**param_group, "params": params}
        # Named parameters (model.named_parameters()) come as (name, tensor) pairs.
        tensors = [p[1] if isinstance(p, tuple) else p for p in params if torch.is_tensor(p) or isinstance(p, tuple)]
        for p in tensors:
            if torch.is_tensor(p) and p.is_complex():
                raise ValueError(
                    f"MARS does not support complex parameters (got one of shape {tuple(p.shape)}, {p.dtype}); "
                    "optimize torch.view_as_real(p) instead"
                )
            if group["fused"] and _is_dtensor(p):
                raise ValueError(
                    "fused=True does not run on DTensor (FSDP2) parameters: construct MARS with fused=None, and "
                    "they take the sharded step (the multi-tensor rule on each rank's shards)"
                )
        if any(map(_is_dtensor, tensors)):
            _sharded_step()  # refused here, in one line, where mars_sharded.py is not beside this file
        if "weight_decay" in param_group and "weight_decay_1d" not in param_group:
            # The group's weight decay is meant for all its tensors (nanoGPT's and Hugging Face's no-decay group).
            inherited = param_group["weight_decay"]
            param_group["weight_decay_1d"] = group["weight_decay_1d"] = inherited
            paper = self.defaults["weight_decay_1d"]
            affected = [p for p in tensors if torch.is_tensor(p) and not _takes_mars(p, group)]
            if inherited != paper and affected:
                warnings.warn(
                    f"MARS: parameter group {len(self.param_groups)} sets weight_decay={inherited} but not "
                    f"weight_decay_1d, so its {len(affected)} tensor(s) that take the AdamW part (1-D: biases, norm "
                    f"weights) decay at {inherited}, the group's weight_decay; the paper's code would decay them at "
                    f"weight_decay_1d={paper}. Set weight_decay_1d in the group to choose (and silence this).",
                    MARSWeightDecayWarning,
                    stacklevel=_callers_level(),
                )
        if "lr_1d_factor" not in group:
            lr = float(group["lr"])
            if lr == 0 and not group["optimize_1d"]:
                raise ValueError(
                    "lr=0 with optimize_1d=False leaves the 1-D learning rate lr*lr_1d/lr "
                    "undefined; construct with the peak lr (a schedule may start at 0)"
                )
            # The ratio: a schedule changes group['lr'] and the 1-D lr follows its shape (_live_lr_1d).
            param_group = {**param_group, "lr_1d_factor": lr_1d_factor(lr, float(group["lr_1d"]))}
        super().add_param_group(param_group)
        self._lr_1d_seen.append(_lr_1d_left(self.param_groups[-1]))

    def state_dict(self):
        state = super().state_dict()
        for group in state["param_groups"]:
            # By name ("bfloat16"): torch.distributed.checkpoint's full-state gather takes only tensors, numbers,
            # strings, lists and dicts. load_state_dict takes the name or the dtype (checkpoints written before).
            if isinstance(group["last_grad_dtype"], torch.dtype):
                group["last_grad_dtype"] = str(group["last_grad_dtype"]).removeprefix("torch.")
        # Exact MARS's 'previous_grad' is left out (the next update_previous_grad() writes it whole before any use);
        # an entry that is no parameter's state (a state-dict hook may write one) passes as it is.
        state["state"] = {
            i: {k: v for k, v in entry.items() if k != "previous_grad"} if isinstance(entry, dict) else entry
            for i, entry in state["state"].items()
        }
        if any(not group["is_approx"] for group in self.param_groups):
            self._write_previous_params(state)
        return state

    def _write_previous_params(self, state):
        """Exact MARS: 'previous_param' (x_{t-1}) in every tensor's state whichever protocol ran, so that any
        checkpoint has the keys of a fresh optimizer's state (torch.distributed.checkpoint loads into that
        template; torch creates it with a step(closure=None), which keeps x). Where no x_{t-1} was kept, the
        parameter stands in, and 'previous_param_kept' says so: load_state_dict drops it again."""
        params = [p for group in self.param_groups for p in group["params"]]
        for i, entry in state["state"].items():
            if isinstance(i, int) and isinstance(entry, dict) and entry:
                entry["previous_param_kept"] = "previous_param" in entry
                entry.setdefault("previous_param", params[i].detach())

    def load_state_dict(self, state_dict):
        # A setting a group was saved without (an older mars.py, or stripped) is this optimizer's; so are foreach,
        # fused and exchange_bucket_mib, how this process computes the step, whatever the checkpoint says.
        paths = [{key: group[key] for key in _PATH_KEYS} for group in self.param_groups]
        current = [
            {k: v for k, v in group.items() if k not in ("params", "param_names")} for group in self.param_groups
        ]
        saved_groups = [{**mine, **saved} for mine, saved in zip(current, state_dict["param_groups"])]
        super().load_state_dict({**state_dict, "param_groups": saved_groups})
        # Exact MARS's protocol restarts (torch's set_state_dict first takes a zero-lr step() to create the state).
        self._protocol.update(_new_protocol(), zero_grad_calls=self._protocol["zero_grad_calls"])
        for group, path in zip(self.param_groups, paths):
            group.update(path)
            group["last_grad_dtype"] = _dtype_by_name(group["last_grad_dtype"])
            for p in group["params"]:
                if not self.state.get(p, {}).pop("previous_param_kept", True):  # the parameter stood in: none kept
                    self.state[p].pop("previous_param")
        self._lr_1d_seen[:] = [_lr_1d_left(group) for group in self.param_groups]  # the groups are the checkpoint's now
        # Optimizer.load_state_dict casts every state tensor to its parameter's dtype and leaves 'step' where it
        # was saved; MARS keeps some in another dtype (float16 parameters' m and v, last_grad_dtype) and every step
        # count on its parameter's device.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params):
            saved = state_dict["state"].get(i)
            for key, value in saved.items() if isinstance(saved, dict) else ():
                if key == "step":
                    self.state[p][key] = torch.as_tensor(value, dtype=torch.float32, device=p.device)
                elif torch.is_tensor(value) and value.dtype != p.dtype and key in self.state[p]:
                    self.state[p][key] = value.to(device=p.device, copy=True)

    def zero_grad(self, set_to_none=True):
        """As torch's; also counted, so that step(closure) in exact mode can tell whether the closure zeroes the
        gradients itself."""
        self._protocol["zero_grad_calls"] += 1
        super().zero_grad(set_to_none=set_to_none)

    # ---------------------------------------------------------------------------------------------------
    # Exact MARS. The step is approximate MARS's (it reads g_{t-1} from 'last_grad' and leaves g_t there); exact
    # MARS differs only in what 'last_grad' holds when the next step starts: ∇f(x_{t-1}, ξ_t), put there either by
    # the hand-written protocol (update_previous_grad stores it one step ahead, update_last_grad installs it) or by
    # step(closure) (_look_ahead_by_closure evaluates the closure at x_{t-1}, kept as 'previous_param').

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
                if p.grad is None or not _takes_mars(p, group):
                    continue
                _check_dense(p.grad)
                state = self.state[p]
                if "previous_grad" not in state:
                    state["previous_grad"] = torch.empty_like(p.grad, dtype=_last_grad_dtype(group, p))
                scale = 1.0 if inverse_scale is None else inverse_scale
                torch.mul(_local(p.grad), scale, out=_local(state["previous_grad"]))  # elementwise: on shards
                stored.append(p)
        if inverse_scale is not None:
            self._keep_finite_look_ahead(stored)
        # Mutated in place, never rebound: a wrapper that forwards attribute reads here (Lightning's
        # LightningOptimizer) then shares the protocol with this optimizer.
        self._protocol["look_ahead"].update(stored)
        self._protocol["look_ahead_called"] = True

    def _keep_finite_look_ahead(self, params):
        """Where any stored look-ahead gradient on a device is not finite, every one on that device (as a
        GradScaler skips a whole step) falls back to the one stored before it (before the first, to zero)."""
        by_device = {}
        for p in params:
            by_device.setdefault(p.device, []).append(p)
        for same_device in by_device.values():
            states = [self.state[p] for p in same_device]
            buffers = [_local(state["previous_grad"]) for state in states]
            # The max-norm is finite exactly when every entry is (and cannot overflow); an empty shard has none.
            nonempty = [buffer for buffer in buffers if buffer.numel()]
            finite = torch.ones((), dtype=torch.bool, device=buffers[0].device)
            if nonempty:
                finite = torch.stack(torch._foreach_norm(nonempty, ord=math.inf)).isfinite().all()
            if any(map(_is_dtensor, same_device)):  # every rank that holds a shard of one decides alike
                finite = _sharded_step().on_every_shard(finite, same_device)
            for state, buffer in zip(states, buffers):
                fallback = state.get("last_grad")
                if fallback is None:
                    fallback = torch.zeros((), dtype=buffer.dtype, device=buffer.device)
                torch.where(finite, buffer, _local(fallback), out=buffer)

    @torch.no_grad()
    def update_last_grad(self):
        """Exact MARS: after step(), make the stored look-ahead gradient the g_{t-1} of the next step. A tensor
        without one keeps its own gradient of the step, which the step left in 'last_grad' (as approximate MARS)."""
        protocol = self._protocol
        if not any(not group["is_approx"] for group in self.param_groups):
            return
        if not protocol["look_ahead"]:
            protocol["look_ahead_called"] = False
            if not protocol["last_grad_pending"]:  # no MARS tensor stepped (1-D only, a ZeRO-1 share without one,
                return  # or a step(closure), which needs no look-ahead)
            raise RuntimeError(
                "exact MARS (is_approx=False): update_last_grad() found no look-ahead gradient; call "
                "update_previous_grad() after the backward pass on the next batch, before step()"
            )
        for p in protocol["look_ahead"]:
            state = self.state[p]
            if "last_grad" in state:  # swap the buffers: the old g_{t-1} is overwritten next time
                state["last_grad"], state["previous_grad"] = state["previous_grad"], state["last_grad"]
            else:
                state["last_grad"] = state.pop("previous_grad")
        protocol["look_ahead"].clear()
        protocol["look_ahead_called"] = False
        protocol["last_grad_pending"] = False

    def _look_ahead_by_closure(self, closure, params, current):
        """Exact MARS through a closure: g_{t-1} = ∇f(x_{t-1}, ξ_t) from closure() with every parameter set back to
        its 'previous_param' (DTensors shard by shard), into 'last_grad'; then closure() at x_t (`current`), whose
        loss is returned. Nothing changes if the closure raises or adds to gradients accumulated before step()."""
        protocol, states = self._protocol, self.state
        earlier = [p for p in params if "previous_param" in states.get(p, {})]
        earlier_current = [x for p, x in zip(params, current) if "previous_param" in states.get(p, {})]
        held = [p.grad for p in params]  # restored if the closure turns out to accumulate into them

        def give_back_the_gradients():
            for p, g in zip(params, held):
                p.grad = g

        def call(at_previous):
            for p in params:
                p.grad = None
            calls = protocol["zero_grad_calls"]
            try:
                if at_previous:
                    _copy_shards(earlier, [states[p]["previous_param"] for p in earlier])
                with torch.enable_grad():
                    loss = closure()
            except BaseException:
                give_back_the_gradients()
                raise
            finally:
                if at_previous:
                    _copy_shards(earlier, earlier_current)
            if all(p.grad is None for p in params):
                give_back_the_gradients()
                raise RuntimeError(_CLOSURE_WITHOUT_GRADIENT)
            if protocol["zero_grad_calls"] == calls and any(g is not None for g in held):
                give_back_the_gradients()
                raise RuntimeError(_CLOSURE_ACCUMULATES)
            return loss

        if earlier:
            call(at_previous=True)
            for group in self.param_groups:
                for p in group["params"] if not group["is_approx"] else ():
                    if p.grad is not None and "last_grad" in states.get(p, {}) and _takes_mars(p, group):
                        _check_dense(p.grad)
                        _local(states[p]["last_grad"]).copy_(_local(p.grad))
        return call(at_previous=False)

    # ---------------------------------------------------------------------------------------------------
    # The step.

    def _parts_of(self, group, lr_1d):
        """The group's tensors with a gradient as the parts mars() steps: those MARS handles, and the AdamW part.
        State is allocated at a tensor's first step (m and v in float32 for float16 parameters: docs/mars.md)."""
        handled, rest = [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            _check_dense(p.grad)
            is_mars = _takes_mars(p, group)
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                moment_dtype = torch.float32 if p.dtype == torch.float16 else p.dtype
                state["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
                if not is_mars or _rule(p, group["mars_type"]) == "adamw":
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(
                            p, dtype=moment_dtype, memory_format=torch.preserve_format
                        )
                if is_mars and "last_grad" not in state:
                    # No previous gradient at t = 1: g_0 := g_1 makes the correction zero (c_1 = g_1).
                    state["last_grad"] = p.grad.to(_last_grad_dtype(group, p), copy=True)
            (handled if is_mars else rest).append(p)
        flags = {key: group[key] for key in _PATH_KEYS}
        mars_numbers = dict(lr=_scalar(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"])
        mars_numbers.update(weight_decay=group["weight_decay"], gamma=group["gamma"], eps_uncorrected=False)
        adamw_numbers = dict(lr=lr_1d, beta1=group["betas_1d"][0], beta2=group["betas_1d"][1], eps=group["eps"])
        adamw_numbers.update(
            weight_decay=group["weight_decay_1d"], gamma=0.0, eps_uncorrected=group["eps_1d_uncorrected"]
        )
        return [
            _Part.of(self.state, params, rules, numbers, **flags)
            for params, rules, numbers in (
                (handled, [_rule(p, group["mars_type"]) for p in handled], mars_numbers),
                (rest, None, adamw_numbers),
            )
            if params
        ]

    def _live_lr_1d(self, index, group):
        """The 1-D lr of this step, group['lr'] × group['lr_1d_factor'], after taking in what was written into
        lr_1d or lr_1d_factor since the last step (docs/mars.md, "Parameter groups"); written back into the group."""
        seen = self._lr_1d_seen[index]
        factor_written = not _unchanged(group["lr_1d_factor"], seen["lr_1d_factor"])
        lr_1d_written = not _unchanged(group["lr_1d"], seen["lr_1d"]) and not _restates_peak(group)
        lr, lr_1d, factor = _scalar(group["lr"]), _scalar(group["lr_1d"]), _scalar(group["lr_1d_factor"])
        if lr_1d_written and factor_written:
            if not _equal_to_rounding(lr_1d, lr * factor):
                raise ValueError(
                    f"parameter group {index}: lr_1d={lr_1d!r} and lr_1d_factor={factor!r} were both written and "
                    f"disagree at lr={lr!r} (the 1-D lr is lr × lr_1d_factor); write one of them"
                )
        elif lr_1d_written:
            if not torch.is_tensor(lr) and lr == 0:
                raise ValueError(
                    f"parameter group {index}: lr_1d={lr_1d!r} was written while lr is 0, so the ratio lr_1d / lr "
                    "the 1-D lr follows is undefined; write lr_1d_factor (the 1-D lr is lr × lr_1d_factor)"
                )
            factor = lr_1d / lr
        live = lr * factor
        group["lr_1d"], group["lr_1d_factor"] = live, factor
        self._lr_1d_seen[index] = {"lr_1d": live, "lr_1d_factor": factor}
        return live

    @torch.no_grad()
    def step(self, closure=None):
        """One MARS step; returns closure()'s loss when a closure is given (exact MARS: see the class docstring)."""
        protocol = self._protocol
        exact = any(not group["is_approx"] for group in self.param_groups)
        hand_written = protocol["look_ahead_called"]  # update_previous_grad() supplies g_{t-1}
        if protocol["last_grad_pending"] and (hand_written or closure is None):
            raise RuntimeError(_STALE_LOOK_AHEAD if hand_written else _NO_SECOND_GRADIENT)
        if len(self._lr_1d_seen) != len(self.param_groups):  # groups installed without add_param_group
            self._lr_1d_seen[:] = [_lr_1d_left(group) for group in self.param_groups]
        for group in self.param_groups:  # everything a scheduler or a user may have written, before any change
            _validate(group, at_step=True)
        lrs_1d = [self._live_lr_1d(index, group) for index, group in enumerate(self.param_groups)]
        # x_t is kept as the next step's x_{t-1} unless the hand-written protocol runs: the closure route needs it,
        # and a first step with neither (torch's zero-lr step that creates the state to load a checkpoint into)
        # keeps the state's keys those of the closure route. Through the protocol it would be stale: dropped.
        keeps_x = exact and not hand_written
        if keeps_x:
            movable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
            current = [p.detach().clone(memory_format=torch.preserve_format) for p in movable]
        elif exact:
            for entry in self.state.values():
                if isinstance(entry, dict):
                    entry.pop("previous_param", None)
        if keeps_x and closure is not None and movable:
            loss = self._look_ahead_by_closure(closure, movable, current)
        else:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
        for group in self.param_groups:  # fused=True: where the kernel runs, as torch's fused optimizers check
            if group["fused"] and not torch.compiler.is_compiling():
                for device, dtype in {(p.device, p.dtype) for p in group["params"] if p.grad is not None}:
                    _fused_kernel().check_device(device, dtype)
        parts, stepped_exact = [], False
        for group, lr_1d in zip(self.param_groups, lrs_1d):
            group_parts = self._parts_of(group, lr_1d)
            parts += group_parts
            stepped_exact |= not group["is_approx"] and any(part.last_grads is not None for part in group_parts)
        mars(parts)
        if keeps_x:
            for p, x in zip(movable, current):
                if p.grad is not None or self.state.get(p):
                    self.state[p]["previous_param"] = x
        # Unless a closure gave this step its g_{t-1}, the next one needs update_last_grad() or a closure.
        protocol["last_grad_pending"] = stepped_exact and not (keeps_x and closure is not None and movable)
        return loss


_NO_SECOND_GRADIENT = (
    "exact MARS (is_approx=False) needs a second gradient each step, ∇f(x_{t-1}, ξ_t), and step() was called "
    "again without a closure, without update_previous_grad() and update_last_grad(). Either pass step() a "
    "closure that zeroes the gradients, runs the forward pass on the current batch and calls backward "
    "(Lightning's automatic optimization does), or call update_previous_grad() after a backward pass on the next "
    "batch before step() and update_last_grad() after it, or use is_approx=True -- the one choice where a "
    "framework calls step() alone (Hugging Face's Trainer, through accelerate's AcceleratedOptimizer, which does "
    "not forward update_previous_grad either)"
)

_STALE_LOOK_AHEAD = (
    "exact MARS (is_approx=False): step() was called again without update_last_grad() after the previous step(), "
    "so the correction would use a stale gradient; call update_last_grad() after every step() (or pass step() a "
    "closure instead of the hand-written protocol)"
)

_CLOSURE_WITHOUT_GRADIENT = (
    "exact MARS (is_approx=False) through step(closure): the closure computed no gradient, so it cannot give "
    "the second gradient exact MARS needs (Lightning's manual optimization passes step() such a closure). "
    "Pass a closure that zeroes the gradients, runs the forward pass on the current batch and calls backward, "
    "or call update_previous_grad() after a backward pass on the next batch before step() and "
    "update_last_grad() after it, or use is_approx=True"
)

_CLOSURE_ACCUMULATES = (
    "exact MARS (is_approx=False) through step(closure): the closure did not call optimizer.zero_grad() and "
    "gradients were already there, so it adds to gradients accumulated before step() (Lightning's "
    "accumulate_grad_batches > 1 does), and exact MARS cannot evaluate those at the previous parameters. Zero "
    "the gradients in the closure with optimizer.zero_grad(), use the hand-written protocol "
    "(update_previous_grad / step / update_last_grad), or is_approx=True"
)


def _callers_level():
    """warnings.warn's stacklevel, from the function that calls this, of the first frame outside mars.py and
    torch.optim: the user's MARS(...) or add_param_group(...) line, which the warning then names."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (
        frame.f_code.co_filename == __file__ or "torch/optim/" in frame.f_code.co_filename.replace("\\", "/")
    ):
        frame, level = frame.f_back, level + 1
    return level


def _new_protocol():
    """Exact MARS's bookkeeping, one dict mutated in place (a wrapper that forwards attribute reads shares it):
    look_ahead, the parameters update_previous_grad() stored a gradient for since update_last_grad(); whether it
    was called since (look_ahead_called); whether the last step() left the next one no g_{t-1} (last_grad_pending);
    and a count of zero_grad() calls (step(closure) checks that the closure zeroes the gradients)."""
    return {"look_ahead": set(), "look_ahead_called": False, "last_grad_pending": False, "zero_grad_calls": 0}


# The live 1-D lr (MARS._live_lr_1d): what a write into the group looks like.


def _lr_1d_left(group):
    """The group's lr_1d and lr_1d_factor, as a step leaves them there (MARS._lr_1d_seen holds one per group)."""
    return {"lr_1d": group["lr_1d"], "lr_1d_factor": group["lr_1d_factor"]}


def _unchanged(value, left):
    """Whether a group value is the one the last step left (tensors: the same object; nothing is read back)."""
    if value is left:
        return True
    return not torch.is_tensor(value) and not torch.is_tensor(left) and value == left


def _equal_to_rounding(a, b):
    """Whether two 1-D lrs are the same number to rounding (tensors are not read back: taken as agreeing)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return True
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def _restates_peak(group):
    """Whether group['lr_1d'] is lr_1d_factor × initial_lr, the 1-D lr at the peak lr (numbers only)."""
    peak, lr_1d, factor = group.get("initial_lr"), group["lr_1d"], group["lr_1d_factor"]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (peak, lr_1d, factor))
    return numbers and peak > 0 and lr_1d_factor(peak, lr_1d) == factor


def lr_1d_factor(lr, lr_1d):
    """The 1-D tensors' lr as a multiple of the group's: lr_1d / lr at the peak lr (1 where lr is 0)."""
    return lr_1d / lr if lr else 1.0


# ---------------------------------------------------------------------------------------------------
# Settings.

# timm's and pytorch_optimizer's names for their MARS types, refused here: the same rules, other defaults
# (docs/mars.md, "Coming from timm or pytorch_optimizer").
_OTHER_LIBRARIES_TYPES = {"adamw": "mars-adamw", "lion": "mars-lion", "shampoo": "mars-shampoo"}


def _validate(hp, at_step=False):
    """ValueError naming the first invalid hyperparameter of hp (a group, or the constructor's defaults).

    at_step: the check step() makes of a live group, which reads no tensor's value (no host sync): a tensor lr,
    lr_1d or lr_1d_factor is checked for its size and dtype only."""

    def invalid(name, why):
        return ValueError(f"invalid {name}: {hp[name]!r} ({why})")

    def is_number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not (is_number(hp["eps"]) and math.isfinite(hp["eps"]) and hp["eps"] > 0):
        raise invalid("eps", "must be a finite number > 0: it keeps the AdamW and Newton-Schulz divisions finite")
    for name in ("lr", "lr_1d", "lr_1d_factor", "weight_decay", "weight_decay_1d", "gamma"):
        value = hp.get(name, 0.0)  # no lr_1d_factor before add_param_group computes it
        if name in ("lr", "lr_1d", "lr_1d_factor") and torch.is_tensor(value):
            if value.numel() != 1 or not value.is_floating_point():
                raise invalid(name, "a Tensor lr must be 1-element and floating point")
            if at_step:
                continue
        elif not is_number(value):
            raise invalid(name, "must be a finite number >= 0")
        if not 0.0 <= float(value) < math.inf:
            raise invalid(name, "must be a finite number >= 0")
    for name in ("amsgrad", "is_approx", "optimize_1d", "eps_1d_uncorrected"):
        if not isinstance(hp[name], bool):
            raise invalid(name, "must be True or False")
    for name in ("betas", "betas_1d"):
        betas = hp[name]
        if not (
            isinstance(betas, (tuple, list)) and len(betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in betas)
        ):
            raise invalid(name, "must be two numbers in [0, 1)")
    mars_type = hp["mars_type"]
    if mars_type not in MARS_TYPES:
        why = f"allowed: {', '.join(MARS_TYPES)}"
        if isinstance(mars_type, str) and mars_type in _OTHER_LIBRARIES_TYPES:
            why += (
                f"; {mars_type!r} is timm's and pytorch_optimizer's name. {_OTHER_LIBRARIES_TYPES[mars_type]!r} is the "
                "same rule, but their MARS's defaults are not this one's (betas, betas_1d, the 1-D lr and weight "
                "decay, which tensors take MARS): docs/mars.md, 'Coming from timm or pytorch_optimizer', gives the "
                "settings that reproduce theirs"
            )
        raise invalid("mars_type", why)
    if at_step:  # what only the constructor's choice decides (routing, paths) is not rewritten by schedules
        return
    if hp["routing"] not in ROUTINGS:
        raise invalid("routing", f"allowed: {', '.join(ROUTINGS)}")
    if hp["routing"] == "none" and hp["optimize_1d"]:
        raise ValueError(
            'invalid routing="none" with optimize_1d=True: optimize_1d gives every tensor the MARS rule, '
            '"none" gives none of them; set one of the two'
        )
    dtype = hp["last_grad_dtype"]
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise invalid("last_grad_dtype", "must be None or a floating torch.dtype")
    for name in ("foreach", "fused"):
        if not (hp[name] is None or isinstance(hp[name], bool)):
            raise invalid(name, "must be None, True or False")
    if hp["fused"] and hp["foreach"]:
        raise ValueError("invalid fused=True with foreach=True: `fused` and `foreach` cannot be `True` together")
    bucket = hp["exchange_bucket_mib"]
    if not (bucket is None or (is_number(bucket) and bucket > 0)):
        raise invalid("exchange_bucket_mib", "must be None or a number of MiB > 0; math.inf exchanges all at once")


def _check_dense(grad):
    if grad.is_sparse:
        raise RuntimeError(
            "MARS does not support sparse gradients (e.g. nn.Embedding(sparse=True)); use dense gradients"
        )


def _takes_mars(p, group):
    """Whether p takes the MARS rule in this group (else the AdamW part): docs/mars.md, "Routing"."""
    routing = group["routing"]
    return group["optimize_1d"] or (routing != "none" and (p.ndim == 2 or (routing == "nd" and p.ndim > 2)))


def _rule(p, mars_type):
    """The update direction a MARS-handled tensor takes: "adamw", "lion", or one of NEWTON_SCHULZ_RULES
    (mars-shampoo's "newton-schulz", mars-m's "newton-schulz-rms")."""
    if mars_type == "mars-lion":
        return "lion"
    if mars_type in ("mars-shampoo", "mars-m") and p.ndim == 2:
        return NEWTON_SCHULZ_RULES[mars_type == "mars-m"]
    return "adamw"  # mars-adamw's, and the other tensors of mars-shampoo and mars-m: Newton-Schulz cannot take them


def update_rule(p, group):
    """How MARS updates p in this parameter group: None for the AdamW part (the tensors MARS does not handle),
    else its rule: "adamw", "lion", or one of NEWTON_SCHULZ_RULES."""
    return _rule(p, group["mars_type"]) if _takes_mars(p, group) else None


def _scalar(value):
    """A 1-element tensor lr as a 0-d tensor (a view: no host read); numbers as they are."""
    return value.reshape(()) if torch.is_tensor(value) and value.ndim else value


def _opmath(dtype):
    """The dtype arithmetic on `dtype` tensors is carried out in: float32 for the half types."""
    return torch.promote_types(dtype, torch.float32)


def _dtype_by_name(dtype):
    """A last_grad_dtype as state_dict() writes it ("bfloat16") or as given (a torch.dtype, or None)."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _last_grad_dtype(group, p):
    """The dtype p's g_{t-1} is stored in. By name where a wrapper copied a checkpoint's group values into the
    group (torch's ZeroRedundancyOptimizer does at every step)."""
    return _dtype_by_name(group["last_grad_dtype"]) or p.dtype


def _lr_on(lr, device):
    """lr as the kernels take it: a number as it is, a tensor on `device` (copied without a host sync)."""
    if torch.is_tensor(lr) and lr.device != device:
        return lr.to(device, non_blocking=True)
    return lr


# ---------------------------------------------------------------------------------------------------
# The functional step: mars() picks the path; the kernels take parallel lists of tensors.


class _Part(NamedTuple):
    """Tensors of one group that step alike, as parallel lists (one entry per tensor), with the numbers of their
    rule and the group's path flags: what mars() dispatches. last_grads and rules are None for the AdamW part
    (AdamW on the raw gradient); exp_avg_sqs and max_exp_avg_sqs hold None where a tensor keeps no such state
    (the Lion and Newton-Schulz rules; amsgrad off)."""

    params: list
    grads: list
    last_grads: list | None
    exp_avgs: list
    exp_avg_sqs: list
    max_exp_avg_sqs: list
    steps: list
    rules: list | None
    numbers: dict  # lr, beta1, beta2, eps, weight_decay, gamma, eps_uncorrected
    foreach: bool | None
    fused: bool | None
    exchange_bucket_mib: float | None = None  # the sharded step's (mars_sharded.py)

    @classmethod
    def of(cls, states, params, rules, numbers, **paths):
        state = [states[p] for p in params]
        last_grads = None if rules is None else [s["last_grad"] for s in state]
        moments = [[s.get(key) for s in state] for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")]
        steps = [s["step"] for s in state]
        return cls(params, [p.grad for p in params], last_grads, *moments, steps, rules, numbers, **paths)

    @property
    def tensors(self):
        """The kernels' positional arguments: params, grads, last_grads, the moments, steps, rules."""
        return self[:8]

    def subset(self, indices):
        return self._replace(
            **{f: None if v is None else [v[i] for i in indices] for f, v in zip(self._fields, self.tensors)}
        )


def mars(parts):
    """One MARS step of `parts` (every group's _Part: its MARS tensors and its AdamW part), each on its path:

    - DTensor parameters (FSDP2, HSDP): mars_sharded.step, all such parts together (one norm all-reduce a step);
    - fused=True: mars_triton.step, the Triton kernel, for every tensor whose tensors share one dense layout, all
      parts together (two launches per device and dtype); the rest of a part as foreach says;
    - foreach=False, or a step traced by torch.compile (whose fused kernels cannot be traced; inductor fuses the
      reference's plain ops): _single_tensor_mars, the reference;
    - otherwise: _multi_tensor_mars.

    Every path but the kernel, which counts its own, starts from step counts advanced here in one call.
    """
    compiling = torch.compiler.is_compiling()
    sharded, fused, local = [], [], []
    for part in parts:
        if any(map(_is_dtensor, part.params)):
            sharded.append(part)
        else:
            (fused if part.fused and not compiling else local).append(part)
    if fused:
        local += _fused_kernel().step(fused, newton_schulz=_newton_schulz_update, is_dense=_is_dense)
    steps = [step for part in sharded + local for step in part.steps]
    if steps:  # on the device: the kernels read the step counts from there
        torch._foreach_add_(steps, 1)
    if sharded:
        _sharded_step().step(sharded, kernels=sys.modules[__name__])
    for part in local:
        reference = part.foreach is False or compiling
        (_single_tensor_mars if reference else _multi_tensor_mars)(*part.tensors, **part.numbers)


def _fused_kernel():
    """mars_triton, the module of fused=True's Triton kernel, imported only where fused=True is asked for or runs:
    mars.py alone steps on every other path."""
    return _sibling(
        "mars_triton",
        "fused=True needs mars_triton.py beside mars.py (pip install <this repository> installs both); without "
        "it, use fused=None (the default path)",
    )


def _sharded_step():
    """mars_sharded, the module of the DTensor (FSDP2, HSDP) step, imported only when DTensor parameters are
    given or step: mars.py alone steps every unsharded parameter."""
    return _sibling(
        "mars_sharded",
        "DTensor (FSDP2, HSDP) parameters need mars_sharded.py beside mars.py (pip install <this repository> "
        "installs both); copy it there, or step unsharded parameters",
    )


def _sibling(name, missing):
    """The module `name` found beside this file: on the path, or in the package mars.py was copied into
    (myproject/optim/mars.py: myproject.optim.<name>); ValueError(missing) where it is not there."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
    if __package__:
        try:
            return importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__package__}.{name}":
                raise
    raise ValueError(missing)


def _by_device_and_dtype(params, *lists):
    """(device, [params, *lists] restricted to the parameters of one device and dtype) for each, in first-seen
    order; a list that is None stays None."""
    indices = {}
    for i, p in enumerate(params):
        indices.setdefault((p.device, p.dtype), []).append(i)
    for (device, _), chosen in indices.items():
        yield device, [None if lst is None else [lst[i] for i in chosen] for lst in (params, *lists)]


# ---------------------------------------------------------------------------------------------------
# Single-tensor reference: the rule of the class docstring, line by line.


def _single_tensor_mars(
    params, grads, last_grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, rules, *, lr, beta1, beta2, eps,
    weight_decay, gamma, eps_uncorrected,
):  # fmt: skip
    for i, p in enumerate(params):
        device_lr = _lr_on(lr, p.device)
        (step_size,), (bias_correction2_rsqrt,) = _adam_scalars([steps[i]], device_lr, beta1, beta2, p.dtype)
        moments = exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i]
        scalars = device_lr, step_size, bias_correction2_rsqrt
        numbers = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        if last_grads is None:
            _adamw_tensor_step(p, grads[i], *moments, *scalars, **numbers, eps_uncorrected=eps_uncorrected)
        else:
            _mars_tensor_step(p, grads[i], last_grads[i], *moments, *scalars, rule=rules[i], **numbers, gamma=gamma)


def _mars_tensor_step(
    p, g, g_prev, m, v, v_max, lr, step_size, bias_correction2_rsqrt, *, rule, beta1, beta2, eps, weight_decay, gamma
):
    """One MARS step of one tensor (g_prev ← g at the end); v, v_max are None where the rule keeps none, and
    step_size, bias_correction2_rsqrt are _adam_scalars' (used by the AdamW rule)."""
    g = g.to(m.dtype)  # float16 parameters: c̃ in float32, as m and v (its small entries underflow float16)
    c = g + gamma * beta1 / (1 - beta1) * (g - g_prev)  # c_t, the variance-reduced gradient
    c = c / torch.linalg.vector_norm(c, dtype=_opmath(c.dtype)).clamp_min(1.0)  # c̃_t: ‖c̃_t‖ <= 1
    _rule_step(p, c, m, v, v_max, lr, step_size, bias_correction2_rsqrt, rule, beta1, beta2, eps, weight_decay)
    g_prev.copy_(g)


def _rule_step(p, c, m, v, v_max, lr, step_size, bias_correction2_rsqrt, rule, beta1, beta2, eps, weight_decay):
    """The preconditioned update of a tensor from its clipped c̃_t: AdamW's, Lion's sign, or Newton-Schulz."""
    if rule == "adamw":
        _adamw_tensor_step(
            p, c, m, v, v_max, lr, step_size, bias_correction2_rsqrt,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        )  # fmt: skip
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


def _multi_tensor_mars(
    params, grads, last_grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, rules, *, lr, beta1, beta2, eps,
    weight_decay, gamma, eps_uncorrected,
):  # fmt: skip
    numbers = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    lists = params, grads, last_grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, rules
    for device, (p, g, g_prev, m, v, v_max, step, rule) in _by_device_and_dtype(*lists):
        device_lr = _lr_on(lr, device)
        if g_prev is None:  # the AdamW part
            _foreach_adamw(p, g, m, v, v_max, step, device_lr, **numbers, eps_uncorrected=eps_uncorrected)
            continue
        c = _corrected_gradients(g, g_prev, m[0].dtype, beta1=beta1, gamma=gamma)
        norms = torch._foreach_norm(c, dtype=_opmath(c[0].dtype))
        _clipped_update(p, g, g_prev, m, v, v_max, step, rule, c, norms, device_lr, **numbers)


def _corrected_gradients(grads, last_grads, dtype, *, beta1, gamma):
    """c_t = g + γβ1/(1-β1) (g - g_prev) of each tensor (one device and dtype), in `dtype` (m's)."""
    k = gamma * beta1 / (1 - beta1)
    # g_prev is replaced by g at the end of the step, so its buffer can hold c meanwhile: the step's one
    # gradient-sized buffer, and no allocation -- unless g_prev is stored in another dtype than c's.
    c = last_grads if last_grads[0].dtype == dtype else [g_prev.to(dtype, copy=True) for g_prev in last_grads]
    torch._foreach_lerp_(c, [g.to(dtype) for g in grads], 1 + k)  # g + k (g - g_prev)
    return c


def _clipped_update(
    params, grads, last_grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, rules, c, norms, lr, *, beta1, beta2,
    eps, weight_decay, newton_schulz=None,
):  # fmt: skip
    """The rest of the step from c_t and its norms: clip, each rule, and g_prev ← g. newton_schulz(params,
    momenta, lr, rule, ...) updates the Newton-Schulz rules' tensors once m is updated."""
    torch._foreach_clamp_min_(norms, 1.0)
    torch._foreach_div_(c, norms)  # clip to Frobenius norm <= 1
    for rule in ("lion", *NEWTON_SCHULZ_RULES, "adamw"):
        picked = [i for i, r in enumerate(rules) if r == rule]
        if not picked:
            continue
        p, x, m, v, v_max, step = (
            [lst[i] for i in picked] for lst in (params, c, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        )
        if rule == "adamw":
            _foreach_adamw(p, x, m, v, v_max, step, lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
            continue
        torch._foreach_lerp_(m, x, 1 - beta1)  # m_t = β1 m_{t-1} + (1 - β1) c̃_t
        if rule == "lion":
            torch._foreach_copy_(x, m)
            torch._foreach_sign_(x)
            _foreach_apply_update(p, x, lr, weight_decay)
        else:
            (newton_schulz or _newton_schulz_update)(p, m, lr, rule, beta1=beta1, eps=eps, weight_decay=weight_decay)
    torch._foreach_copy_(last_grads, grads)


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


def _newton_schulz_update(params, momenta, lr, rule, *, beta1, eps, weight_decay):
    """A Newton-Schulz rule on 2-D tensors (m already updated), one batched Newton-Schulz per shape."""
    by_shape = {}
    for p, m in zip(params, momenta):
        by_shape.setdefault(tuple(p.shape), []).append((p, m))
    for pairs in by_shape.values():
        u = _orthogonal_direction(torch.stack([m for _, m in pairs]), rule, beta1=beta1, eps=eps)
        _foreach_apply_update([p for p, _ in pairs], list(u.unbind(0)), lr, weight_decay)


def _orthogonal_direction(m, rule, *, beta1, eps):
    """u_t of a Newton-Schulz rule for matrix m, or for a stack of same-shape matrices (leading dimension)."""
    divisor, eps, scale = _newton_schulz_terms(rule, m.shape, beta1=beta1, eps=eps)
    return newton_schulz(m if divisor is None else m / divisor, eps=eps) * scale


def _newton_schulz_terms(rule, shape, *, beta1, eps):
    """(what m is divided by first or None, Newton-Schulz's normaliser, the factor of its result) of a rule:

    newton-schulz (mars-shampoo): NS(m / (1-β1)) sqrt(max(1, rows/cols)), normaliser eps.
    newton-schulz-rms (mars-m): 0.2 sqrt(max(rows, cols)) NS(m), normaliser 1e-7, as MARS-M's reference code;
    NS divides m by its norm, so m needs no bias correction, and the factor gives the update AdamW's RMS.
    """
    rows, cols = shape[-2:]
    if rule == "newton-schulz":
        return 1 - beta1, eps, math.sqrt(max(1.0, rows / cols))
    return None, 1e-7, 0.2 * math.sqrt(max(rows, cols))


# Devices whose torch build has the fused AdamW kernel (torch.optim.AdamW(fused=True)'s).
_FUSED_ADAMW_DEVICES = ("cpu", "cuda", "mps", "xpu", "hpu")


def _foreach_adamw(
    params, xs, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, *, beta1, beta2, eps, weight_decay,
    eps_uncorrected=False,
):  # fmt: skip
    """AdamW on inputs xs: torch's fused kernel on the tensors it computes the reference's result on -- it walks
    each tensor's memory linearly, so every tensor must share p's dtype and strides and p fill its memory without
    gaps -- and the reference on the rest (all of them with eps_uncorrected, which the kernel cannot compute)."""
    takes = [
        not eps_uncorrected
        and params[i].device.type in _FUSED_ADAMW_DEVICES
        and _is_dense(params[i])
        and all(t.dtype == params[i].dtype and t.stride() == params[i].stride() for t in tensors if t is not None)
        for i, tensors in enumerate(zip(xs, exp_avgs, exp_avg_sqs, max_exp_avg_sqs))
    ]
    fused = [i for i, ok in enumerate(takes) if ok]
    if fused:
        p, x, m, v, v_max, step = (
            [lst[i] for i in fused] for lst in (params, xs, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        )
        amsgrad = v_max[0] is not None
        torch._fused_adamw_(
            p, x, m, v, v_max if amsgrad else [], step,
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=False,
        )  # fmt: skip
    rest = [i for i, ok in enumerate(takes) if not ok]
    if rest:
        step_sizes, bias_correction2_rsqrts = _adam_scalars(
            [steps[i] for i in rest], lr, beta1, beta2, params[rest[0]].dtype
        )
        for i, step_size, bias_correction2_rsqrt in zip(rest, step_sizes, bias_correction2_rsqrts):
            _adamw_tensor_step(
                params[i], xs[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i], lr, step_size,
                bias_correction2_rsqrt, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                eps_uncorrected=eps_uncorrected,
            )  # fmt: skip


def _is_dense(t):
    """Whether t's elements fill one block of memory without gaps or overlaps, in some dimension order: what torch's
    fused AdamW kernel needs here, and the Triton kernel too (mars() hands it to mars_triton.step)."""
    if t.is_contiguous():  # the common case, checked cheaply: this runs per tensor per step
        return True
    order = sorted(range(t.ndim), key=t.stride, reverse=True)
    return t.permute(order).is_contiguous()


# ---------------------------------------------------------------------------------------------------
# DTensor parameters (FSDP2, HSDP): what this file knows of them. Their step is mars_sharded.py's (_sharded_step);
# exact MARS's protocols act on each rank's shards, elementwise, with these helpers.


def _is_dtensor(t):
    """Whether t is a DTensor; False without a look while torch.distributed.tensor is not imported (then no
    DTensor exists, and a single-process step pays no import)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _local(t):
    """t's shard on this rank (the DTensor's local tensor, a view of it), or t itself (also None, or a rule)."""
    return t.to_local() if _is_dtensor(t) else t


def _copy_shards(targets, sources):
    """targets[i] ← sources[i] in place, shard by shard where they are DTensors (placed alike): DTensor has no
    sharding rule for torch._foreach_copy_, and the copy needs no communication."""
    torch._foreach_copy_([_local(t) for t in targets], [_local(s) for s in sources])
