"""``benchmarks/stack_sampler.py``, which the FSDP2 notes' first-step breakdowns come from: a thread that spends known
times waiting in one function (GIL released) and computing in another (GIL held, so the sampler gets fewer turns) is
sampled, and the seconds by frame come out near them."""
import time

from benchmarks.stack_sampler import StackSampler, frame_label


def _waits_here(seconds):
    time.sleep(seconds)  # a wait in C: what cProfile sees as one call, the sampler as time


def _spins_here(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _work():
    _waits_here(0.4)
    _spins_here(0.2)


def test_seconds_by_frame_follow_where_the_thread_spent_them(tmp_path):
    with StackSampler(interval=0.005) as s:
        _work()
    summary = s.summary(top=50)
    inclusive, own = dict(summary["inclusive_s"]), dict(summary["self_s"])
    label = lambda f: frame_label(f.__code__)  # noqa: E731
    assert label(_waits_here) == "test_stack_sampler.py:_waits_here"
    assert 0.3 <= inclusive[label(_waits_here)] <= 0.5, summary
    assert 0.12 <= inclusive[label(_spins_here)] <= 0.3, summary
    assert 0.5 <= inclusive[label(_work)] <= 0.75, summary
    assert own[label(_waits_here)] >= 0.3 and label(_work) not in own  # _work itself never runs: it calls
    # collapsed stacks: outermost first, the count last; _waits_here's stacks pass through _work
    path = tmp_path / "stacks.txt"
    s.write_collapsed(str(path))
    lines = path.read_text().splitlines()
    waits = [ln for ln in lines if ln.rsplit(" ", 1)[0].endswith(label(_waits_here))]
    assert waits and all(f";{label(_work)};" in ln for ln in waits)
    total = sum(int(ln.rsplit(" ", 1)[1]) for ln in lines) / 1e6  # microseconds
    assert abs(total - sum(s.stacks.values())) < 1e-3 and 0.5 <= total <= s.wall_s
