"""fxfuse.kernels.launch_cache: a stored Triton binary is reused only for arguments Triton would specialise the
same way, and every other call takes the JIT path (which compiles and launches). The GPU runs the real thing in
every attention test there; here a stand-in kernel records which path each call took."""
from types import SimpleNamespace

import pytest
import torch

from fxfuse.kernels import launch_cache
from fxfuse.kernels.launch_cache import CachedLauncher


class _Binary:
    """What Triton's JIT returns: a compiled kernel whose ``run`` is the launcher."""

    packed_metadata = (4, 1, 0)
    function = 1234

    def __init__(self):
        self.launches = []

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter, exit_, *args):
        self.launches.append(((g0, g1, g2), args))


class _Kernel:
    """A stand-in @triton.jit function: (X, n, m, BLOCK: constexpr), m not specialised."""

    def __init__(self):
        self.params = [SimpleNamespace(name="X", is_constexpr=False, do_not_specialize=False),
                       SimpleNamespace(name="n", is_constexpr=False, do_not_specialize=False),
                       SimpleNamespace(name="m", is_constexpr=False, do_not_specialize=True),
                       SimpleNamespace(name="BLOCK", is_constexpr=True, do_not_specialize=False)]
        self.jit_calls = 0
        self.binaries = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.jit_calls += 1
            b = _Binary()
            self.binaries.append(b)
            return b
        return call


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(launch_cache, "fast_launch_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_cache, "_raw_stream", lambda device: 7)


def test_reuses_the_binary_only_for_the_same_specialisation(fast):
    k = _Kernel()
    launch = CachedLauncher(k)
    x = torch.zeros(64)
    launch[(3, 2)](x, 32, 100, BLOCK=16, num_warps=4)       # compiles (JIT path)
    launch[(5, 2)](x, 48, 101, BLOCK=16, num_warps=4)       # n % 16 == 0 again, m unspecialised: stored binary
    assert k.jit_calls == 1 and launch.fast_hits == 1
    (grid, args), = k.binaries[0].launches
    assert grid == (5, 2, 1) and args[1:] == (48, 101, 16)  # every parameter in order, the constexpr included

    launch[(5, 2)](x, 40, 100, BLOCK=16, num_warps=4)       # 40 % 16 != 0: another specialisation
    launch[(5, 2)](x, 1, 100, BLOCK=16, num_warps=4)        # == 1 is specialised too
    launch[(5, 2)](x, 32, 100, BLOCK=32, num_warps=4)       # another constexpr
    launch[(5, 2)](x, 32, 100, BLOCK=16, num_warps=8)       # another launch option
    launch[(5, 2)](x.half(), 32, 100, BLOCK=16, num_warps=4)  # another dtype
    launch[(5, 2)](x[1:], 32, 100, BLOCK=16, num_warps=4)   # a base that is not 16-byte aligned
    launch[(5, 2)](x, 32, 2**31, BLOCK=16, num_warps=4)     # an int that needs 64 bits, even unspecialised
    assert k.jit_calls == 8 and launch.fast_hits == 1

    launch[(1,)](x, 64, 5, BLOCK=16, num_warps=4)           # the first key again
    assert k.jit_calls == 8 and launch.fast_hits == 2


def test_jit_path_when_disabled_or_hooked(fast, monkeypatch):
    k = _Kernel()
    launch = CachedLauncher(k)
    x = torch.zeros(64)
    monkeypatch.setattr(launch_cache, "_hooks_idle", lambda: False)  # a profiler's launch hook is installed
    for _ in range(3):
        launch[(1,)](x, 32, 1, BLOCK=16)
    assert k.jit_calls == 3 and launch.fast_hits == 0
    monkeypatch.setattr(launch_cache, "_hooks_idle", lambda: True)
    monkeypatch.setattr(launch_cache, "fast_launch_enabled", lambda: False)  # FXFUSE_TRITON_FAST_LAUNCH=0
    launch[(1,)](x, 32, 1, BLOCK=16)
    launch[(1,)](x, 32, 1, BLOCK=16)
    assert k.jit_calls == 5 and launch.fast_hits == 0


def test_unknown_argument_kinds_take_the_jit_path(fast):
    k = _Kernel()
    launch = CachedLauncher(k)
    for _ in range(2):
        launch[(1,)](object(), 32, 1, BLOCK=16)
    assert k.jit_calls == 2 and launch.fast_hits == 0


def test_interpreter_never_takes_the_fast_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch_cache.fast_launch_enabled()
