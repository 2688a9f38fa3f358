"""The warm-up runs every synthetic step its shapes list and leaves the engine as it found it.

On CPU the steps run the PyTorch path (no compilation happens there); that every kernel variant is
compiled by them, and none afterwards, is checked on the H200 by `benchmarks/engine/cold_start.py`
(Triton cache misses counted over requests of many lengths after the warm-up) and by
`tests/kernels/test_variants.py` on the bucket rules.
"""

from __future__ import annotations

from antumbra import Engine, SamplingParams
from antumbra.config import SchedulerConfig
from antumbra.kernels.variants import warmup_shapes

SCHED = SchedulerConfig(max_model_len=512, max_num_batched_tokens=128, max_num_seqs=4)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(3, 200)), [9, 8, 7]]


def test_warmup_runs_its_shapes_and_leaves_nothing_behind(tiny_checkpoint):
    events: list[object] = []
    warm = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHED, warmup="on")
    report = warm.warmup
    assert report is not None
    assert list(report.shapes) == warmup_shapes(128, warm.max_model_len - 1, 4)
    assert report.num_steps == len(report.shapes) > 10
    assert (
        max(t for t, _ in report.shapes) == 128 and max(c for _, c in report.shapes) == warm.max_model_len - 1
    )
    warm.subscribe(lambda seq, event: events.append(event))
    warm.check_integrity()
    assert warm.pools.num_free_virtual_pages == warm.pools.layout.num_virtual_pages
    assert warm.pools.num_free_swa_pages == warm.pools.layout.num_swa_pages
    assert warm.cached_block_hashes() == [] and not warm.core.requests
    assert warm.stats()["prompt_tokens"] == 0.0 and warm.stats()["num_steps"] == 0.0
    cold = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHED)
    assert cold.warmup is None
    assert [o.token_ids for o in warm.generate(PROMPTS, PARAMS)] == [
        o.token_ids for o in cold.generate(PROMPTS, PARAMS)
    ]
    assert events  # the real requests' pages reach the cache and publish events; the warm-up's did not
