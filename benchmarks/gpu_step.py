"""One GPU, one training step: metadist's strategies next to the torch code they replace.

    python -m benchmarks.gpu_step [--device auto|cpu|cuda] [--shape auto|full|tiny]
                                  [--steps 20] [--warmup 5] [--only LABEL,...]
                                  [--case-timeout S] [--json PATH] [--quick]

At world 1 no collective moves data, so every difference is what a strategy's code adds to
the step (hooks, casts, copies, host syncs), which is what a fast GPU exposes. The *full*
shape is the issue's table: a 217M-parameter decoder (12 ``nn.TransformerEncoderLayer``
blocks, d_model 1024, 16 heads, ff 4096, causal mask, vocab 32000 embedding and an untied
LM head), batch 8 x 1024 tokens, AdamW; then second-order MAML on the MLP 64-1024-1024-1,
16 tasks x 5 inner steps (benchmarks/maml_overhead.py's GPU size), Adam. Every case runs in
its own process (a fresh CUDA allocator and caches: the peak is that case's alone), from the
same seeded weights and data; ``--warmup`` steps are discarded and each timed step is
bracketed by ``torch.cuda.synchronize`` (median ms/step). Peak MiB is
``torch.cuda.max_memory_allocated`` of the process; the loss is the one of the last step.
Each metadist row's time is also given over the torch row it replaces; the issue's targets
(<= 1.02) are metadist ddp 16-mixed over torch DDP + GradScaler and MAML ddp and zero3 over
plain torch, whose losses and final parameters must also agree. metadist joins no process
group at world 1 (nothing to communicate); torch's DDP and FSDP2 need one, so their cases
make a one-rank group (NCCL on cuda). ``--shape auto`` is *full* on cuda and *tiny* on the
CPU, where only the pipeline is checked (the figures mean nothing; memory is not measured).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

import metadist
from benchmarks import device
from benchmarks.common import Results, output_args, parse, timed
from benchmarks.maml_overhead import GPU_SIZES, SIZES, mlp, tasks
from benchmarks.meta import INNER_STEPS, maml_loss  # the meta benchmark's MAML step

Block = nn.TransformerEncoderLayer
LR_LM, LR_MAML = 1e-4, 1e-3  # AdamW for the decoder; Adam, maml_overhead's, for MAML
TARGET = 1.02  # the bound on ours / theirs


@dataclass(frozen=True)
class Shape:
    """The decoder's size and batch, and the MAML MLP's (inputs, hidden, tasks)."""

    vocab: int
    d: int
    heads: int
    ff: int
    layers: int
    seq: int
    batch: int
    maml: tuple[int, int, int]


SHAPES = {"full": Shape(32000, 1024, 16, 4096, 12, 1024, 8, GPU_SIZES["realistic"]),
          "tiny": Shape(512, 64, 4, 256, 2, 32, 4, SIZES["tiny"])}


@dataclass(frozen=True)
class Case:
    """How one row trains: ``runner`` is torch's own recipe (torch, ddp, fsdp2), metadist's
    strategy ``strategy`` with ``options``, or MAML (maml, maml-metadist)."""

    runner: str
    amp: torch.dtype | None = None  # torch's autocast dtype (float16 adds a GradScaler)
    strategy: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    anchor: str = ""  # the torch row it replaces: the ratio column
    fp16: bool = False  # float16 autocast: skipped where this torch cannot run it


ZERO3_BLOCKS = {"wrap_classes": (Block,), "param_dtype": "bfloat16", "reduce_dtype": "float32"}
FSDP2 = "torch FSDP2 fully_shard per block, bf16 param / fp32 reduce"
CASES: dict[str, Case] = {
    "plain torch, bf16 autocast": Case("torch", torch.bfloat16),
    "metadist single, bf16-mixed": Case("metadist", strategy="single",
                                        options={"precision": "bf16-mixed"},
                                        anchor="plain torch, bf16 autocast"),
    "torch DDP, bf16 autocast": Case("ddp", torch.bfloat16),
    "metadist ddp, bf16-mixed": Case("metadist", strategy="ddp",
                                     options={"precision": "bf16-mixed"},
                                     anchor="torch DDP, bf16 autocast"),
    FSDP2: Case("fsdp2"),
    "metadist zero3 per block, bf16 param / fp32 reduce": Case(
        "metadist", strategy="zero3", options=ZERO3_BLOCKS, anchor=FSDP2),
    "metadist zero2, bf16-mixed": Case("metadist", strategy="zero2",
                                       options={"precision": "bf16-mixed"},
                                       anchor="torch DDP, bf16 autocast"),
    "torch DDP, fp16 autocast + GradScaler": Case("ddp", torch.float16, fp16=True),
    "metadist ddp, 16-mixed": Case("metadist", strategy="ddp", options={"precision": "16-mixed"},
                                   anchor="torch DDP, fp16 autocast + GradScaler", fp16=True),
    "metadist zero3 per block + activation checkpointing, bf16 param / fp32 reduce": Case(
        "metadist", strategy="zero3", options={**ZERO3_BLOCKS, "activation_checkpointing": Block},
        anchor="metadist zero3 per block, bf16 param / fp32 reduce"),
    "MAML: plain torch": Case("maml"),
    "MAML: metadist ddp": Case("maml-metadist", strategy="ddp", anchor="MAML: plain torch"),
    "MAML: metadist zero3": Case("maml-metadist", strategy="zero3", anchor="MAML: plain torch"),
}
FP16_PAIR = ("metadist ddp, 16-mixed", "torch DDP, fp16 autocast + GradScaler")


class Decoder(nn.Module):
    """Embedding, causal ``TransformerEncoderLayer`` blocks, untied head (dropout off, so
    every case computes the same function from the same seeded weights)."""

    mask: Tensor

    def __init__(self, s: Shape) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(s.vocab, s.d)
        self.blocks = nn.ModuleList(Block(s.d, s.heads, s.ff, dropout=0.0, batch_first=True)
                                    for _ in range(s.layers))
        self.head = nn.Linear(s.d, s.vocab)
        # is_causal=True lets attention take SDPA's causal kernel; the mask must still be
        # given (a buffer: moved with the model, never trained or sharded).
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(s.seq),
                             persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        n = tokens.shape[1]
        mask = self.mask[:n, :n]
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        logits: Tensor = self.head(h)
        return logits


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Next-token cross entropy in float32 whatever the logits' dtype (bf16 under the
    param_dtype cases, which run without autocast), so every row computes the same loss."""
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _batches(s: Shape, dev: torch.device) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(4):
        t = torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=g)
        out.append((t[:, :-1].to(dev), t[:, 1:].to(dev)))
    return out


Step = Callable[[], Tensor]  # one optimizer step; returns its loss, detached (no host sync)


@contextlib.contextmanager
def _one_rank_group(dev: torch.device) -> Iterator[None]:
    """torch's DDP and FSDP2 need a default process group, which metadist does not make at
    world 1 (it has nothing to communicate): a one-rank group as a single-GPU torch job has
    one (NCCL on cuda, gloo on the CPU), from the launcher's MASTER_ADDR/PORT."""
    import torch.distributed as dist

    if dist.is_initialized():  # an earlier case in the same pool (--quick) made it
        yield
        return
    cuda = dev.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", device_id=dev if cuda else None)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _torch_step(case: Case, net: Decoder, s: Shape, dev: torch.device) -> Step:
    """torch's own recipe: autocast (plus GradScaler for float16), DDP, or FSDP2 per block."""
    model: nn.Module = net.to(dev)
    if case.runner == "ddp":
        model = device.ddp(net)
    elif case.runner == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # It warns that the root returns a view (the head's matmul): only an in-place op on
        # the logits would matter, and lm_loss makes none.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in net.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(net, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR_LM)
    scaler = torch.amp.GradScaler(dev.type, enabled=case.amp == torch.float16)
    batches, i = _batches(s, dev), [0]

    def step() -> Tensor:
        x, y = batches[i[0] % len(batches)]
        i[0] += 1
        opt.zero_grad()
        amp = (torch.autocast(dev.type, dtype=case.amp) if case.amp is not None
               else contextlib.nullcontext())
        with amp:
            loss = lm_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return step


def _metadist_step(case: Case, net: Decoder, s: Shape, dev: torch.device) -> Step:
    """metadist's recipe: ``setup``, then ``strategy.backward`` (which scales under 16-mixed)."""
    strategy = metadist.strategy(case.strategy, **case.options)
    model, opt = strategy.setup(net, torch.optim.AdamW(net.parameters(), lr=LR_LM))
    batches, i = _batches(s, dev), [0]

    def step() -> Tensor:
        x, y = batches[i[0] % len(batches)]
        i[0] += 1
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        strategy.backward(loss)
        opt.step()
        return loss.detach()

    return step


def _maml_step(case: Case, s: Shape, dev: torch.device
               ) -> tuple[Step, Callable[[], dict[str, Tensor]]]:
    """benchmarks.meta's second-order MAML step, as plain torch (``functional_call``) or
    through a strategy (``full_parameters`` + ``functional_forward``), as maml_overhead runs
    them; and the parameters, to compare after."""
    inputs, hidden, count = s.maml
    data = tasks(inputs, count, dev)
    net = mlp(inputs, hidden)
    if case.runner == "maml":
        net.to(dev)
        plain_opt = torch.optim.Adam(net.parameters(), lr=LR_MAML)

        def plain() -> Tensor:
            plain_opt.zero_grad()
            loss = maml_loss(lambda p, x: functional_call(net, p, (x,)),
                             dict(net.named_parameters()), data)
            loss.backward()
            plain_opt.step()
            return loss.detach()

        return plain, lambda: dict(net.named_parameters())
    strategy = metadist.strategy(case.strategy)
    model, opt = strategy.setup(net, torch.optim.Adam(net.parameters(), lr=LR_MAML))

    def step() -> Tensor:
        opt.zero_grad()
        loss = maml_loss(model.functional_forward, model.full_parameters(), data)
        strategy.backward(loss)
        opt.step()
        return loss.detach()

    return step, model.full_parameters


def _body(label: str, shape: str, steps: int, warmup: int) -> dict[str, Any]:
    """One case in this process: median ms/step, the process's CUDA peak, the last loss (and
    for MAML the final parameters, to compare with plain torch's)."""
    dev, case = device.here(), CASES[label]
    if device.on_cuda():  # a pool (--quick) runs every case in one process: count this one
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with contextlib.ExitStack() as stack:
        if case.runner in ("ddp", "fsdp2"):
            stack.enter_context(_one_rank_group(dev))
        return _measure(case, SHAPES[shape], dev, steps, warmup)


def _measure(case: Case, s: Shape, dev: torch.device, steps: int, warmup: int
             ) -> dict[str, Any]:
    """Build the case, run ``warmup + steps`` steps, time each of the last ``steps``."""
    cuda = device.on_cuda()
    final: Callable[[], dict[str, Tensor]] | None = None
    if case.runner.startswith("maml"):
        step, final = _maml_step(case, s, dev)
        count = sum(p.numel() for p in final().values())
    else:
        net = Decoder(s)
        count = sum(p.numel() for p in net.parameters())  # before any sharding
        step = (_metadist_step if case.runner == "metadist" else _torch_step)(case, net, s, dev)
    losses: list[Tensor] = []
    seconds = []
    for i in range(warmup + steps):
        t = timed(lambda: losses.append(step()))
        if i >= warmup:
            seconds.append(t)
    out: dict[str, Any] = {
        "ms": statistics.median(seconds) * 1e3, "loss": float(losses[-1]), "params": count,
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}
    if final is not None:
        out["final"] = {k: v.detach().float().cpu() for k, v in final().items()}
    return out


def _relative(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """max over tensors of max|a - b| / max|b|: elementwise ratios blow up near zero."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b)


def run_cases(labels: list[str], shape: str, steps: int, warmup: int, quick: bool,
              each: Callable[[str, dict[str, Any] | str], None],
              timeout: float = 600) -> dict[str, Any]:
    """Every case in its own process (under ``quick`` one pool runs them all, start-up paid
    once); a case that fails is its row's error, not the end of the run. ``each(label,
    result or error)`` as each finishes, so a run stopped later keeps what it measured."""
    results: dict[str, dict[str, Any] | str] = {}
    pool: metadist.RankPool | None = None
    try:
        for label in labels:
            job = (label, shape, steps, warmup)
            try:
                if not quick:
                    res: dict[str, Any] | str = metadist.launch(_body, 1, args=job, threads=1,
                                                                timeout=timeout)[0]
                else:
                    if pool is None or pool.closed:  # a failed job closes its pool
                        pool = metadist.RankPool(1, threads=1, timeout=timeout)
                    res = pool.run(_body, job)[0]
            except Exception as err:  # reported in the table: the other cases still run
                print(f"{label} failed:\n{err}", file=sys.stderr, flush=True)  # its traceback
                res = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
            results[label] = res
            each(label, res)
    finally:
        if pool is not None:
            pool.close()
    return results


def _fmt(value: float | None, digits: str = ".1f") -> str:
    return "-" if value is None else format(value, digits)


def report(out: Results, results: dict[str, Any], skipped: dict[str, str], args: argparse.Namespace,
           where: str) -> None:
    """The step table, the MAML table and the ratios against their targets."""
    s = SHAPES[args.shape]
    ok = {k: v for k, v in results.items() if isinstance(v, dict)}

    def ratio(label: str) -> float | None:
        anchor = CASES[label].anchor
        if label in ok and anchor in ok:
            return float(ok[label]["ms"] / ok[anchor]["ms"])
        return None

    def row(label: str) -> list[Any]:
        if label in skipped:
            return [label, "skipped", "-", "-", skipped[label]]
        r = results.get(label)
        if not isinstance(r, dict):
            return [label, "failed", "-", "-", r or "not run"]
        anchor = CASES[label].anchor
        vs = f"{ratio(label):.3f} x {anchor}" if ratio(label) is not None else "-"
        return [label, f"{r['ms']:.2f}", vs, _fmt(r["peak_mib"], ".0f"), f"{r['loss']:.4f}"]

    alone = "one process for all (--quick)" if args.quick else "each case in its own process"
    lm = [k for k in CASES if not k.startswith("MAML") and k in args.cases]
    maml = [k for k in CASES if k.startswith("MAML") and k in args.cases]
    params = next((r["params"] for k, r in ok.items() if k in lm), None)
    if lm:
        size = f"{params / 1e6:.3g}M-parameter " if params else ""
        out.heading(f"{size}decoder ({s.layers} x TransformerEncoderLayer d={s.d}, {s.heads} "
                    f"heads, ff {s.ff}, causal; vocab {s.vocab}, untied head), batch {s.batch} x "
                    f"{s.seq} tokens, AdamW, world 1 ({where}); {alone}, median of {args.steps} "
                    f"steps after {args.warmup} warm-up")
        out.table(["configuration", "ms / step", "time ratio", "peak MiB",
                   f"loss at step {args.steps + args.warmup}"], [row(k) for k in lm],
                  key="decoder step")
    if maml:
        inputs, hidden, count = s.maml
        out.heading(f"second-order MAML, MLP {inputs}-{hidden}-{hidden}-1, {count} tasks x "
                    f"{INNER_STEPS} inner steps, Adam, world 1 ({where}); {alone}, median of "
                    f"{args.steps} meta-steps after {args.warmup} warm-up")
        plain = ok.get("MAML: plain torch")
        rows = []
        for k in maml:
            r = row(k)
            if k in ok and plain is not None:
                r.append(f"{abs(ok[k]['loss'] - plain['loss']) / abs(plain['loss']):.1e}")
                r.append(f"{_relative(ok[k]['final'], plain['final']):.1e}")
            rows.append(r)
        out.table(["configuration", "ms / meta-step", "time ratio", "peak MiB",
                   f"loss at step {args.steps + args.warmup}", "rel. diff loss vs plain",
                   "rel. diff params vs plain (max |a-b| / max |b|)"], rows, key="maml step")
    targets = [(k, ratio(k)) for k in (FP16_PAIR[0], "MAML: metadist ddp", "MAML: metadist zero3")
               if k in args.cases]
    rows = [[f"{k} / {CASES[k].anchor}", _fmt(r, ".3f"), f"<= {TARGET}",
             "-" if r is None else "met" if r <= TARGET else "**not met**"] for k, r in targets]
    if rows:
        out.heading("the issue's targets")
        out.table(["time ratio", "measured", "target", ""], rows, key="targets")
    out.data = {"shape": args.shape, "params": params, "skipped": skipped,
                "cases": {k: ({kk: vv for kk, vv in v.items() if kk != "final"}
                              if isinstance(v, dict) else {"error": v})
                          for k, v in results.items()},
                "ratios": {f"{k} / {CASES[k].anchor}": r for k, r in targets}}


def fp16_reason(on: str) -> str | None:
    """Why the float16 cases cannot run here (None when they can)."""
    from metadist.precision import Precision

    try:
        Precision("16-mixed", on).check()
    except RuntimeError:
        return f"torch {torch.__version__} has no float16 autocast on {on}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("auto", *SHAPES), default="auto",
                    help="full (the issue's table) or tiny; auto: full on cuda, tiny on the CPU")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=5, help="steps discarded first")
    ap.add_argument("--only", default="",
                    help="comma-separated substrings: the cases whose label contains one")
    ap.add_argument("--case-timeout", type=float, default=600,
                    help="seconds one case may take (start-up included) before it is stopped "
                         "and reported as failed; the other cases still run")
    device.add_args(ap, world=False)
    output_args(ap)
    args = parse(ap, shape="tiny", steps=2, warmup=1)
    on = device.resolve(args)
    if args.shape == "auto":
        args.shape = "full" if on == "cuda" else "tiny"
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    args.cases = [k for k in CASES if not wanted or any(w in k for w in wanted)]
    if not args.cases:
        raise SystemExit(f"--only {args.only!r} matches none of: {', '.join(CASES)}")
    reason = fp16_reason(on)
    skipped = {k: reason for k in args.cases if CASES[k].fp16 and reason}
    labels = [k for k in args.cases if k not in skipped]
    with Results("gpu_step", args) as out:  # JSON also of what ran before a failure
        done: dict[str, Any] = {}

        def each(label: str, res: dict[str, Any] | str) -> None:
            done[label] = res
            line = (f"{res['ms']:.2f} ms/step, peak {_fmt(res['peak_mib'], '.0f')} MiB, loss "
                    f"{res['loss']:.4f}" if isinstance(res, dict) else f"FAILED: {res}")
            print(f"[{len(done)}/{len(labels)}] {label}: {line}", flush=True)
            out.data = {"partial": {k: ({"ms": v["ms"], "peak_mib": v["peak_mib"],
                                         "loss": v["loss"]} if isinstance(v, dict) else v)
                                    for k, v in done.items()}}
            out.write()  # a run stopped by a timeout keeps what it measured

        results = run_cases(labels, args.shape, args.steps, args.warmup, args.quick, each,
                            args.case_timeout)
        print()
        for label, why in skipped.items():
            out.skip(label, why)
        report(out, results, skipped, args, device.where(1))
        failed = [k for k, v in results.items() if not isinstance(v, dict)]
        if failed:
            raise SystemExit(f"gpu_step: {len(failed)} case(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
