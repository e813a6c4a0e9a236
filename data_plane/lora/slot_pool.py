"""The device memory of the LoRA slots: every layer's slot weights in one tensor, written whole.

    pool: [max_loras, per_slot]   one row per slot: each LoRA layer's A [in, L * R] and then its B [R, out]

Each LinearWithLoRA's lora_a / lora_b are views of the pool ([max_loras, in, L * R] and
[max_loras, R, out], slot stride = per_slot), which the ops and kernels read in place. An adapter's
*image* is one such row, made by `prepare`: zero-padded past its rank, scale folded into B, in the
slots' dtype (the model's, or --lora-dtype's), on the device. Building it is the slow part of a slot
write (a copy, cast and multiply per projection and layer); it can run on any thread ahead of the
step, and images are kept (LRU by content digest) so an evicted adapter that comes back is one copy
away. Writing a slot is then one `copy_` of a row: the step loop's only LoRA work when an adapter is
loaded.

While the engine serves, `prepare_soon` makes an image on the pool's image thread instead, paced
(IMAGE_BUSY_CPU_SHARE of one CPU, resting after each piece of PACE_PIECE_S), and the scheduler leaves
the adapter's requests waiting until it is kept (`is_pending`): made between two steps, it would delay
every running stream's next token by its whole time (why: see docs/performance.md#hot-loads).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from data_plane.background import BackgroundPace, CpuPace, one_torch_thread
from data_plane.lora.layers import LinearWithLoRA
from data_plane.lora.weights import LoRAAdapterWeights

logger = logging.getLogger(__name__)

# what the image thread may use of one CPU while the engine serves: an image is then kept within a step or
# two, and no step loses more than a share of a CPU to it
IMAGE_BUSY_CPU_SHARE = 0.25


@dataclass(frozen=True)
class _Region:
    """Where one layer's A and B sit in a pool row (element offsets and per-slot shapes)."""

    layer_index: int
    linear: LinearWithLoRA
    a_offset: int
    a_shape: tuple[int, int]  # [in, L * R]
    b_offset: int
    b_shape: tuple[int, int]  # [R, out]


class SlotPool:
    def __init__(self, layers: list[list[LinearWithLoRA]], max_loras: int, kept_images: int) -> None:
        self.kept_images = kept_images
        self._images: OrderedDict[str, torch.Tensor] = OrderedDict()  # sha256 -> image, least recent first
        self._lock = threading.Lock()  # prepare may run on another thread than the step loop
        self._pending: set[str] = set()  # digests the image thread is making
        self._image_thread: ThreadPoolExecutor | None = None  # started by the first prepare_soon
        self._pace = BackgroundPace(lambda: True, IMAGE_BUSY_CPU_SHARE)
        self._regions: list[_Region] = []
        offset = 0
        for layer_index, linears in enumerate(layers):
            for linear in linears:
                (_, a_rows, a_cols), (_, b_rows, b_cols) = linear.lora_a.shape, linear.lora_b.shape
                a_shape, b_shape = (a_rows, a_cols), (b_rows, b_cols)
                self._regions.append(_Region(layer_index, linear, offset, a_shape, offset + a_shape[0] * a_shape[1], b_shape))
                offset += a_shape[0] * a_shape[1] + b_shape[0] * b_shape[1]
        self.per_slot = offset
        if not self._regions:  # no LoRA layers (slot bookkeeping alone)
            self.pool = None
            return
        first = self._regions[0].linear.lora_a
        self.pool = torch.zeros(max_loras, offset, dtype=first.dtype, device=first.device)
        for r in self._regions:  # the layers' buffers become views of the pool (the old ones are freed)
            r.linear.lora_a = self._view(self.pool, r.a_offset, r.a_shape)
            r.linear.lora_b = self._view(self.pool, r.b_offset, r.b_shape)

    @staticmethod
    def _view(rows: torch.Tensor, offset: int, shape: tuple[int, int]) -> torch.Tensor:
        """rows: [..., per_slot] -> [..., *shape], the region starting at `offset` of each row."""
        region = rows[..., offset : offset + shape[0] * shape[1]]
        view: torch.Tensor = region.unflatten(-1, shape)  # type: ignore[no-untyped-call]  # unannotated in torch
        return view

    @torch.no_grad()
    def prepare(self, weights: LoRAAdapterWeights, pace: Callable[[], None] | None = None) -> torch.Tensor | None:
        """The adapter's image [per_slot] on the pool's device (kept for the next write); any thread.
        `pace` is called after each LoRA linear's part of it."""
        if self.pool is None:
            return None
        digest = weights.description.sha256
        with self._lock:
            image = self._images.get(digest)
            if image is not None:
                self._images.move_to_end(digest)
                return image
        # built on the host in the slots' dtype (rounded once here), then one transfer (a no-op on the CPU)
        host = torch.zeros(self.per_slot, dtype=self.pool.dtype)
        for r in self._regions:
            modules = weights.layers.get(r.layer_index)
            if modules:
                r.linear.fill_slot_image(self._view(host, r.a_offset, r.a_shape), self._view(host, r.b_offset, r.b_shape), modules)
                if pace is not None:
                    pace()
        image = host.to(self.pool.device)
        with self._lock:
            self._images[digest] = image
            while len(self._images) > self.kept_images:
                self._images.popitem(last=False)
        return image

    def prepare_soon(self, weights: LoRAAdapterWeights) -> None:
        """Have the image thread make the adapter's image, paced, unless it is kept or being made."""
        if self.pool is None:
            return
        digest = weights.description.sha256
        with self._lock:
            if digest in self._images or digest in self._pending:
                return
            self._pending.add(digest)
            if self._image_thread is None:
                self._image_thread = ThreadPoolExecutor(1, "lora-slot-image", initializer=one_torch_thread)
        self._image_thread.submit(self._prepare_paced, weights)

    def _prepare_paced(self, weights: LoRAAdapterWeights) -> None:
        try:
            self.prepare(weights, pace=CpuPace(self._pace))
        except Exception:  # the step that loads the adapter makes it again, and fails the request there
            logger.exception("making the slot image of %s failed", weights.description.sha256[:12])
        finally:
            with self._lock:
                self._pending.discard(weights.description.sha256)

    def is_pending(self, weights: LoRAAdapterWeights) -> bool:
        """Whether the image thread is still making this content's image."""
        with self._lock:
            return weights.description.sha256 in self._pending

    def is_prepared(self, weights: LoRAAdapterWeights) -> bool:
        """Whether this content's image is kept, so that writing it is one copy."""
        with self._lock:
            return weights.description.sha256 in self._images

    @torch.no_grad()
    def write(self, slot: int, weights: LoRAAdapterWeights | None) -> None:
        """Slot `slot` := the adapter's image (prepared now if it was not yet), or zeros: one copy."""
        if self.pool is None:
            return
        if weights is None:
            self.pool[slot].zero_()
        else:
            image = self.prepare(weights)
            assert image is not None  # prepare answers None only without a pool
            self.pool[slot].copy_(image)

    def forget(self, digest: str) -> None:
        """Drop the kept image of this content (its adapter was removed)."""
        with self._lock:
            self._images.pop(digest, None)
