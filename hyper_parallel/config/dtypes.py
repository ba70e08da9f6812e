"""Names of torch dtypes as they appear in configs and on the command line."""

import torch

TORCH_DTYPE_MAP: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def to_torch_dtype(name: str, *, field: str = "dtype") -> torch.dtype:
    """Resolve a dtype name, or raise an error that names the config field and the choices."""
    try:
        return TORCH_DTYPE_MAP[name]
    except KeyError:
        raise ValueError(f"{field}={name!r} is not a dtype; use one of {sorted(TORCH_DTYPE_MAP)}") from None
