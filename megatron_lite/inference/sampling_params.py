"""How generation chooses each token (generation.py): plain Python, so tools/generate.py checks its flags before
torch is imported."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    """`greedy` takes the most likely token. Otherwise sample from softmax(logits / temperature), keeping
    only the `top_k` most likely tokens (0: all) and the smallest set whose probability reaches `top_p`
    (1.0: all)."""

    greedy: bool = True
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0

    def problems(self) -> list[str]:
        problems = []
        if self.top_k < 0:
            problems.append(f"top-k ({self.top_k}) must be 0 (off) or positive")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top-p ({self.top_p}) must be in (0, 1]")
        if not self.temperature > 0.0:
            problems.append(f"temperature ({self.temperature}) must be positive")
        return problems
