"""The device a command or option asks for: checked, and each error says what is
missing (a CUDA build of torch, a visible device, that index)."""

import pytest
import torch

from petfunc.devices import auto_device, device_type, resolve_device


def without_cuda_build(monkeypatch):
    """This process as a CPU-only build of torch sees it, whatever the machine."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_is_always_there():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu"), "--device") == torch.device("cpu")


def test_cuda_on_a_torch_without_cuda(monkeypatch):
    without_cuda_build(monkeypatch)
    with pytest.raises(ValueError, match=r"^--device cuda: this torch has no CUDA \(torch .*\); install"):
        resolve_device("cuda", "--device")
    with pytest.raises(ValueError, match=r"^option 'device' is 'cuda:1': this torch has no CUDA"):
        resolve_device("cuda:1", "option 'device'")


def test_cuda_build_without_a_visible_device(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^--device cuda: no CUDA device is visible"):
        resolve_device("cuda", "--device")


def test_index_past_the_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1", "--device") == torch.device("cuda", 1)
    assert resolve_device("cuda", "--device") == torch.device("cuda")
    with pytest.raises(
        ValueError, match=r"^--device cuda:2: 2 CUDA device\(s\) are visible \(cuda:0 to cuda:1\)"
    ):
        resolve_device("cuda:2", "--device")


@pytest.mark.parametrize("text", ["cuda:x", "mps", "meta"])
def test_other_devices_are_refused(text):
    with pytest.raises(ValueError, match=rf"^--device {text}: "):
        resolve_device(text, "--device")


def test_auto_is_cuda_when_visible_else_the_cpu(monkeypatch):
    """metatrain's default: the best device of the machine."""
    without_cuda_build(monkeypatch)
    assert resolve_device("auto") == torch.device("cpu") == auto_device()
    assert device_type("auto") == "cpu"
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto", "--device") == torch.device("cuda") == auto_device()
    assert resolve_device("AUTO", "--device") == torch.device("cuda")
    assert device_type("auto") == "cuda"


def test_gpu_is_metatrain_name_of_cuda(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("gpu", "--device") == torch.device("cuda")
    assert resolve_device("GPU", "option 'device'") == torch.device("cuda")
    assert device_type("gpu") == "cuda"
    # without a GPU it is refused as cuda is, in the words of what asked for it
    without_cuda_build(monkeypatch)
    with pytest.raises(ValueError, match=r"^--device gpu: this torch has no CUDA"):
        resolve_device("gpu", "--device")


@pytest.mark.parametrize("text", ["multi-gpu", "multi-cuda"])
def test_several_gpus_in_one_process_are_refused(text):
    """metatrain's multi-gpu: petfunc takes one device per process, and says how to
    train on several."""
    with pytest.raises(ValueError, match=rf"^option 'device' is '{text}': petfunc trains on one device per "):
        resolve_device(text, "option 'device'")
    with pytest.raises(ValueError, match="torchrun or SLURM's srun"):
        resolve_device(text, "--device")
