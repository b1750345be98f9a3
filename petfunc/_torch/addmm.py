"""CPU ``addmm`` split into ``mm`` plus an add that fuses into the next kernel.

Inductor merges ``mm + add`` into ``addmm`` on CPU (on GPUs it splits it again where
the sum only feeds elementwise ops). ATen's CPU ``addmm`` first copies the broadcast
bias into the output and then has the GEMM accumulate onto it: one more write and
read of every product. Split, the add fuses into the kernel that reads the product
next (an activation, a norm, the next gather), for each of the linear layers and
residual sums of a training step; where the product only feeds another matmul, the
add costs what the copy did. A faster step (``benchmarks/compare_step.py
--patches-off addmm_split``, see docs/performance.md).

Two patches:

* :data:`ADDMM_SPLIT` runs :func:`split_cpu_addmm` as inductor's
  ``post_grad_custom_post_pass``, after inductor's own passes. Inductor puts that
  pass's ``uuid()`` into the key of its FX-graph cache: the uuid names petfunc's
  code-generation patches (:func:`petfunc._torch.patch.codegen_hash` and the patches
  installed), so a graph compiled by another petfunc, or with other patches, is
  compiled again instead of loaded with other kernels.
* :data:`ADDMM_MERGE_HOLD` holds inductor's merge of CPU ``mm + add`` back (its
  check ``should_prefer_unfused_addmm`` answers yes for CPU tensors), and
  :func:`petfunc.compile.inductor.compile_inductor_direct` splits the graph before
  inductor's passes instead. Split after the merge, every split made new nodes, and
  inductor's incremental fake-tensor update after its passes re-propagated every
  node downstream of a new one (nearly the whole training step): a shorter cold
  compile (``benchmarks/cold_compile.py --variants grouped late_split``).
"""

from __future__ import annotations

import sys

import torch

from petfunc._torch import versions
from petfunc._torch.patch import SPEED, codegen_hash, installed_names, replacing


def split_cpu_addmm(graph: torch.fx.Graph) -> None:
    """Split every CPU ``addmm(bias, a, b)`` of ``graph`` into ``mm(a, b) + bias``."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default:
            continue
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            continue
        bias, a, b = node.args
        value = node.meta.get("val")
        if (
            not isinstance(bias, torch.fx.Node)
            or value is None
            or value.device.type != "cpu"
            or not node.users
        ):
            continue
        with graph.inserting_before(node):
            product = graph.call_function(aten.mm.default, (a, b))
            product.meta["val"] = aten.mm.default(a.meta["val"], b.meta["val"])
            total = graph.call_function(aten.add.Tensor, (product, bias))
            total.meta["val"] = value
        node.replace_all_uses_with(total)
        graph.erase_node(node)


def post_grad_pass():
    """petfunc's graph pass for inductor's ``post_grad_custom_post_pass``
    (:func:`split_cpu_addmm`), whose ``uuid()`` names petfunc's code generation
    (the module docstring)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class PetfuncPostGrad(CustomGraphPass):
        def __call__(self, graph):
            split_cpu_addmm(graph)

        def uuid(self):
            return f"petfunc-codegen-{codegen_hash()}-{','.join(installed_names())}"

    return PetfuncPostGrad()


def _config_targets():
    import torch._inductor.config

    return [(torch._inductor.config, "post_grad_custom_post_pass")]


# WORKAROUND(torch<2.15): inductor merges CPU mm + add into addmm, whose bias copy
# costs a pass over every product. Remove when inductor splits CPU addmm where the
# add can fuse into a consumer (as it does on GPUs).
ADDMM_SPLIT = replacing(
    "addmm_split",
    purpose=SPEED,
    needed=versions.INDUCTOR_SPEED_PATCHES,
    summary="CPU addmm split into mm + add after inductor's passes (post_grad_custom_post_pass), "
    "whose uuid keys inductor's cache by petfunc's code generation",
    module=sys.modules[__name__],
    targets=_config_targets,
    # a pass of the user's own (set in inductor's config) is left in place
    replacements=lambda original: [post_grad_pass() if original is None else original],
)


def _hold_targets():
    from torch._inductor.fx_passes import post_grad

    # the merge pattern this check belongs to; a torch without it has other passes
    post_grad.is_valid_addmm_fusion  # noqa: B018 - fails the install where it is missing
    return [(post_grad, "should_prefer_unfused_addmm")]


def _hold_replacements(original):
    def prefer_unfused(match):
        bias = match.kwargs.get("inp")
        value = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return True
        return original(match)

    return [prefer_unfused]


# WORKAROUND(torch<2.15): as ADDMM_SPLIT; splitting before inductor's passes needs
# its merge held back, or the split it undoes costs a re-propagation of fake tensors
# through the graph. Remove with ADDMM_SPLIT.
ADDMM_MERGE_HOLD = replacing(
    "addmm_merge_hold",
    purpose=SPEED,
    needed=versions.INDUCTOR_SPEED_PATCHES,
    summary="inductor's merge of CPU mm + add held back, the graph split before its passes",
    module=sys.modules[__name__],
    targets=_hold_targets,
    replacements=_hold_replacements,
    # holding the merge without the split would leave CPU mm + add unmerged: not stock
    wanted=ADDMM_SPLIT.enabled,
)
