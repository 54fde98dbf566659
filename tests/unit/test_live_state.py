"""When a survivor may keep its own state (hyperpodrun/state/live_state.py): only while its values are those of
the save - every way torch changes a model or an optimizer must be seen, `.data` included - whatever object
holds them (a wrapper made again keeps)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hyperpodrun.state.live_state import LiveState
from hyperpodrun.state.state_dicts import rng_state


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
    return LiveState(step, payload)


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
        model[0].weight.mul_(1.0)                                    # an in-place no-op: same values, kept
    assert live.payload_for(1, state) is not None
    with torch.no_grad():
        model[0].weight[3, 4] += 1e-3                                # one element, in place
    assert live.payload_for(1, state) is None
    other = snapshot(1, state)
    assert other.payload_for(1, {k: v for k, v in state.items() if k != "epoch"}) is None


def test_objects_built_again_get_the_previous_generations_tensors(monkeypatch):
    """A model and optimizer built again (inside the re-executed function, or by Lightning's
    configure_optimizers): the saved tensors are still held, so the new objects get their values from them -
    the module's to copy on its device, the optimizer's handed over - unless memory was short when the restart
    began: then the new objects' own values are no step, and they are loaded from a copy."""
    from hyperpodrun.state import live_state
    model, opt, sched, state = setup()
    train_step(model, opt, sched)
    live = snapshot(1, state)
    torch.manual_seed(5)
    model2 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    rebuilt = dict(state, model=model2, opt=opt2)
    payload = live.payload_for(1, rebuilt)
    assert payload is not None and live.handed_over
    kind, sd, keep = payload["state"]["model"]
    assert not keep and torch.equal(sd["0.weight"], model[0].weight)
    assert payload["state"]["opt"][1]["state"][0]["exp_avg"] is opt.state[model[0].weight]["exp_avg"]
    assert live.payload_for(1, state)["state"]["model"][2] is True      # the objects that hold them: kept
    monkeypatch.setattr(live_state, "_free_bytes", lambda device: 0)
    assert live.release_if_short() is False                          # no room beside a model built again
    assert live.payload_for(1, rebuilt) is None
    assert live.payload_for(1, state) is not None                    # the old objects still hold the step


@pytest.mark.parametrize("change", ["add", "element", "copy", "zero"])
def test_a_change_through_data_is_seen(change):
    """`.data` bypasses the version counter; the values are compared, so it is seen all the same."""
    model, opt, sched, state = setup()
    train_step(model, opt, sched)
    live = snapshot(1, state)
    w = model[1].weight
    if change == "add":
        w.data.add_(1e-6)
    elif change == "element":
        w.data[0, 5] = w.data[0, 5] * 1.001
    elif change == "copy":
        w.data.copy_(torch.randn_like(w))
    else:
        opt.state[w]["exp_avg"].data.zero_()                          # the optimizer's state too
    assert live.payload_for(1, state) is None


def test_a_wrapper_made_again_around_the_same_module_keeps():
    """The README's wrapping: the module and optimizer built once, DDP made again in each generation around
    the same module (its construction broadcast writes every parameter in place, same values): kept."""
    import datetime

    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        model, opt, sched, _ = setup()
        ddp = nn.parallel.DistributedDataParallel(model)
        state = {"model": ddp, "opt": opt}
        train_step(ddp, opt)
        live = snapshot(1, state)
        versions = [p._version for p in model.parameters()]
        again = nn.parallel.DistributedDataParallel(model)           # the next generation's wrapper
        assert again is not ddp
        payload = live.payload_for(1, {"model": again, "opt": opt})
        assert payload is not None, [p._version for p in model.parameters()] + versions
        assert live.payload_for(1, {"model": model, "opt": opt}) is None   # bare now: other keys
    finally:
        dist.destroy_process_group()


def test_the_order_of_the_state_dict_does_not_matter():
    model, opt, sched, state = setup()
    train_step(model, opt, sched)
    live = snapshot(1, state)
    payload = live.payload_for(1, dict(reversed(list(state.items()))))
    assert payload is not None and payload["state"]["model"][1]["0.weight"].data_ptr() == model[0].weight.data_ptr()


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


def test_why_a_state_is_not_kept_live_is_said():
    """The restore's log line says why a survivor copies its state back: another step, an in-place change."""
    model, opt, _sched, state = setup()
    train_step(model, opt)
    live = snapshot(1, state)
    assert live.payload_for(2, state) is None and "last save() was step 1" in live.why_not
    assert live.payload_for(1, state) is not None and live.why_not == ""
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert live.payload_for(1, state) is None and "changed since the save" in live.why_not
