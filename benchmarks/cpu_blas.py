"""Float32 matrix products of a PET training step: torch's BLAS (MKL) against oneDNN.

PyTorch's CPU ``mm`` calls MKL. On AMD CPUs MKL takes its AVX2 code path even where
the CPU has AVX-512 (Zen 4, Zen 5), while oneDNN, PyTorch's other CPU math library,
picks its kernels by the instruction sets the CPU reports. This script times both
on the products of the benchmarks' training steps (token-wise layers ``[T, K] x
[K, N]`` with T about 1600 tokens, their weight gradients ``[K, T] x [T, N]``, a
per-atom layer, and a large square product) so that a user can see how far the
BLAS is from what the cores can do. The two are timed in turns on the same
operands (medians); "max rel diff" compares the two results, both float32.

    python benchmarks/cpu_blas.py --threads 2

Results per machine are in benchmarks/README.md; the oneDNN lever is in
docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


SHAPES = [
    # (rows, inner, columns, label)
    (1600, 128, 512, "token-wise layer, d_pet -> 4 d_pet"),
    (1600, 512, 128, "token-wise layer, 4 d_pet -> d_pet"),
    (1600, 128, 128, "token-wise layer, d_pet -> d_pet"),
    (128, 1600, 512, "weight gradient, summed over tokens"),
    (32, 256, 1600, "per-atom layer (32 atoms)"),
    (2048, 2048, 2048, "square, for the peak"),
]


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="turns of each library per shape")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    onednn = getattr(torch._C, "_has_mkldnn", False) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    print(
        f"# torch {torch.__version__}, {args.threads} threads, oneDNN {'available' if onednn else 'not available'}"
    )
    print("| product | BLAS GFLOP/s | oneDNN GFLOP/s | ratio | max rel diff |")
    print("|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for rows, inner, cols, label in SHAPES:
        if rows == 128 and inner == 1600:
            # a weight gradient: both operands are stored token-major, the left one transposed
            a = torch.randn(inner, rows, generator=generator).t()
        else:
            a = torch.randn(rows, inner, generator=generator)
        b = torch.randn(inner, cols, generator=generator)
        flops = 2 * rows * inner * cols
        repeats = max(3, int(2e9 / flops))

        def blas():
            return torch.mm(a, b)

        def dnn():
            # oneDNN's inner product computes x @ w^T
            return torch.ops.mkldnn._linear_pointwise(a, b.t(), None, "none", [], "")

        ref = blas()
        times_blas, times_dnn, diff = [], [], float("nan")
        if onednn:
            other = dnn()
            diff = ((other - ref).abs().max() / ref.abs().max()).item()
        for _ in range(args.rounds):
            times_blas.append(_median_seconds(blas, repeats))
            if onednn:
                times_dnn.append(_median_seconds(dnn, repeats))
        rate_blas = flops / statistics.median(times_blas) / 1e9
        if onednn:
            rate_dnn = flops / statistics.median(times_dnn) / 1e9
            print(
                f"| [{rows}, {inner}] x [{inner}, {cols}] ({label}) | {rate_blas:.0f} | {rate_dnn:.0f} | "
                f"{rate_dnn / rate_blas:.2f}x | {diff:.1e} |"
            )
        else:
            print(f"| [{rows}, {inner}] x [{inner}, {cols}] ({label}) | {rate_blas:.0f} | - | - | - |")


if __name__ == "__main__":
    main()
