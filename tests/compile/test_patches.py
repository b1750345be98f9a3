"""petfunc's patches of torch internals (patches() of petfunc.compile): one registry,
each patch installed and undone exactly, a failing install warned about once and
torch left as it ships, the settings that switch patches off, and for each
correctness patch the torch defect it works around (these tests fail once torch
fixes it: the patch can go then).

Tests of single patches reach them through the registry: ``patch(name)`` of
tests/helpers/patches.py; a patch's ``module`` is the module that implements it.
"""

import warnings

import pytest
import torch
from torch.func import grad, vmap

import petfunc
from petfunc.compile import PatchUnavailableError, PatchWarning, patches, symbolic_vmap_rules
from tests.helpers.patches import patch


NAMES = [p.name for p in patches()]
SETTINGS = ("PETFUNC_STOCK_TORCH", "PETFUNC_PATCHES_OFF", "PETFUNC_GROUP_KERNELS", "PETFUNC_FAST_STRIDES")


@pytest.fixture
def clean_settings(monkeypatch):
    """No setting switches a patch off."""
    for name in (*SETTINGS, "PETFUNC_EARLY_ADDMM_SPLIT"):
        monkeypatch.delenv(name, raising=False)


def test_the_registry_lists_every_patch_once():
    assert len(NAMES) == len(set(NAMES))
    assert set(NAMES) == {
        "vmap_rules",
        "layer_norm_decomposition",
        "fft_meta",
        "triton_tiling",
        "kernel_groups",
        "fast_strides",
        "unguarded_sum_helper",
        "addmm_split",
        "addmm_merge_hold",
    }
    for p in patches():
        assert p.purpose in ("speed", "correctness") and p.summary and p.module is not None
        assert not p.installed, p  # outside petfunc's own work torch is as it ships


@pytest.mark.parametrize("name", NAMES)
def test_install_and_uninstall_restore_torch_exactly(name, clean_settings):
    p = patch(name)
    if not p.needed:
        pytest.skip(f"this torch does not need {name}")
    targets = p.targets()
    originals = [getattr(owner, attribute) for owner, attribute in targets]
    before = p.state()
    assert p.install() and p.installed
    assert p.state() != before
    assert p.install()  # re-entrant: held twice, undone after the last
    p.uninstall()
    assert p.installed and p.state() != before
    p.uninstall()
    assert not p.installed and p.state() == before
    assert all(
        getattr(owner, attribute) is original for (owner, attribute), original in zip(targets, originals)
    )
    with p.scope():
        assert p.installed
    assert p.state() == before
    with pytest.raises(RuntimeError, match="without install"):
        p.uninstall()


@pytest.mark.parametrize("name", NAMES)
def test_a_failing_install_warns_once_and_leaves_torch_unpatched(name, clean_settings, monkeypatch):
    """A private name of torch moved (simulated: the patch's first target deleted):
    the install warns once, names the patch and the error, and changes nothing."""
    p = patch(name)
    if not p.needed:
        pytest.skip(f"this torch does not need {name}")
    monkeypatch.setattr(p, "warned", False)
    owner, attribute = p.targets()[0]
    with monkeypatch.context() as moved:
        moved.delattr(owner, attribute)
        before = p.state()
        with pytest.warns(PatchWarning, match=rf"{name}.*AttributeError"):
            assert not p.install()
        assert not p.installed and isinstance(p.failure, AttributeError)
        assert p.state() == before
        p.uninstall()
        with warnings.catch_warnings():
            warnings.simplefilter("error", PatchWarning)  # once only
            with p.scope():
                assert not p.installed
        assert p.state() == before
    with p.scope():  # torch as it was: installs again
        assert p.installed and p.failure is None


@pytest.mark.parametrize("setting", ["PETFUNC_STOCK_TORCH=1", "PETFUNC_PATCHES_OFF=fast_strides,vmap_rules"])
def test_settings_switch_patches_off(setting, clean_settings, monkeypatch):
    name, value = setting.split("=")
    monkeypatch.setenv(name, value)
    off = set(NAMES) if name == "PETFUNC_STOCK_TORCH" else {"fast_strides", "vmap_rules"}
    for p in patches():
        before = p.state()
        with p.scope():
            assert p.installed == (p.needed and p.name not in off), p
            if not p.installed:
                assert p.state() == before


def test_switches_of_single_patches(clean_settings, monkeypatch):
    for name, switch in [
        ("kernel_groups", "PETFUNC_GROUP_KERNELS"),
        ("fast_strides", "PETFUNC_FAST_STRIDES"),
        ("addmm_merge_hold", "PETFUNC_EARLY_ADDMM_SPLIT"),
    ]:
        monkeypatch.setenv(switch, "0")
        assert not patch(name).enabled()
        monkeypatch.setenv(switch, "1")
        assert patch(name).enabled() == patch(name).needed
    # the merge is only held where CPU addmm is split
    monkeypatch.setenv("PETFUNC_PATCHES_OFF", "addmm_split")
    assert not patch("addmm_merge_hold").enabled()


# ---------------------------------------------------------------------------------------
# the torch defects behind the correctness patches


def _cat_of_rows(w, x):
    return vmap(lambda r: torch.cat([r * w, r]).square().sum())(x)


def _rows(rows, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dtype=torch.float64, generator=g), torch.randn(
        rows, n, dtype=torch.float64, generator=g
    )


def test_torch_batching_rules_fix_sizes(clean_settings, monkeypatch):
    """vmap_rules: torch's own batching rule of ``cat`` reads sizes as integers, so a
    traced vmap holds only for the traced sizes (petfunc.compile refuses other sizes
    by its trace guards); with the patch one graph serves every size."""
    monkeypatch.setenv("PETFUNC_PATCHES_OFF", "vmap_rules")
    stock = petfunc.compile(_cat_of_rows, *_rows(3, 5), backend="aot_eager", static_argnums=())
    torch.testing.assert_close(stock(*_rows(3, 5, 1)), _cat_of_rows(*_rows(3, 5, 1)))
    with pytest.raises(ValueError, match=r"args\[1\]\.size\(\)\[0\] == 3"):
        stock(*_rows(4, 5))
    monkeypatch.delenv("PETFUNC_PATCHES_OFF")
    compiled = petfunc.compile(_cat_of_rows, *_rows(3, 5), backend="aot_eager", static_argnums=())
    for rows, n in ((3, 5), (4, 5), (3, 7), (6, 9)):
        torch.testing.assert_close(compiled(*_rows(rows, n, 2)), _cat_of_rows(*_rows(rows, n, 2)))
    assert compiled.num_graphs == 1


def test_a_traced_vmap_needs_the_vmap_rules(clean_settings, monkeypatch):
    """Without vmap_rules, symbolic_vmap_rules (ensembles, Hessians) refuses to be
    traced, with an error that names the patch; eagerly it runs torch's own rules."""

    def fn(w, x):
        with symbolic_vmap_rules():
            return _cat_of_rows(w, x)

    monkeypatch.setenv("PETFUNC_PATCHES_OFF", "vmap_rules")
    torch.testing.assert_close(fn(*_rows(3, 5)), _cat_of_rows(*_rows(3, 5)))
    with pytest.raises(PatchUnavailableError, match="vmap_rules"):
        petfunc.compile(fn, *_rows(3, 5), backend="aot_eager", static_argnums=())


def _third_derivative(layer_norm, x, w, u, v):
    """d/dx of <d/dx <d/dx sum(tanh(layer_norm(x)) w), v>, u>."""

    def energy(y):
        return (torch.tanh(layer_norm(y)) * w).sum()

    def second(y):
        return (grad(lambda z: (grad(energy)(z) * v).sum())(y) * u).sum()

    return grad(second)(x)


def test_torch_layer_norm_third_derivative_is_wrong(clean_settings, monkeypatch):
    """layer_norm_decomposition: torch's third derivative of layer norm is wrong (not
    round-off: order 1 here); decomposed it equals that of the formula written out.
    Without the patch the decomposition is refused with an error naming it."""
    g = torch.Generator().manual_seed(0)
    x, w, u, v = (torch.randn(4, 6, dtype=torch.float64, generator=g) for _ in range(4))

    def native(y):
        return torch.nn.functional.layer_norm(y, (6,))

    def written_out(y):
        mean = y.mean(-1, keepdim=True)
        return (y - mean) / torch.sqrt(((y - mean) ** 2).mean(-1, keepdim=True) + 1e-5)

    reference = _third_derivative(written_out, x, w, u, v)
    assert (_third_derivative(native, x, w, u, v) - reference).abs().max() > 1e-3
    with symbolic_vmap_rules(decompose_layer_norm=True):
        torch.testing.assert_close(_third_derivative(native, x, w, u, v), reference, rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("PETFUNC_PATCHES_OFF", "layer_norm_decomposition")
    with pytest.raises(PatchUnavailableError, match="layer_norm_decomposition"):
        with symbolic_vmap_rules(decompose_layer_norm=True):
            pass


def _mesh_convolution(x):
    """``ifftn(fftn(x) * 2).real`` summed per mesh, as P3M convolves its mesh."""
    return (
        torch.fft.ifftn(torch.fft.fftn(x, dim=(-3, -2, -1)) * 2.0, dim=(-3, -2, -1))
        .real.square()
        .sum((-1, -2, -3))
    )


def test_torch_fft_meta_fixes_sizes(clean_settings, monkeypatch):
    """fft_meta: torch's shape functions of the FFT kernels fix the mesh sizes of a
    trace (petfunc.compile then refuses other meshes); with the patch one graph serves
    every mesh."""
    g = torch.Generator().manual_seed(0)

    def mesh(*sizes):
        return torch.randn(*sizes, dtype=torch.float64, generator=g)

    monkeypatch.setenv("PETFUNC_PATCHES_OFF", "fft_meta")
    stock = petfunc.compile(_mesh_convolution, mesh(2, 4, 5, 6), backend="aot_eager", static_argnums=())
    x = mesh(2, 4, 5, 6)
    torch.testing.assert_close(stock(x), _mesh_convolution(x))
    with pytest.raises(ValueError, match="assumed"):
        stock(mesh(3, 5, 6, 7))
    monkeypatch.delenv("PETFUNC_PATCHES_OFF")
    compiled = petfunc.compile(_mesh_convolution, mesh(2, 4, 5, 6), backend="aot_eager", static_argnums=())
    for sizes in ((2, 4, 5, 6), (3, 5, 6, 7), (2, 8, 3, 4)):
        x = mesh(*sizes)
        torch.testing.assert_close(compiled(x), _mesh_convolution(x))
    assert compiled.num_graphs == 1
