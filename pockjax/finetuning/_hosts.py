"""`finetune` over several processes (hosts): JAX's distributed runtime joined from
`--coordinator`/`--num-processes`/`--process-id` or from the cluster's environment
(SLURM, Open MPI), each step's batch laid out over every process's devices, and the
run's files written by process 0 alone from state gathered to it."""
from __future__ import annotations

import dataclasses
import os

import re

from pockjax.finetuning._base import FinetuneError, ProcessLost

# What the runtime's errors say when another process is gone: gloo's (CPU) and NCCL's
# collectives, the coordination service's heartbeat and its unavailable peer.
_LOST = re.compile(r"gloo|nccl|connection (closed|reset)|heartbeat|unhealthy|unavailable|"
                   r"socket closed|task died", re.IGNORECASE)

HEARTBEAT_SECONDS = 30
"""How long JAX's coordination service waits for a silent process before it stops the
job: a process killed outright ends the others' run within about this time."""


def _cluster_size() -> int:
    """The processes the cluster started together: the tasks of a SLURM `srun` step (not
    a batch script's allocation, which one process may run in alone), or Open MPI's
    ranks; 1 outside them."""
    for name in ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


@dataclasses.dataclass(frozen=True)
class Hosts:
    """This process's place in a run over several processes.

    Attributes:
      index: this process (0 writes the run's files).
      count: the processes of the run.
    """

    index: int
    count: int

    @property
    def writer(self) -> bool:
        return self.index == 0

    def describe(self) -> str:
        import jax

        return (f"process {self.index} of {self.count}: {jax.local_device_count()} of the "
                f"{jax.device_count()} {jax.devices()[0].platform} devices here; process 0 "
                f"writes the run's files")

    def global_batch(self, shardings, batch):
        """The step's batch (the same numpy arrays on every process) as global arrays
        laid out by `shardings`: each process supplies the rows its devices hold."""
        import jax
        import numpy as np

        return jax.tree_util.tree_map(
            lambda x, s: jax.make_array_from_callback(np.shape(x), s,
                                                      lambda i, x=x: np.asarray(x)[i]),
            batch, shardings)

    def gather(self, tree):
        """Every array of `tree` whole, as numpy, on every process (a collective: all
        processes call it)."""
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)

    def agree_stop(self, code: int) -> int:
        """The largest of every process's `code` (a collective: all processes call it):
        the stop any process's signal asked for (`fit`'s `agree_stop`)."""
        import numpy as np
        from jax.experimental import multihost_utils

        return int(np.max(multihost_utils.process_allgather(np.int32(code))))

    def lost(self, error: Exception, checkpoints) -> ProcessLost | None:
        """`error` as the loss of another process of the run, or None where it is not
        one: the message names the last complete checkpoint of `checkpoints` (`(step,
        path)` pairs) and what to run."""
        if not _LOST.search(str(error)):
            return None
        said = str(error).strip().splitlines()[0][:300]
        kept = (f"the last complete checkpoint is {checkpoints[-1][1].name} (step "
                f"{checkpoints[-1][0]})" if checkpoints else "no checkpoint was written yet")
        return ProcessLost(f"process {self.index} of {self.count}: another process of the run "
                           f"stopped (the step's collective failed: {said}); {kept}. Start "
                           f"every process again with the same command and --resume")

    def barrier(self, name: str) -> None:
        """Wait until every process reaches `name`."""
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def join(coordinator: str | None, num_processes: int | None,
         process_id: int | None) -> Hosts | None:
    """Join JAX's distributed runtime, or None for a run in one process.

    With `coordinator` (HOST:PORT of process 0), `num_processes` and `process_id`, those;
    without them, the cluster's own environment where it starts several processes
    (SLURM's `srun`, Open MPI's `mpirun`: JAX reads it). CPU devices talk through gloo.

    Raises:
      FinetuneError: JAX's backends started before the runtime could be joined, or
        joining failed (the coordinator unreachable within its timeout).
    """
    import jax

    if coordinator is None and _cluster_size() <= 1:
        return None
    if not jax.distributed.is_initialized():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(coordinator, num_processes, process_id,
                                       heartbeat_timeout_seconds=HEARTBEAT_SECONDS)
        except RuntimeError as e:
            where = (f"--coordinator {coordinator} (process {process_id} of {num_processes})"
                     if coordinator else "the cluster's environment")
            raise FinetuneError(f"could not join the run's processes through {where}: {e}. "
                                f"Every process must start with the same --coordinator and "
                                f"--num-processes, each its own --process-id, before any "
                                f"JAX computation in the program") from None
    return Hosts(jax.process_index(), jax.process_count())
