"""Distil a checkpoint's MTP draft block on the target's own greedy continuations.

A draft block with random weights predicts nothing the target would say. This trains it (its own
parameters only: the target, whose embedding and LM head the block shares, stays frozen) to predict
what the target itself decodes greedily:

1. a live engine continues random prompts greedily (the target's own text);
2. the target's plain forward over each whole sequence gives its last-layer streams h_i;
3. the block reads (h_i, token i+1) at every position and is trained with cross-entropy on token
   i+2 wherever that token is one the target generated. A second, chained pass feeds the block's own
   output streams at i as the state for position i+1 (with token i+2, predicting token i+3), the
   way drafting chains it for k > 1, and adds its loss.

The trained block is written back into the checkpoint directory in the release's names and formats
(`mtp_loading.write_mtp`), where `load_mtp` reads it, with a token map beside it: the most frequent
tokens of the target's continuations (`draft_vocab.json`, for `speculative_token_map`).
`python -m antumbra.rl.mtp_distill --model DIR`.

The release stores the block's linears in FP8, its experts in MXFP4 and most of the rest in bfloat16,
so the block served is the trained one rounded, and a block fitted closely to the target's text can
lose much of what it learned in that rounding. So by default (`DistillConfig.serve_formats`) the block
trains as it is served: the optimizer steps float32 master weights, the forward runs the masters read
back through the release's formats (`mtp_names.read_back_`), and the gradient taken there steps the
masters (straight through the rounding). The block written back then serves with exactly the weights
its last step ran. The result reports the loss of the masters and of the block read back from the
checkpoint, over every sequence, so what the rounding costs is measured whichever way it trained.

Device and dtype (`DistillConfig`): by default everything runs on the CPU in float32. In another dtype
(bfloat16, the checkpoint's serving dtype, on CUDA) the engine writing the greedy text, the target's
forward and the block's own forward and backward all run in that dtype, which is how the drafter runs
the block and how it shares the target's embedding and head; the optimizer steps float32 master
copies of the block's parameters, because an Adam update is often below bfloat16's resolution at the
weight's magnitude (8 bits of mantissa) and would be rounded away, then copies them back. The block
written back is the float32 masters.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from antumbra.config import CSA, HCA, SLIDING, FastPathConfig
from antumbra.replicas.engine import Engine
from antumbra.replicas.model.model import DeepseekV4
from antumbra.replicas.model.mtp import MTPBlock, MTPWindowCache
from antumbra.replicas.model.mtp_names import read_back_
from antumbra.replicas.model.tiny import TinyModelSpec
from antumbra.replicas.plan import resolve_dtype
from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.speculative.draft_vocab import TOKEN_MAP_FILE, write_token_map
from antumbra.replicas.speculative.mtp_loading import load_mtp, write_mtp
from antumbra.replicas.speculative.plain_forward import plain_forward

log = logging.getLogger(__name__)

# A tiny target small enough to distil against in seconds on a CPU: a short window and few used token
# ids make its greedy text depend on little context, which a draft block can learn from a few
# thousand positions (a wide random target's text needs far more).
DISTILL_SPEC = TinyModelSpec(
    vocab_size=512, used_vocab_size=64, hidden_size=32, num_heads=2, head_dim=32, q_lora_rank=16,
    o_lora_rank=8, layer_types=(SLIDING, CSA), compress_rates={CSA: 4, HCA: 8}, sliding_window=8,
    n_routed_experts=4, moe_intermediate_size=32,
)


@dataclass(frozen=True)
class DistillConfig:
    num_prompts: int = 64
    prompt_tokens: int = 16
    continuation_tokens: int = 40
    steps: int = 300
    batch_size: int = 8
    learning_rate: float = 3e-3
    chained_weight: float = 0.5  # weight of the chained pass's loss
    seed: int = 0
    # Prompt tokens are drawn from ids [low, high); None: [2, the vocabulary's first quarter).
    token_range: tuple[int, int] | None = None
    # Where the engine, the target's forward and the training run, and their dtype (see the module's
    # docstring); the block's optimizer state is float32 whatever the dtype.
    device: str = "cpu"
    dtype: str = "float32"
    # Train through the release's rounding of the block's weights (module docstring); False: train the
    # unrounded weights, which the checkpoint then rounds.
    serve_formats: bool = True
    # The most token ids the token map written beside the block holds (`draft_vocab.write_token_map`).
    token_map_size: int = 32768


@dataclass(frozen=True)
class DistillResult:
    first_loss: float  # mean loss of the first 10 steps
    last_loss: float  # mean loss of the last 10 steps
    written: Path
    seconds: float = 0.0  # the whole distillation: greedy text, the target's forward, training, writing
    # Seconds of each part: "text" (engine start and greedy text), "forward" (the target's streams),
    # "train", "write".
    phases: dict[str, float] = field(default_factory=dict)
    # Mean loss over every sequence after training: of the block as its last step ran it, of the float32
    # masters (in the training dtype, unrounded by the release's formats), and of the block as written
    # (read back from the checkpoint). With `serve_formats` the first and the last are one block's.
    trained_loss: float = float("nan")
    master_loss: float = float("nan")
    written_loss: float = float("nan")
    token_map: Path | None = None  # the token map written beside the block


def random_prompts(count: int, length: int, token_range: tuple[int, int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    low, high = token_range
    return torch.randint(low, high, (count, length), generator=gen).tolist()


def greedy_sequences(engine: Engine, prompts: list[list[int]], length: int) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation of `length` tokens."""
    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    return [list(p) + list(o.token_ids) for p, o in zip(prompts, outs, strict=True)]


def distill_loss(model: DeepseekV4, block: MTPBlock, ids: torch.Tensor, hidden: torch.Tensor,
                 first_target: int, chained_weight: float, offset: int = 0) -> torch.Tensor:
    """ids [B, S] int64 sequences, hidden [B, S, n, D] the target's streams at every position; tokens
    from column `first_target` on are the ones to predict -> the mean cross-entropy (a scalar). Column 0
    is position `offset` of the sequences (a cropped sequence: `crop_start`)."""
    b, s = ids.shape
    cache = MTPWindowCache(model.config, b, s, hidden.dtype, hidden.device)
    out = block(model, hidden[:, : s - 2], ids[:, 1 : s - 1], [offset] * b, cache)  # predicts ids[:, 2:]
    loss = _masked_ce(out.logits, ids[:, 2:], first_target - 2)
    if chained_weight:
        chained_cache = MTPWindowCache(model.config, b, s, hidden.dtype, hidden.device)
        # Position i + 1 reads the block's own streams at i and token i + 2, predicting token i + 3.
        again = block(model, out.streams[:, : s - 3], ids[:, 2 : s - 1], [offset + 1] * b, chained_cache)
        loss = loss + chained_weight * _masked_ce(again.logits, ids[:, 3:], first_target - 3)
    return loss


def crop_start(first_target: int, window: int) -> int:
    """The first position a sequence whose targets start at `first_target` must keep for the same loss:
    the chained pass's first target reads the block's window of its own streams, each of which read the
    block's window of the target's (two windows back), and the passes start 1 and 0 columns in."""
    return max(0, first_target - 2 * window - 4)


def _masked_ce(logits: torch.Tensor, labels: torch.Tensor, first: int) -> torch.Tensor:
    """Cross-entropy over columns >= first. logits [B, S, V], labels [B, S]."""
    first = max(first, 0)
    return F.cross_entropy(logits[:, first:].reshape(-1, logits.shape[-1]), labels[:, first:].reshape(-1))


def distill(path: str | Path, config: DistillConfig = DistillConfig(),
            prompts: list[list[int]] | None = None,
            continuations: list[list[int]] | None = None) -> DistillResult:
    """Train MTP block 0 of the checkpoint at `path` on `config.device` in `config.dtype` and write it
    back there. `prompts` (all of one length): continue these instead of `config`'s random prompts;
    the block then trains over each sequence's continuation and the two windows before it only
    (`crop_start`), so long prompts cost no more than their last positions. `continuations` (with
    `prompts`, one each, all of one length): train on these instead of the greedy text this function's
    own engine writes, e.g. what the serving engine wrote. Where the target's logits are near ties (a
    random-weight target), another batch size or numerics mode rounds its greedy text otherwise, and a
    block that learnt one text drafts little of the other."""
    if continuations is not None and (prompts is None or len(continuations) != len(prompts)
                                      or len({len(c) for c in continuations}) != 1):
        raise ValueError("continuations need prompts, one continuation each, all of one length")
    started = time.monotonic()
    path = Path(path)
    dtype = resolve_dtype(config.dtype)
    # One batch of greedy runs: the decode graphs of the batch sizes it meets, captured as it meets them.
    engine = Engine.from_pretrained(path, device=config.device, dtype=config.dtype, warmup="off",
                                    fast=FastPathConfig(capture_at_start=False))
    try:
        model: DeepseekV4 = engine.model
        vocab = model.config.vocab_size
        span = config.token_range or (2, max(3, vocab // 4))
        offset, first_target = 0, config.prompt_tokens
        if prompts is None:
            prompts = random_prompts(config.num_prompts, config.prompt_tokens, span, config.seed)
        else:
            if len({len(p) for p in prompts}) != 1:
                raise ValueError("the prompts to distil on must share one length")
            offset = crop_start(len(prompts[0]), model.config.sliding_window)
            first_target = len(prompts[0]) - offset
        greedy_full = ([list(p) + list(c) for p, c in zip(prompts, continuations, strict=True)]
                       if continuations is not None
                       else greedy_sequences(engine, prompts, config.continuation_tokens))
        continuations = [seq[len(p):] for seq, p in zip(greedy_full, prompts, strict=True)]
        sequences = [seq[offset:] for seq in greedy_full]
        phases = {"text": time.monotonic() - started}
        # [N, S, n, D], S the kept positions of each sequence
        hidden = torch.stack([plain_forward(model, seq).streams[offset:] for seq in greedy_full])
        phases["forward"] = _sync_seconds(config.device, started, phases)
    finally:
        engine.shutdown()
    del engine  # its pools: the training needs the memory
    gc.collect()
    if torch.device(config.device).type == "cuda":
        torch.cuda.empty_cache()
    ids = torch.tensor(sequences, device=hidden.device)  # [N, S] int64
    block = load_mtp(path, dtype=dtype, device=config.device)
    block.train()
    model.requires_grad_(False)
    params = dict(block.named_parameters())
    # Invariant: masters[name] is the float32 weight the optimizer steps; params[name] holds what the
    # block serves with: the master read back through the release's formats (`serve_formats`), in the
    # parameter's dtype. `_serve` restores it after every step.
    masters = {name: p.detach().float().clone() for name, p in params.items()}
    _serve(params, masters, config.serve_formats)
    optimizer = torch.optim.Adam(list(masters.values()), lr=config.learning_rate)
    gen = torch.Generator().manual_seed(config.seed)
    precision = torch.get_float32_matmul_precision()
    if torch.device(config.device).type == "cuda":
        # The head's float32 product (`DeepseekV4.logits` under autograd: [positions, D] x [D, vocab],
        # forward and backward) is most of a step's work; TF32 tensor cores take it several times faster,
        # and a training loss needs no more than TF32's 10-bit mantissa.
        torch.set_float32_matmul_precision("high")
    try:
        data = _Sequences(ids, hidden, first_target, offset, config.chained_weight)
        losses = _train(model, block, params, masters, optimizer, data, gen, config)
    finally:
        torch.set_float32_matmul_precision(precision)
    phases["train"] = _sync_seconds(config.device, started, phases)
    trained_loss = _mean_loss(model, block.eval(), data, config.batch_size)
    _serve(params, masters, read_back=False)
    master_loss = _mean_loss(model, block, data, config.batch_size)
    with torch.no_grad():
        for name, p in params.items():
            p.data = masters[name]  # the block written back holds the float32 masters
    written = write_mtp(path, [block])
    token_map = write_token_map(path / TOKEN_MAP_FILE, continuations, config.token_map_size)
    phases["write"] = _sync_seconds(config.device, started, phases)
    as_written = load_mtp(path, dtype=dtype, device=config.device)
    written_loss = _mean_loss(model, as_written, data, config.batch_size)
    log.info("loss over every sequence: as trained %.4f, masters %.4f, as written %.4f", trained_loss,
             master_loss, written_loss)
    head, tail = losses[:10], losses[-10:]
    return DistillResult(sum(head) / len(head), sum(tail) / len(tail), written, time.monotonic() - started,
                         phases, trained_loss, master_loss, written_loss, token_map)


def _serve(params: dict[str, torch.nn.Parameter], masters: dict[str, torch.Tensor], read_back: bool) -> None:
    """Set each parameter to its master, read back through the release's formats if `read_back`."""
    with torch.no_grad():
        values = masters
        if read_back:
            values = {name: m.clone() for name, m in masters.items()}
            read_back_(values)
        for name, p in params.items():
            p.copy_(values[name])


def _mean_loss(model: DeepseekV4, block: MTPBlock, data: _Sequences, batch_size: int) -> float:
    """`distill_loss` (chained pass weighted as trained) over every sequence of `data`, in batches."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(data.ids), batch_size):
            rows = slice(start, start + batch_size)
            n = len(data.ids[rows])
            loss = distill_loss(model, block, data.ids[rows], data.hidden[rows], data.first_target,
                                data.chained_weight, data.offset)
            total, count = total + loss.item() * n, count + n
    return total / count


def _sync_seconds(device: str, started: float, phases: dict[str, float]) -> float:
    """Seconds since `started` not yet in `phases`, the device drained first."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic() - started - sum(phases.values())


@dataclass(frozen=True)
class _Sequences:
    ids: torch.Tensor  # [N, S] int64: each sequence from position `offset`
    hidden: torch.Tensor  # [N, S, n, D] the target's streams there
    first_target: int  # the first column whose token the target generated
    offset: int
    chained_weight: float


def _train(model: DeepseekV4, block: MTPBlock, params: dict[str, torch.nn.Parameter],
           masters: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, data: _Sequences,
           gen: torch.Generator, config: DistillConfig) -> list[float]:
    """`config.steps` optimizer steps on random batches of the sequences -> each step's loss. The
    gradient at the served parameters steps their masters (module docstring)."""
    losses = []
    for step in range(config.steps):
        rows = torch.randperm(len(data.ids), generator=gen)[: config.batch_size].to(data.ids.device)
        loss = distill_loss(model, block, data.ids[rows], data.hidden[rows], data.first_target,
                            config.chained_weight, data.offset)
        optimizer.zero_grad()
        for p in params.values():
            p.grad = None
        loss.backward()
        for name, p in params.items():
            masters[name].grad = None if p.grad is None else p.grad.float()
        optimizer.step()
        _serve(params, masters, config.serve_formats)
        losses.append(loss.item())
        if step % 50 == 0:
            log.info("step %d: loss %.4f", step, losses[-1])
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (its MTP block is replaced)")
    parser.add_argument("--steps", type=int, default=DistillConfig.steps)
    parser.add_argument("--prompts", type=int, default=DistillConfig.num_prompts)
    parser.add_argument("--continuation", type=int, default=DistillConfig.continuation_tokens)
    parser.add_argument("--device", default=DistillConfig.device)
    parser.add_argument("--dtype", default=DistillConfig.dtype,
                        help="float32, or the serving dtype (bfloat16)")
    parser.add_argument("--train-unrounded", action="store_true",
                        help="train the block's weights unrounded (writing the checkpoint rounds them)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = distill(args.model, DistillConfig(steps=args.steps, num_prompts=args.prompts,
                                               continuation_tokens=args.continuation, device=args.device,
                                               dtype=args.dtype, serve_formats=not args.train_unrounded))
    print(f"loss {result.first_loss:.4f} -> {result.last_loss:.4f} in {result.seconds:.1f} s; over every "
          f"sequence, masters {result.master_loss:.4f}, as written {result.written_loss:.4f}; "
          f"wrote {result.written}")


if __name__ == "__main__":
    main()
