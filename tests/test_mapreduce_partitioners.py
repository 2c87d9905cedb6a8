"""Partitioners, reducers and worker ids of metadist.mapreduce, in one process (the world
size comes from launcher variables, as before metadist.init)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import metadist.mapreduce as todist
from metadist.mapreduce.partitioners import partition


@pytest.fixture(autouse=True)
def _three_workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key, value in {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1",
                       "LOCAL_WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("METADIST_LAUNCHER", raising=False)
    yield


def _shapes(parts: list[tuple[int, tuple[object, ...], dict[str, object]]]) -> list[object]:
    return [(w, tuple(a.shape for a in args if isinstance(a, torch.Tensor)))
            for w, args, _ in parts]


def test_exclusive_deals_every_sample_round_robin_over_all_workers() -> None:
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    parts = todist.dim_partitioner(0, exclusive=True, keepdim=False)(x, y, 7)
    assert [w for w, _, _ in parts] == [0, 1, 2, 0, 1]  # the caller's rank takes parts too
    for i, (_, (xi, yi, seven), kwargs) in enumerate(parts):
        assert torch.equal(xi, x[i]) and xi.shape == (2,) and int(yi) == i
        assert seven == 7 and kwargs == {}
    kept = todist.exclusive_batch_partitioner(x)
    assert [args[0].shape for _, args, _ in kept] == [(1, 2)] * 5


def test_contiguous_split_is_balanced_larger_parts_first() -> None:
    x = torch.arange(7.0)
    assert [args[0].tolist() for _, args, _ in todist.batch_partitioner(x)] == [
        [0.0, 1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    # Fewer samples than workers: one part per sample, on the first workers.
    assert _shapes(todist.batch_partitioner(torch.zeros(2, 4))) == [(0, ((1, 4),)),
                                                                   (1, ((1, 4),))]


def test_negative_dim_chosen_workers_and_names() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    parts = todist.dim_partitioner(-1, workers=["worker2", 0])(x)
    assert [(w, args[0].tolist()) for w, args, _ in parts] == [
        (2, [[0.0, 1.0], [4.0, 5.0], [8.0, 9.0]]), (0, [[2.0, 3.0], [6.0, 7.0], [10.0, 11.0]])]


def test_pytrees_are_split_leaf_by_leaf_and_other_values_shared() -> None:
    marker = object()
    batch = {"x": torch.zeros(4, 3), "pair": (torch.ones(4), "name")}
    parts = todist.dim_partitioner(0, exclusive=True, keepdim=False)(
        batch, [marker, torch.arange(4)], scale=torch.full((4, 1), 2.0), flag=True)
    assert len(parts) == 4
    worker, (part_batch, (same, index)), kwargs = parts[3]
    assert worker == 0 and same is marker and int(index) == 3
    assert part_batch["x"].shape == (3,) and part_batch["pair"][1] == "name"
    assert kwargs["flag"] is True and kwargs["scale"].tolist() == [2.0]


def test_size_mismatch_names_both_tensors() -> None:
    with pytest.raises(ValueError, match=r"args\[0\]\['x'\] has 4 \(shape \(4, 3\)\) and "
                                         r"kwargs\['y'\] has 5 \(shape \(5,\)\)"):
        todist.batch_partitioner({"x": torch.zeros(4, 3)}, y=torch.zeros(5))
    with pytest.raises(ValueError, match=r"args\[1\] has shape \(\), which has no dimension 0"):
        todist.batch_partitioner(torch.zeros(2), torch.tensor(1.0))


def test_without_tensors_the_call_runs_on_the_calling_worker() -> None:
    assert todist.batch_partitioner("a", k=1) == [(1, ("a",), {"k": 1})]


def test_option_errors_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="pass exclusive=True or keepdim=True"):
        todist.dim_partitioner(0, keepdim=False)
    with pytest.raises(ValueError, match="has no worker"):
        todist.dim_partitioner(0, workers=[])
    with pytest.raises(ValueError, match=r"worker id 3 is outside the world of 3 ranks"):
        todist.dim_partitioner(0, workers=[3])(torch.zeros(2))
    with pytest.raises(ValueError, match="no worker is named 'w1'; the workers are: worker0"):
        todist.get_worker_id("w1")


def test_partition_accepts_ids_callables_and_checks_their_output() -> None:
    x = torch.zeros(2)
    [part] = partition("worker2", (x,), {"k": 1})
    assert (part.worker, part.args[0] is x, part.kwargs) == (2, True, {"k": 1})
    assert [p.worker for p in partition(None, (torch.zeros(6),), {})] == [0, 1, 2]
    custom = partition(lambda v: [(0, (v,), None), ("worker1", None, {"v": v})], (x,), {})
    assert [(p.worker, len(p.args), sorted(p.kwargs)) for p in custom] == [(0, 1, []),
                                                                          (1, 0, ["v"])]
    with pytest.raises(TypeError, match=r"must be a \(worker, args, kwargs\) triple"):
        partition(lambda v: [v], (x,), {})
    with pytest.raises(TypeError, match="partitioner must be a worker id"):
        partition(2.5, (x,), {})  # type: ignore[arg-type]


def test_world_info_before_init_comes_from_the_launcher() -> None:
    info = todist.get_world_info()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (1, 3, 1, 3)
    assert info.worker_name == "worker1" and todist.get_rank() == todist.get_world_rank() == 1
    assert (todist.get_world_size(), todist.get_local_rank(), todist.get_local_world_size()) == (
        3, 1, 3)
    assert todist.get_worker_id() == 1 and todist.get_worker_id(2) == 2


def test_reducers() -> None:
    results = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])]
    assert todist.mean_reducer(results).tolist() == [2.0, 4.0]
    assert todist.sum_reducer(iter(results)).tolist() == [4.0, 8.0]
    with pytest.raises(ValueError, match="mean_reducer got no results"):
        todist.mean_reducer([])
    with pytest.raises(TypeError, match="the parts returned float"):
        todist.sum_reducer([1.0])  # type: ignore[list-item]
