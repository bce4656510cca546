"""Which block representations cross each pipeline transition (paper section 4.1, Eqs. 7-8).

A block AttnRes stack of L sublayers (blocks of S) is cut into C = P V chunks of consecutive
sublayers; chunk k (0-based) runs on physical stage k mod P (interleaved virtual stages, V chunks
per stage).  After chunk k the stack holds n_k completed block representations (b_0, the
embedding, included) and, when the chunk ends inside a block, the running partial sum (the
analogue of the hidden state a standard pipeline sends).

Transition k -> k+1 sends the partial sum and the blocks the receiving stage lacks:
  cache="none"      every block (naive; Eq. 7 counts these)
  cache="received"  the blocks the receiver has not received before (the paper's cross-stage
                    caching: blocks received in earlier virtual stages stay local; Eq. 8)
  cache="all"       also skips the blocks the receiver produced itself in earlier chunks
All of this is static: every rank derives the same plan from the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

CACHE_POLICIES = ("none", "received", "all")


@dataclass(frozen=True)
class PipelinePlan:
    """chunk_sizes: sublayers per chunk (C = len, a multiple of num_stages); block_size: S."""

    chunk_sizes: Tuple[int, ...]
    block_size: int
    num_stages: int
    cache: str = "received"

    def __post_init__(self):
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages: expected an int >= 1, got {self.num_stages!r}")
        sizes = tuple(self.chunk_sizes)
        if not sizes or len(sizes) % self.num_stages or any(
                not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"chunk_sizes: expected a multiple of num_stages={self.num_stages} of "
                             f"ints >= 1, got {self.chunk_sizes!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size: expected an int >= 1, got {self.block_size!r}")
        if self.cache not in CACHE_POLICIES:
            raise ValueError(f"cache: expected one of {CACHE_POLICIES}, got {self.cache!r}")
        object.__setattr__(self, "chunk_sizes", sizes)

    @classmethod
    def steady(cls, num_stages: int, virtual_stages: int, blocks_per_chunk: int, block_size: int,
               *, offset: int = 1, cache: str = "received") -> "PipelinePlan":
        """The setting of Eqs. 7-8: chunk j (1-based) ends `offset` sublayers into a block
        (0 = on a block boundary) so that it has accumulated exactly j N_p blocks (b_0 counted)."""
        if not isinstance(offset, int) or not 0 <= offset < block_size:
            raise ValueError(f"offset: expected an int in [0, block_size={block_size}), got {offset!r}")
        first = (blocks_per_chunk - 1) * block_size + offset
        if first < 1:
            raise ValueError("blocks_per_chunk=1 with offset=0 leaves the first chunk empty")
        sizes = [first] + [blocks_per_chunk * block_size] * (num_stages * virtual_stages - 1)
        return cls(tuple(sizes), block_size, num_stages, cache)

    # -- layout --------------------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return len(self.chunk_sizes)

    @property
    def virtual_stages(self) -> int:
        return self.num_chunks // self.num_stages

    @property
    def num_layers(self) -> int:
        return sum(self.chunk_sizes)

    def stage_of(self, chunk: int) -> int:
        return chunk % self.num_stages

    def layers(self, chunk: int) -> range:
        """0-based sublayer indices of a chunk."""
        start = sum(self.chunk_sizes[:chunk])
        return range(start, start + self.chunk_sizes[chunk])

    def blocks_after(self, chunk: int) -> int:
        """n_k: completed blocks (b_0 included) once chunk k has run (the last block counts as
        complete after the last sublayer)."""
        end = self.layers(chunk).stop
        if end == self.num_layers:
            return 1 + -(-end // self.block_size)
        return 1 + end // self.block_size

    def produced(self, chunk: int) -> range:
        """Block indices first produced by a chunk (chunk 0 produces b_0 from the embedding)."""
        return range(0 if chunk == 0 else self.blocks_after(chunk - 1), self.blocks_after(chunk))

    def partial_after(self, chunk: int) -> bool:
        """Whether chunk k ends inside a block (then the running partial sum is sent)."""
        end = self.layers(chunk).stop
        return end < self.num_layers and end % self.block_size != 0

    # -- transfers -----------------------------------------------------------------------------
    def held_before(self, chunk: int) -> set:
        """Blocks cached on chunk's stage when its input arrives (per the cache policy)."""
        held: set = set()
        if self.cache == "none":
            return held
        for earlier in range(self.stage_of(chunk), chunk, self.num_stages):
            if earlier > 0:
                held.update(self.sent(earlier - 1))
            if self.cache == "all":
                held.update(self.produced(earlier))
        return held

    def sent(self, chunk: int) -> List[int]:
        """Block indices sent on transition chunk -> chunk + 1 (increasing)."""
        if not 0 <= chunk < self.num_chunks - 1:
            raise ValueError(f"chunk: expected 0 <= chunk < {self.num_chunks - 1}, got {chunk!r}")
        held = self.held_before(chunk + 1)
        return [j for j in range(self.blocks_after(chunk)) if j not in held]

    def block_transfers(self) -> int:
        """Block representations sent over all transitions (per token; times D for elements)."""
        return sum(len(self.sent(k)) for k in range(self.num_chunks - 1))

    def partial_transfers(self) -> int:
        return sum(self.partial_after(k) for k in range(self.num_chunks - 1))


def eq7_naive(num_stages: int, virtual_stages: int, blocks_per_chunk: int) -> int:
    """Paper Eq. 7 (per token, in units of d): sum_{j=1}^{C-1} j N_p = C (C - 1) / 2 N_p."""
    c = num_stages * virtual_stages
    return c * (c - 1) // 2 * blocks_per_chunk


def eq8_cached(num_stages: int, virtual_stages: int, blocks_per_chunk: int) -> int:
    """Paper Eq. 8: P (P - 1) / 2 N_p + (V - 1) P^2 N_p."""
    p = num_stages
    return (p * (p - 1) // 2 + (virtual_stages - 1) * p * p) * blocks_per_chunk
