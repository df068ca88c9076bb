"""A stand-in for sweep.execute in tests of the claims protocol: it "trains" each unfinished
run at once by writing what `train` leaves in a workdir (config.json, metrics.jsonl with the
eval loss and a train record whose keys share prefixes, summary.json), with a final loss that
the test computes from the run."""
import json
import os

from geonorm_jax.training import checkpoint, metrics


def execute(trained, loss_of, unfinished=(), check=None):
  """sweep.execute's replacement: loss_of(run) -> the run's final validation loss; runs named
  in `unfinished` stay unfinished; check(run, config) may assert on each run's config. The
  names of the runs it trains are appended to `trained`."""
  def fake(args, runs):
    del args
    for run in runs:
      if run.summary() is not None or run.name in unfinished:
        continue
      config = run.config()
      if check:
        check(run, config)
      loss = loss_of(run)
      os.makedirs(run.workdir, exist_ok=True)
      checkpoint.save_config_json(run.workdir, config)
      with open(os.path.join(run.workdir, metrics.METRICS_FILENAME), "w") as f:
        for step in (5, 10):
          f.write(json.dumps({"split": "eval", "step": step, "loss": loss + 1 / step}) + "\n")
        f.write(json.dumps({"split": "train", "step": 10, "loss": loss, "loss_z": 0.5,
                            "grad_norm": 1.0, "grad_norm/layer_00": 0.6,
                            "grad_norm/layer_01": 0.8}) + "\n")
      with open(os.path.join(run.workdir, "summary.json"), "w") as f:
        json.dump({"final_eval_loss": loss, "final_train_loss": loss - 0.1, "final_step": 10,
                   "tokens_per_s": 100.0}, f)
      trained.append(run.name)
  return fake


def dirs(tmp_path):
  """--root and --out both under tmp_path: the repository's results/ folders, whose records
  count as finished runs (studies/results_folder.py), are never read."""
  return [f"--root={tmp_path}", f"--out={tmp_path / 'results'}"]
