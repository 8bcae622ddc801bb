"""ml_collections config files: `get_config(arg)` with `key=value` variants."""
