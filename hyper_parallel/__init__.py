"""hyper-parallel: PyTorch-native training of large MoE and multimodal models."""

__version__ = "0.1.0"
