"""The paged KV cache's block bookkeeping alone: allocation, reference counts, the prefix registry."""

from __future__ import annotations

import pytest

from worker.engine.kv_blocks import BlockManager, OutOfBlocks, SequenceBlocks


def computed(blocks: BlockManager, tokens: list[int]) -> SequenceBlocks:
    """A sequence whose ``tokens`` were all computed (blocks taken, whole ones registered)."""
    seq = SequenceBlocks()
    assert blocks.ensure(seq, len(tokens))
    blocks.commit(seq, tokens, len(tokens))
    return seq


def test_allocation_and_reference_counts():
    blocks = BlockManager(4, 4)
    a, b = SequenceBlocks(), SequenceBlocks()
    assert blocks.ensure(a, 9) and len(a.table) == 3 and blocks.used == 3
    assert not blocks.ensure(b, 8) and b.table == [] and blocks.used == 3  # all or nothing
    assert blocks.ensure(b, 4) and blocks.available == 0
    with pytest.raises(OutOfBlocks):
        blocks.allocate()
    blocks.free(a)
    assert blocks.available == 3 and a.table == []


def test_whole_blocks_are_reused_and_the_last_token_is_always_computed():
    blocks = BlockManager(16, 4)
    prompt = list(range(100, 110))  # two whole blocks and two tokens
    first = computed(blocks, prompt)
    assert blocks.cached == 2
    same = SequenceBlocks()
    assert blocks.cached_length(prompt) == 8
    assert blocks.attach_prefix(same, prompt) == 8 and same.table == first.table[:2]
    # A prompt of exactly two blocks reuses one: its last token needs computing for its logits.
    assert blocks.cached_length(prompt[:8]) == 4
    # A different second block shares only the first.
    assert blocks.cached_length([*prompt[:4], 1, 2, 3, 4, 5]) == 4
    assert blocks.cached_length([7, *prompt[1:]]) == 0
    blocks.free(first)
    blocks.free(same)
    assert blocks.used == 0 and blocks.cached == 2  # unheld, but still reusable
    assert blocks.cached_length(prompt) == 8


def test_reusable_blocks_are_evicted_only_when_free_ones_run_out_oldest_chain_end_first():
    blocks = BlockManager(4, 2)
    old = computed(blocks, [1, 2, 3, 4])  # blocks (1,2) -> (3,4)
    blocks.free(old)
    assert blocks.available == 4 and blocks.cached == 2
    taker = SequenceBlocks()
    assert blocks.ensure(taker, 4)  # the two free blocks first
    assert blocks.cached_length([1, 2, 3, 4, 5]) == 4
    assert blocks.ensure(taker, 6)  # one reusable block goes: the chain's end (freed first)
    assert blocks.cached_length([1, 2, 3, 4, 5]) == 2
    assert blocks.ensure(taker, 8)  # and then its start
    assert blocks.cached_length([1, 2, 3, 4, 5]) == 0 and blocks.cached == 0


def test_a_prefix_is_always_used_more_recently_than_what_is_chained_below_it():
    blocks = BlockManager(3, 2)
    seq = computed(blocks, [1, 2, 3, 4, 5, 6])
    blocks.free(seq)
    user = SequenceBlocks()
    assert blocks.attach_prefix(user, [1, 2, 3, 9]) == 2  # the start alone is used again
    blocks.free(user)
    taker = SequenceBlocks()
    assert blocks.ensure(taker, 2)  # the chain's end goes first, then the middle: never the start
    assert blocks.cached_length([1, 2, 3, 4, 5, 6, 7]) == 4
    assert blocks.ensure(taker, 4)
    assert blocks.cached_length([1, 2, 3, 4, 5, 6, 7]) == 2


def test_clearing_the_cache_forgets_every_chain_and_frees_unheld_blocks():
    blocks = BlockManager(4, 2)
    held = computed(blocks, [1, 2, 3, 4])
    loose = computed(blocks, [7, 8, 9, 10])
    blocks.free(loose)
    blocks.clear_cache()
    assert blocks.cached == 0 and blocks.available == 2 and blocks.used == 2
    blocks.free(held)
    assert blocks.available == 4


def test_the_same_prefix_computed_twice_at_once_keeps_one_entry_and_both_chains_go_on():
    blocks = BlockManager(16, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    a, b = SequenceBlocks(), SequenceBlocks()
    assert blocks.ensure(a, 6) and blocks.ensure(b, 6)
    blocks.commit(a, tokens, 4)
    blocks.commit(b, tokens, 6)  # its first two blocks duplicate a's: a's entries are kept
    assert blocks.cached == 3
    later = SequenceBlocks()
    assert blocks.attach_prefix(later, [*tokens, 7]) == 6
    assert later.table == [*a.table[:2], b.table[2]]


def test_prefix_caching_off_registers_nothing():
    blocks = BlockManager(8, 2, prefix_caching=False)
    seq = computed(blocks, [1, 2, 3, 4, 5])
    assert blocks.cached == 0 and blocks.cached_length([1, 2, 3, 4, 5]) == 0
    blocks.free(seq)
    assert blocks.available == 8


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
