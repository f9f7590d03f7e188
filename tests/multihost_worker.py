"""One process of the two-process training run in tests/test_sharding.py.

    python -m tests.multihost_worker PROCESS_ID PORT LAYOUT

Each process has 2 CPU devices, joins the run with `jax.distributed.initialize`,
feeds its own half of every batch and prints the losses and final parameters as
JSON on its last line.
"""
import json
import sys

import jax

pid, port, layout = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import pockjax as pj  # noqa: E402
from tests.test_sharding import LAYOUTS, OPTIMIZERS, SCHEME, _batches, _params, loss  # noqa: E402

mesh = jax.make_mesh((4,), ("data",))
trainer = pj.sparse_train(loss, optimizer=OPTIMIZERS["adam"], scheme=SCHEME, mesh=mesh,
                          **LAYOUTS[layout])
state = trainer.init(_params())
losses = []
for batch in _batches():
    half = len(batch["x"]) // 2
    local = {k: v[pid * half:(pid + 1) * half] for k, v in batch.items()}
    state, metrics = trainer(state, local)
    losses.append(float(metrics["loss"]))
params = multihost_utils.process_allgather(state.params, tiled=True)
print(json.dumps({"losses": losses,
                  "params": jax.tree_util.tree_map(lambda x: np.asarray(x).tolist(), params)}))
