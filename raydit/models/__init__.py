"""Model adapters: make diffusers transformers sequence-parallel without editing them."""
