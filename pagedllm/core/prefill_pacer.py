"""Prompt chunks sized to a time budget while streams decode.

A fixed cap on a step's prompt tokens (`max_prefill_tokens_with_decodes`) bounds the work a
long prompt adds to a step, not its time: the attention of a chunk grows with the context
already read, so the 512th chunk of a 32k prompt costs far more than the first, and every
stream waits as long as the slowest step. The pacer bounds time instead. It keeps two
figures from the steps the engine has timed: how long a step of decodes alone takes, and
what each prompt token added to the last steps that carried some (an average that follows
the prompt's growing context). The next chunk is as many tokens as fit in
(ratio - 1) x the decode step, so a step that carries prompt tokens takes about `ratio`
times a decode step. The prompt is read in more, smaller steps than under a fixed cap.

A step that carries any prompt may also cost a fixed amount, whatever its chunk: on a GPU
it runs eagerly where a decode step replays a CUDA graph (H100, 7B shape: 30 ms for 256
prompt tokens, 36 ms for 512, 9.6 ms for the decodes alone). Counted per token, that cost
shrank every chunk towards the floor and a 32k prompt took 25 s beside 64 streams. So the
pacer fits the added time of its recent prompt steps as fixed + per-token x tokens (once
their chunks differ enough to tell the two apart), takes the fixed part from the budget,
and when it leaves less than half of it, bounds the per-token part by half the budget:
such steps exceed the ratio by their fixed cost, and tiny chunks would only starve the
prompt without making them shorter.

The fit is a straight line; a device's step time need not be one (captured CUDA graphs
pad a chunk up to their size, and a query tile's attention over a long context costs the
same for 16 rows as for 64). So the pacer also corrects itself by what it sees: after
each step whose chunk it sized, it compares the time the chunk added with the budget and
scales the next budgets by the square root of that ratio (the gain, kept within
GAIN_LIMITS). Under async scheduling (the default on CUDA) the step observed ran the
chunk asked one call earlier, and the steps' noise makes consecutive asks differ: the
pacer matches the last two (matching the latest alone, it counted 29 steps of 409 on a
simulated device with 3% noise, and on an H200 paced steps at ratio 2 still ran at 2.2x a
decode step). The gain applies only where the fitted fixed part leaves room for it
(fixed < budget); beyond that the steps overshoot whatever the chunk, and shrinking the
chunks would only starve the prompt.

On CUDA the steps that carry a prompt chunk replay mixed-step graphs, which pad the chunk
to the next of a few sizes (128, 256 and 512 rows under a cap of 512): a step's cost is a
step function of its chunk. On an H200 at ratio 1.5 the line and the gain then chased each
other around it: the gain climbed while chunks inside the 128 bucket cost almost nothing,
the chunk jumped into the 512 bucket (2.2x a decode step), the gain fell, and again; 1% of
the paced steps ran past 2.29x and the streams' p99 gap was 2.04x their median
(benchmarks/results/...-pacer-mixed-ratio1.5-a514b09.jsonl). Given the buckets (`buckets`:
the engine core passes the worker's graph sizes), the pacer keeps what a step of each
bucket added (a moving average, bucket_s) and asks for the largest bucket whose cost fits
the budget, whole, since part of a bucket costs the same; the smallest where none fits. A
bucket not yet timed is tried once the one below fits (unless the fitted line already puts
it past the budget), and the figures of buckets not in use drift down (BUCKET_DECAY) so
that one found too dear is tried again a few hundred steps later, when a new prompt with
little context may afford it. On the simulated H200 above, 99% of the paced steps stay
within 1.7x where the line ran past 2x; not yet measured on a GPU.

Until a step of decodes alone has been timed there is no reference: the pacer then asks
for a step without prompt tokens beside the decodes (chunk 0), and times it. Otherwise a
burst of arrivals, each admitted beside the streams already decoding, would never leave a
decode-only step to time, and every admission step would run at the fixed cap (on an H100,
7B shape: 64 streams' own 256-token prompts put 40 ms gaps into the earliest streams, the
p99 of the whole run once the long prompt itself was paced).

Pure Python and no clock of its own: the engine core times its steps and reports them
(observe), the scheduler asks for the chunk (chunk). With a `trace` (the engine core opens
PAGEDLLM_PACER_TRACE's file) every observed step with decodes is written as a JSON line:
its time, prompt tokens, and the pacer's figures after it, for reading a run afterwards.
"""

from __future__ import annotations

import json
from collections import deque
from typing import TextIO

# Prompt steps the fit of fixed and per-token cost looks back on, and how much their chunk
# sizes must differ (largest / smallest) for the two to be told apart.
FIT_WINDOW = 4
FIT_SPREAD = 1.5
# How far the feedback may scale the budget a chunk is sized to (see above).
GAIN_LIMITS = (0.25, 2.0)
# Graph buckets: each observed prompt step, the other buckets' costs shrink by this much,
# so that one found too dear is tried again some 100 to 200 steps later (a new prompt,
# with little context yet, may afford it again).
BUCKET_DECAY = 0.995


class PrefillPacer:
    def __init__(self, ratio: float, max_chunk: int, min_chunk: int = 16, trace: TextIO | None = None,
                 buckets: list[int] | None = None):
        if not ratio > 1.0:
            raise ValueError(f"the prefill step ratio must be > 1, got {ratio!r}")
        self.ratio = ratio
        self.max_chunk = max(1, max_chunk)
        self.min_chunk = max(1, min(min_chunk, self.max_chunk))
        self.decode_s: float | None = None  # a decode-only step (moving average)
        self.per_token_s: float | None = None  # seconds a prompt token adds to a step
        self.fixed_s = 0.0  # what a step adds for carrying any prompt at all
        self._recent: deque[tuple[int, float]] = deque(maxlen=FIT_WINDOW)  # (tokens, added s)
        self.gain = 1.0  # the feedback's scale on the budget
        # The last chunks sized to the budget (not a cap or floor; None for those): under
        # async scheduling a step is scheduled before the one ahead of it is observed, so
        # the step observed ran the chunk asked one call of chunk() earlier.
        self._asked: deque[int | None] = deque([None, None], maxlen=2)
        self.trace = trace
        # The prompt rows of the mixed-step CUDA graphs (worker/cuda_graphs.py): a step's
        # prompt tokens are padded up to the next of these, so its cost is a step function
        # of the chunk. With them the pacer sizes chunks to whole buckets (bucket_s).
        self.buckets = sorted({b for b in (buckets or []) if 0 < b <= self.max_chunk})
        self.bucket_s: dict[int, float] = {}  # seconds a step in that bucket added (moving average)

    def observe(self, seconds: float, chunks: list[tuple[int, bool]]) -> None:
        """A finished step: its duration and its chunks as (tokens, reads the prompt).
        Steps with no decode in them say nothing about what the streams wait."""
        prompt = sum(n for n, prefill in chunks if prefill)
        if seconds <= 0 or not any(not prefill for _, prefill in chunks):
            return
        try:
            self._observe(seconds, prompt)
        finally:
            if self.trace is not None:
                self.trace.write(json.dumps({
                    "seconds": round(seconds, 6), "prompt": prompt, "asked": list(self._asked),
                    "decode_s": self.decode_s, "fixed_s": self.fixed_s, "per_token_s": self.per_token_s,
                    "gain": round(self.gain, 4),
                    **({"bucket_s": {str(b): round(t, 6) for b, t in self.bucket_s.items()}}
                       if self.buckets else {})}) + "\n")

    def _observe(self, seconds: float, prompt: int) -> None:
        if prompt == 0:
            self.decode_s = seconds if self.decode_s is None else 0.8 * self.decode_s + 0.2 * seconds
            return
        if self.decode_s is None:
            return
        added = max(seconds - self.decode_s, 0.0)
        self._recent.append((prompt, added))
        fit = self._fit()
        if fit is not None:
            self.fixed_s, per = fit
        else:  # chunks too alike to separate the two: the fixed part as last fitted
            per = max(added - self.fixed_s, 0.0) / prompt
        # Half weight on the newest step: a long prompt's per-token cost keeps rising with
        # its context, and the chunk must follow it within a step or two.
        self.per_token_s = per if self.per_token_s is None else 0.5 * self.per_token_s + 0.5 * per
        if self.buckets:  # the step's bucket: its own cost; the others drift down (BUCKET_DECAY)
            b = next((b for b in self.buckets if prompt <= b), None)
            for k in self.bucket_s:
                if k != b:
                    self.bucket_s[k] *= BUCKET_DECAY
            if b is not None:
                old = self.bucket_s.get(b)
                self.bucket_s[b] = added if old is None else 0.5 * old + 0.5 * added
            return
        budget = self._budget()
        if prompt in self._asked and self.fixed_s < budget:  # the step ran a chunk as sized
            err = (budget / max(added, 1e-9)) ** 0.5
            self.gain = min(GAIN_LIMITS[1], max(GAIN_LIMITS[0], self.gain * err))

    def _budget(self) -> float:
        """What a paced step may add to a decode step: (ratio - 1) x the decode step."""
        return (self.ratio - 1.0) * self.decode_s

    def _fit(self) -> tuple[float, float] | None:
        """(fixed, per-token) seconds by least squares over the recent prompt steps, or
        None while their chunk sizes are too close (or the fit is not a rising line)."""
        ns = [n for n, _ in self._recent]
        if len(ns) < 2 or max(ns) < FIT_SPREAD * min(ns):
            return None
        mean_n = sum(ns) / len(ns)
        mean_t = sum(t for _, t in self._recent) / len(ns)
        var = sum((n - mean_n) ** 2 for n in ns)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in self._recent) / var
        if slope <= 0:
            return None
        return max(mean_t - slope * mean_n, 0.0), slope

    def chunk(self) -> int:
        """Prompt tokens for the next step beside decodes; 0 before a step of decodes alone
        has been timed (so that the next one is such a step)."""
        if self.buckets and self.decode_s is not None:
            return self._bucket_chunk()
        if self.decode_s is None or not self.per_token_s:
            self._asked.append(None)
            # nothing timed: a step of decodes alone first; no prompt step: the cap, to measure
            return 0 if self.decode_s is None else self.max_chunk
        budget = self._budget()
        room = max(budget - self.fixed_s, 0.5 * budget)
        if self.fixed_s < budget:
            room *= self.gain
        n = int(room / self.per_token_s)
        self._asked.append(n if self.min_chunk <= n <= self.max_chunk else None)
        return max(self.min_chunk, min(self.max_chunk, n))

    def _bucket_chunk(self) -> int:
        """The largest graph bucket whose cost fits the budget, whole (a chunk costs what
        its bucket costs, so a part of one buys nothing); the smallest where none does
        (any step with a prompt costs that much). A bucket never timed is tried once the
        one below it fits, unless the fitted line already puts it past the budget."""
        budget = self._budget()
        pick = self.buckets[0]
        for b in self.buckets:
            est = self.bucket_s.get(b)
            if est is None and self.per_token_s and self.fixed_s + self.per_token_s * b > budget:
                break  # never timed, and the line says too dear
            if est is not None and est > budget:
                break
            pick = b
            if est is None:
                break  # try it before anything larger
        self._asked.append(pick)
        return pick
