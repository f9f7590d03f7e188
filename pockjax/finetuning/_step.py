"""The step `finetune` trains with, and where it runs: the parameters as the trainer
takes them (`trainer_params`), AdamW over the schedule (`make_trainer`), and the devices
`--devices` and `--mesh` choose (`choose_devices`). The device job's export builds its
step from the same pieces."""
from __future__ import annotations

import dataclasses

from pockjax.finetuning._base import SCHEDULES, FinetuneError
from pockjax.finetuning._formats import frozen_formats
from pockjax.finetuning._model import lm_loss, lm_loss_at, low_bit, stored_by_lowbit
from pockjax.finetuning._options import mesh_axes


@dataclasses.dataclass(frozen=True)
class Placement:
    """The devices a run's step is split over: a mesh whose every axis splits the batch,
    and whose `fsdp` axis (where there is one) shards the parameters and optimizer state.

    Attributes:
      mesh: the `jax.sharding.Mesh`.
      axes: `{axis: size}`, as `--mesh` gives them.
      batch: the global batch, which the devices divide.
    """

    mesh: object
    axes: dict
    batch: int

    @property
    def text(self) -> str:
        """`--mesh`'s form: `data=2,fsdp=2`."""
        return ",".join(f"{a}={n}" for a, n in self.axes.items())

    def sparse_train_keywords(self) -> dict:
        """`sparse_train`'s mesh keywords. The loss's target positions (flat indices
        into the whole batch) are replicated: every device reads them whole."""
        from jax.sharding import PartitionSpec as P

        return dict(mesh=self.mesh, data_axis=tuple(self.axes),
                    param_axis="fsdp" if "fsdp" in self.axes else None,
                    batch_specs={"targets": P(), "target_weights": P()})

    def describe(self, state) -> str:
        """The log's line: the mesh, each device's share of a step's examples, and the
        parameters and optimizer state each device holds."""
        per_device: dict = {}
        whole = 0
        import jax

        for leaf in jax.tree_util.tree_leaves(state):
            if not isinstance(leaf, jax.Array):
                continue
            whole += leaf.nbytes
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        held = max(per_device.values(), default=0)
        n = self.mesh.devices.size
        kind = self.mesh.devices.flat[0].platform
        layout = ("parameters and optimizer state sharded over fsdp" if "fsdp" in self.axes
                  else "parameters and optimizer state replicated")
        return (f"mesh {self.text} on {n} {kind} devices: each takes {self.batch // n} of a "
                f"step's {self.batch} examples; {layout}: {held / 2**20:,.1f} MiB on each "
                f"device of the state's {whole / 2**20:,.1f} MiB")


    def replicated(self, tree):
        """A sharding for each array of `tree` that puts it whole on every device."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        return jax.tree_util.tree_map(lambda _: NamedSharding(self.mesh, P()), tree)

    def compiled_memory(self, trainer, state, batch) -> str | None:
        """The log's line on the step's compiled memory on each device: its arguments
        and temporaries. Read after the first step, from the executable that step
        compiled (lowering it again finds it in JAX's cache); None where XLA does not
        say."""
        stats = trainer.lower(state, batch).compile().memory_analysis()
        if stats is None:
            return None
        args, temp = stats.argument_size_in_bytes, stats.temp_size_in_bytes
        fresh = max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0)
        return (f"the compiled step takes {(args + temp + fresh) / 2**20:,.1f} MiB on each "
                f"device: {args / 2**20:,.1f} MiB of arguments (state and batch), "
                f"{temp / 2**20:,.1f} MiB of temporaries")


def choose_devices(devices, mesh: str | None, batch: int, say, *,
                   processes: int = 1) -> Placement | None:
    """The mesh `--devices` and `--mesh` ask for, or None for one device.

    `auto` takes every device of JAX's default backend where it is a GPU or TPU (as many
    as divide `batch`), and one on CPU: a CPU's devices share its cores, so splitting
    the step brings no speed. `all` takes every device. A mesh without `--devices` takes
    as many devices as its axes multiply to. Over several `processes`, `auto` takes every
    process's devices.

    Raises:
      FinetuneError: more devices asked for than JAX sees, or a batch the devices do not
        divide.
    """
    import jax

    available = jax.devices()
    kind = available[0].platform
    if mesh is not None:
        axes = mesh_axes(mesh)
        n = 1
        for size in axes.values():
            n *= size
    elif devices == "auto":
        n = 1 if kind == "cpu" and processes == 1 else len(available)
        while batch % n and processes == 1:  # the most devices that divide the batch
            n -= 1
        if n < len(available) and kind != "cpu":
            say(f"--devices auto: {n} of the {len(available)} {kind} devices, the most that "
                f"divide --batch {batch}")
        axes = {"data": n}
    else:
        n = len(available) if devices == "all" else int(devices)
        axes = {"data": n}
    if n > len(available):
        hint = (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N set before "
                "Python starts makes N devices)" if kind == "cpu" else "")
        raise FinetuneError(f"--{'mesh ' + mesh if mesh is not None else f'devices {devices}'}"
                            f" needs {n} devices; JAX sees {len(available)} {kind} "
                            f"device{'s' if len(available) > 1 else ''}{hint}")
    if processes > 1 and n != len(available):
        raise FinetuneError(f"a run over {processes} processes takes all their "
                            f"{len(available)} devices; --devices/--mesh ask for {n}")
    if batch % n:
        raise FinetuneError(f"--batch {batch} is split over {n} devices, which do not divide "
                            f"it; give a --batch that is a multiple of {n}")
    if n == 1:
        return None
    auto = (jax.sharding.AxisType.Auto,) * len(axes)  # the axes the step's layout uses
    return Placement(jax.make_mesh(tuple(axes.values()), tuple(axes), devices=available[:n],
                                   axis_types=auto), axes, batch)


def lr_schedule(lr: float, warmup: int, total: int, kind: str):
    """AdamW's learning rate: a linear warm-up, then `kind`'s decay over the rest."""
    import optax

    if kind not in SCHEDULES:
        raise FinetuneError(f"--schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")
    decay = max(total - warmup, 1)
    after = {"cosine": optax.cosine_decay_schedule(lr, decay),
             "linear": optax.linear_schedule(lr, 0.0, decay),
             "constant": optax.constant_schedule(lr)}[kind]
    if warmup <= 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def trainer_params(loaded, chosen, frozen_dtype: str):
    """The loaded model's parameters as `finetune`'s trainer takes them: trained leaves
    float32, frozen ones stored in `frozen_dtype` (bfloat16 `lowbit` nodes, or the
    integer formats) where the loading did not store them already."""
    params = loaded.params
    if frozen_dtype != "float32" and loaded.kind == "flax" and loaded.scheme is None:
        from pockjax.models.llama import cast_frozen
        # Trained leaves float32; frozen ones bfloat16 (Cast nodes), or plain bfloat16
        # arrays that lowbit.quantize stores in the integer format below.
        params = cast_frozen(params, chosen, native=low_bit(frozen_dtype))
    if stored_by_lowbit(frozen_dtype, loaded):
        import jax.numpy as jnp

        from pockjax import lowbit
        try:  # trained leaves stay float32; the step computes the frozen ones in float32
            params = lowbit.quantize(params, chosen, frozen_formats(frozen_dtype),
                                     dtype=jnp.float32)
        except lowbit.QuantizeError as e:
            raise FinetuneError(f"--frozen-dtype {frozen_dtype}: {e}") from None
    return params


def make_trainer(loaded, chosen, *, lr: float, warmup: int, total: int, schedule: str,
                 weight_decay: float, moments: str, skip_nonfinite: bool = False,
                 placement: Placement | None = None):
    """`finetune`'s training step for a loaded model and scheme: `lm_loss` of the model,
    AdamW with the learning-rate schedule over `total` steps, `pockjax.sparse_train`; on
    `placement`'s mesh where one is given."""
    from pockjax.optim import adamw
    from pockjax.train import sparse_train

    def loss_fn(p, b):
        if "targets" in b:  # the head at the counted positions only (target_positions)
            return lm_loss_at(loaded, p, b)
        return lm_loss(loaded.apply(p, b["tokens"]), b["tokens"], b["mask"])

    optimizer = adamw(lr_schedule(lr, warmup, total, schedule), weight_decay=weight_decay,
                      moments=moments)
    on_mesh = {} if placement is None else placement.sparse_train_keywords()
    return sparse_train(loss_fn, optimizer=optimizer, scheme=chosen,
                        skip_nonfinite=skip_nonfinite, **on_mesh)




def search_scheme(loaded, loss_fn, train, held, budget, batch, seq, pad, seed, lr, cache,
                  progress, say):
    """`pockjax.search_scheme` over the model's candidates under `budget`, on the first batches
    of the training data (scored on the validation data, or on training batches the
    search does not train on)."""
    import optax

    from pockjax.data import batch_at, eval_batches
    from pockjax.scheme_search import search_scheme as search
    from pockjax.train import sparse_train

    steps = 10
    train_batches = [batch_at(train, i, batch, seq, seed=seed, pad_id=pad) for i in range(steps)]
    heldout = (list(eval_batches(held, batch, seq, pad))[:4] if held is not None else
               [batch_at(train, steps + i, batch, seq, seed=seed, pad_id=pad) for i in range(2)])

    def factory(scheme):
        return sparse_train(loss_fn, optimizer=optax.adamw(lr), scheme=scheme)

    try:
        scheme, report = search(factory, loaded.params, (train_batches, heldout),
                                       budget=budget, steps=steps, cache=str(cache),
                                       progress=progress)
    except ValueError as e:
        raise FinetuneError(f"--scheme search:{budget}: {e}") from None
    say(f"search under {budget}: trains {', '.join(report.chosen)}")
    return scheme
