"""Where the forward pass runs: this process alone, or with tensor-parallel
worker processes (the only code that starts, watches and stops them)."""
