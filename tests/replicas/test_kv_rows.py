"""Release numerics store KV rows as FP8 codes + UE8M0 scales and indexer keys as FP4 codes.

The stored codes must decode to exactly the values the unpacked pools hold in the same numerics,
so packing changes how many tokens fit, never a result.
"""

from __future__ import annotations

import pytest
import torch

from antumbra import Engine, SamplingParams
from antumbra.cachestore.row_format import RowFormat
from antumbra.cachestore.sizing import pool_device_bytes
from antumbra.config import CSA, HCA, CacheConfig, SchedulerConfig
from antumbra.replicas.model.kv_rows import (
    FP4_KEYS,
    FP8_KV,
    decode_index,
    decode_kv,
    encode_index,
    encode_kv,
    index_row_format,
    kv_row_format,
)
from antumbra.replicas.model.numerics import EXACT, RELEASE
from antumbra.replicas.model.quant import (
    fp4_decode,
    fp4_encode,
    fp4_roundtrip,
    fp8_decode,
    fp8_encode,
    fp8_roundtrip,
)
from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)


def spread(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values over many binades, with all-zero, tiny and huge blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    flat = x.view(-1, shape[-1])
    flat[0, : min(70, shape[-1])] = 0.0
    if flat.shape[0] > 1:
        flat[1] *= 1e-30
    if flat.shape[0] > 2:
        flat[2] *= 1e30
    return x


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 512, (n,), generator=g).tolist()


# ------------------------------------------------------------------------------ codes


@pytest.mark.parametrize("shape", [(6, 448), (3, 5, 48), (4, 130), (0, 64), (2, 0, 64)])
def test_fp8_codes_decode_to_the_round_trip(shape) -> None:
    x = spread(shape, seed=1) if 0 not in shape else torch.zeros(shape)
    codes, exps = fp8_encode(x, 64)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert exps.dtype == torch.uint8 and exps.shape == (*shape[:-1], -(-shape[-1] // 64))
    assert torch.equal(fp8_decode(codes, exps, 64), fp8_roundtrip(x, 64).float())


@pytest.mark.parametrize("shape", [(6, 128), (3, 5, 16), (4, 34), (0, 32)])
def test_fp4_codes_decode_to_the_round_trip(shape) -> None:
    x = spread(shape, seed=2) if 0 not in shape else torch.zeros(shape)
    packed, exps = fp4_encode(x, 32)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(fp4_decode(packed, exps, 32), fp4_roundtrip(x, 32).float())


def test_fp4_codes_need_an_even_width() -> None:
    with pytest.raises(ValueError, match="even width"):
        fp4_encode(torch.ones(2, 33))


# ------------------------------------------------------------------------------ row formats


def test_formats_at_v4_widths_match_the_release_layouts() -> None:
    kv = kv_row_format(RELEASE, 512, 64, torch.bfloat16)
    assert (kv.encoding, kv.width, kv.dtype, kv.row_bytes) == (
        FP8_KV,
        584,
        torch.uint8,
        584,
    )  # FlashMLA's 584 B
    keys = index_row_format(RELEASE, 128, torch.bfloat16)
    assert (keys.encoding, keys.width, keys.row_bytes) == (FP4_KEYS, 68, 68)
    assert kv_row_format(EXACT, 512, 64, torch.bfloat16) == RowFormat.plain(512, torch.bfloat16)
    assert index_row_format(RELEASE, 128, torch.bfloat16, packed=False) == RowFormat.plain(
        128, torch.bfloat16
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("head_dim", "rope_dim"), [(512, 64), (32, 8), (100, 36)])
def test_kv_rows_decode_to_what_unpacked_pools_hold(dtype, head_dim, rope_dim) -> None:
    fmt = kv_row_format(RELEASE, head_dim, rope_dim, dtype)
    x = spread((9, head_dim), seed=head_dim).clamp(-1e30, 1e30).to(dtype)
    rows = encode_kv(fmt, x, rope_dim, RELEASE)
    assert rows.shape == (9, fmt.width) and rows.dtype == torch.uint8
    values = decode_kv(fmt, rows, rope_dim)
    assert values.dtype == dtype
    assert torch.equal(values, RELEASE.kv(x, rope_dim).to(dtype))
    assert torch.equal(values[:, head_dim - rope_dim :], x[:, head_dim - rope_dim :])  # RoPE channels kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [128, 16, 8])
def test_indexer_rows_decode_to_what_unpacked_pools_hold(dtype, dim) -> None:
    fmt = index_row_format(RELEASE, dim, dtype)
    x = torch.randn(7, dim, generator=torch.Generator().manual_seed(dim)).to(dtype)
    values = decode_index(fmt, encode_index(fmt, x, RELEASE))
    assert torch.equal(values, RELEASE.indexer(x).to(dtype))


def test_codes_of_one_mode_refuse_another() -> None:
    fmt = kv_row_format(RELEASE, 32, 8, torch.float32)
    with pytest.raises(ValueError, match="kv_storage='model_dtype'"):
        encode_kv(fmt, torch.ones(2, 32), 8, EXACT)
    keys = index_row_format(RELEASE, 16, torch.float32)
    with pytest.raises(ValueError, match="FP4 indexer numerics"):
        encode_index(keys, torch.ones(2, 16), EXACT)
    with pytest.raises(ValueError, match="kv_storage must be"):
        CacheConfig(kv_storage="fp8")


# ------------------------------------------------------------------------------ engines


def release(path, **kwargs) -> Engine:
    return Engine.from_pretrained(path, device="cpu", dtype="float32", numerics="release", **kwargs)


def row_bytes(engine: Engine) -> int:
    """Bytes of the pools' KV and key rows (the compression state is float32 in every mode)."""
    pools = engine.pools
    tensors = [pools.swa_kv] + [p.rows for p in [*pools.compressors.values(), *pools.indexers.values()]]
    return sum(t.numel() * t.element_size() for t in tensors)


PROMPTS = [tokens(n, seed=n) for n in (5, 130, 700)]


def test_release_pools_store_codes_and_give_bitwise_the_unpacked_results(tiny_checkpoint) -> None:
    packed = release(tiny_checkpoint)
    unpacked = release(tiny_checkpoint, cache=CacheConfig(kv_storage="model_dtype"))
    mc = packed.model_config
    assert packed.pools.swa_kv.dtype == torch.uint8
    assert (
        packed.pools.swa_kv.shape[-1] == kv_row_format(RELEASE, mc.head_dim, mc.rope_dim, torch.float32).width
    )
    for layer, pool in packed.pools.indexers.items():
        assert pool.rows.dtype == torch.uint8 and pool.row_format.encoding == FP4_KEYS, layer
    for pool in packed.pools.compressors.values():
        assert pool.rows.dtype == torch.uint8 and pool.row_format.encoding == FP8_KV
    assert unpacked.pools.swa_kv.dtype == torch.float32 and unpacked.pools.kv_format.is_plain
    # Tiny fp32 rows: KV 128 -> 64 bytes (24 codes, a scale byte, padding, 8 RoPE floats), keys 64 -> 12.
    assert row_bytes(packed) <= 0.5 * row_bytes(unpacked)

    for prompt in PROMPTS:
        assert torch.equal(packed.prompt_logits(prompt), unpacked.prompt_logits(prompt))
        packed.check_integrity()
    outs = packed.generate(PROMPTS, GREEDY)
    refs = unpacked.generate(PROMPTS, GREEDY)
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        assert out.logprobs == ref.logprobs  # the same values decoded: bit-identical arithmetic
    packed.check_integrity()
    # A repeat reads its prefix back from the packed pools' cache.
    again = packed.generate([PROMPTS[2]], GREEDY)[0]
    assert again.token_ids == outs[2].token_ids and again.cached_tokens > 0
    packed.check_integrity()


def test_a_device_budget_holds_more_tokens_when_rows_are_packed(tiny_checkpoint) -> None:
    sched = SchedulerConfig(max_num_seqs=2)
    probe = release(tiny_checkpoint, scheduler=sched)
    mc, swa_pages = probe.model_config, probe.pools.layout.num_swa_pages
    fixed = pool_device_bytes(mc, CacheConfig(), swa_pages, 2, torch.float32, 0)
    per_page = pool_device_bytes(mc, CacheConfig(), swa_pages, 2, torch.float32, 1) - fixed
    budget = fixed + 8 * per_page  # eight pages of rows in the model dtype
    packed = release(tiny_checkpoint, scheduler=sched, cache=CacheConfig(device_budget_bytes=budget))
    unpacked = release(
        tiny_checkpoint,
        scheduler=sched,
        cache=CacheConfig(device_budget_bytes=budget, kv_storage="model_dtype"),
    )
    exact = Engine.from_pretrained(
        tiny_checkpoint,
        device="cpu",
        dtype="float32",
        scheduler=sched,
        cache=CacheConfig(device_budget_bytes=budget),
    )
    tokens_packed = packed.pools.layout.num_virtual_slots
    tokens_unpacked = unpacked.pools.layout.num_virtual_slots
    assert tokens_unpacked == exact.pools.layout.num_virtual_slots == 8 * mc.page_size
    for engine in (packed, unpacked):
        assert engine.pools.device_bytes() <= budget
    # Compressed rows of fp32 values shrink from 128 / 64 bytes to 48 / 12 (tiny widths 32 and 16).
    assert tokens_packed >= 2 * tokens_unpacked, (tokens_packed, tokens_unpacked)
    long_prompt = tokens(tokens_unpacked + 64, seed=9)
    out = packed.generate([long_prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4  # a prompt longer than the unpacked pools could hold
    packed.check_integrity()


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    spec = TinyModelSpec(head_dim=64, index_head_dim=8, layer_types=(CSA, HCA), seed=3)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("wide-release") / "model", spec)


def test_hisparse_host_tier_moves_packed_rows(wide_checkpoint) -> None:
    tier = CacheConfig(hisparse_rows_per_request=64)
    sched = SchedulerConfig(max_num_seqs=4)
    on = release(wide_checkpoint, cache=tier, scheduler=sched)
    off = release(wide_checkpoint, scheduler=sched)
    csa = on.pools.hot.layers[0]
    assert on.pools.hot.rows[csa].dtype == torch.uint8
    assert on.pools.compressors[csa].rows.device.type == "cpu"
    document = tokens(1100, seed=5)  # 275 C4 rows: more than a hot buffer holds
    for prompt in (document + tokens(9, seed=6), document + tokens(17, seed=7)):
        a = on.generate([prompt], GREEDY)[0]
        b = off.generate([prompt], GREEDY)[0]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x == pytest.approx(y, abs=1e-5)
        on.check_integrity()
    stats = on.stats()
    assert stats["host_tier_misses"] > 0 and stats["host_tier_hits"] > 0
