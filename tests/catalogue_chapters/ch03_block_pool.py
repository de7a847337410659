"""Chapter 03's block allocator (``check_block_pool``): right answers written independently, and
the wrong ones a learner writes, one slip each (``pool_with(...)``)."""

from __future__ import annotations

from collections import OrderedDict, deque

from check_catalogue import right, wrong

from minillm.kvcache.block_manager import Block

BP = "check_block_pool"


def pool_with(**slip):
    """The reference pool with one of a learner's slips switched on."""

    class BlockPool:
        def __init__(self, num_blocks):
            self.blocks = [Block(i) for i in range(num_blocks)]
            self.free_ids = deque(range(num_blocks))
            self.cached = {}
            self.evictable = OrderedDict()

        def _unname(self, block):
            if not slip.get("evict_keeps_cached"):
                del self.cached[block.hash]
            if not slip.get("evict_keeps_hash"):
                block.hash, block.parent_hash, block.token_ids = None, None, ()

        def allocate(self):
            if self.evictable and slip.get("evict_first"):
                block_id, _ = self.evictable.popitem(last=False)
                self._unname(self.blocks[block_id])
            elif self.free_ids:
                block_id = self.free_ids[0] if slip.get("keeps_free") else self.free_ids.popleft()
            elif self.evictable:
                if slip.get("lifo"):
                    block_id, _ = self.evictable.popitem()
                elif slip.get("smallest"):
                    block_id = min(self.evictable)
                    del self.evictable[block_id]
                else:
                    block_id, _ = self.evictable.popitem(last=False)
                self._unname(self.blocks[block_id])
            elif slip.get("returns_none"):
                return None
            else:
                raise RuntimeError("no free block")
            if not slip.get("no_refcount"):
                self.blocks[block_id].ref_count = 1
            return block_id

        def ref(self, block_id):
            block = self.blocks[block_id]
            if block.ref_count == 0 and not slip.get("ref_keeps_evictable"):
                del self.evictable[block_id]
            block.ref_count += 1

        def release(self, block_id):
            block = self.blocks[block_id]
            if block.ref_count <= 0 and not slip.get("no_double_free"):
                raise RuntimeError(f"block {block_id}: double free")
            block.ref_count = 0 if slip.get("release_at_once") else block.ref_count - 1
            if block.ref_count == 0:
                if block.hash is not None and not slip.get("forgets_cache"):
                    if slip.get("cached_to_front"):
                        self.evictable[block_id] = None
                        self.evictable.move_to_end(block_id, last=False)
                    else:
                        self.evictable[block_id] = None
                else:
                    self.free_ids.append(block_id)

        def register(self, block_id, block_hash, parent_hash, token_ids):
            block = self.blocks[block_id]
            if slip.get("register_overwrites") or (block.hash is None and block_hash not in self.cached):
                if block.hash is not None:
                    del self.cached[block.hash]
                block.hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tuple(token_ids)
                self.cached[block_hash] = block_id

        def lookup(self, block_hash, parent_hash, token_ids):
            block_id = self.cached.get(block_hash)
            if block_id is None:
                return None
            block = self.blocks[block_id]
            if block.parent_hash != parent_hash and not slip.get("ignores_parent"):
                return None
            if block.token_ids != tuple(token_ids) and not slip.get("ignores_tokens"):
                return None
            return block_id

        def forget(self, block_id):
            block = self.blocks[block_id]
            if block.hash is None:
                return
            del self.cached[block.hash]
            block.hash, block.parent_hash, block.token_ids = None, None, ()
            if block.ref_count == 0 and not slip.get("forget_strands"):
                del self.evictable[block_id]
                self.free_ids.append(block_id)

    return BlockPool


right(BP, pool_with())


class BlockPoolLists:
    """Plain lists and a dict (insertion-ordered) for the LRU; names kept on the blocks."""

    def __init__(self, num_blocks):
        self.blocks = [Block(b) for b in range(num_blocks)]
        self.free_ids = list(range(num_blocks))
        self.cached = {}
        self.evictable = {}  # dicts keep insertion order: the first key is the oldest

    def _drop_name(self, b):
        blk = self.blocks[b]
        self.cached.pop(blk.hash)
        blk.hash, blk.parent_hash, blk.token_ids = None, None, ()

    def allocate(self):
        if len(self.free_ids) > 0:
            b = self.free_ids.pop(0)
        elif len(self.evictable) > 0:
            b = next(iter(self.evictable))
            del self.evictable[b]
            self._drop_name(b)
        else:
            raise RuntimeError("out of KV blocks")
        self.blocks[b].ref_count = 1
        return b

    def ref(self, b):
        self.evictable.pop(b, None)
        self.blocks[b].ref_count += 1

    def release(self, b):
        blk = self.blocks[b]
        if blk.ref_count == 0:
            raise RuntimeError(f"double free of block {b}")
        blk.ref_count -= 1
        if blk.ref_count > 0:
            return
        if blk.hash is None:
            self.free_ids.append(b)
        else:
            self.evictable[b] = True

    def register(self, b, h, parent, tokens):
        if self.blocks[b].hash is not None or h in self.cached:
            return
        self.blocks[b].hash, self.blocks[b].parent_hash, self.blocks[b].token_ids = h, parent, tuple(tokens)
        self.cached[h] = b

    def lookup(self, h, parent, tokens):
        b = self.cached.get(h)
        ok = b is not None and self.blocks[b].parent_hash == parent and self.blocks[b].token_ids == tuple(tokens)
        return b if ok else None

    def forget(self, b):
        if self.blocks[b].hash is None:
            return
        self._drop_name(b)
        if b in self.evictable:
            del self.evictable[b]
            self.free_ids.append(b)


right(BP, BlockPoolLists)

wrong(BP, "the least recently used is", pool_with(lifo=True))
wrong(BP, "the least recently used is", pool_with(smallest=True))
wrong(BP, "the least recently used is", pool_with(cached_to_front=True))
wrong(BP, "is referenced (1) and evictable", pool_with(ref_keeps_evictable=True))
wrong(BP, "ref_count 1", pool_with(no_refcount=True))
wrong(BP, "is referenced (1) and on the free list", pool_with(keeps_free=True))
wrong(BP, "evict only when it is empty", pool_with(evict_first=True))
wrong(BP, "delete its hash from cached too", pool_with(evict_keeps_cached=True))
wrong(BP, "clear block.hash, parent_hash and token_ids", pool_with(evict_keeps_hash=True))
wrong(BP, "a double free must raise RuntimeError", pool_with(no_double_free=True))
wrong(BP, "went back on the free list after one release", pool_with(release_at_once=True))
wrong(BP, "is on the free list but still named 1234", pool_with(forgets_cache=True))
wrong(BP, "a hash collision is not a hit", pool_with(ignores_tokens=True))
wrong(BP, "compare the stored parent_hash too", pool_with(ignores_parent=True))
wrong(BP, "a named block keeps its name", pool_with(register_overwrites=True))
wrong(BP, "is evictable but has no name", pool_with(forget_strands=True))
wrong(BP, "running out must raise RuntimeError", pool_with(returns_none=True))
