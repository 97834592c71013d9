"""``--num-actors`` beyond what the cluster can place: the Ray Data pool starts with the actors
that fit (a fixed pool of more waited for ever on a cluster that cannot grow)."""

from __future__ import annotations

import pytest

from polyaccel.asr.ray_job import _actor_room, _on_cpus


class _Ray:
    def __init__(self, **have: float) -> None:
        self.have = have

    def cluster_resources(self) -> dict[str, float]:
        return dict(self.have)


@pytest.mark.parametrize("have, resources, room", [
    ({"CPU": 2.0}, {"num_cpus": 1}, 2),
    ({"CPU": 16.0}, {"num_cpus": 2}, 8),
    ({"CPU": 64.0, "GPU": 8.0}, {"num_gpus": 1}, 8),
    ({"CPU": 64.0, "GPU": 8.0}, {"num_gpus": 0.5}, 16),
    ({"CPU": 8.0, "neuron_cores": 64.0}, {"num_cpus": 1, "resources": {"neuron_cores": 8}}, 8),
    ({"CPU": 0.5}, {"num_cpus": 1}, 1),  # never 0: the pool needs one
])
def test_actor_room_counts_the_resource_each_actor_asks_for(have, resources, room) -> None:
    assert _actor_room(_Ray(**have), resources) == room


def test_only_cpu_actors_are_spread_one_per_four_cpus() -> None:
    assert _on_cpus({"num_cpus": 1})
    assert not _on_cpus({"num_gpus": 1}) and not _on_cpus({"num_cpus": 1, "resources": {"neuron_cores": 8}})
