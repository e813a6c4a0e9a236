"""The LoRA kernels for CUDA in Triton, after punica: BGMV for decode tokens of mixed adapters, SGMV for
runs of prefill tokens of one adapter, each as a shrink and an expand with the lanes and the rank
trimming of the CPU ops (ops.py states the math). Every kernel reads the slots' A and B in place.

    bgmv shrink: program (token i, lane l):       v[t, l*rank : (l+1)*rank] = x[t] @ A[s, :, l*R : l*R + rank]
    bgmv expand: program (token i, column block): y[t, off_l + c] += v[t, lane l] @ B[s, :rank, off_l + c]
    sgmv shrink: program (segment, row block, lane): the same for BLOCK_M rows of one segment, with tl.dot
    sgmv expand: program (segment, row block, column block), one launch per lane

Products accumulate in float32 (tl.dot in IEEE precision, not TF32: exact as the torch ops are).
Triton is optional (the `cuda` extra): without it `load_triton_kernels` answers None and CUDA serves with
the torch ops. The tests run these kernels on the CPU in Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import logging

import torch

from data_plane.lora.ops import Lanes, SplitKernels
from data_plane.model.lora_batch import LoRABatch

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # not installed: the torch ops serve (see load_triton_kernels)
    triton = None

BLOCK_K = 64  # input features per shrink iteration
BLOCK_N = 64  # output columns per expand program
BLOCK_M = 16  # segment rows per SGMV program (tl.dot's smallest tile)


def _block_rank(rank: int) -> int:
    padded: int = triton.next_power_of_2(rank)
    return max(16, padded)


if triton is not None:
    # The ignores below: triton ships no type information (triton.jit is untyped), and the kernels'
    # arguments are Triton values whose annotations Triton's JIT would read, so they stay unannotated.

    @triton.jit  # type: ignore[untyped-decorator]
    def _bgmv_shrink_kernel(x_ptr, a_ptr, v_ptr, index_ptr, slots_ptr, dim, rank, padded,  # type: ignore[no-untyped-def]
                            x_row, a_slot, a_row, v_row, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
        i, lane = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slots_ptr + i)
        if slot >= 0:  # slot -1: a base-model token, its row of v is left alone
            t = tl.load(index_ptr + i)
            r = tl.arange(0, BLOCK_R)
            acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for k0 in range(0, dim, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(x_ptr + t * x_row + k, mask=k < dim, other=0.0).to(tl.float32)  # [BK]
                a = tl.load(a_ptr + slot * a_slot + k[:, None] * a_row + lane * padded + r[None, :],
                            mask=(k[:, None] < dim) & (r[None, :] < rank), other=0.0).to(tl.float32)  # [BK, BR]
                acc += tl.sum(xk[:, None] * a, axis=0)
            tl.store(v_ptr + t * v_row + lane * rank + r, acc.to(v_ptr.dtype.element_ty), mask=r < rank)

    @triton.jit  # type: ignore[untyped-decorator]
    def _bgmv_expand_kernel(v_ptr, b_ptr, y_ptr, index_ptr, slots_ptr, rank, lane, offset, width,  # type: ignore[no-untyped-def]
                            v_row, b_slot, b_row, y_row, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        i, block = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slots_ptr + i)
        if slot >= 0:
            t = tl.load(index_ptr + i)
            r = tl.arange(0, BLOCK_R)
            c = block * BLOCK_N + tl.arange(0, BLOCK_N)
            vr = tl.load(v_ptr + t * v_row + lane * rank + r, mask=r < rank, other=0.0).to(tl.float32)  # [BR]
            b = tl.load(b_ptr + slot * b_slot + r[:, None] * b_row + offset + c[None, :],
                        mask=(r[:, None] < rank) & (c[None, :] < width), other=0.0).to(tl.float32)  # [BR, BN]
            y_at = y_ptr + t * y_row + offset + c
            y = tl.load(y_at, mask=c < width, other=0.0).to(tl.float32)
            tl.store(y_at, (y + tl.sum(vr[:, None] * b, axis=0)).to(y_ptr.dtype.element_ty), mask=c < width)

    @triton.jit  # type: ignore[untyped-decorator]
    def _sgmv_shrink_kernel(x_ptr, a_ptr, v_ptr, seg_ptr, dim, rank, padded, x_row, a_slot, a_row, v_row,  # type: ignore[no-untyped-def]
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
        seg, block, lane = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot, start, end = tl.load(seg_ptr + seg * 3), tl.load(seg_ptr + seg * 3 + 1), tl.load(seg_ptr + seg * 3 + 2)
        if start + block * BLOCK_M < end:  # segments are shorter than the longest one the grid is sized for
            rows = start + block * BLOCK_M + tl.arange(0, BLOCK_M)
            r = tl.arange(0, BLOCK_R)
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, dim, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xb = tl.load(x_ptr + rows[:, None] * x_row + k[None, :],
                             mask=(rows[:, None] < end) & (k[None, :] < dim), other=0.0).to(tl.float32)  # [BM, BK]
                ab = tl.load(a_ptr + slot * a_slot + k[:, None] * a_row + lane * padded + r[None, :],
                             mask=(k[:, None] < dim) & (r[None, :] < rank), other=0.0).to(tl.float32)  # [BK, BR]
                acc += tl.dot(xb, ab, input_precision="ieee")
            tl.store(v_ptr + rows[:, None] * v_row + lane * rank + r[None, :], acc.to(v_ptr.dtype.element_ty),
                     mask=(rows[:, None] < end) & (r[None, :] < rank))

    @triton.jit  # type: ignore[untyped-decorator]
    def _sgmv_expand_kernel(v_ptr, b_ptr, y_ptr, seg_ptr, rank, lane, offset, width, v_row, b_slot, b_row, y_row,  # type: ignore[no-untyped-def]
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        seg, block, col_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot, start, end = tl.load(seg_ptr + seg * 3), tl.load(seg_ptr + seg * 3 + 1), tl.load(seg_ptr + seg * 3 + 2)
        if start + block * BLOCK_M < end:
            rows = start + block * BLOCK_M + tl.arange(0, BLOCK_M)
            r = tl.arange(0, BLOCK_R)
            c = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
            vb = tl.load(v_ptr + rows[:, None] * v_row + lane * rank + r[None, :],
                         mask=(rows[:, None] < end) & (r[None, :] < rank), other=0.0).to(tl.float32)  # [BM, BR]
            bb = tl.load(b_ptr + slot * b_slot + r[:, None] * b_row + offset + c[None, :],
                         mask=(r[:, None] < rank) & (c[None, :] < width), other=0.0).to(tl.float32)  # [BR, BN]
            y_at = y_ptr + rows[:, None] * y_row + offset + c[None, :]
            mask = (rows[:, None] < end) & (c[None, :] < width)
            y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_at, (y + tl.dot(vb, bb, input_precision="ieee")).to(y_ptr.dtype.element_ty), mask=mask)


class TritonKernels(SplitKernels):
    """LoRAKernels in Triton: one launch per op (per lane for the expands), weights read in place."""

    def bgmv_shrink(self, v: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, index: torch.Tensor,
                    slots: torch.Tensor, num_lanes: int, rank: int, rows_from_zero: bool = False) -> None:
        _rows_contiguous(x, lora_a, v)
        _bgmv_shrink_kernel[(len(index), num_lanes)](
            x, lora_a, v, index, slots, x.shape[1], rank, lora_a.shape[2] // num_lanes,
            x.stride(0), lora_a.stride(0), lora_a.stride(1), v.stride(0), BLOCK_K=BLOCK_K, BLOCK_R=_block_rank(rank))

    def bgmv_expand(self, y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, index: torch.Tensor,
                    slots: torch.Tensor, lanes: Lanes, rank: int, rows_from_zero: bool = False) -> None:
        _rows_contiguous(y, v, lora_b)
        for lane, (offset, width) in enumerate(lanes):
            _bgmv_expand_kernel[(len(index), triton.cdiv(width, BLOCK_N))](
                v, lora_b, y, index, slots, rank, lane, offset, width,
                v.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0), BLOCK_N=BLOCK_N, BLOCK_R=_block_rank(rank))

    def sgmv_shrink(self, v: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch, num_lanes: int) -> None:
        _rows_contiguous(x, lora_a, v)
        table, longest = batch.segment_table(x.device), max(end - start for _, start, end in batch.prefill_segments)
        _sgmv_shrink_kernel[(len(table), triton.cdiv(longest, BLOCK_M), num_lanes)](
            x, lora_a, v, table, x.shape[1], batch.rank, lora_a.shape[2] // num_lanes,
            x.stride(0), lora_a.stride(0), lora_a.stride(1), v.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=_block_rank(batch.rank))

    def sgmv_expand(self, y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch, lanes: Lanes) -> None:
        _rows_contiguous(y, v, lora_b)
        table, longest = batch.segment_table(y.device), max(end - start for _, start, end in batch.prefill_segments)
        for lane, (offset, width) in enumerate(lanes):
            _sgmv_expand_kernel[(len(table), triton.cdiv(longest, BLOCK_M), triton.cdiv(width, BLOCK_N))](
                v, lora_b, y, table, batch.rank, lane, offset, width,
                v.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=_block_rank(batch.rank))


def _rows_contiguous(*tensors: torch.Tensor) -> None:
    """The kernels step along rows by their strides but read each row as consecutive elements."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"LoRA Triton kernels need rows of consecutive elements, got strides {t.stride()}")


def load_triton_kernels() -> TritonKernels | None:
    if triton is None:
        logger.warning("Triton is not installed (pip install 'loraplane[cuda]'): using the pure-torch LoRA ops on CUDA")
        return None
    return TritonKernels()
