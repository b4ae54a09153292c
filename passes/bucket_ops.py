"""The copies around a bucket, as two operators Inductor calls instead of generating code.

    torch.ops.overlapc.pack(parts, rows)            # copy-in: one flat buffer
    torch.ops.overlapc.unpack_columns(rows, offsets, sizes)  # copy-out: member-major

``pack``: every part viewed as ``(rows, -1)`` (row-major; a non-contiguous part is
read through its strides), the views joined along dim 1, the result flattened.
``rows=1`` lays the parts end to end (an all-gather's or all-reduce's bucket
input); ``rows=world`` puts row r of every part together in block r (a
reduce-scatter's bucket input: rank r's block is every member's block r).
``as_bytes=True`` packs each part's bytes (uint8): an all-gather bucket of
several dtypes, whose gathered blocks are viewed back as their dtypes.

``unpack_columns``: ``rows`` is a gathered bucket ``(world, n)``; member i owns
columns ``[offsets[i], offsets[i] + sizes[i])`` of every row. The result is one
flat buffer holding member i's ``(world, sizes[i])`` block contiguous, members
in the order given, so that each member's gathered value is a view of it.

Why operators and not ``cat``: Inductor lowers a ``cat`` of n realized inputs
to one loop nest per input, so a model's buckets cost hundreds of generated
kernels, each with its code generation and C++/Triton compile (Llama 8 layers:
490 kernels against plain Inductor's 210). An operator it does not know is
called as it is (a fallback kernel): no code generated, one allocation, the
same bytes copied, values bit-identical. Both are pure (no mutation, no
aliasing: a fresh contiguous tensor), so AOTAutograd and Inductor may treat
them as any other op. They are registered when this module is imported, which
the bucket pass does; a graph that holds them (a cached or saved one) needs
``overlapc`` imported before it runs.
"""
from __future__ import annotations

import torch

__all__ = ["pack", "unpack_columns", "FAKE_IMPLS"]


@torch.library.custom_op("overlapc::pack", mutates_args=())
def pack(parts: list[torch.Tensor], rows: int, as_bytes: bool = False) -> torch.Tensor:
    """Parts viewed as (rows, -1), joined along dim 1, flattened (see the module docstring);
    ``as_bytes``: each part's bytes (uint8), so that parts of several dtypes join."""
    if as_bytes:
        parts = [part.reshape(rows, -1).contiguous().view(torch.uint8) for part in parts]
    return torch.cat([part.reshape(rows, -1) for part in parts], dim=1).reshape(-1)


@pack.register_fake
def _pack_fake(parts: list[torch.Tensor], rows: int, as_bytes: bool = False) -> torch.Tensor:
    if as_bytes:
        return parts[0].new_empty((sum(part.numel() * part.element_size() for part in parts),), dtype=torch.uint8)
    return parts[0].new_empty((sum(part.numel() for part in parts),))


@torch.library.custom_op("overlapc::unpack_columns", mutates_args=())
def unpack_columns(rows: torch.Tensor, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """Column blocks ``rows[:, offsets[i]:offsets[i] + sizes[i]]`` of ``rows`` (world, n)
    one after another, each contiguous (see the module docstring)."""
    world = rows.shape[0]
    out = rows.new_empty((world * sum(sizes),))
    blocks = [block.view(world, -1) for block in torch.split(out, [world * size for size in sizes])]
    if list(offsets) == [sum(sizes[:i]) for i in range(len(sizes))] and sum(sizes) == rows.shape[1]:
        torch.split_with_sizes_copy(rows, sizes, dim=1, out=blocks)   # one kernel on CUDA
    else:
        for block, offset, size in zip(blocks, offsets, sizes):
            block.copy_(rows.narrow(1, offset, size))
    return out


@unpack_columns.register_fake
def _unpack_columns_fake(rows: torch.Tensor, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    return rows.new_empty((rows.shape[0] * sum(sizes),))


# each operator's fake implementation, which passes/rewrite.py calls directly for a new
# node's value: what the dispatcher would return, without its custom-op layers (4x the cost)
FAKE_IMPLS = {torch.ops.overlapc.pack.default: _pack_fake,
              torch.ops.overlapc.unpack_columns.default: _unpack_columns_fake}
