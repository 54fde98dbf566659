"""hyperpodrun's flag table checked against the installed torchrun's own parser
(torch.distributed.run.get_args_parser): every option string torchrun has - both spellings, short forms,
-h/--help - is a hyperpodrun option, takes a value exactly when torchrun's does, and reads the same PET_*
variable. A torchrun release that adds a flag fails here (CI on torch 2.13, scripts/test-compat.sh on
another torch) instead of surprising a user with "No such option"."""
from __future__ import annotations

import argparse

import click
import pytest
import torch
from torch.distributed.run import get_args_parser

from hyperpodrun.cli import launch


def _theirs() -> list[argparse.Action]:
    return [a for a in get_args_parser()._actions if a.option_strings]


def _ours() -> dict[str, click.Parameter]:
    with launch.make_context("hyperpodrun", ["train.py"], resilient_parsing=True) as ctx:
        params = launch.get_params(ctx)     # -h/--help from the command's own context settings
    out: dict[str, click.Parameter] = {}
    for param in params:
        if isinstance(param, click.Option):
            for opt in (*param.opts, *param.secondary_opts):
                out[opt] = param
    return out


def test_the_installed_torchrun_has_options_to_compare():
    """The comparison below is not vacuous: torchrun's parser has its long-standing options."""
    strings = {s for a in _theirs() for s in a.option_strings}
    assert {"--nproc-per-node", "--nproc_per_node", "--rdzv-backend", "-m", "-r", "-t"} <= strings, strings


def test_every_torchrun_option_string_is_a_hyperpodrun_option():
    ours = _ours()
    missing = sorted(s for a in _theirs() for s in a.option_strings if s not in ours)
    assert not missing, (f"torch {torch.__version__}'s torchrun has options hyperpodrun does not accept: "
                         f"{missing}; add them to hyperpodrun/cli.py (and docs/flags.md)")


@pytest.mark.parametrize("action", _theirs(), ids=lambda a: a.option_strings[-1])
def test_each_torchrun_option_takes_a_value_when_torchruns_does_and_reads_its_pet_variable(action):
    ours = _ours()
    if action.option_strings[0] not in ours:
        pytest.fail(f"{action.option_strings} missing (see the test above)")
    param = ours[action.option_strings[0]]
    assert all(ours.get(s) is param for s in action.option_strings), \
        f"{action.option_strings}: the spellings are different hyperpodrun options"
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return
    takes_value = action.nargs != 0
    assert isinstance(param, click.Option) and param.is_flag is not takes_value, \
        f"{action.option_strings}: torchrun {'takes' if takes_value else 'takes no'} value, hyperpodrun differs"
    if type(action).__name__ in ("env", "check_env"):       # torchrun's PET_* reading actions
        pet = f"PET_{action.dest.upper()}"
        envvars = param.envvar if isinstance(param.envvar, (list, tuple)) else [param.envvar]
        assert pet in envvars, f"{action.option_strings}: torchrun reads {pet}; hyperpodrun reads {envvars}"
