"""The results store: run folders (the truth) and the index over them (runs.jsonl).

results_dir/
  runs.jsonl                  one line per finished attempt (ok or failed); rebuilt from the folders if it lags
  <run_id>/
    .claim                    the claim of the worker running it (flock held for the run's duration)
    config.yaml               the resolved config
    samples.jsonl             one record per evaluated sample
    metrics.json              one flat object; written last, so its presence with status "ok" marks a finished run
    error.txt                 the traceback of a failed run
    .hydra/, kvbench.log      Hydra's own files (when run from the CLI)
    wandb/                    offline W&B run (when logging offline)

One job per module:
  naming    run ids, model labels, the hash of the result-determining config, the experiment key
  files     atomic files (temporary file + os.replace), JSON / JSONL writers and readers, locked appends
  claims    a worker's claim on a run (flock held by an open fd; a heartbeat file where there is no flock)
  folder    one run's folder (RunFolder: metrics.json last, then its runs.jsonl line) and the index repair
  runs      loading a results folder as run records (load_runs), and telling which folders are corrupt
  table     the run records as a pandas DataFrame, and the columns that group one experiment
  faults    named fault points where tests inject a kill or a sleep (no-ops otherwise)

Guarantees (docs: results store):
- Every file but runs.jsonl is written to a temporary file and moved into place (os.replace), so a kill leaves the
  old file or the new one, never half of one. metrics.json is written last: a run without it did not finish.
- runs.jsonl lines are appended whole under an exclusive flock, or not at all (a short write on a full disk is
  taken back out and raised). Readers skip torn or undecodable lines and say how many.
- Each metrics.json carries an `attempt_id`; a finished folder whose attempt is missing from runs.jsonl (a kill
  between the two writes) is appended by `repair_index`, which the app runs once per process and load_runs runs too.
- A run is claimed before it starts (`claim_run`): parallel or repeated sweeps into one folder split the work, and
  the claim of a dead worker (its lock released by the kernel, or its pid gone / heartbeat stale) is taken over.
- A record is normalised when it is written (kvbench.run.app): config.yaml holds the resolved config (a storage codec
  under `quant`, budget null for a method that evicts nothing) and metrics.json says whether the method evicts
  (`evicts`), so readers (kvbench-report, kvbench-compare) need no registry of methods or codecs.

This package file imports nothing: `from kvbench.store.naming import run_id_for` loads only what it names (the
pandas table only where a table is asked for).
"""
