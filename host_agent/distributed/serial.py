"""The agent's thread: collectives run one at a time in issue order, where one may all-reduce
the one queued behind it ahead (``host_agent.pipeline``).

The DDP hook and the ``homagg`` process group each hand their work to one such thread
(``Serial``: a ``ThreadPoolExecutor(1)``'s ``submit`` and ``shutdown``), so every rank's agent
sees its tensors in the order the ranks issued them. A job is a plain callable, or an
``Offering`` one: an all-reduce of one host tensor that can offer that tensor (and its key)
to the job in front of it. While a job runs, ``Behind`` is its ``pipeline.Pipeline``: the next
tensor is ready when the job queued right behind it offers one, and taking it takes that job
off the queue; the thread runs it next, its round 1 already done. Nothing waits for a job that
is not queued yet, and a job that offers nothing (a gloo call, a sparse bucket) is never
taken: the pipeline stops at it.

The thread is a daemon (a script that never shuts its group down still exits), and it is
joined when the interpreter exits (``atexit``), before Python finalizes: a job inside torch's
C++ with the GIL released (a DDP future's ``set_result`` runs DDP's callbacks so) that woke
into a finalizing interpreter would be ended by ``pthread_exit`` through a C++ frame, which
is ``std::terminate``: "terminate called without an active exception", SIGABRT.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from typing import Any, Protocol

log = logging.getLogger("homagg.torch")

#: At exit, how long (s) a thread may take over the jobs already queued before the interpreter
#: finalizes without it (a job bounds itself: the agent's deadline).
EXIT_WAIT = 30.0


class Offering(Protocol):
    def run(self, behind: Behind | None) -> None:
        """The job, with the jobs queued behind it as its pipeline."""
        ...

    def offer(self) -> tuple[Any, Any] | None:
        """The tensor (and its key) this job all-reduces, made once, to go ahead; None if
        this job has none to offer."""
        ...


class Behind:
    """The queue behind the running job, as its ``pipeline.Pipeline``."""

    def __init__(self, q: queue.Queue):
        self.q = q
        self.taken: Offering | None = None

    def _front(self):
        with self.q.mutex:
            return self.q.queue[0] if self.q.queue else None

    def ready(self) -> bool:
        front = self._front()
        return hasattr(front, "offer") and front.offer() is not None

    def take(self) -> tuple[Any, Any]:
        job = self.q.get_nowait()  # (only the thread takes: what was ready is still there)
        assert self.taken is None and job is not None
        self.taken = job
        got = job.offer()
        assert got is not None
        return got


class Serial:
    """One thread that runs the jobs in issue order (``submit``), each with the queue behind it
    as its pipeline when ``pipeline`` is set."""

    def __init__(self, name: str = "homagg-agent", pipeline: bool = True):
        self.pipeline = pipeline
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def submit(self, job) -> None:
        """``job``: a callable, or an ``Offering``."""
        self._q.put(job)

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """The jobs already queued run; then the thread ends (``wait``: joined, for up to
        ``timeout`` seconds if given)."""
        _live.discard(self)
        self._q.put(None)
        if wait:
            self._thread.join(timeout)

    def _serve(self) -> None:
        job = self._q.get()
        while job is not None:
            behind = Behind(self._q) if self.pipeline and hasattr(job, "run") else None
            try:
                job.run(behind) if hasattr(job, "run") else job()
            except Exception:  # (the jobs report their own errors: this one is a bug)
                log.exception("homagg: a job of the agent's thread failed")
            job = behind.taken if behind is not None and behind.taken is not None \
                else self._q.get()


_live: weakref.WeakSet[Serial] = weakref.WeakSet()


@atexit.register
def _join_at_exit() -> None:
    """Every thread still serving finishes its queued jobs before the interpreter finalizes
    (the module's docstring), for up to ``EXIT_WAIT`` seconds each."""
    for serial in list(_live):
        serial.shutdown(wait=True, timeout=EXIT_WAIT)
        if serial._thread.is_alive():
            log.warning("homagg: the agent's thread %s still runs a job at exit (%.0f s)",
                        serial._thread.name, EXIT_WAIT)
