"""raydit: elastic, sequence-parallel video diffusion inference on Ray."""

__version__ = "0.1.0"
