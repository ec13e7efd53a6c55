"""Keep Ray's internal noise out of the log of a local Ray the pipeline starts itself.

Ray Train (v2) starts a detached ``PlacementGroupCleaner`` actor beside every training run. Once
a second it asks the State API whether the train controller is still alive, so that it can remove
the run's placement group if the controller dies while the cluster lives on
(``ray/train/v2/_internal/execution/controller/placement_group_cleaner.py``). The State API is
served by the dashboard, and the local Ray of :func:`pipeline.stage_context.ensure_ray` starts
without one (``include_dashboard=False``: the full dashboard costs ~1 GB of memory in ten module
processes, on a machine the pipeline needs for its models). So every poll fails and the cleaner logs
``Failed to query Ray Train Controller actor state. State API may be temporarily unavailable.
Continuing to monitor.`` once a second for the whole stage: 337 lines, half of the quickstart's log.
Nothing is lost by dropping it there: the local cluster, and the placement group with it, ends with
the driver. Ray knows the warning is noisy (ray-project/ray#62516 raised the State API timeout
because of it; ray-project/ray#65447, open, reworks the cleaner), and no setting turns the cleaner
off, so the pipeline's workers drop that one message.

The record is logged in the cleaner's worker process and reaches the driver as worker output, so
a ``logging.Filter`` in the driver cannot see it: :func:`quiet_local_worker` runs in every worker
as the job's ``worker_process_setup_hook`` (:data:`LOCAL_RUNTIME_ENV`).

Where another Ray runs on the same machine (a second pipeline, a test session) the cleaner fails
differently: a worker has no ``RAY_ADDRESS``, so the State API looks for the cluster among the
machine's processes, finds two and raises ``ConnectionError: Found multiple active Ray
instances``, which ends the cleaner's monitor thread with a 30-line traceback (ray-project/ray#65447
scopes the query to the cleaner's own cluster). The hook drops that one traceback too. Pointing the
State API at this cluster instead (``RAY_ADDRESS`` in the workers) would be worse: the dashboard
address this cluster registers is 127.0.0.1:8265 although nothing of it listens there, and a
dashboard of another Ray on that port would answer that the controller does not exist, which the
cleaner takes for a dead controller and removes the running training's placement group.
"""

from __future__ import annotations

import logging
import threading

#: the logger of Ray Train's placement-group cleaner (its module's ``__name__``)
PG_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
#: the start of the one message dropped from that logger
STATE_API_UNAVAILABLE = "Failed to query Ray Train Controller actor state"


class DropMessage(logging.Filter):
    """Drops the records whose message starts with ``prefix``; every other record passes."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not record.getMessage().startswith(self.prefix)
        except Exception:  # a record whose arguments do not format: let Ray's handler report it
            return True


def install_filter() -> None:
    """Add the :class:`DropMessage` filter of :data:`STATE_API_UNAVAILABLE` to the cleaner's
    logger in this process (once)."""
    cleaner = logging.getLogger(PG_CLEANER_LOGGER)
    if not any(isinstance(f, DropMessage) and f.prefix == STATE_API_UNAVAILABLE
               for f in cleaner.filters):
        cleaner.addFilter(DropMessage(STATE_API_UNAVAILABLE))


#: the name of the cleaner's monitor thread
PG_CLEANER_THREAD = "PlacementGroupCleanerMonitor"


def _is_cleaner_lookup_failure(args) -> bool:
    """Whether a thread's uncaught exception is the cleaner's State API lookup failing because
    several Ray clusters run on this machine."""
    return (getattr(args.thread, "name", None) == PG_CLEANER_THREAD
            and isinstance(args.exc_value, ConnectionError)
            and "multiple active Ray instances" in str(args.exc_value))


def install_thread_hook() -> None:
    """Wrap ``threading.excepthook`` (once) so that the cleaner's monitor thread ending on
    :func:`_is_cleaner_lookup_failure` prints nothing; every other thread's exception goes to the
    previous hook."""
    previous = threading.excepthook
    if getattr(previous, "_dspark_quiet", False):
        return

    def hook(args):
        if not _is_cleaner_lookup_failure(args):
            previous(args)

    hook._dspark_quiet = True
    threading.excepthook = hook


def quiet_local_worker() -> None:
    """``worker_process_setup_hook`` of the pipeline's local Ray (see the module docstring).
    Never raises: a setup hook that raises makes Ray end the worker."""
    try:
        install_filter()
        install_thread_hook()
    except Exception:
        pass


#: ``runtime_env`` of ``ray.init`` for the local Ray the pipeline starts (``pipeline`` is
#: importable in its workers: they run the pipeline's UDFs and training loop)
LOCAL_RUNTIME_ENV = {"worker_process_setup_hook": f"{__name__}.quiet_local_worker"}
