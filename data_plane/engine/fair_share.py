"""Each API request's fair share of the batch, so that no request holds it while others wait.

A group is one API request (Request.group: a completion's prompts share one; any other request is a group of
its own). With G groups running or waiting, a group's share is max_num_seqs / G seats and num_blocks / G KV
blocks (at least 1 of each); a group holding more seats or more blocks than that is over its share. A
sequence's rank is how many sequences of its group come before it: for a running one, those of its group
admitted before it; for a waiting one, every running one of its group and those waiting ahead of it. A
sequence ranked below the seat share, of a group not over its share, is within its share: the scheduler
(scheduler.py) serves those first, and preempts sequences of groups over their share for them (down to
one sequence per group, so that none starves).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from data_plane.engine.sequence import Sequence


@dataclass
class FairShare:
    share: int  # seats per group
    block_share: int  # KV blocks per group
    running: Counter[str]  # running sequences per group (kept current as the step preempts)
    blocks: Counter[str]  # KV blocks the group's running sequences hold (likewise)
    rank: dict[int, int]  # seq id -> sequences of its group before it

    @classmethod
    def of(cls, running: list[Sequence], waiting: Iterable[Sequence], max_num_seqs: int, num_blocks: int) -> FairShare:
        counts: Counter[str] = Counter()
        blocks: Counter[str] = Counter()
        for seq in running:
            counts[seq.request.group] += 1
            blocks[seq.request.group] += len(seq.block_table)
        seen: Counter[str] = Counter()
        rank: dict[int, int] = {}
        for seq in [*running, *waiting]:
            rank[seq.seq_id] = seen[seq.request.group]
            seen[seq.request.group] += 1
        groups = max(1, len(seen))
        return cls(max(1, max_num_seqs // groups), max(1, num_blocks // groups), counts, blocks, rank)

    def _excess(self, group: str) -> float:
        """How far over its share the group is (above 1: over it)."""
        return max(self.running[group] / self.share, self.blocks[group] / self.block_share)

    def within(self, seq: Sequence) -> bool:
        return self.rank[seq.seq_id] < self.share and self._excess(seq.request.group) <= 1

    def order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        """The admission order: the sequences within their share in arrival order, then the others by rank
        (a seat they find goes to the group with the fewest ahead), in arrival order among equals."""
        return sorted(waiting, key=lambda seq: (0, 0) if self.within(seq) else (1, self.rank[seq.seq_id]))

    def victim(self, candidates: list[Sequence]) -> Sequence | None:
        """Of `candidates` (in admission order), the one to preempt for a sequence within its share: the
        most recently admitted of the group furthest over its share; None when no group is over it. A group
        keeps one running sequence, so that none starves (a long one over its blocks' share alone)."""
        over = [seq for seq in candidates if self.running[seq.request.group] > 1 and self._excess(seq.request.group) > 1]
        if not over:
            return None
        most = max(self._excess(seq.request.group) for seq in over)
        return [seq for seq in over if self._excess(seq.request.group) == most][-1]

    def preempted(self, seq: Sequence) -> None:
        """Call before its blocks are freed."""
        self.running[seq.request.group] -= 1
        self.blocks[seq.request.group] -= len(seq.block_table)
