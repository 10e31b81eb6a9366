"""What the defaults' reduction step costs in a CPU forward, against the compute it saves.

Four settings of one model, timed in turns in one process (interleaved, rotating order,
median; see ``vitprune bench``), each as a speedup over the unpruned model and as a share
of its ideal speedup (the ratio of analytic FLOPs):

- ``unpruned``;
- ``defaults``: ``vitprune.patch(model, keep_rate=K, class_only_last=False)``: the defaults'
  reduction with every token through the last block (as the JSON in docs/bench measured
  them; on a class-token model ``patch`` now also computes the class token alone there,
  the ``--class-only`` rows);
- ``defaults, free step``: the same patch with its matching and merging replaced by a slice
  to the same token counts (the rest of the patch, size-aware attention included, runs as
  before): what the defaults would read if their reduction step cost nothing. The gap
  between the two rows is the step's cost; the gap between this row and 100 % is what the
  smaller matrix products themselves give up;
- ``paper (var)``: the paper's three stages with one fusion token;
- ``defaults' method, every S blocks`` (``--every``, default 2 and 3): the defaults' matching
  and merging in every S-th block only (``every_stages``: ``S - 1, 2 S - 1, ...`` where S
  divides the depth), its keep rate fitted to the defaults' FLOPs (``fit_keep_rate``): the
  same cost in fewer, larger steps, so fewer per-step operations. Its accuracy is not the
  defaults': on our six-block models every second block is three stages, the 'bipartite,
  merge, 3 stages' row of docs/merging.md.
- ``defaults with crowding W`` (``--crowding W ...``, none by default): the defaults with
  crowding in their matching (docs/method.md §4): the same tokens and FLOPs, a few more
  elementwise operations per step.
- ``defaults without size-aware attention`` (``--no-size-bias``): the same tokens and merge
  with no ``+log s`` on the attention logits, so the attention runs without an additive
  mask: what the bias costs in time.
- ``--class-only``: the defaults with ``class_only_last`` (the last block computes the class
  token alone): at the same keep rate (fewer FLOPs), and fitted to the defaults' FLOPs
  (``fit_keep_rate``; more tokens kept in the other blocks); and with ``--every`` the
  defaults' method in every S blocks with it too, at the defaults' FLOPs (the last block
  is then no stage).
- ``--spread spread2 spread3``: ``patch(model, keep_rate=K, stages="spread2")`` (and
  ``"spread3"``) as they run: the same blocks as ``--every 2 3 --class-only`` on 12 blocks,
  their keep rate matched by tokens to the defaults as they run, not fitted by FLOPs.

    python examples/step_cost.py --batch 1 --rounds 31 --json docs/bench/cpu_deit_small_step_cost_b1.json

``--dtype bf16`` runs every setting with bfloat16 weights and images (no autocast), the fast
path of CPUs with bfloat16 matrix units (AMX), where the matrix products shrink and the
step's share grows.

Random weights (timing only; the free step's outputs are not meaningful). Run it with
nothing else on the machine: a second busy core moves the ratios by a fifth.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import platform
from typing import Callable, Dict, Iterator

import timm
import torch

import vitprune
import vitprune.core.state as state_module
from vitprune.commands.bench import time_interleaved
from vitprune.core.config import PAPER_OPTIONS, PruneConfig
from vitprune.core.merging import Merged
from vitprune.measure.flops import schedule_flops
from experiments_common import every_stages

#: ``--dtype``: the model's weights and the images.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: The row whose patch reduces with :func:`free_merge`.
FREE = "defaults, free step"


def free_merge(tokens: torch.Tensor, keys: torch.Tensor, sizes: torch.Tensor, k: int, num_prefix: int,
               crowding: float = 0.0) -> Merged:
    """A stand-in for ``merging.bipartite_merge`` that costs two views: the first ``k``
    tokens and sizes. Its index fields are placeholders; nothing in a timed forward reads them."""
    return Merged(tokens[:, :num_prefix + k], sizes[:, :k], sizes, sizes, sizes)


@contextlib.contextmanager
def free_step() -> Iterator[None]:
    """Inside the ``with`` block, patched models reduce with :func:`free_merge`."""
    real = state_module.bipartite_merge
    state_module.bipartite_merge = free_merge
    try:
        yield
    finally:
        state_module.bipartite_merge = real


def every(model: torch.nn.Module, step: int, gflops: float, class_only_last: bool = False) -> PruneConfig:
    """The defaults' method in every ``step``-th block (``every_stages``), with
    the largest keep rate whose analytic FLOPs fit ``gflops``. With ``class_only_last`` the
    last block computes the class token alone, so it is no stage (``(1, 3, 5, 7, 9)`` and
    ``(2, 5, 8)`` on 12 blocks) and its saving goes to the fitted keep rate."""
    stages = every_stages(len(model.blocks), step, class_only_last)
    rate = vitprune.fit_keep_rate(model, gflops, stages=stages, class_only_last=class_only_last)
    return PruneConfig(keep_rate=rate, stages=stages, class_only_last=class_only_last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deit_small_patch16_224")
    parser.add_argument("--keep-rate", type=float, default=0.7)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--every", type=int, nargs="*", default=[2, 3],
                        help="also the defaults' method in every S-th block only, at the defaults' FLOPs")
    parser.add_argument("--crowding", type=float, nargs="*", default=[],
                        help="also the defaults with this crowding weight (patch(crowding=W)): the same tokens")
    parser.add_argument("--no-size-bias", action="store_true",
                        help="also the defaults without size-aware attention (patch(size_aware=False))")
    parser.add_argument("--class-only", action="store_true",
                        help="also the defaults with class_only_last, at their keep rate and at their FLOPs")
    parser.add_argument("--spread", nargs="*", default=[], choices=["spread2", "spread3"],
                        help="also patch(model, keep_rate=K, stages=NAME) as it runs (class token alone in the last block)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="the weights' and images' dtype (bf16: bfloat16 weights, no autocast)")
    parser.add_argument("--json", help="write the table here as JSON")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = timm.create_model(args.model, pretrained=False).eval().to(DTYPES[args.dtype])
    defaults = PruneConfig(keep_rate=args.keep_rate, class_only_last=False)
    paper = PruneConfig(indicator="var", keep_rate=args.keep_rate, **PAPER_OPTIONS)
    models: Dict[str, torch.nn.Module] = {"unpruned": model}
    flops = {"unpruned": schedule_flops(model, None)}

    def add(name: str, config: PruneConfig) -> None:
        """One more timed setting: a patched copy of the model, and its analytic FLOPs."""
        models[name], flops[name] = vitprune.patch(copy.deepcopy(model), config), schedule_flops(model, config)

    for name in ("defaults", FREE):  # the same patch: FREE swaps its step while timed
        add(name, defaults)
    add("paper (var)", paper)
    for step in args.every:
        config = every(model, step, flops["defaults"] / 1e9)
        add(f"defaults' method, every {step} blocks (keep {config.keep_rate:.3f})", config)
    for weight in args.crowding:
        add(f"defaults with crowding {weight:g}", dataclasses.replace(defaults, crowding=weight))
    if args.no_size_bias:
        add("defaults without size-aware attention", dataclasses.replace(defaults, size_aware=False))
    if args.class_only:
        add("defaults, class token alone in the last block", dataclasses.replace(defaults, class_only_last=True))
        rate = vitprune.fit_keep_rate(model, flops["defaults"] / 1e9, class_only_last=True)
        add(f"the same at the defaults' FLOPs (keep {rate:.3f})", PruneConfig(keep_rate=rate, class_only_last=True))
        for step in args.every:
            config = every(model, step, flops["defaults"] / 1e9, class_only_last=True)
            add(f"every {step} blocks, class token alone in the last block (keep {config.keep_rate:.3f})", config)
    for name in args.spread:  # class_only_last stated, as patch settles it here, so resolve gives what runs
        config = PruneConfig(keep_rate=args.keep_rate, stages=name, class_only_last=True)
        rate = config.resolve(len(model.blocks), model.patch_embed.num_patches).keep_rate[0]
        add(f"stages={name!r} (keep {rate:.3f})", config)
    x = torch.randn(args.batch, 3, *model.pretrained_cfg["input_size"][1:], dtype=DTYPES[args.dtype])

    def step(name: str) -> Callable[[], None]:
        context = free_step if name == FREE else contextlib.nullcontext

        def run() -> None:
            with torch.inference_mode(), context():
                models[name](x)
        return run

    seconds: Dict[str, float] = time_interleaved({name: step(name) for name in models}, args.rounds, args.warmup,
                                                 sync=lambda: None)
    rows = []
    print(f"{args.model}, {args.dtype}, batch {args.batch}, keep {args.keep_rate:g}, {args.threads} threads, "
          f"{args.rounds} rounds, torch {torch.__version__}, timm {timm.__version__}")
    width = max(map(len, models))
    print(f"{'setting':<{width}} {'GFLOPs':>7} {'speedup':>8} {'ideal':>6} {'achieved / ideal':>17}")
    for name in models:
        speedup = seconds["unpruned"] / seconds[name]
        ideal = flops["unpruned"] / flops[name]
        rows.append(dict(setting=name, gflops=flops[name] / 1e9, speedup=speedup, ideal=ideal,
                         achieved=speedup / ideal, median_s=seconds[name]))
        share = 100 * speedup / ideal
        print(f"{name:<{width}} {flops[name] / 1e9:>7.2f} {speedup:>7.3f}x {ideal:>5.2f}x {share:>16.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=vars(args), torch=torch.__version__, timm=timm.__version__,
                           machine=platform.processor() or platform.machine(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
