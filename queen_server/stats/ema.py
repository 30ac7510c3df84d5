"""Seconds per token, as exponential moving averages, with prompt and completion apart.

Pure: no I/O, no clock. A streamed job tells both numbers (the time to the first token is the
prompt's, the rest the completion's); a plain job only its total, from which the completion
speed is taken after the prompt's known share.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.2


def ema(previous: float | None, sample: float, alpha: float = ALPHA) -> float:
    return sample if previous is None else previous + alpha * (sample - previous)


@dataclass(slots=True)
class Speed:
    """One worker's speed on one model size class."""

    prompt_s_per_token: float | None = None
    completion_s_per_token: float | None = None
    samples: int = 0

    def record(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        total_s: float,
        ttft_s: float | None,
        alpha: float = ALPHA,
    ) -> None:
        """Fold in one finished job. Jobs with no tokens, or negative times, teach nothing."""
        if not _sane(total_s, ttft_s):
            return
        if ttft_s is not None and prompt_tokens > 0:
            self.prompt_s_per_token = ema(self.prompt_s_per_token, ttft_s / prompt_tokens, alpha)
        sample = self.completion_sample(prompt_tokens, completion_tokens, total_s, ttft_s)
        if sample is None:
            return
        self.completion_s_per_token = ema(self.completion_s_per_token, sample, alpha)
        self.samples += 1

    def completion_sample(self, prompt_tokens: int, completion_tokens: int, total_s: float,
                          ttft_s: float | None) -> float | None:
        """One job's seconds per completion token (the prompt's share taken out: its time to
        first token, else the prompt at this record's prompt speed), or None when it teaches
        nothing. Records nothing."""
        if completion_tokens <= 0 or not _sane(total_s, ttft_s):
            return None
        if ttft_s is not None:
            generating = total_s - ttft_s
        else:
            generating = total_s - (self.prompt_s_per_token or 0.0) * prompt_tokens
        return generating / completion_tokens if generating > 0 else None


def _sane(total_s: float, ttft_s: float | None) -> bool:
    return total_s >= 0 and (ttft_s is None or 0 <= ttft_s <= total_s)
