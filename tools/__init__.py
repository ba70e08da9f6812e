"""Developer tooling that is not needed at training time (docs generation); never imported by ``hyper_parallel``."""
