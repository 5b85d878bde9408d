"""Where one thread's wall time goes, by sampling its Python stack (a small py-spy inside the process).

cProfile traces every call and inflates a first step of ~8 s to ~12 s, unevenly (Dynamo's tracer makes millions of
small calls; a wait in C makes one). A sampler thread that reads the target thread's frame every ``interval``
seconds (``sys._current_frames``) costs one stack walk per sample, and counts a wait the same as work: a sample in
``all_gather_into_tensor`` or in a Triton compile's ``waitpid`` is time the thread spent there, whatever it did.

    with StackSampler() as s:          # samples the thread that entered
        step()
    s.summary()                        # inclusive / self seconds by frame, the hottest stacks
    s.write_collapsed(path)            # "f1;f2;...;fn count" lines: flamegraph.pl / speedscope read them

The numbers are samples x interval: a frame below ~10 samples is noise.
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
        self.stacks: Counter[Tuple[str, ...]] = collections.Counter()
        self.samples = 0
        self.wall_s = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = 0.0

    def _run(self) -> None:
        labels: Dict[object, str] = {}  # code object -> label, computed once
        while not self._stop.wait(self.interval):
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
            if stack:
                self.stacks[tuple(reversed(stack))] += 1
                self.samples += 1

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
        seconds = self.wall_s / self.samples if self.samples else self.interval  # per sample, from the real rate
        inclusive: Counter[str] = collections.Counter()
        own: Counter[str] = collections.Counter()
        tails: Counter[Tuple[str, ...]] = collections.Counter()
        for stack, n in self.stacks.items():
            for label in set(stack):
                inclusive[label] += n
            own[stack[-1]] += n
            tails[stack[-stack_tail:]] += n
        s = lambda c: [(k, round(n * seconds, 3)) for k, n in c.most_common(top)]  # noqa: E731
        return dict(samples=self.samples, wall_s=round(self.wall_s, 3), interval_s=self.interval,
                    inclusive_s=s(inclusive), self_s=s(own),
                    hot_stacks=[(" < ".join(reversed(k)), round(n * seconds, 3))
                                for k, n in tails.most_common(hot_stacks)])

    def write_collapsed(self, path: str) -> None:
        """Brendan Gregg's collapsed format, one stack per line with its sample count."""
        with open(path, "w") as f:
            for stack, n in self.stacks.most_common():
                f.write(";".join(stack) + f" {n}\n")
