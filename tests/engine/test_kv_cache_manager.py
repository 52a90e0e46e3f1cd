"""Block pool bookkeeping: shared prefix blocks, reference counts, LRU reuse of cached free blocks."""
from __future__ import annotations

from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import Request
from specserve.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), set(), 1000)


def admit(kv: KVCacheManager, r: Request) -> list:
    hits = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - len(hits) * kv.block_size, r.num_computed_tokens, hits)
    r.num_computed_tokens = r.num_tokens
    return hits


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True, max_model_len=100)
    a = req("a", list(range(10)))  # 2 full blocks + 2 tokens
    b = req("b", list(range(8)) + [50, 51, 52])
    admit(kv, a)
    hits = admit(kv, b)
    assert [h.block_id for h in hits] == kv.block_ids("a")[:2]
    assert all(h.ref_cnt == 2 for h in hits)
    kv.free(a)
    assert all(h.ref_cnt == 1 for h in hits)
    assert kv.pool.num_free == 10 - 3  # b holds 2 shared + 1 own block; a's private tail block came back
    kv.free(b)
    assert kv.pool.num_free == 10 and kv.usage == 0.0


def test_freed_cached_blocks_are_found_again_until_evicted_lru():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=True, max_model_len=100)
    old = req("old", list(range(100, 109)))  # 2 full blocks
    admit(kv, old)
    kv.free(old)
    again = req("again", list(range(100, 109)))
    assert len(kv.get_computed_blocks(again)) == 2
    # Never-cached blocks are reused first, then cached ones least recently freed first; a
    # prompt's blocks are freed tail first, so its second block goes before its first.
    filler = req("filler", list(range(200, 220)))  # 5 of the 6 blocks
    admit(kv, filler)
    hits = kv.get_computed_blocks(req("x", list(range(100, 109))))
    assert len(hits) == 1 and hits[0].block_id == 0


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, max_model_len=100)
    admit(kv, req("a", list(range(8))))
    assert len(kv.get_computed_blocks(req("b", list(range(8))))) == 1


def test_allocation_fails_cleanly_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False, max_model_len=100)
    r = req("a", list(range(16)))
    assert not kv.allocate_slots(r, 16, r.num_computed_tokens)
    assert kv.pool.num_free == 3 and kv.block_ids("a") == []


def test_the_pool_hands_out_blocks_as_a_free_list_of_every_block_in_id_order():
    """Blocks are made as they are first handed out; the order must stay that of a free list holding every block
    in id order from the start (least recently freed first), which this test keeps beside the pool."""
    import random

    from specserve.engine.kv_cache_manager import BlockPool

    rng = random.Random(0)
    pool, free, held = BlockPool(40, enable_caching=False), list(range(40)), []
    for _ in range(300):
        if held and (rng.random() < 0.5 or not free):
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            give, held = held[:k], held[k:]
            pool.release(give)
            free.extend(b.block_id for b in reversed(give))
        else:
            n = rng.randint(1, len(free))
            got = pool.allocate(n)
            want, free = free[:n], free[n:]
            assert [b.block_id for b in got] == want and all(b.ref_cnt == 1 for b in got)
            held.extend(got)
        assert pool.num_free == len(free)
    assert len(pool.blocks) == 40 and [b.block_id for b in pool.blocks] == list(range(40))
