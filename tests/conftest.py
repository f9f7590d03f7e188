import jax
from hypothesis import settings

# Four host CPU devices, so the SPMD tests (tests/test_sharding.py) have a mesh to
# run on. Other tests use the first device only, as JAX does by default.
jax.config.update("jax_num_cpu_devices", 4)

settings.register_profile("pockjax", deadline=None, max_examples=12, derandomize=True)
settings.load_profile("pockjax")
