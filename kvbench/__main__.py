"""`python -m kvbench [group=option ...] [key=value ...]`: compose the config with Hydra and run it."""
import hydra
from omegaconf import DictConfig

import kvbench.config  # noqa: F401  (registers the config schemas and resolvers)
from kvbench import app
from kvbench.errors import run_app_cli


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    app.main(cfg)


if __name__ == "__main__":
    run_app_cli(main)
