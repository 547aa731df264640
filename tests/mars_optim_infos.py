"""torch's OptimizerInfo entries for every MARS variant, the input of torch's generic optimizer tests
(test/test_optim.py's TestOptimRenewed, which torch does not ship: tests/torch_optim_suite.py runs a checkout's)
and of tests/test_mars_as_torch_optimizer.py, which holds MARS to the same protocol in this repository's CI.

Each variant is MARS with one setting under its own name (torch names a test after `optim_cls.__name__`):
MARS-AdamW, MARS-Lion, MARS-Shampoo, MARS-M, and exact MARS (is_approx=False), whose step takes a closure that
computes the gradient (step_requires_closure). The configurations are torch's for Adam (the default, another lr,
weight decay, amsgrad) and MARS's own settings (the correction's strength, every tensor taking MARS, the N-D
routing, the 1-D AdamW's settings, a bfloat16 previous gradient, a tensor lr).

CONVENTIONS is the one list of torch's tests whose convention does not fit MARS, with why: they are expected
failures of those variants (a convention test that starts to pass fails the suite, as an unexpected success).
"""

import unittest

import torch
from torch.testing._internal.common_methods_invocations import DecorateInfo
from torch.testing._internal.common_optimizers import (
    ErrorOptimizerInput,
    OptimizerInfo,
    OptimizerInput,
    get_error_inputs_for_all_optims,
)

from mars import MARS


def variant(name, **settings):
    """MARS with `settings`, as a callable named `name` that the tests build as they build torch's classes."""

    def build(params, **kwargs):
        return MARS(params, **(settings | kwargs))

    build.__name__ = build.__qualname__ = name
    return build


VARIANTS = {
    "MARS_AdamW": variant("MARS_AdamW"),
    "MARS_Lion": variant("MARS_Lion", mars_type="mars-lion"),
    "MARS_Shampoo": variant("MARS_Shampoo", mars_type="mars-shampoo"),
    "MARS_M": variant("MARS_M", mars_type="mars-m"),
    "MARS_exact": variant("MARS_exact", is_approx=False),
}
APPROXIMATE = ("MARS_AdamW", "MARS_Lion", "MARS_Shampoo", "MARS_M")

# torch's tests whose convention does not fit MARS: name -> (the variants it concerns, why).
CONVENTIONS = {
    "test_load_state_dict_post_hook": (
        tuple(VARIANTS),
        "its load-state-dict pre-hook marks that it ran by writing lr=0.003, and the check reads lr == 0.003 as "
        "'it ran'; 3e-3 is MARS's default lr, so the default configuration reads as marked without the hook",
    ),
    "test_fused_does_not_step_if_foundinf": (
        tuple(VARIANTS),
        "it sets GradScaler's found_inf on the optimizer and expects the fused kernel to skip the step; torch's "
        "fused kernels take the scaler's found_inf and grad_scale (_step_supports_amp_scaling), MARS's kernel "
        "does not claim to, so GradScaler unscales and skips a step itself before step() is called",
    ),
    **dict.fromkeys(
        (
            "test_foreach_matches_forloop",
            "test_fused_matches_forloop",
            "test_param_groups_lr",
            "test_param_groups_weight_decay",
        ),
        (
            ("MARS_exact",),
            "it calls step() without a closure after the first step, where exact MARS has no second gradient "
            "and raises, saying so (docs/mars.md, 'Exact and approximate MARS')",
        ),
    ),
    **dict.fromkeys(
        (
            "test_deepcopy_copies_all_public_attrs",
            "test_grads_are_never_inplaced_into",
            "test_load_nontensor_step",
            "test_non_empty_state",
            "test_step_is_noop_for_zero_grads",
        ),
        (
            ("MARS_exact",),
            "its closure returns a loss without computing a gradient, which exact MARS cannot evaluate at x_{t-1} "
            "and refuses, saying so (docs/mars.md, 'Exact MARS through step(closure)')",
        ),
    ),
    "test_second_order_optims_return_consistent_types": (
        ("MARS_exact",),
        "a test of LBFGS's tolerance_grad, picked for every entry whose step takes a closure",
    ),
}


def optim_inputs(device, dtype=None):
    """The constructor settings each test runs (torch's convention: no foreach or fused here; tests add them)."""
    inputs = [
        OptimizerInput(params=None, kwargs={}, desc="default"),
        OptimizerInput(params=None, kwargs={"lr": 0.01}, desc="non-default lr"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.1}, desc="nonzero weight_decay"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.1, "amsgrad": True}, desc="amsgrad"),
        OptimizerInput(params=None, kwargs={"gamma": 0.5, "betas": (0.9, 0.95)}, desc="strong correction"),
        OptimizerInput(params=None, kwargs={"optimize_1d": True}, desc="every tensor takes MARS"),
        OptimizerInput(params=None, kwargs={"routing": "nd"}, desc="N-D tensors take MARS"),
        OptimizerInput(
            params=None,
            kwargs={"lr_1d": 1e-2, "betas_1d": (0.8, 0.9), "weight_decay_1d": 0.0, "eps_1d_uncorrected": True},
            desc="the 1-D AdamW's settings",
        ),
        OptimizerInput(params=None, kwargs={"last_grad_dtype": torch.bfloat16}, desc="bfloat16 last_grad"),
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(0.01)}, desc="Tensor lr"),
    ]
    if dtype == torch.float16:  # as torch's Adam: 1e-8 vanishes next to float16's sqrt(v)
        for optim_input in inputs:
            optim_input.kwargs["eps"] = 0.1
    return inputs


def error_inputs(device, dtype):
    """torch's errors for every optimizer, and MARS's own invalid settings (each a ValueError naming it)."""
    invalid = [
        ({"betas": (1.0, 0.99)}, "invalid betas"),
        ({"weight_decay": -1}, "invalid weight_decay"),
        ({"eps": 0.0}, "invalid eps"),
        ({"gamma": float("nan")}, "invalid gamma"),
        ({"mars_type": "adamw"}, "invalid mars_type: 'adamw'.*timm's and pytorch_optimizer's name"),
        ({"routing": "3d"}, "invalid routing"),
        ({"routing": "none", "optimize_1d": True}, 'invalid routing="none" with optimize_1d=True'),
        ({"last_grad_dtype": torch.int8}, "invalid last_grad_dtype"),
        ({"foreach": True, "fused": True}, "`fused` and `foreach` cannot be `True` together"),
    ]
    sample = torch.nn.Parameter(torch.randn(2, 2, device=device, dtype=dtype))
    return get_error_inputs_for_all_optims(device, dtype) + [
        ErrorOptimizerInput(
            OptimizerInput(params=[sample], kwargs=kwargs, desc=regex), error_type=ValueError, error_regex=regex
        )
        for kwargs, regex in invalid
    ]


def mars_info(name):
    return OptimizerInfo(
        VARIANTS[name],
        optim_inputs_func=optim_inputs,
        optim_error_inputs_func=error_inputs,
        supported_impls=("foreach", "fused"),
        # The settings later versions of mars.py added to a group: a state dict written before lacks them.
        not_og_supported_flags=("foreach", "fused", "routing", "eps_1d_uncorrected", "last_grad_dtype"),
        supports_fused_on=("cpu", "cuda"),
        supports_complex=False,  # refused: MARS's clip and Newton-Schulz are real; optimize view_as_real(p)
        step_requires_closure=name == "MARS_exact",
        skips=tuple(
            DecorateInfo(unittest.expectedFailure, "TestOptimRenewed", test)
            for test, (variants, _) in CONVENTIONS.items()
            if name in variants
        ),
    )


MARS_OPTIM_DB = [mars_info(name) for name in VARIANTS]
