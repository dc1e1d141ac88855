"""Shared fixtures: offline environment, tiny models built once per session, slow/gpu markers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compute thread per process: e2e tests run a head and several workers on 2 cores, and results
# do not depend on the thread count. Subprocesses inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The CLI's per-user data (TeaCache profiles of `triptych calibrate`): a fresh directory, never the
# user's own.
os.environ["XDG_DATA_HOME"] = __import__("tempfile").mkdtemp(prefix="triptych-test-data-")

import pytest  # noqa: E402


def pytest_configure(config):
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow (benchmarks, long runs)")
    parser.addoption(
        "--only-extras",
        default="",
        metavar="NAMES",
        help="keep only the tests marked needs_extra(NAME) for these comma-separated extras (tests/extras.py)",
    )


def pytest_collection_modifyitems(config, items):
    import torch

    from tests import extras

    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    required = extras.required()
    only = {n.strip() for n in config.getoption("--only-extras").split(",") if n.strip()}
    if only:
        kept = [item for item in items if only & _extras_of(item)]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    for item in items:
        for name in _extras_of(item):
            if not extras.missing(name):
                continue
            if name in required:
                item.add_marker(pytest.mark.extra_required_but_missing(extras.EXTRAS[name].reason()))
            else:
                item.add_marker(pytest.mark.skip(reason=extras.EXTRAS[name].reason()))
        if "slow" in item.keywords:
            if not config.getoption("--run-slow"):
                item.add_marker(skip_slow)
            elif item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(3600))  # long benchmarks: past the suite's 900 s
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def _extras_of(item) -> set[str]:
    return {m.args[0] for m in item.iter_markers("extra")}


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("extra_required_but_missing")
    if marker is not None:
        from tests.extras import REQUIRE_ENV

        pytest.fail(f"{REQUIRE_ENV} requires it, but this test {marker.args[0]}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(family, seed=0)`` → path of a tiny model, built once per session."""
    from triptych.families.registry import make_tiny

    built: dict[tuple[str, int], str] = {}

    def get(family: str, seed: int = 0):
        key = (family, seed)
        if key not in built:
            built[key] = str(make_tiny(family, tmp_path_factory.mktemp(f"{family}-{seed}"), seed=seed))
        return built[key]

    return get


@pytest.fixture(scope="session")
def inductor_cache_dir(tmp_path_factory):
    """One inductor cache for every compiling test of the run, shared by the xdist workers (a worker's
    base temp is a folder of the run's): a model another test already compiled reuses its kernels.
    Dynamo still traces, so the tests' graph counts do not depend on which test ran first."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / "inductor"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests (``pytest.mark.usefixtures``), the count restored after."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
