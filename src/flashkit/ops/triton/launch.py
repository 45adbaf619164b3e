"""Launch a Triton or Gluon kernel again without its JIT entry's per-call work, where that
provably launches the same compiled kernel.

`kernel[grid](*args, **kwargs)` binds and specialises every argument in Triton's binder, turns
the options into a string for its cache key, then launches; on an H200 host that costs 15-23 us
per launch against 6.5-9.2 us for launching the compiled kernel it returns
(benchmarks/results/decode_20261121T064932.json and _081334.json, launch_study); the Gluon
forward's binder (three TMA descriptors, 34 runtime arguments) costs more. A decoding call makes
three launches, a Gluon forward call one. `launch` keeps the compiled kernel under a key that
determines Triton's own cache key (`JITFunction.run`: the specialisation of every argument and the
options) and launches it directly when the key is seen again:
    tensors  each one's dtype and whether data_ptr() % 16 == 0 (Triton's "D" alignment mark);
             a Gluon TensorDescriptor's dtype, block shape, layout and padding; a tuple (a
             kernel's bundle of tensors, features.KernelFeatures.score_tensors, or a user
             modifier's captured values and a block mask's lists, which mix in plain scalars)
             each member's, a plain scalar member by its value
    scalars  their types (int, float, bool, None, or a tuple of those: a bundle) and, for each,
             a code of what Triton's mark of it depends on (`scalar_code`: an int's == 1,
             % 16 == 0 and int32/int64/uint64 range, as far as the parameter's
             do_not_specialize flags let Triton look; nothing of a float's, bool's or None's
             value; a tuple's, its members' codes, as Triton marks each member)
    rest     the constexpr values, the launch options, the device, and the runtime knobs that
             Triton adds to the options (debug, instrumentation mode)
Equal keys imply equal Triton keys, so the kernel launched is the one Triton would launch, and a
scalar that changes every call (a dropout seed, a decoding step's int length) reuses one entry.
Computing the codes costs a C-level dict lookup per scalar, so a second dict keeps the kernel
under the scalars' values as well: a call whose values were seen before costs one tuple hash
(the decoding and forward calls), one with new values the codes' lookups, and only one with
a new code Triton's entry. Anything else (a registered launch hook, the interpreter, a scalar of
another type) takes Triton's entry. tests/test_kvcache.py checks the keys against Triton's
specialiser and launches a stand-in kernel through both caches.

`Prepared` goes one step further for a launch plan (dispatch.py), whose key fixes everything
but the tensors' addresses: its grid, scalars and constexprs are computed once, and a repeated
call fills only the tensors and TMA maps into an argument list made once, then calls the
compiled launcher's C entry. tests/ops/test_launch_plan.py checks that list against Triton's
own launcher and, on the GPU, the results against launches through Triton.
"""

from __future__ import annotations

import functools
import math
import operator
import types
from typing import NamedTuple

import torch
import triton
from triton import knobs
from triton.runtime.jit import JITCallable

try:  # the TMA dtype codes of the host API (fill_tma_descriptor) by the kernel's device codes
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST as _TMA_HOST_DTYPE
except ImportError:  # a Triton without the NVIDIA backend
    _TMA_HOST_DTYPE = {}

from flashkit.ops.triton import ahead
from flashkit.ops.triton.common import interpreting

MAX_ENTRIES = 4096  # forget every entry of a dict beyond this (a safety bound)
# encoded TMA maps kept per descriptor argument of a prepared launch, by tensor address: a
# training loop's allocator hands the same addresses back step after step, one per layer
MAX_MAPS = 64
MAX_GRID_YZ = 65535  # CUDA's limit on a grid's dims y and z (x allows 2**31 - 1)
_SCALAR_TYPES = frozenset((int, float, bool, type(None)))
_compiled: dict = {}  # key (scalars by code) -> Triton's compiled kernel
_by_value: dict = {}  # the same key with the scalars' values instead of their codes -> kernel
_plans: dict = {}  # (id(kernel), number of tensors, tensor names) -> each scalar's codes
_orders: dict = {}  # (id(kernel), tensor names, counts) -> the arguments in signature order
# id(kernel) -> (kernel, number of globals, (scope, itemgetter of its names) per scope, the
# globals those read when last found unchanged)
_globals_seen: dict = {}
_indices: dict = {}  # (id(kernel), varying names, counts) -> (kernel, their scalar indices)
_MISSING = object()
_UNSEEN = (None, 0, (), ())


def tensor_key(t) -> tuple:
    """What Triton's specialisation of a tensor argument depends on: a torch tensor's dtype and
    alignment, a Gluon TMA descriptor's dtype, block, shared layout and padding (its shape and
    strides are runtime arguments; its base is 16-byte aligned by construction). A bundle (a
    tuple, nested or not) gets its members' keys; a plain scalar among them (a modifier's
    captured number, a block mask's sizes) its type and value, on which Triton may specialise."""
    if isinstance(t, torch.Tensor):
        return t.dtype, t.data_ptr() % 16 == 0
    if type(t) is tuple:  # a bundle: Triton specialises each member
        return tuple(map(tensor_key, t))
    if type(t) in _SCALAR_TYPES:
        return type(t), t
    return t.base.dtype, tuple(t.block_shape), t.layout, t.padding


def specialisation(values: tuple) -> tuple:
    """What Triton's specialisation of scalar arguments depends on (scalar_code of each, as
    for a parameter outside do_not_specialize; a tuple's per member): equal for two calls'
    values when the same compiled kernel runs both (Prepared's keyed)."""
    codes = _CODES[(True, True)]
    return tuple(tuple(map(codes.__getitem__, v)) if type(v) is tuple else codes[v]
                 for v in values)


def scalar_code(value, specialize: bool = True, align: bool = True) -> int:
    """What Triton 3.6's specialisation of an int depends on (native_specialize_impl's
    handle_long_type), as a small int: 1 for == 1 (a constexpr), unless the parameter is in
    do_not_specialize (specialize=False); else its range (int32, int64, uint64, or too large,
    which Triton refuses) and, unless do_not_specialize or do_not_specialize_on_alignment
    (align=False), whether % 16 == 0 (the "D" mark). Triton marks a float fp32, a bool u1 and
    None a constexpr whatever the value: -1, except that a float or bool equal to an int (2.0,
    True) gets that int's code, as a dict lookup cannot tell them apart. A tuple (a bundle of
    scalars, which Triton flattens into one parameter per member) gets its members' codes as
    Triton 3.6 marks them: every specialisation on, whatever the parameter's flags."""
    if type(value) is tuple:
        return tuple(map(scalar_code, value))
    if value is None or (type(value) is float and not value.is_integer()):
        return -1
    value = int(value)
    if specialize and value == 1:
        return 1
    width = (0 if -2**31 <= value < 2**31 else 1 if -2**63 <= value < 2**63 else
             2 if 0 <= value < 2**64 else 3)
    return 2 + 2 * width + (specialize and align and value % 16 == 0)


class _Codes(dict):
    """value -> scalar_code(value, specialize, align), computed on a value's first lookup."""

    def __init__(self, specialize: bool, align: bool):
        super().__init__()
        self.specialize, self.align = specialize, align

    def __missing__(self, value) -> int:
        if len(self) >= MAX_ENTRIES:  # seeds and lengths that change every call
            self.clear()
        code = self[value] = scalar_code(value, self.specialize, self.align)
        return code


_CODES = {(specialize, align): _Codes(specialize, align)
          for specialize in (False, True) for align in (False, True)}


def launch(kernel, grid: tuple, tensors: tuple, scalars: tuple, constexprs: dict,
           tensor_params: tuple = (), **options):
    """kernel[grid](*tensors, *scalars, **constexprs, **options), the compiled kernel launched
    directly once it is known; returns that compiled kernel (None where Triton's entry ran it:
    the interpreter, a launch hook, a scalar of another type). The kernel's signature lists the
    tensor arguments, then the scalars, then the constexprs, each in the order given here; or,
    with tensor_params (the names of the tensor parameters), tensors and scalars interleaved in
    any way, each group in signature order (put back in order by one precomputed itemgetter per
    kernel)."""
    args = tensors + scalars
    if tensor_params:
        args = _order(kernel, tensor_params, len(tensors), len(scalars))(args)
    if ahead.active():  # a first call's kernels, compiled together (ahead.py): nothing runs
        settle_cache_keys(kernel, *constexprs.values())
        ahead.submit(kernel, grid, args, constexprs, options)
        return None
    types = scalar_types(scalars)
    if interpreting() or _hooked() or not _plain(types):
        if interpreting():  # the CPU tests check the order the direct launch relies on
            _check_constexpr_order(kernel, len(args), constexprs)
        ahead.settle()
        kernel[grid](*args, **constexprs, **options)
        return None
    device = torch.cuda.current_device()
    key = (id(kernel), device, tuple([tensor_key(t) for t in tensors]), scalars, types,
           tuple(constexprs.values()), tuple(options.items()), knobs.runtime.debug,
           knobs.compilation.instrumentation_mode)
    compiled = _by_value.get(key)
    if compiled is None:  # new values: look their codes up
        coded = _coded_key(kernel, len(tensors), key, tensor_params)
        compiled = _compiled.get(coded)
        if compiled is not None:
            _remember(_by_value, key, compiled)
    if compiled is None or _globals_changed(kernel):
        settle_cache_keys(kernel, *constexprs.values())
        ahead.settle()  # Triton's cache then holds what was compiled ahead
        compiled = kernel[grid](*args, **constexprs, **options)
        if hasattr(compiled, "result"):  # asynchronous compilation
            compiled = compiled.result()
        _check_constexpr_order(kernel, len(args), constexprs)
        _remember(_compiled, _coded_key(kernel, len(tensors), key, tensor_params), compiled)
        _remember(_by_value, key, compiled)
        return compiled
    grid = tuple(grid) + (1,) * (3 - len(grid))
    stream = triton.runtime.driver.active.get_current_stream(device)
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *constexprs.values())
    return compiled


class Prepared:
    """A launch whose grid, scalars, constexprs and options are fixed, called with its tensors
    alone: `prepared(*tensors)` is launch(kernel, grid, tensors, scalars, constexprs,
    tensor_params, **options). A launch plan (dispatch.py) keeps one per kernel it runs, made
    once per plan key, so a call pays for its tensors only.

    descriptors: {index in tensors: a TMA descriptor (hopper_common.descriptor)} for the
    kernel's tensor-descriptor arguments; the call then passes, at that index, the tensor the
    descriptor views (a contiguous tensor: its 2-D or 1-D view has the same address), and only
    that address changes from call to call (the plan key fixes shapes and strides).
    varying: names of scalar parameters whose values each call passes, as
    `prepared(*tensors, varying=values)` (a dropout seed, new every call); Triton must not
    specialise on them (the kernel's do_not_specialize), so every value runs the same kernel,
    unless they are named in `keyed` too: then the caller keeps one Prepared per
    `specialisation` of their values and passes each only values specialised alike (a plan
    for every key length passes the length each call).
    sized: indices of descriptors whose leading dim follows each call's tensor (its numel over
    the template's other dims: a cache one key longer each call), their other dims and
    strides fixed.

    The first two calls go through `launch`, which compiles or finds the kernel; the second
    keeps the compiled kernel's direct launch (`_Direct`) when every pointer tensor is 16-byte
    aligned. Later calls whose pointer tensors have the same dtypes and are aligned (a plan's
    key fixes both) fill the TMA maps (Triton's fill_tma_descriptor) and the tensors'
    addresses into an argument list made once and call the compiled launcher's C entry,
    skipping launch's key, the descriptor objects and Triton's Python wrapper that would
    expand them (Triton 3.6's CudaLauncher: `_c_entry`). Any other call, a launch hook, a
    changed global of the kernel, Triton's debug or instrumentation knobs, the interpreter or a
    kernel that needs scratch memory take `launch`."""

    __slots__ = ("kernel", "grid", "scalars", "constexprs", "tensor_params", "options",
                 "descriptors", "varying", "sized", "launched", "_direct")

    def __init__(self, kernel, grid: tuple, scalars: tuple, constexprs: dict,
                 tensor_params: tuple = (), descriptors: dict | None = None,
                 varying: tuple = (), keyed: tuple = (), sized: tuple = (), **options):
        self.kernel, self.scalars, self.constexprs = kernel, scalars, constexprs
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.tensor_params, self.options = tensor_params, options
        self.varying = _scalar_indices(kernel, varying, len(scalars), len(constexprs),
                                       tensor_params, keyed)
        # the descriptors' geometry without their bases (a plan must not keep tensors alive)
        self.descriptors = {i: _rebased(d, None) for i, d in (descriptors or {}).items()}
        # sized descriptors by index: the elements of one leading-dim row (numel // this = rows)
        self.sized = {i: math.prod(self.descriptors[i].shape[1:]) for i in sized}
        self.launched = False
        self._direct: _Direct | None = None

    def __call__(self, *tensors, varying: tuple = ()) -> None:
        direct = self._direct
        if (direct is None or direct.knobs != (knobs.runtime.debug,
                                               knobs.compilation.instrumentation_mode)
                or _hooked() or _globals_changed(self.kernel)):
            self._launch(tensors, varying)
            return
        args = direct.args.copy()
        # Pointers go in as their addresses: the launcher takes an int as it is, where for a
        # tensor it calls data_ptr() and asks the driver whether the address is device memory
        # (cuPointerGetAttribute, per pointer and launch); the plan's tensors are CUDA ones.
        # The last pointer checked and the dtype it was checked for: a placeholder tensor
        # stands for every absent feature tensor in turn, checked once.
        checked, checked_dtype, address = None, None, 0
        for at, i, dtype in direct.pointers:
            t = tensors[i]
            if t is not checked or dtype is not checked_dtype:
                address = t.data_ptr()
                # a pointer of another dtype, or off the 16-byte alignment, than compiled
                if t.dtype is not dtype or address % 16 != 0:
                    self._launch(tensors, varying)
                    return
                checked, checked_dtype = t, dtype
            args[at] = address
        for i in direct.empties:
            if type(tensors[i]) is not tuple or tensors[i]:
                self._launch(tensors, varying)
                return
        for at, i, template in direct.bundles:
            addresses = _addresses_as(tensors[i], template)
            if addresses is None:
                self._launch(tensors, varying)
                return
            args[at] = addresses
        for at, i, tma, encoded, row_size in direct.maps:
            t = tensors[i]
            # a map by address; a sized one's by address and rows, which follow its tensor
            key = t.data_ptr() if not row_size else (t.data_ptr(), t.numel() // row_size)
            tensor_map = encoded.get(key)
            if tensor_map is None:  # encode the map (a driver call) once per address
                if len(encoded) >= MAX_MAPS:
                    encoded.clear()
                tensor_map = encoded[key] = direct.fill_tma_descriptor(
                    *((key, *tma) if not row_size else
                      (key[0], *tma[:4], [key[1], *tma[4][1:]], *tma[5:])))
            args[at] = tensor_map
            if row_size:  # the descriptor's shape follows the map: rows first
                args[at + 1] = key[1]
        for at, value in zip(direct.varying, varying, strict=True):
            args[at] = value
        direct.entry(*self.grid, direct.current_stream(direct.device), direct.function,
                     direct.cooperative, direct.pdl, None, None, direct.packed_metadata, None,
                     None, None, *args)

    def _launch(self, tensors: tuple, varying: tuple) -> None:
        """Through launch, with the descriptors over this call's tensors; at the second call
        (a Prepared made for one call never gets there), keeps the direct launch of the
        compiled kernel that launch returns if every pointer tensor is 16-byte aligned."""
        args = tuple(t if i not in self.descriptors else
                     _rebased(self.descriptors[i], t, self.sized.get(i, 0))
                     for i, t in enumerate(tensors))
        scalars = list(self.scalars)
        for i, value in zip(self.varying, varying, strict=True):
            scalars[i] = value
        compiled = launch(self.kernel, self.grid, args, tuple(scalars), self.constexprs,
                          self.tensor_params, **self.options)
        pointers = [m for i, t in enumerate(tensors) if i not in self.descriptors
                    for m in _members(t) if isinstance(m, torch.Tensor)]
        if (compiled is not None and self.launched and self._direct is None and not _hooked()
                and all(t.data_ptr() % 16 == 0 for t in pointers)):
            self._direct = _Direct.of(compiled, self, tensors)
        self.launched = True


def planned(plan: dict | None, name: str, prepare):
    """plan[name] (a Prepared, or what a launcher keeps beside its Prepared), made by prepare()
    when the plan has none yet; a new one every call without a plan (plan None: a launcher
    called directly, outside dispatch's plans)."""
    if plan is None:
        return prepare()
    prepared = plan.get(name)
    if prepared is None:
        prepared = plan[name] = prepare()
    return prepared


class _Direct(NamedTuple):
    """A compiled kernel's C launch entry and its argument list in signature order, with where
    each call's tensors go: `pointers` (position in args, index in the tensors, the dtype the
    kernel was compiled for), `bundles` (the same for a tuple, with its _bundle_template),
    `empties` (the indices of the tensors that were empty bundles, (), in args as they are:
    the absent features' bundles, checked to be () again, not filled) and `maps` (position in
    args, index in the tensors, the TMA map's fill arguments after the address, the maps
    encoded so far by address, and a sized descriptor's row size, else 0: a map depends only
    on the address and those arguments, which the plan fixes but for a sized map's rows (its
    maps are kept by address and rows), and encoding one is a driver call of about a
    microsecond)."""
    entry: object
    function: int
    packed_metadata: object
    cooperative: bool
    pdl: bool
    device: int
    args: list
    pointers: tuple
    bundles: tuple
    empties: tuple
    maps: tuple
    varying: tuple  # the positions in args of the varying scalars, in their order
    knobs: tuple  # Triton's debug and instrumentation knobs when compiled
    fill_tma_descriptor: object
    current_stream: object

    @staticmethod
    def of(compiled, prepared: Prepared, tensors: tuple):
        runner = compiled.run  # CudaLauncher (made on first use)
        entry = _c_entry(getattr(runner, "launch", None))
        if entry is None or runner.global_scratch_size or runner.profile_scratch_size:
            return None
        n_tensors = len(tensors)
        n_args = n_tensors + len(prepared.scalars)
        sources = list(range(n_args))
        if prepared.tensor_params:
            sources = list(_order(prepared.kernel, prepared.tensor_params, n_tensors,
                                  len(prepared.scalars))(sources))
        metas = iter(getattr(compiled.metadata, "tensordesc_meta", None) or ())
        args, pointers, bundles, empties, maps, varying = [], [], [], [], [], {}
        for source in sources:
            if source >= n_tensors:
                if source - n_tensors in prepared.varying:
                    varying[source - n_tensors] = len(args)
                args.append(prepared.scalars[source - n_tensors])
                continue
            template = prepared.descriptors.get(source)
            if type(tensors[source]) is tuple:
                if tensors[source]:
                    bundles.append((len(args), source, _bundle_template(tensors[source])))
                else:  # () as compiled: only checked (an absent feature's, most of them)
                    empties.append(source)
                args.append(None if tensors[source] else ())
                continue
            if template is None:
                pointers.append((len(args), source, tensors[source].dtype))
                args.append(None)
                continue
            meta = next(metas, None)
            if meta is None or meta["fp4_padded"] or template.padding != "zero":
                return None  # a descriptor lowered another way: Triton's own wrapper
            shape, strides = list(template.shape), list(template.strides)
            maps.append((len(args), source, (
                meta["swizzle"], meta["elem_size"], _TMA_HOST_DTYPE[meta["elem_type"]],
                meta["block_size"], shape, strides, 0), {}, prepared.sized.get(source, 0)))
            args.extend([None, *shape, *strides])
        if next(metas, None) is not None:
            return None
        args.extend(prepared.constexprs.values())
        driver = triton.runtime.driver.active
        return _Direct(entry, compiled.function, compiled.packed_metadata,
                       runner.launch_cooperative_grid, runner.launch_pdl,
                       torch.cuda.current_device(), args, tuple(pointers), tuple(bundles),
                       tuple(empties), tuple(maps),
                       tuple(varying[i] for i in prepared.varying),
                       (knobs.runtime.debug, knobs.compilation.instrumentation_mode),
                       driver.utils.fill_tma_descriptor, driver.get_current_stream)


def settle_cache_keys(*fns) -> None:
    """Compute the Triton cache key of each jit function in fns (other values are skipped),
    each callee's before its caller's, so that a kernel's key is the same whatever order a
    process compiles its kernels in.

    Why: Triton 3.6 folds into a function's key the global constexprs of the functions it
    calls, read when it visits them; a callee's are only filled in once its own key has been
    computed. So a kernel hashed after another kernel that shares its helpers gets another key
    than hashed first (the forward's and the backward's portable kernels: two keys each), and
    its disk-cache entry from a process that compiled in the other order is never found: a
    warm process compiles again. Keys computed callee first depend on the sources alone.
    Costs an attribute read for a function already keyed."""
    for fn in fns:
        if isinstance(fn, JITCallable) and fn.hash is None:
            _key_callees_first(fn, set())


def _key_callees_first(fn, visiting: set) -> None:
    visiting.add(id(fn))
    for callee in _callees(fn):
        if callee.hash is None and id(callee) not in visiting:
            _key_callees_first(callee, visiting)
    fn.cache_key  # noqa: B018 (computed and kept by Triton)


def _callees(fn) -> list:
    """The jit functions fn's body may call: its globals, closure cells and attributes of the
    modules among them (`common.helper`) named in its code (a superset of what Triton's
    dependency finder visits, which only costs keys computed early)."""
    code = fn.fn.__code__
    values = [fn.__globals__.get(name) for name in code.co_names]
    values += [cell.cell_contents for cell in fn.fn.__closure__ or ()]
    for module in [v for v in values if isinstance(v, types.ModuleType)]:
        values += [getattr(module, name, None) for name in code.co_names]
    return [v for v in values if isinstance(v, JITCallable)]


def _scalar_indices(kernel, names: tuple, n_scalars: int, n_constexprs: int,
                    tensor_params: tuple, keyed: tuple = ()) -> tuple:
    """The indices among a launch's scalars of the parameters `names`, which must be in the
    kernel's do_not_specialize unless `keyed` names them (Prepared's varying and keyed);
    found once per kernel and arguments (_indices: reading the kernel's parameters costs tens
    of microseconds)."""
    if not names:
        return ()
    key = (id(kernel), names, n_scalars, n_constexprs, tensor_params, keyed)
    found = _indices.get(key)
    if found is not None and found[0] is kernel:
        return found[1]
    runtime = kernel.arg_names[:len(kernel.arg_names) - n_constexprs]
    scalar_names = ([n for n in runtime if n not in tensor_params] if tensor_params
                    else runtime[len(runtime) - n_scalars:])
    params = getattr(kernel, "params", None)  # an InterpretedFunction has its kwargs instead
    free = ([p.name for p in params if p.do_not_specialize] if params is not None
            else kernel.kwargs.get("do_not_specialize") or ())
    if not set(names) - set(keyed) <= set(free) or not set(names) <= set(scalar_names):
        raise ValueError(f"launch: {names} must be scalar parameters of {kernel.__name__} in "
                         "its do_not_specialize, or keyed")
    indices = tuple(scalar_names.index(name) for name in names)
    _indices[key] = (kernel, indices)  # the kernel held: its id stays its own
    return indices


def _rebased(template, base: torch.Tensor | None, row_size: int = 0):
    """A copy of the TensorDescriptor template over base, a tensor at the address it views
    (the template's shape and strides from there: a 2-D view of base's memory, whatever
    base's own shape and strides), or over nothing (base None). row_size > 0 (a sized
    descriptor): its leading dim is base.numel() // row_size instead of the template's."""
    desc = object.__new__(type(template))  # copy.copy costs 5x more
    desc.__dict__.update(template.__dict__)
    if row_size:
        desc.shape = [base.numel() // row_size, *template.shape[1:]]
    desc.base = None if base is None else base.as_strided(desc.shape, template.strides)
    return desc


def _c_entry(launcher):
    """The C function under a CudaLauncher's `launch` (Triton 3.6): the compiled module's own
    launch, or for a kernel with tensor-descriptor arguments the one that
    wrap_handle_tensordesc's wrapper closes over as `launcher`; None for anything else."""
    if launcher is None or not hasattr(launcher, "__code__"):
        return launcher  # the C function itself
    cells = dict(zip(launcher.__code__.co_freevars, launcher.__closure__ or (), strict=True))
    cell = cells.get("launcher")
    return None if cell is None else cell.cell_contents


def _check_constexpr_order(kernel, n_args: int, constexprs: dict) -> None:
    """The direct launch passes constexprs positionally: they must be given in the kernel's
    signature order, after its runtime arguments."""
    if kernel.arg_names[n_args:] != list(constexprs):
        raise ValueError(f"launch: {kernel.__name__}'s constexprs must follow its runtime "
                         "arguments in the signature, in order")


def _members(t) -> tuple:
    """The leaves of a launch's tensor argument: itself, or a bundle's members, nested ones
    included."""
    if type(t) is not tuple:
        return (t,)
    return tuple(m for member in t for m in _members(member))


class _Fixed(NamedTuple):
    """A plain scalar in a bundle (a modifier's captured number, a block mask's sizes): the
    direct launch was compiled for this value (launch's key holds it)."""
    value: object


def _bundle_template(bundle: tuple) -> tuple:
    """What a direct launch fixes of a bundle: each tensor member's dtype, each scalar's value
    (_Fixed), nested bundles alike."""
    return tuple(_bundle_template(m) if type(m) is tuple else
                 m.dtype if isinstance(m, torch.Tensor) else _Fixed(m) for m in bundle)


def _addresses_as(bundle: tuple, template: tuple) -> tuple | None:
    """The bundle as the compiled launcher takes it, tensors as their addresses, where it
    matches the template (_bundle_template) the direct launch was compiled for: each tensor of
    its dtype and 16-byte aligned, each scalar the same value of the same type; else None."""
    if type(bundle) is not tuple or len(bundle) != len(template):
        return None
    out = []
    for member, want in zip(bundle, template, strict=True):
        if type(want) is tuple:
            member = _addresses_as(member, want)
            if member is None:
                return None
        elif type(want) is _Fixed:
            if type(member) is not type(want.value) or member != want.value:
                return None
        elif not isinstance(member, torch.Tensor) or member.dtype is not want:
            return None
        else:
            member = member.data_ptr()
            if member % 16 != 0:
                return None
        out.append(member)
    return tuple(out)


def scalar_types(scalars: tuple) -> tuple:
    """The scalars' types as launch's key holds them: a tuple's (a bundle's) as the tuple of
    its members' types, so that a bundle's float 1.0 and int 1, equal as dict keys, are told
    apart as top-level scalars are."""
    types = tuple(map(type, scalars))
    if tuple in types:
        types = tuple(tuple(map(type, s)) if t is tuple else t
                      for s, t in zip(scalars, types, strict=True))
    return types


def _plain(types: tuple) -> bool:
    """Whether every scalar (scalar_types) is an int, float, bool, None or a tuple of those (a
    bundle of scalars, or a user modifier's captured values when there is none: ()), the values
    whose specialisation launch's key knows; anything else (a tuple of captured tensors) goes
    through Triton's binder."""
    return _SCALAR_TYPES.issuperset(types) or all(
        t in _SCALAR_TYPES or type(t) is tuple and _SCALAR_TYPES.issuperset(t) for t in types)


def _order(kernel, tensor_params: tuple, n_tensors: int, n_scalars: int):
    """An itemgetter taking (*tensors, *scalars) to the kernel's signature order."""
    key = (id(kernel), tensor_params, n_tensors, n_scalars)
    order = _orders.get(key)
    if order is None:
        tensor_at, scalar_at = iter(range(n_tensors)), iter(range(n_tensors,
                                                                  n_tensors + n_scalars))
        names = kernel.arg_names[:n_tensors + n_scalars]
        if sum(name in tensor_params for name in names) != n_tensors:
            raise ValueError(f"launch: {kernel.__name__} has no parameters {tensor_params} "
                             f"for {n_tensors} tensors")
        order = _orders[key] = operator.itemgetter(*[
            next(tensor_at) if name in tensor_params else next(scalar_at) for name in names])
    return order


def _coded_key(kernel, n_tensors: int, key: tuple, tensor_params: tuple = ()) -> tuple:
    """launch's key with each scalar's code in place of its value (its scalars plain: _plain)."""
    scalars = key[3]
    plan = _plans.get((id(kernel), n_tensors, tensor_params))
    if plan is None:
        params = (kernel.params[n_tensors:] if not tensor_params else
                  [p for p in kernel.params if p.name not in tensor_params])
        plan = _plans[id(kernel), n_tensors, tensor_params] = tuple(
            _CODES[not p.do_not_specialize, not p.do_not_specialize_on_alignment]
            for p in params[:len(scalars)])
    return key[:3] + (tuple(map(operator.getitem, plan, scalars)),) + key[4:]


def _remember(cache: dict, key: tuple, compiled) -> None:
    if len(cache) >= MAX_ENTRIES:
        cache.clear()
    cache[key] = compiled


def fold(n: int) -> tuple[int, int]:
    """(y, z) with y * z == n and both <= MAX_GRID_YZ: a kernel's (batch, head) programs in
    grid dims y and z, which it reads back as program_id(1) + program_id(2) * num_programs(1)
    (so any batch x heads launches; z = 1, the plain grid, up to the limit)."""
    if n <= MAX_GRID_YZ:
        return n, 1
    return _fold(n, MAX_GRID_YZ)


@functools.lru_cache(maxsize=256)
def _fold(n: int, limit: int) -> tuple[int, int]:
    for z in range(-(-n // limit), min(n, limit) + 1):
        if n % z == 0 and n // z <= limit:
            return n // z, z
    raise NotImplementedError(f"batch x heads = {n} has no factorisation y * z with both <= "
                              f"{limit} (CUDA's grid limit); pad the batch by one entry")


@functools.lru_cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def device_properties(device: torch.device):
    """torch.cuda.get_device_properties of a CUDA device, asked once per device (a few us a
    call otherwise, on every launch's host path)."""
    return _properties(torch.cuda.current_device() if device.index is None else device.index)


def device_facts(device: torch.device) -> tuple[int, bool]:
    """(SM count, whether programmatic dependent launch (PDL, compute capability >= 9) is used)
    for kernels on `device`; (4, False) under the interpreter."""
    if device.type != "cuda" or interpreting():
        return 4, False
    props = device_properties(device)
    return props.multi_processor_count, props.major >= 9


def _hooked() -> bool:
    """Whether a launch hook is registered (Triton 3.6 keeps them in HookChain objects that are
    never None; an empty chain calls nothing, so the direct launch passes no hook)."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(enter is not None and getattr(enter, "calls", True)
                or leave is not None and getattr(leave, "calls", True))


def _globals_changed(kernel) -> bool:
    """Triton's check that the globals a compiled kernel used still hold their values, made
    again only when one of them is another object than at the last check that passed (Triton
    compares deep copies by value: 6.4 us a launch for the Gluon forward's nine gl.constexpr
    globals, whose != builds new constexprs). A global mutated in place (a list) would go
    unseen; the kernels' globals are constexprs. The repeated check reads the globals of each
    scope with one itemgetter and compares them to those seen by identity (list and tuple
    equality test identity first; an equal value that is another object is what Triton's
    check accepts too)."""
    used = kernel.used_global_vals  # (name, id(scope)) -> (value when compiled, scope)
    # by id: a JITFunction's own hash builds its cache key; the entry holds the kernel itself
    owner, count, getters, seen = _globals_seen.get(id(kernel), _UNSEEN)
    if owner is kernel and count == len(used):
        try:
            if [get(scope) for scope, get in getters] == seen:
                return False
        except KeyError:  # a global deleted since
            pass
    where = [(scope, name) for (name, _), (_, scope) in used.items()]
    current = [scope.get(name, _MISSING) for scope, name in where]
    if any(now != value for now, (value, _) in zip(current, used.values(), strict=True)):
        return True
    names_by_scope: dict = {}  # id(scope) -> (scope, its names), in first-seen order
    for scope, name in where:
        names_by_scope.setdefault(id(scope), (scope, []))[1].append(name)
    getters = tuple((scope, operator.itemgetter(*names))
                    for scope, names in names_by_scope.values())
    # held: their identities stay theirs
    _globals_seen[id(kernel)] = (kernel, len(used), getters,
                                 [get(scope) for scope, get in getters])
    return False
