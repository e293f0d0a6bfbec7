"""eagle3-console engine: workspace, config, checks, jobs, servers. Never imports a UI toolkit."""

__version__ = "0.1.0"
