"""bench_profile's attribution: compiled HLO instructions sort into the groups it reports."""
import importlib.util
import pathlib

import jax
import jax.numpy as jnp

_DIR = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
_SPEC = importlib.util.spec_from_file_location("bench_profile", _DIR / "bench_profile.py")
bench_profile = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_profile)


def test_instructions_sort_into_matmuls_attention_activation_and_rest():
  def step(x_NxD, w_DxH, q_BxHxLxK):
    hidden_NxH = jnp.tanh(x_NxD @ w_DxH)
    scores = jnp.einsum("bhlk,bhmk->bhlm", q_BxHxLxK, q_BxHxLxK)
    return hidden_NxH.sum() + jax.nn.logsumexp(scores) + jnp.sum(x_NxD ** 2)
  args = (jnp.ones((64, 16)), jnp.ones((16, 64)), jnp.ones((2, 2, 8, 4)))
  compiled = jax.jit(jax.grad(step, argnums=(0, 1, 2))).lower(*args).compile()
  instructions = bench_profile._hlo_instructions(compiled.as_text())
  groups = {}
  for name, (dims, is_dot) in instructions.items():
    group = bench_profile._jax_group(dims, is_dot, hidden=64)
    groups.setdefault(group, set()).add(dims)
    if name.startswith(("dot", "ynn_fusion")):  # XLA's own dot, or a library fusion's
      assert group == ("attention core" if len(dims) >= 4 else "linear matmuls"), name
  assert (64, 64) in groups["linear matmuls"] and (16, 64) in groups["linear matmuls"]
  assert all(len(d) == 2 for d in groups["linear matmuls"])
  assert all(len(d) >= 4 for d in groups["attention core"]) and groups["attention core"]
  assert groups["MLP activation"] and all(d[-1] == 64 and len(d) < 4
                                          for d in groups["MLP activation"])
  assert (64, 16) in groups["everything else"]
