"""Betty 0.2.1's examples/bert_data_reweighting (main.py, model.py, utils.py): Meta-Weight-Net
data reweighting of a BERT sentence classifier fine-tuned on class-imbalanced data, ported to
run on Betty 0.2.1 and on metadist.compat.betty with only the imports changed
(``run(impl, ...)``).

What is the original's, kept: ``BertModel`` wraps a ``*ForSequenceClassification`` (2 labels;
every parameter ``requires_grad``) and returns (loss, logits, probabilities) given labels;
``MLP`` (``HiddenLayer`` fc+ReLU layers, dropout, ``2 * sigmoid`` output) maps each
sample's detached loss to its weight; ``Finetune`` (lower) minimises the weighted mean of
its per-sample cross entropies (``self.reweight(...)``), ``Reweight`` (upper) the model's own
loss on the balanced meta set through ``self.finetune(seqs, masks, segments, labels)``;
``split_dataset`` (a balanced meta set, the rest imbalanced by ``imbalance_factor``); both
loaders shuffled; the fine-tuning optimizer with decoupled weight decay and
``get_linear_schedule_with_warmup``; Adam for the meta network; the finetune Config
``type=darts, precision=fp32, retain_graph=True, log_step, unroll_steps`` (log_step 1 here),
the reweight Config ``type=darts``; the work order of main.py (seed, model, data, loaders,
optimizer, scheduler, meta network, meta loader, problems, engine).

Changes:

* The model is a tiny ``BertForSequenceClassification`` built from a ``BertConfig`` (2
  layers, hidden size 16, eager attention, no download) instead of roberta-large from the
  hub; inputs are synthetic token ids (8 tokens, padded, with attention masks) whose label
  is whether token 7 occurs in the sentence; no tokenizer.
* Dropout is off (BertConfig's hidden and attention dropout 0, the MLP's ``p`` 0): Betty's
  darts evaluates the lower loss twice (parameters +/- eps v) and differentiates the
  difference divided by 2 eps, so a fresh dropout mask per evaluation makes the
  hypergradient mask noise times 1/(2 eps); and N ranks cannot draw one process's masks.
* ``torch.optim.AdamW`` is written ``torch.optim.Adam(..., decoupled_weight_decay=True)``
  (torch's AdamW is that class with that flag): Betty 0.2.1 rebuilds every optimizer as
  ``type(opt)(params, **opt.defaults)`` and torch 2.13's AdamW keeps
  ``decoupled_weight_decay`` in its defaults without accepting it, so Betty fails at its
  Engine with the original line (TypeError); Adam accepts it, and the update is AdamW's.
* Sizes: 16 meta and 32 (imbalance 3) training samples, global batch 8 (the original runs
  16, or 8 per rank on 2 ranks), unroll_steps 2, 8 iterations (reweight steps 4 times) with
  2 warmup iterations, meta network hidden size 8; float64; learning rates 1e-3 (the
  original's 1e-5 barely moves the parameters of a randomly initialised model in 8 steps);
  ``valid_step`` is beyond the run: ``BERTEngine.validation`` (saving checkpoints to files)
  is left out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from betty_programs.ported import (
    HiddenLayer,
    api,
    engine_config,
    learning_rates,
    place,
    snapshot,
)

VOCAB, SEQ_LEN, GLOBAL_BATCH = 24, 8, 8
ARGS = dict(seed=0, meta_net_hidden_size=8, meta_net_num_layers=1, lr=1e-3, weight_decay=5e-3,
            hypergradient="darts", meta_lr=1e-3, meta_weight_decay=0.0, imbalance_factor=3,
            train_iters=8, warmup_iters=2, valid_step=10**6, unroll_steps=2, dropout=0.0,
            precision="fp32")


class BertModel(nn.Module):
    def __init__(self, config: BertConfig, requires_grad: bool = True) -> None:
        super().__init__()
        self.bert = BertForSequenceClassification(config)
        self.requires_grad = requires_grad
        for param in self.bert.parameters():
            param.requires_grad = requires_grad

    def forward(self, batch_seqs: torch.Tensor, batch_seq_masks: torch.Tensor,
                batch_seq_segments: torch.Tensor, labels: torch.Tensor | None) -> Any:
        out = self.bert(input_ids=batch_seqs, attention_mask=batch_seq_masks,
                        token_type_ids=batch_seq_segments, labels=labels)
        if labels is None:
            return out.logits
        return out.loss, out.logits, F.softmax(out.logits, dim=-1)


class MLP(nn.Module):
    def __init__(self, in_size: int = 1, hidden_size: int = 100, num_layers: int = 1,
                 dropout: float = 0.2) -> None:
        super().__init__()
        self.first_hidden_layer = HiddenLayer(in_size, hidden_size)
        self.rest_hidden_layers = nn.Sequential(
            *[HiddenLayer(hidden_size, hidden_size) for _ in range(num_layers - 1)])
        self.output_layer = nn.Linear(hidden_size, 1)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.rest_hidden_layers(self.first_hidden_layer(x))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return torch.sigmoid(self.output_layer(x)) * 2


def sentences(n: int, g: torch.Generator) -> TensorDataset:
    """(token ids, attention mask, segment ids, label): [CLS]=1, words 3.., padding 0; the
    label says whether word 7 occurs."""
    lengths = torch.randint(4, SEQ_LEN + 1, (n,), generator=g)
    ids = torch.randint(3, VOCAB, (n, SEQ_LEN), generator=g)
    ids[:, 0] = 1
    masks = (torch.arange(SEQ_LEN) < lengths[:, None]).long()
    ids = ids * masks
    labels = (ids == 7).any(1).long()
    return TensorDataset(ids, masks, torch.zeros_like(ids), labels)


def split_dataset(dataset: TensorDataset, imbalance_factor: int, num_meta_total: int,
                  g: torch.Generator) -> tuple[TensorDataset, TensorDataset]:
    """A class-balanced meta set of ``num_meta_total`` samples; the rest with class 1 cut
    down by ``imbalance_factor``."""
    labels = dataset.tensors[3]
    per_class = num_meta_total // 2
    sample_num = (len(labels) - num_meta_total) // 2
    meta: list[int] = []
    train: list[int] = []
    for c in range(2):
        members = torch.nonzero(labels == c).flatten()
        members = members[torch.randperm(len(members), generator=g)].tolist()
        meta += members[:per_class]
        train += members[per_class:][:int(sample_num / imbalance_factor ** c)]
    return (TensorDataset(*(t[train] for t in dataset.tensors)),
            TensorDataset(*(t[meta] for t in dataset.tensors)))


def data(imbalance_factor: int) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    pool = sentences(400, g)
    labels = pool.tensors[3]
    # as many of each class as the split needs: 8 + 24 of class 0, 8 + 8 of class 1
    keep = torch.cat([torch.nonzero(labels == 0).flatten()[:32],
                      torch.nonzero(labels == 1).flatten()[:32]])
    return split_dataset(TensorDataset(*(t[keep] for t in pool.tensors)),
                         imbalance_factor, 16, g)


def run(impl: str, strategy: str = "default", **overrides: Any) -> dict[str, Any]:
    """Reweight for ``train_iters`` iterations; both problems' initial and final parameters,
    the losses each logged (rank 0), the learning rates."""
    b = api(impl)
    args = {**ARGS, **overrides}
    world, _ = place()
    batch = GLOBAL_BATCH // world
    losses: list[tuple[str, int, float]] = []

    torch.manual_seed(args["seed"])  # set_seed
    bert_config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                             num_attention_heads=2, intermediate_size=32,
                             max_position_embeddings=SEQ_LEN, type_vocab_size=2,
                             hidden_dropout_prob=args["dropout"],
                             attention_probs_dropout_prob=args["dropout"], num_labels=2)
    bert_config._attn_implementation = "eager"
    bertmodel = BertModel(bert_config, requires_grad=True).double()
    train_data, meta_data = data(args["imbalance_factor"])
    train_loader = DataLoader(train_data, shuffle=True, batch_size=batch)
    optimizer = torch.optim.Adam(bertmodel.parameters(), lr=args["lr"],
                                 weight_decay=args["weight_decay"], decoupled_weight_decay=True)
    scheduler = get_linear_schedule_with_warmup(optimizer,
                                                num_training_steps=args["train_iters"],
                                                num_warmup_steps=args["warmup_iters"])
    meta_net = MLP(in_size=1, hidden_size=args["meta_net_hidden_size"],
                   num_layers=args["meta_net_num_layers"], dropout=args["dropout"]).double()
    meta_loader = DataLoader(meta_data, shuffle=True, batch_size=batch)
    meta_optimizer = torch.optim.Adam(meta_net.parameters(), lr=args["meta_lr"],
                                      weight_decay=args["meta_weight_decay"])

    class Logged:
        def log(self, stats: dict[str, Any], global_step: Any) -> None:
            losses.append((self.name, self.count, float(stats["loss"])))

    class Finetune(Logged, b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            seqs, masks, segments, labels = batch
            _, logits, _ = self.module(seqs, masks, segments, labels)
            loss_vector = F.cross_entropy(logits.view(-1, 2), labels, reduction="none")
            loss_vector_reshape = torch.reshape(loss_vector, (-1, 1))
            weight = self.reweight(loss_vector_reshape.detach())
            return torch.mean(weight * loss_vector_reshape)

    class Reweight(Logged, b.ImplicitProblem):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any) -> torch.Tensor:
            seqs, masks, segments, labels = batch
            loss, *_ = self.finetune(seqs, masks, segments, labels)
            return loss

    config = engine_config(b, impl, strategy, batchnorm=False, train_iters=args["train_iters"],
                           valid_step=args["valid_step"])
    finetune_config = b.Config(type=args["hypergradient"], precision=args["precision"],
                               retain_graph=True, log_step=1, unroll_steps=args["unroll_steps"])
    reweight_config = b.Config(type="darts", precision=args["precision"], log_step=1)
    finetune = Finetune(name="finetune", module=bertmodel, optimizer=optimizer,
                        scheduler=scheduler, train_data_loader=train_loader,
                        config=finetune_config)
    reweight = Reweight(name="reweight", module=meta_net, optimizer=meta_optimizer,
                        train_data_loader=meta_loader, config=reweight_config)
    problems = [reweight, finetune]
    engine = b.Engine(config=config, problems=problems,
                      dependencies={"l2u": {finetune: [reweight]}, "u2l": {reweight: [finetune]}})
    initial = snapshot(problems)
    engine.run()
    return {"initial": initial, "final": snapshot(problems), "losses": losses,
            "lr": learning_rates(problems), "counts": {p.name: p.count for p in problems}}
