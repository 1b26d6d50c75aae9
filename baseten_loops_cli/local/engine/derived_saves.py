"""Tensors a backward pass would keep that are cheap functions of other kept tensors: kept as
their recipe instead, and rebuilt when the backward reads them (torch's
``saved_tensors_hooks``, the mechanism it offers for packing saved tensors).

Profile (SmolLM2-135M SFT, one 2,000-token row, bf16, no layer recomputed; the autograd
graph's saved tensors by node, 2026-12-07): a decoder layer kept ~23.7 KB a token, 12 KB of it
in its MLP, ``down(act(gate(x)) * up(x))``: ``g = gate(x)`` (for act's backward), ``u = up(x)``
and ``a = act(g)`` (for the product's), and ``h = a * u`` (down_proj's LoRA A, for its
weight's gradient); and 1.1 KB for the attention output's transposed copy that o_proj's LoRA A
keeps beside the untransposed output the attention kernel keeps. ``a`` and ``h`` are
elementwise functions of ``g`` and ``u`` and the copy a transpose of the kept output, so each is
kept as its recipe (:func:`derive`) and rebuilt in the backward: 7.3 KB a token a layer (31%)
less, for ~2 ms of elementwise work a layer a 2k row. Fewer layers then pass the activation
budget and run again in the backward (memory_estimate.checkpoint_layer_count: a 2k SmolLM2 row
recomputes 6 of 30 layers instead of 15). The rebuilt tensors are the same ops on the same
inputs under the same autocast: gradients are bit-identical (tests/test_engine.py).

Only where a backward runs: :func:`packing` wraps the trainer's forward passes that keep a
graph; the recipes' marks on the tensors cost nothing elsewhere. A layer run under activation
checkpointing keeps nothing of its own (torch's checkpoint hooks are the inner ones there).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

# transformers' MLP classes of the form down_proj(act_fn(gate_proj(x)) * up_proj(x)) whose
# forward install() replaces on the module objects (other MLPs keep theirs).
GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})

# The tensors derive() marked on this thread inside packing(), by their storage's address, with
# a weak reference to the storage: a backward keeps views of a marked tensor whose Python
# object is gone (matmul's _unsafe_view of its input; transformers' reshape of the attention's
# output). The recipes hold their sources until packing() ends: tensors the backward keeps
# anyway. Inside a checkpointed layer nothing is marked (suspended()): its graph keeps nothing.
_marked = threading.local()


class _Recipe:
    __slots__ = ("storage", "dtype", "rebuild", "sources", "versions", "autocast")

    def __init__(self, tensor: torch.Tensor, rebuild: Callable[..., torch.Tensor],
                 sources: tuple[torch.Tensor, ...]) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        device = tensor.device.type
        self.storage, self.dtype = StorageWeakRef(tensor.untyped_storage()), tensor.dtype
        self.rebuild, self.sources = rebuild, sources
        self.versions = tuple(s._version for s in sources)
        self.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))

    def rebuilds(self, x: torch.Tensor) -> bool:
        """Whether ``x`` views the marked tensor's storage, alive (so the address is not
        another tensor's), with the sources unchanged since the mark."""
        return (x.dtype == self.dtype and not self.storage.expired()
                and all(s._version == v for s, v in zip(self.sources, self.versions)))


class _Packed:
    """A saved tensor kept as how to rebuild it: the recipe of the tensor whose storage it
    views, and its view of that storage."""
    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: _Recipe, x: torch.Tensor) -> None:
        self.recipe, self.size, self.stride, self.offset = recipe, x.size(), x.stride(), x.storage_offset()


def derive(tensor: torch.Tensor, rebuild: Callable[..., torch.Tensor],
           *sources: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as ``rebuild(*sources)`` (computed under the autocast now in force) and
    return it: inside :func:`packing`, a backward that would keep it (or a view of its
    storage) keeps the recipe. The sources must be tensors the backward keeps anyway, else
    the recipe keeps them instead; neither may change in place after the mark."""
    marked = getattr(_marked, "tensors", None)
    if (marked is None or tensor.is_leaf or not tensor.is_contiguous()
            or tensor.storage_offset()):
        return tensor  # outside packing, no graph (no grad), or a layout a rebuild would not repeat
    marked[tensor.untyped_storage().data_ptr()] = _Recipe(tensor, rebuild, sources)
    return tensor


def _pack(x: torch.Tensor) -> Any:
    marked = getattr(_marked, "tensors", None)
    if not marked or x.layout is not torch.strided:
        return x
    recipe = marked.get(x.untyped_storage().data_ptr())
    if recipe is None or not recipe.rebuilds(x):
        return x
    return _Packed(recipe, x)


def _unpack(packed: Any) -> torch.Tensor:
    if not isinstance(packed, _Packed):
        return packed
    recipe = packed.recipe
    device, enabled, dtype = recipe.autocast
    with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
        base = recipe.rebuild(*recipe.sources)
    return base.as_strided(packed.size, packed.stride, packed.offset)


@contextlib.contextmanager
def _marking(tensors: dict[int, _Recipe] | None) -> Iterator[None]:
    """This thread's marks go to ``tensors`` (None: nothing is marked) in the block."""
    before = getattr(_marked, "tensors", None)
    _marked.tensors = tensors
    try:
        yield
    finally:
        _marked.tensors = before


@contextlib.contextmanager
def packing() -> Iterator[None]:
    """Keep marked tensors (:func:`derive`) as their recipes in the graphs built in the block."""
    with _marking({}), torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


def suspended() -> contextlib.AbstractContextManager[None]:
    """Mark nothing in the block (a checkpointed layer's forward, whose graph keeps nothing:
    recipes would only hold their sources)."""
    return _marking(None)


def install(module: Any) -> None:
    """Make ``module``'s gated MLPs (:data:`GATED_MLPS`) mark ``act(g)`` and ``act(g) * u``
    as recipes over ``g`` and ``u``; idempotent. Results are unchanged."""
    for mlp in module.modules():
        if type(mlp).__name__ in GATED_MLPS and "forward" not in mlp.__dict__:
            mlp.forward = _gated_forward(mlp)


def _gated_forward(mlp: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    act = mlp.act_fn

    def product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return act(gate) * up

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        hidden = derive(derive(act(gate), act, gate) * up, product, gate, up)
        return mlp.down_proj(hidden)

    return forward
