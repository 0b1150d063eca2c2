"""`python -m kvbench [group=option ...] [key=value ...]`: compose the config with Hydra and run it."""
import hydra
from omegaconf import DictConfig

from kvbench.commands import cli, hydra_task
import kvbench.run.config  # noqa: F401  (registers the config schemas and resolvers)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    cli.install_sigterm_handler()  # also in launcher workers (joblib), where run_app_cli did not run
    hydra_task.main(cfg)


if __name__ == "__main__":
    cli.run_app_cli(main)
