"""Optimizer steps under accel: the in-place updates of parameters (leaves that require
grad, updated under ``no_grad``) fuse into regions and build like any other, and training
with them matches eager step by step."""
import copy

import pytest
import torch

import accel
from devices import DEVICES  # tests/devices.py (pytest puts tests/ on sys.path)


OPTIMIZERS = {
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                               weight_decay=1e-2, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, foreach=False),
    "rmsprop_centered_foreach": lambda ps: torch.optim.RMSprop(
        ps, lr=1e-2, momentum=0.5, centered=True, weight_decay=1e-2, foreach=True),
    "sgd_maximize_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1,
                                                       maximize=True, foreach=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=1e-2, foreach=False),
    "adagrad_foreach": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=1e-3, weight_decay=1e-2,
                                                      foreach=True),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0, rho=0.8, weight_decay=1e-2, foreach=False),
    "nadam_decoupled": lambda ps: torch.optim.NAdam(ps, lr=1e-2, decoupled_weight_decay=True,
                                                    weight_decay=1e-2, foreach=False),
    "radam_foreach": lambda ps: torch.optim.RAdam(ps, lr=1e-2, foreach=True),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=2, weight_decay=1e-2, foreach=False),
    "rprop_foreach": lambda ps: torch.optim.Rprop(ps, lr=1e-2, etas=(0.4, 1.3), foreach=True),
}


def test_inplace_update_of_a_parameter_builds_a_kernel():
    p = torch.nn.Parameter(torch.randn(4096))
    g = torch.randn(4096)
    want = p.detach().clone()
    before = accel.stats()
    for _ in range(3):
        with accel.eager(), torch.no_grad():
            p.mul_(0.9).add_(g, alpha=-0.1)
        want.mul_(0.9).add_(g, alpha=-0.1)
        torch.testing.assert_close(p.detach(), want)
    after = accel.stats()
    assert after["compile_failures"] == before["compile_failures"], after
    assert after["eager_replays"] == before["eager_replays"], after
    assert after["kernel_runs"] - before["kernel_runs"] == 3, after
    assert p.requires_grad and p.is_leaf and p.grad is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_with_an_optimizer_matches_eager(name, device):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4)).to(device)
    me, ma = copy.deepcopy(base), copy.deepcopy(base)
    oe, oa = OPTIMIZERS[name](me.parameters()), OPTIMIZERS[name](ma.parameters())
    g = torch.Generator().manual_seed(1)
    before = accel.stats()
    for step in range(4):
        x = torch.randn(8, 16, generator=g).to(device)
        y = torch.randint(0, 4, (8,), generator=g).to(device)
        for m, opt, ctx in ((me, oe, torch.enable_grad), (ma, oa, accel.eager)):
            with ctx():
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
        for (n, pe), pa in zip(me.named_parameters(), ma.parameters()):
            torch.testing.assert_close(pa, pe, msg=f"{n} after step {step}")
    after = accel.stats()
    assert after["compile_failures"] == before["compile_failures"], after
    assert after["eager_replays"] == before["eager_replays"], after
    assert after["kernel_runs"] > before["kernel_runs"], after
