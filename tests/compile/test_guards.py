"""The size checks of petfunc/compile/guards.py: a trace's size relations are
checked at every call and a broken one is named by its input's path."""

import pytest
import torch

from petfunc.compile.guards import TraceGuards


def test_trace_guards_pass_a_well_formed_call_and_name_what_breaks():
    guards = TraceGuards(
        ["L['t0'].size()[0] == L['t1'].size()[0]", "L['t0'].size()[1] == 3"],
        ["args[0]['positions']", "args[0]['charges']"],
    )
    guards.check([torch.zeros(4, 3), torch.zeros(4)])
    guards.check([torch.zeros(7, 3), torch.zeros(7)])
    with pytest.raises(ValueError, match=r"args\[0\]\['positions'\]\.size\(\)\[1\] == 3") as info:
        guards.check([torch.zeros(4, 2), torch.zeros(4)])
    assert "charges" not in str(info.value)  # only the broken relation
    with pytest.raises(ValueError, match=r"positions'\]\.size\(\)\[0\] == args\[0\]\['charges'\]"):
        guards.check([torch.zeros(4, 3), torch.zeros(5)])


def test_no_trace_guards_accept_anything():
    TraceGuards([], []).check([torch.zeros(2), torch.zeros(3, 3)])
