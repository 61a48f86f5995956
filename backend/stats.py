"""Speculation statistics, per request and aggregated.

  acceptance rate        accepted draft tokens / draft tokens proposed
  mean accepted tokens   E[tau]: tokens emitted per target forward, the bonus/recovered token
                         included (plain decoding has E[tau] = 1)
  per-position accept    P(the draft token at depth d was accepted | a depth-d token was drafted)
Draft and verify times are wall-clock seconds of the steps a request took part in.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_steps: int = 0                 # target verify forwards (prefill excluded)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_step_tokens: int = 0           # tokens emitted by verify steps
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0

    def record(self, num_draft: int, draft_depth: int, num_accepted: int, emitted: int,
               draft_s: float, verify_s: float) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_step_tokens += emitted
        self.draft_s += draft_s
        self.verify_s += verify_s
        for lst in (self.drafted_per_pos, self.accepted_per_pos):
            if len(lst) < draft_depth:
                lst.extend([0] * (draft_depth - len(lst)))
        for d in range(draft_depth):
            self.drafted_per_pos[d] += 1
            if d < num_accepted:
                self.accepted_per_pos[d] += 1

    def merge(self, other: "SpecStats") -> None:
        self.num_steps += other.num_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_step_tokens += other.num_step_tokens
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s
        for mine, theirs in ((self.drafted_per_pos, other.drafted_per_pos),
                             (self.accepted_per_pos, other.accepted_per_pos)):
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        return self.num_step_tokens / self.num_steps if self.num_steps else 0.0

    def per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def to_json(self) -> dict:
        total = self.draft_s + self.verify_s
        return {
            "num_steps": self.num_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position()],
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "draft_share": round(self.draft_s / total, 4) if total else 0.0,
        }
