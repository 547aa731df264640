"""MARS: Make vAriance Reduction Shine (Yuan et al. 2024, arXiv:2411.10438) as a torch optimizer, with the
authors' matrix-level instance MARS-M (Liu et al. 2025, arXiv:2510.21800).

Self-contained: imports nothing from this repository (torch only), so the file can be copied into any
project, or installed on its own (``pip install <this repository>``: the distribution mars-optimizer).

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
- DTensor parameters (FSDP2's ``fully_shard``, HSDP), last in this file: ``_sharded_mars`` /
  ``_sharded_adamw``, the multi-tensor rule on each rank's shards (whatever ``foreach`` says; ``fused=True``
  is refused). Only two things in the rule look at a whole tensor: c_t's clip, whose Frobenius norm comes from
  the shards' sums of squares in one all-reduce per step, and Newton-Schulz, which runs on the whole matrix at
  one owner rank per matrix (all-to-all there and back). Nothing here imports torch.distributed until a
  DTensor parameter steps.

Tests hold every path equal to the reference and the reference to a float64 transcription of the rule.
"""

import functools
import math
import sys
import warnings

import torch

__version__ = "0.1.0"

MARS_TYPES = ("mars-adamw", "mars-lion", "mars-shampoo", "mars-m")
# Which tensors take the MARS rule when optimize_1d=False: "2d" exactly the 2-D ones (the paper's code;
# convolution kernels and other N-D tensors get the AdamW rule), "nd" every tensor with 2 or more dims,
# "none" no tensor (a group of embeddings and head that trains with the AdamW part, as MARS-M's code does).
ROUTINGS = ("2d", "nd", "none")
# The rules whose direction is Newton-Schulz of m: mars-shampoo's and mars-m's (_orthogonal_direction).
_NEWTON_SCHULZ_RULES = ("newton-schulz", "newton-schulz-rms")

# Quintic Newton-Schulz coefficients (a, b, c) of the paper's MARS-Shampoo (the same as Muon's).
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz_dtype(device, dtype=torch.float32):
    """The dtype Newton-Schulz runs in by default on `device` for matrices of `dtype`.

    On CUDA the paper's code uses bfloat16, a tensor-core format there since compute capability 8 (A100). Older
    GPUs emulate bfloat16 at a fraction of their float16 speed, so they take float16, which also lands closer
    to the exact iteration: relative to a float64 Newton-Schulz of a GPT-2-sized momentum, float16 is 0.3% off
    and bfloat16 2.7% (docs/mars.md). CPUs without native bfloat16 matmuls run them several times
    slower than float32, so CPUs take float32 (float64 for float64 matrices)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.promote_types(dtype, torch.float32)
    if torch.version.hip or torch.cuda.get_device_properties(device).major >= 8:
        return torch.bfloat16
    return torch.float16


def newton_schulz(G, steps=5, eps=1e-7, dtype=None):
    """Approximate the orthogonal factor U Vᵀ of each matrix G = U S Vᵀ in G's last two dimensions.

    Each matrix is cast to `dtype` and divided by (its Frobenius norm + eps), so every singular value
    starts in [0, 1]; then `steps` quintic iterations X ← aX + b(XXᵀ)X + c(XXᵀ)²X push the singular values
    into roughly [0.7, 1.2]. The iteration runs on the wide orientation (Xᵀ when rows > cols) so XXᵀ is the
    smaller Gram matrix. Leading dimensions are a batch: a stack of same-shape matrices takes one batched
    matmul per product instead of one matmul per matrix. Returns G's dtype.

    dtype=None is newton_schulz_dtype(G.device, G.dtype): bfloat16 on GPUs that run it natively, as the paper's
    code; float16 on older GPUs (V100, T4), which only emulate bfloat16; float32 elsewhere (float64 for float64
    matrices).
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
    (biases, norm weights) decay at compared with the paper's code (see MARS's docstring, "Weight decay")."""


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

    Other tensors (with ``optimize_1d=False``): AdamW on the raw gradient with ``betas_1d``, ``eps``, weight
    decay ``weight_decay_1d`` and the 1-D lr η_t · ``lr_1d_factor`` (see "Live hyperparameters").
    ``amsgrad`` applies to these tensors too, as in the paper's code. Their AdamW adds eps to the
    bias-corrected sqrt(v̂), as torch.optim.AdamW; ``eps_1d_uncorrected=True`` adds it to sqrt(v) before
    the correction, as MARS-M's reference code: m̂ / (sqrt(v̂) + eps / sqrt(1-β2^t)).

    MARS-M (``mars_type="mars-m"``), as its reference code (MARS_M/optimizers/mars_m.py): Newton-Schulz
    normalises m itself (any factor of m cancels, so m is not bias-corrected) with its own normaliser 1e-7,
    and the factor 0.2 sqrt(max(rows, cols)) gives the update the RMS of an AdamW update (Liu et al. 2025,
    "Muon is Scalable for LLM Training"), so lr and weight decay are on AdamW's scale. Its reference trains
    the embeddings, the head and every 1-D tensor with the AdamW part at the same lr and weight decay:
    put those in a group with ``routing="none"``, lr_1d=lr and weight_decay_1d=weight_decay.

    Live hyperparameters. Every number in a group -- lr, lr_1d, lr_1d_factor, betas, betas_1d, eps,
    weight_decay, weight_decay_1d, gamma -- is read at each step: what a scheduler or a user writes there
    takes effect at the next step (checked then, before anything changes). The 1-D lr is a ratio of lr, as
    in the paper's code: ``group["lr_1d_factor"]`` (lr_1d / lr at construction) times ``group["lr"]``, so
    a schedule that writes only lr moves the 1-D lr along the same curve. Each step writes the 1-D lr it
    used into ``group["lr_1d"]``, which therefore reads the 1-D tensors' real lr. Writing into the group:

    - ``lr_1d_factor``: the ratio from the next step on.
    - ``lr_1d``: the 1-D lr of the next step; the ratio becomes lr_1d / lr, which later lr changes then
      scale as before. (lr must not be 0 then: write lr_1d_factor instead.) A written lr_1d equal to
      lr_1d_factor × ``initial_lr`` -- the peak pair a trainer writes back when it restores its settings,
      initial_lr being the peak lr torch's schedulers and this repository's trainer keep in the group --
      restates the ratio and changes nothing.
    - both, disagreeing at the current lr: ValueError.

    torch's OneCycleLR with ``cycle_momentum=True`` (its default) writes β1 into ``betas`` every step
    (0.85 to 0.95), which also scales the correction γβ1/(1-β1) by up to 3.3×; it does not know
    ``betas_1d``, which keeps its value unless you write it.

    Weight decay. ``weight_decay`` (λ above) is the MARS tensors' and ``weight_decay_1d`` the AdamW-rule
    tensors'. A parameter group that sets ``weight_decay`` but not ``weight_decay_1d`` -- nanoGPT's and
    Hugging Face's no-decay group of biases and norm weights, {"params": ..., "weight_decay": 0.0} -- gets
    its own weight_decay for those tensors too (group["weight_decay_1d"] says so), where the paper's code
    decays them at the constructor's weight_decay_1d (default 0.1) whatever the group says. Where the two
    readings differ (the values differ and the group has tensors that take the AdamW part) the constructor
    warns once per group (MARSWeightDecayWarning); setting weight_decay_1d in the group, as this
    repository's trainer does in every group, chooses explicitly and is taken as it is. The constructor's own
    weight_decay keyword does not change weight_decay_1d's default.

    Exact MARS (``is_approx=False``). g_{t-1} is ∇f(x_{t-1}, ξ_t): the current batch's gradient at the
    parameters before the previous step (approximate MARS, the default, takes the previous step's gradient
    ∇f(x_{t-1}, ξ_{t-1})). Two ways to supply it:

    - ``step(closure)``, where closure() zeroes the gradients (``optimizer.zero_grad()``), runs the forward
      pass on the current batch and calls backward, as torch's closures and Lightning's automatic
      optimization do. MARS calls it twice: first with every parameter of the optimizer set back to x_{t-1}
      (kept from the previous step in the state as 'previous_param'), which gives g_{t-1}, then at x_t, the
      call whose loss step() returns and whose gradient the step uses. The first step has no x_0 and calls
      it once (c_1 = g_1). The result equals the hand-written protocol below on the same batches (tests
      hold them bit for bit), for twice the forward and backward passes, as that protocol costs too; the
      closure's side effects (hooks, logging, dropout draws, batch-norm statistics) happen twice. The closure
      must compute the step's whole gradient: one that adds to gradients accumulated before step() (Lightning
      with accumulate_grad_batches > 1, where the stepping micro-batch's closure does not zero them) cannot
      be re-evaluated at x_{t-1}, and step() raises instead of mixing the two. Every parameter the loss
      depends on and that moves must be in this optimizer (not ZeRO-1-sharded: each rank would set back only
      the parameters it steps; FSDP2's DTensor parameters are all in it, each rank setting back its shards),
      and a GradScaler cannot be used (torch refuses closures under one).
    - the hand-written protocol: after a backward pass on the NEXT batch at the current parameters call
      :meth:`update_previous_grad`, then backward on the current batch, :meth:`step`, and
      :meth:`update_last_grad`. With update_previous_grad() called, a closure given to step() is called once,
      as by any optimizer (Lightning's manual optimization passes one that computes nothing; a closure that
      computes no gradient is refused in the closure route above). A step() without update_last_grad() after
      the previous one, or an update_last_grad() without a stored look-ahead gradient, raises instead of
      correcting with a stale gradient. Under a GradScaler pass ``inverse_scale=1 / scaler.get_scale()`` to
      update_previous_grad: it sees the gradient before scaler.step() unscales it (and a non-finite one is
      not kept). A tensor with a gradient in step() but none in the look-ahead pass takes its own gradient as
      g_{t-1}.

    A second step() with neither a closure nor the protocol's calls raises, saying so: there is no second
    gradient (the first step needs none, c_1 = g_1). That is what a framework that calls step() alone
    (Hugging Face's Trainer, through accelerate) gets: use is_approx=True there.

    Difference from the paper's reference code (MARS's and MARS-M's): there ``last_grad`` starts at zero, so
    its first step uses c_1 = (1 + γβ1/(1-β1)) g_1. Here the correction is zero at t = 1 (c_1 = g_1), as
    x_1 = x_0 in Algorithm 1 (MARS) and Algorithm 2 (MARS-M) implies. Once ‖g_1‖ >= 1 the clip makes the
    two identical.

    Sharded parameters (DTensors: FSDP2's ``fully_shard``, HSDP) take the same rule on each rank's shards,
    with each tensor's clip norm and Newton-Schulz computed on the whole tensor (the section at the end of
    this file); every rule, exact MARS both ways, last_grad_dtype and torch.distributed.checkpoint's
    resharding work there, and ``fused=True`` is refused.

    Other libraries' MARS: timm's ``Mars`` and pytorch_optimizer's ``MARS`` name their types "adamw",
    "lion" (and "shampoo"); those names are refused here, because their defaults differ from these (betas,
    betas_1d, the 1-D weight decay and lr, which tensors take MARS): docs/mars.md has the settings that
    reproduce each.

    State per tensor: 'step' (a float32 0-d tensor on the parameter's device, advanced on the device, so
    no step reads a number back from it), 'exp_avg' (m), 'exp_avg_sq' (v, where the rule uses it),
    'max_exp_avg_sq' (amsgrad), 'last_grad' (g_{t-1}, the optimizer's own copy, never an alias of .grad;
    MARS-handled tensors only) and, in exact mode, 'previous_grad' (hand-written protocol) or
    'previous_param' (x_{t-1}, through a closure; every stepped tensor). m and v have the parameter's dtype,
    except for float16 parameters, where they are float32: (1-β2)·c̃² of a unit-norm c̃ underflows float16
    (each entry of c̃ is about 1/sqrt(numel)), and so do many entries of (1-β1)·c̃. A step skipped by
    torch.amp.GradScaler (inf/nan gradients) never reaches step(), so it changes no state. state_dict()
    writes last_grad_dtype by name ("bfloat16": torch.distributed.checkpoint's full-state gather takes no
    torch.dtype; load_state_dict takes either) and leaves out a 'previous_grad' no step is waiting for.

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
        is_approx: True uses the previous step's gradient as g_{t-1}; False: exact MARS, through a closure
            or the hand-written protocol (see above).
        mars_type: "mars-adamw", "mars-lion", "mars-shampoo" or "mars-m".
        optimize_1d: apply MARS to every tensor (default False: only those `routing` names; the rest AdamW).
        routing: "2d" (default, as the paper's code): exactly the 2-D tensors take MARS, so a convolution's
            4-D kernel gets AdamW; "nd": every tensor with 2 or more dimensions takes MARS; "none": every
            tensor of the group takes the AdamW part (with optimize_1d=False).
        lr_1d: AdamW lr of the other tensors at the constructed lr (default 3e-3); the group keeps the ratio
            as lr_1d_factor and lr_1d as the 1-D lr of the last step (see "Live hyperparameters").
        betas_1d: AdamW betas of the other tensors (default (0.9, 0.95)).
        weight_decay_1d: AdamW weight decay of the other tensors (default 0.1); a group that sets
            weight_decay but not weight_decay_1d takes its weight_decay (see "Weight decay").
        eps_1d_uncorrected: the other tensors' AdamW adds eps to sqrt(v) before the bias correction, as
            MARS-M's reference code and pytorch_optimizer's MARS (default False: to sqrt(v̂), as
            torch.optim.AdamW and its fused kernel).
        last_grad_dtype: dtype of the stored previous gradient g_{t-1} (None: the parameter's). bfloat16
            halves its memory; the update itself still computes in the parameter's precision.
        foreach: None or True use the multi-tensor path; False the single-tensor reference.
        fused: True compiles the per-tensor update with torch.compile (needs a C++ compiler on CPU, Triton
            on CUDA; the first step compiles for seconds, later steps and lr changes do not recompile).
            None or False: not compiled. Refused for DTensor parameters, which take the sharded step.
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
        self._protocol = _new_protocol()
        self._lr_1d_seen = []  # per group: the lr_1d and lr_1d_factor the last step left there (_live_lr_1d)
        super().__init__(params, defaults)

    # Exact MARS's protocol and the record of lr_1d travel with copies and pickles: Optimizer's own
    # __getstate__ keeps only defaults, state and param_groups.
    def __getstate__(self):
        return {**super().__getstate__(), "_protocol": self._protocol, "_lr_1d_seen": self._lr_1d_seen}

    def __setstate__(self, state):
        super().__setstate__(state)  # also what Optimizer.load_state_dict calls, with state and groups only
        self.__dict__.setdefault("_protocol", _new_protocol())
        if len(self.__dict__.setdefault("_lr_1d_seen", [])) != len(self.param_groups):
            self._lr_1d_seen[:] = [_seen(group) for group in self.param_groups]

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
            if group["fused"] and _is_dtensor(p):
                raise ValueError(
                    "fused=True does not run on DTensor (FSDP2) parameters: construct MARS with fused=None, and "
                    "they take the sharded step (the multi-tensor rule on each rank's shards)"
                )
        if "weight_decay" in param_group and "weight_decay_1d" not in param_group:
            # The group's weight decay is meant for all its tensors (nanoGPT's and Hugging Face's no-decay group).
            inherited = param_group["weight_decay"]
            param_group["weight_decay_1d"] = group["weight_decay_1d"] = inherited
            paper = self.defaults["weight_decay_1d"]
            affected = [p for p in params if torch.is_tensor(p) and not self._is_mars_tensor(p, group)]
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
            param_group = {**param_group, "lr_1d_factor": lr_1d_factor(lr, group["lr_1d"])}
        super().add_param_group(param_group)
        self._lr_1d_seen.append(_seen(self.param_groups[-1]))

    def state_dict(self):
        # last_grad_dtype travels by name ("bfloat16"): torch.distributed.checkpoint's full-state gather
        # (get_optimizer_state_dict with full_state_dict or cpu_offload) takes only tensors, numbers, strings,
        # lists and dicts. load_state_dict takes the name or the dtype (checkpoints written before).
        state = super().state_dict()
        for group in state["param_groups"]:
            if isinstance(group["last_grad_dtype"], torch.dtype):
                group["last_grad_dtype"] = str(group["last_grad_dtype"]).removeprefix("torch.")
        # Exact MARS's 'previous_grad' is left out: the next update_previous_grad() writes it whole before any
        # use, and the protocol between the calls is not part of a state_dict (load_state_dict restarts it).
        # Left out, a checkpoint is a gradient per matrix smaller, and a full-state load on FSDP2 cannot leave
        # it behind as a whole unsharded tensor on every rank (torch's set_optimizer_state_dict shards only the
        # keys its zero-lr initial step() created).
        state["state"] = {
            i: {key: value for key, value in tensor_state.items() if key != "previous_grad"}
            for i, tensor_state in state["state"].items()
        }
        return state

    def load_state_dict(self, state_dict):
        # Which path runs (foreach, fused) is this process's choice, not the checkpoint's: Optimizer's
        # load_state_dict would take the saved groups' values, so a fused=True optimizer restored from a
        # foreach run would silently stop compiling.
        paths = [{key: group[key] for key in ("foreach", "fused")} for group in self.param_groups]
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            missing = sorted(group.keys() - saved.keys())
            if missing:
                raise ValueError(
                    f"this state dict's parameter groups lack {', '.join(missing)}: it was not written by this MARS "
                    f"(mars.py {__version__}); load it with the version that wrote it"
                )
        super().load_state_dict(state_dict)
        # Exact MARS's protocol restarts with the loaded state: a step() pending from before (torch's
        # set_optimizer_state_dict takes a zero-lr step() on an optimizer without state) would refuse the
        # next step.
        self._protocol.update(_new_protocol(), zero_grad_calls=self._protocol["zero_grad_calls"])
        for group, path in zip(self.param_groups, paths):
            group.update(path)
            group["last_grad_dtype"] = _dtype_by_name(group["last_grad_dtype"])
        # The groups are the checkpoint's now: what they hold is what the last step left there.
        self._lr_1d_seen[:] = [_seen(group) for group in self.param_groups]
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

    def zero_grad(self, set_to_none=True):
        """As torch's; also counted, so that step(closure) in exact mode can tell whether the closure zeroes the
        gradients itself."""
        self._protocol["zero_grad_calls"] += 1
        super().zero_grad(set_to_none=set_to_none)

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
        GradScaler skips a whole step) falls back to the one stored before it; before the first, to zero,
        which gives the next step the reference's first-step correction c = (1 + γβ1/(1-β1)) g."""
        by_device = {}
        for p in params:
            by_device.setdefault(p.device, []).append(p)
        for same_device in by_device.values():
            states = [self.state[p] for p in same_device]
            buffers = [_local(state["previous_grad"]) for state in states]
            # The max-norm is finite exactly when every entry is (and, unlike the 2-norm, cannot overflow). It
            # has no value for an empty tensor (a rank's empty shard), which has nothing to check.
            nonempty = [buffer for buffer in buffers if buffer.numel()]
            finite = torch.ones((), dtype=torch.bool, device=buffers[0].device)
            if nonempty:
                finite = torch.stack(torch._foreach_norm(nonempty, ord=math.inf)).isfinite().all()
            finite = _on_every_shard(finite, same_device)  # sharded tensors: every rank decides alike
            for state, buffer in zip(states, buffers):
                fallback = state.get("last_grad")
                if fallback is None:
                    fallback = torch.zeros((), dtype=buffer.dtype, device=buffer.device)
                fallback = _local(fallback)
                torch.where(finite, buffer, fallback, out=buffer)

    @torch.no_grad()
    def update_last_grad(self):
        """Exact MARS: after step(), make the stored look-ahead gradient the g_{t-1} of the next step."""
        protocol = self._protocol
        exact_groups = [group for group in self.param_groups if not group["is_approx"]]
        if not exact_groups:
            return
        if not protocol["look_ahead"]:
            protocol["look_ahead_called"] = False
            if not protocol["last_grad_pending"]:  # no MARS tensor stepped (1-D only, a ZeRO-1 share without one,
                return  # or a step(closure), which needs no look-ahead)
            raise RuntimeError(
                "exact MARS (is_approx=False): update_last_grad() found no look-ahead gradient; call "
                "update_previous_grad() after the backward pass on the next batch, before step()"
            )
        for group in exact_groups:
            for p in group["params"]:
                state = self.state[p]
                if p not in protocol["look_ahead"]:
                    if protocol["last_grad_pending"] and "last_grad" in state and p.grad is not None:
                        # It stepped, but had no gradient in the look-ahead pass (unused there): its own
                        # gradient, as approximate MARS, rather than a look-ahead gradient from steps ago. (A
                        # step a GradScaler skipped never ran: its gradients may be inf, and nothing moved.)
                        _local(state["last_grad"]).copy_(_local(p.grad))
                    continue
                if "last_grad" in state:  # swap the buffers: the old g_{t-1} is overwritten next time
                    state["last_grad"], state["previous_grad"] = state["previous_grad"], state["last_grad"]
                else:
                    state["last_grad"] = state.pop("previous_grad")
        protocol["look_ahead"].clear()
        protocol["look_ahead_called"] = False
        protocol["last_grad_pending"] = False

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
            state["last_grad"] = p.grad.to(_last_grad_dtype(group, p), copy=True)
        return state

    def _live_lr_1d(self, index, group):
        """The 1-D lr of this step, group['lr'] × group['lr_1d_factor'], after taking in what was written into
        lr_1d or lr_1d_factor since the last step (class docstring, "Live hyperparameters"); written back into
        the group, so lr_1d reads the lr the AdamW-rule tensors train at."""
        seen = self._lr_1d_seen[index]
        lr, lr_1d, factor = group["lr"], group["lr_1d"], group["lr_1d_factor"]
        factor_written = not _same(factor, seen["lr_1d_factor"])
        lr_1d_written = not _same(lr_1d, seen["lr_1d"]) and not _restates_peak(group)
        if lr_1d_written and factor_written:
            if not _agree(lr_1d, lr * factor):
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
        seen["lr_1d"], seen["lr_1d_factor"] = live, factor
        return live

    @torch.no_grad()
    def _evaluate_twice(self, closure):
        """Exact MARS through a closure: g_{t-1} = ∇f(x_{t-1}, ξ_t) from closure() with every parameter set back
        to x_{t-1}, into 'last_grad'; then closure() at x_t, whose loss is returned. x_t is kept as the next
        step's 'previous_param'. Nothing changes (parameters, gradients, state) if the closure raises or turns
        out to add to gradients accumulated before step(). DTensor parameters are set back shard by shard, each
        rank its own (the closure's forward gathers them as usual)."""
        protocol = self._protocol
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]  # others never move
        states = self.state
        earlier = [p for p in params if p in states and "previous_param" in states[p]]
        held = [p.grad for p in params]  # restored if the closure turns out to accumulate into them
        current = [p.detach().clone(memory_format=torch.preserve_format) for p in params]  # x_t
        earlier_set = set(earlier)
        earlier_current = [x for p, x in zip(params, current) if p in earlier_set]

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
                if group["is_approx"]:
                    continue
                for p in group["params"]:
                    state = states.get(p)
                    if p.grad is None or not state or "last_grad" not in state or not self._is_mars_tensor(p, group):
                        continue
                    _check_dense(p.grad)
                    _local(state["last_grad"]).copy_(_local(p.grad))
        loss = call(at_previous=False)
        for p, x in zip(params, current):
            if p.grad is not None or states.get(p):
                states[p]["previous_param"] = x
        return loss

    @torch.no_grad()
    def step(self, closure=None):
        """One MARS step; returns closure()'s loss when a closure is given (exact MARS: see the class docstring)."""
        protocol = self._protocol
        if protocol["last_grad_pending"]:
            if not protocol["look_ahead_called"]:  # no second gradient at all: step() is all the loop calls
                raise RuntimeError(_NO_SECOND_GRADIENT)
            raise RuntimeError(
                "exact MARS (is_approx=False): step() was called again without update_last_grad() after "
                "the previous step(), so the correction would use a stale gradient; call "
                "update_last_grad() after every step() (or pass step() a closure instead of the hand-written "
                "protocol)"
            )
        if len(self._lr_1d_seen) != len(self.param_groups):  # groups installed without add_param_group
            self._lr_1d_seen[:] = [_seen(group) for group in self.param_groups]
        for group in self.param_groups:  # everything a scheduler or a user may have written, before any change
            _validate(group, at_step=True)
        lrs_1d = [self._live_lr_1d(index, group) for index, group in enumerate(self.param_groups)]
        exact_groups = [group for group in self.param_groups if not group["is_approx"]]
        # With update_previous_grad() called, the hand-written protocol supplies g_{t-1}: the closure is called
        # once, as by any optimizer (Lightning's manual optimization passes one that computes nothing).
        by_closure = bool(exact_groups) and closure is not None and not protocol["look_ahead_called"]
        if by_closure:
            loss = self._evaluate_twice(closure)
        else:
            if exact_groups:  # x_{t-1} is kept only from one step(closure) to the next: stale after this step
                for state in self.state.values():
                    state.pop("previous_param", None)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
        sharded = []  # every group's MARS tensors when they are DTensors: stepped together after the loop
        for group, lr_1d in zip(self.param_groups, lrs_1d):
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
                hyper = dict(
                    lr=group["lr"],
                    beta1=group["betas"][0],
                    beta2=group["betas"][1],
                    weight_decay=group["weight_decay"],
                    gamma=group["gamma"],
                    # through a closure, exact MARS filled last_grad itself and keeps g_t there as the fallback
                    # of a tensor the next step's first evaluation leaves without a gradient
                    is_approx=group["is_approx"] or by_closure,
                    eps=group["eps"],
                )
                if _has_dtensor(mars):
                    sharded.append((mars, rules, hyper))
                else:
                    _kernel_mars(group)(mars, rules, **hyper)
                if not group["is_approx"] and not by_closure:
                    protocol["last_grad_pending"] = True
            if adamw:
                if _has_dtensor(adamw):
                    kernel = _sharded_adamw
                else:
                    kernel = _single_tensor_adamw if _reference_path(group) else _multi_tensor_adamw
                kernel(
                    adamw,
                    lr=lr_1d,
                    beta1=group["betas_1d"][0],
                    beta2=group["betas_1d"][1],
                    weight_decay=group["weight_decay_1d"],
                    eps=group["eps"],
                    eps_uncorrected=group["eps_1d_uncorrected"],
                )
        if sharded:
            _sharded_mars(sharded)
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
    """Exact MARS's bookkeeping between calls, one dict mutated in place (never rebound, so a wrapper that
    forwards attribute reads to the optimizer shares it): look_ahead, the parameters whose look-ahead gradient
    update_previous_grad() stored since the last update_last_grad(); look_ahead_called, whether it was called
    since then; last_grad_pending, whether a step() is waiting for update_last_grad(); zero_grad_calls, a count
    of zero_grad() calls (step(closure) checks that the closure zeroes the gradients)."""
    return {"look_ahead": set(), "look_ahead_called": False, "last_grad_pending": False, "zero_grad_calls": 0}


def _seen(group):
    return {"lr_1d": group["lr_1d"], "lr_1d_factor": group["lr_1d_factor"]}


def _same(a, b):
    """Whether a group value is the one the last step left (tensors: the same object; nothing is read back)."""
    if a is b:
        return True
    return not torch.is_tensor(a) and not torch.is_tensor(b) and a == b


def _agree(a, b):
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


# timm's and pytorch_optimizer's names for their MARS types, refused here (the class docstring says why).
_OTHER_LIBRARIES_TYPES = {"adamw": "mars-adamw", "lion": "mars-lion", "shampoo": "mars-shampoo"}


def _validate(hp, at_step=False):
    """ValueError naming the first invalid hyperparameter of hp (a group, or the constructor's defaults).

    at_step: the check step() makes of a live group, which reads no tensor's value (no host sync): a tensor lr,
    lr_1d or lr_1d_factor is checked for its shape and dtype only."""
    for name in ("lr", "lr_1d", "lr_1d_factor", "eps", "weight_decay", "weight_decay_1d", "gamma"):
        if name not in hp:  # lr_1d_factor, before add_param_group computes it
            continue
        value = hp[name]
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        may_be_tensor = name in ("lr", "lr_1d", "lr_1d_factor")
        is_scalar_tensor = may_be_tensor and torch.is_tensor(value) and value.ndim == 0 and value.is_floating_point()
        if name == "eps":
            if not (is_number and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"invalid eps: {value!r} (must be a finite number > 0: it keeps the AdamW and Newton-Schulz "
                    "divisions finite)"
                )
            continue
        if is_scalar_tensor and at_step:
            continue
        if not (is_number or is_scalar_tensor) or not 0.0 <= float(value) < math.inf:
            allowed = "a finite number >= 0" + (" or a 0-d floating tensor" if may_be_tensor else "")
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
    mars_type = hp["mars_type"]
    if mars_type not in MARS_TYPES:
        message = f"invalid mars_type: {mars_type!r} (allowed: {', '.join(MARS_TYPES)})"
        if isinstance(mars_type, str) and mars_type in _OTHER_LIBRARIES_TYPES:
            message += (
                f"; {mars_type!r} is timm's and pytorch_optimizer's name. {_OTHER_LIBRARIES_TYPES[mars_type]!r} "
                "is the same rule, but their MARS's defaults are not this one's (betas, betas_1d, the 1-D lr and "
                "weight decay, which tensors take MARS): docs/mars.md, 'Coming from timm or pytorch_optimizer', "
                "gives the settings that reproduce theirs"
            )
        raise ValueError(message)
    if at_step:  # what only the constructor's choice decides (routing, paths) is not rewritten by schedules
        return
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
    for bucket, bucket_rules in _by_device_and_dtype(entries, rules):
        grads = [p.grad for p, _ in bucket]
        c = _corrected_gradients(bucket, grads, beta1=beta1, gamma=gamma, is_approx=is_approx)
        norms = torch._foreach_norm(c, dtype=_opmath(c[0].dtype))
        hyper = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, is_approx=is_approx)
        _clipped_update(bucket, bucket_rules, grads, c, norms, _lr_on(lr, bucket[0][0].device), **hyper)


def _corrected_gradients(bucket, grads, *, beta1, gamma, is_approx):
    """c_t = g + γβ1/(1-β1) (g - g_prev) of each (p, state) of one device and dtype, in m's dtype."""
    k = gamma * beta1 / (1 - beta1)
    last_grads = [state["last_grad"] for _, state in bucket]
    dtype = bucket[0][1]["exp_avg"].dtype  # c̃'s, as m's: float32 for float16 parameters
    if is_approx and last_grads[0].dtype == dtype:
        # g_prev is replaced by g at the end of the step, so its buffer holds c meanwhile: the
        # step's one gradient-sized buffer, and no allocation.
        c = last_grads
    else:
        # Exact MARS (g_prev belongs to update_last_grad), or g_prev stored in another dtype.
        c = [g_prev.to(dtype, copy=True) for g_prev in last_grads]
    torch._foreach_lerp_(c, [g.to(dtype) for g in grads], 1 + k)  # g + k (g - g_prev)
    return c


def _clipped_update(
    bucket, rules, grads, c, norms, lr, *, beta1, beta2, eps, weight_decay, is_approx, newton_schulz=None
):
    """The rest of the step from c_t and its norms: clip, each rule, and (approximate MARS) g_prev ← g.
    newton_schulz(entries, lr, rule, ...) updates the Newton-Schulz rules' tensors once m is updated."""
    torch._foreach_clamp_min_(norms, 1.0)
    torch._foreach_div_(c, norms)  # clip to Frobenius norm <= 1
    for rule in ("lion", *_NEWTON_SCHULZ_RULES, "adamw"):
        picked = [i for i, r in enumerate(rules) if r == rule]
        if not picked:
            continue
        sub = [bucket[i] for i in picked]
        sub_c = [c[i] for i in picked]
        if rule == "adamw":
            _foreach_adamw(sub, sub_c, lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
            continue
        momenta = [state["exp_avg"] for _, state in sub]
        torch._foreach_lerp_(momenta, sub_c, 1 - beta1)
        if rule == "lion":
            torch._foreach_copy_(sub_c, momenta)
            torch._foreach_sign_(sub_c)
            _foreach_apply_update([p for p, _ in sub], sub_c, lr, weight_decay)
        else:
            (newton_schulz or _newton_schulz_update)(sub, lr, rule, beta1=beta1, eps=eps, weight_decay=weight_decay)
    if is_approx:
        torch._foreach_copy_([state["last_grad"] for _, state in bucket], grads)


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
# recompilation. Tensors whose layouts differ (a transposed parameter with a contiguous gradient) take the eager
# reference, with the numbers as they are. docs/mars.md ("Paths") has the measurements behind the choices below.
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
    # On CPU inductor's float32 sum is a slow cascade when g_prev is in c's dtype, where a float64 sum is faster;
    # with a bfloat16 g_prev the float32 sum is the faster one.
    f64_sum = c.is_cpu and g_prev.dtype == c.dtype
    norm = torch.linalg.vector_norm(c, dtype=torch.float64 if f64_sum else _opmath(c.dtype)).clamp_min(1.0)
    # Inductor divides element by element; times the reciprocal (one rounding more) leaves the divider to the
    # AdamW rule's own division.
    c = c * norm.reciprocal().to(c.dtype)
    rule_numbers = (hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"])
    _rule_step(p, c, m, v, v_max, lr, step_size, bias_correction2_rsqrt, rule, *rule_numbers)
    if keep_grad:
        g_prev.copy_(g)


@functools.cache
def _compiled_mars_tensor_step(simdlen=None):
    # cpp.dynamic_threads: without it inductor may compile a kernel single-threaded (it did for a bfloat16
    # last_grad); with it OpenMP picks the threads at run time (C++ backend only).
    options = {"cpp.dynamic_threads": True} | ({"cpp.simdlen": simdlen} if simdlen else {})
    return torch.compile(_fused_mars_tensor_step, dynamic=True, options=options)


def _simdlen(p, g_prev):
    """The vector width to compile p's step for: None (inductor's choice) except for float32 parameters with a
    half-precision g_prev on an AVX-512 CPU, where 256-bit vectors are faster: the 512-bit kernel walks the
    16-bit g_prev in half-filled, masked vectors. On all-float32 steps the width makes no difference, and on
    bfloat16 or float16 parameters 256 bits are slower (docs/mars.md, "Benchmark")."""
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


# ---------------------------------------------------------------------------------------------------
# DTensor parameters (FSDP2's fully_shard, HSDP): the multi-tensor rule on each rank's shards.
#
# Everything in the rule is elementwise except two things that look at a whole tensor, and only those
# communicate: the clip of c_t, whose Frobenius norm is the square root of the sum over the shards of their
# sums of squares (one all-reduce of every tensor's sum per step and process group), and Newton-Schulz, which
# runs on the whole matrix: each matrix has one owner rank, chosen to balance Newton-Schulz's cost over the
# ranks; an all-to-all sends every shard of m to its owner, the owner computes NS(m) for its matrices, and a
# second all-to-all sends each rank its rows of the update. A rank's shard is its DTensor's local tensor
# (to_local(): a view, so the in-place rule updates the parameter and the state). State stays DTensors, so
# torch.distributed.checkpoint saves and reshards it. torch.distributed is imported only once a DTensor steps.
#
# Per step and process group that shards the parameters: one all-reduce (every sharded tensor's sum of squares)
# and, with Newton-Schulz rules, two all-to-alls (every rank's shards of m to the owners and the updates back).
# No all-gather: nothing else needs a whole tensor. On gloo (CPU, and the tests) the all-to-all of CUDA tensors
# goes through the host; on NCCL it stays on the device.


def _dtensor_class():
    """torch's DTensor class, or None while torch.distributed.tensor is not imported (then no DTensor exists,
    and a single-process step pays no import)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _is_dtensor(t):
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def _has_dtensor(entries):
    return any(_is_dtensor(p) for p, _ in entries)


def _local(t):
    """t's shard on this rank (the DTensor's local tensor, a view of it), or t itself."""
    return t.to_local() if _is_dtensor(t) else t


def _local_entry(p, state):
    return _local(p), {key: _local(value) for key, value in state.items()}


def _copy_shards(targets, sources):
    """targets[i] ← sources[i] in place, shard by shard where they are DTensors (placed alike): DTensor has no
    sharding rule for torch._foreach_copy_, and the copy needs no communication."""
    torch._foreach_copy_([_local(t) for t in targets], [_local(s) for s in sources])


class _Split:
    """How a DTensor's shards make the whole tensor: split along tensor dim `dim` into `world` pieces over the
    process group `group` (the one mesh dim that shards it; replicated on the others), in torch.chunk's sizes,
    as Shard(dim) places them. None from _split_of for a whole tensor on every rank."""

    def __init__(self, group, dim, shape, rank, world):
        self.group, self.dim, self.shape, self.rank, self.world = group, dim, tuple(shape), rank, world
        chunk = -(-shape[dim] // world)  # ceil: the first ranks hold `chunk` rows each, then the rest
        self.sizes = [max(0, min(chunk, shape[dim] - r * chunk)) for r in range(world)]
        self.offsets = [min(r * chunk, shape[dim]) for r in range(world)]

    def local_shape(self, rank):
        shape = list(self.shape)
        shape[self.dim] = self.sizes[rank]
        return shape


def _split_of(p):
    if not _is_dtensor(p):
        return None
    mesh = p.device_mesh
    sharding = [(i, pl) for i, pl in enumerate(p.placements) if not pl.is_replicate() and mesh.size(i) > 1]
    if not sharding:
        return None
    from torch.distributed.tensor import Shard

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


def _sharded_adamw(entries, *, lr, beta1, beta2, eps, weight_decay, eps_uncorrected):
    """The AdamW part on shards: elementwise, so nothing to communicate."""
    local = [_local_entry(p, state) for p, state in entries]
    grads = [_local(p.grad) for p, _ in entries]
    hyper = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, eps_uncorrected=eps_uncorrected)
    for bucket, bucket_grads in _by_device_and_dtype(local, grads):  # each entry with its gradient
        _foreach_adamw(bucket, bucket_grads, _lr_on(lr, bucket[0][0].device), **hyper)


def _sharded_mars(work):
    """One step of every group's MARS tensors, work = [(entries, rules, hyper)] per group: _multi_tensor_mars on
    the shards, with c_t's norms from _whole_norms and Newton-Schulz through _owner_newton_schulz."""
    buckets = []
    for entries, rules, hyper in work:
        for bucket, bucket_rules in _by_device_and_dtype(entries, rules):
            local = [_local_entry(p, state) for p, state in bucket]
            grads = [_local(p.grad) for p, _ in bucket]
            splits = [_split_of(p) for p, _ in bucket]
            c = _corrected_gradients(
                local, grads, beta1=hyper["beta1"], gamma=hyper["gamma"], is_approx=hyper["is_approx"]
            )
            buckets.append((local, bucket_rules, grads, c, splits, hyper))
    all_norms = _whole_norms([(c, splits) for _, _, _, c, splits, _ in buckets])
    split_of = {id(p): split for local, _, _, _, splits, _ in buckets for (p, _), split in zip(local, splits)}
    newton_schulz = []  # (entries, lr, rule, hyper) of each group's Newton-Schulz tensors, for one exchange

    def later(entries, lr, rule, **hyper):
        newton_schulz.append((entries, lr, rule, hyper))

    for (local, rules, grads, c, _, hyper), norms in zip(buckets, all_norms):
        lr = _lr_on(hyper["lr"], local[0][0].device)
        rest = {k: v for k, v in hyper.items() if k not in ("lr", "gamma")}
        _clipped_update(local, rules, grads, c, norms, lr, **rest, newton_schulz=later)
    if newton_schulz:
        _owner_newton_schulz(newton_schulz, split_of)


def _whole_norms(buckets):
    """The Frobenius norm of each whole tensor, for buckets [(c, splits)] of shards: a sharded tensor's is the
    square root of its shards' sums of squares summed over its process group, all of them in one all-reduce
    per process group (FSDP2: one; HSDP: the shard dimension's, as the replicas hold the same gradients)."""
    import torch.distributed as dist

    norms = [list(torch._foreach_norm(c, dtype=_opmath(c[0].dtype))) for c, _ in buckets]
    by_group = {}
    for b, (_, splits) in enumerate(buckets):
        for i, split in enumerate(splits):
            if split is not None:
                by_group.setdefault(split.group, []).append((b, i))
    for group, where in by_group.items():
        squares = torch.stack([norms[b][i].to(torch.float64).square() for b, i in where])
        dist.all_reduce(squares, group=group)
        for (b, i), norm in zip(where, squares.sqrt().unbind()):
            norms[b][i] = norm.to(norms[b][i].dtype)
    return norms


def _on_every_shard(flag, params):
    """A boolean 0-d tensor, True on every rank only where it is True on every rank that shares a process group
    with one of these parameters' shards (one all-reduce per group; none for whole tensors)."""
    groups = {split.group: None for split in map(_split_of, params) if split is not None}
    if not groups:
        return flag
    import torch.distributed as dist

    flag = flag.to(torch.float32)
    for group in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return flag.bool()


def _newton_schulz_cost(shape):
    """Multiply-adds of Newton-Schulz on a matrix (each iteration: three n x n x N products, n <= N)."""
    n, big = sorted(shape[-2:])
    return n * n * big


def _balanced_owners(costs, world):
    """An owner rank for each job: the costliest first, each to the least loaded rank (the lowest on ties).
    Deterministic, so every rank computes the same assignment without communicating."""
    load, owners = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owners[i] = min(range(world), key=lambda r: (load[r], r))
        load[owners[i]] += costs[i]
    return owners


def _owner_newton_schulz(jobs, split_of):
    """The Newton-Schulz rules' updates, jobs = [(entries, lr, rule, hyper)] with m already updated: whole
    tensors as _newton_schulz_update; sharded ones at their owners, one exchange per process group and dtype."""
    exchanges = {}
    for entries, lr, rule, hyper in jobs:
        whole = [entry for entry in entries if split_of[id(entry[0])] is None]
        if whole:
            _newton_schulz_update(whole, lr, rule, **hyper)
        for entry in entries:
            split = split_of[id(entry[0])]
            if split is not None:
                key = (split.group, entry[1]["exp_avg"].dtype, entry[0].device)
                exchanges.setdefault(key, []).append((entry, split, lr, rule, hyper))
    for (group, _, _), items in exchanges.items():
        updates = _exchange_newton_schulz(group, items)
        by_job = {}  # (lr, weight decay) -> parameters and their updates, as _newton_schulz_update applies them
        for (entry, _, lr, _, hyper), u in zip(items, updates):
            job = by_job.setdefault((id(lr), hyper["weight_decay"]), (lr, [], []))
            job[1].append(entry[0])
            job[2].append(u)
        for (_, weight_decay), (lr, params, us) in by_job.items():
            _foreach_apply_update(params, us, lr, weight_decay)


def _exchange_newton_schulz(group, items):
    """Each item's rows of its update u = NS direction of its whole m, items = [(entry, split, lr, rule, hyper)]
    on one process group (_at_owners), each owner's Newton-Schulz batched by shape and rule."""

    def directions(wholes):  # {item: its whole m} of the matrices this rank owns
        batches = {}
        for i in wholes:
            _, split, _, rule, hyper = items[i]
            batches.setdefault((split.shape, rule, hyper["beta1"], hyper["eps"]), []).append(i)
        result = {}
        for (_, rule, beta1, eps), batch in batches.items():
            stacked = torch.stack([wholes[i] for i in batch])
            result.update(zip(batch, _orthogonal_direction(stacked, rule, beta1=beta1, eps=eps).unbind(0)))
        return result

    momenta = [entry[1]["exp_avg"] for entry, _, _, _, _ in items]
    return _at_owners(group, momenta, [split for _, split, _, _, _ in items], directions)


def _at_owners(group, shards, splits, compute, result_dtype=None):
    """This rank's rows of compute's result for each whole tensor, `shards` this rank's rows of each, split as
    `splits` say over the process group `group`: every tensor goes whole to its owner rank (one all-to-all;
    owners balanced by Newton-Schulz's cost), each owner computes compute({index: whole}) -> {index: result}
    for the tensors it owns, and every rank gets back its rows of each result (one all-to-all), in
    result_dtype (default: the shards')."""
    first = splits[0]
    rank, world = first.rank, first.world
    result_dtype = result_dtype or shards[0].dtype
    owners = _balanced_owners([_newton_schulz_cost(split.shape) for split in splits], world)
    owned = [[i for i, owner in enumerate(owners) if owner == r] for r in range(world)]
    row_numel = [math.prod(split.shape) // max(1, split.shape[split.dim]) for split in splits]

    # 1. to the owners: rank r's shard of every tensor r' owns, in owned[r'] order
    send = torch.cat([shards[i].contiguous().view(-1) for r in range(world) for i in owned[r]])
    send_sizes = [sum(shards[i].numel() for i in owned[r]) for r in range(world)]
    recv_sizes = [sum(splits[i].sizes[r] * row_numel[i] for i in owned[rank]) for r in range(world)]
    received = _all_to_all(send, send_sizes, recv_sizes, group)

    # 2. the owner: whole tensors (pieces in rank order along the split dim)
    pieces = {i: [] for i in owned[rank]}
    offset = 0
    for r in range(world):
        for i in owned[rank]:
            n = splits[i].sizes[r] * row_numel[i]
            pieces[i].append(received[offset : offset + n].view(splits[i].local_shape(r)))
            offset += n
    results = compute({i: torch.cat(pieces[i], dim=splits[i].dim) for i in owned[rank]})

    # 3. back: rank r's rows of every result this rank owns, in owned[rank] order
    reply = [
        results[i].narrow(splits[i].dim, splits[i].offsets[r], splits[i].sizes[r]).to(result_dtype).reshape(-1)
        for r in range(world)
        for i in owned[rank]
    ]
    reply = torch.cat(reply) if reply else send.new_empty(0, dtype=result_dtype)
    returned = _all_to_all(reply, recv_sizes, send_sizes, group)
    rows, offset = [None] * len(shards), 0
    for r in range(world):
        for i in owned[r]:
            n = shards[i].numel()
            rows[i] = returned[offset : offset + n].view(shards[i].shape)
            offset += n
    return rows


def map_whole_tensors(params, tensors, fn, result_dtype=None):
    """[fn(whole) for each of `tensors`], each shaped and placed like its parameter in `params`, computed where its
    whole value is: for a DTensor parameter (FSDP2, HSDP), `tensors` holds this rank's rows of it (a local tensor);
    the whole goes to one owner rank, which computes fn there, and this rank gets back its rows of the result, in
    result_dtype (default the tensor's). For a whole parameter fn runs here. This is MARS's owner scheme
    (two all-to-alls per process group, owners balanced by Newton-Schulz's cost) for other whole-matrix rules:
    marsgpt/optimizers.py steps torch.optim.Muon's rule with it."""
    splits = [_split_of(p) for p in params]
    results, exchanges = [None] * len(params), {}
    for i, (split, tensor) in enumerate(zip(splits, tensors)):
        if split is None:
            results[i] = fn(tensor)
        else:
            exchanges.setdefault((split.group, tensor.dtype, tensor.device), []).append(i)
    for (group, _, _), items in exchanges.items():
        rows = _at_owners(
            group,
            [tensors[i] for i in items],
            [splits[i] for i in items],
            lambda wholes: {i: fn(whole) for i, whole in wholes.items()},
            result_dtype,
        )
        for i, row in zip(items, rows):
            results[i] = row
    return results


def _all_to_all(send, send_sizes, recv_sizes, group):
    """dist.all_to_all_single with uneven splits: NCCL's all-to-all; gloo's on host tensors (gloo has no
    all-to-all for CUDA tensors, so those travel through the host)."""
    import torch.distributed as dist

    host = send.device.type != "cpu" and dist.get_backend(group) == "gloo"
    buffer = send.to("cpu") if host else send
    received = buffer.new_empty(sum(recv_sizes))
    dist.all_to_all_single(received, buffer, recv_sizes, send_sizes, group=group)
    return received.to(send.device) if host else received
