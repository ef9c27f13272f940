"""`shoal bench`: load generator for a running server (serve) and offline engine throughput."""
