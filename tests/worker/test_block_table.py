"""Block tables: rows, appends, row moves, kernel blocks and the slot mapping."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.worker.block_table import BlockTable  # noqa: E402


def test_rows_append_and_move():
    table = BlockTable(max_num_seqs=3, max_num_blocks=6, block_size=4)
    table.set_row(0, [5, 9])
    table.set_row(1, [3])
    table.append(0, [2])
    table.append(1, [])
    assert table.row(0) == [5, 9, 2] and table.row(1) == [3]
    assert table.block_from_end(0, 1) == 2 and table.block_from_end(0, 3) == 5
    assert table.block_from_end(1, 2) is None
    table.move_row(0, 2)
    assert table.row(2) == [5, 9, 2]


def test_slot_mapping_follows_the_rows_blocks():
    table = BlockTable(max_num_seqs=2, max_num_blocks=4, block_size=4)
    table.set_row(0, [7, 1])
    table.set_row(1, [3])
    rows = torch.tensor([0, 0, 0, 1])
    positions = torch.tensor([0, 3, 4, 2])
    assert table.slot_mapping(rows, positions).tolist() == [28, 31, 4, 14]


@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_kernel_blocks_address_the_same_slots(kernel):
    """Manager block b = kernel blocks b*k .. b*k+k-1: a token's kernel block and offset give
    the same slot as its manager block and offset."""
    table = BlockTable(max_num_seqs=1, max_num_blocks=3, block_size=4, kernel_block_size=kernel)
    table.set_row(0, [6, 2, 9])
    kernel_row = table.kernel_table(1)[0]
    for pos in range(12):
        slot = int(table.slot_mapping(torch.tensor([0]), torch.tensor([pos])))
        kernel_slot = int(kernel_row[pos // kernel]) * kernel + pos % kernel
        assert slot == kernel_slot


def test_a_kernel_block_size_must_divide_the_block_size():
    with pytest.raises(ValueError, match="must divide"):
        BlockTable(max_num_seqs=1, max_num_blocks=1, block_size=16, kernel_block_size=5)
