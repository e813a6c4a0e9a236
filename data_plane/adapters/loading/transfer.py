"""Adapter weights from one process to another through shared memory, not a socket: from the API process
to the engine core (engine/core/host_copies.py sends, engine/core/engine_core.py opens), and from an
adapter reader process to the API process (reader_process.py adopts).

An adapter's host copy already lives in one shared-memory file (shared_tensors.py: the PEFT loader
writes it there), so handing it to the core sends only its layout (SharedAdapter, inside the engine's
messages.ShipAdapter): nothing is copied on the API's event loop. Weights built any other way (no
`shared` layout; only tests build them so) are copied into a new file at their first hand-over, which
is then kept on them: the same rule of ownership, and no second copy at a later hand-over.

The core maps the file and builds the tensors as views of that mapping (no copy either). It never
removes the file: the API process owns it (shared_tensors.py's rule) and removes it when the
LoRAAdapterWeights it belongs to is dropped, since HostCopies may hand the same adapter over again
after the core dropped it. A file the core cannot map (gone) raises here; the core then refuses that
adapter and serves on.

    file: [a_t of layer 0 module m0 | b_t … | … ], each tensor at a 64-byte aligned offset
"""

from __future__ import annotations

import msgspec
import torch

from data_plane.adapters.loading.shared_tensors import allocate, map_file, view
from data_plane.lora.shared_layout import SharedLayout, TensorKey, TensorSpan
from data_plane.lora.weights import LoRAAdapterWeights, LoRAModuleWeights
from shared.engine_admin import AdapterDescription


class TensorRef(msgspec.Struct, array_like=True):
    offset: int  # bytes into the shared file, 64-byte aligned
    shape: list[int]


class ModuleRef(msgspec.Struct, array_like=True):
    a_t: TensorRef  # [in, r], the slots' input-major layout (LoRAModuleWeights.a_t)
    b_t: TensorRef  # [r, out]
    scaling: float


class SharedAdapter(msgspec.Struct, array_like=True):
    """A LoRAAdapterWeights laid out in one shared-memory file: what crosses to the other process."""

    file: str
    size: int
    dtype: str  # torch dtype name, e.g. "float32"
    path: str
    description: AdapterDescription
    layers: dict[int, dict[str, ModuleRef]]


def share_adapter(weights: LoRAAdapterWeights) -> SharedAdapter:
    """The adapter's layout in its shared file, for the core to map; copies only weights that have none."""
    layout = weights.shared if weights.shared is not None else _copy_to_shared(weights)

    def ref(key: TensorKey) -> TensorRef:
        span = layout.spans[key]
        return TensorRef(span.offset, list(span.shape))

    layers = {
        index: {name: ModuleRef(ref((index, name, "a_t")), ref((index, name, "b_t")), m.scaling)
                for name, m in modules.items()}
        for index, modules in weights.layers.items()
    }
    return SharedAdapter(
        file=layout.file, size=layout.size, dtype=str(layout.dtype).removeprefix("torch."), path=weights.path,
        description=weights.description, layers=layers,
    )


def _copy_to_shared(weights: LoRAAdapterWeights) -> SharedLayout[TensorKey]:
    """Copy weights built without a shared file into a new one, owned by `weights` from now on."""
    tensors: dict[TensorKey, torch.Tensor] = {}
    for index, modules in weights.layers.items():
        for name, m in modules.items():
            tensors[(index, name, "a_t")], tensors[(index, name, "b_t")] = m.a_t, m.b_t
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        raise ValueError(f"an adapter's tensors share one dtype; found {sorted(map(str, dtypes))}")
    views, layout = allocate({key: t.shape for key, t in tensors.items()}, dtypes.pop() if dtypes else torch.float32)
    for key, t in tensors.items():
        views[key].copy_(t)
    weights.shared = layout
    return layout


def adopt_adapter(shared: SharedAdapter) -> LoRAAdapterWeights:
    """In the API process: an adapter whose file another process made for it and handed over (the adapter
    reader, SharedLayout.hand_over): views of the file, which these weights own from now on."""
    weights = open_adapter(shared)
    spans = {(index, name, part): TensorSpan(ref.offset, tuple(ref.shape))
             for index, modules in shared.layers.items() for name, m in modules.items()
             for part, ref in (("a_t", m.a_t), ("b_t", m.b_t))}
    weights.shared = SharedLayout(shared.file, shared.size, getattr(torch, shared.dtype), spans)
    return weights


def open_adapter(shared: SharedAdapter) -> LoRAAdapterWeights:
    """In the core: the adapter as views of the shared file (left in place: the API process owns it).
    OSError when the file cannot be mapped (gone)."""
    buf = map_file(shared.file, shared.size)
    dtype = getattr(torch, shared.dtype)

    def tensor(ref: TensorRef) -> torch.Tensor:
        return view(buf, dtype, TensorSpan(ref.offset, tuple(ref.shape)))

    layers = {
        index: {
            # lora_a / lora_b as PEFT stores them, transposed views of the input-major tensors: the
            # dataclass then finds a_t / b_t contiguous already and copies nothing
            name: LoRAModuleWeights(lora_a=tensor(m.a_t).T, lora_b=tensor(m.b_t).T, scaling=m.scaling)
            for name, m in modules.items()
        }
        for index, modules in shared.layers.items()
    }
    return LoRAAdapterWeights(path=shared.path, description=shared.description, layers=layers)
