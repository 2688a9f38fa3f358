"""The fused MoE router kernel against its reference, and the reference against the model's Router.

Runs in the Triton interpreter on CPU (outputs poisoned first), compiled where a CUDA device is
present. A row's k experts may come in another order than torch's top-k lists them, so rows are
compared as sets, each expert with its own weight. bfloat16 weights are the reference's bit for bit;
float32 ones within a few ulps (the k weights' sum adds in the reduction's order, and the
interpreter's exp / log1p are NumPy's).
"""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.moe_router import route, route_constexprs, route_reference
from antumbra.kernels.moe_router import triton as router_triton

ON_GPU = pytest.mark.gpu
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_EXPERTS = 256
TOP_K = 6
SCALING = 1.5
VOCAB = 97
SCORINGS = ["sqrtsoftplus", "sigmoid"]
DTYPES = [torch.bfloat16, torch.float32]
# The interpreter's NumPy warns where exp overflows; the values are torch's.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@pytest.fixture(autouse=True)
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    def fill(*shape, dtype, device):
        value = -7 if dtype == torch.int64 else float("nan")
        return torch.full(shape, value, dtype=dtype, device=device)

    monkeypatch.setattr(router_triton, "_empty", fill)


def _inputs(rows: int, dtype: torch.dtype, seed: int, device: str = DEVICE) -> dict[str, torch.Tensor]:
    """Gate logits spread past softplus's threshold (20) on both sides, a bias, token ids and a
    hash table of distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, NUM_EXPERTS, generator=g) * 8
    logits[:, :4] = torch.tensor([25.0, -30.0, 20.0, 19.5])
    table = torch.rand(VOCAB, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K]
    return dict(
        logits=logits.to(dtype).to(device),
        bias=(torch.randn(NUM_EXPERTS, generator=g) * 0.5).to(device),
        token_ids=torch.randint(0, VOCAB, (rows,), generator=g).to(device),
        tid2eid=table.to(device),
    )


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's experts in ascending id order, with their weights."""
    ids_sorted, order = ids.sort(dim=1)
    return weights.gather(1, order), ids_sorted


def _assert_same_routes(got, want, dtype: torch.dtype) -> None:
    (got_w, got_ids), (want_w, want_ids) = _by_expert(*got), _by_expert(*want)
    assert got_w.dtype == dtype and got_ids.dtype == torch.int64
    assert not got_w.isnan().any() and (got_ids >= 0).all()
    assert torch.equal(got_ids.cpu(), want_ids.cpu())
    if dtype == torch.bfloat16:
        assert torch.equal(got_w.cpu(), want_w.cpu())
    else:
        torch.testing.assert_close(got_w.cpu(), want_w.cpu(), rtol=4e-7, atol=0.0)


def _both(inp: dict[str, torch.Tensor], scoring: str, hashed: bool, replay: torch.Tensor | None):
    kind = dict(token_ids=inp["token_ids"], tid2eid=inp["tid2eid"]) if hashed else dict(bias=inp["bias"])
    args = (inp["logits"], TOP_K, SCALING, scoring)
    return route(*args, replay=replay, **kind), route_reference(*args, replay=replay, **kind)


@pytest.mark.parametrize("hashed", [False, True], ids=["score", "hash"])
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_kernel_is_the_reference(dtype, scoring, hashed):
    inp = _inputs(5, dtype, seed=len(scoring) + hashed)
    got, want = _both(inp, scoring, hashed, None)
    _assert_same_routes(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_replayed_experts_replace_the_routers_choice(dtype):
    inp = _inputs(4, dtype, seed=3)
    replay = torch.full((4, TOP_K), -1, dtype=torch.int64, device=DEVICE)
    replay[1] = torch.arange(TOP_K)  # rows are replayed whole (R3), or left to the router
    replay[2] = torch.arange(200, 200 + TOP_K)
    for hashed in (False, True):
        got, want = _both(inp, "sqrtsoftplus", hashed, replay)
        _assert_same_routes(got, want, dtype)
        assert got[1][1].tolist() == list(range(TOP_K)) and got[1][2].tolist() == list(range(200, 206))
        unreplayed, _ = _both(inp, "sqrtsoftplus", hashed, None)
        assert torch.equal(got[1][0], unreplayed[1][0]) and torch.equal(got[0][3], unreplayed[0][3])


def test_a_hash_table_of_int32_routes_as_int64():
    inp = _inputs(3, torch.bfloat16, seed=9)
    args = (inp["logits"], TOP_K, SCALING, "sqrtsoftplus")
    narrow = route(*args, token_ids=inp["token_ids"], tid2eid=inp["tid2eid"].int())
    wide = route(*args, token_ids=inp["token_ids"], tid2eid=inp["tid2eid"])
    assert narrow[1].dtype == torch.int64
    assert torch.equal(narrow[1], wide[1]) and torch.equal(narrow[0], wide[0])


def test_float32_weights_hold_the_logits_dtypes_values():
    inp = _inputs(4, torch.bfloat16, seed=13)
    args = (inp["logits"], TOP_K, SCALING, "sqrtsoftplus")
    wide = route(*args, bias=inp["bias"], weights_dtype=torch.float32)
    plain = route(*args, bias=inp["bias"])
    assert wide[0].dtype == torch.float32 and torch.equal(wide[0], plain[0].float())
    assert torch.equal(wide[1], plain[1])
    with pytest.raises(AssertionError, match="would round"):
        route(inp["logits"].float(), TOP_K, SCALING, "sigmoid", bias=inp["bias"],
              weights_dtype=torch.bfloat16)


def test_ties_go_to_the_lowest_expert_id():
    logits = torch.zeros(2, NUM_EXPERTS, device=DEVICE)
    logits[1, 100:] = 1.0
    _, ids = route(logits, TOP_K, SCALING, "sigmoid", bias=torch.zeros(NUM_EXPERTS, device=DEVICE))
    assert ids[0].tolist() == list(range(TOP_K)) and ids[1].tolist() == list(range(100, 100 + TOP_K))


def test_reference_is_the_models_router():
    from antumbra.config import ModelConfig
    from antumbra.replicas.model.moe import Router
    from antumbra.replicas.model.tiny import TinyModelSpec, build_config

    spec = TinyModelSpec(n_routed_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)
    cfg = ModelConfig.from_hf(build_config(spec))
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, cfg.hidden_size, generator=g)
    inp = _inputs(7, torch.float32, seed=5, device="cpu")
    for hashed in (False, True):
        router = Router(cfg, is_hash=hashed)
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=g))
            if hashed:
                router.tid2eid.copy_(torch.randint(0, NUM_EXPERTS, router.tid2eid.shape, generator=g))
            else:
                router.e_score_correction_bias.copy_(inp["bias"])
        ids = torch.randint(0, cfg.vocab_size, (7,), generator=g)
        logits = torch.nn.functional.linear(x, router.weight)
        kind = dict(token_ids=ids, tid2eid=router.tid2eid) if hashed else dict(bias=inp["bias"])
        want = route_reference(logits, TOP_K, cfg.routed_scaling_factor, cfg.scoring_func, **kind)
        got = router(x, ids)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_constexprs_follow_the_widths_only():
    v4 = route_constexprs(256, 6, "sqrtsoftplus", hashed=False, replay=False)
    assert v4["E_PAD"] == 256 and v4["K_PAD"] == 8 and v4["SQRT_SOFTPLUS"] is True and v4["num_warps"] == 2
    small = route_constexprs(12, 3, "sigmoid", hashed=True, replay=True)
    assert small["E_PAD"] == 16 and small["K_PAD"] == 4 and small["HASH"] and small["num_warps"] == 1


def test_bad_inputs_are_refused():
    inp = _inputs(3, torch.bfloat16, seed=1)
    with pytest.raises(AssertionError, match="scoring must be one of"):
        route(inp["logits"], TOP_K, SCALING, "softmax", bias=inp["bias"])
    with pytest.raises(AssertionError, match="bfloat16 or float32"):
        route(inp["logits"].half(), TOP_K, SCALING, "sigmoid", bias=inp["bias"])
    with pytest.raises(AssertionError, match="float32 bias"):
        route(inp["logits"], TOP_K, SCALING, "sigmoid", bias=inp["bias"].half())
    with pytest.raises(AssertionError, match="token_ids"):
        route(inp["logits"], TOP_K, SCALING, "sigmoid", tid2eid=inp["tid2eid"])
    with pytest.raises(AssertionError, match="replay must be"):
        route(inp["logits"], TOP_K, SCALING, "sigmoid", bias=inp["bias"], replay=inp["tid2eid"][:2])
    weights, ids = route(inp["logits"][:0], TOP_K, SCALING, "sigmoid", bias=inp["bias"])
    assert weights.shape == ids.shape == (0, TOP_K)


@ON_GPU
@pytest.mark.parametrize("scoring", SCORINGS)
def test_compiled_is_the_cuda_chain_bit_for_bit_in_bf16(scoring):
    """On the GPU both run the CUDA math library: the kernel's scores are torch's CUDA scores."""
    inp = _inputs(64, torch.bfloat16, seed=21, device="cuda")
    for hashed in (False, True):
        got, want = _both(inp, scoring, hashed, None)
        _assert_same_routes(got, want, torch.bfloat16)


@ON_GPU
def test_the_models_router_runs_the_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch):
    from antumbra.replicas.model import moe

    calls = []
    fused = moe.fused_route
    monkeypatch.setattr(moe, "fused_route", lambda *a, **k: calls.append(1) or fused(*a, **k))
    from antumbra.config import ModelConfig
    from antumbra.replicas.model.tiny import TinyModelSpec, build_config

    cfg = ModelConfig.from_hf(build_config(TinyModelSpec()))
    router = moe.Router(cfg, is_hash=False).cuda()
    with torch.no_grad():
        x = torch.randn(3, cfg.hidden_size, device="cuda")
        router(x, torch.zeros(3, dtype=torch.long, device="cuda"))
    assert calls == [1]
