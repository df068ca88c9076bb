"""DyT's alpha_0 pinned to the paper's table: every (width, depth) cell of "Optimal alpha_0
(attention / other) across model widths and depths in LLaMA training" (Zhu et al. 2025,
arXiv 2503.10622, Section 7.2), the LLaMA 13B row of its per-model table, and what we do
between and outside the table's entries."""
import pytest

from geonorm_jax.nn import placements
from geonorm_jax.nn import spec as spec_lib
from geonorm_jax.training import config as config_lib

# The paper's cells, typed in from the paper (not from placements.py): width -> (attention,
# other) at every depth 8, 16, 32, 64.
PAPER_WIDTH_DEPTH_TABLE = {1024: (1.0, 1.0), 2048: (1.0, 0.5), 4096: (0.8, 0.2),
                           8192: (0.2, 0.05)}
PAPER_DEPTHS = (8, 16, 32, 64)


def _alphas(d_model, num_layers, extra=""):
  config = config_lib.get_config(
      f"tiny,placement=dyt,d_model={d_model},num_layers={num_layers}{extra}")
  spec = spec_lib.resolve(config.model)
  return tuple(spec.option(f"dyt_alpha_{site}") for site in ("attn", "ffn", "final"))


@pytest.mark.parametrize("width", sorted(PAPER_WIDTH_DEPTH_TABLE))
@pytest.mark.parametrize("depth", PAPER_DEPTHS)
def test_every_cell_of_the_width_depth_table(width, depth):
  attention, other = PAPER_WIDTH_DEPTH_TABLE[width]
  assert _alphas(width, depth) == (attention, other, other)


def test_the_per_model_table_rows():
  # LLaMA 7B (4096 x 32), 13B (5120 x 40), 34B (8192 x 48), 70B (8192 x 80).
  assert _alphas(4096, 32) == (0.8, 0.2, 0.2)
  assert _alphas(5120, 40) == (0.6, 0.15, 0.15)
  assert _alphas(8192, 48) == (0.2, 0.05, 0.05)
  assert _alphas(8192, 80) == (0.2, 0.05, 0.05)


@pytest.mark.parametrize("width,depth,row", [
    (128, 4, 1024),  # narrower and shallower than the table: its first row and column
    (768, 12, 1024),
    (1536, 12, 2048),  # between two widths: the next wider row
    (3072, 24, 4096),
    (8192, 200, 8192),  # deeper than the table: its last column
    (16384, 32, 8192),  # wider than the table: its last row
])
def test_between_and_outside_the_table(width, depth, row):
  attention, other = PAPER_WIDTH_DEPTH_TABLE[row]
  assert _alphas(width, depth) == (attention, other, other)


def test_the_13b_row_applies_at_any_depth_and_between_4096_and_5120():
  for width, depth in [(5120, 8), (5120, 64), (4608, 32)]:
    assert _alphas(width, depth) == (0.6, 0.15, 0.15)


def test_dyt_authors_alphas_keeps_its_width_only_call():
  assert placements.dyt_authors_alphas(4096) == (0.8, 0.2, 0.2)
  assert placements.dyt_authors_alphas(128, 4) == (1.0, 1.0, 1.0)


def test_an_explicit_alpha_overrides_the_table():
  assert _alphas(2048, 16, ",dyt_alpha_attn=0.7,dyt_alpha_final=0.3") == (0.7, 0.5, 0.3)
