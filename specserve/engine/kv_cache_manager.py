"""Paged KV cache bookkeeping: a block pool with prefix caching by block hash.

Blocks are shared between requests whose prompts start with the same full
blocks. A block whose last user finished keeps its hash and stays findable
until the pool needs it again; free blocks are reused least recently freed
first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from specserve.engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A block's hash covers its tokens and, through the parent, every token before it."""
    return hash((parent_hash, token_ids))


class BlockPool:
    """The pool's blocks, free or held. A block is made when it is first handed out, so building a pool costs
    nothing per block (a CPU engine's default pool of a small model has hundreds of thousands). What must hold:
    blocks never used go out before any freed one, in id order, then the freed ones least recently freed first,
    exactly as from a free list that started with every block in id order."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        self.num_blocks = num_blocks
        self.blocks: list[Block] = []  # the blocks handed out so far: block i at index i
        self.enable_caching = enable_caching
        # block_id -> Block of the blocks freed after use, in eviction order (least recently freed first).
        self.free: OrderedDict[int, Block] = OrderedDict()
        self.cached: dict[int, Block] = {}
        self.hits = 0
        self.queries = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - len(self.blocks) + len(self.free)

    def allocate(self, n: int) -> list[Block]:
        assert n <= self.num_free, "caller must check num_free first"
        fresh = min(n, self.num_blocks - len(self.blocks))
        out = [Block(i, ref_cnt=1) for i in range(len(self.blocks), len(self.blocks) + fresh)]
        self.blocks.extend(out)
        for _ in range(n - fresh):
            _, block = self.free.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def release(self, blocks: list[Block]) -> None:
        # Release the tail first so the pool evicts a prompt's last blocks before its first ones.
        for b in reversed(blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free[b.block_id] = b

    def lookup(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash)

    def cache(self, block: Block, block_hash: int) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.req_blocks: dict[str, list[Block]] = {}
        # The same blocks' ids, kept beside them so a step reads a request's block table without rebuilding it.
        self.req_block_ids: dict[str, list[int]] = {}
        # Hashes of each request's full blocks, computed once as tokens arrive.
        self.req_hashes: dict[str, list[int]] = {}
        # How many of each request's leading blocks were already offered to the cache: each step then hashes
        # and caches only the blocks it filled, not all of them again.
        self.req_num_cached: dict[str, int] = {}

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and the hit counts: the pool as built, every block free in id order. Only
        while no request holds blocks."""
        if self.req_blocks:
            raise RuntimeError(f"{len(self.req_blocks)} requests still hold KV blocks; finish them first")
        self.pool = BlockPool(self.num_blocks, self.enable_caching)
        self.req_hashes.clear()

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the manager's own list: read it, do not change it)."""
        return self.req_block_ids.get(request_id, [])

    def _block_hashes(self, req: Request) -> list[int]:
        hashes = self.req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= req.num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs])))
        return hashes

    def get_computed_blocks(self, req: Request) -> list[Block]:
        """The longest run of cached blocks that starts the request's tokens.

        At least one token is always left to compute, since the step that
        computes it produces the logits for the next token.
        """
        if not self.enable_caching:
            return []
        hashes = self._block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        self.pool.queries += req.num_tokens
        self.pool.hits += len(hits) * self.block_size
        return hits

    def allocate_slots(
        self, req: Request, num_new_tokens: int, num_computed_tokens: int, new_computed_blocks: list[Block] = (),
        num_lookahead: int = 0,
    ) -> bool:
        """Reserve blocks for num_new_tokens after num_computed_tokens (plus lookahead slots for drafts);
        False if the pool is short."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        ids = self.req_block_ids.setdefault(req.request_id, [])
        num_computed = num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = min(num_computed + num_new_tokens + num_lookahead, self.max_model_len + num_lookahead)
        need = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free - evictable_hits:
            return False
        self.pool.touch(list(new_computed_blocks))
        added = list(new_computed_blocks) + (self.pool.allocate(need) if need > 0 else [])
        blocks.extend(added)
        ids.extend(b.block_id for b in added)
        self._cache_full_blocks(req, num_computed + num_new_tokens)
        return True

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        done = self.req_num_cached.get(req.request_id, 0)
        if (done + 1) * self.block_size > num_tokens:
            return  # no block filled since the last call
        # Only tokens already known are hashed: draft tokens being verified are not.
        hashes = self._block_hashes(req)
        blocks = self.req_blocks[req.request_id]
        num_full = min(num_tokens // self.block_size, len(hashes))
        for i in range(done, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self.req_num_cached[req.request_id] = max(done, num_full)

    def free(self, req: Request) -> None:
        self.reset_for_recompute(req)
        self.req_hashes.pop(req.request_id, None)

    def reset_for_recompute(self, req: Request) -> None:
        """Preemption: give the blocks back but keep the hashes (the tokens are unchanged)."""
        self.pool.release(self.req_blocks.pop(req.request_id, []))
        self.req_block_ids.pop(req.request_id, None)
        self.req_num_cached.pop(req.request_id, None)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.pool.hits / self.pool.queries if self.pool.queries else 0.0
