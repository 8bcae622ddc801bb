"""A job's release in the workers when its launcher leaves the scheduler, run by the scheduler.

A Dask job's DoFns (and their models) stay pooled in the workers of a long-lived cluster
until the launcher releases them (`dask_runner._release_job`, at the job's end or when a
stopped launcher exits). A launcher killed with kill -9 never sends that message, and a
stopping one's may not arrive: the workers kept the job's models for good. The scheduler
sees every client leave, however it ends; this plugin, registered per job, sends the
job's release to every worker when the client that submitted the job is gone.

It is pickled by value (this module imports only the standard library and dask), so the
scheduler needs nothing of o1jax; the release itself runs in the workers, which run the job.
"""

from __future__ import annotations

import asyncio

from distributed.diagnostics.plugin import SchedulerPlugin


class ReleaseWhenClientLeaves(SchedulerPlugin):
  """Sends `release` (a worker "run" message: the job's release, pickled by the client)
  to every worker once client `client_id` is removed, then removes itself."""

  def __init__(self, name: str, client_id: str, release: dict):
    self.name = name
    self.client_id = client_id
    self.release = release
    self._task = None  # (a reference: the event loop keeps weak ones only)

  def remove_client(self, scheduler, client: str) -> None:
    if client != self.client_id or self._task is not None:
      return

    async def release() -> None:
      try:
        await scheduler.broadcast(msg=dict(self.release), on_error="ignore")
      finally:
        if scheduler.plugins.get(self.name) is self:
          scheduler.remove_plugin(name=self.name)

    self._task = asyncio.ensure_future(release())  # (called on the scheduler's event loop)
