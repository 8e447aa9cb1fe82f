"""Hugging Face folders: a ``transformers`` model as the run's model, loco's model exported and loaded back."""
