"""Model packages; each registers its ModelSpec from its __init__."""
