"""Beam on a dask.distributed cluster: Beam's DaskRunner with the translation the eval graph needs.

  --runner=pipelines.beam.dask_runner.DaskRunner --dask_client_address=tcp://scheduler:8786
  --runner=pipelines.beam.dask_runner.DaskRunner --dask_local_workers=2   # LocalCluster here

(`configs/common.py`: `--config.runner.name=dask [--config.runner.address=tcp://host:8786]`.)

The cluster, its scheduling, retries and worker processes are Dask's; this module only turns
the Beam graph into a graph of `dask.bag` partitions. It subclasses Beam's DaskRunner
(2.77, a proof of concept) because that one loses data on this job (each point seen
with Beam 2.77; tests/pipelines/test_eval_dask.py runs a graph with 1-3 on this runner):
  1. outputs a DoFn emits in `finish_bundle` are dropped: `BatchElements`, and so
     RunInference, emits a bundle's last partial batch there, so items vanish silently;
  2. a multi-output ParDo (`with_outputs`, `with_exception_handling`) sends all its
     outputs, tagged or not, to every consumer;
  3. only the last transform visited is computed: of two sinks (results.jsonl,
     dead_letters.jsonl) one never runs;
  4. a side input is computed by iterating its bag inside the consuming task (a nested
     compute); here it is a graph dependency, computed once by the cluster;
  5. `Reshuffle` is a no-op, so a job that starts from one element runs in one partition
     on one worker; here it repartitions to `--dask_partitions` (default: twice the
     cluster's worker threads + 1) so the work items spread over the workers;
  6. a DoFn is deserialized and set up for every partition, so RunInference reloads its
     model per partition; here each worker process keeps a pool of set-up DoFn instances
     per transform (one per concurrent thread) and reuses it across bundles, as Beam's
     other runners do: one model per worker process, loaded once.
Only the global window is supported (the eval job uses no other).
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import threading
import uuid
from typing import Any

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.options.pipeline_options import PipelineOptions, SetupOptions
from apache_beam.pipeline import PipelineVisitor
from apache_beam.runners.dask.dask_runner import DaskOptions as _BeamDaskOptions
from apache_beam.runners.dask.dask_runner import DaskRunner as _BeamDaskRunner
from apache_beam.runners.dask.overrides import (_Create, _Flatten, _GroupAlsoByWindow,
                                                _GroupByKeyOnly, _Read, _Reshuffle, dask_overrides)
from apache_beam.runners.common import Receiver
from apache_beam.runners.runner import PipelineResult, PipelineState
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue
from distributed import WorkerPlugin

from pipelines.beam.options import DASK_RUNNER as RUNNER, SchedulerUnreachableError

_GLOBAL = (GlobalWindow(),)  # the only window translated


class DaskOptions(PipelineOptions):
  """Ours, beside Beam's `--dask_client_address`, `--dask_connection_timeout`, ..."""

  @classmethod
  def _add_argparse_args(cls, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dask_local_workers", type=int, default=2,
                        help="without --dask_client_address: a LocalCluster of this many "
                             "single-threaded worker processes, closed when the job ends")
    parser.add_argument("--dask_partitions", type=int, default=0,
                        help="partitions after a Reshuffle (0: twice the cluster's worker threads + 1)")


# -- running one bundle in a worker ---------------------------------------------------

class _Receivers(dict):
  """Output receivers of one DoFn instance; `values` is emptied at each bundle's start."""

  def __init__(self):
    super().__init__()
    self.values: list = []

  def __missing__(self, tag):
    receiver = self[tag] = _TagReceiver(tag, self.values)
    return receiver


class _TagReceiver(Receiver):  # a compiled base class: the output handler accepts no other
  def __init__(self, tag, values: list):
    self.tag, self.values = tag, values

  def receive(self, windowed_value: WindowedValue) -> None:
    self.values.append((self.tag, windowed_value.value))


class _Instance:
  """A set-up DoFn with its invoker (used by one thread at a time)."""

  def __init__(self, spec: "_ParDoSpec", side_values: tuple):
    from apache_beam.runners.common import DoFnContext, DoFnInvoker, DoFnSignature, _OutputHandler
    from apache_beam.transforms.window import GlobalWindows
    self.receivers = _Receivers()
    handler = _OutputHandler(
        window_fn=GlobalWindows(), main_receivers=self.receivers[None],
        tagged_receivers=self.receivers, per_element_output_counter=None,
        output_batch_converter=None, process_yields_batches=False,
        process_batch_yields_elements=False)
    self.invoker = DoFnInvoker.create_invoker(
        DoFnSignature(spec.fn), handler, context=DoFnContext(spec.label, state=None),
        side_inputs=spec.side_input_maps(side_values), input_args=list(spec.args),
        input_kwargs=spec.kwargs, user_state_context=None,
        bundle_finalizer_param=beam.DoFn.BundleFinalizerParam())
    self.invoker.invoke_setup()


_POOLS: dict[tuple, list] = {}  # (job, transform label) -> idle set-up instances, per process
_POOLS_LOCK = threading.Lock()
# Jobs released in this process: a bundle of one still running then (a stopped job's) tears
# its instance down at its end rather than pool it for good.
_RELEASED_JOBS: set[str] = set()


class _ParDoSpec:
  """What a worker needs to run a ParDo over one partition (pickled into the graph)."""

  def __init__(self, job: str, node, side_specs: list):
    transform = node.transform
    self.key = (job, node.full_label)
    self.label = node.full_label
    self.fn = transform.fn
    self.args, self.kwargs = transform.raw_side_inputs
    self.side_specs = side_specs  # (view class, view options, window mapping fn) per side input

  def side_input_maps(self, side_values: tuple) -> list:
    from apache_beam.transforms.sideinputs import SideInputMap
    return [SideInputMap(view, options, [WindowedValue(v, 0, _GLOBAL) for v in values])
            for (view, options, _), values in zip(self.side_specs, side_values)]

  def run_bundle(self, items: list, *side_values) -> list:
    """One partition = one bundle: start, process each item, finish (whose outputs
    count too); returns (tag, value) pairs."""
    with _POOLS_LOCK:
      pool = _POOLS.setdefault(self.key, [])
      instance = pool.pop() if pool else None
    if instance is None:
      instance = _Instance(self, side_values)  # side inputs: one value per job
    try:
      instance.receivers.values.clear()
      instance.invoker.invoke_start_bundle()
      for item in items:
        instance.invoker.invoke_process(WindowedValue(item, 0, _GLOBAL))
      instance.invoker.invoke_finish_bundle()
      out = list(instance.receivers.values)
      instance.receivers.values.clear()
    except BaseException:
      instance.invoker.invoke_teardown()  # a failed instance is not reused
      raise
    with _POOLS_LOCK:
      released = self.key[0] in _RELEASED_JOBS
      if not released:
        _POOLS.setdefault(self.key, []).append(instance)
    if released:
      instance.invoker.invoke_teardown()
    return out


def pooled_instances() -> int:
  """Set-up DoFn instances this worker process holds (0 between jobs)."""
  with _POOLS_LOCK:
    return sum(len(pool) for pool in _POOLS.values())


def _release_job(job: str, model_tags: tuple = ()) -> int:
  """Runs in every worker at the job's end: tears down the job's DoFn instances (their
  models go with them), so a long-lived cluster does not keep every job's model, and
  removes the job's shared-model files from the worker's temp directory."""
  from pipelines.beam.handler import remove_shared_model_files
  with _POOLS_LOCK:
    _RELEASED_JOBS.add(job)
    keys = [k for k in _POOLS if k[0] == job]
    instances = [i for k in keys for i in _POOLS.pop(k)]
  for instance in instances:
    instance.invoker.invoke_teardown()
  for tag in model_tags:
    remove_shared_model_files(tag)
  return len(instances)


def _concat(*partitions) -> list:
  return list(itertools.chain.from_iterable(partitions))


def _select(pairs: list, tag) -> list:
  return [v for t, v in pairs if t == tag]


def _group_values(item):
  key, pairs = item
  return key, [v.value if isinstance(v, WindowedValue) else v for _, v in pairs]


class _ImportModules(WorkerPlugin):
  """Dask worker plugin: imports `--beam_plugins` modules in every worker at start-up,
  as Beam's SDK workers do (a researcher's own policies, the launcher watch)."""

  def __init__(self, modules: list[str]):
    self.modules = list(modules)
    self.name = "o1jax-beam-plugins-" + uuid.uuid4().hex[:8]

  def setup(self, worker=None):
    import importlib
    for name in self.modules:
      importlib.import_module(name)


# -- the graph ------------------------------------------------------------------------

class _Translator(PipelineVisitor):
  """Beam leaf transforms (after `dask_overrides`) → one dask.bag per PCollection."""

  def __init__(self, job: str, partitions: int):
    self.job, self.partitions = job, partitions
    self.bags: dict[Any, Any] = {}
    self.consumed: set = set()

  def visit_transform(self, node) -> None:
    import dask
    import dask.bag as db
    transform = node.transform
    inputs = [pc for pc in node.inputs if not isinstance(pc, pvalue.PBegin)]
    self.consumed.update(id(pc) for pc in inputs)
    bags = [self.bags[id(pc)] for pc in inputs]
    if isinstance(transform, _Create):
      out = db.from_sequence(list(transform.values) or [None], npartitions=1)
      if not transform.values:
        out = out.filter(lambda _: False)
    elif isinstance(transform, _GroupAlsoByWindow):
      out = bags[0]  # global window only: the grouped values are final
    elif isinstance(transform, beam.ParDo):
      sides = list(node.side_inputs)
      self.consumed.update(id(si.pvalue) for si in sides)
      specs = [(type(si), si._view_options(), si._window_mapping_fn) for si in sides]
      # optimize_graph=False: an optimized copy would rename its keys and compute the
      # whole upstream graph a second time
      side_values = [dask.delayed(_concat)(*self.bags[id(si.pvalue)].to_delayed(optimize_graph=False))
                     for si in sides]
      pairs = bags[0].map_partitions(_ParDoSpec(self.job, node, specs).run_bundle, *side_values)
      for tag, pc in node.outputs.items():
        self.bags[id(pc)] = pairs.map_partitions(_select, tag)
      return
    elif isinstance(transform, _GroupByKeyOnly):
      out = bags[0].groupby(lambda kv: kv[0]).map(_group_values)
    elif isinstance(transform, _Flatten):
      out = db.concat(bags) if bags else db.from_sequence([None]).filter(lambda _: False)
    elif isinstance(transform, _Reshuffle):
      out = bags[0].repartition(npartitions=self.partitions)
    elif isinstance(transform, _Read):
      raise NotImplementedError(f"{RUNNER}: beam.io.Read ({node.full_label}) is not translated")
    elif len(bags) == 1:
      out = bags[0]  # a transform without work of its own
    else:
      raise NotImplementedError(f"{RUNNER}: cannot translate {node.full_label} "
                                f"({type(transform).__name__})")
    for pc in node.outputs.values():
      self.bags[id(pc)] = out

  def sinks(self) -> list:
    """PCollections nobody consumes: computing them computes the whole graph."""
    return [bag for key, bag in self.bags.items() if key not in self.consumed]


class DaskRunnerResult(PipelineResult):
  def __init__(self, client, future, job: str, cluster=None):
    super().__init__(PipelineState.RUNNING)
    self.client, self.future, self.job, self.cluster = client, future, job, cluster
    self._model_tags: tuple = ()
    self._closed = False
    self._guard_name = f"o1jax-release-{job}"
    self._guarded = False
    self._guard()

  @property
  def model_tags(self) -> tuple:
    """The shared models' tags: their files are removed in the workers at the job's end."""
    return self._model_tags

  @model_tags.setter
  def model_tags(self, tags) -> None:
    self._model_tags = tuple(tags)
    self._guard()

  def _guard(self) -> None:
    """Registers (again, with the current tags) the scheduler plugin that releases this
    job in the workers when this client leaves the scheduler: a launcher killed with
    kill -9, or whose own release did not arrive (`dask_release`). A LocalCluster's
    scheduler ends with this process, its workers with it: nothing to guard."""
    if self.cluster is not None:
      return
    import cloudpickle
    from distributed.protocol.pickle import dumps

    from pipelines.beam import dask_release
    cloudpickle.register_pickle_by_value(dask_release)  # (the scheduler needs no o1jax)
    release = {"op": "run", "function": dumps(_release_job),
               "args": dumps((self.job, self._model_tags)), "kwargs": dumps({}), "wait": True}
    try:
      if self._guarded:
        self.client.unregister_scheduler_plugin(self._guard_name)
      self.client.register_plugin(
          dask_release.ReleaseWhenClientLeaves(self._guard_name, self.client.id, release),
          name=self._guard_name)
      self._guarded = True
    except Exception as e:  # noqa: BLE001 - (a scheduler that refuses plugins: the end's release stays)
      import logging
      self._guarded = False
      logging.getLogger(__name__).warning(
          "the dask scheduler did not take the job's release plugin (%s: %s): a launcher "
          "killed with kill -9 would leave the job's models in the workers", type(e).__name__, e)

  def _unguard(self) -> None:
    if self._guarded:
      self._guarded = False
      try:
        self.client.unregister_scheduler_plugin(self._guard_name)
      except Exception:  # noqa: BLE001 - (the scheduler is gone: so is the plugin)
        pass

  def wait_until_finish(self, duration=None) -> str:
    """Waits for the job (at most `duration` ms: then RUNNING if it is not done)."""
    try:
      self.future.result(timeout=None if duration is None else duration / 1000)
      self._state = PipelineState.DONE
    except TimeoutError:
      if duration is not None and not self.future.done():
        return self._state
      self._state = PipelineState.FAILED
      raise
    except BaseException:
      self._state = PipelineState.FAILED
      raise
    finally:
      if self._state != PipelineState.RUNNING:
        self.close()
    return self._state

  def close(self) -> None:
    """Tears the job's DoFns down in the workers and disconnects; a LocalCluster this
    runner started is shut down. Once (a stopping signal may close it from its thread)."""
    if self._closed:
      return
    self._closed = True
    try:
      self.release()
    except Exception:  # a worker gone with the job's failure: nothing of it to release
      pass
    self._unguard()  # (released: the client's leaving need not release it again)
    self.client.close()
    if self.cluster is not None:
      self.cluster.close()

  def release(self) -> None:
    """Tears the job's DoFns down in the workers now, and makes a bundle of it still running
    tear its own down as it ends (a launcher that stops: its exit drops the job's tasks)."""
    self.client.run(_release_job, self.job, self.model_tags)

  def cancel(self) -> str:
    self.future.cancel()
    self._state = PipelineState.CANCELLED
    self.close()
    return self._state

  def metrics(self):
    raise NotImplementedError(f"{RUNNER} does not collect Beam metrics")


CONNECT_DEADLINE_S = 60


def _connect(ddist, beams: dict, remote: bool):
  """`Client(**beams)`; for a remote scheduler within CONNECT_DEADLINE_S (or the given
  timeout + 30 s): a peer that accepts the connection and never answers the handshake
  (a web server on that port) held the launcher forever, past the client's own timeout."""
  if not remote:
    return ddist.Client(**beams)
  _reachable(beams.get("address"))
  timeout = beams.get("timeout")
  deadline = timeout + 30 if isinstance(timeout, int) else CONNECT_DEADLINE_S
  result: dict = {}
  abandoned = threading.Event()

  def connect():
    try:
      client = ddist.Client(**beams)
    except BaseException as e:  # handed to the caller
      result["error"] = e
      return
    if abandoned.is_set():  # answered past the deadline: not left as the default client
      client.close()
    else:
      result["client"] = client

  thread = threading.Thread(target=connect, name="dask-connect", daemon=True)
  thread.start()
  thread.join(deadline)
  if thread.is_alive():
    abandoned.set()
    path = beams.get("scheduler_file")
    if path and not beams.get("address") and not os.path.exists(path):
      # dask waits for the file to appear (a scheduler writes it when it starts)
      raise TimeoutError(f"the scheduler file does not exist (waited {deadline} s for a "
                         f"scheduler to write it)")
    raise TimeoutError(f"no answer from a dask scheduler within {deadline} s")
  if "error" in result:
    raise result["error"]
  return result["client"]


def _reachable(address) -> None:
  """Raises OSError at once for a tcp:// scheduler address (or one without a scheme, which
  dask reads as tcp) whose host does not resolve or whose port refuses the connection
  (dask's client retried those for its whole 30 s timeout); anything else is left to the
  client."""
  if not isinstance(address, str) or not (address.startswith("tcp://") or "://" not in address):
    return
  from distributed.comm.addressing import parse_host_port
  host, port = parse_host_port(address.removeprefix("tcp://"))
  try:
    socket.create_connection((host, port), timeout=5).close()
  except (socket.gaierror, ConnectionRefusedError) as e:
    raise OSError(f"{host}:{port}: {e.strerror or e}") from e
  except OSError:  # a timeout, no route: the client's own wait says it
    pass


class DaskRunner(_BeamDaskRunner):
  """Executes a pipeline on a dask.distributed cluster (a LocalCluster without an address)."""

  def run_pipeline(self, pipeline, options):
    import dask.distributed as ddist
    ours = options.view_as(DaskOptions)
    beams = options.view_as(_BeamDaskOptions).get_all_options(drop_default=True, current_only=True)
    beams.pop("npartitions", None), beams.pop("partition_size", None)
    cluster = None
    if not beams.get("address") and not beams.get("scheduler_file"):
      if ours.dask_local_workers < 1:
        raise ValueError(f"--dask_local_workers must be >= 1, got {ours.dask_local_workers}")
      # Processes, one thread each: JAX and the engine want a process per model.
      cluster = ddist.LocalCluster(n_workers=ours.dask_local_workers, threads_per_worker=1,
                                   processes=True, dashboard_address=None)
      beams["address"] = cluster
    try:
      client = _connect(ddist, beams, cluster is None)
    except Exception as e:  # nothing listening, a wrong host, not a scheduler: one line
      if cluster is not None:
        cluster.close()
      where = beams.get("address") or beams.get("scheduler_file")
      raise SchedulerUnreachableError(
          f"dask scheduler {where} cannot be reached: "
          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    try:
      if cluster is None:  # a cluster being started may not have its workers yet
        wait_s = beams.get("timeout") if isinstance(beams.get("timeout"), int) else 60
        try:
          client.wait_for_workers(1, timeout=wait_s)
        except (TimeoutError, OSError) as e:
          raise ValueError(f"dask scheduler {beams.get('address') or beams.get('scheduler_file')} "
                           f"has no workers (waited {wait_s} s)") from e
      plugins = options.view_as(SetupOptions).beam_plugins or []
      if plugins:
        try:
          client.register_plugin(_ImportModules(plugins))
        except ImportError as e:  # a worker without the package: one line, before any work
          where = "the local cluster" if cluster is not None else beams.get("address") or \
              beams.get("scheduler_file")
          raise ValueError(f"dask workers of {where} cannot import the job's modules "
                           f"({type(e).__name__}: {e}): install o1jax and the config's "
                           f"modules on every worker") from e
      # Default: the fewest partitions dask's scheduler treats as root tasks (more than
      # twice its threads) and so spreads over the workers as they free up; with fewer,
      # every partition follows its input to the worker that read the dataset.
      partitions = ours.dask_partitions or 2 * max(1, sum(client.nthreads().values())) + 1
      pipeline.replace_all(dask_overrides())
      job = uuid.uuid4().hex
      translator = _Translator(job, partitions)
      pipeline.visit(translator)
      import dask.bag as db
      done = db.concat(translator.sinks()).count()  # only a count comes back to the client
      future = client.compute(done)
    except BaseException:
      client.close()
      if cluster is not None:
        cluster.close()
      raise
    return DaskRunnerResult(client, future, job, cluster)
