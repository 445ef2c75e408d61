"""`pytest -n 2` sends out whole modules, the own-Ray ones as one unit (tests/conftest.py's xdist scheduler).

Until 2026-12-03 the grouping rode on `xdist_group` marks, which xdist 3.8 ignores with pytest 9.2: every module
was split over both workers, and nothing noticed. Here the scheduler the conftest hands xdist gets a collection
from two fake workers and hands out its work; which worker got which test says what a real run does. And the
conftest's list of own-Ray modules must agree with the marks, or collection stops.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest

import tests.conftest as conftest

pytest.importorskip("xdist")

OWN_RAY = sorted(conftest.RAY_OF_ITS_OWN_MODULES)
COLLECTION = [
    f"{OWN_RAY[0]}::test_one",
    f"{OWN_RAY[1]}::test_two[a]",
    f"{OWN_RAY[1]}::test_two[b]",
    *(f"tests/unit/test_m{m}.py::test_{k}" for m in range(4) for k in range(3)),
]


class FakeWorker:
    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.got: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices) -> None:
        self.got.extend(indices)

    def send_runtest_all(self) -> None:
        raise AssertionError("everything sent to one worker")

    def shutdown(self) -> None:
        self.shutting_down = True

    def __repr__(self) -> str:
        return self.gateway.id


def fake_config(dist: str) -> SimpleNamespace:
    option = SimpleNamespace(tx=["popen", "popen"], dist=dist, loadscopereorder=False, maxschedchunk=None)
    return SimpleNamespace(option=option, getvalue=lambda k: getattr(option, k), getoption=lambda k: getattr(option, k))


def test_the_scheduler_keeps_modules_whole_and_the_own_ray_ones_together():
    scheduler = conftest.pytest_xdist_make_scheduler(fake_config("loadfile"), log=None)
    workers = [FakeWorker("gw0"), FakeWorker("gw1")]
    for w in workers:
        scheduler.add_node(w)
    for w in workers:
        scheduler.add_node_collection(w, COLLECTION)
    scheduler.schedule()
    while pending := [(w, nodeid) for w in workers for unit in scheduler.assigned_work[w].values()
                      for nodeid, done in unit.items() if not done]:  # fmt: skip
        w, nodeid = pending[0]  # a worker finishes a test and is given more work when it runs low
        scheduler.mark_test_complete(w, COLLECTION.index(nodeid))
    where: dict[str, set[str]] = defaultdict(set)
    for w in workers:
        for i in w.got:
            where[conftest.xdist_unit(COLLECTION[i])].add(w.gateway.id)
    assert sorted(i for w in workers for i in w.got) == list(range(len(COLLECTION)))  # each test once
    assert set(where) == {conftest.RAY_OF_ITS_OWN, *(f"tests/unit/test_m{m}.py" for m in range(4))}
    assert all(len(names) == 1 for names in where.values()), dict(where)  # a unit in one worker
    assert {w.gateway.id for w in workers if w.got} == {"gw0", "gw1"}  # and both workers used


def test_an_explicit_dist_mode_is_left_to_xdist():
    assert conftest.pytest_xdist_make_scheduler(fake_config("load"), log=None) is None


class FakeItem:
    def __init__(self, nodeid: str, keywords: set[str]):
        self.nodeid, self.keywords = nodeid, keywords


def test_an_own_ray_module_missing_from_the_list_stops_collection():
    items = [FakeItem("tests/integration/serve/test_new.py::test_x", {"spawns_ray", "slow"})]
    with pytest.raises(pytest.exit.Exception, match="test_new.py"):
        conftest.pytest_collection_modifyitems(None, items)
    listed = [FakeItem(f"{OWN_RAY[0]}::test_y", {"slow"})]  # listed, but its marks say no Ray of its own
    with pytest.raises(pytest.exit.Exception, match=OWN_RAY[0]):
        conftest.pytest_collection_modifyitems(None, listed)
