"""One block table per KV cache group, with a vectorised slot mapping.

Rows follow the persistent batch's request order, which every group shares. A manager block
of `block_size` tokens may be several kernel blocks of `kernel_block_size` tokens: manager
block b becomes kernel blocks b*k .. b*k+k-1, and slots are the same numbers either way.
"""

from __future__ import annotations

import torch


class BlockTable:
    def __init__(self, max_num_seqs: int, max_num_blocks: int, block_size: int,
                 kernel_block_size: int | None = None) -> None:
        kernel_block_size = kernel_block_size or block_size
        if block_size % kernel_block_size:
            raise ValueError(f"kernel block size {kernel_block_size} must divide the block "
                             f"size {block_size}")
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self.blocks_per_kernel = block_size // kernel_block_size
        # Manager block ids, CPU mirror: [max_num_seqs, max_num_blocks]. Read through the
        # accessors below: the layout is this class's business.
        self.table = torch.zeros(max_num_seqs, max_num_blocks, dtype=torch.int64)
        self.num_blocks = [0] * max_num_seqs

    def row(self, row: int) -> list[int]:
        """The manager block ids of one row, in order."""
        return list(self.table[row, :self.num_blocks[row]].tolist())

    def block_from_end(self, row: int, k: int) -> int | None:
        """The k-th last block id of a row (k = 1: the last), or None if it is shorter."""
        n = self.num_blocks[row]
        return int(self.table[row, n - k]) if n >= k else None

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.table[row, :len(block_ids)] = torch.tensor(block_ids, dtype=torch.int64)
        self.num_blocks[row] = len(block_ids)

    def append(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        if block_ids:
            self.table[row, start:start + len(block_ids)] = torch.tensor(block_ids,
                                                                         dtype=torch.int64)
        self.num_blocks[row] = start + len(block_ids)

    def move_row(self, src: int, dst: int) -> None:
        self.table[dst] = self.table[src]
        self.num_blocks[dst] = self.num_blocks[src]

    def kernel_table(self, num_rows: int) -> torch.Tensor:
        """[num_rows, max_num_blocks * k] kernel block ids."""
        table = self.table[:num_rows]
        if self.blocks_per_kernel == 1:
            return table
        k = self.blocks_per_kernel
        sub = torch.arange(k, dtype=torch.int64)
        return (table.unsqueeze(-1) * k + sub).flatten(1)

    def slot_mapping(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Where each token's K/V goes. Kernel and manager slots are the same numbers:
        (b*k + j) * kernel_block_size + offset == b * block_size + j * kernel_block_size +
        offset, so the manager table answers directly."""
        ids = self.table[rows, positions // self.block_size]
        return ids * self.block_size + positions % self.block_size
