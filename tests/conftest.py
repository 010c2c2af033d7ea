"""Shared test set-up.

Without CUDA, Triton kernels run in its interpreter; that must be decided before
any module defining a @triton.jit kernel is imported, hence here, at the top.
"""

import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # the cache manager's tests run without torch
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

try:
    from hypothesis import settings

    # CI must give the same verdict on the same commit: explore, but from a fixed seed.
    settings.register_profile("repeatable", derandomize=True, deadline=None)
    settings.load_profile("repeatable")
except ImportError:
    pass


def pytest_collection_modifyitems(config, items):
    # slow tests run only when asked for by marker (-m slow, -m "slow or not slow")
    if "slow" not in (config.getoption("markexpr") or ""):
        skip_slow = pytest.mark.skip(reason="slow: select it with -m slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from radixkv.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    from radixkv.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", seed=0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine the idle
    threads spin: one thread keeps a module's CPU time small and steady."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
