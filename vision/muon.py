"""Muon for convolution kernels too: the vision reference's rule (MARS/optimizers/muon.py).

torch.optim.Muon takes 2-D tensors only. The reference's vision trainer gives Muon every tensor with 2 or
more dimensions (the convolution kernels and the classifier's weight) and orthogonalizes a kernel
[out, in, kh, kw] as the matrix [out, in*kh*kw]; this class does the same. For a tensor x with
gradient g and momentum μ (Nesterov):

    B ← μ B + g;   G = g + μ B;   O = NS5(G) · sqrt(max(1, rows/cols));   x ← x (1 - η λ) - η O

NS5 is mars.newton_schulz (5 quintic steps, bfloat16 on CUDA as the reference, float32 on the CPU).
Up to a positive factor, which Newton-Schulz normalises away, this is torch.optim.Muon's update.
"""

import math

import torch

from mars import newton_schulz
from marsgpt.optim_protocol import closure_loss


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5):
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1 or ns_steps < 1:
            raise ValueError(
                f"invalid Muon hyperparameters: lr={lr}, momentum={momentum}, weight_decay={weight_decay}, "
                f"ns_steps={ns_steps} (need lr, weight_decay >= 0, momentum in [0, 1), ns_steps >= 1)"
            )
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon takes tensors with 2 or more dimensions, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.reshape(p.shape[0], -1)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.mul_(momentum).add_(g)
                g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
                update = newton_schulz(g, steps=group["ns_steps"]) * math.sqrt(max(1.0, g.size(0) / g.size(1)))
                p.mul_(1 - lr * group["weight_decay"]).add_(update.view_as(p), alpha=-lr)
        return loss
