"""Tracing for export (petfunc.export.program): the sizes it keeps symbolic must not be
bounded, and a program for another device is traced on the CPU and moved."""

import pytest
import torch

import petfunc.export as pexport
from petfunc.compile import trace_device
from tests.helpers.exported import CONFIG, make_params


def test_check_dynamic_finds_bounds():
    """Export can keep a size symbolic and still bound it: the artifact would then
    refuse batches that the model takes."""

    class Cat(torch.nn.Module):
        def forward(self, a, b):
            return torch.cat([a, b])

    class Branch(torch.nn.Module):
        def forward(self, a, b):
            return a * 2 if a.shape[0] > 5 else a, b

    auto = torch.export.Dim.AUTO
    names = ("species", "centers")
    dynamic = ({0: auto}, {0: auto})
    a, b = torch.ones(8), torch.ones(7)
    pexport.check_dynamic(torch.export.export(Cat(), (a, b), dynamic_shapes=dynamic), names)
    with pytest.raises(RuntimeError, match=r"bounded the size s\d+ to \[6, "):
        pexport.check_dynamic(torch.export.export(Branch(), (a, b), dynamic_shapes=dynamic), names)
    with pytest.raises(RuntimeError, match="specialised size 0 of 'centers' to 7"):
        pexport.check_dynamic(torch.export.export(Cat(), (a, b), dynamic_shapes=({0: auto}, None)), names)


def test_export_for_another_device_is_traced_on_the_cpu(monkeypatch):
    """For a GPU the export is traced on the CPU and moved (petfunc.compile's
    trace_device, then its graph move). Checked with the meta device standing in for the
    GPU: every constant of the program (the weights included) and every output must
    be on it, or the run fails."""
    own = trace_device
    monkeypatch.setattr(
        "petfunc.export.program.trace_device",
        lambda tensors: torch.device("cpu") if tensors[0].device.type == "meta" else own(tensors),
    )
    program, example = pexport.trace(CONFIG, make_params(), torch.float64, "meta")
    assert {t.device.type for t in example} == {"meta"}
    constants = [
        v
        for v in list(program.constants.values()) + list(program.state_dict.values())
        if isinstance(v, torch.Tensor)
    ]
    assert constants and all(v.device.type == "meta" for v in constants)
    out = program.module()(*example)
    assert len(out) == len(pexport.OUTPUTS) and all(t.device.type == "meta" for t in out)
