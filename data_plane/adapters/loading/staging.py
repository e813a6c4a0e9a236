"""A fetched weights file copied into its adapter's host layout while it arrives, on a thread of its own.

Why: otherwise a cold load receives and hashes the weights on one thread, then the PEFT loader
allocates the adapter's shared-memory file and copies every tensor into it transposed, one after the
other, while the second CPU mostly waits (docs/performance.md#artifacts; measure with bench/artifacts.py).
Here a second low-priority thread follows the receiving one: it parses the safetensors header once its
bytes are in, allocates the shared file, and copies each tensor (transposed, in STAGED_DTYPE) as soon as
its span has arrived, noting whether its values are finite. After the last byte the loader adopts that
copy (`adopt`) instead of making it.
TensorStage is the artifacts side's download.Stage: the engine gives it to the fetcher where it wires the
cache (adapters/artifact_source.py); the download never imports it.

Trust: the stage reads bytes not yet verified, so nothing it made is used before the whole file's sha256
matched: the download hands it on only then, and otherwise `discard`s it (the shared file is removed;
nothing was published or served). It decides nothing either: the loader still checks every name,
shape and dtype on the verified header, and adopts the stage only if it holds exactly the tensors it
would have copied, in its own dtype. Bytes the stage cannot handle (a header it cannot parse, a tensor
that is not a 2-D float) are simply not staged; the loader then copies from the verified bytes itself
and refuses what it refuses for a file.

Only while the engine is idle: the stage overlaps the copy with the receive to use a CPU nobody uses.
While the engine has requests there is none to spare (the download rests so as to take at most a
quarter of one, data_plane.background.BackgroundPace), and staging would only move the copy into the
download's window and beside its work, raising the other streams' inter-token latency while it fetches
(docs/performance.md#artifacts); so a stage that finds the engine busy gives up, removes what it made,
and the loader copies after the last byte.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from data_plane.adapters.artifacts.buffers import Buffer
from data_plane.adapters.loading.safetensors_memory import all_finite, span_tensor
from data_plane.adapters.loading.shared_tensors import allocate
from data_plane.background import BackgroundPace, lower_thread_priority
from data_plane.lora.shared_layout import SharedLayout, TensorKey
from shared.safetensors_header import DTYPES, TensorInfo, header_length, parse

# the PEFT loader's host dtype (spec.AdapterReading keeps host copies float32); `adopt` checks it
STAGED_DTYPE = torch.float32


class StagedCopy:
    """What `adopt` hands the loader: views of the adapter's shared file by its keys, the file's layout
    (now the loader's to own), and whether each tensor's values were all finite."""

    def __init__(self, views: dict[TensorKey, torch.Tensor], layout: SharedLayout[TensorKey],
                 finite: dict[TensorKey, bool]) -> None:
        self.views, self.layout, self.finite = views, layout, finite


class TensorStage:
    """Copies the tensors of the safetensors bytes arriving in `buffer` (allocated at the file's listed
    size). The receiving thread calls `arrived(n)` once the first n bytes are in, then `finish()` once all
    are (and verified) or `discard()` on any failure."""

    def __init__(self, buffer: Buffer, pace: BackgroundPace | None = None) -> None:
        self._buffer = buffer
        self._pace = pace if pace is not None else BackgroundPace()  # its `busy`: whether to give up
        self._changed = threading.Condition()
        self._arrived = 0
        self._complete = self._stopped = False
        self._failed = False  # bytes it cannot stage: the loader copies them itself
        self._spans: dict[str, TensorInfo] | None = None
        self._pending: list[tuple[int, str]] = []  # (end, name) not yet copied, the last end first
        self._views: dict[str, torch.Tensor] = {}
        self._finite: dict[str, bool] = {}
        self._layout: SharedLayout[str] | None = None
        self._thread = threading.Thread(target=self._run, name="lora-stage", daemon=True)
        self._thread.start()

    def arrived(self, n: int) -> None:
        with self._changed:
            self._arrived = n
            self._changed.notify()

    def finish(self) -> None:
        """No more bytes will come: returns once everything that can be staged is."""
        with self._changed:
            self._complete = True
            self._changed.notify()
        self._thread.join()

    def discard(self) -> None:
        """Stop, and remove whatever was made (a failed or unverified download, or nobody adopted it)."""
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._thread.join()
        self._remove_copy()

    def adopt(self, names: Mapping[TensorKey, str], shapes: Mapping[TensorKey, list[int]],
              dtype: torch.dtype) -> StagedCopy | None:
        """The staged copy as the loader would have made it: `names` maps each of its keys to a tensor
        of the file, `shapes` gives each key's input-major shape. None (and the stage discarded) unless it
        holds exactly those tensors, complete, in those shapes and `dtype`; once adopted, the file is the
        caller's. Only for a verified file (after `finish`)."""
        if (self._failed or self._layout is None or self._pending or dtype != STAGED_DTYPE
                or sorted(names.values()) != sorted(self._views)
                or any(list(self._views[n].shape) != list(shapes[k]) for k, n in names.items())):
            self.discard()
            return None
        layout, self._layout = self._layout.rekeyed(names), None
        return StagedCopy({k: self._views[n] for k, n in names.items()}, layout,
                          {k: self._finite[n] for k, n in names.items()})

    # ---- the staging thread -------------------------------------------------------------------
    def _run(self) -> None:
        lower_thread_priority()
        try:
            while True:
                with self._changed:
                    while not (self._stopped or self._complete or self._ready(self._arrived)):
                        self._changed.wait()
                    if self._stopped:
                        return
                    available, complete = self._arrived, self._complete
                self._advance(available)
                if complete or self._failed or (self._spans is not None and not self._pending):
                    return
        except Exception:  # noqa: BLE001 - bytes it cannot stage: the loader reads them and says why
            self._failed = True

    def _give_up_if_busy(self) -> bool:
        """While the engine has requests: stop staging and remove what was made (module docstring)."""
        if not self._pace.busy():
            return False
        self._failed = True
        self._remove_copy()
        return True

    def _remove_copy(self) -> None:
        """The shared file and its views, gone (nothing made from unverified or unwanted bytes is kept)."""
        if self._layout is not None:
            self._layout.remove()
            self._layout = None
        self._views.clear()

    def _ready(self, available: int) -> bool:
        """Whether `available` bytes let it make progress (so it does not wake for every piece)."""
        if self._spans is None:
            return available >= 8 and 8 + header_length(memoryview(self._buffer)) <= available
        return bool(self._pending) and self._pending[-1][0] <= available

    def _advance(self, available: int) -> None:
        if self._spans is None:
            if not self._ready(available) or self._give_up_if_busy():
                return
            self._start()
        while self._pending and self._pending[-1][0] <= available and not self._stopped:
            if self._give_up_if_busy():
                return
            _, name = self._pending.pop()
            assert self._spans is not None
            tensor = span_tensor(self._buffer, self._spans[name])  # [r, in] or [out, r]
            self._finite[name] = all_finite(tensor)
            self._views[name].copy_(tensor.T)  # input-major: [in, r] or [r, out], cast

    def _start(self) -> None:
        """The header is in: the shared file for every tensor, or `_failed` if any is not a 2-D float."""
        spans = parse(self._buffer)
        if not spans or any(len(s.shape) != 2 or not DTYPES[s.dtype].floating for s in spans.values()):
            self._failed = True
            return
        views, self._layout = allocate({name: s.shape[::-1] for name, s in spans.items()}, STAGED_DTYPE)
        self._views = views
        self._spans = spans
        self._pending = sorted(((s.start + s.nbytes, name) for name, s in spans.items()), reverse=True)

