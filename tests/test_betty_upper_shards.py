"""The Betty drop-in under "fsdp": an upper problem's hypergradient is taken with respect to
its shard pieces, and those of the lower problems its direct term binds live
(compat/betty/hypergradient.py), so no rank holds the upper model whole,
and what Betty decides from a parameter's gradient being ``None`` (``allow_unused``) is
read from the record of what the backward reached: the same parameters are named, and the
same result comes out, as in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from metadist.testing import run_on_ranks
from parity import assert_tensors_close

ITERS = 8


def _program(strategy: str, allow_unused: bool) -> dict[str, Any]:
    """Two levels: a classifier whose samples a weight network reweights; the weight
    network's own loss reads only its first layer (its other parameters reach the loss
    only through the classifier's response). Both models are units of their own under
    fsdp, so the weight network's hypergradient holds pieces."""
    import metadist
    from betty_programs.reweight import Classifier, Reweight, Trace, data
    from metadist.compat.betty.configs import Config, EngineConfig
    from metadist.compat.betty.engine import Engine

    class PartlyDirect(Reweight):
        def training_step(self, batch: Any) -> torch.Tensor:
            first = next(p for n, p in self.module.named_parameters()
                         if n.endswith("0.weight"))
            return super().training_step(batch) + 0.01 * (first * first).sum()

    world = metadist.init().world_size
    train, meta = data(world)
    torch.manual_seed(2)
    wnet = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid()).double()
    classifier = Classifier("classifier", Config(type="darts", unroll_steps=2),
                            train_data_loader=train)
    reweight = PartlyDirect("reweight", Config(type="darts", allow_unused=allow_unused),
                            wnet, torch.optim.Adam(wnet.parameters(), lr=0.01), None, meta)
    options = {"wrap_classes": (nn.Linear,)} if strategy == "fsdp" else {}
    engine = Engine([reweight, classifier],
                    EngineConfig(train_iters=ITERS, valid_step=0, strategy=strategy,
                                 strategy_options=options),
                    {"u2l": {reweight: [classifier]}, "l2u": {classifier: [reweight]}},
                    Trace())
    try:
        engine.run()
    except ValueError as exc:
        return {"error": str(exc)}
    return {f"{p.name}.{k}": v.detach().clone() for p in (reweight, classifier)
            for k, v in p.module.state_dict().items()}


def test_an_upper_problem_on_shards_equals_one_process() -> None:
    want = run_on_ranks(_program, 1, args=("default", True))[0]
    for got in run_on_ranks(_program, 3, args=("fsdp", True), timeout=300):
        assert "error" not in got, got
        assert_tensors_close(got, want, where="fsdp n=3")


@pytest.mark.parametrize(("strategy", "world"), [("default", 1), ("fsdp", 2)])
def test_allow_unused_false_names_the_same_parameters(strategy: str, world: int) -> None:
    """The direct term of the weight network's loss does not reach its bias or its second
    layer: refused with their names, on shards as on whole parameters."""
    for got in run_on_ranks(_program, world, args=(strategy, False), timeout=300):
        message = got.get("error", "")
        assert "Config(allow_unused=False)" in message, got
        assert "['0.bias', '2.weight', '2.bias']" in message, message


# ----- memory: the upper model as pieces ------------------------------------------------------
def _upper_peak(strategy: str) -> int:
    """Bytes of live storages at the peak of a teacher's hypergradient on the Betty path
    (the last of 3), above what was alive before it: a teacher of many Linear units whose
    whole model is a hyperparameter of its student's loss, through the teacher's forward."""
    import metadist
    from metadist.compat.betty import engine as betty_engine
    from metadist.compat.betty.configs import Config, EngineConfig
    from metadist.compat.betty.engine import Engine
    from metadist.compat.betty.problems import ImplicitProblem
    from metadist.testing import peak_bytes_of
    from test_engine_memory import BATCH, DEPTH, WIDE, WIDTH, wide_net

    class Student(ImplicitProblem):
        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            out = self.module(x)
            return ((out - y) ** 2).mean() + ((out - self.teacher(x)) ** 2).mean()

    class Teacher(ImplicitProblem):
        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return ((self.student(x) - y) ** 2).mean()

    n = metadist.init().world_size
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(BATCH // n, WIDTH, generator=g), torch.randn(BATCH // n, WIDTH,
                                                                      generator=g))
            for _ in range(8)]
    student, teacher = wide_net(WIDTH, 2), wide_net(WIDTH, DEPTH)
    lower = Student("student", Config(type="darts"), student,
                    torch.optim.SGD(student.parameters(), lr=0.01), None, data)
    upper = Teacher("teacher", Config(type="darts"), teacher,
                    torch.optim.SGD(teacher.parameters(), lr=0.01), None, data)
    peaks: list[int] = []
    measured = betty_engine.upper_gradient

    def upper_gradient(engine: Any, p: Any) -> Any:
        out, peak = peak_bytes_of(lambda: measured(engine, p))
        peaks.append(peak)
        return out

    betty_engine.upper_gradient = upper_gradient  # this rank's process only
    options = WIDE if strategy == "fsdp" else {}
    Engine([upper, lower], EngineConfig(train_iters=3, valid_step=0, strategy=strategy,
                                        strategy_options=options),
           {"u2l": {upper: [lower]}, "l2u": {lower: [upper]}}).run()
    return peaks[-1]


def test_an_upper_problems_hypergradient_holds_its_model_as_shards() -> None:
    """At 4 ranks under "fsdp" against "distributed" (ddp): the teacher's hypergradient
    within 1.2 x ddp's / 4 + 4 units (test_engine_memory's slack). Before, the teacher's
    parameters, and the student's bound live for the direct term, were whole clones on
    every rank: fsdp peaked at 1.21 times ddp's (10.27 against 8.45 MB); now 0.21 times."""
    from test_engine_memory import SLACK_UNITS, UNIT

    ddp = max(run_on_ranks(_upper_peak, 4, timeout=300, args=("distributed",)))
    peak = max(run_on_ranks(_upper_peak, 4, timeout=300, args=("fsdp",)))
    bound = 1.2 * ddp / 4 + SLACK_UNITS * UNIT
    assert peak <= bound, (f"fsdp: peak {peak} B per rank over the bound {bound:.0f} B "
                           f"(distributed at 4 ranks: {ddp} B, one unit: {UNIT} B)")
