"""When a survivor may keep its own state (hyperpodrun/runtime/live_state.py): only while nothing of it
changed since the save - every way torch changes a model or an optimizer must be seen."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hyperpodrun.runtime.live_state import LiveState
from hyperpodrun.runtime.state_dicts import rng_state


def setup(batchnorm: bool = False, **opt_kwargs):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8)] + ([nn.BatchNorm1d(8)] if batchnorm else []) + [nn.Linear(8, 1)]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opt_kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = {"model": model, "opt": opt, "sched": sched, "epoch": {"n": 3}}
    return model, opt, sched, state


def train_step(model, opt, sched=None):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if sched is not None:
        sched.step()


def snapshot(step, state) -> LiveState:
    payload = {"state": {k: (("sd", v.state_dict()) if hasattr(v, "state_dict") else ("value", v))
                         for k, v in state.items()}, "rng": rng_state()}
    return LiveState(step, payload, state)


@pytest.mark.parametrize("opt_kwargs", [{"foreach": False}, {"foreach": True}, {"fused": True}],
                         ids=["for-loop", "foreach", "fused"])
def test_an_optimizer_step_after_the_save_is_seen(opt_kwargs):
    model, opt, sched, state = setup(**opt_kwargs)
    train_step(model, opt, sched)
    live = snapshot(1, state)
    loss = model(torch.randn(4, 8)).pow(2).mean()   # forward and backward of the next step change nothing
    opt.zero_grad()
    loss.backward()
    payload = live.payload_for(1, state)
    assert payload is not None
    assert payload["state"]["opt"][1]["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]
    assert payload["state"]["epoch"][1] == {"n": 3}
    opt.step()
    assert live.payload_for(1, state) is None


def test_other_steps_objects_and_in_place_changes_are_seen():
    model, opt, sched, state = setup()
    train_step(model, opt, sched)
    live = snapshot(1, state)
    assert live.payload_for(2, state) is None                       # the job restores another step
    with torch.no_grad():
        model[0].weight.mul_(1.0)                                    # an in-place change, even a no-op one
    assert live.payload_for(1, state) is None
    other = snapshot(1, state)
    rebuilt = dict(state, model=nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
    assert other.payload_for(1, rebuilt) is None                    # built again: not the saved object
    assert other.payload_for(1, {k: v for k, v in state.items() if k != "epoch"}) is None


def test_a_buffer_updated_in_forward_is_seen():
    model, opt, sched, state = setup(batchnorm=True)
    train_step(model, opt)
    live = snapshot(1, state)
    model.eval()
    model(torch.randn(4, 8))                                        # eval: running stats untouched
    assert live.payload_for(1, state) is not None
    model.train()
    model(torch.randn(4, 8))                                        # train: running stats move
    assert live.payload_for(1, state) is None


def test_values_and_hyper_parameters_come_from_the_save_not_the_live_objects():
    model, opt, sched, state = setup()
    train_step(model, opt, sched)
    live = snapshot(1, state)
    saved_lr = opt.param_groups[0]["lr"]
    state["epoch"]["n"] = 99                                         # mutated after the save
    sched.step()                                                     # lr changed, no tensor touched
    payload = live.payload_for(1, state)
    assert payload is not None
    assert payload["state"]["epoch"][1] == {"n": 3}
    assert payload["state"]["opt"][1]["param_groups"][0]["lr"] == saved_lr
    assert payload["state"]["model"][2] is True and payload["state"]["opt"][2] is False
