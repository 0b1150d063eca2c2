"""A run's lifecycle: its spec and config, the plan and checks made before the model loads, the engines, the app that runs one job, the estimate, and the sweep's folders and table."""
