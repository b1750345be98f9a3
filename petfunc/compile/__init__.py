"""``petfunc.compile(fn, *example_args)``: trace once with ``make_fx``, compile the
graph for symbolic sizes (what ``torch.compile(dynamic=True, fullgraph=True)`` does,
without Dynamo's second trace). It knows pytrees and torch, not PET.

The function (a train step, an energy-forces-stress evaluation, a Hessian...) may
take and return any pytree of tensors (dicts, lists, NamedTuples such as
:class:`~petfunc.TrainState`, :class:`~petfunc.data.Batch`, torchopt states).

1. The pytree is flattened; tensors become graph inputs, everything else is a
   constant that must not change between calls.
2. ``make_fx`` traces the whole function, torch.func transforms included, into one
   aten graph, on fake inputs whose data sizes are symbols (parameter sizes, in
   ``static_argnums``, stay fixed) (:mod:`petfunc.compile.trace`). Duck shaping is
   off, so equal sizes at trace time (say 3 structures and the 3 of xyz) are not
   merged into one symbol. Inputs on one GPU are traced as CPU tensors and the graph
   is moved to the GPU afterwards (:func:`trace_device`, :func:`move_graph`).
3. At the first call the ``torch.compile`` backend (``"inductor"``,
   ``"aot_eager"``, ... or a backend callable) compiles that graph, given fake
   inputs with symbolic sizes, exactly as Dynamo hands a graph to a backend
   (:mod:`petfunc.compile.inductor`). Dynamo itself is skipped: the graph is already
   a flat aten graph, and re-tracing it cost much of a warm compile. What Dynamo's
   guards did is kept: every assumption the backend makes about the sizes (at least
   2; a kernel choice for n > 16; ...) is recorded in the shape environment and
   checked at every call; a call that breaks it compiles another graph, as a Dynamo
   recompilation would. Dtype, device, rank and the fixed parameter shapes are
   checked too, with a clear error. For inductor, AOTAutograd is skipped as well:
   one functionalizing, decomposing re-trace goes straight to inductor's inference
   compiler instead of AOTAutograd's two (``aot_autograd=True`` or
   ``PETFUNC_DIRECT_INDUCTOR=0`` restores the usual path, whose cache gives faster
   warm starts). Inductor's probe of the CPU's vector instruction sets runs in a
   background thread while ``make_fx`` traces (:mod:`petfunc.compile.isa_probe`).
4. Any later batch, whatever its numbers of structures, atoms, edges and
   neighbours, reuses the graph, provided no size is 0 or 1 (torch specialises
   those): :func:`petfunc.data.make_batch` pads batches for this.
5. Calls run under ``torch.no_grad()``: gradients are graph outputs, never a
   backward through the compiled region (which would silently drop second-order
   terms).
6. While it traces and compiles, petfunc holds its patches of torch's internals
   (:func:`patches`): symbolic-size vmap rules and FFT shape functions (needed for
   ensembles, Hessians and P3M), and levers that make inductor's cold compile or
   its CPU code faster (kernels built a few per library, a cheaper stride analysis,
   the float32 summation choice without a guard, CPU ``addmm`` split, fewer fusion
   attempts). Each is gated on the torch version and optional:
   ``PETFUNC_STOCK_TORCH=1`` turns them all off, ``PETFUNC_PATCHES_OFF=name,...``
   some of them (:mod:`petfunc._torch.settings`).
7. Static tensors that are consecutive views of one buffer (a state made by
   :func:`petfunc.init_state`: the parameters, each optimizer moment) enter the
   graph as that one buffer, and outputs packed the same way leave it as one
   (:mod:`petfunc.compile.donation`). The traced optimizer step then runs on whole
   vectors. Any later call may pass other tensors: a run that is not packed any more
   is copied into a buffer first.
8. ``donate_argnums`` (as in JAX): outputs laid out like a donated packed buffer
   (the new parameters, each new moment) are written into it by the graph itself,
   so inductor's update kernel overwrites the old state in place. The donated
   argument must not be used after the call.

``compiled.num_graphs`` counts the graphs compiled for this function: 1 after the
first call, and it must stay 1.

**Trace cache.** ``make_fx`` takes seconds to tens of seconds for PET's
derivatives, in every new process. With ``cache_key`` the traced graph is kept in a
file (:func:`trace_cache_dir`, :mod:`petfunc.compile.cache`) and a later process
with the same key, the same petfunc source, the same torch and the same input
signature loads it instead of tracing. The key must name everything the traced
function bakes in that is not an input (the architecture, loss weights, schedule
constants...); :class:`petfunc.ase.PETCalculator` uses it, keyed by its config. The
file is a pickle, trusted like inductor's own cache of generated code next to it.

**Input checks.** Layers above may refuse example inputs they know a backend to
miscompile: :func:`register_input_check`.
"""

from petfunc._torch.patch import Patch as Patch
from petfunc._torch.patch import PatchWarning as PatchWarning
from petfunc._torch.patch import codegen_hash as codegen_hash
from petfunc._torch.registry import patches as patches
from petfunc._torch.vmap_rules import PatchUnavailableError as PatchUnavailableError
from petfunc._torch.vmap_rules import symbolic_vmap_rules as symbolic_vmap_rules
from petfunc.compile.api import compile as compile
from petfunc.compile.api import input_checks as input_checks
from petfunc.compile.api import register_input_check as register_input_check
from petfunc.compile.cache import source_hash as source_hash
from petfunc.compile.cache import trace_cache_dir as trace_cache_dir
from petfunc.compile.compiled import Compiled as Compiled
from petfunc.compile.trace import fake_inputs as fake_inputs
from petfunc.compile.trace import move_graph as move_graph
from petfunc.compile.trace import no_duck_shape as no_duck_shape
from petfunc.compile.trace import trace_device as trace_device
