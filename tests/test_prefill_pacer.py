"""Prompt chunks paced by step time (core/prefill_pacer.py, `prefill_step_ratio`).

The pacer against a simulated device whose step time is known (decodes cost a fixed time,
a prompt token costs more the more context it attends to): the steps that read a long
prompt beside 64 streams stay near `ratio` times a decode step, where a fixed cap lets
them grow with the context; and a real engine reads prompts in paced chunks without
changing a single greedy token."""

from __future__ import annotations

import pytest
from test_prefill_cap import LONG, make_scheduler, running_decodes

from pagedllm.config import EngineConfig
from pagedllm.core import prefill_pacer
from pagedllm.core.prefill_pacer import PrefillPacer
from pagedllm.core.request import Request

DECODE_S = 0.010  # 64 decodes


def device_seconds(chunks, fixed: float = 0.0, pad: int = 1) -> float:
    """The simulated step: the decodes, plus per prompt token 20 us and 2 ns per token of
    context it attends to (attention's share grows with the prompt read so far), plus
    `fixed` for any step that carries prompt tokens (an eager step beside graph decodes).
    `pad`: a chunk costs what a multiple of `pad` tokens costs (a captured graph's size)."""
    t = DECODE_S
    for c in chunks:
        if c.num_tokens > 1:
            n = -(-c.num_tokens // pad) * pad
            mid = c.start + c.num_tokens / 2
            t += n * (20e-6 + 2e-9 * mid)
    if fixed and any(c.num_tokens > 1 for c in chunks):
        t += fixed
    return t


def read_long_prompt(pacer: PrefillPacer | None, cap: int, fixed: float = 0.0,
                     pad: int = 1, lag: bool = False, jitter: float = 0.0,
                     device=None) -> list[tuple[int, float]]:
    """64 streams decode, then a 32k prompt arrives: (chunk, step seconds) per step until
    its first token, with the pacer (if any) timing every step. `lag`: as under async
    scheduling, a step is scheduled before the one before it has been observed, so it
    runs the chunk the pacer asked for a step earlier. `jitter`: each step's time is off by
    up to that fraction either way (a real device's noise). `device`: the step's seconds
    from its chunks, in place of device_seconds(chunks, fixed, pad)."""
    import random

    rng = random.Random(0)
    sched = make_scheduler(cap)
    running_decodes(sched, 64)
    queued = [pacer.chunk() if pacer is not None else None]

    def run_step() -> tuple[object, float]:
        if pacer is not None and lag:
            sched.prefill_chunk_hint, queued[0] = queued[0], pacer.chunk()
        elif pacer is not None:
            sched.prefill_chunk_hint = pacer.chunk()
        out = sched.schedule()
        step = device(out.chunks) if device is not None else device_seconds(out.chunks, fixed, pad)
        seconds = step * (1 + jitter * rng.uniform(-1, 1))
        if pacer is not None:
            pacer.observe(seconds, [(c.num_tokens, c.num_tokens > 1) for c in out.chunks])
        sched.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
        return out, seconds

    for _ in range(5):  # decodes alone: the pacer's reference step
        run_step()
    long = Request("long", [3] * LONG, max_tokens=4)
    sched.add_request(long)
    steps = []
    while long.num_output_tokens == 0:
        out, seconds = run_step()
        steps.append((sum(c.num_tokens for c in out.chunks if c.request_id == "long"), seconds))
    assert sum(n for n, _ in steps) == LONG
    return steps


def test_paced_steps_stay_near_the_ratio_where_a_fixed_cap_grows():
    fixed = read_long_prompt(None, 512)
    assert max(t for _, t in fixed) > 4 * DECODE_S  # 512 tokens late in a 32k prompt
    paced = read_long_prompt(PrefillPacer(2.0, max_chunk=512), 512)
    times = [t for _, t in paced[3:]]  # after the first steps have been timed
    assert max(times) <= 2.15 * DECODE_S and min(times[:-1]) >= 1.8 * DECODE_S
    chunks = [n for n, _ in paced[3:-1]]
    assert chunks[0] > 2 * chunks[-1]  # fewer tokens a step as the context grows
    assert len(paced) > len(fixed)  # the price: the prompt takes more steps


def test_a_fixed_cost_of_most_of_the_budget_is_held_to_the_ratio_by_feedback(monkeypatch):
    """Each prompt step costs 7 ms more whatever its chunk (70% of the budget), and a chunk
    costs what the next multiple of 128 tokens costs (a captured graph's size). The fit
    alone leaves the tokens half the budget (its floor): the steps run at 2.2x a decode
    step, as the streams' gaps did on an H200 at ratio 2. The feedback on the paced steps'
    own times brings them back to the ratio; without it (the gain held at 1) they
    overshoot."""
    import statistics

    from pagedllm.core import prefill_pacer

    def paced_ratio(lag: bool = False) -> float:
        steps = read_long_prompt(PrefillPacer(2.0, max_chunk=512), 512, fixed=0.007, lag=lag,
                                 jitter=0.03 if lag else 0.0)
        return statistics.median(t for _, t in steps[8:-1]) / DECODE_S

    with_feedback, with_lag = paced_ratio(), paced_ratio(lag=True)
    monkeypatch.setattr(prefill_pacer, "GAIN_LIMITS", (1.0, 1.0))
    without = paced_ratio()
    assert without > 2.1
    assert with_feedback <= 2.05
    # async scheduling, and steps 3% noisy: a step runs the chunk asked a step before
    assert with_lag <= 2.05


@pytest.mark.parametrize("fixed", [0.004, 0.015])
def test_a_fixed_cost_per_prompt_step_is_fitted_not_spread_over_tokens(fixed):
    """Each step that carries prompt tokens costs `fixed` more, whatever its chunk (on an
    H100 a 7B step with a prompt chunk ran eagerly: 30 ms for 256 tokens, 36 for 512,
    against 9.6 ms for the decodes alone). Counted per token, that cost once shrank the
    chunks to the 16-token floor: a 32k prompt took some 2,000 steps. The fit takes it
    from the budget; where it leaves less than half (15 ms against 10), the tokens get
    half the budget and each step overshoots by about the fixed cost alone."""
    pacer = PrefillPacer(2.0, max_chunk=512)
    paced = read_long_prompt(pacer, 512, fixed)
    assert pacer.fixed_s == pytest.approx(fixed, rel=0.35)
    times = [t for _, t in paced[4:-1]]
    budget = DECODE_S  # (ratio - 1) x the decode step
    bound = DECODE_S + max(budget, fixed + 0.5 * budget)
    assert max(times) <= 1.1 * bound
    assert len(paced) < 32768 / 60  # chunks in the tens to hundreds, never the floor
    assert min(n for n, _ in paced[:-1]) > 2 * pacer.min_chunk


def test_a_burst_of_arrivals_beside_streams_waits_for_one_timed_decode_step(monkeypatch):
    """A fresh pacer has no decode step to measure against. 8 streams decode when 56 more
    arrive at once (256-token prompts): the first step with decodes carries no prompt (it
    is the reference), and every later step stays near the ratio (1.5), where the fixed cap
    of 512 runs every admission step at 2x a decode step. All 56 are admitted."""
    def admit(pacer: PrefillPacer | None) -> list[tuple[int, float]]:
        sched = make_scheduler(512)
        running_decodes(sched, 8)
        arrivals = [Request(f"a{i}", [i + 2] * 256, max_tokens=100_000) for i in range(56)]
        for r in arrivals:
            sched.add_request(r)
        if pacer is not None:
            sched.prefill_chunk_hint = pacer.chunk()  # as the engine core sets it
        steps = []
        while any(r.num_output_tokens == 0 for r in arrivals):
            out = sched.schedule()
            seconds = device_seconds(out.chunks)
            if pacer is not None:
                pacer.observe(seconds, [(c.num_tokens, c.num_tokens > 1) for c in out.chunks])
                sched.prefill_chunk_hint = pacer.chunk()
            sched.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
            steps.append((sum(c.num_tokens for c in out.chunks if c.request_id[0] == "a" and c.start < 256),
                          seconds))
        return steps

    capped = admit(None)
    assert min(t for _, t in capped) > 2.0 * DECODE_S
    paced = admit(PrefillPacer(1.5, max_chunk=512))
    assert paced[0] == (0, DECODE_S)  # decodes alone: timed
    assert paced[1][0] == 512  # then the cap once, to measure a prompt token
    assert max(t for _, t in paced[2:]) <= 1.55 * DECODE_S
    assert sum(n for n, _ in paced) == 56 * 256


def test_pacer_figures():
    p = PrefillPacer(2.0, max_chunk=256, min_chunk=16)
    assert p.chunk() == 0  # nothing timed: a step of decodes alone first, to time it
    p.observe(0.5, [(100, True)])  # no decode in the step: says nothing about the streams
    assert p.chunk() == 0
    p.observe(0.010, [(1, False)] * 8)
    assert p.chunk() == 256  # no prompt step timed yet: the cap, then measure
    p.observe(0.030, [(1, False)] * 8 + [(100, True)])  # 20 ms for 100 tokens: 0.2 ms each
    assert p.chunk() == 50  # (2 - 1) x 10 ms / 0.2 ms
    p.observe(0.210, [(1, False)] * 8 + [(100, True)])  # 2 ms a token now: the average halves in
    assert p.chunk() == 16  # 10 ms / 1.1 ms -> 9, at least min_chunk
    assert PrefillPacer(3.0, max_chunk=64).max_chunk == 64
    with pytest.raises(ValueError, match="> 1"):
        PrefillPacer(1.0, max_chunk=64)


@pytest.mark.parametrize("ratio", [1.0, 0, "2", True])
def test_prefill_step_ratio_is_checked(ratio):
    with pytest.raises(ValueError, match="prefill_step_ratio"):
        EngineConfig(model="m", prefill_step_ratio=ratio)


def test_an_engine_with_pacing_reads_prompts_in_paced_chunks_and_answers_the_same(tiny_models, tmp_path,
                                                                                 monkeypatch):
    """The tiny Llama on CPU: four streams decode, then a 300-token prompt arrives under a
    small budget; with and without pacing. The pacer times the steps (decodes alone, then
    with the prompt's chunks); pacing changes the chunks, never the tokens. Its trace
    (PAGEDLLM_PACER_TRACE) holds the steps that read the prompt."""
    import json

    from pagedllm import LLM, SamplingParams

    path, _ = tiny_models("llama")
    short = [[5 + i, 9, 13, 17] for i in range(4)]
    long = [(7 * i) % 200 + 3 for i in range(300)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = dict(model=path, device="cpu", skip_tokenizer_init=True, max_model_len=512,
                  max_num_batched_tokens=64, max_prefill_tokens_with_decodes=32, num_kv_blocks=256)

    def run(**extra) -> tuple[dict[str, list[int]], LLM]:
        llm = LLM(**common, **extra)
        engine, outs = llm.engine, {}
        for i, ids in enumerate(short):
            engine.add_request(f"s{i}", None, ids, params)
        for _ in range(4):  # the streams decode alone for a few steps
            engine.step()
        engine.add_request("long", None, long, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = list(o.outputs[0].token_ids)
        return outs, llm

    want, _ = run()
    monkeypatch.setenv("PAGEDLLM_PACER_TRACE", str(tmp_path / "pacer.jsonl"))
    got, llm = run(prefill_step_ratio=1.5)
    assert got == want and set(got) == {"s0", "s1", "s2", "s3", "long"}
    pacer = llm.engine.core._pacer
    assert pacer.decode_s is not None and pacer.per_token_s is not None
    assert 1 <= pacer.chunk() <= 32
    traced = [json.loads(x) for x in (tmp_path / "pacer.jsonl").read_text().splitlines()]
    assert sum(x["prompt"] for x in traced) >= 300 - 32  # the prompt's chunks beside the streams


def test_a_trace_records_each_observed_step():
    """PAGEDLLM_PACER_TRACE's file (here a buffer): a JSON line for each step with decodes,
    with the chunk the pacer had asked for and its figures after the step."""
    import io
    import json

    buf = io.StringIO()
    p = PrefillPacer(2.0, max_chunk=256, trace=buf)
    p.observe(0.5, [(100, True)])  # no decode: not observed, not traced
    p.observe(0.010, [(1, False)] * 8)
    p.chunk()
    p.observe(0.030, [(1, False)] * 8 + [(100, True)])
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert [x["prompt"] for x in lines] == [0, 100]
    assert lines[0]["decode_s"] == 0.010 and lines[1]["per_token_s"] == pytest.approx(0.0002)
    assert set(lines[1]) == {"seconds", "prompt", "asked", "decode_s", "fixed_s", "per_token_s", "gain"}


GRAPH_BUCKETS = [128, 256, 512]
# What a step with a prompt chunk added on an H200 (gpu-7b's shape beside 64 streams, the
# mixed-step graphs of a 512 cap; benchmarks/results/...-pacer-mixed-ratio1.5-a514b09.jsonl):
# about the same for any chunk inside a graph's bucket, plus the chunk's attention over the
# prompt read so far (mostly reading its pages once).
BUCKET_ADDED = {128: 0.0005, 256: 0.0028, 512: 0.0075}
H200_DECODE_S = 0.0093


def bucket_device_seconds(chunks) -> float:
    t = H200_DECODE_S
    n = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
    if n:
        ctx = max(c.start for c in chunks if c.num_tokens > 1)
        t += BUCKET_ADDED[next(b for b in GRAPH_BUCKETS if n <= b)] + ctx * 1.2e-7 + n * ctx * 1e-10
    return t


def read_long_prompt_on_graphs(pacer: PrefillPacer) -> list[tuple[int, float]]:
    """read_long_prompt on the device above, with async scheduling's lag and 3% noise."""
    return read_long_prompt(pacer, 512, lag=True, jitter=0.03, device=bucket_device_seconds)


def test_chunks_fill_graph_buckets_and_stay_near_the_ratio():
    """On the mixed-step graphs a chunk costs what its bucket costs, a step function the
    pacer's straight line cannot follow: at ratio 1.5 it ran at the 512 bucket (2.1x a
    decode step and more), as the H200 run's steps swung between 1.0x and 2.3x. Sized to
    whole buckets, the largest whose cost fits, the steps hold the ratio: the 256 bucket
    while the context is short, the 128 one after."""
    def ratios(steps):
        return sorted(t / H200_DECODE_S for _, t in steps)

    line = ratios(read_long_prompt_on_graphs(PrefillPacer(1.5, max_chunk=512)))
    paced = read_long_prompt_on_graphs(PrefillPacer(1.5, max_chunk=512, buckets=GRAPH_BUCKETS))
    by_bucket = ratios(paced)
    p99 = lambda r: r[int(0.99 * (len(r) - 1))]  # noqa: E731
    assert p99(line) > 2.0
    assert p99(by_bucket) <= 1.7 and by_bucket[len(by_bucket) // 2] <= 1.5
    chunks = [n for n, _ in paced[:-1]]
    assert set(chunks) <= set(GRAPH_BUCKETS)  # whole buckets (the last is what was left)
    assert 256 in chunks[:10] and chunks[-20:] == [128] * 20  # 256 early, 128 late


def test_bucket_pacer_figures():
    p = PrefillPacer(1.5, max_chunk=512, buckets=[512, 128, 256, 1024])
    assert p.buckets == [128, 256, 512]  # sorted, none past the cap
    assert p.chunk() == 0  # a decode step to time first
    p.observe(0.010, [(1, False)] * 8)
    assert p.chunk() == 128  # nothing timed: the smallest bucket first
    p.observe(0.011, [(1, False)] * 8 + [(100, True)])  # 1 ms added: 128 fits the 5 ms budget
    assert p.chunk() == 256  # the next bucket, never timed: tried
    p.observe(0.014, [(1, False)] * 8 + [(256, True)])  # 4 ms: fits; 128's figure drifts down
    assert p.bucket_s == {128: pytest.approx(0.001 * prefill_pacer.BUCKET_DECAY), 256: pytest.approx(0.004)}
    assert p.chunk() == 256  # 512 never timed, and the line (about 19 us a token) puts it past 5 ms
    p.observe(0.016, [(1, False)] * 8 + [(512, True)])  # timed anyway (a cap step): 6 ms, too dear
    assert p.chunk() == 256
    steps = 0
    while p.chunk() == 256 and steps < 100:  # 256 keeps its cost; 512's figure drifts down until it is tried again
        p.observe(0.014, [(1, False)] * 8 + [(256, True)])
        steps += 1
    assert p.chunk() == 512 and 30 <= steps <= 40  # ln(6 / 5) / -ln(0.995): 37
    p.observe(0.030, [(1, False)] * 8 + [(512, True)])  # 20 ms now: none fits, the smallest
    p.observe(0.030, [(1, False)] * 8 + [(256, True)])
    p.observe(0.030, [(1, False)] * 8 + [(128, True)])
    p.observe(0.030, [(1, False)] * 8 + [(128, True)])
    assert p.chunk() == 128


def test_the_engine_core_gives_the_pacer_the_mixed_graph_buckets(monkeypatch):
    """The worker captures mixed-step graphs on CUDA with graphs on and no LoRA; the pacer
    gets their sizes there and none elsewhere."""
    from pagedllm.engine.core import _mixed_graph_buckets

    monkeypatch.delenv("PAGEDLLM_MIXED_GRAPHS", raising=False)
    cfg = EngineConfig(model="m", device="cuda", max_prefill_tokens_with_decodes=512, prefill_step_ratio=1.5)
    assert _mixed_graph_buckets(cfg) == [64, 128, 256, 512]  # paced: an eighth of the cap too
    assert _mixed_graph_buckets(EngineConfig(**{**cfg.__dict__, "prefill_step_ratio": None})) == [128, 256, 512]
    for other in (dict(device="cpu"), dict(enforce_eager=True), dict(enable_lora=True),
                  dict(max_prefill_tokens_with_decodes=None)):
        assert _mixed_graph_buckets(EngineConfig(**{**cfg.__dict__, **other})) == []
    monkeypatch.setenv("PAGEDLLM_MIXED_GRAPHS", "0")
    assert _mixed_graph_buckets(cfg) == []
