"""Pacing: when a prompt's next chunk may run beside decoding streams, and how long an idle engine waits for a
burst, from measured step times (no JAX).

Every heuristic here reads time from the clocks it is given: `clock` times plans (the scheduler's clock; a test
drives it by hand), `wait_clock` measures a burst wait in real time (the condition variable's waits are real).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np

BURST_MAX_PASSES = 8.0
"""Longest burst wait, in decode passes after the first request, while arrivals keep coming within the burst
wait of each other. A request that misses the first step waits a whole step behind it, and then holds up the
step after it; a burst cut in two ends its last stream a step or more later (each arrival costs the serving
path some CPU beside the hosts, so 16 chat streams sent at once by one client reached rank 0 over ~100-300 ms
on the 2-core default: 8-20 one-stream passes)."""
MAX_HOLD_PASSES = 64
"""Most decode passes one decision holds prompt chunks back beside running streams (`Paging.max_decode_slowdown`)."""
DECODE_PASS_WINDOW = 16
"""Decode-only plans whose median pass time is the scheduler's decode pace."""


def _halfway(limit: float) -> float:
    """The slowdown factor halfway from none (1) to `limit`: a held pass slower than this pace times it makes the
    next held plan longer, and held passes' median over it becomes the pace (`Pacing.pace`)."""
    return (1 + limit) / 2


class Pacing:
    """The step-time controller: the decode pace, the chunk hold-back (`max_decode_slowdown`) and the burst wait
    (`burst_wait`). Called under the scheduler's lock."""

    def __init__(self, decode_steps: int, max_decode_slowdown: float, burst_wait: float,
                 clock: Callable[[], float] = time.monotonic,
                 wait_clock: Callable[[], float] = time.monotonic) -> None:
        self.decode_steps = decode_steps
        self.limit = max_decode_slowdown
        self.burst_wait = burst_wait
        self.clock = clock
        self.wait_clock = wait_clock
        # plans with decode rows while a prompt prefills (an "episode"): when it began, its decode passes
        self._episode_t0: float | None = None
        self._episode_passes = 0
        self._planned_at: dict[int, tuple[float, str, int]] = {}  # step_id -> (clock, kind, passes)
        # kind: "chunk" (prompt chunks beside decode rows), "held" (decode rows between them), "decode" (neither)
        self._recent_passes: deque[float] = deque(maxlen=DECODE_PASS_WINDOW)
        self._held_passes: deque[float] = deque(maxlen=DECODE_PASS_WINDOW)  # this episode's, per pass (`pace`)
        self.decode_pass_s: float | None = None
        """Seconds per decode pass of a decode-only plan of `decode_steps` passes while no prompt prefills beside
        the streams, the median of the last `DECODE_PASS_WINDOW`: the pace `max_decode_slowdown` is a factor of (a
        median, as the plans just before a long prompt's first chunk run slower while its request is read and
        tokenized beside them; a moving average took that in). Passes between a prompt's chunks do not count:
        they run slower than undisturbed ones (measured: 5-10% on CPU, caches the chunk step evicted), and
        counting them let the streams drift past the limit."""
        self.chunk_step_s: float | None = None
        """Seconds of the last step that carried prompt chunks beside decode rows."""
        self._chunk_growth_s = 0.0  # how much the last chunk step took over the one before (0 if less)
        self.held_floor = 1
        """The fewest passes a decode-only plan holding a prompt back may have. Every plan costs time beyond its
        passes (gathering inputs, the hosts' round trip, streaming tokens); a plan cut short to end where the
        prompt may go on spreads that over fewer tokens. Where it ran the streams slower per token than halfway
        from their pace to the limit, waiting in such plans makes the wait grow instead of end (measured: a
        1500-token prompt beside 7 streams waited 140 s in one-pass plans), so the floor rises past it, up to
        `decode_steps`. A plan that runs past the wait is repaid: the episode's account lets the next chunks
        follow one another."""

    # -- the chunk hold-back
    def wait_passes(self) -> int:
        """Decode passes the prompts being prefilled must still wait before their next chunk (0: now), while
        streams decode: the time since the prefill began beside them, plus one more chunk step, must stay within
        `max_decode_slowdown` decode passes for each token the streams get. Counting the whole episode's wall
        time, not one chunk step at a time, corrects itself when chunk steps grow (a prompt's later chunks attend
        to more keys), when a step ran before one was measured, and for the host's time between plans."""
        limit = self.limit
        d, m = self.pace(), self.chunk_step_s
        if not limit or d is None or m is None or d <= 0:
            return 0
        elapsed = 0.0 if self._episode_t0 is None else self.clock() - self._episode_t0
        m += self._chunk_growth_s  # a prompt's next chunk attends to more keys than its last: steps grow
        need = (elapsed + m) / (limit * d) - (self._episode_passes + 1)
        return min(MAX_HOLD_PASSES, max(0, int(np.ceil(need))))

    def held_steps(self, steps: int, wait: int) -> int:
        """Passes of a decode-only plan while prompts are held: it ends where they may go on (`held_floor`)."""
        return max(1, min(steps, max(wait, self.held_floor)))

    def pace(self) -> float | None:
        """The decode pass time the limit is a factor of: the pace before the prompt (`decode_pass_s`), unless
        this episode's passes between chunks run slower than halfway from it to the limit. Then the pace follows
        them (their median over that halfway factor): the streams' own passes slow as their keys grow (measured
        on the demo, 7 streams: 30 ms a pass at 256 cached tokens, 50 at 512, 65 at 1000), and against a pace
        they no longer reach, waiting would never pay for a chunk and the prompt would wait until the streams
        end. So a held pass always pays for at least (limit - 1) / (2 * limit) of a pass of the wait."""
        d = self.decode_pass_s
        if d is None or not self._held_passes or self.limit <= 1:
            return d
        return max(d, float(np.median(self._held_passes)) / _halfway(self.limit))

    # -- step times
    def planned(self, step_id: int, now: float, decoding: bool, prefilling: bool, chunks: bool, passes: int) -> None:
        """Note a plan: whether it has decode rows while prompts prefill (an episode goes on or ends), whether it
        carries prompt chunks, its passes; its duration is folded in by `timed`."""
        if decoding and prefilling:
            if self._episode_t0 is None:
                self._episode_t0 = now
            self._episode_passes += passes
        else:
            self._episode_t0, self._episode_passes = None, 0
            self._held_passes.clear()
        if decoding:
            kind = "chunk" if chunks else "held" if self._episode_t0 is not None else "decode"
            self._planned_at[step_id] = (now, kind, passes)

    def forget(self, step_id: int) -> None:
        """A plan that will not report a duration (it failed)."""
        self._planned_at.pop(step_id, None)

    def reset(self) -> None:
        """Every plan in flight is gone (the gang failed): none will report back, and no episode goes on."""
        self._planned_at.clear()
        self._episode_t0, self._episode_passes = None, 0

    def timed(self, step_id: int, now: float) -> None:
        """Fold a finished plan's duration into the decode pass average or the last chunk step."""
        planned = self._planned_at.pop(step_id, None)
        if planned is None:
            return
        t0, kind, passes = planned
        dt = max(now - t0, 0.0)
        if kind == "held" and self.decode_pass_s is not None:
            pace = self.pace()
            assert pace is not None
            if passes < self.decode_steps and dt / passes > _halfway(self.limit) * pace:
                self.held_floor = max(self.held_floor, min(passes + 1, self.decode_steps))
            elif passes == self.decode_steps:
                self._held_passes.append(dt / passes)
            return  # a pass between chunks: the pace before the prompt is what the limit refers to
        if kind in ("decode", "held"):
            if passes == self.decode_steps or self.decode_pass_s is None:
                # the usual pass: a plan of decode_steps passes (a shorter one pays its per-plan costs over fewer)
                self._recent_passes.append(dt / passes)
                self.decode_pass_s = float(np.median(self._recent_passes))
        else:
            self._chunk_growth_s = 0.0 if self.chunk_step_s is None else max(0.0, dt - self.chunk_step_s)
            self.chunk_step_s = dt

    # -- the burst wait
    def gather_burst(self, first_submitted_s: float, queued: Callable[[], int], enough: int,
                     wait: Callable[[float], object]) -> None:
        """With requests queued at an idle engine: wait (`wait(seconds)`, on the scheduler's condition) until
        `burst_wait` decode passes have gone by with no new arrival (from the first, then from each later one), at
        most `BURST_MAX_PASSES` decode passes after the first (nothing to wait for before a pass was measured),
        or until `queued()` reaches `enough` (a request for every slot). A burst sent at once reaches rank 0 over
        tens of milliseconds (HTTP, the proxy, the replica): every request of it that misses the first step waits
        a whole step behind it."""
        if not self.burst_wait or not self.decode_pass_s:
            return
        gap, cap = self.burst_wait * self.decode_pass_s, BURST_MAX_PASSES * self.decode_pass_s
        now = self.wait_clock()  # waited in real time, whatever the plans' clock
        first = now - max(0.0, self.clock() - first_submitted_s)
        deadline, seen = first + gap, queued()
        while queued() < enough and (left := min(deadline, first + cap) - self.wait_clock()) > 0:
            wait(left)
            if queued() > seen:
                deadline, seen = self.wait_clock() + gap, queued()

    def stats(self) -> dict[str, float | int | None]:
        """The step times the chunk hold-back works from."""
        out: dict[str, float | int | None] = {}
        for name, secs in (("decode_pass_ms", self.decode_pass_s), ("chunk_step_ms", self.chunk_step_s)):
            out[name] = None if secs is None else round(1e3 * secs, 2)
        out["held_floor_passes"] = self.held_floor
        return out
