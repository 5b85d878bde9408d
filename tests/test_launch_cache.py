"""fxfuse.kernels.launch_cache: a recorded launch is replayed with the new call's tensors in exactly the argument
slots the recording call's tensors held, only for the same alignment, never keeping the recorded tensors alive,
and not at all where it cannot be proven to be the same launch. On CPU a stand-in kernel records what each replay
launched; the GPU runs the real thing in every attention test there (the launchers replay from their second
call on)."""
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from fxfuse.kernels import launch_cache
from fxfuse.kernels.launch_cache import PlanCache, Recorder, Replay


class _Binary:
    """What Triton's JIT returns: a compiled kernel whose ``run`` is the launcher."""

    packed_metadata = (4, 1, 0)
    function = 1234

    def __init__(self):
        self.launches = []

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter, exit_, *args):
        self.launches.append(((g0, g1, g2), stream, args))


class _Kernel:
    """A stand-in @triton.jit function (X, Y, n, BLOCK: constexpr)."""

    def __init__(self):
        self.params = [SimpleNamespace(name=n, is_constexpr=n == "BLOCK") for n in ("X", "Y", "n", "BLOCK")]
        self.jit_calls = 0
        self.binary = _Binary()

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.jit_calls += 1
            return self.binary
        return call


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(launch_cache, "fast_launch_enabled", lambda: True)
    monkeypatch.setattr(launch_cache, "_hooks_idle", lambda: True)
    monkeypatch.setattr(launch_cache, "_raw_stream", lambda device: 7)


def _record(kern, x, y, n=32):
    rec = Recorder()
    rec.launch(kern, (3, 2), (x, y, n), dict(BLOCK=16, num_warps=4))
    return rec


def test_replay_puts_each_role_in_its_slot(fast):
    kern = _Kernel()
    x, y = torch.zeros(64), torch.ones(64)
    cache = PlanCache()
    cache.store("sig", (y, x), _record(kern, x, y))         # roles: (out=y, in=x)
    assert kern.jit_calls == 1
    x2, y2 = torch.zeros(64), torch.ones(64)
    replay = cache.lookup("sig", (y2, x2))
    assert replay is not None and replay((y2, x2), 0)
    (grid, stream, args), = kern.binary.launches
    assert grid == (3, 2, 1) and stream == 7
    assert args[0] is x2 and args[1] is y2 and args[2:] == (32, 16)  # every parameter in order, constexpr too
    assert kern.jit_calls == 1 and replay.launches == 1
    assert cache.lookup("other signature", (y2, x2)) is None


def test_alignment_is_part_of_the_key(fast):
    kern = _Kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    cache = PlanCache()
    cache.store("sig", (x, y), _record(kern, x, y))
    assert cache.lookup("sig", (x[1:], y)) is None  # a base that is not 16-byte aligned: Triton specialises on it
    assert cache.lookup("sig", (x[4:], y)) is not None


def test_recorded_tensors_are_not_kept_alive(fast):
    kern = _Kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    cache = PlanCache()
    cache.store("sig", (x, y), _record(kern, x, y))
    gone = weakref.ref(x)
    del x
    gc.collect()
    assert gone() is None


def test_what_cannot_be_replayed(fast):
    kern = _Kernel()
    x, y, z = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    assert Replay.of(_record(kern, x, z), (x, y)) is None      # z is no role: it would be launched stale
    rec = Recorder()
    rec.launch(kern, lambda meta: (1,), (x, y, 1), dict(BLOCK=16))
    assert Replay.of(rec, (x, y)) is None                      # a callable grid
    # one tensor in two roles when recorded: a replay whose roles differ there must not launch
    replay = Replay.of(_record(kern, x, x), (x, x))
    assert replay is not None
    assert not replay((x, y), 0) and kern.binary.launches == []
    assert replay((y, y), 0) and len(kern.binary.launches) == 1


def test_scratch_tensors_are_allocated_afresh_by_each_replay(fast, monkeypatch):
    """A tensor the launcher allocated between its launches (written by one, read by the next) is no role: the
    replay allocates one of the same shape and dtype and passes it in both slots, never the recorded one."""
    monkeypatch.setattr(torch, "empty", lambda shape, dtype=None, device=None, _e=torch.empty: _e(shape, dtype=dtype))
    writer, reader = _Kernel(), _Kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    rec = Recorder()
    tmp = rec.scratch((5, 4), torch.int32, "cpu")
    rec.launch(writer, (1,), (x, tmp, 5), dict(BLOCK=16))
    rec.launch(reader, (2,), (tmp, y, 5), dict(BLOCK=16))
    cache = PlanCache()
    cache.store("sig", (x, y), rec)
    gone = weakref.ref(tmp)
    del tmp, rec
    gc.collect()
    assert gone() is None  # the recorded scratch is not kept
    x2, y2 = torch.zeros(64), torch.zeros(64)
    assert cache.lookup("sig", (x2, y2))((x2, y2), 0)
    (_, _, wargs), = writer.binary.launches
    (_, _, rargs), = reader.binary.launches
    assert wargs[0] is x2 and rargs[1] is y2
    assert wargs[1] is rargs[0] and wargs[1].shape == (5, 4) and wargs[1].dtype == torch.int32
    rec = Recorder()
    with pytest.raises(RuntimeError):  # a failed attempt forgets its scratch tensors too
        with rec.attempt():
            rec.scratch((3,), torch.int8, "cpu")
            raise RuntimeError("out of resources")
    assert rec.scratches == []


def test_attempt_forgets_launches_of_a_failed_config():
    kern = _Kernel()
    rec = Recorder()
    x = torch.zeros(4)
    with pytest.raises(RuntimeError):
        with rec.attempt():
            rec.launch(kern, (1,), (x, x, 1), dict(BLOCK=16))
            raise RuntimeError("out of resources")
    assert rec.calls == []


def test_no_replays_where_disabled(monkeypatch):
    monkeypatch.setattr(launch_cache, "_raw_stream", lambda device: 7)
    kern = _Kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    cache = PlanCache()
    monkeypatch.setenv("FXFUSE_TRITON_FAST_LAUNCH", "0")
    cache.store("sig", (x, y), _record(kern, x, y))
    assert cache.lookup("sig", (x, y)) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FXFUSE_TRITON_FAST_LAUNCH", "1")
    assert not launch_cache.fast_launch_enabled()
