"""Which compiled variants the Triton kernels reach, and how a replica warms them all up.

Triton compiles one variant per distinct tuple of constexprs, launch options, argument dtypes and
specialisation of plain arguments: a plain int is specialised on `== 1` and `% 16 == 0`, a pointer
on 16-byte alignment. Every plain int whose value follows a request (token counts, candidate
counts, split counts, trip counts) is marked `do_not_specialize`; ints that are model widths (N, K,
D, W, row strides) keep their hints, which the weight and activation loads vectorise on (an
unspecialised int still compiles as i64 from 2^31 on: the sizes here stay far below). Pointers
keep theirs: every kernel argument is a fresh allocation, a parameter or a pool (all 512-byte
aligned) or a view at an offset fixed per engine. Every constexpr that follows a request is a
function of a few bucketed step quantities, computed by the kernel modules' own planning functions
(`pick_config`, `tiles_for`, `pre_constexprs`, ...), which `step_keys` below calls too:

    T    tokens in the step; T_b = next_power_of_2(T)
    L    the step's largest context (position + 1); C_m = L // m entries of rate m exist
    SMs  the device's multiprocessors (fixed per device)

General (prefill and mixed) step: kernel | launched by | not specialised | variants follow
------------------------------------------------------------------------------------------------
_rms_norm_kernel       RMSNorm on CUDA         -                      nothing (the model's widths)
_swiglu_kernel         SharedExpert on CUDA    -                      nothing (I and act_fp8)
_route_kernel          Router on CUDA          -                      the layer's kind (hash / score)
_cos_sin_kernel        RotaryTable on CUDA     num_positions          nothing (the rope width)
_write_state_kernel    compressors on CUDA     -                      nothing (each compressor's width);
                       (T > GEMV_MAX_TOKENS)                          not launched where the GEMV stores
_gemv_rows_kernel      compressors, Router,    num_tokens, k_steps    HAS_ROWS (the compressors' state
                       indexer head weights                           rows); launched for T <=
                       on CUDA                                        GEMV_MAX_TOKENS (`takes_gemv`)
_mix_partial_kernel    mhc_pre                 num_tokens, k_iters    BLOCK_T = 16 / 32 / 64 for
                                                                      T_b <= 16 / <= 64 / > 64
_pre_finish_kernel     mhc_pre                 num_tokens, split_k,   SPLIT_PAD = next_power_of_2 of
                                               d_iters                the K slices of T_b // 2 + 1
_post_kernel           mhc_post                -                      BLOCK_D 256 / 512 / 1024: halved
                                                                      while T_b * D / BLOCK_D < SMs
_head_finish_kernel    HyperHead on CUDA       num_tokens, split_k,   as _pre_finish_kernel, over the
                       (after the mixing GEMM  d_iters                step's logits rows instead of T
                       of its n mixes)                                (not in `step_keys`)
_gemv_kernel,          Fp8Linear (q_a, q_b,    num_tokens, k_steps    pick_config(T_b, N, SMs): one of
_dot_kernel            kv, o_b, indexer q_b,                          6 configs; the K split sizes the
                       shared experts)                                grid only (also which buffer is
                                                                      written: a uniform branch)
_moe_up_kernel,        PackedExperts           num_pairs              tiles_for(T) = pick_tiles(T_b):
_moe_down_kernel                                                      T_b <= 4 or T_b * k <= 2E /
                                                                      <= 16 E / else
_sum_slots_kernel      PackedExperts (the      -                      nothing (k); not launched where
                       pairs' sum and the                             the tiles sum the slots in the
                       shared expert's add)                           down kernel
_compress_kernel       window compressors      - (events: the grid)   SPLIT in {1, 2, 4, 8} (and the
                       (general: planned on                           BLOCK_D, BLOCK_S, num_warps it
                       step_events(T, m) =                            fixes) from ceil(T_b / m) events,
                       ceil(T_b / m); fast                            never from the windows that close
                       decode: E = B)                                 (data)
_indexer_score_kernel  Indexer.top_rows        N, blocks_per_prog     nothing
_topk_filter_kernel    Indexer.top_rows        N, k, blocks_per_prog  K_PAD = next_power_of_2(k), k =
                       (N = C_4, k = min(                             min(topk, C_4); BLOCK_N,
                       index_topk, C_4))                              FINISH_BLOCK, FINISH_REGS: powers
                                                                      of two of C_4, capped (1024, 2048,
                                                                      4096): constant from C_4 = 4096
_hybrid_split_kernel   Attention               K, blocks_per_split    HAS_EXTRA = K > 0, K = min(topk,
                       (rows T, window W,                             C_4) (CSA) or C_128 (HCA), i.e.
                       K extra keys)                                  L >= m; SINGLE_SPLIT = one split,
                                                                      T > programs_per_sm * SMs / 2
_hybrid_combine_kernel Attention, splits > 1   S                      BLOCK_S = next_power_of_2 of
                                                                      the splits, 2 to 16

`_rope_kernel` (Attention: q, kv and the output's inverse) depends on head counts and widths only (and
the numerics: the kv rotation writes the SWA rows itself unless release numerics encode them).

Fixed-shape decode step (fast_decode.py): the same kernels plus `_window_kernel` / `_rate_kernel`
(page, window, rate, max pages and entries of max_model_len).
Every size there is fixed by the captured batch size and max_model_len, so `FastDecoder.capture_all`
(run at start-up) compiles all of them; `warmup_shapes` is about the general step.

So the T-families (mhc, FP8 linears, MoE, compressors) depend on T_b only, the top-k filter on
next_power_of_2(C_4) only (saturating at 4096 entries), and attention on two booleans: one a
threshold of L per layer kind, one a threshold of T (for a window of at least 64 keys; with fewer,
a step without compressed keys has one split). `warmup_shapes` lists steps that reach every key
these rules allow, `step_keys` computes the keys of one step from the shared planning functions,
and `compile_watch` counts what still compiles.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import triton.language as tl

from antumbra.kernels.common.interpreter import interpreting

Key = tuple[str, frozenset[tuple[str, Any]]]  # (kernel name, constexprs and launch options)


# --------------------------------------------------------------------------- compile_watch


@dataclass(frozen=True)
class CompileEvent:
    """One in-memory cache miss: a kernel variant loaded from Triton's disk cache or compiled."""

    kernel: str  # the @triton.jit function's qualified name
    module: str
    constexprs: tuple[tuple[str, Any], ...]  # constexpr arguments, ints specialised to 1 included
    signature: tuple[tuple[str, str], ...]  # argument -> Triton type ("*bf16", "i32", "constexpr")
    aligned: tuple[str, ...]  # arguments specialised as 16-divisible (ints) or 16-byte aligned (pointers)
    num_warps: int
    num_stages: int
    warmup: bool  # an explicit `kernel.warmup(...)`

    def __str__(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.module}.{self.kernel}[warps={self.num_warps}, stages={self.num_stages}]({consts})"


def _arg_name(names: list[str], path: tuple[int, ...]) -> str:
    return names[path[0]] + "".join(f"[{i}]" for i in path[1:])


class compile_watch:  # noqa: N801 - used as a context manager, like a function
    """Counts every Triton in-memory cache miss (each JIT load or compile) while active.

        with compile_watch() as watch:
            serve(...)
        assert watch.count == 0, watch.report()

    Installs `triton.knobs.runtime.jit_cache_hook`, chaining a hook already there (its answer is
    returned, so a hook that skips compilation still does) and restoring it on exit; nest
    watches last-in first-out. A no-op under TRITON_INTERPRET, which compiles nothing.
    """

    def __init__(self) -> None:
        self.events: list[CompileEvent] = []
        self._lock = threading.Lock()
        self._previous: Any = None
        self._installed = False
        self._active = False

    @property
    def count(self) -> int:
        return len(self.events)

    def by_kernel(self) -> Counter[str]:
        return Counter(event.kernel for event in self.events)

    def report(self) -> str:
        """One line per miss, in order."""
        return "\n".join(str(event) for event in self.events) or "no compilation"

    def __enter__(self) -> compile_watch:
        if interpreting():
            return self
        from triton import knobs

        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        self._installed = self._active = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._installed:
            return
        from triton import knobs

        self._active = False
        if knobs.runtime.jit_cache_hook == self._hook:
            knobs.runtime.jit_cache_hook = self._previous
        self._installed = False

    def _hook(self, *, key: Any, repr: str, fn: Any, compile: dict[str, Any], is_manual_warmup: bool,
              already_compiled: bool) -> bool | None:
        if self._active:
            self._record(fn, compile, is_manual_warmup)
        if self._previous is None:
            return False
        return self._previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                              already_compiled=already_compiled)

    def _record(self, fn: Any, compile: dict[str, Any], warmup: bool) -> None:
        names = list(fn.jit_function.arg_names)
        constants = compile.get("constants") or {}
        configs = compile.get("configs") or [{}]
        aligned = tuple(
            _arg_name(names, path) for path, attrs in configs[0].items()
            if any(attr and attr[0] == "tt.divisibility" for attr in attrs)
        )
        signature = compile.get("signature") or {}
        event = CompileEvent(
            kernel=fn.name,
            module=getattr(fn.module, "__name__", str(fn.module)),
            constexprs=tuple((_arg_name(names, path), value) for path, value in constants.items()),
            signature=tuple((str(name), str(ty)) for name, ty in signature.items()),
            aligned=aligned,
            num_warps=int(compile.get("num_warps", 0)),
            num_stages=int(compile.get("num_stages", 0)),
            warmup=bool(warmup),
        )
        with self._lock:
            self.events.append(event)


# --------------------------------------------------------------------------- the model's launches


@dataclass(frozen=True)
class VariantModel:
    """The model widths the general step's kernels are launched with (`from_config`)."""

    hidden_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    num_heads: int
    head_dim: int
    rope_dim: int
    sliding_window: int
    has_sliding: bool  # sliding-only layers exist
    csa_rate: int  # 0: no CSA layer
    hca_rate: int  # 0: no HCA layer
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    fp8_linears: bool = True  # attention / indexer / shared-expert linears packed (`Fp8Linear`)
    mxfp4_experts: bool = True  # routed experts packed (`PackedExperts`)
    # Release numerics: the shared expert's SwiGLU fuses the FP8 round trip, and the keys take FP8 KV
    # numerics (their rotation writes a tensor that a store launch encodes, not the SWA rows).
    act_fp8: bool = False
    scoring: str = "sqrtsoftplus"  # the routers' scoring function
    router_kinds: tuple[bool, ...] = (False,)  # hash-routed (True) and score-routed (False) layers present

    @staticmethod
    def from_config(
        cfg: Any, *, fp8_linears: bool = True, mxfp4_experts: bool = True, act_fp8: bool = False
    ) -> VariantModel:
        """From an `antumbra.config.ModelConfig` (read by attribute: the kernels import no model code)."""
        kinds = set(cfg.layer_types)
        rates = cfg.compress_rates
        csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"  # antumbra.config's names
        return VariantModel(
            hidden_size=cfg.hidden_size, hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
            num_heads=cfg.num_heads, head_dim=cfg.head_dim, rope_dim=cfg.rope_dim,
            sliding_window=cfg.sliding_window, has_sliding="sliding_attention" in kinds,
            csa_rate=rates.get(csa, 0) if csa in kinds else 0,
            hca_rate=rates.get(hca, 0) if hca in kinds else 0,
            index_topk=cfg.index_topk, index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
            q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
            num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size, fp8_linears=fp8_linears,
            mxfp4_experts=mxfp4_experts, act_fp8=act_fp8, scoring=cfg.scoring_func,
            router_kinds=tuple(sorted({kind == "hash_moe" for kind in cfg.mlp_layer_types})),
        )

    def linears(self) -> list[tuple[int, int]]:
        """(N, K) of each FP8 linear a layer runs (`fp8_linear.FP8_LINEARS`)."""
        shapes = [
            (self.q_lora_rank, self.hidden_size),  # q_a
            (self.num_heads * self.head_dim, self.q_lora_rank),  # q_b
            (self.head_dim, self.hidden_size),  # kv
            (self.hidden_size, self.o_groups * self.o_lora_rank),  # o_b
            (self.moe_intermediate_size, self.hidden_size),  # shared gate, up
            (self.hidden_size, self.moe_intermediate_size),  # shared down
        ]
        if self.csa_rate:
            shapes.append((self.index_n_heads * self.index_head_dim, self.q_lora_rank))  # indexer q_b
        return shapes

    def compressors(self) -> list[tuple[int, int, int]]:
        """(head width, rate, overlap) of each window compressor kind."""
        kinds = []
        if self.csa_rate:
            kinds += [(self.head_dim, self.csa_rate, 2), (self.index_head_dim, self.csa_rate, 2)]
        if self.hca_rate:
            kinds.append((self.head_dim, self.hca_rate, 1))
        return kinds

    def attention_extras(self, context_len: int) -> list[int]:
        """Compressed keys per query (K) of each attention layer kind at context L: the indexer's
        picks of the C_4 entries (CSA), all C_128 entries (HCA), none (sliding)."""
        extras = [0] if self.has_sliding else []
        if self.csa_rate:
            extras.append(min(self.index_topk, context_len // self.csa_rate))
        if self.hca_rate:
            extras.append(context_len // self.hca_rate)
        return extras


def _key(kernel: str, consts: dict[str, Any]) -> Key:
    return kernel, frozenset(consts.items())


def step_keys(
    model: VariantModel, num_tokens: int, context_len: int, num_sms: int, *, on_gpu: bool = True,
    warm: bool = False,
) -> dict[str, frozenset[Key]]:
    """Variant keys (kernel, constexprs) a general step of T tokens and largest context L launches,
    by kernel family, on a device of `num_sms` multiprocessors (`on_gpu=False`: the CPU interpreter's
    plans). Dtype-dependent constexprs (DT, DOT_F32, PRECISION, ASM, PACKED) are left out: they are
    fixed per engine.

    The compressors launch only when a window closes. `warm=False` counts them whenever one may
    (L >= rate): what a request of these sizes can reach. `warm=True` only when the step realised as
    `warmup_shapes` says (every sequence's chunk ends at position L - 1) closes one."""
    import torch

    from antumbra.kernels.compressor import state as compressor_state
    from antumbra.kernels.compressor import triton as compressor
    from antumbra.kernels.fp8_linear import dequant as fp8_dequant
    from antumbra.kernels.fp8_linear import triton as fp8
    from antumbra.kernels.gemv import triton as gemv
    from antumbra.kernels.hybrid_attention import triton as attention
    from antumbra.kernels.indexer_topk import triton as topk
    from antumbra.kernels.mhc import triton as mhc
    from antumbra.kernels.moe_mxfp4 import slots as moe_slots
    from antumbra.kernels.moe_mxfp4 import triton as moe
    from antumbra.kernels.moe_router import triton as router
    from antumbra.kernels.rms_norm import triton as norm
    from antumbra.kernels.rope import angles
    from antumbra.kernels.rope import triton as rope
    from antumbra.kernels.swiglu import triton as swiglu

    t, length = num_tokens, context_len
    keys: dict[str, set[Key]] = {}
    n, d = model.hc_mult, model.hidden_size
    mix, finish = mhc.pre_constexprs(t, n, d, model.hc_sinkhorn_iters, 64 if on_gpu else 32, num_sms)
    keys["mhc"] = {
        _key("_mix_partial_kernel", mix), _key("_pre_finish_kernel", finish),
        _key("_post_kernel", mhc.post_constexprs(t, n, d, num_sms)),
    }
    if on_gpu:  # RMSNorm and the shared expert's SwiGLU run their kernels on CUDA tensors only
        widths = (model.hidden_size, model.q_lora_rank, model.head_dim)
        keys["rms_norm"] = {_key("_rms_norm_kernel", norm.rms_norm_constexprs(w)) for w in widths}
        shared = swiglu.swiglu_constexprs(model.moe_intermediate_size, model.act_fp8)
        keys["swiglu"] = {_key("_swiglu_kernel", shared)}
        if model.scoring in router.SCORINGS:
            keys["moe_router"] = {
                _key("_route_kernel", router.route_constexprs(model.num_experts, model.top_k, model.scoring,
                                                              hashed, replay=False))
                for hashed in model.router_kinds
            }
        keys["rope_angles"] = {_key("_cos_sin_kernel", angles.cos_sin_constexprs(model.rope_dim // 2))}
        if t <= gemv.GEMV_MAX_TOKENS:  # the small bf16 projections take the GEMV (`takes_gemv`)
            keys["gemv"] = {_key("_gemv_rows_kernel", gemv.gemv_constexprs(gemv.GEMV_CONFIG, has_rows))
                            for has_rows in (True, False)}
        else:
            keys["compressor_state"] = {_key("_write_state_kernel", compressor_state.write_state_constexprs(
                width * overlap)) for width, _, overlap in model.compressors()}
    if model.fp8_linears:
        dot_dtype = tl.bfloat16 if on_gpu else tl.float32
        fp8_keys = set()
        for rows, k in model.linears():
            if on_gpu and fp8.uses_dense(t, torch.bfloat16, "cuda"):  # dequantise, then cuBLAS
                dense = fp8_dequant.dequant_constexprs(fp8_dequant.DEQUANT_CONFIG)
                fp8_keys.add(_key("_dequant_fp8_kernel", dense))
                continue
            config, _ = fp8.plan(t, rows, k, num_sms)
            kernel = "_gemv_kernel" if config.block_t == 1 else "_dot_kernel"
            fp8_keys.add(_key(kernel, fp8.launch_constexprs(config, dot_dtype)))
        keys["fp8_linear"] = fp8_keys
    if model.mxfp4_experts:
        tiles = moe.tiles_for(t, model.top_k, model.num_experts)
        inter = model.moe_intermediate_size
        down = moe.down_constexprs(tiles, d, inter, model.top_k)
        keys["moe"] = {
            _key("_moe_up_kernel", moe.up_constexprs(tiles, d, inter, model.top_k)),
            _key("_moe_down_kernel", down),
        }
        if not down["SUM_SLOTS"]:
            keys["moe"].add(_key("_sum_slots_kernel", moe_slots.sum_slots_constexprs(model.top_k)))
    comp_keys = set()
    for width, rate, overlap in model.compressors():
        closes = _closes(t, length, rate) if warm else length >= rate
        if closes:
            split = compressor.plan_split(compressor.step_events(t, rate), width, num_sms if on_gpu else 0)
            comp_keys.add(_key("_compress_kernel", compressor.compress_constexprs(
                width, rate, overlap, model.rope_dim, split)))
    keys["compressor"] = comp_keys
    topk_keys = set()
    if model.csa_rate and length // model.csa_rate > 0:
        entries = length // model.csa_rate
        score = topk.score_constexprs(model.index_n_heads, model.index_head_dim)
        topk_keys.add(_key("_indexer_score_kernel", score))
        picks = min(model.index_topk, entries)
        topk_keys.add(_key("_topk_filter_kernel", topk.filter_constexprs(entries, picks)))
    keys["indexer_topk"] = topk_keys
    attn_keys = set()
    for extra in model.attention_extras(length):
        splits, _ = attention.split_plan(t, model.sliding_window, extra, model.head_dim, num_sms)
        split_consts, combine = attention.launch_constexprs(model.num_heads, model.head_dim, extra, splits)
        attn_keys.add(_key("_hybrid_split_kernel", split_consts))
        if combine is not None:
            attn_keys.add(_key("_hybrid_combine_kernel", combine))
    keys["attention"] = attn_keys
    h, hd, half = model.num_heads, model.head_dim, model.rope_dim // 2
    keys["rope"] = {  # q (per-head norm fused), kv (weighted norm; into its SWA rows), the output's inverse
        _key("_rope_kernel", rope.rope_constexprs(h, hd, half, False, True, False)),
        _key("_rope_kernel", rope.rope_constexprs(1, hd, half, False, True, True, scatter=not model.act_fp8)),
        _key("_rope_kernel", rope.rope_constexprs(h, hd, half, True, False, False)),
    }
    return {family: frozenset(v) for family, v in keys.items()}


def _closes(num_tokens: int, context_len: int, rate: int) -> bool:
    """Does a chunk of min(T, L) tokens ending at position L - 1 close a window of `rate`?"""
    first = context_len - min(num_tokens, context_len)
    return context_len // rate > first // rate


# --------------------------------------------------------------------------- warm-up shapes


def _grid(limit: int) -> list[int]:
    """Powers of two below `limit`, then `limit`."""
    values, v = [], 1
    while v < limit:
        values.append(v)
        v *= 2
    return values + [limit]


def warmup_shapes(
    max_num_batched_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
    *,
    model: VariantModel | None = None,
    num_sms: int | None = None,
) -> list[tuple[int, int]]:
    """-> (num_tokens, context_len) of general steps whose runs reach every kernel variant a step
    within these limits can reach, ordered by context, then tokens.

    Realise a shape (T, L) as ceil(T / L) sequences whose chunks (L tokens each, the last one the
    rest) all end at position L - 1: then L is the largest context, and every rate dividing L
    closes a window. Shapes with T > L are decode batches (T sequences of one token when L = 1);
    a step never holds more than max_num_seqs sequences, so T <= max_num_seqs * L.

    The shapes are the union of, with T over the powers of two up to max_num_batched_tokens (and
    it) and L likewise up to max_model_len:
      * (T, L_p) for every T, L_p the largest power of two <= max_model_len (the T-families, with
        every compressor's windows closing);
      * (1, L) and (the largest feasible T, L) for every L (the top-k filter's buckets, and both
        sides of attention's one-split threshold at every context).
    The T-families key on T_b and the filter on next_power_of_2(C_4), so one T per bucket and one L
    per bucket suffice; attention's booleans are monotone in T at a fixed L, so the two ends of
    each L cover them. Given the `model` and `num_sms`, the list is replaced by a few shapes (of
    all those on the two grids) that still reach every key of the full list.
    """
    limit_t, limit_l, seqs = max_num_batched_tokens, max_model_len, max_num_seqs
    assert limit_t >= 1 and limit_l >= 1 and seqs >= 1
    pow_l = 1 << (limit_l.bit_length() - 1)
    shapes: set[tuple[int, int]] = set()
    for t in _grid(limit_t):
        if t <= seqs * pow_l:
            shapes.add((t, pow_l))
        elif t <= seqs * limit_l:
            shapes.add((t, limit_l))
    for length in _grid(limit_l):
        shapes.add((1, length))
        shapes.add((min(limit_t, seqs * length), length))
    if model is not None:
        assert num_sms is not None, "pruning for a model needs the device's multiprocessor count"
        feasible = {
            (t, length) for t in _grid(limit_t) for length in _grid(limit_l) if t <= seqs * length
        }
        shapes = _cover(shapes | feasible, warm_keys(sorted(shapes), model, num_sms), model, num_sms)
    return sorted(shapes, key=lambda s: (s[1], s[0]))


def warm_keys(
    shapes: list[tuple[int, int]], model: VariantModel, num_sms: int, *, on_gpu: bool = True
) -> set[Key]:
    """Every key the warm-up steps `shapes` launch."""
    keys: set[Key] = set()
    for t, length in shapes:
        for family in step_keys(model, t, length, num_sms, on_gpu=on_gpu, warm=True).values():
            keys |= family
    return keys


def _cover(
    candidates: set[tuple[int, int]], wanted: set[Key], model: VariantModel, num_sms: int
) -> set[tuple[int, int]]:
    """Greedy set cover of `wanted` by candidate shapes: each round the shape reaching the most keys
    not reached yet (every step pays for reading the weights, so fewer steps first), the cheaper
    (tokens times context) on ties."""
    reach = {shape: warm_keys([shape], model, num_sms) & wanted for shape in candidates}
    kept: set[tuple[int, int]] = set()
    missing = set(wanted)
    while missing:
        shape = max(reach, key=lambda s: (len(reach[s] & missing), -s[0] * s[1], -s[0]))
        kept.add(shape)
        missing -= reach.pop(shape)
    return kept


# --------------------------------------------------------------------------- launch recording

KERNEL_MODULES = (
    "antumbra.kernels.compressor.state",
    "antumbra.kernels.compressor.triton",
    "antumbra.kernels.decode_index.triton",
    "antumbra.kernels.fp8_linear.dequant",
    "antumbra.kernels.fp8_linear.triton",
    "antumbra.kernels.gemv.triton",
    "antumbra.kernels.hybrid_attention.triton",
    "antumbra.kernels.indexer_topk.triton",
    "antumbra.kernels.mhc.triton",
    "antumbra.kernels.moe_mxfp4.slots",
    "antumbra.kernels.moe_mxfp4.triton",
    "antumbra.kernels.moe_router.triton",
    "antumbra.kernels.rms_norm.triton",
    "antumbra.kernels.rope.angles",
    "antumbra.kernels.rope.triton",
    "antumbra.kernels.swiglu.triton",
)


@dataclass(frozen=True)
class Launch:
    kernel: str
    constexprs: frozenset[tuple[str, Any]]  # the kernel parameters passed by keyword: its constexprs


def triton_kernels() -> list[tuple[str, Any]]:
    """(name, function) of every @triton.jit function of `KERNEL_MODULES`: the launched kernels
    and the helpers they inline."""
    import importlib

    found = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if hasattr(value, "pre_run_hooks") and hasattr(value, "arg_names"):
                found.append((attr, value))
    return found


class launch_recorder:  # noqa: N801 - used as a context manager, like a function
    """Records every launch of the antumbra kernels while active, with the constexprs it passed
    (on the GPU and in the interpreter alike, through each kernel's pre-run hooks).

        with launch_recorder() as rec:
            model(batch, pools)
        {launch.kernel for launch in rec.launches}
    """

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self._hooks: list[tuple[Any, Any]] = []

    def __enter__(self) -> launch_recorder:
        for name, kernel in triton_kernels():
            params = set(kernel.arg_names)

            def hook(*args: Any, _name: str = name, _params: set[str] = params, **kwargs: Any) -> None:
                consts = frozenset((k, v) for k, v in kwargs.items() if k in _params)
                self.launches.append(Launch(_name, consts))

            kernel.add_pre_run_hook(hook)
            self._hooks.append((kernel, hook))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for kernel, hook in self._hooks:
            kernel.pre_run_hooks.remove(hook)
        self._hooks.clear()
