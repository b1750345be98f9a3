"""The FFT shape functions that petfunc.compile traces P3M with (fft_c2c, fft_c2r,
fft_r2c): the sizes, strides and dtypes of the CPU kernels' outputs."""

import torch

from tests.helpers.patches import patch


def test_fft_shape_functions_match_the_kernels():
    """The shape functions give the outputs of the FFT kernels the sizes, strides and
    dtypes that the CPU kernels give them, for contiguous inputs (what P3M passes)
    and any transformed dimensions. (For other layouts torch's own meta functions
    disagree with its kernels too; inductor asserts the strides of such outputs at
    run time.)"""
    fft = patch("fft_meta").module  # petfunc's shape functions, used or not
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 4, 6, 5), (2, 5, 4, 3), (7, 8, 8, 8)]:
        x = torch.randn(*shape, dtype=torch.complex128, generator=g)
        for dims in [(1, 2, 3), (1, 2), (3,), (0, 2), (0, 1, 2, 3), (2,), (0,)]:
            out = torch.ops.aten._fft_c2c(x, list(dims), 0, True)
            ours = fft.fft_c2c(x, list(dims), 0, True)
            assert (ours.shape, ours.stride()) == (out.shape, out.stride()), ("c2c", shape, dims)
            for last in (2 * (x.shape[dims[-1]] - 1), 2 * x.shape[dims[-1]] - 1):
                out = torch.ops.aten._fft_c2r(x, list(dims), 0, last)
                ours = fft.fft_c2r(x, list(dims), 0, last)
                assert (ours.shape, ours.stride(), ours.dtype) == (out.shape, out.stride(), out.dtype), (
                    "c2r",
                    shape,
                    dims,
                )
    # r2c (used on every torch version): also for permuted inputs
    for shape in [(3, 4, 6, 5), (2, 5, 4, 3), (7, 8, 8, 8), (2, 16, 8, 32)]:
        real = torch.randn(*shape, dtype=torch.float64, generator=g)
        for x in (real, real.permute(0, 2, 1, 3), real.permute(3, 1, 0, 2), real.float()):
            for dims in [(1, 2, 3), (1, 2), (3,), (0, 2), (0, 1, 2, 3), (2,), (0,), (2, 1, 3)]:
                for onesided in (True, False):
                    out = torch.ops.aten._fft_r2c(x, list(dims), 0, onesided)
                    ours = fft.fft_r2c(x, list(dims), 0, onesided)
                    assert (ours.shape, ours.stride(), ours.dtype) == (out.shape, out.stride(), out.dtype), (
                        "r2c",
                        shape,
                        x.stride(),
                        dims,
                        onesided,
                    )
