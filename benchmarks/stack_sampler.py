"""Where one thread's wall time goes, by sampling its Python stack (a small py-spy inside the process).

cProfile traces every call and inflates a first step of ~8 s to ~12 s, unevenly (Dynamo's tracer makes millions of
small calls; a wait in C makes one). A sampler thread that reads the target thread's frame every ``interval``
seconds (``sys._current_frames``) costs one stack walk per sample, and counts a wait the same as work: a sample in
``all_gather_into_tensor`` or in a Triton compile's ``waitpid`` is time the thread spent there, whatever it did.

    with StackSampler() as s:          # samples the thread that entered
        step()
    s.summary()                        # inclusive / self seconds by frame, the hottest stacks
    s.write_collapsed(path)            # "f1;f2;...;fn count" lines: flamegraph.pl / speedscope read them

Each sample weighs the time since the previous one. The sampler is a Python thread: while the sampled thread holds
the GIL (tracing, Python-bound work) it gets a turn only at the interpreter's switch interval (5 ms), so samples come
further apart there than in a wait (GIL released). Weighing each by the mean interval instead (this module's first
version, used for the nineteenth session's GPU samples) over-counts waits and under-counts Python-bound frames: a
CPU test here read a 0.2 s spin as 0.11 s; for a first step that spends ~35% of its time off the CPU, an estimate
from the samples' mean gap gives waits ~1.3x too long and Python-bound frames ~0.85x. A frame below ~10 samples is
noise.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Counter, Dict, List, Optional, Tuple

__all__ = ["StackSampler", "frame_label"]


def frame_label(code) -> str:
    """``package/path.py:function`` for a code object: the path from its package root (site-packages, or the
    repository) so that torch's and fxfuse's frames read the same on every machine."""
    path = code.co_filename
    for marker in ("site-packages/", "dist-packages/"):
        i = path.rfind(marker)
        if i >= 0:
            path = path[i + len(marker):]
            break
    else:
        for top in ("/fxfuse/", "/benchmarks/", "/passes/"):
            i = path.rfind(top)
            if i >= 0:
                path = path[i + 1:]
                break
        else:
            path = os.path.basename(path)
    return f"{path}:{code.co_name}"


class StackSampler:
    """Samples one thread's Python stack every ``interval`` seconds between ``start()`` and ``stop()`` (or as a
    context manager, the thread that enters it)."""

    def __init__(self, interval: float = 0.005, thread_id: Optional[int] = None, max_depth: int = 400):
        self.interval = interval
        self.thread_id = thread_id
        self.max_depth = max_depth
        self.stacks: Dict[Tuple[str, ...], float] = collections.defaultdict(float)  # seconds by stack
        self.samples = 0
        self.wall_s = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = 0.0

    def _run(self) -> None:
        labels: Dict[object, str] = {}  # code object -> label, computed once
        last = self._t0
        while not self._stop.wait(self.interval):
            now = time.perf_counter()
            frame = sys._current_frames().get(self.thread_id)
            stack: List[str] = []
            while frame is not None and len(stack) < self.max_depth:
                code = frame.f_code
                label = labels.get(code)
                if label is None:
                    label = labels[code] = frame_label(code)
                stack.append(label)
                frame = frame.f_back
            del frame
            if stack:  # the time since the last sample, spent (as far as one look can tell) where the thread is now
                self.stacks[tuple(reversed(stack))] += now - last
                self.samples += 1
            last = now

    def start(self) -> "StackSampler":
        if self.thread_id is None:
            self.thread_id = threading.get_ident()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> "StackSampler":
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.wall_s = time.perf_counter() - self._t0
        return self

    def __enter__(self) -> "StackSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self, top: int = 30, hot_stacks: int = 12, stack_tail: int = 6) -> dict:
        """Seconds by frame, inclusive (the frame anywhere on the stack, counted once per sample) and self (the
        innermost frame), and the hottest stacks' last ``stack_tail`` frames."""
        inclusive: Counter[str] = collections.Counter()
        own: Counter[str] = collections.Counter()
        tails: Counter[Tuple[str, ...]] = collections.Counter()
        for stack, sec in self.stacks.items():
            for label in set(stack):
                inclusive[label] += sec
            own[stack[-1]] += sec
            tails[stack[-stack_tail:]] += sec
        s = lambda c: [(k, round(v, 3)) for k, v in c.most_common(top)]  # noqa: E731
        return dict(samples=self.samples, wall_s=round(self.wall_s, 3), interval_s=self.interval,
                    weighting="time since the previous sample", inclusive_s=s(inclusive), self_s=s(own),
                    hot_stacks=[(" < ".join(reversed(k)), round(v, 3)) for k, v in tails.most_common(hot_stacks)])

    def write_collapsed(self, path: str) -> None:
        """Brendan Gregg's collapsed format, one stack per line with its weight in microseconds (flamegraph.pl and
        speedscope take any integer weight)."""
        with open(path, "w") as f:
            for stack, sec in sorted(self.stacks.items(), key=lambda kv: -kv[1]):
                f.write(";".join(stack) + f" {round(sec * 1e6)}\n")
