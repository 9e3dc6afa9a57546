"""The captions and QA jobs' input blocks stay small however large the input (lean: no Ray)."""
from jobs.caption import block_count


def test_rows_per_block_do_not_grow_with_the_input():
    # A prepared pair carries its encoded images; the object store holds blocks in flight between
    # the stages, so its use follows the block size (a fixed 64 blocks: 31 pairs per block at 2,000).
    for n in (1, 7, 8, 9, 200, 2000, 100_000):
        blocks = block_count(n, 8)
        assert 1 <= blocks <= n
        assert -(-n // blocks) <= 8          # rows in the largest block
    assert block_count(0, 8) == 1
