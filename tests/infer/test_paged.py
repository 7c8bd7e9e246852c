"""The paged KV cache's accounting (``PagedKVCache.memory``, ``blocks_needed``, ``reserve``) against
a pool worked out by hand: 1 layer, 1 head, head_dim 2, float32 = 2 x 2 x 4 = 16 bytes a token,
4 blocks of 4 tokens = a 256-byte pool."""

import pytest

from minidist.infer import OutOfBlocks, PagedKVCache

TOK = 16


def pool():
    return PagedKVCache(1, 2, 1, 2, num_blocks=4, block_len=4)


def test_memory_of_a_partly_filled_block_by_hand():
    c = pool()
    assert c.bytes_per_token() == TOK
    assert c.memory() == {"reserved": 0, "used": 0, "waste": 0, "pool": 16 * TOK, "free_blocks": 4}
    c.reserve(0, 3)
    c.lengths[0] = 3
    assert c.memory() == {"reserved": 4 * TOK, "used": 3 * TOK, "waste": TOK, "pool": 16 * TOK,
                          "free_blocks": 3}
    c.reserve(1, 5)  # 2 blocks for 5 tokens (none written yet)
    assert c.memory([1]) == {"reserved": 8 * TOK, "used": 0, "waste": 8 * TOK, "pool": 16 * TOK,
                             "free_blocks": 1}
    c.release(0)
    assert c.memory()["free_blocks"] == 2 and c.memory()["reserved"] == 8 * TOK


@pytest.mark.parametrize("held,length,need", [(0, 0, 0), (0, 1, 1), (0, 4, 1), (0, 5, 2), (1, 4, 0),
                                              (1, 5, 1), (2, 8, 0), (2, 9, 1), (0, 16, 4)])
def test_blocks_needed_is_the_ceiling_less_the_blocks_held(held, length, need):
    c = pool()
    c.reserve(0, held * 4)
    assert c.blocks_needed(0, length) == need


def test_a_reservation_that_does_not_fit_takes_no_block_and_exactly_the_pool_fits():
    c = pool()
    c.reserve(0, 12)
    with pytest.raises(OutOfBlocks, match="slot 1 needs 2 more blocks for 5 tokens; 1 of 4 free"):
        c.reserve(1, 5)
    assert c.memory()["free_blocks"] == 1 and int(c.n_blocks[1]) == 0
    c.reserve(1, 4)  # the last block: exactly the pool
    assert c.memory()["free_blocks"] == 0
    with pytest.raises(ValueError, match="17 tokens exceed max_len 16"):
        c.reserve(0, 17)
