"""Prefix cache: the KV of full blocks, found again by the hash of everything before them.

nano-vllm's scheme (also vLLM's automatic prefix caching): a full block's key is
`hash((parent_key, its tokens))`, so equal keys mean equal token prefixes, and a new
prompt reuses the blocks of the longest run of its leading full blocks whose keys are
cached. The tokens are kept beside the key and compared on a hit, so a hash collision
costs a miss, never a wrong answer. A finished sequence's partially filled last block is
cached the same way, keyed by its fewer tokens (block_pool.py `register_last`; SGLang's radix
cache keeps such tails too), so a prompt that extends a finished text reuses all its KV.

Cached blocks are immutable (a writer copies them first: block_pool.py). A cached block that no
sequence uses is *idle*: it keeps its KV and stays findable, and is the first thing the
pool reclaims when it runs out of free blocks, least recently used first. Blocks in use
are never idle, so eviction never takes a block a sequence still reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

ROOT_KEY = 0x5EED  # the parent key of a sequence's first block


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """Chain hash of a full block: its tokens and (through `parent`) every token before them."""
    return hash((parent, tuple(tokens)))


class PrefixCache:
    """Key -> block for full blocks; an LRU list of the idle ones."""

    def __init__(self):
        self._block_of: dict[int, int] = {}  # key -> block
        self._entry: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (key, tokens)
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entry)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def lookup(self, key: int, tokens: Sequence[int]) -> int | None:
        """The block holding exactly these tokens after this prefix, or None."""
        block = self._block_of.get(key)
        if block is None or self._entry[block][1] != tuple(tokens):
            return None
        return block

    def register(self, block: int, key: int, tokens: Sequence[int]) -> None:
        """Make a just-filled block findable. A key already cached keeps its first block
        (two requests prefilled the same prefix in one step: the second copy stays private)."""
        if key not in self._block_of and block not in self._entry:
            self._block_of[key] = block
            self._entry[block] = (key, tuple(tokens))

    def is_cached(self, block: int) -> bool:
        return block in self._entry

    def idle_blocks(self) -> set[int]:
        return set(self._idle)

    def park(self, block: int) -> None:
        """The block's last user let it go: keep it, most recently used."""
        if block not in self._entry:
            # A check, not an assert: an idle block the cache cannot name would be handed out
            # again by `evict` with no key to forget, its KV read under another prefix.
            from decodekit.engine.block_pool import PoolCorrupted  # block_pool.py imports this module

            raise PoolCorrupted(f"block {block} was released to the prefix cache, which has no entry for it")
        self._idle[block] = None

    def unpark(self, block: int) -> None:
        """An idle block is used again."""
        del self._idle[block]

    def evict(self) -> int:
        """Forget the least recently used idle block and return it for reuse."""
        block, _ = self._idle.popitem(last=False)
        key, _ = self._entry.pop(block)
        del self._block_of[key]
        return block
