"""The Hessian toolkit in one namespace: `from geonorm_jax import hessian`.

Two modules hold the code, split along the seam between operator and estimate:
  hessian_matvec      Hessian-vector products and the matvecs built from them
  hessian_estimators  Lanczos, top eigenvalues, power iteration, SLQ density, Hutchinson/Hutch++
hessian_analysis runs them on a checkpoint; hessian_progress reports their cost and progress.
"""
# pylint: disable=unused-import
from geonorm_jax.hessian.estimators import (
    DEFAULT_BREAKDOWN_TOL, LanczosResult, SpectralDensity, TopEigenvalues, TraceEstimate,
    check_finite, concatenate_runs, density_from_runs, hutchinson_trace, hutchpp_trace,
    lanczos, lanczos_batch, power_iteration, spectral_density, top_eigenvalues)
from geonorm_jax.hessian.matvec import (
    Matvec, accumulated_matvec, activation_matvec, adam_preconditioner, find_adam_state, hvp,
    linearized_matvec, params_matvec, preconditioned_matvec, subset_matvec)
