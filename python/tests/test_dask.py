"""carve.dask's worker plugin on a real distributed.LocalCluster, over host resources (no GPU):
each worker builds its own resource with the options given, counts its own allocations, writes
its own log, and bad options raise typed errors on the client."""

import functools
import os

import pytest

distributed = pytest.importorskip("distributed")

import carve  # noqa: E402
import carve.dask  # noqa: E402
from carve.dask import CarveSetup  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(
        n_workers=2,
        processes=True,
        threads_per_worker=1,
        dashboard_address=":0",
        worker_dashboard_address=":0",
    ) as cluster, distributed.Client(cluster) as c:
        yield c


def _workers(client):
    addrs = sorted(client.scheduler_info()["workers"])
    assert len(addrs) == 2
    return addrs


def describe(dask_worker):
    """On a worker: its process and the chain of kinds of the resource the plugin built."""
    r = carve.dask.worker_resource(dask_worker)
    kinds, pool = [], None
    while r is not None:
        kinds.append(r.kind)
        if isinstance(r, carve.PoolResource):
            pool = r.stats()
        r = r.upstream
    return {"pid": os.getpid(), "kinds": kinds, "pool": pool}


def allocate(nbytes):
    """A task: allocates from the worker's carve resource; returns the pointer."""
    return carve.dask.worker_resource().allocate(nbytes)


def free(ptr, nbytes, dask_worker):
    """Run by client.run, which passes the worker."""
    carve.dask.worker_resource(dask_worker).deallocate(ptr, nbytes)


def test_each_worker_builds_its_own_resource(client):
    carve.dask.setup(
        client,
        resource=carve.HostResource,
        pool_size="1MiB",
        maximum_pool_size=4 * MiB,
        statistics=True,
        track_allocations=True,
    )
    seen = client.run(describe)
    assert len({d["pid"] for d in seen.values()}) == 2
    for d in seen.values():
        assert d["kinds"] == ["statistics", "tracking", "pool", "host"]
        assert d["pool"]["pool_size"] == MiB
    # The maximum holds on each worker, and carve's error type reaches the client.
    a = _workers(client)[0]
    with pytest.raises(carve.OutOfMemoryError):
        client.submit(allocate, 5 * MiB, workers=[a], pure=False).result()


def test_a_factory_builds_the_base(client):
    factory = functools.partial(carve.ExpandableResource.over_host, 64 * MiB)
    carve.dask.setup(client, resource=factory)
    for d in client.run(describe).values():
        assert d["kinds"] == ["expandable"]
    assert client.run(carve.dask.worker_statistics) == dict.fromkeys(_workers(client))


def test_allocations_show_in_each_workers_statistics(client):
    carve.dask.setup(client, resource=carve.HostResource, pool_size=MiB, statistics=True)
    a, b = _workers(client)
    pa = client.submit(allocate, 1000, workers=[a], pure=False).result()
    pb = [client.submit(allocate, 3000, workers=[b], pure=False).result() for _ in range(2)]
    stats = carve.dask.cluster_statistics(client)
    assert (stats[a].current_bytes, stats[a].current_count) == (1000, 1)
    assert (stats[b].current_bytes, stats[b].current_count) == (6000, 2)
    client.run(free, pa, 1000, workers=[a])
    for p in pb:
        client.run(free, p, 3000, workers=[b])
    stats = client.run(carve.dask.worker_statistics)
    assert (stats[a].current_bytes, stats[a].peak_bytes, stats[a].total_count) == (0, 1000, 1)
    assert (stats[b].current_bytes, stats[b].peak_bytes, stats[b].total_count) == (0, 6000, 2)


def test_logging_writes_one_file_per_worker(client, tmp_path):
    logs = tmp_path / "logs"
    carve.dask.setup(client, resource=carve.HostResource, log_directory=logs)
    a, b = _workers(client)
    names = client.run(lambda dask_worker: str(dask_worker.name))
    for addr, n in ((a, 1111), (b, 2222)):
        p = client.submit(allocate, n, workers=[addr], pure=False).result()
        client.run(free, p, n, workers=[addr])
    files = sorted(os.listdir(logs))
    assert files == sorted(f"carve_log_{names[w]}.csv" for w in (a, b))
    for addr, n, other in ((a, 1111, 2222), (b, 2222, 1111)):
        rows = (logs / f"carve_log_{names[addr]}.csv").read_text().splitlines()
        assert rows[0] == "Thread,Time,Action,Pointer,Size,Stream"
        assert [r.split(",")[2:5:2] for r in rows[1:]] == [["allocate", str(n)], ["free", str(n)]]
        assert all(str(other) not in r for r in rows[1:])


def test_replacing_the_plugin_restores_nothing_stale(client):
    carve.dask.setup(client, resource=carve.HostResource, statistics=True)
    client.unregister_worker_plugin("carve")
    assert client.run(carve.dask.worker_statistics) == dict.fromkeys(_workers(client))


@pytest.mark.parametrize(
    "options, error",
    [
        (dict(maximum_pool_size="1GiB"), carve.InvalidArgumentError),
        (dict(pool_size="8MiB", maximum_pool_size="1MiB"), carve.InvalidArgumentError),
        (dict(pool_size="lots"), ValueError),
        (dict(pool_size=-1), ValueError),
        (dict(pool_size=1.5), carve.InvalidArgumentError),
        (dict(pool_size=[1]), TypeError),
        (dict(managed_memory=True, async_alloc=True), carve.InvalidArgumentError),
        (dict(expandable=True, resource=carve.HostResource), carve.InvalidArgumentError),
        (dict(expandable=True, pool_size="1GiB"), carve.InvalidArgumentError),
        (dict(release_threshold="1GiB"), carve.InvalidArgumentError),
        (dict(external_lib_list=["numba"]), carve.InvalidArgumentError),
        (dict(statistics="yes"), TypeError),
        (dict(log_directory=3), TypeError),
    ],
)
def test_bad_options_raise_on_the_client(options, error):
    with pytest.raises(error):
        CarveSetup(**options)


def test_a_resource_in_place_of_a_factory_is_a_type_error():
    # Built here, not in a parameter list: a resource made at collection would stay live for
    # the whole session.
    with pytest.raises(TypeError, match="factory"):
        CarveSetup(resource=carve.HostResource())


@pytest.mark.parametrize("error", [getattr(carve, n) for n in carve.__all__ if n.endswith("Error")])
def test_carve_errors_survive_dasks_exception_pickling(error):
    # Dask ships a worker's exception with tblib, which rebuilds it as cls.__new__(cls, *args).
    from distributed.protocol import pickle
    from tblib import pickling_support

    e = error("carve's message")
    pickling_support.install(e)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is error and back.args == ("carve's message",)


def _not_a_resource():
    return 42


@pytest.mark.parametrize(
    "options, error",
    [
        (dict(resource=_not_a_resource), TypeError),
        (dict(resource=carve.HostResource, external_lib_list="cupy"), carve.InvalidArgumentError),
        pytest.param(
            dict(resource=carve.HostResource, pool_size=0.5),
            carve.InvalidArgumentError,
            # With a device, half its memory is a valid size (a pool that large over pinned
            # host memory, too): the case is the worker with no device.
            marks=pytest.mark.skipif(
                carve.is_available(), reason="a CUDA device is present: a fraction is valid"
            ),
        ),
    ],
)
def test_bad_options_raise_from_the_workers(client, options, error):
    with pytest.raises(error):
        carve.dask.setup(client, **options)


def test_workers_in_one_process_keep_their_own_resources():
    with distributed.LocalCluster(
        n_workers=2, processes=False, threads_per_worker=1, dashboard_address=":0"
    ) as cluster, distributed.Client(cluster) as c:
        carve.dask.setup(c, resource=carve.HostResource, statistics=True)
        a, b = _workers(c)
        p = c.submit(allocate, 4096, workers=[a], pure=False).result()
        stats = carve.dask.cluster_statistics(c)
        assert (stats[a].current_bytes, stats[b].current_bytes) == (4096, 0)
        c.run(free, p, 4096, workers=[a])


def test_device_memory_without_a_device_is_no_device_error(client):
    if carve.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(carve.NoDeviceError):
        carve.dask.setup(client, pool_size="1MiB")
