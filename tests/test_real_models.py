"""Real models: HuggingFace GPT-2 and BERT (tiny, built from configs: no download, no
tokenizer) trained under every strategy match one plain process on the same global batches,
their state dicts are the plain model's, and a full checkpoint loads into a fresh plain model
with ``strict=True``; zero3 under ``torch.compile`` too.

One pool round-trip per world size trains every (model, strategy) case in turn (cached); each
test then checks one case, naming it. A case's exception is recorded, not raised, so one
strategy's failure does not hide the others' results (safe for errors every rank raises at
the same point; one raised on a single rank shows up as the pool's timeout).
"""

from __future__ import annotations

import os

# Before transformers is imported, here and in the ranks (which import this module to run
# its functions): nothing in these tests may reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
)
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import metadist
from metadist.testing import run_on_ranks
from parity import assert_tensors_close, shard, snapshot

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 10, 12, 16, 128  # 12 rows: 6 per rank at 2, 4 at 3
MODELS = ("gpt2", "bert")
DISTRIBUTED = ("ddp", "zero1", "zero2", "zero3", "hsdp")
# zero2 with tiny buckets (several owners); zero3 one unit per transformer block, as
# torchtitan wraps; hsdp by size, so its units cut across the blocks.
OPTIONS: dict[str, dict[str, Any]] = {
    "zero2": {"bucket_cap_mb": 0.01, "first_bucket_mb": 0.005},
    "zero3": {"wrap_classes": (GPT2Block, BertLayer)},
    "hsdp": {"min_unit_params": 2_000},
}
Batch = dict[str, torch.Tensor]


def make_model(name: str) -> nn.Module:
    """A seeded, randomly initialised tiny model; dropout off (each rank would draw its own
    masks, and one process draws others: no parity to check); GPT-2 without its key-value
    cache, as for training (with it, each forward fills a cache nothing reads, and under
    torch.compile every block recompiles on the cache's state)."""
    torch.manual_seed(0)
    match name:
        case "gpt2":
            return GPT2LMHeadModel(GPT2Config(
                n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                eos_token_id=0, use_cache=False))
        case "bert":
            return BertForSequenceClassification(BertConfig(
                vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=32, num_labels=3,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    raise ValueError(f"model {name!r} is not known; choose one of: {', '.join(MODELS)}")


def make_batches(name: str) -> list[Batch]:
    """STEPS global batches of token ids from a seeded generator; BERT's are padded to random
    lengths (attention mask, two segments) and labelled with one of 3 classes."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        if name == "gpt2":
            out.append({"input_ids": ids, "labels": ids})
            continue
        lengths = torch.randint(4, SEQ + 1, (GLOBAL_BATCH, 1), generator=g)
        positions = torch.arange(SEQ)
        mask = (positions < lengths).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask,
                    "token_type_ids": (positions >= lengths // 2).long() * mask,
                    "labels": torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)})
    return out


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    # eps 1e-6: the attention key bias has a zero gradient in exact arithmetic (it shifts every
    # score of a query alike, and softmax ignores that), so in floats it is rounding noise,
    # which depends on the summation order (one process and N ranks sum differently). With
    # the default 1e-8 Adam scales that noise up: 2e-6 apart after 10 steps between one batch
    # and two averaged halves, a fifth of the tolerance from noise alone; 2e-7 with 1e-6.
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01)


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss  # the HF habit: labels in, mean loss out


@contextmanager
def one_thread() -> Iterator[None]:
    """For work in the pytest process: on tensors this small, a second thread is 10x slower
    (it only contends with the ranks, and with anything else, for the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@cache
def reference(name: str) -> dict[str, Any]:
    """One plain process on the whole global batches: the truth every case must match."""
    with one_thread():
        net = make_model(name)
        opt = make_optimizer(net.parameters())
        for batch in make_batches(name):
            opt.zero_grad()
            _loss(net, batch).backward()
            opt.step()
    return {**snapshot(net, opt), "state_dict": _copy(net.state_dict()), "model": net}


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


class Failure(NamedTuple):
    """A case (or one of its checks) that raised: its exception type and message."""

    type: str
    message: str
    where: str

    def __str__(self) -> str:
        return f"{self.type}: {self.message}\n{self.where}"


def _attempt(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        return Failure(type(exc).__name__, str(exc), "".join(traceback.format_exc(limit=-3)))


def checkpoint_path(directory: str, name: str, strategy: str, n: int,
                    compile_model: str | None = None) -> Path:
    return Path(directory) / f"{name}-{strategy}-x{n}-{compile_model or 'eager'}.pt"


def _trained(model: nn.Module, opt: torch.optim.Optimizer, s: metadist.Strategy,
             names: list[str]) -> dict[str, Any]:
    """Parameters by the user's names (a model compiled before setup names them under
    ``_orig_mod.``, as torch does) and the consolidated optimizer state, as parity.snapshot
    names them."""
    state = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
    full = s.optimizer_state_dict(opt)
    assert full is not None
    ordered = [pid for g in full["param_groups"] for pid in g["params"]]
    return {"params": {n: state[n].detach().clone() for n in names},
            "state": {f"{names[i]}.{k}": v.detach().clone() for i, pid in enumerate(ordered)
                      for k, v in full["state"].get(pid, {}).items()
                      if torch.is_tensor(v) and v.dim() > 0}}


def train_case(name: str, strategy: str, directory: str,
               compile_model: str | None = None) -> dict[str, Any]:
    """Train ``name`` through ``strategy`` on this rank's slices of the global batches, then
    record what the tests check: parameters and optimizer state (parity), both state dicts,
    and a full-format checkpoint. ``compile_model``: "after" setup, or "before" it."""
    s = metadist.strategy(strategy, **OPTIONS.get(strategy, {}))
    w = s.world
    net = make_model(name)
    names = [n for n, _ in net.named_parameters()]
    opt = make_optimizer(net.parameters())
    model, opt = s.setup(torch.compile(net) if compile_model == "before" else net, opt)
    forward = torch.compile(model) if compile_model == "after" else model
    for batch in make_batches(name):
        opt.zero_grad()
        s.backward(_loss(forward, {k: shard(v, w.rank, w.world_size).to(s.device)
                                   for k, v in batch.items()}))
        opt.step()
    out: dict[str, Any] = {"trained": _attempt(lambda: _trained(model, opt, s, names)),
                           "state_dict": _attempt(lambda: _copy(model.state_dict())),
                           "module_state_dict": _attempt(
                               lambda: _copy(model.module.state_dict()))}
    path = checkpoint_path(directory, name, strategy, w.world_size, compile_model)
    out["save"] = _attempt(lambda: s.save(path, {"model": model, "optimizer": opt},
                                          format="full"))
    out["offline"] = os.environ.get("HF_HUB_OFFLINE")
    return out


def cases_on_rank(cases: list[tuple[str, str]], directory: str,
                  compile_model: str | None = None) -> dict[tuple[str, str], Any]:
    """Every (model, strategy) case in turn on this rank; a case that raised is a Failure."""
    return {(name, strategy): _attempt(
        lambda name=name, strategy=strategy: train_case(name, strategy, directory,
                                                        compile_model))
            for name, strategy in cases}


WORLD_CASES = {2: [(m, s) for m in MODELS for s in DISTRIBUTED],
               3: [("gpt2", "zero3")]}  # 3 ranks: a block's 12,704 parameters pad to 12,705
CASES = [(m, s, n) for n, cases in WORLD_CASES.items() for m, s in cases] + [
    (m, "single", 1) for m in MODELS]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("real_models"))


@cache
def _cell(n: int, directory: str) -> tuple[dict[tuple[str, str], Any], ...]:
    if n == 1:  # this process, a world of one: no pool to start
        with one_thread():
            return (cases_on_rank([(m, "single") for m in MODELS], directory),)
    return tuple(run_on_ranks(cases_on_rank, n, args=(WORLD_CASES[n], directory), timeout=600))


def _outcomes(name: str, strategy: str, n: int, directory: str) -> list[dict[str, Any]]:
    out = []
    for rank, per_rank in enumerate(_cell(n, directory)):
        got = per_rank[(name, strategy)]
        assert not isinstance(got, Failure), f"{name} {strategy} x{n} rank {rank}: {got}"
        assert got["offline"] == "1", "the ranks must inherit HF_HUB_OFFLINE"
        out.append(got)
    return out


def _ok(value: Any, where: str) -> Any:
    assert not isinstance(value, Failure), f"{where}: {value}"
    return value


@pytest.mark.parametrize(("name", "strategy", "n"), CASES)
def test_trains_like_one_process(name: str, strategy: str, n: int, directory: str) -> None:
    want = reference(name)
    for rank, got in enumerate(_outcomes(name, strategy, n, directory)):
        where = f"{name} {strategy} x{n} rank {rank}"
        trained = _ok(got["trained"], where)
        assert_tensors_close(trained["params"], want["params"], f"{where} parameters")
        assert_tensors_close(trained["state"], want["state"], f"{where} optimizer state")


def _assert_plain_state(key: str, name: str, strategy: str, n: int, directory: str) -> None:
    want = reference(name)["state_dict"]
    for rank, got in enumerate(_outcomes(name, strategy, n, directory)):
        where = f"{name} {strategy} x{n} rank {rank} {key}"
        state = _ok(got[key], where)
        extra, missing = sorted(set(state) - set(want)), sorted(set(want) - set(state))
        assert not extra and not missing, (
            f"{where}: names differ from the plain model's: extra {extra}, missing {missing}")
        assert_tensors_close(state, want, where)


@pytest.mark.parametrize(("name", "strategy", "n"), CASES)
def test_state_dict_is_the_plain_models(name: str, strategy: str, n: int,
                                        directory: str) -> None:
    """``model.state_dict()``: the plain model's names (no non-persistent buffer, tied
    weights under both names) and values."""
    _assert_plain_state("state_dict", name, strategy, n, directory)


@pytest.mark.parametrize(("name", "strategy", "n"), CASES)
def test_module_state_dict_is_the_plain_models(name: str, strategy: str, n: int,
                                               directory: str) -> None:
    """The torch habit ``model.module.state_dict()``: the same as on a plain module."""
    _assert_plain_state("module_state_dict", name, strategy, n, directory)


@pytest.mark.parametrize(("name", "strategy", "n"), CASES)
def test_full_checkpoint_loads_strict_into_a_fresh_plain_model(
        name: str, strategy: str, n: int, directory: str) -> None:
    got = _outcomes(name, strategy, n, directory)[0]
    where = f"{name} {strategy} x{n}"
    _ok(got["save"], f"{where} save(format='full')")
    saved = torch.load(checkpoint_path(directory, name, strategy, n), weights_only=True)
    fresh = make_model(name)
    fresh.load_state_dict(saved["model"], strict=True)
    want = reference(name)
    assert_tensors_close(fresh.state_dict(), want["state_dict"], f"{where} loaded")
    fresh_opt = make_optimizer(fresh.parameters())
    fresh_opt.load_state_dict(saved["optimizer"])  # the plain single-process format
    batch = make_batches(name)[0]
    with torch.no_grad():
        assert_tensors_close({"logits": fresh(**batch).logits},
                             {"logits": want["model"](**batch).logits}, f"{where} outputs")


def test_dp_says_what_to_use_on_fewer_than_two_gpus() -> None:
    """dp drives several GPUs from one process: where there are not two, it refuses before
    touching the model and names ddp. (On CPUs, and so in CI, that is its whole behaviour.)"""
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has several GPUs: dp runs there instead of refusing")
    net = make_model("gpt2")
    with pytest.raises(ValueError, match=r"strategy 'dp' drives several GPUs.*metadist\.strategy"
                                         r"\('ddp'\)"):
        metadist.strategy("dp").setup(net, make_optimizer(net.parameters()))


@cache
def _compiled(when: str, directory: str) -> tuple[dict[str, Any], ...]:
    """GPT-2 under zero3 at 2 ranks, ``torch.compile`` applied ``when`` ("after" setup, to
    the wrapped model, or "before" it, to the plain one)."""
    out = run_on_ranks(cases_on_rank, 2, args=([("gpt2", "zero3")], directory, when),
                       timeout=600)
    return tuple(per_rank[("gpt2", "zero3")] for per_rank in out)


@pytest.mark.parametrize("when", ["after", "before"])
def test_zero3_with_torch_compile_trains_like_one_process(when: str, directory: str) -> None:
    want = reference("gpt2")
    for rank, got in enumerate(_compiled(when, directory)):
        where = f"gpt2 zero3 x2 torch.compile {when} setup, rank {rank}"
        trained = _ok(_ok(got, where)["trained"], where)
        assert_tensors_close(trained["params"], want["params"], f"{where} parameters")
        assert_tensors_close(trained["state"], want["state"], f"{where} optimizer state")


def test_the_comparison_would_catch_ranks_that_never_sync() -> None:
    """A guard on the harness: training on one rank's half of each batch alone (what a
    strategy that dropped the gradient sync would do) is far outside the tolerances."""
    net = make_model("gpt2")
    opt = make_optimizer(net.parameters())
    with one_thread():
        for batch in make_batches("gpt2"):
            opt.zero_grad()
            _loss(net, {k: shard(v, 0, 2) for k, v in batch.items()}).backward()
            opt.step()
    with pytest.raises(AssertionError, match="Mismatched elements"):
        assert_tensors_close(_copy(net.state_dict()), reference("gpt2")["state_dict"])
