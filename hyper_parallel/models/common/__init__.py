"""Common model blocks shared by every model package."""
